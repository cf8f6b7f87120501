"""The ledger's arithmetic and its lock, without Prefect: budgets checked in
one line, a pod admitted at its most or at what is left, refused in one line
when less than the least one pod costs is left, totals by day, deployment
and target, and two processes that ask for the last dollars at once."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import textwrap
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from overbrainer_prefect.money.budgets import Budgets, BudgetSettingError, budgets_from
from overbrainer_prefect.money.ledger import (
    RESERVE_S,
    Ask,
    BudgetRefused,
    BudgetTooSmall,
    Entry,
    Ledger,
    Who,
    admit,
    by_day,
    by_key,
    left_of,
    total,
)
from overbrainer_prefect.money.pods import ask_of, capped
from overbrainer_prefect.money.spend import spend_view
from overbrainer_prefect.money.store import (
    LEDGER_KEY,
    LedgerFile,
    Spent,
    admit_into,
    entry_store,
)
from overbrainer_prefect.money.view import spend_markdown
from overbrainer_prefect.runpod.gpus import GpuChoice, LaunchPlan
from overbrainer_prefect.runpod.models import GpuType
from overbrainer_prefect.runpod.settings import RunpodTargetSettings
from overbrainer_prefect.runs.store import Runs
from overbrainer_prefect.store.base import AlreadyExists, Changed, Store
from tests.faultproxy import FaultProxy

NOW = datetime(2026, 12, 2, 10, 0, tzinfo=UTC)
ROOT = Path(__file__).resolve().parents[1]


def ask(most: float | None = 1.0, least: float = 0.05, target: str = "t/a") -> Ask:
    return Ask(
        most_usd=most, least_usd=least, least_text="ten minutes", what="the run", target=target
    )


def who(deployment: str = "fine-tune/nightly") -> Who:
    return Who(deployment=deployment, flow_run_id="f1")


def entry(
    cost: float, *, ended: bool = True, opened: datetime = NOW, target: str = "t/a", **more: object
) -> Entry:
    return Entry.model_validate(
        {
            "id": os.urandom(4).hex(),
            "opened": opened,
            "target": target,
            "deployment": more.pop("deployment", "train"),
            "what": "the run",
            "max_usd": more.pop("max_usd", cost),
            "run_id": more.pop("run_id", "20261202-090000-abcd"),
            "cost_usd": cost,
            "ended": ended,
            **more,
        }
    )


def no_facts(_: Entry) -> Spent | None:
    return None


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ({"day_usd": -5}, "budget day_usd: $-5 is not a budget"),
        ({"month_usd": "lots"}, "budget month_usd: 'lots' is not a number of dollars"),
        ({"day_usd": True}, "budget day_usd: True is not a number of dollars"),
        ({"targets": {"t/a": {"day_usd": 0}}}, "budget targets.t/a.day_usd: $0 is not a budget"),
        ({"day_usd": 5, "weekly": 1}, "budget weekly: Extra inputs are not permitted"),
        ("20", "the budget is not a JSON object"),
    ],
)
def test_a_budget_that_is_negative_or_not_a_number_is_refused_in_one_line(
    value: object, said: str
) -> None:
    with pytest.raises(BudgetSettingError) as error:
        budgets_from(value)
    assert str(error.value).startswith(said), error.value
    assert "\n" not in str(error.value) and "overbrainer_budget" in str(error.value)


def test_budgets_read_from_text_numbers() -> None:
    budgets = budgets_from({"day_usd": "2.5", "targets": {"t/a": {"month_usd": 9}}})
    assert budgets.day_usd == 2.5 and budgets.month_usd is None
    assert budgets.applying_to("t/a") == [("day", None, 2.5), ("month", "t/a", 9.0)]
    assert budgets.applying_to("t/b") == [("day", None, 2.5)]
    assert budgets_from({"targets": {"a": {"day_usd": 1}}}).applying_to("t/a") == [
        ("day", "t/a", 1.0)
    ]


def test_an_alive_pod_counts_at_its_most_and_an_ended_one_at_what_it_cost() -> None:
    alive = entry(0.10, ended=False, max_usd=0.80)
    ended = entry(0.30, max_usd=0.80)
    billed = entry(0.30, max_usd=0.80, billed_usd=0.32)
    assert (alive.charged, ended.charged, billed.charged) == (0.80, 0.30, 0.32)


def test_a_pod_is_admitted_at_its_most_and_lowered_to_what_is_left() -> None:
    ledger = Ledger(entries=[entry(0.30)])
    budgets = Budgets(day_usd=1.0)
    first, left = admit(ledger, budgets, ask(most=0.50), who(), NOW)
    assert first.max_usd == 0.50 and left[0].left_usd == pytest.approx(0.20)
    second, left = admit(ledger, budgets, ask(most=0.50), who(), NOW)
    assert second.max_usd == pytest.approx(0.20) and left[0].left_usd == 0.0
    # without a budget a pod is only recorded, at its most
    free, none = admit(Ledger(), None, ask(most=3.0), who(), NOW)
    assert free.max_usd == 3.0 and none == []


def test_a_day_that_fits_one_pod_but_not_two_refuses_the_second_in_one_line() -> None:
    ledger = Ledger()
    budgets = Budgets(day_usd=0.60, month_usd=50)
    first, _ = admit(ledger, budgets, ask(most=0.50, least=0.2), who(), NOW)
    first.run_id = "20261202-100000-aaaa"
    with pytest.raises(BudgetRefused) as refused:
        admit(ledger, budgets, ask(most=0.50, least=0.2), who(), NOW)
    line = str(refused.value)
    assert "\n" not in line
    assert "the day's budget ($0.60) has $0.10 left" in line
    assert "$0.50 spent or held by run 20261202-100000-aaaa ($0.50, alive: at its most)" in line
    assert "a pod needs at least $0.20 (ten minutes)" in line
    assert "resets at 2026-12-03 00:00 UTC" in line and "overbrainer_budget" in line
    assert len(ledger.entries) == 1  # nothing added


def test_a_target_budget_bounds_only_that_target_and_the_month_resets_on_the_first() -> None:
    ledger = Ledger(
        entries=[
            entry(4.0, target="t/a", opened=NOW - timedelta(days=1)),
            entry(9.0, target="t/b", opened=datetime(2026, 11, 30, tzinfo=UTC)),
        ]
    )
    budgets = Budgets(month_usd=6.0, targets={"t/a": {"month_usd": 4.5}})
    bounds = {(b.period, b.target): b for b in left_of(ledger, budgets, "t/a", NOW)}
    assert bounds[("month", None)].charged_usd == 4.0  # November's $9 is not December's
    assert bounds[("month", "t/a")].left_usd == pytest.approx(0.5)
    assert bounds[("month", None)].resets == datetime(2027, 1, 1, tzinfo=UTC)
    with pytest.raises(BudgetRefused, match="the month's budget of target t/a"):
        admit(ledger, budgets, ask(least=0.6, target="t/a"), who(), NOW)
    admitted, _ = admit(ledger, budgets, ask(most=3.0, least=0.6, target="t/b"), who(), NOW)
    assert admitted.max_usd == pytest.approx(2.0)


def test_a_budget_below_the_least_one_pod_costs_is_refused_in_one_line() -> None:
    with pytest.raises(BudgetTooSmall) as error:
        admit(Ledger(), Budgets(day_usd=0.01), ask(least=0.05), who(), NOW)
    line = str(error.value)
    assert "the day's budget ($0.01) is below the least one pod of target t/a costs" in line
    assert "\n" not in line


def test_a_kept_pod_is_refused_under_a_budget() -> None:
    with pytest.raises(BudgetRefused, match="keep_pod is on"):
        admit(Ledger(), Budgets(day_usd=5), ask(most=None), who(), NOW)


def test_the_totals_by_day_deployment_and_target_add_up() -> None:
    entries = [
        entry(1.0, deployment="fine-tune/nightly", target="t/a"),
        entry(0.5, deployment="train", target="t/b", opened=NOW - timedelta(days=2)),
        entry(0.25, deployment="fine-tune/nightly", target="t/b", opened=NOW - timedelta(days=2)),
        entry(7.0, opened=NOW - timedelta(days=40)),  # outside the 30 days
    ]
    days = by_day(entries, 30, NOW)
    assert len(days) == 30 and days[NOW.date()] == 1.0
    assert days[(NOW - timedelta(days=2)).date()] == 0.75
    recent = entries[:3]
    assert by_key(recent, "deployment") == {"fine-tune/nightly": 1.25, "train": 0.5}
    assert by_key(recent, "target") == {"t/a": 1.0, "t/b": 0.75}
    assert total(recent) == sum(days.values())


def plan(max_cost: float | None = None, keep: bool = False) -> LaunchPlan:
    def choice(gpu: str, price: float) -> GpuChoice:
        return GpuChoice(
            GpuType(id=gpu, display_name=gpu, memory_gb=24, secure_price=price), 1, price
        )

    return LaunchPlan(
        choices=(choice("A", 0.25), choice("B", 0.50)),
        settings=RunpodTargetSettings(max_hours=2.0, max_cost_usd=max_cost, keep_pod=keep),
        disk_per_hour=0.01,
    )


def test_a_plans_most_is_its_dearest_type_for_max_hours_or_its_cap() -> None:
    assert ask_of(plan(), "the run", "t/a").most_usd == pytest.approx(0.51 * 2)
    assert ask_of(plan(max_cost=0.3), "the run", "t/a").most_usd == 0.3
    assert ask_of(plan(keep=True), "the run", "t/a").most_usd is None
    least = ask_of(plan(), "the run", "t/a")
    assert least.least_usd == pytest.approx(0.26 / 6)
    assert least.least_text == "10 minutes of A (24 GB) at $0.26/h"
    assert capped(plan(max_cost=0.3), 0.2).max_cost_usd == 0.2
    assert capped(plan(max_cost=0.3), 0.5).max_cost_usd == 0.3
    assert capped(plan(), None).max_cost_usd is None


def test_an_admission_never_bound_to_a_record_leaves_the_ledger(tmp_path: Path) -> None:
    runs = Runs(tmp_path)
    ledger = LedgerFile(runs)
    kept = admit_into(ledger, Budgets(day_usd=5), ask(), who(), no_facts, NOW)
    dropped = admit_into(ledger, Budgets(day_usd=5), ask(), who(), no_facts, NOW)
    exports = runs.children("20261202-100000-aaaa", "export")
    kept.bind(exports, "20261202-100001-bbbb")
    assert dropped.close(no_facts) is None
    closed = kept.close(lambda e: Spent(pod_id="p1", cost_usd=0.12, ended=True))
    assert closed is not None and closed.charged == 0.12 and closed.pod_id == "p1"
    assert [e.id for e in ledger.read().entries] == [kept.entry.id]
    bound = entry_store(runs, closed)
    assert bound is not None and (bound.prefix, bound.kind) == (exports.prefix, "export")
    assert LedgerFile.of(exports).key == ledger.key  # a child's ledger is its runs directory's


ADMIT = textwrap.dedent(
    """
    import sys, time
    from datetime import datetime
    from pathlib import Path
    from overbrainer_prefect.money.budgets import Budgets
    from overbrainer_prefect.money.ledger import Ask, BudgetRefused, Who
    from overbrainer_prefect.money.store import LedgerFile, admit_into
    from overbrainer_prefect.runs.store import Runs
    root, go, now = Runs(sys.argv[1]), Path(sys.argv[2]), datetime.fromisoformat(sys.argv[3])
    while not go.exists():
        time.sleep(0.01)
    ask = Ask(most_usd=0.5, least_usd=0.1, least_text="x", what="the run", target="t/a")
    try:
        admit_into(LedgerFile(root), Budgets(day_usd=1.0), ask, Who("d"), lambda e: None, now)
        print("admitted")
    except BudgetRefused as refused:
        print("refused", refused)
    """
)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_two_processes_asking_for_the_last_dollars_at_once_get_them_once(
    where: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Two workers that share only the runs' store (a local directory, or an
    object store) ask for the last dollars of a day at once: one is admitted;
    the other lost the compare-and-swap, read the ledger again and is refused."""
    runs_dir = str(tmp_path) if where == "local" else request.getfixturevalue("s3").bucket_url()
    ledger = LedgerFile(Runs(runs_dir))
    first = admit_into(ledger, Budgets(day_usd=1.0), ask(most=0.5), who(), no_facts, NOW)
    first.bind(Runs(runs_dir), "20261202-100000-aaaa")  # $0.50 left: one more pod at most
    go = tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", ADMIT, runs_dir, str(go), NOW.isoformat()],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    go.touch()
    said = sorted(p.communicate(timeout=120)[0].strip().splitlines()[-1] for p in procs)
    assert said[0] == "admitted", said
    assert said[1].startswith("refused budget: the run is refused") and "has $0.00 left" in said[1]
    assert len(ledger.read().entries) == 2


