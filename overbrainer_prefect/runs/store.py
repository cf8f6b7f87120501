"""The run store: `runs/<run-id>/run.json`, one record per run, written before
each step it describes, so that any process (another worker, another day) can
find a run's job again from the record alone."""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, JsonValue

from overbrainer_prefect.executors.base import JobId
from overbrainer_prefect.runs.ids import is_valid_run_id
from overbrainer_prefect.runs.live import (
    BUILT,
    LIVE_DIR,
    STALE_S,
    mark,
    mark_built,
    marker_age_s,
    marker_key,
    record_dir_of,
    unmark,
)
from overbrainer_prefect.store import LocalStore, ObjectInfo, Store, StoreError, open_store
from overbrainer_prefect.store.base import join
from overbrainer_prefect.store.held import check_guarded
from overbrainer_prefect.store.records import (
    InvalidRecord,
    RecordError,
    RecordIoError,
    StoredRecord,
    read_record,
    store_errors,
    write_record,
)
from overbrainer_prefect.store.where import RUNS_DIR, RUNS_ROOT_ENV

log = logging.getLogger(__name__)

RECORD_FILE = "run.json"
"""The record of a run, in its directory."""

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


class RunRecord(StoredRecord):
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


Objects = list[ObjectInfo]
"""Files of a run, as the store lists them."""

LiveEntries = list[tuple["Runs", str]]
"""Records the live index names: each its store and ID."""


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

    def __init__(self, run_id: str, where: Path | str, kind: str = "run") -> None:
        super().__init__(
            f"no {kind} {run_id} in {where}: check the {kind} ID and the runs directory"
        )


STAGING_ENV = "OVERBRAINER_WORK_DIR"
"""Where a process stages the files of the jobs it starts when its runs are in an
object store (default: a directory of the system's temporary directory)."""


def default_runs_root() -> Path:
    """The local runs directory: `$OVERBRAINER_RUNS_DIR`, else `./runs` (a URL
    there names an object store: see `Runs`)."""
    return Path(os.environ.get(RUNS_ROOT_ENV) or RUNS_DIR).absolute()


def staging_root(store: Store) -> Path:
    """This process's local directory for an object store's runs: what it
    stages for the jobs it starts (their files before they are copied to a
    target), never their records or retrieved files, which are in the store."""
    base = Path(os.environ.get(STAGING_ENV) or Path(tempfile.gettempdir()) / "overbrainer-work")
    return base / hashlib.sha256(store.url.encode()).hexdigest()[:16]


