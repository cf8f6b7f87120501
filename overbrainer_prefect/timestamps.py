"""Times as records keep them: RFC 3339 in UTC with seconds
(`2026-09-22T14:30:05Z`), written and read back the same way by every record
(runs, pods, ledgers)."""

from __future__ import annotations

from datetime import UTC, datetime


def rfc3339(moment: datetime | None = None) -> str:
    """`moment` (default: now) as RFC 3339 UTC with seconds, e.g. `2026-09-22T14:30:05Z`."""
    return (moment or datetime.now(UTC)).astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_rfc3339(value: str) -> datetime:
    """The UTC time an `rfc3339` string names. Raises ValueError when it is not one."""
    return datetime.strptime(value, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
