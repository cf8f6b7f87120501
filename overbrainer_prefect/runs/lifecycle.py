"""The steps of a run, whatever its target and its kind of job: create, start,
watch (follow, then retrieve and verify), collect, cancel and stop.

Every step is recorded in `run.json` before it is taken, so a run can be picked
up again by another process from its record alone. Nothing here knows about
Prefect: the flows pass a `Reporter` that publishes what happens.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Protocol

from pydantic import SecretStr, TypeAdapter

from overbrainer_prefect.executors.base import (
    JOB_LOG,
    ExecError,
    Executor,
    FileDigest,
    JobId,
    JobSpec,
    JobStatus,
)
from overbrainer_prefect.executors.manifest import verify
from overbrainer_prefect.runs.failure import TAIL_LINES, failure_cause
from overbrainer_prefect.runs.ids import new_run_id, parse_rfc3339, rfc3339
from overbrainer_prefect.runs.lock import LOCK_FILE
from overbrainer_prefect.runs.metrics import Metric, MetricsSummary
from overbrainer_prefect.runs.records import write_atomic
from overbrainer_prefect.runs.store import (
    RECORD_FILE,
    RunRecord,
    Runs,
    RunState,
    follow_again,
    subject,
)
from overbrainer_prefect.runs.tail import LineStream
from overbrainer_prefect.trainers.base import (
    STOP_FILE,
    JobContext,
    TargetFacts,
    Trainer,
    TrainError,
)
from overbrainer_prefect.trainers.holdout import HOLDOUT_DIR
from overbrainer_prefect.trainers.probe import parse_probe, probe_command

log = logging.getLogger(__name__)

HF_CACHE_DIR = ".hf-cache"
"""Hugging Face cache on the target, under its work directory, shared by its runs."""

MAX_FAILURES = 5  # failures in a row to reach the job that a watch retries; a success resets it

NOT_RETRIEVED = "artifacts not retrieved: "
"""Start of the note added to a run's message when its files could not be retrieved."""

MANIFEST_FILE = "manifest.json"
"""The verified manifest of a run's retrieved files, kept locally."""

LOCAL_ONLY = (
    RECORD_FILE,
    MANIFEST_FILE,
    LOCK_FILE,
    "pod.json",
    ".pod",
    ".ssh",
    "exports",
    "compares",
    "evaluations",
    HOLDOUT_DIR,  # the rows a run keeps out of its training
)
"""Entries of a local run directory that never leave this machine."""

ENDING_POLL_S = 0.25  # seconds between looks at a job that wrote its end event

STALL_LOG_LINES = 20  # lines of job.log shown when a job makes no progress


class RunError(Exception):
    """A step of a run failed. The message is one line saying what happened to
    the run and what to do next."""


class NotStarted(RunError):
    """The run never started a job."""

    def __init__(self, run_id: str) -> None:
        super().__init__(f"run {run_id} has no job: it stopped before the job started")


class NotEnded(RunError):
    """`collect` was asked for a run that has not ended."""

    def __init__(self, run_id: str) -> None:
        super().__init__(
            f"run {run_id} has not ended yet: follow it with the attach flow (run_id={run_id})"
        )


class Unreachable(RunError):
    """The target stayed unreachable past the retry budget; the job keeps running."""


class NotRetrieved(RunError):
    """A succeeded job's files could not be retrieved and verified; the run stays
    `running` so a later attach tries again."""


class Reporter(Protocol):
    """Where a run's progress goes (Prefect logs and artifacts, or a test's list)."""

    def metric(self, metric: Metric, summary: MetricsSummary) -> None:
        """A new metric line was read."""
        ...

    def status(self, status: JobStatus) -> None:
        """The job's status changed."""
        ...

    def warning(self, message: str) -> None:
        """Something the user should know (a retry, a stall, a job past its bound)."""
        ...


class LogReporter:
    """A `Reporter` that only logs, for callers with nothing to publish to."""

    def metric(self, metric: Metric, summary: MetricsSummary) -> None:
        """Logs the step and its loss."""
        log.info("step %s/%s loss %s", metric.step, summary.max_steps, metric.loss)

    def status(self, status: JobStatus) -> None:
        """Logs the status."""
        log.info("job %s", status)

    def warning(self, message: str) -> None:
        """Logs the warning."""
        log.warning("%s", message)


