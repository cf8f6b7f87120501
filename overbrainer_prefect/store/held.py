"""The locks this task holds, by what each guards (a run's ID), so that every
act on what a lock guards checks first that the lock is still held: a record
write, a file put, a pod's delete or creation, a flow run resumed. Locks are
kept in a context variable: each asyncio task and each thread it starts
(`asyncio.to_thread`) sees the locks of the task that started it, and no
other task's."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from overbrainer_prefect.store.base import Held

_HELD: ContextVar[tuple[tuple[str, Held], ...]] = ContextVar("overbrainer_held", default=())


@contextmanager
def guarding(name: str, held: Held) -> Iterator[None]:
    """Within the block, `check_guarded(name)` checks `held` (a lock on what
    `name` names)."""
    token = _HELD.set((*_HELD.get(), (name, held)))
    try:
        yield
    finally:
        _HELD.reset(token)


def check_guarded(name: str) -> None:
    """Raises LeaseLost when this task holds a lock on `name` that it lost;
    nothing when it holds it, or holds none (a process that never took one)."""
    for guarded, held in _HELD.get():
        if guarded == name:
            held.check()
