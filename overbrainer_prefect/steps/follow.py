"""Following a started job to its end: its metrics tailed and published, its
status polled (failures retried within a budget), its deadline and stalls
watched, then its files retrieved and its outcome saved."""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import UTC, datetime

from overbrainer_prefect.executors.base import (
    JOB_LOG,
    ExecError,
    Executor,
    FileDigest,
    JobId,
    JobStatus,
)
from overbrainer_prefect.runs.failure import TAIL_LINES, failure_cause
from overbrainer_prefect.runs.metrics import MetricsSummary
from overbrainer_prefect.runs.store import (
    RunRecord,
    RunState,
    follow_again,
    subject,
)
from overbrainer_prefect.runs.tail import LineStream
from overbrainer_prefect.steps.checkpoints import Checkpointing, Keeper
from overbrainer_prefect.steps.context import Outcome, RunContext
from overbrainer_prefect.steps.errors import NotRetrieved, NotStarted, Unreachable
from overbrainer_prefect.steps.retrieve import recorded, retrieve
from overbrainer_prefect.store.held import check_guarded
from overbrainer_prefect.timestamps import parse_rfc3339, rfc3339
from overbrainer_prefect.trainers.base import (
    Trainer,
)

log = logging.getLogger(__name__)

MAX_FAILURES = 5  # failures in a row to reach the job that a watch retries; a success resets it
RETRIEVE_TRIES = 3  # tries of a retrieval before its files are noted not retrieved
RETRIEVE_PAUSE_S = 1.0  # seconds between two tries: a restarting container's sshd is back by then

LOST_CONFIRM_S = 1.0
"""Seconds before a job found gone without an exit code is looked at again: a
host going down (a pod deleted at its bound) loses its jobs a moment before its
sshd, and the second look, failing to reach it, makes the watch end unreachable
(its target then says why) instead of recording a job lost. Where the sshd
outlives that second (a loaded machine), the target's `host_gone` decides."""
ENDING_POLL_S = 0.25  # seconds between looks at a job that wrote its end event

STALL_LOG_LINES = 20  # lines of job.log shown when a job makes no progress


async def watch(ctx: RunContext, trainer: Trainer, record: RunRecord) -> Outcome:
    """Follows a started run until its job ends, publishing its metrics and status,
    then retrieves its files and saves its outcome.

    A run already ended is not followed again: its outcome comes from its local
    files, and it counts as retrieved only without a `not_retrieved` reason
    and with its job log downloaded.

    Retrieving means taking the target's SHA-256 manifest of the trainer's
    artifacts and the job log, downloading them, and checking that the local
    files are exactly the manifest's. A succeeded job whose files cannot be
    retrieved stays `running` (NotRetrieved is raised: a later attach tries
    again). A failed or cancelled one is saved with the `artifacts not
    retrieved` reason (`not_retrieved`). A succeeded job with nothing in the trainer's required
    entry is a permanent failure, still retrieved.

    Raises NotStarted for a run without a job, Unreachable when the target stays
    unreachable past the retry budget (the job keeps running), NotRetrieved as
    above, and RecordError when the record cannot be saved.
    """
    job = record.job
    if job is None:
        raise NotStarted(record.id)
    where = ctx.runs.where_of(record.id)
    if record.state.ended:
        return recorded(ctx.runs, trainer, record)
    summary = MetricsSummary()
    stream = LineStream(ctx.executor, f"{record.remote_dir}/{trainer.metrics_file}")
    keeper = (
        Keeper(ctx, record, trainer.checkpoint_dir) if isinstance(trainer, Checkpointing) else None
    )
    try:
        status, timed_out = await _follow(ctx, record, job, stream, summary, keeper)
    finally:
        if keeper is not None:
            await keeper.stop()
    cause = None
    if status.kind == "exited" and status.code != 0:
        cause = failure_cause(await job_log_tail(ctx.executor, record.remote_dir, TAIL_LINES))
    state, message = outcome(status, summary, where, cause)
    if timed_out:
        state = RunState.FAILED
        message = (
            f"the job ran past max_hours ({ctx.max_hours:g} h, deadline {record.deadline}) "
            f"and was cancelled (see {where}/{JOB_LOG})"
        )
    succeeded = state in (RunState.SUCCEEDED, RunState.STOPPED)
    try:
        files, no_output = await _retrieve_retried(ctx, trainer, record, succeeded)
    except ExecError as error:
        if succeeded:
            raise NotRetrieved(
                f"{subject(record)} succeeded but its files could not be retrieved ({error}); "
                f"it stays running: retrieve it with {follow_again(record)}"
            ) from None
        record.state = state
        record.message = message
        record.not_retrieved = str(error)
        record.ended = rfc3339()
        ctx.runs.save(record)
        return Outcome(record=record, summary=summary, retrieved=False)
    if no_output:
        state = RunState.FAILED
        message = f"the job succeeded but left no output (see {where}/{JOB_LOG})"
    if state == RunState.STOPPED:
        record.checkpoint = summary.checkpoint
        message = (
            f"stopped at step {summary.end_step} with checkpoint {summary.checkpoint}: "
            f"resume it with the train flow (resume_from={record.id})"
        )
    record.state = state
    record.message = message
    record.not_retrieved = None
    record.ended = rfc3339()
    ctx.runs.save(record)
    return Outcome(record=record, summary=summary, retrieved=True, files=files)


