"""The `Target` contract, run the same way on every kind of target: this
machine, a real sshd on 127.0.0.1, a pool of two of them, and a Runpod pod
of the simulator (a real process tree running the real bootstrap and
watchdog). Like Prefect's `BlockStandardTestSuite` over every block of
prefect-aws, the same steps and the same assertions hold for each: the
driver above them never asks which one it holds. Only the core is used here: no Prefect server.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from overbrainer_prefect.blocks import (
    LocalTarget,
    RunpodCredentials,
    RunpodTarget,
    SshPool,
    SshPoolHost,
    SshTarget,
)
from overbrainer_prefect.runpod.bootstrap import TIMING_ENV
from overbrainer_prefect.runs.store import RunRecord, Runs, RunState
from overbrainer_prefect.steps import reporters
from overbrainer_prefect.steps import start as start_step
from overbrainer_prefect.steps.context import Outcome
from overbrainer_prefect.targets.base import JobNeed, NoBudget, Target
from tests.conftest import job_venv
from tests.runpod_sim import running_sim
from tests.runpod_sim.pods import SimPods
from tests.shelljobs import WRITE_METRICS, WRITE_OUTPUT, ShellTrainer, started_job
from tests.sshd import Sshd

pytestmark = pytest.mark.slow

FAST = (
    "watch_interval_s=1,lease_ttl_s=6,lease_renew_s=1,lease_tick_s=0.5,deadline_margin_s=4,"
    "arm_timeout_s=30,ready_poll_s=0.3,gone_interval_s=0.3,confirm_timeout_s=30"
)
LOG = logging.getLogger("contract")
TRAINS = f"{WRITE_METRICS}; sleep 2; {WRITE_OUTPUT}"
"""A job that writes metrics and an output after a while (long enough to be left)."""


@pytest.fixture(params=["local", "ssh", "pool", "runpod"])
def place(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Target]:
    """Each kind of target, ready to take jobs."""
    if request.param == "local":
        block: Any = LocalTarget(job_venv=str(job_venv()), work_dir=str(tmp_path / "work"))
        block.poll_seconds = 0.3
        yield block.target("overbrainer-local-target/contract", LOG)
    elif request.param == "ssh":
        with Sshd.create(tmp_path / "sshd") as sshd:
            block = SshTarget(
                host="127.0.0.1",
                port=sshd.port,
                user=sshd.user,
                private_key=sshd.client_key_text,
                host_key=sshd.host_key_line,
                work_dir=str(tmp_path / "work"),
                job_venv=str(job_venv()),
                poll_seconds=0.3,
                connect_timeout=5,
            )
            yield block.target("overbrainer-ssh-target/contract", LOG)
    elif request.param == "pool":
        with Sshd.create(tmp_path / "sshd0") as one, Sshd.create(tmp_path / "sshd1") as two:
            block = SshPool(
                hosts=[
                    SshPoolHost(
                        name=f"box{i}",
                        host="127.0.0.1",
                        port=sshd.port,
                        user=sshd.user,
                        private_key=sshd.client_key_text,
                        host_key=sshd.host_key_line,
                        work_dir=str(tmp_path / f"work{i}"),
                    )
                    for i, sshd in enumerate((one, two))
                ],
                job_venv=str(job_venv()),
                poll_seconds=0.3,
                connect_timeout=5,
                wait_minutes=0,
            )
            yield block.target("overbrainer-ssh-pool/contract", LOG)
    else:
        monkeypatch.setenv(TIMING_ENV, FAST)
        with running_sim() as sim, SimPods(tmp_path / "pods").attached(sim):
            block = RunpodTarget(
                credentials=RunpodCredentials(
                    api_key=sim.api_key, rest_url=sim.rest_url, graphql_url=sim.graphql_url
                ),
                job_venv=str(job_venv()),
                gpu_types=["NVIDIA RTX A4000"],
                image="overbrainer/test:1",
                max_hours=1.0,
                boot_grace_s=60.0,
                retrieve_grace_s=120.0,
                poll_seconds=0.3,
            )
            yield block.target("overbrainer-runpod-target/contract", LOG)


def new_record(place: Target, runs: Runs) -> RunRecord:
    return start_step.create(
        runs, target=place.ref, target_kind=place.kind, workdir=place.workdir, trainer="shell"
    )


def placed_job(place: Target, runs: Runs, script: str) -> Any:
    """Reserves, creates, places and starts a job; yields (placed, ctx, record)."""
    need = JobNeed(what="the contract's job")
    return started_job(place, runs, ShellTrainer(script), need, record_trainer="shell")


def test_a_job_is_placed_followed_retrieved_and_ended(place: Target, tmp_path: Path) -> None:
    runs = Runs(tmp_path / "runs")

    async def go() -> Outcome:
        async with placed_job(place, runs, TRAINS) as (placed, ctx, record):
            return await placed.follow(ctx, ShellTrainer(TRAINS), record)

    outcome = asyncio.run(go())
    assert outcome.record.state == RunState.SUCCEEDED and outcome.retrieved
    assert {f.path for f in outcome.files} >= {"output/adapter_model.safetensors", "job.log"}
    saved = runs.load(outcome.record.id)
    assert not place.leftover(runs, saved)  # nothing of it bills once its files are here


def test_a_job_left_by_its_follower_is_reached_again_from_its_record_alone(
    place: Target, tmp_path: Path
) -> None:
    runs = Runs(tmp_path / "runs")

    async def leave() -> RunRecord:
        async with placed_job(place, runs, TRAINS) as (_, _, record):
            return record  # the follower goes: the job keeps running

    record = asyncio.run(leave())
    assert runs.load(record.id).state == RunState.RUNNING
    assert "follow it again with the attach flow" in place.detached(runs, record)

    async def again() -> Outcome:
        async with place.reach(runs, runs.load(record.id)) as placed:
            assert placed is not None
            ctx = placed.context(runs, reporters.LogReporter())
            return await placed.follow(ctx, ShellTrainer(TRAINS), runs.load(record.id))

    outcome = asyncio.run(again())
    assert outcome.record.state == RunState.SUCCEEDED and outcome.retrieved
    assert not place.leftover(runs, runs.load(record.id))


def test_a_job_placed_but_never_started_is_abandoned_with_nothing_left(
    place: Target, tmp_path: Path
) -> None:
    runs = Runs(tmp_path / "runs")

    async def go() -> RunRecord:
        need = JobNeed(what="the contract's job")
        async with place.reserve(runs, need, NoBudget()) as reservation:
            record = new_record(place, runs)
            async with place.place(runs, record, reservation):
                pass  # its follower dies before the job starts
        return record

    record = asyncio.run(go())
    assert asyncio.run(place.abandon(runs, runs.load(record.id), "interrupted")) is True
    saved = runs.load(record.id)
    # a target answers facts; only the driver changes the record (it fails it)
    assert saved.state == RunState.PREPARING and saved.job is None
    assert not place.leftover(runs, saved)
