"""The live jobs a follower's pass or a collect reads (issue 36): only those
the live index names (runs/live.py), never the history; each one's lock
first, its record only when nobody follows it, a few at a time. Core: no
Prefect, so a pass's store calls run in worker threads of whoever calls it."""

from __future__ import annotations

from collections.abc import Callable, Container
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress

from overbrainer_prefect.runs.lock import followed_by
from overbrainer_prefect.runs.store import RunNotFound, RunRecord, Runs, subject
from overbrainer_prefect.store.records import RecordError
from overbrainer_prefect.targets.base import Logger, Target

LIVE_READERS = (
    8  # live jobs a pass reads at once (a round trip each), within boto3's 10 connections
)


def unfollowed_of(
    entries: list[tuple[Runs, str]],
    following: Container[str],
    followed: list[str] | None = None,
) -> list[tuple[Runs, RunRecord]]:
    """The records of the live index's `entries` that no live process
    follows, runs first, oldest first, read LIVE_READERS at a time (a store's
    round trip each); a marker whose record never came is dropped once
    stale; each job not ended that a live process follows is said in
    `followed` when given (its record read for that). Never raises for one
    job: what cannot be read now is looked at by the next pass. Store calls:
    run in a worker thread."""

    def unfollowed(store: Runs, record_id: str) -> RunRecord | None:
        try:
            follower = followed_by(store, record_id)
            if follower is None:
                return store.load(record_id)
            if followed is not None:
                record = store.load(record_id)
                if not record.state.ended:
                    followed.append(
                        f"{subject(record)} is followed by {follower}; the next collect takes "
                        "it if that follower is gone"
                    )
            return None
        except RunNotFound:
            with suppress(RecordError):  # else the next pass drops it
                store.drop_if_stale(record_id)
        except RecordError:  # unreadable now: the next pass looks again
            pass
        return None

    todo = [
        (store, record_id)
        for store, record_id in sorted(entries, key=lambda entry: (bool(entry[0].prefix), entry[1]))
        if store.key(record_id) not in following
    ]
    if not todo:
        return []
    with ThreadPoolExecutor(min(LIVE_READERS, len(todo))) as pool:
        records = list(pool.map(lambda entry: unfollowed(*entry), todo))
    return [
        (store, record)
        for (store, _), record in zip(todo, records, strict=True)
        if record is not None
    ]


def collectable(
    unfollowed: list[tuple[Runs, RunRecord]],
    targets: dict[str, Target | None],
    holds: Callable[[Runs, RunRecord, Target | None], bool],
    logger: Logger,
) -> list[tuple[Runs, RunRecord, Target | None]]:
    """The jobs among `unfollowed` a collector has something to do with, each
    with its target of `targets` (None when its block is gone): every job not
    ended, and every ended one its target still holds something for (a pod
    not deleted); an ended job `holds` says holds nothing leaves the live
    index. Never raises for one job: what cannot be written now is said and
    tried by the next pass. Store calls: run in a worker thread."""
    found: list[tuple[Runs, RunRecord, Target | None]] = []
    for store, record in unfollowed:
        target = targets.get(record.target)
        if not record.state.ended or (target is not None and target.leftover(store, record)):
            found.append((store, record, target))
        elif not holds(store, record, target):
            try:
                store.unmark_live(record.id)
            except RecordError as error:  # the next pass tries again
                logger.warning(
                    "%s: cannot take it out of the live index: %s", subject(record), error
                )
    return found
