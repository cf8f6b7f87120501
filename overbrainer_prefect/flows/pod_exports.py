"""The export and compare flows on a Runpod target: each job (the run's
export, the base model's export, the compare) on a new pod of its own with
the target's GPU settings (a compare may name its own image), under the same
budget, lease, deadline and cost cap as a run's pod, and that pod deleted
once the job's files are retrieved and verified.

The VRAM floor of `gpu_types: auto` comes from the job: for an export, what
the merge needs (the base model's 16-bit weights, a fifth more, the CUDA
context); for a compare, the tuned GGUF's size plus a fifth plus 2 GB.
"""

from __future__ import annotations

import asyncio
import math
import shutil
from typing import Any

from prefect import get_run_logger
from prefect.client.schemas.objects import State
from prefect.runtime import flow_run

from overbrainer_prefect.blocks import RunpodTarget
from overbrainer_prefect.executors.base import Executor
from overbrainer_prefect.flows.compare import (
    COMPARE,
    CompareFailed,
    CompareReporter,
    CompareResult,
    _base_name,
    base_gguf,
    reused_base,
)
from overbrainer_prefect.flows.compare import (
    _finish as finish_compare,
)
from overbrainer_prefect.flows.export import (
    EXPORT,
    ExportReporter,
    ExportResult,
    check_converter,
    running,
)
from overbrainer_prefect.flows.export import (
    _finish as finish_export,
)
from overbrainer_prefect.flows.podjob import (
    Created,
    follow_again_on_pod,
    plan_job,
    pod_account,
    pod_settings,
    run_on_new_pod,
)
from overbrainer_prefect.runpod.provision import DEFAULT_WORKDIR
from overbrainer_prefect.runpod.vram import GB, VramEstimateError, merge_vram_bytes, model_shape
from overbrainer_prefect.runs import lifecycle
from overbrainer_prefect.runs.lifecycle import RunError
from overbrainer_prefect.runs.store import RunRecord, Runs, subject
from overbrainer_prefect.trainers.base import TrainError
from overbrainer_prefect.trainers.compare import (
    MODELS_DIR,
    BaseExportTrainer,
    CompareSpec,
    CompareTrainer,
    GgufRef,
    base_exports,
    base_key,
    vram_floor,
)
from overbrainer_prefect.trainers.export import OUTPUT_DIR, ExportSpec, ExportTrainer


async def merge_floor(base_model: str, block: RunpodTarget) -> tuple[float | None, str]:
    """The VRAM floor, in whole GB, of a merge into `base_model` (a local
    directory or a Hub id), and how it was found; None (with a warning) when
    the model's shape cannot be read."""
    token = block.huggingface.token if block.huggingface is not None else None
    endpoint = block.huggingface.endpoint if block.huggingface is not None else None
    try:
        shape = await asyncio.to_thread(model_shape, base_model, token=token, endpoint=endpoint)
    except VramEstimateError as error:
        get_run_logger().warning(
            "cannot estimate the VRAM the merge needs (%s): gpu_types auto picks without a "
            "VRAM floor",
            error,
        )
        return None, ""
    need = merge_vram_bytes(shape)
    return (
        float(math.ceil(need / GB)),
        f"the merge into {base_model} needs about {need / GB:.1f} GB of VRAM (its 16-bit "
        "weights, a fifth more, the CUDA context)",
    )


def _converter_check(block: RunpodTarget) -> Any:
    async def check(executor: Executor) -> None:
        await check_converter(executor, block.python)

    return check


async def export_on_pod(
    runs: Runs,
    run: RunRecord,
    spec: ExportSpec,
    trainer: ExportTrainer,
    target_ref: str,
    block: RunpodTarget,
    disk_bytes: int | None = None,
) -> ExportResult | State[Any]:
    """The export of the succeeded run `run` on a new pod of the Runpod target
    `block`: the plan (with the merge's VRAM as the auto floor) logged before
    anything is spent, the export created, its pod provisioned, the converter
    checked, the job followed, the GGUF retrieved and verified, the pod ended.

    Fails with one line before any pod exists when the settings, the key or
    the plan are wrong; with the export's message when its job fails.
    """
    logger = get_run_logger()
    settings = pod_settings(block)
    exports = runs.children(run.id, EXPORT)
    model = trainer.base_model or str(runs.run_dir(run.id) / OUTPUT_DIR)  # full weights: no merge
    floor, why = await merge_floor(model, block)
    async with pod_account(block, exports, logger) as ctx:
        plan = await plan_job(ctx, settings, floor, why)
        logger.info("%s", plan.describe())

        def create() -> Created:
            record = lifecycle.create(
                exports,
                target=target_ref,
                target_kind=block.kind,
                workdir=DEFAULT_WORKDIR,
                trainer=EXPORT,
                spec=spec.model_dump(mode="json"),
                flow_run_id=flow_run.id,
                parent=run.id,
            )
            logger.info(
                "%s (%s) created on Runpod target %r (files in %s)",
                subject(record),
                spec.quant,
                target_ref,
                exports.run_dir(record.id),
            )
            return record, trainer, ExportReporter(logger, record)

        outcome, where = await run_on_new_pod(
            ctx,
            block,
            target_ref,
            settings,
            plan,
            create,
            check=_converter_check(block),
            disk_bytes=disk_bytes,
            what=f"the {spec.quant} export of run {run.id}",
        )
    return await finish_export(exports, outcome, where)