class JobReporter:
    """A `Reporter` for a job that is not a training run (an export, a
    compare): its status and warnings in the flow's log, named by `name`."""

    def __init__(self, logger: logging.Logger | logging.LoggerAdapter[Any], name: str) -> None:
        self.logger = logger
        self.name = name

    def metric(self, metric: Metric, summary: MetricsSummary) -> None:
        """Logs a step (a compare's or an evaluation's answer), of how many."""
        of = f"/{summary.max_steps}" if summary.max_steps else ""
        self.logger.info("%s: step %s%s", self.name, metric.step, of)

    def status(self, status: JobStatus) -> None:
        """Logs the job's new status."""
        self.logger.info("%s: job %s", self.name, status)

    def warning(self, message: str) -> None:
        """Logs a warning."""
        self.logger.warning("%s", message)


@dataclass
class RunContext:
    """What the steps of a run share: where runs live, the target, where progress
    goes, and the bounds of a job."""

    runs: Runs
    executor: Executor
    reporter: Reporter = field(default_factory=LogReporter)
    python: str = "python3"
    """The job venv's Python on the target."""
    poll_s: float = 5.0
    """Time between two looks at the job."""
    max_hours: float | None = None
    """How long a job may run before it is cancelled and the run failed."""
    stall_s: float = 900.0
    """How long without a new metric before the job is reported as stalled."""
    check_facts: Callable[[TargetFacts], None] | None = None
    """The target's own check of the probe before the job starts (a pod: the
    GPUs it bills for); raises TrainError."""


@dataclass
class Outcome:
    """How a run ended: its final record, what its metrics add up to, the files
    retrieved, and whether everything the target had was retrieved and verified
    (what decides whether a pod may be deleted without losing anything)."""

    record: RunRecord
    summary: MetricsSummary
    retrieved: bool
    files: list[FileDigest] = field(default_factory=list)


def create(
    runs: Runs,
    *,
    target: str,
    target_kind: str,
    workdir: str,
    trainer: str = "training",
    spec: Mapping[str, Any] | None = None,
    flow_run_id: str | None = None,
    parent: str | None = None,
) -> RunRecord:
    """Creates a run: a new ID and its record saved as `preparing`, with the run
    directory it will have on the target (`workdir/<id>`). For an export or a
    compare, `parent` is the run it belongs to (and `runs` that run's children).

    Raises RecordIoError when the record cannot be saved.
    """
    run_id = new_run_id()
    record = RunRecord(
        id=run_id,
        target=target,
        target_kind=target_kind,
        trainer=trainer,
        created=rfc3339(),
        remote_dir=f"{workdir.rstrip('/')}/{run_id}",
        spec=dict(spec) if spec is not None else None,
        flow_run_id=flow_run_id,
        parent=parent,
    )
    runs.save(record)
    return record


async def probe(executor: Executor, python: str, modules: Sequence[str]) -> TargetFacts:
    """What the job environment on the target has: its GPUs and the versions of
    `modules`. Raises TrainError when the venv cannot run, ExecError when the
    target cannot be reached."""
    result = await executor.run(probe_command(python, modules), timeout=120)
    return parse_probe(python, result)


async def start(
    ctx: RunContext,
    trainer: Trainer,
    record: RunRecord,
    secrets: Mapping[str, SecretStr] | None = None,
) -> RunRecord:
    """Checks the target's job environment, prepares the run's files, copies them
    to the target and starts the job; the record is saved `running` with the job.

    When anything fails before the job started, the record is saved `failed` with
    the reason and the error is raised (TrainError, ExecError). When the job
    started but its record cannot be saved, nothing could find it again: it is
    cancelled, and the save error is raised.
    """
    try:
        job = await _launch(ctx, trainer, record, secrets or {})
    except (TrainError, ExecError, OSError) as error:
        record.state = RunState.FAILED
        record.message = str(error)
        record.ended = rfc3339()
        try:
            ctx.runs.save(record)
        except Exception as save_error:  # the original error matters more
            log.warning("cannot record run %s as failed: %s", record.id, save_error)
        raise
    record.job = job
    record.state = RunState.RUNNING
    record.started = rfc3339()
    if ctx.max_hours is not None:
        record.deadline = rfc3339(datetime.now(UTC) + timedelta(hours=ctx.max_hours))
    try:
        ctx.runs.save(record)
    except Exception:
        try:
            await ctx.executor.cancel(job)
        except ExecError as cancel_error:
            log.warning(
                "cannot cancel the job of run %s, which is not recorded: %s",
                record.id,
                cancel_error,
            )
        raise
    return record


