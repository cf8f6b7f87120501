"""The jobs of a runs directory as rows: every run and the jobs below it
(exports, compares, evaluations), newest first, with their kind, state,
target, steps, final loss, spend, age, what to run next, and what became of
a run's model (delivered where, or kept back by a gate, and why)."""

from __future__ import annotations

import time
from collections.abc import Iterable

from pydantic import BaseModel, Field

from overbrainer_prefect.cells import sig
from overbrainer_prefect.delivery.record import load_deliveries
from overbrainer_prefect.kinds.registry import KINDS
from overbrainer_prefect.kinds.training import next_step
from overbrainer_prefect.runs.metrics import stored_summary
from overbrainer_prefect.runs.store import (
    RunRecord,
    Runs,
    RunsError,
    RunState,
    follow_again,
    local_path,
)
from overbrainer_prefect.store.records import RecordError
from overbrainer_prefect.targets.spend import spent
from overbrainer_prefect.timestamps import parse_rfc3339
from overbrainer_prefect.trainers.base import METRICS_FILE


class RunRow(BaseModel):
    """One run, export or compare, as the `runs` flow lists it."""

    id: str
    kind: str = Field(description="training, export or compare.")
    state: RunState
    target: str
    parent: str | None = Field(default=None, description="The run an export or compare is of.")
    steps: int | None = None
    final_loss: float | None = None
    spend_usd: float | None = Field(default=None, description="A pod's estimated cost.")
    delivery: str | None = Field(
        default=None,
        description="A run's last delivery (`delivered: ollama tuned:q8_0`) or its gate's "
        "refusal (`not delivered: held-out 0/9 ...`); none when neither happened.",
    )
    created: str
    age: str
    next: str


class RunsListing(BaseModel):
    """What the `runs` flow returns: the rows it listed and how many it left out."""

    runs_dir: str
    rows: list[RunRow] = Field(default_factory=list)
    left_out: int = Field(default=0, description="Rows past `limit`.")
    skipped: list[str] = Field(
        default_factory=list, description="Records that could not be read, with why."
    )


def age_text(created: str, now: float | None = None) -> str:
    """How long ago an RFC 3339 time was: `42 s`, `5 min`, `3 h`, `2 d`."""
    seconds = max(0.0, (now or time.time()) - parse_rfc3339(created).timestamp())
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.0f} h"
    return f"{seconds / 86400:.0f} d"


def next_of(record: RunRecord) -> str:
    """What to run next for a run, export or compare."""
    if record.parent is None:
        return next_step(record)
    if not record.state.ended:
        return f"Follow it again with {follow_again(record)}."
    if record.state == RunState.SUCCEEDED:
        return f"Its files are in `{local_path(record)}/`."
    return f"See `{local_path(record)}/job.log`, fix the cause, and run the {record.trainer} again."


def row_of(store: Runs, record: RunRecord, now: float) -> RunRow:
    """The row of one record: its steps and final loss from its metrics file, its
    spend from its pod record, what became of its model from its deliveries
    record (an unreadable one shows as such)."""
    steps = final = delivery = None
    if record.parent is None:
        try:
            delivery = load_deliveries(store, record.id).latest
        except RecordError as error:
            delivery = f"deliveries unreadable: {error}"
        summary = stored_summary(store, record.id, METRICS_FILE)
        steps = summary.last.step if summary.last else 0
        final = summary.final_loss
    return RunRow(
        id=record.id,
        kind=record.trainer if record.parent is not None else "training",
        state=record.state,
        target=record.target,
        parent=record.parent,
        steps=steps,
        final_loss=final,
        spend_usd=spent(store, record),
        delivery=delivery,
        created=record.created,
        age=age_text(record.created, now),
        next=next_of(record),
    )


def list_rows(runs: Runs, states: set[RunState] | None, skipped: list[str]) -> list[RunRow]:
    """Every run of `runs` and its exports and compares whose state is in
    `states` (all when None), newest first. Unreadable records are noted in
    `skipped` and left out."""

    def skip(name: str, error: RecordError) -> None:
        skipped.append(f"{name}: {error}")

    now = time.time()
    rows = []
    for record in runs.list(skipped=skip):
        stores: list[tuple[Runs, RunRecord]] = [(runs, record)]
        for kind in KINDS:
            if not kind.child:
                continue
            children = kind.store(runs, record.id)
            stores += [(children, child) for child in children.list(skipped=skip)]
        rows += [
            row_of(store, found, now)
            for store, found in stores
            if states is None or found.state in states
        ]
    return sorted(rows, key=lambda row: row.created, reverse=True)


def table_rows(rows: list[RunRow]) -> list[dict[str, object]]:
    """The rows as the table artifact shows them: losses to 4 significant digits,
    spend in dollars."""
    return [
        {
            "run": row.id if row.parent is None else f"{row.id} (of {row.parent})",
            "kind": row.kind,
            "state": str(row.state),
            "target": row.target,
            "steps": row.steps,
            "final loss": None if row.final_loss is None else sig(row.final_loss),
            "spend": None if row.spend_usd is None else f"${row.spend_usd:.2f}",
            "age": row.age,
            "next": row.next,
            "delivery": row.delivery,
        }
        for row in rows
    ]


def unfinished_of(runs: Runs, flow_run_ids: Iterable[str]) -> list[tuple[Runs, RunRecord]]:
    """The jobs (in every store of `runs`) created by one of `flow_run_ids`
    that have not ended, each with its store: those the live index names
    (runs/live.py), every record where it was never built. Raises
    RecordIoError when the runs directory cannot be read."""
    ids = set(flow_run_ids)
    entries = runs.live()
    if entries is None:
        records = [
            (store, record)
            for store in runs.stores()
            for record in store.list(skipped=lambda _name, _error: None)
        ]
    else:
        records = []
        for store, record_id in sorted(
            entries, key=lambda entry: (bool(entry[0].prefix), entry[1])
        ):
            try:
                records.append((store, store.load(record_id)))
            except (RunsError, RecordError):  # not there yet, or unreadable: not this one's
                continue
    return [
        (store, record)
        for store, record in records
        if record.flow_run_id in ids and not record.state.ended
    ]


def listing(store: Runs, states: list[RunState] | None, limit: int) -> tuple[RunsListing, int]:
    """The newest `limit` rows of the runs directory `store` (only those in
    `states` when given) and how many rows there were in all. Raises ValueError
    for a `limit` below 1; RecordIoError when the directory cannot be read."""
    if limit < 1:
        raise ValueError(f"limit must be at least 1, not {limit}")
    skipped: list[str] = []
    rows = list_rows(store, set(states) if states else None, skipped)
    listed = RunsListing(
        runs_dir=store.where,
        rows=rows[:limit],
        left_out=max(0, len(rows) - limit),
        skipped=skipped,
    )
    return listed, len(rows)
