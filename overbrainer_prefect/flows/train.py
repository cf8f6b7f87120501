"""The run flows: `train` (a fine-tune with axolotl on a target), `attach`
(follow a started run again), `stop` (a checkpoint, then its end) and
`cancel`. The driver (`flows/driver.py`) runs the job; its kind
(`kinds/training.py`) says what it checks first, asks and returns."""

from __future__ import annotations

import asyncio

from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from overbrainer_prefect.artifacts import publish_metrics_table, publish_summary, summary_markdown
from overbrainer_prefect.blocks import target_named
from overbrainer_prefect.driver import HOOKS, finish, follow_again, reporter_for, run_new
from overbrainer_prefect.flows.export import export as export_flow
from overbrainer_prefect.flows.results import AnyState, RunFailed, ended
from overbrainer_prefect.kinds.base import Finished, NewJob
from overbrainer_prefect.kinds.export import ExportResult, gguf_markdown
from overbrainer_prefect.kinds.files import FileEntry
from overbrainer_prefect.kinds.registry import recorded_end, trainer_of
from overbrainer_prefect.kinds.training import NAME as TRAINING
from overbrainer_prefect.kinds.training import (
    LostRun,
    RunResult,
    check_before_anything,
    go_on_after_lost_machines,
    lost_markdown,
    next_step,
    result_line,
    result_of,
    resume_point,
    resumed_spec,
    stage_checkpoint,
)
from overbrainer_prefect.runs.lock import RunBusy, follow_lock, holder_of, is_followed
from overbrainer_prefect.runs.store import ResumedFrom, RunRecord, Runs, RunState
from overbrainer_prefect.runs_dir import runs_at
from overbrainer_prefect.steps import end as end_step
from overbrainer_prefect.steps.context import Outcome
from overbrainer_prefect.steps.errors import RunError
from overbrainer_prefect.targets.base import JobNeed, Target
from overbrainer_prefect.targets.spend import spent
from overbrainer_prefect.trainers.axolotl import AxolotlTrainer
from overbrainer_prefect.trainers.export import ExportSpec
from overbrainer_prefect.trainers.spec import TrainingSpec
from overbrainer_prefect.trainers.uploads import Upload, fetched_spec

__all__ = ["FileEntry", "RunFailed", "RunResult", "attach", "cancel", "stop", "train"]


async def run_result(
    runs: Runs,
    outcome: Outcome,
    where: str,
    *,
    cancelling: bool = False,
    exported: ExportResult | str | None = None,
    lost: list[LostRun] | None = None,
) -> RunResult | AnyState:
    """Publishes the metrics table and the run summary, and turns the outcome into
    the flow's result: failed runs fail the flow, cancelled ones cancel it (unless
    this flow is the one that cancelled them). `exported` is the export made after
    training (its GGUF joins the summary and the result), or why it failed (the
    flow then fails, the run staying succeeded)."""
    record = outcome.record
    await publish_metrics_table(record.id, outcome.summary)
    dollars = spent(runs, record)  # what its place cost (issue 20)
    step = next_step(record)
    markdown = summary_markdown(record, where, outcome.summary, outcome.files, step, dollars)
    if lost:
        markdown += lost_markdown(runs, lost, record, where, dollars)
    if isinstance(exported, str):
        await publish_summary(record.id, markdown + f"\n## GGUF\n\nThe export failed: {exported}\n")
        raise RunFailed(exported)
    if exported is not None:
        markdown += gguf_markdown(record.id, exported)
    await publish_summary(record.id, markdown)
    result = result_of(runs, outcome, exported)
    return ended(record, result, cancelling=cancelling, line=result_line(result))


