"""The compare flow: a run's GGUF and its base model's, asked the same questions.

The compare runs on a target like any job (the run's own target by default):
both GGUFs (the run's export, and its base model's, exported once per base
model, target and quant type and reused) are staged with the questions into
`runs/<run-id>/compares/<compare-id>/`, copied to the target, and asked there
by llama.cpp, greedily with a fixed seed; the answers are brought back and
checked against the target's SHA-256 manifest, and shown side by side in a
markdown artifact. Its record, `compare.json`, holds the questions, the seed and
both GGUFs' SHA-256, so a compare can be repeated exactly; a compare that
already succeeded with the same questions, settings, tuned GGUF and target is
reused, not asked again (`kinds/compare.py`).
"""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.artifacts import acreate_markdown_artifact

from overbrainer_prefect.blocks import target_named
from overbrainer_prefect.driver import HOOKS, follow_again, run_new
from overbrainer_prefect.flows.results import AnyState, ended
from overbrainer_prefect.kinds.base import Finished
from overbrainer_prefect.kinds.base_export import base_export_job, base_gguf, reused_base
from overbrainer_prefect.kinds.compare import NAME as COMPARE
from overbrainer_prefect.kinds.compare import (
    CompareFailed,
    CompareResult,
    answers_markdown,
    check_comparable,
    gguf_job,
    gguf_need,
    job_failure,
    plan_line,
    result_line,
    result_of,
    reused_compare,
)
from overbrainer_prefect.kinds.export import running
from overbrainer_prefect.runs.store import Runs, subject
from overbrainer_prefect.runs_dir import runs_at
from overbrainer_prefect.steps.context import Outcome
from overbrainer_prefect.steps.errors import RunError
from overbrainer_prefect.targets.base import Logger, Target
from overbrainer_prefect.trainers.base import TrainError
from overbrainer_prefect.trainers.compare import (
    CompareSpec,
    CompareTrainer,
    GgufRef,
    base_exports,
    base_key,
    check_max_tokens,
    load_questions,
)
from overbrainer_prefect.trainers.export import DEFAULT_QUANT, check_quant


async def publish_answers(compare_id: str, markdown: str) -> None:
    """The compare's answers side by side as a markdown artifact (`compare-<id>-answers`)."""
    await acreate_markdown_artifact(
        markdown=markdown,
        key=f"compare-{compare_id}-answers".lower(),
        description=f"Base and tuned answers of compare {compare_id}",
    )


async def export_base(runs: Runs, base: str, quant: str, place: Target, logger: Logger) -> GgufRef:
    """The base model's GGUF of type `quant`: a succeeded export of it reused, one
    left running followed again, else an export of the plain base model made on the
    target (converted and quantized like the run's; on a pod of its own on Runpod)
    and retrieved and verified into `<runs dir>/.bases/<key>/exports/<export-id>/`.

    Raises CompareFailed with one line when the export fails or its GGUF cannot be
    retrieved (compare again: a started export is followed again).
    """
    store = base_exports(runs, base_key(base, place.ref))
    ref = reused_base(runs, store, base, quant, logger)
    if ref is not None:
        return ref
    again = "compare again: it follows this export again, or makes a new one"
    left = running(store, quant)
    try:
        if left is not None:
            logger.info("%s was left running: following it again", subject(left))
            finished: Finished = await follow_again(runs, store, left, logger)
        else:
            logger.info(
                "the base model %s has no %s GGUF yet: exporting it on %s", base, quant, place.ref
            )
            job = base_export_job(store, base, quant, place.python, place.cpu_threads)
            finished = await run_new(place, job, logger)
    except (TrainError, RunError) as error:
        raise CompareFailed(
            f"the base model's export could not be made: {error}; {again}"
        ) from None
    return base_gguf(runs, store, finished.outcome, subject(finished.outcome.record), logger)


