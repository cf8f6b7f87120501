"""Estimates of what a job needs before anything is spent: the disk an export
takes on its target.

An export of a LoRA holds, at its peak, the base model (loaded from the target's
disk or cache), the merged copy, the f16 GGUF the converter writes, and the
quantized GGUF; an export of full weights holds the weights, the f16 GGUF and
the quantized one. The sizes come from the weights themselves: the tensor
shapes and dtypes in the headers of their safetensors files (read, never
loaded), so a model is sized exactly without torch.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from overbrainer_prefect.trainers.export import QUANTS

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
