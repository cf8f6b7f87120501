"""A flow run from a deployment holds no process while its job runs: once the
job is started, the flow run suspends (Prefect's `suspend_flow_run`: its
process exits), the runs directory's one follower (the `follow` flow) follows
the job, with its live progress and loss curve in the suspended flow run's own
artifacts and log, and resumes the flow run once the job's record is final.
Resumed, the flow run starts again from its beginning (Prefect's behaviour)
and finds its job here, by its flow run's ID: it ends as a flow run that
followed its job itself would, with the same state, result and artifacts.

A flow run suspends only when something will resume it: it runs from a
deployment, it is not a subflow (Prefect cannot suspend those alone), and a
follower lives for its runs directory. The GPU budget's slots its pod holds
are handed over to the follower (`budget_leases`). Otherwise it follows its job itself, as
a flow called directly does; `OVERBRAINER_FOLLOW_IN_PROCESS=1` asks for that.

A suspended flow run waits until its job's bound (its deadline, plus
RESUME_MARGIN_S); a job its follower renews runs past `max_hours`, so the
follower holding the job keeps pushing that pause's end ahead
(`kept_suspended`): Prefect never fails a flow run whose job still runs.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import State, StateType
from prefect.flow_runs import asuspend_flow_run
from prefect.runtime import deployment, flow_run

from overbrainer_prefect.artifacts import PrefectReporter, remember_live_artifacts
from overbrainer_prefect.budget_leases import Leases
from overbrainer_prefect.cancelling import cancel_and_wait
from overbrainer_prefect.runs.lock import follower_of
from overbrainer_prefect.runs.store import RunRecord, Runs, subject
from overbrainer_prefect.steps.reporters import Reporter
from overbrainer_prefect.store.records import store_errors
from overbrainer_prefect.targets.base import Logger
from overbrainer_prefect.targets.sharing import current
from overbrainer_prefect.timestamps import parse_rfc3339

IN_PROCESS_ENV = "OVERBRAINER_FOLLOW_IN_PROCESS"
"""Set to 1 in a deployment's environment: its flow runs follow their jobs themselves."""

SUSPENDED_DIR = ".suspended"
"""Under a store of records: which job each suspended flow run waits for."""

RESUME_MARGIN_S = 2 * 3600
"""How long past its job's bound a suspended flow run may wait to be resumed:
the checkpoint hold, the retrieval and a follower taking over."""

RESUME_LEAD_ENV = "OVERBRAINER_RESUME_LEAD_S"
RESUME_LEAD_S = 30.0
"""How long before a pipeline's training ends (by its pace) its follower
resumes its flow run, so that a worker runs it again (its poll, 10 s by
default, and a new process) while the training ends, and the pod the next job
runs on does not wait for it. The environment's RESUME_LEAD_ENV (the
follower's) says otherwise; 0 resumes it at the training's last step."""

UNBOUNDED_S = 7 * 24 * 3600
"""How long a flow run whose job nothing bounds may wait suspended."""

EXTEND_LOOK_S = 600.0
"""How often the follower holding a job looks at its suspended flow run's pause end."""

EXTEND_WHEN_LEFT_S = RESUME_MARGIN_S / 2
"""A pause whose end is nearer than this is pushed to RESUME_MARGIN_S from now
(so, looked at every EXTEND_LOOK_S, it always has most of an hour left)."""


def _key(store: Runs, flow_run_id: str, kind: str, job_id: str) -> str:
    return store.key(SUSPENDED_DIR, flow_run_id, f"{kind}-{job_id}.json")


def suspended_job(store: Runs, kind: str, attempt: int = 0) -> str | None:
    """The ID of the `attempt`-th `kind` job (0: its first, -1: its last) this flow run
    started in `store` before it suspended, when it did (it has been
    resumed); None otherwise. Raises RecordIoError when the store cannot be
    read."""
    this = flow_run.id
    if this is None or deployment.id is None:
        return None
    under = store.key(SUSPENDED_DIR, this)
    with store_errors(store.store.where(under)):
        names = store.store.names(under)
    prefix = f"{kind}-"
    jobs = sorted(n[len(prefix) : -len(".json")] for n in names if n.startswith(prefix))
    return jobs[attempt] if -len(jobs) <= attempt < len(jobs) else None  # IDs sort by creation


