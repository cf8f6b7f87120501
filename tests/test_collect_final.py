"""Every run is final after one `collect`, whatever its follower left.

A follower SIGKILLed at each point it can die leaves the records that point
leaves (built here on the real store, against the Runpod simulator, without
training anything: no test waits for a model), and the pod is then gone at
its watchdog's bound, as it is on Runpod when nobody collects in time. One
`collect` (a real flow on the real Prefect server) must end the run in a
final state with a message that says what happened, record the pod's end in
`pod.json`, and leave neither the run's host key secret nor its client key.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr

from overbrainer_prefect.executors.base import JOB_LOG, JobId
from overbrainer_prefect.flows import collect
from overbrainer_prefect.runpod import PodRequest, RunpodClient
from overbrainer_prefect.runpod.pod import Attempt, PodRecord, PodState
from overbrainer_prefect.runs.lock import follow_lock
from overbrainer_prefect.runs.manifest import MANIFEST_FILE
from overbrainer_prefect.runs.store import RunRecord, Runs, RunState
from overbrainer_prefect.steps import start as start_step
from overbrainer_prefect.targets.runpod.keys import CLIENT_KEY, SSH_DIR, generate, host_key_secret
from overbrainer_prefect.timestamps import rfc3339
from overbrainer_prefect.trainers.spec import TrainingSpec
from tests.flowrun import run
from tests.runpod_fixtures import target
from tests.runpod_sim import RunpodSim, running_sim
from tests.s3server import S3Server
from tests.test_watchdog import A4000

BOOT_GRACE_S = 60.0
CREATED_AGO_S = 600.0  # the run and its pod were made this long before the collect


@pytest.fixture
def sim() -> Iterator[RunpodSim]:
    with running_sim() as simulator:
        yield simulator


@pytest.fixture(params=["local", "s3"])
def runs_dir(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A runs directory on this machine, or in a bucket of the real S3 server."""
    if request.param == "s3":
        server: S3Server = request.getfixturevalue("s3")
        return server.bucket_url()
    return str(tmp_path / "runs")