async def _retrieve_retried(
    ctx: RunContext, trainer: Trainer, record: RunRecord, succeeded: bool
) -> tuple[list[FileDigest], bool]:
    """`retrieve`, tried again RETRIEVE_TRIES times in all when the target does
    not answer (a container restarting under its job has its sshd back within
    seconds). Raises the last ExecError."""
    for attempt in range(1, RETRIEVE_TRIES + 1):
        try:
            return await retrieve(
                ctx.executor,
                ctx.python,
                trainer,
                ctx.runs,
                record.id,
                record.remote_dir,
                succeeded,
            )
        except ExecError as error:
            if attempt == RETRIEVE_TRIES:
                raise
            ctx.reporter.warning(
                f"cannot retrieve the files of {subject(record)} "
                f"({attempt}/{RETRIEVE_TRIES}): {error}"
            )
            await asyncio.sleep(max(ctx.poll_s, RETRIEVE_PAUSE_S))
    raise AssertionError("unreachable")


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
    keeper: Keeper | None = None,
) -> tuple[JobStatus, bool]:
    """Reads new metric lines and the job's status until the job ends, then reads
    the rest of the metrics file. Up to MAX_FAILURES failures in a row are
    retried; a success resets the count, and the final drain spends what is left.
    A job found lost is looked at again after LOST_CONFIRM_S; still lost on a
    machine its target says is gone, the watch ends Unreachable. A job past its
    deadline is cancelled. With a `keeper`, each new checkpoint of a running job
    is kept in the run's store beside the loop, and the keep in flight when the
    job ends is waited for. Returns the final status and whether the deadline
    was what ended it. Raises LeaseLost, at its next look, when this task
    lost the run's follow lock."""
    failures = 0
    last: JobStatus | None = None
    deadline = parse_rfc3339(record.deadline) if record.deadline else None
    timed_out = False
    last_progress = time.monotonic()
    stall_reported = False
    lost_once = False
    while True:
        check_guarded(record.id)  # a follower that lost the run stops at once (LeaseLost)
        try:
            seen = len(summary.metrics)
            _publish(ctx, await stream.read(), summary)
            status = await ctx.executor.status(job)
        except ExecError as error:
            failures = _retry(ctx, record, failures, error)
        else:
            failures = 0
            if status.kind == "lost" and not lost_once:
                lost_once = True  # look again: is its host still there?
                await asyncio.sleep(LOST_CONFIRM_S)
                continue
            if status.kind == "lost" and ctx.host_gone is not None and await ctx.host_gone():
                raise Unreachable(
                    f"the machine that ran the job of {subject(record)} is gone under it"
                )
            lost_once = False
            if status != last:
                ctx.reporter.status(status)
                last = status
            if status.is_finished:
                break
            if keeper is not None:
                keeper.poke(summary.metrics[-1].step if summary.metrics else None)
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
        # once the job wrote its end event it is about to exit: look again sooner; a local
        # job's exit file is seen as it appears
        await ctx.executor.wait_exit(
            job, min(ctx.poll_s, ENDING_POLL_S) if summary.ended else ctx.poll_s
        )
    while True:
        check_guarded(record.id)
        before = stream.offset
        try:
            _publish(ctx, await stream.read(), summary)
        except ExecError as error:
            failures = _retry(ctx, record, failures, error)
            await asyncio.sleep(ctx.poll_s)
            continue
        if stream.offset == before:
            if keeper is not None:
                await keeper.finish()
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
