"""The follow lock: one follower a run, and a dead follower holds nothing, in
a local runs directory (a kernel lock, dropped at once) and in an object store
(a lease, which expires within its TTL)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from overbrainer_prefect.runs.lock import RunBusy, follow_lock, is_followed
from overbrainer_prefect.runs.store import Runs
from overbrainer_prefect.store.lease import TTL_ENV
from tests.s3server import S3Server

RUN = "20260101-000000-aaaa"
TTL_S = 2.0  # the object store's lease here: a dead follower's run is free within it

HOLD = (
    "import sys, time\n"
    "from overbrainer_prefect.runs.lock import follow_lock\n"
    "from overbrainer_prefect.runs.store import Runs\n"
    "with follow_lock(Runs(sys.argv[1]), sys.argv[2], 'flow-run-1'):\n"
    "    print('held', flush=True)\n"
    "    time.sleep(60)\n"
)


@pytest.fixture(params=["local", "s3"])
def runs_dir(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[str]:
    monkeypatch.setenv(TTL_ENV, str(TTL_S))
    if request.param == "local":
        yield str(tmp_path / "runs")
    else:
        s3: S3Server = request.getfixturevalue("s3")
        yield s3.bucket_url()


def holder(runs_dir: str) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, "-c", HOLD, runs_dir, RUN], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None and process.stdout.readline().strip() == "held"
    return process


def test_a_run_followed_by_another_process_is_busy_with_who_follows_it(runs_dir: str) -> None:
    runs = Runs(runs_dir)
    process = holder(runs_dir)
    try:
        assert is_followed(runs, RUN)
        with pytest.raises(RunBusy) as caught, follow_lock(runs, RUN):
            pass
        assert f"pid {process.pid}" in caught.value.holder
        assert "flow run flow-run-1" in caught.value.holder
    finally:
        process.kill()
        process.wait(timeout=10)


def test_a_follower_killed_outright_leaves_the_run_free(runs_dir: str) -> None:
    """Free at once in a local directory; within the lease's TTL in an object store."""
    runs = Runs(runs_dir)
    process = holder(runs_dir)
    os.kill(process.pid, signal.SIGKILL)
    process.wait(timeout=10)
    killed = time.monotonic()
    deadline = killed + TTL_S + 3
    while is_followed(runs, RUN) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not is_followed(runs, RUN)
    assert time.monotonic() - killed <= TTL_S + 3
    with follow_lock(runs, RUN):
        assert is_followed(runs, RUN)
    assert not is_followed(runs, RUN)


def test_the_lock_is_released_when_its_block_ends(runs_dir: str) -> None:
    runs = Runs(runs_dir)
    with follow_lock(runs, RUN):
        pass
    with follow_lock(runs, RUN):
        pass
    assert not is_followed(runs, RUN)
