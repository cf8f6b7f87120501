"""The evaluation trainer: a fine-tune's GGUF and the one it is measured against,
asked an evaluation's items on a target.

An evaluation's directory (`runs/<run-id>/evaluations/<evaluation-id>/`, and its
copy on the target) holds what the job reads, with paths relative to it:

    models/base.gguf    the GGUF the tuned one is measured against (the base
                        model's, or the last delivered one), same quant type
    models/tuned.gguf   the run's GGUF, from its export
    models/judge.gguf   the judge GGUF, when the judge runs on the target
    inputs.json         the items, the held-out answers, the judge's template
    scripts/            the job script, `overbrainer_evaluate.py`, and the
                        generation it shares with the compare, `overbrainer_generate.py`

The job (see `overbrainer_prefect/jobs/overbrainer_evaluate.py`) writes
`answers.jsonl`, `metrics.jsonl` and, last, `results.json`, which is what an
evaluation brings back, verifies and scores (`evaluation.results.score`).
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

from overbrainer_prefect.evaluation.results import RESULTS_FILE, job_inputs
from overbrainer_prefect.evaluation.spec import EvaluationPlan
from overbrainer_prefect.trainers.base import (
    METRICS_FILE,
    Artifacts,
    JobContext,
    TargetFacts,
    TrainError,
)
from overbrainer_prefect.trainers.compare import (
    ANSWERS_FILE,
    COMPARE_MODULES,
    GENERATE_MODULE,
    MODELS_DIR,
    gguf_job_command,
    gguf_job_env,
)
from overbrainer_prefect.trainers.export import check_modules, copy_job_script

EVALUATION = "evaluation"
"""The kind of an evaluation's record: `runs/<run-id>/evaluations/<id>/evaluation.json`."""

EVALUATE_MODULE = "overbrainer_evaluate"
INPUTS_FILE = "inputs.json"
EVALUATE_MODULES = COMPARE_MODULES
"""What the evaluation job imports: llama_cpp (and numpy, which it depends on)."""


def _stage(source: Path, target: Path) -> None:
    target.unlink(missing_ok=True)
    try:
        target.hardlink_to(source)
    except OSError:
        shutil.copyfile(source, target)


class EvaluateTrainer:
    """An evaluation following `plan`, whose GGUFs are under the runs directory
    `runs_root` (the judge GGUF, if any, where the plan says). `cpu_threads` sets
    llama.cpp's threads on a target without a GPU; on one with a GPU every layer
    is offloaded to it."""

    def __init__(
        self, plan: EvaluationPlan, runs_root: Path, cpu_threads: int | None = None
    ) -> None:
        if cpu_threads is not None and cpu_threads < 1:
            raise TrainError(f"cpu_threads is {cpu_threads}: give 1 or more, or leave it unset")
        self.plan = plan
        self.runs_root = runs_root
        self.cpu_threads = cpu_threads

    @property
    def name(self) -> str:
        """`evaluation`."""
        return EVALUATION

    @property
    def metrics_file(self) -> str:
        """`metrics.jsonl`, written by the job script: one `log` event per answer."""
        return METRICS_FILE

    @property
    def probe_modules(self) -> Sequence[str]:
        """llama_cpp."""
        return EVALUATE_MODULES

    def check(self, facts: TargetFacts) -> None:
        """Raises TrainError when the job venv lacks llama-cpp-python."""
        check_modules(facts, self.probe_modules, "evaluation")

    def prepare(self, local_run_dir: Path, ctx: JobContext) -> None:
        """Stages both GGUFs (and the judge's) under `models/` (hard links when they
        can be), the items in `inputs.json` and the job scripts under `scripts/`.

        Raises TrainError when a GGUF is missing.
        """
        models = local_run_dir / MODELS_DIR
        models.mkdir(parents=True, exist_ok=True)
        for name, ref in (("base", self.plan.base), ("tuned", self.plan.tuned)):
            source = self.runs_root / ref.path
            if not source.is_file():
                raise TrainError(
                    f"the {name} GGUF {source} is missing: export it again (export {ref.export_id})"
                )
            _stage(source, models / f"{name}.gguf")
        judge = self.plan.judge_model
        if judge is not None:
            source = Path(judge.path)
            if not source.is_file():
                raise TrainError(f"the judge GGUF {source} is missing: give the judge's GGUF")
            _stage(source, models / "judge.gguf")
        (local_run_dir / INPUTS_FILE).write_text(job_inputs(self.plan), encoding="utf-8")
        copy_job_script(local_run_dir, GENERATE_MODULE)
        copy_job_script(local_run_dir, EVALUATE_MODULE)

    def commands(self, ctx: JobContext) -> list[list[str]]:
        """The job script with the token limit, the seed and where it runs."""
        plan = self.plan
        return [
            gguf_job_command(ctx, EVALUATE_MODULE, plan.max_tokens, plan.seed, self.cpu_threads)
        ]

    def env(self, ctx: JobContext) -> dict[str, str]:
        """No telemetry, unbuffered output, and the threads of a CPU target."""
        return gguf_job_env(ctx, self.cpu_threads)

    def artifacts(self) -> Artifacts:
        """The results, the answers and the metrics (never the GGUFs it was given); a
        succeeded evaluation must have its results."""
        return Artifacts(entries=(RESULTS_FILE, ANSWERS_FILE, METRICS_FILE), required=RESULTS_FILE)
