"""A pod's disk fits every job it will run: the disk a pipeline's jobs hold
at their peak, from the weights' metadata (the Hub's, served by a stand-in
that has no weights, or a local model's headers), a fixed
`container_disk_gb` too small refused in one line before any pod, and
`auto` sized with headroom.

The sizing is shown on its own (`sizing.disk_peak`, `targets.disk.fit_disk`),
then once through `fine_tune` on the Runpod simulator: an 8B base model on a
target with 50 GB is refused before any pod; with `auto` the pod is asked
for with a disk that fits.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from huggingface_hub import constants as hf_constants

from overbrainer_prefect.blocks import HuggingFaceCredentials
from overbrainer_prefect.executors.base import JobStatus
from overbrainer_prefect.finetune import CompareSettings, FineTuneSpec, PipelineFailed
from overbrainer_prefect.flows import fine_tune
from overbrainer_prefect.runpod.settings import SettingsError, settings_from
from overbrainer_prefect.runs.failure import DISK_FULL, failure_cause
from overbrainer_prefect.runs.metrics import MetricsSummary
from overbrainer_prefect.runs.store import Runs, RunState
from overbrainer_prefect.sizing import (
    DiskJob,
    SizingError,
    Weights,
    disk_peak,
    hub_weights,
    model_weights,
    train_job,
)
from overbrainer_prefect.steps.follow import outcome
from overbrainer_prefect.targets.base import JobNeed
from overbrainer_prefect.targets.disk import DiskTooSmall, fit_disk, sized_gb
from overbrainer_prefect.targets.sharing import after_training
from overbrainer_prefect.trainers.export import ExportSpec
from overbrainer_prefect.trainers.spec import TrainingSpec
from tests.runpod_fixtures import fast, sim
from tests.runpod_fixtures import target as sim_target
from tests.runpod_sim import RunpodSim
from tests.standins.hub_server import HubStandIn, Repo
from tests.test_runpod_flows import run

__all__ = ["fast", "sim"]  # the simulator's fixtures (tests/runpod_fixtures.py)

MODEL = "org/llama-8b"
PARAMS = 8_030_261_248  # Llama-3.1-8B's parameters, all BF16
W = 2 * PARAMS  # its weights' bytes
Q8 = -(-PARAMS * 85 // 80)  # its q8_0 GGUF (8.5 bits a weight), rounded up
LOG = logging.getLogger("test_pod_disk")


def training(**changes: Any) -> TrainingSpec:
    values: dict[str, Any] = {"base_model": MODEL, "datasets": ["/data/chats.jsonl"]}
    return TrainingSpec.model_validate(values | changes)


def pod_target(sim: RunpodSim, **changes: Any) -> str:
    """A Runpod target on the simulator whose pods never come up (no simulated
    pod processes are attached): nothing is trained; a short boot grace."""
    return sim_target(sim, boot_grace_s=3.0, **changes)


def eight_b(model: str) -> Weights:
    assert model == MODEL, model
    return Weights(parameters=PARAMS, size=W)


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[HubStandIn]:
    """The Hub stand-in with the 8B model's metadata (no weights), and
    huggingface_hub allowed to reach it."""
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    with HubStandIn("hf_" + secrets.token_hex(8)) as server:
        server.repos[MODEL] = Repo(MODEL, private=False, safetensors={"BF16": PARAMS})
        server.repos["org/no-safetensors"] = Repo("org/no-safetensors", private=False)
        yield server


# the weights, from the Hub's metadata or the local headers


def test_a_hub_model_is_sized_from_its_metadata_without_a_download(hub: HubStandIn) -> None:
    weights = hub_weights(MODEL, endpoint=hub.url)
    assert weights == Weights(parameters=PARAMS, size=W)
    assert [seen.path for seen in hub.seen] == [f"/api/models/{MODEL}"]
    assert "expand=safetensors" in hub.seen[0].query
    with pytest.raises(SizingError, match="shows no safetensors weights for org/no-safetensors"):
        hub_weights("org/no-safetensors", endpoint=hub.url)
    with pytest.raises(SizingError, match=r"^cannot read the safetensors metadata of org/gone"):
        hub_weights("org/gone", endpoint=hub.url)


def test_a_local_model_is_sized_from_its_headers(tiny_model_dir: Path, tmp_path: Path) -> None:
    weights = model_weights(str(tiny_model_dir))
    files = list(tiny_model_dir.glob("*.safetensors"))
    assert weights.size == sum(f.stat().st_size for f in files) and weights.parameters > 0
    with pytest.raises(SizingError, match="holds no safetensors weights"):
        model_weights(str(tmp_path))
    with pytest.raises(SizingError, match="does not exist here"):
        model_weights(str(tmp_path / "missing"))


@pytest.fixture
def tiny_model_dir(tmp_path: Path) -> Path:
    """A model directory whose one safetensors file holds two BF16 tensors."""
    import json
    import struct

    header = {
        "a": {"dtype": "BF16", "shape": [4, 8], "data_offsets": [0, 64]},
        "b": {"dtype": "BF16", "shape": [8], "data_offsets": [64, 80]},
    }
    raw = json.dumps(header).encode()
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(80))
    return model


# the peak of a pipeline's jobs


def test_an_8b_lora_fine_tune_peaks_in_its_export() -> None:
    later = after_training(training(), ExportSpec(quant="q8_0"))
    jobs = [("the run", train_job(training()))] + [
        (need.what, need.disk) for need in later if need.disk is not None
    ]
    peak = disk_peak(jobs, eight_b)
    by_job = {job.what.split(" (")[0]: (job.held, job.own) for job in peak.jobs}
    assert by_job == {
        "the run": (0, W),  # the base, downloaded into the Hub cache
        "the merge into org/llama-8b": (W, W + 2 * PARAMS + Q8),  # merged, f16, q8_0
        "the q8_0 export of the base model org/llama-8b": (W + Q8, 2 * PARAMS + Q8),
        "the compare": (W + 2 * Q8, 2 * Q8),  # both GGUFs staged again
    }
    assert peak.largest.what.startswith("the merge into") and peak.total == 3 * W + Q8
    assert peak.cached == W  # one base, cached once
    assert 56e9 < peak.total < 57e9


def test_an_f16_export_peaks_in_the_compare_and_a_full_run_counts_its_checkpoints() -> None:
    later = after_training(training(), ExportSpec(quant="f16"))
    jobs = [("the run", train_job(training()))] + [(n.what, n.disk) for n in later if n.disk]
    peak = disk_peak(jobs, eight_b)
    assert peak.largest.what == "the compare" and peak.total == W + 2 * W + 2 * W
    # full weights: the model, and each checkpoint with its AdamW moments (max_steps / save_steps)
    full = training(adapter="full", save_steps=50, max_steps=100)
    assert train_job(full).checkpoints == 2
    assert train_job(full.model_copy(update={"extra": {"save_total_limit": 1}})).checkpoints == 1
    (run,) = disk_peak([("the run", train_job(full))], eight_b).jobs
    assert run.own == W + W + 2 * (W + 8 * PARAMS)
    # across 2 nodes DeepSpeed ZeRO saves each node's part of the optimizer state on that node
    zero3 = full.model_copy(update={"sharding": "zero3", "nodes": 2})
    assert train_job(zero3).shards == 2
    (node,) = disk_peak([("the run", train_job(zero3))], eight_b).jobs
    assert node.own == W + W + 2 * (W + 4 * PARAMS)
    fsdp = full.model_copy(update={"sharding": "fsdp", "nodes": 2})  # saved whole by rank 0
    assert train_job(fsdp).shards == 1
    # an export that keeps its intermediates leaves its merged model and f16 GGUF to the next
    kept = after_training(training(), ExportSpec(quant="q8_0", keep_intermediate=True))
    jobs = [("the run", train_job(training()))] + [(n.what, n.disk) for n in kept if n.disk]
    after_export = disk_peak(jobs, eight_b).jobs[2]
    assert after_export.held == W + (W + 2 * PARAMS) + Q8


# the pod's disk: refused when fixed too small, sized for auto


def pipeline_needs(quant: str = "q8_0") -> tuple[JobNeed, list[JobNeed]]:
    return JobNeed(what="the run", training=training()), after_training(
        training(), ExportSpec(quant=quant)
    )


def test_a_fixed_disk_too_small_is_refused_in_one_line(hub: HubStandIn) -> None:
    need, later = pipeline_needs()
    settings = settings_from({"container_disk_gb": 50})
    with pytest.raises(DiskTooSmall) as refused:
        fit_disk(settings, need, later, "runpod/pod", None, hub.url, LOG)
    line = str(refused.value)
    assert "\n" not in line and isinstance(refused.value, SettingsError)
    assert line == (
        "runpod/pod: container_disk_gb is 50 GB, but the pod's jobs need about 57 GB, at the "
        "peak of the merge into org/llama-8b (the export): set container_disk_gb to 70, or to auto"
    )
    assert sized_gb(3 * W + Q8) == 70
    # a disk that holds them is kept as it is
    roomy = settings_from({"container_disk_gb": 80})
    assert fit_disk(roomy, need, later, "runpod/pod", None, hub.url, LOG) is roomy


def test_auto_is_sized_with_headroom_rounded_up(hub: HubStandIn) -> None:
    need, later = pipeline_needs()
    auto = settings_from({"container_disk_gb": "auto"})
    sized = fit_disk(auto, need, later, "runpod/pod", None, hub.url, LOG)
    # 56.7 GB at the export's peak, a tenth more and 5 GB: 67.4, rounded up to 70
    assert sized.container_disk_gb == sized.disk_gb == 70
    assert sized_gb(3 * W + Q8) == 70 and sized_gb(0) == 20
    # the training alone (its own pod): the base in the cache
    alone = fit_disk(auto, need, [], "runpod/pod", None, hub.url, LOG)
    assert alone.container_disk_gb == 25  # 16.1 GB, a tenth more and 5: 22.7 → 25


def test_a_network_volume_leaves_the_container_disk_the_hub_cache(
    hub: HubStandIn, caplog: pytest.LogCaptureFixture
) -> None:
    need, later = pipeline_needs()
    volume = {"network_volume_id": "vol1", "data_center_ids": ["EU-RO-1"]}
    fixed = settings_from({"container_disk_gb": 20, **volume})
    with caplog.at_level(logging.INFO, LOG.name):
        assert fit_disk(fixed, need, later, "runpod/pod", None, hub.url, LOG) is fixed
    assert (
        "container_disk_gb 20 leaves little room: the pod's jobs need 16.1 GB for the Hub cache "
        "(their run directories are on the network volume); 25 or auto is safer"
    ) in caplog.text
    auto = settings_from({"container_disk_gb": "auto", **volume})
    assert fit_disk(auto, need, later, "runpod/pod", None, hub.url, LOG).container_disk_gb == 25


def test_a_disk_that_cannot_be_sized_is_told(
    hub: HubStandIn, caplog: pytest.LogCaptureFixture
) -> None:
    need = JobNeed(what="the run", training=training(base_model="org/no-safetensors"))
    fixed = settings_from({"container_disk_gb": 30})
    with caplog.at_level(logging.INFO, LOG.name):
        assert fit_disk(fixed, need, [], "runpod/pod", None, hub.url, LOG) is fixed
        auto = fit_disk(
            settings_from({"container_disk_gb": "auto"}), need, [], "runpod/pod", None, hub.url, LOG
        )
        # a job that says nothing of its disk (an export run alone)
        bare = JobNeed(what="the q8_0 export of run R", merge_model=MODEL)
        assert fit_disk(fixed, bare, [], "runpod/pod", None, hub.url, LOG) is fixed
    assert auto.container_disk_gb == 50
    assert "cannot size the disk of the pod for the run (the Hugging Face Hub shows no " in (
        caplog.text
    )
    assert "container_disk_gb 30 is kept" in caplog.text
    assert "container_disk_gb auto takes 50 GB" in caplog.text


def test_container_disk_gb_takes_a_size_or_auto() -> None:
    assert settings_from({}).container_disk_gb == 50
    assert settings_from({"container_disk_gb": " Auto "}).container_disk_gb == "auto"
    assert settings_from({"container_disk_gb": "auto"}).disk_gb == 50  # not yet sized
    assert settings_from({"container_disk_gb": "60"}).container_disk_gb == 60
    for wrong, said in ((5, "greater than or equal to 20"), ("lots", "give a number of GB")):
        with pytest.raises(SettingsError, match=f"^container_disk_gb: .*{said}"):
            settings_from({"container_disk_gb": wrong})


# through the pipeline, on the Runpod simulator


def test_a_fine_tune_of_an_8b_model_is_refused_on_50_gb_and_given_a_disk_that_fits_with_auto(
    prefect_server: None,
    sim: RunpodSim,
    hub: HubStandIn,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the night's fingerprint and the training's preflight ask the Hub too (the stand-in has
    # no config.json: sequence_len is not checked)
    monkeypatch.setattr(hf_constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(
        hf_constants,
        "HUGGINGFACE_CO_URL_TEMPLATE",
        hub.url + "/{repo_id}/resolve/{revision}/{filename}",
    )
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    dataset = tmp_path / "chats.jsonl"
    dataset.write_text(
        '{"messages": [{"role": "user", "content": "Hi."}, '
        '{"role": "assistant", "content": "Hello."}]}\n'
    )
    hf = HuggingFaceCredentials(token=hub.token, endpoint=hub.url)
    fine = FineTuneSpec(
        target=pod_target(sim, huggingface=hf),
        training=training(datasets=[str(dataset)], max_steps=2),
        export=ExportSpec(quant="q8_0"),
        compare=CompareSettings(questions=["Hi?"]),
        runs_dir=str(tmp_path / "runs"),
    )
    # a target with the default 50 GB: refused in one line, before any pod or run exists
    with pytest.raises(PipelineFailed) as refused:
        run(fine_tune(fine))
    line = str(refused.value)
    assert "\n" not in line, line
    assert line.endswith(
        "container_disk_gb is 50 GB, but the pod's jobs need about 57 GB, at the peak of the "
        "merge into org/llama-8b (the export): set container_disk_gb to 70, or to auto"
    ), line
    assert sim.pods(include_deleted=True) == [] and sim.requests_to("POST", "/v1/pods") == []
    assert Runs(tmp_path / "runs").list() == []
    assert not [seen.path for seen in hub.seen if ".safetensors" in seen.path]  # no weight asked

    # auto: the pod is asked for with 70 GB (it never answers SSH here: no job runs)
    auto = fine.model_copy(
        update={"target": pod_target(sim, huggingface=hf, container_disk_gb="auto")}
    )
    with pytest.raises(PipelineFailed, match="did not answer SSH within boot_grace"):
        run(fine_tune(auto))
    (pod,) = sim.pods(include_deleted=True)
    assert pod.request["disk"] == 70 and pod.deleted
    assert not [seen.path for seen in hub.seen if ".safetensors" in seen.path]


def test_a_job_whose_disk_filled_says_so() -> None:
    converter = (
        "INFO:hf-to-gguf:blk.30.ffn_up.weight, torch.bfloat16 --> F16, shape = {4096, 14336}\n"
        "Traceback (most recent call last):\n"
        '  File "convert_hf_to_gguf.py", line 4431, in write\n'
        "OSError: [Errno 28] No space left on device\n"
        "export failed: the converter failed: OSError: [Errno 28] No space left on device\n"
    )
    merge = "safetensors_rust.SafetensorError: Error while serializing: IoError(Os { code: 28, "
    merge += 'kind: StorageFull, message: "No space left on device" })\n'
    quantize = (
        "llama_model_quantize: failed to quantize: basic_ios::clear: No space left on device\n"
    )
    for log in (converter, merge, quantize):
        assert failure_cause(log) == DISK_FULL
    assert failure_cause("Traceback (most recent call last):\nValueError: bad row\n") == (
        "ValueError: bad row"
    )
    state, message = outcome(JobStatus(kind="exited", code=1), MetricsSummary(), "runs/r")
    assert state == RunState.FAILED and message is not None
    _, message = outcome(JobStatus(kind="exited", code=1), MetricsSummary(), "runs/r", DISK_FULL)
    assert message == f"the job exited with code 1: {DISK_FULL} (see runs/r/job.log)"


def test_an_export_on_a_pod_of_its_own_is_sized_for_itself(hub: HubStandIn) -> None:
    q4 = -(-PARAMS * 489 // 800)  # 4.89 bits a weight
    auto = settings_from({"container_disk_gb": "auto"})
    run = JobNeed(what="the export", disk=DiskJob("export", model=MODEL, quant="q4_k_m"))
    sized = fit_disk(auto, run, [], "runpod/pod", None, hub.url, LOG)
    assert sized.container_disk_gb == sized_gb(W + W + 2 * PARAMS + q4) == 65  # 53.1 GB
    # the base model's export merges nothing: 37.0 GB fits the default 50
    base = JobNeed(what="the base", disk=DiskJob("base_export", model=MODEL, quant="q4_k_m"))
    fixed = settings_from({})
    assert fit_disk(fixed, base, [], "runpod/pod", None, hub.url, LOG) is fixed
    assert base.disk is not None
    assert disk_peak([("b", base.disk)], eight_b).total == W + 2 * PARAMS + q4
