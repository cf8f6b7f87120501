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
reused, not asked again.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import acreate_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import FlowRun, State
from prefect.flows import Flow
from prefect.logging.loggers import flow_run_logger
from prefect.runtime import flow_run
from prefect.states import Cancelled
from pydantic import BaseModel, Field

from overbrainer_prefect.blocks import RunpodTarget, TargetBlock
from overbrainer_prefect.executors.base import ExecError, Executor, FileDigest, JobStatus
from overbrainer_prefect.executors.manifest import sha256_file
from overbrainer_prefect.flows.export import (
    ExportReporter,
    check_converter,
    gguf_entry,
    reusable,
    running,
)
from overbrainer_prefect.flows.hooks import cancel_pod_job_hook, crashed_pod_job_hook
from overbrainer_prefect.flows.targets import load_target
from overbrainer_prefect.flows.train import FileEntry, RunFailed, run_context, start_job
from overbrainer_prefect.runs import lifecycle
from overbrainer_prefect.runs.ids import rfc3339
from overbrainer_prefect.runs.lifecycle import Outcome, RunContext, RunError
from overbrainer_prefect.runs.lock import RunBusy, follow_lock
from overbrainer_prefect.runs.metrics import Metric, MetricsSummary
from overbrainer_prefect.runs.store import RunRecord, Runs, RunState, local_path, subject
from overbrainer_prefect.trainers.base import Trainer, TrainError
from overbrainer_prefect.trainers.compare import (
    ANSWERS_FILE,
    BASES_DIR,
    MODELS_DIR,
    BaseExportTrainer,
    CompareSpec,
    CompareTrainer,
    GgufRef,
    ModelAnswer,
    base_exports,
    base_key,
    check_max_tokens,
    load_questions,
    read_answers,
    spec_of,
    vram_floor,
)
from overbrainer_prefect.trainers.export import DEFAULT_QUANT, base_model, check_quant

COMPARE = "compare"
"""The kind of a compare's record: `runs/<run-id>/compares/<compare-id>/compare.json`."""

EXPORT = "export"

HOOK_CANCEL_S = 120.0  # how long a cancellation hook spends cancelling and retrieving a job

GB = 10**9


class NotComparable(RunError):
    """A run that cannot be compared as it is; nothing was started. One line."""


class CompareFailed(RunError):
    """The base model's GGUF could not be made; the message says what to do."""


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


class CompareReporter:
    """A `Reporter` for a compare's job (or a base export's): each answer, the job's
    status and warnings in the flow's log, named as `name`."""

    def __init__(self, logger: logging.Logger | logging.LoggerAdapter[Any], name: str) -> None:
        self.logger = logger
        self.name = name

    def metric(self, metric: Metric, summary: MetricsSummary) -> None:
        """Logs an answer given (a compare writes one `log` event per answer)."""
        self.logger.info("%s: answer %s/%s", self.name, metric.step, summary.max_steps)

    def status(self, status: JobStatus) -> None:
        """Logs the job's new status."""
        self.logger.info("%s: job %s", self.name, status)

    def warning(self, message: str) -> None:
        """Logs a warning."""
        self.logger.warning("%s", message)


def tuned_gguf(runs: Runs, run_id: str, quant: str) -> GgufRef:
    """The GGUF of the latest succeeded export of run `run_id` to `quant`, checked
    against the SHA-256 it was retrieved with.

    Raises NotComparable with one line when there is none, or it changed.
    """
    exports = runs.children(run_id, EXPORT)
    done = reusable(exports, quant)
    entry = gguf_entry(lifecycle.load_manifest(exports.run_dir(done.id))) if done else None
    if done is None or entry is None:
        raise NotComparable(
            f"run {run_id} has no succeeded {quant} export to compare: run the export flow "
            f"first (run_id={run_id}, quant={quant})"
        )
    path = exports.run_dir(done.id) / entry.path
    _check_gguf(path, entry, f"the GGUF of export {done.id} of run {run_id}")
    return GgufRef(
        path=path.relative_to(runs.root).as_posix(),
        size=entry.size,
        sha256=entry.sha256,
        export_id=done.id,
    )


def _check_gguf(path: Path, entry: FileDigest, what: str) -> None:
    try:
        size, digest = sha256_file(path)
    except OSError as error:
        raise NotComparable(f"cannot read {what} ({path}): {error.strerror or error}") from None
    if size != entry.size or digest != entry.sha256:
        raise NotComparable(
            f"{what} ({path}) differs from the file retrieved and verified (SHA-256): "
            "export it again"
        )


