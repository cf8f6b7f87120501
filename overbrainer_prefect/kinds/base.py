"""What every kind of job declares: its name in records, where its records
live, and how its trainer is made again from its record alone."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from pydantic import BaseModel, Field, JsonValue

from overbrainer_prefect.executors.base import Executor
from overbrainer_prefect.kinds.files import FileEntry
from overbrainer_prefect.runs.store import RunRecord, Runs, RunState, local_path, subject
from overbrainer_prefect.steps.context import Outcome
from overbrainer_prefect.steps.errors import RunError
from overbrainer_prefect.targets.base import JobNeed
from overbrainer_prefect.trainers.base import Trainer

Rebuild = Callable[[Runs, RunRecord, int | None], Trainer]
"""Makes a job's trainer from the runs directory, its record and the CPU
threads it may use; raises TrainError or RunError with one line."""


class JobResult(BaseModel):
    """What the flow of every kind returns (and Prefect persists) of its job:
    the run it is or belongs to, where it ran, how it ended, its retrieved
    files and what to do next."""

    run_id: str
    state: RunState
    target: str
    message: str | None = None
    files: list[FileEntry] = Field(default_factory=list)
    next: str


class ChildResult(JobResult):
    """The result of a job that belongs to a run (an export, a compare)."""

    reused: bool = Field(
        default=False, description="An earlier succeeded job of the same inputs, returned as is."
    )


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


Check = Callable[[Executor], Awaitable[None]]
"""A check of the job's machine before its job starts (raises TrainError with one line)."""


@dataclass
class NewJob:
    """A job to run: where its record goes, what it needs, its record's
    contents, and how its trainer is made once its record exists."""

    store: Runs
    need: JobNeed
    kind: str
    """The record's `trainer`: training, export or compare."""
    prepare: Callable[[RunRecord], Trainer]
    """Makes the job's trainer once its record exists and is locked (stages a
    checkpoint, logs what is asked)."""
    spec: dict[str, JsonValue] | None = None
    """The job's parameters, as its record keeps them (`RunRecord.spec`)."""
    parent: str | None = None
    subdir: str = ""
    """Where its directory is under the target's work directory (`exports`)."""
    check: Check | None = None
    started: Callable[[RunRecord], None] | None = None
    """Called once the job's files were copied (whether or not it started)."""
    attempt: int = 0
    """Which job of its kind this is in its flow run (a training going on
    after a lost machine is the next): a resumed flow run finds each again."""


@dataclass
class Finished:
    """How a job ended: its outcome, where it ran, and whether this process
    cancelled it."""

    outcome: Outcome
    where: str
    cancelled: bool = False


def child_next_step(record: RunRecord, done: str, again: str) -> str:
    """What to do next about a job that belongs to a run (an export, a compare):
    `done` once it succeeded; while it has not ended, follow it again with its
    flow; after a failure, read its log, fix the cause and `again` (`export
    again`) with its flow."""
    flow, run_id = record.trainer, record.parent
    if record.state == RunState.SUCCEEDED:
        return done
    if not record.state.ended:
        return f"Follow it again: run the `{flow}` flow (run_id={run_id}, {flow}_id={record.id})."
    return (
        f"See `{local_path(record)}/job.log`, fix the cause, and {again} with the `{flow}` "
        f"flow (run_id={run_id})."
    )
