"""`runs/<run-id>/deliveries.json`: every delivery of a run, appended once
made, with what was sent and its SHA-256. Written atomically, under a lock so
that two flows delivering the same run at once both stay recorded. It never
holds a secret (URLs are kept without user or password)."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from overbrainer_prefect.runs.records import RecordIoError, load_record, save_record

DELIVERIES_FILE = "deliveries.json"
LOCK_FILE = ".deliveries.lock"


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
    delivered: str = Field(description="When, RFC 3339 UTC.")
    flow_run_id: str | None = None


class Deliveries(BaseModel):
    """The record: deliveries oldest first."""

    model_config = ConfigDict(extra="forbid")

    deliveries: list[Delivery] = Field(default_factory=list)


def load_deliveries(run_dir: Path) -> Deliveries:
    """The deliveries recorded in the run directory `run_dir` (none when there
    is no record yet).

    Raises RecordIoError or InvalidRecord when the record cannot be read.
    """
    try:
        return load_record(run_dir / DELIVERIES_FILE, Deliveries, "deliveries")
    except FileNotFoundError:
        return Deliveries()


def add_delivery(run_dir: Path, delivery: Delivery) -> Deliveries:
    """Appends `delivery` to the record of `run_dir` and returns the record.

    Raises RecordIoError or InvalidRecord when the record cannot be read or written.
    """
    with _locked(run_dir):
        record = load_deliveries(run_dir)
        record.deliveries.append(delivery)
        save_record(run_dir, DELIVERIES_FILE, record)
        return record


@contextmanager
def _locked(run_dir: Path) -> Iterator[None]:
    try:
        fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as error:
        raise RecordIoError(run_dir / LOCK_FILE, error) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