async def finish_compare(
    compares: Runs,
    outcome: Outcome,
    where: str,
    *,
    cancelling: bool = False,
) -> CompareResult | AnyState:
    """Publishes the answers side by side and turns the outcome into the flow's
    result: a failed compare fails the flow, a cancelled one cancels it."""
    record = outcome.record
    result = result_of(compares, record, outcome.files)
    await publish_answers(record.id, answers_markdown(result, where))
    why = job_failure(compares, record.id, "compare failed: ") if record.state.ended else None
    return ended(record, result, cancelling=cancelling, why=why, line=result_line(result, record))


@flow(name="compare", persist_result=True, **HOOKS)
async def compare(
    run_id: str,
    questions: list[str] | None = None,
    questions_file: str | None = None,
    quant: str = DEFAULT_QUANT,
    max_tokens: int = 128,
    seed: int = 0,
    target: str | None = None,
    runs_dir: str | None = None,
    compare_id: str | None = None,
    image: str | None = None,
) -> CompareResult | AnyState:
    """Asks the base model of run `run_id` and its fine-tune the same questions, side
    by side: the run's `quant` GGUF (from its export) and its base model's GGUF of
    the same type (exported once per base model, target and quant, and reused), on
    the run's target or on `target`, greedily (temperature 0) with `seed`, each
    answer at most `max_tokens` tokens, through each model's own chat template.
    The answers are retrieved and verified by SHA-256 into
    `runs/<run_id>/compares/<compare-id>/answers.jsonl` and shown side by side in
    a markdown artifact with their lengths and tokens/s.

    `questions` is a list of strings, or `questions_file` a file holding a JSON or
    YAML list of strings. A compare of the same questions, settings, tuned GGUF and
    target that already succeeded is returned as it is (`reused`). With
    `compare_id`, follows that compare again. On a Runpod target, the base
    model's export and the compare each run on a new pod of their own (with
    `image` as the compare pod's Docker image when given), deleted once their
    files are verified.

    Fails with one line, before anything is created, without questions, with
    questions that are not a list of strings, an unknown quant type, or a run
    without a succeeded export of that quant; fails with the compare's message
    when its job fails (a question longer than the model's context, a GGUF
    llama.cpp cannot load).
    """
    runs = await runs_at(runs_dir)
    logger = get_run_logger()
    compares = runs.children(run_id, COMPARE)
    if compare_id is not None:
        finished = await follow_again(runs, compares, compares.load(compare_id), logger)
        return await finish_compare(compares, finished.outcome, finished.where)
    asked = load_questions(questions, questions_file)
    check_max_tokens(max_tokens)
    quant = check_quant(quant)
    run, tuned, base = check_comparable(runs, run_id, quant)
    place = await target_named(target or run.target, logger)
    reused = reused_compare(compares, run_id, asked, max_tokens, seed, quant, tuned, place.ref)
    if reused is not None:
        done, result = reused
        logger.info(
            "reused %s, which asked the same %d questions of the same GGUF on %s: nothing "
            "asked again",
            subject(done),
            len(asked),
            done.ended,
        )
        await publish_answers(done.id, answers_markdown(result, place.ref))
        logger.info("%s", result_line(result, done))
        return result
    need = gguf_need(f"the compare of run {run_id}", tuned, image)
    place.check(need)  # a wrong image fails here, before any base export
    logger.info("%s", plan_line(run_id, len(asked), quant, max_tokens, seed, place.ref, tuned))
    spec = CompareSpec(
        questions=asked,
        max_tokens=max_tokens,
        seed=seed,
        quant=quant,
        base_model=base,
        tuned=tuned,
        base=await export_base(runs, base, quant, place, logger),
    )
    trainer = CompareTrainer(spec, runs, cpu_threads=place.cpu_threads)
    job = gguf_job(compares, need, COMPARE, trainer, spec.model_dump(mode="json"), run_id)
    finished = await run_new(place, job, logger)
    return await finish_compare(compares, finished.outcome, finished.where)
