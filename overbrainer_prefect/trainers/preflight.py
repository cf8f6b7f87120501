"""The checks a fine-tune passes before a cent is spent: before any run
directory, pod or job exists.

`preflight(spec, gpus=...)` runs every check that needs no target
(`TrainingSpec.check_local_files`: the dataset files and their rows, the
model's context length; the `extra` and dataset keys are checked when the spec
is validated) and, when the GPUs the job will have are known (a Runpod pod's
`gpu_count`, or the probe of an SSH box), the checks of the spec against them:
QLoRA, bf16/fp16, flash attention and sample packing need a GPU; DeepSpeed and
FSDP shard across two GPUs or more (all nodes' GPUs together); a training
across nodes needs a GPU on every node; FSDP cannot shard 8-bit weights. The
trainer runs the same target checks again once the target is probed.
"""

from __future__ import annotations

from collections.abc import Collection

from overbrainer_prefect.trainers.base import TrainError
from overbrainer_prefect.trainers.spec import DEEPSPEED_STAGES, TrainingSpec

BF16_CAPABILITY = (8, 0)
"""The compute capability from which NVIDIA GPUs have bf16 and FlashAttention 2 (Ampere)."""

TRACKER_SECRETS = {"wandb": "WANDB_API_KEY"}
"""The secret each tracker needs in the job's environment."""


def preflight(
    spec: TrainingSpec,
    *,
    gpus: int | None = None,
    compute_capability: tuple[int, int] | None = None,
    secrets: Collection[str] | None = None,
    hub_token: str | None = None,
) -> list[str]:
    """Checks `spec` before anything exists: its local files and the model's
    context (see `TrainingSpec.check_local_files`), then, when `gpus` (the GPUs
    the job will have: 0 for a CPU) is known, what the spec asks of them (with
    `compute_capability`, the lowest of those GPUs, when known), and, when
    `secrets` (the names of the secrets the job gets) is known, that each
    tracker has its key. `hub_token` reads a gated Hub model's config.
    Returns warnings.

    Raises TrainError with one line naming the fix for the first problem.
    """
    warnings = spec.check_local_files(hub_token)
    if gpus is not None:
        problem = target_problem(spec, gpus, compute_capability)
        if problem is not None:
            raise TrainError(problem)
    if secrets is not None:
        problem = tracker_problem(spec, secrets)
        if problem is not None:
            raise TrainError(problem)
    return warnings


def target_problem(
    spec: TrainingSpec, gpus: int, compute_capability: tuple[int, int] | None = None
) -> str | None:
    """One line saying why a job with `gpus` GPUs (0: a CPU) on each of its
    nodes, of `compute_capability` (None: not known), cannot run `spec`, or
    None.

    Every sharding runs across nodes under torchrun, with any adapter
    (axolotl checks no sharding against the node count: DDP replicates the
    model on every GPU, ZeRO and FSDP shard it over all of them), so nodes
    refuse none of them; but axolotl, once WORLD_SIZE > 1, maps each
    process's model to the GPU of its LOCAL_RANK (`device_map {"": rank}` in
    its normalize_config), so a training across nodes needs a GPU on each."""
    if gpus == 0 and spec.nodes > 1:
        return (
            f"nodes={spec.nodes} runs axolotl as one process per GPU, each loading the model "
            "onto its own GPU (axolotl's device_map {'': LOCAL_RANK} once WORLD_SIZE > 1), and "
            "this target's machines have none: use machines with a GPU each, or set nodes to 1"
        )
    if gpus == 0:
        if spec.adapter == "qlora":
            return (
                "qlora needs a CUDA GPU (bitsandbytes 4-bit) and this target has none: use "
                "adapter lora, or a target with a GPU"
            )
        if spec.precision in ("bf16", "fp16"):
            return (
                f"precision {spec.precision} needs a GPU and this target has none: use "
                "precision auto (fp32 on a CPU), or a target with a GPU"
            )
        for name in ("flash_attention", "sample_packing"):
            if getattr(spec, name):
                return (
                    f"{name} needs an NVIDIA GPU and this target has none: turn {name} off, "
                    "or use a target with a GPU"
                )
    if spec.sharding != "ddp" and gpus * spec.nodes < 2:
        what = sharding_label(spec.sharding)
        return (
            f"sharding {spec.sharding} ({what}) splits the work across GPUs and this target has "
            f"{gpus}: use sharding ddp, or a target with 2 or more GPUs (or nodes=2 or more)"
        )
    if spec.sharding == "fsdp" and spec.extra.get("load_in_8bit"):
        return (
            "FSDP cannot shard 8-bit (bitsandbytes int8) weights: remove load_in_8bit, or use "
            "adapter qlora, or sharding zero2 or zero3"
        )
    if compute_capability is not None and compute_capability < BF16_CAPABILITY:
        have = f"{compute_capability[0]}.{compute_capability[1]}"
        if spec.precision == "bf16":
            return (
                f"precision bf16 needs compute capability 8.0 (Ampere) or newer and this "
                f"target's GPUs are {have}: use precision auto or fp16"
            )
        if spec.flash_attention:
            return (
                f"flash_attention (FlashAttention 2) needs compute capability 8.0 (Ampere) or "
                f"newer and this target's GPUs are {have}: turn flash_attention off"
            )
    return None


def tracker_problem(spec: TrainingSpec, secrets: Collection[str]) -> str | None:
    """One line naming the key a tracker of `spec` needs and the job's secrets
    (their names) lack, or None."""
    for tracker in spec.trackers:
        key = TRACKER_SECRETS.get(tracker)
        if key is not None and key not in secrets:
            return (
                f"trackers has {tracker} but the job gets no {key}: add {key}=... to the "
                "target's env_file (it reaches the job through its environment only)"
            )
    return None


def sharding_label(sharding: str) -> str:
    """How messages name a `sharding` choice: `DeepSpeed ZeRO-2`, `FSDP`, `DDP`."""
    if sharding in DEEPSPEED_STAGES:
        return f"DeepSpeed ZeRO-{DEEPSPEED_STAGES[sharding]}"
    return sharding.upper()