@flow(name="train", persist_result=True, **HOOKS)
async def train(
    target: str,
    training: TrainingSpec | None = None,
    resume_from: str | None = None,
    runs_dir: str | None = None,
    export: ExportSpec | None = None,
    bounds: dict[str, float] | None = None,
    uploads: list[Upload] | None = None,
) -> RunResult | AnyState:
    """Fine-tunes a model with axolotl on `target` (a target block's name): creates
    a run, starts its job, follows it live, then retrieves and verifies its files.

    `resume_from` names a stopped run whose checkpoint the new run starts from
    (its training spec is reused when `training` is not given). With `export`, a
    succeeded run is then exported to a GGUF on the same target (the `export`
    flow, as a subflow), which joins the run's summary and result. `bounds`
    (`max_hours`, `max_cost_usd`) replace the target block's own for this run.
    `uploads` are the local datasets and base model folder of `training` as
    the machine that asked for the run put them into the runs directory
    (`trainers.uploads`, e.g. `axolotl train --cloud` with a deployment): they
    are read from there, each file checked by SHA-256, instead of the paths
    `training` names. Fails before
    any run exists when the target block or a dataset file is missing; fails with
    the run's message when its job fails, or the export's when it fails.
    """
    runs = await runs_at(runs_dir)
    logger = get_run_logger()
    place = await target_named(target, logger, bounds)
    point = None
    if resume_from is not None:
        stopped = runs.load(resume_from)
        point = resume_point(runs, stopped)
        training = resumed_spec(runs, stopped, training)
    if training is None:
        raise ValueError("give the training spec (training=...), or a stopped run to resume_from")
    spec = training
    if uploads:
        spec = await asyncio.to_thread(fetched_spec, runs, spec, uploads)
    await check_before_anything(spec, place, logger)
    finished = await run_new(place, _training_job(runs, place, spec, point), logger)

    async def again(
        spec: TrainingSpec, point: ResumedFrom | None, attempt: int, usd: float
    ) -> Finished:
        return await run_new(place, _training_job(runs, place, spec, point, attempt, usd), logger)

    finished, lost = await go_on_after_lost_machines(runs, place, finished, logger, again)
    outcome = finished.outcome
    if export is None or outcome.record.state != RunState.SUCCEEDED:
        return await run_result(runs, outcome, finished.where, lost=lost)
    exported = await _export_after(outcome.record.id, export, runs_dir)
    return await run_result(runs, outcome, finished.where, exported=exported, lost=lost)


def _training_job(
    runs: Runs,
    place: Target,
    spec: TrainingSpec,
    point: ResumedFrom | None,
    attempt: int = 0,
    spent_usd: float = 0.0,
) -> NewJob:
    """A training job on `place`, from the checkpoint of `point` when given
    (`spent_usd`: what its lost machines cost, which its cost cap counts)."""

    def prepare(record: RunRecord) -> AxolotlTrainer:
        resume = None
        if point is not None:
            resume = stage_checkpoint(runs, point, record)
            record.resumed_from = point
            runs.save(record)
        return AxolotlTrainer(spec, resume_from=resume, cpu_threads=place.cpu_threads)

    return NewJob(
        store=runs,
        need=JobNeed(what="the run", training=spec, spent_usd=spent_usd),
        kind=TRAINING,
        prepare=prepare,
        spec=spec.model_dump(mode="json"),
        attempt=attempt,
    )


async def _export_after(run_id: str, spec: ExportSpec, runs_dir: str | None) -> ExportResult | str:
    """Exports a run that just succeeded (the `export` flow, as a subflow); returns
    its result, or one line saying why it failed and how to export again."""
    again = f"export it again with the export flow (run_id={run_id}, quant={spec.quant})"
    try:
        exported = await export_flow(
            run_id=run_id,
            quant=spec.quant,
            runs_dir=runs_dir,
            keep_intermediate=spec.keep_intermediate,
        )
    except Exception as error:
        return f"run {run_id} succeeded, but its export failed: {error}; {again}"
    if not isinstance(exported, ExportResult) or exported.gguf is None:
        return f"run {run_id} succeeded, but its export brought back no GGUF; {again}"
    return exported


