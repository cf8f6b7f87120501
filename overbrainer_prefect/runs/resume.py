"""Resuming a stopped run: its checkpoint becomes the start of a new run."""

from __future__ import annotations

import shutil
from pathlib import PurePosixPath

from overbrainer_prefect.runs.lifecycle import RunError
from overbrainer_prefect.runs.store import ResumedFrom, RunRecord, Runs, RunState

RESUME_DIR = "resume"
"""Where a resumed run's starting checkpoint sits in its run directory."""


def resume_point(runs: Runs, stopped: RunRecord) -> ResumedFrom:
    """The checkpoint a new run can resume from: the one the stopped run saved,
    retrieved and verified in its local directory.

    Raises RunError with one line when the run did not stop with a checkpoint or
    the checkpoint is not here.
    """
    if stopped.state != RunState.STOPPED or not stopped.checkpoint:
        raise RunError(
            f"run {stopped.id} is {stopped.state}, not stopped with a checkpoint: only a run "
            "stopped with the stop flow can be resumed"
        )
    checkpoint = PurePosixPath(stopped.checkpoint)
    if checkpoint.is_absolute() or ".." in checkpoint.parts:
        raise RunError(f"run {stopped.id} names an invalid checkpoint: it cannot be resumed")
    if not (runs.run_dir(stopped.id) / checkpoint).is_dir():
        raise RunError(
            f"the checkpoint {checkpoint} of run {stopped.id} is not in "
            f"{runs.run_dir(stopped.id)}: retrieve it with the attach flow (run_id={stopped.id})"
        )
    step_text = checkpoint.name.rpartition("-")[2]
    return ResumedFrom(
        run_id=stopped.id,
        checkpoint=str(checkpoint),
        step=int(step_text) if step_text.isdigit() else 0,
    )


def stage_checkpoint(runs: Runs, point: ResumedFrom, record: RunRecord) -> str:
    """Copies the checkpoint of `point` into the new run `record`'s directory and
    returns its path there, relative to the run directory (what the trainer
    resumes from). Raises OSError when it cannot be copied."""
    source = runs.run_dir(point.run_id) / point.checkpoint
    relative = resume_path(point)
    shutil.copytree(source, runs.run_dir(record.id) / relative, dirs_exist_ok=True)
    return relative


def resume_path(point: ResumedFrom) -> str:
    """Where `stage_checkpoint` puts the checkpoint of `point`, relative to the new
    run's directory: what its trainer resumes from."""
    return f"{RESUME_DIR}/{PurePosixPath(point.checkpoint).name}"
