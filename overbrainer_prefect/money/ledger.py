"""The ledger: one entry a pod, from the moment it is admitted (before it is
asked for) to what it cost once it ended; its totals by day, month,
deployment and target; what is left of a budget; the admission of a pod's
most and the one line that refuses it.

A pod alive counts at the most it can cost (what it was admitted for: its
watchdog's cost cap), an ended one at what it cost (Runpod's bill once the
ledger was reconciled with it, else rate × uptime). An entry counts in the
UTC day and month it was admitted in. An entry not bound to its job's record
by its reservation bound (RESERVE_S after its admission: no pod was asked
for) expires: it holds nothing since, and says why. Pure arithmetic on records: no
Prefect, no file (see `store`), no provider (see `pods`).
"""

from __future__ import annotations

import secrets
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from overbrainer_prefect.money.budgets import HOW_TO_SET, Budgets

SHOWN_ENTRIES = 4  # entries named in a refusal line; the rest are counted
KEPT_DAYS = 100  # ended entries older than this leave the ledger (the view shows 30 days)
RESERVE_S = 900.0
"""The reservation bound: how long after its admission an entry not yet bound
to its job's record holds its dollars. A live process binds it within seconds
of its admission (before its pod is asked for), unless it waits for the GPU
budget's slots: bound later than this, it is admitted again then
(`readmit`). One whose process died before (its worker killed between its
admission and its placement: no pod was made) holds nothing past it."""


class BudgetRefused(Exception):
    """A pod does not fit in what is left of a budget; the message is one
    line: what was spent, by which runs, what is left, when it resets."""


class BudgetTooSmall(BudgetRefused):
    """A budget smaller than the least one pod costs: no pod ever fits."""


class Entry(BaseModel):
    """One pod in the ledger."""

    model_config = ConfigDict(extra="ignore")

    id: str
    opened: datetime = Field(description="When the pod was admitted (UTC).")
    target: str
    deployment: str = Field(description="`flow/deployment`, or the flow's name without one.")
    flow_run_id: str | None = None
    what: str = Field(description="The job, as messages name it.")
    max_usd: float = Field(description="The most it was admitted for: its cost cap.")
    run_id: str | None = Field(default=None, description="The job's record, once created.")
    store_dir: str | None = Field(default=None, description="Where that record is.")
    pod_id: str | None = None
    cluster_id: str | None = Field(
        default=None, description="An instant cluster's id (`pod_id` is its primary's pod)."
    )
    pod_ids: list[str] = Field(
        default_factory=list, description="An instant cluster's pods, by rank: one entry for all."
    )
    cost_usd: float | None = Field(default=None, description="Rate × uptime, as last seen.")
    billed_usd: float | None = Field(default=None, description="What Runpod billed, reconciled.")
    ended: bool = False
    expires: datetime | None = Field(
        default=None,
        description="Its reservation bound while it is not bound to a record (None: once bound, "
        "or admission + RESERVE_S for an entry written before).",
    )
    expired: str | None = Field(
        default=None, description="Why it was released unbound at its reservation bound."
    )

    @property
    def charged(self) -> float:
        """What the entry counts for: an ended pod's cost (Runpod's bill when
        known), an alive one's most (or its cost so far, when higher)."""
        cost = self.billed_usd if self.billed_usd is not None else self.cost_usd
        if self.ended:
            return cost or 0.0
        return max(self.max_usd, cost or 0.0)

    @property
    def reserved_until(self) -> datetime:
        """Its reservation bound: until when it holds its dollars unbound to a record."""
        return self.expires or self.opened + timedelta(seconds=RESERVE_S)

    @property
    def who(self) -> str:
        """`run R` once bound to its record, else `the run of flow run F (being
        prepared, held until T)`."""
        if self.run_id is not None:
            return f"run {self.run_id}"
        if self.expired is not None:
            return f"{self.what} of flow run {self.flow_run_id or '?'} (expired unbound)"
        return (
            f"{self.what} of flow run {self.flow_run_id or '?'} (being prepared, held until "
            f"{when(self.reserved_until)})"
        )


class Ledger(BaseModel):
    """Every entry, oldest first."""

    model_config = ConfigDict(extra="ignore")

    entries: list[Entry] = Field(default_factory=list)

    def entry(self, entry_id: str) -> Entry | None:
        """The entry `entry_id`, or None."""
        return next((e for e in self.entries if e.id == entry_id), None)

    def prune(self, now: datetime) -> None:
        """Releases the entries past their reservation bound (`expire`), then
        drops the ended entries older than KEPT_DAYS."""
        self.expire(now)
        oldest = now - timedelta(days=KEPT_DAYS)
        self.entries = [e for e in self.entries if not e.ended or e.opened >= oldest]

    def expire(self, now: datetime) -> list[Entry]:
        """Releases the entries never bound to a job's record by their
        reservation bound (see RESERVE_S): each ends at $0, saying why (no pod
        was asked for under it). Returns them."""
        released = []
        for entry in self.entries:
            if entry.ended or entry.run_id is not None or now < entry.reserved_until:
                continue
            entry.ended = True
            entry.cost_usd = 0.0
            entry.expired = (
                f"{entry.what} of flow run {entry.flow_run_id or '?'} admitted at "
                f"{usd(entry.max_usd)} on {when(entry.opened)} was never bound to a job's record "
                f"by its reservation bound ({when(entry.reserved_until)}): no pod was asked for "
                "under it (its process ended before, or it is admitted again once placed), so it "
                "holds nothing since"
            )
            released.append(entry)
        return released


