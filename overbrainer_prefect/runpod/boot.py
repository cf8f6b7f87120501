"""A pod's start, told from what Runpod shows of its container: a start
command that exits is found out while the client waits for the pod's SSH,
not at the end of the boot grace.

Runpod restarts a container whose main process exits (the pod stays
`RUNNING` and keeps billing): its `startedAt` moves and its
`runtime.uptime` starts again from 0. The pod's start command (the
bootstrap + watchdog) never exits while the pod lives, so a container that
started again, or a pod that stopped, while it starts is a start command
that cannot run: the wait ends at once, with the last lines of the pod's
container log (`GET /pods/{id}/logs`) in the message, and the pod is deleted.
"""

from __future__ import annotations

from dataclasses import dataclass

from overbrainer_prefect.runpod.client import RunpodClient
from overbrainer_prefect.runpod.errors import RunpodError
from overbrainer_prefect.runpod.models import Pod

LOG_TAIL = 5  # lines of the container's log a start failure quotes
STOPPED = ("EXITED", "TERMINATED", "ERROR")  # statuses of a pod that no longer runs


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


async def last_lines(client: RunpodClient, pod_id: str, tail: int = LOG_TAIL) -> list[str]:
    """The last `tail` lines the pod's start command printed (its container
    log), best effort: none when Runpod cannot give them."""
    try:
        return await client.pod_logs(pod_id, "container", tail=tail)
    except RunpodError:
        return []


def start_failure(pod_id: str, image: str, status: str, restarts: int, lines: list[str]) -> str:
    """The one line saying that the pod's start command cannot run: how its
    container ended (restarted `restarts` times, or stopped with `status`),
    the last `lines` of its log, and what to do."""
    if restarts:
        how = (
            f"its start command exited and Runpod restarted its container "
            f"({restarts} restart{'s' if restarts > 1 else ''} seen)"
        )
    else:
        how = f"its container stopped ({status})"
    said = f"; its log ends: {' | '.join(lines)}" if lines else "; its log shows nothing (yet)"
    return (
        f"pod {pod_id} cannot start: {how}{said}. It is deleted. Check that the image {image} "
        "has sh, base64 and gzip and runs the start command it is given (a Docker CMD), "
        "then start the run again"
    )
