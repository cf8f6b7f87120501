"""The tests' bound on a flow run: a hang fails its test with where it waits."""

from __future__ import annotations

import asyncio

import pytest

from tests.flowrun import run


def test_a_coroutine_past_its_bound_fails_naming_where_it_waits_and_is_cancelled() -> None:
    cancelled: list[bool] = []

    async def stuck_in_a_step() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    with pytest.raises(AssertionError, match=r"still running after 0.5 s; .*stuck_in_a_step"):
        run(stuck_in_a_step(), bound_s=0.5)
    assert cancelled == [True]
    assert run(asyncio.sleep(0, result="done"), bound_s=5) == "done"
