"""The collector on the real (ephemeral) Prefect server, with real jobs on the
local target (shell scripts that write what a fine-tune leaves, so no test
waits for a model): it finishes the runs whose follower is gone, cancels the
job of a run whose flow run was cancelled, ends the flow runs their dead
processes left behind, and never touches a run another process follows."""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import StateType
from prefect.states import State

from overbrainer_prefect.blocks import LocalTarget
from overbrainer_prefect.executors.base import JobSpec
from overbrainer_prefect.flows.collect import CREATE_GRACE_S, collect
from overbrainer_prefect.runs import Runs, RunState
from overbrainer_prefect.runs.lock import follow_lock
from overbrainer_prefect.runs.store import RunRecord
from overbrainer_prefect.steps import start as start_step
from overbrainer_prefect.timestamps import rfc3339
from overbrainer_prefect.trainers.spec import TrainingSpec
from tests.procs import alive
from tests.shelljobs import WRITE_OUTPUT, wait_for

collect_module = importlib.import_module("overbrainer_prefect.flows.collect")
"""The module (`overbrainer_prefect.flows.collect` names the flow, which the package exports)."""

LOOKS_TRAINED = (
    'printf \'%s\\n\' \'{"event":"begin","max_steps":2}\' > metrics.jsonl && '
    'printf \'%s\\n\' \'{"event":"log","step":1,"loss":2.5}\' >> metrics.jsonl && '
    'printf \'%s\\n\' \'{"event":"log","step":2,"loss":2.0}\' >> metrics.jsonl && '
    'printf \'%s\\n\' \'{"event":"end","step":2}\' >> metrics.jsonl && ' + WRITE_OUTPUT
)


@flow(name="stand-in-train")
def stand_in() -> None:
    """A flow whose runs stand for the train flow runs that died."""


@pytest.fixture
def target(prefect_server: None, tmp_path: Path) -> tuple[str, LocalTarget]:
    name = f"collect-{uuid.uuid4().hex[:8]}"
    block = LocalTarget(job_venv="/nonexistent", work_dir=str(tmp_path / "work"), poll_seconds=0.2)
    block.save(name)
    return f"overbrainer-local-target/{name}", block


def flow_run_in(state: StateType) -> str:
    """A flow run left in `state`, as a dead process leaves it."""

    async def go() -> str:
        async with get_client() as client:
            created = await client.create_flow_run(stand_in, state=State(type=StateType.RUNNING))
            if state != StateType.RUNNING:
                await client.set_flow_run_state(created.id, State(type=state), force=True)
            return str(created.id)

    return asyncio.run(go())


def flow_run_state(flow_run_id: str) -> Any:
    async def go() -> Any:
        async with get_client() as client:
            return (await client.read_flow_run(uuid.UUID(flow_run_id))).state

    return asyncio.run(go())


def started_run(
    runs: Runs, target: tuple[str, LocalTarget], script: str, flow_run_id: str | None
) -> RunRecord:
    """A run whose job runs `script`, recorded `running`, and whose follower is gone."""
    ref, block = target
    executor = block.executor(ref)
    spec = TrainingSpec(base_model="org/model", datasets=["org/data"])
    record = start_step.create(
        runs,
        target=ref,
        target_kind="local",
        workdir=executor.workdir,
        spec=spec.model_dump(mode="json"),
        flow_run_id=flow_run_id,
    )
    Path(record.remote_dir).mkdir(parents=True)

    async def spawn() -> Any:
        try:
            return await executor.spawn(
                JobSpec(
                    run_id=record.id, run_dir=record.remote_dir, commands=[["sh", "-c", script]]
                )
            )
        finally:
            await executor.close()

    record.job = asyncio.run(spawn())
    record.state = RunState.RUNNING
    runs.save(record)
    return record


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_collect_finishes_a_run_whose_follower_died_and_ends_its_flow_run(
    target: tuple[str, LocalTarget], tmp_path: Path
) -> None:
    runs = Runs(tmp_path / "runs")
    left_running = flow_run_in(StateType.RUNNING)
    record = started_run(runs, target, LOOKS_TRAINED, left_running)
    asyncio.run(wait_for(lambda: (Path(record.remote_dir) / "job.exit").exists(), 30, "the job"))

    rows = asyncio.run(collect(runs_dir=str(runs.root)))

    assert [(r.run_id, r.action, r.state, r.retrieved) for r in rows] == [
        (record.id, "followed to its end", RunState.SUCCEEDED, True)
    ]
    saved = runs.load(record.id)
    assert saved.state == RunState.SUCCEEDED and saved.ended is not None
    local = runs.run_dir(record.id)
    assert sha256(local / "output/adapter_model.safetensors") == sha256(
        Path(record.remote_dir) / "output/adapter_model.safetensors"
    )
    state = flow_run_state(left_running)
    assert state.type == StateType.CRASHED and record.id in state.message


def test_collect_follows_a_job_still_running_to_its_end(
    target: tuple[str, LocalTarget], tmp_path: Path
) -> None:
    runs = Runs(tmp_path / "runs")
    record = started_run(runs, target, "sleep 2 && " + LOOKS_TRAINED, None)
    rows = asyncio.run(collect(runs_dir=str(runs.root)))
    assert [(r.action, r.state) for r in rows] == [("followed to its end", RunState.SUCCEEDED)]
    assert (runs.run_dir(record.id) / "metrics.jsonl").is_file()


