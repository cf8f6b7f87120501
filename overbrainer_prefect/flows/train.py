"""The run flows: `train`, `attach`, `stop` and `cancel`.

Each works from `run.json` alone once a run exists, so any of them can pick a
run up in another process, on another worker, another day. The steps
themselves live in `overbrainer_prefect.runs`; these flows add what Prefect
shows: logs, progress, a metrics table and a run summary.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import State
from prefect.runtime import flow_run
from prefect.states import Cancelled
from pydantic import BaseModel, Field

from overbrainer_prefect.artifacts import (
    PrefectReporter,
    live_progress,
    next_step,
    publish_metrics_table,
    publish_summary,
    summary_markdown,
)
from overbrainer_prefect.blocks import RunpodTarget, TargetBlock
from overbrainer_prefect.executors.base import Executor
from overbrainer_prefect.flows.hooks import on_cancelled, on_crashed
from overbrainer_prefect.flows.targets import load_target
from overbrainer_prefect.runs import lifecycle
from overbrainer_prefect.runs.lifecycle import Outcome, RunContext, RunError
from overbrainer_prefect.runs.lock import RunBusy, follow_lock, holder_of, is_followed
from overbrainer_prefect.runs.resume import resume_path, resume_point, stage_checkpoint
from overbrainer_prefect.runs.store import RunRecord, Runs, RunState, subject
from overbrainer_prefect.trainers.axolotl import AxolotlTrainer
from overbrainer_prefect.trainers.base import Trainer
from overbrainer_prefect.trainers.export import ExportSpec
from overbrainer_prefect.trainers.spec import TrainingSpec

if TYPE_CHECKING:
    from overbrainer_prefect.flows.export import ExportResult


class RunFailed(Exception):
    """A run ended failed; the message says why and what to do next."""


class FileEntry(BaseModel):
    """A retrieved file, verified by SHA-256."""

    path: str
    size: int
    sha256: str


class RunResult(BaseModel):
    """What a run flow returns (and Prefect persists): how the run ended."""

    run_id: str
    state: RunState
    target: str
    message: str | None = None
    steps: int = 0
    first_loss: float | None = None
    final_loss: float | None = None
    retrieved: bool = False
    files: list[FileEntry] = Field(default_factory=list)
    run_dir: str
    next: str
    export_id: str | None = Field(default=None, description="The export made after training.")
    gguf: FileEntry | None = Field(
        default=None, description="Its GGUF, the path relative to the run directory."
    )


def trainer_of(record: RunRecord, block: TargetBlock) -> AxolotlTrainer:
    """The trainer of a run, rebuilt from its record. Raises RunError when the
    record holds no training spec."""
    if record.spec is None:
        raise RunError(f"run {record.id} has no training spec in its record: it cannot be followed")
    spec = TrainingSpec.model_validate(record.spec)
    resume = resume_path(record.resumed_from) if record.resumed_from else None
    return AxolotlTrainer(spec, resume_from=resume, cpu_threads=block.cpu_threads)


def run_context(runs: Runs, block: TargetBlock, executor: Executor, reporter: Any) -> RunContext:
    """The context of the steps of a run (or of an export, with `runs` its run's
    exports) on the target `block`: its executor, where progress goes, its bounds."""
    return RunContext(
        runs=runs,
        executor=executor,
        reporter=reporter,
        python=block.python,
        poll_s=block.poll_seconds,
        max_hours=block.max_hours,
        stall_s=block.stall_minutes * 60,
    )


@task(name="create-run", cache_policy=NO_CACHE, persist_result=False)
async def create_run(
    runs: Runs, target_ref: str, block: TargetBlock, training: TrainingSpec
) -> RunRecord:
    """Creates the run's record, `preparing`."""
    executor = block.executor(target_ref)
    record = lifecycle.create(
        runs,
        target=target_ref,
        target_kind=block.kind,
        workdir=executor.workdir,
        spec=training.model_dump(mode="json"),
        flow_run_id=flow_run.id,
    )
    get_run_logger().info(
        "run %s created on %s (files in %s)",
        record.id,
        executor.description,
        runs.run_dir(record.id),
    )
    return record


