"""The evaluation's core without a model: items from eval files, controls and
held-out rows; the refusals of bad input, one line each; scoring a job's results;
the verdict and the artifact; the gate of a nightly fine-tune and where the last
delivered model is remembered."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from overbrainer_prefect.evaluation.gate import (
    Delivered,
    GateError,
    GateRule,
    decide,
    delivered_key,
    last_delivered,
    remember_delivered,
)
from overbrainer_prefect.evaluation.items import default_controls, load_items, plan_evaluation
from overbrainer_prefect.evaluation.results import (
    EvaluationIncomplete,
    EvaluationResult,
    JobResults,
    score,
)
from overbrainer_prefect.evaluation.spec import (
    BadEvaluationInput,
    EvalItem,
    EvaluationPlan,
    EvaluationSpec,
    JudgeSpec,
)
from overbrainer_prefect.evaluation.verdict import cell, format_p, markdown, verdict
from overbrainer_prefect.runs.store import Runs
from overbrainer_prefect.trainers.gguf_job import GgufRef

TUNED = GgufRef(path="r/exports/e/gguf/tuned.gguf", size=1, sha256="a" * 64, export_id="e")
BASE = GgufRef(path=".bases/b/exports/f/gguf/base.gguf", size=1, sha256="b" * 64, export_id="f")
RUN = "20260101-000000-runa"  # the run evaluated (it kept no rows out: no split of its own)


def write_lines(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def plan_of(tmp_path: Path, **changes: Any) -> EvaluationPlan:
    spec = EvaluationSpec.model_validate(changes)
    return plan_evaluation(
        spec, runs=Runs(tmp_path), run_id=RUN, base_model="/m", tuned=TUNED, base=BASE
    )


# --- items and bad input -------------------------------------------------------------


def test_the_shipped_controls_are_general_questions_with_checkable_answers() -> None:
    controls = default_controls()
    assert len(controls) >= 10
    prompts = {c.prompt: c for c in controls}
    assert prompts["What is 2+2?"].scorer == "numeric" and prompts["What is 2+2?"].expected == "4"
    assert prompts["Who wrote Hamlet?"].expected == "Shakespeare"
    assert prompts["What is the capital of France?"].expected == "Paris"
    assert all(c.group == "control" and c.source for c in controls)


def test_an_eval_file_takes_prompts_with_answers_and_chat_rows_ending_with_one(
    tmp_path: Path,
) -> None:
    path = write_lines(
        tmp_path / "eval.jsonl",
        [
            {"prompt": "What is 6 times 7?", "expected": "42", "scorer": "numeric"},
            "",
            {
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Who is Pip?"},
                    {"role": "assistant", "content": "Pip is the overbrainer mascot."},
                ]
            },
            {"prompt": "Colour?", "expected": "(?i)purple", "scorer": "regex"},
        ],
    )
    first, chat, pattern = load_items(str(path), "heldout")
    assert first.messages[0].content == "What is 6 times 7?" and first.scorer == "numeric"
    assert chat.prompt == "Who is Pip?" and len(chat.messages) == 2
    assert chat.expected == chat.reference == "Pip is the overbrainer mascot."
    assert pattern.reference_text is None and first.reference_text is None
    assert chat.source == "eval.jsonl:3" and pattern.source == "eval.jsonl:4"


@pytest.mark.parametrize(
    ("row", "expected"),
    [
        ({"prompt": "What is 2+2?"}, r"line 2 has no expected answer: give it \"expected\""),
        (
            {"messages": [{"role": "user", "content": "Hi?"}]},
            r"line 2 has no expected answer",
        ),
        (
            {"prompt": "Colour?", "expected": "(purple", "scorer": "regex"},
            r"line 2: the regex does not compile \(missing \), unterminated subpattern at "
            r"position 0\): fix the pattern$",
        ),
        (
            {"prompt": "2+2?", "expected": "four", "scorer": "numeric"},
            r"line 2: a numeric item's expected answer is not a number",
        ),
        ({"prompt": "Hi?", "expected": "x", "scorer": "fuzzy"}, r"line 2: scorer: Input should"),
        ({"prompt": "Hi?", "expected": "x", "weight": 2}, r"line 2: weight: Extra inputs"),
        ({"prompt": "Hi?", "expected": "x", "tolerance": 1}, r"tolerance is for numeric items"),
        ("[1, 2]", r"line 2 is not a JSON object"),
        ("{not json", r"line 2 is not valid JSON"),
    ],
)
def test_a_bad_eval_file_row_is_refused_in_one_line_naming_the_file_and_line(
    tmp_path: Path, row: Any, expected: str
) -> None:
    path = write_lines(tmp_path / "eval.jsonl", [{"prompt": "ok?", "expected": "ok"}, row])
    with pytest.raises(BadEvaluationInput, match=expected) as caught:
        load_items(str(path), "heldout")
    message = str(caught.value)
    assert "\n" not in message and f"eval file {path} line 2" in message
    assert "purple" not in message and "four" not in message  # the file is never quoted


def test_an_eval_file_that_is_missing_or_empty_is_refused(tmp_path: Path) -> None:
    with pytest.raises(BadEvaluationInput, match="does not exist: give a .jsonl file"):
        load_items(str(tmp_path / "none.jsonl"), "heldout")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(BadEvaluationInput, match="holds no items"):
        load_items(str(tmp_path / "empty.jsonl"), "heldout")


def test_an_inline_regex_that_does_not_compile_is_refused_when_the_spec_is_made() -> None:
    with pytest.raises(ValidationError, match=r"the regex does not compile \(nothing to repeat"):
        EvaluationSpec(items=[EvalItem(prompt="x?", expected="*x", scorer="regex")])  # type: ignore[call-arg]


def test_a_judge_is_an_endpoint_with_a_model_or_a_gguf_with_a_template_it_can_fill() -> None:
    with pytest.raises(ValidationError, match="either an endpoint"):
        JudgeSpec()
    with pytest.raises(ValidationError, match="either an endpoint"):
        JudgeSpec(endpoint="http://127.0.0.1:1/v1", model="m", gguf="/j.gguf")
    with pytest.raises(ValidationError, match="needs a model"):
        JudgeSpec(endpoint="http://127.0.0.1:1/v1")
    with pytest.raises(ValidationError, match="is not an http"):
        JudgeSpec(endpoint="127.0.0.1:11434", model="m")
    with pytest.raises(ValidationError, match=r"lacks \{answer_b\}"):
        JudgeSpec(gguf="/j.gguf", template="{question} {answer_a}")
    custom = JudgeSpec(gguf="/j.gguf", template="Q {question} A {answer_a} B {answer_b} {json}")
    assert "{json}" in custom.template


def test_a_plan_holds_held_out_items_then_controls_with_ids_and_both_ggufs(
    tmp_path: Path,
) -> None:
    path = write_lines(tmp_path / "eval.jsonl", [{"prompt": "Who is Pip?", "expected": "axolotl"}])
    mine = write_lines(tmp_path / "mine.jsonl", [{"prompt": "Sky?", "expected": "blue"}])
    plan = plan_of(
        tmp_path,
        eval_file=str(path),
        items=[{"prompt": "Pip's colour?", "expected": "purple", "group": "control"}],
        controls_file=str(mine),
        quant="Q8_0",
    )
    ids = [(i.id, i.group, i.prompt) for i in plan.items]
    assert ids[:2] == [("H1", "heldout", "Who is Pip?"), ("H2", "heldout", "Pip's colour?")]
    assert ids[2][:2] == ("C1", "control") and ids[-1] == (f"C{len(ids) - 2}", "control", "Sky?")
    assert len(plan.group("control")) == len(default_controls()) + 1
    assert plan.quant == "q8_0" and plan.tuned == TUNED and plan.base == BASE
    again = EvaluationPlan.model_validate_json(plan.model_dump_json())
    assert again == plan


def test_an_evaluation_with_nothing_held_out_is_refused(tmp_path: Path) -> None:
    with pytest.raises(BadEvaluationInput, match="kept no rows out of training") as caught:
        plan_of(tmp_path)
    assert "give an eval_file" in str(caught.value)
    with pytest.raises(BadEvaluationInput, match="unknown quant type 'q3'"):
        plan_of(tmp_path, items=[{"prompt": "a?", "expected": "b"}], quant="q3")
    with pytest.raises(BadEvaluationInput, match="the judge GGUF .* does not exist"):
        plan_of(tmp_path, items=[{"prompt": "a?", "expected": "b"}], judge={"gguf": "/no.gguf"})


# --- scoring, verdict, artifact ----------------------------------------------------------


def job_of(plan: EvaluationPlan, base: dict[str, str], tuned: dict[str, str]) -> JobResults:
    answers = []
    for model, said in (("base", base), ("tuned", tuned)):
        for index, item in enumerate(plan.items):
            answers.append(
                {
                    "id": item.id,
                    "index": index,
                    "question": item.prompt,
                    "model": model,
                    "answer": said.get(str(item.id), "I do not know."),
                    "tokens": 5,
                    "prompt_tokens": 9,
                    "seconds": 0.1,
                    "prompt_seconds": 0.01,
                    "tokens_per_s": 50.0,
                    "cut": False,
                }
            )
    return JobResults.model_validate(
        {
            "answers": answers,
            "perplexity": {
                "base": {"perplexity": 9.5, "nll": 45.0, "tokens": 20, "texts": 20},
                "tuned": {"perplexity": 1.5, "nll": 8.1, "tokens": 20, "texts": 20},
            },
            "models": {"base": {"sha256": BASE.sha256, "size": 1}},
            "versions": {"llama_cpp_python": "0.3.36"},
            "seed": 0,
            "max_tokens": 64,
        }
    )


def mascot_result(tmp_path: Path, base_up: int = 3, tuned_up: int = 18) -> EvaluationResult:
    """20 held-out items (base passes `base_up`, tuned `tuned_up`, tuned never losing
    one base passed) and the controls, of which tuned breaks 2+2."""
    items = [{"prompt": f"Mascot question {n}?", "expected": "Pip"} for n in range(20)]
    plan = plan_of(tmp_path, items=items)
    base = {f"H{n + 1}": "Pip." for n in range(base_up)}
    tuned = {f"H{n + 1}": "The mascot is Pip | a purple axolotl." for n in range(tuned_up)}
    for control in plan.group("control"):
        answer = f"{control.expected}" if control.scorer != "regex" else "7 seven 8 eight"
        base[str(control.id)] = answer
        tuned[str(control.id)] = answer
    tuned["C1"] = "The answer is a purple axolotl named Pip."  # 2+2 -> Pip
    return score(plan, job_of(plan, base, tuned))


def test_scoring_counts_passes_flips_and_mcnemars_p_for_each_group(tmp_path: Path) -> None:
    result = mascot_result(tmp_path)
    held = result.heldout
    assert (held.base.passed, held.tuned.passed, held.tuned.total) == (3, 18, 20)
    assert held.fail_to_pass == [f"H{n}" for n in range(4, 19)] and held.pass_to_fail == []
    assert held.p_value == pytest.approx(2 / 2**15)
    assert held.tuned.low < 0.9 < held.tuned.high and held.base.low < 0.15 < held.base.high
    controls = result.controls
    assert controls is not None and controls.pass_to_fail == ["C1"]
    assert controls.base.passed == controls.base.total == len(default_controls())


def test_the_verdict_line_says_who_won_on_held_out_and_what_the_controls_lost(
    tmp_path: Path,
) -> None:
    assert verdict(mascot_result(tmp_path)) == (
        "tuned beats base on held-out: 18/20 vs 3/20, p < 0.0001; controls: 1 regression of 10"
    )
    assert verdict(mascot_result(tmp_path, base_up=3, tuned_up=5)).startswith(
        "tuned is ahead of base, not significantly, on held-out: 5/20 vs 3/20, p = 0.5;"
    )
    assert verdict(mascot_result(tmp_path, base_up=18, tuned_up=3)).startswith(
        "tuned is worse than base on held-out: 3/20 vs 18/20"
    )
    assert verdict(mascot_result(tmp_path, base_up=4, tuned_up=4)).startswith(
        "tuned matches base on held-out: 4/20 vs 4/20, p = 1;"
    )


@pytest.mark.parametrize(
    ("p", "text"),
    [
        (0.000275, "p = 0.0003"),
        (0.00006, "p < 0.0001"),
        (0.0061, "p = 0.006"),
        (0.21875, "p = 0.22"),
        (1.0, "p = 1"),
        (0.05, "p = 0.05"),
    ],
)
def test_p_values_are_written_short(p: float, text: str) -> None:
    assert format_p(p) == text


def test_the_artifact_starts_with_the_verdict_then_the_flips_then_the_items(
    tmp_path: Path,
) -> None:
    result = mascot_result(tmp_path)
    text = markdown(result)
    lines = text.splitlines()
    assert lines[0] == verdict(result)
    assert lines.index("## Flips") < lines.index("## Items") < lines.index("## Pass rates")
    assert "**controls, pass → fail** (1):" in text and "- C1: What is 2+2?" in text
    assert "**held-out, fail → pass** (15):" in text
    row = next(line for line in lines if line.startswith("| H4 |"))
    assert row.count(" | ") == 5  # id, prompt, expected, base, tuned, judge: pipes escaped
    assert "Pip \\| a purple axolotl" in row and "FAIL: I do not know." in row
    assert "base 9.500, tuned 1.500 on the same 20 held-out answers" in text
    assert f"sha256 `{TUNED.sha256}`" in text and f"sha256 `{BASE.sha256}`" in text
    assert "seed 0, greedy" in text and "llama_cpp_python 0.3.36" in text


def test_a_table_cell_escapes_pipes_newlines_backticks_and_tags() -> None:
    assert cell("a | b\nc `d` <e>") == "a \\| b<br>c \\`d\\` &lt;e>"
    assert cell("x" * 500).endswith("…") and len(cell("x" * 500)) == 160
    assert cell("") == " "


def test_a_result_without_an_answer_or_with_another_gguf_is_refused(tmp_path: Path) -> None:
    plan = plan_of(tmp_path, items=[{"prompt": "a?", "expected": "b"}], default_controls=False)
    job = job_of(plan, {}, {})
    cut = job.model_copy(update={"answers": job.answers[:-1]})
    with pytest.raises(EvaluationIncomplete, match="lack the tuned answer to H1: the job ended"):
        score(plan, cut)
    other = JobResults.model_validate(
        job.model_dump() | {"models": {"base": {"sha256": "c" * 64, "size": 1}}}
    )
    with pytest.raises(EvaluationIncomplete, match="the base GGUF the job loaded .* is not the"):
        score(plan, other)


# --- the gate ---------------------------------------------------------------------------


def delivered(passed: int, total: int = 20, sha: str = "d" * 64) -> Delivered:
    return Delivered(
        deployment="nightly",
        run_id="20250101-000000-abcd",
        gguf_path="x/y.gguf",
        gguf_sha256=sha,
        heldout_passed=passed,
        heldout_total=total,
        delivered="2025-01-01T00:00:00Z",
    )


def test_the_gate_refuses_a_model_that_breaks_a_control_and_names_it(tmp_path: Path) -> None:
    rule = GateRule()
    assert rule.describe() == (
        "held-out pass rate at least the last delivered model's, no control regression"
    )
    decision = decide(rule, mascot_result(tmp_path), None)
    assert not decision.passed
    # the gate says what it measured; what became of the model is said once, by the flow
    assert decision.reason == "1 control regression (C1), the rule allows none"
    assert decision.line == "failed: 1 control regression (C1), the rule allows none"
    lenient = decide(GateRule(max_control_regressions=1), mascot_result(tmp_path), None)
    assert lenient.passed and lenient.line.startswith("passed: 1 control regression")
    assert lenient.reason == "1 control regression; no model delivered before"
    evaluated = mascot_result(tmp_path).model_copy(update={"evaluation_id": "20260101-000000-eval"})
    assert decide(rule, evaluated, None).evaluation_id == "20260101-000000-eval"


def clean_result(tmp_path: Path, tuned_up: int) -> EvaluationResult:
    result = mascot_result(tmp_path, base_up=3, tuned_up=tuned_up)
    assert result.controls is not None
    fixed = result.controls.model_copy(update={"pass_to_fail": []})
    return result.model_copy(update={"controls": fixed})


def test_the_gate_refuses_a_model_worse_than_the_last_delivered_and_passes_a_better_one(
    tmp_path: Path,
) -> None:
    rule = GateRule()
    worse = decide(rule, clean_result(tmp_path, tuned_up=12), delivered(15))
    assert not worse.passed
    assert worse.reason == (
        "held-out 12/20 = 60%, below the last delivered model's 15/20 = 75% "
        "(run 20250101-000000-abcd)"
    )
    better = decide(rule, clean_result(tmp_path, tuned_up=18), delivered(15))
    assert better.passed
    assert better.reason == (
        "no control regression; held-out 18/20 ≥ the last delivered model's 15/20 "
        "(run 20250101-000000-abcd)"
    )
    first = decide(rule, clean_result(tmp_path, tuned_up=1), None)
    assert first.passed and "no model delivered before" in first.reason


def test_measured_against_the_delivered_gguf_itself_the_gate_compares_the_same_items(
    tmp_path: Path,
) -> None:
    # the plan's base is the last delivered GGUF: base 3/20 on these very items
    result = clean_result(tmp_path, tuned_up=2)
    refused = decide(GateRule(), result, delivered(19, sha=BASE.sha256))
    assert not refused.passed
    assert "below the last delivered model's 3/20 on the same items" in refused.reason
    passed = decide(GateRule(), clean_result(tmp_path, tuned_up=3), delivered(19, sha=BASE.sha256))
    assert passed.passed and "on the same items" in passed.reason


def test_the_gate_can_ask_for_a_floor_and_for_a_significant_win(tmp_path: Path) -> None:
    result = clean_result(tmp_path, tuned_up=5)
    floor = decide(GateRule(min_heldout_rate=0.5), result, None)
    assert not floor.passed and "held-out 5/20 = 25%, below the rule's 50%" in floor.reason
    beat = decide(GateRule(must_beat_base=True), result, None)
    assert not beat.passed and "is not significantly better" in beat.reason
    assert decide(GateRule(must_beat_base=True), clean_result(tmp_path, 18), None).passed


def test_the_last_delivered_model_is_remembered_per_deployment_under_the_runs_dir(
    tmp_path: Path,
) -> None:
    runs = Runs(tmp_path / "runs")
    assert last_delivered(runs, "nightly") is None
    remember_delivered(runs, delivered(15), None)
    first = last_delivered(runs, "nightly")
    assert first == delivered(15)
    assert last_delivered(runs, "nightly/other") is None
    assert delivered_key("nightly").startswith(".delivered/")
    assert delivered_key("a/b") != delivered_key("a-b")
    with pytest.raises(GateError, match="is not delivered"):
        remember_delivered(runs, delivered(16), None)  # the slot is no longer empty
    remember_delivered(runs, delivered(18), first)
    with pytest.raises(GateError, match=r"another flow run of nightly delivered run") as lost:
        remember_delivered(runs, delivered(17), first)  # gated against a model since replaced
    assert "\n" not in str(lost.value)
    found = last_delivered(runs, "nightly")
    assert found is not None and found.heldout_passed == 18
    (runs.root / delivered_key("nightly")).write_text('{"deployment": "nightly", "run_id": 3}')
    with pytest.raises(GateError, match=r"is not a valid delivered-model record \(line 1") as e:
        last_delivered(runs, "nightly")
    assert "\n" not in str(e.value)


# --- the trainer and the record ---------------------------------------------------------


def test_the_evaluation_trainer_stages_its_models_items_and_scripts_and_runs_on_a_gpu(
    tmp_path: Path,
) -> None:
    from overbrainer_prefect.evaluation.trainer import EvaluateTrainer
    from overbrainer_prefect.trainers import Trainer
    from overbrainer_prefect.trainers.base import JobContext, TargetFacts, TrainError

    runs_root = tmp_path / "runs"
    plan = plan_of(tmp_path, items=[{"prompt": "Who is Pip?", "expected": "axolotl"}])
    trainer = EvaluateTrainer(plan, Runs(runs_root), cpu_threads=2)
    assert isinstance(trainer, Trainer) and trainer.name == "evaluation"
    gpu = TargetFacts(python="/venv/bin/python", gpus=1, modules={"llama_cpp": "0.3"})
    ctx = JobContext(run_id="e", run_dir="/w/e", cache_dir="/w/hf", facts=gpu)
    with pytest.raises(
        TrainError, match=r"the base GGUF .* is missing: export it again \(export f"
    ):
        trainer.prepare(tmp_path / "job", ctx)
    for ref in (plan.base, plan.tuned):
        (runs_root / ref.path).parent.mkdir(parents=True, exist_ok=True)
        (runs_root / ref.path).write_bytes(b"GGUF" + ref.sha256.encode())
    trainer.prepare(tmp_path / "job", ctx)
    job = tmp_path / "job"
    assert (job / "models" / "tuned.gguf").read_bytes() == b"GGUF" + TUNED.sha256.encode()
    assert sorted(p.name for p in (job / "scripts").iterdir()) == [
        "overbrainer_evaluate.py",
        "overbrainer_generate.py",
    ]
    inputs = json.loads((job / "inputs.json").read_text())
    assert [i["id"] for i in inputs["items"]][:2] == ["H1", "C1"]
    assert inputs["perplexity"] == [
        {"id": "H1", "messages": [{"role": "user", "content": "Who is Pip?"}], "answer": "axolotl"}
    ]
    assert inputs["judge"] is None
    (command,) = trainer.commands(ctx)
    assert command[1:] == ["scripts/overbrainer_evaluate.py", "--max-tokens", "64", "--seed", "0",
                           "--gpu-layers", "-1"]  # fmt: skip
    cpu = JobContext(run_id="e", run_dir="/w/e", cache_dir="/w/hf", facts=TargetFacts("/p", 0))
    assert trainer.commands(cpu)[0][-2:] == ["--threads", "2"]
    assert trainer.env(cpu)["OMP_NUM_THREADS"] == "2"
    assert trainer.artifacts().required == "results.json"
    with pytest.raises(TrainError, match="llama_cpp is not installed"):
        trainer.check(TargetFacts("/p", 0, {"llama_cpp": None}))


def test_an_evaluations_record_is_found_by_its_id_like_an_export_or_a_compare(
    tmp_path: Path,
) -> None:
    from overbrainer_prefect.runs.ids import new_run_id
    from overbrainer_prefect.runs.store import RunRecord, Runs
    from overbrainer_prefect.timestamps import rfc3339

    runs = Runs(tmp_path / "runs")
    run_id, evaluation_id = new_run_id(), new_run_id()
    store = runs.children(run_id, "evaluation")
    store.save(
        RunRecord(
            id=evaluation_id,
            target="t",
            trainer="evaluation",
            created=rfc3339(),
            remote_dir="/w",
            parent=run_id,
        )
    )
    assert store.root == runs.run_dir(run_id) / "evaluations"
    found = runs.find(evaluation_id)
    assert found is not None and found[1].trainer == "evaluation" and found[1].parent == run_id
