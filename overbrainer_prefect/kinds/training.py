"""A training run: axolotl fine-tunes a model, `<runs dir>/<id>/run.json`.
Its result (what the train flow returns and Prefect persists), resuming a
stopped run (its checkpoint becomes the start of a new run, trained on the
run's own copy of its data, from any working directory), and how its trainer
is made again from its record."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath

from pydantic import Field

from overbrainer_prefect.executors.base import FileDigest
from overbrainer_prefect.executors.nodes import node_dir, node_rank
from overbrainer_prefect.kinds.base import Finished, JobKind, JobResult
from overbrainer_prefect.kinds.export import ExportResult
from overbrainer_prefect.kinds.files import FileEntry
from overbrainer_prefect.runs.checkpoints import (
    KeptCheckpoint,
    in_checkpoint,
    last_kept,
    load_kept,
)
from overbrainer_prefect.runs.manifest import load_manifest
from overbrainer_prefect.runs.store import ResumedFrom, RunRecord, Runs, RunsError, RunState
from overbrainer_prefect.steps.context import Outcome
from overbrainer_prefect.steps.errors import RunError
from overbrainer_prefect.store import StoreError
from overbrainer_prefect.store.records import RecordError
from overbrainer_prefect.targets.base import Logger, Target
from overbrainer_prefect.targets.spend import spent
from overbrainer_prefect.trainers.axolotl import AxolotlTrainer, data_copies, launch_summary
from overbrainer_prefect.trainers.base import TargetFacts, Trainer, TrainError
from overbrainer_prefect.trainers.holdout import holdout_problem
from overbrainer_prefect.trainers.preflight import preflight
from overbrainer_prefect.trainers.spec import DatasetSpec, TrainingSpec
from overbrainer_prefect.trainers.staging import StoredInput, stage_on_volume, stage_stored

NAME = "training"
"""A training run's records: `<runs dir>/<id>/run.json`."""

RESUME_DIR = "resume"
"""Where a resumed run's starting checkpoint sits in its run directory."""


def resume_point(runs: Runs, stopped: RunRecord) -> ResumedFrom:
    """The checkpoint a new run can resume from: the one the stopped run saved,
    retrieved and verified in its local directory; for a failed run (one
    lost with its machine, not gone on), its last checkpoint kept in the
    store while it trained.

    Raises RunError with one line when the run did not stop with a checkpoint
    (nor failed with one kept) or the checkpoint is not here.
    """
    if stopped.state == RunState.FAILED:
        point = lost_point(runs, stopped)
        if point is not None:
            return point
    if stopped.state != RunState.STOPPED or not stopped.checkpoint:
        raise RunError(
            f"run {stopped.id} is {stopped.state}, not stopped with a checkpoint nor failed with "
            "one kept: only a run stopped with the stop flow, or lost with its machine once a "
            "checkpoint was kept, can be resumed"
        )
    checkpoint = PurePosixPath(stopped.checkpoint)
    if checkpoint.is_absolute() or ".." in checkpoint.parts:
        raise RunError(f"run {stopped.id} names an invalid checkpoint: it cannot be resumed")
    if not _checkpoint_files(runs, stopped.id, str(checkpoint))[0]:
        raise RunError(
            f"the checkpoint {checkpoint} of run {stopped.id} is not in "
            f"{runs.where_of(stopped.id)}: retrieve it with the attach flow (run_id={stopped.id})"
        )
    step_text = checkpoint.name.rpartition("-")[2]
    return ResumedFrom(
        run_id=stopped.id,
        checkpoint=str(checkpoint),
        step=int(step_text) if step_text.isdigit() else 0,
    )


def _checkpoint_files(
    runs: Runs, run_id: str, checkpoint: str
) -> tuple[list[FileDigest], KeptCheckpoint | None]:
    """The files of a run's checkpoint (across nodes, every node's part: the
    others' under `nodes/<rank>/`) as its verified manifest lists them, or,
    when its files were never retrieved (its machine was lost), as they were
    verified when it was kept while the job trained; with, for one kept on a
    network volume (not in the store), how it was kept there."""
    listed = [
        entry for entry in load_manifest(runs, run_id) if in_checkpoint(entry.path, checkpoint)
    ]
    if listed:
        return listed, None
    kept = [
        p
        for p in load_kept(runs, run_id).checkpoints
        if p.path.rstrip("/") == checkpoint.rstrip("/")
    ]
    on_volume = kept[-1] if kept and kept[-1].volume is not None and kept[-1].remote else None
    files = [f.digest() for point in kept for f in point.files if in_checkpoint(f.path, checkpoint)]
    return files, on_volume


