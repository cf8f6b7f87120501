"""What a job's place cost, asked of the target it ran on from that target's
own records alone (a pod's rate × uptime): the runs list and the summaries read
it here, never a provider's records themselves."""

from __future__ import annotations

from collections.abc import Callable

from overbrainer_prefect.runs.store import CHILD_KINDS, RunRecord, Runs
from overbrainer_prefect.targets.pod import PodTarget, pod_spent

SPENT: dict[str, Callable[[Runs, RunRecord], float | None]] = {PodTarget.kind: pod_spent}
"""Each kind of target that bills, and how it reads what a job cost there."""


def spent(store: Runs, record: RunRecord) -> float | None:
    """The dollars the place of the job `record` (in `store`) cost, estimated
    by its target; None on a machine you own, or when its target cannot tell."""
    reader = SPENT.get(record.target_kind)
    return reader(store, record) if reader is not None else None


def run_spent(runs: Runs, run_id: str) -> float | None:
    """What every place of a run cost: its training's and each of its exports',
    compares' and evaluations' (issue 20: a fine-tune's summary says its own
    dollars); None when none of them ran where it bills."""
    found = []
    for store in (runs, *(runs.children(run_id, kind) for kind in CHILD_KINDS)):
        records = [runs.load(run_id)] if store is runs else store.list(lambda *_: None)
        found += [spent(store, record) for record in records]
    known = [dollars for dollars in found if dollars is not None]
    return sum(known) if known else None
