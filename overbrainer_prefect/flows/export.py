"""The export flow: a succeeded run's model as one verified GGUF file.

The export runs on a target like any job (the run's own target by default):
the run's model and config are staged into `runs/<run-id>/exports/<export-id>/`,
copied to the target, merged, converted and quantized there by llama.cpp, and
the GGUF brought back and checked against the target's SHA-256 manifest. Its
record, `export.json`, follows the same rules as a run's, so `export` with an
`export_id` follows it again from any process. An export of the same run and
quant type that already succeeded is reused, not made again (`kinds/export.py`).
"""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.artifacts import acreate_markdown_artifact

from overbrainer_prefect.blocks import target_named
from overbrainer_prefect.driver import HOOKS, follow_again, run_new
from overbrainer_prefect.flows.results import AnyState, ended
from overbrainer_prefect.kinds.export import NAME as EXPORT
from overbrainer_prefect.kinds.export import (
    ExportResult,
    check_exportable,
    result_line,
    result_of,
    reused_export,
    run_export,
    summary_markdown,
)
from overbrainer_prefect.runs.store import Runs, subject
from overbrainer_prefect.runs_dir import runs_at
from overbrainer_prefect.steps.context import Outcome
from overbrainer_prefect.trainers.export import DEFAULT_QUANT, ExportSpec, check_quant


async def finish_export(
    exports: Runs, outcome: Outcome, where: str, *, cancelling: bool = False
) -> ExportResult | AnyState:
    """Publishes the export summary (`export-<id>-summary`) and turns the
    outcome into the flow's result: a failed export fails the flow, a cancelled
    one cancels it."""
    record = outcome.record
    result = result_of(exports, record, outcome.files)
    await acreate_markdown_artifact(
        markdown=summary_markdown(result, where, record),
        key=f"export-{record.id}-summary".lower(),
        description=f"Summary of export {record.id}",
    )
    return ended(record, result, cancelling=cancelling, line=result_line(result, record))


@flow(name="export", persist_result=True, **HOOKS)
async def export(
    run_id: str,
    quant: str = DEFAULT_QUANT,
    target: str | None = None,
    runs_dir: str | None = None,
    export_id: str | None = None,
    keep_intermediate: bool = False,
) -> ExportResult | AnyState:
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
    runs = await runs_at(runs_dir)
    logger = get_run_logger()
    exports = runs.children(run_id, EXPORT)
    if export_id is not None:
        finished = await follow_again(runs, exports, exports.load(export_id), logger)
        return await finish_export(exports, finished.outcome, finished.where)
    spec = ExportSpec(quant=check_quant(quant), keep_intermediate=keep_intermediate)
    run = runs.load(run_id)
    check_exportable(runs, run)
    reused = reused_export(exports, run_id, spec.quant)
    if reused is not None:
        done, result = reused
        logger.info(
            "reused %s (%s), which succeeded on %s: nothing exported again",
            subject(done),
            spec.quant,
            done.ended,
        )
        logger.info("%s", result_line(result, done))
        return result
    place = await target_named(target or run.target, logger)
    job = run_export(runs, run, spec, place.python, place.cpu_threads, logger)
    finished = await run_new(place, job, logger)
    return await finish_export(exports, finished.outcome, finished.where)
