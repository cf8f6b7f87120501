"""An evaluation of a run: its tuned GGUF and its base's scored on held-out
items and controls, `<run dir>/evaluations/<id>/evaluation.json`."""

from __future__ import annotations

from overbrainer_prefect.evaluation.spec import EvaluationPlan
from overbrainer_prefect.evaluation.trainer import EvaluateTrainer
from overbrainer_prefect.kinds.base import JobKind
from overbrainer_prefect.runs.store import RunRecord, Runs
from overbrainer_prefect.trainers.base import Trainer

NAME = "evaluation"
"""An evaluation's records: `<run dir>/evaluations/<id>/evaluation.json`."""


def _rebuild(runs: Runs, record: RunRecord, cpu_threads: int | None) -> Trainer:
    return EvaluateTrainer(
        EvaluationPlan.model_validate(record.spec), runs, cpu_threads=cpu_threads
    )


KIND = JobKind(name=NAME, child=True, rebuild=_rebuild)