def waited_for(store: Runs, record: RunRecord) -> bool:
    """Whether the flow run that started the job `record` suspended while it
    ran (so no process of it is left to run its hooks). False when that
    cannot be read."""
    return _waited(store, record) is not None


def waited_in_pipeline(store: Runs, record: RunRecord) -> bool:
    """Whether the flow run that suspended while the job `record` ran is a
    pipeline's, whose next job runs on the same place (a pod kept for it)."""
    return bool((_waited(store, record) or {}).get("pipeline"))


def _waited(store: Runs, record: RunRecord) -> dict[str, object] | None:
    if record.flow_run_id is None:
        return None
    key = _key(store, record.flow_run_id, record.trainer, record.id)
    try:
        found = store.store.read(key)
        data = json.loads(found.data) if found is not None else None
    except Exception:  # an unreadable store: as if it did not (the hook's grace is waited)
        return None
    return data if isinstance(data, dict) else None


def why_not_suspend(store: Runs, budget_held: bool = False) -> str | None:
    """Why this flow run follows its job itself rather than suspending (None:
    it suspends). A flow called directly says nothing (''). Raises
    RecordIoError when the runs directory cannot be read."""
    if flow_run.id is None or deployment.id is None:
        return ""
    if flow_run.parent_flow_run_id is not None:
        return ""  # a subflow: its parent's process runs it
    if os.environ.get(IN_PROCESS_ENV, "").strip() in ("1", "true", "yes"):
        return f"{IN_PROCESS_ENV} is set"
    if budget_held:
        return "its pipeline's pod holds the GPU budget's slots in this process while it lives"
    if follower_of(store) is None:
        return (
            f"no follower follows {store.top.where}: start one with "
            "`prefect deployment run follow/always` (see the README's deployments)"
        )
    return None


def resume_lead_s() -> float:
    """RESUME_LEAD_S, or what RESUME_LEAD_ENV says (a number of seconds >= 0)."""
    try:
        return max(0.0, float(os.environ.get(RESUME_LEAD_ENV) or RESUME_LEAD_S))
    except ValueError:
        return RESUME_LEAD_S


def timeout_s(deadline: str | None) -> int:
    """How long a flow run may wait suspended for a job bounded by `deadline`
    (RFC 3339, None: unbounded): until then, plus RESUME_MARGIN_S."""
    if deadline is None:
        return UNBOUNDED_S
    try:
        left = (parse_rfc3339(deadline) - datetime.now(UTC)).total_seconds()
    except ValueError:
        return UNBOUNDED_S
    return int(max(left, 0.0) + RESUME_MARGIN_S)


async def suspend(
    store: Runs,
    record: RunRecord,
    kind: str,
    reporter: Reporter,
    deadline: str | None,
    logger: Logger,
    *,
    leases: Leases | None = None,
) -> None:
    """Suspends this flow run while the job `record` runs: its live artifacts
    are opened here (the follower updates them), the job is kept as this flow
    run's, and the process exits (Prefect's Pause, which the caller lets
    through: its follow lock is released on the way out, once the flow run
    is suspended); the GPU budget's `leases` it holds for the job's pod are
    handed over to the follower. Returns, having done nothing else, when Prefect refuses to
    suspend (the flow run was resumed already): the caller follows the job.
    Raises RecordIoError when the store cannot be written (nothing suspended)."""
    this = flow_run.id
    assert this is not None  # why_not_suspend said it is a flow run
    if isinstance(reporter, PrefectReporter):
        await reporter.open()
        remember_live_artifacts(store, record.id, reporter)
    if leases is not None:
        leases.hand_over(store, record.id)
    sharing = current()
    key = _key(store, this, kind, record.id)
    with store_errors(store.store.where(key)):
        store.store.write(key, json.dumps({"job": record.id, "pipeline": bool(sharing)}).encode())
    if sharing is not None:  # the pipeline's pod stays for its next job: its follower hands it on
        sharing.handed_over = True
    follower = follower_of(store) or "the next follower"
    wait = timeout_s(deadline)
    logger.info(
        "%s runs; this flow run waits suspended, holding no process, while the follower "
        "(%s) follows it: it resumes once the job's files are verified (at most %.1f h from now). "
        "Cancel it as any flow run: its job is cancelled and what it ran on ended",
        subject(record),
        follower,
        wait / 3600,
    )
    await asuspend_flow_run(timeout=wait, key=f"job-{record.id}")


