"""The run rules on a real local target with real (shell) jobs: outcomes,
retrieval and verification, cancel, bounds on a job's time, and starts that fail."""

from __future__ import annotations

import asyncio
import os
import secrets
import sys
from pathlib import Path

import pytest
from pydantic import SecretStr

from overbrainer_prefect.executors.base import JOB_LOG, JobStatus
from overbrainer_prefect.executors.local import LocalExecutor
from overbrainer_prefect.runs.metrics import Metric, MetricsSummary
from overbrainer_prefect.runs.store import RunRecord, Runs, RunState
from overbrainer_prefect.steps import end as end_step
from overbrainer_prefect.steps import follow
from overbrainer_prefect.steps import start as start_step
from overbrainer_prefect.steps.context import Outcome, RunContext
from overbrainer_prefect.steps.errors import NotRetrieved
from tests.shelljobs import WRITE_METRICS, WRITE_OUTPUT, ShellTrainer, wait_for


class Collected:
    """A reporter that keeps what it is told."""

    def __init__(self) -> None:
        self.metrics: list[Metric] = []
        self.statuses: list[JobStatus] = []
        self.warnings: list[str] = []

    def metric(self, metric: Metric, summary: MetricsSummary) -> None:
        self.metrics.append(metric)

    def status(self, status: JobStatus) -> None:
        self.statuses.append(status)

    def warning(self, message: str) -> None:
        self.warnings.append(message)


def context(tmp_path: Path, **changes: object) -> RunContext:
    ctx = RunContext(
        runs=Runs(tmp_path / "runs"),
        executor=LocalExecutor(tmp_path / "target", name="box"),
        reporter=Collected(),
        python=sys.executable,
        poll_s=0.1,
    )
    for name, value in changes.items():
        setattr(ctx, name, value)
    return ctx


async def started(ctx: RunContext, trainer: ShellTrainer) -> RunRecord:
    record = start_step.create(
        ctx.runs, target="box", target_kind="local", workdir=ctx.executor.workdir
    )
    return await start_step.start(ctx, trainer, record)


def run_job(tmp_path: Path, script: str, **changes: object) -> Outcome:
    async def go() -> Outcome:
        ctx = context(tmp_path, **changes)
        trainer = ShellTrainer(script)
        return await follow.watch(ctx, trainer, await started(ctx, trainer))

    return asyncio.run(go())


def test_outcomes_follow_the_exit_code_and_the_metrics() -> None:
    summary = MetricsSummary()
    state, message = follow.outcome(JobStatus.exited(0), summary, "runs/r1")
    assert state == RunState.FAILED
    assert message is not None and "plugin was not loaded" in message
    summary.add('{"event": "begin", "time": 1}')
    assert follow.outcome(JobStatus.exited(0), summary, "runs/r1") == (RunState.SUCCEEDED, None)
    assert follow.outcome(JobStatus.exited(2), summary, "runs/r1") == (
        RunState.FAILED,
        "the job exited with code 2 (see runs/r1/job.log)",
    )
    assert follow.outcome(JobStatus.cancelled(), summary, "runs/r1") == (
        RunState.CANCELLED,
        None,
    )
    assert follow.outcome(JobStatus.lost(), summary, "runs/r1")[0] == RunState.FAILED
    summary.add('{"event": "end", "stopped": true, "checkpoint": "output/checkpoint-2"}')
    assert follow.outcome(JobStatus.exited(0), summary, "runs/r1") == (RunState.STOPPED, None)


def test_a_job_with_metrics_and_output_succeeds_with_every_file_verified(tmp_path: Path) -> None:
    outcome = run_job(tmp_path, f"{WRITE_METRICS}; {WRITE_OUTPUT}; echo done")
    record = outcome.record
    assert record.state == RunState.SUCCEEDED and outcome.retrieved
    assert [f.path for f in outcome.files] == [
        JOB_LOG,
        "metrics.jsonl",
        "output/adapter_model.safetensors",
    ]
    local = Runs(tmp_path / "runs").run_dir(record.id)
    assert (local / "output/adapter_model.safetensors").read_text() == "weights\n"
    assert "done" in (local / JOB_LOG).read_text()
    assert [m.step for m in outcome.summary.metrics] == [1, 2, 3]
    assert outcome.summary.final_loss == pytest.approx(1.3)
    assert Runs(tmp_path / "runs").load(record.id).state == RunState.SUCCEEDED


