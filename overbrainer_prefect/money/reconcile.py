"""The ledger against what the provider billed: an ended pod whose bill is
known counts at its bill, and a bill that differs from the ledger's own
figure (rate × uptime) is reported, pod by pod."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol, runtime_checkable

from overbrainer_prefect.money.ledger import Entry, usd

TOLERANCE_USD = 0.01  # a difference below a cent is billing's rounding, not a difference
TOLERANCE_SHARE = 0.05  # nor one below a twentieth of the pod's cost (billing's own granularity)


@runtime_checkable
class Billing(Protocol):
    """A target whose provider answers what it billed each of its pods."""

    async def billed(self, since: datetime) -> dict[str, float]:
        """Dollars billed by pod id since `since`. Raises when the account
        does not answer it."""
        ...


@dataclass(frozen=True)
class Difference:
    """A pod the ledger and the bill disagree on."""

    entry: Entry
    ledger_usd: float
    billed_usd: float

    def line(self) -> str:
        """`pod P of run R: the ledger says $0.12, Runpod billed $0.15` (`cluster C`
        for an instant cluster's pods together)."""
        entry = self.entry
        place = f"cluster {entry.cluster_id}" if entry.cluster_id else f"pod {entry.pod_id}"
        return (
            f"{place} of {self.entry.who}: the ledger says "
            f"{usd(self.ledger_usd)}, the provider billed {usd(self.billed_usd)}"
        )


def reconcile(entries: Iterable[Entry], billed: Mapping[str, float]) -> list[Difference]:
    """Writes each ended pod's bill into its entry (`billed_usd`), and returns
    the pods whose bill differs from the ledger's own figure by more than a
    cent and a twentieth. A pod alive keeps counting at its most."""
    found = []
    for entry in entries:
        pods = entry.pod_ids or ([entry.pod_id] if entry.pod_id is not None else [])
        if not entry.ended or not pods or any(pod not in billed for pod in pods):
            continue
        bill = sum(billed[pod] for pod in pods)  # a cluster's bill is its pods'

        entry.billed_usd = bill
        own = entry.cost_usd or 0.0
        if abs(bill - own) > max(TOLERANCE_USD, TOLERANCE_SHARE * own):
            found.append(Difference(entry, own, bill))
    return found
