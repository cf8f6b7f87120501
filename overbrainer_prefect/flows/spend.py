"""The `spend` flow: where the money went in the last days (30 by default),
from the ledger of a runs directory: dollars by day, by deployment and by
target as bar charts and tables in one markdown artifact (`spend`), what is
left of today's and this month's budgets, and the pods whose provider's
bill differs from the ledger.

Before it counts, the ledger is brought up to date from the pods' records
(a pod deleted since is counted at what it cost), and, for each target whose
provider answers what it billed (Runpod), reconciled with that bill.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from prefect import flow, get_run_logger
from prefect.artifacts import acreate_markdown_artifact

from overbrainer_prefect.flows.money import read_budgets
from overbrainer_prefect.flows.targets import target_named
from overbrainer_prefect.money.ledger import (
    Entry,
    by_day,
    by_key,
    day_start,
    now_utc,
    since,
    total,
    usd,
)
from overbrainer_prefect.money.pods import cost_facts
from overbrainer_prefect.money.reconcile import Billing, reconcile
from overbrainer_prefect.money.store import LedgerFile, refresh
from overbrainer_prefect.money.view import SpendError, SpendView, left_rows, pod_row, spend_markdown
from overbrainer_prefect.runs.store import Runs
from overbrainer_prefect.targets.base import Logger

SPEND_ARTIFACT = "spend"
MAX_DAYS = 100  # the ledger keeps ended pods this long


async def _bills(
    entries: list[Entry], first: datetime, logger: Logger
) -> tuple[dict[str, float], list[str], list[str]]:
    """What each target's provider billed its pods since `first`, when it answers."""
    billed: dict[str, float] = {}
    read: list[str] = []
    unread: list[str] = []
    for ref in sorted({e.target for e in entries if e.pod_id is not None}):
        try:
            target = await target_named(ref, logger)
            if not isinstance(target, Billing):
                continue
            billed.update(await target.billed(first))
            read.append(ref)
        except Exception as error:  # the ledger's own figures stand, and it is said
            unread.append(f"{ref}: {error}")
    return billed, read, unread


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
    if not 1 <= days <= MAX_DAYS:
        raise SpendError(f"days={days}: give 1 to {MAX_DAYS} (the ledger keeps {MAX_DAYS} days)")
    runs = Runs(runs_dir)
    ledger_file = LedgerFile(runs.root)
    now = now_utc()
    with ledger_file.locked() as ledger:
        refresh(ledger, cost_facts)
    recent = since(ledger, days, now)
    differences: list[str] = []
    read: list[str] = []
    unread: list[str] = []
    if reconcile_bills and recent:
        first = day_start(now) - timedelta(days=days - 1)
        billed, read, unread = await _bills(recent, first, logger)
        if billed:
            with ledger_file.locked() as ledger:
                recent = since(ledger, days, now)
                differences = [d.line() for d in reconcile(recent, billed)]
    for line in differences:
        logger.warning("spend: the provider's bill differs: %s", line)
    budgets = await read_budgets()
    view = SpendView(
        runs_dir=str(runs.root),
        days=days,
        total_usd=total(recent),
        by_day={day.isoformat(): dollars for day, dollars in by_day(recent, days, now).items()},
        by_deployment=by_key(recent, "deployment"),
        by_target=by_key(recent, "target"),
        left=left_rows(ledger, budgets, now),
        pods=[pod_row(e) for e in reversed(recent)],
        differences=differences,
        reconciled=read,
        not_reconciled=unread,
    )
    await acreate_markdown_artifact(
        markdown=spend_markdown(view),
        key=SPEND_ARTIFACT,
        description=f"Where the money went in the last {days} days, and what is left",
    )
    logger.info(
        "spend: %s in the last %d days over %d pods%s",
        usd(view.total_usd),
        days,
        len(recent),
        "; "
        + "; ".join(
            f"{usd(r.left_usd)} left of the {r.period}'s {usd(r.budget_usd)}"
            + (f" of {r.target}" if r.target else "")
            for r in view.left
        )
        if view.left
        else "",
    )
    return view
