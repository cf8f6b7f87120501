"""What the flows raise and return that every kind of job shares."""

from __future__ import annotations

from overbrainer_prefect.reports.files import FileEntry

__all__ = ["FileEntry", "RunFailed"]


class RunFailed(Exception):
    """A job ended failed; the message says why and what to do next."""
