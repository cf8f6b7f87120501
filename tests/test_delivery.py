"""Delivery of a run: its verified GGUF to an Ollama server, its adapter and
GGUF with a model card to the Hugging Face Hub, through the real clients
(httpx, huggingface_hub's `HfApi`) against stand-ins of the two APIs on
127.0.0.1 (tests/standins/), and through the `deliver` flow on the real
Prefect test server.

The GGUF is a real one, written by the `gguf` package of the job venv (a
header with SmolLM2's chat template and a vocabulary, and a tensor); the run
and its export are laid out by the real store and retrieved by the real
retrieval (`retrieve.retrieve` with a `LocalExecutor`), so their manifests
are the ones a real run has.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import shutil
import struct
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from huggingface_hub import HfApi
from huggingface_hub import constants as hf_constants
from pydantic import SecretStr

from overbrainer_prefect.delivery.gguf_metadata import GgufError, read_header
from overbrainer_prefect.delivery.hub import HubError, HubFile, commit_to_hub
from overbrainer_prefect.delivery.modelcard import CardFacts, card_data, model_card
from overbrainer_prefect.delivery.ollama import (
    CHATML_TEMPLATE,
    OllamaClient,
    OllamaRejected,
    chat_settings,
)
from overbrainer_prefect.delivery.record import (
    DELIVERIES_FILE,
    DeliveredFile,
    Delivery,
    NotDelivered,
    add_delivery,
    add_not_delivered,
    load_deliveries,
)
from overbrainer_prefect.delivery.sources import LocalFile, SourceError, find_gguf
from overbrainer_prefect.executors.base import JOB_LOG
from overbrainer_prefect.executors.local import LocalExecutor
from overbrainer_prefect.runs.store import RunRecord, Runs, RunState
from overbrainer_prefect.steps import retrieve
from overbrainer_prefect.steps import start as start_step
from overbrainer_prefect.timestamps import rfc3339
from overbrainer_prefect.trainers.axolotl import AxolotlTrainer
from overbrainer_prefect.trainers.base import METRICS_FILE, Artifacts
from overbrainer_prefect.trainers.spec import TrainingSpec
from tests.flowrun import run
from tests.ports import free_port
from tests.standins.hub_server import HubStandIn
from tests.standins.ollama_server import OllamaStandIn

TOKEN = "hf_" + secrets.token_hex(16)  # made at test time, never committed
BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"
QUANT = "q4_k_m"
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

WRITE_GGUF = """
import sys
import numpy as np
import gguf

path, template = sys.argv[1], sys.stdin.read()
writer = gguf.GGUFWriter(path, "llama")
writer.add_name("overbrainer-delivery-test")
writer.add_context_length(64)
writer.add_embedding_length(8)
writer.add_block_count(1)
writer.add_tokenizer_model("gpt2")
writer.add_token_list([f"tok{i}" for i in range(500)])
writer.add_token_scores([0.0] * 500)
writer.add_chat_template(template)
writer.add_tensor("token_embd.weight", np.arange(64, dtype=np.float32).reshape(8, 8))
writer.write_header_to_file()
writer.write_kv_data_to_file()
writer.write_tensors_to_file()
writer.close()
"""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="session")
def gguf_file(job_python: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real GGUF written by the `gguf` package: SmolLM2's chat template, 500
    tokens, one tensor."""
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    subprocess.run(
        [job_python, "-c", WRITE_GGUF, str(path)],
        input=SMOLLM2_TEMPLATE,
        text=True,
        check=True,
        timeout=120,
    )
    return path


@pytest.fixture
def ollama_server() -> Iterator[OllamaStandIn]:
    with OllamaStandIn() as server:
        yield server


@pytest.fixture
def hub() -> Iterator[HubStandIn]:
    with HubStandIn(TOKEN, user="tester", orgs=("overbrainer",)) as server:
        yield server


@pytest.fixture
def hub_client(monkeypatch: pytest.MonkeyPatch) -> None:
    """huggingface_hub allowed to reach the stand-in: the session is offline
    (conftest), and the stand-in speaks the LFS protocol, not Xet."""
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hf_constants, "HF_HUB_DISABLE_XET", True)