def lost_point(runs: Runs, lost: RunRecord) -> ResumedFrom | None:
    """Where a run lost with its machine goes on from: its last checkpoint
    kept in the store while it trained; when it kept none (lost before its
    first), the checkpoint it started from itself; None when it started from
    step 0 and kept none: it starts again from step 0."""
    kept = last_kept(runs, lost.id)
    if kept is None:
        return lost.resumed_from
    return ResumedFrom(run_id=lost.id, checkpoint=kept.path, step=kept.step)


FROM_STEP_0 = "step 0 (no checkpoint was kept before the loss)"
"""Where a training lost before its first checkpoint went on from."""


def stage_checkpoint(runs: Runs, point: ResumedFrom, record: RunRecord) -> str:
    """Stages the checkpoint of `point` in the new run `record`'s directory
    (from the runs' store: hard links from a local one, fetched by the job from
    an object store; one kept on a network volume and never retrieved, linked
    in by the job from there) and returns its path there, relative to the run
    directory (what the trainer resumes from). Across nodes, each other
    node's part is staged under `nodes/<rank>/` at that path, which the
    upload puts in that node's run directory alone (`executors.nodes`).
    Raises TrainError when a file of it is not in the store."""
    relative = resume_path(point)
    again = f"retrieve it with the attach flow (run_id={point.run_id})"
    local = runs.run_dir(record.id)
    files, on_volume = _checkpoint_files(runs, point.run_id, point.checkpoint)
    start = len(point.checkpoint.rstrip("/")) + 1
    if on_volume is not None:
        linked = [
            StoredInput(
                path=f"{relative}/{entry.path[start:]}",
                source=f"{on_volume.remote}/{entry.path[start:]}",
                size=entry.size,
                sha256=entry.sha256,
            )
            for entry in files
        ]
        stage_on_volume(local, linked)
        return relative
    for entry in files:
        own = node_dir(node_rank(entry.path))  # a node's part goes to its own nodes/<rank>/
        inside = entry.path[len(own) + start :]
        key = runs.key(point.run_id, entry.path)
        missing = f"{runs.store.where(key)} is missing: {again}"
        staged = f"{own}{relative}/{inside}"
        stage_stored(runs, key, local, staged, entry.size, entry.sha256, missing)
    return relative


def resume_path(point: ResumedFrom) -> str:
    """Where `stage_checkpoint` puts the checkpoint of `point`, relative to the new
    run's directory: what its trainer resumes from."""
    return f"{RESUME_DIR}/{PurePosixPath(point.checkpoint).name}"


def resumed_spec(
    runs: Runs, stopped: RunRecord, training: TrainingSpec | None = None
) -> TrainingSpec:
    """The training spec a run resuming `stopped` trains with: `training`, or the
    stopped run's own, with every local dataset the stopped run uploaded read
    from its copy in the stopped run's directory (`<runs>/<id>/data/...`, an
    absolute path), so that the resume works from any working directory and on
    any worker that sees the runs directory. A dataset `training` names that
    the stopped run did not carry is left as it is.

    Raises RunError with one line when neither spec is there.
    """
    if stopped.spec is None and training is None:
        raise RunError(
            f"run {stopped.id} has no training spec in its record: give the training spec"
        )
    original = TrainingSpec.model_validate(stopped.spec) if stopped.spec is not None else None
    spec = training if training is not None else original
    assert spec is not None
    copies: dict[str, str] = {}
    if original is not None:
        local = runs.run_dir(stopped.id)
        for dataset, relative in zip(original.local_datasets(), data_copies(original), strict=True):
            if _here(runs, stopped.id, relative):
                copies[dataset.path] = str(local / relative)
    if not copies:
        return spec
    datasets = [
        DatasetSpec.model_validate(d.model_dump() | {"path": copies[d.path]})
        if d.is_local and d.path in copies
        else d
        for d in spec.datasets
    ]
    return spec.model_copy(update={"datasets": datasets})


def _here(runs: Runs, run_id: str, relative: str) -> bool:
    """Whether the file `relative` of the run is on this machine: in its local
    runs directory, or fetched from its object store into this process's
    staging directory (a dataset: the user's rows, not a model)."""
    path = runs.run_dir(run_id) / relative
    if runs.store.local_path(runs.key(run_id, relative)) is not None or path.exists():
        return path.exists()
    try:
        runs.store.get_file(runs.key(run_id, relative), path)
    except (FileNotFoundError, StoreError):
        return False
    return True


class RunResult(JobResult):
    """What a run flow returns (and Prefect persists): how the run ended."""

    steps: int = 0
    first_loss: float | None = None
    final_loss: float | None = None
    retrieved: bool = False
    run_dir: str
    export_id: str | None = Field(default=None, description="The export made after training.")
    gguf: FileEntry | None = Field(
        default=None, description="Its GGUF, the path relative to the run directory."
    )


def _rebuild(runs: Runs, record: RunRecord, cpu_threads: int | None) -> Trainer:
    resume = resume_path(record.resumed_from) if record.resumed_from else None
    return AxolotlTrainer(
        TrainingSpec.model_validate(record.spec), resume_from=resume, cpu_threads=cpu_threads
    )


KIND = JobKind(name=NAME, child=False, rebuild=_rebuild, progress=True)
"""A training run: `<runs dir>/<id>/run.json`."""


def next_step(record: RunRecord) -> str:
    """What to run next for a run, as the summary and messages say it."""
    if record.state == RunState.STOPPED:
        return f"Resume it: run the `train` flow with `resume_from={record.id}`."
    if record.state in (RunState.RUNNING, RunState.PREPARING):
        return f"Follow it again: run the `attach` flow with `run_id={record.id}`."
    if record.state == RunState.SUCCEEDED and (record.spec or {}).get("preprocess_only"):
        return f"Its tokenized datasets are in `runs/{record.id}/prepared/`."
    if record.state == RunState.SUCCEEDED:
        return f"Its files are in `runs/{record.id}/`; export it with the `export` flow."
    return f"See `runs/{record.id}/job.log`, fix the cause, and start a new run."


def result_of(runs: Runs, outcome: Outcome, exported: ExportResult | None = None) -> RunResult:
    """What a run flow returns for the run of `outcome`: how it ended, its
    steps and losses, its verified files, what to run next, and the GGUF of
    `exported`, the export made after it, when there is one."""
    record, summary = outcome.record, outcome.summary
    result = RunResult(
        run_id=record.id,
        state=record.state,
        target=record.target,
        message=record.message,
        steps=summary.last.step if summary.last else 0,
        first_loss=summary.first_loss,
        final_loss=summary.final_loss,
        retrieved=outcome.retrieved,
        files=[FileEntry.of(f) for f in outcome.files],
        run_dir=runs.where_of(record.id),
        next=next_step(record),
    )
    if exported is not None and exported.gguf is not None:
        result.export_id = exported.export_id
        result.gguf = exported.gguf.model_copy(
            update={"path": f"exports/{exported.export_id}/{exported.gguf.path}"}
        )
    return result


def result_line(result: RunResult) -> str:
    """The line an ended run is logged with: its steps, final loss, files, what next."""
    return (
        f"run {result.run_id} {result.state}: {result.steps} steps, final loss "
        f"{result.final_loss}, {len(result.files)} files verified. {result.next}"
    )


async def check_before_anything(spec: TrainingSpec, place: Target, logger: Logger) -> TargetFacts:
    """The pre-flight checks of a training run, before its record, pod or job
    exists: its local files and rows, the model's context, and what the spec
    asks of the GPUs the job will have (probed on a machine you own; a pod's
    count). Logs the launch plan and the warnings; returns what the probe
    found. Raises TrainError (one line)."""
    secrets = place.secrets()
    hub = secrets.get("HF_TOKEN")
    facts = await place.facts(AxolotlTrainer(spec).probe_modules)
    warnings = preflight(
        spec,
        gpus=facts.gpus,
        compute_capability=facts.compute_capability,
        secrets=list(secrets),
        hub_token=hub.get_secret_value() if hub is not None else None,
    )
    problem = holdout_problem(spec)
    if problem is not None:
        raise TrainError(problem)
    for warning in warnings:
        logger.warning("%s", warning)
    logger.info("the run will be %s on %s", launch_summary(spec, facts.gpus), place.ref)
    return facts


@dataclass
class LostRun:
    """A run of a training lost with its machine: why, the checkpoint it
    could go on from, where it ran, and why it did not go on (None: it did)."""

    record: RunRecord
    why: str
    point: ResumedFrom | None
    where: str
    stop: str | None = None


