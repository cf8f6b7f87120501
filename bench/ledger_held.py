"""Money held by the dead (issue 36), on a real S3 server (moto's, on
127.0.0.1) shared as two machines would share it:

- TRAINS processes each admit a pod into the ledger under a day budget, then
  are SIGKILLed before their pod is asked for (a worker evicted between its
  admission and its placement); once their reservation bound passed, the next
  admission is made, and the entries of the dead that still hold dollars are
  counted: `ledger-entries-held-by-dead`, goal 0.
- LOST admissions each have the answer to their conditional PUT of the ledger
  lost after it landed (the store wrapped so that the write lands, then the
  writer hears that the ledger changed): the entries past one per admission
  are counted: `ledger-entries-twice-after-lost-answer`, goal 0.

A few seconds.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from datetime import UTC, datetime, timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from kit.lines import bench, note, progress, run_main  # noqa: E402

TRAINS = 4  # processes killed after their admission
LOST = 4  # admissions whose answer is lost
NOW = datetime(2026, 12, 5, 10, 0, tzinfo=UTC)
ADMIT_AND_DIE = textwrap.dedent(
    """
    import sys, time
    from datetime import datetime
    from overbrainer_prefect.money.budgets import Budgets
    from overbrainer_prefect.money.ledger import Ask, Who
    from overbrainer_prefect.money.store import LedgerFile, admit_into
    from overbrainer_prefect.runs.store import Runs
    ask = Ask(most_usd=0.25, least_usd=0.05, least_text="x", what="the run", target="t/a")
    admit_into(LedgerFile(Runs(sys.argv[1])), Budgets(day_usd=1.0), ask, Who("train", sys.argv[3]),
               lambda e: None, datetime.fromisoformat(sys.argv[2]))
    print("admitted", flush=True)
    time.sleep(600)
    """
)


def held_by_dead(url: str) -> None:
    """TRAINS admissions killed before their pod, then one after their bound."""
    from overbrainer_prefect.money.budgets import Budgets
    from overbrainer_prefect.money.ledger import RESERVE_S, Ask, Who
    from overbrainer_prefect.money.store import LedgerFile, admit_into
    from overbrainer_prefect.runs.store import Runs

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", ADMIT_AND_DIE, url, NOW.isoformat(), f"f{n}"],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for n in range(TRAINS)
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None
            said = proc.stdout.readline().strip()
            if said != "admitted":
                raise RuntimeError(f"an admission did not happen: {said!r}")
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    ledger = LedgerFile(Runs(url))
    later = NOW + timedelta(seconds=RESERVE_S + 1)
    ask = Ask(most_usd=0.25, least_usd=0.05, least_text="x", what="the run", target="t/a")
    admit_into(ledger, Budgets(day_usd=1.0), ask, Who("train", "next"), lambda e: None, later)
    dead = [e for e in ledger.read().entries if e.flow_run_id != "next"]
    held = [e for e in dead if e.charged > 0]
    note(
        f"{TRAINS} trains killed after their admission; after their reservation bound "
        f"({RESERVE_S:g} s) {len(held)} still hold dollars, "
        f"{sum(1 for e in dead if e.expired)} expired with why"
    )
    bench("ledger-entries-held-by-dead", len(held), "count", "<=", 0, digits=0)


def lost_answers(url: str) -> None:
    """LOST admissions, each write landing and its answer lost."""
    from overbrainer_prefect.money.budgets import Budgets
    from overbrainer_prefect.money.ledger import Ask, Who
    from overbrainer_prefect.money.store import LEDGER_KEY, LedgerFile, admit_into
    from overbrainer_prefect.runs.store import Runs
    from overbrainer_prefect.store.base import AlreadyExists, Changed

    runs = Runs(url)
    store = runs.store
    create, replace = store.create, store.replace
    lose = [True]

    def lossy_create(key: str, data: bytes) -> str:
        written = create(key, data)
        if key.endswith(LEDGER_KEY) and lose[0]:
            lose[0] = False
            raise AlreadyExists(key)
        return written

    def lossy_replace(key: str, data: bytes, etag: str) -> str:
        written = replace(key, data, etag)
        if key.endswith(LEDGER_KEY) and lose[0]:
            lose[0] = False
            raise Changed(key)
        return written

    store.create = lossy_create  # type: ignore[method-assign]
    store.replace = lossy_replace  # type: ignore[method-assign]
    ledger = LedgerFile(runs)
    ask = Ask(most_usd=0.1, least_usd=0.05, least_text="x", what="the run", target="t/a")
    for n in range(LOST):
        lose[0] = True
        admit_into(ledger, Budgets(day_usd=5.0), ask, Who("train", f"l{n}"), lambda e: None, NOW)
    twice = len(ledger.read().entries) - LOST
    note(f"{LOST} admissions whose answer was lost after the write landed: {twice} entries twice")
    bench("ledger-entries-twice-after-lost-answer", twice, "count", "<=", 0, digits=0)


def main() -> None:
    from tests.s3server import S3Server, credentials_env

    os.environ.update(credentials_env(), AWS_EC2_METADATA_DISABLED="true")
    root = Path(tempfile.mkdtemp(prefix="bench-ledger-"))
    try:
        with S3Server.start(root / "moto.log") as s3:
            progress("admissions killed before their pod")
            held_by_dead(s3.bucket_url())
            progress("admissions whose answer is lost")
            lost_answers(s3.bucket_url())
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    run_main(__file__, main)
