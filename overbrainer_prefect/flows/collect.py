"""The collector: finishes the runs whose follower is gone.

While a run trains, its follower (the `train` flow run that started it, or an
`attach`) holds the run's follow lock. When the follower dies without a trace
(its worker was killed, the machine rebooted), no hook runs: the job keeps
running on its target, bounded by its max_hours, and its record says
`running` with nobody following it. The `collect` flow, scheduled every few
minutes, finds those runs and finishes them: it follows each job to its end
(at once when it has already ended), retrieves and verifies its files, and
records the outcome. A run whose flow run was cancelled while nothing could
run its cancellation hook has its job cancelled instead.

A run is never followed by two processes: the collector takes the run's lock
before it touches the run and leaves alone any run another live process holds.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from prefect import flow, get_run_logger
from prefect.artifacts import acreate_markdown_artifact
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import State, StateType
from prefect.exceptions import ObjectNotFound
from prefect.runtime import flow_run
from prefect.states import Cancelled, Crashed
from pydantic import BaseModel

from overbrainer_prefect.artifacts import (
    PrefectReporter,
    next_step,
    publish_metrics_table,
    publish_summary,
    summary_markdown,
)
from overbrainer_prefect.blocks import RunpodTarget, TargetBlock
from overbrainer_prefect.executors.base import ExecError
from overbrainer_prefect.flows.hooks import crashed_pod_job_hook
from overbrainer_prefect.flows.targets import UnknownTarget, load_target
from overbrainer_prefect.flows.train import follow_job, run_context, trainer_of
from overbrainer_prefect.runpod.context import PodError
from overbrainer_prefect.runpod.errors import RunpodError
from overbrainer_prefect.runs import lifecycle
from overbrainer_prefect.runs.ids import rfc3339
from overbrainer_prefect.runs.lifecycle import Outcome, RunError
from overbrainer_prefect.runs.lock import RunBusy, follow_lock, is_followed
from overbrainer_prefect.runs.records import RecordError
from overbrainer_prefect.runs.store import RunRecord, Runs, RunsError, RunState, subject
from overbrainer_prefect.trainers.base import Trainer
from overbrainer_prefect.trainers.compare import BASES_DIR, BaseExportTrainer, base_exports

COLLECT_ARTIFACT = "collected-runs"
"""Key of the markdown artifact in which each collect says what it did."""

CANCELLED_FLOW_RUN = frozenset({StateType.CANCELLING, StateType.CANCELLED})
"""States of a run's flow run that mean someone asked for the run to be cancelled."""

LEFT_BEHIND = frozenset({StateType.RUNNING, StateType.CANCELLING})
"""States of a run's flow run that its dead process left behind, which the
collector settles once it finished the run (releasing its deployment's
concurrency slot)."""

FINAL_FLOW_RUN = frozenset(
    {StateType.COMPLETED, StateType.FAILED, StateType.CRASHED, StateType.CANCELLED}
)
"""States of a flow run that will never touch its run again."""


class Collected(BaseModel):
    """What the collector did with one run."""

    run_id: str
    """The run, or the export or compare (`kind`), the collector finished."""
    target: str
    was: RunState
    kind: str = "run"
    """`run`, or an export or compare: `export E of run R`."""
    action: str
    state: RunState
    retrieved: bool = False
    files: int = 0
    message: str | None = None


@dataclass
class Finished:
    """A run the collector finished: its outcome, where it ran, and whether the
    collector cancelled its job (because its flow run had been cancelled)."""

    outcome: Outcome
    target: str
    cancelled: bool


