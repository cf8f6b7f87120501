"""Ending a job: cancelling it (what it left retrieved best effort), asking it
to stop with a checkpoint, and failing a record that will not run."""

from __future__ import annotations

import logging

from overbrainer_prefect.executors.base import (
    ExecError,
    JobStatus,
)
from overbrainer_prefect.runs.store import (
    RunRecord,
    Runs,
    RunState,
    subject,
)
from overbrainer_prefect.steps.context import RunContext
from overbrainer_prefect.steps.errors import NotStarted, RunError
from overbrainer_prefect.steps.retrieve import retrieve
from overbrainer_prefect.store.records import CHANGE_TRIES, RecordChanged
from overbrainer_prefect.timestamps import rfc3339
from overbrainer_prefect.trainers.base import (
    STOP_FILE,
    Trainer,
)

log = logging.getLogger(__name__)


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
    record.not_retrieved = None
    record.ended = rfc3339()
    ctx.runs.save(record)
    try:
        await retrieve(
            ctx.executor, ctx.python, trainer, ctx.runs, record.id, record.remote_dir, False
        )
    except ExecError as error:
        ctx.reporter.warning(f"cannot retrieve the files of cancelled {subject(record)}: {error}")
        record.not_retrieved = str(error)
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
    already ended (a record another process changed meanwhile is read again
    and decided again); returns it, or None when it cannot be read or saved
    (logged)."""
    try:
        for _ in range(CHANGE_TRIES):
            record = runs.load(run_id)
            if record.state.ended:
                return record
            record.state = RunState.FAILED
            record.message = message
            record.ended = rfc3339()
            try:
                runs.save(record)
            except RecordChanged:
                continue
            return record
        raise RecordChanged(f"{runs.where_of(run_id)} kept changing while it was failed")
    except Exception as error:  # the caller's own cleanup matters more
        log.warning("cannot record %s as failed: %s", run_id, error)
        return None