def lost_markdown(
    runs: Runs, lost: Sequence[LostRun], last: RunRecord, where: str, dollars: float | None
) -> str:
    """The summary's section listing every machine a training ran on: each
    run lost with its machine (why, the step the next went on from, what it
    cost), then the last one."""
    lines = [
        "",
        "## Machines",
        "",
        "| run | where | how it ended | went on from | cost |",
        "| --- | --- | --- | --- | --- |",
    ]
    total = 0.0
    for run in lost:
        cost = spent(runs, run.record)
        total += cost or 0.0
        if run.stop is not None:
            went_on = f"not resumed: {run.stop}"
        elif run.point is None:
            went_on = FROM_STEP_0
        else:
            went_on = f"{run.point.checkpoint} (step {run.point.step})"
        shown = "-" if cost is None else f"${cost:.2f}"
        lines.append(f"| {run.record.id} | {run.where} | lost: {run.why} | {went_on} | {shown} |")
    if not lost or lost[-1].record.id != last.id:
        total += dollars or 0.0
        shown = "-" if dollars is None else f"${dollars:.2f}"
        lines.append(f"| {last.id} | {where} | {last.state} | - | {shown} |")
    lines += ["", f"Every machine together cost ${total:.2f}.", ""]
    return "\n".join(lines)


Again = Callable[[TrainingSpec, ResumedFrom | None, int, float], Awaitable[Finished]]
"""Runs a training again in a new run on a new machine: its spec, the
checkpoint it goes on from (None: step 0), its attempt, and what its lost
machines cost (its cost cap counts it); returns how it ended."""


async def go_on_after_lost_machines(
    runs: Runs, place: Target, finished: Finished, logger: Logger, again: Again
) -> tuple[Finished, list[LostRun]]:
    """While the training was lost with its machine (a pod terminated, its
    container restarted, a node of a training across nodes lost), it goes
    on in a new run on a new machine (`again`), up to the target's
    max_restarts: from its last checkpoint kept in the store (across nodes,
    the last with every node's part), or, lost before its first, from where
    it started itself (step 0, or the checkpoint it was resumed from);
    returns how the last run ended and each run lost on the way. Each loss
    is said in one line, and in the lost run's message. No restart past
    max_restarts, or when the next machine cannot be had (its budget
    refuses it): the last lost run's failure stands, with why and the
    command that goes on."""
    lost: list[LostRun] = []
    while finished.outcome.record.state == RunState.FAILED:
        record = finished.outcome.record
        why = place.lost_machine(runs, record)
        if why is None:
            break
        point = lost_point(runs, record)
        lost.append(LostRun(record=record, why=why, point=point, where=finished.where))
        if len(lost) > place.max_restarts:
            stop = f"max_restarts ({place.max_restarts}) reached"
            logger.warning("run %s: %s; it is not resumed: %s", record.id, why, stop)
            lost[-1].stop = stop
            if point is not None:
                go_on = f"resume it from {point.checkpoint} with the train flow "
                _note(runs, record, f"{record.message}; {go_on}(resume_from={record.id})", logger)
            else:
                go_on = "start it again from step 0 with the train flow"
                _note(runs, record, f"{why}; no checkpoint of it was kept: {go_on}", logger)
            break
        start = FROM_STEP_0 if point is None else f"{point.checkpoint} (step {point.step})"
        spec = resumed_spec(runs, record)
        machine = "new machines" if spec.nodes > 1 else "a new machine"
        logger.warning(
            "run %s: %s; it goes on from %s in a new run on %s (restart %d of %d)",
            record.id,
            why,
            start,
            machine,
            len(lost),
            place.max_restarts,
        )
        _note(runs, record, f"{why}; it went on from {start} in a new run on {machine}", logger)
        spent_usd = sum(spent(runs, run.record) or 0.0 for run in lost)
        try:
            finished = await again(spec, point, len(lost), spent_usd)
        except Exception as error:  # the next machine cannot be had: the loss stands
            logger.warning("run %s: it cannot go on: %s", record.id, error)
            lost[-1].stop = f"no new machine: {error}"
            break
    return finished, lost


def _note(runs: Runs, record: RunRecord, message: str, logger: Logger) -> None:
    """Gives the lost run `record` (and its saved record) `message`: where it
    went on, or how to resume it, instead of advice to start it again. A
    record that cannot be saved keeps its saved message (logged)."""
    record.message = message
    try:
        saved = runs.load(record.id)
        saved.message = message
        runs.save(saved)
    except (RunsError, RecordError) as error:
        logger.warning("run %s: cannot record where it goes on: %s", record.id, error)
