"""Rebuilding any job's trainer from its record alone: what every process that
follows a job again (attach, the collector, a hook) does the same way."""

from __future__ import annotations

from overbrainer_prefect.evaluation.spec import EvaluationPlan
from overbrainer_prefect.runs.lifecycle import RunError
from overbrainer_prefect.runs.resume import resume_path
from overbrainer_prefect.runs.store import RunRecord, Runs, subject
from overbrainer_prefect.trainers.axolotl import AxolotlTrainer
from overbrainer_prefect.trainers.base import Trainer
from overbrainer_prefect.trainers.compare import BaseExportTrainer, CompareTrainer, spec_of
from overbrainer_prefect.trainers.evaluate import EVALUATION, EvaluateTrainer
from overbrainer_prefect.trainers.export import ExportSpec, ExportTrainer
from overbrainer_prefect.trainers.spec import TrainingSpec

TRAINING = "training"
EXPORT = "export"
COMPARE = "compare"
"""The kinds of job a record's `trainer` names."""


def trainer_of(runs: Runs, record: RunRecord, cpu_threads: int | None = None) -> Trainer:
    """The trainer of the job `record` (a run's training, a run's export or
    compare, a base model's export), rebuilt from its record; `runs` is the
    runs directory (the root store). Raises RunError with one line when the
    record holds no usable spec."""
    spec = record.spec
    if record.trainer == EVALUATION:
        if spec is None:
            raise RunError(f"{subject(record)} has no evaluation plan in its record")
        return EvaluateTrainer(
            EvaluationPlan.model_validate(spec), runs.root, cpu_threads=cpu_threads
        )
    if record.trainer == COMPARE:
        compare = spec_of(spec)
        if compare is None:
            raise RunError(
                f"{subject(record)} has no compare spec in its record: it cannot be followed"
            )
        return CompareTrainer(compare, runs.root, cpu_threads=cpu_threads)
    if record.trainer == EXPORT and record.parent is None:
        spec = spec or {}
        return BaseExportTrainer(
            str(spec.get("base_model")), str(spec.get("quant")), cpu_threads=cpu_threads
        )
    if record.trainer == EXPORT:
        if spec is None:
            raise RunError(
                f"{subject(record)} has no export spec in its record: it cannot be followed"
            )
        assert record.parent is not None
        run = runs.load(record.parent)
        return ExportTrainer(
            run, runs.run_dir(run.id), ExportSpec.model_validate(spec), cpu_threads=cpu_threads
        )
    if spec is None:
        raise RunError(
            f"{subject(record)} has no training spec in its record: it cannot be followed"
        )
    resume = resume_path(record.resumed_from) if record.resumed_from else None
    return AxolotlTrainer(
        TrainingSpec.model_validate(spec), resume_from=resume, cpu_threads=cpu_threads
    )
