"""Records in the store: JSON objects changed only by compare-and-swap (a
record is created once, then replaced only on the version that was read), read
back without ever quoting what they hold. `run.json`, a target's own records,
the records of exports and compares, the ledger and the deployments' memories
all go through here."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, PrivateAttr, ValidationError

from overbrainer_prefect.store.base import AlreadyExists, Busy, Changed, Store, StoreError

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)

CHANGE_TRIES = 30  # compare-and-swap rounds `update_record` makes before it gives up


class RecordError(Exception):
    """A record cannot be read or written."""


class RecordIoError(RecordError):
    """A record could not be read or written: its store failed or did not answer."""

    def __init__(self, where: Path | str, error: OSError | StoreError | str) -> None:
        if isinstance(error, OSError):
            why = error.strerror or str(error)
            super().__init__(f"cannot access {where}: {why}")
        else:
            super().__init__(str(error))
        self.path = where


class RecordChanged(RecordError):
    """A record changed since this process read it: another process wrote it
    first. The caller reads it again and decides again."""


class ForeignRecord(RecordError):
    """A deployment's record file holds another deployment's record."""


class InvalidRecord(RecordError):
    """A file is not a valid record. Only where the problem is is kept: the
    parser's message could quote a value straight from the file."""

    def __init__(self, path: Path | str, kind: str, line: int, column: int) -> None:
        super().__init__(f"{path} is not a valid {kind} record (line {line}, column {column})")
        self.path = path
        self.line = line
        self.column = column


class StoredRecord(BaseModel):
    """A record that remembers the version of its store it was read at (`_etag`,
    None for a new one), so that it is saved only over that version. The
    version is not part of what the record says: two records are equal when
    their fields are."""

    _etag: str | None = PrivateAttr(default=None)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BaseModel):
            return NotImplemented
        return (
            type(self) is type(other)
            and self.__dict__ == other.__dict__
            and self.__pydantic_extra__ == other.__pydantic_extra__
        )

    __hash__ = None  # type: ignore[assignment]  # a record changes: it is no dictionary key


@contextmanager
def store_errors(where: str) -> Iterator[None]:
    """Raises what the store raises in the block as RecordIoError (one line)."""
    try:
        yield
    except (AlreadyExists, Changed, Busy):
        raise
    except StoreError as error:
        raise RecordIoError(where, error) from None


def record_bytes(record: BaseModel) -> bytes:
    """A record as it is written: indented JSON and a newline."""
    return record.model_dump_json(indent=2).encode() + b"\n"


def parse_record(content: bytes, where: Path | str, model: type[M], kind: str) -> M:
    """`content` as a `model` record. Raises InvalidRecord (with a line and
    column, never the content) when it is not valid JSON or not a valid
    `kind` record."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRecord(where, kind, 1, 1) from None
    # The parser's errors quote the file: only a position leaves these blocks,
    # and the error is raised outside them so it carries no context either.
    position: tuple[int, int] | None = None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        position = (error.lineno, error.colno)
    if position is None:
        try:
            return model.model_validate(data)
        except ValidationError as error:
            details = error.errors(include_input=False, include_url=False)
            # a value that is there and wrong is where to look first; a missing key has no place
            details.sort(key=lambda detail: detail["type"] == "missing")
            position = _position_of(text, details[0]["loc"] if details else ())
    raise InvalidRecord(where, kind, *position)


def read_record(store: Store, key: str, model: type[M], kind: str) -> tuple[M, str] | None:
    """The `kind` record at `key` and its version, None when there is none.

    Raises RecordIoError when it cannot be read, InvalidRecord when it is not
    a valid record.
    """
    where = store.where(key)
    with store_errors(where):
        found = store.read(key)
    if found is None:
        return None
    return parse_record(found.data, where, model, kind), found.etag


def write_record(store: Store, key: str, record: BaseModel, etag: str | None) -> str:
    """Creates the record at `key` (`etag` None) or replaces the version
    `etag` of it; returns its new version.

    Raises RecordChanged when another process created or changed it first,
    RecordIoError when it cannot be written.
    """
    where = store.where(key)
    try:
        with store_errors(where):
            if etag is None:
                return store.create(key, record_bytes(record))
            return store.replace(key, record_bytes(record), etag)
    except (AlreadyExists, Changed):
        raise RecordChanged(
            f"{where} was changed by another process since this one read it"
        ) from None


def update_record(
    store: Store, key: str, model: type[M], kind: str, change: Callable[[M | None], M | None]
) -> M | None:
    """Changes the record at `key` by compare-and-swap: reads it, asks
    `change` for the new record (given None when there is none; returning
    None leaves it), writes it on the version read; a lost race reads again
    and asks `change` again, so `change` decides from what it is given alone.
    Returns the record as written (or left).

    Raises RecordChanged after CHANGE_TRIES lost races, RecordIoError or
    InvalidRecord when it cannot be read or written.
    """
    for _ in range(CHANGE_TRIES):
        found = read_record(store, key, model, kind)
        current, etag = found if found is not None else (None, None)
        new = change(current.model_copy(deep=True) if current is not None else None)
        if new is None:
            return current
        try:
            write_record(store, key, new, etag)
        except RecordChanged:
            continue
        return new
    raise RecordChanged(f"{store.where(key)} kept changing while this process changed it")


def _position_of(content: str, loc: tuple[int | str, ...]) -> tuple[int, int]:
    """Where the value a validation error points at starts in `content`: the
    first `"key":` of the deepest named key of `loc`, else the end of the file."""
    for key in reversed(loc):
        if isinstance(key, str):
            index = content.find(json.dumps(key) + ":")
            if index < 0:
                index = content.find(json.dumps(key))
            if index >= 0:
                line = content.count("\n", 0, index) + 1
                column = index - (content.rfind("\n", 0, index) + 1) + 1
                return line, column
    lines = content.splitlines() or [""]
    return len(lines), len(lines[-1]) + 1


class DeploymentRecord(StoredRecord):
    """A record kept per deployment (its last delivered model, its nights)."""

    model_config = ConfigDict(extra="forbid")

    deployment: str


D = TypeVar("D", bound=DeploymentRecord)


def load_deployment_record(
    store: Store, key: str, model: type[D], kind: str, deployment: str
) -> D | None:
    """The `kind` record of `deployment` at `key`, or None when there is none yet.

    Raises RecordError (see `read_record`) when it cannot be read, and
    ForeignRecord when it is another deployment's.
    """
    found = read_record(store, key, model, kind)
    if found is None:
        return None
    if found[0].deployment != deployment:
        raise ForeignRecord(f"{store.where(key)} is the record of another deployment")
    return found[0]


def save_deployment_record(store: Store, key: str, record: DeploymentRecord, kind: str) -> None:
    """Writes `record` as its deployment's record at `key` (whatever it held:
    the latest word of that deployment, unless it is another's). Raises
    RecordError, and ForeignRecord over another deployment's record."""

    def change(current: DeploymentRecord | None) -> DeploymentRecord:
        if current is not None and current.deployment != record.deployment:
            raise ForeignRecord(f"{store.where(key)} is the record of another deployment")
        return record

    update_record(store, key, type(record), kind, change)
