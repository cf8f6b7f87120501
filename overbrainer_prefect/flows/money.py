"""The day's and month's dollar budgets of a Prefect server, and the
admission of a pod into the ledger (see `money`): what Prefect adds to it.

The budgets are one Prefect variable, `overbrainer_budget`, set once for the
server (`python blocks/create_blocks.py --budget-day-usd 20
--budget-month-usd 300`, or `prefect variable set overbrainer_budget
'{"day_usd": 20, "month_usd": 300, "targets": {"overbrainer-runpod-target/runpod":
{"day_usd": 5}}}' --overwrite`). Without it, pods are recorded in the ledger
but not bounded by a day or a month.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from prefect.client.orchestration import get_client
from prefect.runtime import deployment, flow_run
from prefect.variables import Variable

from overbrainer_prefect.money.budgets import Budgets, budgets_from
from overbrainer_prefect.money.ledger import Ask, Who, now_utc, usd
from overbrainer_prefect.money.store import Admission, Facts, LedgerFile, admit_into
from overbrainer_prefect.money.view import left_text
from overbrainer_prefect.runs.store import Runs
from overbrainer_prefect.targets.base import Logger

BUDGET_VARIABLE = "overbrainer_budget"
"""The Prefect variable holding the budgets (JSON)."""


async def read_budgets() -> Budgets | None:
    """The server's budgets, None when none is set. Raises BudgetSettingError
    with one line when the variable holds something else than budgets."""
    value: Any = await Variable.aget(BUDGET_VARIABLE)
    if value is None:
        return None
    return budgets_from(value)


async def set_budgets(
    day_usd: Any = None, month_usd: Any = None, targets: dict[str, Any] | None = None
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
    if admitted.cap_usd is not None:
        lowered = ask.most_usd is None or admitted.cap_usd < ask.most_usd - 1e-9
        logger.info(
            "budget: %s admitted at %s%s; %s",
            ask.what,
            usd(admitted.cap_usd),
            f" (lowered from {usd(ask.most_usd or 0)} to what is left: its pod's cost cap)"
            if lowered
            else " (its pod's cost cap)",
            left_text(admitted.left),
        )
    try:
        yield admitted
    finally:
        try:
            entry = await asyncio.shield(asyncio.to_thread(admitted.close, facts))
        except Exception as error:  # the ledger keeps it at its most: safe, and said
            logger.warning("budget: cannot record what %s cost: %s", ask.what, error)
        else:
            if entry is not None and entry.ended and entry.cost_usd is not None:
                logger.info(
                    "budget: %s cost %s (admitted at %s)",
                    entry.who,
                    usd(entry.cost_usd),
                    usd(entry.max_usd),
                )
