"""How much VRAM per GPU a fine-tune needs, from its base model's shape.

The shape (parameter count, hidden size, layers, heads, vocabulary) comes
from a local model directory (`config.json` and the safetensors headers) or
from the Hugging Face Hub (`config.json` and the safetensors metadata, never
the weights). The estimate adds up (research/training-tools.md §2.2):

- the weights, in bf16 (2 bytes a parameter), or NF4 for QLoRA (about 0.55,
  the embeddings and the head staying 16-bit);
- what training holds per trainable parameter: the LoRA adapter with its
  gradient and AdamW moments in fp32 (16 bytes), or for a full fine-tune the
  bf16 gradient and moments (6 bytes more per parameter);
- the activations, `34·s·b·h` bytes per layer with an sdpa/flash attention
  (only the layer inputs with gradient checkpointing);
- the logits and their softmax in fp32, `8·b·s·V` bytes;
- a fixed 1 GiB for the CUDA context and the allocator.

On N GPUs, DDP keeps all of it on each GPU; DeepSpeed ZeRO-1 shards the
optimizer state across them (for a full fine-tune DeepSpeed's bf16 keeps an
fp32 master copy and fp32 moments: 12 bytes a parameter), ZeRO-2 the
gradients too, and ZeRO-3 or FSDP the weights as well (plus one layer gathered
at a time). Activations and logits stay per GPU. A training across N nodes
of G GPUs each (`nodes`) is one group of N × G GPUs: the states are sharded
over all of them, and each GPU needs the same again under DDP.

It is an estimate to pick a GPU type by, not a promise: the floor is rounded
up to whole GB.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, SupportsInt, cast

from pydantic import SecretStr

Adapter = Literal["lora", "qlora", "full"]
Sharding = Literal["ddp", "zero1", "zero2", "zero3", "fsdp"]


class FineTune(Protocol):
    """What the VRAM of a fine-tune depends on: the fields of a training spec
    (`trainers.spec.TrainingSpec`) the estimate reads."""

    @property
    def adapter(self) -> Adapter: ...
    @property
    def sequence_len(self) -> int: ...
    @property
    def micro_batch_size(self) -> int: ...
    @property
    def lora_r(self) -> int: ...
    @property
    def gradient_checkpointing(self) -> bool: ...
    @property
    def sharding(self) -> Sharding: ...
    @property
    def nodes(self) -> int:
        """Machines the training runs on at once, each with the same GPUs."""
        ...

    @property
    def extra(self) -> Mapping[str, object]:
        """Further axolotl keys (`gradient_checkpointing` may be among them)."""
        ...


GB = 1_000_000_000
GIB = 1 << 30
OVERHEAD_BYTES = GIB  # CUDA context, cuBLAS workspaces, allocator slack
ACTIVATION_BYTES_PER_TOKEN_HIDDEN = 34  # per layer, mixed precision, fused attention
LOGIT_BYTES = 8  # fp32 logits and their softmax, per token and vocabulary entry
LORA_STATE_BYTES = 16  # fp32 adapter weight, gradient and two AdamW moments
LORA_WEIGHT_GRAD_BYTES = 8  # of which the fp32 adapter weight and its gradient
FULL_EXTRA_BYTES = 6  # bf16 gradient and two bf16 AdamW moments, beside the bf16 weight
FULL_GRAD_BYTES = 2  # of which the bf16 gradient
DEEPSPEED_OPTIMIZER_BYTES = 12  # DeepSpeed's bf16 keeps an fp32 master weight and fp32 moments
NF4_BYTES = 0.55  # a 4-bit weight with its quantization constants
HEADER_LIMIT = 100 << 20  # bytes of a safetensors header read at most


class VramEstimateError(ValueError):
    """The model's shape could not be read; the message is one line."""


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of a model: its parameter count and the
    dimensions of its transformer."""

    params: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_embeddings: bool = False

    @classmethod
    def from_config(cls, config: Mapping[str, object], params: int | None = None) -> ModelShape:
        """The shape of a transformers `config.json`, with `params` counted from
        its weights (estimated from the dimensions, Llama-style, when None).
        Raises VramEstimateError when a dimension is missing."""
        text = config.get("text_config")
        if isinstance(text, Mapping) and "hidden_size" not in config:
            config = text  # a multimodal model: the language model's shape
        hidden = _dim(config, "hidden_size", "n_embd", "d_model")
        layers = _dim(config, "num_hidden_layers", "n_layer", "num_layers")
        heads = _dim(config, "num_attention_heads", "n_head")
        kv_heads = _int(config.get("num_key_value_heads") or heads)
        head_dim = _int(config.get("head_dim") or hidden // heads)
        intermediate = _int(config.get("intermediate_size") or config.get("n_inner") or 4 * hidden)
        vocab = _dim(config, "vocab_size")
        tied = bool(config.get("tie_word_embeddings", False))
        if params is None:
            attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
            mlp = 3 * hidden * intermediate
            params = layers * (attention + mlp + 2 * hidden) + vocab * hidden * (1 if tied else 2)
        return cls(
            params=params,
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=intermediate,
            vocab_size=vocab,
            tie_embeddings=tied,
        )

    @property
    def embedding_params(self) -> int:
        """Parameters of the embeddings and the output head."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_embeddings else 2)

    def lora_params(self, rank: int) -> int:
        """Trainable parameters of a LoRA of `rank` on every linear layer
        (q, k, v, o, gate, up, down): `rank·(d_in + d_out)` each."""
        h, q, kv, i = (
            self.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
            self.intermediate_size,
        )
        per_layer = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h)
        return rank * per_layer * self.num_layers


