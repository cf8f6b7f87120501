"""The spend view's content, from the ledger alone: what is left of each
budget, each pod's row, and the markdown the `spend` flow publishes."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field

from overbrainer_prefect.losscurve import data_uri
from overbrainer_prefect.money.budgets import Budgets
from overbrainer_prefect.money.chart import columns_svg, rows_svg
from overbrainer_prefect.money.ledger import (
    Ask,
    Entry,
    Ledger,
    Left,
    left_of,
    usd,
    when,
)
from overbrainer_prefect.money.store import Admission


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
    state: str = Field(
        description="alive (counted at its most), ended, or expired (released unbound)."
    )
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
    expired: list[str] = Field(
        default_factory=list,
        description="Entries released at their reservation bound, never bound to a job's "
        "record: why each holds nothing.",
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
    """The table row of one entry (an instant cluster's: one row naming its pods)."""
    shown = entry.pod_id
    if entry.cluster_id is not None:
        shown = (
            f"cluster {entry.cluster_id}: {len(entry.pod_ids)} pods ({', '.join(entry.pod_ids)})"
        )
    return PodRow(
        opened=entry.opened.strftime("%Y-%m-%d %H:%M"),
        run_id=entry.run_id,
        pod_id=shown,
        deployment=entry.deployment,
        target=entry.target,
        state="expired" if entry.expired else "ended" if entry.ended else "alive",
        usd=entry.charged,
        admitted_usd=entry.max_usd,
        billed_usd=entry.billed_usd,
    )


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
    if view.expired:
        lines += ["## Expired admissions", ""]
        lines += [f"- {why}" for why in view.expired]
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


def left_text(left: list[Left]) -> str:
    """`$0.40 left of the day's budget ($1.00) until 2026-12-03 00:00 UTC, ...`."""
    return ", ".join(
        f"{usd(bound.left_usd)} left of {bound.name()} ({usd(bound.budget_usd)}) "
        f"until {when(bound.resets)}"
        for bound in left
    )


def admitted_line(ask: Ask, admitted: Admission) -> str | None:
    """`the run admitted at $1.20 (its pod's cost cap); $3.80 left of ...`, None
    when no budget bounds the pod."""
    if admitted.cap_usd is None:
        return None
    lowered = ask.most_usd is None or admitted.cap_usd < ask.most_usd - 1e-9
    why = (
        f" (lowered from {usd(ask.most_usd or 0)} to what is left: its pod's cost cap)"
        if lowered
        else " (its pod's cost cap)"
    )
    return (
        f"budget: {ask.what} admitted at {usd(admitted.cap_usd)}{why}; {left_text(admitted.left)}"
    )


def cost_line(entry: Entry | None) -> str | None:
    """`budget: W cost $0.12 (admitted at $1.20)` for an ended entry whose cost
    is known, else None."""
    if entry is None or not entry.ended or entry.cost_usd is None:
        return None
    return f"budget: {entry.who} cost {usd(entry.cost_usd)} (admitted at {usd(entry.max_usd)})"
