"""The evaluate flow: did the fine-tune help, and what did it break.

The shipped GGUFs of the run and of its base model (same quant) answer the
run's held-out items and the controls on the target, as one more job of the
driver (on a pod of its own on Runpod); the answers are retrieved and
verified, scored here (so a scoring can be redone from the files), and shown
in an artifact whose first line is the verdict. The result is recorded under
the run (`runs/R/evaluations/E/`), with the SHA-256 of both models and
everything needed to repeat it.
"""

from __future__ import annotations

import asyncio

from prefect import flow, get_run_logger
from prefect.artifacts import acreate_markdown_artifact

from overbrainer_prefect.blocks import target_named
from overbrainer_prefect.driver import HOOKS, follow_again, run_new
from overbrainer_prefect.evaluation.items import plan_evaluation
from overbrainer_prefect.evaluation.judge import check_judge_endpoint
from overbrainer_prefect.evaluation.results import (
    SCORED_FILE,
    EvaluationResult,
    score_retrieved,
)
from overbrainer_prefect.evaluation.spec import EvaluationPlan, EvaluationSpec
from overbrainer_prefect.evaluation.trainer import EvaluateTrainer
from overbrainer_prefect.evaluation.verdict import markdown, verdict
from overbrainer_prefect.flows.compare import export_base
from overbrainer_prefect.flows.results import AnyState, ended
from overbrainer_prefect.kinds.compare import check_comparable, gguf_job, gguf_need
from overbrainer_prefect.kinds.evaluation import NAME as EVALUATION
from overbrainer_prefect.runs.store import Runs, subject
from overbrainer_prefect.runs_dir import runs_at
from overbrainer_prefect.steps.context import Outcome
from overbrainer_prefect.trainers.export import check_quant


async def finish_evaluation(
    runs: Runs, store: Runs, outcome: Outcome, *, cancelling: bool = False
) -> EvaluationResult | AnyState:
    """Scores the retrieved answers of an ended evaluation and records the
    result beside them (`evaluation.results.score_retrieved`), publishes the
    artifact (verdict first) and logs the verdict. A failed evaluation fails
    the flow with its job's cause; a cancelled one cancels it."""
    record = outcome.record
    returned = ended(record, None, cancelling=cancelling)
    if returned is not None:
        return returned
    plan = EvaluationPlan.model_validate(record.spec)
    result = await asyncio.to_thread(score_retrieved, store, plan, record.id)
    line = verdict(result)
    get_run_logger().info(
        "%s: %s (in %s)", subject(record), line, store.where_of(record.id, SCORED_FILE)
    )
    await acreate_markdown_artifact(
        markdown=markdown(result), key=f"evaluation-{record.id}".lower(), description=line[:500]
    )
    return result


@flow(name="evaluate", persist_result=True, **HOOKS)
async def evaluate(
    run_id: str,
    evaluation: EvaluationSpec | None = None,
    target: str | None = None,
    runs_dir: str | None = None,
    evaluation_id: str | None = None,
    image: str | None = None,
) -> EvaluationResult | AnyState:
    """Evaluates run `run_id`'s shipped GGUF against its base model's (same
    quant, llama.cpp, temperature 0, fixed seed) on the run's target or on
    `target`: the held-out rows the run kept out of training and/or an eval
    file's items, and the controls (the shipped set and the user's), scored
    exact / contains / regex / numeric, optionally judged pairwise in both
    orders; pass rates with their intervals, the flips, McNemar's exact test
    and held-out perplexity. With `evaluation_id`, follows that evaluation again.

    Fails with one line, before anything runs, for an eval row missing its
    expected answer, a regex that does not compile, a judge endpoint that does
    not answer, no held-out item, or a run without a succeeded export of the
    quant; with the evaluation's cause when its job fails.
    """
    runs = await runs_at(runs_dir)
    logger = get_run_logger()
    store = runs.children(run_id, EVALUATION)
    if evaluation_id is not None:
        finished = await follow_again(runs, store, store.load(evaluation_id), logger)
        return await finish_evaluation(runs, store, finished.outcome)
    spec = evaluation or EvaluationSpec()
    if spec.judge is not None:
        check_judge_endpoint(spec.judge)
    quant = check_quant(spec.quant)
    run, tuned, base = check_comparable(runs, run_id, quant)
    # every input checked before anything runs (the base's GGUF stands in for now)
    plan_evaluation(spec, runs=runs, run_id=run_id, base_model=base, tuned=tuned, base=tuned)
    place = await target_named(target or run.target, logger)
    need = gguf_need(f"the evaluation of run {run_id}", tuned, image)
    place.check(need)
    base_ref = await export_base(runs, base, quant, place, logger)
    plan = plan_evaluation(
        spec, runs=runs, run_id=run_id, base_model=base, tuned=tuned, base=base_ref
    )
    logger.info(
        "run %s: %d items (%d held-out) to its base model and its fine-tune (%s) on %s",
        run_id,
        len(plan.items),
        sum(1 for item in plan.items if item.group == "heldout"),
        quant,
        place.ref,
    )
    trainer = EvaluateTrainer(plan, runs, cpu_threads=place.cpu_threads)
    job = gguf_job(store, need, EVALUATION, trainer, plan.model_dump(mode="json"), run_id)
    finished = await run_new(place, job, logger)
    return await finish_evaluation(runs, store, finished.outcome)
