"""An axolotl YAML as this product's `TrainingSpec`: the keys the spec models
go into its fields, every other key into `extra` (checked against the
axolotl key lists this package ships, the nearest known key suggested). A key
the YAML leaves out gets axolotl's default, not the spec's, so the run trains
what `axolotl train config.yml` would train on that machine."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import JsonValue, ValidationError

from overbrainer_prefect.trainers.spec import OWNED_KEYS, TrainingSpec

AXOLOTL_DEFAULTS: dict[str, JsonValue] = {
    "micro_batch_size": 1,
    "gradient_accumulation_steps": 1,
    "sequence_len": 512,
    "num_epochs": 1.0,
    "lr_scheduler": "cosine",
    "warmup_steps": 0,  # axolotl's None: no warm-up
    "lora_dropout": 0.0,
    "val_set_size": 0.0,
}
"""axolotl 0.21's defaults (its config schema) of the spec's fields whose own
defaults differ; tests/test_axolotl_cloud.py checks them against the job venv's
axolotl."""

AS_FIELDS = (
    "base_model",
    "sequence_len",
    "micro_batch_size",
    "gradient_accumulation_steps",
    "num_epochs",
    "max_steps",
    "learning_rate",
    "lr_scheduler",
    "warmup_steps",
    "lora_r",
    "lora_alpha",
    "lora_dropout",
    "lora_target_modules",
    "val_set_size",
    "eval_steps",
    "save_steps",
    "seed",
    "chat_template",
    "sample_packing",
)
"""axolotl keys that are spec fields of the same name and meaning."""

DROPPED = frozenset({"output_dir", "dataset_prepared_path", "logging_steps"})
"""Keys of the run's own layout: the trainer sets them (the run's files land in
its run directory), so the YAML's are left out."""

DEEPSPEED_STAGE = re.compile(r"zero([123])")


class MappingError(ValueError):
    """The YAML cannot be trained as it is; the message is one line saying what to fix."""


def spec_from_axolotl(
    config: Mapping[str, object], overrides: Mapping[str, object] | None = None
) -> tuple[TrainingSpec, list[str]]:
    """The `TrainingSpec` of axolotl's `config` with the command line's
    `overrides` (`--learning-rate 1e-4`), and notes on what the run does
    otherwise than axolotl would (`output_dir` left to the run).

    Raises MappingError with one line for a YAML the spec refuses: no
    base_model, no datasets, no learning_rate, an unknown key (with the nearest
    one), a key this launcher cannot carry yet (plugins, a dataset `type` given
    as a mapping, a DeepSpeed file it does not know)."""
    left: dict[str, object] = {**config, **(overrides or {})}
    notes: list[str] = []
    values: dict[str, object] = {}
    for key in ("base_model", "datasets", "learning_rate"):
        if left.get(key) in (None, "", []):
            raise MappingError(f"the axolotl YAML has no {key}: axolotl needs it")
    for key in AS_FIELDS:
        if left.get(key) is not None:
            values[key] = left.pop(key)
        else:
            left.pop(key, None)
    for key, default in AXOLOTL_DEFAULTS.items():
        values.setdefault(key, default)
    values["datasets"] = [_dataset(entry) for entry in _listed(left.pop("datasets"))]
    values["base_model"] = local_model(str(values["base_model"]))
    _adapter(left, values)
    _precision(left, values)
    _sharding(left, values)
    _trackers(left, values)
    if left.pop("flash_attention", None) is True:
        values["flash_attention"] = True
    if left.get("attn_implementation") == "flash_attention_2":
        left.pop("attn_implementation")
        values["flash_attention"] = True
    if values.get("sample_packing") is True:
        left.pop("pad_to_sequence_len", None)  # the trainer sets it with sample packing
    checkpointing = left.pop("gradient_checkpointing", None)
    if checkpointing is True:
        values["gradient_checkpointing"] = True
    elif checkpointing not in (None, False):
        left["gradient_checkpointing"] = checkpointing  # axolotl's own values (`offload`)
    if left.get("plugins"):
        raise MappingError(
            "the axolotl YAML names plugins: the overbrainer launcher does not carry plugins "
            "yet (the run's metrics plugin takes that key); remove them"
        )
    left.pop("plugins", None)
    if left.get("resume_from_checkpoint") or left.get("auto_resume_from_checkpoints"):
        raise MappingError(
            "the axolotl YAML resumes from a checkpoint: name the stopped run to go on from "
            "with `resume_from: <run id>` in cloud.yml instead"
        )
    for key in DROPPED:
        if left.pop(key, None) is not None and key == "output_dir":
            notes.append("output_dir is left to the run: its files land in its run directory")
    for key in OWNED_KEYS:
        left.pop(key, None)
    values["extra"] = {key: value for key, value in left.items() if value is not None}
    try:
        return TrainingSpec.model_validate(values), notes
    except ValidationError as error:
        raise MappingError(_one_line(error)) from None


