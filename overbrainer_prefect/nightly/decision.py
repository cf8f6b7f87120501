"""Whether a night trains, and the words that say why.

A night whose fingerprint equals that of the last model its deployment
delivered trains nothing (unless forced): "nothing changed since run R
(delivered DATE): nothing trained". Otherwise it trains, and its summary says
what changed since the last night that trained and since the last delivery.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from overbrainer_prefect.cells import code_cell, table_cell
from overbrainer_prefect.nightly.fingerprint import (
    Fingerprint,
    differences,
    fingerprint,
    hub_resolver,
    pinned,
)
from overbrainer_prefect.nightly.record import Night, load_night, save_night
from overbrainer_prefect.runs.store import Runs
from overbrainer_prefect.timestamps import rfc3339
from overbrainer_prefect.trainers.spec import TrainingSpec

DELIVERED, LAST = "delivered", "last"


class NightFacts(BaseModel):
    """A night as its summary shows it: its fingerprint, what changed since the
    last night and the last delivery, and why it trains (or not)."""

    model_config = ConfigDict(extra="forbid")

    deployment: str
    fingerprint: Fingerprint
    prepared_by: str | None = Field(default=None, description="The prepare block, if any.")
    last: Night | None = Field(default=None, description="The last night that trained.")
    delivered: Night | None = Field(default=None, description="The last delivered model's night.")
    since_last: list[str] | None = None
    since_delivered: list[str] | None = None
    forced: bool = False
    skipped: str | None = Field(default=None, description="Why nothing trained, if so.")


class NothingTrained(BaseModel):
    """What a night that trained nothing returns: why, and its fingerprint."""

    reason: str
    night: NightFacts


def plan_night(
    runs: Runs,
    deployment: str,
    print_: Fingerprint,
    *,
    force: bool = False,
    prepared_by: str | None = None,
) -> NightFacts:
    """The night of `deployment` whose fingerprint is `print_`: what changed since
    its last night and its last delivered model (from the records under
    `runs`), and `skipped` set when it equals the last delivered model's
    and `force` is off.

    Raises NightlyRecordError with one line when a record cannot be read.
    """
    last = load_night(runs, deployment, LAST)
    delivered = load_night(runs, deployment, DELIVERED)
    facts = NightFacts(
        deployment=deployment,
        fingerprint=print_,
        prepared_by=prepared_by,
        last=last,
        delivered=delivered,
        since_last=differences(last.fingerprint, print_) if last else None,
        since_delivered=differences(delivered.fingerprint, print_) if delivered else None,
        forced=force,
    )
    if delivered is not None and delivered.fingerprint.key == print_.key and not force:
        facts.skipped = (
            f"nothing changed since run {delivered.run_id} (delivered {delivered.at}): "
            "nothing trained; to train anyway, run the fine-tune with force=True"
        )
    return facts


def remember_trained(runs: Runs, facts: NightFacts, run_id: str, flow_run_id: str | None) -> None:
    """Records the night `facts`, which trained run `run_id`, as its deployment's
    last night that trained.

    Raises NightlyRecordError with one line when it cannot be written."""
    _remember(runs, facts, run_id, flow_run_id, LAST)


def remember_delivered(runs: Runs, facts: NightFacts, run_id: str, flow_run_id: str | None) -> None:
    """Records the night `facts`, whose run `run_id` was delivered, as the one the
    next night is compared with.

    Raises NightlyRecordError with one line when it cannot be written."""
    _remember(runs, facts, run_id, flow_run_id, DELIVERED)


def _remember(
    runs: Runs, facts: NightFacts, run_id: str, flow_run_id: str | None, which: str
) -> None:
    night = Night(
        deployment=facts.deployment,
        fingerprint=facts.fingerprint,
        run_id=run_id,
        flow_run_id=flow_run_id,
        at=rfc3339(),
    )
    save_night(runs, night, which)


def why(facts: NightFacts) -> str:
    """Why the night trains (or not), in one line."""
    if facts.skipped is not None:
        return facts.skipped
    if facts.delivered is None:
        return "no model delivered for this deployment yet"
    if facts.forced and not facts.since_delivered:
        return f"forced: nothing changed since run {facts.delivered.run_id}"
    changed = "; ".join(facts.since_delivered or [])
    return f"changed since run {facts.delivered.run_id} (delivered {facts.delivered.at}): {changed}"


def night_facts(facts: NightFacts) -> list[tuple[str, str]]:
    """The night's (label, markdown) rows for the pipeline summary: its
    fingerprint, what prepared its data, what changed since the last night and
    the last delivery, and why it trained."""
    rows = [("fingerprint", code_cell(facts.fingerprint.short))]
    if facts.prepared_by is not None:
        rows.append(("prepared by", code_cell(facts.prepared_by)))
    for number, path in enumerate(_datasets(facts.fingerprint), 1):
        rows.append((f"dataset {number}", code_cell(path)))
    if facts.last is not None:
        changes = "; ".join(facts.since_last or []) or "nothing"
        since = f"run {facts.last.run_id}, {facts.last.at}"
        rows.append((f"changed since the last night ({since})", table_cell(changes)))
    rows.append(("trained because", table_cell(why(facts))))
    return rows


def _datasets(print_: Fingerprint) -> list[str]:
    names = sorted(
        (n for n in print_.sources if n.startswith("dataset ")), key=lambda n: int(n.split()[1])
    )
    return [print_.sources[n] for n in names]


def decide(
    training: TrainingSpec,
    export: BaseModel,
    evaluation: BaseModel | None,
    runs: Runs,
    deployment: str,
    *,
    force: bool = False,
    prepared_by: str | None = None,
) -> tuple[TrainingSpec, NightFacts, list[str]]:
    """Fingerprints what the night would train (Hub revisions resolved to
    their commits) and plans it (see `plan_night`): returns the training with
    those commits pinned, the night's facts, and the lines that say so (the Hub
    commits, then whether it trains and why). Raises FingerprintError or
    NightlyRecordError with one line."""
    print_ = fingerprint(training, export, evaluation, hub_resolver())
    facts = plan_night(runs, deployment, print_, force=force, prepared_by=prepared_by)
    hub = {k: v for k, v in print_.parts.items() if "@" in v and not k.endswith("settings")}
    lines = [f"Hub commits: {', '.join(f'{k} {v}' for k, v in hub.items())}"] if hub else []
    if facts.skipped is not None:
        lines.append(f"fingerprint {print_.short}: {facts.skipped}")
    else:
        lines.append(f"fingerprint {print_.short}: trains: {why(facts)}")
    return pinned(training, print_), facts, lines


def remember(
    runs: Runs,
    facts: NightFacts,
    run_id: str,
    flow_run_id: str | None,
    *,
    trained: bool,
    delivered: bool,
) -> str | None:
    """Records the night `facts` of run `run_id`: as its deployment's last night
    that `trained`, and, when it `delivered`, as the night the next one is
    compared with; returns the line that says so when it delivered. Raises
    NightlyRecordError with one line when a record cannot be written."""
    if trained:
        remember_trained(runs, facts, run_id, flow_run_id)
    if not delivered:
        return None
    remember_delivered(runs, facts, run_id, flow_run_id)
    return (
        f"fingerprint {facts.fingerprint.short} delivered: the next night with the same data "
        "trains nothing"
    )
