"""What a step of a run raises: one line saying what happened and what to do next."""

from __future__ import annotations


class RunError(Exception):
    """A step of a run failed. The message is one line saying what happened to
    the run and what to do next."""


class NotStarted(RunError):
    """The run never started a job."""

    def __init__(self, run_id: str) -> None:
        super().__init__(f"run {run_id} has no job: it stopped before the job started")


class NotEnded(RunError):
    """`collect` was asked for a run that has not ended."""

    def __init__(self, run_id: str) -> None:
        super().__init__(
            f"run {run_id} has not ended yet: follow it with the attach flow (run_id={run_id})"
        )


class Unreachable(RunError):
    """The target stayed unreachable past the retry budget; the job keeps running."""


class NotRetrieved(RunError):
    """A succeeded job's files could not be retrieved and verified; the run stays
    `running` so a later attach tries again."""
