"""What a job's place cost, asked of the target it ran on from that target's
own records alone (a pod's rate × uptime): the runs list and the summaries read
it here, never a provider's records themselves."""

from __future__ import annotations

from collections.abc import Callable

from overbrainer_prefect.runs.store import RunRecord, Runs
from overbrainer_prefect.targets.pod import PodTarget, pod_spent

SPENT: dict[str, Callable[[Runs, RunRecord], float | None]] = {PodTarget.kind: pod_spent}
"""Each kind of target that bills, and how it reads what a job cost there."""


def spent(store: Runs, record: RunRecord) -> float | None:
    """The dollars the place of the job `record` (in `store`) cost, estimated
    by its target; None on a machine you own, or when its target cannot tell."""
    reader = SPENT.get(record.target_kind)
    return reader(store, record) if reader is not None else None
