"""What the flows of every kind of job share: how an ended job becomes the
flow's result (a failed job fails the flow, a cancelled one cancels it), and
the one alias of Prefect's state of any result."""

from __future__ import annotations

from typing import Any, TypeAlias, TypeVar

from prefect import get_run_logger
from prefect.client.schemas.objects import State
from prefect.states import Cancelled

from overbrainer_prefect.runs.store import RunRecord, RunState, subject

AnyState: TypeAlias = State[Any]  # Prefect's state, whatever result it carries
ResultT = TypeVar("ResultT")


class RunFailed(Exception):
    """A job ended failed; the message says why and what to do next."""


def ended(
    record: RunRecord,
    result: ResultT,
    *,
    cancelling: bool = False,
    why: str | None = None,
    line: str | None = None,
) -> ResultT | AnyState:
    """`result`, the result of the ended job `record`, as its flow returns it:
    a cancelled job's (unless this flow cancelled it) as a `Cancelled` state
    holding it, and `line` logged when the result is returned as is. Raises
    RunFailed for a failed job: `<subject> failed: <message>` and `why` after
    it when given."""
    if record.state == RunState.FAILED:
        raise RunFailed(f"{subject(record)} failed: {record.message}" + (f": {why}" if why else ""))
    if record.state == RunState.CANCELLED and not cancelling:
        return Cancelled(message=f"{subject(record)} was cancelled", data=result)
    if line is not None:
        get_run_logger().info("%s", line)
    return result