@dataclass(frozen=True)
class Ask:
    """What a pod asks of the budget, from its launch plan: the most it can
    cost (None when nothing bounds it: a kept pod), the least one costs, and
    that least in words (`ten minutes of NVIDIA RTX A4000 at $0.26/h`)."""

    most_usd: float | None
    least_usd: float
    least_text: str
    what: str
    target: str
    kind: str = "pod"


@dataclass(frozen=True)
class Who:
    """Who asks: the deployment (`flow/deployment`, or the flow's name) and flow run."""

    deployment: str
    flow_run_id: str | None = None


@dataclass(frozen=True)
class Left:
    """What is left of one bound: its period, its scope (a target, or None
    for every target), its dollars, what is charged in it, and when it resets."""

    period: str
    target: str | None
    budget_usd: float
    charged_usd: float
    resets: datetime

    @property
    def left_usd(self) -> float:
        """Dollars left (never below 0)."""
        return max(0.0, self.budget_usd - self.charged_usd)

    def name(self) -> str:
        """`the day's budget` or `target T's month budget`."""
        if self.target is None:
            return f"the {self.period}'s budget"
        return f"the {self.period}'s budget of target {self.target}"


def day_start(moment: datetime) -> datetime:
    """00:00 UTC of `moment`'s day."""
    moment = moment.astimezone(UTC)
    return datetime(moment.year, moment.month, moment.day, tzinfo=UTC)


def month_start(moment: datetime) -> datetime:
    """00:00 UTC of the 1st of `moment`'s month."""
    moment = moment.astimezone(UTC)
    return datetime(moment.year, moment.month, 1, tzinfo=UTC)


def period_bounds(period: str, now: datetime) -> tuple[datetime, datetime]:
    """The start of `period` (`day` or `month`) holding `now`, and when it resets."""
    if period == "day":
        start = day_start(now)
        return start, start + timedelta(days=1)
    start = month_start(now)
    following = (start + timedelta(days=32)).replace(day=1)
    return start, following


def in_period(entry: Entry, period: str, now: datetime, target: str | None = None) -> bool:
    """Whether `entry` counts in the `period` holding `now` (and for `target`)."""
    start, end = period_bounds(period, now)
    return start <= entry.opened < end and (target is None or entry.target == target)


def left_of(ledger: Ledger, budgets: Budgets, target: str, now: datetime) -> list[Left]:
    """What is left of each bound a pod of `target` must fit in, at `now`."""
    found = []
    for period, scope, dollars in budgets.applying_to(target):
        charged = sum(e.charged for e in ledger.entries if in_period(e, period, now, scope))
        found.append(Left(period, scope, dollars, charged, period_bounds(period, now)[1]))
    return found


def usd(amount: float) -> str:
    """`$0.44`, or `$0.0042` below a cent."""
    return f"${amount:.2f}" if amount >= 0.01 or amount == 0 else f"${amount:.2g}"


def when(moment: datetime) -> str:
    """`2026-12-03 00:00 UTC`."""
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M UTC")


def spenders(entries: Iterable[Entry]) -> str:
    """The entries that charged a bound, dearest first: `run R ($0.40, alive), ...`."""
    ranked = sorted((e for e in entries if e.charged > 0), key=lambda e: -e.charged)
    shown = [
        f"{e.who} ({usd(e.charged)}{', alive: at its most' if not e.ended else ''})"
        for e in ranked[:SHOWN_ENTRIES]
    ]
    if len(ranked) > SHOWN_ENTRIES:
        shown.append(f"{len(ranked) - SHOWN_ENTRIES} more")
    return ", ".join(shown) if shown else "nothing"


def refusal(bound: Left, ledger: Ledger, ask: Ask, now: datetime) -> str:
    """The one line refusing a pod that does not fit in `bound`."""
    counted = [e for e in ledger.entries if in_period(e, bound.period, now, bound.target)]
    return (
        f"budget: {ask.what} is refused before anything is created: {bound.name()} "
        f"({usd(bound.budget_usd)}) has {usd(bound.left_usd)} left, "
        f"{usd(bound.charged_usd)} spent or held by {spenders(counted)}; a pod needs at "
        f"least {usd(ask.least_usd)} ({ask.least_text}). It resets at {when(bound.resets)}: "
        f"run it again then, or raise the budget with {HOW_TO_SET}"
    )


def too_small(bound: Left, ask: Ask) -> str:
    """The one line for a budget below the least one pod costs."""
    return (
        f"budget: {bound.name()} ({usd(bound.budget_usd)}) is below the least one pod of "
        f"target {ask.target} costs ({usd(ask.least_usd)}: {ask.least_text}), so no pod can "
        f"ever run; nothing was created. Raise it with {HOW_TO_SET}"
    )


