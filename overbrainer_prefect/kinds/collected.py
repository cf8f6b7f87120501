"""What the collector did with each job whose follower was gone, and its report."""

from __future__ import annotations

from pydantic import BaseModel

from overbrainer_prefect.runs.store import RunRecord, Runs, RunsError, RunState
from overbrainer_prefect.store.records import RecordError


class Collected(BaseModel):
    """What the collector did with one job."""

    run_id: str
    """The run, or the export or compare (`kind`), the collector finished."""
    target: str
    was: RunState
    kind: str = "run"
    """`run`, or an export or compare: `export E of run R`."""
    action: str
    state: RunState
    retrieved: bool = False
    files: int = 0
    message: str | None = None


def state_now(runs: Runs, record: RunRecord) -> RunState:
    """The state `record` has on disk now (as it was, when it cannot be read)."""
    try:
        return runs.load(record.id).state
    except (RecordError, RunsError):
        return record.state


def collected_markdown(rows: list[Collected], root: str, followed: list[str] | None = None) -> str:
    """The collect's report: one row a job it finished, then a line each job
    it left to its live follower (`followed`: who, until when)."""
    lines = [f"# Collected runs in `{root}`", ""]
    tail = ["", *(f"- {line}" for line in followed)] if followed else []
    if not rows:
        lines.append("Nothing to collect: every run has ended or is followed.")
        return "\n".join([*lines, *tail]) + "\n"
    lines += [
        "| run | target | was | action | now | files | message |",
        "|---|---|---|---|---|---:|---|",
    ]
    for row in rows:
        files = f"{row.files} verified" if row.retrieved else "not retrieved"
        message = (row.message or "").replace("|", "\\|").replace("\n", " ")
        shown = row.run_id if row.kind == "run" else row.kind
        lines.append(
            f"| {shown} | {row.target} | {row.was} | {row.action} | **{row.state}** "
            f"| {files} | {message} |"
        )
    return "\n".join([*lines, *tail]) + "\n"
