"""A pod's start, told from what Runpod shows of its container and from its
container's log: a start command that cannot run is found out while the
client waits for the pod's SSH, not at the end of the boot grace.

Runpod restarts a container whose main process exits (the pod stays
`RUNNING` and keeps billing). The pod's start command (the bootstrap +
watchdog) never exits while the pod lives, so a container that started
again, or a pod that stopped, while it starts is a start command that
cannot run. Two things tell it:

- the pod view: its `startedAt` moves, or its `runtime.uptime` starts again
  from 0 (not every view shows that while a container crash-loops);
- the pod's log (`GET /pods/{id}/logs`), read once SSH is late (`late_s`
  after the pod first showed `RUNNING`, and again every `LOG_LOOK_S`): the
  bootstrap's start line printed twice, the container's own events showing
  it exited or started again, a tool the start command needs missing, or
  the bootstrap saying its sshd cannot start.

Either way the wait ends at once, with the last lines of the log in the
message, and the pod is deleted.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

from overbrainer_prefect.runpod.client import RunpodClient
from overbrainer_prefect.runpod.errors import RunpodError
from overbrainer_prefect.runpod.models import Pod

LOG_TAIL = 5  # lines of the container's log a start failure quotes
LOG_READ = 50  # lines of each log read to decide from
LOG_LOOK_S = 10.0  # between two reads of a late pod's log (a read may last LOGS_READ_S: billed)
STOPPED = ("EXITED", "TERMINATED", "ERROR")  # statuses of a pod that no longer runs

START_MARK = "overbrainer-bootstrap: started"
"""The line the bootstrap prints first (its container log) each time it starts."""

NO_SSHD_MARK = "overbrainer-bootstrap: sshd:"
"""How the bootstrap prints (to its container log) that its sshd cannot start."""

_MISSING = re.compile(
    r"not found|no such file or directory|command not found|executable file not found|"
    r"exec format error|permission denied|cannot execute",
    re.IGNORECASE,
)
"""What a start command prints when a tool it needs is missing or cannot run."""

_EXITED = re.compile(r"\bexit(?:ed|s)?\b.*\bcode\b|\bcontainer (?:exited|died|stopped)\b", re.I)
"""A container event (the `system` log) saying that the start command exited."""

_STARTED = re.compile(r"\bcontainer start(?:ed)?\b|\bstart(?:ing)? container\b", re.I)
"""A container event (the `system` log) saying that the container started."""


@dataclass
class ContainerWatch:
    """What the looks at a starting pod saw of its container: its last start
    (`startedAt`), its uptime, and how often it started again."""

    started_at: str | None = None
    uptime_s: float | None = None
    restarts: int = 0

    def look(self, pod: Pod) -> bool:
        """Records a look at the pod; True when its container started again
        since the last look (`startedAt` moved, or its uptime went back)."""
        again = False
        if pod.started_at is not None or self.started_at is not None:
            again = None not in (pod.started_at, self.started_at) and (
                pod.started_at != self.started_at
            )
        elif pod.uptime_s is not None and self.uptime_s is not None:
            again = pod.uptime_s < self.uptime_s  # Runpod shows no start time: its uptime
        if again:
            self.restarts += 1
        if pod.started_at is not None:
            self.started_at = pod.started_at
        if pod.uptime_s is not None:
            self.uptime_s = pod.uptime_s
        return again


def log_verdict(container: list[str], system: list[str]) -> str | None:
    """How the pod's start command failed, from the last lines of its
    container log (`container`: what it printed) and of its container's
    events (`system`), or None when they show no failure (yet).

    Told apart: the bootstrap's start line printed more than once (its
    container restarted), its sshd that cannot start, a tool the start
    command needs that is missing (a line after the bootstrap's last start),
    and a container that exited or started more than once (its events)."""
    starts = [i for i, line in enumerate(container) if START_MARK in line]
    if len(starts) > 1:
        return f"its start command started {len(starts)} times: Runpod restarted its container"
    after = container[starts[-1] + 1 :] if starts else container
    sshd = next((line for line in after if NO_SSHD_MARK in line), None)
    if sshd is not None:
        return "its sshd cannot start, so nothing will answer SSH"
    if any(_MISSING.search(line) for line in after):
        return "a tool its start command needs is missing or cannot run"
    exits = sum(1 for line in system if _EXITED.search(line))
    if exits:
        return (
            f"its start command exited and Runpod restarted its container "
            f"({exits} exit{'s' if exits > 1 else ''} in its events)"
        )
    if sum(1 for line in system if _STARTED.search(line)) > 1:
        return "its container started more than once: Runpod restarted it"
    return None


@dataclass
class BootWatch:
    """The client's watch over a starting pod's start command, look after
    look while it waits for the pod's SSH: the pod view at every look, the
    pod's log once SSH is late (`late_s` after the pod first showed
    `RUNNING`)."""

    pod_id: str
    image: str
    late_s: float
    container: ContainerWatch = field(default_factory=ContainerWatch)
    running_since: float | None = None
    """When (monotonic) the pod first showed RUNNING."""
    log_read_at: float | None = None
    """When (monotonic) its log was last read."""

    async def look(self, client: RunpodClient, pod: Pod) -> str | None:
        """Looks at the pod as Runpod shows it now (reading its log once SSH
        is late); returns the one-line message of a start command that cannot
        run (see `start_failure`), or None while nothing says so."""
        now = time.monotonic()
        if pod.status == "RUNNING" and self.running_since is None:
            self.running_since = now
        restarted = self.container.look(pod)
        if restarted or pod.status in STOPPED:
            how = (
                restart_text(self.container.restarts)
                if restarted
                else f"its container stopped ({pod.status})"
            )
            return start_failure(
                self.pod_id, self.image, how, await last_lines(client, self.pod_id)
            )
        if self.running_since is None or now - self.running_since < self.late_s:
            return None
        if self.log_read_at is not None and now - self.log_read_at < LOG_LOOK_S:
            return None
        self.log_read_at = now
        container = await last_lines(client, self.pod_id, LOG_READ)
        system = await last_lines(client, self.pod_id, LOG_READ, source="system")
        verdict = log_verdict(container, system)
        if verdict is None:
            return None
        return start_failure(self.pod_id, self.image, verdict, container[-LOG_TAIL:])


def restart_text(restarts: int) -> str:
    """How a start command that Runpod restarted `restarts` times is told."""
    plural = "s" if restarts > 1 else ""
    return (
        f"its start command exited and Runpod restarted its container "
        f"({restarts} restart{plural} seen)"
    )


async def last_lines(
    client: RunpodClient, pod_id: str, tail: int = LOG_TAIL, source: str = "container"
) -> list[str]:
    """The last `tail` lines of the pod's log `source` (`container`: what its
    start command printed; `system`: its container's events), best effort:
    none when Runpod cannot give them."""
    try:
        return await client.pod_logs(pod_id, source, tail=tail)
    except RunpodError:
        return []


def start_failure(pod_id: str, image: str, how: str, lines: list[str]) -> str:
    """The one line saying that the pod's start command cannot run: `how`
    (what its container or its log showed), the last `lines` of its log,
    and what to do."""
    said = f"; its log ends: {' | '.join(lines)}" if lines else "; its log shows nothing (yet)"
    return (
        f"pod {pod_id} cannot start: {how}{said}. It is deleted. Check that the image {image} "
        "has sh, base64 and gzip and runs the start command it is given (a Docker CMD), "
        "then start the run again"
    )
