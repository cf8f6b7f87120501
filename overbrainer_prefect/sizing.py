"""Estimates of what a job needs before anything is spent: the disk an export
takes on its target, and the disk a machine made for a job (a pod) must have
for every job it will run (`disk_peak`).

An export of a LoRA holds, at its peak, the base model (loaded from the target's
disk or cache), the merged copy, the f16 GGUF the converter writes, and the
quantized GGUF; an export of full weights holds the weights, the f16 GGUF and
the quantized one. The sizes come from the weights themselves: the tensor
shapes and dtypes in the headers of their safetensors files (read, never
loaded), so a model is sized exactly without torch.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from overbrainer_prefect.trainers.export import QUANTS
from overbrainer_prefect.trainers.spec import DEEPSPEED_STAGES, TrainingSpec

DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "I64": 8,
    "I32": 4,
    "F16": 2,
    "BF16": 2,
    "I16": 2,
    "U8": 1,
    "I8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
"""Bytes per element of each safetensors dtype."""

HEADER_MAX = 100 << 20  # a safetensors header larger than this is not one

GIB = 1 << 30


@dataclass(frozen=True)
class Weights:
    """The weights of a model directory: their parameters and their bytes on disk."""

    parameters: int
    size: int


def safetensors_weights(model_dir: Path) -> Weights | None:
    """The parameters and bytes of the top-level `*.safetensors` files of
    `model_dir`, from their headers; None when there is none or one cannot be read."""
    files = sorted(model_dir.glob("*.safetensors")) if model_dir.is_dir() else []
    if not files:
        return None
    parameters = size = 0
    for path in files:
        try:
            with path.open("rb") as file:
                (length,) = struct.unpack("<Q", file.read(8))
                if length > HEADER_MAX:
                    return None
                header = json.loads(file.read(length))
            size += path.stat().st_size
        except (OSError, ValueError, struct.error):
            return None
        for name, tensor in header.items():
            if name == "__metadata__" or not isinstance(tensor, dict):
                continue
            count = 1
            for dim in tensor.get("shape", []):
                count *= int(dim)
            parameters += count
    return Weights(parameters=parameters, size=size)


@dataclass(frozen=True)
class ExportDisk:
    """The disk an export needs on its target, in bytes, step by step."""

    quant: str
    parameters: int
    base: int
    """The base model a LoRA is merged into (0 for full weights)."""
    model: int
    """The run's model staged for the export (the adapter, or the full weights)."""
    merged: int
    """The merged model (0 for full weights: they are converted as they are)."""
    f16: int
    """The f16 GGUF the converter writes."""
    quantized: int
    """The quantized GGUF (0 for f16: the converter's GGUF is the result)."""

    @property
    def total(self) -> int:
        """Everything at once: what the target's disk must hold at the peak."""
        return self.base + self.model + self.merged + self.f16 + self.quantized

    def describe(self) -> str:
        """One line: the total and its parts, in GiB."""
        parts = [
            f"{name} {_gib(value)}"
            for name, value in (
                ("base", self.base),
                ("model", self.model),
                ("merged", self.merged),
                ("f16 GGUF", self.f16),
                (f"{self.quant} GGUF", self.quantized),
            )
            if value
        ]
        return (
            f"an export to {self.quant} of {self.parameters / 1e6:,.1f}M parameters needs about "
            f"{_gib(self.total)} of disk ({', '.join(parts)})"
        )


def export_disk(model_dir: Path, base_model: str | None, quant: str) -> ExportDisk | None:
    """The disk an export to `quant` of the run model in `model_dir` needs: a LoRA
    (adapter_config.json there) is merged into `base_model`, which must be a
    directory on this machine to be sized; full weights are sized from `model_dir`.
    None when the weights to size are not at hand (a base named by a Hub id).

    Raises KeyError for a quant type an export does not make.
    """
    bits = QUANTS[quant]
    staged = sum(p.stat().st_size for p in model_dir.iterdir() if p.is_file())
    lora = (model_dir / "adapter_config.json").is_file()
    if lora:
        if base_model is None or not base_model.startswith(("/", ".", "~")):
            return None
        weights = safetensors_weights(Path(base_model).expanduser())
    else:
        weights = safetensors_weights(model_dir)
    if weights is None:
        return None
    f16 = weights.parameters * 2
    return ExportDisk(
        quant=quant,
        parameters=weights.parameters,
        base=weights.size if lora else 0,
        model=staged,
        merged=weights.size if lora else 0,  # saved in the base's own dtype
        f16=f16,
        quantized=0 if quant == "f16" else int(weights.parameters * bits / 8),
    )