async def _launch(
    ctx: RunContext, trainer: Trainer, record: RunRecord, secrets: Mapping[str, SecretStr]
) -> JobId:
    facts = await probe(ctx.executor, ctx.python, trainer.probe_modules)
    if ctx.check_facts is not None:
        ctx.check_facts(facts)
    trainer.check(facts)
    local = ctx.runs.run_dir(record.id)
    job_ctx = JobContext(
        run_id=record.id,
        run_dir=record.remote_dir,
        cache_dir=f"{ctx.executor.workdir.rstrip('/')}/{HF_CACHE_DIR}",
        facts=facts,
    )
    trainer.prepare(local, job_ctx)
    await ctx.executor.upload(local, record.remote_dir, (*LOCAL_ONLY, ctx.runs.record_file))
    spec = JobSpec(
        run_id=record.id,
        run_dir=record.remote_dir,
        commands=trainer.commands(job_ctx),
        env=trainer.env(job_ctx),
        secrets=dict(secrets),
    )
    return await ctx.executor.spawn(spec)


async def watch(ctx: RunContext, trainer: Trainer, record: RunRecord) -> Outcome:
    """Follows a started run until its job ends, publishing its metrics and status,
    then retrieves its files and saves its outcome.

    A run already ended is not followed again: its outcome comes from its local
    files, and it counts as retrieved only without an `artifacts not retrieved`
    note and with its job log downloaded.

    Retrieving means taking the target's SHA-256 manifest of the trainer's
    artifacts and the job log, downloading them, and checking that the local
    files are exactly the manifest's. A succeeded job whose files cannot be
    retrieved stays `running` (NotRetrieved is raised: a later attach tries
    again). A failed or cancelled one is saved with the `artifacts not
    retrieved:` note. A succeeded job with nothing in the trainer's required
    entry is a permanent failure, still retrieved.

    Raises NotStarted for a run without a job, Unreachable when the target stays
    unreachable past the retry budget (the job keeps running), NotRetrieved as
    above, and RecordError when the record cannot be saved.
    """
    job = record.job
    if job is None:
        raise NotStarted(record.id)
    local = ctx.runs.run_dir(record.id)
    if record.state.ended:
        return recorded(ctx.runs, trainer, record)
    summary = MetricsSummary()
    stream = LineStream(ctx.executor, f"{record.remote_dir}/{trainer.metrics_file}")
    status, timed_out = await _follow(ctx, record, job, stream, summary)
    cause = None
    if status.kind == "exited" and status.code != 0:
        cause = failure_cause(await job_log_tail(ctx.executor, record.remote_dir, TAIL_LINES))
    state, message = outcome(status, summary, str(local), cause)
    if timed_out:
        state = RunState.FAILED
        message = (
            f"the job ran past max_hours ({ctx.max_hours:g} h, deadline {record.deadline}) "
            f"and was cancelled (see {local}/{JOB_LOG})"
        )
    succeeded = state in (RunState.SUCCEEDED, RunState.STOPPED)
    try:
        files, no_output = await retrieve(
            ctx.executor, trainer, record.remote_dir, local, succeeded
        )
    except ExecError as error:
        if succeeded:
            raise NotRetrieved(
                f"{subject(record)} succeeded but its files could not be retrieved ({error}); "
                f"it stays running: retrieve it with {follow_again(record)}"
            ) from None
        record.state = state
        record.message = not_retrieved(message, error)
        record.ended = rfc3339()
        ctx.runs.save(record)
        return Outcome(record=record, summary=summary, retrieved=False)
    if no_output:
        state = RunState.FAILED
        message = f"the job succeeded but left no output (see {local}/{JOB_LOG})"
    if state == RunState.STOPPED:
        record.checkpoint = summary.checkpoint
        message = (
            f"stopped at step {summary.end_step} with checkpoint {summary.checkpoint}: "
            f"resume it with the train flow (resume_from={record.id})"
        )
    record.state = state
    record.message = message
    record.ended = rfc3339()
    ctx.runs.save(record)
    return Outcome(record=record, summary=summary, retrieved=True, files=files)


