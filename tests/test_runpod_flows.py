"""The run flows on a Runpod target, against the Runpod simulator whose pods
are real local process trees (the package's real bootstrap + watchdog, a real
sshd on 127.0.0.1) and real axolotl fine-tunes of the tiny model inside them,
on the real (ephemeral) Prefect server.

What is shown: a pod is deleted only after the run's files are verified, and
its deletion is confirmed; GPU types without capacity, a 500 after a create
and 429s are handled with exactly one pod; whatever dies, the watchdog
deletes the pod at its bound and `attach` tells the truth; cancellation
through the Prefect API deletes the pod; no secret lands in a file, a log, a
result or an artifact; bad input fails in one line before any pod exists.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterKey,
    LogFilter,
    LogFilterFlowRunId,
)
from prefect.states import Cancelling

from overbrainer_prefect.blocks import RunpodCredentials, RunpodTarget
from overbrainer_prefect.flows import RunResult, attach, pods, train
from overbrainer_prefect.flows.hooks import cancel_runs_of
from overbrainer_prefect.flows.pods import PodsError
from overbrainer_prefect.runpod.bootstrap import TIMING_ENV
from overbrainer_prefect.runpod.keys import CLIENT_KEY, SSH_DIR
from overbrainer_prefect.runpod.pod import MAX_HOURS_REACHED, PodRecord, PodState
from overbrainer_prefect.runs import lifecycle
from overbrainer_prefect.runs.store import Runs, RunState
from overbrainer_prefect.trainers.spec import TrainingSpec
from tests.conftest import REPO, job_venv
from tests.runpod_sim import RunpodSim, running_sim
from tests.runpod_sim.pods import SimPods
from tests.test_train_flow import kill, spec, wait_until

pytestmark = pytest.mark.slow

FAST = (
    "watch_interval_s=1,lease_ttl_s=6,lease_renew_s=1,lease_tick_s=0.5,deadline_margin_s=4,"
    "arm_timeout_s=30,ready_poll_s=0.3,gone_interval_s=0.3,confirm_timeout_s=30"
)
"""Timings short enough for tests: the watchdog looks every second, a lease
holds 6 s."""

A4000 = "NVIDIA RTX A4000"
A5000 = "NVIDIA RTX A5000"


@pytest.fixture
def fast(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TIMING_ENV, FAST)


@pytest.fixture
def sim(fast: None, tmp_path: Path) -> Iterator[RunpodSim]:
    with running_sim() as simulator:
        yield simulator


@pytest.fixture
def pods_of(sim: RunpodSim, tmp_path: Path) -> Iterator[SimPods]:
    with SimPods(tmp_path / "pods").attached(sim) as simulated:
        yield simulated


def target(sim: RunpodSim, **changes: Any) -> str:
    """Saves a Runpod target on the simulator and returns its name."""
    values: dict[str, Any] = {
        "credentials": RunpodCredentials(
            api_key=sim.api_key, rest_url=sim.rest_url, graphql_url=sim.graphql_url
        ),
        "job_venv": str(job_venv()),
        "gpu_types": [A4000],
        "image": "overbrainer/test:1",
        "max_hours": 1.0,
        "boot_grace_s": 60.0,
        "retrieve_grace_s": 120.0,
        "poll_seconds": 0.5,
        "stall_minutes": 1.0,
        "cpu_threads": 1,
    }
    values.update(changes)
    name = f"pod-{uuid.uuid4().hex[:8]}"
    RunpodTarget(**values).save(name)
    return name


def run(coroutine: Any) -> Any:
    return asyncio.run(coroutine)


def only_run(runs_dir: Path) -> Any:
    records = Runs(runs_dir).list()
    assert len(records) == 1, records
    return records[0]


def secrets_of(sim: RunpodSim) -> list[bytes]:
    """Every secret the account and its pods ever had: the account key, each
    pod's key, each pod's host key (as given, base64, and decoded)."""
    found = [sim.api_key.encode()]
    for pod in sim.pods(include_deleted=True):
        found.append(pod.api_key.encode())
        host = pod.env.get("OVERBRAINER_HOST_KEY", "")
        if host:
            found.append(host.encode())
            body = base64.b64decode(host).decode()
            found.append(body.encode())
            found += [line.encode() for line in body.splitlines() if len(line) > 40]
    return found


def assert_no_secret_in_files(root: Path, secrets: list[bytes]) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert b"PRIVATE KEY" not in data, path
            for secret in secrets:
                assert secret not in data, path


def flow_logs(flow_run_id: str) -> list[str]:
    async def go() -> list[str]:
        async with get_client() as client:
            logs = await client.read_logs(
                log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[uuid.UUID(flow_run_id)]))
            )
            return [log.message for log in logs]

    return run(go())


def artifacts_of(run_id: str) -> list[Any]:
    async def go() -> list[Any]:
        async with get_client() as client:
            return await client.read_artifacts(
                artifact_filter=ArtifactFilter(key=ArtifactFilterKey(like_=run_id))
            )

    return run(go())


def test_a_train_on_a_simulated_pod_deletes_the_pod_only_after_its_files_are_verified(
    prefect_server: None,
    sim: RunpodSim,
    pods_of: SimPods,
    tiny: tuple[Path, Path],
    tmp_path: Path,
) -> None:
    runs_dir = tmp_path / "runs"
    name = target(sim)
    result = run(train(target=name, training=spec(*tiny), runs_dir=str(runs_dir)))
    assert isinstance(result, RunResult)
    assert result.state == RunState.SUCCEEDED, result.message
    assert "output/adapter_model.safetensors" in {f.path for f in result.files}
    runs = Runs(runs_dir)
    local = runs.run_dir(result.run_id)
    pod = PodRecord.load(runs, result.run_id)
    assert pod is not None and pod.pod_id is not None
    assert pod.state == PodState.DELETED and pod.gpu_type_id == A4000
    assert pod.cost_per_hour == pytest.approx(0.25)
    assert pod.deadline_unix is not None and pod.secret_deleted
    # deleted only after the files were verified: the manifest was written first
    simulated = sim.pod(pod.pod_id)
    assert simulated.deleted and simulated.deleted_at is not None
    assert (local / "manifest.json").stat().st_mtime <= simulated.deleted_at
    # the retrieved marker was written on the pod before the delete
    remote = pods_of.workspace_of(pod.pod_id) / "overbrainer" / result.run_id
    assert (remote / ".pod" / "retrieved").is_file()
    # its deletion confirmed: 404s in a row after the delete, then a list
    after = sim.requests[
        max(
            i
            for i, r in enumerate(sim.requests)
            if r.method == "DELETE" and r.path == f"/v2/pods/{pod.pod_id}"
        ) :
    ]
    gets = [r.status for r in after if r.method == "GET" and r.path == f"/v2/pods/{pod.pod_id}"]
    assert gets[-3:] == [404, 404, 404]
    assert any(r.method == "GET" and r.path == "/v2/pods" for r in after)
    assert not pods_of.running(pod.pod_id)
    # the watchdog's log came back, with its decisions
    log = (local / ".pod" / "watchdog.log").read_text()
    for said in ("claim:", "api: the Runpod API answers", "cost cap armed:", "job: started"):
        assert said in log, log
    # no key is left: the client key removed, the host key secret deleted
    assert not (local / SSH_DIR / CLIENT_KEY).exists()
    assert sim.secret_names() == []
    secrets = secrets_of(sim)
    assert_no_secret_in_files(runs_dir, secrets)
    record = runs.load(result.run_id)
    assert record.target_kind == "runpod" and record.flow_run_id is not None
    texts = flow_logs(record.flow_run_id)
    assert any("Runpod: NVIDIA RTX A4000" in text for text in texts), texts
    assert any("deleted and its deletion confirmed" in text for text in texts), texts
    found = artifacts_of(result.run_id)
    assert any(a.key == f"run-{result.run_id}-pod" for a in found)
    shown = [*texts, result.model_dump_json(), *(json.dumps(a.data) for a in found)]
    for text in shown:
        for secret in secrets:
            assert secret.decode() not in text
        assert "PRIVATE KEY" not in text
