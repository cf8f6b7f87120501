"""A delivery from start to record, without Prefect: what a run delivers,
checked before anything is sent (`check_delivery`); its GGUF pushed to an
Ollama server (`push_to_ollama`) and/or its files committed with their model
card to a Hub repository (`commit_run`); each as the `Delivery` its run
records, and the line that says how to deliver again when one fails.
The `deliver` flow adds the blocks, the logs and the link artifacts."""

from __future__ import annotations

import asyncio
import hashlib
import re
from dataclasses import dataclass
from typing import Literal

from pydantic import SecretStr

from overbrainer_prefect.delivery import DeliveryError, public_url
from overbrainer_prefect.delivery.gguf_metadata import read_header
from overbrainer_prefect.delivery.hub import Committed, HubFile, check_repo_id, commit_to_hub
from overbrainer_prefect.delivery.modelcard import facts_of_run, model_card
from overbrainer_prefect.delivery.ollama import ModelSettings, OllamaClient, Pushed, chat_settings
from overbrainer_prefect.delivery.record import (
    DeliveredFile,
    Delivery,
    NotDelivered,
    add_not_delivered,
)
from overbrainer_prefect.delivery.result import DEFAULT_HF_BLOCK, DeliveryFailed, deliver_again
from overbrainer_prefect.delivery.sources import (
    ExportedGguf,
    LocalFile,
    adapter_files,
    find_gguf,
    normalize_quant,
)
from overbrainer_prefect.evaluation.gate import GateDecision
from overbrainer_prefect.runs.store import RunRecord, Runs, RunState
from overbrainer_prefect.timestamps import rfc3339

What = Literal["adapter", "gguf", "both"]
"""What a Hub delivery commits: the adapter, the GGUF, or both."""


@dataclass(frozen=True)
class ToDeliver:
    """A succeeded run's files, checked against their verified manifest before
    anything is sent: its GGUF of `quant` (when a destination needs it) and its
    adapter files (when the Hub gets them)."""

    record: RunRecord
    quant: str
    hub_repo: str | None
    gguf: ExportedGguf | None
    adapter: list[LocalFile]


def check_delivery(
    runs: Runs, run_id: str, ollama: str | None, hub_repo: str | None, quant: str, what: What
) -> ToDeliver:
    """What run `run_id` delivers to `ollama` and/or `hub_repo`, every file
    checked. Raises DeliveryFailed with one line, before anything is sent, when
    no destination is given, the run has not succeeded, the quant or repo id
    is not valid, or a file is missing or does not match its manifest."""
    if ollama is None and hub_repo is None:
        raise DeliveryFailed(
            "nothing to deliver to: give ollama=<OllamaServer block name> and/or "
            "hub_repo=<org/name>"
        )
    try:
        quant = normalize_quant(quant)
        if hub_repo is not None:
            hub_repo = check_repo_id(hub_repo)
        record = runs.load(run_id)
        if record.state != RunState.SUCCEEDED:
            raise DeliveryFailed(
                f"run {run_id} has not succeeded ({record.state}): only a succeeded run is "
                "delivered"
            )
        needs_gguf = ollama is not None or (hub_repo is not None and what != "adapter")
        needs_adapter = hub_repo is not None and what != "gguf"
        gguf = find_gguf(runs, record, quant) if needs_gguf else None
        adapter = adapter_files(runs, record) if needs_adapter else []
    except DeliveryError as error:
        raise DeliveryFailed(str(error)) from None
    return ToDeliver(record, quant, hub_repo, gguf, adapter)


async def push_to_ollama(
    url: str, record: RunRecord, gguf: ExportedGguf, model: str
) -> tuple[Pushed, ModelSettings]:
    """Pushes the verified GGUF to the Ollama server at `url` (its blob only
    when the server does not have it) and creates `model` with the chat
    template of the GGUF (or the run's training template). Raises
    DeliveryError with one line."""
    try:
        header = await asyncio.to_thread(read_header, gguf.file.path)
        template = (record.spec or {}).get("chat_template")
        settings = chat_settings(
            header.chat_template, template if isinstance(template, str) else None
        )
        async with OllamaClient(url) as client:
            pushed = await client.push_gguf(gguf.file.path, gguf.file.sha256, model, settings)
    except OSError as error:
        raise DeliveryError(f"cannot read {gguf.file.shown} ({error.strerror or error})") from None
    return pushed, settings


def commit_run(
    runs: Runs,
    record: RunRecord,
    repo: str,
    token: SecretStr,
    endpoint: str | None,
    private: bool,
    adapter: list[LocalFile],
    gguf: ExportedGguf | None,
) -> tuple[Committed, int]:
    """Commits the adapter files and/or the GGUF with their model card to `repo`,
    in one commit; returns it and how many files it holds besides the card.
    Raises DeliveryError with one line."""
    files = [HubFile(path_in_repo=f.name, file=f) for f in adapter]
    if gguf is not None:
        files.append(HubFile(path_in_repo=gguf.file.name, file=gguf.file))
    facts = facts_of_run(
        runs,
        record,
        repo.rsplit("/", 1)[-1],
        [(f.path_in_repo, f.file) for f in files],
        gguf,
        bool(adapter),
    )
    parts = (["adapter"] if adapter else []) + ([f"GGUF {gguf.quant}"] if gguf else [])
    committed = commit_to_hub(
        repo,
        files,
        model_card(facts).content,
        token=token,
        endpoint=endpoint,
        private=private,
        message=f"overbrainer run {record.id}: {' and '.join(parts)}",
    )
    return committed, len(files)


