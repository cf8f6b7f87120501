"""What the flows raise that every kind of job shares."""

from __future__ import annotations


class RunFailed(Exception):
    """A job ended failed; the message says why and what to do next."""