def safetensors(values: list[float]) -> bytes:
    """A valid safetensors file holding one F32 tensor."""
    data = struct.pack(f"<{len(values)}f", *values)
    header = json.dumps(
        {"lora_A.weight": {"dtype": "F32", "shape": [len(values)], "data_offsets": [0, len(data)]}}
    ).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + data


class ExportArtifacts:
    """What an export job brings back (the retrieval only asks for this)."""

    def artifacts(self) -> Artifacts:
        return Artifacts(entries=("gguf", METRICS_FILE), required="gguf")


@dataclass
class FakeRun:
    runs: Runs
    record: RunRecord
    run_dir: Path
    export_id: str
    gguf: Path
    dataset: bytes


def make_run(tmp_path: Path, gguf_file: Path, *, export: bool = True) -> FakeRun:
    """A succeeded run of SmolLM2 with a LoRA adapter (and a checkpoint), and a
    succeeded export of it to a q4_k_m GGUF, both retrieved and verified by the
    real retrieval from a local work directory."""
    runs = Runs(tmp_path / "runs")
    work = tmp_path / "work"
    dataset = tmp_path / "chat.jsonl"
    dataset.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    spec = TrainingSpec.model_validate(
        {
            "base_model": BASE,
            "datasets": [str(dataset)],
            "max_steps": 6,
            "lora_r": 8,
            "lora_alpha": 16,
            "learning_rate": 5e-3,
            "extra": {"gradient_checkpointing": True, "comet_api_key": "not-for-the-card"},
        }
    )
    record = start_step.create(
        runs,
        target="overbrainer-local-target/test",
        target_kind="local",
        workdir=str(work),
        spec=spec.model_dump(mode="json"),
    )
    remote = Path(record.remote_dir)
    (remote / "output" / "checkpoint-6").mkdir(parents=True)
    (remote / "output" / "adapter_model.safetensors").write_bytes(safetensors([0.5] * 16))
    (remote / "output" / "adapter_config.json").write_text(
        json.dumps({"base_model_name_or_path": BASE, "peft_type": "LORA", "r": 8})
    )
    (remote / "output" / "chat_template.jinja").write_text(SMOLLM2_TEMPLATE)
    (remote / "output" / "README.md").write_text("axolotl's own card\n")
    (remote / "output" / "training_args.bin").write_bytes(b"\x80\x04pickle")
    (remote / "output" / "checkpoint-6" / "adapter_model.safetensors").write_bytes(
        safetensors([0.25] * 16)
    )
    (remote / "axolotl.yaml").write_text(f"base_model: {BASE}\n")
    losses = [2.0, 1.6, 1.3, 1.1, 0.9, 0.75]
    metrics = [{"event": "begin", "max_steps": 6, "time": 1.0}]
    metrics += [{"event": "log", "step": i + 1, "loss": loss} for i, loss in enumerate(losses)]
    metrics.append({"event": "end", "step": 6})
    (remote / METRICS_FILE).write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (remote / JOB_LOG).write_text("trained\n")
    local = runs.run_dir(record.id)
    (local / "data").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(dataset, local / "data" / "chat.jsonl")
    executor = LocalExecutor(work)
    trainer = AxolotlTrainer(spec)
    run(
        retrieve.retrieve(
            executor, sys.executable, trainer, runs, record.id, record.remote_dir, True
        )
    )
    record.state = RunState.SUCCEEDED
    record.ended = rfc3339()
    runs.save(record)
    export_id = ""
    gguf = Path()
    if export:
        exports = runs.children(record.id, "export")
        exported = start_step.create(
            exports,
            target=record.target,
            target_kind="local",
            workdir=str(work / "exports"),
            trainer="export",
            spec={"quant": QUANT},
            parent=record.id,
        )
        eremote = Path(exported.remote_dir)
        (eremote / "gguf").mkdir(parents=True)
        name = f"smollm2-135m-instruct-{record.id}-{QUANT}.gguf"
        shutil.copyfile(gguf_file, eremote / "gguf" / name)
        (eremote / METRICS_FILE).write_text('{"event": "end"}\n')
        (eremote / JOB_LOG).write_text("exported\n")
        elocal = exports.run_dir(exported.id)
        run(
            retrieve.retrieve(
                executor,
                sys.executable,
                ExportArtifacts(),
                exports,
                exported.id,
                exported.remote_dir,
                True,  # type: ignore[arg-type]
            )
        )
        exported.state = RunState.SUCCEEDED
        exported.ended = rfc3339()
        exports.save(exported)
        export_id, gguf = exported.id, elocal / "gguf" / name
    return FakeRun(runs, record, local, export_id, gguf, dataset.read_bytes())


