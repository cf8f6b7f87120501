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
from pathlib import Path
from typing import Any

from prefect import get_run_logger
from prefect.client.schemas.objects import State
from prefect.runtime import flow_run
from prefect.states import Completed
from pydantic import BaseModel

from overbrainer_prefect.evaluation.spec import EvaluationSpec
from overbrainer_prefect.flows.prepare import PREPARE_TIMEOUT_S, load_prepare, run_prepare
from overbrainer_prefect.nightly.decision import (
    NightFacts,
    plan_night,
    remember_delivered,
    remember_trained,
    why,
)
from overbrainer_prefect.nightly.fingerprint import fingerprint, hub_resolver, pinned
from overbrainer_prefect.nightly.prepared import apply, check_rows, parse_output
from overbrainer_prefect.nightly.record import NightlyRecordError
from overbrainer_prefect.trainers.spec import TrainingSpec


class NothingTrained(BaseModel):
    """What a night that trained nothing returns: why, and its fingerprint."""

    reason: str
    night: NightFacts


@dataclass
class NightStart:
    """A night, once prepared and fingerprinted: what it trains and evaluates
    (the prepared files, Hub commits pinned), its facts, and the flow run's
    final state when it trains nothing."""

    training: TrainingSpec
    evaluation: EvaluationSpec | None
    facts: NightFacts
    skipped: State[Any] | None = None


async def begin_night(
    training: TrainingSpec,
    export: BaseModel,
    evaluation: EvaluationSpec | None,
    runs_root: Path,
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
        prepared = parse_output(lines, working_dir, prepare)
        await asyncio.to_thread(check_rows, prepared, prepare)
        training, evaluation = apply(training, evaluation, prepared, prepare)
        logger.info(
            "prepare %r wrote %s%s",
            prepare,
            ", ".join(str(p) for p in prepared.datasets),
            f" and the eval file {prepared.eval_file}" if prepared.eval_file else "",
        )
    print_ = await asyncio.to_thread(fingerprint, training, export, evaluation, hub_resolver())
    facts = await asyncio.to_thread(
        plan_night, runs_root, deployment, print_, force=force or resumed, prepared_by=prepare
    )
    hub = {k: v for k, v in print_.parts.items() if "@" in v and not k.endswith("settings")}
    if hub:
        logger.info("Hub commits: %s", ", ".join(f"{k} {v}" for k, v in hub.items()))
    start = NightStart(pinned(training, print_), evaluation, facts)
    if facts.skipped is not None:
        logger.info("fingerprint %s: %s", print_.short, facts.skipped)
        start.skipped = Completed(
            message=facts.skipped, data=NothingTrained(reason=facts.skipped, night=facts)
        )
    else:
        logger.info("fingerprint %s: trains: %s", print_.short, why(facts))
    return start


async def end_night(
    runs_root: Path, start: NightStart, run_id: str, delivered: bool, resumed: bool
) -> None:
    """Remembers the night `start` that trained run `run_id` as its deployment's
    last night (unless it only continued a run), and, when it `delivered`, as
    the night the next one is compared with. Never fails the pipeline: a record
    that cannot be written is a warning (the next night then trains)."""
    this = str(flow_run.id) if flow_run.id else None
    logger = get_run_logger()
    try:
        if not resumed:
            await asyncio.to_thread(remember_trained, runs_root, start.facts, run_id, this)
        if delivered:
            await asyncio.to_thread(remember_delivered, runs_root, start.facts, run_id, this)
    except NightlyRecordError as error:
        logger.warning("%s: the next night trains whatever its data", error)
        return
    if delivered:
        logger.info(
            "fingerprint %s delivered: the next night with the same data trains nothing",
            start.facts.fingerprint.short,
        )
