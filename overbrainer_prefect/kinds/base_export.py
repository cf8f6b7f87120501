"""A base model's export: the plain base model converted and quantized like a
run's model, once per base model, target and quant type, kept under
`<runs dir>/.bases/<key>/exports/<id>/export.json` and reused by every compare
and evaluation of every run of that base."""

from __future__ import annotations

from overbrainer_prefect.executors.base import JOB_LOG
from overbrainer_prefect.kinds.base import JobKind, NewJob
from overbrainer_prefect.kinds.compare import (
    CompareFailed,
    _base_ref,
    job_failure,
)
from overbrainer_prefect.kinds.export import NAME, export_job, gguf_entry, reusable
from overbrainer_prefect.runs.store import RunRecord, Runs, RunState, subject
from overbrainer_prefect.sizing import DiskJob
from overbrainer_prefect.steps.context import Outcome
from overbrainer_prefect.targets.base import Logger
from overbrainer_prefect.trainers.base import Trainer
from overbrainer_prefect.trainers.export import BaseExportTrainer
from overbrainer_prefect.trainers.gguf_job import GgufRef


def _rebuild(runs: Runs, record: RunRecord, cpu_threads: int | None) -> Trainer:
    spec = record.spec or {}
    return BaseExportTrainer(
        str(spec.get("base_model")), str(spec.get("quant")), cpu_threads=cpu_threads
    )


KIND = JobKind(name=NAME, child=False, rebuild=_rebuild)
"""A base model's export: an export record of no run."""


def reused_base(runs: Runs, store: Runs, base: str, quant: str, logger: Logger) -> GgufRef | None:
    """The GGUF of the latest succeeded export of the base model `base` to
    `quant` in `store`, when it still matches its SHA-256 (a warning says when
    it no longer does); None when there is none to reuse."""
    done = reusable(store, quant)
    ref = _base_ref(store, done, runs) if done is not None else None
    if done is not None and ref is not None:
        logger.info(
            "the base model's GGUF (%s) is reused from %s: %s",
            quant,
            subject(done),
            ref.path,
        )
        return ref
    if done is not None:
        logger.warning(
            "the GGUF of %s no longer matches its SHA-256: exporting the base again",
            subject(done),
        )
    return None


def base_gguf(runs: Runs, store: Runs, outcome: Outcome, name: str, logger: Logger) -> GgufRef:
    """The verified GGUF of the base export whose job ended with `outcome`.
    Raises CompareFailed with one line (the job's own reason, where its log is)
    when it did not succeed or brought back no GGUF."""
    record = outcome.record
    log = store.where_of(record.id, JOB_LOG)
    if outcome.record.state != RunState.SUCCEEDED:
        reason = outcome.record.message or str(outcome.record.state)
        why = job_failure(store, record.id, "export failed: ")
        raise CompareFailed(
            f"{name} {outcome.record.state}: {reason.split(' (see ')[0]} (see {log})"
            + (f": {why}" if why else "")
        )
    entry = gguf_entry(outcome.files)
    if entry is None:
        raise CompareFailed(f"{name} brought back no GGUF (see {log})")
    logger.info("%s succeeded: %s (sha256 %s)", name, entry.path, entry.sha256)
    return GgufRef(
        path=store.key(record.id, entry.path),
        size=entry.size,
        sha256=entry.sha256,
        export_id=record.id,
    )


def base_export_job(
    store: Runs, base: str, quant: str, python: str, cpu_threads: int | None
) -> NewJob:
    """The new export of the plain base model `base` to `quant` (converted and
    quantized like a run's; on a pod of its own on Runpod), on a target whose
    job venv runs `python`."""
    return export_job(
        store,
        BaseExportTrainer(base, quant, cpu_threads=cpu_threads),
        {"quant": quant, "keep_intermediate": False, "base_model": base},
        base,
        python,
        what=f"the {quant} export of the base model {base}",
        parent=None,
        subdir="bases",
        disk=DiskJob("base_export", model=base, quant=quant),
    )
