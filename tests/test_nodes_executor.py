"""One job across nodes (`executors.nodes`), its nodes two local executors
with work directories of their own: every node gets the rendezvous in its
job's environment, and no node trains alone (a node that fails or is lost,
its job gone or its machine silent a few looks in a row, cancels every node
still running, and the job's status is that node's, read after read); every
node's files are listed, retrieved and verified under its rank, in a local
runs directory or by the nodes themselves into an object store (moto's S3
server); a node's own files are uploaded to it alone; a checkpoint is kept
only with every node's part. Real jobs, this machine's processes; no sshd
needed."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import pytest

from overbrainer_prefect.executors.base import (
    CANCEL_FILE,
    ExecError,
    FileDigest,
    JobId,
    JobSpec,
    JobStatus,
    TargetUnreachable,
)
from overbrainer_prefect.executors.local import LocalExecutor
from overbrainer_prefect.executors.manifest import verify
from overbrainer_prefect.executors.nodes import NODE_GONE_LOOKS, NodesExecutor
from overbrainer_prefect.runs.checkpoints import KeptCheckpoint, last_kept
from overbrainer_prefect.runs.store import Runs
from overbrainer_prefect.steps.checkpoints import COMPLETE_MARK, keep
from overbrainer_prefect.steps.direct import put_files
from tests import procs
from tests.s3server import S3Server
from tests.shelljobs import ESCAPED, wait_for

WAITS = "i=0; while [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done"
"""A node's job that runs for 30 s at most, unless it is ended."""


class Machine(LocalExecutor):
    """A node on this machine that can stop answering (`silent`), as a
    machine gone from the network does."""

    silent = False

    async def status(self, job: JobId) -> JobStatus:
        """Its job's status; TargetUnreachable while it is silent."""
        if self.silent:
            raise TargetUnreachable("status", f"{self.description} does not answer")
        return await super().status(job)


def nodes(tmp_path: Path, told: list[tuple[int, str]] | None = None) -> NodesExecutor:
    executors = [Machine(tmp_path / f"node{rank}", name=f"node{rank}") for rank in (0, 1)]
    lost = (lambda rank, why: told.append((rank, why))) if told is not None else None
    return NodesExecutor(executors, "127.0.0.1", sys.executable, lost=lost)


def job(executor: NodesExecutor, script: str) -> JobSpec:
    """A job running `script`, its rank's own part picked by `PET_NODE_RANK`."""
    run_dir = os.path.join(executor.workdir, "20260101-000000-abcd")
    return JobSpec(run_id="20260101-000000-abcd", run_dir=run_dir, commands=[["sh", "-c", script]])


def test_every_node_gets_the_rendezvous_and_its_own_rank(tmp_path: Path) -> None:
    executor = nodes(tmp_path)
    script = (
        'printf \'{"nodes": "%s", "rank": "%s", "addr": "%s", "port": "%s"}\' '
        '"$PET_NNODES" "$PET_NODE_RANK" "$PET_MASTER_ADDR" "$PET_MASTER_PORT" > env.json'
    )

    async def go() -> JobStatus:
        first = await executor.spawn(job(executor, script))
        await wait_for(lambda: all(any((tmp_path / f"node{r}").rglob("job.exit")) for r in (0, 1)))
        return await executor.status(first)

    assert asyncio.run(go()) == JobStatus.exited(0)
    told = [json.loads(next((tmp_path / f"node{r}").rglob("env.json")).read_text()) for r in (0, 1)]
    assert [t["rank"] for t in told] == ["0", "1"]
    assert {t["nodes"] for t in told} == {"2"} and {t["addr"] for t in told} == {"127.0.0.1"}
    assert told[0]["port"] == told[1]["port"] and int(told[0]["port"]) > 0
    assert len(executor.jobs) == 2 and executor.jobs[1].dir.startswith(str(tmp_path / "node1"))


