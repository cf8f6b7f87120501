"""The flow runs that started jobs, as the collector and the follower see them
on the Prefect server: whether one was cancelled, the state a dead one is left
in, whether one waits suspended for its job, and resuming it."""

from __future__ import annotations

from collections.abc import Collection
from datetime import UTC, datetime, timedelta
from uuid import UUID

from prefect import get_run_logger
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterId,
    FlowRunFilterState,
    FlowRunFilterStateType,
)
from prefect.client.schemas.objects import FlowRun, State, StateType
from prefect.client.schemas.responses import SetStateStatus
from prefect.exceptions import ObjectNotFound
from prefect.logging.loggers import flow_run_logger
from prefect.runtime import flow_run
from prefect.states import Cancelled, Crashed, Scheduled

from overbrainer_prefect.resume_here import HERE, RESUME_HOLD_S
from overbrainer_prefect.runs.store import RunRecord, subject
from overbrainer_prefect.store import LeaseLost
from overbrainer_prefect.store.held import check_guarded
from overbrainer_prefect.targets.base import Logger

CANCELLED_FLOW_RUN = frozenset({StateType.CANCELLING, StateType.CANCELLED})
"""States of a job's flow run that mean someone asked for the job to be cancelled."""

CANCELLING = frozenset({StateType.CANCELLING})
"""The state of a flow run asked to be cancelled, not cancelled yet."""

LEFT_BEHIND = frozenset({StateType.RUNNING, StateType.CANCELLING, StateType.PENDING})
"""States of a job's flow run that its dead process left behind, which the
collector settles once it finished the job (releasing its deployment's
concurrency slot)."""


async def cancelled_at(flow_run_id: str | None) -> float | None:
    """When the flow run that created a job was cancelled (or asked to be), as
    a Unix time; None when it was not, or the record names none this Prefect
    server knows."""
    found = await _flow_run(flow_run_id)
    state = found.state if found is not None else None
    if state is None or state.type not in CANCELLED_FLOW_RUN:
        return None
    return state.timestamp.timestamp()


CANCELLED_READ_AT_ONCE = 200
"""Flow runs asked about in one request by `cancelled_among` (the server's default limit)."""


async def cancelled_among(flow_run_ids: Collection[str | None]) -> dict[str, float]:
    """Which of the flow runs `flow_run_ids` were cancelled (or asked to be),
    with when (a Unix time), in one request to the server for every
    CANCELLED_READ_AT_ONCE of them (a follower asks about every job it
    follows each pass: one request a job would grow the server's load with
    them). Ids that are not a flow run's are skipped. Raises what the Prefect
    client raises when the server cannot be reached."""
    ids = list(dict.fromkeys(u for i in flow_run_ids if (u := _uuid(i)) is not None))
    found: dict[str, float] = {}
    async with get_client() as client:
        for start in range(0, len(ids), CANCELLED_READ_AT_ONCE):
            chunk = ids[start : start + CANCELLED_READ_AT_ONCE]
            for run in await client.read_flow_runs(
                flow_run_filter=FlowRunFilter(
                    id=FlowRunFilterId(any_=chunk),
                    state=FlowRunFilterState(
                        type=FlowRunFilterStateType(any_=sorted(CANCELLED_FLOW_RUN))
                    ),
                ),
                limit=len(chunk),
            ):
                if run.state is not None:
                    found[str(run.id)] = run.state.timestamp.timestamp()
    return found


def _uuid(text: str | None) -> UUID | None:
    """`text` as a flow run's id, None when it is none or not a UUID."""
    try:
        return UUID(text) if text is not None else None
    except ValueError:
        return None


async def settle_flow_run(
    record: RunRecord, ended: str, left: frozenset[StateType] = LEFT_BEHIND
) -> StateType | None:
    """Ends the flow run that created `record` when its dead process left it
    `Running` or `Pending` (now `Crashed`) or `Cancelling` (now `Cancelled`),
    those of `left` only, saying what became of its job (`ended`); this also
    frees its deployment's concurrency slot. Returns the state set, None when
    the flow run had moved on. A server that refuses is logged, not raised:
    the job is recorded."""
    if record.flow_run_id is None or record.flow_run_id == str(flow_run.id):
        return None
    try:
        async with get_client() as client:
            found = await client.read_flow_run(UUID(record.flow_run_id))
            if found.state is None or found.state.type not in left:
                return None
            message = (
                f"its process is gone; the collect flow run {flow_run.id} finished "
                f"{subject(record)}: {ended}"
            )
            state: State[object] = (
                Cancelled(message=message)
                if found.state.type == StateType.CANCELLING
                else Crashed(message=message)
            )
            result = await client.set_flow_run_state(found.id, state)
    except (ObjectNotFound, ValueError):
        return None
    except Exception as error:  # the job is recorded; this is only the flow run's label
        get_run_logger().warning(
            "cannot end flow run %s of %s: %s", record.flow_run_id, subject(record), error
        )
        return None
    if result.state is None or result.state.type != state.type:
        return None
    get_run_logger().info(
        "flow run %s of %s: %s (%s)", record.flow_run_id, subject(record), state.name, message
    )
    return state.type