def job_trainer(runs: Runs, record: RunRecord, block: TargetBlock) -> Trainer:
    """The trainer of any job, rebuilt from its record: a run's training, a run's
    export or compare, or a base model's export (an export with no run).
    Raises RunError when the record holds no usable spec."""
    if record.trainer == "compare":
        from overbrainer_prefect.flows.compare import compare_trainer_of

        return compare_trainer_of(runs, record, block)
    if record.trainer == "export" and record.parent is None:
        spec = record.spec or {}
        return BaseExportTrainer(
            str(spec.get("base_model")), str(spec.get("quant")), cpu_threads=block.cpu_threads
        )
    if record.trainer == "export":
        from overbrainer_prefect.flows.export import export_trainer_of

        return export_trainer_of(runs)(record, block)
    return trainer_of(record, block)


async def finish_run(
    runs: Runs,
    record: RunRecord,
    *,
    cancel: bool = False,
    reporter: Any = None,
    store: Runs | None = None,
) -> Finished:
    """Finishes a started run whose follower is gone. The caller holds the run's
    follow lock.

    With `cancel` (its flow run was cancelled and no hook finished it), the job
    is cancelled and what it left retrieved, best effort; a job that had already
    ended is followed instead, so its real outcome is recorded. Otherwise the job
    is followed to its end (at once when it has already ended), its files
    retrieved and verified, and the outcome recorded. The outcome's `retrieved`
    says whether everything the target held is here: only then may the target's
    copy go (a pod be deleted).

    `store` holds the record when it is an export or a compare (`runs` is then
    the runs directory its run is in).

    Raises UnknownTarget when the run's target block no longer exists, RunError
    (Unreachable, NotRetrieved, ...) when the job cannot be followed to its end,
    ExecError when the target cannot be reached to cancel the job.
    """
    store = store or runs
    target_ref, block = await load_target(record.target)
    trainer = job_trainer(runs, record, block)
    if isinstance(block, RunpodTarget):
        return await _finish_on_pod(store, record, block, trainer, cancel=cancel, reporter=reporter)
    executor = block.executor(target_ref)
    try:
        ctx = run_context(store, block, executor, reporter or lifecycle.LogReporter())
        if cancel:
            record, status, retrieved = await lifecycle.cancel(ctx, trainer, record)
            if status.kind == "cancelled":
                outcome = await lifecycle.watch(ctx, trainer, record)
                outcome.retrieved = retrieved
                return Finished(outcome, executor.description, cancelled=True)
        outcome = await follow_job(ctx, trainer, record)
        return Finished(outcome, executor.description, cancelled=False)
    finally:
        await executor.close()


async def _finish_on_pod(
    runs: Runs,
    record: RunRecord,
    block: RunpodTarget,
    trainer: Trainer,
    *,
    cancel: bool,
    reporter: Any,
) -> Finished:
    """`finish_run` for a run on a pod: its pod reached again from `pod.json`,
    the job followed (the lease renewed) or cancelled, its files retrieved and
    verified, then the pod deleted (confirmed). A run whose pod is gone is
    recorded from its local files, failed with the reason."""
    from overbrainer_prefect.flows.podjob import finish_on_pod, pod_account

    async with pod_account(block, runs, get_run_logger()) as ctx:
        outcome, where = await finish_on_pod(
            ctx, block, record, trainer, reporter or lifecycle.LogReporter(), cancel=cancel
        )
    cancelled = cancel and outcome.record.state == RunState.CANCELLED
    return Finished(outcome, where, cancelled=cancelled)


async def flow_run_state(flow_run_id: str | None) -> StateType | None:
    """The state of the flow run that created a run, None when the record names
    none or this Prefect server does not know it."""
    if flow_run_id is None:
        return None
    try:
        async with get_client() as client:
            found = await client.read_flow_run(UUID(flow_run_id))
    except (ObjectNotFound, ValueError):
        return None
    return found.state.type if found.state is not None else None


