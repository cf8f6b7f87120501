"""Resumed flow runs run again in the follower's process (`resume_here`), on
the real (ephemeral) Prefect server: a follower that died while it ran some
has them put back to `Scheduled` by the next one, and only them (not a run a
worker claimed, not one that ended, not the live follower's own); one that
ended its term while it still runs some keeps them (the next follower leaves
them to its process while it lives, and runs them again once it died, on a
local and an object store); a flow run that may not run here (not from a
deployment) is left to the worker, untouched; one that may is resumed held
back from the worker's poll and claimed by the follower (no poll between the
two can take it); a suspended flow run whose
job runs past its pause's bound has that bound pushed ahead by its follower,
and still resumes. The whole way (a deployment
run resumed and run again by the follower) is tested in
test_suspended_runs.py."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path
from uuid import UUID

import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.client.schemas.objects import FlowRun, StateType
from prefect.flows import Flow
from prefect.settings import PREFECT_WORKER_PREFETCH_SECONDS
from prefect.states import Completed, Paused, Pending, Running, Scheduled, State, Suspended

from overbrainer_prefect import resume_here
from overbrainer_prefect.flowruns import resume
from overbrainer_prefect.resume_here import (
    CLAIM,
    HERE,
    HERE_DIR,
    Here,
    Recovered,
    Reserved,
    recover,
    recover_again,
    running_lock,
)
from overbrainer_prefect.runs import RunRecord, Runs, RunState
from overbrainer_prefect.store.lease import TTL_ENV
from overbrainer_prefect.suspension import RESUME_MARGIN_S, extend_pause

LOG = logging.getLogger("test_resume_here")


@flow(name="stand-in-resumed")
def stand_in() -> None:
    """A flow whose runs stand for resumed train flow runs."""


async def _run_through(*states: State[object]) -> UUID:
    """A flow run of the stand-in taken through `states`, in order (each accepted)."""
    async with get_client() as client:
        made = await client.create_flow_run(stand_in, state=Scheduled())
        for state in states:
            answer = await client.set_flow_run_state(made.id, state, force=True)
            assert answer.state is not None and answer.state.type == state.type, answer
        return made.id


async def state_of(flow_run_id: UUID) -> tuple[StateType, str]:
    async with get_client() as client:
        found = await client.read_flow_run(flow_run_id)
    assert found.state is not None
    return found.state.type, found.state.name or ""


def test_the_next_follower_puts_back_only_what_a_dead_follower_was_running(
    prefect_server: None, tmp_path: Path
) -> None:
    runs = Runs(tmp_path / "runs")

    def claimed() -> Pending[object]:
        return Pending(name=CLAIM)

    async def scenario() -> None:
        running_here = await _run_through(claimed(), Running())  # the dead follower ran it
        pending_here = await _run_through(claimed())  # claimed, its engine not started yet
        by_a_worker = await _run_through(Pending(), Running())  # a worker's own process runs it
        ended = await _run_through(claimed(), Running(), Completed())
        live_ones = await _run_through(claimed(), Running())  # the live follower runs it
        for flow_run_id, follower in (
            (running_here, "dead"),
            (pending_here, "dead"),
            (by_a_worker, "dead"),  # a marker left when the claim was refused, then it died
            (ended, "dead"),
            (live_ones, "live"),
        ):
            runs.store.write(
                runs.key(HERE_DIR, f"{flow_run_id}.json"),
                json.dumps({"follower": follower}).encode(),
            )

        assert await recover(runs, "live", LOG) == Recovered(put_back=2)
        assert await state_of(running_here) == (StateType.SCHEDULED, "Resuming")
        assert await state_of(pending_here) == (StateType.SCHEDULED, "Resuming")
        assert await state_of(by_a_worker) == (StateType.RUNNING, "Running")
        assert await state_of(ended) == (StateType.COMPLETED, "Completed")
        assert await state_of(live_ones) == (StateType.RUNNING, "Running")
        # the dead follower's markers are gone, the live one's stays
        assert runs.store.names(runs.key(HERE_DIR)) == [f"{live_ones}.json"]
        # looked at again: nothing left to put back
        assert await recover(runs, "live", LOG) == Recovered()

    asyncio.run(scenario())


def test_a_flow_run_not_from_a_deployment_is_left_to_the_worker_untouched(
    prefect_server: None, tmp_path: Path
) -> None:
    runs = Runs(tmp_path / "runs")
    here = Here(runs, {"stand-in-resumed": stand_in}, "live")

    async def scenario() -> None:
        waiting = await _run_through(Paused(reschedule=True), Scheduled(name="Resuming"))
        async with get_client() as client:
            found = await client.read_flow_run(waiting)
        assert await here.reserve(found, LOG) is None
        assert await state_of(waiting) == (StateType.SCHEDULED, "Resuming")

    asyncio.run(scenario())
    assert here.running() == 0
    assert not (runs.root / HERE_DIR).exists()


async def suspended_in_pool(
    pool: str, resumed: Flow[..., object], count: int, monkeypatch: pytest.MonkeyPatch
) -> list[UUID]:
    """`count` suspended flow runs of `resumed` from a deployment of the work
    pool `pool`, made with this process's follower: a flow run of the same
    flow from another deployment of that pool (PREFECT__FLOW_RUN_ID), so that
    a follower's `Here` may run them again."""
    async with get_client() as client:
        await client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
        flow_id = await client.create_flow(resumed)
        made: dict[str, list[UUID]] = {}
        for name, runs in (("follower", 1), ("train", count)):
            deployment_id = await client.create_deployment(
                flow_id=flow_id,
                name=name,
                work_pool_name=pool,
                entrypoint=f"tests/test_resume_here.py:{resumed.fn.__name__}",
            )
            made[name] = [
                (await client.create_flow_run_from_deployment(deployment_id)).id
                for _ in range(runs)
            ]
        monkeypatch.setenv("PREFECT__FLOW_RUN_ID", str(made["follower"][0]))  # the follower's
        for waiting in made["train"]:
            await client.set_flow_run_state(waiting, Running(), force=True)
            await client.set_flow_run_state(waiting, Suspended(timeout_seconds=600))
    return made["train"]


