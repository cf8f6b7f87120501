"""Checkpoints kept in the run's store as the job saves them, so that a run
whose machine is lost can go on from its last one elsewhere.

While a training job runs, its follower looks for a new complete checkpoint
(`checkpoint-N/` with its `trainer_state.json`, which the trainer writes
last) each time the job makes a step, and at least every RESCAN_S or RESCAN_POLLS
polls (a checkpoint saved for a stop, at a pod's checkpoint hold). The newest one not
kept yet goes to the run's store where the final retrieval would put it
(`output/checkpoint-N/`): downloaded and hashed here into a local runs
directory, put by the target itself into an object store (`direct.put_files`).
It counts as kept once every file's SHA-256 is verified against the
target's own (across nodes: every node's part, rank 0's under its path and
each other node's under `nodes/<rank>/`; one missing a node's part is not
complete: under axolotl every process writes at least its
`rng_state_<rank>.pth` there, and its shards under DeepSpeed ZeRO), and is
then added to the run's `checkpoints.json`. On a pod
whose run directory is on a network volume that keeps the checkpoints
(`RunContext.checkpoints_volume`), nothing moves: the pod hashes it where
the job wrote it, and that is what is recorded. One keep at
a time runs beside the follow loop; a failure is a warning, tried again at the
next checkpoint, and never fails the run.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from pathlib import PurePosixPath
from typing import Protocol, runtime_checkable

from overbrainer_prefect.executors.base import ExecError, Executor
from overbrainer_prefect.executors.manifest import verify
from overbrainer_prefect.executors.nodes import NodesExecutor, node_rank
from overbrainer_prefect.runs.checkpoints import (
    KeptCheckpoint,
    KeptFile,
    load_kept,
    save_kept,
)
from overbrainer_prefect.runs.store import RunRecord, Runs, subject
from overbrainer_prefect.steps.context import RunContext
from overbrainer_prefect.steps.direct import put_files
from overbrainer_prefect.store.records import RecordError
from overbrainer_prefect.timestamps import rfc3339

log = logging.getLogger(__name__)

FINISH_BOUND_S = 120.0
"""How long the end of a follow waits for the checkpoint being kept."""

COMPLETE_MARK = "trainer_state.json"
"""Written last into a checkpoint directory: its presence makes it complete."""

RESCAN_S = 30.0
"""Seconds after which the target is looked at again for a new checkpoint
even when the job made no step (a checkpoint saved for a stop, or still
being written at the last look)."""
RESCAN_POLLS = 6  # ... or after this many polls of the job, when that is sooner

LIST_TIMEOUT_S = 60.0

_CHECKPOINT = re.compile(r"checkpoint-(\d+)")

_LIST = (
    'cd "$1" 2>/dev/null || exit 0; '
    f'for mark in "$2"/checkpoint-*/{COMPLETE_MARK}; do '
    f'[ -f "$mark" ] && echo "${{mark%/{COMPLETE_MARK}}}"; done; exit 0'
)
"""Lists the complete checkpoint directories under `$2` of the run directory `$1`."""


@runtime_checkable
class Checkpointing(Protocol):
    """A trainer whose job saves resumable checkpoints (`checkpoint-N/`) in
    `checkpoint_dir`, relative to its run directory."""

    @property
    def checkpoint_dir(self) -> str:
        """Where the job saves its `checkpoint-N/` directories."""
        ...


def step_of(path: str) -> int | None:
    """The step of the checkpoint directory `path` (`output/checkpoint-40`:
    40), None when it is not one."""
    found = _CHECKPOINT.fullmatch(PurePosixPath(path).name)
    return int(found.group(1)) if found else None


async def complete_checkpoints(executor: Executor, remote: str, directory: str) -> dict[int, str]:
    """The complete checkpoints under `directory` of the run directory
    `remote` on the target, by step (their paths relative to `remote`).

    Raises ExecError when the target cannot be asked.
    """
    result = await executor.run(["sh", "-c", _LIST, "sh", remote, directory], LIST_TIMEOUT_S)
    if result.code != 0:
        raise ExecError("list the checkpoints", result.stderr.strip()[-300:] or "no answer")
    found: dict[int, str] = {}
    for line in result.stdout.splitlines():
        path = line.strip().removeprefix("./")
        step = step_of(path)
        if step is not None:
            found[step] = path
    return found


async def keep(
    executor: Executor,
    python: str,
    runs: Runs,
    record_id: str,
    remote: str,
    path: str,
    step: int,
    volume: str | None = None,
) -> KeptCheckpoint:
    """Brings the checkpoint directory `path` of the job in `remote` into the
    store of `runs` (record `record_id`), at the same path, and checks every
    file against the target's SHA-256 manifest of it: downloaded and hashed
    here into a local store, put and checked by an object store; with
    `volume` (the network volume `remote` is on), left there, as hashed
    there. Then adds it to the run's `checkpoints.json`. Returns it.

    Raises ExecError when the target or the store fails, a file does not
    verify, or `checkpoints.json` cannot be written.
    """
    manifest = await executor.manifest(remote, [path])
    if not any(PurePosixPath(f.path).name == COMPLETE_MARK for f in manifest):
        raise ExecError("keep the checkpoint", f"{path} is gone or incomplete on the target")
    if isinstance(executor, NodesExecutor):  # complete only with every node's part
        have = {node_rank(f.path) for f in manifest}
        lacking = [str(rank) for rank in range(len(executor.nodes)) if rank not in have]
        if lacking:
            raise ExecError(
                "keep the checkpoint",
                f"{path} has no part on node {', '.join(lacking)}: it is not complete",
            )
    parts: dict[str, list[str]] = {}
    if volume is None and runs.store.direct:
        parts = await put_files(executor, python, runs, record_id, remote, manifest)
    elif volume is None:  # on a volume, hashed where the job wrote it: the manifest is the check
        local = runs.run_dir(record_id)
        await executor.download(remote, local, [path])
        await asyncio.to_thread(verify, local, [path], (), manifest)
    point = KeptCheckpoint(
        step=step,
        path=path,
        kept=rfc3339(),
        files=[
            KeptFile(
                path=f.path,
                size=f.size,
                sha256=f.sha256,
                parts=parts.get(f.path, []) if len(parts.get(f.path, [])) > 1 else [],
            )
            for f in manifest
        ],
        volume=volume,
        remote=f"{remote.rstrip('/')}/{path}" if volume is not None else None,
    )
    kept = await asyncio.to_thread(load_kept, runs, record_id)
    kept.add(point)
    try:
        await asyncio.to_thread(save_kept, runs, record_id, kept)
    except RecordError as error:
        raise ExecError("keep the checkpoint", str(error)) from None
    return point


class Keeper:
    """Keeps the checkpoints of one followed job in its run's store, one at
    a time, beside the follow loop (see the module)."""

    def __init__(self, ctx: RunContext, record: RunRecord, directory: str) -> None:
        self.ctx = ctx
        self.record = record
        self.directory = directory
        last = load_kept(ctx.runs, record.id).last
        self.kept_step = last.step if last is not None else -1
        self.failed_step = -1
        self.scanned_step = -1
        self.scanned_at = 0.0
        self.task: asyncio.Task[None] | None = None

    def poke(self, step: int | None) -> None:
        """Starts a look for a new checkpoint, and its keep, when none is in
        flight and the job made a step since the last look (or RESCAN_S, or
        RESCAN_POLLS polls, passed). Never raises."""
        if self.task is not None and not self.task.done():
            return
        now = time.monotonic()
        current = step if step is not None else -1
        rescan_s = min(RESCAN_S, RESCAN_POLLS * self.ctx.poll_s)
        if current <= self.scanned_step and now - self.scanned_at < rescan_s:
            return
        self.scanned_step, self.scanned_at = max(current, self.scanned_step), now
        self.task = asyncio.create_task(self._keep_newest())

    async def finish(self) -> None:
        """Waits for the keep in flight, if any (the job ended: the final
        retrieval then skips what it kept), at most FINISH_BOUND_S: past it,
        the keep is cancelled and the final retrieval copies its files."""
        if self.task is not None:
            done, _ = await asyncio.wait([self.task], timeout=FINISH_BOUND_S)
            if not done:
                log.warning(
                    "%s: a checkpoint still being kept after %g s is left to the final retrieval",
                    self.record.id,
                    FINISH_BOUND_S,
                )
                await self.stop()
            self.task = None

    async def stop(self) -> None:
        """Cancels the keep in flight, if any (its follower gives up)."""
        if self.task is not None and not self.task.done():
            self.task.cancel()
            await asyncio.wait([self.task])  # its own cancel, not this task's, is not raised
        self.task = None

    async def _keep_newest(self) -> None:
        ctx, record = self.ctx, self.record
        try:
            found = await complete_checkpoints(ctx.executor, record.remote_dir, self.directory)
        except ExecError as error:
            log.debug("cannot list the checkpoints of %s: %s", record.id, error)
            return  # the follow loop reports a target that does not answer
        newer = [s for s in found if s > max(self.kept_step, self.failed_step)]
        if not newer:
            return
        step = max(newer)
        path = found[step]
        name = PurePosixPath(path).name
        try:
            await keep(
                ctx.executor,
                ctx.python,
                ctx.runs,
                record.id,
                record.remote_dir,
                path,
                step,
                ctx.checkpoints_volume,
            )
        except Exception as error:  # a keep that fails never fails the run
            self.failed_step = step
            ctx.reporter.warning(
                f"{subject(record)}: {name} could not be kept in {ctx.runs.where_of(record.id)} "
                f"({error}); the next checkpoint tries again, and the job goes on"
            )
            return
        self.kept_step = step
        where = ctx.runs.where_of(record.id, path)
        if ctx.checkpoints_volume is not None:
            where = f"network volume {ctx.checkpoints_volume} ({record.remote_dir}/{path})"
        ctx.reporter.note(f"{subject(record)}: {name} (step {step}) kept in {where}, verified")
