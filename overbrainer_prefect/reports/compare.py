"""What a compare's outcome says: its result (what the compare flow returns and
Prefect persists), built from its record and retrieved answers, and the
markdown that shows the answers side by side."""

from __future__ import annotations

from pydantic import BaseModel, Field

from overbrainer_prefect.cells import code_cell, table_cell
from overbrainer_prefect.executors.base import FileDigest
from overbrainer_prefect.reports.files import FileEntry
from overbrainer_prefect.runs.lifecycle import RunError
from overbrainer_prefect.runs.store import RunRecord, Runs, RunState, local_path, subject
from overbrainer_prefect.trainers.compare import (
    ANSWERS_FILE,
    GgufRef,
    ModelAnswer,
    read_answers,
    spec_of,
)


class AnswerPair(BaseModel):
    """One question, and the base and tuned models' answers to it."""

    question: str
    base: ModelAnswer | None = None
    tuned: ModelAnswer | None = None


class CompareResult(BaseModel):
    """What the compare flow returns (and Prefect persists): the compare and its answers."""

    compare_id: str
    run_id: str
    state: RunState
    target: str
    quant: str
    seed: int
    max_tokens: int
    base_model: str
    base_gguf: GgufRef
    tuned_gguf: GgufRef
    message: str | None = None
    reused: bool = Field(
        default=False, description="An earlier succeeded compare of the same, returned as is."
    )
    answers: list[AnswerPair] = Field(default_factory=list)
    files: list[FileEntry] = Field(default_factory=list)
    compare_dir: str
    answers_path: str | None = Field(default=None, description="answers.jsonl on this machine.")
    next: str

    def mean_tokens_per_s(self, model: str) -> float | None:
        """The mean decoding speed of `model` (`base` or `tuned`) over its answers."""
        speeds = [
            a.tokens_per_s
            for pair in self.answers
            for a in (pair.base if model == "base" else pair.tuned,)
            if a is not None and a.tokens_per_s is not None
        ]
        return sum(speeds) / len(speeds) if speeds else None


def result_of(
    compares: Runs, record: RunRecord, files: list[FileDigest], *, reused: bool = False
) -> CompareResult:
    """The flow's result for the compare `record`, from its retrieved `files` and
    its local answers."""
    spec = spec_of(record.spec)
    if spec is None:
        raise RunError(f"{subject(record)} has no compare spec in its record")
    local = compares.run_dir(record.id)
    path = local / ANSWERS_FILE
    try:
        answers = read_answers(path.read_text(encoding="utf-8", errors="replace"))
    except OSError:
        answers = []
    pairs = [AnswerPair(question=q) for q in spec.questions]
    for answer in answers:
        if 0 <= answer.index < len(pairs) and answer.model in ("base", "tuned"):
            setattr(pairs[answer.index], answer.model, answer)
    return CompareResult(
        compare_id=record.id,
        run_id=record.parent or "",
        state=record.state,
        target=record.target,
        quant=spec.quant,
        seed=spec.seed,
        max_tokens=spec.max_tokens,
        base_model=spec.base_model,
        base_gguf=spec.base,
        tuned_gguf=spec.tuned,
        message=record.message,
        reused=reused,
        answers=pairs,
        files=[FileEntry.of(f) for f in files],
        compare_dir=str(local),
        answers_path=str(path) if path.is_file() else None,
        next=_next_step(record),
    )


def _next_step(record: RunRecord) -> str:
    run_id = record.parent
    if record.state == RunState.SUCCEEDED:
        return (
            f"The answers are in `{local_path(record)}/{ANSWERS_FILE}`; compare other questions "
            f"with the `compare` flow (run_id={run_id})."
        )
    if not record.state.ended:
        return f"Follow it again: run the `compare` flow (run_id={run_id}, compare_id={record.id})."
    return (
        f"See `{local_path(record)}/job.log`, fix the cause, and compare again with the "
        f"`compare` flow (run_id={run_id})."
    )


def answers_markdown(result: CompareResult, target_description: str) -> str:
    """The compare artifact: the models, then every question with the base and tuned
    answers side by side, then a table of answer lengths and tokens/s."""
    lines = [
        f"# Compare {result.compare_id} of run {result.run_id}",
        "",
        "| | |",
        "|---|---|",
        f"| state | **{result.state}**{' (reused)' if result.reused else ''} |",
        f"| target | {table_cell(target_description)} |",
        f"| quant | {result.quant} |",
        f"| seed | {result.seed} (greedy, temperature 0) |",
        f"| max tokens | {result.max_tokens} |",
        f"| base | {code_cell(result.base_model)}, SHA-256 `{result.base_gguf.sha256}` |",
        f"| tuned | export {result.tuned_gguf.export_id}, SHA-256 `{result.tuned_gguf.sha256}` |",
    ]
    if result.message:
        lines.append(f"| message | {table_cell(result.message)} |")
    lines += ["", "## Answers", "", "| # | question | base | tuned |", "|---:|---|---|---|"]
    for number, pair in enumerate(result.answers, start=1):
        lines.append(
            f"| {number} | {table_cell(pair.question)} | {_answer_cell(pair.base)} "
            f"| {_answer_cell(pair.tuned)} |"
        )
    lines += [
        "",
        "## Length and speed",
        "",
        "| # | base tokens | base tokens/s | tuned tokens | tuned tokens/s |",
        "|---:|---:|---:|---:|---:|",
    ]
    for number, pair in enumerate(result.answers, start=1):
        lines.append(
            f"| {number} | {_tokens(pair.base)} | {_speed(pair.base)} | {_tokens(pair.tuned)} "
            f"| {_speed(pair.tuned)} |"
        )
    base_mean, tuned_mean = result.mean_tokens_per_s("base"), result.mean_tokens_per_s("tuned")
    lines.append(f"| mean | | {number_text(base_mean)} | | {number_text(tuned_mean)} |")
    lines += ["", "## Next", "", result.next, ""]
    return "\n".join(lines)


def _answer_cell(answer: ModelAnswer | None) -> str:
    if answer is None:
        return "*(no answer)*"
    cut = " *(cut at the token limit)*" if answer.cut else ""
    return f"{table_cell(answer.answer) if answer.answer else '*(empty)*'}{cut}"


def _tokens(answer: ModelAnswer | None) -> str:
    if answer is None:
        return "-"
    return f"{answer.tokens}{' (cut)' if answer.cut else ''}"


def _speed(answer: ModelAnswer | None) -> str:
    return number_text(answer.tokens_per_s) if answer is not None else "-"


def number_text(value: float | None) -> str:
    """A speed to one decimal, `-` when unknown."""
    return "-" if value is None else f"{value:.1f}"
