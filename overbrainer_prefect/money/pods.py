"""What a Runpod pod asks of the budget, from its launch plan, and what its
record says it cost: the two facts the ledger needs of a pod.

The most a pod can cost is its plan's bound at the dearest GPU type it may
fall back to: its GPUs and container disk for `max_hours` and the checkpoint
hold, or the target's `max_cost_usd` when lower. The least one costs is its
cheapest type for LEAST_HOURS (or `max_hours` when shorter): less than that
left of a budget refuses the pod. With a budget, the pod's watchdog is armed
at the most it was admitted for, so what the ledger holds is what it bounds.
"""

from __future__ import annotations

from dataclasses import replace

from overbrainer_prefect.money.ledger import Ask, Entry, usd
from overbrainer_prefect.money.store import Facts, Spent, entry_store
from overbrainer_prefect.runpod.gpus import LaunchPlan
from overbrainer_prefect.runpod.pod import PodRecord
from overbrainer_prefect.runs.store import Runs

LEAST_HOURS = 1 / 6  # ten minutes: a pod boots, runs a short job and is retrieved in no less


def ask_of(plan: LaunchPlan, what: str, target: str) -> Ask:
    """What a pod of `plan` for the job `what` on `target` asks of the budget."""
    hours = plan.max_hours + plan.checkpoint_hold_s / 3600
    dearest = max(choice.price_per_hour for choice in plan.choices) + plan.disk_per_hour
    cheapest = min(plan.choices, key=lambda choice: choice.price_per_hour)
    most: float | None = None
    if not plan.keep_pod:
        most = dearest * hours
        if plan.max_cost_usd is not None:
            most = min(most, plan.max_cost_usd)
    least_hours = min(LEAST_HOURS, hours)
    rate = cheapest.price_per_hour + plan.disk_per_hour
    minutes = least_hours * 60
    return Ask(
        most_usd=most,
        least_usd=rate * least_hours,
        least_text=f"{minutes:g} minutes of {cheapest.label()} at {usd(rate)}/h",
        what=what,
        target=target,
        kind="runpod",
    )


def capped(plan: LaunchPlan, cap_usd: float | None) -> LaunchPlan:
    """`plan` with its cost cap lowered to `cap_usd` (unchanged without one):
    the cap the pod's record and its watchdog are armed with."""
    if cap_usd is None:
        return plan
    cap = cap_usd if plan.max_cost_usd is None else min(plan.max_cost_usd, cap_usd)
    return replace(plan, settings=plan.settings.model_copy(update={"max_cost_usd": cap}))


def cost_facts_of(runs: Runs) -> Facts:
    """What the pod of an entry's job cost, from its `pod.json` in the runs
    directory of `runs` (see `cost_facts`)."""
    return lambda entry: cost_facts(runs, entry)


def cost_facts(runs: Runs, entry: Entry) -> Spent | None:
    """What the pod of `entry`'s job cost, from its `pod.json` (None when the
    records are not here or cannot be read, or the job is still before its
    pod). A job that ended without a pod cost nothing."""
    store = entry_store(runs, entry)
    if entry.run_id is None or store is None:
        return None
    try:
        pod = PodRecord.load(store, entry.run_id)
        if pod is None:
            ended = store.load(entry.run_id).state.ended
            return Spent(pod_id=None, cost_usd=0.0, ended=True) if ended else None
    except Exception:  # another machine's runs directory, or a damaged record
        return None
    return Spent(
        pod_id=pod.pod_id,
        cost_usd=pod.estimated_spend() or 0.0,
        ended=pod.gone,
        pod_ids=tuple(node.pod_id for node in pod.nodes),
        cluster_id=pod.cluster_id,
    )