def test_a_job_that_exits_0_without_metrics_fails_with_the_plugin_message(tmp_path: Path) -> None:
    outcome = run_job(tmp_path, f"{WRITE_OUTPUT}; echo trained")
    assert outcome.record.state == RunState.FAILED
    assert outcome.record.message is not None
    assert "the overbrainer metrics plugin was not loaded" in outcome.record.message
    assert outcome.retrieved


def test_a_failing_job_fails_with_its_exit_code(tmp_path: Path) -> None:
    outcome = run_job(tmp_path, f"{WRITE_METRICS}; exit 3")
    assert outcome.record.state == RunState.FAILED
    local = Runs(tmp_path / "runs").run_dir(outcome.record.id)
    assert outcome.record.message == f"the job exited with code 3 (see {local}/job.log)"


def test_a_success_without_output_is_a_permanent_failure(tmp_path: Path) -> None:
    outcome = run_job(tmp_path, WRITE_METRICS)
    assert outcome.record.state == RunState.FAILED
    assert outcome.record.message is not None and "left no output" in outcome.record.message
    assert outcome.retrieved


def test_a_job_killed_by_someone_else_is_looked_at_again_then_failed_lost(
    tmp_path: Path,
) -> None:
    # its wrapper killed: no exit code; its host still answers the second look
    reporter = Collected()
    outcome = run_job(tmp_path, f"{WRITE_METRICS}; kill -9 $PPID; sleep 1", reporter=reporter)
    assert outcome.record.state == RunState.FAILED
    message = outcome.record.message
    assert message is not None and message.startswith("the job stopped without an exit code")
    assert reporter.statuses[-1] == JobStatus.lost()
    assert reporter.statuses.count(JobStatus.lost()) == 1 and not reporter.warnings


def test_a_job_past_max_hours_is_cancelled_and_the_run_failed(tmp_path: Path) -> None:
    outcome = run_job(tmp_path, f"{WRITE_METRICS}; sleep 60", max_hours=1.0 / 3600)
    assert outcome.record.state == RunState.FAILED
    assert outcome.record.message is not None and "ran past max_hours" in outcome.record.message


def test_a_stalled_job_is_reported_with_its_last_log_lines(tmp_path: Path) -> None:
    reporter = Collected()
    outcome = run_job(
        tmp_path,
        f"echo loading-the-model; {WRITE_METRICS}; sleep 2; {WRITE_OUTPUT}",
        stall_s=0.5,
        reporter=reporter,
    )
    assert outcome.record.state == RunState.SUCCEEDED
    stalls = [w for w in reporter.warnings if "no new metric" in w]
    assert len(stalls) == 1 and "loading-the-model" in stalls[0]


def test_a_missing_different_or_extra_file_leaves_a_success_running(tmp_path: Path) -> None:
    async def go() -> None:
        ctx = context(tmp_path)
        trainer = ShellTrainer(f"{WRITE_METRICS}; {WRITE_OUTPUT}")
        record = await started(ctx, trainer)
        job = record.job
        assert job is not None
        await wait_for(
            lambda: os.path.exists(f"{record.remote_dir}/job.exit"), what="the job's end"
        )
        assert (await ctx.executor.status(job)).kind == "exited"
        local = ctx.runs.run_dir(record.id)
        # an extra local file the target never had
        (local / "output").mkdir(parents=True)
        (local / "output" / "stray.bin").write_text("not from the target")
        with pytest.raises(NotRetrieved, match='"output/stray.bin" is not on the target'):
            await follow.watch(ctx, trainer, record)
        assert ctx.runs.load(record.id).state == RunState.RUNNING
        (local / "output" / "stray.bin").unlink()
        # attach again: everything verifies now
        outcome = await follow.watch(ctx, trainer, ctx.runs.load(record.id))
        assert outcome.record.state == RunState.SUCCEEDED and outcome.retrieved

    asyncio.run(go())


