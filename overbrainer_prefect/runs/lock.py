"""Who follows a run: a lock in its directory, so that a run is never followed
by two processes at once, and that a dead follower cannot keep.

The lock is an advisory `flock` on `runs/<id>/.follow.lock`: the kernel (or
the NFS server, on a shared runs volume) drops it when its holder dies, however
it dies. The file also says who holds it, for messages.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from overbrainer_prefect.runs.ids import rfc3339

LOCK_FILE = ".follow.lock"


class RunBusy(Exception):
    """Another live process follows the run."""

    def __init__(self, run_dir: Path, holder: str) -> None:
        super().__init__(f"{run_dir.name} is being followed by {holder}")
        self.holder = holder


def holder_of(run_dir: Path) -> str:
    """Who the lock file says holds the lock (`pid P on H, flow run F, since T`)."""
    try:
        data = json.loads((run_dir / LOCK_FILE).read_text())
        text = f"pid {data['pid']} on {data['host']}"
        if data.get("flow_run_id"):
            text += f", flow run {data['flow_run_id']}"
        return f"{text}, since {data['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


@contextmanager
def follow_lock(run_dir: Path, flow_run_id: str | None = None) -> Iterator[None]:
    """Holds the follow lock of the run directory `run_dir` (created if needed)
    for the duration of the block.

    Raises RunBusy, at once, when another live process holds it.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunBusy(run_dir, holder_of(run_dir)) from None
        me = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "flow_run_id": flow_run_id,
            "since": rfc3339(),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def is_followed(run_dir: Path) -> bool:
    """Whether a live process holds the follow lock of `run_dir` now."""
    try:
        fd = os.open(run_dir / LOCK_FILE, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False
