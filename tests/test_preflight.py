"""The checks before a cent is spent: dataset rows, the model's context, axolotl's
keys, and what the target's GPUs can run. Each refusal is one line naming the
fix, and the runs directory is left as it was."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from overbrainer_prefect.runpod.gpus import GpuChoiceError, plan_launch
from overbrainer_prefect.runpod.models import GpuType
from overbrainer_prefect.runpod.settings import settings_from
from overbrainer_prefect.runs.store import Runs
from overbrainer_prefect.steps import start as start_step
from overbrainer_prefect.trainers.base import TrainError
from overbrainer_prefect.trainers.preflight import preflight
from overbrainer_prefect.trainers.spec import TrainingSpec

CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.fixture
def runs(tmp_path: Path) -> Runs:
    """A runs directory that already holds one run, to show that a refusal changes nothing."""
    store = Runs(tmp_path / "runs")
    start_step.create(store, target="box", target_kind="local", workdir=str(tmp_path / "work"))
    return store


def model_dir(tmp_path: Path, context: int = 2048) -> Path:
    directory = tmp_path / "model"
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"max_position_embeddings": context}))
    return directory


def dataset(tmp_path: Path, lines: list[str], name: str = "chat.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines))
    return path


def make(tmp_path: Path, data: Path, **changes: Any) -> TrainingSpec:
    values: dict[str, Any] = {"base_model": str(model_dir(tmp_path)), "datasets": [str(data)]}
    values.update(changes)
    return TrainingSpec.model_validate(values)


def refused(runs: Runs, spec: TrainingSpec, **target: Any) -> str:
    before = snapshot(runs.root)
    with pytest.raises(TrainError) as raised:
        preflight(spec, **target)
    assert snapshot(runs.root) == before
    message = str(raised.value)
    assert "\n" not in message
    return message


# Dataset rows


def test_good_chat_rows_pass_and_warn_of_nothing(tmp_path: Path) -> None:
    data = dataset(tmp_path, [json.dumps(CHAT)] * 3 + [""])
    assert preflight(make(tmp_path, data)) == []


def test_a_row_that_is_not_json_is_named_by_file_and_line(tmp_path: Path, runs: Runs) -> None:
    data = dataset(tmp_path, [json.dumps(CHAT), '{"messages": [oops'])
    message = refused(runs, make(tmp_path, data))
    assert message.startswith(f"dataset {data} line 2 is not JSON (")
    assert message.endswith("): fix or remove it")


def test_rows_without_messages_say_to_set_field_messages(tmp_path: Path, runs: Runs) -> None:
    data = dataset(tmp_path, [json.dumps({"conversations": CHAT["messages"]})])
    assert refused(runs, make(tmp_path, data)) == (
        f"dataset {data} line 1 has no list of messages under `messages` (the row has "
        "`conversations`): set field_messages to the key that holds the conversation"
    )
    fixed = make(tmp_path, data, datasets=[{"path": str(data), "field_messages": "conversations"}])
    assert preflight(fixed) == []


def test_messages_in_another_shape_need_their_property_mappings(tmp_path: Path, runs: Runs) -> None:
    turns = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]
    data = dataset(tmp_path, [json.dumps({"messages": turns})])
    message = refused(runs, make(tmp_path, data))
    assert message.startswith(f"dataset {data} line 1 message 0 has no `role` (it has `from`")
    mapped = {"path": str(data), "message_property_mappings": {"role": "from", "content": "value"}}
    assert preflight(make(tmp_path, data, datasets=[mapped])) == []


def test_alpaca_rows_need_an_instruction_and_an_output(tmp_path: Path, runs: Runs) -> None:
    data = dataset(
        tmp_path, [json.dumps({"instruction": "a", "output": "b"}), '{"instruction": 1}']
    )
    spec = make(tmp_path, data, datasets=[{"path": str(data), "type": "alpaca"}])
    assert refused(runs, spec).startswith(f"dataset {data} line 2 has no `output` (type alpaca")


def test_a_json_array_is_read_row_by_row(tmp_path: Path, runs: Runs) -> None:
    data = tmp_path / "chat.json"
    data.write_text(json.dumps([CHAT, {"text": "x"}]))
    assert refused(runs, make(tmp_path, data)).startswith(f"dataset {data} row 1 has no list")


def test_a_format_whose_rows_are_not_read_here_is_a_warning(tmp_path: Path) -> None:
    data = tmp_path / "chat.parquet"
    data.write_bytes(b"PAR1")
    assert preflight(make(tmp_path, data)) == [
        f"dataset {data}: rows of this format are not checked before the run"
    ]


# The model's context


def test_a_sequence_len_past_the_models_context_is_refused(tmp_path: Path, runs: Runs) -> None:
    data = dataset(tmp_path, [json.dumps(CHAT)])
    spec = make(tmp_path, data, sequence_len=1_000_000_000)
    assert refused(runs, spec) == (
        f"sequence_len 1000000000 is longer than the 2048 tokens {spec.base_model} was trained "
        "for (max_position_embeddings in its config.json): set sequence_len to 2048 or less"
    )
    assert preflight(make(tmp_path, data, sequence_len=2048)) == []


def test_a_hub_model_that_cannot_be_read_is_a_warning_not_a_refusal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = dataset(tmp_path, [json.dumps(CHAT)])
    spec = make(tmp_path, data, base_model=f"no-such-org/model-{uuid.uuid4().hex[:8]}")
    [warning] = preflight(spec)
    assert warning.startswith(f"cannot read the config.json of {spec.base_model} from the Hugging")
    assert warning.endswith("sequence_len is not checked")


# axolotl's keys


def test_a_typo_in_extra_is_refused_with_the_key_axolotl_knows() -> None:
    with pytest.raises(ValidationError) as raised:
        TrainingSpec.model_validate({"datasets": ["org/x"], "extra": {"gradient_checkpoint": True}})
    assert (
        "unknown axolotl key in extra `gradient_checkpoint` (axolotl 0.19.0 and 0.21.0 do not "
        "know it): "
        "did you mean `gradient_checkpointing`?"
    ) in str(raised.value)


def test_a_typo_in_a_dataset_key_is_refused_and_known_ones_pass_through() -> None:
    with pytest.raises(ValidationError, match="did you mean `roles_to_train`"):
        TrainingSpec.model_validate({"datasets": [{"path": "org/x", "roles_to_trian": ["gpt"]}]})
    spec = TrainingSpec.model_validate(
        {"datasets": [{"path": "org/x", "roles_to_train": ["assistant"], "ds_type": "json"}]}
    )
    assert spec.datasets[0].options == {"roles_to_train": ["assistant"], "ds_type": "json"}


def test_deepspeed_in_extra_is_refused_for_the_sharding_field() -> None:
    with pytest.raises(ValidationError, match="set the sharding field instead"):
        TrainingSpec.model_validate({"datasets": ["org/x"], "extra": {"deepspeed": "ds.json"}})


# What the target can run


@pytest.mark.parametrize(
    ("changes", "target", "says"),
    [
        ({"adapter": "qlora"}, {"gpus": 0}, "qlora needs a CUDA GPU (bitsandbytes 4-bit) and"),
        ({"sharding": "zero2"}, {"gpus": 1}, "sharding zero2 (DeepSpeed ZeRO-2) splits the work"),
        ({"sharding": "fsdp"}, {"gpus": 1}, "sharding fsdp (FSDP) splits the work across GPUs"),
        (
            {"sharding": "fsdp", "extra": {"load_in_8bit": True}},
            {"gpus": 4},
            "FSDP cannot shard 8-bit (bitsandbytes int8) weights",
        ),
        ({"precision": "bf16"}, {"gpus": 0}, "precision bf16 needs a GPU"),
        ({"flash_attention": True}, {"gpus": 0}, "flash_attention needs an NVIDIA GPU"),
        ({"sample_packing": True}, {"gpus": 0}, "sample_packing needs an NVIDIA GPU"),
        (
            {"precision": "bf16"},
            {"gpus": 1, "compute_capability": (7, 5)},
            "precision bf16 needs compute capability 8.0 (Ampere) or newer",
        ),
        ({"trackers": ["wandb"]}, {"secrets": ["HF_TOKEN"]}, "the job gets no WANDB_API_KEY"),
    ],
)
def test_what_the_target_cannot_run_is_one_line_and_nothing_is_created(
    tmp_path: Path, runs: Runs, changes: dict[str, Any], target: dict[str, Any], says: str
) -> None:
    data = dataset(tmp_path, [json.dumps(CHAT)])
    spec = make(tmp_path, data, **changes)
    assert says in refused(runs, spec, **target)
    preflight(spec)  # without the target's facts these checks wait for its probe


def test_sharding_on_enough_gpus_passes(tmp_path: Path) -> None:
    data = dataset(tmp_path, [json.dumps(CHAT)])
    for sharding in ("zero1", "zero2", "zero3", "fsdp"):
        spec = make(tmp_path, data, sharding=sharding, adapter="qlora")
        assert preflight(spec, gpus=2, compute_capability=(9, 0)) == []


def test_across_nodes_every_sharding_and_adapter_runs_on_one_gpu_a_node_but_not_on_none(
    tmp_path: Path, runs: Runs
) -> None:
    data = dataset(tmp_path, [json.dumps(CHAT)])
    for sharding in ("ddp", "zero1", "zero2", "zero3", "fsdp"):  # 2 nodes of 1 GPU: 2 GPUs
        for adapter in ("lora", "qlora", "full"):
            spec = make(tmp_path, data, sharding=sharding, adapter=adapter, nodes=2)
            assert preflight(spec, gpus=1, compute_capability=(9, 0)) == [], (sharding, adapter)
    # axolotl puts each process's model on the GPU of its LOCAL_RANK: a CPU node cannot join
    spec = make(tmp_path, data, nodes=2)
    says = refused(runs, spec, gpus=0)
    assert "nodes=2 runs axolotl as one process per GPU" in says and "\n" not in says
    assert says.endswith("use machines with a GPU each, or set nodes to 1")
    assert "sharding zero3" in refused(runs, make(tmp_path, data, sharding="zero3"), gpus=1)


def test_a_gpu_count_the_gpu_type_cannot_have_is_refused_before_any_pod(runs: Runs) -> None:
    catalog = [
        GpuType(
            id="NVIDIA A40",
            display_name="A40",
            memory_gb=48,
            secure_price=0.4,
            community_price=0.35,
            max_count_secure=8,
            max_count_community=8,
        )
    ]
    before = snapshot(runs.root)
    settings = settings_from({"gpu_types": ["NVIDIA A40"], "gpu_count": 16})
    with pytest.raises(GpuChoiceError) as raised:
        plan_launch(settings, catalog)
    assert str(raised.value) == (
        "GPU type NVIDIA A40 has at most 8 GPUs in one pod on the secure cloud, not 16: set "
        "gpu_count to 8 or less"
    )
    assert snapshot(runs.root) == before


# Through the train flow


@pytest.mark.slow
def test_the_train_flow_refuses_bad_rows_and_a_long_sequence_before_any_run_exists(
    prefect_server: None, tmp_path: Path
) -> None:
    from overbrainer_prefect.blocks import LocalTarget
    from overbrainer_prefect.flows import train
    from tests.conftest import job_venv

    name = f"local-{uuid.uuid4().hex[:8]}"
    LocalTarget(job_venv=str(job_venv()), work_dir=str(tmp_path / "work")).save(name)
    runs = Runs(tmp_path / "runs")
    runs.root.mkdir()
    bad = dataset(tmp_path, [json.dumps(CHAT), "not json"], "bad.jsonl")
    good = dataset(tmp_path, [json.dumps(CHAT)], "good.jsonl")
    for spec, says in (
        (make(tmp_path, bad), f"dataset {bad} line 2 is not JSON"),
        (make(tmp_path, good, sequence_len=4096), "sequence_len 4096 is longer than the 2048"),
    ):
        with pytest.raises(TrainError) as raised:
            asyncio.run(train(target=name, training=spec, runs_dir=str(runs.root)))
        assert says in str(raised.value)
        assert list(runs.root.iterdir()) == []
        assert not (tmp_path / "work").exists()
