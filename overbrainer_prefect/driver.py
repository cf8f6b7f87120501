"""The one job driver: every kind of job (a run's training, its export, a base
model's export, a compare) goes through the same steps on any `Target`:

1. check and reserve what the job needs before anything exists;
2. create its record (`preparing`) and take its follow lock at once;
3. place it (a pod provisioned for it), start its job, follow it, retrieve
   and verify its files, end what it ran on by the outcome.

The same code follows a job again from its record alone (`follow_again`:
attach, `export(export_id=...)`, `compare(compare_id=...)`, the collector),
and ends it when its flow run is cancelled or crashes (one hook of each,
shared by every flow). The flow modules keep only what their kind adds.
Nothing here asks which target it holds.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from functools import partial
from typing import Any
from uuid import UUID

from prefect import task
from prefect.artifacts import acreate_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
from prefect.client.schemas.objects import FlowRun, State
from prefect.flows import Flow
from prefect.logging.loggers import flow_run_logger
from prefect.runtime import flow_run
from prefect.states import Cancelled, Crashed

from overbrainer_prefect import suspension
from overbrainer_prefect.artifacts import (
    PrefectReporter,
    artifact_key,
    live_artifacts_of,
    live_progress,
)
from overbrainer_prefect.blocks import target_named
from overbrainer_prefect.flowruns import resume
from overbrainer_prefect.kinds.base import Finished, NewJob
from overbrainer_prefect.kinds.listing import unfinished_of
from overbrainer_prefect.kinds.registry import kind_of, recorded_end, trainer_of
from overbrainer_prefect.runs.lock import RunBusy, follow_lock, is_followed, lost_line
from overbrainer_prefect.runs.metrics import MetricsSummary
from overbrainer_prefect.runs.store import RunRecord, Runs, RunState, subject
from overbrainer_prefect.server_budget import PrefectBudget
from overbrainer_prefect.steps import end as end_step
from overbrainer_prefect.steps import follow, retrieve
from overbrainer_prefect.steps import start as start_step
from overbrainer_prefect.steps.context import Outcome, RunContext
from overbrainer_prefect.steps.errors import INTERRUPTED, RunError, failure_reason
from overbrainer_prefect.steps.hooks import cancel_recorded, crashed_recorded
from overbrainer_prefect.steps.reporters import JobReporter, Reporter
from overbrainer_prefect.store import LeaseLost
from overbrainer_prefect.store.held import check_guarded
from overbrainer_prefect.targets.base import Logger, Placed, Reservation, Target
from overbrainer_prefect.trainers.base import Trainer

MAX_DEPTH = 3  # fine_tune → train → export: the deepest subflows go


def reporter_for(
    record: RunRecord, logger: Logger, placed: Placed | None = None, store: Runs | None = None
) -> Reporter:
    """Where a job's progress goes: a training run's live progress, loss curve
    (with what its pod has cost so far) and log, the job log's warnings that
    matter (the artifacts its suspended flow run opened, when `store` keeps
    them; and when that flow run is a pipeline's, its resume shortly before
    the training's end: `suspension.resume_lead_s`); or another job's status
    in the log."""
    if kind_of(record).progress:
        if placed is None:
            return PrefectReporter(logger, record.id)
        executor, remote = placed.executor, record.remote_dir
        pipeline = store is not None and suspension.waited_in_pipeline(store, record)
        return PrefectReporter(
            logger,
            record.id,
            spend=placed.spend,
            job_log=lambda: follow.job_log_tail(executor, remote),
            artifact_ids=live_artifacts_of(store, record.id) if store is not None else None,
            near_end=partial(resume, record, logger) if pipeline else None,
            near_end_s=suspension.resume_lead_s(),
        )
    return JobReporter(logger, subject(record))


@task(name="start-job", cache_policy=NO_CACHE, persist_result=False)
async def start_job(
    ctx: RunContext, trainer: Trainer, record: RunRecord, target: Target, placed: Placed
) -> RunRecord:
    """Checks the machine, uploads the job's files and starts its job."""
    record = await start_step.start(ctx, trainer, record, dict(target.secrets()))
    placed.started(ctx.runs, record)
    if isinstance(ctx.reporter, (PrefectReporter, JobReporter)):
        ctx.reporter.logger.info(
            "%s: job started on %s (pid %s)%s",
            subject(record),
            placed.description,
            record.job.pid if record.job else "?",
            f", deadline {record.deadline}" if record.deadline else "",
        )
    return record


@dataclass(frozen=True)
class _Taken:
    """What the follow task returns when its follow lock was lost: the flow
    says so in one line, where a task's exception would log a traceback."""

    lost: LeaseLost


@task(name="follow-job", cache_policy=NO_CACHE, persist_result=False)
async def _follow_task(
    placed: Placed, ctx: RunContext, trainer: Trainer, record: RunRecord
) -> Outcome | _Taken:
    try:
        async with live_progress(ctx.reporter):
            outcome = await placed.follow(ctx, trainer, record)
        return _settle_lost(ctx.runs, outcome)
    except LeaseLost as lost:
        return _Taken(lost)


async def follow_job(
    placed: Placed, ctx: RunContext, trainer: Trainer, record: RunRecord
) -> Outcome:
    """Follows the job to its end, retrieves and verifies its files, and ends
    what it ran on by the outcome (a task of the flow run); a job whose
    machine is gone under it has its record failed with why. Raises LeaseLost
    when the job's follow lock was lost on the way (nothing more done)."""
    followed = await _follow_task(placed, ctx, trainer, record)
    if isinstance(followed, _Taken):
        raise followed.lost
    return followed


def _settle_lost(store: Runs, outcome: Outcome) -> Outcome:
    """`outcome`, its record failed with `outcome.lost` when what its job ran
    on is gone (the target says why; the driver writes it)."""
    if outcome.lost is not None:
        failed = end_step.fail(store, outcome.record.id, outcome.lost)
        if failed is not None:
            outcome.record = failed
    return outcome


async def publish_facts(record: RunRecord, facts: list[tuple[str, str]]) -> None:
    """A markdown artifact of what a job's place cost (a pod's GPU, rate,
    uptime, spend and how it ended); nothing for a machine you own."""
    if not facts:
        return
    name = subject(record)
    lines = [f"# Where {name} ran", "", "| | |", "| --- | --- |"]
    lines += [f"| {key} | {value} |" for key, value in facts]
    await acreate_markdown_artifact(
        markdown="\n".join(lines) + "\n",
        key=artifact_key(record.id, "pod"),
        description=f"Where {name} ran and what it cost",
    )


async def run_new(target: Target, job: NewJob, logger: Logger) -> Finished:
    """Runs a new job on `target`: checks and reserves what it needs (the GPU
    budget, waiting while other pods hold it), creates its record and takes
    its follow lock, places it, starts its job, follows it, retrieves and
    verifies its files, then ends what it ran on.

    Raises (one line, nothing created) when the target refuses the job or
    cannot reserve it; (the record failed, nothing left billing) when it
    cannot be placed or its job cannot start; RunError when the job cannot
    be followed to its end (it keeps running: the message says how to follow
    it again). A follow lock lost on the way (another follower took the job)
    stops everything at once, says so in one line, and ends as that follower
    records the job's end.
    """
    store = job.store
    waited = suspension.suspended_job(store, job.kind, job.attempt)
    if waited is not None:  # resumed: its job was started before this flow run suspended
        return await _resumed(target, store, store.load(waited), logger)
    target.check(job.need)
    budget = PrefectBudget()
    async with target.reserve(store, job.need, budget) as reservation:
        record = start_step.create(
            store,
            target=target.ref,
            target_kind=target.kind,
            workdir=posixpath.join(target.workdir, job.subdir) if job.subdir else target.workdir,
            trainer=job.kind,
            spec=job.spec,
            flow_run_id=flow_run.id,
            parent=job.parent,
        )
        with follow_lock(store, record.id, flow_run.id):
            logger.info(
                "%s created on %s (files in %s)",
                subject(record),
                target.ref,
                store.where_of(record.id),
            )
            try:
                trainer = job.prepare(record)
                record = store.load(record.id)
                return await _place_and_follow(
                    target, job, store, record, trainer, reservation, budget, logger
                )
            except LeaseLost as lost:
                logger.warning("%s", lost_line(record.id, lost))
                lost_run = record.id
            except BaseException as error:
                if store.load(record.id).job is None:  # nothing runs: the record says why
                    end_step.fail(store, record.id, failure_reason(error))
                raise
    # another follower took the job: its end is as that follower records it
    bound_s = float(suspension.timeout_s(store.load(lost_run).deadline))
    return Finished(await recorded_end(store, lost_run, bound_s), target.ref)


async def _place_and_follow(
    target: Target,
    job: NewJob,
    store: Runs,
    record: RunRecord,
    trainer: Trainer,
    reservation: Reservation[Any],
    budget: PrefectBudget,
    logger: Logger,
) -> Finished:
    """Places the new job `record`, records where its directory is, starts
    its job, follows it and ends what it ran on; or, once it started, waits
    suspended while the runs directory's follower does (`suspension`)."""
    async with target.place(store, record, reservation) as placed:
        remote_dir = placed.remote_dir(record)
        if remote_dir != record.remote_dir:
            record.remote_dir = remote_dir
            store.save(record)
        ctx = placed.context(store, reporter_for(record, logger, placed))
        try:
            if job.check is not None:
                await job.check(placed.executor)
            record = await start_job(ctx, trainer, record, target, placed)
        finally:
            if job.started is not None:
                job.started(record)
        why = suspension.why_not_suspend(store)
        if why is None:
            await suspension.suspend(
                store,
                record,
                job.kind,
                ctx.reporter,
                placed.deadline(record),
                logger,
                leases=budget.leases if budget.holding else None,
            )
        elif why:
            logger.info("%s: this flow run follows its job itself: %s", subject(record), why)
        outcome = await follow_job(placed, ctx, trainer, record)
        await publish_facts(outcome.record, placed.facts())
        return Finished(outcome, placed.description)


async def _resumed(target: Target, store: Runs, record: RunRecord, logger: Logger) -> Finished:
    """The end of the job `record` this flow run started before it suspended:
    as its follower recorded it; waited for while its follower follows it (it
    resumed this flow run shortly before the job's end), within the job's own
    bound; followed here when nobody follows it and it has not ended."""
    bound_s = float(suspension.timeout_s(record.deadline))
    if is_followed(store, record.id):
        logger.info(
            "%s has not ended yet: its follower resumed this flow run before the end, and "
            "records it",
            subject(record),
        )
        return Finished(await recorded_end(store, record.id, bound_s), target.ref)
    if not record.state.ended:
        logger.info("%s has not ended yet: following it here", subject(record))
        try:
            return await follow_again(store.top, store, record, logger, target=target)
        except RunError:
            if not is_followed(store, record.id):
                raise
            return Finished(await recorded_end(store, record.id, bound_s), target.ref)
    trainer = trainer_of(store.top, record, target.cpu_threads)
    logger.info("%s %s; its follower recorded its end", subject(record), record.state)
    return Finished(retrieve.recorded(store, trainer, record), target.ref)


async def finish(
    target: Target,
    store: Runs,
    record: RunRecord,
    trainer: Trainer,
    logger: Logger,
    *,
    cancel: bool = False,
) -> Finished:
    """Brings a job to a final state from its records alone; the caller holds
    its follow lock and has just read `record`.

    A job that never started has what its target holds for it deleted and is
    failed `interrupted before the job started`. Otherwise what it ran on is
    reached again: a running job is followed to its end (with `cancel`,
    cancelled and what it left retrieved, best effort), an ended one has its
    files retrieved again when they were not; then what it ran on is ended by
    the outcome (a pod is deleted once its files are verified). A job whose
    machine is gone is reported from its local files.

    Raises RunError when the job cannot be followed to its end; what the
    target raises when it cannot be reached now (try again).
    """
    if record.job is None:
        return await _abandoned(target, store, record)
    async with target.reach(store, record) as placed:
        if placed is None:
            if not record.state.ended:
                end_step.fail(store, record.id, target.lost(store, record))
            return Finished(
                retrieve.recorded(store, trainer, store.load(record.id)), "its local files"
            )
        ctx = placed.context(store, reporter_for(record, logger, placed, store))
        cancelled = False
        if record.state == RunState.RUNNING and cancel:
            record, status, retrieved = await end_step.cancel(ctx, trainer, record)
            if status.kind == "cancelled":
                outcome = retrieve.recorded(store, trainer, record)
                outcome.retrieved = retrieved
                await placed.end(outcome)
                cancelled = True
        if cancelled:
            pass
        elif record.state == RunState.RUNNING:
            outcome = await follow_job(placed, ctx, trainer, record)
        else:
            retrieved = True
            if record.not_retrieved is not None or not retrieve.has_job_log(store, record):
                record, retrieved = await retrieve.collect(ctx, trainer, record)
            outcome = retrieve.recorded(store, trainer, record)
            outcome.retrieved = retrieved
            await placed.end(outcome)
        await publish_facts(outcome.record, placed.facts())
        return Finished(outcome, placed.description, cancelled=cancelled)


async def _abandoned(target: Target, store: Runs, record: RunRecord) -> Finished:
    """A job that never started and that nobody prepares: what its target holds
    for it deleted, its record failed `interrupted before the job started`."""
    reason = (record.message or INTERRUPTED) if record.state.ended else INTERRUPTED
    await target.abandon(store, record, reason)
    end_step.fail(store, record.id, reason)
    return Finished(Outcome(store.load(record.id), MetricsSummary(), retrieved=False), target.ref)


async def follow_again(
    runs: Runs,
    store: Runs,
    record: RunRecord,
    logger: Logger,
    *,
    cancel: bool = False,
    target: Target | None = None,
) -> Finished:
    """`finish` under the job's follow lock, its target and trainer found from
    its record: what attach, an export or compare followed again, and the
    collector do. `runs` is the runs directory, `store` the record's own.

    Raises RunError when another live process follows the job (also when
    another took it from this one on the way: said in one line, and nothing
    more done), or it cannot be followed to its end; UnknownTarget when its
    target block is gone. `target` is the record's own, when the caller has
    it already.
    """
    target = target or await target_named(record.target, logger)
    try:
        with follow_lock(store, record.id, flow_run.id):
            record = store.load(record.id)  # as its last follower left it
            # a read slower than the lease (a stalled store) may come back after another
            # follower took the run and ended it: nothing is done or said from it then
            check_guarded(record.id)
            if record.job is None:
                return await _abandoned(target, store, record)
            trainer = trainer_of(runs, record, target.cpu_threads)
            return await finish(target, store, record, trainer, logger, cancel=cancel)
    except RunBusy as busy:
        raise RunError(
            f"{subject(record)} is already followed by {busy.holder}: it records the outcome; "
            "follow it again only once that follower has ended"
        ) from None
    except LeaseLost as lost:
        line = lost_line(record.id, lost)
        logger.warning("%s", line)
        raise RunError(
            f"{subject(record)} is already followed by another process ({line}): it records "
            "the outcome"
        ) from None


# -- hooks ------------------------------------------------------------------------------


def runs_of(flow_run: FlowRun) -> Runs:
    """The runs directory a flow run used (its `runs_dir`, or its spec's)."""
    parameters = flow_run.parameters or {}
    runs_dir = parameters.get("runs_dir")
    spec = parameters.get("spec")
    if runs_dir is None and isinstance(spec, dict):
        runs_dir = spec.get("runs_dir")
    return Runs(runs_dir)


async def subflow_runs(flow_run_id: UUID) -> list[FlowRun]:
    """The flow runs below `flow_run_id` (its subflows, theirs, to MAX_DEPTH)."""
    found: list[FlowRun] = []
    parents = [flow_run_id]
    async with get_client() as client:
        for _ in range(MAX_DEPTH):
            if not parents:
                break
            children = await client.read_flow_runs(
                flow_run_filter=FlowRunFilter(
                    parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=parents)
                )
            )
            found += children
            parents = [child.id for child in children]
    return found