# the GGUF header and the chat template


def test_a_real_gguf_header_gives_its_chat_template(gguf_file: Path, tmp_path: Path) -> None:
    header = read_header(gguf_file)
    assert header.version == 3 and header.tensor_count == 1
    assert header.chat_template == SMOLLM2_TEMPLATE
    assert header.metadata["general.architecture"] == "llama"
    assert header.metadata["llama.context_length"] == 64
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"PK\x03\x04" + b"\0" * 60)
    with pytest.raises(GgufError, match="model.gguf is not a GGUF file"):
        read_header(not_gguf)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(gguf_file.read_bytes()[:200])
    with pytest.raises(GgufError, match="cut short"):
        read_header(cut)


def test_a_chatml_template_becomes_an_ollama_template_with_its_stop_word_and_system() -> None:
    settings = chat_settings(SMOLLM2_TEMPLATE)
    assert settings.template == CHATML_TEMPLATE
    assert settings.parameters == {"stop": ["<|im_end|>"]}
    assert settings.system == SMOLLM2_SYSTEM
    plain_chatml = SMOLLM2_TEMPLATE.replace(
        "{% if loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n' }}{% endif %}",
        "",
    )
    assert chat_settings(plain_chatml).system is None
    assert chat_settings("{{ bos_token }}[INST] {{ messages }} [/INST]").template is None
    assert chat_settings(None, "chatml").template == CHATML_TEMPLATE


# Ollama, through the client


def test_pushing_a_gguf_creates_the_model_from_its_blob_with_its_template(
    ollama_server: OllamaStandIn, gguf_file: Path
) -> None:
    digest = sha256(gguf_file.read_bytes())
    settings = chat_settings(read_header(gguf_file).chat_template)

    async def push() -> Any:
        async with OllamaClient(ollama_server.url) as client:
            return await client.push_gguf(gguf_file, digest, "tuned-smollm", settings)

    pushed = run(push())
    assert pushed.uploaded and pushed.digest == f"sha256:{digest}"
    assert pushed.statuses[-1] == "success"
    model = ollama_server.models["tuned-smollm:latest"]
    assert model.files == {"tiny.gguf": f"sha256:{digest}"}
    assert model.template == CHATML_TEMPLATE and model.system == SMOLLM2_SYSTEM
    assert model.parameters == {"stop": ["<|im_end|>"]}
    assert ollama_server.blobs[f"sha256:{digest}"] == gguf_file.read_bytes()
    again = run(push())
    assert not again.uploaded
    assert ollama_server.count("HEAD", "/api/blobs/") == 2
    assert ollama_server.count("POST", "/api/blobs/") == 1


def test_a_blob_that_does_not_hash_to_its_digest_is_refused(
    ollama_server: OllamaStandIn, gguf_file: Path
) -> None:
    wrong = sha256(b"something else")

    async def push() -> None:
        async with OllamaClient(ollama_server.url) as client:
            await client.push_blob(gguf_file, wrong)

    with pytest.raises(OllamaRejected, match="refused to store the GGUF \\(400: digest mismatch"):
        run(push())
    assert ollama_server.blobs == {}


