"""A helper task is ended for sure (`overbrainer_prefect.cancelling`): one
that loses a cancel, as Python 3.11's `asyncio.wait_for` loses one that lands
while its inner call completes (CPython gh-86296), is cancelled again and
ends, where a plain cancel and wait would wait for ever (make test,
2026-12-06: a pod's lease renewal loop outlived its job's follow that way)."""

from __future__ import annotations

import asyncio

import pytest

from overbrainer_prefect import cancelling
from overbrainer_prefect.cancelling import cancel_and_wait

LOOKS = 0.01  # seconds between two turns of the stand-in renewal loop


async def renewing(lost: int, turns: list[int]) -> None:
    """A renewal loop whose first `lost` cancels are lost, as a `wait_for`
    that completed as the cancel landed loses it (the cancel is swallowed)."""
    while True:
        try:
            turns.append(1)
            await asyncio.sleep(LOOKS)
        except asyncio.CancelledError:
            if lost == 0:
                raise
            lost -= 1


def test_a_task_that_lost_a_cancel_is_cancelled_again_and_ends() -> None:
    async def scenario() -> None:
        turns: list[int] = []
        task = asyncio.create_task(renewing(2, turns))
        await asyncio.sleep(3 * LOOKS)
        assert await cancel_and_wait(task, again_s=0.05)
        assert task.cancelled()
        # the plain way waits for ever: one cancel, lost, then the loop goes on
        plain = asyncio.create_task(renewing(1, []))
        await asyncio.sleep(3 * LOOKS)
        plain.cancel()
        done, _ = await asyncio.wait([plain], timeout=0.5)
        assert not done, "a lost cancel leaves the loop running"
        assert await cancel_and_wait(plain, again_s=0.05)

    asyncio.run(scenario())


def test_a_task_that_runs_on_past_the_tries_is_given_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cancelling, "TRIES", 5)

    async def scenario() -> None:
        task = asyncio.create_task(renewing(8, []))  # loses more cancels than one call makes
        await asyncio.sleep(LOOKS)
        assert not await cancel_and_wait(task, again_s=0.01)  # bounded: it gives up
        assert not task.done()
        assert await cancel_and_wait(task, again_s=0.01)  # the next call ends it
        assert task.cancelled()

    asyncio.run(scenario())


def test_an_ended_task_is_not_cancelled_and_its_error_is_dropped() -> None:
    async def scenario() -> None:
        async def fails() -> None:
            raise RuntimeError("renewal refused")

        task = asyncio.create_task(fails())
        await asyncio.wait([task])
        assert await cancel_and_wait(task)
        assert not task.cancelled()

    asyncio.run(scenario())
