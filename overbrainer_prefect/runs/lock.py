"""Who follows a run: a lock on it in its store, so that a run is never
followed by two processes at once, and that a dead follower cannot keep.

In a local runs directory the lock is an advisory `flock` on
`runs/<id>/.follow.lock`, which the kernel (or the NFS server, on a shared
volume) drops when its holder dies, however it dies; in an object store it is
a lease there, renewed while its holder lives, that expires within its TTL
when it dies (store/lease.py), and that its holder loses when it cannot
renew it in time. Either says who holds it, for messages, and whether it is
still held (`Held.lost`): every act on a run (a record write, a file put, a
pod's delete, a flow run's resume) checks the run's lock first
(`store/held.py`), and one whose lock is lost raises LeaseLost instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from datetime import UTC, datetime

from overbrainer_prefect.runs.store import Runs
from overbrainer_prefect.store import Busy, Held, LeaseLost
from overbrainer_prefect.store.held import guarding
from overbrainer_prefect.store.lease import LeaseStore, lease_held
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


def lost_line(run_id: str, lost: LeaseLost) -> str:
    """What a follower that lost the run `run_id` says, in one line."""
    if lost.taken:
        return f"another follower took run {run_id} at {lost.at}: this one stops following it"
    return (
        f"another follower may take run {run_id} from {lost.at} (its follow lock was "
        f"{lost.why}; the follower or the next collect takes it): this one stops following it"
    )


@contextmanager
def follow_lock(runs: Runs, run_id: str, flow_run_id: str | None = None) -> Iterator[Held]:
    """Holds the follow lock of the run `run_id` of `runs` for the duration of
    the block, which gets whether it still holds it (`Held`); within it,
    every act on the run checks it (`store/held.py`: LeaseLost).

    Raises RunBusy, at once, when another live process holds it; RecordIoError
    when its store cannot be reached.
    """
    key = runs.key(run_id, LOCK_FILE)
    with _held(runs, key, run_id, flow_run_id) as held, guarding(run_id, held):
        yield held


@contextmanager
def follower_lock(runs: Runs, flow_run_id: str | None = None) -> Iterator[Held]:
    """Holds the lock of the one follower of the runs directory `runs` (its
    top) for the duration of the block, which gets whether it still holds it
    (`Held`). Raises RunBusy, at once, when another live follower holds it;
    RecordIoError when its store cannot be reached."""
    top = runs.top
    with _held(top, top.key(FOLLOWER_LOCK), top.where, flow_run_id) as held:
        yield held


def follower_of(runs: Runs) -> str | None:
    """Who follows every job of the runs directory `runs` now (its follower's
    holder text), None when no follower lives. Raises RecordIoError."""
    top = runs.top
    key = top.key(FOLLOWER_LOCK)
    with store_errors(top.store.where(key)):
        return top.store.holder(key)


@contextmanager
def _held(runs: Runs, key: str, what: str, flow_run_id: str | None) -> Iterator[Held]:
    holder = {"flow_run_id": flow_run_id, "since": rfc3339()}
    with ExitStack() as stack:
        try:
            with store_errors(runs.store.where(key)):
                held = stack.enter_context(runs.store.lock(key, holder))
        except Busy as busy:
            raise RunBusy(what, busy.holder) from None
        yield held


def followed_by(runs: Runs, run_id: str) -> str | None:
    """Who follows the run `run_id` now and until when its lock holds without
    them (`F until T` for a lease, by the store's clock; `F while it lives`
    for a lock its holder's death drops), None when no live process does.
    Raises RecordIoError."""
    key = runs.key(run_id, LOCK_FILE)
    with store_errors(runs.store.where(key)):
        store = runs.store
        if not isinstance(store, LeaseStore):  # a lock its holder's death drops
            holder = store.holder(key)
            return None if holder is None else f"{holder} while it lives"
        held = lease_held(store, key)  # one read: who, and until when
    if held is None:
        return None
    return f"{held[0]} until {rfc3339(datetime.fromtimestamp(held[1], UTC))}"


def is_followed(runs: Runs, run_id: str) -> bool:
    """Whether a live process holds the follow lock of the run `run_id` now."""
    key = runs.key(run_id, LOCK_FILE)
    with store_errors(runs.store.where(key)):
        return runs.store.holder(key) is not None
