"""axolotl's own `axolotl train config.yml --cloud cloud.yml` (the job venv's
axolotl 0.21 CLI, not a call of the class) with `provider: overbrainer`: a
tiny training on a local target, bad input in one line with nothing created,
and axolotl's registry finding the launcher.

The package is made visible to axolotl's Python without installing it into
the shared job venv: the repository and a `*.dist-info` holding this
package's `axolotl.cloud_providers` entry point (read from pyproject.toml) go
on its PYTHONPATH, where importlib.metadata finds entry points (the
dist-info is left out when the package is installed there already: the
repository, first on the path, is still what runs).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from overbrainer_prefect.axolotl_cloud.cloud import CloudConfigError, read_cloud
from overbrainer_prefect.axolotl_cloud.console import QUESTION
from overbrainer_prefect.axolotl_cloud.mapping import AXOLOTL_DEFAULTS, spec_from_axolotl
from overbrainer_prefect.runpod.bootstrap import TIMING_ENV
from tests.conftest import REPO, job_venv
from tests.runpod_sim import RunpodSim, running_sim
from tests.runpod_sim.pods import SimPods
from tests.s3server import S3Server
from tests.test_runpod_flows import FAST, LONG, fast, pods_of, running_on_pod, sim
from tests.test_runpod_flows import target as runpod_target
from tests.test_train_flow import kill, wait_until

__all__ = ["fast", "pods_of", "sim"]  # the simulator's fixtures, shared with the Runpod flow tests

COMMAND_BOUND_S = 420.0  # a tiny training through the whole chain, on a loaded machine


@pytest.fixture(scope="module")
def visible(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding this package's dist-info (its entry points from
    pyproject.toml), to put on axolotl's PYTHONPATH with the repository."""
    root = tmp_path_factory.mktemp("axolotl-sees")
    if list((job_venv() / "lib").glob("python3*/site-packages/overbrainer_prefect-*.dist-info")):
        return root  # installed there (`--no-deps`): a second registration would be refused
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    info = root / f"overbrainer_prefect-{project['version']}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n"
    )
    lines = []
    for group, points in project["entry-points"].items():
        lines.append(f"[{group}]")
        lines += [f"{name} = {value}" for name, value in points.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return root


def axolotl_env(visible: Path, **changes: str) -> dict[str, str]:
    """The environment of axolotl's command: the package visible, the test's
    Prefect server, no telemetry."""
    from prefect.settings import PREFECT_API_URL

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(visible), str(REPO)])
    env["AXOLOTL_DO_NOT_TRACK"] = "1"
    env["DO_NOT_TRACK"] = "1"
    api = PREFECT_API_URL.value()
    if api:
        env["PREFECT_API_URL"] = str(api)
    env.update(changes)
    return env


def axolotl_train(
    visible: Path,
    where: Path,
    config: dict[str, Any],
    cloud: dict[str, Any],
    command: str = "train",
    **env: str,
) -> subprocess.CompletedProcess[str]:
    """`axolotl COMMAND config.yml --cloud cloud.yml` in `where` (train by default)."""
    return Started(visible, where, config, cloud, command, **env).finished()


