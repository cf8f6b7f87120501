"""Records on disk: JSON files replaced atomically, read back without ever
quoting what they hold. `run.json`, a target's own records and the records of exports and
compares all go through here."""

from __future__ import annotations

import json
import logging
import os
import secrets
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)


class RecordError(Exception):
    """A record cannot be read or written."""


class RecordIoError(RecordError):
    """A record file or directory could not be read or written."""

    def __init__(self, path: Path, error: OSError) -> None:
        super().__init__(f"cannot access {path}: {error.strerror or error}")
        self.path = path


class ForeignRecord(RecordError):
    """A deployment's record file holds another deployment's record."""


class InvalidRecord(RecordError):
    """A file is not a valid record. Only where the problem is is kept: the
    parser's message could quote a value straight from the file."""

    def __init__(self, path: Path, kind: str, line: int, column: int) -> None:
        super().__init__(f"{path} is not a valid {kind} record (line {line}, column {column})")
        self.path = path
        self.line = line
        self.column = column


def write_atomic(directory: Path, name: str, content: bytes) -> None:
    """Replaces `directory/name` with `content` atomically: writes a private
    temporary file of its own in `directory` (`.<name>.<random>.tmp`, mode 0600,
    never shared with a concurrent save), flushes it to disk, then renames it
    over `directory/name`, so a reader sees either the old or the new content.
    The temporary file is removed when the write or the rename fails.

    Raises RecordIoError when the file cannot be written or renamed.
    """
    tmp = directory / f".{name}.{secrets.token_hex(8)}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as error:
        raise RecordIoError(tmp, error) from None
    try:
        try:
            view = memoryview(content)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, directory / name)
    except OSError as error:
        try:
            tmp.unlink()
        except OSError as unlink_error:
            log.warning("cannot remove %s: %s", tmp, unlink_error)
        raise RecordIoError(directory / name, error) from None


def save_record(directory: Path, name: str, record: BaseModel) -> None:
    """Writes `record` as indented JSON to `directory/name` with `write_atomic`,
    creating `directory` if needed. Raises RecordIoError when it cannot."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise RecordIoError(directory, error) from None
    content = record.model_dump_json(indent=2).encode() + b"\n"
    write_atomic(directory, name, content)


def load_record(path: Path, model: type[M], kind: str) -> M:
    """Reads the record at `path` as `model`.

    Raises FileNotFoundError when there is none, RecordIoError when it cannot be
    read, and InvalidRecord (with a line and column, never the content) when it
    is not valid JSON or not a valid `kind` record.
    """
    try:
        content = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise
    except UnicodeDecodeError:
        raise InvalidRecord(path, kind, 1, 1) from None
    except OSError as error:
        raise RecordIoError(path, error) from None
    # The parser's errors quote the file: only a position leaves these blocks,
    # and the error is raised outside them so it carries no context either.
    position: tuple[int, int] | None = None
    try:
        data = json.loads(content)
    except json.JSONDecodeError as error:
        position = (error.lineno, error.colno)
    if position is None:
        try:
            return model.model_validate(data)
        except ValidationError as error:
            details = error.errors(include_input=False, include_url=False)
            # a value that is there and wrong is where to look first; a missing key has no place
            details.sort(key=lambda detail: detail["type"] == "missing")
            position = _position_of(content, details[0]["loc"] if details else ())
    raise InvalidRecord(path, kind, *position)


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


class DeploymentRecord(BaseModel):
    """A record kept per deployment (its last delivered model, its nights)."""

    model_config = ConfigDict(extra="forbid")

    deployment: str


D = TypeVar("D", bound=DeploymentRecord)


def load_deployment_record(path: Path, model: type[D], kind: str, deployment: str) -> D | None:
    """The `kind` record of `deployment` at `path`, or None when there is none yet.

    Raises RecordError (see `load_record`) when it cannot be read, and
    ForeignRecord when it is another deployment's.
    """
    try:
        record = load_record(path, model, kind)
    except FileNotFoundError:
        return None
    if record.deployment != deployment:
        raise ForeignRecord(f"{path} is the record of another deployment")
    return record