@dataclass(frozen=True)
class VramEstimate:
    """The VRAM one GPU needs for a fine-tune, by part, in bytes."""

    weights: int
    training_state: int
    activations: int
    logits: int
    overhead: int = OVERHEAD_BYTES

    @property
    def total(self) -> int:
        """All parts together, in bytes."""
        return self.weights + self.training_state + self.activations + self.logits + self.overhead

    @property
    def floor_gb(self) -> int:
        """The total in whole GB, rounded up: the least VRAM a GPU type needs."""
        return math.ceil(self.total / GB)

    def __str__(self) -> str:
        return (
            f"{self.total / GB:.1f} GB (weights {self.weights / GB:.1f}, training state "
            f"{self.training_state / GB:.1f}, activations {self.activations / GB:.1f}, logits "
            f"{self.logits / GB:.1f}, overhead {self.overhead / GB:.1f})"
        )


def estimate_vram(
    shape: ModelShape,
    adapter: Adapter,
    *,
    sequence_len: int,
    micro_batch_size: int,
    lora_r: int = 16,
    gradient_checkpointing: bool = False,
    gpus: int = 1,
    sharding: Sharding = "ddp",
) -> VramEstimate:
    """The VRAM each GPU needs to fine-tune a model of `shape` with `adapter`
    on `micro_batch_size` sequences of `sequence_len` tokens per GPU, the job
    running on `gpus` GPUs with `sharding` (see the module's text for the
    formula)."""
    n = max(1, gpus)
    if adapter == "qlora":
        body = max(0, shape.params - shape.embedding_params)
        weights = int(body * NF4_BYTES) + 2 * shape.embedding_params
    else:
        weights = 2 * shape.params
    if adapter == "full":
        grads, moments = FULL_GRAD_BYTES * shape.params, (FULL_EXTRA_BYTES - 2) * shape.params
        if sharding in ("zero1", "zero2", "zero3"):
            moments = DEEPSPEED_OPTIMIZER_BYTES * shape.params
    else:
        lora = shape.lora_params(lora_r)
        grads = LORA_WEIGHT_GRAD_BYTES * lora
        moments = (LORA_STATE_BYTES - LORA_WEIGHT_GRAD_BYTES) * lora
    if sharding in ("zero1", "zero2", "zero3", "fsdp") and n > 1:
        moments //= n
        if sharding != "zero1":
            grads //= n
        if sharding in ("zero3", "fsdp"):
            gathered = 2 * shape.params // max(1, shape.num_layers)  # one layer at a time
            weights = weights // n + gathered
    state = grads + moments
    tokens = sequence_len * micro_batch_size
    per_layer = ACTIVATION_BYTES_PER_TOKEN_HIDDEN * tokens * shape.hidden_size
    if gradient_checkpointing:
        activations = 2 * tokens * shape.hidden_size * shape.num_layers + per_layer
    else:
        activations = per_layer * shape.num_layers
    logits = LOGIT_BYTES * tokens * shape.vocab_size
    return VramEstimate(
        weights=weights, training_state=state, activations=activations, logits=logits
    )


def training_vram(shape: ModelShape, spec: FineTune, gpus: int = 1) -> VramEstimate:
    """The VRAM each of `gpus` GPUs (of each of its `nodes`) needs to run the
    fine-tune `spec` of a model of `shape`: its adapter, sequence length,
    micro-batch, LoRA rank, gradient checkpointing (the field, or `extra`'s)
    and sharding, its states sharded over every node's GPUs."""
    checkpointing = spec.gradient_checkpointing or bool(spec.extra.get("gradient_checkpointing"))
    return estimate_vram(
        shape,
        spec.adapter,
        sequence_len=spec.sequence_len,
        micro_batch_size=spec.micro_batch_size,
        lora_r=spec.lora_r,
        gradient_checkpointing=checkpointing,
        gpus=max(1, gpus) * spec.nodes,
        sharding=spec.sharding,
    )


