"""What every kind of job declares: its name in records, where its records
live, and how its trainer is made again from its record alone."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from overbrainer_prefect.runs.store import RunRecord, Runs, subject
from overbrainer_prefect.steps.errors import RunError
from overbrainer_prefect.trainers.base import Trainer

Rebuild = Callable[[Runs, RunRecord, int | None], Trainer]
"""Makes a job's trainer from the runs directory, its record and the CPU
threads it may use; raises TrainError or RunError with one line."""


@dataclass(frozen=True)
class JobKind:
    """A kind of job: its records are `<runs dir>/<id>/run.json` for a kind of
    its own (`child` false: a training run, a base model's export) or
    `<run dir>/<name>s/<id>/<name>.json` below the run they belong to."""

    name: str
    """The record's `trainer`: what kind of job it holds."""
    child: bool
    """Whether its records belong to a run (an export, a compare, an evaluation)."""
    rebuild: Rebuild
    """Makes its trainer from a record whose spec is there."""
    progress: bool = False
    """Whether its jobs show live progress, a loss curve and a run summary (a
    training run); other kinds log their steps."""

    def holds(self, record: RunRecord) -> bool:
        """Whether `record` is a job of this kind."""
        return record.trainer == self.name and (record.parent is not None) == self.child

    def store(self, runs: Runs, run_id: str) -> Runs:
        """The store of this kind's records below run `run_id`. Raises
        InvalidRunId for an invalid ID."""
        return runs.children(run_id, self.name)

    def trainer(self, runs: Runs, record: RunRecord, cpu_threads: int | None = None) -> Trainer:
        """The trainer of the job `record`, made again from its record alone.
        Raises RunError with one line when its record holds no spec, or what
        `rebuild` raises when the spec cannot be used."""
        if record.spec is None:
            raise RunError(
                f"{subject(record)} has no {self.name} spec in its record: it cannot be followed"
            )
        return self.rebuild(runs, record, cpu_threads)