def _listed(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise MappingError("the axolotl YAML's datasets is not a list: give a list of datasets")
    return value


def _dataset(entry: Any) -> Any:
    if not isinstance(entry, dict):
        return entry
    entry = {k: v for k, v in entry.items() if v is not None}
    if isinstance(entry.get("type"), dict):
        raise MappingError(
            f"dataset {entry.get('path')}: a `type` given as a mapping (a custom format) is not "
            "carried yet: use a named type such as chat_template, alpaca or completion"
        )
    path = entry.get("path")
    if isinstance(path, str) and path.startswith(".") and Path(path).exists():
        entry["path"] = str(Path(path).resolve())  # the job reads it from the run's data/
    return entry


def local_model(model: str) -> str:
    """`model`, or, when it is a relative model directory that exists here,
    made absolute: a local target reads it from the job's own directory
    otherwise."""
    if model.startswith(".") and Path(model).is_dir():
        return str(Path(model).resolve())
    return model


def _adapter(left: dict[str, object], values: dict[str, object]) -> None:
    adapter = left.pop("adapter", None)
    four_bit = left.pop("load_in_4bit", None)
    if adapter in (None, ""):
        values["adapter"] = "full"
    elif adapter in ("lora", "qlora"):
        values["adapter"] = adapter
    else:
        raise MappingError(
            f"adapter {adapter!r} is not carried by the overbrainer launcher: use lora, qlora, "
            "or no adapter (a full fine-tune)"
        )
    if four_bit and adapter != "qlora":
        left["load_in_4bit"] = four_bit
    if left.pop("lora_target_linear", None) is True:
        values.pop("lora_target_modules", None)  # every linear layer: the spec's default


def _precision(left: dict[str, object], values: dict[str, object]) -> None:
    bf16, fp16 = left.pop("bf16", None), left.pop("fp16", None)
    left.pop("tf32", None)
    if bf16 == "auto":
        values["precision"] = "auto"
    elif bf16 is True:
        values["precision"] = "bf16"
    elif fp16 is True:
        values["precision"] = "fp16"
    else:
        values["precision"] = "fp32"


def _sharding(left: dict[str, object], values: dict[str, object]) -> None:
    deepspeed = left.pop("deepspeed", None)
    if deepspeed is not None:
        stage = DEEPSPEED_STAGE.search(Path(str(deepspeed)).name)
        if stage is None:
            raise MappingError(
                f"deepspeed {deepspeed}: the overbrainer launcher ships ZeRO-1, 2 and 3 configs "
                "of its own; name one of axolotl's (deepspeed_configs/zero2.json) or remove it"
            )
        values["sharding"] = f"zero{stage[1]}"
    version, fsdp = left.pop("fsdp_version", None), left.pop("fsdp", None)
    if version is not None or fsdp or "fsdp_config" in left:
        values["sharding"] = "fsdp"


def _trackers(left: dict[str, object], values: dict[str, object]) -> None:
    trackers: list[str] = []
    project = left.pop("wandb_project", None)
    if project:
        trackers.append("wandb")
        values["tracker_project"] = project
    if left.pop("use_mlflow", None) or left.get("mlflow_tracking_uri"):
        trackers.append("mlflow")
        values["tracker_uri"] = left.pop("mlflow_tracking_uri", None)
        experiment = left.pop("mlflow_experiment_name", None)
        if experiment:
            values["tracker_project"] = experiment
    if trackers:
        values["trackers"] = trackers


def _one_line(error: ValidationError) -> str:
    first = error.errors()[0]
    where = ".".join(str(part) for part in first["loc"])
    if where.startswith("extra."):
        where = ""
    message = str(first["msg"]).removeprefix("Value error, ")
    return f"the axolotl YAML: {where + ': ' if where else ''}{message}"