def read_local_shape(model_dir: Path) -> ModelShape:
    """The shape of the model in `model_dir`: its `config.json`, and its
    parameter count from the safetensors headers (single file or shards)
    when there are any. Raises VramEstimateError with one line."""
    config_path = model_dir / "config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise VramEstimateError(
            f"{model_dir} has no config.json: is it a model directory?"
        ) from None
    except (OSError, ValueError) as exc:
        raise VramEstimateError(f"cannot read {config_path}: {type(exc).__name__}") from None
    if not isinstance(config, Mapping):
        raise VramEstimateError(f"{config_path} is not a JSON object")
    files = _safetensors_files(model_dir)
    counted = sum(_count_params(path) for path in files)
    return ModelShape.from_config(config, counted or None)


def fetch_hub_shape(
    repo_id: str,
    *,
    token: SecretStr | None = None,
    endpoint: str | None = None,
    revision: str | None = None,
) -> ModelShape:
    """The shape of the Hub model `repo_id`: its `config.json`, and its
    parameter count from the safetensors metadata (headers only, never the
    weights). Raises VramEstimateError with one line when the Hub cannot be
    reached (or `HF_HUB_OFFLINE` is set) or the model has no such files."""
    try:
        from huggingface_hub import HfApi, hf_hub_download
    except ImportError:  # pragma: no cover - a dependency of the package
        raise VramEstimateError("huggingface_hub is not installed") from None
    secret = token.get_secret_value() if token is not None else None
    try:
        path = hf_hub_download(
            repo_id, "config.json", revision=revision, token=secret, endpoint=endpoint
        )
        config = json.loads(Path(path).read_text(encoding="utf-8"))
    except Exception as exc:
        raise VramEstimateError(
            f"cannot read the config.json of {repo_id} from the Hugging Face Hub "
            f"({type(exc).__name__}): set min_vram_gb instead"
        ) from None
    params: int | None
    try:
        metadata = HfApi(endpoint=endpoint, token=secret).get_safetensors_metadata(
            repo_id, revision=revision
        )
        params = sum(metadata.parameter_count.values()) or None
    except Exception:  # no safetensors, or a quantized repo: count from the config
        params = None
    if not isinstance(config, Mapping):
        raise VramEstimateError(f"the config.json of {repo_id} is not a JSON object")
    return ModelShape.from_config(config, params)


def model_shape(
    base_model: str, *, token: SecretStr | None = None, endpoint: str | None = None
) -> ModelShape:
    """The shape of `base_model`: a local model directory when one exists at
    that path, else a Hub model id. Raises VramEstimateError with one line."""
    local = Path(base_model).expanduser()
    if local.is_dir():
        return read_local_shape(local)
    return fetch_hub_shape(base_model, token=token, endpoint=endpoint)


def _int(value: object) -> int:
    """`int(value)` of a config.json value: TypeError or ValueError when it is no number."""
    return int(cast(SupportsInt | str, value))


def _dim(config: Mapping[str, object], *names: str) -> int:
    for name in names:
        value = config.get(name)
        if isinstance(value, int) and value > 0:
            return value
    raise VramEstimateError(f"the model's config.json has no {names[0]}: set min_vram_gb instead")


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        except (OSError, ValueError, AttributeError):
            raise VramEstimateError(f"cannot read {index}") from None
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    return sorted(model_dir.glob("*.safetensors"))


def _count_params(path: Path) -> int:
    """Elements of every tensor of the safetensors file `path`, from its header."""
    try:
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > HEADER_LIMIT:
                raise ValueError("header too large")
            header = json.loads(f.read(length))
    except (OSError, ValueError, struct.error) as exc:
        raise VramEstimateError(f"cannot read the header of {path}: {exc}") from None
    total = 0
    for name, info in header.items():
        if name == "__metadata__" or not isinstance(info, Mapping):
            continue
        total += math.prod(int(d) for d in info.get("shape", []))
    return total


def merge_vram_bytes(shape: ModelShape) -> int:
    """The VRAM merging a LoRA into a model of `shape` needs on one GPU, in
    bytes: its 16-bit weights, a fifth more for the tensors the merge makes,
    and the CUDA context."""
    weights = 2 * shape.params
    return weights + weights // 5 + OVERHEAD_BYTES
