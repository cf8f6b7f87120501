"""One job on a pod of its own, whatever the job is (a run's training, an
export, a base model's export, a compare): the launch plan logged before
anything is spent, the GPU budget taken, the pod provisioned for the job's
record, the job started and followed with the pod's lease renewed, its
files retrieved and verified, then the pod ended. The same steps reach the
pod again from the record alone (follow again, the collector), and end it
when the flow run is cancelled or crashes.

A job's record lives in its own store (`runs/`, `runs/R/exports/`,
`runs/R/compares/`, `runs/.bases/K/exports/`), and so does its `pod.json`,
keys and watchdog log: every pod belongs to exactly one record.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

from prefect import task
from prefect.artifacts import acreate_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from overbrainer_prefect.artifacts import artifact_key, live_progress
from overbrainer_prefect.blocks import RunpodTarget
from overbrainer_prefect.executors.base import ExecError, Executor
from overbrainer_prefect.executors.local import LocalExecutor
from overbrainer_prefect.flows.budget import SPEND_LIMIT, budget_limits, cents_per_hour, gpu_budget
from overbrainer_prefect.flows.train import start_job
from overbrainer_prefect.runpod.bootstrap import PodTiming
from overbrainer_prefect.runpod.context import INTERRUPTED, PodContext, PodError, PodGone
from overbrainer_prefect.runpod.ending import (
    detached_message,
    end_pod,
    fail_run,
    fetch_watchdog_log,
    kept_message,
    release,
    remove_hint,
)
from overbrainer_prefect.runpod.errors import RunpodError
from overbrainer_prefect.runpod.follow import settle, watch_leased
from overbrainer_prefect.runpod.gpus import LaunchPlan, plan_from_api
from overbrainer_prefect.runpod.orphans import orphan_warnings, pod_rows, sweep_host_keys
from overbrainer_prefect.runpod.pod import PodRecord, PodState
from overbrainer_prefect.runpod.provision import Provisioned, provision
from overbrainer_prefect.runpod.reconnect import reconnect
from overbrainer_prefect.runpod.settings import RunpodTargetSettings, settings_from
from overbrainer_prefect.runpod.volume import ensure_volume
from overbrainer_prefect.runs import lifecycle
from overbrainer_prefect.runs.lifecycle import NotRetrieved, Outcome, RunContext, RunError
from overbrainer_prefect.runs.lock import RunBusy, follow_lock
from overbrainer_prefect.runs.store import RunRecord, Runs, RunState, follow_again, subject
from overbrainer_prefect.trainers.base import Trainer

HOOK_RETRIEVE_S = 120.0  # how long a cancellation hook spends cancelling and retrieving a job

Check = Callable[[Executor], Awaitable[None]]
"""A check of the pod before the job starts (raises TrainError with one line)."""


def pod_run_context(
    runs: Runs, block: RunpodTarget, executor: Executor, reporter: Any
) -> RunContext:
    """The context of the steps of a job on a pod. The job has no deadline of
    its own: the pod's watchdog and the client's guard bound it."""
    return RunContext(
        runs=runs,
        executor=executor,
        reporter=reporter,
        python=block.python,
        poll_s=block.poll_seconds,
        max_hours=None,
        stall_s=block.stall_minutes * 60,
    )


def pod_settings(block: RunpodTarget, image: str | None = None) -> RunpodTargetSettings:
    """The checked settings of a Runpod target, with another Docker `image`
    when given (a compare's own image). Raises SettingsError with one line."""
    values: dict[str, Any] = {
        name: getattr(block, name) for name in RunpodTargetSettings.model_fields
    }
    if image:
        values["image"] = image
    return settings_from(values)


@asynccontextmanager
async def pod_account(
    block: RunpodTarget, runs: Runs, logger: logging.Logger | logging.LoggerAdapter[Any]
) -> AsyncIterator[PodContext]:
    """The Runpod account of a target, as the context of the steps of the jobs
    of `runs`, for the length of the block."""
    async with block.credentials.client() as client:
        yield PodContext(client=client, runs=runs, log=logger)


async def plan_job(
    ctx: PodContext, settings: RunpodTargetSettings, floor_gb: float | None, why: str
) -> LaunchPlan:
    """The launch plan of a job that needs `floor_gb` of VRAM per GPU (`why`
    says how that was found): with `gpu_types` auto and no `min_vram_gb`, the
    floor keeps the types with at least that much. Raises GpuChoiceError with
    one line, RunpodError when Runpod refuses the key or cannot be read."""
    floor = None
    if settings.is_auto and settings.min_vram_gb is None and floor_gb is not None:
        floor = float(floor_gb)
        ctx.log.info("%s: gpu_types auto keeps the types with at least %g GB", why, floor)
    return await plan_from_api(ctx.client, settings, vram_floor_gb=floor)


def plan_price(plan: LaunchPlan) -> float:
    """The most a pod of `plan` may cost an hour: the dearest type it may fall back to."""
    return max(choice.price_per_hour for choice in plan.choices)


async def within_budget(plan: LaunchPlan, logger: Any) -> LaunchPlan:
    """`plan` without the GPU types dearer than the whole GPU budget's spend
    limit (logged), so that the pod is held at the price of the dearest type
    it may still fall back to. Unchanged without a budget on the server, or
    when no type fits (taking the budget then says why in one line)."""
    spend = (await budget_limits()).get(SPEND_LIMIT)
    if spend is None:
        return plan
    kept = tuple(c for c in plan.choices if cents_per_hour(c.price_per_hour) <= spend)
    if not kept or len(kept) == len(plan.choices):
        return plan
    dropped = [c.label() for c in plan.choices if c not in kept]
    logger.info(
        "the GPU budget allows $%.2f/h in all: %s left out of the GPU types to try",
        spend / 100,
        ", ".join(dropped),
    )
    return replace(plan, choices=kept)


async def warn_orphans(ctx: PodContext, runs: Runs) -> None:
    """Warns of the pods of the account nothing here follows (best effort),
    and sweeps the host key secrets no pod needs any more. Never deletes a pod."""
    try:
        rows = await pod_rows(ctx.client, runs)
    except RunpodError as error:
        ctx.log.warning("cannot look for leftover pods: %s", error)
        return
    for warning in orphan_warnings(rows):
        ctx.log.warning("%s", warning)
    try:
        for warning in await sweep_host_keys(ctx.client, runs, rows):
            ctx.log.warning("%s", warning)
    except RunpodError as error:
        ctx.log.warning("cannot look for leftover host key secrets: %s", error)


@task(name="provision-pod", cache_policy=NO_CACHE, persist_result=False)
async def provision_pod(
    ctx: PodContext,
    record: RunRecord,
    settings: RunpodTargetSettings,
    plan: LaunchPlan,
    api_url: str,
    name: str,
) -> Provisioned:
    """Creates the job's pod and waits until it is ready and capped."""
    return await provision(ctx, record, settings, plan, api_url=api_url, name=name)


@task(name="follow-pod-job", cache_policy=NO_CACHE, persist_result=False)
async def follow_pod_job(
    ctx: PodContext,
    run_ctx: RunContext,
    trainer: Trainer,
    record: RunRecord,
    pod: PodRecord,
) -> Outcome:
    """Follows the job on its pod to its end (the lease renewed while it
    progresses, the client's guard at the deadline), then retrieves and
    verifies its files."""
    async with live_progress(run_ctx.reporter):
        watched = await watch_leased(run_ctx, trainer, record, pod, ctx.timing, run_ctx.stall_s)
    return await settle(ctx, pod, record.id, watched)


async def publish_pod_summary(pod: PodRecord, record: RunRecord | None = None) -> None:
    """A markdown artifact of a job's pod: GPU, rate, uptime, spend, and how it ended."""
    spend = pod.estimated_spend()
    rows = [
        ("Pod", pod.name),
        (
            "GPU",
            f"{pod.gpu_count} × {pod.gpu_type_id}" if pod.gpu_count > 1 else str(pod.gpu_type_id),
        ),
        ("Rate", f"${pod.cost_per_hour:.2f}/h" if pod.cost_per_hour is not None else "unknown"),
        ("Uptime", f"{pod.uptime_s() / 60:.1f} min"),
        ("Estimated spend", f"${spend:.4f}" if spend is not None else "unknown"),
        ("Watchdog deadline (max_hours)", pod.deadline or "none"),
        ("State", str(pod.state)),
        (
            "Deleted",
            f"{pod.deleted} by {pod.deleted_by}: {pod.delete_reason}" if pod.deleted else "no",
        ),
        ("Create attempts", ", ".join(f"{a.gpu_type_id}: {a.result}" for a in pod.attempts)),
    ]
    name = subject(record) if record is not None else f"run {pod.run_id}"
    lines = [f"# Pod of {name}", "", "| | |", "| --- | --- |"]
    lines += [f"| {key} | {value} |" for key, value in rows]
    await acreate_markdown_artifact(
        markdown="\n".join(lines) + "\n",
        key=artifact_key(pod.run_id, "pod"),
        description=f"The Runpod pod of {name}",
    )


Created = tuple[RunRecord, Trainer, Any]
"""A new job: its record (saved `preparing`), its trainer, and where its progress goes."""


async def run_on_new_pod(
    ctx: PodContext,
    block: RunpodTarget,
    target_ref: str,
    settings: RunpodTargetSettings,
    plan: LaunchPlan,
    create: Callable[[], Created],
    *,
    check: Check | None = None,
    disk_bytes: int | None = None,
    what: str = "the job",
) -> tuple[Outcome, str]:
    """Runs a new job on a pod of its own: checks the target's network volume
    (grown within `max_volume_gb` when `what`, writing about `disk_bytes`
    there, needs more), takes the GPU budget for the pod's
    price (waiting while other pods hold it), then `create`s the job's record
    (in the store `ctx.runs`), holds its follow lock, provisions the pod, runs
    `check` on it, starts the job, follows it, retrieves and verifies its
    files, then ends the pod. Returns the outcome and where it ran.

    Raises VolumeError (nothing created) when the network volume cannot be
    used; BudgetError (nothing created) when the budget can never hold the
    pod; PodError (the record failed, every pod of it deleted) when the pod
    cannot be had or `check` fails; RunError when the watch fails (the job and
    its pod keep running; the message says how to follow it again or remove
    the pod).
    """
    await ensure_volume(ctx.client, settings, disk_bytes, what, ctx.log)
    plan = await within_budget(plan, ctx.log)
    async with gpu_budget(plan_price(plan)):
        record, trainer, reporter = create()
        with follow_lock(ctx.runs.run_dir(record.id), flow_run.id):
            ready = await provision_pod(
                ctx, record, settings, plan, block.credentials.rest_url, target_ref
            )
            outcome = await _run_on_pod(ctx, block, trainer, ready, reporter, check)
            return outcome, ready.executor.description


async def _run_on_pod(
    ctx: PodContext,
    block: RunpodTarget,
    trainer: Trainer,
    ready: Provisioned,
    reporter: Any,
    check: Check | None,
) -> Outcome:
    """Starts the job of a provisioned record and follows it on its pod; ends the pod."""
    pod, executor = ready.pod, ready.executor
    runs = ctx.runs
    record = runs.load(pod.run_id)
    try:
        run_ctx = pod_run_context(runs, block, executor, reporter)
        try:
            if check is not None:
                await check(executor)
            record = await start_job(run_ctx, trainer, record, block)
        except BaseException as error:
            # no job runs: the pod has nothing left to do
            await asyncio.shield(release(ctx, pod, "its job could not start"))
            if isinstance(error, Exception) and not runs.load(record.id).state.ended:
                fail_run(runs, record.id, str(error) or type(error).__name__)
            raise
        pod.state = PodState.RUNNING
        try:
            pod.save(runs)
        except Exception as error:
            raise PodError(
                f"the job of {subject(record)} runs on pod {pod.name}{pod.rate_text()}, but "
                f"pod.json cannot be saved ({error}); {remove_hint(record.id)}"
            ) from None
        if pod.keep:
            ctx.log.warning("%s", kept_message(runs, pod, record.id))
        else:
            ctx.log.info(
                "%s: its job runs on pod %s%s; the pod's watchdog deletes it at max_hours "
                "(%s) unless this flow renews its lease while the job progresses",
                subject(record),
                pod.name,
                pod.rate_text(),
                pod.deadline,
            )
        return await follow_and_end(ctx, block, trainer, run_ctx, record, pod)
    finally:
        await executor.close()


async def follow_and_end(
    ctx: PodContext,
    block: RunpodTarget,
    trainer: Trainer,
    run_ctx: RunContext,
    record: RunRecord,
    pod: PodRecord,
) -> Outcome:
    """Follows a started job on its pod, then ends the pod. A pod gone under
    the watch fails the record with its reason (its outcome then comes from
    the local files); a watch that fails otherwise leaves the job and the pod
    running, and the error says how to follow it again or remove the pod."""
    try:
        outcome = await follow_pod_job(ctx, run_ctx, trainer, record, pod)
    except PodGone as gone:
        ctx.log.warning("%s", gone)
        return await local_outcome(ctx.runs, record.id, trainer)
    except NotRetrieved as error:
        pod.state = PodState.AWAITING_RETRIEVAL
        pod.save(ctx.runs)
        await fetch_watchdog_log(ctx.runs, run_ctx.executor, record)
        raise RunError(
            f"{error}; its pod {pod.name}{pod.rate_text()} stays until its watchdog's retrieve "
            f"grace ends, or {remove_hint(record.id)}"
        ) from None
    except (RunError, ExecError) as error:
        detached = detached_message(
            ctx.runs, pod, record, block.retrieve_grace_s, ctx.timing.lease_ttl_s
        )
        raise RunError(f"{error}. {detached}") from None
    await end_pod(ctx, pod, run_ctx.executor, outcome.record, outcome.retrieved)
    await publish_pod_summary(pod, outcome.record)
    return outcome


async def local_outcome(runs: Runs, run_id: str, trainer: Trainer) -> Outcome:
    """The outcome of an ended job from its local files alone (its pod is gone)."""
    record = runs.load(run_id)
    if not record.state.ended:
        record.state = RunState.FAILED
        record.message = record.message or "its pod no longer exists"
        runs.save(record)
    nowhere = LocalExecutor(runs.run_dir(run_id), name="runs")
    pod = PodRecord.load(runs, run_id)
    if pod is not None:
        await publish_pod_summary(pod, record)
    return await lifecycle.watch(RunContext(runs=runs, executor=nowhere), trainer, record)


async def collect_and_end(
    ctx: PodContext, trainer: Trainer, run_ctx: RunContext, record: RunRecord, pod: PodRecord
) -> Outcome:
    """An ended job whose pod is still there: retrieves its files again when
    they were not, then ends the pod."""
    local_log = ctx.runs.run_dir(record.id) / "job.log"
    if lifecycle.artifacts_missing(record) or not local_log.is_file():
        record, retrieved = await lifecycle.collect(run_ctx, trainer, record)
    else:
        retrieved = True
    outcome = await lifecycle.watch(run_ctx, trainer, record)
    outcome.retrieved = retrieved
    await end_pod(ctx, pod, run_ctx.executor, outcome.record, outcome.retrieved)
    await publish_pod_summary(pod, outcome.record)
    return outcome


def pod_of(runs: Runs, record: RunRecord) -> PodRecord:
    """The pod record of a job. Raises RunError when it never asked for a pod."""
    pod = PodRecord.load(runs, record.id)
    if pod is None:
        raise RunError(
            f"{subject(record)} has no pod record ({record.id}/pod.json): it never asked for a "
            "pod, so there is nothing to reach"
        )
    return pod


async def finish_on_pod(
    ctx: PodContext,
    block: RunpodTarget,
    record: RunRecord,
    trainer: Trainer,
    reporter: Any,
    *,
    cancel: bool = False,
) -> tuple[Outcome, str]:
    """Finishes a started job on its pod from its records alone; the caller
    holds its follow lock. Reaches the pod again, then follows a running job
    (the lease renewed) to its end, or retrieves what an ended one left; with
    `cancel`, cancels a running job and retrieves what it left, best effort.
    Ends the pod once the files are verified. A job whose pod is gone is
    reported from its local files (failed with the reason when it was still
    running: its watchdog's bound). Returns the outcome and where it ran.

    Raises RunError when the job has not started, or cannot be followed to
    its end (the message says how to follow it again or remove the pod);
    PodError when the pod cannot be reached or looked up.
    """
    runs = ctx.runs
    pod = pod_of(runs, record)
    if record.job is None:
        raise RunError(
            f"{subject(record)} has no job yet: its pod is still starting, or it stopped before "
            "its job started; see the pods flow (action=list)"
        )
    executor = await reconnect(ctx, pod, record, record.target)
    if executor is None:
        ctx.log.info("%s: pod %s no longer exists", subject(record), pod.name)
        if not record.state.ended:
            fail_run(runs, record.id, pod.limit_reached() or f"pod {pod.name} no longer exists")
        return await local_outcome(runs, record.id, trainer), "its local files"
    try:
        run_ctx = pod_run_context(runs, block, executor, reporter)
        if cancel and record.state == RunState.RUNNING:
            record, status, retrieved = await lifecycle.cancel(run_ctx, trainer, record)
            if status.kind == "cancelled":
                outcome = await lifecycle.watch(run_ctx, trainer, record)
                outcome.retrieved = retrieved
                await end_pod(ctx, pod, executor, outcome.record, retrieved)
                await publish_pod_summary(pod, outcome.record)
                return outcome, executor.description
        if record.state == RunState.RUNNING:
            outcome = await follow_and_end(ctx, block, trainer, run_ctx, record, pod)
        else:
            outcome = await collect_and_end(ctx, trainer, run_ctx, record, pod)
        return outcome, executor.description
    finally:
        await executor.close()


async def follow_again_on_pod(
    runs: Runs,
    record: RunRecord,
    trainer: Trainer,
    block: RunpodTarget,
    reporter: Any,
    logger: logging.Logger | logging.LoggerAdapter[Any],
) -> tuple[Outcome, str]:
    """`finish_on_pod` under the job's follow lock: what the attach flow, and an
    export or compare followed again, do on a Runpod target. Raises RunError
    when another live process follows the job."""
    try:
        async with pod_account(block, runs, logger) as ctx:
            with follow_lock(runs.run_dir(record.id), flow_run.id):
                record = runs.load(record.id)
                return await finish_on_pod(ctx, block, record, trainer, reporter)
    except RunBusy as busy:
        raise RunError(
            f"{subject(record)} is already followed by {busy.holder}: it records the outcome; "
            "follow it again only once that follower has ended"
        ) from None


# -- hooks ------------------------------------------------------------------------------


async def cancel_pod_job(
    runs: Runs,
    record: RunRecord,
    trainer: Trainer | None,
    block: RunpodTarget,
    flow_run_id: str,
    logger: logging.Logger | Any,
) -> None:
    """What a cancelled flow run leaves of a job on a pod, from its records
    alone: before the job started, every pod of it is deleted and it is
    failed "interrupted before the job started"; after, the job is cancelled,
    what it left retrieved best effort (bounded in time), and the pod deleted.
    `trainer` None: the job's trainer cannot be rebuilt (nothing is retrieved)."""
    pod = PodRecord.load(runs, record.id)
    name = subject(record)
    async with pod_account(block, runs, logger) as ctx:
        if record.job is None:
            if pod is not None:
                await release(ctx, pod, INTERRUPTED)
            fail_run(runs, record.id, INTERRUPTED)
            left = pod is not None and not pod.gone
            logger.warning(
                "%s: interrupted before its job started; %s",
                name,
                f"a pod of it may be left: {remove_hint(record.id)}"
                if left
                else "it has no pod left",
            )
            return
        if pod is None:
            logger.warning("%s has no pod record: nothing to end", name)
            return
        with follow_lock(runs.run_dir(record.id), flow_run_id):
            try:
                executor = await reconnect(ctx, pod, record, record.target)
            except PodError as error:
                logger.warning("%s: %s", name, error)
                executor = None
            retrieved = False
            if executor is not None:
                try:
                    if trainer is None:
                        await executor.cancel(record.job)
                        logger.info("%s: job cancelled on pod %s", name, pod.name)
                    else:
                        run_ctx = pod_run_context(runs, block, executor, lifecycle.LogReporter())
                        _, status, retrieved = await asyncio.wait_for(
                            lifecycle.cancel(run_ctx, trainer, record), HOOK_RETRIEVE_S
                        )
                        logger.info("%s: job %s on pod %s", name, status, pod.name)
                except (ExecError, RunError, TimeoutError) as error:
                    logger.warning("%s: cannot cancel its job cleanly: %s", name, error)
                finally:
                    await fetch_watchdog_log(runs, executor, record)
                    await executor.close()
            if not runs.load(record.id).state.ended:
                fail_run(runs, record.id, "its flow run was cancelled")
            await release(ctx, pod, "its flow run was cancelled")
            logger.info(
                "%s: its files were %sretrieved; pod %s %s",
                name,
                "" if retrieved else "not ",
                pod.name,
                "deleted" if pod.gone else f"may be left: {remove_hint(record.id)}",
            )


async def crashed_pod_job(
    runs: Runs, record: RunRecord, block: RunpodTarget, logger: logging.Logger | Any
) -> None:
    """What a crashed flow run leaves of a job on a pod: a started job is left
    to its pod's watchdog, and the log says how to follow it again or remove
    the pod; a job that never started has its pods deleted."""
    pod = PodRecord.load(runs, record.id)
    if record.job is not None:
        if pod is not None:
            logger.warning(
                "%s",
                detached_message(
                    runs, pod, record, block.retrieve_grace_s, PodTiming.from_env().lease_ttl_s
                ),
            )
        else:
            logger.warning(
                "%s keeps running; follow it again with %s", subject(record), follow_again(record)
            )
        return
    async with pod_account(block, runs, logger) as ctx:
        if pod is not None:
            await release(ctx, pod, INTERRUPTED)
        fail_run(runs, record.id, INTERRUPTED)