def test_a_node_that_fails_cancels_every_node_still_running_and_its_code_is_the_jobs(
    tmp_path: Path,
) -> None:
    executor = nodes(tmp_path)
    script = f'if [ "$PET_NODE_RANK" = 1 ]; then sleep 0.5; exit 3; fi; {WAITS}'

    async def go() -> list[JobStatus]:
        first = await executor.spawn(job(executor, script))
        assert await executor.status(first) == JobStatus.running()
        await wait_for(lambda: any((tmp_path / "node1").rglob("job.exit")), 10, "node 1's end")
        return [await executor.status(first) for _ in range(3)]

    assert asyncio.run(go()) == [JobStatus.exited(3)] * 3
    rank0 = Path(executor.jobs[0].dir)
    assert (rank0 / CANCEL_FILE).exists()  # rank 0 did not train alone


def test_a_node_lost_ends_the_job_on_every_node_and_the_job_reads_lost(tmp_path: Path) -> None:
    """Node 1's job group is killed, as the OOM killer or a user would, and
    its escaped child (a torchrun worker's session of its own) runs on: it
    is killed with the loss, so the machine is free for the run that goes on."""
    told: list[tuple[int, str]] = []
    executor = nodes(tmp_path, told)
    script = f'[ "$PET_NODE_RANK" = 0 ] || {{ {ESCAPED}; }}; {WAITS}'

    async def go() -> list[JobStatus]:
        first = await executor.spawn(job(executor, script))
        pid = executor.jobs[1].pid
        escaped = Path(executor.jobs[1].dir) / "escaped.pid"
        wrote = lambda: escaped.exists() and escaped.read_text().strip() != ""  # noqa: E731
        await wait_for(wrote, 10, "node 1's escaped child's PID")
        assert procs.leads_group(pid) and procs.alive(int(escaped.read_text()))
        os.killpg(pid, signal.SIGKILL)  # node 1 is lost; its escaped child runs on
        await wait_for(lambda: not procs.alive(pid), 10, "node 1 gone")
        assert procs.alive(int(escaped.read_text()))
        return [await executor.status(first) for _ in range(3)]

    assert asyncio.run(go()) == [JobStatus.lost()] * 3
    assert (Path(executor.jobs[0].dir) / CANCEL_FILE).exists()
    assert not (Path(executor.jobs[1].dir) / CANCEL_FILE).exists()  # lost, not cancelled
    assert not procs.alive(int((Path(executor.jobs[1].dir) / "escaped.pid").read_text()))
    assert told == [(1, "node 1 (local target 'node1'): its job is gone without an exit code")]


def test_a_node_whose_machine_stops_answering_is_lost_after_a_few_looks_and_ends_every_node(
    tmp_path: Path,
) -> None:
    told: list[tuple[int, str]] = []
    executor = nodes(tmp_path, told)
    machine = executor.nodes[1]
    assert isinstance(machine, Machine)

    async def go() -> list[JobStatus]:
        first = await executor.spawn(job(executor, WAITS))
        machine.silent = True
        for _ in range(NODE_GONE_LOOKS - 1):  # not lost yet: a blip is retried
            with pytest.raises(TargetUnreachable, match="node1. does not answer"):
                await executor.status(first)
        assert told == [] and not (Path(executor.jobs[0].dir) / CANCEL_FILE).exists()
        return [await executor.status(first) for _ in range(2)]

    try:
        assert asyncio.run(go()) == [JobStatus.lost()] * 2
    finally:
        for each in executor.jobs:
            if procs.alive(each.pid):
                os.killpg(each.pid, signal.SIGKILL)
    assert (Path(executor.jobs[0].dir) / CANCEL_FILE).exists()  # rank 0 did not train alone
    ((rank, why),) = told
    assert rank == 1 and why.startswith("node 1 (local target 'node1'): it does not answer (")


