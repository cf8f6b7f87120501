"""The follow lock: one follower a run, and a dead follower holds nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from overbrainer_prefect.runs.lock import RunBusy, follow_lock, is_followed

HOLD = (
    "import sys, time\n"
    "from pathlib import Path\n"
    "from overbrainer_prefect.runs.lock import follow_lock\n"
    "with follow_lock(Path(sys.argv[1]), 'flow-run-1'):\n"
    "    print('held', flush=True)\n"
    "    time.sleep(60)\n"
)


def holder(run_dir: Path) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None and process.stdout.readline().strip() == "held"
    return process


def test_a_run_followed_by_another_process_is_busy_with_who_follows_it(tmp_path: Path) -> None:
    run_dir = tmp_path / "20260101-000000-aaaa"
    process = holder(run_dir)
    try:
        assert is_followed(run_dir)
        with pytest.raises(RunBusy) as caught, follow_lock(run_dir):
            pass
        assert f"pid {process.pid}" in caught.value.holder
        assert "flow run flow-run-1" in caught.value.holder
    finally:
        process.kill()
        process.wait(timeout=10)


def test_a_follower_killed_outright_leaves_the_run_free(tmp_path: Path) -> None:
    run_dir = tmp_path / "20260101-000000-aaaa"
    process = holder(run_dir)
    os.kill(process.pid, signal.SIGKILL)
    process.wait(timeout=10)
    deadline = time.monotonic() + 5
    while is_followed(run_dir) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not is_followed(run_dir)
    with follow_lock(run_dir):
        assert is_followed(run_dir)
    assert not is_followed(run_dir)


def test_the_lock_is_released_when_its_block_ends(tmp_path: Path) -> None:
    run_dir = tmp_path / "20260101-000000-aaaa"
    with follow_lock(run_dir):
        pass
    with follow_lock(run_dir):
        pass
    assert not is_followed(run_dir)