@flow(name="attach", persist_result=True, **HOOKS)
async def attach(run_id: str, runs_dir: str | None = None) -> RunResult | AnyState:
    """Follows a started run again (after its first follower died, or its files
    could not be retrieved) until its job ends, then retrieves and verifies its
    files and ends what it ran on. For a run already ended whose files were not
    retrieved, retrieves them again; for one whose job never started, deletes
    what its target holds for it and records it failed. Touches nothing for an
    unknown or invalid run ID."""
    runs = await runs_at(runs_dir)
    record = runs.load(run_id)
    finished = await follow_again(runs, runs, record, get_run_logger())
    return await run_result(runs, finished.outcome, finished.where)


@flow(name="stop", persist_result=True)
async def stop(run_id: str, runs_dir: str | None = None) -> RunResult | AnyState:
    """Asks a running job to save a resumable checkpoint and stop, then follows it
    to its end and retrieves its files (checkpoint included). Resume it with the
    `train` flow and `resume_from=<run_id>`."""
    runs = await runs_at(runs_dir)
    record = runs.load(run_id)
    logger = get_run_logger()
    place = await target_named(record.target, logger)
    trainer = trainer_of(runs, record, place.cpu_threads)
    async with place.reach(runs, record) as placed:
        if placed is None:
            raise RunError(f"run {run_id} has nothing left to run on: nothing to stop")
        await end_step.request_stop(placed.context(runs, reporter_for(record, logger)), record)
    logger.info("run %s: asked its job for a checkpoint and a stop", run_id)
    try:
        with follow_lock(runs, run_id, flow_run.id):
            record = runs.load(run_id)
            finished = await finish(place, runs, record, trainer, logger)
            return await run_result(runs, finished.outcome, finished.where)
    except RunBusy as busy:
        logger.info(
            "run %s is followed by %s, which will record the stop and retrieve the "
            "checkpoint; resume it afterwards with the train flow (resume_from=%s)",
            run_id,
            busy.holder,
            run_id,
        )
        return await _wait_for_end(runs, run_id, place.ref)


@flow(name="cancel", persist_result=True)
async def cancel(run_id: str, runs_dir: str | None = None) -> RunResult | AnyState:
    """Cancels the job of a run (its whole process group), records it
    `cancelled`, retrieves what it left, best effort, and ends what it ran on.
    A run whose job never started has what its target holds deleted and is
    recorded failed; one whose job had already ended is recorded as it ended."""
    runs = await runs_at(runs_dir)
    record = runs.load(run_id)
    logger = get_run_logger()
    if is_followed(runs, run_id) and record.job is not None:
        # its follower sees the cancel, records it, retrieves what the job left
        place = await target_named(record.target, logger)
        async with place.reach(runs, record) as placed:
            if placed is not None:
                await placed.executor.cancel(record.job)
        logger.info(
            "run %s: job cancelled; its follower (%s) records it",
            run_id,
            holder_of(runs, run_id),
        )
        return await _wait_for_end(runs, run_id, place.ref, cancelling=True)
    finished = await follow_again(runs, runs, record, logger, cancel=True)
    if not finished.cancelled and record.job is not None:
        raise RunError(
            f"run {run_id}: its job had already ended, so nothing was cancelled; it is recorded "
            f"{finished.outcome.record.state} ({finished.outcome.record.message or 'no message'})"
        )
    logger.info(
        "run %s %s; its files were %sretrieved",
        run_id,
        finished.outcome.record.state,
        "" if finished.outcome.retrieved else "not ",
    )
    return await run_result(runs, finished.outcome, finished.where, cancelling=True)


async def _wait_for_end(
    runs: Runs, run_id: str, where: str, *, cancelling: bool = False
) -> RunResult | AnyState:
    """Waits (bounded) until the run's other follower has recorded its end, and
    reports that outcome; past the bound, says the run is still followed."""
    outcome = await recorded_end(runs, run_id)
    return await run_result(runs, outcome, where, cancelling=cancelling)
