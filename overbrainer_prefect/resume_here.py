"""Resumed flow runs run again in the follower's own process.

A suspended `train` (or `export`, `compare`, `evaluate`) flow run, once its
job's files are verified, has little left to do: read its job's record and
end as it ended. Resumed the plain way, it waits for a worker's poll and a new
Python process (seconds of a core each, minutes when a hundred jobs end
together on a small machine). So the follower claims it itself, as a worker
would (Prefect's `Pending`, which a worker cannot take from it; resumed held
back from the worker's poll, RESUME_HOLD_S, so that no poll takes it between
the resume and the claim), and runs it
in a thread of its own process with Prefect's own engine, from its
beginning, as the worker's process would have: same state, result,
artifacts and log.

It does so only where the worker would have run it the same way: a flow of
this package, from a deployment of the follower's own work pool, with the
same pull steps and job variables, whose environment is the follower's; at
most MAX_HERE at once (a verified job's flow run waits up to ROOM_WAIT_S for
one of them to end). Any other is left to the worker.

Each flow run run here leaves a marker in the runs directory and holds a lock
there (`running_lock`: a kernel lock on a local directory, a lease on an
object store) while it runs. A follower at its term's end hands the runs
directory over to its successor and waits for the flow runs its process
runs: the successor leaves them to it while their locks are held, so none
runs twice. One whose process died (its lock dropped or lapsed) is put back
to `Scheduled` by the follower that finds its marker, and runs again (it only
reads records).
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import Mapping
from contextlib import ExitStack
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

from prefect.client.orchestration import PrefectClient, get_client
from prefect.client.schemas.objects import FlowRun, StateDetails, StateType
from prefect.client.schemas.responses import (
    DeploymentResponse,
    OrchestrationResult,
    SetStateStatus,
)
from prefect.flow_engine import run_flow
from prefect.flows import Flow
from prefect.runtime import flow_run
from prefect.states import Pending, Scheduled

from overbrainer_prefect.runs.store import Runs
from overbrainer_prefect.store import Held, LeaseLost
from overbrainer_prefect.targets.base import Logger

MAX_HERE = 4
"""Resumed flow runs a follower runs at once; more are left to the worker."""

ROOM_WAIT_S = 5.0
"""How long a flow run about to be resumed waits for one of the MAX_HERE flow
runs already run here to end before it is left to the worker: one run here
ends in a second or two, while the worker's takes its poll and a new process
(about 3 s of a core), which slows the follower's next ones. Handing each run
over as soon as all MAX_HERE were busy made a cliff: jobs ending 0.75 s apart
sent 36 of 100 resumed runs to the worker and resume-p95 to 45.9 s
(bench/suspended_scale.py)."""

ROOM_LOOK_S = 0.1
"""How often a flow run waiting for room here looks again."""

HERE_DIR = ".resumed-here"
"""Under a runs directory: a marker per flow run a follower runs in its process."""

CLAIM = "ResumedByFollower"
"""The name of the `Pending` state by which a follower claims a resumed flow run."""

RESUME_HOLD_S = 60.0
"""How long a flow run the follower resumes to run it itself is held back from
the worker (its `Scheduled` state's time, past the worker's prefetch): the
follower claims it at once, so that the worker's poll cannot take it between
the resume and the claim; one whose claim fails runs on the worker after it."""

JOIN_S = 6 * 3600.0
"""The most a follower at its term's end waits for the flow runs its process
runs (its successor follows every job meanwhile, and leaves these to it): a
resumed flow run ends within minutes, unless it follows a job in-process (an
export of a resumed `train`, a subflow), which its own bound (`max_hours`)
ends first. Past it, they die with the process and run again."""

RECOVER_AGAIN_S = 30.0
"""How often a follower looks again at the flow runs an ended follower's
process still runs, to run again those whose process died meanwhile."""

Own = tuple[str | None, object, dict[str, Any]]
"""A follower's work pool, pull steps and job variables."""

AnyFlow = Flow[..., Any]
"""One of this package's flows, whatever its parameters."""

HERE: ContextVar[Here | None] = ContextVar("overbrainer_resume_here", default=None)
"""Set in the follower: where the flow runs it resumes may run again."""


@dataclass(frozen=True)
class Reserved:
    """A suspended flow run made ready to run here before its resume: its
    flow, its marker and its lock (`held`, released by closing it)."""

    flow_run_id: UUID
    flow: AnyFlow
    marker: str
    held: ExitStack


