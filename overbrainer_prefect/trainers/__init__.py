"""Trainers: the kinds of job a run can start (axolotl training, export, compare)."""

from overbrainer_prefect.trainers.base import (
    METRICS_FILE,
    STOP_FILE,
    Artifacts,
    JobContext,
    TargetFacts,
    Trainer,
    TrainError,
)

__all__ = [
    "METRICS_FILE",
    "STOP_FILE",
    "Artifacts",
    "JobContext",
    "TargetFacts",
    "TrainError",
    "Trainer",
]