def test_creating_a_model_from_a_blob_the_server_lacks_fails_with_its_error(
    ollama_server: OllamaStandIn,
) -> None:
    async def create() -> None:
        async with OllamaClient(ollama_server.url) as client:
            await client.create(
                "tuned", {"model.gguf": f"sha256:{sha256(b'never sent')}"}, chat_settings(None)
            )

    with pytest.raises(OllamaRejected, match="refused to create the model tuned .*not found"):
        run(create())
    assert ollama_server.models == {}


# the Hub, through huggingface_hub


def test_a_commit_to_a_bare_repo_name_goes_to_the_tokens_namespace_in_one_commit(
    hub: HubStandIn, hub_client: None, gguf_file: Path, tmp_path: Path
) -> None:
    card = "---\nbase_model: HuggingFaceTB/SmolLM2-135M-Instruct\ntags:\n- overbrainer\n---\n# t\n"
    file = LocalFile(
        gguf_file, "tiny.gguf", gguf_file.stat().st_size, sha256(gguf_file.read_bytes())
    )
    committed = commit_to_hub(
        "tuned",
        [HubFile("tiny.gguf", file)],
        card,
        token=SecretStr(TOKEN),
        endpoint=hub.url,
        message="a GGUF",
    )
    assert committed.repo_id == "tester/tuned" and committed.private is True
    assert committed.url == f"{hub.url}/tester/tuned"
    repo = hub.repos["tester/tuned"]
    assert [c.added for c in repo.commits] == [["README.md", "tiny.gguf"]]
    assert repo.files["tiny.gguf"].lfs_sha256 == file.sha256
    assert repo.files["tiny.gguf"].content == gguf_file.read_bytes()
    api = HfApi(endpoint=hub.url, token=TOKEN)
    assert sorted(api.list_repo_files("tester/tuned")) == ["README.md", "tiny.gguf"]
    with pytest.raises(HubError, match=r"refused to create the repository someone/x \(403\)"):
        commit_to_hub("someone/x", [], card, token=SecretStr(TOKEN), endpoint=hub.url, message="m")


def test_the_hub_is_not_reached_while_the_environment_says_offline(hub: HubStandIn) -> None:
    with pytest.raises(HubError, match="HF_HUB_OFFLINE is set"):
        commit_to_hub("o/r", [], "# c\n", token=SecretStr(TOKEN), endpoint=hub.url, message="m")
    assert hub.seen == []


def test_a_model_card_names_a_hub_base_model_only_and_never_a_secret_looking_setting() -> None:
    facts = CardFacts(
        title="t",
        run_id="20260101-000000-abcd",
        base_model="/models/local-smollm",
        adapter="lora",
        settings={"lora_r": 8},
    )
    meta = card_data(facts).to_dict()  # huggingface_hub's ModelCardData: None fields left out
    assert "base_model" not in meta and meta["library_name"] == "peft"
    assert meta["tags"] == ["overbrainer", "axolotl", "lora"]
    card = model_card(facts)
    assert "`local-smollm`" in card.text
    assert card.data.to_dict() == meta  # the card parses back to the metadata it was given


# the record of what became of a run


def test_the_record_says_what_became_of_a_run_last_delivered_or_kept_back(
    tmp_path: Path,
) -> None:
    file = DeliveredFile(path="m.gguf", size=1, sha256="0" * 64)

    def delivery(destination: str, name: str, when: str, flow_run: str) -> Delivery:
        return Delivery(
            destination=destination,  # type: ignore[arg-type]
            name=name,
            url="http://127.0.0.1:11434",
            files=[file],
            evaluation_id="20260101-000000-ev01",
            delivered=when,
            flow_run_id=flow_run,
        )

    runs, run_id = Runs(tmp_path), "20260101-000000-aaaa"
    assert load_deliveries(runs, run_id).latest is None
    refused = NotDelivered(
        reason="held-out 0/9 = 0%, below the last delivered model's 1/1 = 100% (run r)",
        evaluation_id="20260101-000000-ev00",
        decided="2026-01-01T01:00:00Z",
    )
    add_not_delivered(runs, run_id, refused)
    assert load_deliveries(runs, run_id).latest == f"not delivered: {refused.reason}"
    add_delivery(runs, run_id, delivery("ollama", "tuned:q8_0", "2026-01-02T01:00:00Z", "f1"))
    add_delivery(runs, run_id, delivery("hub", "org/tuned", "2026-01-02T01:00:05Z", "f1"))
    record = load_deliveries(runs, run_id)
    assert record.latest == "delivered: ollama tuned:q8_0, hub org/tuned"
    assert [d.evaluation_id for d in record.deliveries] == ["20260101-000000-ev01"] * 2
    assert record.not_delivered == [refused]
    later = refused.model_copy(update={"decided": "2026-01-03T01:00:00Z"})
    assert add_not_delivered(runs, run_id, later).latest == f"not delivered: {refused.reason}"


