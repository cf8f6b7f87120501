"""A pod lost under a training costs only time (issue 29): on the project's
simulated pods (real sshd processes running the real bootstrap and watchdog),
a container restarted mid-training, once a checkpoint was kept in the runs
store, has the run go on by itself from that checkpoint in a new run on a new
pod, its steps continuing from the checkpoint's, every pod and what it cost in
the summary; with `max_restarts` 0 the run fails with the loss and no second
pod is made."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from overbrainer_prefect.flows import RunResult, train
from overbrainer_prefect.money.limits import BudgetError
from overbrainer_prefect.runpod.pod import PodRecord, PodState
from overbrainer_prefect.runs import Runs, RunState
from overbrainer_prefect.runs.checkpoints import last_kept
from overbrainer_prefect.targets.base import JobNeed
from overbrainer_prefect.targets.pod import _after_lost_pods
from tests.flowrun import run
from tests.runpod_sim import RunpodSim
from tests.runpod_sim.pods import SimPods
from tests.test_money_ledger import plan
from tests.test_runpod_flows import artifacts_of, fast, pods_of, sim, target
from tests.test_train_flow import spec

__all__ = ["fast", "pods_of", "sim"]  # the simulator's fixtures, shared with the Runpod flow tests

pytestmark = pytest.mark.slow

RESTART_BOUND_S = 240.0  # for a checkpoint to be kept, then the container restarted


def restart_once_a_checkpoint_is_kept(
    sim: RunpodSim,
    pods: SimPods,
    runs_dir: Path,
    restarted: list[tuple[str, int]],
    terminate: bool = False,
) -> threading.Thread:
    """A thread that restarts the container of the first run's pod once a
    checkpoint of it is kept in the runs store (its host restarts it, as
    Runpod's do), or with `terminate`, has Runpod terminate the pod (the
    account's balance ran out), noting (run, kept step)."""

    def watch() -> None:
        deadline = time.monotonic() + RESTART_BOUND_S
        while time.monotonic() < deadline and not restarted:
            runs = Runs(runs_dir)
            for record in runs.list(skipped=lambda _name, _error: None):
                kept = last_kept(runs, record.id)
                pod = PodRecord.load(runs, record.id)
                if kept is not None and pod is not None and pod.pod_id is not None:
                    if terminate:
                        sim.terminate(pod.pod_id)
                    else:
                        pods.restart(sim.pod(pod.pod_id))
                    restarted.append((record.id, kept.step))
                    return
            time.sleep(0.2)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def steps_of(runs: Runs, run_id: str) -> list[int]:
    lines = (runs.run_dir(run_id) / "metrics.jsonl").read_text().splitlines()
    events = [json.loads(line) for line in lines if line.strip()]
    return [e["step"] for e in events if e.get("event") == "log"]


@pytest.mark.parametrize("lost", ["restarted", "terminated"])
def test_a_pod_lost_mid_training_goes_on_from_its_kept_checkpoint_on_a_new_pod(
    prefect_server: None,
    sim: RunpodSim,
    pods_of: SimPods,
    tiny: tuple[Path, Path],
    tmp_path: Path,
    lost: str,
) -> None:
    runs_dir = tmp_path / "runs"
    pods_of.restart_delay_s = (0.2, 0.4)
    restarted: list[tuple[str, int]] = []
    watcher = restart_once_a_checkpoint_is_kept(
        sim, pods_of, runs_dir, restarted, terminate=lost == "terminated"
    )
    name = target(sim)
    training = spec(*tiny, max_steps=40, save_steps=5)
    result = run(train(target=name, training=training, runs_dir=str(runs_dir)))
    watcher.join(timeout=5)
    assert restarted, "no checkpoint was kept before the run ended"
    (lost_id, kept_step) = restarted[0]
    assert isinstance(result, RunResult)
    assert result.state == RunState.SUCCEEDED, result.message
    runs = Runs(runs_dir)
    first_run = runs.load(lost_id)
    told = first_run.message or ""
    assert first_run.state == RunState.FAILED, told
    assert ("restarted" if lost == "restarted" else "Runpod terminated it") in told, told
    # a new run on a new pod, from the kept checkpoint, its steps going on from there
    went_on = runs.load(result.run_id)
    assert went_on.id != lost_id and went_on.resumed_from is not None
    assert went_on.resumed_from.run_id == lost_id and went_on.resumed_from.step == kept_step
    assert min(steps_of(runs, went_on.id)) > kept_step and max(steps_of(runs, went_on.id)) == 40
    first, second = PodRecord.load(runs, lost_id), PodRecord.load(runs, went_on.id)
    assert first is not None and second is not None and first.pod_id != second.pod_id
    assert first.state == PodState.DELETED
    if lost == "restarted":
        assert first.restarted is not None
    else:
        assert first.deleted_by == "unknown" and first.restarted is None
    assert second.state == PodState.DELETED
    assert sim.pods() == [] and len(sim.pods(include_deleted=True)) == 2
    # the summary lists both pods: why the first was lost, where the second went on from
    (summary,) = [a for a in artifacts_of(went_on.id) if a.key == f"run-{went_on.id}-summary"]
    text = str(summary.data)
    assert "## Machines" in text and lost_id in text and "lost: " in text, text
    assert f"checkpoint-{kept_step} (step {kept_step})" in text, text


def test_with_max_restarts_0_a_run_lost_with_its_pod_fails_with_the_loss(
    prefect_server: None,
    sim: RunpodSim,
    pods_of: SimPods,
    tiny: tuple[Path, Path],
    tmp_path: Path,
) -> None:
    runs_dir = tmp_path / "runs"
    pods_of.restart_delay_s = (0.2, 0.4)
    restarted: list[tuple[str, int]] = []
    watcher = restart_once_a_checkpoint_is_kept(sim, pods_of, runs_dir, restarted)
    name = target(sim, max_restarts=0)
    training = spec(*tiny, max_steps=40, save_steps=5)
    state = run(train(target=name, training=training, runs_dir=str(runs_dir), return_state=True))
    watcher.join(timeout=5)
    assert restarted and state.is_failed(), state
    assert "restarted" in (state.message or ""), state.message
    assert [r.id for r in Runs(runs_dir).list()] == [restarted[0][0]]
    assert len(sim.pods(include_deleted=True)) == 1 and sim.pods() == []


def test_max_cost_usd_counts_the_pods_a_training_lost_before() -> None:
    first = JobNeed(what="the run")
    assert _after_lost_pods(plan(max_cost=3.0), first).max_cost_usd == 3.0
    again = JobNeed(what="the run", spent_usd=1.25)
    assert _after_lost_pods(plan(max_cost=3.0), again).max_cost_usd == pytest.approx(1.75)
    assert _after_lost_pods(plan(), again).max_cost_usd is None  # no cap: nothing to count
    with pytest.raises(BudgetError, match=r"max_cost_usd \(\$1.00\) is spent by the pods"):
        _after_lost_pods(plan(max_cost=1.0), JobNeed(what="the run", spent_usd=1.0))