class Runs:
    """The runs directory of a project or deployment, in its store (a local
    directory, or an object store named by an `s3://` URL); also, with another
    `record_file`, `kind` and `prefix`, the exports or compares of a run.

    Records go through the store by compare-and-swap: a record read by `load`
    remembers its version, and `save` writes it only over that version (a new
    record only where there is none), so two processes never overwrite each
    other: the loser gets RecordChanged and reads again.
    """

    def __init__(
        self,
        root: Path | str | Store | None = None,
        record_file: str = RECORD_FILE,
        kind: str = "run",
        prefix: str = "",
    ) -> None:
        # (not `isinstance(root, Store)`: a protocol's check reads every property of it)
        self.store: Store = (
            open_store(root) if root is None or isinstance(root, str | Path) else root
        )
        self.prefix = prefix.strip("/")
        self.record_file = record_file
        self.kind = kind

    def __repr__(self) -> str:
        return f"Runs({self.where!r}, kind={self.kind!r})"

    @property
    def where(self) -> str:
        """How messages name this directory (a path, or an `s3://` URL)."""
        return self.store.where(self.prefix) if self.prefix else self.store.url

    @property
    def root(self) -> Path:
        """Its local directory: the directory itself in a local store; in an
        object store, where this process stages the files of the jobs it
        starts (`staging_root`)."""
        base = self.store.root if isinstance(self.store, LocalStore) else staging_root(self.store)
        return base / self.prefix if self.prefix else base

    @property
    def top(self) -> Runs:
        """The runs directory this store is part of (itself for the runs)."""
        return Runs(self.store)

    def key(self, *parts: str) -> str:
        """The store key of `parts` under this directory."""
        return join(self.prefix, *parts)

    def children(self, run_id: str, kind: str) -> Runs:
        """The store of the `kind` records (`export`, `compare`) of run `run_id`:
        `<run dir>/<kind>s/<id>/<kind>.json`. Raises InvalidRunId for an invalid ID."""
        self._checked(run_id)
        return Runs(
            self.store, record_file=f"{kind}.json", kind=kind, prefix=self.key(run_id, f"{kind}s")
        )

    def bases(self, key: str) -> Runs:
        """The store of the exports of the base model `key` (`.bases/<key>/exports/`)."""
        return Runs(
            self.store,
            record_file="export.json",
            kind="export",
            prefix=join(BASES_DIR, key, "exports"),
        )

    def at(self, prefix: str) -> Runs:
        """The store of the records at `prefix` of this runs directory (its
        `prefix`): `''` the runs, `R/<kind>s` the exports, compares or
        evaluations of run R, `.bases/K/exports` a base model's exports.
        Raises RunsError for any other prefix."""
        parts = prefix.split("/") if prefix else []
        top = self.top
        if not parts:
            return top
        kinds = {f"{kind}s": kind for kind in CHILD_KINDS}
        if len(parts) == 2 and is_valid_run_id(parts[0]) and parts[1] in kinds:
            return top.children(parts[0], kinds[parts[1]])
        if len(parts) == 3 and parts[0] == BASES_DIR and parts[2] == "exports":
            return top.bases(parts[1])
        raise RunsError(f"{prefix!r} holds no records of the runs directory {top.where}")

    def find(self, record_id: str) -> tuple[Runs, RunRecord] | None:
        """The store holding the record `record_id` and the record: a run of this
        directory, an export, compare or evaluation of one of its runs, or a base model's
        export (`.bases/<key>/exports/`); None when none is here. IDs are unique
        (time + random), so the first found is the one.

        Raises InvalidRunId for an invalid ID; RecordIoError or InvalidRecord
        when the record found cannot be read."""
        self._checked(record_id)
        if self.exists(record_id, self.record_file):
            return self, self.load(record_id)
        for parent in self._names(""):
            if not is_valid_run_id(parent):
                continue
            for kind in CHILD_KINDS:
                store = self.children(parent, kind)
                if store.exists(record_id, store.record_file):
                    return store, store.load(record_id)
        for base in self._names(BASES_DIR):
            store = self.bases(base)
            if store.exists(record_id, store.record_file):
                return store, store.load(record_id)
        return None

    def stores(self) -> list[Runs]:
        """Every store under this runs directory that holds records: the runs,
        the exports and compares of each run, and each base model's exports.
        Raises RecordIoError when the runs directory cannot be read."""
        found: list[Runs] = [self]
        for record in self.list(skipped=lambda _name, _error: None):
            names = self._names(record.id)
            for kind in CHILD_KINDS:
                if f"{kind}s" in names:
                    found.append(self.children(record.id, kind))
        for base in self._names(BASES_DIR):
            if "exports" in self._names(join(BASES_DIR, base)):
                found.append(self.bases(base))
        return found

    def _checked(self, run_id: str) -> str:
        if not is_valid_run_id(run_id):
            raise InvalidRunId(run_id)
        return run_id

    def _names(self, under: str) -> list[str]:
        with store_errors(self.where):
            return self.store.names(self.key(under) if under else self.prefix)

    def run_dir(self, run_id: str) -> Path:
        """The local directory of the run `run_id` (see `root`).

        Raises InvalidRunId when `run_id` is not a run ID, so a directory
        outside the runs directory is never returned.
        """
        return self.root / self._checked(run_id)

    def where_of(self, run_id: str, *parts: str) -> str:
        """How messages name the run `run_id`'s directory, or a file of it."""
        return self.store.where(self.key(self._checked(run_id), *parts))

    def save(self, record: RunRecord) -> None:
        """Writes `record` to its `run.json`: created when it is new, else only
        over the version it was read at (see the class).

        Raises InvalidRunId for an invalid ID, RecordChanged when another
        process wrote it since, RecordIoError when it cannot be written,
        LeaseLost when this task lost the run's follow lock (before: nothing
        written; while it was written: what the caller does next is not done).
        """
        key = self.key(self._checked(record.id), self.record_file)
        check_guarded(record.id)
        if record._etag is not None:
            record._etag = write_record(self.store, key, record, record._etag)
            check_guarded(record.id)  # lost while it was written: nothing that follows is done
            return
        # a new record: in the live index before it exists, so whatever dies next, a pass
        # finds it; marked again after, in case a pass dropped the first marker as stale
        # while this process was stalled between the two (see runs/live.py)
        record_dir = self.key(record.id)
        with store_errors(self.store.where(marker_key(record_dir))):
            mark(self.store, record_dir)
        record._etag = write_record(self.store, key, record, None)
        try:
            mark(self.store, record_dir)
        except StoreError as error:  # the first marker stands but for that one race
            log.warning("cannot mark %s live again: %s", self.where_of(record.id), error)
        check_guarded(record.id)

    def load(self, run_id: str) -> RunRecord:
        """The record of the run `run_id`, with its version.

        Raises InvalidRunId for an invalid ID, RunNotFound when it has no record,
        RecordIoError or InvalidRecord when the record cannot be read.
        """
        key = self.key(self._checked(run_id), self.record_file)
        found = read_record(self.store, key, RunRecord, self.kind)
        if found is None:
            raise RunNotFound(run_id, self.where, self.kind)
        record, etag = found
        record._etag = etag
        return record

    def list(self, skipped: Callable[[str, RecordError], None] | None = None) -> list[RunRecord]:
        """Every run with a readable record, oldest first. Directories without a
        record are ignored; records that fail to load are skipped and passed to
        `skipped` (by default logged as a warning).

        Raises RecordIoError when the runs directory itself cannot be read.
        """
        records = []
        for name in self._names(""):
            if not is_valid_run_id(name):
                continue
            try:
                records.append(self.load(name))
            except RunNotFound:
                continue
            except (InvalidRecord, RecordIoError) as error:
                if skipped is None:
                    log.warning("skipping unreadable %s record for %s: %s", self.kind, name, error)
                else:
                    skipped(name, error)
        return records

    # -- the live index (runs/live.py) ---------------------------------------------------

    def live(self) -> LiveEntries | None:
        """The records the live index of this runs directory names (its top's),
        each as its store and ID, in one listing of `.live/`; None when the
        index was never built (`build_live`). Names that are no record of it
        are left out. Raises RecordIoError when the store cannot be read."""
        top = self.top
        with store_errors(top.store.where(LIVE_DIR)):
            names = top.store.names(LIVE_DIR)
        if BUILT not in names:
            return None
        found: LiveEntries = []
        for name in names:
            record_dir = record_dir_of(name)
            if record_dir is None:
                continue
            prefix, _, record_id = record_dir.rpartition("/")
            try:
                found.append((top.at(prefix), top._checked(record_id)))
            except RunsError:
                continue
        return found

    def mark_live(self, record_id: str) -> None:
        """Puts the record `record_id` of this store in the live index (again).
        Raises InvalidRunId, RecordIoError."""
        record_dir = self.key(self._checked(record_id))
        with store_errors(self.store.where(marker_key(record_dir))):
            mark(self.store, record_dir)

    def unmark_live(self, record_id: str) -> None:
        """Takes the record `record_id` of this store out of the live index: only
        for a record final and holding nothing, which it never leaves.
        Raises InvalidRunId, RecordIoError."""
        record_dir = self.key(self._checked(record_id))
        with store_errors(self.store.where(marker_key(record_dir))):
            unmark(self.store, record_dir)

    def drop_if_stale(self, record_id: str) -> bool:
        """For a marker of the live index whose record `record_id` is missing:
        removes it once it is STALE_S old (its creator died before it wrote
        the record), and marks the record again when it appeared meanwhile.
        Returns whether the marker is gone. Raises InvalidRunId, RecordIoError."""
        record_dir = self.key(self._checked(record_id))
        with store_errors(self.store.where(marker_key(record_dir))):
            age = marker_age_s(self.store, record_dir)
            if age is not None and age < STALE_S:
                return False
            unmark(self.store, record_dir)
            if self.store.head(self.key(record_id, self.record_file)) is None:
                return True
            mark(self.store, record_dir)
            return False

    def build_live(self, live: Callable[[Runs, RunRecord], bool]) -> int:
        """Builds the live index of a runs directory written before it had one:
        reads every record once (every store of `stores`), marks those
        `live` says are, then says the index is built. Records that cannot be
        read are marked (a pass looks at them again). A directory that holds
        nothing yet is left as it is (its first record makes it). Returns how
        many were marked. Raises RecordIoError when the store cannot be read or
        written."""
        top = self.top
        marked = 0
        if not top._names(""):
            return marked
        for store in top.stores():
            unreadable: dict[str, RecordError] = {}
            for record in store.list(skipped=unreadable.__setitem__):
                if live(store, record):
                    store.mark_live(record.id)
                    marked += 1
            for name in unreadable:
                store.mark_live(name)
                marked += 1
        with store_errors(top.store.where(LIVE_DIR)):
            mark_built(top.store)
        return marked

    # -- the files of a run ------------------------------------------------------------

    def read_bytes(self, run_id: str, rel: str) -> bytes:
        """The file `rel` of the run `run_id`. Raises FileNotFoundError when
        there is none, RecordIoError when it cannot be read."""
        key = self.key(self._checked(run_id), rel)
        with store_errors(self.store.where(key)):
            found = self.store.read(key)
        if found is None:
            raise FileNotFoundError(self.store.where(key))
        return found.data

    def read_text(self, run_id: str, rel: str) -> str:
        """`read_bytes` as UTF-8 text (undecodable bytes replaced)."""
        return self.read_bytes(run_id, rel).decode("utf-8", errors="replace")

    def write_bytes(self, run_id: str, rel: str, data: bytes) -> None:
        """Writes the file `rel` of the run `run_id` (one writer's file, never a
        record). Raises RecordIoError when it cannot be written, LeaseLost
        (nothing written) when this task lost the run's follow lock."""
        key = self.key(self._checked(run_id), rel)
        check_guarded(run_id)
        with store_errors(self.store.where(key)):
            self.store.write(key, data)

    def exists(self, run_id: str, rel: str) -> bool:
        """Whether the run `run_id` has the file `rel`. Raises RecordIoError."""
        key = self.key(self._checked(run_id), rel)
        with store_errors(self.store.where(key)):
            return self.store.head(key) is not None

    def files(self, run_id: str, under: str = "") -> Objects:
        """The files of the run `run_id` under `under` (all: ''), their keys
        relative to the run's directory. Raises RecordIoError."""
        base = self.key(self._checked(run_id))
        with store_errors(self.where):
            found = self.store.objects(join(base, under) if under else base)
        return [ObjectInfo(info.key[len(base) + 1 :], info.size, info.sha256) for info in found]

    def remove(self, run_id: str, rel: str) -> None:
        """Removes the file (or directory) `rel` of the run `run_id`. Raises
        RecordIoError, and LeaseLost (nothing removed) when this task lost the
        run's follow lock."""
        key = self.key(self._checked(run_id), rel)
        check_guarded(run_id)
        with store_errors(self.store.where(key)):
            self.store.delete(key)
