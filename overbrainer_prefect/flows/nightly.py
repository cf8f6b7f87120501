"""The start and end of a night of the `fine_tune` flow: prepare its data,
fingerprint what it would train, and train nothing when nothing changed since
the last model its deployment delivered; once it ran, remember what it
trained and, when it delivered, what the next night is compared with.

The logic is the core's (`nightly/`); this module adds the prepare block, the
flow run's log and its state.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from prefect import get_run_logger
from prefect.runtime import flow_run
from prefect.states import Completed
from pydantic import BaseModel

from overbrainer_prefect.evaluation.spec import EvaluationSpec
from overbrainer_prefect.flows.results import AnyState
from overbrainer_prefect.nightly.decision import (
    NightFacts,
    NothingTrained,
    decide,
    remember,
)
from overbrainer_prefect.nightly.prepared import PREPARE_TIMEOUT_S, take_prepared
from overbrainer_prefect.nightly.record import NightlyRecordError
from overbrainer_prefect.runs.store import Runs
from overbrainer_prefect.shell_prepare import load_prepare, run_prepare
from overbrainer_prefect.trainers.spec import TrainingSpec


@dataclass
class NightStart:
    """A night, once prepared and fingerprinted: what it trains and evaluates
    (the prepared files, Hub commits pinned), its facts, and the flow run's
    final state when it trains nothing."""

    training: TrainingSpec
    evaluation: EvaluationSpec | None
    facts: NightFacts
    skipped: AnyState | None = None


async def begin_night(
    training: TrainingSpec,
    export: BaseModel,
    evaluation: EvaluationSpec | None,
    runs: Runs,
    deployment: str,
    *,
    prepare: str | None = None,
    force: bool = False,
    resumed: bool = False,
    prepare_timeout_s: float = PREPARE_TIMEOUT_S,
) -> NightStart:
    """Runs the prepare block `prepare` (if any) and takes its files as the
    night's datasets and eval file, then fingerprints what the night would
    train and compares it with the last model `deployment` delivered: when
    they are equal (and neither `force` nor `resumed`, a pipeline continued
    from its run), `skipped` is the `Completed` state "nothing changed since
    run R (delivered DATE): nothing trained".

    Raises PrepareError, FingerprintError or NightlyRecordError with one line,
    before anything is created.
    """
    logger = get_run_logger()
    if prepare is not None:
        block = await load_prepare(prepare)
        logger.info("preparing the night's data with the Shell Operation block %r", prepare)
        lines, working_dir = await run_prepare(block, prepare, prepare_timeout_s)
        training, evaluation, wrote = await asyncio.to_thread(
            take_prepared, lines, working_dir, prepare, training, evaluation
        )
        logger.info("%s", wrote)
    training, facts, said = await asyncio.to_thread(
        decide,
        training,
        export,
        evaluation,
        runs,
        deployment,
        force=force or resumed,
        prepared_by=prepare,
    )
    for line in said:
        logger.info("%s", line)
    start = NightStart(training, evaluation, facts)
    if facts.skipped is not None:
        start.skipped = Completed(
            message=facts.skipped, data=NothingTrained(reason=facts.skipped, night=facts)
        )
    return start


async def end_night(
    runs: Runs, start: NightStart, run_id: str, delivered: bool, resumed: bool
) -> None:
    """Remembers the night `start` that trained run `run_id` as its deployment's
    last night (unless it only continued a run), and, when it `delivered`, as
    the night the next one is compared with. Never fails the pipeline: a record
    that cannot be written is a warning (the next night then trains)."""
    this = str(flow_run.id) if flow_run.id else None
    try:
        line = await asyncio.to_thread(
            remember, runs, start.facts, run_id, this, trained=not resumed, delivered=delivered
        )
    except NightlyRecordError as error:
        get_run_logger().warning("%s: the next night trains whatever its data", error)
        return
    if line is not None:
        get_run_logger().info("%s", line)
