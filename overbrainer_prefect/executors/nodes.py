"""One job across several machines (a training on N nodes), as one executor:
its files go to every node, its job starts on every node with torchrun's own
rendezvous in its environment, and it is followed as one job whose progress
is rank 0's. Every node's files are retrieved, each node's listed in the
manifest taken on that node: rank 0's where a one-node run keeps them, every
other node's under `nodes/<rank>/`; `nodes.json` names the node of each.

Each node's job gets `PET_NNODES`, `PET_NODE_RANK`, `PET_MASTER_ADDR` and
`PET_MASTER_PORT` (torchrun reads its `--nnodes`, `--node-rank`,
`--master-addr` and `--master-port` from them): the first node's address
and a port free on it at the start, node ranks 0..N-1. No node trains alone:
when a node's job ends badly or is lost while rank 0 runs, every node's job
is cancelled, and the job's status is that node's (its exit code, or lost);
once rank 0 ended, any node still running is cancelled. A node is lost when
its job is gone without an exit code, or when its machine does not answer
NODE_GONE_LOOKS looks in a row while rank 0's does (at once when rank 0's
job already failed or was lost): the job's status is then `lost`, said first to
`lost` (the node's rank and why), every node's job still running is
cancelled, and what a lost job left running on a machine that answers (a
torchrun worker, in a session of its own) is killed there, so that the run
that goes on can have that machine.

Files uploaded under `nodes/<rank>/` of the run's local directory (a node's
part of the checkpoint a run resumes from) go to that node only, into its
run directory; everything else goes to every node.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path

from overbrainer_prefect.executors.base import (
    MAX_TAIL_READ,
    CommandResult,
    ExecError,
    Executor,
    FileDigest,
    JobId,
    JobSpec,
    JobStatus,
)

NODES_DIR = "nodes"
"""In a run's local directory, `nodes/<rank>/`: the files of every node but rank 0."""
NODES_MANIFEST = "nodes.json"
"""Beside a run's manifest: every retrieved file with the node (rank, machine) it came from."""
RANK_ENV = "PET_NODE_RANK"
"""A node's rank (0..N-1) in its job's environment, as torchrun reads it."""
NODE_GONE_LOOKS = 3
"""Looks in a row a node's machine does not answer, rank 0's does, before the node is lost."""
FREE_PORT = "import socket; s = socket.socket(); s.bind(('', 0)); print(s.getsockname()[1])"
"""Printed by the first node's Python: a port free there for the rendezvous."""


