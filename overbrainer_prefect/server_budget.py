"""The budgets as a Prefect server keeps them: what Prefect adds to `money/`.

- The GPU budget (`money/limits.py`): two global concurrency limits, created
  once per server (`python blocks/create_blocks.py --budget-pods 2
  --budget-dollars-per-hour 5`, or `prefect gcl create`). A flow takes both
  before it provisions a pod and holds them while the pod lives (`async with
  gpu_budget(price_per_hour)`): a flow that cannot take them waits until
  others release theirs. Slots are leased: when the process holding them
  dies, Prefect frees them once the lease runs out.
- The day's and month's dollars: one Prefect variable, `overbrainer_budget`,
  set once for the server (`python blocks/create_blocks.py --budget-day-usd 20
  --budget-month-usd 300`, or `prefect variable set overbrainer_budget
  '{"day_usd": 20, "month_usd": 300, "targets": {"overbrainer-runpod-target/runpod":
  {"day_usd": 5}}}' --overwrite`). Without it, pods are recorded in the ledger
  but not bounded by a day or a month.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import (
    GlobalConcurrencyLimitCreate,
    GlobalConcurrencyLimitUpdate,
)
from prefect.exceptions import ObjectNotFound
from prefect.logging.loggers import get_logger, get_run_logger
from prefect.runtime import deployment, flow_run
from prefect.variables import Variable
from pydantic import JsonValue

from overbrainer_prefect.budget_leases import Leases, leased
from overbrainer_prefect.money.budgets import Budgets, budgets_from
from overbrainer_prefect.money.ledger import Ask, Who, now_utc
from overbrainer_prefect.money.limits import (
    POD_LIMIT,
    SPEND_LIMIT,
    BudgetError,
    cents_per_hour,
    check_budget,
    create_commands,
    too_dear,
)
from overbrainer_prefect.money.store import Admission, Facts, LedgerFile, admit_into
from overbrainer_prefect.money.view import admitted_line, cost_line
from overbrainer_prefect.runs.store import Runs
from overbrainer_prefect.targets.base import Logger

BUDGET_VARIABLE = "overbrainer_budget"
"""The Prefect variable holding the budgets (JSON)."""


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


async def budget_bounds_pods() -> bool:
    """Whether this server has a GPU budget (either of its limits): a pod's
    flow run then holds its slots while the pod lives. Raises what the
    Prefect client raises when the server cannot be reached."""
    return any(size is not None for size in (await budget_limits()).values())


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
    checked = check_budget(pods, dollars_per_hour)
    sizes = {pods_limit: checked[POD_LIMIT], spend_limit: checked[SPEND_LIMIT]}
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
    leases: Leases | None = None,
) -> AsyncIterator[bool]:
    """Holds one pod and `price_per_hour` of the GPU budget for the duration of
    the block, waiting (up to `timeout_s`, default forever) until both are free;
    yields whether it holds slots (False without the budget's limits). Its
    slots are held under leases (`leases`, which may hand them over to a
    follower: they then outlive the block).

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
        yield False
        return
    spend = sizes[spend_limit] or 0
    refused = too_dear(price_per_hour, spend, spend_limit)
    if refused is not None:
        raise BudgetError(refused)
    logger.info(
        "taking the GPU budget: 1 pod of %s, $%.2f/h of $%.2f/h",
        sizes[pods_limit],
        price_per_hour,
        spend / 100,
    )
    leases = leases or Leases()
    async with (
        leased(pods_limit, 1, timeout_s, leases, logger),
        leased(spend_limit, cents, timeout_s, leases, logger),
    ):
        yield True


def _logger() -> Logger:
    try:
        return get_run_logger()
    except Exception:  # outside a flow run: the library's logger
        return get_logger("overbrainer.budget")


async def read_budgets() -> Budgets | None:
    """The server's budgets, None when none is set. Raises BudgetSettingError
    with one line when the variable holds something else than budgets."""
    value: JsonValue = await Variable.aget(BUDGET_VARIABLE)
    if value is None:
        return None
    return budgets_from(value)


async def set_budgets(
    day_usd: JsonValue = None,
    month_usd: JsonValue = None,
    targets: dict[str, JsonValue] | None = None,
) -> Budgets:
    """Checks and saves the server's budgets (replacing them); returns them.
    Raises BudgetSettingError with one line (nothing saved) for a negative or
    non-numeric budget."""
    budgets = budgets_from(
        {"day_usd": day_usd, "month_usd": month_usd, "targets": dict(targets or {})}
    )
    await Variable.aset(
        BUDGET_VARIABLE, budgets.model_dump(mode="json", exclude_none=True), overwrite=True
    )
    return budgets


async def clear_budgets() -> None:
    """Removes the server's budgets: pods are then bounded by their own caps only."""
    await Variable.aunset(BUDGET_VARIABLE)


async def who_asks() -> Who:
    """This flow run's deployment (`flow/deployment`, or the flow's name without one)."""
    name = flow_run.flow_name or "?"
    run_id = flow_run.id
    deployment_id = deployment.id
    if deployment_id is not None:
        try:
            async with get_client() as client:
                found = await client.read_deployment(deployment_id)
                flow = await client.read_flow(found.flow_id)
                name = f"{flow.name}/{found.name}"
        except Exception:  # the deployment was deleted: the flow's name will do
            pass
    return Who(deployment=name, flow_run_id=str(run_id) if run_id else None)


@asynccontextmanager
async def admission(
    store: Runs, ask: Ask, facts: Facts, logger: Logger
) -> AsyncIterator[Admission | None]:
    """Admits a pod's most into the ledger of `store`'s runs directory under
    the server's budgets (see `money.store.admit_into`) for the length of the
    block, logging what it was admitted for and what is left; on exit, its
    entry is brought up to date from `facts` (what the pod cost).

    Raises BudgetRefused or BudgetTooSmall (one line, nothing created),
    BudgetSettingError for budgets that cannot be read.
    """
    budgets = await read_budgets()
    who = await who_asks()
    ledger = LedgerFile.of(store)
    admitted = await asyncio.to_thread(admit_into, ledger, budgets, ask, who, facts, now_utc())
    line = admitted_line(ask, admitted)
    if line is not None:
        logger.info("%s", line)
    try:
        yield admitted
    finally:
        try:
            entry = await asyncio.shield(asyncio.to_thread(admitted.close, facts))
        except Exception as error:  # the ledger keeps it at its most: safe, and said
            logger.warning("budget: cannot record what %s cost: %s", ask.what, error)
        else:
            cost = cost_line(entry)
            if cost is not None:
                logger.info("%s", cost)


class PrefectBudget:
    """The GPU budget of this Prefect server as the `Budget` a target holds
    while its pod lives (see `targets.base.Budget`). `holding` says whether
    this process holds slots of it now (it must live while it does)."""

    def __init__(self) -> None:
        self.holding = False
        self.leases = Leases()

    async def spend_limit_cents(self) -> int | None:
        """The spend limit's size in cents an hour, None without one."""
        return (await budget_limits()).get(SPEND_LIMIT)

    def hold(self, price_per_hour: float) -> AbstractAsyncContextManager[None]:
        """`gpu_budget(price_per_hour)`, noting whether it holds slots."""
        return self._held(price_per_hour)

    @asynccontextmanager
    async def _held(self, price_per_hour: float) -> AsyncIterator[None]:
        async with gpu_budget(price_per_hour, leases=self.leases) as holding:
            self.holding = holding
            try:
                yield
            finally:
                self.holding = False

    def admit(
        self, store: Runs, ask: Ask, facts: Facts
    ) -> AbstractAsyncContextManager[Admission | None]:
        """The day's and month's budgets of this server (`admission`)."""
        return admission(store, ask, facts, _logger())