@task(name="start-job", cache_policy=NO_CACHE, persist_result=False)
async def start_job(
    ctx: RunContext, trainer: Trainer, record: RunRecord, block: TargetBlock
) -> RunRecord:
    """Checks the target, uploads the run (or export) and starts its job."""
    record = await lifecycle.start(ctx, trainer, record, block.secrets())
    get_run_logger().info(
        "%s: job started on %s (pid %s), deadline %s",
        subject(record),
        ctx.executor.description,
        record.job.pid if record.job else "?",
        record.deadline,
    )
    return record


@task(name="follow-job", cache_policy=NO_CACHE, persist_result=False)
async def follow_job(ctx: RunContext, trainer: Trainer, record: RunRecord) -> Outcome:
    """Follows the job to its end, then retrieves and verifies its files."""
    async with live_progress(ctx.reporter):
        return await lifecycle.watch(ctx, trainer, record)


async def _finish(
    runs: Runs,
    outcome: Outcome,
    where: str,
    *,
    cancelling: bool = False,
    exported: ExportResult | str | None = None,
) -> RunResult | State[Any]:
    """Publishes the metrics table and the run summary, and turns the outcome into
    the flow's result: failed runs fail the flow, cancelled ones cancel it (unless
    this flow is the one that cancelled them). `exported` is the export made after
    training (its GGUF joins the summary and the result), or why it failed (the
    flow then fails, the run staying succeeded)."""
    from overbrainer_prefect.flows.export import gguf_markdown

    record = outcome.record
    logger = get_run_logger()
    await publish_metrics_table(record.id, outcome.summary)
    step = next_step(record)
    markdown = summary_markdown(record, where, outcome.summary, outcome.files, step)
    if isinstance(exported, str):
        markdown += f"\n## GGUF\n\nThe export failed: {exported}\n"
    elif exported is not None:
        markdown += gguf_markdown(record.id, exported)
    await publish_summary(record.id, markdown)
    result = RunResult(
        run_id=record.id,
        state=record.state,
        target=record.target,
        message=record.message,
        steps=outcome.summary.last.step if outcome.summary.last else 0,
        first_loss=outcome.summary.first_loss,
        final_loss=outcome.summary.final_loss,
        retrieved=outcome.retrieved,
        files=[FileEntry(path=f.path, size=f.size, sha256=f.sha256) for f in outcome.files],
        run_dir=str(runs.run_dir(record.id)),
        next=step,
    )
    if isinstance(exported, str):
        raise RunFailed(exported)
    if exported is not None and exported.gguf is not None:
        result.export_id = exported.export_id
        result.gguf = exported.gguf.model_copy(
            update={"path": f"exports/{exported.export_id}/{exported.gguf.path}"}
        )
    if record.state == RunState.FAILED:
        raise RunFailed(f"run {record.id} failed: {record.message}")
    if record.state == RunState.CANCELLED and not cancelling:
        return Cancelled(message=f"run {record.id} was cancelled", data=result)
    logger.info(
        "run %s %s: %d steps, final loss %s, %d files verified. %s",
        record.id,
        record.state,
        result.steps,
        result.final_loss,
        len(result.files),
        step,
    )
    return result


