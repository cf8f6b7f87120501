"""A job that asks GGUFs with llama.cpp: what the compare and the evaluation share.

Both stage a fine-tune's GGUF and the one it is measured against under
`models/` (`tuned.gguf`, `base.gguf`), and run a job script beside the
generation they share (`scripts/overbrainer_generate.py`) with a token limit
and a seed, every layer on the GPU when there is one, else on `cpu_threads`
threads. Each writes `answers.jsonl` and `metrics.jsonl` (one `log` event per
answer).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from overbrainer_prefect.runs.store import Runs
from overbrainer_prefect.trainers.base import JobContext, TrainerBase, TrainError
from overbrainer_prefect.trainers.staging import SCRIPTS_DIR, copy_job_script, stage_stored

ANSWERS_FILE = "answers.jsonl"
MODELS_DIR = "models"
GENERATE_MODULE = "overbrainer_generate"
"""The generation the compare and evaluation jobs share, a sibling of their scripts."""
LLAMA_MODULES = ("llama_cpp",)
"""What a GGUF job imports (llama-cpp-python; numpy comes with it)."""

MAX_TOKENS_LIMIT = 8192  # the most tokens an answer may be given: more is a typo, not a compare


class GgufRef(BaseModel):
    """A GGUF a compare or an evaluation uses: where it is under the runs
    directory, its size and SHA-256, and the export that made it."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(description="Relative to the runs directory.")
    size: int = Field(ge=0)
    sha256: str
    export_id: str


class GgufAsk(BaseModel):
    """How a GGUF job asks and of which models: what a compare's spec and an
    evaluation's plan both hold."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: int = Field(ge=1, le=MAX_TOKENS_LIMIT)
    seed: int
    quant: str
    base_model: str = Field(description="The base model the run fine-tuned.")
    tuned: GgufRef
    base: GgufRef = Field(description="The model the tuned one is measured against.")


class GgufJobTrainer(TrainerBase):
    """The part of a compare or an evaluation trainer that asks `ask`'s GGUFs,
    found in the runs directory `runs`, with the job script `script`.
    `cpu_threads` sets llama.cpp's threads on a target without a GPU; on one
    with a GPU every layer is offloaded to it.

    Raises TrainError when `cpu_threads` is below 1.
    """

    modules: Sequence[str] = LLAMA_MODULES
    script: str
    """The job script's module, under `overbrainer_prefect/jobs/`."""

    def __init__(self, ask: GgufAsk, runs: Runs, cpu_threads: int | None = None) -> None:
        if cpu_threads is not None and cpu_threads < 1:
            raise TrainError(f"cpu_threads is {cpu_threads}: give 1 or more, or leave it unset")
        self.ask = ask
        self.runs = runs.top
        self.cpu_threads = cpu_threads

    def stage(self, local_run_dir: Path) -> Path:
        """Stages both GGUFs under `models/` (from the runs' store: hard links
        from a local one, fetched by the job from an object store) and the job
        scripts under `scripts/`; returns `models/`.

        Raises TrainError when a GGUF is missing.
        """
        models = local_run_dir / MODELS_DIR
        models.mkdir(parents=True, exist_ok=True)
        for name, ref in (("base", self.ask.base), ("tuned", self.ask.tuned)):
            where = self.runs.store.where(ref.path)
            missing = (
                f"the {name} GGUF {where} is missing: export it again (export {ref.export_id})"
            )
            dest = f"{MODELS_DIR}/{name}.gguf"
            stage_stored(self.runs, ref.path, local_run_dir, dest, ref.size, ref.sha256, missing)
        copy_job_script(local_run_dir, GENERATE_MODULE)
        copy_job_script(local_run_dir, self.script)
        return models

    def commands(self, ctx: JobContext) -> list[list[str]]:
        """The job script with its token limit and seed, every layer on the GPU
        when there is one, else `cpu_threads` threads."""
        command = [ctx.facts.python, f"{SCRIPTS_DIR}/{self.script}.py"]
        command += ["--max-tokens", str(self.ask.max_tokens), "--seed", str(self.ask.seed)]
        if ctx.facts.gpus > 0:
            command += ["--gpu-layers", "-1"]
        elif self.cpu_threads is not None:
            command += ["--threads", str(self.cpu_threads)]
        return [command]

    def env(self, ctx: JobContext) -> dict[str, str]:
        """No telemetry, unbuffered output, and the threads of a CPU target."""
        env = {"DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1"}
        if ctx.facts.gpus == 0 and self.cpu_threads is not None:
            env["OMP_NUM_THREADS"] = str(self.cpu_threads)
        return env