async def settle_flow_run(record: RunRecord, ended: str) -> StateType | None:
    """Ends the flow run that created `record` when its dead process left it
    `Running` (now `Crashed`) or `Cancelling` (now `Cancelled`), saying what
    became of its run (`ended`); this also frees its deployment's concurrency
    slot. Returns the state set, None when the flow run had moved on. A server
    that refuses is logged, not raised: the run itself is already recorded."""
    if record.flow_run_id is None:
        return None
    try:
        async with get_client() as client:
            found = await client.read_flow_run(UUID(record.flow_run_id))
            if found.state is None or found.state.type not in LEFT_BEHIND:
                return None
            message = (
                f"its process is gone; the collect flow run {flow_run.id} finished run "
                f"{record.id}: {ended}"
            )
            state: State[Any] = (
                Cancelled(message=message)
                if found.state.type == StateType.CANCELLING
                else Crashed(message=message)
            )
            result = await client.set_flow_run_state(found.id, state)
    except (ObjectNotFound, ValueError):
        return None
    except Exception as error:  # the run is recorded; this is only the flow run's label
        get_run_logger().warning(
            "cannot end flow run %s of run %s: %s", record.flow_run_id, record.id, error
        )
        return None
    if result.state is None or result.state.type != state.type:
        return None
    get_run_logger().info(
        "flow run %s of run %s: %s (%s)", record.flow_run_id, record.id, state.name, message
    )
    return state.type


def orphans(runs: Runs) -> list[tuple[Runs, RunRecord]]:
    """The runs, exports, compares and base model exports not ended that no
    live process follows, each with the store holding it: runs first, oldest
    first."""
    stores = [runs]
    records = runs.list(skipped=lambda _name, _error: None)
    for record in records:
        stores += [runs.children(record.id, kind) for kind in ("export", "compare")]
    bases = runs.root / BASES_DIR
    if bases.is_dir():
        stores += [base_exports(runs, key.name) for key in sorted(bases.iterdir())]
    found = []
    for store in stores:
        listed = records if store is runs else store.list(skipped=lambda _name, _error: None)
        found += [
            (store, record)
            for record in listed
            if not record.state.ended and not is_followed(store.run_dir(record.id))
        ]
    return found


async def collect_run(runs: Runs, record: RunRecord, store: Runs | None = None) -> Collected | None:
    """Takes the follow lock of a run (or of an export or compare, held in
    `store`) nobody follows and finishes it; returns what was done, or None
    when there was nothing to do (another process took it, it ended
    meanwhile, or it is still being prepared)."""
    logger = get_run_logger()
    store = store or runs
    state = await flow_run_state(record.flow_run_id)
    was = record.state
    name = subject(record)
    row = Collected(
        run_id=record.id,
        target=record.target,
        was=was,
        action="",
        state=was,
        kind=name if record.parent is not None or record.trainer != "training" else "run",
    )
    try:
        with follow_lock(store.run_dir(record.id), flow_run.id):
            record = store.load(record.id)  # as its last follower left it
            if record.state.ended:
                return None
            if record.job is None:
                if state is None or state not in FINAL_FLOW_RUN:
                    return None  # its flow run may still be preparing it
                if record.target_kind == "runpod":
                    await crashed_pod_job_hook(store, record, logger)  # its pods are deleted
                    record = store.load(record.id)
                if not record.state.ended:
                    record.state = RunState.FAILED
                    record.message = "interrupted before the job started"
                    record.ended = rfc3339()
                    store.save(record)
                logger.info(
                    "%s: its flow run is %s and its job never started: recorded failed",
                    name,
                    state.value.lower(),
                )
                return row.model_copy(
                    update={
                        "action": "failed: interrupted before the job started",
                        "state": record.state,
                        "message": record.message,
                    }
                )
            cancel = state in CANCELLED_FLOW_RUN
            logger.info(
                "%s is %s and nobody follows it: %s",
                name,
                record.state,
                "its flow run was cancelled, so its job is cancelled"
                if cancel
                else "following its job to its end",
            )
            training = record.parent is None and record.trainer == "training"
            reporter = PrefectReporter(logger, record.id) if training else None
            finished = await finish_run(runs, record, cancel=cancel, reporter=reporter, store=store)
    except RunBusy:
        return None
    except (
        UnknownTarget,
        RunError,
        ExecError,
        RecordError,
        RunsError,
        PodError,
        RunpodError,
    ) as error:
        logger.warning("%s: cannot finish it: %s", name, error)
        current = _state_of(store, record)
        return row.model_copy(
            update={"action": "left as it was", "state": current, "message": str(error)}
        )
    outcome = finished.outcome
    ended = outcome.record
    if ended.parent is None and ended.trainer == "training":
        await publish_metrics_table(ended.id, outcome.summary)
        await publish_summary(
            ended.id,
            summary_markdown(
                ended, finished.target, outcome.summary, outcome.files, next_step(ended)
            ),
        )
    files = f"{len(outcome.files)} files " + ("verified" if outcome.retrieved else "not retrieved")
    logger.info("%s %s: %s", name, ended.state, files)
    await settle_flow_run(ended, f"{ended.state}, {files}")
    return row.model_copy(
        update={
            "action": "job cancelled" if finished.cancelled else "followed to its end",
            "state": ended.state,
            "retrieved": outcome.retrieved,
            "files": len(outcome.files),
            "message": ended.message,
        }
    )


