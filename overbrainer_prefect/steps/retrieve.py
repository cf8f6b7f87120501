"""Retrieving a job's files: downloaded, checked against the target's SHA-256
manifest, the manifest kept; an ended job's outcome read from its local files."""

from __future__ import annotations

import asyncio
import glob
import logging
import os
import secrets
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path

from overbrainer_prefect.executors.base import (
    JOB_LOG,
    ExecError,
    Executor,
    FileDigest,
)
from overbrainer_prefect.executors.manifest import verify
from overbrainer_prefect.executors.nodes import NODES_MANIFEST, NodesExecutor, node_dir, node_rank
from overbrainer_prefect.runs.checkpoints import (
    KeptFile,
    in_checkpoint,
    load_kept,
    save_kept,
    sorted_against,
)
from overbrainer_prefect.runs.manifest import MANIFEST_FILE, load_manifest, manifest_bytes
from overbrainer_prefect.runs.metrics import stored_summary
from overbrainer_prefect.runs.store import (
    RunRecord,
    Runs,
    RunState,
    subject,
)
from overbrainer_prefect.steps.context import Outcome, RunContext
from overbrainer_prefect.steps.direct import put_files
from overbrainer_prefect.steps.errors import NotEnded
from overbrainer_prefect.store.held import check_guarded
from overbrainer_prefect.store.records import RecordError
from overbrainer_prefect.trainers.base import (
    Trainer,
)

log = logging.getLogger(__name__)


async def retrieve(
    executor: Executor,
    python: str,
    trainer: Trainer,
    runs: Runs,
    record_id: str,
    remote: str,
    succeeded: bool,
) -> tuple[list[FileDigest], bool]:
    """Brings the trainer's artifacts and the job log of the job in `remote`
    into the store of `runs` (record `record_id`) and checks they are
    exactly the target's SHA-256 manifest: into a local runs directory they
    are downloaded and checked here (none missing, none different, none
    extra); into an object store the target puts them itself and the store's
    own SHA-256 of each is checked (`direct.put_files`). The checkpoints kept
    while the job trained (`checkpoints.json`) are not copied again when the
    target still holds them as they were kept (they are verified all the
    same); one the target no longer holds stays as it was kept; one it
    changed since is replaced only by a copy that verified, and recorded
    anew. The manifest is kept beside them (and, for a job across nodes,
    `nodes.json`: the node each file came from). Returns it and, for a succeeded
    job, whether its required entry held no file at all.

    Raises ExecError when the target or the store fails or a file does not
    verify; LeaseLost, having written nothing, when this task lost the run's
    follow lock.
    """
    check_guarded(record_id)
    artifacts = trainer.artifacts()
    entries = [*artifacts.entries, JOB_LOG]
    manifest = await executor.manifest(remote, entries, artifacts.exclude)
    required = artifacts.required
    no_output = (
        succeeded
        and required is not None
        and not any(f.path == required or f.path.startswith(f"{required}/") for f in manifest)
    )
    kept = (await asyncio.to_thread(load_kept, runs, record_id)).in_store()
    if runs.store.direct:
        held = {f.path: f for point in kept.checkpoints for f in point.files if f.parts}
        parts = await put_files(executor, python, runs, record_id, remote, manifest, held)
        _, _, changed = sorted_against(kept, manifest)
        if changed:
            await asyncio.to_thread(_record_changed, runs, record_id, changed, manifest, parts)
    else:
        local = runs.run_dir(record_id)
        same, gone, changed = sorted_against(kept, manifest)
        if changed:
            await _replace_verified(executor, remote, local, changed, artifacts.exclude, manifest)
        skip = [*artifacts.exclude, *map(glob.escape, [*same, *changed])]
        await executor.download(remote, local, entries, skip)
        exclude = [*artifacts.exclude, *map(glob.escape, gone)]
        await asyncio.to_thread(verify, local, entries, exclude, manifest)
        if changed:
            await asyncio.to_thread(_record_changed, runs, record_id, changed, manifest)
    try:
        runs.write_bytes(record_id, MANIFEST_FILE, manifest_bytes(manifest))
        if isinstance(executor, NodesExecutor):  # which node each file came from
            runs.write_bytes(record_id, NODES_MANIFEST, executor.node_files(manifest))
    except RecordError as error:
        raise ExecError("keep the manifest", str(error)) from None
    return manifest, no_output