def ended_job(tmp_path: Path, waiting: UUID, run_id: str = "r1") -> RunRecord:
    """The record of a job that succeeded, whose flow run `waiting` waits suspended."""
    return RunRecord(
        id=run_id,
        target="local",
        created="2026-12-06T00:00:00Z",
        remote_dir=str(tmp_path),
        state=RunState.SUCCEEDED,
        flow_run_id=str(waiting),
    )


class PolledBeforeItsClaim(Here):
    """A follower's `Here` that, between its resume of a flow run and its
    claim, polls the work pool as a worker does (`polled`: what it got)."""

    pool = "resumed-here-pool"
    polled: list[UUID] | None = None

    async def take(self, waiting: FlowRun, reserved: Reserved, logger: logging.Logger) -> bool:
        soon = datetime.now(UTC) + timedelta(seconds=PREFECT_WORKER_PREFETCH_SECONDS.value())
        async with get_client() as client:
            found = await client.get_scheduled_flow_runs_for_work_pool(
                self.pool, scheduled_before=soon
            )
        self.polled = [r.flow_run.id for r in found]
        return await super().take(waiting, reserved, logger)


def test_a_resumed_flow_run_the_follower_runs_is_never_the_workers_to_take(
    prefect_server: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The follower resumes a suspended flow run of its own work pool held
    back from the worker's poll (past its prefetch) and claims it at once: a
    worker polling between the resume and the claim does not get it, the
    follower runs it to its end (in t8 of stop 46 a worker's poll took one
    between the two, and it ran in a new process instead)."""
    runs = Runs(tmp_path / "runs")
    here = PolledBeforeItsClaim(runs, {"stand-in-resumed": stand_in}, "live")

    async def scenario() -> None:
        [waiting] = await suspended_in_pool(PolledBeforeItsClaim.pool, stand_in, 1, monkeypatch)
        record = ended_job(tmp_path, waiting)
        token = HERE.set(here)
        try:
            assert await resume(record, LOG)
        finally:
            HERE.reset(token)
        assert here.polled is not None and waiting not in here.polled, here.polled
        assert await asyncio.to_thread(here.join, 60) == 0
        async with get_client() as client:
            states = sorted(await client.read_flow_run_states(waiting), key=lambda s: s.timestamp)
        after = [(s.type, s.name) for s in states][-4:]
        assert after == [
            (StateType.SCHEDULED, "Resuming"),
            (StateType.PENDING, CLAIM),
            (StateType.RUNNING, "Running"),
            (StateType.COMPLETED, "Completed"),
        ], after
        assert runs.store.names(runs.key(HERE_DIR)) == []  # its marker and lock are gone

    asyncio.run(scenario())


GATE = threading.Semaphore(0)
"""Each run of `gated` ends once the test releases this once."""


@flow(name="gated-resumed")
def gated() -> None:
    """A resumed flow run that runs until the test lets it end (at most a minute)."""
    GATE.acquire(timeout=60)


def test_a_full_follower_makes_a_resumed_flow_run_wait_for_room_then_leaves_it_to_the_worker(
    prefect_server: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A follower already running its most flow runs again (MAX_HERE, here 1)
    keeps the next one suspended while it waits for room (ROOM_WAIT_S), and
    runs it itself once the first ended, instead of handing it to the worker
    at once (a new process; at 0.75 s between jobs' ends that sent 36 of 100
    to the worker in bench/suspended_scale.py); one that finds no room within
    the bound is resumed for the worker, said in one line."""
    monkeypatch.setattr(resume_here, "MAX_HERE", 1)
    monkeypatch.setattr(resume_here, "ROOM_WAIT_S", 60.0)
    runs = Runs(tmp_path / "runs")
    here = Here(runs, {"gated-resumed": gated}, "live")

    async def states(flow_run_id: UUID) -> list[tuple[StateType, str | None]]:
        async with get_client() as client:
            found = await client.read_flow_run_states(flow_run_id)
        return [(s.type, s.name) for s in sorted(found, key=lambda s: s.timestamp)]

    async def scenario() -> None:
        first, second, third = await suspended_in_pool("room-pool", gated, 3, monkeypatch)
        token = HERE.set(here)
        try:
            assert await resume(ended_job(tmp_path, first, "r1"), LOG)
            assert here.running() == 1
            waits = asyncio.create_task(resume(ended_job(tmp_path, second, "r2"), LOG))
            await asyncio.sleep(1.5)
            assert not waits.done()
            assert (await state_of(second))[0] == StateType.PAUSED  # not handed to the worker
            GATE.release()  # the first ends: room for the second
            assert await asyncio.wait_for(waits, 60)
            assert (StateType.PENDING, CLAIM) in await states(second)
            assert here.running() == 1

            monkeypatch.setattr(resume_here, "ROOM_WAIT_S", 0.5)
            with caplog.at_level(logging.INFO, logger=LOG.name):
                assert await resume(ended_job(tmp_path, third, "r3"), LOG)
            assert await state_of(third) == (StateType.SCHEDULED, "Resuming")
            assert (StateType.PENDING, CLAIM) not in await states(third)
            said = [
                r.getMessage() for r in caplog.records if "left to the worker" in r.getMessage()
            ]
            assert said == [
                f"flow run {third} is left to the worker: this follower already runs 1 flow "
                "runs again (its most at once)"
            ], said
        finally:
            HERE.reset(token)
            GATE.release()  # the second ends
        assert await asyncio.to_thread(here.join, 60) == 0
        assert (await state_of(first))[0] == StateType.COMPLETED
        assert (await state_of(second))[0] == StateType.COMPLETED
        assert runs.store.names(runs.key(HERE_DIR)) == []

    asyncio.run(scenario())


ROOT = Path(__file__).resolve().parents[1]
LEASE_TTL_S = 2  # the lease a process of an object store's follower holds: lapses soon after death

STILL_RUNNING = textwrap.dedent(
    """
    import sys, time
    from overbrainer_prefect.resume_here import running_lock
    from overbrainer_prefect.runs import RunRecord, Runs, RunState
    runs = Runs(sys.argv[1])
    with runs.store.lock(running_lock(runs, sys.argv[2]), {"flow_run_id": "ended"}):
        print("running", flush=True)  # the flow run runs on in this process
        time.sleep(600)
    """
)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_flow_run_an_ended_followers_process_still_runs_is_left_to_it_until_it_dies(
    where: str,
    prefect_server: None,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A follower ended its term while a resumed flow run still runs in its
    process (which holds the flow run's lock): the next follower leaves it to
    that process, nothing runs twice; once that process died (its lock
    dropped, or its lease lapsed), the next follower runs it again."""
    runs_dir = (
        str(tmp_path / "runs") if where == "local" else request.getfixturevalue("s3").bucket_url()
    )
    runs = Runs(runs_dir)
    monkeypatch.setattr(resume_here, "RECOVER_AGAIN_S", 0.2)

    async def scenario() -> None:
        running = await _run_through(Pending(name=CLAIM), Running())
        runs.store.write(
            runs.key(HERE_DIR, f"{running}.json"), json.dumps({"follower": "ended"}).encode()
        )
        ended = subprocess.Popen(
            [sys.executable, "-c", STILL_RUNNING, runs_dir, str(running)],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT), TTL_ENV: str(LEASE_TTL_S)},
        )
        try:
            assert ended.stdout is not None and ended.stdout.readline().strip() == "running"
            said: set[str] = set()
            first = await recover(runs, "next", LOG, said)
            assert first == Recovered(still_running=1)
            assert await state_of(running) == (StateType.RUNNING, "Running")
            again = asyncio.create_task(recover_again(runs, "next", LOG, first, said))
            await asyncio.sleep(1.0)
            assert not again.done()  # its process lives: left to it, looked at again
            assert await state_of(running) == (StateType.RUNNING, "Running")
            os.kill(ended.pid, signal.SIGKILL)
            ended.wait(timeout=30)
            await asyncio.wait_for(again, 30)  # its lock dropped: it runs again
        finally:
            if ended.poll() is None:
                ended.kill()
                ended.wait()
        assert await state_of(running) == (StateType.SCHEDULED, "Resuming")
        assert runs.store.names(runs.key(HERE_DIR)) == []
        assert runs.store.holder(running_lock(runs, running)) is None

    asyncio.run(scenario())


def test_a_suspended_flow_run_whose_job_runs_past_its_bound_still_resumes(
    prefect_server: None,
) -> None:
    """A job its follower renews runs past the bound its flow run's pause was
    set to: the follower holding it pushes the pause's end ahead, so the
    flow run is resumed (not failed by Prefect) once the job ends; a pause
    not pushed fails as Prefect fails it."""

    async def suspended_for(seconds: int) -> UUID:
        async with get_client() as client:
            flow_id = await client.create_flow(stand_in)
            deployment_id = await client.create_deployment(flow_id=flow_id, name="paused")
            made = await client.create_flow_run_from_deployment(deployment_id)
            await client.set_flow_run_state(made.id, Running(), force=True)
            answer = await client.set_flow_run_state(
                made.id, Suspended(timeout_seconds=seconds, pause_key=f"job-{made.id}")
            )
            assert answer.state is not None and answer.state.type == StateType.PAUSED, answer
            return made.id

    async def resumed(flow_run_id: UUID) -> tuple[StateType, str]:
        async with get_client() as client:
            await client.resume_flow_run(flow_run_id)
        return await state_of(flow_run_id)

    async def scenario() -> None:
        kept, left = await suspended_for(3), await suspended_for(3)
        until = await extend_pause(str(kept), LOG)
        assert until is not None
        assert await extend_pause(str(kept), LOG) is None  # time enough left: nothing written
        async with get_client() as client:
            found = await client.read_flow_run(kept)
        assert found.state is not None and found.state.name == "Suspended"
        assert found.state.state_details.pause_key == f"job-{kept}"
        assert found.state.state_details.pause_timeout is not None
        left_s = (found.state.state_details.pause_timeout - datetime.now(UTC)).total_seconds()
        assert RESUME_MARGIN_S - 60 < left_s <= RESUME_MARGIN_S
        await asyncio.sleep(3.5)  # past the bound it was suspended with
        assert await resumed(kept) == (StateType.SCHEDULED, "Resuming")
        assert (await resumed(left))[0] == StateType.FAILED

    asyncio.run(scenario())
