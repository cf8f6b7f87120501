"""The `spend` flow: where the money went in the last days (30 by default),
from the ledger of a runs directory: dollars by day, by deployment and by
target as bar charts and tables in one markdown artifact (`spend`), what is
left of today's and this month's budgets, and the pods whose provider's
bill differs from the ledger (`money/spend.py`).
"""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.artifacts import acreate_markdown_artifact

from overbrainer_prefect.blocks import target_named
from overbrainer_prefect.money.ledger import now_utc
from overbrainer_prefect.money.spend import check_days, spend_line, spend_view
from overbrainer_prefect.money.view import SpendView, spend_markdown
from overbrainer_prefect.runs_dir import runs_at
from overbrainer_prefect.server_budget import read_budgets
from overbrainer_prefect.targets.base import Target

SPEND_ARTIFACT = "spend"


@flow(name="spend", log_prints=False)
async def spend(
    days: int = 30, runs_dir: str | None = None, reconcile_bills: bool = True
) -> SpendView:
    """Where the money went in the last `days` UTC days (today included), from
    the ledger of `runs_dir`: dollars by day, deployment and target as bar
    charts and tables, what is left of each budget, the pods, and the pods
    whose provider's bill differs from the ledger (`reconcile_bills`).

    Raises SpendError (one line) for `days` outside 1 to MAX_DAYS;
    BudgetSettingError for budgets that cannot be read.
    """
    logger = get_run_logger()
    check_days(days)

    async def find(ref: str) -> Target:
        return await target_named(ref, logger)

    budgets = await read_budgets()
    view = await spend_view(
        await runs_at(runs_dir), days, budgets, now_utc(), find if reconcile_bills else None
    )
    for line in view.differences:
        logger.warning("spend: the provider's bill differs: %s", line)
    await acreate_markdown_artifact(
        markdown=spend_markdown(view),
        key=SPEND_ARTIFACT,
        description=f"Where the money went in the last {days} days, and what is left",
    )
    logger.info("%s", spend_line(view))
    return view