# the deliver flow


def read_artifacts(run_id: str) -> dict[str, Any]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    async def go() -> dict[str, Any]:
        async with get_client() as client:
            found = await client.read_artifacts(
                artifact_filter=ArtifactFilter(key=ArtifactFilterKey(like_=f"run-{run_id}"))
            )
            return {a.key: a for a in found if a.key is not None}

    return dict(run(go()))


def save_ollama_block(url: str, prefix: str | None = None) -> str:
    from overbrainer_prefect.blocks import OllamaServer

    name = f"ollama-{uuid.uuid4().hex[:8]}"
    OllamaServer(url=url, model_prefix=prefix).save(name)
    return name


def save_hf_block(token: str, endpoint: str) -> str:
    from overbrainer_prefect.blocks import HuggingFaceCredentials

    name = f"hf-{uuid.uuid4().hex[:8]}"
    HuggingFaceCredentials(token=SecretStr(token), endpoint=endpoint).save(name)
    return name


def test_the_deliver_flow_creates_the_ollama_model_records_and_links_it(
    prefect_server: None, ollama_server: OllamaStandIn, gguf_file: Path, tmp_path: Path
) -> None:
    from overbrainer_prefect.flows.deliver import deliver

    fake = make_run(tmp_path, gguf_file)
    block = save_ollama_block(ollama_server.url, prefix="ft-")
    run_id = fake.record.id
    result = run(deliver(run_id=run_id, ollama=block, runs_dir=str(fake.runs.root)))
    name = f"ft-smollm2-135m-instruct-{run_id}:{QUANT}"
    [delivery] = result.deliveries
    assert delivery.destination == "ollama" and delivery.name == name
    digest = sha256(fake.gguf.read_bytes())
    model = ollama_server.models[name]
    assert model.files == {fake.gguf.name: f"sha256:{digest}"}
    assert model.template == CHATML_TEMPLATE and model.parameters == {"stop": ["<|im_end|>"]}
    assert model.system == SMOLLM2_SYSTEM
    tags = json.loads(
        run(_get(ollama_server.url + "/api/tags")),
    )
    assert [m["name"] for m in tags["models"]] == [name]
    recorded = load_deliveries(fake.runs, fake.record.id).deliveries
    assert [(d.destination, d.name, d.export_id, d.files[0].sha256) for d in recorded] == [
        ("ollama", name, fake.export_id, digest)
    ]
    artifacts = read_artifacts(run_id)
    [link] = [a for k, a in artifacts.items() if k.startswith(f"run-{run_id}-ollama-")]
    assert link.data == f"[{name} on {ollama_server.url}]({ollama_server.url})"
    evaluation_id = "20260101-000000-eval"  # the evaluation a gate let it through on
    run(
        deliver(
            run_id=run_id,
            ollama=block,
            runs_dir=str(fake.runs.root),
            evaluation_id=evaluation_id,
        )
    )
    assert ollama_server.count("POST", "/api/blobs/") == 1
    assert ollama_server.count("HEAD", "/api/blobs/") == 2
    first, again = load_deliveries(fake.runs, fake.record.id).deliveries
    assert first.evaluation_id is None and again.evaluation_id == evaluation_id


async def _get(url: str) -> str:
    import httpx

    async with httpx.AsyncClient() as client:
        return (await client.get(url)).text


