"""The day's and month's budgets on the real (ephemeral) Prefect server with
the Runpod simulator: a pod's cost cap lowered to what is left and its
watchdog armed at it, a second run refused in one line with nothing created,
two admissions at once for the last dollars, and the spend view, whose
totals and bars are the simulator's own bill."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import importlib.util
import logging
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

from overbrainer_prefect.blocks import RunpodTarget
from overbrainer_prefect.flows import cancel, spend, train
from overbrainer_prefect.flows.spend import SPEND_ARTIFACT
from overbrainer_prefect.money.budgets import BudgetSettingError
from overbrainer_prefect.money.ledger import BudgetRefused, BudgetTooSmall
from overbrainer_prefect.money.store import LedgerFile
from overbrainer_prefect.money.view import SpendError
from overbrainer_prefect.runpod.pod import PodRecord, PodState
from overbrainer_prefect.runs.store import Runs, RunState
from overbrainer_prefect.server_budget import (
    PrefectBudget,
    clear_budgets,
    read_budgets,
    set_budgets,
)
from overbrainer_prefect.targets.base import JobNeed
from tests import runpod_fixtures as on_pods
from tests.flowrun import run
from tests.runpod_fixtures import target
from tests.runpod_sim import RunpodSim
from tests.runpod_sim.pods import SimPods
from tests.test_runpod_flows import follower_killed_while_training
from tests.test_train_flow import spec

pytestmark = pytest.mark.slow

fast, sim, pods_of = on_pods.fast, on_pods.sim, on_pods.pods_of  # the simulator's fixtures


def svgs_of(markdown: str) -> list[ET.Element]:
    """The SVG images a markdown artifact carries, parsed (well-formed or it raises)."""
    found = re.findall(r"\(data:image/svg\+xml;base64,([A-Za-z0-9+/=]+)\)", markdown)
    return [ET.fromstring(base64.b64decode(data)) for data in found]


def bars(svg: ET.Element) -> dict[str, float]:
    return {
        rect.attrib["data-label"]: float(rect.attrib["data-usd"])
        for rect in svg.iter("{http://www.w3.org/2000/svg}rect")
        if rect.attrib.get("class") == "bar"
    }


def spend_markdown() -> str:
    async def go() -> str:
        async with get_client() as client:
            found = await client.read_artifacts(
                artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[SPEND_ARTIFACT]))
            )
            latest = max(found, key=lambda a: a.created or 0)
            return str(latest.data)

    return run(go())


def test_budgets_that_are_negative_or_not_numbers_are_refused_and_nothing_is_saved(
    prefect_server: None,
) -> None:
    run(clear_budgets_quietly())
    with pytest.raises(BudgetSettingError, match=r"^budget day_usd: \$-1 is not a budget"):
        run(set_budgets(day_usd=-1))
    with pytest.raises(BudgetSettingError, match="'ten' is not a number of dollars"):
        run(set_budgets(month_usd="ten"))
    assert run(read_budgets()) is None
    with pytest.raises(SpendError, match=r"^days=0: give 1 to 100"):
        run(spend(days=0))


async def clear_budgets_quietly() -> None:
    with contextlib.suppress(Exception):  # none was set
        await clear_budgets()


def test_two_admissions_started_together_for_the_last_dollars_one_runs_one_is_refused(
    prefect_server: None, sim: RunpodSim, tmp_path: Path
) -> None:
    name = target(sim, max_cost_usd=0.06)  # A4000: 10 minutes, the least, is $0.043
    place = RunpodTarget.load(name).target(name, logging.getLogger("budget-test"))
    store = Runs(tmp_path / "runs")
    inside = asyncio.Event()

    async def reserve() -> str:
        try:
            async with place.reserve(store, JobNeed(what="the run"), PrefectBudget()) as held:
                inside.set()
                await asyncio.sleep(0.5)  # both asked before either ends
                assert held.admission is not None
                return f"admitted at {held.plan.max_cost_usd}"  # type: ignore[attr-defined]
        except BudgetRefused as refused:
            await asyncio.wait_for(inside.wait(), 60)
            return f"refused: {refused}"

    async def go() -> list[str]:
        await set_budgets(day_usd=0.08)
        try:
            return sorted(await asyncio.gather(reserve(), reserve()))
        finally:
            await clear_budgets()

    said = run(go())
    assert said[0] == "admitted at 0.06", said
    assert said[1].startswith("refused: budget: the run is refused before anything is created")
    assert "has $0.02 left" in said[1] and "\n" not in said[1]
    assert store.list() == [] and sim.pods(include_deleted=True) == []
    assert LedgerFile.of(store).read().entries == []  # never bound to a record: it left


def test_a_budget_below_the_least_one_pod_costs_is_refused_before_anything_exists(
    prefect_server: None, sim: RunpodSim, tmp_path: Path
) -> None:
    name = target(sim)
    runs_dir = tmp_path / "runs"

    async def go() -> None:
        await set_budgets(day_usd=0.01)
        try:
            await train(target=name, training=spec(tmp_path, tmp_path), runs_dir=str(runs_dir))
        finally:
            await clear_budgets()

    with pytest.raises(BudgetTooSmall) as error:
        run(go())
    line = str(error.value)
    assert "the day's budget ($0.01) is below the least one pod of target" in line
    assert "10 minutes of NVIDIA RTX A4000 (16 GB)" in line and "\n" not in line
    assert Runs(runs_dir).list() == [] and sim.pods(include_deleted=True) == []


def test_a_day_that_fits_one_pod_caps_it_at_what_is_left_refuses_the_second_and_shows_the_bill(
    prefect_server: None,
    sim: RunpodSim,
    pods_of: SimPods,
    tiny: tuple[Path, Path],
    tmp_path: Path,
) -> None:
    runs_dir = tmp_path / "runs"
    name = target(sim)  # A4000 at $0.25/h for 1 h: at most $0.26, no max_cost_usd of its own
    run(set_budgets(day_usd=0.10, month_usd=5))
    try:
        # the first run's follower dies while it trains: its pod lives on, held at its most
        record = follower_killed_while_training(name, tiny, runs_dir, tmp_path)
        pod = PodRecord.load(Runs(runs_dir), record.id)
        assert pod is not None and pod.pod_id is not None
        assert pod.max_cost_usd == pytest.approx(0.10)  # lowered from $0.26 to what is left
        log = pods_of.watchdog_log(pod.pod_id, record.id)
        assert "cost cap armed: max_cost_usd $0.1 at $0.256944/h" in log, log
        # the second run: refused in one line, before any record or pod exists
        with pytest.raises(BudgetRefused) as refused:
            run(train(target=name, training=spec(*tiny), runs_dir=str(runs_dir)))
        line = str(refused.value)
        assert "\n" not in line, line
        assert "the day's budget ($0.10) has $0.00 left" in line, line
        assert f"run {record.id} ($0.10, alive: at its most)" in line, line
        assert "resets at" in line and "00:00 UTC" in line, line
        assert [r.id for r in Runs(runs_dir).list()] == [record.id]
        assert len(sim.pods(include_deleted=True)) == 1
        # the first ends (cancelled); the spend view counts it at what the simulator billed
        assert run(cancel(run_id=record.id, runs_dir=str(runs_dir))).state == RunState.CANCELLED
        view = run(spend(runs_dir=str(runs_dir)))
    finally:
        run(clear_budgets())
    ended = PodRecord.load(Runs(runs_dir), record.id)
    assert ended is not None and ended.state == PodState.DELETED
    billed = sim.spend()
    assert 0 < billed < 0.10
    assert view.total_usd == pytest.approx(billed, abs=1e-9)
    assert view.by_target == {record.target: pytest.approx(billed, abs=1e-9)}
    assert sum(view.by_day.values()) == pytest.approx(billed, abs=1e-9)
    assert view.reconciled == [record.target] and view.differences == []
    assert [p.pod_id for p in view.pods] == [pod.pod_id] and view.pods[0].state == "ended"
    day = next(row for row in view.left if row.period == "day")
    assert day.left_usd == pytest.approx(0.10 - billed, abs=1e-9)
    # the chart: well-formed SVG whose bars are those totals
    markdown = spend_markdown()
    by_day, by_deployment, by_target = (bars(svg) for svg in svgs_of(markdown))
    assert len(by_day) == 30 and sum(by_day.values()) == pytest.approx(billed, abs=1e-5)
    assert by_target == {record.target: pytest.approx(billed, abs=1e-5)}
    assert sum(by_deployment.values()) == pytest.approx(billed, abs=1e-5)
    assert "| day: $0.10 |" in markdown


def test_create_blocks_sets_the_day_and_month_budgets_and_a_targets_own(
    prefect_server: None,
) -> None:
    spec_ = importlib.util.spec_from_file_location(
        "create_blocks", Path(__file__).resolve().parents[1] / "blocks" / "create_blocks.py"
    )
    assert spec_ is not None and spec_.loader is not None
    create_blocks = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(create_blocks)
    try:
        assert create_blocks.main(["--budget-day-usd", "2", "--budget-month-usd", "30"]) == 0
        ref = "overbrainer-runpod-target/nightly"
        assert create_blocks.main(["--budget-day-usd", "0.5", "--budget-target", ref]) == 0
        budgets = run(read_budgets())
        assert budgets is not None and (budgets.day_usd, budgets.month_usd) == (2.0, 30.0)
        assert budgets.targets[ref].day_usd == 0.5 and budgets.targets[ref].month_usd is None
    finally:
        run(clear_budgets_quietly())