@flow(name="train", persist_result=True, on_cancellation=[on_cancelled], on_crashed=[on_crashed])
async def train(
    target: str,
    training: TrainingSpec | None = None,
    resume_from: str | None = None,
    runs_dir: str | None = None,
    export: ExportSpec | None = None,
) -> RunResult | State[Any]:
    """Fine-tunes a model with axolotl on `target` (a target block's name): creates
    a run, starts its job, follows it live, then retrieves and verifies its files.

    `resume_from` names a stopped run whose checkpoint the new run starts from
    (its training spec is reused when `training` is not given). With `export`, a
    succeeded run is then exported to a GGUF on the same target (the `export`
    flow, as a subflow), which joins the run's summary and result. Fails before
    any run exists when the target block or a dataset file is missing; fails with
    the run's message when its job fails, or the export's when it fails.
    """
    runs = Runs(runs_dir)
    target_ref, block = await load_target(target)
    point = None
    if resume_from is not None:
        stopped = runs.load(resume_from)
        point = resume_point(runs, stopped)
        if training is None and stopped.spec is not None:
            training = TrainingSpec.model_validate(stopped.spec)
    if training is None:
        raise ValueError("give the training spec (training=...), or a stopped run to resume_from")
    training.check_local_files()
    if isinstance(block, RunpodTarget):
        from overbrainer_prefect.flows.runpod import train_on_pod

        return await train_on_pod(runs, target_ref, block, training, point, export, runs_dir)
    record = await create_run(runs, target_ref, block, training)
    resume = None
    if point is not None:
        resume = stage_checkpoint(runs, point, record)
        record.resumed_from = point
        runs.save(record)
    trainer = AxolotlTrainer(training, resume_from=resume, cpu_threads=block.cpu_threads)
    executor = block.executor(target_ref)
    try:
        with follow_lock(runs.run_dir(record.id), flow_run.id):
            ctx = run_context(runs, block, executor, PrefectReporter(get_run_logger(), record.id))
            record = await start_job(ctx, trainer, record, block)
            outcome = await follow_job(ctx, trainer, record)
            if export is None or outcome.record.state != RunState.SUCCEEDED:
                return await _finish(runs, outcome, executor.description)
        exported = await _export_after(outcome.record.id, export, runs_dir)
        return await _finish(runs, outcome, executor.description, exported=exported)
    finally:
        await executor.close()


async def _export_after(run_id: str, spec: ExportSpec, runs_dir: str | None) -> ExportResult | str:
    """Exports a run that just succeeded (the `export` flow, as a subflow); returns
    its result, or one line saying why it failed and how to export again."""
    from overbrainer_prefect.flows.export import ExportResult
    from overbrainer_prefect.flows.export import export as export_flow

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


async def _load(run_id: str, runs_dir: str | None) -> tuple[Runs, RunRecord, TargetBlock]:
    runs = Runs(runs_dir)
    record = runs.load(run_id)
    _, block = await load_target(record.target)
    return runs, record, block


@flow(name="attach", persist_result=True, on_cancellation=[on_cancelled], on_crashed=[on_crashed])
async def attach(run_id: str, runs_dir: str | None = None) -> RunResult | State[Any]:
    """Follows a started run again (after its first follower died, or its files
    could not be retrieved) until its job ends, then retrieves and verifies its
    files. For a run already ended whose files were not retrieved, retrieves
    them again. Touches nothing for an unknown or invalid run ID."""
    runs, record, block = await _load(run_id, runs_dir)
    if isinstance(block, RunpodTarget):
        from overbrainer_prefect.flows.runpod import attach_on_pod

        return await attach_on_pod(runs, record, block)
    executor = block.executor(record.target)
    try:
        trainer = trainer_of(record, block)
        ctx = run_context(runs, block, executor, PrefectReporter(get_run_logger(), record.id))
        try:
            with follow_lock(runs.run_dir(record.id), flow_run.id):
                record = runs.load(run_id)  # as the last follower left it
                if record.state.ended and lifecycle.artifacts_missing(record):
                    record, _ = await lifecycle.collect(ctx, trainer, record)
                outcome = await follow_job(ctx, trainer, record)
                return await _finish(runs, outcome, executor.description)
        except RunBusy as busy:
            raise RunError(
                f"run {run_id} is already followed by {busy.holder}: it records the outcome; "
                "attach again only once that follower has ended"
            ) from None
    finally:
        await executor.close()