def outcome(
    status: JobStatus, summary: MetricsSummary, where: str, cause: str | None = None
) -> tuple[RunState, str | None]:
    """The final state of a run whose job ended with `status`, and its message
    (which names its job log under `where`, the run's local directory).

    Exit 0 with metrics succeeded (or stopped, when the job stopped on request
    and saved a checkpoint); exit 0 without metrics failed, since the metrics
    plugin was not loaded; another exit code failed with that code and `cause`
    (what its job log says went wrong, see `failure_cause`); a cancelled job is
    cancelled; a job gone without an exit code failed.
    """
    see = f"see {where}/{JOB_LOG}"
    if status.kind == "exited" and status.code == 0:
        if summary.lines == 0:
            return RunState.FAILED, (
                f"the job wrote no metrics: the overbrainer metrics plugin was not loaded ({see})"
            )
        if summary.stopped and summary.checkpoint:
            return RunState.STOPPED, None
        return RunState.SUCCEEDED, None
    if status.kind == "exited":
        why = f": {cause}" if cause else ""
        return RunState.FAILED, f"the job exited with code {status.code}{why} ({see})"
    if status.kind == "cancelled":
        return RunState.CANCELLED, None
    return RunState.FAILED, f"the job stopped without an exit code ({see})"


async def _follow(
    ctx: RunContext,
    record: RunRecord,
    job: JobId,
    stream: LineStream,
    summary: MetricsSummary,
) -> tuple[JobStatus, bool]:
    """Reads new metric lines and the job's status until the job ends, then reads
    the rest of the metrics file. Up to MAX_FAILURES failures in a row are
    retried; a success resets the count, and the final drain spends what is left.
    A job past its deadline is cancelled. Returns the final status and whether
    the deadline was what ended it."""
    failures = 0
    last: JobStatus | None = None
    deadline = parse_rfc3339(record.deadline) if record.deadline else None
    timed_out = False
    last_progress = time.monotonic()
    stall_reported = False
    while True:
        try:
            seen = len(summary.metrics)
            _publish(ctx, await stream.read(), summary)
            status = await ctx.executor.status(job)
        except ExecError as error:
            failures = _retry(ctx, record, failures, error)
        else:
            failures = 0
            if status != last:
                ctx.reporter.status(status)
                last = status
            if status.is_finished:
                break
            if len(summary.metrics) > seen:
                last_progress, stall_reported = time.monotonic(), False
            elif not stall_reported and time.monotonic() - last_progress > ctx.stall_s:
                stall_reported = True
                await _report_stall(ctx, record)
            if deadline is not None and datetime.now(UTC) >= deadline:
                ctx.reporter.warning(
                    f"{subject(record)} ran past max_hours ({ctx.max_hours:g} h): "
                    "cancelling its job"
                )
                try:
                    await ctx.executor.cancel(job)
                except ExecError as error:
                    failures = _retry(ctx, record, failures, error)
                timed_out = True
        # once the job wrote its end event it is about to exit: look again sooner
        await asyncio.sleep(min(ctx.poll_s, ENDING_POLL_S) if summary.ended else ctx.poll_s)
    while True:
        before = stream.offset
        try:
            _publish(ctx, await stream.read(), summary)
        except ExecError as error:
            failures = _retry(ctx, record, failures, error)
            await asyncio.sleep(ctx.poll_s)
            continue
        if stream.offset == before:
            return status, timed_out and status.kind == "cancelled"


