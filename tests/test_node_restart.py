"""What a training across nodes on a pool does once a node was lost, from
its records alone (no machine is reached): the pool says why it was lost
(`pool.json`; a Runpod cluster in its `pod.json`), the training goes on
from its last complete checkpoint, or from step 0 when none was kept, or,
past max_restarts, fails with one line naming the command that goes on;
each node's part of the checkpoint is staged for the node of its rank. The
run itself, on three real sshd, is in tests/test_ssh_pool.py."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from pathlib import Path

import pytest

from overbrainer_prefect.blocks import RunpodCredentials, RunpodTarget
from overbrainer_prefect.executors.base import FileDigest
from overbrainer_prefect.executors.local import LocalExecutor
from overbrainer_prefect.kinds.base import Finished
from overbrainer_prefect.kinds.training import (
    FROM_STEP_0,
    go_on_after_lost_machines,
    lost_point,
    resume_path,
    stage_checkpoint,
)
from overbrainer_prefect.runpod.pod import ClusterNode, PodRecord
from overbrainer_prefect.runs.checkpoints import (
    KeptCheckpoint,
    KeptCheckpoints,
    KeptFile,
    in_checkpoint,
    save_kept,
    sorted_against,
)
from overbrainer_prefect.runs.metrics import MetricsSummary
from overbrainer_prefect.runs.store import ResumedFrom, RunRecord, Runs, RunState
from overbrainer_prefect.steps import end as end_step
from overbrainer_prefect.steps import start as start_step
from overbrainer_prefect.steps.context import Outcome
from overbrainer_prefect.targets.host import Bounds
from overbrainer_prefect.targets.pool import PoolHost, PoolPlacement, PoolTarget
from overbrainer_prefect.trainers.spec import TrainingSpec

LOG = logging.getLogger("restart")
SPEC = TrainingSpec(datasets=["data/train.jsonl"], nodes=2)
LOST = "node 1 (ssh target 'p:box1'): it does not answer (refused); it was machine box1"


def pool(tmp_path: Path, max_restarts: int) -> PoolTarget:
    hosts = [
        PoolHost(f"box{i}", f"u@127.0.0.1:{2200 + i}", str(tmp_path / f"w{i}"), LocalExecutor)
        for i in range(3)
    ]
    return PoolTarget(
        "p",
        hosts,
        Bounds(python="/v/bin/python"),
        wait_s=0,
        secrets=dict,
        cpu_threads=None,
        log=LOG,
        max_restarts=max_restarts,
    )


def failed_run(runs: Runs, nodes: list[str], lost: str | None) -> RunRecord:
    """A training across `nodes` whose job ended failed, `lost` in its pool.json."""
    record = start_step.create(
        runs, target="p", target_kind="pool", workdir="/w", spec=SPEC.model_dump(mode="json")
    )
    PoolPlacement(
        run_id=record.id,
        host=(nodes or ["box0"])[0],
        address="u@127.0.0.1:2200",
        remote_dir=f"/w/{record.id}",
        claimed="2026-12-05T00:00:00Z",
        nodes=nodes,
        lost=lost,
    ).save(runs)
    ended = end_step.fail(runs, record.id, "its job was lost")
    assert ended is not None and ended.state == RunState.FAILED
    return ended


def finished(record: RunRecord) -> Finished:
    return Finished(Outcome(record, MetricsSummary(), retrieved=False), "2 nodes")


def keep_checkpoint(runs: Runs, record: RunRecord, step: int) -> KeptCheckpoint:
    """A checkpoint of every node kept in the store: rank 0's part and node 1's."""
    path = f"output/checkpoint-{step}"
    files = []
    for name, data in ((f"{path}/rank-0.pt", b"shard 0"), (f"nodes/1/{path}/rank-1.pt", b"s1")):
        runs.write_bytes(record.id, name, data)
        files.append(KeptFile(path=name, size=len(data), sha256=hashlib.sha256(data).hexdigest()))
    point = KeptCheckpoint(step=step, path=path, kept="2026-12-05T00:00:00Z", files=files)
    save_kept(runs, record.id, KeptCheckpoints(checkpoints=[point]))
    return point


def test_the_pool_says_a_training_across_nodes_was_lost_only_from_its_record(
    tmp_path: Path,
) -> None:
    runs = Runs(tmp_path / "runs")
    target = pool(tmp_path, 2)
    assert target.max_restarts == 2
    lost = failed_run(runs, ["box0", "box1"], LOST)
    assert target.lost_machine(runs, lost) == f"a node of the training was lost ({LOST})"
    assert target.lost_machine(runs, failed_run(runs, ["box0", "box1"], None)) is None
    assert target.lost_machine(runs, failed_run(runs, [], LOST)) is None  # one machine


def test_a_lost_training_without_a_kept_checkpoint_goes_on_from_step_0(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    runs = Runs(tmp_path / "runs")
    target = pool(tmp_path, 1)
    lost = failed_run(runs, ["box0", "box1"], LOST)
    asked: list[tuple[ResumedFrom | None, int]] = []

    async def again(spec: TrainingSpec, point: ResumedFrom | None, n: int, usd: float) -> Finished:
        asked.append((point, n))
        assert spec.nodes == 2
        return finished(failed_run(runs, ["box0", "box2"], LOST))  # lost again

    with caplog.at_level(logging.WARNING, logger="restart"):
        ended, runs_lost = asyncio.run(
            go_on_after_lost_machines(runs, target, finished(lost), LOG, again)
        )
    assert asked == [(None, 1)]  # once: max_restarts 1
    assert [r.point for r in runs_lost] == [None, None]
    said = [r.getMessage() for r in caplog.records]
    assert f"goes on from {FROM_STEP_0} in a new run on new machines (restart 1 of 1)" in said[0]
    assert runs.load(lost.id).message.endswith(
        f"it went on from {FROM_STEP_0} in a new run on new machines"
    )
    last = runs.load(ended.outcome.record.id).message
    assert "\n" not in last and "no checkpoint of it was kept" in last
    assert last.endswith("start it again from step 0 with the train flow")


def test_past_max_restarts_a_lost_training_fails_naming_how_to_go_on_from_its_checkpoint(
    tmp_path: Path,
) -> None:
    runs = Runs(tmp_path / "runs")
    lost = failed_run(runs, ["box0", "box1"], LOST)
    kept = keep_checkpoint(runs, lost, 6)

    async def again(spec: TrainingSpec, point: ResumedFrom | None, n: int, usd: float) -> Finished:
        raise AssertionError("max_restarts 0: never again")

    ended, runs_lost = asyncio.run(
        go_on_after_lost_machines(runs, pool(tmp_path, 0), finished(lost), LOG, again)
    )
    assert ended.outcome.record.id == lost.id and runs_lost[0].stop == "max_restarts (0) reached"
    message = runs.load(lost.id).message
    assert "\n" not in message
    assert message.endswith(
        f"resume it from {kept.path} with the train flow (resume_from={lost.id})"
    )


def test_every_nodes_part_of_the_checkpoint_is_staged_for_the_node_of_its_rank(
    tmp_path: Path,
) -> None:
    runs = Runs(tmp_path / "runs")
    lost = failed_run(runs, ["box0", "box1"], LOST)
    keep_checkpoint(runs, lost, 6)
    point = lost_point(runs, lost)
    assert point == ResumedFrom(run_id=lost.id, checkpoint="output/checkpoint-6", step=6)
    new = start_step.create(runs, target="p", target_kind="pool", workdir="/w")
    assert stage_checkpoint(runs, point, new) == resume_path(point) == "resume/checkpoint-6"
    local = runs.run_dir(new.id)
    assert (local / "resume" / "checkpoint-6" / "rank-0.pt").read_bytes() == b"shard 0"
    assert (local / "nodes" / "1" / "resume" / "checkpoint-6" / "rank-1.pt").read_bytes() == b"s1"
    assert not (local / "resume" / "checkpoint-6" / "rank-1.pt").exists()


def test_a_kept_checkpoint_across_nodes_found_unchanged_is_not_copied_again() -> None:
    files = [
        KeptFile(path="output/checkpoint-6/rank-0.pt", size=1, sha256="a"),
        KeptFile(path="nodes/1/output/checkpoint-6/rank-1.pt", size=1, sha256="b"),
    ]
    point = KeptCheckpoint(
        step=6, path="output/checkpoint-6", kept="2026-12-05T00:00:00Z", files=files
    )
    kept = KeptCheckpoints(checkpoints=[point])
    manifest = [f.digest() for f in files] + [
        FileDigest(path="output/adapter_model.safetensors", size=1, sha256="c"),
        FileDigest(path="nodes/1/output/checkpoint-60/rank-1.pt", size=1, sha256="d"),
    ]
    assert sorted_against(kept, manifest) == (["output/checkpoint-6"], [], [])
    changed = [*manifest[:1], FileDigest(path=files[1].path, size=1, sha256="e")]
    assert sorted_against(kept, changed) == ([], [], ["output/checkpoint-6"])  # node 1's differs
    assert in_checkpoint("nodes/1/output/checkpoint-6/rank-1.pt", "output/checkpoint-6")
    assert not in_checkpoint("nodes/1/output/checkpoint-60/rank-1.pt", "output/checkpoint-6")


def test_a_cluster_that_lost_a_node_goes_on_from_its_records_alone_within_max_restarts(
    tmp_path: Path,
) -> None:
    """On a Runpod target: a training whose cluster lost a node (both
    witnesses, recorded in pod.json as `node_lost`) is a lost machine only
    once its cluster was deleted; past max_restarts it fails with one line
    naming the command that goes on from its last complete checkpoint."""
    runs = Runs(tmp_path / "runs")
    record = start_step.create(
        runs,
        target="runpod/c",
        target_kind="runpod",
        workdir="/w",
        spec=SPEC.model_dump(mode="json"),
    )
    why = "node 1 of cluster c1 was lost: the follower's SSH lost its job (it does not answer)"
    pod = PodRecord(
        run_id=record.id,
        host_key="k",
        pod_id="p0",
        cluster_id="c1",
        cluster_pods=2,
        nodes=[ClusterNode(pod_id="p0", rank=0), ClusterNode(pod_id="p1", rank=1)],
        node_lost=why,
        lost_step=7,
    )
    pod.save(runs)
    lost = end_step.fail(runs, record.id, "its job was lost")
    assert lost is not None
    block = RunpodTarget(
        credentials=RunpodCredentials(api_key="k"), job_venv="/v", gpu_types=["A"], max_restarts=0
    )
    target = block.target("runpod/c", LOG)
    assert target.lost_machine(runs, lost) is None  # its cluster not deleted: not lost yet
    pod.mark_deleted("client", "a lost node")
    pod.save(runs)
    assert target.lost_machine(runs, lost) == f"{why} at step 7"
    kept = keep_checkpoint(runs, lost, 6)

    async def again(spec: TrainingSpec, point: ResumedFrom | None, n: int, usd: float) -> Finished:
        raise AssertionError("max_restarts 0: never again")

    ended, runs_lost = asyncio.run(
        go_on_after_lost_machines(runs, target, finished(lost), LOG, again)
    )
    assert ended.outcome.record.id == lost.id and runs_lost[0].stop == "max_restarts (0) reached"
    message = runs.load(lost.id).message
    assert "\n" not in message
    assert message.endswith(
        f"resume it from {kept.path} with the train flow (resume_from={lost.id})"
    )