async def _replace_verified(
    executor: Executor,
    remote: str,
    local: Path,
    changed: Sequence[str],
    exclude: Sequence[str],
    manifest: Sequence[FileDigest],
) -> None:
    """Replaces the kept checkpoint directories `changed` of the local run
    directory `local` with the target's copies, each downloaded beside them
    and checked against `manifest` first: a copy that does not verify
    leaves the kept one as it was. Raises ExecError then."""
    staging = local / f".retrieving-{secrets.token_hex(6)}"
    old = local / f".replaced-{secrets.token_hex(6)}"
    try:
        await executor.download(remote, staging, changed, exclude)
        listed = [f for f in manifest if any(in_checkpoint(f.path, p) for p in changed)]
        await asyncio.to_thread(verify, staging, changed, exclude, listed)
        ranks = sorted({node_rank(f.path) for f in listed})  # across nodes, every node's part
        for path in (node_dir(rank) + each for each in changed for rank in ranks):
            if not (staging / path).exists():
                continue
            (old / path).parent.mkdir(parents=True, exist_ok=True)
            if (local / path).exists():
                os.replace(local / path, old / path)
            (local / path).parent.mkdir(parents=True, exist_ok=True)
            os.replace(staging / path, local / path)
    except OSError as error:
        raise ExecError("download", f"cannot replace a kept checkpoint: {error}") from None
    finally:
        await asyncio.to_thread(shutil.rmtree, staging, True)
        await asyncio.to_thread(shutil.rmtree, old, True)


def _record_changed(
    runs: Runs,
    record_id: str,
    changed: Sequence[str],
    manifest: Sequence[FileDigest],
    parts: Mapping[str, Sequence[str]] | None = None,
) -> None:
    """Records the kept checkpoints `changed`, replaced by verified copies,
    with their files as `manifest` lists them (and the SHA-256 of each part
    an object store holds them in, `parts`). Raises ExecError when
    `checkpoints.json` cannot be written."""
    parts = parts or {}
    kept = load_kept(runs, record_id)
    for point in kept.checkpoints:
        if point.volume is None and point.path in changed:
            point.files = [
                KeptFile(
                    path=f.path,
                    size=f.size,
                    sha256=f.sha256,
                    parts=list(parts.get(f.path, [])) if len(parts.get(f.path, [])) > 1 else [],
                )
                for f in manifest
                if in_checkpoint(f.path, point.path)
            ]
    try:
        save_kept(runs, record_id, kept)
    except RecordError as error:
        raise ExecError("keep the checkpoints", str(error)) from None


async def collect(ctx: RunContext, trainer: Trainer, record: RunRecord) -> tuple[RunRecord, bool]:
    """Retrieves again the files of an ended run whose target still holds them;
    on success clears its `not_retrieved` reason. A failure is reported
    as a warning and leaves the record as it was. Returns the record and whether
    its files were retrieved.

    Raises NotEnded for a run still preparing or running.
    """
    if not record.state.ended:
        raise NotEnded(record.id)
    succeeded = record.state in (RunState.SUCCEEDED, RunState.STOPPED)
    try:
        await retrieve(
            ctx.executor, ctx.python, trainer, ctx.runs, record.id, record.remote_dir, succeeded
        )
    except ExecError as error:
        ctx.reporter.warning(f"cannot retrieve the files of {subject(record)}: {error}")
        return record, False
    if record.not_retrieved is not None:
        record.not_retrieved = None
        ctx.runs.save(record)
    return record, True


def has_job_log(runs: Runs, record: RunRecord) -> bool:
    """Whether the job log of `record` was retrieved into its store."""
    try:
        return runs.exists(record.id, JOB_LOG)
    except RecordError:
        return False


def recorded(runs: Runs, trainer: Trainer, record: RunRecord) -> Outcome:
    """The outcome of an ended job from its stored files alone (what it ran on
    is gone, or it was never started): its metrics, and its verified files
    when they were retrieved."""
    summary = stored_summary(runs, record.id, trainer.metrics_file)
    retrieved = (
        record.job is not None and record.not_retrieved is None and has_job_log(runs, record)
    )
    files = load_manifest(runs, record.id) if retrieved else []
    return Outcome(record=record, summary=summary, retrieved=retrieved, files=files)
