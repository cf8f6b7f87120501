"""What a flow run that was cancelled or crashed leaves of one of its jobs,
from the job's records alone: the core of the flows' state hooks (the hooks
find the target and log; this ends the job on it)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

from overbrainer_prefect.executors.base import ExecError
from overbrainer_prefect.runs.lock import follow_lock
from overbrainer_prefect.runs.store import RunRecord, Runs, subject
from overbrainer_prefect.steps import end as end_step
from overbrainer_prefect.steps import reporters
from overbrainer_prefect.steps.errors import INTERRUPTED, RunError
from overbrainer_prefect.trainers.base import Trainer

if TYPE_CHECKING:
    from overbrainer_prefect.targets.base import Logger, Target

HOOK_RETRIEVE_S = 120.0  # how long a cancellation hook spends cancelling and retrieving a job
HOOK_GRACE_S = 90.0
"""How long after its flow run was cancelled a job is left to that flow run's
cancellation hook: between the runner killing the flow's process and the hook
taking the run's follow lock, the run is unlocked, and a collect then would take
the job from the hook. A job no hook came for is cancelled by a collect after."""


async def cancel_recorded(
    target: Target,
    store: Runs,
    record: RunRecord,
    holder: str,
    trainer_for: Callable[[RunRecord], Trainer],
    logger: Logger,
) -> None:
    """Ends one job of a cancelled flow run under its follow lock (held as
    `holder`): a job not started has what its target holds deleted and is
    failed; a started one is cancelled, what it left retrieved (bounded by
    HOOK_RETRIEVE_S), its record failed and what it ran on deleted. A job that
    cannot be cancelled cleanly is logged and still ended. Raises RunBusy when
    another live process follows it, and what the target raises."""
    name = subject(record)
    with follow_lock(store, record.id, holder):
        record = store.load(record.id)
        if record.state.ended:
            return
        if record.job is None:
            left = not await target.abandon(store, record, INTERRUPTED)
            end_step.fail(store, record.id, INTERRUPTED)
            logger.warning(
                "%s: interrupted before its job started; %s",
                name,
                "something of it may be left: " + target.detached(store, record)
                if left
                else "nothing of it is left",
            )
            return
        retrieved = False
        try:
            trainer: Trainer | None = trainer_for(record)
        except Exception as error:
            logger.warning("%s: its trainer cannot be rebuilt (%s)", name, error)
            trainer = None
        async with target.reach(store, record) as placed:
            if placed is not None:
                try:
                    if trainer is None:
                        await placed.executor.cancel(record.job)
                    else:
                        ctx = placed.context(store, reporters.LogReporter())
                        _, status, retrieved = await asyncio.wait_for(
                            end_step.cancel(ctx, trainer, record), HOOK_RETRIEVE_S
                        )
                        logger.info("%s: job %s on %s", name, status, placed.description)
                except (ExecError, RunError, TimeoutError) as error:
                    logger.warning("%s: cannot cancel its job cleanly: %s", name, error)
        end_step.fail(store, record.id, "its flow run was cancelled")
        gone = await target.abandon(store, record, "its flow run was cancelled")
        logger.info(
            "%s: its files were %sretrieved; %s",
            name,
            "" if retrieved else "not ",
            "nothing of it is left"
            if gone
            else "something may be left: " + target.detached(store, record),
        )


async def crashed_recorded(target: Target, store: Runs, record: RunRecord, logger: Logger) -> None:
    """One job of a crashed flow run: a started job keeps running (bounded by
    its target) and the log says how to follow it again; one that never
    started has what its target holds deleted and is failed. Raises what the
    target raises."""
    if record.job is not None:
        logger.warning("%s", target.detached(store, record))
        return
    await target.abandon(store, record, INTERRUPTED)
    end_step.fail(store, record.id, INTERRUPTED)