def test_an_ollama_server_that_is_down_leaves_the_gguf_verified_and_says_how_to_deliver_again(
    prefect_server: None, gguf_file: Path, tmp_path: Path
) -> None:
    from overbrainer_prefect.delivery.result import DeliveryFailed
    from overbrainer_prefect.flows.deliver import deliver

    fake = make_run(tmp_path, gguf_file)
    block = save_ollama_block(f"http://127.0.0.1:{free_port()}")
    with pytest.raises(DeliveryFailed) as failed:
        run(deliver(run_id=fake.record.id, ollama=block, runs_dir=str(fake.runs.root)))
    message = str(failed.value)
    assert "\n" not in message
    assert "cannot reach the Ollama server" in message and "nothing answers there" in message
    assert (
        f"the GGUF stays verified at runs/{fake.record.id}/exports/{fake.export_id}/gguf/"
        in message
    )
    assert f"the deliver flow (run_id={fake.record.id}, ollama={block}, quant={QUANT})" in message
    assert not (fake.run_dir / DELIVERIES_FILE).exists()
    assert fake.gguf.is_file()


def test_a_model_the_ollama_server_rejects_leaves_the_gguf_verified_and_says_how_to_deliver_again(
    prefect_server: None, ollama_server: OllamaStandIn, gguf_file: Path, tmp_path: Path
) -> None:
    from overbrainer_prefect.delivery.result import DeliveryFailed
    from overbrainer_prefect.flows.deliver import deliver

    fake = make_run(tmp_path, gguf_file)
    block = save_ollama_block(ollama_server.url)
    with pytest.raises(DeliveryFailed) as failed:
        run(
            deliver(
                run_id=fake.record.id,
                ollama=block,
                model_name="not a name!",
                runs_dir=str(fake.runs.root),
            )
        )
    message = str(failed.value)
    assert "\n" not in message
    assert "refused to create the model not a name!:q4_k_m (400: invalid model name)" in message
    assert "the GGUF stays verified at" in message and "model_name=not a name!" in message
    assert ollama_server.models == {}


def test_delivering_to_ollama_without_an_export_says_to_run_the_export_flow_first(
    prefect_server: None, ollama_server: OllamaStandIn, gguf_file: Path, tmp_path: Path
) -> None:
    from overbrainer_prefect.delivery.result import DeliveryFailed
    from overbrainer_prefect.flows.deliver import deliver

    fake = make_run(tmp_path, gguf_file, export=False)
    block = save_ollama_block(ollama_server.url)
    with pytest.raises(DeliveryFailed) as failed:
        run(deliver(run_id=fake.record.id, ollama=block, runs_dir=str(fake.runs.root)))
    assert str(failed.value) == (
        f"run {fake.record.id} has no succeeded export of quant {QUANT}: run the export flow "
        f"(run_id={fake.record.id}, quant={QUANT}) first"
    )
    assert ollama_server.seen == []


def test_a_gguf_that_differs_from_its_manifest_is_never_sent(
    ollama_server: OllamaStandIn, gguf_file: Path, tmp_path: Path
) -> None:
    fake = make_run(tmp_path, gguf_file)
    data = bytearray(fake.gguf.read_bytes())
    data[-1] ^= 0xFF
    fake.gguf.write_bytes(bytes(data))
    with pytest.raises(SourceError, match="differs from the file retrieved and verified"):
        find_gguf(fake.runs, fake.record, "Q4_K_M")


