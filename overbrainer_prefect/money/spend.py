"""Where the money went in the last days, from the ledger of a runs
directory: the ledger brought up to date from the pods' records (a pod
deleted since is counted at what it cost), reconciled with what each
target's provider billed when it answers (Runpod), and counted by day,
deployment and target (`SpendView`). The `spend` flow adds the target
blocks, the artifact and the log."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta

from overbrainer_prefect.money.budgets import Budgets
from overbrainer_prefect.money.ledger import (
    Entry,
    Ledger,
    by_day,
    by_key,
    day_start,
    since,
    total,
    usd,
)
from overbrainer_prefect.money.pods import cost_facts_of
from overbrainer_prefect.money.reconcile import Billing, reconcile
from overbrainer_prefect.money.store import LedgerFile, refresh
from overbrainer_prefect.money.view import SpendError, SpendView, left_rows, pod_row
from overbrainer_prefect.runs.store import Runs

MAX_DAYS = 100  # the ledger keeps ended pods this long

FindTarget = Callable[[str], Awaitable[object]]
"""The target of a target block's name (raises when there is none)."""


def check_days(days: int) -> None:
    """Raises SpendError (one line) for `days` outside 1 to MAX_DAYS."""
    if not 1 <= days <= MAX_DAYS:
        raise SpendError(f"days={days}: give 1 to {MAX_DAYS} (the ledger keeps {MAX_DAYS} days)")


async def bills(
    entries: list[Entry], first: datetime, find: FindTarget
) -> tuple[dict[str, float], list[str], list[str]]:
    """What each target's provider billed its pods since `first`, when it
    answers: (dollars by pod id, the targets read, `target: why` of those
    that could not be)."""
    billed: dict[str, float] = {}
    read: list[str] = []
    unread: list[str] = []
    for ref in sorted({e.target for e in entries if e.pod_id is not None}):
        try:
            target = await find(ref)
            if not isinstance(target, Billing):
                continue
            billed.update(await target.billed(first))
            read.append(ref)
        except Exception as error:  # the ledger's own figures stand, and it is said
            unread.append(f"{ref}: {error}")
    return billed, read, unread


async def spend_view(
    runs: Runs, days: int, budgets: Budgets | None, now: datetime, find: FindTarget | None
) -> SpendView:
    """Where the money of the runs directory `runs` went in the last `days`
    UTC days (today included) and what is left of each budget; with `find`,
    the pods whose provider's bill differs from the ledger. Raises SpendError
    (one line) for `days` outside 1 to MAX_DAYS, RecordIoError."""
    check_days(days)
    ledger_file = LedgerFile(runs)
    facts = cost_facts_of(runs)

    def refreshed(ledger: Ledger) -> Ledger:
        refresh(ledger, facts, now)
        return ledger

    ledger = ledger_file.change(refreshed)
    recent = since(ledger, days, now)
    differences: list[str] = []
    read: list[str] = []
    unread: list[str] = []
    if find is not None and recent:
        first = day_start(now) - timedelta(days=days - 1)
        billed, read, unread = await bills(recent, first, find)
        if billed:

            def reconciled(ledger: Ledger) -> list[str]:
                return [d.line() for d in reconcile(since(ledger, days, now), billed)]

            differences = ledger_file.change(reconciled)
            ledger = ledger_file.read()
            recent = since(ledger, days, now)
    return SpendView(
        runs_dir=runs.where,
        days=days,
        total_usd=total(recent),
        by_day={day.isoformat(): dollars for day, dollars in by_day(recent, days, now).items()},
        by_deployment=by_key(recent, "deployment"),
        by_target=by_key(recent, "target"),
        left=left_rows(ledger, budgets, now),
        pods=[pod_row(e) for e in reversed(recent)],
        expired=[e.expired for e in reversed(recent) if e.expired is not None],
        differences=differences,
        reconciled=read,
        not_reconciled=unread,
    )


def spend_line(view: SpendView) -> str:
    """`spend: $1.20 in the last 30 days over 4 pods; $0.80 left of the day's $2.00`."""
    left = "; ".join(
        f"{usd(r.left_usd)} left of the {r.period}'s {usd(r.budget_usd)}"
        + (f" of {r.target}" if r.target else "")
        for r in view.left
    )
    return (
        f"spend: {usd(view.total_usd)} in the last {view.days} days over {len(view.pods)} pods"
        + (f"; {left}" if left else "")
    )
