"""What the steps of a run share (`RunContext`) and how a run ended (`Outcome`)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass, field

from overbrainer_prefect.executors.base import (
    Executor,
    FileDigest,
)
from overbrainer_prefect.runs.metrics import MetricsSummary
from overbrainer_prefect.runs.store import (
    RunRecord,
    Runs,
)
from overbrainer_prefect.steps.reporters import LogReporter, Reporter
from overbrainer_prefect.trainers.base import TargetFacts

log = logging.getLogger(__name__)

COLLECTOR = "collector"
"""`ENDED_BY` in the collect flow."""

ENDED_BY: ContextVar[str] = ContextVar("overbrainer_ended_by", default="client")
"""Who this process is when it deletes what a job ran on (a pod's `deleted_by`):
`client`, the flow that follows the job; the collect flow sets `COLLECTOR`."""


@dataclass
class RunContext:
    """What the steps of a run share: where runs live, the target, where progress
    goes, and the bounds of a job."""

    runs: Runs
    executor: Executor
    reporter: Reporter = field(default_factory=LogReporter)
    python: str = "python3"
    """The job venv's Python on the target."""
    poll_s: float = 5.0
    """Time between two looks at the job."""
    max_hours: float | None = None
    """How long a job may run before it is cancelled and the run failed."""
    stall_s: float = 900.0
    """How long without a new metric before the job is reported as stalled."""
    local_only: tuple[str, ...] = ()
    """The target's own records of a job in its run directory (a pod's record,
    keys and watchdog log): never uploaded."""
    check_facts: Callable[[TargetFacts], None] | None = None
    """The target's own check of the probe before the job starts (a pod: the
    GPUs it bills for); raises TrainError."""
    probed: dict[tuple[str, ...], TargetFacts] = field(default_factory=dict)
    """Probes of the same machine's job environment this process already took
    (its pre-flight's), by the modules asked: not taken again at the start."""
    checkpoints_volume: str | None = None
    """The network volume the job's run directory is on, when its checkpoints
    are kept there as the job writes them (hashed there, not copied into the
    store): its ID."""
    host_gone: Callable[[], Awaitable[bool]] | None = None
    """The target's own look at whether the machine under a job found lost is
    gone (a pod deleted at its bound): then the watch ends unreachable and the
    target says why, however long the machine's sshd outlived the job."""


@dataclass
class Outcome:
    """How a run ended: its final record, what its metrics add up to, the files
    retrieved, and whether everything the target had was retrieved and verified
    (what decides whether a pod may be deleted without losing anything)."""

    record: RunRecord
    summary: MetricsSummary
    retrieved: bool
    files: list[FileDigest] = field(default_factory=list)
    lost: str | None = None
    """Why what the job ran on is gone under its follower (a pod deleted at its
    bound), when it is: the reason the caller fails its record with."""
