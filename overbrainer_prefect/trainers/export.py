"""The export trainer: a succeeded run's model turned into one GGUF file on a target.

The export's directory (`runs/<run-id>/exports/<export-id>/`, and its copy on the
target) holds what the job reads, with paths relative to it:

    model/          the top-level files of the run's `output/` (adapter or full
                    weights, never a checkpoint)
    axolotl.yaml    the run's config, which names the base model a LoRA is merged into
    scripts/        the job script, `overbrainer_export.py`, and `overbrainer_run.py`,
                    which runs it and ends its process without Python's teardown

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
from collections.abc import Sequence
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator

from overbrainer_prefect.executors.base import FileDigest
from overbrainer_prefect.runs.manifest import load_manifest
from overbrainer_prefect.runs.store import RunRecord, Runs
from overbrainer_prefect.store.records import RecordError
from overbrainer_prefect.trainers.base import (
    METRICS_FILE,
    Artifacts,
    JobContext,
    TrainerBase,
    TrainError,
)
from overbrainer_prefect.trainers.staging import (
    RUNNER_MODULE,
    SCRIPTS_DIR,
    copy_job_script,
    stage_stored,
)

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


def model_files(runs: Runs, run_id: str) -> list[FileDigest]:
    """The files of a run's model, as its verified manifest lists them: the
    top-level files of its `output/` (an adapter, or full weights), never its
    checkpoints.

    Raises TrainError when `output/` holds neither an adapter (adapter_config.json)
    nor a model (config.json).
    """
    files = sorted(
        (
            entry
            for entry in load_manifest(runs, run_id)
            if entry.path.startswith(f"{OUTPUT_DIR}/") and entry.path.count("/") == 1
        ),
        key=lambda entry: entry.path,
    )
    names = {posixpath.basename(entry.path) for entry in files}
    if "adapter_config.json" not in names and "config.json" not in names:
        raise TrainError(
            f"{runs.where_of(run_id, OUTPUT_DIR)} holds no model (no adapter_config.json, "
            "no config.json): only a run that saved its model can be exported"
        )
    return files


def run_config(runs: Runs, run_id: str) -> str | None:
    """The text of the run's `axolotl.yaml`, None when it has none or it cannot be read."""
    try:
        return runs.read_text(run_id, CONFIG_FILE)
    except (OSError, RecordError):
        return None


def base_model(runs: Runs, run_id: str) -> str | None:
    """The base model the run's `axolotl.yaml` names (a directory on its target or
    a Hugging Face id), or None when it names none or cannot be read."""
    text = run_config(runs, run_id)
    try:
        config = yaml.safe_load(text) if text is not None else None
    except yaml.YAMLError:
        return None
    base = config.get("base_model") if isinstance(config, dict) else None
    return base if isinstance(base, str) and base else None


def is_lora(runs: Runs, run_id: str) -> bool:
    """Whether the run's model is an adapter (merged into its base by an export)."""
    return any(
        entry.path == f"{OUTPUT_DIR}/adapter_config.json" for entry in load_manifest(runs, run_id)
    )


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
        """Puts the export job script and the runner under `scripts/`."""
        copy_job_script(local_run_dir, JOB_MODULE)
        copy_job_script(local_run_dir, RUNNER_MODULE)

    def commands(self, ctx: JobContext) -> list[list[str]]:
        """The job script run by the runner (`python scripts/overbrainer_run.py
        overbrainer_export ...`: once the export ended well, its process ends
        without the interpreter's teardown of torch, transformers and peft),
        with the job venv's Python and the converter next to it, its quant, its
        file's name and `options`."""
        python = ctx.facts.python
        command = [python, f"{SCRIPTS_DIR}/{RUNNER_MODULE}.py", JOB_MODULE]
        command += ["--converter", converter_path(python)]
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
    """An export of the succeeded run `run` of `runs`, following `spec`: its
    model (merged into its base when it is a LoRA), named for the run (its file
    and its `general.name`)."""

    def __init__(
        self, run: RunRecord, runs: Runs, spec: ExportSpec, cpu_threads: int | None = None
    ) -> None:
        super().__init__(spec.quant, tuned_gguf_name(run.id), base_model(runs, run.id), cpu_threads)
        self.run = run
        self.runs = runs
        self.spec = spec
        self.title = model_title(run.id, self.base_model)
        self.lora = is_lora(runs, run.id)

    def prepare(self, local_run_dir: Path, ctx: JobContext) -> None:
        """Stages the run's model under `model/` (from its store: hard links
        from a local one, fetched by the job from an object store), its
        `axolotl.yaml`, and the job script under `scripts/` in the export's
        local directory.

        Raises TrainError when the run has no model or no config.
        """
        files = model_files(self.runs, self.run.id)
        config = run_config(self.runs, self.run.id)
        if self.lora and config is None:
            raise TrainError(
                f"{self.runs.where_of(self.run.id, CONFIG_FILE)} is missing: a LoRA cannot be "
                "merged without the base model it names"
            )
        (local_run_dir / MODEL_DIR).mkdir(parents=True, exist_ok=True)
        again = f"retrieve it again with the attach flow (run_id={self.run.id})"
        for entry in files:
            dest = f"{MODEL_DIR}/{posixpath.basename(entry.path)}"
            key = self.runs.key(self.run.id, entry.path)
            missing = f"{self.runs.store.where(key)} is missing: {again}"
            stage_stored(self.runs, key, local_run_dir, dest, entry.size, entry.sha256, missing)
        if config is not None:
            (local_run_dir / CONFIG_FILE).write_text(config, encoding="utf-8")
        super().prepare(local_run_dir, ctx)

    def options(self) -> list[str]:
        """The GGUF's `general.name`, and whether to keep the intermediate files."""
        keep = ["--keep-intermediate"] if self.spec.keep_intermediate else []
        return ["--title", self.title, *keep]

    def offline(self) -> bool:
        """Offline when the run's model is full weights (nothing to merge into), or
        the base a LoRA is merged into is a directory."""
        return not self.lora or super().offline()


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
