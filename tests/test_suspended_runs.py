"""Flow runs that hold no process while their job trains (issue 28), on a real
Prefect server with a real process worker: a `train` deployment run suspends
once its job started, the `follow` deployment's one follower follows the job
(its progress in the suspended run's own artifacts and log), and resumes it
to `Completed` with its files verified, through its follower being SIGKILLed
and replaced and the Prefect server restarted mid-training; a suspended run
cancelled with `prefect flow-run cancel` on a simulated pod has its job cancelled by
the follower, its pod deleted and its host-key secret gone;
a suspended run on a simulated Runpod pod has its pod deleted by the follower;
a `fine-tune` with an evaluation, from its deployment, on one simulated pod,
waits suspended while it trains and goes on on that pod once resumed."""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from overbrainer_prefect.evaluation.results import SCORED_FILE
from overbrainer_prefect.money.limits import POD_LIMIT, SPEND_LIMIT
from overbrainer_prefect.resume_here import CLAIM
from overbrainer_prefect.runpod.pod import PodState
from overbrainer_prefect.runs import Runs, RunState
from overbrainer_prefect.runs.lock import follower_of
from overbrainer_prefect.server_budget import set_budget
from overbrainer_prefect.targets.runpod.keys import CLIENT_KEY, SSH_DIR
from tests.prefect_server import FOLLOWER, Stack, followed, tiny_training, wait_until
from tests.procs import alive, group_alive, held_stopped
from tests.test_deployments import OnSim, assert_verified, on_sim, pod_of

__all__ = ["on_sim"]  # the simulated pods' fixture, shared with the deployment tests

pytest_plugins = ["tests.prefect_server"]
pytestmark = pytest.mark.slow


def pid_of(stack: Stack, flow_run_id: uuid.UUID) -> int | None:
    """The PID of the process a worker started for the flow run (`host:pid`)."""
    found = stack.flow_run(flow_run_id).infrastructure_pid
    return int(str(found).rsplit(":", 1)[-1]) if found else None


def start_follower(stack: Stack) -> uuid.UUID:
    """A run of the follower deployment, once it holds the runs directory."""
    flow_run_id = stack.run_deployment(FOLLOWER, minutes=30, every_s=1)
    wait_until(
        lambda: follower_of(Runs(stack.runs)) is not None and pid_of(stack, flow_run_id),
        240,
        "the follower to hold the runs directory",
    )
    return flow_run_id


@pytest.fixture(autouse=True)
def a_worker_after(deployed: Stack) -> Iterator[None]:
    """A worker of the stack runs after each test, as the other modules of the
    stack's unit expect (the simulated pods' fixture stops its own)."""
    yield
    deployed.worker()


@pytest.fixture
def follower(deployed: Stack) -> Iterator[list[uuid.UUID]]:
    """A follower for the test (more may be added); every one is ended after
    it, so that the other deployment tests follow their jobs in-process."""
    deployed.worker()
    started = [start_follower(deployed)]
    try:
        yield started
    finally:
        for flow_run_id in started:
            if not deployed.flow_run(flow_run_id).state.is_final():
                deployed.cancel(flow_run_id, check=False)
        for flow_run_id in started:
            deployed.wait_final(flow_run_id, timeout=120)
        wait_until(lambda: follower_of(Runs(deployed.runs)) is None, 60, "the follower to go")


def job_of(stack: Stack, flow_run_id: uuid.UUID) -> Any:
    """The run the flow run started, once its job runs."""
    for record in Runs(stack.runs).list():
        if record.flow_run_id == str(flow_run_id) and record.job is not None:
            return record
    return None


def suspended_with_its_job(stack: Stack, flow_run_id: uuid.UUID) -> Any:
    """Waits until the flow run waits suspended with its job running and its
    process gone; returns the job's record."""
    wait_until(
        lambda: stack.flow_run(flow_run_id).state.is_paused(), 300, "the flow run to suspend"
    )
    record = job_of(stack, flow_run_id)
    assert record is not None and record.state == RunState.RUNNING, record
    assert group_alive(record.job.pid)
    pid = pid_of(stack, flow_run_id)
    assert pid is not None
    wait_until(lambda: not alive(pid), 60, "the suspended flow run's process to exit")
    return record


def artifacts_of(stack: Stack, flow_run_id: uuid.UUID) -> dict[str, str]:
    """The flow run's artifacts, by key: their latest data."""

    async def read(client: Any) -> dict[str, str]:
        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

        found = await client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
        return {a.key: str(a.data) for a in found if a.key}

    return dict(stack.server.call(read))


def logs_of(stack: Stack, flow_run_id: uuid.UUID) -> str:
    """The flow run's log, as the server has it."""

    async def read(client: Any) -> str:
        from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

        found = await client.read_logs(
            log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]))
        )
        return "\n".join(log.message for log in found)

    return str(stack.server.call(read))