def _retry(ctx: RunContext, record: RunRecord, failures: int, error: ExecError) -> int:
    """Counts one more failure in a row to reach the job; past the budget, gives
    up with a message saying the job keeps running and how to follow it again."""
    if failures >= MAX_FAILURES:
        raise Unreachable(
            f"cannot reach the job of {subject(record)} on {ctx.executor.description} after "
            f"{MAX_FAILURES + 1} tries ({error}); the job keeps running there: follow it again "
            f"with {follow_again(record)}"
        ) from None
    ctx.reporter.warning(f"cannot reach the job ({failures + 1}/{MAX_FAILURES}): {error}")
    return failures + 1


def _publish(ctx: RunContext, lines: list[str], summary: MetricsSummary) -> None:
    for line in lines:
        metric = summary.add(line)
        if metric is not None:
            ctx.reporter.metric(metric, summary)


async def _report_stall(ctx: RunContext, record: RunRecord) -> None:
    tail = await job_log_tail(ctx.executor, record.remote_dir)
    ctx.reporter.warning(
        f"{subject(record)} has written no new metric for {ctx.stall_s:g} s; "
        f"the last lines of its job log:\n{tail}"
    )


async def job_log_tail(executor: Executor, remote_dir: str, lines: int = STALL_LOG_LINES) -> str:
    """The last `lines` lines of a job's log on the target (empty when it cannot
    be read)."""
    path = f"{remote_dir}/{JOB_LOG}"
    try:
        result = await executor.run(["tail", "-n", str(lines), path], timeout=30)
    except ExecError:
        return ""
    return result.stdout.rstrip()


async def retrieve(
    executor: Executor, trainer: Trainer, remote: str, local: Path, succeeded: bool
) -> tuple[list[FileDigest], bool]:
    """Copies the trainer's artifacts and the job log from `remote` into `local`,
    then checks that the local files are exactly the target's SHA-256 manifest:
    none missing, none different, none extra. Returns the manifest and, for a
    succeeded job, whether its required entry held no file at all.

    Raises ExecError when the target fails or a file does not verify.
    """
    artifacts = trainer.artifacts()
    entries = [*artifacts.entries, JOB_LOG]
    manifest = await executor.manifest(remote, entries, artifacts.exclude)
    required = artifacts.required
    no_output = (
        succeeded
        and required is not None
        and not any(f.path == required or f.path.startswith(f"{required}/") for f in manifest)
    )
    await executor.download(remote, local, entries, artifacts.exclude)
    await asyncio.to_thread(verify, local, entries, artifacts.exclude, manifest)
    write_atomic(local, MANIFEST_FILE, _MANIFEST.dump_json(manifest, indent=2) + b"\n")
    return manifest, no_output


_MANIFEST = TypeAdapter(list[FileDigest])


def load_manifest(local: Path) -> list[FileDigest]:
    """The verified manifest saved by the last retrieval into the run directory
    `local` (empty when there was none or it cannot be read)."""
    try:
        return _MANIFEST.validate_json((local / MANIFEST_FILE).read_bytes())
    except (OSError, ValueError):
        return []


def not_retrieved(message: str | None, error: Exception) -> str:
    """`message` with the reason the files could not be retrieved added to it."""
    if message:
        return f"{message} ({NOT_RETRIEVED}{error})"
    return f"{NOT_RETRIEVED}{error}"


def artifacts_missing(record: RunRecord) -> bool:
    """Whether the record of an ended run says its files were not retrieved."""
    return record.message is not None and NOT_RETRIEVED in record.message


def without_note(message: str | None) -> str | None:
    """`message` without the note `not_retrieved` added to it."""
    if message is None or message.startswith(NOT_RETRIEVED):
        return None
    index = message.find(f" ({NOT_RETRIEVED}")
    return message if index < 0 else message[:index]


