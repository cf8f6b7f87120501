"""The export flow: a succeeded run's model as one verified GGUF file.

The export runs on a target like any job (the run's own target by default):
the run's model and config are staged into `runs/<run-id>/exports/<export-id>/`,
copied to the target, merged, converted and quantized there by llama.cpp, and
the GGUF brought back and checked against the target's SHA-256 manifest. Its
record, `export.json`, follows the same rules as a run's, so `export` with an
`export_id` follows it again from any process. An export of the same run and
quant type that already succeeded is reused, not made again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import acreate_markdown_artifact
from prefect.client.schemas.objects import State
from prefect.states import Cancelled

from overbrainer_prefect.cells import size_text
from overbrainer_prefect.executors.base import Executor
from overbrainer_prefect.flows.driver import HOOKS, Check, NewJob, follow_again, run_new
from overbrainer_prefect.flows.results import RunFailed
from overbrainer_prefect.flows.targets import target_named
from overbrainer_prefect.kinds.export import NAME as EXPORT
from overbrainer_prefect.kinds.export import (
    ExportResult,
    NotExportable,
    check_exportable,
    result_of,
    reusable,
    running,
    summary_markdown,
)
from overbrainer_prefect.runs.store import RunRecord, Runs, RunState, subject
from overbrainer_prefect.sizing import ExportDisk, export_disk
from overbrainer_prefect.steps import retrieve
from overbrainer_prefect.steps.context import Outcome
from overbrainer_prefect.targets.base import JobNeed
from overbrainer_prefect.trainers.base import Trainer, TrainError
from overbrainer_prefect.trainers.export import (
    DEFAULT_QUANT,
    OUTPUT_DIR,
    ExportSpec,
    ExportTrainer,
    check_quant,
    converter_path,
)


async def publish_export_summary(export_id: str, markdown: str) -> None:
    """The export summary as a markdown artifact (`export-<id>-summary`)."""
    await acreate_markdown_artifact(
        markdown=markdown,
        key=f"export-{export_id}-summary".lower(),
        description=f"Summary of export {export_id}",
    )


async def check_converter(executor: Executor, python: str) -> None:
    """Raises TrainError with one line when llama.cpp's converter is not in the
    target's job venv (ExecError when the target cannot be reached)."""
    path = converter_path(python)
    result = await executor.run(["test", "-f", path], timeout=60)
    if result.code != 0:
        venv = path.rsplit("/share/", 1)[0]
        raise TrainError(
            f"llama.cpp's converter is not at {path} on {executor.description}: install the "
            f"export tools with `scripts/job-env.sh {venv}` there"
        )


def converter_check(python: str) -> Check:
    """The check, before an export's job starts, that its machine has llama.cpp's converter."""

    async def check(executor: Executor) -> None:
        await check_converter(executor, python)

    return check


def log_disk(name: str, model_dir: Path, trainer: ExportTrainer) -> ExportDisk | None:
    """Logs the disk the export of the model in `model_dir` needs (base, merged
    copy, GGUF); returns the estimate (None when the base model is not a
    directory here)."""
    logger = get_run_logger()
    need = export_disk(model_dir, trainer.base_model, trainer.spec.quant)
    if need is None:
        logger.info(
            "%s: cannot estimate the disk of its export (its base model %s is not a directory "
            "here)",
            name,
            trainer.base_model,
        )
        return None
    logger.info("%s: %s", name, need.describe())
    return need


async def finish_export(
    exports: Runs, outcome: Outcome, where: str, *, cancelling: bool = False
) -> ExportResult | State[Any]:
    """Publishes the export summary and turns the outcome into the flow's result:
    a failed export fails the flow, a cancelled one cancels it."""
    record = outcome.record
    result = result_of(exports, record, outcome.files)
    await publish_export_summary(record.id, summary_markdown(result, where, record))
    if record.state == RunState.FAILED:
        raise RunFailed(f"{subject(record)} failed: {record.message}")
    if record.state == RunState.CANCELLED and not cancelling:
        return Cancelled(message=f"{subject(record)} was cancelled", data=result)
    _log_result(result, record)
    return result


