"""The run flows on a Runpod target: `train` provisions a pod for the run,
starts its job there through the SSH executor, follows it with the pod's
lease renewed while it makes progress, and ends the pod only after a
verified retrieval; `attach`, `stop` and `cancel` work from `run.json` and
`pod.json` alone. The public flows (`flows.train`) hand a Runpod target to
these functions; the steps themselves are in `overbrainer_prefect.runpod`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import acreate_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import State
from prefect.runtime import flow_run

from overbrainer_prefect.artifacts import PrefectReporter, artifact_key
from overbrainer_prefect.blocks import RunpodTarget
from overbrainer_prefect.executors.base import ExecError, Executor
from overbrainer_prefect.executors.local import LocalExecutor
from overbrainer_prefect.flows.train import (
    RunResult,
    _export_after,
    _finish,
    start_job,
    trainer_of,
)
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
from overbrainer_prefect.runpod.provision import DEFAULT_WORKDIR, Provisioned, provision
from overbrainer_prefect.runpod.reconnect import reconnect
from overbrainer_prefect.runpod.settings import RunpodTargetSettings
from overbrainer_prefect.runpod.vram import VramEstimateError, estimate_vram, model_shape
from overbrainer_prefect.runs import lifecycle
from overbrainer_prefect.runs.lifecycle import NotRetrieved, Outcome, RunContext, RunError
from overbrainer_prefect.runs.lock import RunBusy, follow_lock, is_followed
from overbrainer_prefect.runs.resume import stage_checkpoint
from overbrainer_prefect.runs.store import ResumedFrom, RunRecord, Runs, RunState
from overbrainer_prefect.trainers.axolotl import AxolotlTrainer
from overbrainer_prefect.trainers.base import Trainer
from overbrainer_prefect.trainers.export import ExportSpec
from overbrainer_prefect.trainers.spec import TrainingSpec

HOOK_RETRIEVE_S = 120.0  # how long a cancellation hook spends cancelling and retrieving a job
FOLLOWER_WAIT_S = 300.0  # how long stop and cancel wait for another follower to record the end


def pod_run_context(
    runs: Runs, block: RunpodTarget, executor: Executor, reporter: Any
) -> RunContext:
    """The context of the steps of a run on a pod. The job has no deadline of
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


async def plan_for(
    ctx: PodContext,
    settings: RunpodTargetSettings,
    training: TrainingSpec | None,
    block: RunpodTarget,
) -> LaunchPlan:
    """The launch plan of a run: for `auto` GPU types without `min_vram_gb`,
    with the VRAM floor estimated from the base model's shape (a warning says
    when it cannot be). Raises GpuChoiceError with one line, RunpodError when
    Runpod refuses the key or cannot be read."""
    floor: float | None = None
    if settings.is_auto and settings.min_vram_gb is None and training is not None:
        token = block.huggingface.token if block.huggingface is not None else None
        endpoint = block.huggingface.endpoint if block.huggingface is not None else None
        try:
            shape = await asyncio.to_thread(
                model_shape, training.base_model, token=token, endpoint=endpoint
            )
            need = estimate_vram(
                shape,
                training.adapter,
                sequence_len=training.sequence_len,
                micro_batch_size=training.micro_batch_size,
                lora_r=training.lora_r,
                gradient_checkpointing=bool(training.extra.get("gradient_checkpointing")),
            )
            floor = float(need.floor_gb)
            ctx.log.info(
                "the run needs about %s of VRAM per GPU (estimate): gpu_types auto keeps the "
                "types with at least %d GB",
                need,
                need.floor_gb,
            )
        except VramEstimateError as error:
            ctx.log.warning(
                "cannot estimate the VRAM the run needs (%s): gpu_types auto picks without a "
                "VRAM floor",
                error,
            )
    return await plan_from_api(ctx.client, settings, vram_floor_gb=floor)