def test_a_node_silent_once_rank_0_failed_is_lost_at_once(tmp_path: Path) -> None:
    told: list[tuple[int, str]] = []
    executor = nodes(tmp_path, told)
    machine = executor.nodes[1]
    assert isinstance(machine, Machine)
    script = f'if [ "$PET_NODE_RANK" = 0 ]; then exit 1; fi; {WAITS}'

    async def go() -> JobStatus:
        first = await executor.spawn(job(executor, script))
        await wait_for(lambda: any((tmp_path / "node0").rglob("job.exit")), 10, "rank 0's end")
        machine.silent = True
        return await executor.status(first)

    try:
        assert asyncio.run(go()) == JobStatus.lost()
    finally:
        if procs.alive(executor.jobs[1].pid):
            os.killpg(executor.jobs[1].pid, signal.SIGKILL)
    assert [rank for rank, _ in told] == [1]


def test_a_cancelled_job_whose_node_then_stops_answering_stays_cancelled(tmp_path: Path) -> None:
    told: list[tuple[int, str]] = []
    executor = nodes(tmp_path, told)
    machine = executor.nodes[1]
    assert isinstance(machine, Machine)

    async def go() -> JobStatus:
        first = await executor.spawn(job(executor, WAITS))
        await executor.cancel(first)
        machine.silent = True  # a cancel is no loss
        return await executor.status(first)

    assert asyncio.run(go()) == JobStatus.cancelled() and told == []


def test_a_nodes_own_files_are_uploaded_to_that_node_alone(tmp_path: Path) -> None:
    executor = NodesExecutor(
        [LocalExecutor(tmp_path / f"node{rank}", name=f"node{rank}") for rank in (0, 1)],
        "127.0.0.1",
        sys.executable,
    )
    local = tmp_path / "local"
    (local / "resume" / "checkpoint-3").mkdir(parents=True)
    (local / "resume" / "checkpoint-3" / "rank-0.pt").write_bytes(b"shard 0")
    own = local / "nodes" / "1" / "resume" / "checkpoint-3"
    own.mkdir(parents=True)
    (own / "rank-1.pt").write_bytes(b"shard 1")
    remote = os.path.join(executor.workdir, "run")
    asyncio.run(executor.upload(local, remote))
    node0, node1 = tmp_path / "node0" / "run", tmp_path / "node1" / "run"
    assert (node0 / "resume" / "checkpoint-3" / "rank-0.pt").read_bytes() == b"shard 0"
    assert (node1 / "resume" / "checkpoint-3" / "rank-0.pt").read_bytes() == b"shard 0"
    assert (node1 / "resume" / "checkpoint-3" / "rank-1.pt").read_bytes() == b"shard 1"
    assert not (node0 / "resume" / "checkpoint-3" / "rank-1.pt").exists()
    assert not (node0 / "nodes").exists() and not (node1 / "nodes").exists()


def test_a_checkpoint_is_kept_only_with_every_nodes_part(tmp_path: Path) -> None:
    executor = nodes(tmp_path)
    runs = Runs(tmp_path / "runs")
    record = "20260101-000000-abcd"
    remote = os.path.join(executor.workdir, "run")
    point = Path(remote) / "output" / "checkpoint-3"
    point.mkdir(parents=True)
    (point / "rank-0.pt").write_bytes(b"shard 0")
    (point / COMPLETE_MARK).write_text("{}")

    def keep_it() -> KeptCheckpoint:
        return asyncio.run(
            keep(executor, sys.executable, runs, record, remote, "output/checkpoint-3", 3)
        )

    with pytest.raises(ExecError, match="has no part on node 1: it is not complete"):
        keep_it()
    assert last_kept(runs, record) is None
    shard = tmp_path / "node1" / "run" / "output" / "checkpoint-3"
    shard.mkdir(parents=True)
    (shard / "rank-1.pt").write_bytes(b"shard 1")
    kept = keep_it()
    assert {f.path for f in kept.files} == {
        "output/checkpoint-3/rank-0.pt",
        f"output/checkpoint-3/{COMPLETE_MARK}",
        "nodes/1/output/checkpoint-3/rank-1.pt",
    }
    assert last_kept(runs, record) == kept
    local = runs.run_dir(record)
    assert (local / "nodes" / "1" / "output" / "checkpoint-3" / "rank-1.pt").read_bytes() == (
        b"shard 1"
    )