def test_collect_cancels_the_job_of_a_run_whose_flow_run_was_cancelled(
    target: tuple[str, LocalTarget], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(collect_module, "HOOK_GRACE_S", 0.0)  # no hook is coming
    runs = Runs(tmp_path / "runs")
    cancelling = flow_run_in(StateType.CANCELLING)
    record = started_run(runs, target, "sleep 600", cancelling)

    rows = asyncio.run(collect(runs_dir=str(runs.root)))

    assert [(r.action, r.state) for r in rows] == [("job cancelled", RunState.CANCELLED)]
    assert runs.load(record.id).state == RunState.CANCELLED
    assert record.job is not None
    assert not alive(record.job.pid)
    assert flow_run_state(cancelling).type == StateType.CANCELLED


def test_collect_leaves_a_job_whose_flow_run_was_just_cancelled_to_its_cancellation_hook(
    target: tuple[str, LocalTarget], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # between the runner killing a cancelled flow run's process and its hook taking
    # the run's lock, nothing holds the run: a collect then leaves it to the hook
    grace = 10.0
    monkeypatch.setattr(collect_module, "HOOK_GRACE_S", grace)
    runs = Runs(tmp_path / "runs")
    cancelled = flow_run_in(StateType.CANCELLED)
    since = time.monotonic()
    record = started_run(runs, target, "sleep 600", cancelled)
    before = (runs.run_dir(record.id) / "run.json").read_text()

    assert asyncio.run(collect(runs_dir=str(runs.root))) == []

    assert time.monotonic() - since < grace, "the first collect came after the grace"
    assert (runs.run_dir(record.id) / "run.json").read_text() == before
    assert record.job is not None and alive(record.job.pid)
    # once the hook had its time and did not come, a collect cancels the job
    time.sleep(max(0.0, grace + 1 - (time.monotonic() - since)))
    rows = asyncio.run(collect(runs_dir=str(runs.root)))
    assert [(r.action, r.state) for r in rows] == [("job cancelled", RunState.CANCELLED)]
    assert not alive(record.job.pid)


def test_collect_never_touches_a_run_another_process_follows(
    target: tuple[str, LocalTarget], tmp_path: Path
) -> None:
    runs = Runs(tmp_path / "runs")
    record = started_run(runs, target, LOOKS_TRAINED, None)
    before = runs.run_dir(record.id) / "run.json"
    text = before.read_text()
    with follow_lock(runs, record.id, "another follower"):
        asyncio.run(wait_for(lambda: (Path(record.remote_dir) / "job.exit").exists(), 30, "job"))
        assert asyncio.run(collect(runs_dir=str(runs.root))) == []
        assert before.read_text() == text
    assert not (runs.run_dir(record.id) / "metrics.jsonl").exists()


def test_collect_fails_a_run_whose_flow_run_ended_before_its_job_started(
    target: tuple[str, LocalTarget], tmp_path: Path
) -> None:
    runs = Runs(tmp_path / "runs")
    ref, block = target
    crashed = flow_run_in(StateType.CRASHED)
    record = start_step.create(
        runs, target=ref, target_kind="local", workdir=block.work_dir, flow_run_id=crashed
    )
    assert asyncio.run(collect(runs_dir=str(runs.root))) == []  # its creator may lock it yet
    backdate(runs, record.id, CREATE_GRACE_S + 1)
    rows = asyncio.run(collect(runs_dir=str(runs.root)))
    assert [(r.run_id, r.state) for r in rows] == [(record.id, RunState.FAILED)]
    assert runs.load(record.id).message == "interrupted before the job started"


def backdate(runs: Runs, record_id: str, seconds: float) -> None:
    """Makes a record look created `seconds` ago."""
    saved = runs.load(record_id)
    saved.created = rfc3339(datetime.now(UTC) - timedelta(seconds=seconds))
    runs.save(saved)


def test_collect_leaves_a_run_its_live_creator_is_still_preparing(
    target: tuple[str, LocalTarget], tmp_path: Path
) -> None:
    runs = Runs(tmp_path / "runs")
    ref, block = target
    running = flow_run_in(StateType.RUNNING)
    record = start_step.create(
        runs, target=ref, target_kind="local", workdir=block.work_dir, flow_run_id=running
    )
    backdate(runs, record.id, CREATE_GRACE_S + 1)
    with follow_lock(runs, record.id, "its creator"):  # what decides: the lock
        assert asyncio.run(collect(runs_dir=str(runs.root))) == []
    assert runs.load(record.id).state == RunState.PREPARING
    assert flow_run_state(running).type == StateType.RUNNING


def test_collect_fails_a_preparing_run_whose_flow_run_still_says_running_but_nobody_holds(
    target: tuple[str, LocalTarget], tmp_path: Path
) -> None:
    runs = Runs(tmp_path / "runs")
    ref, block = target
    left = flow_run_in(StateType.RUNNING)  # what a killed process leaves forever
    record = start_step.create(
        runs, target=ref, target_kind="local", workdir=block.work_dir, flow_run_id=left
    )
    backdate(runs, record.id, CREATE_GRACE_S + 1)
    rows = asyncio.run(collect(runs_dir=str(runs.root)))
    assert [(r.run_id, r.state) for r in rows] == [(record.id, RunState.FAILED)]
    assert flow_run_state(left).type == StateType.CRASHED


def test_collect_of_an_empty_runs_directory_says_there_was_nothing(
    prefect_server: None, tmp_path: Path
) -> None:
    assert asyncio.run(collect(runs_dir=str(tmp_path / "runs"))) == []