async def export_base_on_pod(
    runs: Runs, base: str, quant: str, target_ref: str, block: RunpodTarget
) -> GgufRef:
    """The base model's GGUF of type `quant` for a compare on a Runpod target:
    a succeeded export of it reused, one left running followed again, else an
    export of the plain base model on a new pod of its own (deleted once the
    GGUF is verified).

    Raises CompareFailed with one line when the export fails or its GGUF
    cannot be retrieved.
    """
    logger = get_run_logger()
    store = base_exports(runs, base_key(base, target_ref))
    ref = reused_base(runs, store, base, quant)
    if ref is not None:
        return ref
    trainer = BaseExportTrainer(base, quant, cpu_threads=block.cpu_threads)
    again = "compare again: it follows this export again, or makes a new one"
    left = running(store, quant)
    try:
        if left is not None:
            name = _base_name(left, base)
            logger.info("%s was left running: following it again", name)
            reporter = ExportReporter(logger, left)
            reporter.name = name
            outcome, _ = await follow_again_on_pod(store, left, trainer, block, reporter, logger)
            return base_gguf(runs, store, outcome, name)
        settings = pod_settings(block)
        floor, why = await merge_floor(base, block)
        async with pod_account(block, store, logger) as ctx:
            plan = await plan_job(ctx, settings, floor, why)
            logger.info("%s", plan.describe())
            names: list[str] = []

            def create() -> Created:
                record = lifecycle.create(
                    store,
                    target=target_ref,
                    target_kind=block.kind,
                    workdir=DEFAULT_WORKDIR,
                    trainer=EXPORT,
                    spec={"quant": quant, "keep_intermediate": False, "base_model": base},
                    flow_run_id=flow_run.id,
                )
                names.append(_base_name(record, base))
                logger.info(
                    "the base model %s has no %s GGUF yet: %s made on a pod of Runpod target "
                    "%r (files in %s)",
                    base,
                    quant,
                    names[0],
                    target_ref,
                    store.run_dir(record.id),
                )
                reporter = ExportReporter(logger, record)
                reporter.name = names[0]
                return record, trainer, reporter

            outcome, _ = await run_on_new_pod(
                ctx,
                block,
                target_ref,
                settings,
                plan,
                create,
                check=_converter_check(block),
                what=f"the {quant} export of the base model {base}",
            )
            name = names[0]
    except (TrainError, RunError) as error:
        raise CompareFailed(
            f"the base model's export could not be made: {error}; {again}"
        ) from None
    return base_gguf(runs, store, outcome, name)


async def compare_on_pod(
    runs: Runs,
    run_id: str,
    spec: CompareSpec,
    target_ref: str,
    block: RunpodTarget,
    image: str | None,
) -> CompareResult | State[Any]:
    """The compare of run `run_id` on a new pod of the Runpod target `block`
    (with `image` when given): the plan, its price and the number of
    questions logged before anything is spent (the VRAM floor from the tuned
    GGUF's size), the compare created, its pod provisioned, both GGUFs and
    the questions copied, the job followed, the answers retrieved and
    verified, the pod ended. `spec.base` must already be here (see
    `export_base_on_pod`).

    Fails with one line before any pod exists when the settings, the image,
    the key or the plan are wrong; with the compare's message when its job fails.
    """
    logger = get_run_logger()
    settings = pod_settings(block, image)
    compares = runs.children(run_id, COMPARE)
    floor = math.ceil(vram_floor(spec.tuned.size) / GB)
    why = (
        f"the compare needs about {vram_floor(spec.tuned.size) / GB:.1f} GB of VRAM (the "
        f"{spec.quant} GGUF, {spec.tuned.size / 1e6:.1f} MB, plus a fifth, plus 2 GB)"
    )
    trainer = CompareTrainer(spec, runs.root, cpu_threads=block.cpu_threads)
    async with pod_account(block, compares, logger) as ctx:
        plan = await plan_job(ctx, settings, float(floor), why)
        logger.info(
            "run %s: %d questions to its base model and its fine-tune on image %s. %s",
            run_id,
            len(spec.questions),
            settings.image,
            plan.describe(),
        )
        created: list[RunRecord] = []

        def create() -> Created:
            record = lifecycle.create(
                compares,
                target=target_ref,
                target_kind=block.kind,
                workdir=DEFAULT_WORKDIR,
                trainer=COMPARE,
                spec=spec.model_dump(mode="json"),
                flow_run_id=flow_run.id,
                parent=run_id,
            )
            created.append(record)
            logger.info(
                "%s created on Runpod target %r (files in %s)",
                subject(record),
                target_ref,
                compares.run_dir(record.id),
            )
            return record, trainer, CompareReporter(logger, subject(record))

        try:
            outcome, where = await run_on_new_pod(
                ctx,
                block,
                target_ref,
                settings,
                plan,
                create,
                disk_bytes=spec.tuned.size + spec.base.size,  # both GGUFs are copied there
                what=f"the compare of run {run_id}",
            )
        finally:  # the staged GGUFs were copied to the pod (links here, but no need)
            for record in created:
                shutil.rmtree(compares.run_dir(record.id) / MODELS_DIR, ignore_errors=True)
    return await finish_compare(compares, outcome, where)
