"""The GPU budget's slots under leases that can outlive the process that took
them: a pod's flow run holds its slots (one pod, its cents an hour) while the
pod lives, renewing their leases; when it suspends while its job runs, it
hands them over (kept in the job's run directory) to the follower, which
renews them while it follows the job and releases them once the job ended.
A follower at its term's end renews them from when it lets go of its jobs
until its successor follows them (`flows/follow.py`): no gap between two
followers. Leases nobody renews free their slots within LEASE_S (Prefect's
own bound on a dead holder), as they always did when a flow run's process died.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.concurrency._asyncio import aacquire_concurrency_slots_with_lease
from prefect.concurrency.context import ConcurrencyContext

from overbrainer_prefect.cancelling import cancel_and_wait
from overbrainer_prefect.money.limits import LEASE_S
from overbrainer_prefect.runs.lock import follower_of
from overbrainer_prefect.runs.store import Runs
from overbrainer_prefect.targets.base import Logger

HANDOVER_S = 600.0
"""The most a follower that holds GPU budget leases of its jobs waits (renewing
them) for its successor to hold the runs directory: the follow deployment's
schedule starts one within ten minutes when the one it started does not come."""
HANDOVER_LOOK_S = 2.0  # between two looks at who holds it

RENEW_EVERY_S = LEASE_S / 3
"""How often a holder renews its leases."""

LEASES_FILE = "budget-leases.json"
"""In a job's run directory: the leases of its pod's budget slots, handed over."""


class Leases:
    """The leases one pod's hold of the budget took, and whether they were
    handed over (then they outlive the hold)."""

    def __init__(self) -> None:
        self.ids: list[UUID] = []
        self.handed_over = False

    def hand_over(self, store: Runs, run_id: str) -> None:
        """Keeps the leases past this process for the follower of the job
        `run_id` (in its run directory): neither the hold's end nor Prefect's
        cleanup of this flow run's leases releases them. Raises RecordIoError
        when they cannot be kept (nothing handed over)."""
        store.write_bytes(run_id, LEASES_FILE, json.dumps([str(i) for i in self.ids]).encode())
        self.handed_over = True
        context = ConcurrencyContext.get()
        if context is not None:
            context.cleanup_lease_ids[:] = [
                i for i in context.cleanup_lease_ids if i not in self.ids
            ]


def handed_over(store: Runs, run_id: str) -> list[UUID]:
    """The budget leases handed over with the job `run_id`; none when there
    are none, or they cannot be read (their slots then free themselves)."""
    try:
        return [UUID(i) for i in json.loads(store.read_bytes(run_id, LEASES_FILE))]
    except Exception:  # none kept (no budget, or followed in-process)
        return []


@asynccontextmanager
async def leased(
    name: str, occupy: int, timeout_s: float | None, leases: Leases, logger: Logger
) -> AsyncIterator[None]:
    """Holds `occupy` slots of the global concurrency limit `name` for the
    block, waiting (up to `timeout_s`, None: forever) until they are free,
    under a lease renewed while the block runs, released at its end unless
    handed over. Raises TimeoutError past `timeout_s`; what Prefect raises
    when the limit does not exist."""
    granted = await aacquire_concurrency_slots_with_lease(
        [name], occupy, timeout_seconds=timeout_s, lease_duration=LEASE_S, strict=True
    )
    leases.ids.append(granted.lease_id)
    try:
        async with renewed([granted.lease_id], logger):
            yield
    finally:
        if not leases.handed_over:
            await asyncio.shield(release([granted.lease_id], logger))


@asynccontextmanager
async def renewed(
    ids: Sequence[UUID], logger: Logger, *, at_once: bool = False, last_on_exit: bool = False
) -> AsyncIterator[None]:
    """Renews the leases `ids` every RENEW_EVERY_S while the block runs (first
    at once with `at_once`: leases taken over; once more at its end with
    `last_on_exit`: leases handed on, which then last a whole LEASE_S for
    their next holder); a lease that cannot be renewed is logged once: its
    slots free themselves."""
    warned: set[UUID] = set()
    renewing = asyncio.create_task(_renew(ids, logger, at_once, warned))
    try:
        yield
    finally:
        await cancel_and_wait(renewing)
        if last_on_exit and ids:
            await asyncio.shield(_renew_once(ids, logger, warned))


async def _renew(ids: Sequence[UUID], logger: Logger, at_once: bool, warned: set[UUID]) -> None:
    while True:
        if not at_once:
            await asyncio.sleep(RENEW_EVERY_S)
        at_once = False
        await _renew_once(ids, logger, warned)


async def _renew_once(ids: Sequence[UUID], logger: Logger, warned: set[UUID]) -> None:
    for lease in ids:
        try:
            async with get_client() as client:
                await client.renew_concurrency_lease(lease, LEASE_S)
        except Exception as error:
            if lease not in warned:
                warned.add(lease)
                logger.warning(
                    "cannot renew the GPU budget's lease %s (%s): its slots free themselves "
                    "within %g s; the pod stays bounded by its watchdog",
                    lease,
                    error,
                    LEASE_S,
                )


async def release(ids: Sequence[UUID], logger: Logger) -> None:
    """Releases the leases `ids` (their slots free at once). A lease already
    gone or a server that refuses is logged: its slots free themselves."""
    for lease in ids:
        try:
            async with get_client() as client:
                await client.release_concurrency_slots_with_lease(lease)
        except Exception as error:
            logger.warning("cannot release the GPU budget's lease %s now: %s", lease, error)


async def taken_over(runs: Runs, logger: Logger) -> None:
    """Waits (at most HANDOVER_S) until a follower holds the runs directory
    again: the successor, which follows every job from then on, and renews
    the GPU budget's leases of the jobs this one followed. Says in one line
    when none came. Never raises: a store away is looked at again."""
    loop = asyncio.get_running_loop()
    end = loop.time() + HANDOVER_S
    while loop.time() < end:
        try:
            holder = await asyncio.to_thread(follower_of, runs)
        except Exception as error:  # the store is away: looked at again
            logger.warning("cannot read who follows %s now: %s", runs.where, error)
            holder = None
        if holder is not None:
            logger.info("%s is followed by the next follower (%s)", runs.where, holder)
            return
        await asyncio.sleep(HANDOVER_LOOK_S)
    logger.warning(
        "the next follower did not take %s within %g s: the GPU budget's slots of the jobs "
        "this one followed free themselves within %g s unless it takes them first (its "
        "schedule starts one)",
        runs.where,
        HANDOVER_S,
        LEASE_S,
    )
