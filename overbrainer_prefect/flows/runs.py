"""The `runs` flow: the runs of a runs directory (their exports and compares
too), newest first, with their kind, state, target, steps, final loss, spend,
age and what to run next, as a table artifact and the flow's result."""

from __future__ import annotations

from datetime import UTC, datetime

from prefect import flow, get_run_logger
from prefect.artifacts import acreate_table_artifact

from overbrainer_prefect.kinds.listing import RunsListing, list_rows, table_rows
from overbrainer_prefect.runs.store import Runs, RunState

RUNS_ARTIFACT = "runs"


@flow(name="runs", persist_result=True)
async def runs(
    state: list[RunState] | None = None, runs_dir: str | None = None, limit: int = 100
) -> RunsListing:
    """Lists the runs of the runs directory (`runs_dir`, $OVERBRAINER_RUNS_DIR or
    ./runs) with their exports and compares, newest first: kind, state, target,
    steps, final loss, spend, age and what to run next, as a table artifact
    (`runs`). `state` keeps only the rows in those states. Unreadable records
    are left out and logged; fails only when the runs directory cannot be read."""
    if limit < 1:
        raise ValueError(f"limit must be at least 1, not {limit}")
    store = Runs(runs_dir)
    skipped: list[str] = []
    rows = list_rows(store, set(state) if state else None, skipped)
    logger = get_run_logger()
    for line in skipped:
        logger.warning("left out an unreadable record: %s", line)
    shown, left_out = rows[:limit], max(0, len(rows) - limit)
    wanted = f" ({', '.join(str(s) for s in state)})" if state else ""
    description = f"Runs in {store.root}{wanted}, newest first"
    if left_out:
        description += f"; {left_out} older ones left out (raise limit)"
    if shown:
        await acreate_table_artifact(
            table=table_rows(shown), key=RUNS_ARTIFACT, description=description
        )
    else:
        await acreate_table_artifact(
            table=[{"run": f"no run{wanted} in {store.root}"}],
            key=RUNS_ARTIFACT,
            description=description,
        )
    logger.info(
        "%d of %d rows%s in %s listed (table artifact %r), at %s",
        len(shown),
        len(rows),
        wanted,
        store.root,
        RUNS_ARTIFACT,
        datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
    )
    return RunsListing(runs_dir=str(store.root), rows=shown, left_out=left_out, skipped=skipped)