@flow(name="stop", persist_result=True)
async def stop(run_id: str, runs_dir: str | None = None) -> RunResult | State[Any]:
    """Asks a running job to save a resumable checkpoint and stop, then follows it
    to its end and retrieves its files (checkpoint included). Resume it with the
    `train` flow and `resume_from=<run_id>`."""
    runs, record, block = await _load(run_id, runs_dir)
    if isinstance(block, RunpodTarget):
        from overbrainer_prefect.flows.runpod import stop_on_pod

        return await stop_on_pod(runs, record, block)
    executor = block.executor(record.target)
    try:
        trainer = trainer_of(record, block)
        ctx = run_context(runs, block, executor, PrefectReporter(get_run_logger(), record.id))
        await lifecycle.request_stop(ctx, record)
        logger = get_run_logger()
        logger.info("run %s: asked its job for a checkpoint and a stop", run_id)
        try:
            with follow_lock(runs.run_dir(run_id), flow_run.id):
                outcome = await follow_job(ctx, trainer, runs.load(run_id))
                return await _finish(runs, outcome, executor.description)
        except RunBusy as busy:
            logger.info(
                "run %s is followed by %s, which will record the stop and retrieve the "
                "checkpoint; resume it afterwards with the train flow (resume_from=%s)",
                run_id,
                busy.holder,
                run_id,
            )
            return await _wait_for_end(runs, run_id, executor)
    finally:
        await executor.close()


@flow(name="cancel", persist_result=True)
async def cancel(run_id: str, runs_dir: str | None = None) -> RunResult | State[Any]:
    """Cancels the job of a run (its whole process group), records it
    `cancelled`, and retrieves what it left, best effort."""
    runs, record, block = await _load(run_id, runs_dir)
    if isinstance(block, RunpodTarget):
        from overbrainer_prefect.flows.runpod import cancel_on_pod

        return await cancel_on_pod(runs, record, block)
    executor = block.executor(record.target)
    try:
        trainer = trainer_of(record, block)
        ctx = run_context(runs, block, executor, PrefectReporter(get_run_logger(), record.id))
        if is_followed(runs.run_dir(run_id)) and record.job is not None:
            # its follower sees the cancel, records it and retrieves what the job left
            await executor.cancel(record.job)
            get_run_logger().info(
                "run %s: job cancelled; its follower (%s) records it",
                run_id,
                holder_of(runs.run_dir(run_id)),
            )
            return await _wait_for_end(runs, run_id, executor, cancelling=True)
        record, status, retrieved = await lifecycle.cancel(ctx, trainer, record)
        if status.kind != "cancelled":
            raise RunError(
                f"run {run_id}: its job had already ended ({status}), so nothing was cancelled; "
                f"follow it with the attach flow (run_id={run_id}) to record its outcome"
            )
        outcome = await lifecycle.watch(ctx, trainer, record)
        outcome.retrieved = retrieved
        get_run_logger().info(
            "run %s cancelled; its files were %sretrieved", run_id, "" if retrieved else "not "
        )
        return await _finish(runs, outcome, executor.description, cancelling=True)
    finally:
        await executor.close()


FOLLOWER_WAIT_S = 300.0  # how long stop and cancel wait for another follower to record the end


async def _wait_for_end(
    runs: Runs, run_id: str, executor: Executor, *, cancelling: bool = False
) -> RunResult | State[Any]:
    """Waits (bounded) until the run's other follower has recorded its end, and
    reports that outcome; past the bound, says the run is still followed."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + FOLLOWER_WAIT_S
    while loop.time() < deadline:
        record = runs.load(run_id)
        if record.state.ended and not is_followed(runs.run_dir(run_id)):
            outcome = await lifecycle.watch(
                RunContext(runs=runs, executor=executor), _record_trainer(record), record
            )
            return await _finish(runs, outcome, executor.description, cancelling=cancelling)
        await asyncio.sleep(1.0)
    raise RunError(
        f"run {run_id} is still followed by {holder_of(runs.run_dir(run_id))} after "
        f"{FOLLOWER_WAIT_S:g} s; see its flow run for the outcome"
    )


def _record_trainer(record: RunRecord) -> AxolotlTrainer:
    """The trainer of an ended run, for reading its local files."""
    if record.spec is None:
        raise RunError(f"run {record.id} has no training spec in its record")
    return AxolotlTrainer(TrainingSpec.model_validate(record.spec))