async def warn_orphans(ctx: PodContext) -> None:
    """Warns of the pods of the account nothing here follows (best effort),
    and sweeps the host key secrets no pod needs any more. Never deletes a pod."""
    try:
        rows = await pod_rows(ctx.client, ctx.runs)
    except RunpodError as error:
        ctx.log.warning("cannot look for leftover pods: %s", error)
        return
    for warning in orphan_warnings(rows):
        ctx.log.warning("%s", warning)
    try:
        for warning in await sweep_host_keys(ctx.client, ctx.runs, rows):
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
    """Creates the run's pod and waits until it is ready and capped."""
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
    reporter = run_ctx.reporter
    assert isinstance(reporter, PrefectReporter)
    await reporter.open()

    async def pump() -> None:
        while True:
            await asyncio.sleep(1.0)
            await reporter.flush()

    pumping = asyncio.create_task(pump())
    try:
        watched = await watch_leased(run_ctx, trainer, record, pod, ctx.timing, run_ctx.stall_s)
    finally:
        pumping.cancel()
        await reporter.flush(force=True)
    return await settle(ctx, pod, record.id, watched)


async def publish_pod_summary(pod: PodRecord) -> None:
    """A markdown artifact of the run's pod: GPU, rate, uptime, spend, and how it ended."""
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
    lines = [f"# Pod of run {pod.run_id}", "", "| | |", "| --- | --- |"]
    lines += [f"| {key} | {value} |" for key, value in rows]
    await acreate_markdown_artifact(
        markdown="\n".join(lines) + "\n",
        key=artifact_key(pod.run_id, "pod"),
        description=f"The Runpod pod of run {pod.run_id}",
    )


async def train_on_pod(
    runs: Runs,
    target_ref: str,
    block: RunpodTarget,
    training: TrainingSpec,
    point: ResumedFrom | None,
    export: ExportSpec | None,
    runs_dir: str | None,
) -> RunResult | State[Any]:
    """`train` on a Runpod target: the plan checked and logged before anything
    is spent, the orphans of the account warned about, the run created, its
    pod provisioned, its job started and followed, its files retrieved and
    verified, then its pod ended. Fails with one line before any pod exists
    when the settings, the key or the plan are wrong."""
    logger = get_run_logger()
    settings = block.settings()
    async with block.credentials.client() as client:
        ctx = PodContext(client=client, runs=runs, log=logger)
        plan = await plan_for(ctx, settings, training, block)
        logger.info("%s", plan.describe())
        await warn_orphans(ctx)
        record = lifecycle.create(
            runs,
            target=target_ref,
            target_kind=block.kind,
            workdir=DEFAULT_WORKDIR,
            spec=training.model_dump(mode="json"),
            flow_run_id=flow_run.id,
        )
        logger.info(
            "run %s created on %s (files in %s)", record.id, target_ref, runs.run_dir(record.id)
        )
        resume = None
        if point is not None:
            resume = stage_checkpoint(runs, point, record)
            record.resumed_from = point
            runs.save(record)
        trainer = AxolotlTrainer(training, resume_from=resume, cpu_threads=block.cpu_threads)
        with follow_lock(runs.run_dir(record.id), flow_run.id):
            ready = await provision_pod(
                ctx, record, settings, plan, block.credentials.rest_url, target_ref
            )
            outcome = await _run_on_pod(ctx, block, trainer, ready)
        if export is not None and outcome.record.state == RunState.SUCCEEDED:
            exported = await _export_after(outcome.record.id, export, runs_dir)
            return await _finish(runs, outcome, ready.executor, exported=exported)
        return await _finish(runs, outcome, ready.executor)


async def _run_on_pod(
    ctx: PodContext, block: RunpodTarget, trainer: AxolotlTrainer, ready: Provisioned
) -> Outcome:
    """Starts the job of a provisioned run and follows it on its pod; ends the pod."""
    pod, executor = ready.pod, ready.executor
    runs = ctx.runs
    record = runs.load(pod.run_id)
    try:
        run_ctx = pod_run_context(runs, block, executor, PrefectReporter(ctx.log, record.id))
        try:
            record = await start_job(run_ctx, trainer, record, block)
        except BaseException:
            # no job runs: the pod has nothing left to do
            await asyncio.shield(release(ctx, pod, "its job could not start"))
            raise
        pod.state = PodState.RUNNING
        try:
            pod.save(runs)
        except Exception as error:
            raise PodError(
                f"the job of run {record.id} runs on pod {pod.name}{pod.rate_text()}, but "
                f"pod.json cannot be saved ({error}); {remove_hint(record.id)}"
            ) from None
        if pod.keep:
            ctx.log.warning("%s", kept_message(runs, pod, record.id))
        else:
            ctx.log.info(
                "run %s: its job runs on pod %s%s; the pod's watchdog deletes it at max_hours "
                "(%s) unless this flow renews its lease while the job progresses",
                record.id,
                pod.name,
                pod.rate_text(),
                pod.deadline,
            )
        return await _follow_and_end(ctx, block, trainer, run_ctx, record, pod)
    finally:
        await executor.close()


