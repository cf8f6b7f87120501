"""A run's compare: its tuned GGUF and its base model's asked the same
questions, `<run dir>/compares/<id>/compare.json`. Whether a run can be
compared, a finished or running compare found for reuse, its result (what the
compare flow returns and Prefect persists), the markdown that shows the
answers side by side, and how its trainer is made again from its record."""

from __future__ import annotations

import shutil

from pydantic import BaseModel, Field, JsonValue

from overbrainer_prefect.cells import code_cell, table_cell
from overbrainer_prefect.executors.base import JOB_LOG, FileDigest
from overbrainer_prefect.kinds.base import ChildResult, JobKind, NewJob, child_next_step
from overbrainer_prefect.kinds.export import NAME as EXPORT
from overbrainer_prefect.kinds.export import gguf_entry, reusable
from overbrainer_prefect.kinds.files import FileEntry
from overbrainer_prefect.runs.manifest import load_manifest, stored_wrong
from overbrainer_prefect.runs.store import RunRecord, Runs, RunState, local_path, subject
from overbrainer_prefect.steps.errors import RunError
from overbrainer_prefect.store.records import RecordError
from overbrainer_prefect.targets.base import JobNeed
from overbrainer_prefect.trainers.base import Trainer
from overbrainer_prefect.trainers.compare import (
    CompareTrainer,
    ModelAnswer,
    read_answers,
    spec_of,
    vram_floor,
)
from overbrainer_prefect.trainers.export import base_model
from overbrainer_prefect.trainers.gguf_job import ANSWERS_FILE, MODELS_DIR, GgufRef

NAME = "compare"
"""A compare's records: `<run dir>/compares/<id>/compare.json`."""


class AnswerPair(BaseModel):
    """One question, and the base and tuned models' answers to it."""

    question: str
    base: ModelAnswer | None = None
    tuned: ModelAnswer | None = None


class CompareResult(ChildResult):
    """What the compare flow returns (and Prefect persists): the compare and its answers."""

    compare_id: str
    quant: str
    seed: int
    max_tokens: int
    base_model: str
    base_gguf: GgufRef
    tuned_gguf: GgufRef
    answers: list[AnswerPair] = Field(default_factory=list)
    compare_dir: str
    answers_path: str | None = Field(default=None, description="answers.jsonl on this machine.")

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
    its stored answers."""
    spec = spec_of(record.spec)
    if spec is None:
        raise RunError(f"{subject(record)} has no compare spec in its record")
    try:
        answers = read_answers(compares.read_text(record.id, ANSWERS_FILE))
        stored = True
    except (OSError, RecordError):
        answers, stored = [], False
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
        compare_dir=compares.where_of(record.id),
        answers_path=compares.where_of(record.id, ANSWERS_FILE) if stored else None,
        next=child_next_step(
            record,
            f"The answers are in `{local_path(record)}/{ANSWERS_FILE}`; compare other "
            f"questions with the `compare` flow (run_id={record.parent}).",
            "compare again",
        ),
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


class NotComparable(RunError):
    """A run that cannot be compared as it is; nothing was started. One line."""


class CompareFailed(RunError):
    """The base model's GGUF could not be made; the message says what to do."""


def tuned_gguf(runs: Runs, run_id: str, quant: str) -> GgufRef:
    """The GGUF of the latest succeeded export of run `run_id` to `quant`, checked
    against the SHA-256 it was retrieved with.

    Raises NotComparable with one line when there is none, or it changed.
    """
    exports = runs.children(run_id, EXPORT)
    done = reusable(exports, quant)
    entry = gguf_entry(load_manifest(exports, done.id)) if done else None
    if done is None or entry is None:
        raise NotComparable(
            f"run {run_id} has no succeeded {quant} export to compare: run the export flow "
            f"first (run_id={run_id}, quant={quant})"
        )
    what = f"the GGUF of export {done.id} of run {run_id}"
    if (wrong := stored_wrong(exports, done.id, entry)) is not None:
        where = exports.where_of(done.id, entry.path)
        raise NotComparable(f"{what} ({where}) {wrong}: export it again")
    return GgufRef(
        path=exports.key(done.id, entry.path),
        size=entry.size,
        sha256=entry.sha256,
        export_id=done.id,
    )


def check_comparable(runs: Runs, run_id: str, quant: str) -> tuple[RunRecord, GgufRef, str]:
    """The record of run `run_id`, its tuned GGUF and the base model it fine-tuned.

    Raises InvalidRunId or RunNotFound for a run that is not there, NotComparable
    with one line when the run has no usable export of `quant`, or its config
    names no base model.
    """
    run = runs.load(run_id)
    tuned = tuned_gguf(runs, run_id, quant)
    base = base_model(runs, run_id)
    if base is None:
        raise NotComparable(
            f"runs/{run_id}/axolotl.yaml names no base model: there is nothing to compare the "
            "fine-tune with"
        )
    return run, tuned, base


def running_compare(
    compares: Runs,
    questions: list[str],
    max_tokens: int,
    seed: int,
    quant: str,
    tuned_sha256: str,
) -> RunRecord | None:
    """A compare of the same questions, settings and tuned GGUF (by its SHA-256)
    whose job runs (or ran unwatched) now, if any."""
    for record in compares.list(skipped=lambda _name, _error: None):
        spec = spec_of(record.spec)
        if spec is None or record.state != RunState.RUNNING or record.job is None:
            continue
        if spec.asks(questions, max_tokens, seed, quant, tuned_sha256):
            return record
    return None


