"""`runs/<run-id>/deliveries.json`: every delivery of a run, appended once
made, with what was sent and its SHA-256 (and the evaluation whose gate let it
through), and every time a gate kept the run from being delivered, with why.
Changed by compare-and-swap, so that two flows delivering the same run at
once both stay recorded. It never holds a secret (URLs are kept without user
or password)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from overbrainer_prefect.runs.store import Runs
from overbrainer_prefect.store.records import read_record, update_record

DELIVERIES_FILE = "deliveries.json"


class DeliveredFile(BaseModel):
    """A file as it was delivered: its name at the destination, size and SHA-256."""

    model_config = ConfigDict(extra="forbid")

    path: str
    size: int
    sha256: str


class Delivery(BaseModel):
    """One delivery of a run to one destination."""

    model_config = ConfigDict(extra="forbid")

    destination: Literal["ollama", "hub"]
    name: str = Field(description="The Ollama model, or the Hub repository id.")
    url: str = Field(description="The Ollama server, or the Hub repository's page.")
    export_id: str | None = Field(default=None, description="The export whose GGUF was sent.")
    quant: str | None = None
    files: list[DeliveredFile] = Field(default_factory=list)
    commit: str | None = Field(default=None, description="The Hub commit that added the files.")
    private: bool | None = Field(default=None, description="Whether the Hub repository is private.")
    evaluation_id: str | None = Field(
        default=None, description="The evaluation whose gate let it through (none: no gate)."
    )
    delivered: str = Field(description="When, RFC 3339 UTC.")
    flow_run_id: str | None = None


class NotDelivered(BaseModel):
    """A gate's refusal: the run was trained, evaluated and kept, not delivered."""

    model_config = ConfigDict(extra="forbid")

    reason: str = Field(description="The criterion the evaluation failed, in one line.")
    evaluation_id: str | None = None
    decided: str = Field(description="When, RFC 3339 UTC.")
    flow_run_id: str | None = None


class Deliveries(BaseModel):
    """The record: deliveries and refusals, each oldest first."""

    model_config = ConfigDict(extra="forbid")

    deliveries: list[Delivery] = Field(default_factory=list)
    not_delivered: list[NotDelivered] = Field(default_factory=list)

    @property
    def latest(self) -> str | None:
        """What became of the run last, in a few words: `delivered: ollama
        tuned:q8_0, hub org/name` (the deliveries of its last flow run) or
        `not delivered: <reason>`; None when nothing was delivered or refused."""
        last = self.deliveries[-1] if self.deliveries else None
        refused = self.not_delivered[-1] if self.not_delivered else None
        if refused is not None and (last is None or refused.decided > last.delivered):
            return f"not delivered: {refused.reason}"
        if last is None:
            return None
        made = [d for d in self.deliveries if d.flow_run_id == last.flow_run_id] or [last]
        return "delivered: " + ", ".join(f"{d.destination} {d.name}" for d in made)


def load_deliveries(runs: Runs, run_id: str) -> Deliveries:
    """The deliveries recorded for the run `run_id` (none when there is no
    record yet).

    Raises RecordIoError or InvalidRecord when the record cannot be read.
    """
    found = read_record(runs.store, runs.key(run_id, DELIVERIES_FILE), Deliveries, "deliveries")
    return found[0] if found is not None else Deliveries()


def add_delivery(runs: Runs, run_id: str, delivery: Delivery) -> Deliveries:
    """Appends `delivery` to the record of the run `run_id` and returns the record.

    Raises RecordIoError or InvalidRecord when the record cannot be read or written.
    """
    return _changed(runs, run_id, lambda record: record.deliveries.append(delivery))


def add_not_delivered(runs: Runs, run_id: str, refused: NotDelivered) -> Deliveries:
    """Appends the gate's refusal `refused` to the record of the run `run_id`
    and returns the record.

    Raises RecordIoError or InvalidRecord when the record cannot be read or written.
    """
    return _changed(runs, run_id, lambda record: record.not_delivered.append(refused))


def _changed(runs: Runs, run_id: str, change: Callable[[Deliveries], None]) -> Deliveries:
    """The record of the run read, changed by `change` and saved by
    compare-and-swap (two flows delivering the run at once both stay recorded)."""

    def changed(record: Deliveries | None) -> Deliveries:
        record = record or Deliveries()
        change(record)
        return record

    saved = update_record(
        runs.store, runs.key(run_id, DELIVERIES_FILE), Deliveries, "deliveries", changed
    )
    assert saved is not None
    return saved
