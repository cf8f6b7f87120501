"""Compares: a real fine-tune of the tiny model (trained once for the session and
exported to q8_0 by the `train` flow, tests/tiny_runs.py) and its base model, both as q8_0 GGUFs,
asked the same questions by real llama.cpp on the local target through the
`compare` flow; the answers retrieved, verified and shown side by side. Also: the
base GGUF made once and reused, a compare reused, runaway generation cut and
marked, a question too long for the model failing the job, and the refusals
that start nothing."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

from overbrainer_prefect.flows import CompareResult, compare
from overbrainer_prefect.kinds.compare import NotComparable, answers_markdown
from overbrainer_prefect.runs import Runs, RunState
from overbrainer_prefect.runs.ids import new_run_id
from overbrainer_prefect.runs.store import BASES_DIR, RunRecord
from overbrainer_prefect.timestamps import rfc3339
from overbrainer_prefect.trainers.compare import (
    BadCompareInput,
    BadQuestions,
    CompareSpec,
    base_key,
    load_questions,
    read_answers,
    vram_floor,
)
from overbrainer_prefect.trainers.export import UnknownQuant
from tests.flowrun import run
from tests.tiny_runs import COMPARE_MAX_TOKENS, QUESTIONS, TinyCompared

MAX_TOKENS = COMPARE_MAX_TOKENS  # the tiny model never ends its answers: every one is cut


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@dataclass
class Trained:
    """The module's fine-tune, exported to q8_0, and its first compare."""

    target: str
    runs_dir: Path
    work: Path
    run_id: str
    first: CompareResult

    def compares(self) -> list[RunRecord]:
        return Runs(self.runs_dir).children(self.run_id, "compare").list()

    def base_exports(self) -> list[Path]:
        return sorted((self.runs_dir / BASES_DIR).glob("*/exports/*/export.json"))


@pytest.fixture(scope="module")
def trained(tiny_compared: TinyCompared) -> Trained:
    """The session's fine-tune of the tiny model (6 steps, exported to q8_0) and
    its first compare, shared with the evaluation tests (tests/tiny_runs.py)."""
    run = tiny_compared.run
    return Trained(run.target, run.runs_dir, run.work, run.run_id, tiny_compared.first)


def read_artifact(key: str) -> Any:
    async def go() -> Any:
        async with get_client() as client:
            found = await client.read_artifacts(
                artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key]))
            )
            return found[0] if found else None

    return run(go())


@pytest.mark.slow
def test_a_real_compare_answers_with_both_models_and_its_answers_are_verified(
    trained: Trained,
) -> None:
    result = trained.first
    assert result.state == RunState.SUCCEEDED and not result.reused
    assert result.target.endswith(trained.target) and result.quant == "q8_0"
    (record,) = trained.compares()
    assert record.id == result.compare_id and record.parent == trained.run_id
    assert record.trainer == "compare" and record.state == RunState.SUCCEEDED
    # answers.jsonl was retrieved and is exactly the manifest's
    local = Runs(trained.runs_dir).children(trained.run_id, "compare").run_dir(record.id)
    answers_file = local / "answers.jsonl"
    assert result.answers_path == str(answers_file)
    (entry,) = [f for f in result.files if f.path == "answers.jsonl"]
    assert sha256(answers_file) == entry.sha256 and answers_file.stat().st_size == entry.size
    assert {f.path for f in result.files} == {"answers.jsonl", "metrics.jsonl", "job.log"}
    lines = read_answers(answers_file.read_text())
    assert [(a.model, a.index) for a in lines] == [
        ("base", 0),
        ("base", 1),
        ("tuned", 0),
        ("tuned", 1),
    ]
    # both models answered each question, through the GGUF's chat template, with a speed
    assert [p.question for p in result.answers] == QUESTIONS
    for pair in result.answers:
        for answer in (pair.base, pair.tuned):
            assert answer is not None and answer.template
            assert answer.prompt_tokens > 5 and answer.tokens >= 1
            assert answer.tokens_per_s is not None and answer.tokens_per_s > 0
    assert result.mean_tokens_per_s("base") and result.mean_tokens_per_s("tuned")
    # the record says how to repeat it exactly: seed, questions, both GGUFs' SHA-256
    stored = CompareSpec.model_validate(record.spec)
    assert stored.seed == 0 and stored.questions == QUESTIONS and stored.max_tokens == MAX_TOKENS
    runs_root = trained.runs_dir.absolute()
    assert sha256(runs_root / stored.tuned.path) == stored.tuned.sha256
    assert sha256(runs_root / stored.base.path) == stored.base.sha256
    assert stored.tuned.sha256 != stored.base.sha256
    assert stored.tuned.path.startswith(f"{trained.run_id}/exports/")
    assert stored.base.path.startswith(f"{BASES_DIR}/")
    # the job ran in the target's compares dir with copies of the GGUFs, removed at its end
    remote = Path(record.remote_dir)
    assert remote.parent == trained.work / "compares"
    assert (remote / "questions.json").is_file() and (remote / "answers.jsonl").is_file()
    assert not (remote / "models").exists() and not (local / "models").exists()
    # the side-by-side artifact is on the server
    artifact = read_artifact(f"compare-{record.id}-answers")
    assert artifact is not None
    assert all(q in artifact.data for q in QUESTIONS)
    assert "| # | question | base | tuned |" in artifact.data and "tokens/s" in artifact.data
    assert stored.base.sha256 in artifact.data and stored.tuned.sha256 in artifact.data


