"""The collector: finishes the runs whose follower is gone.

While a run trains, its follower (the `train` flow run that started it, or an
`attach`) holds the run's follow lock. When the follower dies without a trace
(its worker was killed, the machine rebooted), no hook runs: the job keeps
running on its target, bounded by its max_hours, and its record says
`running` with nobody following it. The `collect` flow, scheduled every few
minutes, finds those runs and finishes them: it follows each job to its end
(at once when it has already ended), retrieves and verifies its files, and
records the outcome. A run whose flow run was cancelled while nothing could
run its cancellation hook has its job cancelled instead, once the hook had
`HOOK_GRACE_S` to do it.

A run is never followed by two processes: the collector takes the run's lock
before it touches the run and leaves alone any run another live process holds.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Container

import anyio.from_thread
import anyio.to_thread
from prefect import flow, get_run_logger
from prefect.artifacts import acreate_markdown_artifact

from overbrainer_prefect.artifacts import publish_metrics_table, publish_summary, summary_markdown
from overbrainer_prefect.blocks import TargetGone, UnknownTarget, target_named
from overbrainer_prefect.budget_leases import LEASES_FILE, handed_over, release, renewed
from overbrainer_prefect.driver import follow_again
from overbrainer_prefect.executors.base import ExecError
from overbrainer_prefect.flowruns import (
    CANCELLING,
    LEFT_BEHIND,
    cancelled_at,
    resume,
    settle_flow_run,
)
from overbrainer_prefect.kinds.base import Finished
from overbrainer_prefect.kinds.collected import Collected, collected_markdown, state_now
from overbrainer_prefect.kinds.live import collectable, unfollowed_of
from overbrainer_prefect.kinds.registry import kind_of
from overbrainer_prefect.kinds.training import next_step
from overbrainer_prefect.runs.lock import RunBusy
from overbrainer_prefect.runs.store import (
    RunRecord,
    Runs,
    RunsError,
    RunState,
    subject,
)
from overbrainer_prefect.runs_dir import runs_at
from overbrainer_prefect.steps.context import COLLECTOR, ENDED_BY
from overbrainer_prefect.steps.errors import RunError, TargetError
from overbrainer_prefect.steps.hooks import HOOK_GRACE_S
from overbrainer_prefect.store.records import RecordChanged, RecordError
from overbrainer_prefect.suspension import kept_suspended, waited_for, waited_in_pipeline
from overbrainer_prefect.targets.base import Logger, Target
from overbrainer_prefect.targets.sharing import shared
from overbrainer_prefect.targets.spend import spent
from overbrainer_prefect.timestamps import parse_rfc3339

COLLECT_ARTIFACT = "collected-runs"
"""Key of the markdown artifact in which each collect says what it did."""

CHANGE_ROUNDS = 5  # rounds a job's records are read again after another process changed them
CREATE_GRACE_S = 10.0  # a record this young and unlocked may still be taking its creator's lock


def _age_s(record: RunRecord) -> float:
    try:
        return time.time() - parse_rfc3339(record.created).timestamp()
    except ValueError:
        return float("inf")


async def candidates(
    runs: Runs,
    *,
    following: Container[str] = frozenset(),
    followed: list[str] | None = None,
) -> list[tuple[Runs, RunRecord, Target | None]]:
    """The jobs the collector has something to do with, each with its store and
    target (None when its target block is gone): every job not ended that no
    live process follows (the follow lock decides, never a flow run's state),
    and every ended job whose target still holds something for it (a pod not
    deleted). Runs first, oldest first.

    Only the records the live index names are read (runs/live.py), never the
    history: one listing, then each live job's lock, then its record when
    nobody follows it; `following` names the jobs (`store.key(id)`) the
    caller follows itself, which are not read at all. A job found final and
    holding nothing leaves the index; a runs directory without one has it
    built first. Each job not ended that another live process follows is
    said in `followed` (who, until when). Every store call runs in a worker
    thread."""
    logger = get_run_logger()
    targets: dict[str, Target | None] = {}
    gone: set[str] = set()  # target blocks no longer saved: nothing can end what they left

    async def target_of(store: Runs, record: RunRecord) -> Target | None:
        if record.target not in targets:
            try:
                targets[record.target] = await target_named(record.target, logger)
            except Exception as error:  # one bad block must not stop the others
                logger.warning("target %s of %s: %s", record.target, subject(record), error)
                targets[record.target] = None
                if isinstance(error, TargetGone):
                    gone.add(record.target)
        return targets[record.target]

    def holds(store: Runs, record: RunRecord, target: Target | None) -> bool:
        if target is None:  # whether it holds something cannot be told, unless its block is gone
            return record.target not in gone
        return target.holds(store, record)

    def live(store: Runs, record: RunRecord) -> bool:  # asked from a worker thread of anyio's
        if not record.state.ended:
            return True
        return holds(store, record, anyio.from_thread.run(target_of, store, record))

    entries = await asyncio.to_thread(runs.live)
    if entries is None:
        marked = await anyio.to_thread.run_sync(runs.build_live, live)
        logger.info("indexed the live jobs of %s once: %d live", runs.where, marked)
        entries = await asyncio.to_thread(runs.live) or []
    unfollowed = await asyncio.to_thread(unfollowed_of, entries, following, followed)
    for store, record in unfollowed:
        await target_of(store, record)
    return await asyncio.to_thread(collectable, unfollowed, targets, holds, logger)


async def collect_job(
    runs: Runs,
    store: Runs,
    record: RunRecord,
    target: Target | None = None,
    logger: Logger | None = None,
) -> Collected | None:
    """Takes the follow lock of a job nobody follows and brings it to a final
    state (see `driver.finish`): a job never started has what its target holds
    deleted and is failed; a running one is followed to its end (its job
    cancelled when its flow run was cancelled, once its cancellation hook had
    HOOK_GRACE_S to do it); an ended one whose target still
    holds something has its files retrieved again when they were not, then
    what it ran on ended. Its dead flow run is settled. Returns what was done,
    or None when there was nothing to do (another process took it, or it is
    too young to be abandoned). A flow run that waits suspended for the job is
    resumed once it is final; `logger` is where the job's lines go."""
    logger = logger or get_run_logger()
    name = subject(record)
    was = record.state
    kind = "run" if kind_of(record).progress else name
    row = Collected(
        run_id=record.id, target=record.target, was=was, action="", state=was, kind=kind
    )
    if record.job is None and not record.state.ended and _age_s(record) < CREATE_GRACE_S:
        return None  # its creator may not hold its lock yet
    since = await cancelled_at(record.flow_run_id)
    cancel = since is not None
    hooked = not waited_for(store, record)  # a suspended flow run has no process to run hooks
    grace = HOOK_GRACE_S if hooked else 0.0
    if since is not None and time.time() - since < grace and not record.state.ended:
        logger.info("%s: its flow run was just cancelled: left to its cancellation hook", name)
        return None
    try:
        finished = await _brought_to_end(runs, store, record, logger, cancel, target)
    except RunError as error:
        if "already followed" in str(error):
            return None
        return _left(row, store, record, error)
    except RunBusy:
        return None
    except (UnknownTarget, ExecError, RecordError, RunsError, TargetError) as error:
        return _left(row, store, record, error)
    outcome = finished.outcome
    ended = outcome.record
    if kind_of(ended).progress and ended.job is not None:
        await publish_metrics_table(ended.id, outcome.summary)
        await publish_summary(
            ended.id,
            summary_markdown(
                ended,
                finished.where,
                outcome.summary,
                outcome.files,
                next_step(ended),
                spent(store, ended),  # what its place cost (issue 20)
            ),
        )
    files = f"{len(outcome.files)} files " + ("verified" if outcome.retrieved else "not retrieved")
    logger.info("%s %s: %s", name, ended.state, files)
    # a flow run that waited suspended is resumed, not settled (one resumed before its job's
    # end runs again), unless it was cancelled meanwhile
    await settle_flow_run(
        ended, f"{ended.state}, {files}", left=LEFT_BEHIND if hooked else CANCELLING
    )
    if ended.state.ended:
        await resume(ended, logger)
    if ended.job is None:
        action = f"failed: {ended.message}"
    elif finished.cancelled:
        action = "job cancelled"
    elif was.ended:
        action = "ended what it ran on"
    else:
        action = "followed to its end"
    return row.model_copy(
        update={
            "action": action,
            "state": ended.state,
            "retrieved": outcome.retrieved,
            "files": len(outcome.files),
            "message": ended.message,
        }
    )


async def _brought_to_end(
    runs: Runs,
    store: Runs,
    record: RunRecord,
    logger: Logger,
    cancel: bool,
    target: Target | None,
) -> Finished:
    """Brings the job `record` to its final state (`_follow_for_its_flow_run`),
    saying first what it does. A record another process changed meanwhile (a
    compare-and-swap lost: a pod's reaper recorded its delete, a write whose
    answer was lost landed) is read again and decided again from what it says
    now, up to CHANGE_ROUNDS times, as `update_record` does.

    Raises what `_follow_for_its_flow_run` raises; RecordChanged when the
    records kept changing for every round."""
    name = subject(record)
    for round_ in range(CHANGE_ROUNDS):
        if record.job is None and not record.state.ended:
            logger.info("%s never started its job and nobody prepares it: abandoning it", name)
        elif not record.state.ended:
            logger.info(
                "%s is %s and nobody follows it: %s",
                name,
                record.state,
                "its flow run was cancelled, so its job is cancelled"
                if cancel
                else "following its job to its end",
            )
        else:
            logger.info(
                "%s is %s, but its target still holds something: ending it", name, record.state
            )
        try:
            return await _follow_for_its_flow_run(runs, store, record, logger, cancel, target)
        except RecordChanged as changed:
            if round_ + 1 == CHANGE_ROUNDS:
                raise
            logger.info("%s: %s; reading it again", name, changed)
            record = store.load(record.id)
    raise AssertionError("unreachable: the last round returns or raises")


async def _follow_for_its_flow_run(
    runs: Runs,
    store: Runs,
    record: RunRecord,
    logger: Logger,
    cancel: bool,
    target: Target | None,
) -> Finished:
    """`follow_again`, holding what the job's suspended flow run handed over:
    its pod's GPU budget slots (their leases renewed while it is followed,
    released once it ended) and, for the training of a pipeline, its pod,
    which stays up for the pipeline's next job once the training succeeded
    (its watchdog's next_job_grace bounds it), as it would have, had the
    pipeline followed it; its pause kept from timing out while it runs."""
    leases = handed_over(store, record.id)
    async with renewed(leases, logger, at_once=True), kept_suspended(store, record, logger):
        if cancel or not waited_in_pipeline(store, record):
            finished = await follow_again(runs, store, record, logger, cancel=cancel, target=target)
        else:
            async with shared() as sharing:
                finished = await follow_again(runs, store, record, logger, target=target)
                sharing.handed_over = finished.outcome.record.state == RunState.SUCCEEDED
    if leases and finished.outcome.record.state.ended:
        await release(leases, logger)
        store.remove(record.id, LEASES_FILE)
    return finished


def _left(row: Collected, store: Runs, record: RunRecord, error: Exception) -> Collected:
    get_run_logger().warning("%s: cannot finish it: %s", subject(record), error)
    return row.model_copy(
        update={
            "action": "left as it was",
            "state": state_now(store, record),
            "message": str(error),
        }
    )


@flow(name="collect", persist_result=True)
async def collect(runs_dir: str | None = None) -> list[Collected]:
    """Brings every job whose follower is gone to a final state, in one run:
    a job still running that no live process follows is followed to its end
    and its files retrieved and verified (its job cancelled instead when its
    flow run was cancelled); a job that never started and that nobody
    prepares has what its target holds (its pod) deleted and is failed; an
    ended job whose pod is still there has its files retrieved (when they were
    not) and its pod deleted. Each job's dead flow run is settled. Jobs another
    process follows are left alone. What it deletes is recorded deleted by
    the `collector`. Publishes what it did as the `collected-runs` artifact
    and returns it.

    Raises RecordIoError when the runs directory cannot be read, and, once every
    other job is done, the first unexpected error one of them met.
    """
    runs = await runs_at(runs_dir)
    followed: list[str] = []
    found = await candidates(runs, followed=followed)
    acting = ENDED_BY.set(COLLECTOR)  # the jobs' tasks below copy it: pods say who deleted them
    try:
        results = await asyncio.gather(
            *(collect_job(runs, store, record, target) for store, record, target in found),
            return_exceptions=True,
        )
    finally:
        ENDED_BY.reset(acting)
    rows: list[Collected] = []
    errors: list[BaseException] = []
    for (store, record, _), result in zip(found, results, strict=True):
        if isinstance(result, BaseException):
            errors.append(result)
            rows.append(
                Collected(
                    run_id=record.id,
                    target=record.target,
                    was=record.state,
                    action="failed to collect",
                    state=state_now(store, record),
                    message=f"{type(result).__name__}: {result}",
                )
            )
        elif result is not None:
            rows.append(result)
    await acreate_markdown_artifact(
        markdown=collected_markdown(rows, runs.where, followed),
        key=COLLECT_ARTIFACT,
        description="What the last collect did",
    )
    get_run_logger().info(
        "collected %d run(s) in %s%s%s",
        len(rows),
        runs.where,
        "".join(f"; {r.run_id}: {r.action}, {r.state}" for r in rows),
        "".join(f"; {line}" for line in followed),
    )
    if errors:
        raise errors[0]
    return rows
