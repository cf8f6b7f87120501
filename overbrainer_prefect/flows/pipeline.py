"""The `fine_tune` pipeline: train, then export, then compare, as one flow.

Each step is its own flow (`train`, `export`, `compare`), run as a subflow, so
each shows in the Prefect UI as a flow run of its own, linked to the pipeline's.
Every step is recorded by its own flow (`run.json`, `export.json`,
`compare.json`), so a pipeline that stopped at a step is continued by another
`fine_tune` of the same run (`run_id`): what finished is reused from its records,
not done again, and the step that failed is taken up where it was.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, TypeVar

from prefect import flow, get_run_logger
from prefect.client.schemas.objects import State
from prefect.runtime import deployment

from overbrainer_prefect.delivery.result import DeliveryResult
from overbrainer_prefect.driver import HOOKS
from overbrainer_prefect.evaluation.gate import (
    Delivered,
    GateError,
    decide,
    forget_delivered,
    last_delivered,
    remember_delivered,
)
from overbrainer_prefect.evaluation.verdict import verdict
from overbrainer_prefect.finetune import (
    DeliverSettings,
    FineTuneResult,
    FineTuneSpec,
    PipelineFailed,
    kept_text,
)
from overbrainer_prefect.flows.compare import compare
from overbrainer_prefect.flows.deliver import deliver
from overbrainer_prefect.flows.evaluate import evaluate
from overbrainer_prefect.flows.export import export
from overbrainer_prefect.flows.gate import not_delivered
from overbrainer_prefect.flows.nightly import begin_night, end_night
from overbrainer_prefect.flows.train import attach, train
from overbrainer_prefect.kinds import compare as compare_kind
from overbrainer_prefect.kinds import export as export_kind
from overbrainer_prefect.kinds import training as training_kind
from overbrainer_prefect.kinds.compare import running_compare
from overbrainer_prefect.kinds.export import running
from overbrainer_prefect.kinds.training import RunResult
from overbrainer_prefect.nightly.prepared import PREPARE_TIMEOUT_S
from overbrainer_prefect.pipeline_summary import publish_pipeline_summary
from overbrainer_prefect.runs.store import RunRecord, Runs, RunState
from overbrainer_prefect.runs_dir import runs_at
from overbrainer_prefect.server_budget import budget_bounds_pods
from overbrainer_prefect.suspension import suspended_job, why_not_suspend
from overbrainer_prefect.targets.sharing import after_training, shared
from overbrainer_prefect.targets.spend import run_spent, spent
from overbrainer_prefect.trainers.compare import check_max_tokens, load_questions

T = TypeVar("T")


async def _train_step(
    spec: FineTuneSpec, runs: Runs, run: RunRecord | None
) -> tuple[str | None, RunResult | State[Any] | None]:
    """The training step: a succeeded run is reused (returns its ID and None), a
    running one followed again (attach), a stopped one resumed (a new run), a
    failed one trained again (a new run); without a run, a new one is trained."""
    logger = get_run_logger()
    if run is not None and run.state == RunState.SUCCEEDED:
        logger.info("run %s succeeded on %s: reused, not trained again", run.id, run.ended)
        return run.id, None
    if run is not None and run.state == RunState.RUNNING and run.job is not None:
        if suspended_job(runs, training_kind.NAME, -1) == run.id:
            # resumed by its follower shortly before the training's end: the training
            # step waits for the follower to record it, as this flow run started it
            return None, await train.fn(
                target=spec.target, training=spec.training, runs_dir=spec.runs_dir
            )
        logger.info("run %s was left running: following it again", run.id)
        return run.id, await attach(run_id=run.id, runs_dir=spec.runs_dir)
    if run is not None and run.state == RunState.STOPPED:
        logger.info("run %s stopped: resuming it from its checkpoint in a new run", run.id)
        result = await train(target=spec.target, resume_from=run.id, runs_dir=spec.runs_dir)
        return None, result
    if run is not None:
        logger.info("run %s is %s: training again, in a new run", run.id, run.state)
    if run is None and (
        suspended_job(runs, training_kind.NAME) is not None  # its trainings, found again
        or why_not_suspend(runs, budget_held=await budget_bounds_pods()) is None
    ):
        # in this flow run, not a subflow of its own, so that this flow run waits
        # suspended while the job trains (Prefect cannot suspend a subflow alone)
        return None, await train.fn(
            target=spec.target, training=spec.training, runs_dir=spec.runs_dir
        )
    result = await train(target=spec.target, training=spec.training, runs_dir=spec.runs_dir)
    return None, result


def _trained_before_suspending(runs: Runs) -> RunRecord | None:
    """The run this flow run trained before it suspended (it was resumed),
    when it succeeded or still runs: the pipeline goes on from it (its pod
    found again while it lives). None otherwise: a failed one is followed
    again by the training step in this flow run, which says why, or goes on
    from its last checkpoint when its machine was lost."""
    waited = suspended_job(runs, training_kind.NAME, -1)
    if waited is None:
        return None
    run = runs.load(waited)
    return run if run.state in (RunState.SUCCEEDED, RunState.RUNNING) else None


class _Ended(Exception):
    """A step's subflow ended in a state of its own (cancelled): so does the pipeline."""

    def __init__(self, state: State[Any]) -> None:
        super().__init__(state.name)
        self.state = state