HOLD = textwrap.dedent(
    """
    import sys, time
    from overbrainer_prefect.money.store import LedgerFile
    from overbrainer_prefect.runs.store import Runs

    def decide(ledger):
        print("holding", flush=True)  # read, not yet written: killed here
        time.sleep(600)

    LedgerFile(Runs(sys.argv[1])).change(decide)
    """
)


def test_a_process_killed_in_the_middle_of_a_change_keeps_nothing(tmp_path: Path) -> None:
    """Killed between its read of the ledger and its write: nothing to wait
    for, nothing half-written; the next admission goes through."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)
        ledger = LedgerFile(Runs(tmp_path))
        admitted = admit_into(ledger, None, ask(), who(), no_facts, NOW)
        assert admitted.cap_usd is None and len(ledger.read().entries) == 1
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


def test_a_run_and_a_fine_tune_summary_say_what_their_pods_cost(tmp_path: Path) -> None:
    from overbrainer_prefect.artifacts import summary_markdown
    from overbrainer_prefect.pipeline_summary import pipeline_markdown
    from overbrainer_prefect.runpod.pod import PodRecord
    from overbrainer_prefect.runs.metrics import MetricsSummary
    from overbrainer_prefect.steps.start import create
    from overbrainer_prefect.targets.spend import run_spent, spent

    runs = Runs(tmp_path / "runs")
    record = create(runs, target="t/a", target_kind="runpod", workdir="/w")
    exports = runs.children(record.id, "export")
    export = create(exports, target="t/a", target_kind="runpod", workdir="/w", trainer="export")
    for store, run_id, hours in ((runs, record.id, 1.0), (exports, export.id, 0.5)):
        PodRecord(
            run_id=run_id,
            host_key="ssh-ed25519 AAAA",
            cost_per_hour=0.25,
            created_unix=1_000_000,
            deleted_unix=1_000_000 + int(hours * 3600),
        ).save(store)
    assert spent(runs, runs.load(record.id)) == pytest.approx(0.25)
    assert run_spent(runs, record.id) == pytest.approx(0.375)
    summary = summary_markdown(record, "t/a", MetricsSummary(), [], "next", 0.25)
    assert "| dollars | $0.2500 (its pod: rate × uptime) |" in summary
    assert "Dollars: **$0.3750**" in pipeline_markdown(record.id, [], "", 0.375)
    assert "dollars" not in summary_markdown(record, "t/a", MetricsSummary(), [], "next")


def test_a_bill_that_differs_from_the_ledger_is_reported_and_counts() -> None:
    from overbrainer_prefect.money.reconcile import reconcile

    same = entry(0.100, pod_id="p1")
    off = entry(0.100, pod_id="p2", run_id="20261202-100000-bbbb")
    alive = entry(0.05, ended=False, max_usd=0.5, pod_id="p3")
    differences = reconcile([same, off, alive], {"p1": 0.104, "p2": 0.25, "p3": 0.3})
    assert [d.line() for d in differences] == [
        "pod p2 of run 20261202-100000-bbbb: the ledger says $0.10, the provider billed $0.25"
    ]
    assert (same.charged, off.charged, alive.charged) == (0.104, 0.25, 0.5)


def _lose_one_answer(store: Store, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The fault: the store's next conditional write of the ledger lands, and
    its answer is lost; what the writer hears is that the ledger changed
    meanwhile (what a retried PUT hears once another writer wrote after its
    own: its write's token is no longer there). Returns the writes lost."""
    lost: list[str] = []
    create, replace = store.create, store.replace

    def lossy_create(key: str, data: bytes) -> str:
        written = create(key, data)
        if key.endswith(LEDGER_KEY) and not lost:
            lost.append(key)
            raise AlreadyExists(f"{key} exists")
        return written

    def lossy_replace(key: str, data: bytes, etag: str) -> str:
        written = replace(key, data, etag)
        if key.endswith(LEDGER_KEY) and not lost:
            lost.append(key)
            raise Changed(f"{key} changed since it was read")
        return written

    monkeypatch.setattr(store, "create", lossy_create)
    monkeypatch.setattr(store, "replace", lossy_replace)
    return lost


