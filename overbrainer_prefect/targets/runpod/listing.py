"""The pods of an account as the `pods` flow lists them, and what it returns."""

from __future__ import annotations

from datetime import UTC, datetime

from pydantic import BaseModel, Field

from overbrainer_prefect.targets.runpod.orphans import PodRow
from overbrainer_prefect.timestamps import rfc3339


class PodsError(ValueError):
    """The pods flow cannot do what it was asked; the message is one line."""


class PodListing(BaseModel):
    """One pod of ours, as the pods flow lists it."""

    pod_id: str
    run_id: str
    owner: str = Field(default="", description="`run R`, or `export E of run R`.")
    status: str
    run_state: str
    gpu: str
    rate_per_hour: float | None
    uptime_hours: float
    estimated_spend: float | None
    orphan: bool
    why: str
    unfollowed: bool = Field(
        default=False, description="Its pod holds files of a job that nobody follows."
    )
    files_lost_at: str | None = Field(
        default=None,
        description="When its watchdog deletes it with those files (RFC 3339), when known.",
    )
    save_with: str = Field(default="", description="The command that saves those files.")


class PodsResult(BaseModel):
    """What the pods flow found or did."""

    action: str
    pods: list[PodListing] = Field(default_factory=list)
    removed: list[str] = Field(default_factory=list, description="Pods deleted, confirmed.")
    warnings: list[str] = Field(default_factory=list)


def pod_listing(row: PodRow) -> PodListing:
    """A pod's row as the pods flow lists it: spend and uptime rounded."""
    return PodListing(
        pod_id=row.pod_id,
        run_id=row.run_id,
        owner=row.owner,
        status=row.status,
        run_state=row.run_state,
        gpu=row.gpu,
        rate_per_hour=row.rate,
        uptime_hours=round(row.uptime_s / 3600, 3),
        estimated_spend=None if row.estimated_spend is None else round(row.estimated_spend, 4),
        orphan=row.orphan,
        why=row.why,
        unfollowed=row.unfollowed,
        files_lost_at=None
        if row.files_lost_at is None
        else rfc3339(datetime.fromtimestamp(row.files_lost_at, UTC)),
        save_with=row.save_with,
    )
