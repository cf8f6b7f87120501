"""GPU choice: the launch plan from the target's settings and Runpod's
catalog, the VRAM estimate from a model's shape, the fallback to the next
GPU type without capacity, and one line for every bad input."""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr

from overbrainer_prefect.runpod import (
    GpuChoiceError,
    GpuType,
    NoCapacity,
    Pod,
    PodRequest,
    RetryPolicy,
    RunpodClient,
    RunpodError,
    RunpodTargetSettings,
    SettingsError,
    create_with_fallback,
    estimate_vram,
    model_shape,
    overpriced,
    plan_from_api,
    plan_launch,
    settings_from,
)
from overbrainer_prefect.runpod.gpus import GpuChoice
from overbrainer_prefect.runpod.models import DataCenter
from overbrainer_prefect.runpod.vram import VramEstimateError, read_local_shape
from tests.runpod_sim import DEFAULT_DATA_CENTERS, RunpodSim, default_gpus, running_sim

FAST = RetryPolicy(
    backoff_s=0.02, max_backoff_s=0.1, reconcile_interval_s=0.05, reconcile_window_s=0.3
)

SEVEN_B = {  # Llama-2-7B's shape
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "intermediate_size": 11008,
    "vocab_size": 32000,
}
TINY = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 320,
}


@pytest.fixture
def sim() -> Iterator[RunpodSim]:
    with running_sim() as simulator:
        yield simulator


def catalog() -> list[GpuType]:
    """The simulator's catalog, as the client reads it."""
    return [
        GpuType(
            id=g.id,
            display_name=g.name,
            memory_gb=g.memory,
            secure=g.secure,
            community=g.community,
            secure_price=g.secure_price,
            community_price=g.community_price,
            max_count_secure=g.max_count,
            max_count_community=g.max_count,
            availability="HIGH",
        )
        for g in default_gpus()
    ]


def settings(**fields: Any) -> RunpodTargetSettings:
    return settings_from(fields)