class Started:
    """`axolotl COMMAND config.yml --cloud cloud.yml` started in `where` (its
    output into files there, so that several run at once without one waiting
    on a full pipe); `finished` waits for it, bounded by COMMAND_BOUND_S from
    its start."""

    def __init__(
        self,
        visible: Path,
        where: Path,
        config: dict[str, Any],
        cloud: dict[str, Any],
        command: str = "train",
        **env: str,
    ) -> None:
        self.where = where
        (where / "config.yml").write_text(yaml.safe_dump(config))
        (where / "cloud.yml").write_text(yaml.safe_dump({"python": sys.executable, **cloud}))
        self.args = [
            str(job_venv() / "bin" / "axolotl"),
            command,
            "config.yml",
            "--cloud",
            "cloud.yml",
        ]
        self.deadline = time.monotonic() + COMMAND_BOUND_S
        with (where / "stdout.txt").open("w") as out, (where / "stderr.txt").open("w") as err:
            self.process = subprocess.Popen(
                self.args,
                cwd=where,
                env=axolotl_env(visible, **env),
                stdout=out,
                stderr=err,
                text=True,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.done: subprocess.CompletedProcess[str] | None = None

    def finished(self) -> subprocess.CompletedProcess[str]:
        """Its exit code and output, once it ended; fails (the command's
        process group killed) when it runs past its bound."""
        if self.done is None:
            try:
                code = self.process.wait(timeout=max(1.0, self.deadline - time.monotonic()))
            finally:
                kill(self.process)
            self.done = subprocess.CompletedProcess(
                self.args,
                code,
                (self.where / "stdout.txt").read_text(),
                (self.where / "stderr.txt").read_text(),
            )
        return self.done


@pytest.fixture(scope="module")
def module_sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunpodSim]:
    """A Runpod simulator for the module's commands started together, its pods
    real process trees, with the Runpod flow tests' short timings (`fast`)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(TIMING_ENV, FAST)
        with running_sim() as simulator:
            pods = SimPods(tmp_path_factory.mktemp("module-pods"))
            with pods.attached(simulator):
                yield simulator


@pytest.fixture(scope="module")
def started(
    prefect_server: None,
    module_sim: RunpodSim,
    visible: Path,
    tiny: tuple[Path, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, Started]]:
    """The module's real `axolotl ... --cloud` commands that need no answer at
    a terminal, started together at once (each pays axolotl's CLI start,
    torch's imports, most of a minute on a loaded machine: they overlap); each
    test reads its own with `finished()`. Any still running at the end is killed."""
    places = {name: tmp_path_factory.mktemp(name) for name in COMMANDS}
    bad = {"base_model": "org/model", "datasets": ["org/data"], "learning_rate": 1e-4}
    local = places["local"]
    runs = {name: str(where / "runs") for name, where in places.items()}
    each = {
        "typo": (bad, {"provider": "overbrainer", "taget": "local", "runs_dir": runs["typo"]}),
        "nowhere": (
            bad,
            {"provider": "overbrainer", "target": "nowhere", "runs_dir": runs["nowhere"]},
        ),
        "local": (
            tiny_config(*tiny),
            {
                "provider": "overbrainer",
                "target": saved_local_target(local),
                "runs_dir": runs["local"],
                "max_hours": 1,
            },
        ),
        "preprocess": (
            tiny_config(*tiny),
            {
                "provider": "overbrainer",
                "target": saved_local_target(places["preprocess"]),
                "runs_dir": runs["preprocess"],
            },
        ),
        "pod": (
            tiny_config(*tiny),
            {
                "provider": "overbrainer",
                "target": runpod_target(module_sim),
                "runs_dir": runs["pod"],
                "max_hours": 0.5,
                "max_cost_usd": 1,
            },
        ),
    }
    commands: dict[str, Started] = {}
    try:
        for name, (config, cloud) in each.items():
            command = "preprocess" if name == "preprocess" else "train"
            commands[name] = Started(visible, places[name], config, cloud, command)
        yield commands
    finally:
        for each_started in commands.values():
            kill(each_started.process)


COMMANDS = ("typo", "nowhere", "local", "preprocess", "pod")
"""The commands `started` starts together, each in its own directory."""


def orchestrate(
    where: Path,
    config: dict[str, Any],
    cloud: dict[str, Any],
    command: str = "train",
    timeout_s: float = 120.0,
    **env: str,
) -> subprocess.CompletedProcess[str]:
    """What the launcher runs in the orchestrator's Python for `command`
    (train, preprocess, lm_eval), without axolotl's CLI before it (whose
    imports take most of a minute on a loaded machine)."""
    request = {"cloud": cloud, "config_dir": str(where), "config_yaml": yaml.safe_dump(config)}
    (where / "request.json").write_text(json.dumps(request))
    changed = dict(os.environ, PYTHONPATH=str(REPO), **env)
    if "PREFECT_API_URL" not in env:
        changed.pop("PREFECT_API_URL", None)
    return subprocess.run(
        [sys.executable, "-m", "overbrainer_prefect.axolotl_cloud", command, "request.json"],
        cwd=where,
        env=changed,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        stdin=subprocess.DEVNULL,
    )


def ours(output: str) -> list[str]:
    """The launcher's own lines."""
    return [line for line in output.splitlines() if line.startswith("overbrainer: ")]


def tiny_config(model: Path, dataset: Path) -> dict[str, Any]:
    return {
        "base_model": str(model),
        "datasets": [{"path": str(dataset), "type": "chat_template"}],
        "adapter": "lora",
        "lora_r": 8,
        "lora_alpha": 16,
        "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
        "sequence_len": 64,
        "micro_batch_size": 4,
        "max_steps": 3,
        "learning_rate": 5e-3,
        "seed": 0,
        "output_dir": "./outputs/tiny",
    }


def saved_local_target(tmp_path: Path) -> str:
    """A new LocalTarget block of the job venv, working in `tmp_path`/work; its name."""
    from overbrainer_prefect.blocks import LocalTarget

    name = f"local-{uuid.uuid4().hex[:8]}"
    LocalTarget(
        job_venv=str(job_venv()), work_dir=str(tmp_path / "work"), poll_seconds=0.5, cpu_threads=1
    ).save(name)
    return name


def test_axolotls_registry_returns_the_launcher_without_importing_anything_heavy(
    visible: Path,
) -> None:
    code = (
        "import sys\n"
        "from axolotl.cli.cloud.registry import load_cloud_provider\n"
        "launcher = load_cloud_provider({'provider': 'overbrainer', 'target': 'x'})\n"
        "print(type(launcher).__module__, type(launcher).__name__)\n"
        "print(sorted(m for m in ('torch', 'prefect', 'transformers') if m in sys.modules))\n"
    )
    done = subprocess.run(
        [str(job_venv() / "bin" / "python"), "-c", code],
        env=axolotl_env(visible),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert done.stdout.splitlines() == [
        "overbrainer_prefect.axolotl_cloud.launcher OverbrainerLauncher",
        "[]",
    ]


def test_a_typo_in_cloud_yml_ends_the_command_in_one_line_with_nothing_created(
    started: dict[str, Started],
) -> None:
    """`taget: local` in cloud.yml (started with the module's other commands)."""
    done = started["typo"].finished()
    tmp_path = started["typo"].where
    assert done.returncode == 2, done.stderr
    assert ours(done.stderr) == [
        "overbrainer: cloud.yml: unknown key `taget`: did you mean `target`?"
    ]
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "runs").exists()