async def cancel_job(
    runs: Runs, store: Runs, record: RunRecord, holder: str, logger: Logger
) -> None:
    """What a cancelled flow run leaves of one of its jobs (`cancel_recorded`,
    on the target its record names). A failure is logged with what to do."""
    try:
        target = await target_named(record.target, logger)
        await cancel_recorded(
            target,
            store,
            record,
            holder,
            lambda rec: trainer_of(runs, rec, target.cpu_threads),
            logger,
        )
    except Exception as error:  # a hook must not fail the cancellation itself
        logger.warning(
            "%s: cannot end it (%s); cancel it again with the cancel flow, or remove its pod with "
            "the pods flow (action=remove, run_id=%s)",
            subject(record),
            error,
            record.id,
        )


async def crashed_job(store: Runs, record: RunRecord, logger: Logger) -> None:
    """What a crashed flow run leaves of one of its jobs (`crashed_recorded`,
    on the target its record names)."""
    try:
        await crashed_recorded(await target_named(record.target, logger), store, record, logger)
    except Exception as error:
        logger.warning(
            "%s: it may keep something billing (%s); remove it with the pods flow "
            "(action=remove, run_id=%s)",
            subject(record),
            error,
            record.id,
        )


async def _flow_runs_below(flow_run: FlowRun, logger: Logger) -> list[FlowRun]:
    try:
        return await subflow_runs(flow_run.id)
    except Exception as error:  # a hook must not fail on the server
        logger.warning("cannot find the subflow runs of this flow run: %s", error)
        return []


