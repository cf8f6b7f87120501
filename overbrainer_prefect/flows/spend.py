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
from pydantic import BaseModel, Field

from overbrainer_prefect.flows.money import read_budgets
from overbrainer_prefect.flows.targets import target_named
from overbrainer_prefect.losscurve import data_uri
from overbrainer_prefect.money.budgets import Budgets
from overbrainer_prefect.money.chart import columns_svg, rows_svg
from overbrainer_prefect.money.ledger import (
    Entry,
    Ledger,
    Left,
    by_day,
    by_key,
    day_start,
    left_of,
    now_utc,
    since,
    total,
    usd,
    when,
)
from overbrainer_prefect.money.pods import cost_facts
from overbrainer_prefect.money.reconcile import Billing, reconcile
from overbrainer_prefect.money.store import LedgerFile, refresh
from overbrainer_prefect.runs.store import Runs
from overbrainer_prefect.targets.base import Logger

SPEND_ARTIFACT = "spend"
MAX_DAYS = 100  # the ledger keeps ended pods this long


class SpendError(ValueError):
    """Parameters of the spend flow that cannot be used; one line."""


class LeftRow(BaseModel):
    """What is left of one budget."""

    period: str
    target: str | None = Field(default=None, description="None: every target together.")
    budget_usd: float
    spent_usd: float = Field(description="Ended pods at their cost, alive ones at their most.")
    left_usd: float
    resets: str


class PodRow(BaseModel):
    """One pod of the ledger."""

    opened: str
    run_id: str | None
    pod_id: str | None
    deployment: str
    target: str
    state: str = Field(description="alive (counted at its most) or ended.")
    usd: float = Field(description="What it counts for.")
    admitted_usd: float
    billed_usd: float | None = None


class SpendView(BaseModel):
    """What the `spend` flow returns (and shows)."""

    runs_dir: str
    days: int
    total_usd: float
    by_day: dict[str, float]
    by_deployment: dict[str, float]
    by_target: dict[str, float]
    left: list[LeftRow] = Field(default_factory=list)
    pods: list[PodRow] = Field(default_factory=list)
    differences: list[str] = Field(
        default_factory=list, description="Pods whose bill differs from the ledger."
    )
    reconciled: list[str] = Field(
        default_factory=list, description="Targets whose provider's bill was read."
    )
    not_reconciled: list[str] = Field(
        default_factory=list, description="Targets whose bill could not be read, with why."
    )


def left_rows(ledger: Ledger, budgets: Budgets | None, now: datetime) -> list[LeftRow]:
    """What is left of every budget (every target's, then each target's own)."""
    if budgets is None:
        return []
    bounds: list[Left] = left_of(ledger, budgets.model_copy(update={"targets": {}}), "", now)
    for target in budgets.targets:
        bounds += [b for b in left_of(ledger, budgets, target, now) if b.target is not None]
    return [
        LeftRow(
            period=b.period,
            target=b.target,
            budget_usd=b.budget_usd,
            spent_usd=b.charged_usd,
            left_usd=b.left_usd,
            resets=when(b.resets),
        )
        for b in bounds
    ]


def pod_row(entry: Entry) -> PodRow:
    """The table row of one entry."""
    return PodRow(
        opened=entry.opened.strftime("%Y-%m-%d %H:%M"),
        run_id=entry.run_id,
        pod_id=entry.pod_id,
        deployment=entry.deployment,
        target=entry.target,
        state="ended" if entry.ended else "alive",
        usd=entry.charged,
        admitted_usd=entry.max_usd,
        billed_usd=entry.billed_usd,
    )


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


def spend_markdown(view: SpendView) -> str:
    """The spend artifact: budgets left, the three charts and their tables, the pods."""
    lines = [f"# Spend of the last {view.days} days: {usd(view.total_usd)}", ""]
    if view.left:
        lines += ["| budget | spent or held | left | resets |", "|---|---:|---:|---|"]
        for row in view.left:
            scope = f" of {row.target}" if row.target else ""
            lines.append(
                f"| {row.period}{scope}: {usd(row.budget_usd)} | {usd(row.spent_usd)} "
                f"| **{usd(row.left_usd)}** | {row.resets} |"
            )
    else:
        lines.append(
            "No day or month budget is set: `python blocks/create_blocks.py "
            "--budget-day-usd 20 --budget-month-usd 300` sets one."
        )
    lines += ["", "Alive pods count at the most they can cost, ended ones at what they cost.", ""]
    days = list(view.by_day.items())
    charts = [
        ("day", columns_svg(days, f"dollars by day, last {view.days} days (UTC)"), days),
        (
            "deployment",
            rows_svg(list(view.by_deployment.items()), "dollars by deployment"),
            list(view.by_deployment.items()),
        ),
        (
            "target",
            rows_svg(list(view.by_target.items()), "dollars by target"),
            list(view.by_target.items()),
        ),
    ]
    for name, svg, rows in charts:
        lines += [f"## By {name}", "", f"![dollars by {name}]({data_uri(svg)})", ""]
        shown = [(label, dollars) for label, dollars in rows if dollars > 0 or name != "day"]
        lines += [f"| {name} | dollars |", "|---|---:|"]
        lines += [f"| {label} | {usd(dollars)} |" for label, dollars in shown] or ["| - | $0 |"]
        lines.append("")
    if view.differences or view.reconciled or view.not_reconciled:
        lines += ["## Against the provider's bill", ""]
        if view.reconciled:
            lines.append(f"Reconciled with the bill of {', '.join(view.reconciled)}.")
        lines += [f"- differs: {d}" for d in view.differences]
        lines += [f"- not read: {n}" for n in view.not_reconciled]
        lines.append("")
    lines += ["## Pods", ""]
    if not view.pods:
        lines.append(f"No pod in the last {view.days} days.")
        return "\n".join(lines) + "\n"
    lines += [
        "| admitted (UTC) | run | pod | deployment | target | state | dollars | admitted at |",
        "|---|---|---|---|---|---|---:|---:|",
    ]
    for pod in view.pods:
        lines.append(
            f"| {pod.opened} | {pod.run_id or '-'} | {pod.pod_id or '-'} | {pod.deployment} "
            f"| {pod.target} | {pod.state} | {usd(pod.usd)} | {usd(pod.admitted_usd)} |"
        )
    return "\n".join(lines) + "\n"


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
