"""What a fine-tune asks and returns: the `fine_tune` flow's one parameter
(where it runs, what it trains, exports, asks, evaluates, gates and delivers)
and its result, and the words of a pipeline that stopped at a step."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from overbrainer_prefect.delivery.result import DEFAULT_HF_BLOCK, DeliveryResult
from overbrainer_prefect.evaluation.gate import (
    GateDecision,
    GateRule,
)
from overbrainer_prefect.evaluation.results import EvaluationResult
from overbrainer_prefect.evaluation.spec import EvaluationSpec
from overbrainer_prefect.kinds.compare import CompareResult
from overbrainer_prefect.kinds.export import ExportResult
from overbrainer_prefect.kinds.training import RunResult
from overbrainer_prefect.nightly.decision import NightFacts
from overbrainer_prefect.runs.store import Runs
from overbrainer_prefect.steps.errors import RunError
from overbrainer_prefect.trainers.compare import MAX_TOKENS_LIMIT
from overbrainer_prefect.trainers.export import ExportSpec
from overbrainer_prefect.trainers.spec import TrainingSpec


class CompareSettings(BaseModel):
    """What the compare step asks: the questions (a list, or a file holding a JSON or
    YAML list of strings), how long an answer may be, and the seed."""

    model_config = ConfigDict(extra="forbid")

    questions: list[str] = Field(default_factory=list, description="The questions to ask.")
    questions_file: str | None = Field(
        default=None, description="A file holding a JSON or YAML list of questions."
    )
    max_tokens: int = Field(
        default=128, ge=1, le=MAX_TOKENS_LIMIT, description="The most tokens of an answer."
    )
    seed: int = Field(default=0, description="The seed (answers are greedy, temperature 0).")
    image: str | None = Field(
        default=None,
        description="On a Runpod target: the Docker image of the compare's pod (default: the "
        "target's image).",
    )


class DeliverSettings(BaseModel):
    """Where a fine-tune that passes its gate is delivered (the `deliver` flow's
    parameters): an `OllamaServer` block and/or a Hub repository."""

    model_config = ConfigDict(extra="forbid")

    ollama: str | None = Field(default=None, description="The OllamaServer block to push to.")
    model_name: str | None = Field(default=None, description="The Ollama model's name.")
    hub_repo: str | None = Field(default=None, description="The Hub repository (owner/name).")
    huggingface: str = Field(
        default=DEFAULT_HF_BLOCK, description="The HuggingFaceCredentials block of the push."
    )
    private: bool = Field(default=True, description="A new Hub repository is private.")


class FineTuneSpec(BaseModel):
    """The whole fine-tune: where it runs, what it trains, what it exports and what
    it asks the base and tuned models (the `fine_tune` flow's one parameter)."""

    model_config = ConfigDict(extra="forbid")

    target: str = Field(description="The target block every step runs on.")
    training: TrainingSpec
    export: ExportSpec = Field(default_factory=ExportSpec)
    compare: CompareSettings = Field(default_factory=CompareSettings)
    evaluation: EvaluationSpec | None = Field(
        default=None,
        description="Evaluate the tuned GGUF against its base on held-out items and controls.",
    )
    gate: GateRule | None = Field(
        default=None,
        description="What the evaluation must show for the model to be delivered (needs "
        "`evaluation`); the last delivered model of this deployment is the reference.",
    )
    deliver: DeliverSettings | None = Field(
        default=None, description="Where the model goes once it passed its gate (if any)."
    )
    runs_dir: str | None = Field(
        default=None, description="The runs directory ($OVERBRAINER_RUNS_DIR, else ./runs)."
    )

    @field_validator("target")
    @classmethod
    def _target_named(cls, target: str) -> str:
        if not target.strip():
            raise ValueError("name the target block the fine-tune runs on")
        return target

    @model_validator(mode="after")
    def _gate_needs_evaluation(self) -> FineTuneSpec:
        if self.gate is not None and self.evaluation is None:
            raise ValueError("a gate needs an evaluation: set evaluation, or unset gate")
        return self


class FineTuneResult(BaseModel):
    """What the `fine_tune` flow returns (and Prefect persists): the run, its export
    and its compare, and which steps were reused from an earlier pipeline."""

    run_id: str
    run: RunResult | None = Field(
        default=None, description="The training step's result (None when the run was reused)."
    )
    export: ExportResult
    compare: CompareResult
    evaluation: EvaluationResult | None = None
    verdict: str | None = Field(default=None, description="The evaluation's verdict.")
    gate: GateDecision | None = Field(default=None, description="What the gate decided.")
    delivered: DeliveryResult | None = None
    reused: list[str] = Field(
        default_factory=list, description="The steps taken from their records, not done again."
    )
    next: str
    night: NightFacts | None = Field(
        default=None, description="The night's fingerprint and what changed since the last."
    )


class PipelineFailed(RunError):
    """A step of the pipeline failed; the message names the step, what was kept
    and how to continue."""


def kept_text(runs: Runs, run_id: str | None, export_id: str | None) -> str:
    """What a stopped pipeline kept (the run, its export) and how to continue it."""
    if run_id is None:
        return "nothing was kept: start a new fine_tune"
    kept = f"run {run_id} (succeeded, in {runs.where_of(run_id)})"
    if export_id is not None:
        kept += f" and its export {export_id}"
    return f"kept {kept}; continue with the fine_tune flow (run_id={run_id})"