async def extend_pause(flow_run_id: str, logger: Logger) -> datetime | None:
    """Pushes the end of the pause of the suspended flow run `flow_run_id` to
    RESUME_MARGIN_S from now when it is nearer than EXTEND_WHEN_LEFT_S: its
    job still runs (the caller follows it). Returns the new end, None when
    nothing was changed (not suspended, or time enough left). A state another
    process set meanwhile (a cancel) is put back at once. Raises what the
    Prefect client raises when the server cannot be reached."""
    async with get_client() as client:
        found = await client.read_flow_run(UUID(flow_run_id))
        now = found.state
        if now is None or now.type != StateType.PAUSED:
            return None
        ends = now.state_details.pause_timeout
        right_now = datetime.now(UTC)
        if ends is None or (ends - right_now).total_seconds() > EXTEND_WHEN_LEFT_S:
            return None
        until = right_now + timedelta(seconds=RESUME_MARGIN_S)
        later: State[object] = State(
            type=StateType.PAUSED,
            name=now.name,
            message=f"its job still runs: it waits until {until:%Y-%m-%d %H:%M} UTC at most",
            state_details=now.state_details.model_copy(update={"pause_timeout": until}),
        )
        answer = await client.set_flow_run_state(found.id, later, force=True)
        if answer.state is None:
            return None
        # Prefect has no compare-and-swap of states: one set between the read and this
        # write (a cancel, a resume) is put back over the extension
        states = sorted(await client.read_flow_run_states(found.id), key=lambda s: s.timestamp)
        ours = next((i for i, s in enumerate(states) if s.id == answer.state.id), None)
        before = states[ours - 1] if ours else None
        if before is not None and before.id != now.id:
            logger.info(
                "flow run %s went %s while its pause was extended: kept %s",
                flow_run_id,
                before.name,
                before.name,
            )
            again: State[object] = State(
                type=before.type,
                name=before.name,
                message=before.message,
                state_details=before.state_details,
            )
            await client.set_flow_run_state(found.id, again, force=True)
            return None
    logger.info(
        "flow run %s: its job still runs, so it waits suspended until %s UTC at most",
        flow_run_id,
        f"{until:%Y-%m-%d %H:%M}",
    )
    return until


@asynccontextmanager
async def kept_suspended(store: Runs, record: RunRecord, logger: Logger) -> AsyncIterator[None]:
    """While the block follows the job `record`, keeps the flow run that waits
    suspended for it from timing out (`extend_pause`, first at once, then
    every EXTEND_LOOK_S). Nothing when no flow run waits for it. A server
    that cannot be reached is logged once and looked at again."""
    if record.flow_run_id is None or not waited_for(store, record):
        yield
        return
    task = asyncio.create_task(_keep(record.flow_run_id, record, logger))
    try:
        yield
    finally:
        await cancel_and_wait(task)


async def _keep(flow_run_id: str, record: RunRecord, logger: Logger) -> None:
    warned = False
    while True:
        try:
            await extend_pause(flow_run_id, logger)
        except Exception as error:
            if not warned:
                warned = True
                logger.warning(
                    "%s: cannot extend the pause of its flow run %s now (%s); tried again in %g s",
                    subject(record),
                    flow_run_id,
                    error,
                    EXTEND_LOOK_S,
                )
        await asyncio.sleep(EXTEND_LOOK_S)
