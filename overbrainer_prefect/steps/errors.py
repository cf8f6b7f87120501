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


INTERRUPTED = "interrupted before the job started"
"""Why a job fails when its flow was cancelled or killed before its job started."""


class TargetError(Exception):
    """Where a job runs could not do what the job needed (a pod not had, not
    reached, gone, not deleted). The message is one line saying what happened
    and what to do next; `kept` is what the job's record keeps of it when the
    job fails because of it (never an answer of a provider's API)."""

    def __init__(self, message: str = "", *, kept: str | None = None) -> None:
        super().__init__(message)
        self._kept = kept

    @property
    def kept(self) -> str:
        """What a record keeps of this error."""
        return self._kept if self._kept is not None else str(self)


def failure_reason(error: BaseException) -> str:
    """What the record of a job that did not start keeps of the error that
    stopped it: a target's own words for it, the error's message, or
    `INTERRUPTED` when the flow was cancelled or killed."""
    if not isinstance(error, Exception):
        return INTERRUPTED
    if isinstance(error, TargetError):
        return error.kept
    return str(error) or type(error).__name__