def ollama_delivery(
    url: str,
    pushed: Pushed,
    gguf: ExportedGguf,
    evaluation_id: str | None,
    flow_run_id: str | None = None,
) -> Delivery:
    """The record of a GGUF pushed to the Ollama server at `url`."""
    return Delivery(
        destination="ollama",
        name=pushed.model,
        url=public_url(url),
        export_id=gguf.export_id,
        quant=gguf.quant,
        files=[DeliveredFile(path=pushed.file_name, size=gguf.file.size, sha256=gguf.file.sha256)],
        evaluation_id=evaluation_id,
        delivered=rfc3339(),
        flow_run_id=flow_run_id,
    )


def hub_delivery(
    committed: Committed,
    gguf: ExportedGguf | None,
    evaluation_id: str | None,
    flow_run_id: str | None = None,
) -> Delivery:
    """The record of a commit to a Hub repository."""
    return Delivery(
        destination="hub",
        name=committed.repo_id,
        url=committed.url,
        export_id=gguf.export_id if gguf else None,
        quant=gguf.quant if gguf else None,
        files=[
            DeliveredFile(path=f.path_in_repo, size=f.file.size, sha256=f.file.sha256)
            for f in committed.files
        ],
        commit=committed.commit,
        private=committed.private,
        evaluation_id=evaluation_id,
        delivered=rfc3339(),
        flow_run_id=flow_run_id,
    )


def verified_line(todo: ToDeliver) -> str | None:
    """`run R: GGUF <path> of export E verified (SHA-256 ...)`, None without a GGUF."""
    gguf = todo.gguf
    if gguf is None:
        return None
    return (
        f"run {todo.record.id}: GGUF {gguf.file.shown} of export {gguf.export_id} verified "
        f"(SHA-256 {gguf.file.sha256})"
    )


def ollama_failure(todo: ToDeliver, error: DeliveryError, ollama: str, model: str | None) -> str:
    """Why the push to the `OllamaServer` block `ollama` failed, what stays
    verified, and the deliver flow that delivers it again."""
    again = deliver_again(todo.record.id, todo.quant, ollama=ollama, model_name=model)
    return f"{error}; {_kept(todo)}: deliver it again with {again}"


def hub_failure(
    todo: ToDeliver, error: DeliveryError, huggingface: str, private: bool, what: What
) -> str:
    """Why the commit to the Hub failed, what stays verified, and the deliver
    flow that delivers it again (its non-default parameters)."""
    again = deliver_again(
        todo.record.id,
        todo.quant,
        hub_repo=todo.hub_repo,
        huggingface=huggingface if huggingface != DEFAULT_HF_BLOCK else None,
        private=None if private else "false",
        what=what,
    )
    return f"{error}; no commit was made and {_kept(todo)}: deliver again with {again}"


def _kept(todo: ToDeliver) -> str:
    if todo.gguf is not None:
        return f"the GGUF stays verified at {todo.gguf.file.shown}"
    return f"the adapter stays verified in runs/{todo.record.id}/output/"


def link_of(run_id: str, delivery: Delivery) -> tuple[str, str, str]:
    """The link a delivery shows: its text, its description, and the part of
    its artifact key after the run's (lowercase, one per destination and name)."""
    if delivery.destination == "ollama":
        text = f"{delivery.name} on {delivery.url}"
        description = f"Run {run_id} delivered to Ollama as {delivery.name}"
    else:
        text = f"{delivery.name} on the Hugging Face Hub"
        description = f"Run {run_id} delivered to the Hub, commit {delivery.commit}"
    digest = hashlib.sha256(delivery.name.encode()).hexdigest()[:8]
    slug = re.sub(r"[^a-z0-9]+", "-", delivery.name.lower()).strip("-")[:40]
    return text, description, f"{delivery.destination}-{slug}-{digest}"


def keep_back(
    runs: Runs, run_id: str, gate: GateDecision, again: str, flow_run_id: str | None = None
) -> str:
    """Records in the run's `deliveries.json` that `gate` kept run `run_id`
    back, and returns the line that says so: `not delivered: <reason>; ...`
    with what was kept and `again`, the command that delivers it anyway.
    Raises RecordError when the refusal cannot be recorded."""
    refused = NotDelivered(
        reason=gate.reason,
        evaluation_id=gate.evaluation_id,
        decided=rfc3339(),
        flow_run_id=flow_run_id,
    )
    add_not_delivered(runs, run_id, refused)
    evaluation = f" (evaluation {gate.evaluation_id})" if gate.evaluation_id else ""
    return (
        f"not delivered: {gate.reason}{evaluation}; run {run_id} and its GGUF are kept: "
        f"deliver it anyway with {again}"
    )
