"""The Prefect run flows on the local target, with real axolotl fine-tunes of
the tiny model, on the real (ephemeral) Prefect server: train, cancel, stop
and resume, attach after the first follower was killed, and bad input."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

from overbrainer_prefect.blocks import LocalTarget, UnknownTarget
from overbrainer_prefect.flows import RunResult, attach, cancel, stop, train
from overbrainer_prefect.runs import InvalidRunId, RunNotFound, Runs, RunState
from overbrainer_prefect.trainers.spec import TrainingSpec
from tests.conftest import REPO, job_venv
from tests.flowrun import run
from tests.procs import alive

pytestmark = pytest.mark.slow

SECRET = "hf_" + secrets.token_hex(16)  # made at test time, never committed


def spec(model: Path, dataset: Path, **changes: Any) -> TrainingSpec:
    values: dict[str, Any] = {
        "base_model": str(model),
        "datasets": [str(dataset)],
        "sequence_len": 64,
        "micro_batch_size": 4,
        "max_steps": 6,
        "learning_rate": 5e-3,
        "lora_r": 8,
        "lora_alpha": 16,
        "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
        "warmup_steps": 0,
        "seed": 0,
    }
    values.update(changes)
    return TrainingSpec.model_validate(values)


@pytest.fixture
def target(prefect_server: None, tmp_path: Path) -> str:
    """A saved local target block whose jobs run in this test's work dir, with a
    secret in its env file."""
    env_file = tmp_path / "job.env"
    env_file.write_text(f"HF_TOKEN={SECRET}\n")
    name = f"local-{uuid.uuid4().hex[:8]}"
    LocalTarget(
        job_venv=str(job_venv()),
        work_dir=str(tmp_path / "work"),
        env_file=str(env_file),
        poll_seconds=0.5,
        cpu_threads=1,
    ).save(name)
    return name


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def read_artifacts(run_id: str) -> dict[str, Any]:
    async def go() -> dict[str, Any]:
        async with get_client() as client:
            found = await client.read_artifacts(
                artifact_filter=ArtifactFilter(key=ArtifactFilterKey(like_=f"run-{run_id}"))
            )
            return {a.key: a for a in found}

    return run(go())


def assert_no_secret_under(*roots: Path) -> None:
    for root in roots:
        for path in root.rglob("*"):
            if path.is_file():
                assert SECRET.encode() not in path.read_bytes(), path


def test_a_real_fine_tune_through_the_train_flow_is_retrieved_and_verified(
    target: str, tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    """A real axolotl job of 6 steps through the train flow: its metrics plugin's
    events (what the trainer-level test of test_axolotl_trainer asserted of its own
    job), its files retrieved and verified, its artifacts, and no secret anywhere."""
    runs_dir = tmp_path / "runs"
    result = run(train(target=target, training=spec(*tiny), runs_dir=str(runs_dir)))
    assert isinstance(result, RunResult)
    assert result.state == RunState.SUCCEEDED, result.message
    assert result.steps == 6 and result.final_loss is not None
    local = Runs(runs_dir).run_dir(result.run_id)
    paths = {f.path for f in result.files}
    assert {"job.log", "metrics.jsonl", "axolotl.yaml", "output/adapter_model.safetensors"} <= paths
    for entry in result.files:
        assert sha256(local / entry.path) == entry.sha256
        assert (local / entry.path).stat().st_size == entry.size
    record = Runs(runs_dir).load(result.run_id)
    assert record.state == RunState.SUCCEEDED and record.job is not None
    # what the metrics plugin wrote, a flushed line each, in order
    found = [json.loads(line) for line in (local / "metrics.jsonl").read_text().splitlines()]
    assert [e["event"] for e in found] == ["begin"] + ["log"] * 6 + ["end"]
    assert found[0]["max_steps"] == 6 and found[0]["step"] == 0
    logs = found[1:-1]
    assert [e["step"] for e in logs] == [1, 2, 3, 4, 5, 6]
    assert all({"loss", "learning_rate", "grad_norm", "epoch", "time"} <= e.keys() for e in logs)
    assert logs[-1]["loss"] < logs[0]["loss"]
    assert [e["time"] for e in found] == sorted(e["time"] for e in found)
    assert found[-1] | {"step": 6, "stopped": False, "checkpoint": None} == found[-1]
    assert found[-1]["train_loss"] > 0
    assert "output/adapter_config.json" in paths
    assert not any(p.startswith("output/checkpoint-") for p in paths)  # nothing heavy retrieved
    log = (local / "job.log").read_text(errors="replace")
    assert "overbrainer metrics plugin loaded" in log
    assert "Plugin loaded successfully: overbrainer_metrics.MetricsPlugin" in log
    artifacts = read_artifacts(result.run_id)
    assert {f"run-{result.run_id}-{k}" for k in ("progress", "metrics", "summary")} <= set(
        artifacts
    )
    summary = artifacts[f"run-{result.run_id}-summary"].data
    assert "output/adapter_model.safetensors" in summary and result.run_id in summary
    table = json.loads(artifacts[f"run-{result.run_id}-metrics"].data)
    assert [row["step"] for row in table] == [1, 2, 3, 4, 5, 6]
    progress = artifacts[f"run-{result.run_id}-progress"].data
    assert float(progress) == 100.0
    assert_no_secret_under(runs_dir, tmp_path / "work")
    assert all(SECRET not in json.dumps(a.data) for a in artifacts.values())


def wait_until(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def python_in_child(
    code: str, args: list[str], log: Path, cwd: Path = REPO
) -> subprocess.Popen[bytes]:
    """Runs `code` (a flow call) in another Python process with `args` as its
    argv, against this session's Prefect server, in a session of its own."""
    from prefect.settings import PREFECT_API_URL

    env = dict(os.environ, PREFECT_API_URL=str(PREFECT_API_URL.value()))
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        cwd=cwd,
        env=env,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def start_in_child(
    target: str, training: TrainingSpec, runs_dir: Path, log: Path, cwd: Path = REPO
) -> subprocess.Popen[bytes]:
    """Runs the train flow in another Python process, against this session's
    server, in `cwd`."""
    code = (
        "import asyncio, json, sys\n"
        "from overbrainer_prefect.flows import train\n"
        "from overbrainer_prefect.trainers.spec import TrainingSpec\n"
        "spec = TrainingSpec.model_validate(json.loads(sys.argv[2]))\n"
        "asyncio.run(train(target=sys.argv[1], training=spec, runs_dir=sys.argv[3]))\n"
    )
    return python_in_child(code, [target, training.model_dump_json(), str(runs_dir)], log, cwd)


def first_running(runs_dir: Path) -> Any:
    for record in Runs(runs_dir).list():
        if record.state == RunState.RUNNING and record.job is not None:
            metrics = Path(record.remote_dir) / "metrics.jsonl"
            if metrics.exists() and '"log"' in metrics.read_text():
                return record
    return None


def kill(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)


def test_attach_from_a_second_process_completes_a_run_whose_first_follower_was_killed(
    target: str, tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    runs_dir = tmp_path / "runs"
    child = start_in_child(target, spec(*tiny, max_steps=30), runs_dir, tmp_path / "child.log")
    try:
        wait_until(lambda: first_running(runs_dir) is not None, 240, "the child's job to train")
    finally:
        kill(child)  # SIGKILL: no hook, no cleanup, the job keeps running
    record = first_running(runs_dir) or Runs(runs_dir).list()[0]
    assert Runs(runs_dir).load(record.id).state == RunState.RUNNING
    result = run(attach(run_id=record.id, runs_dir=str(runs_dir)))
    assert result.state == RunState.SUCCEEDED, result.message
    assert result.steps == 30
    assert "output/adapter_model.safetensors" in {f.path for f in result.files}


def test_cancel_stops_a_training_job_and_retrieves_what_it_left(
    target: str, tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    runs_dir = tmp_path / "runs"
    child = start_in_child(target, spec(*tiny, max_steps=400), runs_dir, tmp_path / "child.log")
    try:
        wait_until(lambda: first_running(runs_dir) is not None, 240, "the job to train")
        record = first_running(runs_dir)
        result = run(cancel(run_id=record.id, runs_dir=str(runs_dir)))
    finally:
        kill(child)
    assert result.state == RunState.CANCELLED
    assert result.retrieved
    saved = Runs(runs_dir).load(record.id)
    assert saved.state == RunState.CANCELLED and saved.message is None
    local = Runs(runs_dir).run_dir(record.id)
    assert (local / "job.log").is_file() and (local / "metrics.jsonl").is_file()
    # the whole process group is gone
    assert record.job is not None
    assert not alive(record.job.pid)


def test_stop_saves_a_checkpoint_and_a_new_run_resumes_from_it_in_another_directory(
    target: str, tiny: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stop from another process, then resume from another working directory
    with the data only in the stopped run's own copy; the resumed job starts at
    the checkpoint's step and trains step + 1 on. (Holds what the trainer-level
    stop/resume test and `test_resume_anywhere`'s real resume asserted: one pair
    of trainings shows all three.)"""
    model, data = tiny
    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    shutil.copyfile(data, project / "data" / "chat.jsonl")
    runs_dir = tmp_path / "runs"
    relative = Path("data/chat.jsonl")  # relative to where the run starts
    child = start_in_child(
        target, spec(model, relative, max_steps=200), runs_dir, tmp_path / "child.log", project
    )
    try:
        wait_until(lambda: first_running(runs_dir) is not None, 240, "the job to train")
        record = first_running(runs_dir)
        stopped = run(stop(run_id=record.id, runs_dir=str(runs_dir)))
    finally:
        kill(child)
    assert stopped.state == RunState.STOPPED, stopped.message
    saved = Runs(runs_dir).load(record.id)
    assert saved.checkpoint is not None and saved.checkpoint.startswith("output/checkpoint-")
    step = int(saved.checkpoint.rpartition("-")[2])
    assert 0 < step < 200
    checkpoint = Runs(runs_dir).run_dir(record.id) / saved.checkpoint
    for name in ("optimizer.pt", "trainer_state.json", "adapter_model.safetensors"):
        assert (checkpoint / name).is_file(), name
    assert f"resume_from={record.id}" in (saved.message or "")
    ended = json.loads(
        (Runs(runs_dir).run_dir(record.id) / "metrics.jsonl").read_text().splitlines()[-1]
    )
    assert ended | {"event": "end", "step": step, "stopped": True} == ended
    assert ended["checkpoint"] == saved.checkpoint

    shutil.rmtree(project)  # the data is only in the stopped run now
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    resumed = run(
        train(
            target=target,
            training=spec(model, relative, max_steps=step + 3),
            resume_from=record.id,
            runs_dir=str(runs_dir),
        )
    )
    assert resumed.state == RunState.SUCCEEDED, resumed.message
    new = Runs(runs_dir).load(resumed.run_id)
    assert new.resumed_from is not None and new.resumed_from.run_id == record.id
    assert new.resumed_from.step == step
    lines = (Runs(runs_dir).run_dir(new.id) / "metrics.jsonl").read_text().splitlines()
    events = [json.loads(line) for line in lines]
    assert events[0]["event"] == "begin" and events[0]["step"] == step
    assert [e["step"] for e in events if e["event"] == "log"] == [step + 1, step + 2, step + 3]
    assert events[-1] | {"event": "end", "step": step + 3, "stopped": False} == events[-1]


def test_an_unknown_target_block_fails_before_any_run_exists(
    prefect_server: None, tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    with pytest.raises(UnknownTarget, match="no target block named 'nope'.*create it"):
        run(train(target="nope", training=spec(*tiny), runs_dir=str(tmp_path / "runs")))
    assert not (tmp_path / "runs").exists()


def test_a_missing_dataset_file_fails_before_any_run_exists(
    target: str, tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    model, _ = tiny
    training = spec(model, tmp_path / "missing.jsonl")
    with pytest.raises(Exception, match="missing.jsonl"):
        run(train(target=target, training=training, runs_dir=str(tmp_path / "runs")))
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("flow", [attach, stop, cancel])
def test_an_invalid_or_unknown_run_id_touches_nothing(
    prefect_server: None, tmp_path: Path, flow: Any
) -> None:
    runs_dir = tmp_path / "runs"
    with pytest.raises(InvalidRunId, match="is not a valid run ID"):
        run(flow(run_id="../etc", runs_dir=str(runs_dir)))
    with pytest.raises(RunNotFound, match="no run 20260101-000000-zzzz"):
        run(flow(run_id="20260101-000000-zzzz", runs_dir=str(runs_dir)))
    assert not runs_dir.exists()


def test_the_cancellation_hook_cancels_the_job_of_a_killed_flow_run_from_its_record(
    target: str, tiny: tuple[Path, Path], tmp_path: Path
) -> None:

    from overbrainer_prefect.driver import on_cancelled
    from overbrainer_prefect.flows import train as train_flow

    runs_dir = tmp_path / "runs"
    child = start_in_child(target, spec(*tiny, max_steps=400), runs_dir, tmp_path / "child.log")
    try:
        wait_until(lambda: first_running(runs_dir) is not None, 240, "the job to train")
        record = first_running(runs_dir)
    finally:
        kill(child)  # as Prefect does before it runs the hook elsewhere
    assert record.flow_run_id is not None

    async def hook() -> None:
        async with get_client() as client:
            flow_run = await client.read_flow_run(uuid.UUID(record.flow_run_id))
        await on_cancelled(train_flow, flow_run, flow_run.state)

    run(hook())
    saved = Runs(runs_dir).load(record.id)
    assert saved.state == RunState.CANCELLED
    assert (Runs(runs_dir).run_dir(record.id) / "job.log").is_file()
    assert saved.job is not None and not Path(saved.job.dir, "job.exit").exists()
