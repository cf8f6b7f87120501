"""Running a flow (or any coroutine) from a test, within a bound.

pytest-timeout, past its limit, shows only the event loop waiting in `select`:
not which step of which flow hung. A flow run past `FLOW_BOUND_S` (a hang on
any machine: the slowest flow of the suite takes a few minutes on a loaded
one) fails its test with where each task of its loop waits, then is cancelled
(its flow cleans up as on any cancel).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

FLOW_BOUND_S = 420.0
"""Seconds a flow of a test may run (pytest's own timeout, 600 s, counts the
test's fixtures too)."""
CLEANUP_S = 60.0  # seconds a flow past its bound has to clean up once cancelled
FRAMES = 8  # innermost frames shown per task


def run(coroutine: Coroutine[Any, Any, T], bound_s: float = FLOW_BOUND_S) -> T:
    """Runs `coroutine` in a new event loop and returns what it returns (or
    raises what it raises). Past `bound_s` seconds, raises AssertionError
    naming where each task of the loop waits, once the coroutine was
    cancelled."""

    async def bounded() -> T:
        task = asyncio.ensure_future(coroutine)
        done, _ = await asyncio.wait({task}, timeout=bound_s)
        if task in done:
            return task.result()
        where = waiting_tasks()
        task.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(task, CLEANUP_S)
        raise AssertionError(f"still running after {bound_s:g} s; its tasks wait in: {where}")

    return asyncio.run(bounded())


def waiting_tasks() -> str:
    """Each task of the running loop but the caller's, with its innermost
    frames (file:line function, innermost first), on one line."""
    shown = []
    for task in asyncio.all_tasks():
        if task is asyncio.current_task():
            continue
        frames = task.get_stack()[-FRAMES:]
        where = " < ".join(
            f"{Path(f.f_code.co_filename).name}:{f.f_lineno} {f.f_code.co_name}"
            for f in reversed(frames)
        )
        shown.append(f"[{task.get_name()}] {where or 'not started'}")
    return " | ".join(shown) or "no other task"
