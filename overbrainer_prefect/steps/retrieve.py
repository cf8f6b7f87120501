"""Retrieving a job's files: downloaded, checked against the target's SHA-256
manifest, the manifest kept; an ended job's outcome read from its local files."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from pydantic import TypeAdapter

from overbrainer_prefect.executors.base import (
    JOB_LOG,
    ExecError,
    Executor,
    FileDigest,
)
from overbrainer_prefect.executors.manifest import verify
from overbrainer_prefect.runs.metrics import MetricsSummary
from overbrainer_prefect.runs.records import write_atomic
from overbrainer_prefect.runs.store import (
    RunRecord,
    Runs,
    RunState,
    subject,
)
from overbrainer_prefect.steps.context import Outcome, RunContext
from overbrainer_prefect.steps.errors import NotEnded
from overbrainer_prefect.trainers.base import (
    Trainer,
)

log = logging.getLogger(__name__)

MANIFEST_FILE = "manifest.json"
"""The verified manifest of a run's retrieved files, kept locally."""


async def retrieve(
    executor: Executor, trainer: Trainer, remote: str, local: Path, succeeded: bool
) -> tuple[list[FileDigest], bool]:
    """Copies the trainer's artifacts and the job log from `remote` into `local`,
    then checks that the local files are exactly the target's SHA-256 manifest:
    none missing, none different, none extra. Returns the manifest and, for a
    succeeded job, whether its required entry held no file at all.

    Raises ExecError when the target fails or a file does not verify.
    """
    artifacts = trainer.artifacts()
    entries = [*artifacts.entries, JOB_LOG]
    manifest = await executor.manifest(remote, entries, artifacts.exclude)
    required = artifacts.required
    no_output = (
        succeeded
        and required is not None
        and not any(f.path == required or f.path.startswith(f"{required}/") for f in manifest)
    )
    await executor.download(remote, local, entries, artifacts.exclude)
    await asyncio.to_thread(verify, local, entries, artifacts.exclude, manifest)
    write_atomic(local, MANIFEST_FILE, _MANIFEST.dump_json(manifest, indent=2) + b"\n")
    return manifest, no_output


_MANIFEST = TypeAdapter(list[FileDigest])


def load_manifest(local: Path) -> list[FileDigest]:
    """The verified manifest saved by the last retrieval into the run directory
    `local` (empty when there was none or it cannot be read)."""
    try:
        return _MANIFEST.validate_json((local / MANIFEST_FILE).read_bytes())
    except (OSError, ValueError):
        return []


async def collect(ctx: RunContext, trainer: Trainer, record: RunRecord) -> tuple[RunRecord, bool]:
    """Retrieves again the files of an ended run whose target still holds them;
    on success clears its `not_retrieved` reason. A failure is reported
    as a warning and leaves the record as it was. Returns the record and whether
    its files were retrieved.

    Raises NotEnded for a run still preparing or running.
    """
    if not record.state.ended:
        raise NotEnded(record.id)
    local = ctx.runs.run_dir(record.id)
    succeeded = record.state in (RunState.SUCCEEDED, RunState.STOPPED)
    try:
        await retrieve(ctx.executor, trainer, record.remote_dir, local, succeeded)
    except ExecError as error:
        ctx.reporter.warning(f"cannot retrieve the files of {subject(record)}: {error}")
        return record, False
    if record.not_retrieved is not None:
        record.not_retrieved = None
        ctx.runs.save(record)
    return record, True


def has_job_log(runs: Runs, record: RunRecord) -> bool:
    """Whether the job log of `record` was retrieved into its local directory."""
    return (runs.run_dir(record.id) / JOB_LOG).is_file()


def recorded(runs: Runs, trainer: Trainer, record: RunRecord) -> Outcome:
    """The outcome of an ended job from its local files alone (what it ran on
    is gone, or it was never started): its metrics, and its verified files
    when they were retrieved."""
    local = runs.run_dir(record.id)
    summary = _local_summary(local / trainer.metrics_file)
    retrieved = (
        record.job is not None and record.not_retrieved is None and (local / JOB_LOG).is_file()
    )
    files = load_manifest(local) if retrieved else []
    return Outcome(record=record, summary=summary, retrieved=retrieved, files=files)


def _local_summary(path: Path) -> MetricsSummary:
    try:
        return MetricsSummary.of_text(path.read_text(encoding="utf-8", errors="replace"))
    except FileNotFoundError:
        return MetricsSummary()