def test_verification_names_a_missing_and_a_different_file(tmp_path: Path) -> None:
    from overbrainer_prefect.executors.base import ExecError
    from overbrainer_prefect.executors.manifest import local_manifest, verify

    remote, local = tmp_path / "remote", tmp_path / "local"
    for root in (remote, local):
        (root / "output").mkdir(parents=True)
        (root / "output" / "a.bin").write_bytes(b"a" * 1000)
    (remote / "output" / "b.bin").write_bytes(b"b")
    manifest = local_manifest(remote, ["output"], [])
    with pytest.raises(ExecError, match='"output/b.bin" is missing locally'):
        verify(local, ["output"], [], manifest)
    (local / "output" / "b.bin").write_bytes(b"B")
    with pytest.raises(ExecError, match='"output/b.bin" differs from the target'):
        verify(local, ["output"], [], manifest)
    (local / "output" / "b.bin").write_bytes(b"b")
    verify(local, ["output"], [], manifest)


def test_cancel_stops_the_job_and_retrieves_what_it_left(tmp_path: Path) -> None:
    async def go() -> None:
        ctx = context(tmp_path)
        trainer = ShellTrainer(f"{WRITE_OUTPUT}; {WRITE_METRICS}; sleep 60 & wait")
        record = await started(ctx, trainer)
        await wait_for(lambda: os.path.exists(f"{record.remote_dir}/metrics.jsonl"), what="metrics")
        record, status, retrieved = await end_step.cancel(ctx, trainer, record)
        assert status == JobStatus.cancelled()
        assert record.state == RunState.CANCELLED and retrieved
        local = ctx.runs.run_dir(record.id)
        assert (local / "output/adapter_model.safetensors").exists()
        assert ctx.runs.load(record.id).state == RunState.CANCELLED

    asyncio.run(go())


def test_a_start_whose_target_cannot_run_the_job_fails_the_run_with_the_reason(
    tmp_path: Path,
) -> None:
    async def go() -> None:
        ctx = context(tmp_path, python=str(tmp_path / "no-venv" / "bin" / "python"))
        trainer = ShellTrainer("true")
        record = start_step.create(
            ctx.runs, target="box", target_kind="local", workdir=ctx.executor.workdir
        )
        with pytest.raises(Exception, match="no-venv"):
            await start_step.start(ctx, trainer, record)
        saved = ctx.runs.load(record.id)
        assert saved.state == RunState.FAILED and saved.job is None
        assert saved.message is not None and "no-venv" in saved.message

    asyncio.run(go())


def test_a_job_whose_run_cannot_be_recorded_is_cancelled(tmp_path: Path) -> None:
    async def go() -> None:
        ctx = context(tmp_path)
        trainer = ShellTrainer("sleep 30")
        record = start_step.create(
            ctx.runs, target="box", target_kind="local", workdir=ctx.executor.workdir
        )
        original_save = ctx.runs.save
        saves = 0

        def failing_save(rec: RunRecord) -> None:
            nonlocal saves
            saves += 1
            if rec.state == RunState.RUNNING:
                raise OSError("disk full")
            original_save(rec)

        ctx.runs.save = failing_save  # type: ignore[method-assign]
        with pytest.raises(OSError, match="disk full"):
            await start_step.start(ctx, trainer, record)
        run_dir = Path(record.remote_dir)
        await wait_for(lambda: (run_dir / "job.cancelled").exists(), what="the cancel")
        job = record.job
        assert job is not None

        async def cancelled() -> bool:
            # the cancel ends with a SIGKILL, which a loaded machine delivers a moment later
            return await ctx.executor.status(job) == JobStatus.cancelled()

        await wait_for(cancelled, what="the job to be cancelled")

    asyncio.run(go())


def test_secrets_reach_the_job_but_no_file_of_the_run(tmp_path: Path) -> None:
    secret = "hf_" + secrets.token_hex(16)

    async def go() -> RunRecord:
        ctx = context(tmp_path)
        trainer = ShellTrainer(
            f'[ "${{#HF_TOKEN}}" -eq {len(secret)} ] || exit 9; {WRITE_METRICS}; {WRITE_OUTPUT}'
        )
        record = start_step.create(
            ctx.runs, target="box", target_kind="local", workdir=ctx.executor.workdir
        )
        record = await start_step.start(ctx, trainer, record, {"HF_TOKEN": SecretStr(secret)})
        return (await follow.watch(ctx, trainer, record)).record

    record = asyncio.run(go())
    assert record.state == RunState.SUCCEEDED, record.message
    for root in (tmp_path / "runs", tmp_path / "target"):
        for path in root.rglob("*"):
            if path.is_file():
                assert secret.encode() not in path.read_bytes(), path