def check_comparable(runs: Runs, run_id: str, quant: str) -> tuple[RunRecord, GgufRef, str]:
    """The record of run `run_id`, its tuned GGUF and the base model it fine-tuned.

    Raises InvalidRunId or RunNotFound for a run that is not there, NotComparable
    with one line when the run has no usable export of `quant`, or its config
    names no base model.
    """
    run = runs.load(run_id)
    tuned = tuned_gguf(runs, run_id, quant)
    base = base_model(runs.run_dir(run_id))
    if base is None:
        raise NotComparable(
            f"runs/{run_id}/axolotl.yaml names no base model: there is nothing to compare the "
            "fine-tune with"
        )
    return run, tuned, base


def reusable_compare(
    compares: Runs,
    questions: list[str],
    max_tokens: int,
    seed: int,
    quant: str,
    tuned: GgufRef,
    target: str,
) -> RunRecord | None:
    """The latest succeeded compare that asked the same questions of the same tuned
    GGUF the same way on `target`, whose answers are here as retrieved, or None."""
    found: list[RunRecord] = []
    for record in compares.list(skipped=lambda _name, _error: None):
        spec = spec_of(record.spec)
        if spec is None or record.state != RunState.SUCCEEDED or record.target != target:
            continue
        if lifecycle.artifacts_missing(record):
            continue
        if not spec.asks(questions, max_tokens, seed, quant, tuned.sha256):
            continue
        local = compares.run_dir(record.id)
        entry = next((f for f in lifecycle.load_manifest(local) if f.path == ANSWERS_FILE), None)
        answers = local / ANSWERS_FILE
        if entry is not None and answers.is_file() and answers.stat().st_size == entry.size:
            found.append(record)
    return max(found, key=lambda r: (r.ended or r.created, r.id)) if found else None


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
        files=[FileEntry(path=f.path, size=f.size, sha256=f.sha256) for f in files],
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
        f"| target | {_cell(target_description)} |",
        f"| quant | {result.quant} |",
        f"| seed | {result.seed} (greedy, temperature 0) |",
        f"| max tokens | {result.max_tokens} |",
        f"| base | `{_cell(result.base_model)}`, SHA-256 `{result.base_gguf.sha256}` |",
        f"| tuned | export {result.tuned_gguf.export_id}, SHA-256 `{result.tuned_gguf.sha256}` |",
    ]
    if result.message:
        lines.append(f"| message | {_cell(result.message)} |")
    lines += ["", "## Answers", "", "| # | question | base | tuned |", "|---:|---|---|---|"]
    for number, pair in enumerate(result.answers, start=1):
        lines.append(
            f"| {number} | {_cell(pair.question)} | {_answer_cell(pair.base)} "
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
    lines.append(f"| mean | | {_number(base_mean)} | | {_number(tuned_mean)} |")
    lines += ["", "## Next", "", result.next, ""]
    return "\n".join(lines)


def _cell(text: str) -> str:
    """`text` in one markdown table cell: pipes escaped, line breaks as `<br>`."""
    escaped = text.replace("\\", "\\\\").replace("|", "\\|").replace("<", "&lt;")
    return "<br>".join(line for line in escaped.splitlines()) or " "


def _answer_cell(answer: ModelAnswer | None) -> str:
    if answer is None:
        return "*(no answer)*"
    cut = " *(cut at the token limit)*" if answer.cut else ""
    return f"{_cell(answer.answer) if answer.answer else '*(empty)*'}{cut}"


def _tokens(answer: ModelAnswer | None) -> str:
    if answer is None:
        return "-"
    return f"{answer.tokens}{' (cut)' if answer.cut else ''}"


def _speed(answer: ModelAnswer | None) -> str:
    return _number(answer.tokens_per_s) if answer is not None else "-"


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


async def publish_answers(compare_id: str, markdown: str) -> None:
    """The compare's answers side by side as a markdown artifact (`compare-<id>-answers`)."""
    await acreate_markdown_artifact(
        markdown=markdown,
        key=f"compare-{compare_id}-answers".lower(),
        description=f"Base and tuned answers of compare {compare_id}",
    )


def _base_ref(store: Runs, record: RunRecord, runs: Runs) -> GgufRef | None:
    """The verified GGUF of the succeeded base export `record`, or None when its
    local file no longer matches the SHA-256 it was retrieved with."""
    entry = gguf_entry(lifecycle.load_manifest(store.run_dir(record.id)))
    if entry is None:
        return None
    path = store.run_dir(record.id) / entry.path
    try:
        size, digest = sha256_file(path)
    except OSError:
        return None
    if size != entry.size or digest != entry.sha256:
        return None
    return GgufRef(
        path=path.relative_to(runs.root).as_posix(),
        size=size,
        sha256=digest,
        export_id=record.id,
    )


FAILURE_TAIL = 64 << 10  # bytes at the end of a job log searched for the job's own failure line


def job_failure(local: Path, prefix: str) -> str | None:
    """The one line a failed job script wrote to say why (`compare failed: ...`),
    from the end of its retrieved `job.log` in `local`, without `prefix`; None when
    there is none."""
    try:
        with (local / "job.log").open("rb") as log:
            log.seek(max(0, log.seek(0, 2) - FAILURE_TAIL))
            tail = log.read().decode("utf-8", errors="replace")
    except OSError:
        return None
    lines = [line[len(prefix) :].strip() for line in tail.splitlines() if line.startswith(prefix)]
    return lines[-1] if lines else None


def _base_name(record: RunRecord, base: str) -> str:
    return f"base export {record.id} ({base})"


@task(name="export-base", cache_policy=NO_CACHE, persist_result=False)
async def export_base(
    runs: Runs,
    base: str,
    quant: str,
    target_ref: str,
    block: TargetBlock,
    executor: Executor,
) -> GgufRef:
    """The base model's GGUF of type `quant`: a succeeded export of it reused, one
    left running followed again, else an export of the plain base model made on the
    target (converted and quantized like the run's) and retrieved and verified into
    `<runs dir>/.bases/<key>/exports/<export-id>/`.

    Raises CompareFailed with one line when the export fails or its GGUF cannot be
    retrieved (compare again: a started export is followed again).
    """
    logger = get_run_logger()
    store = base_exports(runs, base_key(base, target_ref))
    ref = reused_base(runs, store, base, quant)
    if ref is not None:
        return ref
    trainer = BaseExportTrainer(base, quant, cpu_threads=block.cpu_threads)
    record = running(store, quant)
    if record is None:
        await check_converter(executor, block.python)
        record = lifecycle.create(
            store,
            target=target_ref,
            target_kind=block.kind,
            workdir=f"{executor.workdir.rstrip('/')}/{BASES_DIR.lstrip('.')}",
            trainer=EXPORT,
            spec={"quant": quant, "keep_intermediate": False, "base_model": base},
            flow_run_id=flow_run.id,
        )
        logger.info(
            "the base model %s has no %s GGUF yet: %s made on %s (files in %s)",
            base,
            quant,
            _base_name(record, base),
            executor.description,
            store.run_dir(record.id),
        )
    else:
        logger.info("%s was left running: following it again", _base_name(record, base))
    name = _base_name(record, base)
    reporter = ExportReporter(logger, record)
    reporter.name = name
    ctx = run_context(store, block, executor, reporter)
    again = "compare again: it follows this export again, or makes a new one"
    try:
        with follow_lock(store.run_dir(record.id), flow_run.id):
            if record.job is None:
                record = await lifecycle.start(ctx, trainer, record, block.secrets())
            outcome = await lifecycle.watch(ctx, trainer, record)
    except RunBusy as busy:
        raise CompareFailed(
            f"{name} is followed by {busy.holder}: compare again once it has ended"
        ) from None
    except (TrainError, ExecError, RunError) as error:
        raise CompareFailed(f"{name} could not be made: {error}; {again}") from None
    return base_gguf(runs, store, outcome, name)


def reused_base(runs: Runs, store: Runs, base: str, quant: str) -> GgufRef | None:
    """The GGUF of the latest succeeded export of the base model `base` to
    `quant` in `store`, when it still matches its SHA-256 (a warning says when
    it no longer does); None when there is none to reuse."""
    logger = get_run_logger()
    done = reusable(store, quant)
    ref = _base_ref(store, done, runs) if done is not None else None
    if done is not None and ref is not None:
        logger.info(
            "the base model's GGUF (%s) is reused from %s: %s",
            quant,
            _base_name(done, base),
            ref.path,
        )
        return ref
    if done is not None:
        logger.warning(
            "the GGUF of %s no longer matches its SHA-256: exporting the base again",
            _base_name(done, base),
        )
    return None


def base_gguf(runs: Runs, store: Runs, outcome: Outcome, name: str) -> GgufRef:
    """The verified GGUF of the base export whose job ended with `outcome`.
    Raises CompareFailed with one line (the job's own reason, where its log is)
    when it did not succeed or brought back no GGUF."""
    logger = get_run_logger()
    record = outcome.record
    local = store.run_dir(record.id)
    if outcome.record.state != RunState.SUCCEEDED:
        reason = lifecycle.without_note(outcome.record.message) or str(outcome.record.state)
        why = job_failure(local, "export failed: ")
        raise CompareFailed(
            f"{name} {outcome.record.state}: {reason.split(' (see ')[0]} (see {local}/job.log)"
            + (f": {why}" if why else "")
        )
    entry = gguf_entry(outcome.files)
    if entry is None:
        raise CompareFailed(f"{name} brought back no GGUF (see {local}/job.log)")
    logger.info("%s succeeded: %s (sha256 %s)", name, entry.path, entry.sha256)
    return GgufRef(
        path=(local / entry.path).relative_to(runs.root).as_posix(),
        size=entry.size,
        sha256=entry.sha256,
        export_id=record.id,
    )


@task(name="create-compare", cache_policy=NO_CACHE, persist_result=False)
async def create_compare(
    compares: Runs, run_id: str, target_ref: str, block: TargetBlock, spec: CompareSpec
) -> RunRecord:
    """Creates the compare's record, `preparing`, under its run."""
    executor = block.executor(target_ref)
    record = lifecycle.create(
        compares,
        target=target_ref,
        target_kind=block.kind,
        workdir=f"{executor.workdir.rstrip('/')}/compares",
        trainer=COMPARE,
        spec=spec.model_dump(mode="json"),
        flow_run_id=flow_run.id,
        parent=run_id,
    )
    get_run_logger().info(
        "%s created on %s (files in %s)",
        subject(record),
        executor.description,
        compares.run_dir(record.id),
    )
    return record


@task(name="follow-compare", cache_policy=NO_CACHE, persist_result=False)
async def follow_compare(ctx: RunContext, trainer: CompareTrainer, record: RunRecord) -> Outcome:
    """Follows the compare's job to its end, then retrieves and verifies its answers."""
    return await lifecycle.watch(ctx, trainer, record)


async def _finish(
    compares: Runs,
    outcome: Outcome,
    where: str,
    *,
    cancelling: bool = False,
) -> CompareResult | State[Any]:
    """Publishes the answers side by side and turns the outcome into the flow's
    result: a failed compare fails the flow, a cancelled one cancels it."""
    record = outcome.record
    result = result_of(compares, record, outcome.files)
    await publish_answers(record.id, answers_markdown(result, where))
    if record.state == RunState.FAILED:
        reason = job_failure(compares.run_dir(record.id), "compare failed: ")
        raise RunFailed(
            f"{subject(record)} failed: {record.message}" + (f": {reason}" if reason else "")
        )
    if record.state == RunState.CANCELLED and not cancelling:
        return Cancelled(message=f"{subject(record)} was cancelled", data=result)
    _log_result(result, record)
    return result


def _log_result(result: CompareResult, record: RunRecord) -> None:
    cut = sum(1 for p in result.answers for a in (p.base, p.tuned) if a is not None and a.cut)
    get_run_logger().info(
        "%s %s%s: %d questions answered by both models, %d cut at %d tokens; "
        "tokens/s base %s, tuned %s. %s",
        subject(record),
        record.state,
        " (reused)" if result.reused else "",
        sum(1 for p in result.answers if p.base is not None and p.tuned is not None),
        cut,
        result.max_tokens,
        _number(result.mean_tokens_per_s("base")),
        _number(result.mean_tokens_per_s("tuned")),
        result.next,
    )


def compare_trainer_of(runs: Runs, record: RunRecord, block: TargetBlock) -> CompareTrainer:
    """The trainer of a compare of a run of `runs`, rebuilt from its record.
    Raises RunError when its record holds no compare spec."""
    spec = spec_of(record.spec)
    if spec is None:
        raise RunError(
            f"{subject(record)} has no compare spec in its record: it cannot be followed"
        )
    return CompareTrainer(spec, runs.root, cpu_threads=block.cpu_threads)


async def _follow_again(runs: Runs, run_id: str, compare_id: str) -> CompareResult | State[Any]:
    """Follows a started compare again until its job ends, then retrieves its
    answers; for one ended whose files were not retrieved, retrieves them again."""
    compares = runs.children(run_id, COMPARE)
    record = compares.load(compare_id)
    target_ref, block = await load_target(record.target)
    if isinstance(block, RunpodTarget):
        from overbrainer_prefect.flows.podjob import follow_again_on_pod

        logger = get_run_logger()
        outcome, where = await follow_again_on_pod(
            compares,
            record,
            compare_trainer_of(runs, record, block),
            block,
            CompareReporter(logger, subject(record)),
            logger,
        )
        return await _finish(compares, outcome, where)
    executor = block.executor(target_ref)
    try:
        trainer = compare_trainer_of(runs, record, block)
        reporter = CompareReporter(get_run_logger(), subject(record))
        ctx = run_context(compares, block, executor, reporter)
        try:
            with follow_lock(compares.run_dir(compare_id), flow_run.id):
                record = compares.load(compare_id)
                if record.state.ended and lifecycle.artifacts_missing(record):
                    record, _ = await lifecycle.collect(ctx, trainer, record)
                outcome = await follow_compare(ctx, trainer, record)
                return await _finish(compares, outcome, executor.description)
        except RunBusy as busy:
            raise RunError(
                f"{subject(record)} is already followed by {busy.holder}: it records the "
                "outcome; follow it again only once that follower has ended"
            ) from None
    finally:
        await executor.close()


def _unfinished_of(flow_run: FlowRun) -> list[tuple[Runs, RunRecord, str]]:
    """The compares and base exports a flow run created that have not ended, with
    their store and what their trainer is."""
    parameters = flow_run.parameters or {}
    runs = Runs(parameters.get("runs_dir"))
    stores = [(runs.children(str(parameters.get("run_id")), COMPARE), COMPARE)]
    bases = runs.root / BASES_DIR
    if bases.is_dir():
        stores += [(base_exports(runs, key.name), EXPORT) for key in sorted(bases.iterdir())]
    found = []
    for store, kind in stores:
        for record in store.list(skipped=lambda _name, _error: None):
            if record.flow_run_id == str(flow_run.id) and not record.state.ended:
                found.append((store, record, kind))
    return found


def _name_of(record: RunRecord, kind: str) -> str:
    if kind == COMPARE:
        return subject(record)
    return _base_name(record, str((record.spec or {}).get("base_model")))


async def on_compare_cancelled(flow: Flow[Any, Any], flow_run: FlowRun, state: State[Any]) -> None:
    """`on_cancellation` hook of the compare flow: the compares and base exports it
    created that have not ended are ended too: one not started is failed, a started
    job cancelled and what it left retrieved (bounded in time)."""
    logger = flow_run_logger(flow_run, flow)
    try:
        runs = Runs((flow_run.parameters or {}).get("runs_dir"))
        unfinished = _unfinished_of(flow_run)
    except Exception as error:  # a hook must not fail the cancellation itself
        logger.warning("cannot find the compares of this flow run: %s", error)
        return
    from overbrainer_prefect.flows.collect import job_trainer

    def rebuild(job: RunRecord, block: TargetBlock) -> Trainer:
        return job_trainer(runs, job, block)

    for store, record, kind in unfinished:
        name = _name_of(record, kind)
        if record.target_kind == "runpod":
            await cancel_pod_job_hook(store, record, str(flow_run.id), logger, trainer_of=rebuild)
            continue
        if record.job is None:
            record.state = RunState.FAILED
            record.message = "interrupted before the job started"
            record.ended = rfc3339()
            store.save(record)
            logger.info("%s: interrupted before its job started; nothing runs", name)
            continue
        _, block = await load_target(record.target)
        executor = block.executor(record.target)
        ctx = RunContext(runs=store, executor=executor, python=block.python)
        try:
            trainer = rebuild(record, block)
            with follow_lock(store.run_dir(record.id), str(flow_run.id)):
                _, status, retrieved = await asyncio.wait_for(
                    lifecycle.cancel(ctx, trainer, record), HOOK_CANCEL_S
                )
            logger.info(
                "%s: job %s; its files were %sretrieved", name, status, "" if retrieved else "not "
            )
        except (ExecError, TimeoutError, RunBusy, RunError) as error:
            logger.warning(
                "%s: cannot cancel its job on %s (%s); follow it again with the compare flow "
                "(run_id=%s)",
                name,
                executor.description,
                error,
                (flow_run.parameters or {}).get("run_id"),
            )
        finally:
            await executor.close()


async def on_compare_crashed(flow: Flow[Any, Any], flow_run: FlowRun, state: State[Any]) -> None:
    """`on_crashed` hook of the compare flow: a started compare or base export keeps
    running (bounded by its target's max_hours); says how to follow it again."""
    logger = flow_run_logger(flow_run, flow)
    try:
        unfinished = _unfinished_of(flow_run)
    except Exception:
        return
    for store, record, kind in unfinished:
        if record.target_kind == "runpod":
            await crashed_pod_job_hook(store, record, logger)
            continue
        if record.job is None:
            continue
        if kind == COMPARE:
            logger.warning(
                "%s keeps running on its target; follow it again with the compare flow "
                "(run_id=%s, compare_id=%s)",
                subject(record),
                record.parent,
                record.id,
            )
        else:
            logger.warning(
                "%s keeps running on its target; the next compare of the run follows it again",
                _name_of(record, kind),
            )


@flow(
    name="compare",
    persist_result=True,
    on_cancellation=[on_compare_cancelled],
    on_crashed=[on_compare_crashed],
)
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
) -> CompareResult | State[Any]:
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
    runs = Runs(runs_dir)
    if compare_id is not None:
        return await _follow_again(runs, run_id, compare_id)
    asked = load_questions(questions, questions_file)
    check_max_tokens(max_tokens)
    quant = check_quant(quant)
    run, tuned, base = check_comparable(runs, run_id, quant)
    compares = runs.children(run_id, COMPARE)
    logger = get_run_logger()
    target_ref, block = await load_target(target or run.target)
    done = reusable_compare(compares, asked, max_tokens, seed, quant, tuned, target_ref)
    if done is not None:
        files = lifecycle.load_manifest(compares.run_dir(done.id))
        result = result_of(compares, done, files, reused=True)
        logger.info(
            "reused %s, which asked the same %d questions of the same GGUF on %s: nothing "
            "asked again",
            subject(done),
            len(asked),
            done.ended,
        )
        await publish_answers(done.id, answers_markdown(result, target_ref))
        _log_result(result, done)
        return result
    busy = running_compare(compares, asked, max_tokens, seed, quant, tuned.sha256)
    if busy is not None:
        raise NotComparable(
            f"{subject(busy)} of the same questions is already running: follow it with the "
            f"compare flow (run_id={run_id}, compare_id={busy.id})"
        )

    def asking(base_ref: GgufRef) -> CompareSpec:
        return CompareSpec(
            questions=asked,
            max_tokens=max_tokens,
            seed=seed,
            quant=quant,
            base_model=base,
            tuned=tuned,
            base=base_ref,
        )

    if isinstance(block, RunpodTarget):
        from overbrainer_prefect.flows.pod_exports import compare_on_pod, export_base_on_pod
        from overbrainer_prefect.flows.podjob import pod_settings

        pod_settings(block, image)  # a wrong image fails here, before any pod
        base_ref = await export_base_on_pod(runs, base, quant, target_ref, block)
        spec = asking(base_ref)
        return await compare_on_pod(runs, run_id, spec, target_ref, block, image)
    if image is not None:
        logger.warning(
            "image=%s is for a Runpod target's compare pod: %s runs on its own machine",
            image,
            target_ref,
        )
    executor = block.executor(target_ref)
    try:
        logger.info(
            "run %s: %d questions to its base model and its fine-tune (%s, at most %d tokens "
            "each, seed %d) on %s",
            run_id,
            len(asked),
            quant,
            max_tokens,
            seed,
            executor.description,
        )
        logger.info(
            "run %s: VRAM floor %.1f GB (the %s GGUF, %.1f MB, plus a fifth, plus 2 GB)",
            run_id,
            vram_floor(tuned.size) / GB,
            quant,
            tuned.size / 1e6,
        )
        spec = asking(await export_base(runs, base, quant, target_ref, block, executor))
        trainer = CompareTrainer(spec, runs.root, cpu_threads=block.cpu_threads)
        record = await create_compare(compares, run_id, target_ref, block, spec)
        with follow_lock(compares.run_dir(record.id), flow_run.id):
            reporter = CompareReporter(logger, subject(record))
            ctx = run_context(compares, block, executor, reporter)
            try:
                record = await start_job(ctx, trainer, record, block)
            finally:  # the staged GGUFs were copied to the target (links here, but no need)
                shutil.rmtree(compares.run_dir(record.id) / MODELS_DIR, ignore_errors=True)
            outcome = await follow_compare(ctx, trainer, record)
            return await _finish(compares, outcome, executor.description)
    finally:
        await executor.close()