def states_after_pause(stack: Stack, flow_run_id: uuid.UUID) -> list[tuple[str, str]]:
    """The (type, name) of each state the flow run took after its last pause."""

    async def read(client: Any) -> list[tuple[str, str]]:
        found = sorted(await client.read_flow_run_states(flow_run_id), key=lambda s: s.timestamp)
        paused = [n for n, s in enumerate(found) if s.type.value == "PAUSED"]
        return [(s.type.value, s.name) for s in found[paused[-1] + 1 :]] if paused else []

    return list(stack.server.call(read))


def test_a_train_run_waits_suspended_while_followers_die_and_the_server_restarts(
    deployed: Stack, follower: list[uuid.UUID], tiny: tuple[Path, Path]
) -> None:
    flow_run_id = deployed.run_deployment(
        "train/local", target=deployed.target, training=tiny_training(*tiny, max_steps=60)
    )
    record = suspended_with_its_job(deployed, flow_run_id)
    # its live progress goes to its own artifacts, opened before it suspended
    keys = artifacts_of(deployed, flow_run_id)
    curve = f"run-{record.id}-loss-curve".lower()
    assert curve in keys and f"run-{record.id}-progress".lower() in keys

    # its job held stopped until the next follower follows it: still training then, however
    # long the follower's death, the server's restart and the next one's start take
    with held_stopped(record.job.pid):
        # the follower dies (SIGKILL: no hook, no release): the job lives on, its lock is free
        first = pid_of(deployed, follower[0])
        assert first is not None
        os.kill(first, signal.SIGKILL)
        wait_until(lambda: follower_of(Runs(deployed.runs)) is None, 60, "the dead follower's lock")
        assert group_alive(record.job.pid)
        assert deployed.flow_run(flow_run_id).state.is_paused()

        # the server restarts while the run waits: nothing of it is lost
        deployed.server.stop()
        deployed.server.start()
        assert deployed.flow_run(flow_run_id).state.is_paused()

        # the next follower takes the job over where it is, and resumes the run at its end
        follower.append(start_follower(deployed))
        wait_until(lambda: followed(deployed, record.id), 120, "the next follower to follow it")
    done = deployed.wait_final(flow_run_id, timeout=600)
    assert done.state.is_completed(), done.state
    saved = Runs(deployed.runs).load(record.id)
    assert saved.state == RunState.SUCCEEDED and saved.message is None, saved
    assert_verified(deployed.runs, record.id)
    # one run, one job: the resumed flow run found its job, it started none
    assert [r.id for r in Runs(deployed.runs).list() if r.flow_run_id == str(flow_run_id)] == [
        record.id
    ]
    keys = artifacts_of(deployed, flow_run_id)
    assert "<svg" in keys[curve] or "data:image/svg" in keys[curve], keys[curve][:300]
    assert f"run-{record.id}-summary".lower() in keys
    # the resumed run's last lines reach the server after its state (its logs are sent
    # in batches): read again until they are there
    log = wait_until(
        lambda: "its follower recorded its end" in (t := logs_of(deployed, flow_run_id)) and t,
        60,
        "the resumed run's last log lines",
    )
    assert "waits suspended" in log and "its follower recorded its end" in log, log[-3000:]
    assert f"run {record.id}: step" in log, "the follower's progress lines, in the run's own log"
    # resumed, it ran again in the follower's process (claimed by it, no worker's process)
    assert states_after_pause(deployed, flow_run_id) == [
        ("SCHEDULED", "Resuming"),
        ("PENDING", CLAIM),
        ("RUNNING", "Running"),
        ("COMPLETED", "Completed"),
    ]


def test_cancelling_a_suspended_run_cancels_its_job_through_the_follower(
    deployed: Stack, on_sim: OnSim, follower: list[uuid.UUID], tiny: tuple[Path, Path]
) -> None:
    flow_run_id = deployed.run_deployment(
        "train/local", target=on_sim.target, training=tiny_training(*tiny, max_steps=100000)
    )
    record = suspended_with_its_job(deployed, flow_run_id)
    pod_id = pod_of(deployed, record.id).pod_id
    metrics = Path(record.remote_dir) / "metrics.jsonl"
    wait_until(lambda: metrics.exists() and '"log"' in metrics.read_text(), 240, "the job to train")
    # as a person cancels it: the suite's one `prefect flow-run cancel` (the other tests ask
    # the server through the client, `Stack.cancel`)
    deployed.server.cli("flow-run", "cancel", str(flow_run_id))
    done = deployed.wait_final(flow_run_id, timeout=120)
    assert done.state.is_cancelled(), done.state
    # no process of the flow run runs its hook: the follower cancels the job and records it
    saved = wait_until(
        lambda: (r := Runs(deployed.runs).load(record.id)).state.ended and r,
        60,
        "the follower to record the job's end",
    )
    assert saved.state == RunState.CANCELLED, saved
    wait_until(lambda: not group_alive(record.job.pid), 30, "the job's process group to go")
    local = Runs(deployed.runs).run_dir(record.id)
    assert (local / "job.log").is_file() and (local / "metrics.jsonl").is_file()
    # what it left retrieved, its pod deleted: nothing bills, no secret stays in the account
    # (pod.json says `deleted` once confirmed; the follower then sweeps the run's other pods
    # and only then forgets its keys: wait for the record to say they are gone too)
    pod = wait_until(
        lambda: (p := pod_of(deployed, record.id)).state == PodState.DELETED and p.forgotten and p,
        60,
        "the follower to delete the pod and forget its keys",
    )
    assert pod.pod_id == pod_id and on_sim.sim.pod(pod_id).deleted and on_sim.sim.pods() == []
    assert on_sim.sim.secret_names() == []
    assert not (local / SSH_DIR / CLIENT_KEY).exists()


