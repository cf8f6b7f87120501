"""The `deliver` flow: puts a succeeded run where people run models, an Ollama
server (its exported GGUF) and/or a Hugging Face Hub repository (its adapter
and/or GGUF, with a model card), each file checked against its verified
manifest before it is sent. What was delivered is recorded in
`runs/<run-id>/deliveries.json`, and a link artifact points to each
destination."""

from __future__ import annotations

import asyncio
import hashlib
import re
from typing import Any, Literal

from prefect import flow, get_run_logger, task
from prefect.artifacts import acreate_link_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from overbrainer_prefect.artifacts import artifact_key
from overbrainer_prefect.blocks import HuggingFaceCredentials, OllamaServer
from overbrainer_prefect.delivery import DeliveryError, public_url
from overbrainer_prefect.delivery.gguf_metadata import read_header
from overbrainer_prefect.delivery.hub import (
    CARD_FILE,
    Committed,
    HubFile,
    check_repo_id,
    commit_to_hub,
)
from overbrainer_prefect.delivery.modelcard import facts_of_run, model_card
from overbrainer_prefect.delivery.ollama import OllamaClient, Pushed, chat_settings
from overbrainer_prefect.delivery.record import DeliveredFile, Delivery, add_delivery
from overbrainer_prefect.delivery.result import (
    DEFAULT_HF_BLOCK,
    DeliveryFailed,
    DeliveryResult,
    deliver_again,
    ollama_model_name,
)
from overbrainer_prefect.delivery.sources import (
    ExportedGguf,
    LocalFile,
    adapter_files,
    find_gguf,
    normalize_quant,
)
from overbrainer_prefect.runs.ids import rfc3339
from overbrainer_prefect.runs.store import RunRecord, Runs, RunState

What = Literal["adapter", "gguf", "both"]


@flow(name="deliver", persist_result=True)
async def deliver(
    run_id: str,
    ollama: str | None = None,
    model_name: str | None = None,
    hub_repo: str | None = None,
    huggingface: str = DEFAULT_HF_BLOCK,
    private: bool = True,
    quant: str = "q4_k_m",
    what: What = "both",
    runs_dir: str | None = None,
    evaluation_id: str | None = None,
) -> DeliveryResult:
    """Delivers the succeeded run `run_id`: to the Ollama server of the
    `OllamaServer` block `ollama` (its GGUF of type `quant`, as the model
    `model_name`, by default `<base>-<run-id>:<quant>` after the block's
    prefix), and/or to the Hub repository `hub_repo` with the token of the
    `HuggingFaceCredentials` block `huggingface` (`what`: the adapter, the
    GGUF or both, and a model card, in one commit; a new repository is
    `private` by default). `evaluation_id`, the evaluation whose gate let the
    run through, is recorded with each delivery.

    Fails before anything is sent, with one line, when no destination is
    given, the run has not succeeded, it has no export of `quant` when a GGUF
    is needed, a file does not match its verified manifest, or a block is
    missing. A destination that fails does not stop the other; the flow then
    fails with one line per failure saying how to deliver again (the GGUF stays
    verified in the run directory).
    """
    logger = get_run_logger()
    if ollama is None and hub_repo is None:
        raise DeliveryFailed(
            "nothing to deliver to: give ollama=<OllamaServer block name> and/or "
            "hub_repo=<org/name>"
        )
    try:
        quant = normalize_quant(quant)
        if hub_repo is not None:
            hub_repo = check_repo_id(hub_repo)
    except DeliveryError as error:
        raise DeliveryFailed(str(error)) from None
    runs = Runs(runs_dir)
    record = runs.load(run_id)
    if record.state != RunState.SUCCEEDED:
        raise DeliveryFailed(
            f"run {run_id} has not succeeded ({record.state}): only a succeeded run is delivered"
        )
    needs_gguf = ollama is not None or (hub_repo is not None and what != "adapter")
    needs_adapter = hub_repo is not None and what != "gguf"
    try:
        gguf = await asyncio.to_thread(find_gguf, runs, record, quant) if needs_gguf else None
        adapter = await asyncio.to_thread(adapter_files, runs, record) if needs_adapter else []
    except DeliveryError as error:
        raise DeliveryFailed(str(error)) from None
    server = await _load_block(OllamaServer, ollama) if ollama is not None else None
    credentials = (
        await _load_block(HuggingFaceCredentials, huggingface) if hub_repo is not None else None
    )
    if gguf is not None:
        logger.info(
            "run %s: GGUF %s of export %s verified (SHA-256 %s)",
            run_id,
            gguf.file.shown,
            gguf.export_id,
            gguf.file.sha256,
        )
    deliveries: list[Delivery] = []
    failures: list[str] = []
    if server is not None and gguf is not None and ollama is not None:
        name = ollama_model_name(record, quant, model_name, server.model_prefix)
        again = deliver_again(run_id, quant, ollama=ollama, model_name=model_name)
        try:
            pushed = await deliver_to_ollama(server, record, gguf, name)
        except DeliveryError as error:
            failures.append(
                f"{error}; the GGUF stays verified at {gguf.file.shown}: deliver it again "
                f"with {again}"
            )
        else:
            made = _ollama_delivery(server, pushed, gguf, evaluation_id)
            deliveries.append(await _recorded(runs, run_id, made))
    if credentials is not None and hub_repo is not None:
        again = deliver_again(
            run_id,
            quant,
            hub_repo=hub_repo,
            huggingface=huggingface if huggingface != DEFAULT_HF_BLOCK else None,
            private=None if private else "false",
            what=what,
        )
        try:
            committed = await deliver_to_hub(
                runs, record, hub_repo, credentials, private, adapter, gguf
            )
        except DeliveryError as error:
            kept = (
                f"the GGUF stays verified at {gguf.file.shown}"
                if gguf
                else f"the adapter stays verified in runs/{run_id}/output/"
            )
            failures.append(f"{error}; no commit was made and {kept}: deliver again with {again}")
        else:
            made = _hub_delivery(committed, gguf, evaluation_id)
            deliveries.append(await _recorded(runs, run_id, made))
            if private and committed.private is False:
                logger.warning(
                    "%s already existed and is public: the Hub keeps an existing repository's "
                    "visibility",
                    committed.repo_id,
                )
    if failures:
        raise DeliveryFailed(" | ".join(failures))
    return DeliveryResult(run_id=run_id, deliveries=deliveries)


