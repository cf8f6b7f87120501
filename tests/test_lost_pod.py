"""A pod lost under a training costs only time (issue 29): on the project's
simulated pods (real sshd processes running the real bootstrap and watchdog),
a pod terminated by Runpod, then the next pod's container restarted, each once
a checkpoint was kept in the runs store, has the run go on by itself each time
from the last kept checkpoint in a new run on a new pod, its steps continuing
from the checkpoint's, every pod and what it cost in the summary. A pod
whose host stops answering (frozen, its SSH refused, while Runpod shows it
running) is deleted by its follower as a lost host; with `max_restarts` 0
the run then fails with the loss, no second pod is made, and its message
names how to go on from its kept checkpoint."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from overbrainer_prefect.flows import RunResult, train
from overbrainer_prefect.kinds.training import resume_point
from overbrainer_prefect.money.limits import BudgetError
from overbrainer_prefect.runpod.bootstrap import TIMING_ENV
from overbrainer_prefect.runpod.pod import PodRecord, PodState
from overbrainer_prefect.runs import Runs, RunState
from overbrainer_prefect.runs.checkpoints import last_kept, load_kept
from overbrainer_prefect.targets.base import JobNeed
from overbrainer_prefect.targets.pod import _after_lost_pods
from overbrainer_prefect.trainers.staging import stored_inputs
from tests.flowrun import run
from tests.runpod_fixtures import FAST, fast, pods_of, sim, target
from tests.runpod_sim import RunpodSim
from tests.runpod_sim.pods import SimPods
from tests.test_money_ledger import plan
from tests.test_runpod_flows import artifacts_of
from tests.test_train_flow import spec

__all__ = ["fast", "pods_of", "sim"]  # the simulator's fixtures (tests/runpod_fixtures.py)

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
    "terminated" (Runpod terminates it: the account's balance ran out) or
    "host lost" (its host freezes and refuses SSH while Runpod shows the pod
    running), noting (run, kept step) for each."""

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
                    elif ways[len(lost)] == "host lost":
                        pods.lose_host(sim.pod(pod.pod_id))
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
    before's kept checkpoint, all three in the summary. The target keeps the
    checkpoints on its network volume (`checkpoints_on: volume`): hashed
    where the job wrote them, none copied while it trained; the next pod, in
    the volume's data center, links the terminated pod's in from there."""
    runs_dir = tmp_path / "runs"
    pods_of.restart_delay_s = (0.2, 0.4)
    lost: list[tuple[str, int]] = []
    ways = ("terminated", "restarted")
    watcher = lose_pods_once_a_checkpoint_is_kept(sim, pods_of, runs_dir, lost, ways)
    volume = sim.add_volume(10, "EU-RO-1")
    on_volume = {"network_volume_id": volume, "data_center_ids": ["EU-RO-1"]}
    name = target(sim, checkpoints_on="volume", **on_volume)
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
    assert "start the run again" not in told[0], told
    # each new run on a new pod, from the kept checkpoint before it, its steps going on
    for text, (_, step) in zip(told, lost, strict=True):  # each says where it went on
        assert f"checkpoint-{step} (step {step}) in a new run on a new machine" in text, text
    second, went_on = runs.load(restarted_id), runs.load(result.run_id)
    assert second.resumed_from is not None and went_on.resumed_from is not None
    assert (second.resumed_from.run_id, second.resumed_from.step) == (terminated_id, first_step)
    assert (went_on.resumed_from.run_id, went_on.resumed_from.step) == (restarted_id, second_step)
    assert min(steps_of(runs, restarted_id)) > first_step
    # kept on the volume, never copied: the next pod linked the terminated one's in from it
    kept = load_kept(runs, terminated_id).checkpoints
    assert kept and all(point.volume == volume for point in kept), kept
    assert not list(runs.run_dir(terminated_id).glob("output/checkpoint-*")), "copied"
    inputs = stored_inputs(runs.run_dir(restarted_id))
    assert inputs and all(f"/{terminated_id}/output/checkpoint-" in str(i.source) for i in inputs)
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


def lose_host_twice(
    sim: RunpodSim,
    pods: SimPods,
    runs_dir: Path,
    caplog: pytest.LogCaptureFixture,
    lost: list[tuple[str, int]],
) -> threading.Thread:
    """A thread that loses the host of the run's pod once a checkpoint of it
    is kept and brings it back once its follower says it tries SSH again;
    then, once a later checkpoint is kept, loses it for good. Notes (run,
    kept step) at each loss."""

    def kept() -> tuple[str, int, str] | None:
        runs = Runs(runs_dir)
        for record in runs.list(skipped=lambda _name, _error: None):
            point, pod = last_kept(runs, record.id), PodRecord.load(runs, record.id)
            if point is not None and pod is not None and pod.pod_id is not None:
                return record.id, point.step, pod.pod_id
        return None

    def watch() -> None:
        deadline = time.monotonic() + RESTART_BOUND_S
        while time.monotonic() < deadline and len(lost) < 2:
            found = kept()
            if found is not None and (not lost or found[1] > lost[0][1]):
                run_id, step, pod_id = found
                pods.lose_host(sim.pod(pod_id))
                lost.append((run_id, step))
                if len(lost) == 1:
                    while time.monotonic() < deadline and TRYING_AGAIN not in caplog.text:
                        time.sleep(0.2)
                    pods.find_host(sim.pod(pod_id))
            time.sleep(0.2)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


TRYING_AGAIN = "does not answer SSH while Runpod shows it: trying it again"


def test_a_pod_whose_host_stops_answering_is_deleted_and_with_max_restarts_0_the_run_fails(
    prefect_server: None,
    sim: RunpodSim,
    pods_of: SimPods,
    tiny: tuple[Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A lost host: the pod frozen and its SSH refused while Runpod shows it
    running. Back within `lost_host_s` (8 s here, 180 s by default), its job
    is followed again; the second time it stays silent, the follower
    deletes the pod, `pod.json` and the run say why and at which step; it is
    a loss the run could go on from, but with max_restarts 0 it fails, and
    no second pod is made. What billed: the pod until its delete, about
    lost_host_s + the tries after the loss."""
    monkeypatch.setenv(TIMING_ENV, f"{FAST},lost_host_s=8")
    runs_dir = tmp_path / "runs"
    lost: list[tuple[str, int]] = []
    watcher = lose_host_twice(sim, pods_of, runs_dir, caplog, lost)
    name = target(sim, max_restarts=0)
    training = spec(*tiny, max_steps=40, save_steps=5)
    state = run(train(target=name, training=training, runs_dir=str(runs_dir), return_state=True))
    watcher.join(timeout=5)
    assert len(lost) == 2 and state.is_failed(), (lost, state)
    assert "answers SSH again: its job is followed again" in caplog.text
    assert "stopped answering SSH" in (state.message or ""), state.message
    runs = Runs(runs_dir)
    (run_id, _), (same_run, kept_step) = lost
    assert same_run == run_id  # the same run, followed again after its host came back
    assert [r.id for r in runs.list()] == [run_id]
    record = runs.load(run_id)
    assert record.state == RunState.FAILED and "a lost host" in (record.message or ""), record
    assert "Runpod's runtime of it stalled" in (record.message or ""), record  # its 2nd witness
    pod = PodRecord.load(runs, run_id)
    assert pod is not None and pod.state == PodState.DELETED and pod.deleted_by == "client", pod
    assert pod.host_lost is not None and pod.lost_step is not None and pod.lost_step >= kept_step
    assert len(sim.pods(include_deleted=True)) == 1 and sim.pods() == []
    assert not pods_of.running(str(pod.pod_id))  # its frozen processes are gone with it
    # taken for a lost machine, not resumed only because of max_restarts
    (summary,) = [a for a in artifacts_of(run_id) if a.key == f"run-{run_id}-summary"]
    assert "not resumed: max_restarts (0) reached" in str(summary.data), summary.data
    # the message names the next command, which goes on from the last kept checkpoint (a
    # resume from a kept checkpoint is the first test's, from the store and from a volume)
    assert f"with the train flow (resume_from={run_id})" in (record.message or ""), record
    point, last = resume_point(runs, record), last_kept(runs, run_id)
    assert last is not None and (point.run_id, point.step) == (run_id, last.step), point


