"""The lines a bench script prints, and the wrapper that turns any failure
into one `BENCH-ERROR` line.

    BENCH <name> <value> <unit> goal <op> <target>
    BENCH-ERROR <script> <one line why>

`#` lines say what was measured; a figure that misses its goal is printed all
the same, with `MISSED` after it so a reader sees it without doing the sums.
"""

from __future__ import annotations

import operator
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

ERROR_EXIT = 3  # a script that printed its BENCH-ERROR line exits with this (the Makefile's cue)

_OPS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge,
    "<=": operator.le,
    ">": operator.gt,
    "<": operator.lt,
}


def bench(
    name: str,
    value: float,
    unit: str,
    op: str | None = None,
    target: float | None = None,
    digits: int = 2,
) -> bool:
    """Prints `BENCH name value unit [goal op target]`; returns whether the goal
    is met (True without a goal). Raises KeyError for an unknown `op`."""
    met = True
    if op is not None and target is not None:
        met = _OPS[op](value, target)
        while digits < 4 and _OPS[op](round(value, digits), target) != met:
            digits += 1  # never a rounded figure that seems to meet a goal it misses
    line = f"BENCH {name} {value:.{digits}f} {unit}"
    if op is not None and target is not None:
        line += f" goal {op} {target:g}" + ("" if met else "  MISSED")
    print(line, flush=True)
    return met


def note(text: str) -> None:
    """Prints a `#` line (what was measured, the raw numbers)."""
    for line in text.splitlines() or [""]:
        print(f"# {line}", flush=True)


_STARTED = time.monotonic()


def progress(text: str) -> None:
    """Says on stderr what the script is doing, with the seconds since it began
    (stdout keeps only the BENCH and # lines)."""
    print(
        f"[{Path(sys.argv[0]).name} +{time.monotonic() - _STARTED:.0f}s] {text}",
        file=sys.stderr,
        flush=True,
    )


def one_line(error: BaseException) -> str:
    """`error` as one line: its type and the first line of its message."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def run_main(script: str, main: Callable[[], None]) -> None:
    """Runs `main`; any failure (Ctrl-C included) is printed as one
    `BENCH-ERROR <script> <why>` line, the traceback only with BENCH_DEBUG=1,
    and the process exits ERROR_EXIT."""
    name = Path(script).name
    try:
        main()
    except BaseException as error:  # every failure becomes one line
        if isinstance(error, SystemExit) and error.code in (0, None):
            raise

        if os.environ.get("BENCH_DEBUG") == "1":
            traceback.print_exc()
        print(f"BENCH-ERROR {name} {one_line(error)}", flush=True)
        sys.exit(ERROR_EXIT)