def _log_result(result: ExportResult, record: RunRecord) -> None:
    steps = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in result.phases.items())
    if result.gguf is None:
        get_run_logger().info("%s %s. %s", subject(record), record.state, result.next)
        return
    get_run_logger().info(
        "%s %s%s: %s (%s, sha256 %s)%s. %s",
        subject(record),
        record.state,
        " (reused)" if result.reused else "",
        result.gguf.path,
        size_text(result.gguf.size),
        result.gguf.sha256,
        f"; {steps}" if steps else "",
        result.next,
    )


def export_job(
    store: Runs,
    trainer: Trainer,
    spec: dict[str, Any],
    model: str,
    python: str,
    *,
    what: str,
    parent: str | None,
    subdir: str,
    disk_bytes: int | None = None,
) -> NewJob:
    """The new job of an export (of a run's model, or of a base model) by
    `trainer`, whose merge loads `model`: its machine checked for the converter."""
    return NewJob(
        store=store,
        need=JobNeed(what=what, merge_model=model, disk_bytes=disk_bytes),
        kind=EXPORT,
        prepare=lambda _record: trainer,
        spec=spec,
        parent=parent,
        subdir=subdir,
        check=converter_check(python),
    )


@flow(name="export", persist_result=True, **HOOKS)
async def export(
    run_id: str,
    quant: str = DEFAULT_QUANT,
    target: str | None = None,
    runs_dir: str | None = None,
    export_id: str | None = None,
    keep_intermediate: bool = False,
) -> ExportResult | State[Any]:
    """Exports the model of the succeeded run `run_id` to a GGUF of type `quant`
    (q4_k_m, q5_k_m, q8_0 or f16): on the run's own target, or on `target` (a
    target block's name), its LoRA merged into its base, converted and quantized
    with llama.cpp; the GGUF retrieved and verified by SHA-256 into
    `runs/<run_id>/exports/<export-id>/gguf/`.

    An export of the same run and quant that already succeeded is returned as it
    is (`reused`). With `export_id`, follows that export again (after its first
    follower died, or its files could not be retrieved). `keep_intermediate`
    leaves the merged model and the f16 GGUF on the target.

    Fails with one line, before anything is created, for an unknown quant type,
    a run that has not succeeded, has no model or whose files are not here; fails
    with the export's message when its job fails.
    """
    runs = Runs(runs_dir)
    logger = get_run_logger()
    exports = runs.children(run_id, EXPORT)
    if export_id is not None:
        finished = await follow_again(runs, exports, exports.load(export_id), logger)
        return await finish_export(exports, finished.outcome, finished.where)
    spec = ExportSpec(quant=check_quant(quant), keep_intermediate=keep_intermediate)
    run = runs.load(run_id)
    check_exportable(runs, run)
    done = reusable(exports, spec.quant)
    if done is not None:
        result = result_of(exports, done, retrieve.load_manifest(exports.run_dir(done.id)))
        result.reused = True
        logger.info(
            "reused %s (%s), which succeeded on %s: nothing exported again",
            subject(done),
            spec.quant,
            done.ended,
        )
        _log_result(result, done)
        return result
    busy = running(exports, spec.quant)
    if busy is not None:
        raise NotExportable(
            f"{subject(busy)} ({spec.quant}) is already running: follow it with the export flow "
            f"(run_id={run_id}, export_id={busy.id})"
        )
    place = await target_named(target or run.target, logger)
    run_dir = runs.run_dir(run_id)
    trainer = ExportTrainer(run, run_dir, spec, cpu_threads=place.cpu_threads)
    need = log_disk(f"run {run_id}", run_dir / OUTPUT_DIR, trainer)
    job = export_job(
        exports,
        trainer,
        spec.model_dump(mode="json"),
        trainer.base_model or str(run_dir / OUTPUT_DIR),  # full weights: no merge
        place.python,
        what=f"the {spec.quant} export of run {run_id}",
        parent=run_id,
        subdir="exports",
        disk_bytes=need.total - need.base if need is not None else None,  # in the run dir
    )
    finished = await run_new(place, job, logger)
    return await finish_export(exports, finished.outcome, finished.where)