def disk_warning(need: ExportDisk, available: int | None, target: str) -> str | None:
    """The warning to give when `target`'s disk (`available` bytes, None when not
    known) cannot hold what the export needs; None when it can or is not known."""
    if available is None or available >= need.total:
        return None
    return (
        f"{target} has {_gib(available)} of disk but {need.describe()}: give the target a "
        "larger disk, or export to a smaller quant type"
    )


def _gib(size: int) -> str:
    return f"{size / GIB:.2f} GiB" if size >= GIB // 100 else f"{size / (1 << 20):.1f} MiB"


class SizingError(ValueError):
    """A model whose weights cannot be sized; the message is one line."""


def hub_weights(repo_id: str, *, token: str | None = None, endpoint: str | None = None) -> Weights:
    """The parameters and bytes of the safetensors weights of the Hub model
    `repo_id`, from the Hub's safetensors metadata (`model_info` with
    `expand=["safetensors"]`: one request, no weight downloaded).

    Raises SizingError with one line when the Hub cannot be asked (or
    `HF_HUB_OFFLINE` is set) or shows no safetensors metadata for it.
    """
    try:
        from huggingface_hub import HfApi
    except ImportError:  # pragma: no cover - a dependency of the package
        raise SizingError("huggingface_hub is not installed") from None
    try:
        info = HfApi(endpoint=endpoint, token=token).model_info(repo_id, expand=["safetensors"])
    except Exception as error:
        raise SizingError(
            f"cannot read the safetensors metadata of {repo_id} from the Hugging Face Hub "
            f"({type(error).__name__})"
        ) from None
    counts = info.safetensors.parameters if info.safetensors is not None else {}
    if not counts:
        raise SizingError(f"the Hugging Face Hub shows no safetensors weights for {repo_id}")
    return Weights(
        parameters=sum(counts.values()),
        size=sum(count * DTYPE_BYTES.get(dtype.upper(), 2) for dtype, count in counts.items()),
    )


def model_weights(model: str, *, token: str | None = None, endpoint: str | None = None) -> Weights:
    """The weights of `model`: a model directory on this machine when one is
    at that path (its safetensors headers), else a Hub id (`hub_weights`).
    Raises SizingError with one line."""
    local = Path(model).expanduser()
    if local.is_dir():
        weights = safetensors_weights(local)
        if weights is None:
            raise SizingError(f"{local} holds no safetensors weights that can be read")
        return weights
    if model.startswith(("/", ".", "~")):
        raise SizingError(f"the model directory {model} does not exist here")
    return hub_weights(model, token=token, endpoint=endpoint)


DiskKind = Literal["train", "export", "base_export", "ggufs"]

ADAM_STATE_BYTES = 8
"""Bytes a full fine-tune's checkpoint keeps per parameter beside the weights:
AdamW's two fp32 moments."""


@dataclass(frozen=True)
class DiskJob:
    """What one job writes on its machine's disk, for a target that sizes the
    disk per job (a pod). `model` is the model it loads from the Hub or a
    directory (a training's base, the base a LoRA is merged into, a base
    exported as it is); None for an export of full weights."""

    kind: DiskKind
    model: str | None = None
    quant: str | None = None
    """An export's quant type (and of the GGUFs the jobs after it ask)."""
    full: bool = False
    """A training of full weights (and their export: no merge)."""
    keep: bool = False
    """An export that keeps its intermediates (`keep_intermediate`: the merged
    model and the f16 GGUF stay in its `work/`)."""
    checkpoints: int = 1
    """Checkpoints a training of full weights may leave (model and optimizer state)."""
    shards: int = 1
    """The nodes a training's checkpoints shard their optimizer state over
    (DeepSpeed ZeRO across nodes: each node saves its ranks' part; rank 0's
    node also the whole model, so its disk holds the most)."""
    gguf_bytes: int | None = None
    """A job asking GGUFs of known size made elsewhere (its own machine's compare)."""