class Here:
    """The flow runs this process runs again (`flows`: this package's flows, by
    name), and the work pool, pull steps and job variables a deployment's
    flow run must have for that (the follower's own); none once the
    follower's lock `held` is lost (set once the follower holds it)."""

    def __init__(
        self,
        runs: Runs,
        flows: Mapping[str, AnyFlow],
        follower: str | None,
        held: Held | None = None,
    ) -> None:
        self.held = held
        self.runs = runs.top
        self.flows = dict(flows)
        self.follower = follower
        self._threads: dict[UUID, threading.Thread] = {}
        self._promised: set[UUID] = set()  # reserved, not yet taken or released
        self._mine: Own | None = None
        self._names: dict[UUID, str] = {}

    def running(self) -> int:
        """How many flow runs run here now."""
        self._threads = {k: t for k, t in self._threads.items() if t.is_alive()}
        return len(self._threads)

    def _full(self) -> bool:
        """Whether MAX_HERE flow runs run here or are about to."""
        return self.running() + len(self._promised) >= MAX_HERE

    async def _room(self, waiting: FlowRun, logger: Logger) -> bool:
        """Waits up to ROOM_WAIT_S for room for one more flow run here;
        whether there is (said when there is not)."""
        deadline = time.monotonic() + ROOM_WAIT_S
        while self._full():
            if time.monotonic() >= deadline:
                logger.info(
                    "flow run %s is left to the worker: this follower already runs %d flow "
                    "runs again (its most at once)",
                    waiting.id,
                    MAX_HERE,
                )
                return False
            await asyncio.sleep(ROOM_LOOK_S)
        return True

    async def reserve(self, waiting: FlowRun, logger: Logger) -> Reserved | None:
        """Makes ready to run the suspended flow run `waiting` in a thread of
        this process, before it is resumed, when it may run here (see the
        module): its lock taken, its marker written. When MAX_HERE already
        run here, it first waits up to ROOM_WAIT_S for one of them to end.
        None when it may not; then it is resumed the plain way, for the
        worker. Raises nothing: a refusal, or a server or a store that cannot
        be reached, leaves it to the worker."""
        if self.held is not None and self.held.lost:  # another follower runs them now
            return None
        if not await self._room(waiting, logger):  # full: no need to ask the server about it
            return None
        if self.held is not None and self.held.lost:
            return None
        self._promised.add(waiting.id)  # no await since the room was found
        reserved = None
        try:
            reserved = await self._reserve(waiting, logger)
        finally:  # a refusal, or this task cancelled: the room is free again
            if reserved is None:
                self._promised.discard(waiting.id)
        return reserved

    async def _reserve(self, waiting: FlowRun, logger: Logger) -> Reserved | None:
        """`reserve` once there is room here."""
        held = ExitStack()  # its lock, held from before its marker until its marker is gone
        locked = False
        marker = self.runs.key(HERE_DIR, f"{waiting.id}.json")
        try:
            flow = await self._flow_for(waiting)
            if flow is None:
                return None
            lock = running_lock(self.runs, waiting.id)
            with ExitStack() as taking:  # raises Busy: nothing held, nothing removed
                taking.enter_context(self.runs.store.lock(lock, {"flow_run_id": self.follower}))
                held.callback(self.runs.store.delete, lock)  # last: once it is released
                held.enter_context(taking.pop_all())
            locked = True
            self.runs.store.write(marker, json.dumps({"follower": self.follower}).encode())
        except Exception as error:
            if locked:  # its marker may be written: removed, then its lock
                self._let_go(marker, held, logger)
            logger.warning("flow run %s is left to the worker: %s", waiting.id, error)
            return None
        return Reserved(waiting.id, flow, marker, held)

    def release(self, reserved: Reserved, logger: Logger) -> None:
        """Lets go of a flow run reserved and not taken (its resume refused)."""
        self._promised.discard(reserved.flow_run_id)
        self._let_go(reserved.marker, reserved.held, logger)

    async def take(self, waiting: FlowRun, reserved: Reserved, logger: Logger) -> bool:
        """Claims the flow run `waiting`, reserved before it was resumed and
        just resumed (`Scheduled`, held back from the worker RESUME_HOLD_S),
        as a worker would (`Pending`, CLAIM), and runs it in a thread of this
        process; returns whether it does. Raises nothing: a claim refused or
        a server that cannot be reached lets it go, and the worker runs it
        once its hold ends."""
        try:
            async with get_client() as client:
                answer: OrchestrationResult[object] = await client.set_flow_run_state(
                    waiting.id,
                    Pending(  # to start now, not at the hold's end its Scheduled state had
                        name=CLAIM,
                        message=f"run again by the follower {self.follower}",
                        state_details=StateDetails.model_validate(
                            {"scheduled_time": datetime.now(UTC)}
                        ),
                    ),
                )
        except Exception as error:
            self.release(reserved, logger)
            logger.warning("flow run %s is left to the worker: %s", waiting.id, error)
            return False
        if answer.status != SetStateStatus.ACCEPT or answer.state is None:
            self.release(reserved, logger)
            return False
        claimed = waiting.model_copy(update={"state": answer.state})  # as the server has it now
        thread = threading.Thread(
            target=self._run,
            args=(reserved.flow, claimed, reserved.marker, reserved.held, logger),
            name=f"flow-run-{waiting.id}",
            daemon=True,
        )
        self._threads[waiting.id] = thread
        self._promised.discard(reserved.flow_run_id)
        thread.start()  # a new thread starts with an empty context: no flow run of this one's
        logger.info("flow run %s runs again in this follower's process", waiting.id)
        return True

    def _run(
        self, flow: AnyFlow, claimed: FlowRun, marker: str, held: ExitStack, logger: Logger
    ) -> None:
        try:
            # as a worker's process runs it: its parameters from the flow run, then its engine
            started = run_flow(flow, flow_run=claimed, return_type="state")
            state = asyncio.run(started) if asyncio.iscoroutine(started) else started
            logger.info("flow run %s: %s", claimed.id, getattr(state, "name", state))
        except BaseException as error:  # its engine recorded its end; this thread just ends
            logger.warning("flow run %s ended here with %r", claimed.id, error)
        finally:
            self._let_go(marker, held, logger)

    def _let_go(self, marker: str, held: ExitStack, logger: Logger) -> None:
        """Removes a flow run's marker, then releases and removes its lock."""
        try:
            self.runs.store.delete(marker)
        except Exception as error:  # the next follower finds its flow run final
            logger.warning("cannot remove %s: %s", self.runs.store.where(marker), error)
        finally:
            try:
                held.close()
            except Exception as error:  # a lock left expires, or drops with this process
                logger.warning("cannot release the lock of %s: %s", marker, error)

    def join(self, timeout_s: float = JOIN_S) -> int:
        """Waits up to `timeout_s` for the flow runs running here; returns how
        many still run (they die with this process: their locks drop, and the
        follower that finds their markers runs them again)."""
        deadline = time.monotonic() + timeout_s
        for thread in list(self._threads.values()):
            thread.join(max(0.0, deadline - time.monotonic()))
        return self.running()

    async def wait_out(self, logger: Logger) -> None:
        """The follower's last act: waits (at most JOIN_S) for the flow runs its
        process runs, saying so; the next follower leaves them to it meanwhile,
        and runs again those still running past it. Never raises."""
        running = self.running()
        if running:
            logger.info(
                "%d flow run(s) still run in this follower's process: it waits for them to end "
                "(the next follower leaves them to it)",
                running,
            )
        if await asyncio.to_thread(self.join):
            logger.warning(
                "flow runs still run in this follower's process after %g h: they end with it, and "
                "the next follower runs them again",
                JOIN_S / 3600,
            )

    async def _flow_for(self, waiting: FlowRun) -> AnyFlow | None:
        """This package's flow of `waiting` when it may run here, else None."""
        if waiting.deployment_id is None:
            return None
        async with get_client() as client:
            name = self._names.get(waiting.flow_id)
            if name is None:
                name = self._names[waiting.flow_id] = (await client.read_flow(waiting.flow_id)).name
            flow = self.flows.get(name)
            if flow is None:
                return None
            theirs = await client.read_deployment(waiting.deployment_id)
            mine = await self._own(client)
        if theirs.entrypoint is None or theirs.entrypoint.rsplit(":", 1)[-1] != flow.fn.__name__:
            return None
        pool, pull, variables = mine
        wanted = {**(theirs.job_variables or {}), **(waiting.job_variables or {})}
        env = {**(variables.get("env") or {}), **(wanted.pop("env", None) or {})}
        same_env = all(os.environ.get(k) == (None if v is None else str(v)) for k, v in env.items())
        rest = {k: v for k, v in variables.items() if k != "env"}
        if theirs.work_pool_name != pool or theirs.pull_steps != pull or wanted != rest:
            return None
        return flow if same_env else None

    async def _own(self, client: PrefectClient) -> Own:
        """The work pool, pull steps and job variables of this follower."""
        if self._mine is None:
            this = await client.read_flow_run(UUID(str(flow_run.id)))
            found: DeploymentResponse | None = (
                await client.read_deployment(this.deployment_id) if this.deployment_id else None
            )
            variables = {**((found.job_variables if found else None) or {})}
            variables.update(this.job_variables or {})
            self._mine = (
                found.work_pool_name if found else None,
                found.pull_steps if found else None,
                variables,
            )
        return self._mine