def _state_of(runs: Runs, record: RunRecord) -> RunState:
    try:
        return runs.load(record.id).state
    except (RecordError, RunsError):
        return record.state


def collected_markdown(rows: list[Collected], root: str) -> str:
    """The collect's report: one row a run it finished."""
    lines = [f"# Collected runs in `{root}`", ""]
    if not rows:
        lines.append("Nothing to collect: every run has ended or is followed.")
        return "\n".join(lines) + "\n"
    lines += [
        "| run | target | was | action | now | files | message |",
        "|---|---|---|---|---|---:|---|",
    ]
    for row in rows:
        files = f"{row.files} verified" if row.retrieved else "not retrieved"
        message = (row.message or "").replace("|", "\\|").replace("\n", " ")
        shown = row.run_id if row.kind == "run" else row.kind
        lines.append(
            f"| {shown} | {row.target} | {row.was} | {row.action} | **{row.state}** "
            f"| {files} | {message} |"
        )
    return "\n".join(lines) + "\n"


@flow(name="collect", persist_result=True)
async def collect(runs_dir: str | None = None) -> list[Collected]:
    """Finishes every run whose follower is gone: a run still `running` that no
    live process follows is followed to its end and its files retrieved and
    verified (its job cancelled instead when its flow run was cancelled); a run
    whose flow run ended before its job started is recorded failed. Runs another
    process follows are left alone. Publishes what it did as the
    `collected-runs` artifact and returns it.

    Raises RecordIoError when the runs directory cannot be read, and, once every
    other run is done, the first unexpected error one of them met.
    """
    runs = Runs(runs_dir)
    found = orphans(runs)
    results = await asyncio.gather(
        *(collect_run(runs, record, store) for store, record in found), return_exceptions=True
    )
    rows: list[Collected] = []
    errors: list[BaseException] = []
    for (store, record), result in zip(found, results, strict=True):
        if isinstance(result, BaseException):
            errors.append(result)
            rows.append(
                Collected(
                    run_id=record.id,
                    target=record.target,
                    was=record.state,
                    action="failed to collect",
                    state=_state_of(store, record),
                    message=f"{type(result).__name__}: {result}",
                )
            )
        elif result is not None:
            rows.append(result)
    await acreate_markdown_artifact(
        markdown=collected_markdown(rows, str(runs.root)),
        key=COLLECT_ARTIFACT,
        description="What the last collect did",
    )
    get_run_logger().info(
        "collected %d run(s) in %s%s",
        len(rows),
        runs.root,
        "".join(f"; {r.run_id}: {r.action}, {r.state}" for r in rows),
    )
    if errors:
        raise errors[0]
    return rows
