"""Trainers: the kinds of job a run can start (axolotl training, export, compare)."""

from overbrainer_prefect.trainers.axolotl import AxolotlTrainer
from overbrainer_prefect.trainers.base import (
    METRICS_FILE,
    STOP_FILE,
    Artifacts,
    JobContext,
    TargetFacts,
    Trainer,
    TrainError,
)
from overbrainer_prefect.trainers.probe import parse_probe, probe_command
from overbrainer_prefect.trainers.spec import DatasetSpec, TrainingSpec, spec_problem

__all__ = [
    "METRICS_FILE",
    "STOP_FILE",
    "Artifacts",
    "AxolotlTrainer",
    "DatasetSpec",
    "JobContext",
    "TargetFacts",
    "TrainError",
    "Trainer",
    "TrainingSpec",
    "parse_probe",
    "probe_command",
    "spec_problem",
]
