"""Where the ledger lives: `<runs directory>/.ledger/ledger.json`, replaced
atomically, and changed only under an advisory `flock` on
`.ledger/ledger.lock`, which the kernel (or the NFS server, on a shared runs
volume) drops when its holder dies, however it dies: two processes can never
both take the last dollars, and a dead one never keeps the ledger.

An admission is an entry added under the lock before anything is created;
it is bound to its job's record once that exists, and brought up to date
from what the job's place says it cost (`Spent`) when the job ends, at each
later admission and in the spend view. An admission whose job never got a
record leaves the ledger: nothing of it was created.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from overbrainer_prefect.money.budgets import Budgets
from overbrainer_prefect.money.ledger import Ask, Entry, Ledger, Left, Who, admit
from overbrainer_prefect.runs.ids import is_valid_run_id
from overbrainer_prefect.runs.records import load_record, save_record
from overbrainer_prefect.runs.store import BASES_DIR, Runs

LEDGER_DIR = ".ledger"
LEDGER_FILE = "ledger.json"
LOCK_FILE = "ledger.lock"


@dataclass(frozen=True)
class Spent:
    """What a job's place says it cost: its pod, dollars so far (None when
    unknown), and whether nothing of it bills any more."""

    pod_id: str | None
    cost_usd: float | None
    ended: bool


Facts = Callable[[Entry], Spent | None]
"""What an entry's job's place cost, from its records (None when they cannot be read here)."""


def runs_root_of(store: Runs) -> Path:
    """The runs directory a store belongs to (an export's store is inside its run's)."""
    if store.kind == "run":
        return store.root
    for path in (store.root, *store.root.parents):
        if path.name == BASES_DIR or is_valid_run_id(path.name):
            return path.parent
    return store.root


class LedgerFile:
    """The ledger of one runs directory (see the module)."""

    def __init__(self, runs_root: Path) -> None:
        self.dir = Path(runs_root) / LEDGER_DIR
        self.path = self.dir / LEDGER_FILE

    @classmethod
    def of(cls, store: Runs) -> LedgerFile:
        """The ledger of the runs directory `store` belongs to."""
        return cls(runs_root_of(store))

    def read(self) -> Ledger:
        """The ledger as last saved (empty when there is none). Raises
        RecordIoError or InvalidRecord when it cannot be read."""
        try:
            return load_record(self.path, Ledger, "ledger")
        except FileNotFoundError:
            return Ledger()

    @contextmanager
    def locked(self) -> Iterator[Ledger]:
        """The ledger under its lock (waiting for another holder), saved when
        the block ends without an error. Raises RecordIoError when it cannot
        be read or written."""
        self.dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            ledger = self.read()
            yield ledger
            save_record(self.dir, LEDGER_FILE, ledger)
        finally:
            os.close(fd)  # closing the descriptor releases the lock


def refresh(ledger: Ledger, facts: Facts) -> list[Entry]:
    """Brings the entries not ended up to date from `facts`; returns those changed."""
    changed = []
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
        self.cap_usd = entry.max_usd if budgets is not None and budgets.bounded else None

    def bind(self, store: Runs, run_id: str) -> None:
        """Records that the admitted pod is the one of the job `run_id` in
        `store` (before the pod is asked for). Raises RecordIoError."""
        with self.ledger.locked() as ledger:
            entry = ledger.entry(self.entry.id)
            if entry is not None:
                entry.run_id = run_id
                entry.store_dir = str(store.root)
                self.entry = entry

    def close(self, facts: Facts) -> Entry | None:
        """Brings the entry up to date once the job's place is done with
        (its pod deleted, or left to its watchdog: then it stays at its most);
        an entry never bound to a record leaves the ledger. Returns the entry
        as saved, None when it left. Raises RecordIoError."""
        with self.ledger.locked() as ledger:
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


def admit_into(
    ledger_file: LedgerFile,
    budgets: Budgets | None,
    ask: Ask,
    who: Who,
    facts: Facts,
    now: datetime,
) -> Admission:
    """Under the ledger's lock: the entries brought up to date (`facts`),
    then the pod admitted (see `ledger.admit`). Raises BudgetRefused or
    BudgetTooSmall (nothing added), RecordIoError."""
    with ledger_file.locked() as ledger:
        refresh(ledger, facts)
        entry, left = admit(ledger, budgets, ask, who, now)
    return Admission(ledger_file, entry, left, budgets)
