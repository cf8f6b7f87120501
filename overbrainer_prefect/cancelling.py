"""Ending a helper task for sure (a lease's renewal loop, a pause's keeper).

On Python 3.11 (the flows' interpreter) a cancel that lands while an
`asyncio.wait_for` inside the task is completing is lost: `wait_for` returns
its result instead of raising `CancelledError` (CPython gh-86296, fixed in
3.12). A loop whose one cancel was lost goes on, and whoever awaits it after
cancelling it waits for ever: a pod's lease renewal (asyncssh's `run` waits
with `wait_for`) kept a finished job's follow from ever returning, so its
files were never marked retrieved and the pod was deleted by its watchdog
while the follow hung (make test, 2026-12-06)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

AGAIN_S = 1.0
"""Seconds between two cancels of a task that runs on after one."""

TRIES = 30
"""Cancels of one task at most; past them it is left running, not waited for."""


async def cancel_and_wait(task: asyncio.Task[Any], again_s: float = AGAIN_S) -> bool:
    """Cancels `task` and waits for it to end, cancelling it again every
    `again_s` while it runs on (a cancel it lost), TRIES times at most.
    Returns whether it ended; its result or exception is dropped. Raises
    CancelledError only when the caller itself is cancelled meanwhile."""
    for _ in range(TRIES):
        if task.done():
            break
        task.cancel()
        await asyncio.wait([task], timeout=again_s)
    if not task.done():
        return False
    with contextlib.suppress(asyncio.CancelledError, Exception):
        task.result()
    return True