def test_max_cost_usd_counts_the_pods_a_training_lost_before() -> None:
    first = JobNeed(what="the run")
    assert _after_lost_pods(plan(max_cost=3.0), first).max_cost_usd == 3.0
    again = JobNeed(what="the run", spent_usd=1.25)
    assert _after_lost_pods(plan(max_cost=3.0), again).max_cost_usd == pytest.approx(1.75)
    assert _after_lost_pods(plan(), again).max_cost_usd is None  # no cap: nothing to count
    with pytest.raises(BudgetError, match=r"max_cost_usd \(\$1.00\) is spent by the pods"):
        _after_lost_pods(plan(max_cost=1.0), JobNeed(what="the run", spent_usd=1.0))


def test_a_training_lost_before_its_first_checkpoint_starts_again_from_step_0_on_a_new_pod(
    prefect_server: None,
    sim: RunpodSim,
    pods_of: SimPods,
    tiny: tuple[Path, Path],
    tmp_path: Path,
) -> None:
    """Its pod's container restarted at its first step, no checkpoint kept yet
    (save_steps past max_steps): with max_restarts 1 the run starts again from
    step 0 in a new run on a new pod, which succeeds; the lost run says so, and
    the summary lists both pods."""
    runs_dir = tmp_path / "runs"
    pods_of.restart_delay_s = (0.2, 0.4)
    lost: list[str] = []

    def first_step_logged(record_id: str, pod_id: str) -> bool:
        metrics = pods_of.workspace_of(pod_id) / "overbrainer" / record_id / "metrics.jsonl"
        return metrics.is_file() and '"log"' in metrics.read_text()

    def watch() -> None:
        deadline = time.monotonic() + RESTART_BOUND_S
        while time.monotonic() < deadline and not lost:
            runs = Runs(runs_dir)
            for record in runs.list(skipped=lambda _name, _error: None):
                pod = PodRecord.load(runs, record.id)
                if pod is not None and pod.pod_id and first_step_logged(record.id, pod.pod_id):
                    assert last_kept(runs, record.id) is None
                    pods_of.restart(sim.pod(pod.pod_id))
                    lost.append(record.id)
                    break
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    name = target(sim, max_restarts=1)
    training = spec(*tiny, max_steps=6, save_steps=100)
    result = run(train(target=name, training=training, runs_dir=str(runs_dir)))
    watcher.join(timeout=5)
    assert len(lost) == 1, lost
    assert isinstance(result, RunResult) and result.state == RunState.SUCCEEDED, result
    runs = Runs(runs_dir)
    (lost_id,) = lost
    first, again = runs.load(lost_id), runs.load(result.run_id)
    assert first.state == RunState.FAILED and again.id != lost_id
    told = first.message or ""
    assert "restarted" in told and "it went on from step 0" in told, told
    assert "Start it again" not in told, told
    assert again.resumed_from is None and min(steps_of(runs, again.id)) == 1
    assert max(steps_of(runs, again.id)) == 6
    assert len(sim.pods(include_deleted=True)) == 2 and sim.pods() == []
    (summary,) = [a for a in artifacts_of(again.id) if a.key == f"run-{again.id}-summary"]
    assert "step 0 (no checkpoint was kept before the loss)" in str(summary.data), summary.data
