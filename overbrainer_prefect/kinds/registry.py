"""Every kind of job, found by its record: what the driver, the collector and
the hooks ask to follow or end a job whatever its kind. A new kind of job is a
module of `kinds/` declaring a `KIND`, listed here."""

from __future__ import annotations

from overbrainer_prefect.kinds import base_export, compare, evaluation, export, training
from overbrainer_prefect.kinds.base import JobKind
from overbrainer_prefect.runs.store import RunRecord, Runs, subject
from overbrainer_prefect.steps.errors import RunError
from overbrainer_prefect.trainers.base import Trainer

KINDS: tuple[JobKind, ...] = (
    training.KIND,
    export.KIND,
    base_export.KIND,
    compare.KIND,
    evaluation.KIND,
)
"""The kinds of job this package runs."""


def kind_of(record: RunRecord) -> JobKind:
    """The kind of the job `record`. Raises RunError with one line for a
    record of a kind this version does not know."""
    for kind in KINDS:
        if kind.holds(record):
            return kind
    raise RunError(
        f"{subject(record)} is a job of a kind this version does not know "
        f"({record.trainer!r}): follow it with the version that made it"
    )


def trainer_of(runs: Runs, record: RunRecord, cpu_threads: int | None = None) -> Trainer:
    """The trainer of the job `record` (a run's training, export, compare or
    evaluation, a base model's export), made again from its record; `runs`
    is the runs directory. Raises RunError with one line when the record
    holds no usable spec."""
    return kind_of(record).trainer(runs, record, cpu_threads)
