"""What a process costs, read from /proc: CPU seconds and resident memory,
for itself and for a tree of processes (the reaped children included)."""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path

from tests import procs

TICK = os.sysconf("SC_CLK_TCK")  # clock ticks per second in /proc/<pid>/stat
PAGE = os.sysconf("SC_PAGE_SIZE")


def _stat_fields(pid: int) -> list[str]:
    """The fields of /proc/<pid>/stat after the command name (field 3 first)."""
    text = Path(f"/proc/{pid}/stat").read_text()
    return text.rpartition(")")[2].split()


def machine_busy_s() -> float:
    """CPU seconds this machine spent busy (all cores, every process), from
    /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / TICK


def cpu_seconds(pid: int, reaped: bool = True) -> float:
    """User + system CPU seconds of process `pid`, with those of the children it
    reaped when `reaped`. Raises OSError when the process is gone."""
    fields = _stat_fields(pid)
    ticks = int(fields[11]) + int(fields[12])  # utime, stime
    if reaped:
        ticks += int(fields[13]) + int(fields[14])  # cutime, cstime
    return ticks / TICK


def rss_bytes(pid: int) -> int:
    """Resident memory of process `pid` (VmRSS). Raises OSError when it is gone."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def tree(pid: int) -> list[int]:
    """`pid` and every process below it."""
    return [pid, *procs.descendants(pid)]


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of `pid` and every live process below it, reaped children
    included (each second counted once: a live process's reaped children are
    no longer in the tree)."""
    total = 0.0
    for member in tree(pid):
        try:
            total += cpu_seconds(member)
        except OSError:
            continue
    return total


def tree_rss_bytes(pid: int) -> int:
    """Resident memory of `pid` and every live process below it."""
    total = 0
    for member in tree(pid):
        try:
            total += rss_bytes(member)
        except OSError:
            continue
    return total


def started_unix(kernel_start: str) -> float:
    """A process's start time as /proc/<pid>/stat gives it (clock ticks since
    boot, the `started` of a JobId) as Unix time, to 10 ms: the boot moment is
    taken from /proc/uptime (`btime` in /proc/stat is whole seconds)."""
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return time.time() - uptime + int(kernel_start) / TICK


def own_cpu_seconds() -> float:
    """CPU seconds this process has used (all its threads)."""
    return time.process_time()


def children_cpu_seconds() -> float:
    """CPU seconds of the children this process has reaped so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime
