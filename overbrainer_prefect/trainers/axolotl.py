"""The axolotl trainer: a LoRA, QLoRA or full fine-tune run by `axolotl.cli.train`.

The run directory holds everything the job reads, with paths relative to it
(the job runs there): `axolotl.yaml`, the local datasets under `data/`, the
metrics plugin under `plugins/`, and the DeepSpeed config the spec chose under
`deepspeed/` (shipped with this package: axolotl's `fetch` would need the
network at run time).

On a target with N > 1 GPUs the job is N processes, one per GPU, launched as
`axolotl train axolotl.yaml --launcher torchrun -- --nproc_per_node=N` launches
them: `torchrun --nproc_per_node=N -m axolotl.cli.train axolotl.yaml`, here
`python -m torch.distributed.run` (what the `torchrun` script runs), so that
nothing needs the job venv's `bin/` on the PATH, with `--standalone` so that
two jobs on one machine never share a rendezvous port. The processes stay
children of the job, so cancelling its process group reaches them through
torchrun, which passes the signal on. The job writes `metrics.jsonl` (through the
plugin), `output/` (the adapter or model, and `checkpoint-N/` when it is asked
to stop) and `prepared/` (the tokenized datasets, left on the target).
"""

from __future__ import annotations

import posixpath
import shutil
from collections.abc import Sequence
from importlib import resources
from pathlib import Path, PurePosixPath

import yaml
from pydantic import JsonValue

from overbrainer_prefect.trainers.base import (
    METRICS_FILE,
    STOP_FILE,
    Artifacts,
    JobContext,
    TargetFacts,
    TrainerBase,
    TrainError,
)
from overbrainer_prefect.trainers.holdout import split_heldout
from overbrainer_prefect.trainers.keys import (
    AXOLOTL_VERSION,
    OLDEST_LINE,
    SHIPPED,
    keys_for,
    release_line,
    unknown_key,
)
from overbrainer_prefect.trainers.preflight import BF16_CAPABILITY, sharding_label, target_problem
from overbrainer_prefect.trainers.spec import DEEPSPEED_STAGES, DatasetSpec, TrainingSpec
from overbrainer_prefect.trainers.staging import RUNNER_MODULE, copy_job_script

CONFIG_FILE = "axolotl.yaml"
OUTPUT_DIR = "output"
PREPARED_DIR = "prepared"  # tokenized datasets: rebuilt from the data when needed, never retrieved
DATA_DIR = "data"
PLUGINS_DIR = "plugins"
PLUGIN_MODULE = "overbrainer_metrics"
PLUGIN = f"{PLUGIN_MODULE}.MetricsPlugin"

DEEPSPEED_DIR = "deepspeed"
"""Where the run's DeepSpeed config sits in its run directory."""

LAUNCHER = "torch.distributed.run"  # the module behind `torchrun`

FSDP_CONFIG: dict[str, JsonValue] = {
    "offload_params": False,
    "cpu_ram_efficient_loading": False,  # FSDP2 refuses it with load_in_4bit (QLoRA)
    "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",  # the model's own decoder layers
    "state_dict_type": "FULL_STATE_DICT",  # one model a save, as a single GPU writes it
    "reshard_after_forward": True,
}
"""The FSDP2 settings of `sharding: fsdp` (axolotl's multi-GPU guide); `extra`'s
`fsdp_config` is laid over them."""

TRACKER_MODULES = {"wandb": "wandb", "mlflow": "mlflow"}
"""The module each tracker needs in the job venv."""

SAVE_KEYS = frozenset({"save_strategy", "saves_per_epoch", "hub_model_id"})
"""Keys of `extra` that say when checkpoints are saved (hub_model_id pushes them)."""

CPU_FLAGS: dict[str, JsonValue] = {
    # axolotl turns `bf16: auto` into fp16 on a CPU, and its LoRA kernels need CUDA
    "bf16": False,
    "fp16": False,
    "tf32": False,
    "lora_mlp_kernel": False,
    "lora_qkv_kernel": False,
    "lora_o_kernel": False,
    "lora_embedding_kernel": False,
    "flash_attention": False,
    "sample_packing": False,  # packing needs a varlen attention backend
    "load_in_4bit": False,  # bitsandbytes quantization needs CUDA
    "load_in_8bit": False,
    "optimizer": "adamw_torch",  # the default adamw_torch_fused wants an accelerator
    "dataloader_num_workers": 0,
    "dataloader_pin_memory": False,
    "dataset_num_proc": 1,  # the default 2 spends seconds forking for a small dataset
}
"""What a CPU-only target needs, whatever the spec says."""


class AxolotlTrainer(TrainerBase):
    """A fine-tune with axolotl, following `spec`.

    `resume_from` is a checkpoint directory relative to the run directory (e.g.
    `resume/checkpoint-3`, copied there from a stopped run) that training
    resumes from. `cpu_threads` sets OMP_NUM_THREADS on a CPU-only target.
    `processes` is the number of training processes: by default one per GPU
    (one on a CPU); more than one on a CPU trains with gloo, for tests.
    """

    def __init__(
        self,
        spec: TrainingSpec,
        resume_from: str | None = None,
        cpu_threads: int | None = None,
        processes: int | None = None,
    ) -> None:
        if resume_from is not None:
            parts = PurePosixPath(resume_from).parts
            if not parts or resume_from.startswith("/") or ".." in parts:
                raise TrainError(
                    f"the checkpoint to resume from, {resume_from}, must be a directory inside "
                    "the run directory, like resume/checkpoint-3"
                )
        if cpu_threads is not None and cpu_threads < 1:
            raise TrainError(f"cpu_threads is {cpu_threads}: give 1 or more, or leave it unset")
        if processes is not None and processes < 1:
            raise TrainError(f"processes is {processes}: give 1 or more, or leave it unset")
        self.spec = spec
        self.resume_from = resume_from
        self.cpu_threads = cpu_threads
        self.processes = processes

    name = "training"
    checkpoint_dir = OUTPUT_DIR
    """Where the job saves its `checkpoint-N/` (kept in the run's store as they come)."""

    @property
    def probe_modules(self) -> Sequence[str]:
        """torch and axolotl, and what the spec asks for: deepspeed for ZeRO,
        flash_attn for flash attention, wandb or mlflow for its trackers."""
        modules = ["torch", "axolotl"]
        if self.spec.sharding in DEEPSPEED_STAGES:
            modules.append("deepspeed")
        if self.spec.flash_attention:
            modules.append("flash_attn")
        modules += [TRACKER_MODULES[t] for t in self.spec.trackers]
        return tuple(modules)

    def install_hint(self, module: str, python: str) -> str:
        """`uv pip install` of `module` into the job venv of `python`."""
        package = "flash-attn --no-build-isolation" if module == "flash_attn" else module
        return f"install it with `uv pip install --python {python} {package}`"

    def check(self, facts: TargetFacts) -> None:
        """Raises TrainError when the job venv lacks a module of `probe_modules`,
        when its axolotl is older than the oldest release line the trainer writes
        configs for or does not know a key the spec gives (`extra`, dataset
        options: see `axolotl_problem`), or when the target cannot run the spec
        (see `preflight.target_problem`: QLoRA or bf16 without a GPU, DeepSpeed
        on one GPU...)."""
        super().check(facts)
        problem = axolotl_problem(self.spec, facts.modules.get("axolotl"), facts.python)
        if problem is not None:
            raise TrainError(problem)
        self._check_target(facts)

    def process_count(self, facts: TargetFacts) -> int:
        """How many training processes the job runs: `processes` when set, else
        one per GPU (one on a CPU); one for a preprocessing."""
        if self.spec.preprocess_only:
            return 1
        if self.processes is not None:
            return self.processes
        return max(1, facts.gpus)

    def launch(self, facts: TargetFacts) -> str:
        """The launch plan in words, for the logs before a run starts: processes,
        GPUs and sharding (see `launch_summary`)."""
        return launch_summary(self.spec, facts.gpus, self.process_count(facts))

    def prepare(self, local_run_dir: Path, ctx: JobContext) -> None:
        """Copies the local datasets into `data/` and the metrics plugin into `plugins/`
        of the local run directory, and writes `axolotl.yaml`.

        With `holdout` set, the held-out rows are taken out of the copies in `data/`
        and kept in `heldout/` (local only: see trainers/holdout.py).

        Raises TrainError when a local dataset file is missing, the held-out split
        cannot be made, or the target cannot run the spec (QLoRA without a GPU).
        """
        self.spec.check_files_exist()
        self._check_target(ctx.facts)
        data_paths = self._copy_datasets(local_run_dir)
        split_heldout(local_run_dir, data_paths, self.spec)  # held-out rows leave data/
        for module in (PLUGIN_MODULE, RUNNER_MODULE):
            copy_job_script(local_run_dir, module, PLUGINS_DIR)
        if self.spec.sharding in DEEPSPEED_STAGES:
            name = f"{self.spec.sharding}.json"
            shipped = resources.files("overbrainer_prefect.trainers").joinpath(DEEPSPEED_DIR, name)
            (local_run_dir / DEEPSPEED_DIR).mkdir(parents=True, exist_ok=True)
            (local_run_dir / DEEPSPEED_DIR / name).write_bytes(shipped.read_bytes())
        config = self.config(ctx.facts, data_paths)
        text = yaml.safe_dump(config, sort_keys=False, default_flow_style=False)
        (local_run_dir / CONFIG_FILE).write_text(text, encoding="utf-8")

    def config(
        self, facts: TargetFacts, data_paths: Sequence[str] | None = None
    ) -> dict[str, JsonValue]:
        """The axolotl config of the run, for a target with `facts`. `data_paths` are
        the run-relative paths the local datasets were copied to, in order."""
        spec = self.spec
        local = iter(data_paths or [d.path for d in spec.local_datasets()])
        datasets: list[JsonValue] = [
            _dataset_entry(d, next(local, None) if d.is_local else None) for d in spec.datasets
        ]
        config: dict[str, JsonValue] = {
            "base_model": spec.base_model,
            "datasets": datasets,
            "chat_template": spec.chat_template,
            "sequence_len": spec.sequence_len,
            "micro_batch_size": spec.micro_batch_size,
            "gradient_accumulation_steps": spec.gradient_accumulation_steps,
            "num_epochs": spec.num_epochs,
        }
        if spec.max_steps is not None:
            config["max_steps"] = spec.max_steps
        config |= {"learning_rate": spec.learning_rate, "lr_scheduler": spec.lr_scheduler}
        if "warmup_ratio" not in spec.extra:  # axolotl refuses both
            config["warmup_steps"] = spec.warmup_steps
        config |= {"val_set_size": spec.val_set_size, "seed": spec.seed}
        if spec.val_set_size > 0 and not EVAL_KEYS & spec.extra.keys():
            if spec.eval_steps is not None:
                config["eval_steps"] = spec.eval_steps
            else:
                config["eval_strategy"] = "epoch"  # also at the end of a run cut by max_steps
            if spec.sample_packing:
                config["eval_sample_packing"] = False  # a small eval share packs into too few rows
        if spec.save_steps is not None:
            config["save_steps"] = spec.save_steps
        elif not SAVE_KEYS & spec.extra.keys():
            # no checkpoint each epoch (model and optimizer state: heavy to bring back);
            # the final model is saved all the same, and a stop request still saves one
            config["save_strategy"] = "no"
        if spec.adapter != "full":
            config |= {
                "adapter": spec.adapter,
                "lora_r": spec.lora_r,
                "lora_alpha": spec.lora_alpha,
                "lora_dropout": spec.lora_dropout,
            }
            if spec.lora_target_modules:
                config["lora_target_modules"] = list(spec.lora_target_modules)
            else:
                config["lora_target_linear"] = True
            if spec.adapter == "qlora":
                config["load_in_4bit"] = True
        if facts.gpus > 0:
            config |= precision_flags(spec.precision, facts.compute_capability)
        if spec.flash_attention:
            config["attn_implementation"] = "flash_attention_2"
        if spec.sample_packing:
            config |= {"sample_packing": True, "pad_to_sequence_len": True}
        if spec.gradient_checkpointing and spec.sharding != "fsdp":
            config["gradient_checkpointing"] = True
        if "wandb" in spec.trackers:
            config["wandb_project"] = spec.tracker_project
        if "mlflow" in spec.trackers:
            config |= {
                "use_mlflow": True,
                "mlflow_tracking_uri": spec.tracker_uri,
                "mlflow_experiment_name": spec.tracker_project,
            }
        extra = dict(spec.extra)
        if spec.sharding in DEEPSPEED_STAGES:
            config["deepspeed"] = f"{DEEPSPEED_DIR}/{spec.sharding}.json"
        elif spec.sharding == "fsdp":
            fsdp = dict(FSDP_CONFIG)
            if spec.gradient_checkpointing:  # FSDP checkpoints activations itself
                fsdp["activation_checkpointing"] = True
            tuned = extra.pop("fsdp_config", None)
            if isinstance(tuned, dict):  # a mapping, as the spec checked
                fsdp |= tuned
            config |= {"fsdp_version": 2, "fsdp_config": fsdp}
        config |= extra
        config |= {
            "output_dir": OUTPUT_DIR,
            "dataset_prepared_path": PREPARED_DIR,
            "logging_steps": 1,
            "plugins": [PLUGIN],
            "overbrainer_metrics_file": METRICS_FILE,
            "overbrainer_stop_file": STOP_FILE,
        }
        if self.resume_from is not None:
            config["resume_from_checkpoint"] = self.resume_from
        if facts.gpus == 0:
            config |= CPU_FLAGS
        return config

    def commands(self, ctx: JobContext) -> list[list[str]]:
        """One process: `python -m overbrainer_run axolotl.cli.train
        axolotl.yaml`, with the job venv's Python (`accelerate` need not be on
        the PATH): axolotl's CLI module, run as `-m` runs it, whose process
        ends without the interpreter's teardown once it succeeded
        (`RUNNER_MODULE`). N processes: `python -m torch.distributed.run
        --standalone --nproc_per_node=N -m overbrainer_run axolotl.cli.train
        axolotl.yaml`, what axolotl's torchrun launcher runs. On several nodes,
        the same without `--standalone`: each node's target gives it the
        rendezvous (`executors.nodes`). A preprocessing: `python -m
        overbrainer_run axolotl.cli.preprocess axolotl.yaml`, one process, then,
        once it succeeded, its end event written to the metrics file (no
        trainer runs, so the metrics plugin writes none)."""
        if self.spec.preprocess_only:  # one process: the datasets, tokenized once
            ended = (
                f"import json, time; open({METRICS_FILE!r}, 'a').write(json.dumps({{'event': "
                "'end', 'step': 0, 'stopped': False, 'preprocessed': True, 'time': time.time()})"
                " + '\\n')"
            )
            return [
                [ctx.facts.python, "-m", RUNNER_MODULE, "axolotl.cli.preprocess", CONFIG_FILE],
                [ctx.facts.python, "-c", ended],
            ]
        train = ["-m", RUNNER_MODULE, "axolotl.cli.train", CONFIG_FILE]
        processes = self.process_count(ctx.facts)
        if self.spec.nodes > 1:  # the rendezvous comes from each node's environment (PET_*)
            return [[ctx.facts.python, "-m", LAUNCHER, f"--nproc_per_node={processes}", *train]]
        if processes == 1:
            return [[ctx.facts.python, *train]]
        launcher = ["-m", LAUNCHER, "--standalone", f"--nproc_per_node={processes}"]
        return [[ctx.facts.python, *launcher, *train]]

    def env(self, ctx: JobContext) -> dict[str, str]:
        """No telemetry, no wandb unless a tracker asks for it, the target's Hugging
        Face cache, the plugin on the Python path, unbuffered output; offline when
        nothing comes from the Hub. Tracker keys are secrets: they come from the
        target, never from here."""
        env = {
            "AXOLOTL_DO_NOT_TRACK": "1",
            "DO_NOT_TRACK": "1",
            "HF_HOME": ctx.cache_dir,
            "PYTHONPATH": posixpath.join(ctx.run_dir, PLUGINS_DIR),
            "PYTHONUNBUFFERED": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
        if "wandb" in self.spec.trackers:
            env["WANDB_NAME"] = ctx.run_id
        else:
            env["WANDB_MODE"] = "disabled"
        if self._needs_no_hub():
            env["HF_HUB_OFFLINE"] = "1"  # also skips axolotl's token check against the Hub
        if ctx.facts.gpus == 0 and self.cpu_threads is not None:
            env["OMP_NUM_THREADS"] = str(self.cpu_threads)
        return env

    def artifacts(self) -> Artifacts:
        """`output/` (the adapter or model, and any checkpoint a stop saved), the
        metrics and the config; a succeeded run must have something in `output/`.
        A preprocessing's are `prepared/` (the tokenized datasets, which must be
        there), the metrics (its end event) and the config."""
        if self.spec.preprocess_only:
            return Artifacts(
                entries=(PREPARED_DIR, METRICS_FILE, CONFIG_FILE),
                exclude=("__pycache__",),
                required=PREPARED_DIR,
            )
        return Artifacts(
            entries=(OUTPUT_DIR, METRICS_FILE, CONFIG_FILE),
            exclude=(PREPARED_DIR, "__pycache__"),
            required=OUTPUT_DIR,
        )

    def _check_target(self, facts: TargetFacts) -> None:
        problem = target_problem(self.spec, facts.gpus, facts.compute_capability)
        if problem is not None:
            raise TrainError(problem)
        processes = self.process_count(facts)
        if facts.gpus > 0 and processes != facts.gpus:
            raise TrainError(
                f"processes is {processes} but the target has {facts.gpus} GPUs: every GPU "
                "runs one process; leave processes unset"
            )

    def _needs_no_hub(self) -> bool:
        model_is_dir = self.spec.base_model.startswith(("/", "."))
        pushes = "hub_model_id" in self.spec.extra
        return model_is_dir and not pushes and all(d.is_local for d in self.spec.datasets)

    def _copy_datasets(self, run_dir: Path) -> list[str]:
        copied = data_copies(self.spec)
        for dataset, relative in zip(self.spec.local_datasets(), copied, strict=True):
            source = Path(dataset.path).expanduser()
            target = run_dir / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            if source.is_dir():
                shutil.copytree(source, target, dirs_exist_ok=True)
            else:
                shutil.copyfile(source, target)
        return copied


def axolotl_problem(spec: TrainingSpec, version: str | None, python: str) -> str | None:
    """One line saying why axolotl `version` (what the probe of the job venv of
    `python` found) cannot run `spec`, or None: it is older than the oldest
    release line the trainer writes configs for, or its key list (shipped for
    its release line) lacks a key of `extra` or of a dataset's options. An
    axolotl whose line has no shipped list is left to check the config itself."""
    line = release_line(version or "")
    if version is None or line is None:
        return None
    upgrade = f"`uv pip install --python {python} axolotl=={AXOLOTL_VERSION}`"
    if line < OLDEST_LINE:
        return (
            f"the job venv has axolotl {version} and the trainer writes configs for "
            f"{OLDEST_LINE[0]}.{OLDEST_LINE[1]} or newer: upgrade it with {upgrade}"
        )
    keys = keys_for(version)
    if keys is None:
        return None
    given = [(key, "config", "axolotl key in extra") for key in spec.extra]
    given += [
        (key, "dataset", "dataset key") for dataset in spec.datasets for key in dataset.options
    ]
    for key, kind, what in given:
        problem = unknown_key(key, getattr(keys, kind), what, (keys.version,))
        if problem is None:
            continue
        knowing = [k.version for k in SHIPPED.values() if key in getattr(k, kind)]
        if knowing:  # another release line knows it
            return (
                f"{what} `{key}` is known to axolotl {' and '.join(knowing)}, not to the job "
                f"venv's {keys.version}: install axolotl {knowing[-1]} there "
                f"(`uv pip install --python {python} axolotl=={knowing[-1]}`), or remove `{key}`"
            )
        return problem
    return None


EVAL_KEYS = frozenset({"eval_steps", "evals_per_epoch", "eval_strategy"})
"""Keys of `extra` that say when to evaluate, in place of the spec's."""


def data_copies(spec: TrainingSpec) -> list[str]:
    """Where `prepare` copies each local dataset of `spec`, in order, relative to
    the run directory: `data/<file name>`, prefixed by the dataset's index when
    an earlier one has the same name."""
    copied: list[str] = []
    taken: set[str] = set()
    for index, dataset in enumerate(spec.datasets):
        if not dataset.is_local:
            continue
        name = Path(dataset.path).expanduser().name
        name = name if name not in taken else f"{index}-{name}"
        taken.add(name)
        copied.append(f"{DATA_DIR}/{name}")
    return copied


def precision_flags(
    precision: str, compute_capability: tuple[int, int] | None
) -> dict[str, JsonValue]:
    """axolotl's precision keys on a GPU: `auto` is bf16 from compute capability
    8.0 on, fp16 below it, and axolotl's own detection when it is not known."""
    if precision == "auto":
        if compute_capability is None:
            return {"bf16": "auto"}
        precision = "bf16" if compute_capability >= BF16_CAPABILITY else "fp16"
    if precision == "bf16":
        return {"bf16": True, "fp16": False}
    if precision == "fp16":
        return {"bf16": False, "fp16": True}
    return {"bf16": False, "fp16": False, "tf32": False}


def launch_summary(spec: TrainingSpec, gpus: int, processes: int | None = None) -> str:
    """The launch plan in words: `4 processes (torchrun, one a GPU) on 4 GPUs,
    DeepSpeed ZeRO-3: weights, gradients and optimizer state sharded`, or
    `1 process on 1 GPU`, `1 process on the CPU`."""
    processes = processes or max(1, gpus)
    where = "the CPU" if gpus == 0 else f"{gpus} GPU{'s' if gpus > 1 else ''}"
    if processes == 1:
        return f"1 process on {where}"
    text = f"{processes} processes (torchrun, {'one a GPU' if gpus else 'gloo'}) on {where}, "
    sharded = {
        "ddp": "each holds the whole model",
        "zero1": "optimizer state sharded",
        "zero2": "optimizer state and gradients sharded",
        "zero3": "weights, gradients and optimizer state sharded",
        "fsdp": "weights, gradients and optimizer state sharded",
    }[spec.sharding]
    return text + f"{sharding_label(spec.sharding)}: {sharded}"


def _dataset_entry(dataset: DatasetSpec, local_path: str | None) -> dict[str, JsonValue]:
    entry: dict[str, JsonValue] = {"path": local_path or dataset.path, "type": dataset.type}
    for key in ("split", "field_messages", "name"):
        value = getattr(dataset, key)
        if value is not None:
            entry[key] = value
    return entry | dataset.options