@task(name="deliver-to-ollama", cache_policy=NO_CACHE, persist_result=False)
async def deliver_to_ollama(
    server: OllamaServer, record: RunRecord, gguf: ExportedGguf, model: str
) -> Pushed:
    """Pushes the verified GGUF to the server (its blob only when the server does
    not have it) and creates `model` with the chat template of the GGUF.
    Raises DeliveryError with one line."""
    logger = get_run_logger()
    try:
        header = await asyncio.to_thread(read_header, gguf.file.path)
        template = (record.spec or {}).get("chat_template")
        training_template = template if isinstance(template, str) else None
        settings = chat_settings(header.chat_template, training_template)
        async with OllamaClient(server.url) as client:
            pushed = await client.push_gguf(gguf.file.path, gguf.file.sha256, model, settings)
    except OSError as error:
        raise DeliveryError(f"cannot read {gguf.file.shown} ({error.strerror or error})") from None
    logger.info(
        "run %s: model %s created on %s from %s (%s; blob %s)",
        record.id,
        pushed.model,
        public_url(server.url),
        gguf.file.name,
        settings.described,
        "sent" if pushed.uploaded else "already there",
    )
    return pushed


@task(name="deliver-to-hub", cache_policy=NO_CACHE, persist_result=False)
async def deliver_to_hub(
    runs: Runs,
    record: RunRecord,
    repo: str,
    credentials: HuggingFaceCredentials,
    private: bool,
    adapter: list[LocalFile],
    gguf: ExportedGguf | None,
) -> Committed:
    """Commits the adapter files and/or the GGUF with their model card to `repo`,
    in one commit. Raises DeliveryError with one line."""
    files = [HubFile(path_in_repo=f.name, file=f) for f in adapter]
    if gguf is not None:
        files.append(HubFile(path_in_repo=gguf.file.name, file=gguf.file))
    title = repo.rsplit("/", 1)[-1]
    facts = await asyncio.to_thread(
        facts_of_run,
        runs.run_dir(record.id),
        record,
        title,
        [(f.path_in_repo, f.file) for f in files],
        gguf,
        bool(adapter),
    )
    parts = (["adapter"] if adapter else []) + ([f"GGUF {gguf.quant}"] if gguf else [])
    committed = await asyncio.to_thread(
        commit_to_hub,
        repo,
        files,
        model_card(facts).content,
        token=credentials.token,
        endpoint=credentials.endpoint,
        private=private,
        message=f"overbrainer run {record.id}: {' and '.join(parts)}",
    )
    get_run_logger().info(
        "run %s: %d files and %s committed to %s (commit %s)",
        record.id,
        len(files),
        CARD_FILE,
        committed.url,
        committed.commit,
    )
    return committed


async def _load_block(kind: type[Any], name: str) -> Any:
    try:
        return await kind.aload(name)
    except ValueError:
        raise DeliveryFailed(
            f"no {kind.get_block_type_name()!r} block named {name!r}: create it with "
            "`python blocks/create_blocks.py` or in the Prefect UI under Blocks"
        ) from None


def _ollama_delivery(
    server: OllamaServer, pushed: Pushed, gguf: ExportedGguf, evaluation_id: str | None
) -> Delivery:
    return Delivery(
        destination="ollama",
        name=pushed.model,
        url=public_url(server.url),
        export_id=gguf.export_id,
        quant=gguf.quant,
        files=[DeliveredFile(path=pushed.file_name, size=gguf.file.size, sha256=gguf.file.sha256)],
        evaluation_id=evaluation_id,
        delivered=rfc3339(),
        flow_run_id=flow_run.id,
    )


def _hub_delivery(
    committed: Committed, gguf: ExportedGguf | None, evaluation_id: str | None
) -> Delivery:
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
        flow_run_id=flow_run.id,
    )


async def _recorded(runs: Runs, run_id: str, delivery: Delivery) -> Delivery:
    """Records `delivery` in the run's `deliveries.json` and links it, as soon as it is made."""
    await asyncio.to_thread(add_delivery, runs.run_dir(run_id), delivery)
    await _link(run_id, delivery)
    return delivery


async def _link(run_id: str, delivery: Delivery) -> None:
    if delivery.destination == "ollama":
        text = f"{delivery.name} on {delivery.url}"
        description = f"Run {run_id} delivered to Ollama as {delivery.name}"
    else:
        text = f"{delivery.name} on the Hugging Face Hub"
        description = f"Run {run_id} delivered to the Hub, commit {delivery.commit}"
    await acreate_link_artifact(
        link=delivery.url,
        link_text=text,
        key=artifact_key(run_id, f"{delivery.destination}-{_key_part(delivery.name)}"),
        description=description,
    )


def _key_part(name: str) -> str:
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:40]
    return f"{slug}-{digest}"
