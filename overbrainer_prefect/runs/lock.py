"""Who follows a run: a lock on it in its store, so that a run is never
followed by two processes at once, and that a dead follower cannot keep.

In a local runs directory the lock is an advisory `flock` on
`runs/<id>/.follow.lock`, which the kernel (or the NFS server, on a shared
volume) drops when its holder dies, however it dies; in an object store it is
a lease there, renewed while its holder lives, that expires within its TTL
when it dies (store/lease.py). Either says who holds it, for messages.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from datetime import UTC, datetime

from overbrainer_prefect.runs.store import Runs
from overbrainer_prefect.store import Busy
from overbrainer_prefect.store.records import store_errors
from overbrainer_prefect.timestamps import rfc3339

LOCK_FILE = ".follow.lock"
FOLLOWER_LOCK = ".follower.lock"
"""The lock of the runs directory's one follower (the `follow` flow), at its top."""


class RunBusy(Exception):
    """Another live process follows the run."""

    def __init__(self, run_id: str, holder: str) -> None:
        super().__init__(f"{run_id} is being followed by {holder}")
        self.holder = holder


def holder_of(runs: Runs, run_id: str) -> str:
    """Who holds the follow lock of the run `run_id` (`pid P on H, flow run F,
    since T`), or `another process` when that cannot be said."""
    key = runs.key(run_id, LOCK_FILE)
    with store_errors(runs.store.where(key)):
        return runs.store.holder(key) or "another process"


@contextmanager
def follow_lock(runs: Runs, run_id: str, flow_run_id: str | None = None) -> Iterator[None]:
    """Holds the follow lock of the run `run_id` of `runs` for the duration of
    the block.

    Raises RunBusy, at once, when another live process holds it; RecordIoError
    when its store cannot be reached.
    """
    with _held(runs, runs.key(run_id, LOCK_FILE), run_id, flow_run_id):
        yield


@contextmanager
def follower_lock(runs: Runs, flow_run_id: str | None = None) -> Iterator[None]:
    """Holds the lock of the one follower of the runs directory `runs` (its
    top) for the duration of the block. Raises RunBusy, at once, when another
    live follower holds it; RecordIoError when its store cannot be reached."""
    top = runs.top
    with _held(top, top.key(FOLLOWER_LOCK), top.where, flow_run_id):
        yield


def follower_of(runs: Runs) -> str | None:
    """Who follows every job of the runs directory `runs` now (its follower's
    holder text), None when no follower lives. Raises RecordIoError."""
    top = runs.top
    key = top.key(FOLLOWER_LOCK)
    with store_errors(top.store.where(key)):
        return top.store.holder(key)


@contextmanager
def _held(runs: Runs, key: str, what: str, flow_run_id: str | None) -> Iterator[None]:
    holder = {"flow_run_id": flow_run_id, "since": rfc3339()}
    with ExitStack() as held:
        try:
            with store_errors(runs.store.where(key)):
                held.enter_context(runs.store.lock(key, holder))
        except Busy as busy:
            raise RunBusy(what, busy.holder) from None
        yield


def followed_by(runs: Runs, run_id: str) -> str | None:
    """Who follows the run `run_id` now and until when its lock holds without
    them (`F until T` for a lease, `F while it lives` for a lock its holder's
    death drops), None when no live process does. Raises RecordIoError."""
    key = runs.key(run_id, LOCK_FILE)
    with store_errors(runs.store.where(key)):
        holder = runs.store.holder(key)
        if holder is None:
            return None
        found = None if runs.store.local_path(key) is not None else runs.store.read(key)
    until = _expires(found.data) if found is not None else None
    if until is None:
        return f"{holder} while it lives"
    return f"{holder} until {rfc3339(datetime.fromtimestamp(until, UTC))}"


def _expires(data: bytes) -> float | None:
    """When the lease `data` expires (Unix seconds), None when it does not say."""
    try:
        lease = json.loads(data)
    except ValueError:
        return None
    expires = lease.get("expires") if isinstance(lease, dict) else None
    return float(expires) if isinstance(expires, int | float) else None


def is_followed(runs: Runs, run_id: str) -> bool:
    """Whether a live process holds the follow lock of the run `run_id` now."""
    key = runs.key(run_id, LOCK_FILE)
    with store_errors(runs.store.where(key)):
        return runs.store.holder(key) is not None
