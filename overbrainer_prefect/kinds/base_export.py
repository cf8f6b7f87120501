"""A base model's export: the plain base model converted and quantized like a
run's model, once per base model, target and quant type, kept under
`<runs dir>/.bases/<key>/exports/<id>/export.json` and reused by every compare
and evaluation of every run of that base."""

from __future__ import annotations

from overbrainer_prefect.kinds.base import JobKind
from overbrainer_prefect.kinds.export import NAME
from overbrainer_prefect.runs.store import RunRecord, Runs
from overbrainer_prefect.trainers.base import Trainer
from overbrainer_prefect.trainers.export import BaseExportTrainer


def _rebuild(runs: Runs, record: RunRecord, cpu_threads: int | None) -> Trainer:
    spec = record.spec or {}
    return BaseExportTrainer(
        str(spec.get("base_model")), str(spec.get("quant")), cpu_threads=cpu_threads
    )


KIND = JobKind(name=NAME, child=False, rebuild=_rebuild)
"""A base model's export: an export record of no run."""
