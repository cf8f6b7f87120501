"""A pod lost under a training costs only time (issue 29): on the project's
simulated pods (real sshd processes running the real bootstrap and watchdog),
a pod terminated by Runpod, then the next pod's container restarted, each once
a checkpoint was kept in the runs store, has the run go on by itself each time
from the last kept checkpoint in a new run on a new pod, its steps continuing
from the checkpoint's, every pod and what it cost in the summary; with
`max_restarts` 0 the run fails with the loss and no second pod is made."""

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


def lose_pods_once_a_checkpoint_is_kept(
    sim: RunpodSim,
    pods: SimPods,
    runs_dir: Path,
    lost: list[tuple[str, int]],
    ways: tuple[str, ...] = ("restarted",),
) -> threading.Thread:
    """A thread that loses the pod of each run in turn, once a checkpoint of
    that run is kept in the runs store, the n-th the n-th of `ways`:
    "restarted" (its host restarts its container, as Runpod's do) or
    "terminated" (Runpod terminates it: the account's balance ran out), noting
    (run, kept step) for each."""

    def watch() -> None:
        deadline = time.monotonic() + RESTART_BOUND_S * len(ways)
        while time.monotonic() < deadline and len(lost) < len(ways):
            runs = Runs(runs_dir)
            done = {run_id for run_id, _ in lost}
            for record in runs.list(skipped=lambda _name, _error: None):
                if record.id in done:
                    continue
                kept = last_kept(runs, record.id)
                pod = PodRecord.load(runs, record.id)
                if kept is not None and pod is not None and pod.pod_id is not None:
                    if ways[len(lost)] == "terminated":
                        sim.terminate(pod.pod_id)
                    else:
                        pods.restart(sim.pod(pod.pod_id))
                    lost.append((record.id, kept.step))
                    break
            time.sleep(0.2)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def steps_of(runs: Runs, run_id: str) -> list[int]:
    lines = (runs.run_dir(run_id) / "metrics.jsonl").read_text().splitlines()
    events = [json.loads(line) for line in lines if line.strip()]
    return [e["step"] for e in events if e.get("event") == "log"]


def test_a_training_goes_on_from_its_kept_checkpoint_on_a_new_pod_each_time_its_pod_is_lost(
    prefect_server: None,
    sim: RunpodSim,
    pods_of: SimPods,
    tiny: tuple[Path, Path],
    tmp_path: Path,
) -> None:
    """Its first pod terminated by Runpod, then its second pod's container
    restarted (max_restarts 2): three pods, each run going on from the one
    before's kept checkpoint, all three in the summary."""
    runs_dir = tmp_path / "runs"
    pods_of.restart_delay_s = (0.2, 0.4)
    lost: list[tuple[str, int]] = []
    ways = ("terminated", "restarted")
    watcher = lose_pods_once_a_checkpoint_is_kept(sim, pods_of, runs_dir, lost, ways)
    name = target(sim)
    training = spec(*tiny, max_steps=40, save_steps=5)
    result = run(train(target=name, training=training, runs_dir=str(runs_dir)))
    watcher.join(timeout=5)
    assert len(lost) == 2, f"a checkpoint was not kept before each loss: {lost}"
    assert isinstance(result, RunResult)
    assert result.state == RunState.SUCCEEDED, result.message
    runs = Runs(runs_dir)
    (terminated_id, first_step), (restarted_id, second_step) = lost
    told = [runs.load(run_id).message or "" for run_id, _ in lost]
    assert [runs.load(run_id).state for run_id, _ in lost] == [RunState.FAILED] * 2, told
    assert "Runpod terminated it" in told[0] and "restarted" in told[1], told
    # each new run on a new pod, from the kept checkpoint before it, its steps going on
    second, went_on = runs.load(restarted_id), runs.load(result.run_id)
    assert second.resumed_from is not None and went_on.resumed_from is not None
    assert (second.resumed_from.run_id, second.resumed_from.step) == (terminated_id, first_step)
    assert (went_on.resumed_from.run_id, went_on.resumed_from.step) == (restarted_id, second_step)
    assert min(steps_of(runs, restarted_id)) > first_step
    assert min(steps_of(runs, went_on.id)) > second_step and max(steps_of(runs, went_on.id)) == 40
    pods = [PodRecord.load(runs, run_id) for run_id in (terminated_id, restarted_id, went_on.id)]
    assert all(pod is not None and pod.state == PodState.DELETED for pod in pods), pods
    assert len({pod.pod_id for pod in pods if pod is not None}) == 3
    assert pods[0] is not None and pods[0].deleted_by == "unknown" and pods[0].restarted is None
    assert pods[1] is not None and pods[1].restarted is not None
    assert sim.pods() == [] and len(sim.pods(include_deleted=True)) == 3
    # the summary lists every pod: why each was lost, where the next went on from
    (summary,) = [a for a in artifacts_of(went_on.id) if a.key == f"run-{went_on.id}-summary"]
    text = str(summary.data)
    assert "## Machines" in text and terminated_id in text and restarted_id in text, text
    assert text.count("| lost: ") == 2, text
    for step in (first_step, second_step):
        assert f"checkpoint-{step} (step {step})" in text, text


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
    watcher = lose_pods_once_a_checkpoint_is_kept(sim, pods_of, runs_dir, restarted)
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
