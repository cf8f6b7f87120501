"""What the nights of a deployment trained, remembered under the runs directory.

Two small records per deployment, in `<runs dir>/.nightly/` (a dot directory,
never taken for a run), named like the gate's record of the last delivered
model (`<deployment>-<hash>`):

- `<name>.delivered.json`: the fingerprint of the last model delivered, its
  run and when; a night whose fingerprint equals it trains nothing;
- `<name>.last.json`: the fingerprint of the last night that trained, so the
  next night's summary says what changed since.

Each is written atomically, whole; nothing else is kept.
"""

from __future__ import annotations

from pydantic import Field

from overbrainer_prefect.evaluation.gate import deployment_stem
from overbrainer_prefect.nightly.fingerprint import Fingerprint
from overbrainer_prefect.runs.store import Runs
from overbrainer_prefect.store.records import (
    DeploymentRecord,
    RecordError,
    load_deployment_record,
    save_deployment_record,
)

NIGHTLY_DIR = ".nightly"
"""Under the runs directory: the fingerprints of each deployment's nights."""


class NightlyRecordError(Exception):
    """A night's record cannot be read or written. The message is one line."""


class Night(DeploymentRecord):
    """One night of a deployment: what it trained (its fingerprint), its run
    once it has one, its flow run and when."""

    fingerprint: Fingerprint
    run_id: str | None = Field(default=None, description="The training run, once there is one.")
    flow_run_id: str | None = Field(default=None, description="The fine-tune's flow run.")
    at: str = Field(description="When it trained, or was delivered: RFC 3339 UTC.")


def night_key(deployment: str, which: str) -> str:
    """The key of the record `which` (`delivered` or `last`) of `deployment`'s nights."""
    return f"{NIGHTLY_DIR}/{deployment_stem(deployment)}.{which}.json"


def load_night(runs: Runs, deployment: str, which: str) -> Night | None:
    """The night `which` (`delivered`: the last delivered model's; `last`: the
    last night that trained) of `deployment`, or None when there is none yet.

    Raises NightlyRecordError with one line when the record cannot be read.
    """
    try:
        return load_deployment_record(
            runs.store, runs.key(night_key(deployment, which)), Night, "night", deployment
        )
    except RecordError as error:
        raise NightlyRecordError(f"{error}: remove it, the next night then trains") from None


def save_night(runs: Runs, night: Night, which: str) -> None:
    """Records `night` as its deployment's night `which`, atomically.

    Raises NightlyRecordError with one line when it cannot be written.
    """
    key = runs.key(night_key(night.deployment, which))
    try:
        save_deployment_record(runs.store, key, night, "night")
    except RecordError as error:
        raise NightlyRecordError(str(error)) from None
