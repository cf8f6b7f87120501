"""This machine's processes as /proc shows them, for the tests and benchmarks
that start, follow and stop process trees: one walk of /proc, and what is
asked of it (children, descendants, liveness, process groups), and killing by PID.

A process that ends while /proc is read is left out; nothing here raises for it.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")


@dataclass(frozen=True)
class Proc:
    """One process: its PID, command name (`comm`), state letter, parent, group and session."""

    pid: int
    name: str
    state: str
    ppid: int
    pgid: int
    session: int

    @property
    def zombie(self) -> bool:
        """Whether it has ended and waits to be reaped (or is being reaped)."""
        return self.state in ("Z", "X")


def read(pid: int) -> Proc | None:
    """Process `pid` from /proc/<pid>/stat, or None when there is none."""
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    head, _, tail = stat.rpartition(")")
    fields = tail.split()
    if len(fields) < 4:
        return None
    return Proc(
        pid=pid,
        name=head.partition("(")[2],
        state=fields[0],
        ppid=int(fields[1]),
        pgid=int(fields[2]),
        session=int(fields[3]),
    )


def table() -> dict[int, Proc]:
    """Every process of this machine now, by PID."""
    found: dict[int, Proc] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            proc = read(int(entry.name))
            if proc is not None:
                found[proc.pid] = proc
    return found


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not)."""
    proc = read(pid)
    return proc is not None and not proc.zombie


def children(pid: int, procs: dict[int, Proc] | None = None) -> list[Proc]:
    """The processes whose parent is `pid` (from `procs`, a fresh `table()` by default)."""
    procs = table() if procs is None else procs
    return [proc for proc in procs.values() if proc.ppid == pid]


def descendants(pid: int, *, zombies: bool = True) -> list[int]:
    """The PIDs below `pid` (its children first, then theirs...), now; without
    zombies (and what is below them) when `zombies` is False."""
    by_parent: dict[int, list[Proc]] = {}
    for proc in table().values():
        by_parent.setdefault(proc.ppid, []).append(proc)
    found: list[int] = []
    pending = [pid]
    while pending:
        parent = pending.pop(0)
        for child in by_parent.get(parent, []):
            if child.zombie and not zombies:
                continue
            found.append(child.pid)
            pending.append(child.pid)
    return found


def leads_group(pid: int) -> bool:
    """Whether `pid` leads its own process group (a job whose `setsid` ran)."""
    proc = read(pid)
    return proc is not None and proc.pgid == pid


def group_alive(pgid: int) -> bool:
    """Whether any live process is in the process group `pgid`."""
    return any(p.pgid == pgid and not p.zombie for p in table().values())


@contextlib.contextmanager
def held_stopped(pgid: int) -> Iterator[None]:
    """The process group `pgid` (a job) stopped (SIGSTOP) inside the block and
    let go on (SIGCONT) when the block ends, also when it fails: a training held
    while a test kills, waits and takes it over costs no CPU and cannot end
    meanwhile, however fast or slow the machine. A group gone by then is no error."""
    os.killpg(pgid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGCONT)


def with_argv(needle: bytes) -> list[int]:
    """PIDs of the processes whose command line holds `needle`."""
    found = []
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if needle in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
    return found


def kill_pids(pids: Iterable[int], sig: int = signal.SIGKILL) -> None:
    """Sends `sig` to each of `pids` that still exists (and may be signalled)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)
