"""What a fine-tune trains: the model, its data and its hyperparameters.

`TrainingSpec` is a flow parameter: the Prefect UI renders it as a form, so
every field says what it is and has a default where one makes sense. It is
validated when the flow is called (each problem is one line saying what to
fix); `check_local_files` then checks, on the machine that starts the run,
that every local dataset file exists and reads as its `type` needs, that
`sequence_len` fits the model and that every `extra` key is one axolotl knows
(see `trainers/preflight.py`), before any run is created.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from overbrainer_prefect.trainers.base import TrainError
from overbrainer_prefect.trainers.context import context_length
from overbrainer_prefect.trainers.keys import CONFIG_KEYS, DATASET_KEYS, unknown_key
from overbrainer_prefect.trainers.rows import first_bad_row

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
"""A Hugging Face Hub repository id: `org/name`."""

DATA_SUFFIXES = frozenset(
    {".jsonl", ".json", ".parquet", ".csv", ".tsv", ".txt", ".arrow", ".gz", ".zst", ".bz2"}
)
"""File extensions that make a dataset path a local file, not a Hub id (a Hub
name may hold a dot, like `teknium/OpenHermes-2.5`)."""

OWNED_KEYS = frozenset(
    {
        "output_dir",
        "dataset_prepared_path",
        "plugins",
        "datasets",
        "resume_from_checkpoint",
        "auto_resume_from_checkpoints",
        "logging_steps",
        "overbrainer_metrics_file",
        "overbrainer_stop_file",
    }
)
"""axolotl keys the trainer sets itself: the run directory's layout, the
metrics plugin, the datasets it uploads and the checkpoint it resumes from."""


Precision = Literal["auto", "bf16", "fp16", "fp32"]
Sharding = Literal["ddp", "zero1", "zero2", "zero3", "fsdp"]
Tracker = Literal["wandb", "mlflow"]

DEEPSPEED_STAGES: dict[str, int] = {"zero1": 1, "zero2": 2, "zero3": 3}
"""The DeepSpeed ZeRO stage of each `sharding` choice that is one."""


AxolotlKeys = Annotated[
    dict[str, JsonValue], WithJsonSchema({"type": "object", "additionalProperties": True})
]
"""axolotl config keys and their values, as JSON; a plain JSON object in the
Prefect form (the schema pydantic would give JsonValue is a `$ref` to `{}`)."""

ONE_MACHINE_KEYS = ("device_map", "max_memory")
"""axolotl keys that spread one model over one machine's GPUs (naive model
parallel): a process of one node cannot hold layers on another node."""

SHARDING_KEYS = frozenset({"deepspeed", "fsdp", "fsdp_version"})
"""axolotl keys that `sharding` sets (`fsdp_config` in `extra` tunes `sharding: fsdp`)."""


class DatasetSpec(BaseModel):
    """One training dataset: a local file uploaded with the run, or a Hub dataset.

    A bare string is accepted as shorthand for `{"path": ...}`. Every other key of
    axolotl's dataset schema (`roles_to_train`, `message_property_mappings`,
    `data_files`, `ds_type`...) is passed to axolotl as it is; a key axolotl
    does not know is refused with the nearest one it does.
    """

    model_config = ConfigDict(extra="allow", frozen=True)

    path: str = Field(
        min_length=1,
        description="A local .jsonl/.json/.parquet/.csv file on the machine that starts the run "
        "(it is uploaded with the run), or a Hugging Face Hub dataset id like `org/name`.",
    )
    type: str = Field(
        default="chat_template",
        min_length=1,
        description="axolotl's dataset format: `chat_template` for rows of `messages`, or "
        "`alpaca`, `completion`, `input_output`...",
    )
    split: str | None = Field(
        default=None, description="The split to train on (Hub datasets); default `train`."
    )
    field_messages: str | None = Field(
        default=None,
        description="The column that holds the conversation (`chat_template`); default `messages`.",
    )
    name: str | None = Field(
        default=None, description="The Hub dataset's configuration name, when it has several."
    )

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, data: object) -> object:
        if isinstance(data, str):
            return {"path": data}
        return data

    @model_validator(mode="after")
    def _axolotl_knows_the_extra_keys(self) -> DatasetSpec:
        for key in self.model_extra or {}:
            problem = unknown_key(key, DATASET_KEYS, "dataset key")
            if problem is not None:
                raise ValueError(problem)
        return self

    @property
    def options(self) -> dict[str, JsonValue]:
        """The axolotl dataset keys given beyond the named fields, as given."""
        return dict(self.model_extra or {})

    @field_validator("path")
    @classmethod
    def _path_is_usable(cls, path: str) -> str:
        path = path.strip()
        if not path:
            raise ValueError("the dataset path is empty: give a local .jsonl file or org/name")
        if "/" in path and not (_is_local(path) or HUB_ID.match(path)):
            raise ValueError(
                f"dataset {path} is neither a local file nor a Hub dataset id: give a path "
                "to a local .jsonl file or a Hub dataset id like org/name"
            )
        return path

    @property
    def is_local(self) -> bool:
        """Whether `path` names a file on this machine (it exists, or it looks like a
        path: it starts with `.`, `/` or `~`, or ends with a data file extension)
        rather than a Hub dataset id."""
        return _is_local(self.path)

    def local_problem(self) -> str | None:
        """One line saying why this dataset cannot be used from this machine, or None."""
        if not self.is_local:
            if HUB_ID.match(self.path):
                return None
            return (
                f"dataset {self.path} is neither a local file nor a Hub dataset id: give a path "
                "to a local .jsonl file or a Hub dataset id like org/name"
            )
        local = Path(self.path).expanduser()
        if not local.exists():
            return (
                f"dataset file {self.path} does not exist: give a path to a local .jsonl file "
                "or a Hub dataset id like org/name"
            )
        if not (local.is_file() or local.is_dir()):
            return f"dataset {self.path} is not a file: give a path to a local .jsonl file"
        return None


class TrainingSpec(BaseModel):
    """A fine-tune: the base model, the datasets, the adapter and the training
    hyperparameters, as axolotl takes them. Keys it does not name can be passed
    to axolotl as they are in `extra`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    base_model: str = Field(
        default="HuggingFaceTB/SmolLM2-135M-Instruct",
        min_length=1,
        description="The model to fine-tune: a Hugging Face Hub id like `org/name`, or a "
        "directory on the target that holds a model.",
    )
    adapter: Literal["lora", "qlora", "full"] = Field(
        default="lora",
        description="`lora` trains a small adapter; `qlora` a LoRA over a 4-bit model (GPU "
        "only, least memory); `full` trains every weight (most memory).",
    )
    datasets: list[DatasetSpec] = Field(
        min_length=1,
        description="The training data: local files (uploaded with the run) or Hub dataset ids.",
    )
    sequence_len: int = Field(
        default=2048, gt=0, description="Longest sample in tokens; longer ones are dropped."
    )
    micro_batch_size: int = Field(default=2, gt=0, description="Samples per GPU per step.")
    gradient_accumulation_steps: int = Field(
        default=4, gt=0, description="Micro-batches summed into one optimizer step."
    )
    num_epochs: float = Field(
        default=1.0, gt=0, description="Passes over the data (ignored when max_steps is set)."
    )
    max_steps: int | None = Field(
        default=None,
        gt=0,
        description="Optimizer steps to train; when set it wins over num_epochs.",
    )
    learning_rate: float = Field(default=2e-4, gt=0, description="Peak learning rate.")
    lr_scheduler: str = Field(
        default="cosine",
        min_length=1,
        description="Learning-rate schedule: `cosine`, `linear`, `constant`, "
        "`constant_with_warmup`...",
    )
    warmup_steps: int = Field(
        default=10, ge=0, description="Steps of linear warm-up to the peak learning rate."
    )
    lora_r: int = Field(default=16, gt=0, description="LoRA rank (lora and qlora).")
    lora_alpha: int = Field(default=32, gt=0, description="LoRA scaling (lora and qlora).")
    lora_dropout: float = Field(
        default=0.05, ge=0, lt=1, description="Dropout on the LoRA layers (lora and qlora)."
    )
    lora_target_modules: list[str] | None = Field(
        default=None,
        description="Module names LoRA adapts, like `q_proj`; empty means every linear layer.",
    )
    val_set_size: float = Field(
        default=0.0,
        ge=0,
        description="Held-out evaluation share (0 to 1), or a number of rows; 0 means no eval.",
    )
    eval_steps: int | None = Field(
        default=None,
        gt=0,
        description="Evaluate on the held-out share every this many steps (with val_set_size); "
        "empty evaluates at the end of each epoch. eval_loss is followed like loss.",
    )
    precision: Precision = Field(
        default="auto",
        description="`auto`: bf16 on GPUs that have it (compute capability 8.0, Ampere, or "
        "newer), else fp16, and fp32 on a CPU; or `bf16`, `fp16`, `fp32` (bf16 and fp16 "
        "need a GPU).",
    )
    flash_attention: bool = Field(
        default=False,
        description="FlashAttention 2 (`attn_implementation: flash_attention_2`): faster and "
        "leaner attention on an NVIDIA GPU with flash-attn installed in the job venv.",
    )
    sample_packing: bool = Field(
        default=False,
        description="Pack several short samples into each sequence_len row (fewer padded "
        "tokens, more steps per second); needs a GPU.",
    )
    gradient_checkpointing: bool = Field(
        default=False,
        description="Recompute activations in the backward pass: much less VRAM for about a "
        "third more compute.",
    )
    sharding: Sharding = Field(
        default="ddp",
        description="How N > 1 GPUs share the work: `ddp` (each GPU holds the whole model), "
        "`zero1`/`zero2`/`zero3` (DeepSpeed ZeRO: optimizer state, then gradients, then "
        "weights sharded), or `fsdp` (PyTorch FSDP2, weights sharded). Sharding needs 2 or "
        "more GPUs.",
    )
    nodes: int = Field(
        default=1,
        ge=1,
        description="Machines the training runs on at once, under torchrun's rendezvous: 2 or "
        "more on a pool of SSH machines (one free machine each); 1 elsewhere.",
    )
    trackers: list[Tracker] = Field(
        default_factory=list,
        description="Experiment trackers to report to: `wandb` (needs WANDB_API_KEY) and/or "
        "`mlflow` (needs tracker_uri). Keys come from the target's env_file, through the "
        "job's environment only.",
    )
    tracker_project: str = Field(
        default="overbrainer",
        min_length=1,
        description="The W&B project, or the MLflow experiment, the run reports to.",
    )
    tracker_uri: str | None = Field(
        default=None,
        description="The MLflow tracking server's URL (MLFLOW_TRACKING_TOKEN, when it needs "
        "one, comes from the target's env_file).",
    )
    save_steps: int | None = Field(
        default=None,
        gt=0,
        description="Save a checkpoint every this many steps; empty saves only at the end "
        "(a stop request always saves one).",
    )
    seed: int = Field(default=42, description="Random seed, for runs that can be repeated.")
    chat_template: str = Field(
        default="tokenizer_default",
        min_length=1,
        description="Chat template: `tokenizer_default` (the model's own), `chatml`, "
        "`llama3`, `qwen3`...",
    )
    preprocess_only: bool = Field(
        default=False,
        description="Only prepare the datasets (`axolotl.cli.preprocess`): the run's files "
        "are its tokenized datasets under `prepared/`, nothing is trained.",
    )
    extra: AxolotlKeys = Field(
        default_factory=dict,
        description="More axolotl config keys, passed as they are (e.g. "
        "`gradient_checkpointing: true`).",
    )

    @field_validator("lora_target_modules")
    @classmethod
    def _no_empty_modules(cls, modules: list[str] | None) -> list[str] | None:
        if modules is not None and any(not m.strip() for m in modules):
            raise ValueError("lora_target_modules holds an empty name: remove it")
        return modules or None

    @field_validator("trackers")
    @classmethod
    def _trackers_once(cls, trackers: list[str]) -> list[str]:
        return list(dict.fromkeys(trackers))

    @model_validator(mode="after")
    def _settings_fit_together(self) -> TrainingSpec:
        if self.eval_steps is not None and self.val_set_size == 0:
            raise ValueError("eval_steps is set but val_set_size is 0: set val_set_size too")
        if "mlflow" in self.trackers and not self.tracker_uri:
            raise ValueError("trackers has mlflow but no tracker_uri: give the MLflow server URL")
        if self.preprocess_only and self.nodes > 1:
            raise ValueError("preprocess_only prepares the datasets on one machine: set nodes to 1")
        if self.nodes > 1:
            for key in ONE_MACHINE_KEYS:
                if key in self.extra:
                    raise ValueError(
                        f"extra sets {key}, which spreads the model over one machine's GPUs "
                        f"and cannot span {self.nodes} nodes: remove {key}, or set nodes to 1"
                    )
        return self

    @field_validator("val_set_size", "holdout")
    @classmethod
    def _share_or_rows(cls, size: float, info: ValidationInfo) -> float:
        if size >= 1 and size != int(size):
            raise ValueError(
                f"{info.field_name} {size} is neither a share below 1 nor a whole number of rows"
            )
        return size

    @field_validator("extra")
    @classmethod
    def _extra_owns_nothing(cls, extra: dict[str, JsonValue]) -> dict[str, JsonValue]:
        # gradient_checkpointing may also take axolotl's own values (`offload`) in extra
        own = set(cls.model_fields) - {"extra", "gradient_checkpointing"}
        for key in extra:
            problem = unknown_key(key, CONFIG_KEYS, "axolotl key in extra")
            if problem is not None:
                raise ValueError(problem)
            if key in OWNED_KEYS:
                raise ValueError(
                    f"extra sets {key}, which the trainer sets itself: remove it from extra"
                )
            if key in SHARDING_KEYS:
                raise ValueError(
                    f"extra sets {key}: set the sharding field instead (zero1, zero2, zero3 or "
                    "fsdp), which ships its config with the run"
                )
            if key in own:
                raise ValueError(
                    f"extra sets {key}, a field of its own: set the {key} field instead"
                )
        tuned = extra.get("fsdp_config")
        if tuned is not None and not isinstance(tuned, dict):
            raise ValueError(
                "extra's fsdp_config is not a mapping: give FSDP settings as keys and values, "
                "e.g. {offload_params: true}"
            )
        return extra

    def local_datasets(self) -> list[DatasetSpec]:
        """The datasets that are files on this machine, to upload with the run."""
        return [d for d in self.datasets if d.is_local]

    def check_files_exist(self) -> None:
        """Checks that every local dataset file exists on this machine. Relative
        paths are read from the current directory.

        Raises TrainError with one line for the first dataset that cannot be used.
        """
        for dataset in self.datasets:
            problem = dataset.local_problem()
            if problem is not None:
                raise TrainError(problem)

    def check_local_files(self, hub_token: str | None = None) -> list[str]:
        """The pre-flight checks that need no target, before a run is created:
        every local dataset file exists and its rows carry what their `type`
        needs (the first bad row named by file and line), and `sequence_len`
        fits the model's context (read from its directory's config.json, or from
        the Hub with `hub_token` for a gated model). Relative paths are read
        from the current directory. Returns warnings: a model whose config
        cannot be read, a file whose rows are not checked.

        Raises TrainError with one line for the first problem.
        """
        self.check_files_exist()
        warnings: list[str] = []
        for dataset in self.local_datasets():
            fields = dict(dataset.options)
            if dataset.field_messages is not None:
                fields["field_messages"] = dataset.field_messages
            problem, warning = first_bad_row(Path(dataset.path).expanduser(), dataset.type, fields)
            if problem is not None:
                raise TrainError(problem)
            if warning is not None:
                warnings.append(warning)
        context, warning = context_length(self.base_model, hub_token)
        if warning is not None:
            warnings.append(warning)
        rope = "rope_scaling" in self.extra or "rope_theta" in self.extra
        if context is not None and self.sequence_len > context and not rope:
            raise TrainError(
                f"sequence_len {self.sequence_len} is longer than the {context} tokens "
                f"{self.base_model} was trained for (max_position_embeddings in its "
                f"config.json): set sequence_len to {context} or less"
            )
        return warnings

    # The held-out split for the evaluation (trainers/holdout.py).
    holdout: float = Field(
        default=0.0,
        ge=0,
        description="Rows of the local JSON-lines datasets kept out of training for the "
        "evaluation: a share (below 1) or a number of rows; 0 keeps none. The split is fixed "
        "by the seed and recorded with the run, and its rows are never uploaded.",
    )


def spec_problem(spec: TrainingSpec) -> str | None:
    """One line saying why a local dataset of `spec` cannot be found from this
    machine, or None (its rows are checked by `check_local_files`)."""
    try:
        spec.check_files_exist()
    except TrainError as exc:
        return str(exc)
    return None


def _is_local(path: str) -> bool:
    if path.startswith((".", "/", "~")) or Path(path).suffix.lower() in DATA_SUFFIXES:
        return True
    return Path(path).expanduser().exists()