async def suspended(flow_run_id: str | None) -> FlowRun | None:
    """The flow run `flow_run_id` when it waits suspended (or paused) now;
    None when it does not, or this Prefect server does not know it. Raises
    what the Prefect client raises when the server cannot be reached."""
    found = await _flow_run(flow_run_id)
    return (
        found if found is not None and found.state is not None and found.state.is_paused() else None
    )


async def _flow_run(flow_run_id: str | None) -> FlowRun | None:
    """The flow run `flow_run_id` as the server has it, None for none or one
    it does not know."""
    if flow_run_id is None:
        return None
    try:
        async with get_client() as client:
            return await client.read_flow_run(UUID(flow_run_id))
    except (ObjectNotFound, ValueError):
        return None


def job_logger(waiting: FlowRun | None, logger: Logger) -> Logger:
    """Where a followed job's lines go: the log of the flow run that waits
    suspended for it, else `logger`."""
    return flow_run_logger(waiting) if waiting is not None else logger


async def resume(record: RunRecord, logger: Logger, left_s: float | None = None) -> bool:
    """Resumes the flow run that started `record` when it waits suspended for
    it (the job's record is final): a worker runs it again (in the follower,
    the follower itself when it may: `resume_here`), and it ends as its job
    did. With `left_s`, the job has not ended: about that many seconds
    are left of it, and the flow run, started again, waits for its follower
    to record its end. Returns whether it was resumed. A server that refuses
    or cannot be reached is logged with what to do, never raised: the job is
    recorded, and the next pass of the follower tries again. Raises
    LeaseLost, resuming nothing, when this task lost the job's follow lock."""
    check_guarded(record.id)
    here = HERE.get()
    reserved = None
    try:
        waiting = await suspended(record.flow_run_id)
        if waiting is None:
            return False
        if here is not None and left_s is None:  # in the follower: it runs it itself when it may
            reserved = await here.reserve(waiting, logger)
            check_guarded(record.id)  # it may have waited for room: the job is still this task's
        async with get_client() as client:
            if reserved is None:
                answer = await client.resume_flow_run(waiting.id)
            else:  # held back from the worker's poll until the follower claims it
                hold = datetime.now(UTC) + timedelta(seconds=RESUME_HOLD_S)
                answer = await client.set_flow_run_state(
                    waiting.id, Scheduled(name="Resuming", scheduled_time=hold)
                )
    except BaseException as error:
        if here is not None and reserved is not None:
            here.release(reserved, logger)
        if isinstance(error, LeaseLost) or not isinstance(error, Exception):
            raise  # the job is another follower's now, or this task is cancelled
        logger.warning(
            "cannot resume flow run %s of %s now (%s); the follower tries again, or resume it "
            "from its page in the Prefect UI",
            record.flow_run_id,
            subject(record),
            error,
        )
        return False
    if answer.status != SetStateStatus.ACCEPT:
        if here is not None and reserved is not None:
            here.release(reserved, logger)
        reason = answer.details.reason if hasattr(answer.details, "reason") else answer.status
        logger.warning(
            "flow run %s of %s cannot be resumed: %s; %s is recorded %s",
            record.flow_run_id,
            subject(record),
            reason,
            subject(record),
            record.state,
        )
        return False
    if left_s is not None:
        logger.info(
            "%s: about %.0f s of training left: its flow run %s resumed now, so that it goes on "
            "as soon as the training ends",
            subject(record),
            left_s,
            record.flow_run_id,
        )
        return True
    logger.info("%s %s: its flow run %s resumed", subject(record), record.state, record.flow_run_id)
    if here is not None and reserved is not None:
        await here.take(waiting, reserved, logger)
    return True
