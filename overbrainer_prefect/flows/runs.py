"""The `runs` flow: the runs of a runs directory (their exports and compares
too), newest first, with their kind, state, target, steps, final loss, spend,
age, what to run next and what became of their model (delivered where, or kept
back by a gate, and why), as a table artifact and the flow's result
(`kinds/listing.py`)."""

from __future__ import annotations

from datetime import UTC, datetime

from prefect import flow, get_run_logger
from prefect.artifacts import acreate_table_artifact

from overbrainer_prefect.kinds.listing import RunsListing, listing, table_rows
from overbrainer_prefect.runs.store import RunState
from overbrainer_prefect.runs_dir import runs_at

RUNS_ARTIFACT = "runs"


@flow(name="runs", persist_result=True)
async def runs(
    state: list[RunState] | None = None, runs_dir: str | None = None, limit: int = 100
) -> RunsListing:
    """Lists the runs of the runs directory (`runs_dir`, $OVERBRAINER_RUNS_DIR or
    ./runs) with their exports and compares, newest first: kind, state, target,
    steps, final loss, spend, age, what to run next and delivery, as a table artifact
    (`runs`). `state` keeps only the rows in those states. Unreadable records
    are left out and logged; fails only when the runs directory cannot be read."""
    store = await runs_at(runs_dir)
    listed, total = listing(store, state, limit)
    logger = get_run_logger()
    for line in listed.skipped:
        logger.warning("left out an unreadable record: %s", line)
    wanted = f" ({', '.join(str(s) for s in state)})" if state else ""
    description = f"Runs in {store.where}{wanted}, newest first"
    if listed.left_out:
        description += f"; {listed.left_out} older ones left out (raise limit)"
    await acreate_table_artifact(
        table=table_rows(listed.rows) or [{"run": f"no run{wanted} in {store.where}"}],
        key=RUNS_ARTIFACT,
        description=description,
    )
    logger.info(
        "%d of %d rows%s in %s listed (table artifact %r), at %s",
        len(listed.rows),
        total,
        wanted,
        store.where,
        RUNS_ARTIFACT,
        datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
    )
    return listed