async def _step(what: str, kept: str, subflow: Awaitable[T | State[Any]]) -> T:
    """The result of one step's subflow. Raises PipelineFailed (the step, its
    error, what was kept and how to continue) when it fails, `_Ended` when it
    ended in a state of its own."""
    try:
        result = await subflow
    except Exception as error:
        raise PipelineFailed(f"the fine-tune stopped at {what}: {error}; {kept}") from None
    if isinstance(result, State):
        raise _Ended(result)
    return result


@flow(name="fine-tune", persist_result=True, **HOOKS)
async def fine_tune(
    spec: FineTuneSpec,
    run_id: str | None = None,
    prepare: str | None = None,
    force: bool = False,
    prepare_timeout_s: float = PREPARE_TIMEOUT_S,
) -> FineTuneResult | State[Any]:
    """Fine-tunes a model, exports it to a GGUF and compares its answers with its base
    model's: the `train`, `export` and `compare` flows run in turn as subflows on
    `spec.target`, each its own flow run linked to this one.

    With `run_id`, continues the pipeline of that run: a succeeded run is not
    trained again, a succeeded export of the same quant is reused, a succeeded
    compare of the same questions and settings is reused, and a step left running
    is followed again.

    First, `prepare` (a saved prefect-shell `ShellOperation` block) runs on the
    worker and the files its output names (`OVERBRAINER_DATASET=<path>`,
    `OVERBRAINER_EVAL=<path>` lines) become the datasets and eval file; then what
    would be trained is fingerprinted, and when it equals the last delivered
    model's of this deployment, the flow run ends `Completed`, "nothing changed
    since run R (delivered DATE): nothing trained", unless `force`.

    Fails with one line, before anything starts, for a prepare that fails, runs
    past `prepare_timeout_s`, names no file or a file with no rows, for bad
    questions (none, not a list of strings, both a list and a file) or an
    unknown run; fails with the message of the step that failed, what was kept,
    and how to continue.
    """
    try:
        return await _fine_tune(spec, run_id, prepare, force, prepare_timeout_s)
    except _Ended as ended:
        return ended.state


