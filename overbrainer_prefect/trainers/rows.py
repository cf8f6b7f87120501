"""What the rows of a local dataset file must carry for their axolotl `type`,
checked before a run exists.

A JSON lines file (`.jsonl`, `.json`, and their `.gz`) is read row by row:
each row must be a JSON object holding what its type reads (`chat_template`:
a list of messages, each with a role and a content; `alpaca`: `instruction`
and `output`; `completion`: `text`; `input_output`: `segments`). The first bad
row is named by file and line. Other formats (Parquet, Arrow, CSV,
directories) are not read here: the caller gets a warning.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO

JSON_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")
"""The files whose rows are checked."""

SHOWN_KEYS = 6  # keys of a bad row named in its message, at most

RowCheck = Callable[[Mapping[str, object]], str | None]
"""What is wrong with one row (a JSON object), or None."""


def first_bad_row(
    path: Path, dataset_type: str, fields: Mapping[str, object]
) -> tuple[str | None, str | None]:
    """Reads the local dataset file `path` as axolotl would for `dataset_type`
    (with the dataset's own keys `fields`: `field_messages`, `field`,
    `message_property_mappings`...). Returns (problem, warning): the one line
    naming the first bad row and what to fix, or a warning when the file's
    format is not one whose rows are read here. Never raises."""
    name = path.name.lower()
    if path.is_dir() or not name.endswith(JSON_SUFFIXES):
        return None, f"dataset {path}: rows of this format are not checked before the run"
    need = _requirement(dataset_type, fields)
    try:
        for where, row in _rows(path):
            if not isinstance(row, dict):
                return f"dataset {path} {where} is not a JSON object: each row must be one", None
            problem = need(row)
            if problem is not None:
                return f"dataset {path} {where} {problem}", None
    except _NotJson as bad:
        return f"dataset {path} {bad.where} is not JSON ({bad.reason}): fix or remove it", None
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        return f"dataset {path} cannot be read ({type(exc).__name__}): check the file", None
    return None, None


class _NotJson(Exception):
    def __init__(self, where: str, reason: str) -> None:
        super().__init__(where)
        self.where = where
        self.reason = reason


def _open(path: Path) -> IO[str]:
    if path.name.lower().endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return path.open(encoding="utf-8")


def _rows(path: Path) -> Iterator[tuple[str, object]]:
    """(where, row) of each row: JSON lines, or one JSON array of rows."""
    with _open(path) as file:
        first = ""
        for line in file:
            if line.strip():
                first = line
                break
        if first.lstrip().startswith("["):  # one JSON array (or an object per line after all)
            text = first + file.read()
            try:
                rows = json.loads(text)
            except ValueError as exc:
                raise _NotJson("(a JSON array)", _reason(exc)) from None
            for index, row in enumerate(rows if isinstance(rows, list) else [rows]):
                yield f"row {index}", row
            return
    with _open(path) as file:
        for number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            try:
                yield f"line {number}", json.loads(line)
            except ValueError as exc:
                raise _NotJson(f"line {number}", _reason(exc)) from None


def _reason(exc: ValueError) -> str:
    if isinstance(exc, json.JSONDecodeError):
        return f"{exc.msg} at column {exc.colno}"
    return type(exc).__name__


def _requirement(dataset_type: str, fields: Mapping[str, object]) -> RowCheck:
    """The check of one row for `dataset_type`: returns what is wrong, or None."""
    if dataset_type == "chat_template":
        return _chat_rows(fields)
    if dataset_type == "alpaca":
        return _keys_needed(("instruction", "output"), "type alpaca reads")
    if dataset_type == "completion":
        field = str(fields.get("field") or "text")
        return _keys_needed((field,), "type completion reads", fix="set the dataset's field")
    if dataset_type == "input_output":
        return _keys_needed(("segments",), "type input_output reads")
    return lambda row: None


def _keys_needed(keys: tuple[str, ...], why: str, fix: str = "") -> RowCheck:
    def check(row: Mapping[str, object]) -> str | None:
        missing = [k for k in keys if row.get(k) is None]
        if not missing:
            return None
        shown = ", ".join(f"`{k}`" for k in missing)
        then = f": {fix}" if fix else ": give each row those keys, or change the dataset's type"
        return f"has no {shown} ({why} {', '.join(keys)}; the row has {_keys(row)}){then}"

    return check


def _chat_rows(fields: Mapping[str, object]) -> RowCheck:
    messages = str(fields.get("field_messages") or "messages")
    mappings = fields.get("message_property_mappings")
    mapped = dict(mappings) if isinstance(mappings, Mapping) else {}
    role = str(mapped.get("role") or fields.get("message_field_role") or "role")
    content = str(mapped.get("content") or fields.get("message_field_content") or "content")

    def check(row: Mapping[str, object]) -> str | None:
        turns = row.get(messages)
        if not isinstance(turns, list) or not turns:
            return (
                f"has no list of messages under `{messages}` (the row has {_keys(row)}): set "
                "field_messages to the key that holds the conversation"
            )
        for index, turn in enumerate(turns):
            if not isinstance(turn, dict):
                return f"message {index} is not a JSON object"
            if turn.get(role) is None:
                return (
                    f"message {index} has no `{role}` (it has {_keys(turn)}): set "
                    "message_property_mappings, e.g. {role: from, content: value}"
                )
            if turn.get(content) is None and turn.get("tool_calls") is None:
                return (
                    f"message {index} has no `{content}` (it has {_keys(turn)}): set "
                    "message_property_mappings, e.g. {role: from, content: value}"
                )
        return None

    return check


def _keys(row: Mapping[str, object]) -> str:
    names = [f"`{str(k)[:40]}`" for k in list(row)[:SHOWN_KEYS]]
    more = f" and {len(row) - SHOWN_KEYS} more" if len(row) > SHOWN_KEYS else ""
    return (", ".join(names) + more) if names else "no keys"