def running_lock(runs: Runs, flow_run_id: UUID | str) -> str:
    """The key of the lock a flow run run in a follower's process holds while it runs."""
    return runs.top.key(HERE_DIR, f"{flow_run_id}.lock")


@dataclass(frozen=True)
class Recovered:
    """What `recover` did: flow runs put back to `Scheduled`, and those left
    to the process of an ended follower that still runs them."""

    put_back: int = 0
    still_running: int = 0


async def recover(
    runs: Runs,
    follower: str | None,
    logger: Logger,
    said: set[str] | None = None,
    held: Held | None = None,
) -> Recovered:
    """Puts back to `Scheduled` the flow runs a dead follower was running again
    in its process (its markers whose lock no live process holds; `Pending`
    or `Running` still, claimed by it), so that they run again; removes the
    markers of those that ended. Those still run by an ended follower's
    process (their lock held) are left to it, said once (`said`: the
    markers already said). Each is done only while this follower still holds
    the runs directory's lock `held`: once it is lost it stops at once and
    says so. Raises nothing: what cannot be read now is looked at again."""
    top = runs.top
    put_back = still = 0
    said = set() if said is None else said
    try:
        names = top.store.names(top.key(HERE_DIR))
    except Exception as error:
        logger.warning("cannot read %s: %s", top.store.where(top.key(HERE_DIR)), error)
        return Recovered()
    for name in names:
        if not name.endswith(".json"):
            continue
        marker = top.key(HERE_DIR, name)
        try:
            found = top.store.read(marker)
            holder = json.loads(found.data).get("follower") if found is not None else None
            if holder == follower:
                continue
            flow_run_id = UUID(name.removesuffix(".json"))
            running = top.store.holder(running_lock(top, flow_run_id))
            if running is not None:
                still += 1
                if name not in said:
                    said.add(name)
                    logger.info(
                        "flow run %s still runs in the process of the follower %s, which ended "
                        "its term (%s): left to it",
                        flow_run_id,
                        holder,
                        running,
                    )
                continue
            if held is not None:
                held.check()
            async with get_client() as client:
                states = sorted(
                    await client.read_flow_run_states(flow_run_id), key=lambda s: s.timestamp
                )
                now = states[-1] if states else None
                claims = [s for s in states if s.type == StateType.PENDING]
                ours = bool(claims) and claims[-1].name == CLAIM
                if now is not None and now.type in (StateType.PENDING, StateType.RUNNING) and ours:
                    if held is not None:
                        held.check()  # another follower may run it now: never put it back then
                    await client.set_flow_run_state(
                        flow_run_id,
                        Scheduled(
                            name="Resuming",
                            message=f"its follower {holder} died while it ran it: it runs again",
                        ),
                        force=True,
                    )
                    put_back += 1
                    logger.info(
                        "flow run %s was run again by the follower %s, which died: it runs again",
                        flow_run_id,
                        holder,
                    )
            if held is not None:
                held.check()
            top.store.delete(marker)
            top.store.delete(running_lock(top, flow_run_id))
        except LeaseLost as lost:
            logger.warning(
                "another follower took the runs directory %s at %s: this one stops recovering "
                "its flow runs (%s)",
                top.where,
                lost.at,
                lost.why,
            )
            break
        except Exception as error:
            still += 1  # looked at again
            logger.warning("cannot look at %s now: %s", top.store.where(marker), error)
    return Recovered(put_back, still)


async def recover_again(
    runs: Runs,
    follower: str | None,
    logger: Logger,
    first: Recovered,
    said: set[str],
    held: Held | None = None,
) -> None:
    """While `recover` left flow runs to an ended follower's process (`first`;
    `said`: those it said), looks again every RECOVER_AGAIN_S: one whose
    process died meanwhile (its lock dropped or lapsed) runs again. Ends when
    none is left (or cancelled, with the follower's term)."""
    left = first.still_running
    while left and not (held is not None and held.lost):
        await asyncio.sleep(RECOVER_AGAIN_S)
        left = (await recover(runs, follower, logger, said, held)).still_running