@pytest.mark.slow
def test_runaway_generation_is_cut_at_the_limit_and_marked(trained: Trained) -> None:
    # the tiny model emits byte tokens and never its end token
    for pair in trained.first.answers:
        for answer in (pair.base, pair.tuned):
            assert answer is not None
            assert answer.cut and answer.tokens == MAX_TOKENS
    artifact = read_artifact(f"compare-{trained.first.compare_id}-answers")
    assert "cut at the token limit" in artifact.data and f"{MAX_TOKENS} (cut)" in artifact.data


@pytest.mark.slow
def test_the_base_gguf_is_exported_once_and_reused_by_the_next_compare(
    trained: Trained,
) -> None:
    before = trained.base_exports()
    assert len(before) == 1
    record = json.loads(before[0].read_text())
    assert record["state"] == "succeeded" and record["spec"]["quant"] == "q8_0"
    assert before[0].parent.parent.parent.name == base_key(
        record["spec"]["base_model"], trained.first.target
    )
    result = run(
        compare(
            run_id=trained.run_id,
            questions=["Hello?"],
            quant="q8_0",
            max_tokens=3,
            seed=7,
            runs_dir=str(trained.runs_dir),
        )
    )
    assert isinstance(result, CompareResult) and result.state == RunState.SUCCEEDED
    assert not result.reused and result.seed == 7
    assert trained.base_exports() == before
    assert result.base_gguf == trained.first.base_gguf
    assert all(p.base is not None and p.base.tokens == 3 for p in result.answers)


@pytest.mark.slow
def test_a_second_compare_of_the_same_questions_is_reused(trained: Trained) -> None:
    before = [r.id for r in trained.compares()]
    result = run(
        compare(
            run_id=trained.run_id,
            questions=QUESTIONS,
            quant="Q8_0",
            max_tokens=MAX_TOKENS,
            runs_dir=str(trained.runs_dir),
        )
    )
    assert isinstance(result, CompareResult) and result.reused
    assert result.compare_id == trained.first.compare_id
    assert result.answers == trained.first.answers
    assert [r.id for r in trained.compares()] == before


@pytest.mark.slow
def test_a_question_longer_than_the_models_context_fails_the_compare_job_naming_it(
    trained: Trained,
) -> None:
    too_long = "why " * 400  # the tiny model's context holds 256 tokens
    with pytest.raises(
        Exception,
        match=r"compare \S+ of run \S+ failed: the job exited with code 2 \(see \S+\): "
        r"question 2 is \d+ tokens through the base model's chat template, and its context "
        r"holds 256: shorten it$",
    ):
        run(
            compare(
                run_id=trained.run_id,
                questions=["Hi?", too_long],
                quant="q8_0",
                runs_dir=str(trained.runs_dir),
            )
        )
    failed = [r for r in trained.compares() if r.state == RunState.FAILED]
    assert len(failed) == 1
    assert f"runs/{trained.run_id}/compares/{failed[0].id}/job.log" in (failed[0].message or "")
    log = Runs(trained.runs_dir).children(trained.run_id, "compare").run_dir(failed[0].id)
    text = (log / "job.log").read_text()
    assert "question 2 is" in text and "context holds 256: shorten it" in text


@pytest.mark.slow
@pytest.mark.parametrize(
    ("changes", "error", "expected"),
    [
        ({"questions": []}, BadQuestions, r"^no questions: give questions=\[\.\.\.\]"),
        ({"questions": ["ok?", "  "]}, BadQuestions, r"^question 2 is empty"),
        ({"quant": "q3_k"}, UnknownQuant, r"'q3_k': use one of"),
        ({"quant": "f16"}, NotComparable, r"has no succeeded f16 export to compare: run the "),
        ({"max_tokens": 0}, BadCompareInput, r"^max_tokens is 0: give a number of tokens from 1"),
    ],
)
def test_bad_compare_input_is_refused_in_one_line_and_nothing_is_started(
    trained: Trained, changes: dict[str, Any], error: type[Exception], expected: str
) -> None:
    before = ([r.id for r in trained.compares()], trained.base_exports())
    arguments: dict[str, Any] = {
        "run_id": trained.run_id,
        "questions": ["Hi?"],
        "quant": "q8_0",
        "runs_dir": str(trained.runs_dir),
        **changes,
    }
    with pytest.raises(error, match=expected) as caught:
        run(compare(**arguments))
    assert "\n" not in str(caught.value)
    assert ([r.id for r in trained.compares()], trained.base_exports()) == before