async def _settle_children(children: list[FlowRun], state: State[Any], logger: Logger) -> None:
    """Marks the unfinished subflow runs `state`: they ran in this flow run's
    process, so nothing else ends them."""
    for child in children:
        if child.state is not None and child.state.is_final():
            continue
        try:
            async with get_client() as client:
                await client.set_flow_run_state(child.id, state, force=True)
        except Exception as error:
            logger.warning("cannot mark subflow run %s %s: %s", child.id, state.name, error)


async def _jobs_of(
    flow_run: FlowRun, logger: Logger
) -> tuple[Runs, list[FlowRun], list[tuple[Runs, RunRecord]]]:
    """The runs directory a flow run used, its subflow runs, and the jobs they
    created that have not ended."""
    children = await _flow_runs_below(flow_run, logger)
    runs = runs_of(flow_run)
    ids = [str(flow_run.id), *(str(child.id) for child in children)]
    try:
        return runs, children, unfinished_of(runs, ids)
    except Exception as error:  # a hook must not fail on a bad runs directory
        logger.warning("cannot find the jobs of this flow run: %s", error)
        return runs, children, []


async def on_cancelled(flow: Flow[Any, Any], flow_run: FlowRun, state: State[Any]) -> None:
    """`on_cancellation` hook of every flow: the jobs this flow run and its
    subflows started are cancelled, what they left retrieved, what they ran
    on deleted; the subflow runs are marked cancelled."""
    logger = flow_run_logger(flow_run, flow)
    runs, children, jobs = await _jobs_of(flow_run, logger)
    for store, record in jobs:
        await cancel_job(runs, store, record, str(flow_run.id), logger)
    await _settle_children(children, Cancelled(message="its parent flow run was cancelled"), logger)


async def on_crashed(flow: Flow[Any, Any], flow_run: FlowRun, state: State[Any]) -> None:
    """`on_crashed` hook of every flow: a started job is left to its bounds
    (the log says how to follow it again), one never started has what it
    holds deleted; the subflow runs are marked crashed."""
    logger = flow_run_logger(flow_run, flow)
    _, children, jobs = await _jobs_of(flow_run, logger)
    for store, record in jobs:
        await crashed_job(store, record, logger)
    await _settle_children(children, Crashed(message="its parent flow run crashed"), logger)


HOOKS: dict[str, Any] = {"on_cancellation": [on_cancelled], "on_crashed": [on_crashed]}
"""The state hooks every flow that starts jobs takes (`@flow(..., **HOOKS)`)."""