def _base_ref(store: Runs, record: RunRecord, runs: Runs) -> GgufRef | None:
    """The verified GGUF of the succeeded base export `record`, or None when its
    stored file no longer matches the SHA-256 it was retrieved with."""
    entry = gguf_entry(load_manifest(store, record.id))
    if entry is None or stored_wrong(store, record.id, entry) is not None:
        return None
    return GgufRef(
        path=store.key(record.id, entry.path),
        size=entry.size,
        sha256=entry.sha256,
        export_id=record.id,
    )


FAILURE_TAIL = 64 << 10  # bytes at the end of a job log searched for the job's own failure line


def job_failure(store: Runs, record_id: str, prefix: str) -> str | None:
    """The one line a failed job script wrote to say why (`compare failed: ...`),
    from the end of the retrieved `job.log` of `record_id`, without `prefix`;
    None when there is none."""
    try:
        tail = store.read_bytes(record_id, JOB_LOG)[-FAILURE_TAIL:].decode(errors="replace")
    except (OSError, RecordError):
        return None
    lines = [line[len(prefix) :].strip() for line in tail.splitlines() if line.startswith(prefix)]
    return lines[-1] if lines else None


def _rebuild(runs: Runs, record: RunRecord, cpu_threads: int | None) -> Trainer:
    spec = spec_of(record.spec)
    if spec is None:
        raise RunError(
            f"{subject(record)} has no compare spec in its record: it cannot be followed"
        )
    return CompareTrainer(spec, runs, cpu_threads=cpu_threads)


KIND = JobKind(name=NAME, child=True, rebuild=_rebuild)
"""A run's compare: `<run dir>/compares/<id>/compare.json`."""


def reused_compare(
    compares: Runs,
    run_id: str,
    questions: list[str],
    max_tokens: int,
    seed: int,
    quant: str,
    tuned: GgufRef,
    target: str,
) -> tuple[RunRecord, CompareResult] | None:
    """The latest succeeded compare that asked the same questions of the same
    tuned GGUF the same way on `target`, whose answers are here as retrieved,
    and its result (`reused`); None when there is none. Raises NotComparable
    with one line when such a compare runs now (follow that one)."""
    found: list[RunRecord] = []
    for record in compares.list(skipped=lambda _name, _error: None):
        spec = spec_of(record.spec)
        if spec is None or record.state != RunState.SUCCEEDED or record.target != target:
            continue
        if record.not_retrieved is not None:
            continue
        if not spec.asks(questions, max_tokens, seed, quant, tuned.sha256):
            continue
        entry = next(
            (f for f in load_manifest(compares, record.id) if f.path == ANSWERS_FILE), None
        )
        if entry is not None and stored_wrong(compares, record.id, entry) is None:
            found.append(record)
    if found:
        done = max(found, key=lambda r: (r.ended or r.created, r.id))
        files = load_manifest(compares, done.id)
        return done, result_of(compares, done, files, reused=True)
    busy = running_compare(compares, questions, max_tokens, seed, quant, tuned.sha256)
    if busy is not None:
        raise NotComparable(
            f"{subject(busy)} of the same questions is already running: follow it with the "
            f"compare flow (run_id={run_id}, compare_id={busy.id})"
        )
    return None


def gguf_need(what: str, tuned: GgufRef, image: str | None) -> JobNeed:
    """What a job that asks the tuned GGUF and its base's (a compare, an
    evaluation) needs: the GGUF's memory, both GGUFs' disk, its image."""
    return JobNeed(what=what, gguf_bytes=tuned.size, disk_bytes=2 * tuned.size, image=image)


def gguf_job(
    store: Runs,
    need: JobNeed,
    kind: str,
    trainer: Trainer,
    spec: dict[str, JsonValue],
    run_id: str,
) -> NewJob:
    """The new job of run `run_id` that asks its GGUFs (a compare, an
    evaluation): once its files are copied to the target, the GGUFs staged
    in its directory (links here) are removed."""

    def unstage(record: RunRecord) -> None:
        shutil.rmtree(store.run_dir(record.id) / MODELS_DIR, ignore_errors=True)

    return NewJob(
        store=store,
        need=need,
        kind=kind,
        prepare=lambda _record: trainer,
        spec=spec,
        parent=run_id,
        subdir=f"{kind}s",
        started=unstage,
    )


def result_line(result: CompareResult, record: RunRecord) -> str:
    """The line an ended compare is logged with: how many questions both
    models answered, how many were cut, their speeds, what to do next."""
    cut = sum(1 for p in result.answers for a in (p.base, p.tuned) if a is not None and a.cut)
    both = sum(1 for p in result.answers if p.base is not None and p.tuned is not None)
    return (
        f"{subject(record)} {record.state}{' (reused)' if result.reused else ''}: {both} "
        f"questions answered by both models, {cut} cut at {result.max_tokens} tokens; "
        f"tokens/s base {number_text(result.mean_tokens_per_s('base'))}, tuned "
        f"{number_text(result.mean_tokens_per_s('tuned'))}. {result.next}"
    )


def plan_line(
    run_id: str, questions: int, quant: str, max_tokens: int, seed: int, where: str, tuned: GgufRef
) -> str:
    """The line a new compare is announced with: what it asks, where, and the
    GPU memory it needs."""
    return (
        f"run {run_id}: {questions} questions to its base model and its fine-tune ({quant}, "
        f"at most {max_tokens} tokens each, seed {seed}) on {where}; VRAM floor "
        f"{vram_floor(tuned.size) / 1e9:.1f} GB (the {quant} GGUF, {tuned.size / 1e6:.1f} MB, "
        "plus a fifth, plus 2 GB)"
    )
