"""A training across nodes on a Runpod target: one instant cluster of the
Runpod simulator, whose pods are real local process trees (the package's
bootstrap and watchdog, a real sshd on 127.0.0.1) on a private network of
their own (loopback addresses of the cluster), the job a plain torch DDP
step (gloo) under torchrun on every pod (tests/ddpjob.py: axolotl does not
run multi-process on the CPU).

What is shown: both pods are real members of one process group, the run's
progress is rank 0's, every node's files are retrieved and verified, the
cluster is deleted as one only after that, and it is priced, capped and
recorded as its two pods; a cluster the simulator cannot place fails in one
line with nothing created; a cluster that loses a pod (Runpod terminates it)
is deleted as one and the training goes on from its last complete
checkpoint on a new cluster."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from prefect import flow, get_run_logger

from overbrainer_prefect.blocks import RunpodTarget
from overbrainer_prefect.driver import run_new
from overbrainer_prefect.kinds.base import Finished, NewJob
from overbrainer_prefect.kinds.training import (
    Again,
    LostRun,
    go_on_after_lost_machines,
    resume_path,
    stage_checkpoint,
)
from overbrainer_prefect.money.ledger import Ask, Entry
from overbrainer_prefect.money.pods import cost_facts
from overbrainer_prefect.money.reconcile import reconcile
from overbrainer_prefect.money.store import Admission, Facts, LedgerFile, update
from overbrainer_prefect.money.view import pod_row
from overbrainer_prefect.runpod.bootstrap import TIMING_ENV
from overbrainer_prefect.runpod.errors import PodError
from overbrainer_prefect.runpod.pod import PodRecord, PodState
from overbrainer_prefect.runs.checkpoints import last_kept
from overbrainer_prefect.runs.store import ResumedFrom, RunRecord, Runs, RunState
from overbrainer_prefect.steps import end as end_step
from overbrainer_prefect.steps import reporters
from overbrainer_prefect.steps.context import Outcome
from overbrainer_prefect.targets.base import JobNeed, Target
from overbrainer_prefect.targets.runpod.ending import VERIFIED_REASON
from overbrainer_prefect.targets.spend import spent
from overbrainer_prefect.trainers.base import TrainError
from overbrainer_prefect.trainers.spec import TrainingSpec
from tests.ddpjob import DdpTrainer
from tests.runpod_fixtures import A4000, FAST, fast, pods_of, sim, target_values
from tests.runpod_sim import RunpodSim
from tests.runpod_sim.api import SimRequest
from tests.runpod_sim.pods import SimPods
from tests.shelljobs import WRITE_METRICS, WRITE_OUTPUT, ShellTrainer, started_job, wait_for

__all__ = ["fast", "pods_of", "sim"]  # the simulator's fixtures (tests/runpod_fixtures.py)

LOG = logging.getLogger("cluster")


def runpod(sim: RunpodSim, **changes: Any) -> Target:
    return RunpodTarget.model_validate(target_values(sim, **changes)).target(
        "runpod-target/cluster", LOG
    )


def nodes_need(nodes: int) -> JobNeed:
    return JobNeed(
        what="the training", training=TrainingSpec(datasets=["data/train.jsonl"], nodes=nodes)
    )


class Recorded:
    """A `Budget` that bounds nothing and records what it was asked to admit and hold."""

    def __init__(self) -> None:
        self.asks: list[Ask] = []
        self.held: list[float] = []

    async def spend_limit_cents(self) -> int | None:
        return None

    @asynccontextmanager
    async def hold(self, price_per_hour: float) -> AsyncIterator[None]:
        self.held.append(price_per_hour)
        yield

    @asynccontextmanager
    async def admit(self, store: Runs, ask: Ask, facts: Facts) -> AsyncIterator[Admission | None]:
        self.asks.append(ask)
        yield None


def test_a_training_across_two_nodes_runs_on_one_instant_cluster_deleted_as_one_once_verified(
    sim: RunpodSim, pods_of: SimPods, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="cluster")
    runs = Runs(tmp_path / "runs")
    trainer = DdpTrainer(steps=600, pause_s=0.1)  # a minute at most, stopped at step 2 or so
    target = runpod(sim, max_cost_usd=2.0)

    async def start() -> RunRecord:
        async with started_job(target, runs, trainer, nodes_need(2)) as (_, _, record):
            return record  # its follower goes: both pods train on

    started = asyncio.run(start())
    primary = PodRecord.load(runs, started.id)
    assert primary is not None and len(primary.node_jobs) == 2
    rank0 = pods_of.workspace_of(primary.nodes[0].pod_id) / "overbrainer" / started.id
    asyncio.run(wait_for(lambda: '"step": 2' in read(rank0 / "metrics.jsonl"), 60, "step 2"))

    async def again() -> Outcome:  # from its records alone, as attach, stop or collect do
        async with target.reach(runs, runs.load(started.id)) as placed:
            assert placed is not None and placed.description.startswith("2 nodes: ")
            ctx = placed.context(runs, reporters.LogReporter())
            await end_step.request_stop(ctx, runs.load(started.id))
            return await placed.follow(ctx, trainer, runs.load(started.id))

    outcome = asyncio.run(again())
    record = outcome.record
    assert record.state == RunState.STOPPED and outcome.retrieved, record
    pod = PodRecord.load(runs, record.id)
    assert pod is not None and pod.cluster_id is not None and pod.cluster_pods == 2
    assert [n.rank for n in pod.nodes] == [0, 1] and pod.pod_id == pod.nodes[0].pod_id
    # one cluster of two pods, nothing else made; deleted as one, by this side, after the
    # run's files were verified (the manifest written first), each pod confirmed gone
    [cluster] = sim.clusters(include_deleted=True)
    assert cluster.id == pod.cluster_id and cluster.pod_ids == [n.pod_id for n in pod.nodes]
    assert sorted(p.id for p in sim.pods(include_deleted=True)) == sorted(cluster.pod_ids)
    assert cluster.deleted_at is not None and all(sim.pod(i).deleted for i in cluster.pod_ids)
    local = runs.run_dir(record.id)
    assert (local / "manifest.json").stat().st_mtime <= cluster.deleted_at
    assert pod.state == PodState.DELETED and pod.gone, pod
    # this side deletes it once the files are verified; a watchdog that reads the
    # `.pod/retrieved` this side wrote just before may delete it first (seen under load):
    # either way for this ending's reason
    assert pod.deleted_by in ("client", "watchdog"), pod
    assert pod.delete_reason == VERIFIED_REASON, pod
    deletes = [r for r in sim.requests if r.method == "DELETE"]
    # (a pod's watchdog that tries too, once its pod is gone, is refused: 401, nothing done)
    assert [(r.path, r.status) for r in deletes if "/clusters/" in r.path and r.status < 300] == [
        (f"/v2/clusters/{cluster.id}", 204)
    ]
    assert not any(r.path.startswith("/v2/pods/") for r in deletes)
    for pod_id in cluster.pod_ids:
        assert not pods_of.running(pod_id)
    # each pod a real member of the gloo group, rendezvous at the primary's private address
    told = []
    for node in pod.nodes:
        run_dir = pods_of.workspace_of(node.pod_id) / "overbrainer" / record.id
        told.append(json.loads((run_dir / f"rank-{node.rank}.json").read_text()))
        assert (told[-1]["rank"], told[-1]["world_size"], told[-1]["node_rank"]) == (
            node.rank,
            2,
            node.rank,
        )
        assert told[-1]["backend"] == "gloo"
        assert node.address == sim.pod(node.pod_id).private_ip
        assert node.address is not None and node.address.startswith("127.77.")
        job = (run_dir / "job.sh").read_text()  # the rendezvous: the primary's private address
        assert f"export PET_MASTER_ADDR={pod.nodes[0].address}" in job
        assert f"export PET_NODE_RANK={node.rank}" in job
        watchdog = (run_dir / ".pod" / "watchdog.log").read_text()
        assert f"cluster: node {node.rank} of 2 at {node.address}" in watchdog
        assert "cost cap armed:" in watchdog and (run_dir / ".pod" / "retrieved").is_file()
    assert told[0]["weights_sha256"] == told[1]["weights_sha256"]  # DDP made them one
    assert pod.nodes[0].address != pod.nodes[1].address
    assert pod.node_jobs and len(pod.node_jobs) == 2
    # the run's progress is rank 0's; a stop checkpoints every node; every node's files
    # retrieved and verified
    steps = [m.step for m in outcome.summary.metrics]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 2
    point = outcome.summary.checkpoint
    assert point == f"output/checkpoint-{len(steps)}"
    paths = {f.path for f in outcome.files}
    assert {"output/adapter_model.safetensors", "nodes/1/job.log"} <= paths
    assert {f"{point}/rank-0.pt", f"nodes/1/{point}/rank-1.pt"} <= paths
    listed = json.loads((local / "nodes.json").read_text())
    assert [n["rank"] for n in listed["nodes"]] == [0, 1]
    for node, shown in zip(pod.nodes, listed["nodes"], strict=True):
        assert node.pod_id in shown["node"]
    # priced, capped and bounded as its two pods: $0.25/h each on an A4000
    assert pod.cost_per_hour == pytest.approx(0.50)
    assert pod.rate is not None and pod.rate > 0.50
    assert pod.estimated_spend() == pytest.approx(sim.spend(), rel=0.2, abs=1e-4)
    said = caplog.text
    assert "an instant cluster of 2 pods of NVIDIA RTX A4000" in said
    assert "$0.50/h in all (2 × $0.25/h)" in said
    cap = pods_of.workspace_of(pod.nodes[1].pod_id) / "overbrainer" / record.id / ".pod" / "cap"
    assert cap.read_text().startswith(f"rate={pod.rate:g} max_cost_usd=2")
    # the spend view: the cluster is one line naming its two pods; its bill is theirs
    entry = Entry(
        id="e1",
        opened=datetime.now(UTC),
        target=target.ref,
        deployment="train",
        what="the training",
        max_usd=2.0,
        run_id=record.id,
        store_dir="",
    )
    spent = cost_facts(runs, entry)
    assert spent is not None and spent.ended
    update(entry, spent)
    row = pod_row(entry)
    assert row.pod_id == f"cluster {cluster.id}: 2 pods ({', '.join(cluster.pod_ids)})"
    billed = {pod_id: sim.spend(pod_id) for pod_id in cluster.pod_ids}
    reconcile([entry], billed)
    assert entry.billed_usd == pytest.approx(sum(billed.values()))


def test_a_cluster_runpod_cannot_place_fails_in_one_line_before_anything_is_created(
    sim: RunpodSim, pods_of: SimPods, tmp_path: Path
) -> None:
    runs = Runs(tmp_path / "runs")
    target = runpod(sim)
    sim.set_capacity(A4000, 1)  # one pod's GPU free: not two
    trainer = DdpTrainer(steps=2)

    async def go() -> None:
        async with started_job(target, runs, trainer, nodes_need(2)):
            raise AssertionError("placed")

    with pytest.raises(PodError) as caught:
        asyncio.run(go())
    message = str(caught.value)
    assert "\n" not in message
    assert "cannot place an instant cluster of 2 pods" in message, message
    assert sim.pods(include_deleted=True) == [] and sim.clusters(include_deleted=True) == []
    [record] = Runs(tmp_path / "runs").list()  # the driver fails it with this line
    pod = PodRecord.load(runs, record.id)
    assert pod is not None and pod.gone and pod.secret_deleted
    assert sim.secret_names() == []
    # the day's and month's budgets admit, and the GPU budget holds, both pods' price
    budget = Recorded()

    async def reserve(nodes: int) -> None:
        async with target.reserve(runs, nodes_need(nodes), budget):
            pass

    asyncio.run(reserve(1))
    asyncio.run(reserve(2))
    one, two = budget.asks
    assert one.most_usd is not None and two.most_usd is not None
    assert two.most_usd == pytest.approx(2 * one.most_usd)
    assert two.least_usd == pytest.approx(2 * one.least_usd)
    assert budget.held == [pytest.approx(0.25), pytest.approx(0.50)]
    assert sim.pods(include_deleted=True) == []
    # more nodes than a self-serve cluster has pods: refused before anything
    with pytest.raises(TrainError, match="a Runpod instant cluster has 2 to 8 pods"):
        target.check(nodes_need(9))
    volume = sim.add_volume(50, "EU-RO-1")  # its pods would share one run directory
    on_volume = runpod(sim, network_volume_id=volume, data_center_ids=["EU-RO-1"])
    with pytest.raises(TrainError, match="mount a network volume"):
        on_volume.check(nodes_need(2))
    on_volume.check(nodes_need(1))


def test_a_watchdog_bound_deletes_the_whole_cluster(
    sim: RunpodSim, pods_of: SimPods, tmp_path: Path
) -> None:
    runs = Runs(tmp_path / "runs")
    trainer = ShellTrainer(f"{WRITE_METRICS}; {WRITE_OUTPUT}")  # ends at once, on each pod
    target = runpod(sim, retrieve_grace_s=2.0)

    async def start() -> RunRecord:
        async with started_job(target, runs, trainer, nodes_need(2)) as (_, _, record):
            return record  # nobody follows it: its files are never retrieved

    record = asyncio.run(start())

    def deletes() -> list[SimRequest]:
        return [r for r in sim.requests if r.method == "DELETE"]

    def deleted() -> bool:  # (the other watchdog's key may be refused: its pod is gone)
        return any(r.status == 204 for r in deletes())

    asyncio.run(wait_for(deleted, 90, "a watchdog to delete the cluster"))
    [cluster] = sim.clusters(include_deleted=True)
    sent = deletes()
    assert not any(r.path.startswith("/v2/pods/") for r in sent), sent
    by = [r for r in sent if r.path == f"/v2/clusters/{cluster.id}" and r.status == 204]
    assert len(by) == 1 and by[0].scope in {f"pod:{i}" for i in cluster.pod_ids}, sent
    deleter = by[0].scope.removeprefix("pod:")
    log = pods_of.watchdog_log(deleter, record.id)
    assert "its files were not retrieved (retrieve_grace)" in log, log
    assert "the whole cluster is deleted" in log, log
    assert all(sim.pod(i).deleted for i in cluster.pod_ids)

    async def look() -> bool:
        async with target.reach(runs, runs.load(record.id)) as placed:
            return placed is None

    assert asyncio.run(look())  # gone, and its record says so
    pod = PodRecord.load(runs, record.id)
    assert pod is not None and pod.gone


def read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def test_a_node_whose_job_fails_ends_the_job_on_every_pod_and_the_cluster_with_it(
    prefect_server: None, sim: RunpodSim, pods_of: SimPods, tmp_path: Path
) -> None:
    """Through the job driver in a flow run, as the train flow runs it: the
    day's and month's ledger admits the cluster, and its entry is one line
    naming its pods once it ended."""
    runs = Runs(tmp_path / "runs")
    # node 1 fails at once; rank 0 would train on alone for a minute
    script = f'if [ "$PET_NODE_RANK" = 1 ]; then exit 3; fi; {WRITE_METRICS}; sleep 60'
    trainer = ShellTrainer(script, required=None)
    target = runpod(sim, max_cost_usd=1.0)

    @flow(name="cluster-training", persist_result=False)
    async def training() -> Outcome:
        job = NewJob(store=runs, need=nodes_need(2), kind="training", prepare=lambda _: trainer)
        return (await run_new(target, job, get_run_logger())).outcome

    outcome = asyncio.run(training())
    assert outcome.record.state == RunState.FAILED, outcome.record
    assert outcome.record.flow_run_id is not None
    pod = PodRecord.load(runs, outcome.record.id)
    assert pod is not None
    rank0 = pods_of.workspace_of(pod.nodes[0].pod_id) / "overbrainer" / outcome.record.id
    assert (rank0 / "job.cancelled").exists()  # rank 0 did not train alone
    [cluster] = sim.clusters(include_deleted=True)
    assert outcome.retrieved and cluster.deleted_at is not None and pod.gone
    [entry] = LedgerFile.of(runs).read().entries
    assert entry.run_id == outcome.record.id and entry.ended
    assert entry.cluster_id == cluster.id and entry.pod_ids == cluster.pod_ids
    assert pod.rate is not None  # admitted at both pods' most: max_hours and the checkpoint hold
    assert entry.max_usd == pytest.approx(pod.rate * (1 + 90 / 3600))
    assert pod_row(entry).pod_id == f"cluster {cluster.id}: 2 pods ({', '.join(cluster.pod_ids)})"


def test_a_cluster_that_loses_a_node_goes_on_from_its_last_complete_checkpoint_on_a_new_one(
    prefect_server: None,
    sim: RunpodSim,
    pods_of: SimPods,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The host of the rank-1 pod of a 2-pod cluster is lost (frozen, its SSH
    refused) once a complete checkpoint (both nodes' parts) is kept, while
    Runpod still shows the pod RUNNING: its follower, whose SSH lost the
    node's job, looks at Runpod's runtime of it again `lost_host_s` later
    and sees it stalled (the second witness), ends the job on every node
    and deletes the whole cluster; within max_restarts the training goes on
    from that checkpoint on a new 2-pod cluster, and succeeds there. What
    billed: the first cluster until about lost_host_s after the node went
    silent, not until its watchdog's retrieve grace."""
    caplog.set_level(logging.WARNING)
    monkeypatch.setenv(TIMING_ENV, f"{FAST},lost_host_s=4")
    runs = Runs(tmp_path / "runs")
    target = runpod(sim, max_cost_usd=2.0, max_restarts=1)
    steps = 24
    terminated: list[str] = []
    spent_before: list[float] = []

    def job(point: ResumedFrom | None, attempt: int = 0, usd: float = 0.0) -> NewJob:
        pause, save = (0.5, 3) if point is None else (0.05, steps)  # lost first: 12 s at most
        trainer = DdpTrainer(steps, pause, save, resume_path(point) if point else None)
        return training_job(runs, trainer, point, attempt, usd)

    async def again(spec: TrainingSpec, point: Any, attempt: int, usd: float) -> Finished:
        assert spec.nodes == 2
        spent_before.append(usd)
        return await run_new(target, job(point, attempt, usd), get_run_logger())

    def kept(record: RunRecord) -> bool:
        return last_kept(runs, record.id) is not None

    def freeze(pod_id: str) -> None:
        pods_of.lose_host(sim.pod(pod_id))

    watcher = terminate_once(sim, runs, 1, kept, terminated, lose=freeze)
    ended, lost = asyncio.run(restarting(runs, target, job(None), again))
    watcher.join(timeout=5)
    assert len(terminated) == 1, "no checkpoint was kept before node 1 could be lost"
    [first_id] = terminated
    [run_lost] = lost
    assert run_lost.record.id == first_id and run_lost.stop is None
    # the loss: both witnesses, the job ended on every node, the whole cluster deleted
    first = PodRecord.load(runs, first_id)
    assert first is not None and first.gone and first.deleted_by == "client", first
    told = first.node_lost or ""
    assert f"node 1 of cluster {first.cluster_id} was lost" in told, told
    assert "the follower's SSH lost its job" in told and "it does not answer" in told, told
    assert f"of its pod {first.nodes[1].pod_id}, Runpod's runtime of it stalled" in told, told
    rank0 = pods_of.workspace_of(first.nodes[0].pod_id) / "overbrainer" / first_id
    assert not pods_of.running(first.nodes[0].pod_id)  # rank 0 did not train alone
    assert (rank0 / "metrics.jsonl").is_file()
    clusters = sim.clusters(include_deleted=True)
    assert len(clusters) == 2 and all(c.deleted_at is not None for c in clusters), clusters
    assert clusters[0].id == first.cluster_id
    # it went on from its last complete checkpoint, said in one line
    kept = last_kept(runs, first_id)
    point = run_lost.point
    assert (
        kept is not None
        and point is not None
        and (point.checkpoint, point.step)
        == (
            kept.path,
            kept.step,
        )
    )
    assert {f.path for f in kept.files} >= {
        f"{kept.path}/rank-0.pt",
        f"{kept.path}/trainer_state.json",
        f"nodes/1/{kept.path}/rank-1.pt",
    }  # complete: every node's part, each verified
    said = [r.getMessage() for r in caplog.records if "goes on from" in r.getMessage()]
    assert len(said) == 1 and "\n" not in said[0], said
    on = f"{kept.path} (step {kept.step}) in a new run on new machines (restart 1 of 1)"
    assert f"goes on from {on}" in said[0] and "node 1 of cluster" in said[0], said
    assert f"it went on from {kept.path}" in (runs.load(first_id).message or "")
    # the new run: a new cluster of two pods, from that checkpoint, every node's files verified
    outcome = ended.outcome
    record = outcome.record
    assert record.state == RunState.SUCCEEDED and outcome.retrieved, record
    assert record.resumed_from == point
    second = PodRecord.load(runs, record.id)
    assert second is not None and second.cluster_id == clusters[1].id and second.gone
    assert len(second.nodes) == 2, second  # its watchdog may act on `.pod/retrieved` first
    assert second.deleted_by in ("client", "watchdog"), second
    assert second.delete_reason == VERIFIED_REASON, second
    for node in second.nodes:
        run_dir = pods_of.workspace_of(node.pod_id) / "overbrainer" / record.id
        own = run_dir / "resume" / f"checkpoint-{point.step}" / f"rank-{node.rank}.pt"
        assert own.is_file()
        state = json.loads((run_dir / f"rank-{node.rank}.json").read_text())
        assert state["resumed_at"] == point.step and state["world_size"] == 2
    assert [m.step for m in outcome.summary.metrics] == list(range(point.step + 1, steps + 1))
    end = f"output/checkpoint-{steps}"
    paths = {f.path for f in outcome.files}
    assert {f"{end}/rank-0.pt", f"nodes/1/{end}/rank-1.pt", "nodes/1/job.log"} <= paths
    # both clusters' cost counted: the second's cap counts the first's, each in the ledger
    assert spent_before == [pytest.approx(spent(runs, run_lost.record) or 0.0)]
    assert spent_before[0] > 0
    entries = LedgerFile.of(runs).read().entries
    assert sorted((e.run_id, e.cluster_id) for e in entries) == sorted(
        [(first_id, clusters[0].id), (record.id, clusters[1].id)]
    )
    assert all(e.ended for e in entries)