def test_no_prefect_server_ends_the_command_in_one_line(tmp_path: Path) -> None:
    from tests.ports import free_port

    done = orchestrate(
        tmp_path,
        {"base_model": "org/model", "datasets": ["org/data"], "learning_rate": 1e-4},
        {"provider": "overbrainer", "target": "local"},
        PREFECT_API_URL=f"http://127.0.0.1:{free_port()}/api",
    )
    assert done.returncode == 2, done.stderr
    [line] = ours(done.stderr)
    assert line.startswith("overbrainer: no Prefect server answers at http://127.0.0.1:")


def test_an_unknown_target_ends_the_command_in_one_line_with_nothing_created(
    started: dict[str, Started],
) -> None:
    """`target: nowhere` in cloud.yml (started with the module's other commands)."""
    done = started["nowhere"].finished()
    tmp_path = started["nowhere"].where
    assert done.returncode == 2, done.stderr
    [line] = ours(done.stderr)
    assert line.startswith("overbrainer: no target block named 'nowhere'"), line
    assert not (tmp_path / "runs").exists()


def test_a_key_the_axolotl_versions_do_not_know_ends_the_command_in_one_line(
    tmp_path: Path,
) -> None:
    config = {"base_model": "org/m", "datasets": ["org/d"], "learning_rate": 1e-4}
    done = orchestrate(tmp_path, config | {"lora_dropuot": 0.1}, {"target": "local"})
    assert done.returncode == 2, done.stderr
    [line] = ours(done.stderr)
    assert "unknown axolotl key in extra `lora_dropuot`" in line
    assert "did you mean `lora_dropout`?" in line


@pytest.mark.slow
def test_a_tiny_training_through_axolotls_command_ends_0_with_its_files_verified(
    started: dict[str, Started],
) -> None:
    """`tiny_config` on a local target, `max_hours: 1` (started with the
    module's other commands)."""
    from overbrainer_prefect.runs import Runs, RunState

    done = started["local"].finished()
    tmp_path = started["local"].where
    runs_dir = tmp_path / "runs"
    assert done.returncode == 0, done.stderr[-4000:]
    lines = ours(done.stderr)
    assert (
        lines[0]
        == "overbrainer: output_dir is left to the run: its files land in its run directory"
    )
    assert lines[1].startswith("overbrainer: the flow run: http")
    assert "files verified in" in lines[-1], lines
    [record] = Runs(runs_dir).list()
    assert record.state == RunState.SUCCEEDED
    local = Runs(runs_dir).run_dir(record.id)
    shown = {
        line.split()[-1]: line.split()[0]
        for line in done.stdout.splitlines()
        if re.match(r"  [0-9a-f]{64}  ", line)
    }
    assert "output/adapter_model.safetensors" in shown
    for path, digest in shown.items():
        assert hashlib.sha256((local / path).read_bytes()).hexdigest() == digest
    assert "step 3/3" in done.stderr  # the job's progress lines reached the terminal
    assert not (tmp_path / "outputs").exists()