def test_a_run_without_an_export_is_refused_and_nothing_is_created(
    prefect_server: None, tmp_path: Path
) -> None:
    runs = Runs(tmp_path / "runs")
    run_id = new_run_id()
    runs.save(
        RunRecord(
            id=run_id,
            target="overbrainer-local-target/nowhere",
            created=rfc3339(),
            remote_dir="/nowhere",
            state=RunState.SUCCEEDED,
        )
    )
    with pytest.raises(NotComparable, match=rf"run {run_id} has no succeeded q4_k_m export"):
        run(compare(run_id=run_id, questions=["Hi?"], runs_dir=str(runs.root)))
    assert sorted(p.name for p in runs.run_dir(run_id).iterdir()) == ["run.json"]
    assert not (runs.root / BASES_DIR).exists()


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("{not: [a list", r"is not valid JSON or YAML \(line 1\)"),
        ('{"q": "What?"}', r"is a dict, not a list: give a JSON or YAML list of strings"),
        ('["What?", 3]', r"item 2 is not a string"),
        ("[]", r"is empty: give"),
        ("", r"is empty: give"),
    ],
)
def test_a_questions_file_that_is_not_a_list_of_strings_is_refused_in_one_line(
    tmp_path: Path, content: str, expected: str
) -> None:
    path = tmp_path / "questions.yaml"
    path.write_text(content)
    with pytest.raises(BadQuestions, match=expected) as caught:
        load_questions(None, str(path))
    assert "\n" not in str(caught.value) and "What?" not in str(caught.value)


def test_questions_come_from_a_json_or_yaml_file_or_a_list_never_both(tmp_path: Path) -> None:
    (tmp_path / "q.json").write_text('["What is X?", "Who is Y?"]')
    (tmp_path / "q.yaml").write_text("- What is X?\n- 'Who: is Y?'\n")
    assert load_questions(None, str(tmp_path / "q.json")) == ["What is X?", "Who is Y?"]
    assert load_questions(None, str(tmp_path / "q.yaml")) == ["What is X?", "Who: is Y?"]
    assert load_questions(["A?"], None) == ["A?"]
    with pytest.raises(BadQuestions, match="not both"):
        load_questions(["A?"], str(tmp_path / "q.json"))
    with pytest.raises(BadQuestions, match="does not exist"):
        load_questions(None, str(tmp_path / "missing.json"))


def test_the_vram_floor_is_the_gguf_plus_a_fifth_plus_two_gigabytes() -> None:
    assert vram_floor(5 * 10**9) == 5 * 10**9 + 10**9 + 2 * 10**9
    assert vram_floor(0) == 2 * 10**9


def test_a_base_model_is_keyed_by_its_name_and_for_a_directory_by_its_target() -> None:
    hub = base_key("HuggingFaceTB/SmolLM2-135M-Instruct", "a")
    assert hub.startswith("SmolLM2-135M-Instruct-") and hub == base_key(
        "HuggingFaceTB/SmolLM2-135M-Instruct", "b"
    )
    local = base_key("/models/smollm2/", "overbrainer-local-target/a")
    assert local.startswith("smollm2-") and local != base_key("/models/smollm2/", "ssh/b")
    assert "/" not in base_key("../x y", "t")


def test_the_answers_artifact_keeps_each_answer_in_its_own_cell() -> None:
    gguf = {"path": "x.gguf", "size": 1, "sha256": "ab" * 32, "export_id": "e"}
    line = {
        "index": 0,
        "question": "A | B?",
        "model": "base",
        "answer": "one\ntwo | <b>",
        "tokens": 3,
        "prompt_tokens": 9,
        "seconds": 0.1,
        "prompt_seconds": 0.01,
        "tokens_per_s": 42.0,
        "cut": True,
    }
    (answer,) = read_answers(json.dumps(line) + "\nnot json\n")
    result = CompareResult.model_validate(
        {
            "compare_id": "c",
            "run_id": "r",
            "state": "succeeded",
            "target": "t",
            "quant": "q8_0",
            "seed": 0,
            "max_tokens": 3,
            "base_model": "/m",
            "base_gguf": gguf,
            "tuned_gguf": gguf,
            "answers": [{"question": "A | B?", "base": answer.model_dump()}],
            "compare_dir": "/d",
            "next": "n",
        }
    )
    markdown = answers_markdown(result, "this machine")
    row = next(line for line in markdown.splitlines() if line.startswith("| 1 | A"))
    assert row.count(" | ") == 3  # number, question, base, tuned: the pipes inside are escaped
    assert "one<br>two \\| \\<b\\>" in row and "*(no answer)*" in row
    assert "| 1 | 3 (cut) | 42.0 | - | - |" in markdown
