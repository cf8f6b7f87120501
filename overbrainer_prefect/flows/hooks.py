"""What happens to a run when its flow run is cancelled or crashes.

Prefect runs these hooks after it stopped the flow's process, often in another
process (the worker's or the runner's): nothing of the flow's memory is there.
So they find the run from `run.json` alone: the record of every run holds the
flow run that created it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from prefect.client.schemas.objects import FlowRun, State
from prefect.flows import Flow
from prefect.logging.loggers import flow_run_logger

from overbrainer_prefect.executors.base import ExecError
from overbrainer_prefect.runs import lifecycle
from overbrainer_prefect.runs.ids import rfc3339
from overbrainer_prefect.runs.lifecycle import RunContext
from overbrainer_prefect.runs.lock import RunBusy, follow_lock
from overbrainer_prefect.runs.store import RunRecord, Runs, RunState, follow_again, subject

if TYPE_CHECKING:
    from overbrainer_prefect.trainers.base import Trainer

HOOK_RETRIEVE_S = 120.0  # how long a cancellation hook spends retrieving what a job left


def runs_of(flow_run: FlowRun) -> tuple[Runs, list[RunRecord]]:
    """The runs store the flow run used, and the runs it created that have not ended."""
    runs_dir = (flow_run.parameters or {}).get("runs_dir")
    runs = Runs(runs_dir)
    mine = [
        record
        for record in runs.list(skipped=lambda run_id, error: None)
        if record.flow_run_id == str(flow_run.id) and not record.state.ended
    ]
    return runs, mine


async def cancel_runs_of(flow_run: FlowRun, logger: logging.Logger | Any) -> None:
    """Ends the unfinished runs of a cancelled flow run: a run whose job had not
    started is failed `interrupted before the job started`; a started job is
    cancelled, what it left retrieved (bounded in time) and the run recorded."""
    from overbrainer_prefect.flows.targets import load_target
    from overbrainer_prefect.flows.train import trainer_of

    runs, records = runs_of(flow_run)
    for record in records:
        if record.target_kind == "runpod":
            await cancel_pod_job_hook(runs, record, str(flow_run.id), logger)
            continue
        if record.job is None:
            record.state = RunState.FAILED
            record.message = "interrupted before the job started"
            record.ended = rfc3339()
            runs.save(record)
            logger.info("run %s: interrupted before its job started; nothing runs", record.id)
            continue
        _, block = await load_target(record.target)
        executor = block.executor(record.target)
        ctx = RunContext(runs=runs, executor=executor, python=block.python)
        try:
            with follow_lock(runs.run_dir(record.id), str(flow_run.id)):
                _, status, retrieved = await asyncio.wait_for(
                    lifecycle.cancel(ctx, trainer_of(record, block), record), HOOK_RETRIEVE_S
                )
            logger.info(
                "run %s: job %s on %s; its files were %sretrieved",
                record.id,
                status,
                executor.description,
                "" if retrieved else "not ",
            )
        except (ExecError, TimeoutError, RunBusy) as error:
            logger.warning(
                "run %s: cannot cancel its job on %s (%s); cancel it with the cancel flow "
                "(run_id=%s)",
                record.id,
                executor.description,
                error,
                record.id,
            )
        finally:
            await executor.close()


async def on_cancelled(flow: Flow[Any, Any], flow_run: FlowRun, state: State[Any]) -> None:
    """`on_cancellation` hook of the run flows: cancels the jobs they started."""
    await cancel_runs_of(flow_run, flow_run_logger(flow_run, flow))


async def on_crashed(flow: Flow[Any, Any], flow_run: FlowRun, state: State[Any]) -> None:
    """`on_crashed` hook of the run flows: a started job keeps running (bounded by
    its max_hours, on a pod by its watchdog); says how to follow it again. On
    Runpod, the pods of a run whose job never started are deleted."""
    logger = flow_run_logger(flow_run, flow)
    runs, records = runs_of(flow_run)
    for record in records:
        if record.target_kind == "runpod":
            await crashed_pod_job_hook(runs, record, logger)
            continue
        if record.job is not None:
            logger.warning(
                "run %s keeps running on its target (bounded by max_hours); follow it again "
                "with the attach flow (run_id=%s), or cancel it with the cancel flow",
                record.id,
                record.id,
            )


TrainerOf = Callable[[RunRecord, Any], "Trainer"]
"""Rebuilds a job's trainer from its record and its target block."""


async def cancel_pod_job_hook(
    runs: Runs,
    record: RunRecord,
    flow_run_id: str,
    logger: logging.Logger | Any,
    trainer_of: TrainerOf | None = None,
) -> None:
    """`on_cancellation` for a job on a pod (see `flows.podjob.cancel_pod_job`;
    a training run's trainer by default); a failure is logged with how to
    remove what may be left."""
    from overbrainer_prefect.blocks import RunpodTarget
    from overbrainer_prefect.flows.podjob import cancel_pod_job
    from overbrainer_prefect.flows.targets import load_target
    from overbrainer_prefect.flows.train import trainer_of as training_trainer

    try:
        _, block = await load_target(record.target)
        if not isinstance(block, RunpodTarget):
            raise ValueError(f"the target {record.target} of {subject(record)} is no Runpod target")
        try:
            trainer = (trainer_of or training_trainer)(record, block)
        except Exception as error:
            logger.warning("%s: its trainer cannot be rebuilt (%s)", subject(record), error)
            trainer = None
        await cancel_pod_job(runs, record, trainer, block, flow_run_id, logger)
    except Exception as error:
        logger.warning(
            "%s: cannot end its pod (%s); remove it with the pods flow (action=remove, run_id=%s)",
            subject(record),
            error,
            record.id,
        )


async def crashed_pod_job_hook(runs: Runs, record: RunRecord, logger: logging.Logger | Any) -> None:
    """`on_crashed` for a job on a pod (see `flows.podjob.crashed_pod_job`)."""
    from overbrainer_prefect.blocks import RunpodTarget
    from overbrainer_prefect.flows.podjob import crashed_pod_job
    from overbrainer_prefect.flows.targets import load_target

    try:
        _, block = await load_target(record.target)
        if not isinstance(block, RunpodTarget):
            raise ValueError(f"the target {record.target} of {subject(record)} is no Runpod target")
        await crashed_pod_job(runs, record, block, logger)
    except Exception as error:
        logger.warning(
            "%s: its pod may keep running (%s); follow it again with %s, or remove the pod with "
            "the pods flow (action=remove, run_id=%s)",
            subject(record),
            error,
            follow_again(record),
            record.id,
        )
