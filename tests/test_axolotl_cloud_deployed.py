"""axolotl's own `axolotl train config.yml --cloud cloud.yml` with
`deployment: train/local`: the training runs as a run of the deployment on
the `deployed` stack's process worker (a real Prefect server), its local
dataset and base model folder uploaded into the deployment's runs directory
first (verified by SHA-256, read from there by the worker), the flow run's
link, its progress lines and its verified files in the terminal; Ctrl-C then
`l` leaves the run to its worker, which ends it."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from overbrainer_prefect.axolotl_cloud.console import LEFT_RUNNING, QUESTION
from overbrainer_prefect.runs import Runs, RunState
from overbrainer_prefect.trainers.uploads import UPLOADS_DIR
from tests.conftest import job_venv
from tests.prefect_server import Stack, training_now, wait_until
from tests.procs import held_stopped
from tests.test_axolotl_cloud import axolotl_env, axolotl_train, ours, tiny_config, visible
from tests.test_train_flow import kill

STEPS = 300  # about 3 s of the tiny model's training on a quiet machine, held stopped (SIGSTOP)
# from its first step seen until the command ended

__all__ = ["visible"]  # the fixture, shared with tests/test_axolotl_cloud.py

pytest_plugins = ["tests.prefect_server"]
pytestmark = pytest.mark.slow


def laptop_yaml(tiny: tuple[Path, Path], where: Path) -> dict[str, Any]:
    """The tiny YAML with its model folder and dataset copied into `where`,
    named by relative paths (what a laptop's YAML names)."""
    model, dataset = tiny
    shutil.copytree(model, where / "model")
    (where / "data").mkdir()
    shutil.copyfile(dataset, where / "data" / "chat.jsonl")
    return tiny_config(where / "model", where / "data" / "chat.jsonl") | {
        "base_model": "./model",
        "datasets": [{"path": "./data/chat.jsonl", "type": "chat_template"}],
    }


def new_runs(stack: Stack, before: set[str]) -> list[str]:
    return [p.name for p in Path(stack.runs).glob("[!.]*") if p.name not in before]


def test_a_deployments_run_uploads_the_local_inputs_and_ends_0_with_its_files_verified(
    deployed: Stack, visible: Path, tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    before = {p.name for p in Path(deployed.runs).glob("*")}
    cloud = {"provider": "overbrainer", "target": deployed.target, "deployment": "train/local"}
    done = axolotl_train(
        visible,
        tmp_path,
        laptop_yaml(tiny, tmp_path),
        cloud,
        PREFECT_API_URL=deployed.server.api_url,
    )
    assert done.returncode == 0, done.stderr[-4000:] + done.stdout[-4000:]
    lines = ours(done.stderr)
    uploads = Path(deployed.runs) / UPLOADS_DIR
    dataset, model = tmp_path / "data" / "chat.jsonl", tmp_path / "model"
    checked = r"bytes, SHA-256 checked\) to " + re.escape(str(uploads)) + r"/[0-9a-f]{32}"
    said = "overbrainer: uploaded "
    assert re.fullmatch(re.escape(f"{said}{dataset} (1 file, ") + r"\d+ " + checked, lines[1])
    assert re.fullmatch(re.escape(f"{said}{model} (") + r"\d+ files, \d+ " + checked, lines[2])
    assert lines[3].startswith("overbrainer: the flow run: http"), lines
    assert re.search(r"step 3/3", done.stdout), done.stdout[-3000:]  # its progress lines
    [run_id] = new_runs(deployed, before)
    runs = Runs(deployed.runs)
    assert lines[-1] == (
        f"overbrainer: run {run_id} succeeded: {lines[-1].split(': ')[2].split()[0]} files "
        f"verified in {runs.where_of(run_id)}"
    ), lines
    record = runs.load(run_id)
    assert record.state == RunState.SUCCEEDED
    spec = record.spec or {}
    assert spec["datasets"][0]["path"].startswith(f"{uploads}/"), spec  # read from the store
    assert spec["base_model"].startswith(f"{uploads}/"), spec
    shown = {
        line.split()[-1]: line.split()[0]
        for line in done.stdout.splitlines()
        if re.match(r"  [0-9a-f]{64}  ", line)
    }
    assert "output/adapter_model.safetensors" in shown
    trained_on = runs.run_dir(run_id) / "data" / "chat.jsonl"  # the upload, as the job read it
    assert trained_on.read_bytes() == dataset.read_bytes()
    for path, digest in shown.items():
        assert hashlib.sha256((runs.run_dir(run_id) / path).read_bytes()).hexdigest() == digest


def test_ctrl_c_then_leave_ends_the_command_3_and_the_deployments_worker_ends_the_run(
    deployed: Stack, visible: Path, tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    """The command exits at once with its line; the run was still training,
    and its flow run on the worker follows it to its end: succeeded, not
    cancelled."""
    known = {record.id for record in Runs(deployed.runs).list()}
    config = laptop_yaml(tiny, tmp_path) | {"max_steps": STEPS}
    cloud = {"target": deployed.target, "deployment": "train/local", "python": sys.executable}
    (tmp_path / "config.yml").write_text(yaml.safe_dump(config))
    (tmp_path / "cloud.yml").write_text(yaml.safe_dump({"provider": "overbrainer", **cloud}))
    err = tmp_path / "stderr.txt"
    with err.open("w") as stderr, (tmp_path / "stdout.txt").open("w") as stdout:
        command = subprocess.Popen(
            [str(job_venv() / "bin" / "axolotl"), "train", "config.yml", "--cloud", "cloud.yml"],
            cwd=tmp_path,
            env=axolotl_env(visible, PREFECT_API_URL=deployed.server.api_url),
            stdin=subprocess.PIPE,
            stdout=stdout,
            stderr=stderr,
            text=True,
            start_new_session=True,  # its own group, as a terminal's foreground job
        )
    try:
        record = wait_until(lambda: training_now(deployed, known), 300, "the job to train", 0.1)
        with held_stopped(record.job.pid):  # still training when the command has ended
            os.killpg(command.pid, signal.SIGINT)
            wait_until(lambda: QUESTION.strip() in err.read_text(), 30, "the question")
            assert command.stdin is not None
            command.stdin.write("l\n")
            command.stdin.flush()
            code = command.wait(timeout=60)
            left_at = Runs(deployed.runs).load(record.id)
            metrics = (Path(record.remote_dir) / "metrics.jsonl").read_text()
    finally:
        kill(command)
    said = err.read_text()
    assert code == LEFT_RUNNING, said[-3000:]
    assert (  # after the question, on its line (a terminal echoes the answer's newline)
        f"{QUESTION}overbrainer: left running: run {record.id} goes on on {deployed.target}; "
        f"follow it again with the attach flow (run_id={record.id})"
    ) in said, said[-3000:]
    assert left_at.state == RunState.RUNNING, left_at.message  # it went on without the command
    assert '"event": "end"' not in metrics  # its job was still training when the command ended
    ends = time.monotonic() + 300
    while time.monotonic() < ends and not Runs(deployed.runs).load(record.id).state.ended:
        time.sleep(1)
    ended = Runs(deployed.runs).load(record.id)
    assert ended.state == RunState.SUCCEEDED, ended.message
    adapter = Runs(deployed.runs).run_dir(record.id) / "output" / "adapter_model.safetensors"
    assert adapter.is_file()
