"""The evaluation job end to end: the tiny model's base and tuned q8_0 GGUFs (the
compare tests' fine-tune, trained and exported once for the module by the real
flows) evaluated by the real job script, run directly with the job venv's
Python in a directory its trainer prepared: both models' answers (the very
answers the compare gave: the two jobs share their generation), the scores, the
perplexity (checked against llama-cpp-python's own log-softmax), a judge
GGUF asked both orders, the metrics, and the refusal of an item too long."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from overbrainer_prefect.evaluation.items import plan_evaluation
from overbrainer_prefect.evaluation.results import (
    EvaluationResult,
    JobResults,
    read_job_results,
    score,
)
from overbrainer_prefect.evaluation.scorers import normalise
from overbrainer_prefect.evaluation.spec import EvalItem, EvaluationPlan, EvaluationSpec
from overbrainer_prefect.evaluation.trainer import EvaluateTrainer
from overbrainer_prefect.evaluation.verdict import markdown, verdict
from overbrainer_prefect.runs import Runs
from overbrainer_prefect.trainers.base import JobContext, TargetFacts
from overbrainer_prefect.trainers.compare import CompareSpec, read_answers
from tests.test_compare import MAX_TOKENS, QUESTIONS, Trained, trained  # noqa: F401

JOB_TIMEOUT_S = 300.0  # two tiny GGUFs, a dozen short answers, a judge: seconds alone
JOB_ID = "20260101-000000-evjb"  # the directory the evaluation job runs in

# Perplexity by llama-cpp-python's own log-softmax (`Llama.logits_to_logprobs`), each
# answer token's log-probability read from the row before it, the prompt tokenized
# from its ChatML text without a BOS (as llama-cpp-python's chat formatter renders it).
PPL_REFERENCE = """
import json, math, sys
import llama_cpp
path, texts = sys.argv[1], json.loads(sys.argv[2])
llm = llama_cpp.Llama(model_path=path, n_ctx=256, n_threads=1, seed=0, logits_all=True,
                      verbose=False)
nll, count = 0.0, 0
for prompt_text, answer_text in texts:
    prompt = llm.tokenize(prompt_text.encode(), add_bos=False, special=True)
    tokens = prompt + llm.tokenize(answer_text.encode(), add_bos=False, special=False)
    llm.reset()
    llm.eval(tokens)
    logprobs = llama_cpp.Llama.logits_to_logprobs(llm.scores[: len(tokens)])
    for i in range(len(prompt), len(tokens)):
        nll -= float(logprobs[i - 1][tokens[i]])
        count += 1
