"""The GPU budget: global concurrency limits that bound how many pods run at
once and what they cost together, so that a burst of scheduled runs queues
instead of overspending.

Two limits, created once per Prefect server (`python blocks/create_blocks.py
--budget-pods 2 --budget-dollars-per-hour 5`, or `prefect gcl create`):

- `overbrainer-gpu-pods`: one slot a pod;
- `overbrainer-gpu-cents-per-hour`: one slot a cent of hourly price, so a pod
  at $0.53/h holds 53 slots.

A flow takes both before it provisions a pod and holds them while the pod
lives (`async with gpu_budget(price_per_hour)`): a flow that cannot take them
waits until others release theirs. Slots are leased: when the process holding
them dies, Prefect frees them once the lease runs out.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

from prefect.client.orchestration import get_client
from prefect.concurrency.asyncio import concurrency
from prefect.exceptions import ObjectNotFound
from prefect.logging.loggers import get_logger, get_run_logger

from overbrainer_prefect.flows.money import admission
from overbrainer_prefect.money.ledger import Ask
from overbrainer_prefect.money.store import Admission, Facts
from overbrainer_prefect.runs.store import Runs

POD_LIMIT = "overbrainer-gpu-pods"
"""The global concurrency limit counting pods (one slot a pod)."""

SPEND_LIMIT = "overbrainer-gpu-cents-per-hour"
"""The global concurrency limit counting the hourly price of the pods, in cents."""

LEASE_S = 300.0  # the slots of a holder that died free themselves after this long


class BudgetError(Exception):
    """The GPU budget cannot be taken; the message says what to do."""


def cents_per_hour(price_per_hour: float) -> int:
    """The slots a pod at `price_per_hour` dollars an hour takes of the spend limit
    (cents, rounded up; at least one). Raises BudgetError for a negative or
    non-finite price."""
    if not math.isfinite(price_per_hour) or price_per_hour < 0:
        raise BudgetError(f"{price_per_hour!r} is not a price in dollars an hour")
    return max(1, math.ceil(round(price_per_hour * 100, 6)))


def create_commands(pods: int = 2, dollars_per_hour: float = 5.0) -> str:
    """The commands that create the budget's limits (for messages and the README)."""
    return (
        f"`prefect gcl create {POD_LIMIT} --limit {pods}` and "
        f"`prefect gcl create {SPEND_LIMIT} --limit {cents_per_hour(dollars_per_hour)}` "
        f"(or `python blocks/create_blocks.py --budget-pods {pods} "
        f"--budget-dollars-per-hour {dollars_per_hour:g}`)"
    )


async def budget_limits(
    pods_limit: str = POD_LIMIT, spend_limit: str = SPEND_LIMIT
) -> dict[str, int | None]:
    """The size of each budget limit on the server, None for one that does not
    exist. Raises what the Prefect client raises when the server cannot be reached."""
    sizes: dict[str, int | None] = {}
    async with get_client() as client:
        for name in (pods_limit, spend_limit):
            try:
                sizes[name] = (await client.read_global_concurrency_limit_by_name(name)).limit
            except ObjectNotFound:
                sizes[name] = None
    return sizes


async def set_budget(
    pods: int,
    dollars_per_hour: float,
    *,
    pods_limit: str = POD_LIMIT,
    spend_limit: str = SPEND_LIMIT,
) -> dict[str, int]:
    """Creates the budget's limits, or resizes them, on the server: at most `pods`
    pods at once, together at most `dollars_per_hour`. Returns each limit's size.

    Raises BudgetError for a budget below one pod or one cent an hour.
    """
    from prefect.client.schemas.actions import (
        GlobalConcurrencyLimitCreate,
        GlobalConcurrencyLimitUpdate,
    )

    if pods < 1:
        raise BudgetError(f"--budget-pods {pods}: allow at least one pod")
    if dollars_per_hour <= 0:
        raise BudgetError(f"--budget-dollars-per-hour {dollars_per_hour:g}: allow more than $0/h")
    sizes = {pods_limit: pods, spend_limit: cents_per_hour(dollars_per_hour)}
    async with get_client() as client:
        for name, size in sizes.items():
            try:
                await client.read_global_concurrency_limit_by_name(name)
            except ObjectNotFound:
                await client.create_global_concurrency_limit(
                    GlobalConcurrencyLimitCreate(name=name, limit=size)
                )
            else:
                await client.update_global_concurrency_limit(
                    name, GlobalConcurrencyLimitUpdate(limit=size, active=True)
                )
    return sizes


@asynccontextmanager
async def gpu_budget(
    price_per_hour: float,
    *,
    timeout_s: float | None = None,
    strict: bool = False,
    pods_limit: str = POD_LIMIT,
    spend_limit: str = SPEND_LIMIT,
) -> AsyncIterator[None]:
    """Holds one pod and `price_per_hour` of the GPU budget for the duration of
    the block, waiting (up to `timeout_s`, default forever) until both are free.

    Without the budget's limits on the server, a run is not bounded: it says so
    in the flow run's log and goes on, unless `strict`, when it raises
    BudgetError. A pod that costs more than the whole spend limit raises
    BudgetError at once (it could never start). Raises TimeoutError when the
    slots are not free within `timeout_s`.
    """
    logger = _logger()
    cents = cents_per_hour(price_per_hour)
    sizes = await budget_limits(pods_limit, spend_limit)
    missing = [name for name, size in sizes.items() if size is None]
    if missing:
        message = (
            f"no GPU budget on this Prefect server (missing {', '.join(missing)}): "
            f"create it with {create_commands()}"
        )
        if strict:
            raise BudgetError(message)
        logger.warning("%s; this pod is not bounded by a budget", message)
        yield
        return
    spend = sizes[spend_limit]
    if spend is not None and cents > spend:
        raise BudgetError(
            f"a pod at ${price_per_hour:.2f}/h costs more than the whole GPU budget "
            f"(${spend / 100:.2f}/h, limit {spend_limit}): raise it with `prefect gcl update "
            f"{spend_limit} --limit {cents}`, or choose a cheaper GPU"
        )
    logger.info(
        "taking the GPU budget: 1 pod of %s, $%.2f/h of $%.2f/h",
        sizes[pods_limit],
        price_per_hour,
        (spend or 0) / 100,
    )
    async with (
        concurrency(
            pods_limit, occupy=1, timeout_seconds=timeout_s, lease_duration=LEASE_S, strict=True
        ),
        concurrency(
            spend_limit,
            occupy=cents,
            timeout_seconds=timeout_s,
            lease_duration=LEASE_S,
            strict=True,
        ),
    ):
        yield


def _logger() -> logging.Logger | logging.LoggerAdapter[Any]:
    try:
        return get_run_logger()
    except Exception:  # outside a flow run: the library's logger
        return get_logger("overbrainer.budget")


class PrefectBudget:
    """The GPU budget of this Prefect server as the `Budget` a target holds
    while its pod lives (see `targets.base.Budget`)."""

    async def spend_limit_cents(self) -> int | None:
        """The spend limit's size in cents an hour, None without one."""
        return (await budget_limits()).get(SPEND_LIMIT)

    def hold(self, price_per_hour: float) -> AbstractAsyncContextManager[None]:
        """`gpu_budget(price_per_hour)`."""
        return gpu_budget(price_per_hour)

    def admit(
        self, store: Runs, ask: Ask, facts: Facts
    ) -> AbstractAsyncContextManager[Admission | None]:
        """The day's and month's budgets of this server (`flows.money.admission`)."""
        return admission(store, ask, facts, _logger())