@pytest.mark.parametrize("where", ["local", "s3"])
def test_an_admission_whose_answer_was_lost_after_it_landed_is_one_entry(
    where: str, tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A conditional PUT of the ledger lands and its answer is lost: the
    admission reads the ledger again, finds its own entry (its id was made
    once, before the compare-and-swap) and adds no second one, so the day's
    second pod is still admitted. On S3 the answer is lost for real, by the
    fault proxy between the store and the S3 server (the PUT applied, its
    connection closed before its answer)."""
    with contextlib.ExitStack() as stack:
        if where == "local":
            runs = Runs(str(tmp_path))
            lost = _lose_one_answer(runs.store, monkeypatch)

            def lose() -> None:
                lost.clear()  # the next ledger write's answer is lost

            def losses() -> int:
                return len(lost)
        else:
            s3 = request.getfixturevalue("s3")
            proxy = stack.enter_context(FaultProxy(s3.port, max_s=120))
            runs = Runs(s3.bucket_url(endpoint=proxy.endpoint))
            ledger_put = rb"^PUT [^ ]*" + re.escape(LEDGER_KEY.encode())

            def lose() -> None:
                proxy.drop_answers(1, ledger_put)

            def losses() -> int:
                return proxy.dropped

        ledger = LedgerFile(runs)
        budgets = Budgets(day_usd=1.0)
        lose()
        first = admit_into(ledger, budgets, ask(most=0.5), who(), no_facts, NOW)  # created
        assert losses() == 1 and [e.id for e in ledger.read().entries] == [first.entry.id]
        lose()
        second = admit_into(ledger, budgets, ask(most=0.5), who(), no_facts, NOW)  # replaced
        assert losses() == (1 if where == "local" else 2) and second.cap_usd == 0.5
        assert [e.id for e in ledger.read().entries] == [first.entry.id, second.entry.id]


ADMIT_AND_DIE = textwrap.dedent(
    """
    import sys, time
    from datetime import datetime
    from overbrainer_prefect.money.budgets import Budgets
    from overbrainer_prefect.money.ledger import Ask, Who
    from overbrainer_prefect.money.store import LedgerFile, admit_into
    from overbrainer_prefect.runs.store import Runs
    ask = Ask(most_usd=0.14, least_usd=0.05, least_text="x", what="the run", target="t/a")
    now = datetime.fromisoformat(sys.argv[2])
    admit_into(LedgerFile(Runs(sys.argv[1])), Budgets(day_usd=0.17), ask, Who("train", "f1"),
               lambda e: None, now)
    print("admitted", flush=True)  # killed here: before its record and its pod exist
    time.sleep(600)
    """
)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_train_killed_after_its_admission_holds_nothing_past_its_reservation_bound(
    where: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A train under a day budget that fits one pod is killed after its
    admission, before its pod exists: until its reservation bound its entry
    holds the day (the refusal says until when); past it, the next train is
    admitted, and the spend view says which entry expired and why."""
    runs_dir = str(tmp_path) if where == "local" else request.getfixturevalue("s3").bucket_url()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    dying = subprocess.Popen(
        [sys.executable, "-c", ADMIT_AND_DIE, runs_dir, NOW.isoformat()],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert dying.stdout is not None and dying.stdout.readline().strip() == "admitted"
        os.kill(dying.pid, signal.SIGKILL)
        dying.wait(timeout=30)
    finally:
        if dying.poll() is None:
            dying.kill()
            dying.wait()
    runs = Runs(runs_dir)
    ledger = LedgerFile(runs)
    budgets = Budgets(day_usd=0.17)
    (dead,) = ledger.read().entries
    soon = NOW + timedelta(minutes=1)
    with pytest.raises(BudgetRefused) as refused:
        admit_into(ledger, budgets, ask(most=0.14), who(), no_facts, soon)
    assert "has $0.03 left, $0.14 spent or held by the run of flow run f1 (being prepared" in str(
        refused.value
    )
    assert f"held until {(NOW + timedelta(seconds=RESERVE_S)):%Y-%m-%d %H:%M} UTC" in str(
        refused.value
    )
    later = NOW + timedelta(seconds=RESERVE_S + 1)
    admitted = admit_into(ledger, budgets, ask(most=0.14), who(), no_facts, later)
    assert admitted.cap_usd == 0.14
    expired = ledger.read().entry(dead.id)
    assert expired is not None and expired.ended and expired.charged == 0
    view = asyncio.run(spend_view(runs, 1, budgets, later, None))
    assert [(p.state, p.admitted_usd, p.usd) for p in view.pods] == [
        ("alive", 0.14, 0.14),
        ("expired", 0.14, 0.0),
    ]
    (why,) = view.expired
    assert why.startswith("the run of flow run f1 admitted at $0.14 on 2026-12-02 10:00 UTC")
    assert "never bound to a job's record by its reservation bound" in why
    assert "no pod was asked for" in why
    assert "expired" in spend_markdown(view) and why in spend_markdown(view)


def test_an_admission_placed_past_its_reservation_bound_is_admitted_again_when_it_fits(
    tmp_path: Path,
) -> None:
    """A live train that waited past its reservation bound (for the GPU
    budget's slots) before its pod is asked for: bound to its record then,
    it is admitted again at its cap when that still fits, else refused in
    one line before anything is created."""
    runs = Runs(tmp_path)
    ledger = LedgerFile(runs)
    budgets = Budgets(day_usd=1.0)
    waited = admit_into(ledger, budgets, ask(most=0.5), who(), no_facts, NOW)
    later = NOW + timedelta(seconds=RESERVE_S + 1)
    admit_into(ledger, budgets, ask(most=0.5), who(), no_facts, later)  # $0.50 still left
    waited.bind(runs, "20261202-100000-aaaa", later)
    bound = ledger.read().entry(waited.entry.id)
    assert bound is not None and not bound.ended and bound.charged == 0.5
    assert bound.run_id == "20261202-100000-aaaa" and bound.opened == later
    with pytest.raises(BudgetRefused):  # the day is full again: both count
        admit_into(ledger, budgets, ask(most=0.5), who(), no_facts, later)
    # the same wait with the day taken meanwhile: refused when it binds
    late = admit_into(ledger, Budgets(day_usd=2.0), ask(most=1.0), who(), no_facts, later)
    latest = later + timedelta(seconds=RESERVE_S + 1)
    admit_into(ledger, Budgets(day_usd=2.0), ask(most=1.0), who(), no_facts, latest)
    with pytest.raises(BudgetRefused) as refused:
        late.bind(runs, "20261202-100000-bbbb", latest)
    line = str(refused.value)
    assert "\n" not in line and "was not placed within its reservation bound" in line, line
    assert "the day's budget ($2.00) now has $0.50 left" in line, line
    assert late.close(no_facts) is None  # never bound: it leaves the ledger
    assert ledger.read().entry(late.entry.id) is None
