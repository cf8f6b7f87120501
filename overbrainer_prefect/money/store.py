"""Where the ledger lives: `<runs directory>/.ledger/ledger.json`, in the runs
directory's store, changed only by compare-and-swap (`LedgerFile.change`):
each change reads the ledger and its version, decides, and writes only over
that version; a change that lost a race reads again and decides again. Two
processes (on two machines that share only the store) can never both take
the last dollars, and a dead one holds nothing.

An admission is an entry added before anything is created; it is bound to
its job's record once that exists, and brought up to date from what the
job's place says it cost (`Spent`) when the job ends, at each later
admission and in the spend view. An admission whose job never got a record
leaves the ledger: nothing of it was created; one whose process died before
it could say so expires at its reservation bound (`ledger.RESERVE_S`).

An admission is idempotent: its entry's id is made once, before its
compare-and-swap rounds, so a round tried again after a write that landed
(its answer lost) finds its entry there and adds no second one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TypeVar

from overbrainer_prefect.money.budgets import Budgets
from overbrainer_prefect.money.ledger import (
    Ask,
    Entry,
    Ledger,
    Left,
    Who,
    admit,
    left_of,
    new_entry_id,
    now_utc,
    readmit,
)
from overbrainer_prefect.runs.store import Runs, RunsError
from overbrainer_prefect.store.records import RecordChanged, read_record, write_record

LEDGER_DIR = ".ledger"
LEDGER_FILE = "ledger.json"
LEDGER_KEY = f"{LEDGER_DIR}/{LEDGER_FILE}"
CHANGE_TRIES = 50  # compare-and-swap rounds of one ledger change (every admission writes it)

T = TypeVar("T")


@dataclass(frozen=True)
class Spent:
    """What a job's place says it cost: its pod, dollars so far (None when
    unknown), and whether nothing of it bills any more."""

    pod_id: str | None
    cost_usd: float | None
    ended: bool
    pod_ids: tuple[str, ...] = ()
    """An instant cluster's pods, by rank (`pod_id` is its primary's)."""
    cluster_id: str | None = None


Facts = Callable[[Entry], Spent | None]
"""What an entry's job's place cost, from its records (None when they cannot be read here)."""


def entry_store(runs: Runs, entry: Entry) -> Runs | None:
    """The store of the record an entry is bound to (`Entry.store_dir`: its
    prefix under the runs directory; or, written before, an absolute path
    inside a local runs directory), None when it is not bound or not here."""
    if entry.store_dir is None:
        return None
    where = entry.store_dir
    if where.startswith("/"):
        try:
            where = Path(where).relative_to(runs.top.root).as_posix()
        except ValueError:
            return None
        where = "" if where == "." else where
    try:
        return runs.at(where)
    except RunsError:
        return None


class LedgerFile:
    """The ledger of one runs directory (see the module)."""

    def __init__(self, runs: Runs) -> None:
        self.runs = runs.top
        self.key = self.runs.key(LEDGER_KEY)

    @classmethod
    def of(cls, store: Runs) -> LedgerFile:
        """The ledger of the runs directory `store` belongs to."""
        return cls(store)

    @property
    def where(self) -> str:
        """How messages name the ledger."""
        return self.runs.store.where(self.key)

    def read(self) -> Ledger:
        """The ledger as last saved (empty when there is none). Raises
        RecordIoError or InvalidRecord when it cannot be read."""
        found = read_record(self.runs.store, self.key, Ledger, "ledger")
        return found[0] if found is not None else Ledger()

    def change(self, decide: Callable[[Ledger], T]) -> T:
        """Changes the ledger by compare-and-swap: `decide` changes the ledger
        it is given (and returns what the caller wants of it); it is saved
        only over the version read, else read again and `decide` asked again,
        so `decide` must decide from the ledger alone (and find what a
        landed write of its own added: a lost answer reads as a lost race). A
        ledger `decide` leaves as it was is not written. Raises what `decide`
        raises (nothing is saved), RecordChanged after CHANGE_TRIES lost
        races, RecordIoError or InvalidRecord."""
        for _ in range(CHANGE_TRIES):
            found = read_record(self.runs.store, self.key, Ledger, "ledger")
            ledger, etag = found if found is not None else (Ledger(), None)
            was = ledger.model_dump()
            result = decide(ledger)
            if ledger.model_dump() == was:
                return result
            try:
                write_record(self.runs.store, self.key, ledger, etag)
            except RecordChanged:
                continue
            return result
        raise RecordChanged(f"{self.where} kept changing while this process changed it")


def refresh(ledger: Ledger, facts: Facts, now: datetime) -> list[Entry]:
    """Releases the entries past their reservation bound at `now`
    (`Ledger.expire`) and brings the bound entries not ended up to date from
    `facts`; returns those changed."""
    changed = ledger.expire(now)
    for entry in ledger.entries:
        if entry.ended or entry.run_id is None:
            continue
        spent = facts(entry)
        if spent is None:
            continue
        update(entry, spent)
        changed.append(entry)
    return changed


def update(entry: Entry, spent: Spent) -> None:
    """Writes what a job's place cost into its entry."""
    entry.pod_id = spent.pod_id or entry.pod_id
    if spent.cluster_id is not None:
        entry.cluster_id = spent.cluster_id
        entry.pod_ids = list(spent.pod_ids)
    if spent.cost_usd is not None:
        entry.cost_usd = spent.cost_usd
    entry.ended = spent.ended


