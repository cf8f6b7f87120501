"""Every kind of job, found by its record: what the driver, the collector and
the hooks ask to follow or end a job whatever its kind. A new kind of job is a
module of `kinds/` declaring a `KIND`, listed here."""

from __future__ import annotations

import asyncio

from overbrainer_prefect.kinds import base_export, compare, evaluation, export, training
from overbrainer_prefect.kinds.base import JobKind
from overbrainer_prefect.runs.lock import holder_of, is_followed
from overbrainer_prefect.runs.store import RunRecord, Runs, subject
from overbrainer_prefect.steps import retrieve
from overbrainer_prefect.steps.context import Outcome
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


FOLLOWER_WAIT_S = 300.0  # how long stop and cancel wait for another follower to record the end


async def recorded_end(runs: Runs, run_id: str, bound_s: float = FOLLOWER_WAIT_S) -> Outcome:
    """The outcome of run `run_id` as its other follower records it: waits
    (up to `bound_s`) until the run has ended and nothing follows it. Raises
    RunError with one line when it is still followed past the bound."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + bound_s
    while loop.time() < deadline:
        record = runs.load(run_id)
        if record.state.ended and not is_followed(runs, run_id):
            return retrieve.recorded(runs, trainer_of(runs, record), record)
        await asyncio.sleep(1.0)
    raise RunError(
        f"run {run_id} is still followed by {holder_of(runs, run_id)} after "
        f"{bound_s:g} s; see its flow run for the outcome"
    )