class NodesExecutor:
    """A job on `nodes` (rank 0 first), the first reached by the others at
    `master_addr`; `python` is the job venv's Python (the same path on each).
    `jobs` are the nodes' jobs of a job started before (from its record);
    `spawned` is told the nodes' jobs once all started, before the job's
    record is saved (so another process finds every node's job again);
    `lost` is told the rank of a node lost and why, before the other nodes'
    jobs are cancelled (an error it raises is ignored: the job is lost all
    the same). Every method raises ExecError (TargetUnreachable when a node
    cannot be reached), naming the node."""

    def __init__(
        self,
        nodes: Sequence[Executor],
        master_addr: str,
        python: str,
        *,
        jobs: Sequence[JobId] = (),
        spawned: Callable[[list[JobId]], None] | None = None,
        lost: Callable[[int, str], None] | None = None,
    ) -> None:
        if not nodes:
            raise ExecError("connect", "a job across nodes needs at least one node")
        self.nodes = list(nodes)
        self.master_addr = master_addr
        self.python = python
        self.jobs = list(jobs)
        self._spawned = spawned
        self._lost = lost
        self._silent = [0] * len(self.nodes)
        """Looks in a row each node's machine did not answer."""
        self._ended: JobStatus | None = None
        """The job's status once a node was lost: said again without asking."""

    @property
    def workdir(self) -> str:
        """Rank 0's work directory."""
        return self.nodes[0].workdir

    @property
    def description(self) -> str:
        """`N nodes: <rank 0's>, <rank 1's>...`."""
        return f"{len(self.nodes)} nodes: " + ", ".join(n.description for n in self.nodes)

    def on(self, rank: int, path: str) -> str:
        """`path` (under rank 0's work directory) on the node `rank`."""
        base = self.workdir.rstrip("/")
        if rank == 0 or not (path == base or path.startswith(base + "/")):
            return path
        return self.nodes[rank].workdir.rstrip("/") + path[len(base) :]

    async def run(
        self, argv: Sequence[str], timeout: float = 60.0, stdin: bytes | None = None
    ) -> CommandResult:
        """Runs a command on rank 0's node."""
        return await self.nodes[0].run(argv, timeout, stdin)

    async def upload(self, local: Path, remote: str, skip: Sequence[str] = ()) -> None:
        """Copies the run directory to every node, at once, less `nodes/`;
        then `nodes/<rank>/` (when there is one) into the run directory of
        the node `rank` alone."""

        async def one(rank: int, node: Executor) -> None:
            await node.upload(local, self.on(rank, remote), [*skip, NODES_DIR])
            own = local / NODES_DIR / str(rank)
            if rank and own.is_dir():
                await node.upload(own, self.on(rank, remote), skip)

        await asyncio.gather(*(one(k, node) for k, node in enumerate(self.nodes)))

    async def spawn(self, job: JobSpec) -> JobId:
        """Starts the job on every node with the rendezvous in its environment
        (see the module) and returns rank 0's job. A node whose job cannot
        start has every node's job started so far cancelled (ExecError)."""
        port = await self._free_port()
        started: list[JobId] = []
        try:
            for rank, node in enumerate(self.nodes):
                env = {
                    **job.env,
                    "PET_NNODES": str(len(self.nodes)),
                    RANK_ENV: str(rank),
                    "PET_MASTER_ADDR": self.master_addr,
                    "PET_MASTER_PORT": str(port),
                }
                run_dir = self.on(rank, job.run_dir)
                started.append(await node.spawn(dataclasses.replace(job, run_dir=run_dir, env=env)))
        except BaseException:
            await asyncio.shield(self._cancel_all(started))
            raise
        self.jobs = started
        if self._spawned is not None:
            try:
                self._spawned(started)
            except BaseException:
                await asyncio.shield(self._cancel_all(started))
                raise
        return started[0]

    async def _free_port(self) -> int:
        result = await self.nodes[0].run([self.python, "-c", FREE_PORT], timeout=60)
        text = result.stdout.strip()
        if result.code != 0 or not text.isdigit():
            raise ExecError(
                "spawn",
                f"no port for the rendezvous on {self.nodes[0].description}: exit {result.code}",
            )
        return int(text)

    async def status(self, job: JobId) -> JobStatus:
        """The job's status across its nodes (see the module): running while
        every node runs (a node other than rank 0 that ended well waits for
        rank 0); `lost` once a node is lost, every node still running
        cancelled; else that of the node that ended it (its exit code),
        every node still running cancelled. Read again, it says the same: the
        node that ended it keeps its status. Raises TargetUnreachable when
        rank 0's machine does not answer, or another's does not yet count as
        lost."""
        if self._ended is not None:
            return self._ended
        if len(self.jobs) != len(self.nodes):
            return await self.nodes[0].status(job)
        looks = await asyncio.gather(
            *(node.status(each) for node, each in zip(self.nodes, self.jobs, strict=True)),
            return_exceptions=True,
        )
        for look in looks:
            if isinstance(look, BaseException) and not isinstance(look, ExecError):
                raise look
        first = looks[0]
        if isinstance(first, BaseException):
            raise first
        silent: dict[int, ExecError] = {}
        for rank, look in enumerate(looks):
            self._silent[rank] = self._silent[rank] + 1 if isinstance(look, ExecError) else 0
            if isinstance(look, ExecError):
                silent[rank] = look
        found = {rank: look for rank, look in enumerate(looks) if isinstance(look, JobStatus)}
        # rank 0 failed or lost (not cancelled: a cancel is no loss): a silent node is lost now
        ended_badly = first.kind == "lost" or (first.kind == "exited" and first.code != 0)
        gone = [
            (rank, f"it does not answer ({error})")
            for rank, error in silent.items()
            if ended_badly or self._silent[rank] >= NODE_GONE_LOOKS
        ] + [
            (rank, "its job is gone without an exit code")
            for rank, look in found.items()
            if look.kind == "lost"
        ]
        if gone and first != JobStatus.exited(0):
            return await self._lose(*min(gone), found)
        if silent and first.kind == "running":
            raise next(iter(silent.values()))  # not lost yet: looked at again
        others = [found[rank] for rank in sorted(found) if rank]
        failed = next((s for s in others if _failed(s)), None)
        cancelled = any(s.kind == "cancelled" for s in others)
        if first.kind == "running" and failed is None and not cancelled:
            return first
        running = [rank for rank, s in found.items() if s.kind == "running"]
        if running:
            await self._cancel_all([self.jobs[rank] for rank in running], running)
        if failed is not None and first.kind in ("running", "cancelled", "lost"):
            return failed
        return JobStatus.cancelled() if first.kind == "running" else first

    async def _lose(self, rank: int, why: str, found: dict[int, JobStatus]) -> JobStatus:
        """The job lost with its node `rank` (`why`): said to `lost` first,
        then every node's job still running cancelled, and what a lost node's
        job left running on a machine that answers (a torchrun worker in a
        session of its own, holding the machine the run goes on with) ended;
        `lost` from now on."""
        self._ended = JobStatus.lost()
        if self._lost is not None:
            with contextlib.suppress(Exception):  # lost all the same; its target says less of it
                self._lost(rank, f"node {rank} ({self.nodes[rank].description}): {why}")
        gone = [k for k, s in found.items() if s.kind == "lost"]
        ended = await asyncio.gather(
            *(self.nodes[k].cancel(self.jobs[k]) for k in gone), return_exceptions=True
        )
        for error in ended:  # not ended: its machine's own claim says so to the next run
            if isinstance(error, BaseException) and not isinstance(error, ExecError):
                raise error
        running = [k for k, s in found.items() if s.kind == "running" and k != rank]
        if running:
            await self._cancel_all([self.jobs[k] for k in running], running)
        return self._ended

    async def wait_exit(self, job: JobId, seconds: float) -> None:
        """Waits `seconds`: a look at the job costs a command on the host, made
        once a poll. Raises nothing."""
        await asyncio.sleep(seconds)

    async def cancel(self, job: JobId) -> None:
        """Cancels the job on every node."""
        await self._cancel_all(self.jobs or [job])

    async def _cancel_all(self, jobs: Sequence[JobId], ranks: Sequence[int] = ()) -> None:
        """Cancels `jobs`, those of the nodes `ranks` (by default 0, 1...)."""
        nodes = [self.nodes[rank] for rank in ranks] if ranks else self.nodes
        errors = await asyncio.gather(
            *(node.cancel(each) for node, each in zip(nodes, jobs, strict=False)),
            return_exceptions=True,
        )
        for error in errors:
            if isinstance(error, BaseException):
                raise error

    async def read_from(self, path: str, offset: int, limit: int = MAX_TAIL_READ) -> bytes:
        """Reads rank 0's file (its metrics are the run's)."""
        return await self.nodes[0].read_from(path, offset, limit)

    async def manifest(
        self, remote: str, entries: Sequence[str], exclude: Sequence[str] = ()
    ) -> list[FileDigest]:
        """Every node's manifest, each taken on its node: rank 0's files as
        its paths say (its adapter, metrics and logs are the run's), every
        other node's under `nodes/<rank>/` (its shards of a checkpoint, its
        log)."""
        found = await asyncio.gather(
            *(
                node.manifest(self.on(k, remote), entries, node_exclude(exclude, k))
                for k, node in enumerate(self.nodes)
            )
        )
        return [
            dataclasses.replace(f, path=node_dir(k) + f.path)
            for k, files in enumerate(found)
            for f in files
        ]

    async def download(
        self, remote: str, local: Path, entries: Sequence[str], exclude: Sequence[str] = ()
    ) -> None:
        """Copies every node's files, at once: rank 0's into `local`, every
        other node's into `local/nodes/<rank>/` (`manifest`'s paths)."""
        await asyncio.gather(
            *(
                node.download(
                    self.on(k, remote),
                    local / node_dir(k) if k else local,
                    entries,
                    node_exclude(exclude, k),
                )
                for k, node in enumerate(self.nodes)
            )
        )

    def node_files(self, manifest: Sequence[FileDigest]) -> bytes:
        """`nodes.json` of a run retrieved with `manifest`: every node (its
        rank, its machine, where its files are) and every file with the rank
        and machine it came from."""
        ranks = [node_rank(f.path) for f in manifest]
        document = {
            "nodes": [
                {"rank": k, "node": node.description, "dir": node_dir(k).rstrip("/") or "."}
                for k, node in enumerate(self.nodes)
            ],
            "files": [
                {
                    "path": f.path,
                    "rank": rank,
                    "node": self.nodes[rank].description,
                    "size": f.size,
                    "sha256": f.sha256,
                }
                for f, rank in zip(manifest, ranks, strict=True)
            ],
        }
        return (json.dumps(document, indent=2) + "\n").encode()

    async def touch(self, path: str) -> None:
        """Creates the marker `path` on every node (a stop reaches every rank)."""
        await asyncio.gather(*(n.touch(self.on(k, path)) for k, n in enumerate(self.nodes)))

    async def close(self) -> None:
        """Closes every node's connection."""
        for node in self.nodes:
            await node.close()


def node_dir(rank: int) -> str:
    """Where the files of the node `rank` are in the run's local directory:
    the directory itself for rank 0, `nodes/<rank>/` for the others."""
    return f"{NODES_DIR}/{rank}/" if rank else ""


def node_rank(path: str) -> int:
    """The rank of the node a retrieved file's `path` came from (see `node_dir`)."""
    parts = path.split("/")
    if len(parts) > 2 and parts[0] == NODES_DIR and parts[1].isdigit():
        return int(parts[1])
    return 0


def node_exclude(exclude: Sequence[str], rank: int) -> list[str]:
    """The patterns of `exclude` as the node `rank` sees its own paths: for
    rank 0 all of them; for another, those of no node's directory as they
    are, those of its own with `nodes/<rank>/` taken off."""
    if not rank:
        return [p for p in exclude if not p.startswith(f"{NODES_DIR}/")]
    own = node_dir(rank)
    return [
        p[len(own) :] if p.startswith(own) else p
        for p in exclude
        if p.startswith(own) or not p.startswith(f"{NODES_DIR}/")
    ]


def _failed(status: JobStatus) -> bool:
    """Whether a node's job was lost or failed: it ends the job on every node."""
    return status.kind == "lost" or (status.kind == "exited" and status.code != 0)