def train_job(spec: TrainingSpec) -> DiskJob:
    """The disk job of the training `spec`: its base model (downloaded whole,
    even for a QLoRA) and, for full weights, the model and the checkpoints it
    may leave (one, the checkpoint hold's, unless `save_steps` saves more: as
    many as `save_total_limit` in `extra`, else one a `save_steps` of
    `max_steps`), on each node of a training across nodes its own part of
    their optimizer state when DeepSpeed ZeRO shards it (FSDP's are saved
    whole, FULL_STATE_DICT, by rank 0)."""
    checkpoints = 1
    if spec.save_steps is not None:
        limit = spec.extra.get("save_total_limit")
        if isinstance(limit, int) and limit > 0:
            checkpoints = limit
        elif spec.max_steps is not None:
            checkpoints = max(1, math.ceil(spec.max_steps / spec.save_steps))
    return DiskJob(
        "train",
        model=spec.base_model,
        full=spec.adapter == "full",
        checkpoints=checkpoints,
        shards=spec.nodes if spec.sharding in DEEPSPEED_STAGES else 1,
    )


@dataclass(frozen=True)
class JobDisk:
    """One job's peak on its machine's disk: `held` what the jobs before it left
    there (their models in the Hub cache, their results), `own` what it writes
    at its peak, in bytes."""

    what: str
    held: int
    own: int

    @property
    def peak(self) -> int:
        """What the disk holds at the job's peak."""
        return self.held + self.own


@dataclass(frozen=True)
class DiskPeak:
    """What a machine's disk holds at the peak of each of its jobs, in order."""

    jobs: tuple[JobDisk, ...]
    cached: int = 0
    """Of it, the models the jobs load from the Hub cache (outside the run directories)."""

    @property
    def largest(self) -> JobDisk:
        """The job at whose peak the disk holds the most."""
        return max(self.jobs, key=lambda job: job.peak)

    @property
    def total(self) -> int:
        """The most the disk holds at once, in bytes."""
        return self.largest.peak


def disk_peak(jobs: Sequence[tuple[str, DiskJob]], weights: Callable[[str], Weights]) -> DiskPeak:
    """What a disk holds at the peak of each of `jobs` (named by their first
    element) run in turn on one machine, with `weights` giving a model's
    parameters and bytes (`model_weights`; it raises SizingError, passed on).

    Each model a job loads stays in the Hub cache for the jobs after it; each
    job's results and inputs stay (a training's model and checkpoints, an
    export's GGUF and the full weights staged for it): nothing removes a
    finished job's run directory from its machine; each job's own
    intermediates are removed by its job as it ends (the export's merged model
    and f16 GGUF under `work/`, unless it keeps them; the staged GGUFs of a
    compare or an evaluation under `models/`).
    """
    cached: set[str] = set()
    held = in_cache = 0
    gguf = 0  # the last export's GGUF: the size of those the jobs after it ask
    peaks = []
    for what, job in jobs:
        fresh = 0
        base = None
        if job.model is not None:
            base = weights(job.model)
            own = job.kind == "export" and job.full  # the run's own weights: not from a cache
            if not own and job.model not in cached:
                cached.add(job.model)
                fresh = base.size
                in_cache += fresh
        if job.kind == "train":
            assert base is not None, "a training has a base model"
            left = 0
            if job.full:  # the model in bf16, and each checkpoint with its AdamW moments
                left = 2 * base.parameters * (1 + job.checkpoints) + (
                    ADAM_STATE_BYTES * base.parameters * job.checkpoints // max(1, job.shards)
                )
            peaks.append(JobDisk(what, held, fresh + left))
            held += fresh + left
        elif job.kind in ("export", "base_export"):
            assert base is not None and job.quant is not None, "an export of a model to a quant"
            made = _gguf_size(base.parameters, job.quant)
            run_export = job.kind == "export"
            staged = 2 * base.parameters if run_export and job.full else 0  # stays in model/
            work = 2 * base.parameters if job.quant != "f16" else 0  # the f16 GGUF, in work/
            work += base.size if run_export and not job.full else 0  # the merged model
            peaks.append(JobDisk(what, held, fresh + staged + work + made))
            held += fresh + staged + made + (work if job.keep else 0)
            gguf = made
        else:
            size = job.gguf_bytes if job.gguf_bytes is not None else gguf
            peaks.append(JobDisk(what, held, fresh + 2 * size))  # both GGUFs, staged
            held += fresh
    if not peaks:
        raise SizingError("no job to size the disk for")
    return DiskPeak(tuple(peaks), cached=in_cache)


def _gguf_size(parameters: int, quant: str) -> int:
    """A GGUF's bytes: its parameters at the quant type's bits per weight."""
    return math.ceil(parameters * QUANTS[quant] / 8)