async def _follow_and_end(
    ctx: PodContext,
    block: RunpodTarget,
    trainer: Trainer,
    run_ctx: RunContext,
    record: RunRecord,
    pod: PodRecord,
) -> Outcome:
    """Follows a started run on its pod, then ends the pod. A pod gone under
    the watch fails the run with its reason (its outcome then comes from the
    local files); a watch that fails otherwise leaves the job and the pod
    running, and the error says how to follow it again or remove the pod."""
    try:
        outcome = await follow_pod_job(ctx, run_ctx, trainer, record, pod)
    except PodGone as gone:
        ctx.log.warning("%s", gone)
        return await _local_outcome(ctx.runs, record.id, trainer)
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
            ctx.runs, pod, record.id, block.retrieve_grace_s, ctx.timing.lease_ttl_s
        )
        raise RunError(f"{error}. {detached}") from None
    await end_pod(ctx, pod, run_ctx.executor, outcome.record, outcome.retrieved)
    await publish_pod_summary(pod)
    return outcome


async def _local_outcome(runs: Runs, run_id: str, trainer: Trainer) -> Outcome:
    """The outcome of an ended run from its local files alone (its pod is gone)."""
    record = runs.load(run_id)
    if not record.state.ended:
        record.state = RunState.FAILED
        record.message = record.message or "its pod no longer exists"
        runs.save(record)
    nowhere = LocalExecutor(runs.run_dir(run_id), name="runs")
    pod = PodRecord.load(runs, run_id)
    if pod is not None:
        await publish_pod_summary(pod)
    return await lifecycle.watch(RunContext(runs=runs, executor=nowhere), trainer, record)


async def attach_on_pod(
    runs: Runs, record: RunRecord, block: RunpodTarget
) -> RunResult | State[Any]:
    """`attach` on a Runpod run: reaches its pod again from `pod.json`, follows
    the job (the lease renewed) or retrieves what an ended one left, then ends
    the pod. A run whose pod is gone is reported from its local files, failed
    with the reason when it was still running (its watchdog's bound)."""
    logger = get_run_logger()
    pod = _pod_of(runs, record)
    if record.job is None:
        raise RunError(
            f"run {record.id} has no job yet: its pod is still starting, or it stopped before its "
            f"job started; see the pods flow (action=list)"
        )
    trainer = trainer_of(record, block)
    async with block.credentials.client() as client:
        ctx = PodContext(client=client, runs=runs, log=logger)
        try:
            with follow_lock(runs.run_dir(record.id), flow_run.id):
                record = runs.load(record.id)
                executor = await reconnect(ctx, pod, record, record.target)
                if executor is None:
                    logger.info("run %s: pod %s no longer exists", record.id, pod.name)
                    if not record.state.ended:
                        reason = pod.limit_reached() or f"pod {pod.name} no longer exists"
                        fail_run(runs, record.id, reason)
                    outcome = await _local_outcome(runs, record.id, trainer)
                    return await _finish(runs, outcome, LocalExecutor(runs.run_dir(record.id)))
                try:
                    run_ctx = pod_run_context(
                        runs, block, executor, PrefectReporter(logger, record.id)
                    )
                    if record.state == RunState.RUNNING:
                        outcome = await _follow_and_end(ctx, block, trainer, run_ctx, record, pod)
                    else:
                        outcome = await _collect_and_end(ctx, trainer, run_ctx, record, pod)
                    return await _finish(runs, outcome, executor)
                finally:
                    await executor.close()
        except RunBusy as busy:
            raise RunError(
                f"run {record.id} is already followed by {busy.holder}: it records the outcome; "
                "attach again only once that follower has ended"
            ) from None