@pytest.fixture
def gpu_budget_limits(deployed: Stack) -> Iterator[None]:
    """The GPU budget's limits on the stack's server for the test (removed after it)."""

    async def make(client: Any) -> None:
        await set_budget(2, 5.0)

    async def remove(client: Any) -> None:
        for name in (POD_LIMIT, SPEND_LIMIT):
            await client.delete_global_concurrency_limit_by_name(name)

    deployed.server.call(make)
    try:
        yield
    finally:
        deployed.server.call(remove)


def active_pod_slots(stack: Stack) -> int:
    async def read(client: Any) -> int:
        return int((await client.read_global_concurrency_limit_by_name(POD_LIMIT)).active_slots)

    return int(stack.server.call(read))


def test_a_suspended_run_on_a_simulated_pod_hands_its_budget_and_its_pod_to_the_follower(
    deployed: Stack,
    on_sim: OnSim,
    gpu_budget_limits: None,
    follower: list[uuid.UUID],
    tiny: tuple[Path, Path],
) -> None:
    flow_run_id = deployed.run_deployment(
        "train/local", target=on_sim.target, training=tiny_training(*tiny, max_steps=40)
    )
    record = suspended_with_its_job(deployed, flow_run_id)
    pod_id = pod_of(deployed, record.id).pod_id
    assert on_sim.pods.running(pod_id)
    # its process is gone, the pod's slot of the GPU budget is still held (by the follower)
    assert active_pod_slots(deployed) == 1
    done = deployed.wait_final(flow_run_id, timeout=600)
    assert done.state.is_completed(), done.state
    wait_until(lambda: active_pod_slots(deployed) == 0, 60, "the follower to free the slot")
    saved = Runs(deployed.runs).load(record.id)
    assert saved.state == RunState.SUCCEEDED, saved
    assert_verified(deployed.runs, record.id)
    pod = wait_until(  # its keys are forgotten after the sweep of the run's other pods
        lambda: (p := pod_of(deployed, record.id)).forgotten and p, 60, "the keys to go"
    )
    assert pod.state == PodState.DELETED and pod.deleted_by == "collector", pod
    assert on_sim.sim.pod(pod_id).deleted and on_sim.sim.pods() == []
    assert on_sim.sim.secret_names() == []


def test_a_fine_tune_deployment_waits_suspended_while_it_trains_and_goes_on_on_its_one_pod(
    deployed: Stack, on_sim: OnSim, follower: list[uuid.UUID], tiny: tuple[Path, Path]
) -> None:
    spec = {
        "target": on_sim.target,
        "training": tiny_training(*tiny, max_steps=40, holdout=8),
        "export": {"quant": "q8_0"},
        "compare": {"questions": ["Hello?"], "max_tokens": 4},
        "evaluation": {
            "items": [
                {
                    "messages": [{"role": "user", "content": "Say the secret word."}],
                    "expected": "^ZZZ never said$",
                    "scorer": "regex",
                }
            ],
            "max_tokens": 8,
            "quant": "q8_0",
        },
    }
    flow_run_id = deployed.run_deployment("fine-tune/nightly", spec=spec)
    record = suspended_with_its_job(deployed, flow_run_id)  # no process while it trains
    done = deployed.wait_final(flow_run_id, timeout=900)
    assert done.state.is_completed(), done.state
    runs = Runs(deployed.runs)
    assert runs.load(record.id).state == RunState.SUCCEEDED
    assert_verified(deployed.runs, record.id)
    # one pod for the training, the exports, the compare and the evaluation: made for the
    # run, kept between its jobs while the flow run waited, deleted after the last job
    (made,) = on_sim.sim.pods(include_deleted=True)
    assert made.id == pod_of(deployed, record.id).pod_id
    assert made.deleted and on_sim.sim.pods() == [] and on_sim.sim.secret_names() == []
    for kind in ("export", "compare"):
        children = runs.children(record.id, kind).list()
        assert [c.state for c in children] == [RunState.SUCCEEDED], (kind, children)
    (evaluated,) = runs.children(record.id, "evaluation").root.iterdir()
    assert (evaluated / SCORED_FILE).is_file()
    log = logs_of(deployed, flow_run_id)
    assert "waits suspended" in log and "reused, not trained again" in log, log[-3000:]
