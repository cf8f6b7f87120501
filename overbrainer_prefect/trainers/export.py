"""The export trainer: a succeeded run's model turned into one GGUF file on a target.

The export's directory (`runs/<run-id>/exports/<export-id>/`, and its copy on the
target) holds what the job reads, with paths relative to it:

    model/          the top-level files of the run's `output/` (adapter or full
                    weights, never a checkpoint)
    axolotl.yaml    the run's config, which names the base model a LoRA is merged into
    scripts/        the job script, `overbrainer_export.py`

The job (see `overbrainer_prefect/jobs/overbrainer_export.py`) merges, converts
with llama.cpp's converter and quantizes; it writes `gguf/run-<run-id>-<quant>.gguf`
(`general.name`: the run, and the base it was tuned from) and
`metrics.jsonl` (begin, one `phase` event per step, end), which are what an
export brings back and verifies.
"""

from __future__ import annotations

import json
import posixpath
import re
import shutil
from collections.abc import Sequence
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator

from overbrainer_prefect.runs.store import RunRecord
from overbrainer_prefect.trainers.base import (
    METRICS_FILE,
    Artifacts,
    JobContext,
    TrainerBase,
    TrainError,
)
from overbrainer_prefect.trainers.staging import SCRIPTS_DIR, copy_job_script, link_or_copy

QUANTS: dict[str, float] = {"q4_k_m": 4.89, "q5_k_m": 5.70, "q8_0": 8.50, "f16": 16.0}
"""The quant types an export makes, with their bits per weight (llama.cpp's
quantize README, Llama-3.1-8B): what a GGUF's size is estimated from."""

DEFAULT_QUANT = "q4_k_m"

MODEL_DIR = "model"
GGUF_DIR = "gguf"
CONFIG_FILE = "axolotl.yaml"
OUTPUT_DIR = "output"  # where a training run leaves its model
JOB_MODULE = "overbrainer_export"

CONVERTER = "share/llama.cpp/convert_hf_to_gguf.py"
"""llama.cpp's HF->GGUF converter, relative to the job venv (scripts/job-env.sh puts it
there, from the llama-cpp-python sdist the venv's llama.cpp was built from)."""

MODULES = ("torch", "transformers", "peft", "llama_cpp")
"""What the job imports: the merge (torch, transformers, peft) and the quantizer."""

NAME_CHARS = re.compile(r"[^A-Za-z0-9._-]+")


class UnknownQuant(ValueError):
    """A quant type an export does not make. The message lists the known ones."""

    def __init__(self, quant: str) -> None:
        super().__init__(f"unknown quant type {quant!r}: use one of {', '.join(QUANTS)}")


def check_quant(quant: str) -> str:
    """`quant` in its canonical spelling (lowercase). Raises UnknownQuant for a
    type an export does not make."""
    canonical = quant.strip().lower()
    if canonical not in QUANTS:
        raise UnknownQuant(quant)
    return canonical


class ExportSpec(BaseModel):
    """What an export makes of a run's model (a flow parameter)."""

    model_config = ConfigDict(extra="forbid")

    quant: str = Field(
        default=DEFAULT_QUANT,
        description=f"The GGUF's quant type: one of {', '.join(QUANTS)}.",
    )
    keep_intermediate: bool = Field(
        default=False,
        description="Keep the merged model and the f16 GGUF on the target (under work/).",
    )

    @field_validator("quant")
    @classmethod
    def _known_quant(cls, quant: str) -> str:
        return check_quant(quant)


def model_files(run_dir: Path) -> list[Path]:
    """The files of a run's model: the top-level files of its `output/` (an adapter,
    or full weights), never its checkpoints.

    Raises TrainError when `output/` holds neither an adapter (adapter_config.json)
    nor a model (config.json).
    """
    output = run_dir / OUTPUT_DIR
    files = sorted(p for p in output.iterdir() if p.is_file()) if output.is_dir() else []
    names = {p.name for p in files}
    if "adapter_config.json" not in names and "config.json" not in names:
        raise TrainError(
            f"{output} holds no model (no adapter_config.json, no config.json): "
            "only a run that saved its model can be exported"
        )
    return files


