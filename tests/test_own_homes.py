"""The SSH sessions of the test sshd and of the simulated pods have a home of
their own, as a box or a container has: their `HOME` and working directory are
theirs, this machine's profile is not read (its `pyenv rehash` takes a lock in
this machine's home, which a pod killed mid-session left behind for every later
test), and what they write in `~` stays in their home."""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import pytest

from overbrainer_prefect.runpod.bootstrap import TIMING_ENV
from overbrainer_prefect.runs.store import Runs
from overbrainer_prefect.targets.runpod.context import PodContext
from tests.runpod_sim import running_sim
from tests.runpod_sim.pods import SimPods
from tests.sshd import Sshd
from tests.test_watchdog import FAST, Bed, ready_pod, run, settings

MACHINE_HOME = Path(os.path.expanduser("~"))
# prints where the session is, then writes a file in its ~; bash's -c reads ~/.bashrc first
PROBE = 'echo "$HOME"; pwd; echo "$PATH"; touch ~/{marker}'


def probed(lines: str, home: Path, marker: str) -> None:
    """Asserts what `PROBE` printed and wrote: the session's own home, nothing of this machine's."""
    shown_home, cwd, path = lines.strip().splitlines()
    assert Path(shown_home) == home and Path(cwd) == home
    assert ".pyenv" not in path and str(MACHINE_HOME) not in path.split(":")
    assert (home / marker).is_file()
    assert not (MACHINE_HOME / marker).exists()


def test_a_session_of_the_test_sshd_has_its_own_home(tmp_path: Path) -> None:
    marker = f"marker-{uuid.uuid4().hex}"
    with Sshd.create(tmp_path / "sshd") as sshd:
        done = subprocess.run(
            [
                "ssh",
                "-i",
                str(sshd.client_key_path),
                "-p",
                str(sshd.port),
                "-o",
                "BatchMode=yes",
                "-o",
                "StrictHostKeyChecking=no",
                "-o",
                "UserKnownHostsFile=/dev/null",
                "-o",
                "LogLevel=ERROR",
                f"{sshd.user}@127.0.0.1",
                PROBE.format(marker=marker),
            ],
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=60,
            check=False,
        )
    assert done.returncode == 0, done.stderr
    probed(done.stdout, sshd.home, marker)


@pytest.mark.slow
def test_a_simulated_pods_ssh_session_has_the_pods_own_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(TIMING_ENV, FAST)
    marker = f"marker-{uuid.uuid4().hex}"
    with running_sim() as sim, SimPods(tmp_path / "pods").attached(sim) as pods:
        bed = Bed(sim, pods, Runs(tmp_path / "runs"))

        async def body(ctx: PodContext) -> tuple[str, str]:
            ready = await ready_pod(ctx, bed, settings())
            try:
                result = await ready.executor.run(["sh", "-c", PROBE.format(marker=marker)])
            finally:
                await ready.executor.close()
            assert result.code == 0, result.stderr
            assert ready.pod.pod_id is not None
            return ready.pod.pod_id, result.stdout

        pod_id, lines = run(bed, body)
        probed(lines, pods.home_of(pod_id), marker)
