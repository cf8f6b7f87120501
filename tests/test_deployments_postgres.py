"""The train deployment on a Prefect server backed by PostgreSQL, its runs in a
bucket of a real S3 server (moto's) and nowhere on a disk, with two real
process workers that share nothing but the server and the bucket (each its own
working directory, a clone of the flows, and its own HOME and staging
directory, in a mount namespace of its own where the other's HOME and clone
are empty, where `unshare` is allowed; the local target's jobs run in the
staging directories, the target machine's disk): the flow run suspends on
worker A once its job trains (issue 28); worker A and the follower it ran are
SIGKILLed mid-training; once A's follow lease expired, a follower on worker B
follows the job to its end from the bucket, verified there, and resumes the
flow run, which worker B runs to `Completed` (issue 27). What bills: nothing
(a local target); what is lost: nothing.

A module of its own (not in the `deployed` unit of tests/scheduling.py): it
starts its own stack, so it runs beside the deployment tests on another
worker."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from overbrainer_prefect.runs import Runs, RunState
from overbrainer_prefect.runs.lock import follower_of
from overbrainer_prefect.store.lease import TTL_ENV
from tests.prefect_server import (
    FOLLOWER,
    Stack,
    Worker,
    clone,
    followed,
    hidden_from,
    own_mounts_allowed,
    start_stack,
    tiny_training,
    wait_until,
)
from tests.procs import alive, group_alive, held_stopped
from tests.s3server import S3Server
from tests.test_object_store import LEASE_TTL_S, assert_stored_as_manifest, staged_files
from tests.test_suspended_runs import start_follower, suspended_with_its_job

pytest_plugins = ["tests.prefect_server", "tests.postgres"]
pytestmark = pytest.mark.slow


def own_worker(stack: Stack, name: str, other: str, root: Path) -> Worker:
    """A worker of the stack in a clone of its own, with its own HOME and
    staging directory (where its local jobs run: the target machine's disk),
    and the tests' follow lease TTL, in a mount namespace of its own where
    the other worker's HOME and clone are empty (where `unshare` is
    allowed); started."""
    for who in (name, other):
        for part in ("home", "clone"):
            (root / who / part).mkdir(parents=True, exist_ok=True)
    home, where = root / name / "home", clone(root / name / "clone")
    worker = Worker(
        stack.server,
        f"{name}-{uuid.uuid4().hex[:6]}",
        where,
        hide=[root / other / "home", root / other / "clone"],
        HOME=str(home),
        OVERBRAINER_PROJECT_DIR=str(where),
        OVERBRAINER_WORK_DIR=str(root / name / "staging"),
        **{TTL_ENV: str(LEASE_TTL_S)},
    )
    stack.workers.append(worker)
    worker.start()
    assert worker.process is not None
    if own_mounts_allowed():  # what the other worker holds is not even visible to this one
        assert hidden_from(worker.process.pid) == [str(p) for p in worker.hide]
    return worker


def test_on_postgresql_a_suspended_run_of_a_killed_worker_is_finished_by_another_from_a_bucket(
    postgres: Any, s3: S3Server, tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    url = s3.bucket_url()
    # no worker of the stack's own (it would share this process's HOME): A and B have theirs
    stack = start_stack(
        tmp_path / "pg", postgres.url, names=["train/local", FOLLOWER], runs=url, worker=False
    )
    runs = Runs(url)
    try:
        a = own_worker(stack, "a", "b", tmp_path)
        start_follower(stack)
        flow_run_id = stack.run_deployment(
            "train/local", target=stack.target, training=tiny_training(*tiny, max_steps=30)
        )
        record = suspended_with_its_job(stack, flow_run_id)
        metrics = Path(record.remote_dir) / "metrics.jsonl"
        wait_until(lambda: metrics.exists() and '"log"' in metrics.read_text(), 240, "a step")

        # its job held stopped from its first step until B follows it: still training when
        # taken over, however long A's lease takes to expire and B to start
        with held_stopped(record.job.pid):
            # worker A dies with the follower it ran (SIGKILL: no hook, no release)
            a.kill(spare_sessions={record.job.pid})
            assert group_alive(record.job.pid) and stack.flow_run(flow_run_id).state.is_paused()
            wait_until(lambda: follower_of(runs) is None, LEASE_TTL_S + 60, "A's lease to expire")

            # worker B, sharing nothing with A but the server and the bucket, takes it over
            b = own_worker(stack, "b", "a", tmp_path)
            start_follower(stack)
            wait_until(lambda: followed(stack, record.id), 120, "B's follower to follow the job")
        done = stack.wait_final(flow_run_id, timeout=600)
        assert done.state.is_completed(), done.state
        saved = runs.load(record.id)
        assert saved.state == RunState.SUCCEEDED and saved.message is None, saved
        assert_stored_as_manifest(runs, record.id)
        assert [r.id for r in runs.list()] == [record.id]  # one run, one job
        # the server kept it in PostgreSQL: suspended, then resumed to its end
        assert postgres.query(f"select state_type from flow_run where id = '{flow_run_id}'") == [
            "COMPLETED"
        ]
        states = postgres.query(
            "select name from flow_run_state "
            f"where flow_run_id = '{flow_run_id}' order by timestamp"
        )
        assert "Suspended" in states and states.index("Suspended") < len(states) - 1, states
        # no runs directory on any disk, no model bytes kept by either worker
        for home in (tmp_path / "a" / "home", tmp_path / "b" / "home"):
            assert not any(p.suffix == ".safetensors" for p in staged_files(home)), home
        assert not (tmp_path / "pg" / "runs").exists()
        assert b.running
    finally:
        stack.stop()
    assert not any(alive(w.process.pid) for w in stack.workers if w.process is not None)
