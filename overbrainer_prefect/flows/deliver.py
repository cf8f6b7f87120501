"""The `deliver` flow: puts a succeeded run where people run models, an Ollama
server (its exported GGUF) and/or a Hugging Face Hub repository (its adapter
and/or GGUF, with a model card), each file checked against its verified
manifest before it is sent (`delivery/deliver.py`). What was delivered is
recorded in `runs/<run-id>/deliveries.json`, and a link artifact points to
each destination."""

from __future__ import annotations

import asyncio
from typing import TypeVar

from prefect import flow, get_run_logger, task
from prefect.artifacts import acreate_link_artifact
from prefect.blocks.core import Block
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from overbrainer_prefect.artifacts import artifact_key
from overbrainer_prefect.blocks import HuggingFaceCredentials, OllamaServer
from overbrainer_prefect.delivery import DeliveryError, public_url
from overbrainer_prefect.delivery.deliver import (
    ToDeliver,
    What,
    check_delivery,
    commit_run,
    hub_delivery,
    hub_failure,
    link_of,
    ollama_delivery,
    ollama_failure,
    push_to_ollama,
    verified_line,
)
from overbrainer_prefect.delivery.hub import CARD_FILE, Committed
from overbrainer_prefect.delivery.ollama import Pushed
from overbrainer_prefect.delivery.record import Delivery, add_delivery
from overbrainer_prefect.delivery.result import (
    DEFAULT_HF_BLOCK,
    DeliveryFailed,
    DeliveryResult,
    ollama_model_name,
)
from overbrainer_prefect.delivery.sources import ExportedGguf
from overbrainer_prefect.runs.store import RunRecord, Runs
from overbrainer_prefect.runs_dir import runs_at

BlockT = TypeVar("BlockT", bound=Block)


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
    runs = await runs_at(runs_dir)
    todo = await asyncio.to_thread(check_delivery, runs, run_id, ollama, hub_repo, quant, what)
    server = await _load_block(OllamaServer, ollama) if ollama is not None else None
    hub = todo.hub_repo
    credentials = await _load_block(HuggingFaceCredentials, huggingface) if hub else None
    gguf, verified = todo.gguf, verified_line(todo)
    if verified is not None:
        logger.info("%s", verified)
    deliveries: list[Delivery] = []
    failures: list[str] = []
    if server is not None and gguf is not None and ollama is not None:
        name = ollama_model_name(todo.record, todo.quant, model_name, server.model_prefix)
        try:
            pushed = await deliver_to_ollama(server, todo.record, gguf, name)
        except DeliveryError as error:
            failures.append(ollama_failure(todo, error, ollama, model_name))
        else:
            made = ollama_delivery(server.url, pushed, gguf, evaluation_id, flow_run.id)
            deliveries.append(await _recorded(runs, run_id, made))
    if credentials is not None and hub is not None:
        try:
            committed = await deliver_to_hub(runs, todo, hub, credentials, private)
        except DeliveryError as error:
            failures.append(hub_failure(todo, error, huggingface, private, what))
        else:
            made = hub_delivery(committed, gguf, evaluation_id, flow_run.id)
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
    """Pushes the run's verified GGUF to the server and creates `model` (see
    `delivery.deliver.push_to_ollama`). Raises DeliveryError with one line."""
    pushed, settings = await push_to_ollama(server.url, record, gguf, model)
    get_run_logger().info(
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
    runs: Runs, todo: ToDeliver, repo: str, credentials: HuggingFaceCredentials, private: bool
) -> Committed:
    """Commits the run's adapter files and/or GGUF with their model card to
    `repo`, in one commit (see `delivery.deliver.commit_run`). Raises
    DeliveryError with one line."""
    committed, files = await asyncio.to_thread(
        commit_run,
        runs,
        todo.record,
        repo,
        credentials.token,
        credentials.endpoint,
        private,
        todo.adapter,
        todo.gguf,
    )
    get_run_logger().info(
        "run %s: %d files and %s committed to %s (commit %s)",
        todo.record.id,
        files,
        CARD_FILE,
        committed.url,
        committed.commit,
    )
    return committed


async def _load_block(kind: type[BlockT], name: str) -> BlockT:
    try:
        return await kind.aload(name)
    except ValueError:
        raise DeliveryFailed(
            f"no {kind.get_block_type_name()!r} block named {name!r}: create it with "
            "`python blocks/create_blocks.py` or in the Prefect UI under Blocks"
        ) from None


async def _recorded(runs: Runs, run_id: str, delivery: Delivery) -> Delivery:
    """Records `delivery` in the run's `deliveries.json` and links it, as soon as it is made."""
    await asyncio.to_thread(add_delivery, runs, run_id, delivery)
    text, description, key = link_of(run_id, delivery)
    await acreate_link_artifact(
        link=delivery.url,
        link_text=text,
        key=artifact_key(run_id, key),
        description=description,
    )
    return delivery
