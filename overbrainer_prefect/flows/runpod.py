"""The run flows on a Runpod target: `train` provisions a pod for the run,
starts its job there through the SSH executor, follows it with the pod's
lease renewed while it makes progress, and ends the pod only after a
verified retrieval; `attach`, `stop` and `cancel` work from `run.json` and
`pod.json` alone. The public flows (`flows.train`) hand a Runpod target to
these functions; the steps themselves are in `overbrainer_prefect.runpod`.
"""

from __future__ import annotations

import asyncio
from typing import Any

from prefect import get_run_logger
from prefect.client.schemas.objects import State
from prefect.runtime import flow_run

from overbrainer_prefect.artifacts import PrefectReporter
from overbrainer_prefect.blocks import RunpodTarget
from overbrainer_prefect.executors.base import Executor
from overbrainer_prefect.flows.podjob import (
    Created,
    follow_again_on_pod,
    follow_and_end,
    plan_job,
    pod_account,
    pod_of,
    pod_run_context,
    publish_pod_summary,
    run_on_new_pod,
    warn_orphans,
)
from overbrainer_prefect.flows.train import (
    RunResult,
    _export_after,
    _finish,
    trainer_of,
)
from overbrainer_prefect.runpod.context import PodContext
from overbrainer_prefect.runpod.ending import (
    end_pod,
    fail_run,
    release,
    remove_hint,
)
from overbrainer_prefect.runpod.gpus import LaunchPlan
from overbrainer_prefect.runpod.provision import DEFAULT_WORKDIR
from overbrainer_prefect.runpod.reconnect import reconnect
from overbrainer_prefect.runpod.settings import RunpodTargetSettings
from overbrainer_prefect.runpod.vram import VramEstimateError, estimate_vram, model_shape
from overbrainer_prefect.runs import lifecycle
from overbrainer_prefect.runs.lifecycle import RunContext, RunError
from overbrainer_prefect.runs.lock import RunBusy, follow_lock, is_followed
from overbrainer_prefect.runs.resume import stage_checkpoint
from overbrainer_prefect.runs.store import ResumedFrom, RunRecord, Runs, RunState
from overbrainer_prefect.trainers.axolotl import AxolotlTrainer
from overbrainer_prefect.trainers.base import Trainer
from overbrainer_prefect.trainers.export import ExportSpec
from overbrainer_prefect.trainers.spec import TrainingSpec

FOLLOWER_WAIT_S = 300.0  # how long stop and cancel wait for another follower to record the end


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
    why = ""
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
            why = f"the run needs about {need} of VRAM per GPU (estimate)"
        except VramEstimateError as error:
            ctx.log.warning(
                "cannot estimate the VRAM the run needs (%s): gpu_types auto picks without a "
                "VRAM floor",
                error,
            )
    return await plan_job(ctx, settings, floor, why)


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
    async with pod_account(block, runs, logger) as ctx:
        plan = await plan_for(ctx, settings, training, block)
        logger.info("%s", plan.describe())
        await warn_orphans(ctx, runs)

        def create() -> Created:
            record = lifecycle.create(
                runs,
                target=target_ref,
                target_kind=block.kind,
                workdir=DEFAULT_WORKDIR,
                spec=training.model_dump(mode="json"),
                flow_run_id=flow_run.id,
            )
            logger.info(
                "run %s created on %s (files in %s)",
                record.id,
                target_ref,
                runs.run_dir(record.id),
            )
            resume = None
            if point is not None:
                resume = stage_checkpoint(runs, point, record)
                record.resumed_from = point
                runs.save(record)
            trainer = AxolotlTrainer(training, resume_from=resume, cpu_threads=block.cpu_threads)
            return record, trainer, PrefectReporter(logger, record.id)

        outcome, where = await run_on_new_pod(
            ctx, block, target_ref, settings, plan, create, what="the run"
        )
    if export is not None and outcome.record.state == RunState.SUCCEEDED:
        exported = await _export_after(outcome.record.id, export, runs_dir)
        return await _finish(runs, outcome, where, exported=exported)
    return await _finish(runs, outcome, where)


async def attach_on_pod(
    runs: Runs, record: RunRecord, block: RunpodTarget
) -> RunResult | State[Any]:
    """`attach` on a Runpod run: reaches its pod again from `pod.json`, follows
    the job (the lease renewed) or retrieves what an ended one left, then ends
    the pod. A run whose pod is gone is reported from its local files, failed
    with the reason when it was still running (its watchdog's bound)."""
    logger = get_run_logger()
    pod_of(runs, record)
    trainer = trainer_of(record, block)
    reporter = PrefectReporter(logger, record.id)
    outcome, where = await follow_again_on_pod(runs, record, trainer, block, reporter, logger)
    return await _finish(runs, outcome, where)


async def stop_on_pod(runs: Runs, record: RunRecord, block: RunpodTarget) -> RunResult | State[Any]:
    """`stop` on a Runpod run: asks its job for a checkpoint, then follows it to
    its end (or lets its live follower do it) and ends the pod."""
    logger = get_run_logger()
    pod = pod_of(runs, record)
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
                    outcome = await follow_and_end(ctx, block, trainer, run_ctx, record, pod)
                    return await _finish(runs, outcome, executor.description)
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
    pod = pod_of(runs, record)
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
            await publish_pod_summary(pod, outcome.record)
            logger.info(
                "run %s cancelled; its files were %sretrieved",
                record.id,
                "" if retrieved else "not ",
            )
            return await _finish(runs, outcome, executor.description, cancelling=True)
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
            return await _finish(runs, outcome, executor.description, cancelling=cancelling)
        await asyncio.sleep(1.0)
    raise RunError(
        f"run {run_id} is still followed after {FOLLOWER_WAIT_S:g} s; see its flow run for "
        "the outcome"
    )