def new_entry_id() -> str:
    """A new entry's id, made once per admission (outside its compare-and-swap
    rounds: a round tried again finds the entry a landed write added)."""
    return secrets.token_hex(6)


def admit(
    ledger: Ledger,
    budgets: Budgets | None,
    ask: Ask,
    who: Who,
    now: datetime,
    entry_id: str | None = None,
) -> tuple[Entry, list[Left]]:
    """Admits a pod into `ledger` (the new entry is appended) and returns its
    entry and what is left of each bound once it is counted. Its most
    (`entry.max_usd`, the cost cap to arm) is the ask's most, lowered to what
    is left of the tightest bound.

    Without budgets, the pod is only recorded at its most (for the spend
    view). The entry is `entry_id` (a new id without one); it holds its
    dollars unbound until its reservation bound (RESERVE_S). Raises
    BudgetTooSmall when a bound is below the least one pod costs,
    BudgetRefused when what is left of a bound is, or when a pod nothing
    bounds (`keep_pod`) meets a budget; nothing is added then.
    """
    bounds = left_of(ledger, budgets, ask.target, now) if budgets is not None else []
    for bound in bounds:
        if bound.budget_usd < ask.least_usd:
            raise BudgetTooSmall(too_small(bound, ask))
    if bounds and ask.most_usd is None:
        raise BudgetRefused(
            f"budget: {ask.what} is refused before anything is created: keep_pod is on, so "
            "nothing bounds what its pod costs, and a day or month budget is set; turn keep_pod "
            "off on the target, or remove the budget with `prefect variable unset "
            "overbrainer_budget`"
        )
    for bound in bounds:
        if bound.left_usd < ask.least_usd:
            raise BudgetRefused(refusal(bound, ledger, ask, now))
    most = ask.most_usd
    if bounds:
        tightest = min(bound.left_usd for bound in bounds)
        most = tightest if most is None else min(most, tightest)
    entry = Entry(
        id=entry_id or new_entry_id(),
        opened=now,
        expires=now + timedelta(seconds=RESERVE_S),
        target=ask.target,
        deployment=who.deployment,
        flow_run_id=who.flow_run_id,
        what=ask.what,
        max_usd=most if most is not None else 0.0,
        ended=False,
    )
    ledger.prune(now)
    ledger.entries.append(entry)
    return entry, left_of(ledger, budgets, ask.target, now) if budgets is not None else []


def readmit(ledger: Ledger, budgets: Budgets | None, entry: Entry, now: datetime) -> None:
    """Admits again, at the most it was admitted for (its pod's cost cap is
    armed at it), an entry released at its reservation bound whose job is
    placed now; it counts from `now`. Raises BudgetRefused (one line, the
    entry left released) when that no longer fits in what is left."""
    entry.ended = True  # counted out while what is left is reckoned
    for bound in left_of(ledger, budgets, entry.target, now) if budgets is not None else []:
        if bound.left_usd < entry.max_usd - 1e-9:
            counted = [e for e in ledger.entries if in_period(e, bound.period, now, bound.target)]
            raise BudgetRefused(
                f"budget: {entry.what} is refused before anything is created: admitted at "
                f"{usd(entry.max_usd)} on {when(entry.opened)}, it was not placed within its "
                f"reservation bound ({RESERVE_S / 60:g} min) and was released; {bound.name()} "
                f"({usd(bound.budget_usd)}) now has {usd(bound.left_usd)} left, "
                f"{usd(bound.charged_usd)} spent or held by {spenders(counted)}. Run it again "
                f"(it is admitted at what is left), or raise the budget with {HOW_TO_SET}"
            )
    entry.opened = now
    entry.expires = None
    entry.ended = False
    entry.expired = None
    entry.cost_usd = None


# -- where the money went ---------------------------------------------------------------


def since(ledger: Ledger, days: int, now: datetime) -> list[Entry]:
    """The entries of the last `days` UTC days (today included)."""
    first = day_start(now) - timedelta(days=days - 1)
    return [e for e in ledger.entries if e.opened >= first]


def by_day(entries: Iterable[Entry], days: int, now: datetime) -> dict[date, float]:
    """Dollars charged each UTC day of the last `days` (every day, 0 when nothing)."""
    first = day_start(now) - timedelta(days=days - 1)
    totals = {(first + timedelta(days=i)).date(): 0.0 for i in range(days)}
    for entry in entries:
        day = entry.opened.astimezone(UTC).date()
        if day in totals:
            totals[day] += entry.charged
    return totals


def by_key(entries: Iterable[Entry], key: Literal["deployment", "target"]) -> dict[str, float]:
    """Dollars charged by `deployment` or `target`, dearest first."""
    totals: dict[str, float] = defaultdict(float)
    for entry in entries:
        totals[entry.deployment if key == "deployment" else entry.target] += entry.charged
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


def total(entries: Iterable[Entry]) -> float:
    """Dollars charged by `entries`."""
    return sum(entry.charged for entry in entries)


def now_utc() -> datetime:
    """Now, in UTC."""
    return datetime.now(UTC)
