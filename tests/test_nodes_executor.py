"""One job across nodes (`executors.nodes`), its nodes two local executors
with work directories of their own: every node gets the rendezvous in its
job's environment, and no node trains alone (a node that fails or is lost
cancels every node still running, and the job's status is that node's, read
after read); every node's files are listed, retrieved and verified under
its rank, in a local runs directory or by the nodes themselves into an
object store (moto's S3 server). Real jobs, this machine's processes; no
sshd needed."""

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
    JobSpec,
    JobStatus,
)
from overbrainer_prefect.executors.local import LocalExecutor
from overbrainer_prefect.executors.manifest import verify
from overbrainer_prefect.executors.nodes import NodesExecutor
from overbrainer_prefect.runs.store import Runs
from overbrainer_prefect.steps.direct import put_files
from tests import procs
from tests.s3server import S3Server
from tests.shelljobs import wait_for

WAITS = "i=0; while [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done"
"""A node's job that runs for 30 s at most, unless it is ended."""


def nodes(tmp_path: Path) -> NodesExecutor:
    executors = [LocalExecutor(tmp_path / f"node{rank}", name=f"node{rank}") for rank in (0, 1)]
    return NodesExecutor(executors, "127.0.0.1", sys.executable)


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
    executor = nodes(tmp_path)

    async def go() -> list[JobStatus]:
        first = await executor.spawn(job(executor, WAITS))
        pid = executor.jobs[1].pid
        await wait_for(lambda: procs.leads_group(pid), 10, "node 1's job in its own group")
        os.killpg(pid, signal.SIGKILL)  # node 1 is lost
        await wait_for(lambda: not procs.alive(pid), 10, "node 1 gone")
        return [await executor.status(first) for _ in range(3)]

    assert asyncio.run(go()) == [JobStatus.lost()] * 3
    assert (Path(executor.jobs[0].dir) / CANCEL_FILE).exists()


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