async def collect(ctx: RunContext, trainer: Trainer, record: RunRecord) -> tuple[RunRecord, bool]:
    """Retrieves again the files of an ended run whose target still holds them;
    on success removes the `artifacts not retrieved` note. A failure is reported
    as a warning and leaves the record as it was. Returns the record and whether
    its files were retrieved.

    Raises NotEnded for a run still preparing or running.
    """
    if not record.state.ended:
        raise NotEnded(record.id)
    local = ctx.runs.run_dir(record.id)
    succeeded = record.state in (RunState.SUCCEEDED, RunState.STOPPED)
    try:
        await retrieve(ctx.executor, trainer, record.remote_dir, local, succeeded)
    except ExecError as error:
        ctx.reporter.warning(f"cannot retrieve the files of {subject(record)}: {error}")
        return record, False
    if artifacts_missing(record):
        record.message = without_note(record.message)
        ctx.runs.save(record)
    return record, True


async def cancel(
    ctx: RunContext, trainer: Trainer, record: RunRecord
) -> tuple[RunRecord, JobStatus, bool]:
    """Cancels the job of a started run, then reads its status back.

    Only when the job reads `cancelled` is the record changed: saved
    `cancelled`, then its files retrieved and verified best effort (a failure is
    noted in its message). A job that had already ended is left alone and the
    record returned unchanged, so a later attach records its real outcome.
    Returns the record, the job's status and whether the files were retrieved.

    Raises NotStarted for a run without a job, ExecError when the target cannot
    be reached, RecordError when the record cannot be saved.
    """
    if record.job is None:
        raise NotStarted(record.id)
    await ctx.executor.cancel(record.job)
    status = await ctx.executor.status(record.job)
    if status.kind != "cancelled":
        return record, status, False
    record.state = RunState.CANCELLED
    record.message = None
    record.ended = rfc3339()
    ctx.runs.save(record)
    local = ctx.runs.run_dir(record.id)
    try:
        await retrieve(ctx.executor, trainer, record.remote_dir, local, False)
    except ExecError as error:
        ctx.reporter.warning(f"cannot retrieve the files of cancelled {subject(record)}: {error}")
        record.message = not_retrieved(None, error)
        try:
            ctx.runs.save(record)
        except Exception as save_error:
            log.warning("cannot note the missing files of run %s: %s", record.id, save_error)
        return record, status, False
    return record, status, True


async def request_stop(ctx: RunContext, record: RunRecord) -> None:
    """Asks the job of a running run to save a resumable checkpoint and stop, by
    creating its stop request file on the target.

    Raises NotStarted for a run without a job, RunError for a run that has
    ended, ExecError when the target cannot be reached.
    """
    if record.job is None:
        raise NotStarted(record.id)
    if record.state.ended:
        raise RunError(f"{subject(record)} has already ended ({record.state}): nothing to stop")
    await ctx.executor.touch(f"{record.remote_dir}/{STOP_FILE}")


def fail(runs: Runs, run_id: str, message: str) -> RunRecord | None:
    """Saves the record `run_id` of `runs` failed with `message` unless it
    already ended; returns it, or None when it cannot be read or saved (logged)."""
    try:
        record = runs.load(run_id)
        if not record.state.ended:
            record.state = RunState.FAILED
            record.message = message
            record.ended = rfc3339()
            runs.save(record)
        return record
    except Exception as error:  # the caller's own cleanup matters more
        log.warning("cannot record %s as failed: %s", run_id, error)
        return None


def has_job_log(runs: Runs, record: RunRecord) -> bool:
    """Whether the job log of `record` was retrieved into its local directory."""
    return (runs.run_dir(record.id) / JOB_LOG).is_file()


def recorded(runs: Runs, trainer: Trainer, record: RunRecord) -> Outcome:
    """The outcome of an ended job from its local files alone (what it ran on
    is gone, or it was never started): its metrics, and its verified files
    when they were retrieved."""
    local = runs.run_dir(record.id)
    summary = _local_summary(local / trainer.metrics_file)
    retrieved = (
        record.job is not None and not artifacts_missing(record) and (local / JOB_LOG).is_file()
    )
    files = load_manifest(local) if retrieved else []
    return Outcome(record=record, summary=summary, retrieved=retrieved, files=files)


def _local_summary(path: Path) -> MetricsSummary:
    try:
        return MetricsSummary.of_text(path.read_text(encoding="utf-8", errors="replace"))
    except FileNotFoundError:
        return MetricsSummary()