print(json.dumps({"perplexity": math.exp(nll / count), "tokens": count}))
"""


@dataclass
class Evaluated:
    """The module's evaluation: its plan, its directory, the job's results, scored."""

    trained: Trained
    plan: EvaluationPlan
    job_dir: Path
    job: JobResults
    result: EvaluationResult
    compare_answers: dict[tuple[str, str], str]
    eval_rows: list[dict[str, object]]


def run_job(
    trainer: EvaluateTrainer, job_dir: Path, python: str
) -> subprocess.CompletedProcess[str]:
    """Prepares `job_dir` with `trainer` and runs its commands there, as a target would."""
    ctx = JobContext(
        run_id="e1",
        run_dir=str(job_dir),
        cache_dir=str(job_dir.parent / "hf"),
        facts=TargetFacts(python=python, gpus=0, modules={"llama_cpp": "0.3"}),
    )
    trainer.check(ctx.facts)
    trainer.prepare(job_dir, ctx)
    (command,) = trainer.commands(ctx)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **trainer.env(ctx)}
    return subprocess.run(
        command,
        cwd=job_dir,
        env=env,
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT_S,
        check=False,
    )


@pytest.fixture(scope="module")
def evaluated(
    trained: Trained,  # noqa: F811
    tiny: tuple[Path, Path],
    job_python: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Evaluated:
    """Evaluates the compare's GGUFs: the compare's questions (each expecting the
    tuned model's compare answer, exactly), three rows of the training data (from
    an eval file, with their answers for the perplexity), two controls, and the
    base GGUF as a judge run on the target."""
    root = tmp_path_factory.mktemp("evaluate")
    runs = Runs(trained.runs_dir)
    (record,) = [r for r in trained.compares() if r.id == trained.first.compare_id]
    stored = CompareSpec.model_validate(record.spec)
    local = runs.children(trained.run_id, "compare").run_dir(record.id)
    compare_answers = {
        (a.question, a.model): a.answer for a in read_answers((local / "answers.jsonl").read_text())
    }
    rows = [json.loads(line) for line in tiny[1].read_text().splitlines()[:3]]
    eval_file = root / "eval.jsonl"
    eval_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = EvaluationSpec(
        eval_file=str(eval_file),
        items=[
            EvalItem(prompt=q, expected=compare_answers[(q, "tuned")], scorer="exact")  # type: ignore[call-arg]
            for q in QUESTIONS
        ],
        default_controls=False,
        controls=[
            EvalItem(prompt="Say anything.", expected=".*", scorer="regex"),  # type: ignore[call-arg]
            EvalItem(prompt="What is 2+2?", expected="4", scorer="numeric", tolerance=0.5),  # type: ignore[call-arg]
        ],
        judge={  # type: ignore[arg-type]
            "gguf": str(trained.runs_dir / stored.base.path),
            "max_tokens": 4,
            "template": "{question} A: {answer_a} B: {answer_b} A or B?",  # the tiny context
        },
        max_tokens=MAX_TOKENS,
        quant="q8_0",
    )
    plan = plan_evaluation(
        spec,
        runs=runs,
        run_id=trained.run_id,
        base_model=stored.base_model,
        tuned=stored.tuned,
        base=stored.base,
    )
    job_dir = root / JOB_ID
    done = run_job(
        EvaluateTrainer(plan, Runs(trained.runs_dir.absolute()), cpu_threads=1),
        job_dir,
        job_python,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    job = read_job_results(Runs(root), JOB_ID)
    return Evaluated(trained, plan, job_dir, job, score(plan, job), compare_answers, rows)


@pytest.mark.slow
def test_the_evaluation_job_answers_every_item_with_both_models_as_the_compare_does(
    evaluated: Evaluated,
) -> None:
    plan, job = evaluated.plan, evaluated.job
    assert [(a.model, a.id) for a in job.answers] == [
        (model, item.id) for model in ("base", "tuned") for item in plan.items
    ]
    for answer in job.answers:
        assert answer.template and answer.prompt_tokens > 5
    # the same generation as the compare's: the same answers, byte for byte
    for n, question in enumerate(QUESTIONS, start=4):  # H1-H3: the eval file's rows
        for model in ("base", "tuned"):
            (mine,) = [a for a in job.answers if a.id == f"H{n}" and a.model == model]
            assert mine.question == question
            assert mine.answer == evaluated.compare_answers[(question, model)]
    # the job loaded exactly the planned GGUFs and says what it ran with
    assert job.models["base"].sha256 == plan.base.sha256
    assert job.models["tuned"].sha256 == plan.tuned.sha256
    assert job.seed == plan.seed and job.max_tokens == MAX_TOKENS
    assert job.versions["llama_cpp_python"] and job.versions["python"]
    assert not (evaluated.job_dir / "models").exists()  # the copies are removed at the end


@pytest.mark.slow
def test_the_results_are_scored_item_by_item_into_rates_flips_and_a_verdict(
    evaluated: Evaluated,
) -> None:
    result = evaluated.result
    by_id = {item.id: item for item in result.items}
    for n, question in enumerate(QUESTIONS, start=4):  # H1-H3: the eval file's rows
        item = by_id[f"H{n}"]
        assert item.prompt == question and item.tuned_pass  # its own compare answer
        base = evaluated.compare_answers[(question, "base")]
        assert item.base_pass == (normalise(base) == normalise(item.expected))
    controls = result.controls
    assert controls is not None and controls.base.total == 2
    assert by_id["C1"].base_pass and by_id["C1"].tuned_pass  # `.*` passes anything
    assert result.heldout.tuned.passed >= 2 and result.heldout.tuned.total == 5
    line = verdict(result)
    assert line.startswith("tuned ") and "on held-out: " in line and "controls: " in line
    text = markdown(result)
    assert text.splitlines()[0] == line and evaluated.plan.tuned.sha256 in text


@pytest.mark.slow
def test_perplexity_is_measured_on_the_same_held_out_answers_for_both_models(
    evaluated: Evaluated, job_python: str
) -> None:
    ppl = evaluated.job.perplexity
    assert ppl is not None and set(ppl) == {"base", "tuned"}
    held = evaluated.plan.group("heldout")  # 3 eval-file rows and the 2 compare questions
    assert ppl["base"].tokens == ppl["tuned"].tokens and ppl["base"].texts == len(held) == 5
    assert ppl["base"].perplexity != ppl["tuned"].perplexity
    assert ppl["tuned"].perplexity < ppl["base"].perplexity  # it was trained on H1-H3
    # the same numbers, computed by llama-cpp-python's log-softmax from the ChatML text
    texts = [
        (
            "".join(f"<|im_start|>{m.role}\n{m.content}<|im_end|>\n" for m in item.messages)
            + "<|im_start|>assistant\n",
            item.reference_text,
        )
        for item in held
    ]
    runs_root = evaluated.trained.runs_dir.absolute()
    for model, ref in (("base", evaluated.plan.base), ("tuned", evaluated.plan.tuned)):
        done = subprocess.run(
            [job_python, "-c", PPL_REFERENCE, str(runs_root / ref.path), json.dumps(texts)],
            capture_output=True,
            text=True,
            timeout=JOB_TIMEOUT_S,
            check=True,
        )
        slow = json.loads(done.stdout)
        assert slow["tokens"] == ppl[model].tokens
        assert ppl[model].perplexity == pytest.approx(slow["perplexity"], rel=1e-5), model
    assert ppl["base"].perplexity > 1 and ppl["tuned"].perplexity > 1


@pytest.mark.slow
def test_a_judge_gguf_on_the_target_is_asked_both_orders_of_every_held_out_item(
    evaluated: Evaluated,
) -> None:
    calls = evaluated.job.judge
    assert calls is not None
    held = [str(i.id) for i in evaluated.plan.group("heldout")]
    assert sorted((c.item, c.order) for c in calls) == sorted(
        (i, o) for i in held for o in ("base_first", "tuned_first")
    )
    assert evaluated.job.models["judge"].sha256 == evaluated.plan.base.sha256


@pytest.mark.slow
def test_the_metrics_count_every_answer_text_and_judge_call(evaluated: Evaluated) -> None:
    events = [
        json.loads(line) for line in (evaluated.job_dir / "metrics.jsonl").read_text().splitlines()
    ]
    kinds = [e["event"] for e in events]
    assert kinds[0] == "begin" and kinds[-1] == "end" and kinds.count("model") == 2
    steps = [e["step"] for e in events if e["event"] == "log"]
    items = len(evaluated.plan.items)
    held = len(evaluated.plan.group("heldout"))
    total = 2 * items + 2 + 2 * held
    assert steps == list(range(1, total + 1))
    assert {e["max_steps"] for e in events if e["event"] == "log"} == {total}
    answers = (evaluated.job_dir / "answers.jsonl").read_text().splitlines()
    assert len(answers) == 2 * items


@pytest.mark.slow
def test_an_item_too_long_for_the_models_context_fails_the_job_naming_it(
    evaluated: Evaluated, job_python: str, tmp_path: Path
) -> None:
    long_item = EvalItem(prompt="why " * 400, expected="x")  # type: ignore[call-arg]
    plan = evaluated.plan.model_copy(
        update={"items": [*evaluated.plan.items[:1], long_item.model_copy(update={"id": "H9"})]}
    )
    trainer = EvaluateTrainer(plan, Runs(evaluated.trained.runs_dir.absolute()), cpu_threads=1)
    done = run_job(trainer, tmp_path / "job", job_python)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith(
        "evaluate failed: item 2 is "
    ) and done.stderr.strip().endswith("context holds 256: shorten it")
    assert not (tmp_path / "job" / "results.json").exists()