def base_model(run_dir: Path) -> str | None:
    """The base model the run's `axolotl.yaml` names (a directory on its target or
    a Hugging Face id), or None when it names none or cannot be read."""
    try:
        config = yaml.safe_load((run_dir / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return None
    base = config.get("base_model") if isinstance(config, dict) else None
    return base if isinstance(base, str) and base else None


def is_lora(run_dir: Path) -> bool:
    """Whether the run's model is an adapter (merged into its base by an export)."""
    return (run_dir / OUTPUT_DIR / "adapter_config.json").is_file()


def gguf_name(run_id: str, base: str | None) -> str:
    """The GGUF's file name without its quant: the base model's last path part and
    the run ID (`smollm2-base-20261130-184143-h2vk`), in file-name-safe characters."""
    stem = NAME_CHARS.sub("-", posixpath.basename((base or "model").rstrip("/"))).strip(".-")
    return f"{stem or 'model'}-{run_id}"


def tuned_gguf_name(run_id: str) -> str:
    """The tuned GGUF's file name without its quant, named for the run it was
    tuned by (`run-20261130-184143-h2vk`), not for its base (which `gguf_name`
    names, for a base model's own export)."""
    return f"run-{run_id}"


def model_title(run_id: str, base: str | None) -> str:
    """The tuned GGUF's `general.name`: the run, and the base it was tuned from
    (`run 20261130-184143-h2vk, tuned from smollm2-base`)."""
    stem = posixpath.basename((base or "").rstrip("/"))
    return f"run {run_id}, tuned from {stem}" if stem else f"run {run_id}"


def converter_path(python: str) -> str:
    """Where llama.cpp's converter is on a target whose job venv has `python`
    (`<venv>/bin/python`)."""
    venv = posixpath.dirname(posixpath.dirname(python))
    return posixpath.join(venv, CONVERTER)


EXPORT_ARTIFACTS = Artifacts(entries=(GGUF_DIR, METRICS_FILE), required=GGUF_DIR)
"""What an export brings back: `gguf/` and the metrics; a succeeded one must have its GGUF."""


class GgufExport(TrainerBase):
    """What both exports share: the export job (`scripts/overbrainer_export.py`)
    making `gguf/<gguf_stem>-<quant>.gguf` of a model with llama.cpp's converter
    next to the job venv's Python, in an environment without telemetry, with
    the target's Hugging Face cache; offline when the model to convert, or the
    base a LoRA is merged into, is a directory. `cpu_threads` sets
    OMP_NUM_THREADS and llama.cpp's quantize threads on a target without a GPU."""

    name = "export"
    modules: Sequence[str] = MODULES

    def __init__(
        self, quant: str, gguf_stem: str, base_model: str | None, cpu_threads: int | None
    ) -> None:
        self.quant = quant
        self.gguf_stem = gguf_stem
        self.base_model = base_model
        self.cpu_threads = cpu_threads

    @property
    def gguf(self) -> str:
        """The GGUF the export makes, relative to its directory."""
        return f"{GGUF_DIR}/{self.gguf_stem}-{self.quant}.gguf"

    def options(self) -> list[str]:
        """The export job's options beyond its quant and its file's name."""
        return []

    def offline(self) -> bool:
        """Whether the job fetches nothing from the Hub: its base model is a directory."""
        base = self.base_model
        return base is None or base.startswith(("/", ".", "~"))

    def prepare(self, local_run_dir: Path, ctx: JobContext) -> None:
        """Puts the export job script under `scripts/`."""
        copy_job_script(local_run_dir, JOB_MODULE)

    def commands(self, ctx: JobContext) -> list[list[str]]:
        """The job script with the job venv's Python and the converter next to it,
        its quant, its file's name and `options`."""
        python = ctx.facts.python
        command = [python, f"{SCRIPTS_DIR}/{JOB_MODULE}.py", "--converter", converter_path(python)]
        command += ["--quant", self.quant, "--name", self.gguf_stem]
        if ctx.facts.gpus == 0 and self.cpu_threads is not None:
            command += ["--threads", str(self.cpu_threads)]
        return [command + self.options()]

    def env(self, ctx: JobContext) -> dict[str, str]:
        """No telemetry, the target's Hugging Face cache, unbuffered output;
        offline when nothing is to be fetched (`offline`)."""
        env = {
            "DO_NOT_TRACK": "1",
            "HF_HOME": ctx.cache_dir,
            "PYTHONUNBUFFERED": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "TRANSFORMERS_VERBOSITY": "error",
        }
        if self.offline():
            env["HF_HUB_OFFLINE"] = "1"
        if ctx.facts.gpus == 0 and self.cpu_threads is not None:
            env["OMP_NUM_THREADS"] = str(self.cpu_threads)
        return env

    def artifacts(self) -> Artifacts:
        """`gguf/` and the metrics; a succeeded export must have its GGUF."""
        return EXPORT_ARTIFACTS


class ExportTrainer(GgufExport):
    """An export of the succeeded run `run`, whose local directory is `run_dir`,
    following `spec`: its model (merged into its base when it is a LoRA), named
    for the run (its file and its `general.name`)."""

    def __init__(
        self, run: RunRecord, run_dir: Path, spec: ExportSpec, cpu_threads: int | None = None
    ) -> None:
        super().__init__(spec.quant, tuned_gguf_name(run.id), base_model(run_dir), cpu_threads)
        self.run = run
        self.run_dir = run_dir
        self.spec = spec
        self.title = model_title(run.id, self.base_model)

    def prepare(self, local_run_dir: Path, ctx: JobContext) -> None:
        """Stages the run's model under `model/`, its `axolotl.yaml`, and the job
        script under `scripts/` in the export's local directory.

        Raises TrainError when the run has no model or no config.
        """
        files = model_files(self.run_dir)
        config = self.run_dir / CONFIG_FILE
        if is_lora(self.run_dir) and not config.is_file():
            raise TrainError(
                f"{config} is missing: a LoRA cannot be merged without the base model it names"
            )
        model = local_run_dir / MODEL_DIR
        model.mkdir(parents=True, exist_ok=True)
        for source in files:
            link_or_copy(source, model / source.name)
        if config.is_file():
            shutil.copyfile(config, local_run_dir / CONFIG_FILE)
        super().prepare(local_run_dir, ctx)

    def options(self) -> list[str]:
        """The GGUF's `general.name`, and whether to keep the intermediate files."""
        keep = ["--keep-intermediate"] if self.spec.keep_intermediate else []
        return ["--title", self.title, *keep]

    def offline(self) -> bool:
        """Offline when the run's model is full weights (nothing to merge into), or
        the base a LoRA is merged into is a directory."""
        return not is_lora(self.run_dir) or super().offline()


class BaseExportTrainer(GgufExport):
    """An export of the plain base model `base_model` (a directory on the target or
    a Hugging Face id) to a GGUF of type `quant`: the export job with `--base`,
    converted and quantized like a run's model, nothing merged."""

    def __init__(self, base_model: str, quant: str, cpu_threads: int | None = None) -> None:
        super().__init__(quant, gguf_name("base", base_model), base_model, cpu_threads)

    def options(self) -> list[str]:
        """`--base`: the job exports the base model, which is on the target."""
        return ["--base", str(self.base_model)]


def phases(metrics_text: str) -> dict[str, float]:
    """The seconds each step of an export took (`merge`, `convert`, `quantize`), from
    its metrics file's text; a skipped step counts 0. Lines that are not events are
    ignored."""
    found: dict[str, float] = {}
    for line in metrics_text.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if not isinstance(event, dict) or event.get("event") != "phase":
            continue
        name, seconds = event.get("name"), event.get("seconds")
        if isinstance(name, str) and isinstance(seconds, int | float):
            found[name] = float(seconds)
    return found