def test_a_collect_that_leaves_a_run_to_its_live_follower_says_who_and_until_when(
    prefect_server: None, runs_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    runs = Runs(runs_dir)
    record = start_step.create(
        runs, target="overbrainer-local-target/x", target_kind="local", workdir="/w"
    )
    with follow_lock(runs, record.id, "its follower"), caplog.at_level(logging.INFO):
        assert run(collect(runs_dir=runs_dir)) == []
    said = [r.getMessage() for r in caplog.records if "collected 0 run(s)" in r.getMessage()]
    assert len(said) == 1, said
    assert f"run {record.id} is followed by pid {os.getpid()} on " in said[0], said
    assert "flow run its follower" in said[0], said
    assert "; the next collect takes it if that follower is gone" in said[0], said
    if runs_dir.startswith("s3://"):  # a lease: until it expires, unless renewed
        assert re.search(r" until \d{4}-\d\d-\d\dT", said[0]), said
    else:  # a lock the kernel drops with its holder
        assert " while it lives;" in said[0], said


def ago(seconds: float) -> str:
    return rfc3339(datetime.fromtimestamp(time.time() - seconds, UTC))


async def _api(sim: RunpodSim, body: Any) -> Any:
    async with RunpodClient(SecretStr(sim.api_key), sim.rest_url, sim.graphql_url) as client:
        return await body(client)


@dataclass(frozen=True)
class Point:
    """Where a follower died: what its records said then, and what one
    collect must leave (the run's state, a phrase of its message, a phrase of
    why pod.json says its pod was deleted)."""

    name: str
    state: RunState
    message: str
    deleted_for: str
    started: bool = False
    ended: RunState | None = None
    pod: dict[str, Any] = field(default_factory=dict)
    """pod.json's fields; those named `*_unix` in seconds from the collect."""
    made: bool = True
    """The pod was created (and is gone by now)."""
    kept: bool = False
    """Its files were retrieved and verified (a manifest here)."""
    by: str = "watchdog"
    """Who pod.json says deleted it (`unknown`: nothing here tells its watchdog from Runpod)."""


POINTS = [
    Point(
        "before create",
        RunState.FAILED,
        "interrupted before the job started",
        "",
        pod={"state": PodState.CREATING},
        made=False,
    ),
    Point(
        "after create",
        RunState.FAILED,
        "interrupted before the job started",
        "no job started within boot_grace",
        pod={"state": PodState.BOOTING},
    ),
    Point(
        "after SSH ready",
        RunState.FAILED,
        "interrupted before the job started",
        "no job started within boot_grace",
        pod={"state": PodState.READY, "deadline_unix": 3000},
    ),
    Point(
        "while training",
        RunState.FAILED,
        "max_hours reached",
        "max_hours reached",
        started=True,
        pod={"state": PodState.RUNNING, "deadline_unix": -60},
    ),
    Point(
        "during retrieval",
        RunState.FAILED,
        "retrieve_grace",
        "retrieve_grace",
        by="unknown",
        started=True,
        pod={"state": PodState.RUNNING, "deadline_unix": 3000},
    ),
    Point(
        "after verify",
        RunState.SUCCEEDED,
        "",
        "retrieved and verified",
        started=True,
        ended=RunState.SUCCEEDED,
        pod={"state": PodState.RUNNING, "retrieved_marked": True, "deadline_unix": 3000},
        kept=True,
    ),
    Point(
        "between two jobs of a pipeline",
        RunState.SUCCEEDED,
        "",
        "no next job of the pipeline started within next_job_grace",
        started=True,
        ended=RunState.SUCCEEDED,
        pod={
            "state": PodState.READY,
            "deadline_unix": 3000,
            "between_unix": -70,  # its bound passed 10 s ago
            "next_job_grace_s": 60.0,
        },
        kept=True,
    ),
]


def left_by_a_dead_follower(sim: RunpodSim, runs: Runs, name: str, point: Point) -> RunRecord:
    """A run on the target `name` as a follower killed at `point` leaves it:
    its record and its pod.json as they were then, its client key here and
    its host key secret in the account, and its pod (when it was made) made in
    the simulator, then deleted by its watchdog (gone when the collect runs)."""
    record = start_step.create(
        runs,
        target=f"overbrainer-runpod-target/{name}",
        target_kind="runpod",
        workdir="/w",
        spec=TrainingSpec(base_model="org/model", datasets=["org/data"]).model_dump(mode="json"),
    )
    record.created = ago(CREATED_AGO_S)
    if point.started:
        record.job = JobId(dir=record.remote_dir, pid=4321)
        record.state = RunState.RUNNING
    if point.ended is not None:
        record.state = point.ended
        record.ended = ago(200)
        record.message = "the job succeeded"
    runs.save(record)
    if point.kept:
        runs.write_bytes(record.id, MANIFEST_FILE, b"[]\n")
        runs.write_bytes(record.id, JOB_LOG, b"done\n")
    generate(runs, record.id)
    secret = host_key_secret(record.id)

    async def make(client: RunpodClient) -> str | None:
        await client.create_secret(secret, SecretStr("host key"))
        if not point.made:
            return None
        made = await client.create_pod(
            PodRequest(name=f"ob-{record.id}-a1", image="x:1", gpu_type_id=A4000)
        )
        await client.delete_pod(made.id)  # its watchdog, at its bound
        return made.id

    pod_id = asyncio.run(_api(sim, make))
    attempts = (
        []
        if pod_id is None
        else [
            Attempt(
                name=f"ob-{record.id}-a1",
                gpu_type_id=A4000,
                at=ago(CREATED_AGO_S),
                result="created",
                pod_id=pod_id,
            )
        ]
    )
    PodRecord(
        run_id=record.id,
        pod_id=pod_id,
        attempts=attempts,
        host_key="ssh-ed25519 AAAA",
        host_key_secret=secret,
        created_unix=time.time() - CREATED_AGO_S,
        boot_grace_s=BOOT_GRACE_S,
        retrieve_grace_s=120.0,
        cost_per_hour=0.25,
        pipeline_job=record.id if point.pod.get("between_unix") else None,
        **{
            key: (int if key == "deadline_unix" else float)(time.time() + value)
            if key.endswith("_unix")
            else value
            for key, value in point.pod.items()
        },
    ).save(runs)
    return runs.load(record.id)


def assert_final_and_clean(sim: RunpodSim, runs: Runs, record: RunRecord) -> RunRecord:
    saved = runs.load(record.id)
    assert saved.state.ended, saved
    pod = PodRecord.load(runs, record.id)
    assert pod is not None and pod.gone, pod
    assert pod.secret_deleted, pod
    assert host_key_secret(record.id) not in sim.secret_names()
    assert not (runs.run_dir(record.id) / SSH_DIR / CLIENT_KEY).exists()
    return saved


@pytest.mark.parametrize("point", POINTS, ids=[p.name for p in POINTS])
def test_a_run_whose_follower_died_and_whose_pod_is_gone_at_its_bound_is_final_after_one_collect(
    prefect_server: None, sim: RunpodSim, tmp_path: Path, point: Point
) -> None:
    runs = Runs(tmp_path / "runs")
    name = target(sim, boot_grace_s=BOOT_GRACE_S)
    record = left_by_a_dead_follower(sim, runs, name, point)
    rows = run(collect(runs_dir=str(runs.root)))
    assert [(r.run_id, r.state) for r in rows] == [(record.id, point.state)], rows
    saved = assert_final_and_clean(sim, runs, record)
    assert point.message in (saved.message or ""), saved.message
    pod = PodRecord.load(runs, record.id)
    assert pod is not None
    if point.made:
        assert pod.state == PodState.DELETED and pod.deleted_by == point.by, pod
        assert point.deleted_for in (pod.delete_reason or ""), pod.delete_reason


def test_a_record_another_process_changes_under_the_collect_is_read_again_and_the_run_ends(
    prefect_server: None, sim: RunpodSim, tmp_path: Path
) -> None:
    """The pod's reaper (another process) records it deleted at its boot bound
    while the collect deletes it too: the collect's own write of pod.json then
    meets a version it did not read. It reads it again and decides again: the
    run ends failed, and nothing of its pod is left."""
    runs = Runs(tmp_path / "runs")
    name = target(sim, boot_grace_s=BOOT_GRACE_S)
    ready = next(p for p in POINTS if p.name == "after SSH ready")
    record = left_by_a_dead_follower(sim, runs, name, replace(ready, made=False))
    pod = PodRecord.load(runs, record.id)
    assert pod is not None

    async def make(client: RunpodClient) -> str:
        made = await client.create_pod(
            PodRequest(name=f"ob-{record.id}-a1", image="x:1", gpu_type_id=A4000)
        )
        return made.id

    pod.pod_id = asyncio.run(_api(sim, make))
    pod.save(runs)

    def reaper_writes(_deleted: Any) -> None:  # the reaper records the same delete first
        theirs = PodRecord.load(runs, record.id)
        assert theirs is not None
        theirs.mark_deleted("reaper", "no job started within boot_grace (the reaper)")
        theirs.save(runs)

    sim.on_pod_delete = reaper_writes
    rows = run(collect(runs_dir=str(runs.root)))
    assert [(r.run_id, r.state) for r in rows] == [(record.id, RunState.FAILED)], rows
    saved = assert_final_and_clean(sim, runs, record)
    assert saved.message == "interrupted before the job started"


def test_a_client_key_whose_removal_failed_is_removed_by_the_next_collect(
    prefect_server: None, sim: RunpodSim, tmp_path: Path
) -> None:
    """Seen in the chaos soak (seed 838930): a run ended, its pod deleted and
    its host key secret too, but the removal of its private client key from
    the store failed (a stall, a 503): the key stayed in the bucket for ever,
    since the run no longer counted as holding anything. Now pod.json says
    whether the key was removed (`client_key_removed`), the run stays in the
    live index until it is, and the next collect removes it."""
    runs = Runs(tmp_path / "runs")
    name = target(sim, boot_grace_s=BOOT_GRACE_S)
    verified = next(p for p in POINTS if p.name == "after verify")
    record = left_by_a_dead_follower(sim, runs, name, verified)
    run(collect(runs_dir=str(runs.root)))
    assert_final_and_clean(sim, runs, record)
    pod = PodRecord.load(runs, record.id)
    assert pod is not None and pod.client_key_removed and pod.forgotten, pod
    # as the end of that collect would have left it had the key's removal failed
    generate(runs, record.id)
    pod.client_key_removed = False
    pod.save(runs)
    runs.mark_live(record.id)
    assert (runs.run_dir(record.id) / SSH_DIR / CLIENT_KEY).exists()
    run(collect(runs_dir=str(runs.root)))
    assert_final_and_clean(sim, runs, record)
    pod = PodRecord.load(runs, record.id)
    assert pod is not None and pod.client_key_removed, pod
    assert runs.load(record.id).state == RunState.SUCCEEDED