def test_a_cancel_cancels_every_node(tmp_path: Path) -> None:
    executor = nodes(tmp_path)

    async def go() -> JobStatus:
        first = await executor.spawn(job(executor, WAITS))
        await executor.cancel(first)
        return await executor.status(first)

    assert asyncio.run(go()) == JobStatus.cancelled()
    assert all((Path(each.dir) / CANCEL_FILE).exists() for each in executor.jobs)


def test_a_stop_request_reaches_every_node(tmp_path: Path) -> None:
    executor = nodes(tmp_path)
    run_dir = os.path.join(executor.workdir, "20260101-000000-abcd")
    asyncio.run(executor.touch(os.path.join(run_dir, "stop.request")))
    for rank in (0, 1):
        assert (tmp_path / f"node{rank}" / "20260101-000000-abcd" / "stop.request").exists()


def test_every_nodes_files_are_listed_retrieved_and_verified_under_its_rank(
    tmp_path: Path,
) -> None:
    executor = nodes(tmp_path)
    for rank in (0, 1):  # each node its own part of the checkpoint, rank 0 the adapter
        point = tmp_path / f"node{rank}" / "run" / "output" / "checkpoint-2"
        point.mkdir(parents=True)
        (point / f"rank-{rank}.pt").write_bytes(b"shard %d" % rank)
    (tmp_path / "node0" / "run" / "output" / "adapter.bin").write_bytes(b"adapter")
    remote, local = os.path.join(executor.workdir, "run"), tmp_path / "local"

    async def go() -> list[FileDigest]:
        manifest = await executor.manifest(remote, ["output"])
        await executor.download(remote, local, ["output"])
        return manifest

    manifest = asyncio.run(go())
    paths = [f.path for f in manifest]
    assert paths == [
        "output/adapter.bin",
        "output/checkpoint-2/rank-0.pt",
        "nodes/1/output/checkpoint-2/rank-1.pt",
    ]
    verify(local, ["output"], (), manifest)  # every node's files, each against its node's
    listed = json.loads(executor.node_files(manifest))
    node1 = "local target 'node1'"
    assert [(f["path"], f["rank"], f["node"]) for f in listed["files"]][2] == (paths[2], 1, node1)
    assert listed["nodes"][1] == {"rank": 1, "node": node1, "dir": "nodes/1"}
    (local / paths[2]).write_bytes(b"shard 0")  # node 1's shard not as node 1 has it
    with pytest.raises(ExecError, match="nodes/1/output/checkpoint-2/rank-1.pt.*differs"):
        verify(local, ["output"], (), manifest)
    (local / paths[2]).unlink()
    with pytest.raises(ExecError, match="rank-1.pt.*missing"):
        verify(local, ["output"], (), manifest)


def test_into_an_object_store_every_node_puts_its_own_files_under_its_rank(
    s3: S3Server, tmp_path: Path
) -> None:
    executor = nodes(tmp_path)
    for rank in (0, 1):
        point = tmp_path / f"node{rank}" / "run" / "output" / "checkpoint-2"
        point.mkdir(parents=True)
        (point / f"rank-{rank}.pt").write_bytes(b"shard %d" % rank)
    runs = Runs(s3.bucket_url(bucket=s3.bucket()))
    remote = os.path.join(executor.workdir, "run")

    async def go() -> tuple[list[FileDigest], dict[str, list[str]]]:
        manifest = await executor.manifest(remote, ["output"])
        return manifest, await put_files(executor, sys.executable, runs, "r1", remote, manifest)

    manifest, parts = asyncio.run(go())
    assert set(parts) == {f.path for f in manifest}
    shard = "nodes/1/output/checkpoint-2/rank-1.pt"  # node 1's, under its rank as listed
    assert shard in parts
    held = runs.store.head(runs.key("r1", shard))
    assert held is not None and held.size == len(b"shard 1")
    assert runs.store.head(runs.key("r1", "output/checkpoint-2/rank-1.pt")) is None