async def _collect_and_end(
    ctx: PodContext, trainer: Trainer, run_ctx: RunContext, record: RunRecord, pod: PodRecord
) -> Outcome:
    """An ended run whose pod is still there: retrieves its files again when
    they were not, then ends the pod."""
    local_log = ctx.runs.run_dir(record.id) / "job.log"
    if lifecycle.artifacts_missing(record) or not local_log.is_file():
        record, retrieved = await lifecycle.collect(run_ctx, trainer, record)
    else:
        retrieved = True
    outcome = await lifecycle.watch(run_ctx, trainer, record)
    outcome.retrieved = retrieved
    await end_pod(ctx, pod, run_ctx.executor, outcome.record, outcome.retrieved)
    await publish_pod_summary(pod)
    return outcome


def _pod_of(runs: Runs, record: RunRecord) -> PodRecord:
    pod = PodRecord.load(runs, record.id)
    if pod is None:
        raise RunError(
            f"run {record.id} has no pod record (runs/{record.id}/pod.json): it never asked for a "
            "pod, so there is nothing to reach"
        )
    return pod


async def stop_on_pod(runs: Runs, record: RunRecord, block: RunpodTarget) -> RunResult | State[Any]:
    """`stop` on a Runpod run: asks its job for a checkpoint, then follows it to
    its end (or lets its live follower do it) and ends the pod."""
    logger = get_run_logger()
    pod = _pod_of(runs, record)
    trainer = trainer_of(record, block)
    async with block.credentials.client() as client:
        ctx = PodContext(client=client, runs=runs, log=logger)
        executor = await reconnect(ctx, pod, record, record.target)
        if executor is None:
            raise RunError(f"run {record.id} has no pod left: nothing to stop")
        try:
            run_ctx = pod_run_context(runs, block, executor, PrefectReporter(logger, record.id))
            await lifecycle.request_stop(run_ctx, record)
            logger.info("run %s: asked its job for a checkpoint and a stop", record.id)
            try:
                with follow_lock(runs.run_dir(record.id), flow_run.id):
                    record = runs.load(record.id)
                    outcome = await _follow_and_end(ctx, block, trainer, run_ctx, record, pod)
                    return await _finish(runs, outcome, executor)
            except RunBusy as busy:
                logger.info(
                    "run %s is followed by %s, which records the stop, retrieves the checkpoint "
                    "and ends the pod",
                    record.id,
                    busy.holder,
                )
                return await _wait_for_end(runs, record.id, executor, trainer)
        finally:
            await executor.close()


async def cancel_on_pod(
    runs: Runs, record: RunRecord, block: RunpodTarget
) -> RunResult | State[Any]:
    """`cancel` on a Runpod run: cancels its job (its whole process group),
    retrieves what it left best effort, then ends the pod (left for its
    retrieve grace when the files could not be retrieved). A run whose job
    never started has its pod deleted and is failed."""
    logger = get_run_logger()
    pod = _pod_of(runs, record)
    async with block.credentials.client() as client:
        ctx = PodContext(client=client, runs=runs, log=logger)
        if record.job is None:
            await release(ctx, pod, "the run was cancelled before its job started")
            fail_run(runs, record.id, "cancelled before the job started")
            raise RunError(
                f"run {record.id} was cancelled before its job started; "
                + (
                    "its pod was deleted"
                    if pod.gone
                    else f"a pod may be left: {remove_hint(record.id)}"
                )
            )
        trainer = trainer_of(record, block)
        executor = await reconnect(ctx, pod, record, record.target)
        if executor is None:
            if not record.state.ended:
                fail_run(runs, record.id, pod.limit_reached() or f"pod {pod.name} no longer exists")
            raise RunError(f"run {record.id} has no pod left: nothing to cancel")
        try:
            if is_followed(runs.run_dir(record.id)):
                await executor.cancel(record.job)
                logger.info(
                    "run %s: job cancelled; its follower records it and ends the pod", record.id
                )
                return await _wait_for_end(runs, record.id, executor, trainer, cancelling=True)
            run_ctx = pod_run_context(runs, block, executor, PrefectReporter(logger, record.id))
            record, status, retrieved = await lifecycle.cancel(run_ctx, trainer, record)
            if status.kind != "cancelled":
                raise RunError(
                    f"run {record.id}: its job had already ended ({status}), so nothing was "
                    f"cancelled; follow it with the attach flow (run_id={record.id}) to record its "
                    "outcome and end its pod"
                )
            outcome = await lifecycle.watch(run_ctx, trainer, record)
            outcome.retrieved = retrieved
            await end_pod(ctx, pod, executor, outcome.record, retrieved)
            await publish_pod_summary(pod)
            logger.info(
                "run %s cancelled; its files were %sretrieved",
                record.id,
                "" if retrieved else "not ",
            )
            return await _finish(runs, outcome, executor, cancelling=True)
        finally:
            await executor.close()


