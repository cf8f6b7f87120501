"""Creating a run and starting its job: the record saved `preparing`, the
target's job environment probed, the files prepared and uploaded, the job
spawned detached and the record saved `running` with it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta

from pydantic import JsonValue, SecretStr

from overbrainer_prefect.executors.base import (
    ExecError,
    Executor,
    JobId,
    JobSpec,
)
from overbrainer_prefect.runs.ids import new_run_id
from overbrainer_prefect.runs.lock import LOCK_FILE
from overbrainer_prefect.runs.manifest import MANIFEST_FILE
from overbrainer_prefect.runs.store import (
    RECORD_FILE,
    RunRecord,
    Runs,
    RunState,
)
from overbrainer_prefect.steps.context import RunContext
from overbrainer_prefect.steps.direct import (
    FETCH_ENV,
    check_reach,
    fetch_command,
    fetch_plan,
    push_staged,
)
from overbrainer_prefect.store import StoreError
from overbrainer_prefect.timestamps import rfc3339
from overbrainer_prefect.trainers.base import (
    JobContext,
    TargetFacts,
    Trainer,
    TrainError,
)
from overbrainer_prefect.trainers.holdout import HOLDOUT_DIR
from overbrainer_prefect.trainers.probe import parse_probe, probe_command
from overbrainer_prefect.trainers.staging import stored_inputs

log = logging.getLogger(__name__)

HF_CACHE_DIR = ".hf-cache"
"""Hugging Face cache on the target, under its work directory, shared by its runs."""

LOCAL_ONLY = (
    RECORD_FILE,
    MANIFEST_FILE,
    LOCK_FILE,
    "exports",
    "compares",
    "evaluations",
    HOLDOUT_DIR,  # the rows a run keeps out of its training
)
"""Entries of a local run directory that never leave this machine (with the
target's own records of the job: `RunContext.local_only`)."""


def create(
    runs: Runs,
    *,
    target: str,
    target_kind: str,
    workdir: str,
    trainer: str = "training",
    spec: Mapping[str, JsonValue] | None = None,
    flow_run_id: str | None = None,
    parent: str | None = None,
) -> RunRecord:
    """Creates a run: a new ID and its record saved as `preparing`, with the run
    directory it will have on the target (`workdir/<id>`). For an export or a
    compare, `parent` is the run it belongs to (and `runs` that run's children).

    Raises RecordIoError when the record cannot be saved.
    """
    run_id = new_run_id()
    record = RunRecord(
        id=run_id,
        target=target,
        target_kind=target_kind,
        trainer=trainer,
        created=rfc3339(),
        remote_dir=f"{workdir.rstrip('/')}/{run_id}",
        spec=dict(spec) if spec is not None else None,
        flow_run_id=flow_run_id,
        parent=parent,
    )
    runs.save(record)
    return record


async def probe(executor: Executor, python: str, modules: Sequence[str]) -> TargetFacts:
    """What the job environment on the target has: its GPUs and the versions of
    `modules`. Raises TrainError when the venv cannot run, ExecError when the
    target cannot be reached."""
    result = await executor.run(probe_command(python, modules), timeout=120)
    return parse_probe(python, result)


async def start(
    ctx: RunContext,
    trainer: Trainer,
    record: RunRecord,
    secrets: Mapping[str, SecretStr] | None = None,
) -> RunRecord:
    """Checks the target's job environment, prepares the run's files, copies them
    to the target and starts the job; the record is saved `running` with the job.

    When anything fails before the job started, the record is saved `failed` with
    the reason and the error is raised (TrainError, ExecError). When the job
    started but its record cannot be saved, nothing could find it again: it is
    cancelled, and the save error is raised.
    """
    try:
        job = await _launch(ctx, trainer, record, secrets or {})
    except (TrainError, ExecError, OSError) as error:
        record.state = RunState.FAILED
        record.message = str(error)
        record.ended = rfc3339()
        try:
            ctx.runs.save(record)
        except Exception as save_error:  # the original error matters more
            log.warning("cannot record run %s as failed: %s", record.id, save_error)
        raise
    record.job = job
    record.state = RunState.RUNNING
    record.started = rfc3339()
    if ctx.max_hours is not None:
        record.deadline = rfc3339(datetime.now(UTC) + timedelta(hours=ctx.max_hours))
    try:
        ctx.runs.save(record)
    except Exception:
        try:
            await ctx.executor.cancel(job)
        except ExecError as cancel_error:
            log.warning(
                "cannot cancel the job of run %s, which is not recorded: %s",
                record.id,
                cancel_error,
            )
        raise
    return record


async def _launch(
    ctx: RunContext, trainer: Trainer, record: RunRecord, secrets: Mapping[str, SecretStr]
) -> JobId:
    facts = ctx.probed.get(tuple(trainer.probe_modules))
    if facts is None:
        facts = await probe(ctx.executor, ctx.python, trainer.probe_modules)
    if ctx.check_facts is not None:
        ctx.check_facts(facts)
    trainer.check(facts)
    if ctx.runs.store.direct:  # a job that could not put its files would train for nothing
        await check_reach(ctx.executor, ctx.python, ctx.runs, record.id)
    local = ctx.runs.run_dir(record.id)
    job_ctx = JobContext(
        run_id=record.id,
        run_dir=record.remote_dir,
        cache_dir=f"{ctx.executor.workdir.rstrip('/')}/{HF_CACHE_DIR}",
        facts=facts,
    )
    trainer.prepare(local, job_ctx)
    commands = trainer.commands(job_ctx)
    job_secrets = dict(secrets)
    inputs = stored_inputs(local)
    if inputs:  # what the job reads from an object store: fetched by the job itself, first
        try:
            plan = await asyncio.to_thread(fetch_plan, ctx.runs, inputs)
        except StoreError as error:
            raise TrainError(f"cannot hand the job its inputs: {error}") from None
        job_secrets[FETCH_ENV] = SecretStr(plan)
        commands = [fetch_command(facts.python, record.remote_dir), *commands]
    await ctx.executor.upload(
        local, record.remote_dir, (*LOCAL_ONLY, *ctx.local_only, ctx.runs.record_file)
    )
    if ctx.runs.store.direct:
        try:
            await asyncio.to_thread(push_staged, ctx.runs, record.id, local, ctx.local_only)
        except StoreError as error:
            raise TrainError(f"cannot keep the job's files in the store: {error}") from None
    spec = JobSpec(
        run_id=record.id,
        run_dir=record.remote_dir,
        commands=commands,
        env=trainer.env(job_ctx),
        secrets=job_secrets,
    )
    return await ctx.executor.spawn(spec)
