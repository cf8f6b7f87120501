"""The Runpod simulator as the Runpod tests use it (test_runpod_flows,
test_runpod_cluster, test_runpod_pipeline, test_lost_pod, test_pod_disk):
the pods' short timings, the simulator and its pods as fixtures, and a
Runpod target on it. A module uses the fixtures by importing them (and
naming them in its `__all__`)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from overbrainer_prefect.blocks import RunpodCredentials, RunpodTarget
from overbrainer_prefect.runpod.bootstrap import TIMING_ENV
from tests.conftest import job_venv
from tests.runpod_sim import RunpodSim, running_sim
from tests.runpod_sim.pods import SimPods

FAST = (
    "watch_interval_s=1,lease_ttl_s=6,lease_renew_s=1,lease_tick_s=0.5,deadline_margin_s=4,"
    "arm_timeout_s=30,ready_poll_s=0.3,gone_interval_s=0.3,confirm_timeout_s=30,"
    "checkpoint_hold_s=90"
)
"""Timings short enough for tests: the watchdog looks every second, a lease
holds 6 s."""

A4000 = "NVIDIA RTX A4000"
A5000 = "NVIDIA RTX A5000"


@pytest.fixture
def fast(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pods' short timings (`FAST`) in this process's environment (and its children's)."""
    monkeypatch.setenv(TIMING_ENV, FAST)


@pytest.fixture
def sim(fast: None) -> Iterator[RunpodSim]:
    """The Runpod simulator on 127.0.0.1, with the pods' short timings."""
    with running_sim() as simulator:
        yield simulator


@pytest.fixture
def pods_of(sim: RunpodSim, tmp_path: Path) -> Iterator[SimPods]:
    """The simulator's pods: real local process trees (bootstrap, watchdog, sshd)."""
    with SimPods(tmp_path / "pods").attached(sim) as simulated:
        yield simulated


def target_values(sim: RunpodSim, **changes: Any) -> dict[str, Any]:
    """The fields of a Runpod target on the simulator (one A4000, the job venv,
    bounds of a minute or two), with `changes`."""
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
    return values


def target(sim: RunpodSim, **changes: Any) -> str:
    """Saves a Runpod target on the simulator and returns its name."""
    name = f"pod-{uuid.uuid4().hex[:8]}"
    RunpodTarget(**target_values(sim, **changes)).save(name)
    return name