def write_model(directory: Path, config: dict[str, Any], tensors: dict[str, list[int]]) -> Path:
    """A model directory: `config.json`, and a safetensors file whose header
    declares `tensors` (name: shape); the data is zeros."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    offset, header = 0, {}
    for name, shape in tensors.items():
        size = 4
        for dim in shape:
            size *= dim
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    (directory / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))
    return directory


def floor_of(config: dict[str, Any], adapter: str, tmp_path: Path) -> int:
    shape = model_shape(str(write_model(tmp_path / "m", config, {})))
    return estimate_vram(
        shape,
        adapter,  # type: ignore[arg-type]
        sequence_len=2048,
        micro_batch_size=1,
    ).floor_gb


def test_auto_picks_the_cheapest_type_for_a_tiny_model(tmp_path: Path) -> None:
    model = write_model(tmp_path / "tiny", TINY, {"embed": [320, 64], "layer.0": [64, 64]})
    shape = read_local_shape(model)
    assert shape.params == 320 * 64 + 64 * 64  # counted from the safetensors header
    need = estimate_vram(shape, "lora", sequence_len=256, micro_batch_size=2)
    assert need.floor_gb == 2  # the fixed overhead, mostly
    plan = plan_launch(settings(), catalog(), vram_floor_gb=need.floor_gb)
    prices = [choice.price_per_hour for choice in plan.choices]
    assert plan.first.id == "NVIDIA RTX A4000"  # $0.25/h, the cheapest secure type
    assert prices == sorted(prices)
    assert len(plan.choices) == len(catalog())


def test_auto_picks_a_large_type_for_a_full_fine_tune_of_a_7b_model(tmp_path: Path) -> None:
    full = floor_of(SEVEN_B, "full", tmp_path)
    assert 60 <= full <= 100
    plan = plan_launch(settings(), catalog(), vram_floor_gb=full)
    assert plan.first.id == "NVIDIA A100 80GB PCIe"
    assert all(choice.gpu.memory_gb >= full for choice in plan.choices)
    lora = floor_of(SEVEN_B, "lora", tmp_path)
    assert 16 < lora <= 40  # 13.5 GB of bf16 weights, the activations, the rest
    assert plan_launch(settings(), catalog(), vram_floor_gb=lora).first.id == "NVIDIA A40"
    assert floor_of(SEVEN_B, "qlora", tmp_path) < lora


def test_min_vram_gb_wins_over_the_estimate() -> None:
    plan = plan_launch(settings(min_vram_gb=100), catalog(), vram_floor_gb=2)
    assert [c.id for c in plan.choices] == ["AMD Instinct MI300X OAM", "NVIDIA H200"]


def test_an_explicit_list_is_tried_in_its_order() -> None:
    plan = plan_launch(settings(gpu_types=["NVIDIA A40", "NVIDIA RTX A4000"]), catalog())
    assert [c.id for c in plan.choices] == ["NVIDIA A40", "NVIDIA RTX A4000"]
    two = plan_launch(settings(gpu_types="NVIDIA A40", gpu_count=2), catalog())
    assert two.first.price_per_hour == pytest.approx(0.88)  # the pod's: both GPUs


def test_the_community_cloud_uses_its_own_prices() -> None:
    plan = plan_launch(settings(cloud="community"), catalog())
    assert plan.first.id == "NVIDIA RTX A5000"  # $0.16/h on community
    assert "NVIDIA H200" not in [c.id for c in plan.choices]  # secure only


@pytest.mark.parametrize(
    ("fields", "floor", "line"),
    [
        (
            {"gpu_types": ["RTX 4090"]},
            None,
            'unknown GPU type "RTX 4090" in gpu_types: did you mean "NVIDIA GeForce RTX 4090"',
        ),
        (
            {"max_price_per_hour": 0.1},
            None,
            "no GPU type on the secure cloud costs at most $0.10/h: the cheapest is NVIDIA RTX "
            "A4000 at $0.25/h; raise max_price_per_hour",
        ),
        (
            {"max_price_per_hour": 1.0},
            65,
            "no GPU type on the secure cloud with at least 65 GB of VRAM costs at most $1.00/h: "
            "the cheapest is NVIDIA A100 80GB PCIe at $1.64/h; raise max_price_per_hour",
        ),
        (
            {"min_vram_gb": 500},
            None,
            "no GPU type on the secure cloud has 500 GB of VRAM (min_vram_gb): the largest is "
            "AMD Instinct MI300X OAM with 192 GB; lower min_vram_gb",
        ),
        (
            {},
            900,
            "no GPU type on the secure cloud has 900 GB of VRAM (the estimate of the run's "
            "needs): the largest is AMD Instinct MI300X OAM with 192 GB; use adapter qlora",
        ),
        (
            {"gpu_types": ["NVIDIA H200"], "cloud": "community"},
            None,
            "GPU type NVIDIA H200 is not offered on the community cloud: set cloud to secure",
        ),
        (
            {"data_center_ids": ["EU-RO-9"]},
            None,
            "unknown data center EU-RO-9 in data_center_ids: did you mean EU-RO-1",
        ),
    ],
)
def test_bad_input_is_one_line(fields: dict[str, Any], floor: int | None, line: str) -> None:
    centers = [DataCenter(id=dc) for dc in DEFAULT_DATA_CENTERS]
    with pytest.raises(GpuChoiceError) as caught:
        plan_launch(settings(**fields), catalog(), vram_floor_gb=floor, data_centers=centers)
    message = str(caught.value)
    assert message.startswith(line)
    assert "\n" not in message


@pytest.mark.parametrize(
    ("fields", "line"),
    [
        ({"image": " "}, "image: the image is missing: set image to a Docker image"),
        (
            {"gpu_types": []},
            'gpu_types: gpu_types is empty: list GPU type ids, or set it to "auto"',
        ),
        ({"gpu_types": ["auto"]}, 'gpu_types: "auto" is not a GPU type'),
        ({"network_volume_id": "v1"}, "a network volume needs exactly one data center"),
        ({"max_hours": 0}, "max_hours: Input should be greater than 0"),
    ],
)
def test_bad_settings_are_one_line(fields: dict[str, Any], line: str) -> None:
    with pytest.raises(SettingsError) as caught:
        settings_from(fields)
    assert str(caught.value).startswith(line)
    assert "\n" not in str(caught.value)


def test_a_model_shape_that_cannot_be_read_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(VramEstimateError) as offline:
        model_shape("org/never-downloaded-model")  # HF_HUB_OFFLINE is set for the tests
    assert str(offline.value).startswith(
        "cannot read the config.json of org/never-downloaded-model from the Hugging Face Hub"
    )
    assert "\n" not in str(offline.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(VramEstimateError, match="has no config.json: is it a model directory"):
        model_shape(str(tmp_path / "empty"))
    broken = write_model(tmp_path / "broken", {"hidden_size": 8}, {})
    with pytest.raises(VramEstimateError, match="has no num_hidden_layers: set min_vram_gb"):
        model_shape(str(broken))


def test_the_launch_plan_says_what_ends_the_pod_and_what_it_may_cost() -> None:
    plan = plan_launch(
        settings(gpu_types=["NVIDIA A40", "NVIDIA L40S"], max_hours=6, max_cost_usd=2.0),
        catalog(),
    )
    text = plan.describe()
    assert text.startswith(
        "Runpod: NVIDIA A40 (48 GB) on the secure cloud at $0.44/h; without capacity, then "
        "NVIDIA L40S ($0.86/h). The pod is deleted once the run's files are retrieved and "
        "verified, by its watchdog at max_hours (6 h;"
    )
    assert "at max_cost_usd ($2.00)" in text
    assert "60 min after its job ends unretrieved, and 30 min after it starts if no job" in text
    assert ": at most $2.00 at this rate" in text
    assert "($0.86/h at most on another type)" in text
    assert "container disk included" in text and "keeps it 15 min more" in text
    assert plan.worst_case_usd == pytest.approx(2.0)
    kept = plan_launch(settings(gpu_types="NVIDIA A40", keep_pod=True), catalog())
    assert "nothing deletes the pod when the run ends" in kept.describe()
    assert kept.worst_case_usd is None


def test_a_type_without_capacity_moves_to_the_next(sim: RunpodSim) -> None:
    attempts: list[str] = []

    def factory(choice: GpuChoice) -> PodRequest:
        return PodRequest(name=f"ob-r1-{len(attempts)}", image="img:1", gpu_type_id=choice.id)

    async def main() -> Any:
        async with RunpodClient(SecretStr(sim.api_key), sim.rest_url, retry=FAST) as client:
            plan = await plan_from_api(client, settings(), vram_floor_gb=2)
            sim.set_capacity("NVIDIA RTX A4000", 0)  # listed in stock, gone at the create
            return await create_with_fallback(
                client, plan, factory, before_attempt=lambda c, r: attempts.append(c.id)
            )

    placed = asyncio.run(main())
    assert attempts == ["NVIDIA RTX A4000", "NVIDIA RTX A5000"]
    assert placed.choice.id == "NVIDIA RTX A5000"
    assert placed.refused == ("NVIDIA RTX A4000 (no capacity)",)
    assert [(p.id, p.gpu_type_id) for p in sim.pods()] == [(placed.pod.id, "NVIDIA RTX A5000")]


def test_no_capacity_anywhere_says_which_types_were_tried(sim: RunpodSim) -> None:
    for gpu in ("NVIDIA A40", "NVIDIA L40S"):
        sim.set_capacity(gpu, 0)

    async def main() -> None:
        async with RunpodClient(SecretStr(sim.api_key), sim.rest_url, retry=FAST) as client:
            plan = await plan_from_api(client, settings(gpu_types=["NVIDIA A40", "NVIDIA L40S"]))
            await create_with_fallback(
                client,
                plan,
                lambda c: PodRequest(name=f"ob-{c.gpu.display_name}", image="i", gpu_type_id=c.id),
            )

    with pytest.raises(NoCapacity) as caught:
        asyncio.run(main())
    assert "none of the GPU types tried has capacity right now (NVIDIA A40, NVIDIA L40S)" in str(
        caught.value
    )
    assert sim.pods() == []


def test_an_invalid_key_fails_before_any_pod_exists(sim: RunpodSim) -> None:
    async def main() -> None:
        async with RunpodClient(SecretStr("rpa_bad"), sim.rest_url, retry=FAST) as client:
            await plan_from_api(client, settings())

    with pytest.raises(RunpodError) as caught:
        asyncio.run(main())
    assert str(caught.value) == (
        "Runpod answered 401 (unauthorized): check the API key of the RunpodCredentials block"
    )
    assert sim.requests_to("POST", "/v2/pods") == []


def test_a_pod_placed_above_the_price_limit_is_refused() -> None:
    pod = Pod.model_validate({"id": "k3x9abc", "status": "RUNNING", "cost": 0.99})
    assert overpriced(pod, settings(max_price_per_hour=0.5), 0.44) == (
        "pod k3x9abc bills $0.99/h, above max_price_per_hour ($0.50/h): it is deleted"
    )
    assert overpriced(pod, settings(max_price_per_hour=1.0), 0.44) is None