def test_a_cluster_whose_primary_is_terminated_is_deleted_and_past_max_restarts_fails(
    prefect_server: None, sim: RunpodSim, pods_of: SimPods, tmp_path: Path
) -> None:
    """Runpod terminates the primary (rank 0) of a 2-pod cluster once the job
    started on both, no checkpoint kept: the follower cannot reach the job and Runpod shows that
    pod gone while node 1 runs on, a lost node: the whole cluster is deleted
    (node 1 with it); with max_restarts 0 the run fails with one line naming
    the command that goes on (from step 0)."""
    runs = Runs(tmp_path / "runs")
    target = runpod(sim, max_restarts=0)
    terminated: list[str] = []

    async def again(spec: TrainingSpec, point: Any, attempt: int, usd: float) -> Finished:
        raise AssertionError("max_restarts 0: never again")

    watcher = terminate_once(sim, runs, 0, lambda _: True, terminated)  # once both started
    job = training_job(runs, DdpTrainer(steps=600, pause_s=0.1), None)
    ended, lost = asyncio.run(restarting(runs, target, job, again))
    watcher.join(timeout=5)
    [run_id] = terminated
    [run_lost] = lost
    record = runs.load(run_id)
    assert ended.outcome.record.id == run_id and record.state == RunState.FAILED, record
    assert run_lost.point is None and run_lost.stop == "max_restarts (0) reached"
    pod = PodRecord.load(runs, run_id)
    assert pod is not None and pod.gone and pod.deleted_by == "client", pod
    told = pod.node_lost or ""
    assert f"node 0 of cluster {pod.cluster_id} was lost" in told, told
    # this side's witness: SSH could not reach the terminated pod, or (when its sshd went
    # first) its job was gone without an exit code; Runpod's is that the pod is gone
    assert "could not reach it" in told or "its job is gone without an exit code" in told, told
    assert f"its pod {pod.nodes[0].pod_id} no longer" in told, told
    [cluster] = sim.clusters(include_deleted=True)
    assert cluster.deleted_at is not None and all(sim.pod(i).deleted for i in cluster.pod_ids)
    assert not pods_of.running(pod.nodes[1].pod_id)  # node 1 did not train on alone
    message = record.message or ""
    assert "\n" not in message and message.startswith(told), message
    assert message.endswith(
        "no checkpoint of it was kept: start it again from step 0 with the train flow"
    ), message


