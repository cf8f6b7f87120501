"""The axolotl trainer: a LoRA, QLoRA or full fine-tune run by `axolotl.cli.train`.

The run directory holds everything the job reads, with paths relative to it
(the job runs there): `axolotl.yaml`, the local datasets under `data/`, and the
metrics plugin under `plugins/`. The job writes `metrics.jsonl` (through the
plugin), `output/` (the adapter or model, and `checkpoint-N/` when it is asked
to stop) and `prepared/` (the tokenized datasets, left on the target).
"""

from __future__ import annotations

import posixpath
import shutil
from collections.abc import Sequence
from importlib import resources
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from overbrainer_prefect.trainers.base import (
    METRICS_FILE,
    STOP_FILE,
    Artifacts,
    JobContext,
    TargetFacts,
    TrainError,
)
from overbrainer_prefect.trainers.holdout import split_heldout
from overbrainer_prefect.trainers.spec import DatasetSpec, TrainingSpec

CONFIG_FILE = "axolotl.yaml"
OUTPUT_DIR = "output"
PREPARED_DIR = "prepared"  # tokenized datasets: rebuilt from the data when needed, never retrieved
DATA_DIR = "data"
PLUGINS_DIR = "plugins"
PLUGIN_MODULE = "overbrainer_metrics"
PLUGIN = f"{PLUGIN_MODULE}.MetricsPlugin"

SAVE_KEYS = frozenset({"save_strategy", "saves_per_epoch", "hub_model_id"})
"""Keys of `extra` that say when checkpoints are saved (hub_model_id pushes them)."""