def schema_defaults(keys: set[str]) -> dict[str, Any]:
    """The defaults of `keys` in the job venv's axolotl config schema, read from
    its source (importing it takes torch: most of a minute on a loaded machine)."""
    import ast

    schemas = next((job_venv() / "lib").glob("python3*/site-packages/axolotl/utils/schemas"))
    found: dict[str, Any] = {}
    for path in sorted(schemas.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            if node.target.id not in keys or node.value is None:
                continue
            value = node.value
            if isinstance(value, ast.Call):
                value = next(k.value for k in value.keywords if k.arg == "default")
            found[node.target.id] = ast.literal_eval(value)
    return found


def test_the_axolotl_defaults_the_mapping_uses_are_the_job_venvs() -> None:
    found = schema_defaults(set(AXOLOTL_DEFAULTS))
    assert found == AXOLOTL_DEFAULTS | {"warmup_steps": None}


def test_axolotl_keys_go_to_the_spec_fields_and_the_rest_to_extra() -> None:
    spec, notes = spec_from_axolotl(
        {
            "base_model": "org/model",
            "datasets": [{"path": "org/data", "type": "alpaca"}],
            "learning_rate": 1e-4,
            "adapter": "qlora",
            "load_in_4bit": True,
            "lora_target_linear": True,
            "bf16": "auto",
            "deepspeed": "deepspeed_configs/zero3_bf16.json",
            "wandb_project": "p",
            "weight_decay": 0.01,
            "output_dir": "./out",
        },
        {"max_steps": 7},
    )
    assert (spec.adapter, spec.precision, spec.sharding) == ("qlora", "auto", "zero3")
    assert spec.max_steps == 7 and spec.micro_batch_size == 1 and spec.warmup_steps == 0
    assert spec.trackers == ["wandb"] and spec.tracker_project == "p"
    assert spec.lora_target_modules is None
    assert spec.extra == {"weight_decay": 0.01}
    assert notes == ["output_dir is left to the run: its files land in its run directory"]
    full, _ = spec_from_axolotl({"base_model": "m/m", "datasets": ["d/d"], "learning_rate": 1})
    assert full.adapter == "full" and full.precision == "fp32"


def test_cloud_yml_is_checked_key_by_key() -> None:
    assert read_cloud({"provider": "overbrainer", "target": "t", "max_hours": 2}).bounds() == {
        "max_hours": 2
    }
    with pytest.raises(CloudConfigError, match="did you mean `max_cost_usd`"):
        read_cloud({"target": "t", "max_cost": 3})
    with pytest.raises(CloudConfigError, match="target: missing"):
        read_cloud({"provider": "overbrainer"})
    with pytest.raises(CloudConfigError, match="max_hours: Input should be greater than 0"):
        read_cloud({"target": "t", "max_hours": 0})


def interrupted(
    visible: Path, where: Path, config: dict[str, Any], cloud: dict[str, Any], answer: str
) -> tuple[int, str, Any]:
    """`axolotl train --cloud` until its job trains, then Ctrl-C at the terminal
    (SIGINT to the command's process group: both its processes get it), the
    question answered `answer`; its exit code, its stderr and the run's record
    as it trained."""
    runs_dir = Path(cloud["runs_dir"])
    (where / "config.yml").write_text(yaml.safe_dump(config))
    (where / "cloud.yml").write_text(yaml.safe_dump({"python": sys.executable, **cloud}))
    err = where / "stderr.txt"
    with err.open("w") as stderr, (where / "stdout.txt").open("w") as stdout:
        command = subprocess.Popen(
            [str(job_venv() / "bin" / "axolotl"), "train", "config.yml", "--cloud", "cloud.yml"],
            cwd=where,
            env=axolotl_env(visible),
            stdin=subprocess.PIPE,
            stdout=stdout,
            stderr=stderr,
            text=True,
            start_new_session=True,  # its own group, as a terminal's foreground job
        )
    try:
        wait_until(lambda: running_on_pod(runs_dir) is not None, 300, "the job to train")
        record = running_on_pod(runs_dir)
        os.killpg(command.pid, signal.SIGINT)
        wait_until(lambda: QUESTION.strip() in err.read_text(), 30, "the question")
        assert command.stdin is not None
        command.stdin.write(f"{answer}\n")
        command.stdin.flush()
        code = command.wait(timeout=240)
    finally:
        kill(command)
    said = err.read_text()
    assert said.count(QUESTION.strip()) == 1, said[-3000:]  # asked once
    return code, said, record


@pytest.mark.slow
def test_ctrl_c_then_cancel_cancels_the_job_on_its_pod_and_deletes_the_pod(
    prefect_server: None,
    sim: RunpodSim,
    pods_of: SimPods,
    visible: Path,
    tiny: tuple[Path, Path],
    tmp_path: Path,
) -> None:
    from overbrainer_prefect.runpod.pod import PodRecord, PodState
    from overbrainer_prefect.runs import Runs, RunState

    runs_dir = tmp_path / "runs"
    cloud = {"provider": "overbrainer", "target": runpod_target(sim), "runs_dir": str(runs_dir)}
    config = tiny_config(*tiny) | {"max_steps": LONG}
    code, said, record = interrupted(visible, tmp_path, config, cloud, "c")
    assert code == 1, said[-3000:]
    saved = Runs(runs_dir).load(record.id)
    assert saved.state == RunState.CANCELLED, saved.message
    pod = PodRecord.load(Runs(runs_dir), record.id)
    assert pod is not None and pod.state == PodState.DELETED and pod.pod_id is not None
    assert sim.pod(pod.pod_id).deleted and not pods_of.running(pod.pod_id)


@pytest.mark.slow
def test_ctrl_c_then_stop_retrieves_a_checkpoint_and_says_how_to_resume(
    prefect_server: None, visible: Path, tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    from overbrainer_prefect.runs import Runs, RunState

    name = saved_local_target(tmp_path)
    runs_dir = tmp_path / "runs"
    cloud = {"provider": "overbrainer", "target": name, "runs_dir": str(runs_dir)}
    config = tiny_config(*tiny) | {"max_steps": LONG}
    code, said, record = interrupted(visible, tmp_path, config, cloud, "s")
    assert code == 1, said[-3000:]
    saved = Runs(runs_dir).load(record.id)
    assert saved.state == RunState.STOPPED, saved.message
    assert list((Runs(runs_dir).run_dir(record.id) / "output").glob("checkpoint-*"))
    assert f"resume it with `resume_from: {record.id}` in cloud.yml" in ours(said)[-1]


def test_a_deployment_that_does_not_exist_ends_the_command_in_one_line(
    prefect_server: None, tmp_path: Path
) -> None:
    from prefect.settings import PREFECT_API_URL

    done = orchestrate(
        tmp_path,
        {"base_model": "org/model", "datasets": ["org/data"], "learning_rate": 1e-4},
        {"target": "anything", "deployment": "train/nowhere"},
        PREFECT_API_URL=str(PREFECT_API_URL.value()),
    )
    assert done.returncode == 2, done.stderr
    assert ours(done.stderr) == [
        "overbrainer: no deployment train/nowhere: deploy it (`prefect deploy`) or fix "
        "`deployment:` in cloud.yml"
    ]


def test_a_deployments_run_whose_last_log_lines_reach_the_server_after_its_state_succeeds(
    prefect_server: None, capsys: pytest.CaptureFixture[str]
) -> None:
    # a flow run's process sends its log in batches: its Completed state can reach the server
    # before the line that says the run succeeded (seen in `make test`: the command ended 1,
    # "the flow run ended Completed: no message"); the command reads on until that line comes
    import asyncio
    from datetime import UTC, datetime

    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import LogCreate
    from prefect.states import Completed

    from overbrainer_prefect.axolotl_cloud.console import (
        SUCCEEDED,
        Following,
        Request,
        follow_deployed,
    )
    from overbrainer_prefect.trainers.spec import TrainingSpec

    @flow(name="late-log")
    def late_log() -> None:
        """Never run: its flow run is made and ended through the client."""

    line = "run 20261205-000000-late succeeded: 3 files verified"
    cloud = read_cloud({"provider": "overbrainer", "target": "t", "deployment": "train/x"})
    request = Request(cloud=cloud, spec=TrainingSpec.model_construct(), notes=[])
    following = Following(cloud=cloud)

    async def scenario() -> int:
        async with get_client() as client:
            made = await client.create_flow_run(late_log)
            await client.set_flow_run_state(made.id, Completed(), force=True)
            ended = asyncio.create_task(follow_deployed(made, request, following))
            await asyncio.sleep(5.0)  # past two batch intervals: the old loop ended by then
            assert not ended.done(), "ended before the run's last line reached the server"
            late = LogCreate(
                name="prefect.flow_runs",
                level=20,
                message=line,
                timestamp=datetime.now(UTC),
                flow_run_id=made.id,
            )
            await client.create_logs([late])
            return await asyncio.wait_for(ended, timeout=60.0)

    code = asyncio.run(scenario())
    printed = capsys.readouterr()
    assert code == SUCCEEDED, printed
    assert line in printed.out
    assert following.run_id == "20261205-000000-late"
    assert "the run succeeded" in printed.err


@pytest.mark.parametrize("what", ["train", "preprocess", "lm_eval"])
def test_without_an_orchestrator_python_each_command_says_so_in_one_line(
    visible: Path, what: str
) -> None:
    said = "overbrainer: no orchestrator Python found: set `python:` in cloud.yml"
    code = (
        "import sys\n"
        "from overbrainer_prefect.axolotl_cloud.launcher import OverbrainerLauncher\n"
        "launcher = OverbrainerLauncher.from_config({'provider': 'overbrainer', 'target': 't'})\n"
        f"launcher.{what}('base_model: x')\n"
    )
    env = axolotl_env(visible, PATH="/usr/bin:/bin")
    env.pop("OVERBRAINER_PYTHON", None)
    done = subprocess.run(
        [str(job_venv() / "bin" / "python"), "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    [line] = done.stderr.splitlines()
    assert line.startswith(said), line


def test_a_bound_the_target_does_not_have_ends_the_command_in_one_line(
    prefect_server: None, tmp_path: Path
) -> None:
    from prefect.settings import PREFECT_API_URL

    name = saved_local_target(tmp_path)
    done = orchestrate(
        tmp_path,
        {"base_model": "org/model", "datasets": ["org/data"], "learning_rate": 1e-4},
        {"target": name, "max_cost_usd": 5, "runs_dir": str(tmp_path / "runs")},
        PREFECT_API_URL=str(PREFECT_API_URL.value()),
    )
    assert done.returncode == 2, done.stderr
    assert ours(done.stderr) == [
        f"overbrainer: target overbrainer-local-target/{name} has no max_cost_usd: remove it "
        "(only a Runpod target's cost is bounded)"
    ]
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_a_tiny_training_on_a_simulated_pod_ends_0_with_its_files_verified_and_no_pod(
    module_sim: RunpodSim, started: dict[str, Started]
) -> None:
    """`tiny_config` on a Runpod target of the simulator, `max_hours: 0.5` and
    `max_cost_usd: 1` (started with the module's other commands)."""
    from overbrainer_prefect.runpod.pod import PodRecord, PodState
    from overbrainer_prefect.runs import Runs, RunState

    sim = module_sim
    done = started["pod"].finished()
    runs_dir = started["pod"].where / "runs"
    assert done.returncode == 0, done.stderr[-4000:]
    assert "files verified in" in ours(done.stderr)[-1]
    [record] = Runs(runs_dir).list()
    assert record.state == RunState.SUCCEEDED
    pod = PodRecord.load(Runs(runs_dir), record.id)
    assert pod is not None and pod.state == PodState.DELETED and pod.pod_id is not None
    assert sim.pod(pod.pod_id).deleted
    assert (Runs(runs_dir).run_dir(record.id) / "output" / "adapter_model.safetensors").is_file()


def test_what_the_targets_job_venv_cannot_run_ends_the_command_in_one_line(
    prefect_server: None, tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    """The probe of a machine you own runs before anything exists: flash
    attention on a CPU box whose job venv has no flash_attn."""
    from prefect.settings import PREFECT_API_URL

    name = saved_local_target(tmp_path)
    done = orchestrate(
        tmp_path,
        tiny_config(*tiny) | {"flash_attention": True},
        {"target": name, "runs_dir": str(tmp_path / "runs")},
        PREFECT_API_URL=str(PREFECT_API_URL.value()),
    )
    assert done.returncode == 2, done.stderr
    assert ours(done.stderr)[1:] == [
        "overbrainer: flash_attention needs an NVIDIA GPU and this target has none: turn "
        "flash_attention off, or use a target with a GPU"
    ]
    assert not (tmp_path / "runs").exists() and not (tmp_path / "work").exists()


def test_a_preprocessing_runs_axolotls_preprocess_once_and_brings_back_prepared() -> None:
    from overbrainer_prefect.kinds.training import next_step
    from overbrainer_prefect.runs import RunRecord, RunState
    from overbrainer_prefect.trainers.axolotl import AxolotlTrainer
    from overbrainer_prefect.trainers.base import JobContext, TargetFacts

    spec, _ = spec_from_axolotl({"base_model": "o/m", "datasets": ["o/d"], "learning_rate": 1})
    only = spec.model_copy(update={"preprocess_only": True})
    ctx = JobContext(
        run_id="r", run_dir="/w/r", cache_dir="/hf", facts=TargetFacts(python="/py", gpus=4)
    )
    prepare, ended = AxolotlTrainer(only).commands(ctx)
    assert prepare == ["/py", "-m", "overbrainer_run", "axolotl.cli.preprocess", "axolotl.yaml"]
    assert ended[:2] == ["/py", "-c"] and "'event': 'end'" in ended[2]
    assert AxolotlTrainer(spec).commands(ctx)[0][:3] == ["/py", "-m", "torch.distributed.run"]
    artifacts = AxolotlTrainer(only).artifacts()
    assert artifacts.required == "prepared" and "prepared" in artifacts.entries
    assert "prepared" not in AxolotlTrainer(only).artifacts().exclude
    assert AxolotlTrainer(only).config(ctx.facts)["dataset_prepared_path"] == "prepared"
    record = RunRecord(
        id="20260101-000000-abcd",
        target="t",
        created="2026-01-01T00:00:00Z",
        remote_dir="/w",
        state=RunState.SUCCEEDED,
        spec=only.model_dump(mode="json"),
    )
    assert "tokenized datasets are in `runs/20260101-000000-abcd/prepared/`" in next_step(record)


def test_a_preprocessing_that_names_a_run_to_resume_from_ends_in_one_line(
    tmp_path: Path,
) -> None:
    config = {"base_model": "org/m", "datasets": ["org/d"], "learning_rate": 1e-4}
    cloud = {"target": "local", "resume_from": "20260101-000000-abcd"}
    done = orchestrate(tmp_path, config, cloud, "preprocess")
    assert done.returncode == 2, done.stderr
    assert ours(done.stderr) == [
        "overbrainer: cloud.yml: resume_from: a preprocessing starts from no checkpoint: remove it"
    ]


@pytest.mark.slow
def test_axolotls_preprocess_command_brings_back_the_tokenized_datasets_verified(
    started: dict[str, Started],
) -> None:
    """`axolotl preprocess` of `tiny_config` on a local target (started with
    the module's other commands)."""
    from overbrainer_prefect.runs import Runs, RunState

    done = started["preprocess"].finished()
    tmp_path = started["preprocess"].where
    runs_dir = tmp_path / "runs"
    assert done.returncode == 0, done.stderr[-4000:]
    assert "files verified in" in ours(done.stderr)[-1], ours(done.stderr)
    [record] = Runs(runs_dir).list()
    assert record.state == RunState.SUCCEEDED
    assert (record.spec or {}).get("preprocess_only") is True
    local = Runs(runs_dir).run_dir(record.id)
    shown = {
        line.split()[-1]: line.split()[0]
        for line in done.stdout.splitlines()
        if re.match(r"  [0-9a-f]{64}  ", line)
    }
    prepared = [path for path in shown if path.startswith("prepared/")]
    assert any(path.endswith(".arrow") for path in prepared), shown
    for path, digest in shown.items():
        assert hashlib.sha256((local / path).read_bytes()).hexdigest() == digest
    assert not (local / "output").exists() and not (tmp_path / "outputs").exists()


def lm_eval_request(tmp_path: Path, cloud: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    """`axolotl lm-eval --cloud`'s work in the orchestrator's Python, on the
    test's Prefect server, with the tiny YAML of a base model `org/model`."""
    from prefect.settings import PREFECT_API_URL

    config = {"base_model": "org/model", "datasets": ["org/data"], "learning_rate": 1e-4}
    return orchestrate(
        tmp_path,
        config,
        {"runs_dir": str(tmp_path / "runs"), **cloud},
        "lm_eval",
        PREFECT_API_URL=str(PREFECT_API_URL.value()),
    )


def test_lm_eval_without_a_trained_run_of_the_yamls_model_ends_in_one_line(
    prefect_server: None, tmp_path: Path
) -> None:
    done = lm_eval_request(tmp_path, {"target": "local"})
    assert done.returncode == 2, done.stderr
    assert ours(done.stderr) == [
        f"overbrainer: no succeeded training of org/model in {tmp_path / 'runs'}: train it "
        "first (`axolotl train config.yml --cloud cloud.yml`) or name a run with `run_id:` in "
        "cloud.yml"
    ]
    bad = lm_eval_request(tmp_path, {"target": "local", "evaluation": {"quant": 3, "x": 1}})
    assert bad.returncode == 2, bad.stderr
    [line] = ours(bad.stderr)
    assert line.startswith("overbrainer: cloud.yml: evaluation."), line


def test_lm_eval_runs_the_evaluate_flow_on_the_newest_training_of_the_yamls_model(
    prefect_server: None, tmp_path: Path
) -> None:
    """The newest succeeded training of `org/model` (not a preprocessing, not
    another model's) goes to the evaluate flow, whose own refusal (no export
    to evaluate) ends the command in one line; then `run_id:` names a run."""
    from overbrainer_prefect.runs import RunRecord, Runs, RunState

    runs = Runs(tmp_path / "runs")
    spec, _ = spec_from_axolotl({"base_model": "org/model", "datasets": ["d"], "learning_rate": 1})
    made = [
        ("20260101-000000-aaaa", spec),
        ("20260102-000000-bbbb", spec),
        ("20260103-000000-cccc", spec.model_copy(update={"preprocess_only": True})),
        ("20260104-000000-dddd", spec.model_copy(update={"base_model": "other/model"})),
    ]
    for run_id, each in made:
        runs.save(
            RunRecord(
                id=run_id,
                target="local",
                created="2026-01-01T00:00:00Z",
                remote_dir="/w",
                state=RunState.SUCCEEDED,
                spec=each.model_dump(mode="json"),
            )
        )
    done = lm_eval_request(tmp_path, {"target": "local"})
    assert done.returncode == 1, done.stderr
    lines = ours(done.stderr)
    assert lines[0].startswith("overbrainer: evaluating run 20260102-000000-bbbb: http"), lines
    assert lines[-1] == (
        "overbrainer: the evaluation ended Failed: run 20260102-000000-bbbb has no succeeded "
        "q4_k_m export to compare: run the export flow first (run_id=20260102-000000-bbbb, "
        "quant=q4_k_m)"
    ), lines
    named = lm_eval_request(
        tmp_path,
        {"target": "local", "run_id": "20260101-000000-aaaa", "evaluation": {"quant": "q8_0"}},
    )
    assert named.returncode == 1, named.stderr
    assert ours(named.stderr)[-1].endswith("(run_id=20260101-000000-aaaa, quant=q8_0)")


def test_local_inputs_go_into_the_store_and_come_back_only_as_they_were_put(
    s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a deployment's worker reads instead of the laptop's paths: from an
    object store, fetched into its staging directory; from a local one, where
    it is; a file changed in the store since is refused in one line."""
    from overbrainer_prefect.runs import Runs
    from overbrainer_prefect.runs.store import STAGING_ENV
    from overbrainer_prefect.trainers.uploads import UploadError, fetched_spec, local_inputs, upload

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "model" / "weights.bin").write_bytes(b"w" * 1000)
    (tmp_path / "chat.jsonl").write_text('{"messages": []}\n')
    config = {
        "base_model": str(tmp_path / "model"),
        "datasets": [str(tmp_path / "chat.jsonl"), "org/hub-data"],
        "learning_rate": 1e-4,
    }
    spec, _ = spec_from_axolotl(config)
    assert local_inputs(spec) == [str(tmp_path / "chat.jsonl"), str(tmp_path / "model")]
    monkeypatch.setenv(STAGING_ENV, str(tmp_path / "worker"))
    for runs in (Runs(s3.bucket_url()), Runs(tmp_path / "runs")):
        uploads = [upload(runs, local) for local in local_inputs(spec)]
        assert upload(runs, str(tmp_path / "chat.jsonl")) == uploads[0]  # one upload per content
        read = fetched_spec(runs, spec, uploads)
        dataset, model = Path(read.datasets[0].path), Path(read.base_model)
        assert (
            dataset.read_text() == '{"messages": []}\n' and read.datasets[1].path == "org/hub-data"
        )
        assert sorted(p.name for p in model.iterdir()) == ["config.json", "weights.bin"]
        assert str(dataset).startswith(str(runs.root / ".uploads"))
        assert fetched_spec(runs, spec, uploads) == read  # a copy still the same is kept
        runs.store.write(f"{uploads[0].key}/chat.jsonl", b'{"messages": [1]}\n')
        if runs.store.local_path(uploads[0].key) is None:
            dataset.unlink()  # the worker's copy from an object store: read again
        with pytest.raises(UploadError, match=r"chat.jsonl differs from the file uploaded \("):
            fetched_spec(runs, spec, uploads)


def test_get_local_dirs_names_what_the_running_commands_yaml_names_here(
    visible: Path, tmp_path: Path
) -> None:
    """axolotl calls it before `train`, with only the working directory: the
    YAML is the one its click command was given."""
    (tmp_path / "model").mkdir()
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "chat.jsonl").write_text("{}\n")
    config = {
        "base_model": "./model",
        "datasets": [{"path": "data/chat.jsonl"}, "org/hub-data", {"path": "./data"}],
    }
    (tmp_path / "config.yml").write_text(yaml.safe_dump(config))
    code = (
        "import json, click\n"
        "from overbrainer_prefect.axolotl_cloud.launcher import OverbrainerLauncher\n"
        "launcher = OverbrainerLauncher.from_config({'provider': 'overbrainer', 'target': 't'})\n"
        "print(json.dumps(launcher.get_local_dirs('.')))\n"
        "with click.Context(click.Command('train')) as context:\n"
        "    context.params['config'] = 'config.yml'\n"
        "    print(json.dumps(launcher.get_local_dirs('.')))\n"
    )
    done = subprocess.run(
        [str(job_venv() / "bin" / "python"), "-c", code],
        cwd=tmp_path,
        env=axolotl_env(visible),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    outside, inside = (json.loads(line) for line in done.stdout.splitlines())
    assert outside == {}
    assert inside == {
        "datasets/0": str(tmp_path / "data" / "chat.jsonl"),
        "datasets/2": str(tmp_path / "data"),
        "base_model": str(tmp_path / "model"),
    }


@pytest.mark.slow
def test_ctrl_c_then_stop_during_a_preprocessing_cancels_it_in_one_line(
    prefect_server: None, tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    """A preprocessing keeps no checkpoint (axolotl's preprocess never reads
    the stop request): `s` cancels its job instead, and says so. Without
    axolotl's CLI before it (what it hands over is the same)."""
    from prefect.settings import PREFECT_API_URL

    from overbrainer_prefect.runs import Runs, RunState

    runs_dir = tmp_path / "runs"
    cloud = {"target": saved_local_target(tmp_path), "runs_dir": str(runs_dir)}
    request = {
        "cloud": cloud,
        "config_dir": str(tmp_path),
        "config_yaml": yaml.safe_dump(tiny_config(*tiny)),
    }
    (tmp_path / "request.json").write_text(json.dumps(request))
    err = tmp_path / "stderr.txt"
    env = dict(os.environ, PYTHONPATH=str(REPO), PREFECT_API_URL=str(PREFECT_API_URL.value()))
    with err.open("w") as stderr:
        command = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "overbrainer_prefect.axolotl_cloud",
                "preprocess",
                "request.json",
            ],
            cwd=tmp_path,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            text=True,
            start_new_session=True,
        )

    def started() -> Any:
        found = [r for r in Runs(runs_dir).list() if r.job is not None] if runs_dir.exists() else []
        return found[0] if found else None

    try:
        wait_until(started, 240, "the preprocessing's job to start")
        record = started()
        assert record.state == RunState.RUNNING, record.state
        command.send_signal(signal.SIGINT)
        wait_until(lambda: QUESTION.strip() in err.read_text(), 30, "the question")
        assert command.stdin is not None
        command.stdin.write("s\n")
        command.stdin.flush()
        code = command.wait(timeout=240)
    finally:
        kill(command)
    said = err.read_text()
    assert code == 1, said[-3000:]
    line = "overbrainer: a preprocessing keeps no checkpoint to go on from: it is cancelled instead"
    # a line of its own, or right after the question (no terminal echoes the answer's newline;
    # the flow's log lines race the question)
    assert re.search(f"^(?:{re.escape(QUESTION)})?{re.escape(line)}$", said, re.M), said[-3000:]
    assert Runs(runs_dir).load(record.id).state == RunState.CANCELLED


def test_a_local_dataset_for_a_deployment_whose_runs_directory_is_unknown_ends_in_one_line(
    prefect_server: None, tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    """A deployment deployed without OVERBRAINER_RUNS_DIR (its worker's own
    `runs/`) and no `runs_dir:` in cloud.yml: nowhere both sides reach, so
    nothing is uploaded and no flow run made."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    name = f"unreachable-{uuid.uuid4().hex[:6]}"

    async def deploy() -> None:
        async with get_client() as client:
            flow_id = await client.create_flow_from_name("train")
            await client.create_deployment(flow_id, name, job_variables={"env": {}})

    asyncio.run(deploy())
    done = orchestrate(
        tmp_path,
        tiny_config(*tiny),
        {"target": saved_local_target(tmp_path), "deployment": f"train/{name}"},
        PREFECT_API_URL=str(PREFECT_API_URL.value()),
    )
    assert done.returncode == 2, done.stderr
    assert ours(done.stderr)[1:] == [
        f"overbrainer: {tiny[1]} is here, which a deployment's worker cannot read, and the runs "
        f"directory of train/{name} is not known here: set `runs_dir:` in cloud.yml to the one "
        "its workers use (a bucket, or a directory both reach), and it is uploaded there"
    ]
    assert not (tmp_path / "work").exists() and "the flow run:" not in done.stderr