async def _fine_tune(
    spec: FineTuneSpec,
    run_id: str | None,
    prepare: str | None,
    force: bool,
    prepare_timeout_s: float,
) -> FineTuneResult | State[Any]:
    runs = await runs_at(spec.runs_dir)
    questions = load_questions(spec.compare.questions, spec.compare.questions_file)
    check_max_tokens(spec.compare.max_tokens)
    run = runs.load(run_id) if run_id is not None else _trained_before_suspending(runs)
    night = await begin_night(
        spec.training,
        spec.export,
        spec.evaluation,
        runs,
        _deployment_name(),
        prepare=prepare,
        force=force,
        resumed=run is not None,
        prepare_timeout_s=prepare_timeout_s,
    )
    if night.skipped is not None:
        return night.skipped  # nothing changed since the last delivered model
    spec = spec.model_copy(update={"training": night.training, "evaluation": night.evaluation})
    logger = get_run_logger()
    reused: list[str] = []

    later = after_training(
        spec.training, spec.export, spec.compare.image, spec.evaluation is not None
    )
    async with shared(later, (runs, run.id) if run else None):  # one pod
        try:
            trained_id, trained = await _train_step(spec, runs, run)
        except Exception as error:
            raise PipelineFailed(f"the fine-tune stopped at training: {error}") from None
        if isinstance(trained, State):
            return trained  # the training was cancelled: so is the pipeline
        if trained is None:
            reused.append(training_kind.NAME)
        run_result = trained if isinstance(trained, RunResult) else None
        run_id = trained_id or (run_result.run_id if run_result else None)
        if run_id is None or (run_result is not None and run_result.state != RunState.SUCCEEDED):
            state = run_result.state if run_result else "unknown"
            raise PipelineFailed(
                f"the fine-tune stopped at training: run {run_id} is {state}; "
                f"{kept_text(runs, None, None)}"
            )

        quant = spec.export.quant
        left = running(export_kind.KIND.store(runs, run_id), quant)
        exported = await _step(
            "the export",
            kept_text(runs, run_id, None),
            export(
                run_id=run_id,
                quant=quant,
                target=spec.target,
                runs_dir=spec.runs_dir,
                export_id=left.id if left is not None else None,
                keep_intermediate=spec.export.keep_intermediate,
            ),
        )
        if exported.reused:
            reused.append(export_kind.NAME)

        settings = spec.compare
        kept = kept_text(runs, run_id, exported.export_id)
        left_compare = running_compare(
            compare_kind.KIND.store(runs, run_id),
            questions,
            settings.max_tokens,
            settings.seed,
            quant,
            exported.gguf.sha256 if exported.gguf is not None else "",
        )
        compared = await _step(
            "the compare",
            kept,
            compare(
                run_id=run_id,
                questions=questions,
                quant=quant,
                max_tokens=settings.max_tokens,
                seed=settings.seed,
                target=spec.target,
                runs_dir=spec.runs_dir,
                compare_id=left_compare.id if left_compare is not None else None,
                image=settings.image,
            ),
        )
        if compared.reused:
            reused.append(compare_kind.NAME)

        logger.info(
            "fine-tune of run %s%s: GGUF %s, answers in %s",
            run_id,
            f" (reused: {', '.join(reused)})" if reused else "",
            exported.gguf_path,
            compared.answers_path,
        )
        result = FineTuneResult(
            run_id=run_id,
            run=run_result,
            export=exported,
            compare=compared,
            reused=reused,
            next=compared.next,
            night=night.facts,
        )
        if spec.evaluation is not None:
            evaluated = await _step(
                "the evaluation",
                kept,
                evaluate(
                    run_id=run_id,
                    evaluation=spec.evaluation.model_copy(update={"quant": quant}),
                    target=spec.target,
                    runs_dir=spec.runs_dir,
                ),
            )
            result.evaluation, result.verdict = evaluated, verdict(evaluated)
            logger.info("run %s: %s", run_id, result.verdict)
    name = _deployment_name()
    last = last_delivered(runs, name) if result.evaluation is not None else None
    if spec.gate is not None and result.evaluation is not None:
        result.gate = decide(spec.gate, result.evaluation, last)
        logger.info("the gate (%s) %s", spec.gate.describe(), result.gate.line)
    if spec.deliver is not None and (result.gate is None or result.gate.passed):
        result.delivered = await _deliver(spec, runs, run_id, quant, result, name, kept, last)
        made = ", ".join(f"{d.destination} {d.name}" for d in result.delivered.deliveries)
        logger.info("run %s delivered: %s", run_id, made)
    await end_night(runs, night, run_id, result.delivered is not None, run is not None)
    await publish_pipeline_summary(
        result,
        runs,
        _links(result.delivered),
        spent(runs, runs.load(run_id)),
        run_spent(runs, run_id),  # what every pod of the fine-tune cost (issue 20)
    )
    if result.gate is not None and not result.gate.passed:
        return await not_delivered(runs, run_id, result.gate, _deliver_again(spec, run_id), result)
    return result


def _deployment_name() -> str:
    """The name the gate keys the last delivered model by: this flow run's
    deployment (`fine-tune/nightly`), or the flow's when it runs without one."""
    name = deployment.name
    return f"fine-tune/{name}" if name else "fine-tune"


async def _deliver(
    spec: FineTuneSpec,
    runs: Runs,
    run_id: str,
    quant: str,
    result: FineTuneResult,
    name: str,
    kept: str,
    last: Delivered | None,
) -> DeliveryResult:
    """Delivers the run (the `deliver` flow, as a subflow); after an evaluation,
    once it took its deployment's delivered-model slot from `last`, the model its
    gate measured it against (`remember_delivered`: one of two racing flow runs
    takes it), given back when the delivery fails."""
    settings, evaluated = spec.deliver, result.evaluation
    assert settings is not None
    taken: tuple[Delivered, str] | None = None
    if evaluated is not None:
        mine = Delivered.of(name, run_id, evaluated)
        try:
            taken = mine, remember_delivered(runs, mine, last)
        except GateError as error:
            stopped = f"the fine-tune stopped at the delivery: {error}; {kept}"
            raise PipelineFailed(stopped) from None
    try:
        delivered = await deliver(
            run_id=run_id,
            ollama=settings.ollama,
            model_name=settings.model_name,
            hub_repo=settings.hub_repo,
            huggingface=settings.huggingface,
            private=settings.private,
            quant=quant,
            runs_dir=spec.runs_dir,
            evaluation_id=evaluated.evaluation_id if evaluated is not None else None,
        )
    except Exception as error:
        if taken is not None:
            forget_delivered(runs, *taken, last)
        raise PipelineFailed(f"the fine-tune stopped at the delivery: {error}; {kept}") from None
    return delivered


def _deliver_again(spec: FineTuneSpec, run_id: str) -> str:
    """The deliver flow's command that delivers run `run_id` where `spec` would have."""
    settings = spec.deliver or DeliverSettings()
    given = {"ollama": settings.ollama, "hub_repo": settings.hub_repo, "quant": spec.export.quant}
    params = ", ".join(f"{key}={value}" for key, value in given.items() if value is not None)
    return f"the deliver flow (run_id={run_id}, {params})"


def _links(delivered: DeliveryResult | None) -> list[tuple[str, str]] | None:
    if delivered is None:
        return None
    return [(f"{d.destination}: {d.name}", d.url) for d in delivered.deliveries]