def test_the_deliver_flow_commits_adapter_gguf_and_card_to_a_private_repo_in_one_commit(
    prefect_server: None,
    hub: HubStandIn,
    hub_client: None,
    gguf_file: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    from overbrainer_prefect.flows.deliver import deliver

    caplog.set_level(logging.DEBUG)
    fake = make_run(tmp_path, gguf_file)
    block = save_hf_block(TOKEN, hub.url)
    run_id = fake.record.id
    result = run(
        deliver(
            run_id=run_id,
            hub_repo="overbrainer/smollm2-tuned",
            huggingface=block,
            runs_dir=str(fake.runs.root),
        )
    )
    repo = hub.repos["overbrainer/smollm2-tuned"]
    assert repo.private
    assert len(repo.commits) == 1
    assert sorted(repo.files) == sorted(
        [
            "README.md",
            "adapter_config.json",
            "adapter_model.safetensors",
            "chat_template.jinja",
            fake.gguf.name,
        ]
    )
    assert (fake.run_dir / "output" / "checkpoint-6" / "adapter_model.safetensors").is_file()
    assert not any("checkpoint" in path for commit in repo.commits for path in commit.added)
    local = fake.run_dir / "output"
    assert (
        repo.files["adapter_model.safetensors"].content
        == (local / "adapter_model.safetensors").read_bytes()
    )
    assert repo.files["adapter_model.safetensors"].lfs_sha256 is not None
    assert repo.files[fake.gguf.name].content == fake.gguf.read_bytes()
    card = repo.files["README.md"].content.decode()
    meta = yaml.safe_load(card.split("---\n")[1])
    assert meta["base_model"] == BASE and meta["library_name"] == "peft"
    assert meta["tags"] == ["overbrainer", "axolotl", "gguf", "lora"]
    assert f"| `chat.jsonl` | {len(fake.dataset)} | `{sha256(fake.dataset)}` |" in card
    assert "final training loss: 0.7500" in card and "| lora_r | `8` |" in card
    assert sha256(fake.gguf.read_bytes()) in card and "not-for-the-card" not in card
    assert "comet_api_key" not in card
    [delivery] = result.deliveries
    assert delivery.url == f"{hub.url}/overbrainer/smollm2-tuned" and delivery.private
    assert load_deliveries(fake.runs, fake.record.id).deliveries[0].commit == repo.commits[0].oid
    artifacts = read_artifacts(run_id)
    [link] = [a for k, a in artifacts.items() if k.startswith(f"run-{run_id}-hub-")]
    assert link.data == f"[overbrainer/smollm2-tuned on the Hugging Face Hub]({delivery.url})"
    for seen in hub.seen:
        assert TOKEN not in seen.path + seen.query and TOKEN.encode() not in seen.body
        assert all(TOKEN not in v for k, v in seen.headers.items() if k != "authorization")
    api_calls = [s for s in hub.seen if s.path.startswith("/api/")]
    assert api_calls and all(s.headers["authorization"] == f"Bearer {TOKEN}" for s in api_calls)
    out, err = capfd.readouterr()
    assert TOKEN not in caplog.text + out + err
    for path in fake.runs.root.rglob("*"):
        assert not path.is_file() or TOKEN.encode() not in path.read_bytes(), path


def test_a_wrong_hub_token_fails_in_one_line_that_never_holds_it(
    prefect_server: None,
    hub: HubStandIn,
    hub_client: None,
    gguf_file: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    from overbrainer_prefect.delivery.result import DeliveryFailed
    from overbrainer_prefect.flows.deliver import deliver

    caplog.set_level(logging.DEBUG)
    wrong = "hf_" + secrets.token_hex(16)
    fake = make_run(tmp_path, gguf_file)
    block = save_hf_block(wrong, hub.url)
    with pytest.raises(DeliveryFailed) as failed:
        run(
            deliver(
                run_id=fake.record.id,
                hub_repo="overbrainer/x",
                huggingface=block,
                what="adapter",
                runs_dir=str(fake.runs.root),
            )
        )
    message = str(failed.value)
    assert "\n" not in message
    assert message.startswith("the Hub refused to check the token (401): the token was refused")
    assert f"deliver again with the deliver flow (run_id={fake.record.id}, " in message
    assert hub.repos == {}
    out, err = capfd.readouterr()
    for text in (message, repr(failed.value), caplog.text, out, err):
        assert wrong not in text and TOKEN not in text


def test_the_delivery_core_imports_without_prefect() -> None:
    code = (
        "import sys\n"
        "import overbrainer_prefect.delivery.ollama, overbrainer_prefect.delivery.hub\n"
        "import overbrainer_prefect.delivery.modelcard, overbrainer_prefect.delivery.record\n"
        "print(','.join(sorted(m for m in sys.modules if m.split('.')[0] == 'prefect')))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == ""