def training_job(
    runs: Runs, trainer: DdpTrainer, point: ResumedFrom | None, attempt: int = 0, usd: float = 0.0
) -> NewJob:
    """A training across two nodes with `trainer`, from the checkpoint of
    `point` (each node's part staged for that node alone) when given."""
    training = TrainingSpec(datasets=["data/train.jsonl"], nodes=2)

    def prepare(record: RunRecord) -> DdpTrainer:
        if point is not None:
            stage_checkpoint(runs, point, record)
            record.resumed_from = point
            runs.save(record)
        return trainer

    need = JobNeed(what="the training", training=training, spent_usd=usd)
    spec = training.model_dump(mode="json")
    return NewJob(
        store=runs, need=need, kind="training", prepare=prepare, spec=spec, attempt=attempt
    )


async def restarting(
    runs: Runs, target: Target, first: NewJob, again: Again
) -> tuple[Finished, list[LostRun]]:
    """`first` run through the job driver in a flow run, then gone on with
    `again` after each lost machine, as the train flow does."""

    @flow(name="cluster-training-restart", persist_result=False)
    async def training() -> tuple[Finished, list[LostRun]]:
        logger = get_run_logger()
        finished = await run_new(target, first, logger)
        return await go_on_after_lost_machines(runs, target, finished, logger, again)

    return await training()


def terminate_once(
    sim: RunpodSim,
    runs: Runs,
    rank: int,
    ready: Callable[[RunRecord], bool],
    done: list[str],
    lose: Callable[[str], None] | None = None,
) -> threading.Thread:
    """A thread that terminates the pod of node `rank` of the first run whose
    every node's job started and which is `ready`, as Runpod does on its own
    (nobody asked), or loses it otherwise (`lose`, given the pod's id),
    noting the run in `done`."""

    def watch() -> None:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not done:
            for record in runs.list(skipped=lambda _name, _error: None):
                pod = PodRecord.load(runs, record.id)
                if pod is not None and len(pod.node_jobs) == 2 and ready(record):
                    (lose or sim.terminate)(pod.nodes[rank].pod_id)
                    done.append(record.id)
                    break
            time.sleep(0.2)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread
