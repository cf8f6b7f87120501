"""The result of an evaluation: the job's raw output, scored against its plan.

The evaluation job writes `results.json` (see jobs/overbrainer_evaluate.py):
every answer of both models, their perplexity on the held-out answers, the
judge GGUF's replies when it ran one, the SHA-256 of the GGUFs it loaded and the
versions it ran with. `score` reads it with the plan into an
`EvaluationResult`: each item passed or failed by each model, each group's pass
rates with Wilson intervals, the items that flipped, McNemar's exact p, the
judge's outcome. Scoring happens here, not on the target, so it can be redone
from the files alone.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import httpx
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from overbrainer_prefect.evaluation.judge import JudgeCall, JudgeOutcome, OpenAIJudge, summarise
from overbrainer_prefect.evaluation.scorers import ScorerKind, passes
from overbrainer_prefect.evaluation.spec import EvalItem, EvaluationPlan, Group
from overbrainer_prefect.evaluation.stats import mcnemar_exact, wilson
from overbrainer_prefect.runs.store import Runs
from overbrainer_prefect.store.records import RecordError, record_bytes
from overbrainer_prefect.trainers.compare import ModelAnswer

RESULTS_FILE = "results.json"
"""What the evaluation job writes last, in its directory."""


class EvaluationIncomplete(ValueError):
    """An evaluation's results do not answer its plan. The message is one line."""


class ItemAnswer(ModelAnswer):
    """One answer of one model to one item, as the evaluation job wrote it."""

    id: str = Field(description="The item's id (H1, C1...).")


class Perplexity(BaseModel):
    """One model's perplexity on the held-out answers: exp of the mean negative
    log-likelihood of the answer tokens, each given its prompt."""

    model_config = ConfigDict(extra="forbid")

    perplexity: float = Field(gt=0)
    nll: float = Field(description="The summed negative log-likelihood, in nats.")
    tokens: int = Field(ge=1, description="The answer tokens scored.")
    texts: int = Field(ge=1, description="The held-out answers scored.")


class ModelFile(BaseModel):
    """A GGUF as the job loaded it on the target."""

    model_config = ConfigDict(extra="forbid")

    sha256: str
    size: int = Field(ge=0)


class JobResults(BaseModel):
    """`results.json`: what the evaluation job measured, unscored."""

    model_config = ConfigDict(extra="forbid")

    answers: list[ItemAnswer]
    perplexity: dict[str, Perplexity] | None = None
    judge: list[JudgeCall] | None = None
    judge_model: str | None = None
    models: dict[str, ModelFile] = Field(default_factory=dict)
    versions: dict[str, str] = Field(default_factory=dict)
    seed: int
    max_tokens: int


def read_job_results(store: Runs, evaluation_id: str) -> JobResults:
    """The job's `results.json` of the evaluation `evaluation_id`. Raises
    EvaluationIncomplete with one line when it is missing or not the job's shape."""
    path = store.where_of(evaluation_id, RESULTS_FILE)
    try:
        return JobResults.model_validate_json(store.read_bytes(evaluation_id, RESULTS_FILE))
    except FileNotFoundError:
        raise EvaluationIncomplete(f"no {path}: the evaluation job did not finish") from None
    except (RecordError, ValueError, ValidationError):
        raise EvaluationIncomplete(
            f"{path} is not an evaluation job's results: run the evaluation again"
        ) from None


class PassRate(BaseModel):
    """How many items of a group a model passed, with a Wilson interval."""

    model_config = ConfigDict(extra="forbid")

    passed: int = Field(ge=0)
    total: int = Field(ge=0)
    rate: float
    low: float
    high: float


class GroupResult(BaseModel):
    """Both models on one group of items: pass rates, flips, McNemar's p."""

    model_config = ConfigDict(extra="forbid")

    group: Group
    base: PassRate
    tuned: PassRate
    fail_to_pass: list[str] = Field(description="Items base failed and tuned passed.")
    pass_to_fail: list[str] = Field(description="Items base passed and tuned failed.")
    p_value: float = Field(description="McNemar's exact test on the paired outcomes.")