async def _wait_for_end(
    runs: Runs, run_id: str, executor: Executor, trainer: Trainer, *, cancelling: bool = False
) -> RunResult | State[Any]:
    """Waits (bounded) until the run's other follower recorded its end, and
    reports that outcome."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + FOLLOWER_WAIT_S
    while loop.time() < deadline:
        record = runs.load(run_id)
        if record.state.ended and not is_followed(runs.run_dir(run_id)):
            outcome = await lifecycle.watch(
                RunContext(runs=runs, executor=executor), trainer, record
            )
            return await _finish(runs, outcome, executor, cancelling=cancelling)
        await asyncio.sleep(1.0)
    raise RunError(
        f"run {run_id} is still followed after {FOLLOWER_WAIT_S:g} s; see its flow run for "
        "the outcome"
    )


# -- hooks ------------------------------------------------------------------------------


async def cancel_pod_run(
    runs: Runs,
    record: RunRecord,
    block: RunpodTarget,
    flow_run_id: str,
    logger: logging.Logger | Any,
) -> None:
    """What a cancelled flow run leaves of a Runpod run, from `run.json` and
    `pod.json` alone: before the job started, every pod of the run is deleted
    and the run failed "interrupted before the job started"; after, the job is
    cancelled, what it left retrieved best effort (bounded in time), and the
    pod deleted."""
    pod = PodRecord.load(runs, record.id)
    async with block.credentials.client() as client:
        ctx = PodContext(client=client, runs=runs, log=logger)
        if record.job is None:
            if pod is not None:
                await release(ctx, pod, INTERRUPTED)
            fail_run(runs, record.id, INTERRUPTED)
            left = pod is not None and not pod.gone
            logger.warning(
                "run %s: interrupted before its job started; %s",
                record.id,
                f"a pod of it may be left: {remove_hint(record.id)}"
                if left
                else "it has no pod left",
            )
            return
        if pod is None:
            logger.warning("run %s has no pod record: nothing to end", record.id)
            return
        with follow_lock(runs.run_dir(record.id), flow_run_id):
            try:
                executor = await reconnect(ctx, pod, record, record.target)
            except PodError as error:
                logger.warning("run %s: %s", record.id, error)
                executor = None
            retrieved = False
            if executor is not None:
                try:
                    trainer = trainer_of(record, block)
                    run_ctx = pod_run_context(runs, block, executor, lifecycle.LogReporter())
                    _, status, retrieved = await asyncio.wait_for(
                        lifecycle.cancel(run_ctx, trainer, record), HOOK_RETRIEVE_S
                    )
                    logger.info("run %s: job %s on pod %s", record.id, status, pod.name)
                except (ExecError, RunError, TimeoutError) as error:
                    logger.warning("run %s: cannot cancel its job cleanly: %s", record.id, error)
                finally:
                    await fetch_watchdog_log(runs, executor, record)
                    await executor.close()
            if not runs.load(record.id).state.ended:
                fail_run(runs, record.id, "its flow run was cancelled")
            await release(ctx, pod, "its flow run was cancelled")
            logger.info(
                "run %s: its files were %sretrieved; pod %s %s",
                record.id,
                "" if retrieved else "not ",
                pod.name,
                "deleted" if pod.gone else f"may be left: {remove_hint(record.id)}",
            )


async def crashed_pod_run(
    runs: Runs, record: RunRecord, block: RunpodTarget, logger: logging.Logger | Any
) -> None:
    """What a crashed flow run leaves of a Runpod run: a started job is left to
    its pod's watchdog, and the log says how to attach or remove the pod; a
    run whose job never started has its pods deleted."""
    pod = PodRecord.load(runs, record.id)
    if record.job is not None:
        if pod is not None:
            logger.warning(
                "%s",
                detached_message(
                    runs, pod, record.id, block.retrieve_grace_s, PodTiming.from_env().lease_ttl_s
                ),
            )
        return
    async with block.credentials.client() as client:
        ctx = PodContext(client=client, runs=runs, log=logger)
        if pod is not None:
            await release(ctx, pod, INTERRUPTED)
        fail_run(runs, record.id, INTERRUPTED)
