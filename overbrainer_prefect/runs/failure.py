"""Why a job failed, in one line, from the end of its `job.log`.

A failed axolotl job ends its log with a Python traceback: the exception
axolotl (or a library under it) raised is the cause. Some exceptions only wrap
the real one (`DatasetGenerationError: An error occurred while generating the
dataset`, torchrun's `ChildFailedError`): then the error logged just before
it, or the exception it was raised from, is added, e.g. `JSON parse error:
Invalid value. in row 1`. Without a traceback, the last `[ERROR]` line is the
cause (a wrapper prefers the `[ERROR]` line logged before it: datasets logs
the parse error there). A disk that filled (`No space left on device`, errno
28, anywhere in the end of the log: Python's, Rust's and C's words for it) is
the cause whatever was raised over it. The line never holds more than
CAUSE_MAX characters.
"""

from __future__ import annotations

import re

CAUSE_MAX = 400  # characters of a cause, at most: it goes into one-line messages
TAIL_LINES = 400  # lines of a job log's end that the cause is looked for in

WRAPPERS = frozenset(
    {
        "DatasetGenerationError",
        "ChildFailedError",
        "CalledProcessError",
        "SystemExit",
    }
)
"""Exceptions that only say that another one happened."""

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_EXCEPTION = re.compile(
    r"^((?:[A-Za-z_]\w*\.)*([A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt)))(?::\s*(.*))?$"
)
_ERROR_LOG = re.compile(r"\[ERROR\]\s*(?:\[[^\]]*\]\s*)*(.*)$")
_DISK_FULL = re.compile(r"No space left on device|\[Errno 28\]|os error 28", re.IGNORECASE)
DISK_FULL = (
    "its machine's disk filled (No space left on device): give it more disk (on Runpod, a "
    "larger container_disk_gb, or auto)"
)
"""The cause of a job that ran out of disk."""


def failure_cause(log_text: str) -> str | None:
    """The cause of a failed job from its log's text (its end is enough): the
    last exception raised, with the error under it when it only wraps one;
    None when the log shows no error."""
    lines = [_ANSI.sub("", line).rstrip() for line in log_text.splitlines()[-TAIL_LINES:]]
    if any(_DISK_FULL.search(line) for line in lines):
        return DISK_FULL
    exceptions: list[tuple[int, str, str]] = []  # (line, short type, "Type: message")
    errors: list[tuple[int, str]] = []
    in_traceback = False
    for index, line in enumerate(lines):
        if line.startswith("Traceback (most recent call last)"):
            in_traceback = True
            continue
        logged = _ERROR_LOG.search(line)
        if logged and logged.group(1).strip():
            errors.append((index, logged.group(1).strip()))
        if in_traceback and line and not line[0].isspace():
            in_traceback = False
            found = _EXCEPTION.match(line.strip())
            if found:
                message = (found.group(3) or "").strip()
                text = f"{found.group(2)}: {message}" if message else found.group(2)
                exceptions.append((index, found.group(2), text))
    if not exceptions:
        return _short(errors[-1][1]) if errors else None
    index, kind, text = exceptions[-1]
    if kind not in WRAPPERS:
        return _short(text)
    earlier = [e for e in exceptions[:-1] if e[1] not in WRAPPERS]
    logged_before = [e for e in errors if e[0] < index]
    if logged_before:
        return _short(f"{text} ({logged_before[-1][1]})")
    if earlier:
        return _short(f"{text} ({earlier[-1][2]})")
    return _short(text)


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= CAUSE_MAX else text[: CAUSE_MAX - 1] + "…"
