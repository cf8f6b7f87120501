"""The GPU budget: global concurrency limits on the real (ephemeral) Prefect
server, held around the life of a pod."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import pytest
from prefect.client.orchestration import get_client

from overbrainer_prefect.server_budget import (
    BudgetError,
    budget_limits,
    cents_per_hour,
    gpu_budget,
    set_budget,
)


def names() -> dict[str, str]:
    """Limit names of this test only, so tests never share slots."""
    tag = uuid.uuid4().hex[:8]
    return {"pods_limit": f"test-pods-{tag}", "spend_limit": f"test-cents-{tag}"}


async def hold(
    label: str, price: float, limits: dict[str, str], log: list[tuple[str, str, float]]
) -> None:
    async with gpu_budget(price, **limits):
        log.append((label, "in", time.monotonic()))
        await asyncio.sleep(1.0)
        log.append((label, "out", time.monotonic()))


async def meet(
    label: str, other: str, price: float, limits: dict[str, str], inside: dict[str, asyncio.Event]
) -> bool:
    """Holds the budget until the other holder is inside too (bounded); returns
    whether both were inside at once."""
    async with gpu_budget(price, **limits):
        inside[label].set()
        try:
            await asyncio.wait_for(inside[other].wait(), 60)
        except TimeoutError:
            return False
        return True


def overlapped(log: list[tuple[str, str, float]]) -> bool:
    spans: dict[str, list[float]] = {}
    for label, _, at in log:
        spans.setdefault(label, []).append(at)
    (a_in, a_out), (b_in, b_out) = spans.values()
    return a_in < b_out and b_in < a_out


async def delete(limits: dict[str, str]) -> None:
    async with get_client() as client:
        for name in limits.values():
            await client.delete_global_concurrency_limit_by_name(name)


def test_a_price_takes_one_slot_a_cent_rounded_up() -> None:
    assert cents_per_hour(0.53) == 53
    assert cents_per_hour(0.531) == 54
    assert cents_per_hour(0.0) == 1
    with pytest.raises(BudgetError, match="not a price"):
        cents_per_hour(-1.0)


def test_two_holders_of_a_one_pod_budget_run_one_after_the_other(prefect_server: None) -> None:
    limits = names()

    async def go() -> list[tuple[str, str, float]]:
        await set_budget(1, 10.0, **limits)
        log: list[tuple[str, str, float]] = []
        try:
            await asyncio.gather(hold("a", 0.5, limits, log), hold("b", 0.5, limits, log))
        finally:
            await delete(limits)
        return log

    log = asyncio.run(go())
    assert not overlapped(log), log


def test_pods_that_together_cost_more_than_the_budget_run_one_after_the_other(
    prefect_server: None,
) -> None:
    limits = names()

    async def one_after_the_other(price: float) -> list[tuple[str, str, float]]:
        await set_budget(5, 1.0, **limits)
        log: list[tuple[str, str, float]] = []
        try:
            await asyncio.gather(hold("a", price, limits, log), hold("b", price, limits, log))
        finally:
            await delete(limits)
        return log

    async def together(price: float) -> list[bool]:
        await set_budget(5, 1.0, **limits)
        inside = {"a": asyncio.Event(), "b": asyncio.Event()}
        try:
            return list(
                await asyncio.gather(
                    meet("a", "b", price, limits, inside), meet("b", "a", price, limits, inside)
                )
            )
        finally:
            await delete(limits)

    assert not overlapped(asyncio.run(one_after_the_other(0.6)))  # $1.20/h > $1.00/h
    assert asyncio.run(together(0.4)) == [True, True]  # $0.80/h together fits


def test_a_pod_dearer_than_the_whole_budget_is_refused_at_once(prefect_server: None) -> None:
    limits = names()

    async def go() -> None:
        await set_budget(2, 1.0, **limits)
        try:
            async with gpu_budget(1.5, **limits):
                raise AssertionError("the budget let a $1.50/h pod in under $1.00/h")
        finally:
            await delete(limits)

    with pytest.raises(BudgetError, match=r"costs more than the whole GPU budget.*gcl update"):
        asyncio.run(go())


def test_without_a_budget_a_pod_runs_unbounded_unless_strict(prefect_server: None) -> None:
    limits = names()

    async def go(strict: bool) -> Any:
        assert set((await budget_limits(**limits)).values()) == {None}
        async with gpu_budget(0.5, strict=strict, **limits):
            return "ran"

    assert asyncio.run(go(False)) == "ran"
    with pytest.raises(BudgetError, match="no GPU budget.*create_blocks.py --budget-pods"):
        asyncio.run(go(True))


def test_set_budget_resizes_an_existing_budget(prefect_server: None) -> None:
    limits = names()

    async def go() -> dict[str, int | None]:
        await set_budget(1, 1.0, **limits)
        await set_budget(3, 2.5, **limits)
        try:
            return await budget_limits(**limits)
        finally:
            await delete(limits)

    assert asyncio.run(go()) == {limits["pods_limit"]: 3, limits["spend_limit"]: 250}