class ItemResult(BaseModel):
    """One item: both answers and whether each passed."""

    model_config = ConfigDict(extra="forbid")

    id: str
    group: Group
    prompt: str
    expected: str
    scorer: ScorerKind
    tolerance: float = 0.0
    source: str | None = None
    base_answer: str
    tuned_answer: str
    base_pass: bool
    tuned_pass: bool
    base_cut: bool = False
    tuned_cut: bool = False
    judge_score: float | None = Field(
        default=None, description="The judge's score of the tuned answer (1 better, 0 worse)."
    )


class EvaluationResult(BaseModel):
    """A scored evaluation: everything a verdict, an artifact or a gate needs, and
    the plan it repeats with."""

    model_config = ConfigDict(extra="forbid")

    plan: EvaluationPlan
    heldout: GroupResult
    controls: GroupResult | None = None
    items: list[ItemResult]
    perplexity: dict[str, Perplexity] | None = None
    judge: JudgeOutcome | None = None
    models: dict[str, ModelFile] = Field(default_factory=dict)
    versions: dict[str, str] = Field(default_factory=dict)
    evaluation_id: str | None = Field(
        default=None, description="The evaluation's record under its run (`evaluations/<id>/`)."
    )


def _rate(passed: int, total: int, confidence: float) -> PassRate:
    interval = wilson(passed, total, confidence)
    return PassRate(
        passed=passed,
        total=total,
        rate=passed / total if total else 0.0,
        low=interval.low,
        high=interval.high,
    )


def group_result(group: Group, items: Sequence[ItemResult], confidence: float) -> GroupResult:
    """Pass rates, flips and McNemar's p of `items` (all of one group)."""
    up = [i.id for i in items if i.tuned_pass and not i.base_pass]
    down = [i.id for i in items if i.base_pass and not i.tuned_pass]
    return GroupResult(
        group=group,
        base=_rate(sum(i.base_pass for i in items), len(items), confidence),
        tuned=_rate(sum(i.tuned_pass for i in items), len(items), confidence),
        fail_to_pass=up,
        pass_to_fail=down,
        p_value=mcnemar_exact(len(up), len(down)),
    )


def answers_by_item(plan: EvaluationPlan, job: JobResults) -> dict[str, dict[str, ItemAnswer]]:
    """The job's answers by item id and model. Raises EvaluationIncomplete naming
    the first item a model did not answer."""
    found: dict[str, dict[str, ItemAnswer]] = {}
    for answer in job.answers:
        found.setdefault(answer.id, {})[answer.model] = answer
    for item in plan.items:
        for model in ("base", "tuned"):
            if model not in found.get(str(item.id), {}):
                raise EvaluationIncomplete(
                    f"the evaluation's results lack the {model} answer to {item.id}: the job "
                    "ended early; run the evaluation again"
                )
    return found


def judge_pairs(plan: EvaluationPlan, job: JobResults) -> list[tuple[EvalItem, str, str]]:
    """What the judge is asked: each held-out item with its base and tuned answers.
    Raises EvaluationIncomplete when an answer is missing."""
    found = answers_by_item(plan, job)
    return [
        (item, found[str(item.id)]["base"].answer, found[str(item.id)]["tuned"].answer)
        for item in plan.group("heldout")
    ]


def score(
    plan: EvaluationPlan, job: JobResults, judge_calls: Sequence[JudgeCall] | None = None
) -> EvaluationResult:
    """The evaluation's result: `job` (the job's results.json) scored by `plan`, with
    the judge's calls (`judge_calls` from an endpoint judge, else the job's own).

    Raises EvaluationIncomplete with one line when an item lacks an answer, or a
    GGUF the job loaded is not the one planned (its SHA-256 differs)."""
    for name, ref in (("base", plan.base), ("tuned", plan.tuned)):
        loaded = job.models.get(name)
        if loaded is not None and loaded.sha256 != ref.sha256:
            raise EvaluationIncomplete(
                f"the {name} GGUF the job loaded (sha256 {loaded.sha256[:12]}) is not the one "
                f"planned ({ref.sha256[:12]}): run the evaluation again"
            )
    found = answers_by_item(plan, job)
    calls = list(judge_calls) if judge_calls is not None else list(job.judge or [])
    judge = None
    if plan.judge is not None and calls:
        name = plan.judge.model or job.judge_model or Path(plan.judge.gguf or "judge").name
        judge = summarise(calls, name)
    items = []
    for item in plan.items:
        base, tuned = found[str(item.id)]["base"], found[str(item.id)]["tuned"]
        items.append(
            ItemResult(
                id=str(item.id),
                group=item.group,
                prompt=item.prompt,
                expected=item.expected,
                scorer=item.scorer,
                tolerance=item.tolerance,
                source=item.source,
                base_answer=base.answer,
                tuned_answer=tuned.answer,
                base_pass=passes(item.scorer, base.answer, item.expected, item.tolerance),
                tuned_pass=passes(item.scorer, tuned.answer, item.expected, item.tolerance),
                base_cut=base.cut,
                tuned_cut=tuned.cut,
                judge_score=judge.scores.get(str(item.id)) if judge is not None else None,
            )
        )
    heldout = [i for i in items if i.group == "heldout"]
    controls = [i for i in items if i.group == "control"]
    return EvaluationResult(
        plan=plan,
        heldout=group_result("heldout", heldout, plan.confidence),
        controls=group_result("control", controls, plan.confidence) if controls else None,
        items=items,
        perplexity=job.perplexity,
        judge=judge,
        models=job.models,
        versions=job.versions,
    )


def job_inputs(plan: EvaluationPlan) -> str:
    """The evaluation job's `inputs.json`: the items' conversations, the held-out
    answers to measure perplexity on, and the judge's template when a judge GGUF
    runs on the target (see jobs/overbrainer_evaluate.py)."""
    items = [
        {
            "id": item.id,
            "messages": [m.model_dump() for m in item.messages],
            "group": item.group,
            "expected": item.reference_text or item.expected,
        }
        for item in plan.items
    ]
    perplexity = [
        {"id": item.id, "messages": [m.model_dump() for m in item.messages], "answer": text}
        for item in plan.group("heldout")
        if (text := item.reference_text)
    ]
    judge = None
    if plan.judge is not None and plan.judge_model is not None:
        judge = {
            "template": plan.judge.template,
            "max_tokens": plan.judge.max_tokens,
            "items": [str(item.id) for item in plan.group("heldout")],
        }
    document = {
        "items": items,
        "perplexity": perplexity if plan.perplexity else [],
        "judge": judge,
    }
    return json.dumps(document, ensure_ascii=False, indent=1) + "\n"


SCORED_FILE = "evaluation.json"
"""The scored result of an evaluation, beside its retrieved files (local only)."""


def score_retrieved(store: Runs, plan: EvaluationPlan, evaluation_id: str) -> EvaluationResult:
    """Scores the answers the evaluation `evaluation_id`'s job left in `store`
    (retrieved and verified), asking the plan's endpoint judge both orders
    here when it has one, and records the result beside them
    (`evaluation.json`). Raises EvaluationError (or the judge's error) with
    one line."""
    job = read_job_results(store, evaluation_id)
    calls = None
    if plan.judge is not None and plan.judge.endpoint is not None:
        with httpx.Client() as client:
            calls = OpenAIJudge(plan.judge, client).judge(judge_pairs(plan, job), plan.seed)
    result = score(plan, job, calls).model_copy(update={"evaluation_id": evaluation_id})
    try:
        store.write_bytes(evaluation_id, SCORED_FILE, record_bytes(result))
    except RecordError as error:
        raise EvaluationIncomplete(f"cannot record the result: {error}") from None
    return result