CPU_FLAGS: dict[str, Any] = {
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


class AxolotlTrainer:
    """A fine-tune with axolotl, following `spec`.

    `resume_from` is a checkpoint directory relative to the run directory (e.g.
    `resume/checkpoint-3`, copied there from a stopped run) that training
    resumes from. `cpu_threads` sets OMP_NUM_THREADS on a CPU-only target.
    """

    def __init__(
        self, spec: TrainingSpec, resume_from: str | None = None, cpu_threads: int | None = None
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
        self.spec = spec
        self.resume_from = resume_from
        self.cpu_threads = cpu_threads

    @property
    def name(self) -> str:
        """`training`."""
        return "training"

    @property
    def metrics_file(self) -> str:
        """`metrics.jsonl`, written by the metrics plugin."""
        return METRICS_FILE

    @property
    def probe_modules(self) -> Sequence[str]:
        """torch and axolotl."""
        return ("torch", "axolotl")

    def check(self, facts: TargetFacts) -> None:
        """Raises TrainError when the job venv lacks torch or axolotl, or when a QLoRA
        run is asked of a target without a GPU."""
        for module in self.probe_modules:
            if facts.modules.get(module) is None:
                raise TrainError(
                    f"{module} is not installed in the job venv {facts.python}: install it with "
                    f"`uv pip install --python {facts.python} {module}` there"
                )
        self._check_adapter(facts)

    def prepare(self, local_run_dir: Path, ctx: JobContext) -> None:
        """Copies the local datasets into `data/` and the metrics plugin into `plugins/`
        of the local run directory, and writes `axolotl.yaml`.

        With `holdout` set, the held-out rows are taken out of the copies in `data/`
        and kept in `heldout/` (local only: see trainers/holdout.py).

        Raises TrainError when a local dataset file is missing, the held-out split
        cannot be made, or the target cannot run the spec (QLoRA without a GPU).
        """
        self.spec.check_local_files()
        self._check_adapter(ctx.facts)
        data_paths = self._copy_datasets(local_run_dir)
        split_heldout(local_run_dir, data_paths, self.spec)  # held-out rows leave data/
        plugins = local_run_dir / PLUGINS_DIR
        plugins.mkdir(parents=True, exist_ok=True)
        source = resources.files("overbrainer_prefect.jobs").joinpath(f"{PLUGIN_MODULE}.py")
        (plugins / f"{PLUGIN_MODULE}.py").write_bytes(source.read_bytes())
        config = self.config(ctx.facts, data_paths)
        text = yaml.safe_dump(config, sort_keys=False, default_flow_style=False)
        (local_run_dir / CONFIG_FILE).write_text(text, encoding="utf-8")

    def config(self, facts: TargetFacts, data_paths: Sequence[str] | None = None) -> dict[str, Any]:
        """The axolotl config of the run, for a target with `facts`. `data_paths` are
        the run-relative paths the local datasets were copied to, in order."""
        spec = self.spec
        local = iter(data_paths or [d.path for d in spec.local_datasets()])
        datasets = [
            _dataset_entry(d, next(local, None) if d.is_local else None) for d in spec.datasets
        ]
        config: dict[str, Any] = {
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
        config |= spec.extra
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
        """`python -m axolotl.cli.train axolotl.yaml`, with the job venv's Python (no
        launcher: `accelerate` need not be on the PATH)."""
        return [[ctx.facts.python, "-m", "axolotl.cli.train", CONFIG_FILE]]

    def env(self, ctx: JobContext) -> dict[str, str]:
        """No telemetry, no wandb, the target's Hugging Face cache, the plugin on the
        Python path, unbuffered output; offline when nothing comes from the Hub."""
        env = {
            "AXOLOTL_DO_NOT_TRACK": "1",
            "DO_NOT_TRACK": "1",
            "WANDB_MODE": "disabled",
            "HF_HOME": ctx.cache_dir,
            "PYTHONPATH": posixpath.join(ctx.run_dir, PLUGINS_DIR),
            "PYTHONUNBUFFERED": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
        if self._needs_no_hub():
            env["HF_HUB_OFFLINE"] = "1"  # also skips axolotl's token check against the Hub
        if ctx.facts.gpus == 0 and self.cpu_threads is not None:
            env["OMP_NUM_THREADS"] = str(self.cpu_threads)
        return env

    def artifacts(self) -> Artifacts:
        """`output/` (the adapter or model, and any checkpoint a stop saved), the
        metrics and the config; a succeeded run must have something in `output/`."""
        return Artifacts(
            entries=(OUTPUT_DIR, METRICS_FILE, CONFIG_FILE),
            exclude=(PREPARED_DIR, "__pycache__"),
            required=OUTPUT_DIR,
        )

    def _check_adapter(self, facts: TargetFacts) -> None:
        if self.spec.adapter == "qlora" and facts.gpus == 0:
            raise TrainError(
                "qlora needs a CUDA GPU (bitsandbytes 4-bit) and this target has none: use "
                "adapter lora, or a target with a GPU"
            )

    def _needs_no_hub(self) -> bool:
        model_is_dir = self.spec.base_model.startswith(("/", "."))
        pushes = "hub_model_id" in self.spec.extra
        return model_is_dir and not pushes and all(d.is_local for d in self.spec.datasets)

    def _copy_datasets(self, run_dir: Path) -> list[str]:
        copied: list[str] = []
        taken: set[str] = set()
        for index, dataset in enumerate(self.spec.datasets):
            if not dataset.is_local:
                continue
            source = Path(dataset.path).expanduser()
            name = source.name if source.name not in taken else f"{index}-{source.name}"
            taken.add(name)
            target = run_dir / DATA_DIR / name
            target.parent.mkdir(parents=True, exist_ok=True)
            if source.is_dir():
                shutil.copytree(source, target, dirs_exist_ok=True)
            else:
                shutil.copyfile(source, target)
            copied.append(f"{DATA_DIR}/{name}")
        return copied


def _dataset_entry(dataset: DatasetSpec, local_path: str | None) -> dict[str, Any]:
    entry: dict[str, Any] = {"path": local_path or dataset.path, "type": dataset.type}
    for key in ("split", "field_messages", "name"):
        value = getattr(dataset, key)
        if value is not None:
            entry[key] = value
    return entry
