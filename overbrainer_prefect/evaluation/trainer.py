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

from pathlib import Path

from overbrainer_prefect.evaluation.results import RESULTS_FILE, job_inputs
from overbrainer_prefect.evaluation.spec import EvaluationPlan
from overbrainer_prefect.runs.store import Runs
from overbrainer_prefect.trainers.base import METRICS_FILE, Artifacts, JobContext, TrainError
from overbrainer_prefect.trainers.gguf_job import ANSWERS_FILE, GgufJobTrainer
from overbrainer_prefect.trainers.staging import link_or_copy

EVALUATION = "evaluation"
"""The kind of an evaluation's record: `runs/<run-id>/evaluations/<id>/evaluation.json`."""

EVALUATE_MODULE = "overbrainer_evaluate"
INPUTS_FILE = "inputs.json"


class EvaluateTrainer(GgufJobTrainer):
    """An evaluation following `plan`, whose GGUFs are under the runs directory
    `runs` (the judge GGUF, if any, where the plan says). `cpu_threads` sets
    llama.cpp's threads on a target without a GPU; on one with a GPU every layer
    is offloaded to it.

    Raises TrainError when `cpu_threads` is below 1."""

    name = EVALUATION
    script = EVALUATE_MODULE

    def __init__(self, plan: EvaluationPlan, runs: Runs, cpu_threads: int | None = None) -> None:
        super().__init__(plan, runs, cpu_threads)
        self.plan = plan

    def prepare(self, local_run_dir: Path, ctx: JobContext) -> None:
        """Stages both GGUFs (and the judge's) under `models/` (hard links when they
        can be), the items in `inputs.json` and the job scripts under `scripts/`.

        Raises TrainError when a GGUF is missing.
        """
        models = self.stage(local_run_dir)
        judge = self.plan.judge_model
        if judge is not None:
            source = Path(judge.path)
            if not source.is_file():
                raise TrainError(f"the judge GGUF {source} is missing: give the judge's GGUF")
            link_or_copy(source, models / "judge.gguf")
        (local_run_dir / INPUTS_FILE).write_text(job_inputs(self.plan), encoding="utf-8")

    def artifacts(self) -> Artifacts:
        """The results, the answers and the metrics (never the GGUFs it was given); a
        succeeded evaluation must have its results."""
        return Artifacts(entries=(RESULTS_FILE, ANSWERS_FILE, METRICS_FILE), required=RESULTS_FILE)
