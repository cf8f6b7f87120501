"""The run store: `runs/<run-id>/run.json`, one record per run, written before
each step it describes, so that any process (another worker, another day) can
find a run's job again from the record alone."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, JsonValue

from overbrainer_prefect.executors.base import JobId
from overbrainer_prefect.runs.ids import is_valid_run_id
from overbrainer_prefect.runs.records import (
    InvalidRecord,
    RecordError,
    RecordIoError,
    load_record,
    save_record,
)

log = logging.getLogger(__name__)

RUNS_DIR = "runs"
"""The directory holding the runs, under the project (or the deployment's) directory."""

RECORD_FILE = "run.json"
"""The record of a run, in its directory."""

RUNS_ROOT_ENV = "OVERBRAINER_RUNS_DIR"
"""Environment variable naming the runs directory (a shared volume when several
machines attach to the same runs); default `./runs`."""


CHILD_KINDS = ("export", "compare", "evaluation")
"""The kinds of record a run holds below it: `<run dir>/<kind>s/<id>/<kind>.json`."""

BASES_DIR = ".bases"
"""Under the runs directory: the exports of base models, `<key>/exports/<id>/`."""


class RunState(StrEnum):
    """Where a run stands, as last seen."""

    PREPARING = "preparing"
    """Files are being prepared or uploaded; the job has not started."""
    RUNNING = "running"
    """The job was started and has not been seen ending."""
    SUCCEEDED = "succeeded"
    """The job ended with exit code 0, wrote metrics, and its files were verified."""
    STOPPED = "stopped"
    """The job was asked to stop, saved a resumable checkpoint and ended."""
    FAILED = "failed"
    """The job failed, stopped without an exit code, or wrote no metrics."""
    CANCELLED = "cancelled"
    """The job was cancelled."""

    @property
    def ended(self) -> bool:
        """Whether the run is in a final state (nothing left to follow)."""
        return self not in (RunState.PREPARING, RunState.RUNNING)


class ResumedFrom(BaseModel):
    """The checkpoint of a stopped run that a new run started from."""

    model_config = ConfigDict(extra="forbid")

    run_id: str = Field(description="The stopped run.")
    checkpoint: str = Field(description="Its checkpoint, relative to its run directory.")
    step: int = Field(ge=0, description="The step the checkpoint was saved at.")


class RunRecord(BaseModel):
    """`runs/<run-id>/run.json`: what is needed to find a run's job again and to
    say how it ended. It never holds a secret."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    id: str = Field(description="The run ID, also the directory name.")
    target: str = Field(description="Name of the target block the run runs on.")
    target_kind: str = Field(default="local", description="local, ssh or runpod.")
    trainer: str = Field(default="training", description="The kind of job.")
    created: str = Field(description="Creation time, RFC 3339 UTC.")
    remote_dir: str = Field(description="The run directory on the target.")
    job: JobId | None = Field(default=None, description="The job, once started.")
    state: RunState = Field(default=RunState.PREPARING)
    message: str | None = Field(default=None, description="Why the run failed, when it did.")
    not_retrieved: str | None = Field(
        default=None,
        description="Why the job's files could not be retrieved, while they could not "
        "(cleared once a later retrieval verified them).",
    )
    started: str | None = Field(default=None, description="When the job started, RFC 3339.")
    ended: str | None = Field(default=None, description="When the run was seen ending.")
    deadline: str | None = Field(
        default=None, description="When the job is cancelled if still running (max_hours)."
    )
    spec: dict[str, JsonValue] | None = Field(
        default=None,
        description="The job's parameters (a TrainingSpec), so any process can "
        "follow, stop or resume the run.",
    )
    resumed_from: ResumedFrom | None = Field(default=None)
    checkpoint: str | None = Field(
        default=None,
        description="The resumable checkpoint of a stopped run, relative to its run directory.",
    )
    parent: str | None = Field(
        default=None,
        description="For an export or a compare: the run it belongs to.",
    )
    flow_run_id: str | None = Field(
        default=None, description="The Prefect flow run that created the run."
    )


NOT_RETRIEVED = "artifacts not retrieved: "
"""How messages name a record's `not_retrieved` reason."""


def told(record: RunRecord) -> str | None:
    """A record's message as people read it: why it failed, and why its files
    were not retrieved when they were not."""
    note = f"{NOT_RETRIEVED}{record.not_retrieved}" if record.not_retrieved else None
    if record.message and note:
        return f"{record.message} ({note})"
    return record.message or note


def subject(record: RunRecord) -> str:
    """How messages name a record: `run R`, `export E of run R`, or a base
    model's export `base export E (model)`."""
    if record.parent is None and record.trainer == "export":
        return f"base export {record.id} ({(record.spec or {}).get('base_model')})"
    if record.parent is None:
        return f"run {record.id}"
    return f"{record.trainer} {record.id} of run {record.parent}"


def follow_again(record: RunRecord) -> str:
    """The flow, with its parameters, that follows a record again."""
    if record.parent is None and record.trainer == "export":
        return "the compare flow (a compare of the same base model follows it again)"
    if record.parent is None:
        return f"the attach flow (run_id={record.id})"
    return f"the {record.trainer} flow (run_id={record.parent}, {record.trainer}_id={record.id})"


def local_path(record: RunRecord) -> str:
    """Where a record's files are, as messages name it (`runs/R` or `runs/R/exports/E`)."""
    if record.parent is None:
        return f"runs/{record.id}"
    return f"runs/{record.parent}/{record.trainer}s/{record.id}"


class RunsError(Exception):
    """A run ID, directory or record is not usable. The message is one line."""


class InvalidRunId(RunsError):
    """An ID that cannot name a run directory."""

    def __init__(self, run_id: str) -> None:
        super().__init__(
            f"{run_id!r} is not a valid run ID (YYYYMMDD-HHMMSS-xxxx): list the runs with "
            "the runs flow, or look in runs/"
        )


class RunNotFound(RunsError):
    """A valid ID without a record."""

    def __init__(self, run_id: str, root: Path, kind: str = "run") -> None:
        super().__init__(
            f"no {kind} {run_id} in {root}: check the {kind} ID and the runs directory"
        )


def default_runs_root() -> Path:
    """The runs directory: `$OVERBRAINER_RUNS_DIR`, else `./runs`."""
    return Path(os.environ.get(RUNS_ROOT_ENV) or RUNS_DIR).absolute()


class Runs:
    """The runs directory of a project or deployment; also, with another
    `record_file` and `kind`, the exports or compares of a run."""

    def __init__(
        self, root: Path | str | None = None, record_file: str = RECORD_FILE, kind: str = "run"
    ) -> None:
        self.root = Path(root).absolute() if root is not None else default_runs_root()
        self.record_file = record_file
        self.kind = kind

    def children(self, run_id: str, kind: str) -> Runs:
        """The store of the `kind` records (`export`, `compare`) of run `run_id`:
        `<run dir>/<kind>s/<id>/<kind>.json`. Raises InvalidRunId for an invalid ID."""
        return Runs(self.run_dir(run_id) / f"{kind}s", record_file=f"{kind}.json", kind=kind)

    def find(self, record_id: str) -> tuple[Runs, RunRecord] | None:
        """The store holding the record `record_id` and the record: a run of this
        directory, an export, compare or evaluation of one of its runs, or a base model's
        export (`.bases/<key>/exports/`); None when none is here. IDs are unique
        (time + random), so the first found is the one.

        Raises InvalidRunId for an invalid ID; RecordIoError or InvalidRecord
        when the record found cannot be read."""
        self.run_dir(record_id)  # validates the ID before it names a path
        if (self.root / record_id / self.record_file).is_file():
            return self, self.load(record_id)
        for kind in CHILD_KINDS:
            for found in sorted(self.root.glob(f"*/{kind}s/{record_id}/{kind}.json")):
                parent = found.parent.parent.parent.name
                if is_valid_run_id(parent):
                    store = self.children(parent, kind)
                    return store, store.load(record_id)
        for found in sorted(self.root.glob(f"{BASES_DIR}/*/exports/{record_id}/export.json")):
            store = Runs(found.parent.parent, record_file="export.json", kind="export")
            return store, store.load(record_id)
        return None

    def stores(self) -> list[Runs]:
        """Every store under this runs directory that holds records: the runs,
        the exports and compares of each run, and each base model's exports.
        Raises RecordIoError when the runs directory cannot be read."""
        found: list[Runs] = [self]
        for record in self.list(skipped=lambda _name, _error: None):
            for kind in CHILD_KINDS:
                if (self.root / record.id / f"{kind}s").is_dir():
                    found.append(self.children(record.id, kind))
        bases = self.root / BASES_DIR
        if bases.is_dir():
            for key in sorted(bases.iterdir()):
                if (key / "exports").is_dir():
                    found.append(Runs(key / "exports", record_file="export.json", kind="export"))
        return found

    def run_dir(self, run_id: str) -> Path:
        """The local directory of the run `run_id`.

        Raises InvalidRunId when `run_id` is not a run ID, so a directory
        outside the runs directory is never returned.
        """
        if not is_valid_run_id(run_id):
            raise InvalidRunId(run_id)
        return self.root / run_id

    def save(self, record: RunRecord) -> None:
        """Writes `record` to its `run.json`, replacing it atomically, and creates
        the run directory if needed.

        Raises InvalidRunId for an invalid ID and RecordIoError when it cannot be written.
        """
        save_record(self.run_dir(record.id), self.record_file, record)

    def load(self, run_id: str) -> RunRecord:
        """The record of the run `run_id`.

        Raises InvalidRunId for an invalid ID, RunNotFound when it has no record,
        RecordIoError or InvalidRecord when the record cannot be read.
        """
        path = self.run_dir(run_id) / self.record_file
        try:
            return load_record(path, RunRecord, self.kind)
        except FileNotFoundError:
            raise RunNotFound(run_id, self.root, self.kind) from None

    def list(self, skipped: Callable[[str, RecordError], None] | None = None) -> list[RunRecord]:
        """Every run with a readable record, oldest first. Directories without a
        record are ignored; records that fail to load are skipped and passed to
        `skipped` (by default logged as a warning).

        Raises RecordIoError when the runs directory itself cannot be read.
        """
        try:
            names = sorted(entry.name for entry in self.root.iterdir())
        except FileNotFoundError:
            return []
        except OSError as error:
            raise RecordIoError(self.root, error) from None
        records = []
        for name in names:
            if not is_valid_run_id(name) or not (self.root / name / self.record_file).is_file():
                continue
            try:
                records.append(self.load(name))
            except (InvalidRecord, RecordIoError) as error:
                if skipped is None:
                    log.warning("skipping unreadable %s record for %s: %s", self.kind, name, error)
                else:
                    skipped(name, error)
        return records