class Admission:
    """A pod admitted into the ledger: its cost cap (`cap_usd`, the most it
    was admitted for, None when no budget bounds it), what is left of each
    bound, and its entry, bound to the job's record with `bind`."""

    def __init__(
        self, ledger: LedgerFile, entry: Entry, left: list[Left], budgets: Budgets | None
    ) -> None:
        self.ledger = ledger
        self.entry = entry
        self.left = left
        self.budgets = budgets
        self.cap_usd = entry.max_usd if budgets is not None and budgets.bounded else None

    def bind(self, store: Runs, run_id: str, now: datetime | None = None) -> None:
        """Records that the admitted pod is the one of the job `run_id` in
        `store` (before the pod is asked for). An entry released at its
        reservation bound meanwhile (its job waited that long) is admitted
        again at its cap (`ledger.readmit`). Raises BudgetRefused (one line,
        nothing created) when that cap no longer fits, RecordIoError."""
        at = now or now_utc()

        def decide(ledger: Ledger) -> Entry:
            entry = ledger.entry(self.entry.id)
            if entry is None:  # not in the ledger any more: recorded again, as released
                entry = self.entry.model_copy(update={"ended": True, "expired": "not found"})
                ledger.entries.append(entry)
            if entry.expired is not None:
                readmit(ledger, self.budgets, entry, at)
            entry.run_id = run_id
            entry.store_dir = store.prefix
            entry.expires = None
            return entry

        self.entry = self.ledger.change(decide)

    def close(self, facts: Facts) -> Entry | None:
        """Brings the entry up to date once the job's place is done with
        (its pod deleted, or left to its watchdog: then it stays at its most);
        an entry never bound to a record leaves the ledger. Returns the entry
        as saved, None when it left. Raises RecordIoError."""

        def decide(ledger: Ledger) -> Entry | None:
            entry = ledger.entry(self.entry.id)
            if entry is None:
                return None
            if entry.run_id is None:
                ledger.entries.remove(entry)
                return None
            spent = facts(entry)
            if spent is not None:
                update(entry, spent)
            return entry

        return self.ledger.change(decide)


def admit_into(
    ledger_file: LedgerFile,
    budgets: Budgets | None,
    ask: Ask,
    who: Who,
    facts: Facts,
    now: datetime,
) -> Admission:
    """In one compare-and-swap change of the ledger: the entries brought up
    to date (`facts`), then the pod admitted (see `ledger.admit`). Of two
    processes asking at once for the last dollars, one is admitted; the other
    reads the ledger again and is refused. A round tried again after its
    write landed (its answer lost) finds its own entry: one entry, not two.
    Raises BudgetRefused or BudgetTooSmall (nothing added), RecordIoError."""
    entry_id = new_entry_id()  # once, outside the rounds: a landed write is recognised

    def decide(ledger: Ledger) -> tuple[Entry, list[Left]]:
        refresh(ledger, facts, now)
        mine = ledger.entry(entry_id)
        if mine is not None:  # this admission's write landed, its answer was lost
            left = left_of(ledger, budgets, ask.target, now) if budgets is not None else []
            return mine, left
        return admit(ledger, budgets, ask, who, now, entry_id)

    entry, left = ledger_file.change(decide)
    return Admission(ledger_file, entry, left, budgets)
