"""The export flow: a succeeded run's model as one verified GGUF file.

The export runs on a target like any job (the run's own target by default):
the run's model and config are staged into `runs/<run-id>/exports/<export-id>/`,
copied to the target, merged, converted and quantized there by llama.cpp, and
the GGUF brought back and checked against the target's SHA-256 manifest. Its
record, `export.json`, follows the same rules as a run's, so `export` with an
`export_id` follows it again from any process. An export of the same run and
quant type that already succeeded is reused, not made again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
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
from overbrainer_prefect.flows.hooks import cancel_pod_job_hook, crashed_pod_job_hook
from overbrainer_prefect.flows.targets import load_target
from overbrainer_prefect.flows.train import FileEntry, RunFailed, run_context, start_job
from overbrainer_prefect.runs import lifecycle
from overbrainer_prefect.runs.ids import parse_rfc3339, rfc3339
from overbrainer_prefect.runs.lifecycle import Outcome, RunContext, RunError
from overbrainer_prefect.runs.lock import RunBusy, follow_lock
from overbrainer_prefect.runs.metrics import Metric, MetricsSummary
from overbrainer_prefect.runs.store import RunRecord, Runs, RunState, local_path, subject
from overbrainer_prefect.sizing import ExportDisk, disk_warning, export_disk
from overbrainer_prefect.trainers.base import TrainError
from overbrainer_prefect.trainers.export import (
    CONFIG_FILE,
    DEFAULT_QUANT,
    GGUF_DIR,
    OUTPUT_DIR,
    ExportSpec,
    ExportTrainer,
    check_quant,
    converter_path,
    is_lora,
    model_files,
    phases,
)

EXPORT = "export"
"""The kind of an export's record: `runs/<run-id>/exports/<export-id>/export.json`."""

HOOK_CANCEL_S = 120.0  # how long a cancellation hook spends cancelling and retrieving an export


class NotExportable(RunError):
    """A run that cannot be exported as it is; nothing was started. One line."""


class ExportResult(BaseModel):
    """What the export flow returns (and Prefect persists): the export, and its GGUF."""

    export_id: str
    run_id: str
    quant: str
    state: RunState
    target: str
    message: str | None = None
    reused: bool = Field(
        default=False, description="An earlier succeeded export of the same quant, returned as is."
    )
    gguf: FileEntry | None = Field(
        default=None, description="The GGUF, its path relative to the export directory."
    )
    gguf_path: str | None = Field(default=None, description="The GGUF on this machine.")
    phases: dict[str, float] = Field(
        default_factory=dict, description="Seconds of each step: merge, convert, quantize."
    )
    files: list[FileEntry] = Field(default_factory=list)
    export_dir: str
    next: str


class ExportReporter:
    """A `Reporter` for an export's job: its status and warnings in the flow's log,
    named as `export E of run R` (an export writes phases, not training metrics)."""

    def __init__(self, logger: logging.Logger | logging.LoggerAdapter[Any], record: RunRecord):
        self.logger = logger
        self.name = subject(record)

    def metric(self, metric: Metric, summary: MetricsSummary) -> None:
        """Logs a step (an export writes none)."""
        self.logger.info("%s: step %s", self.name, metric.step)

    def status(self, status: JobStatus) -> None:
        """Logs the job's new status."""
        self.logger.info("%s: job %s", self.name, status)

    def warning(self, message: str) -> None:
        """Logs a warning."""
        self.logger.warning("%s", message)


def check_exportable(runs: Runs, run: RunRecord) -> list[Path]:
    """The files of a run's model, once the run is found exportable: succeeded, its
    files retrieved, its model (the top-level files of `output/`) and, for a LoRA,
    its `axolotl.yaml` present locally and matching the SHA-256 manifest they were
    retrieved with.

    Raises NotExportable with one line saying what is wrong and what to do.
    """
    where = f"runs/{run.id}"
    if run.state == RunState.STOPPED:
        raise NotExportable(
            f"run {run.id} is stopped: only a succeeded run can be exported (resume it with "
            f"the train flow, resume_from={run.id})"
        )
    if run.state != RunState.SUCCEEDED:
        raise NotExportable(f"run {run.id} is {run.state}: only a succeeded run can be exported")
    if lifecycle.artifacts_missing(run):
        raise NotExportable(
            f"the files of run {run.id} were not retrieved: retrieve them with the attach flow "
            f"(run_id={run.id}), then export it"
        )
    run_dir = runs.run_dir(run.id)
    manifest = {entry.path: entry for entry in lifecycle.load_manifest(run_dir)}
    for rel, entry in manifest.items():
        top_level_model = rel.startswith(f"{OUTPUT_DIR}/") and rel.count("/") == 1
        if top_level_model or rel == CONFIG_FILE:
            _check_file(run_dir / rel, f"{where}/{rel}", entry)
    try:
        files = model_files(run_dir)
    except TrainError:
        raise NotExportable(
            f"run {run.id} has no model in {where}/{OUTPUT_DIR}/ (no adapter_config.json, no "
            "config.json): only a run that saved its model can be exported"
        ) from None
    if is_lora(run_dir) and not (run_dir / CONFIG_FILE).is_file():
        raise NotExportable(
            f"{where}/{CONFIG_FILE} is missing: the LoRA of run {run.id} cannot be merged "
            "without the base model it names"
        )
    return files


def _check_file(path: Path, shown: str, entry: FileDigest) -> None:
    try:
        size, digest = sha256_file(path)
    except FileNotFoundError:
        raise NotExportable(
            f"{shown} is missing on this machine (it was retrieved and verified, then removed): "
            "restore it, or train the run again"
        ) from None
    except OSError as error:
        raise NotExportable(f"cannot read {shown}: {error.strerror or error}") from None
    if size != entry.size or digest != entry.sha256:
        raise NotExportable(
            f"{shown} differs from the file retrieved and verified (SHA-256): restore it, "
            "or train the run again"
        )


def gguf_entry(files: list[FileDigest]) -> FileDigest | None:
    """The GGUF among an export's retrieved files."""
    return next(
        (f for f in files if f.path.startswith(f"{GGUF_DIR}/") and f.path.endswith(".gguf")), None
    )


def reusable(exports: Runs, quant: str) -> RunRecord | None:
    """The latest succeeded export of `quant` whose GGUF is here, as retrieved (its
    size checked; delivery hashes it again before it leaves), or None."""
    found: list[RunRecord] = []
    for record in exports.list(skipped=lambda _name, _error: None):
        if record.state != RunState.SUCCEEDED or lifecycle.artifacts_missing(record):
            continue
        if str((record.spec or {}).get("quant", "")).lower() != quant:
            continue
        entry = gguf_entry(lifecycle.load_manifest(exports.run_dir(record.id)))
        path = exports.run_dir(record.id) / entry.path if entry else None
        if entry is not None and path is not None and _has_size(path, entry.size):
            found.append(record)
    return max(found, key=lambda r: (r.ended or r.created, r.id)) if found else None


def _has_size(path: Path, size: int) -> bool:
    try:
        return path.is_file() and path.stat().st_size == size
    except OSError:
        return False


def running(exports: Runs, quant: str) -> RunRecord | None:
    """An export of `quant` whose job runs (or ran unwatched) now, if any."""
    for record in exports.list(skipped=lambda _name, _error: None):
        same = str((record.spec or {}).get("quant", "")).lower() == quant
        if same and record.state == RunState.RUNNING and record.job is not None:
            return record
    return None


def result_of(
    exports: Runs, record: RunRecord, files: list[FileDigest], *, reused: bool = False
) -> ExportResult:
    """The flow's result for the export `record`, from its retrieved `files` and
    its local metrics file."""
    local = exports.run_dir(record.id)
    try:
        timings = phases((local / "metrics.jsonl").read_text(encoding="utf-8", errors="replace"))
    except OSError:
        timings = {}
    entry = gguf_entry(files)
    return ExportResult(
        export_id=record.id,
        run_id=record.parent or "",
        quant=str((record.spec or {}).get("quant", "")),
        state=record.state,
        target=record.target,
        message=record.message,
        reused=reused,
        gguf=FileEntry(path=entry.path, size=entry.size, sha256=entry.sha256) if entry else None,
        gguf_path=str(local / entry.path) if entry else None,
        phases=timings,
        files=[FileEntry(path=f.path, size=f.size, sha256=f.sha256) for f in files],
        export_dir=str(local),
        next=_next_step(record),
    )


def _next_step(record: RunRecord) -> str:
    run_id = record.parent
    if record.state == RunState.SUCCEEDED:
        return (
            f"The GGUF is in `{local_path(record)}/{GGUF_DIR}/`; deliver it to Ollama or the "
            "Hugging Face Hub with the delivery flows."
        )
    if not record.state.ended:
        return f"Follow it again: run the `export` flow (run_id={run_id}, export_id={record.id})."
    return (
        f"See `{local_path(record)}/job.log`, fix the cause, and export again with the `export` "
        f"flow (`run_id={run_id}`)."
    )


def summary_markdown(result: ExportResult, target_description: str, record: RunRecord) -> str:
    """The export summary: the export, its run, quant type, target, state, the
    GGUF with its size and SHA-256, the time of each step, and what to do next."""
    lines = [
        f"# Export {result.export_id} of run {result.run_id}",
        "",
        "| | |",
        "|---|---|",
        f"| state | **{result.state}** |",
        f"| quant | {result.quant} |",
        f"| target | {target_description} |",
        f"| duration | {_duration(record)} |",
    ]
    if result.gguf is not None:
        lines += [
            f"| GGUF | `{result.gguf.path}` |",
            f"| size | {_size(result.gguf.size)} |",
            f"| SHA-256 | `{result.gguf.sha256}` |",
        ]
    for name in ("merge", "convert", "quantize"):
        if name in result.phases:
            lines.append(f"| {name} | {result.phases[name]:.1f} s |")
    if result.message:
        lines.append(f"| message | {_cell(result.message)} |")
    lines += ["", f"## Files ({len(result.files)}, verified by SHA-256)", ""]
    if result.files:
        lines += ["| file | size | SHA-256 |", "|---|---:|---|"]
        lines += [f"| `{f.path}` | {_size(f.size)} | `{f.sha256}` |" for f in result.files]
    else:
        lines.append("No file was retrieved.")
    lines += ["", "## Next", "", result.next, ""]
    return "\n".join(lines)


def gguf_markdown(run_id: str, result: ExportResult) -> str:
    """The section a training run's summary gets for the export made after it."""
    if result.gguf is None:
        return ""
    return "\n".join(
        [
            "",
            f"## GGUF ({result.quant}, export {result.export_id})",
            "",
            "| file | size | SHA-256 |",
            "|---|---:|---|",
            f"| `exports/{result.export_id}/{result.gguf.path}` | {_size(result.gguf.size)} "
            f"| `{result.gguf.sha256}` |",
            "",
        ]
    )


async def publish_export_summary(export_id: str, markdown: str) -> None:
    """The export summary as a markdown artifact (`export-<id>-summary`)."""
    await acreate_markdown_artifact(
        markdown=markdown,
        key=f"export-{export_id}-summary".lower(),
        description=f"Summary of export {export_id}",
    )


def _duration(record: RunRecord) -> str:
    if not record.started or not record.ended:
        return "-"
    seconds = (parse_rfc3339(record.ended) - parse_rfc3339(record.started)).total_seconds()
    return f"{seconds:.0f} s"


def _size(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{size} B"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def target_disk(block: TargetBlock) -> int | None:
    """The disk a target is known to have, in bytes (a pod's container disk); None
    for a local or SSH target, whose free space is theirs to manage, and for a
    pod with a network volume (checked, and grown, before its pod is asked for)."""
    if getattr(block, "network_volume_id", None):
        return None
    gb = getattr(block, "container_disk_gb", None)
    return int(gb) * 10**9 if isinstance(gb, int | float) else None


async def check_converter(executor: Executor, python: str) -> None:
    """Raises TrainError with one line when llama.cpp's converter is not in the
    target's job venv (ExecError when the target cannot be reached)."""
    path = converter_path(python)
    result = await executor.run(["test", "-f", path], timeout=60)
    if result.code != 0:
        venv = path.rsplit("/share/", 1)[0]
        raise TrainError(
            f"llama.cpp's converter is not at {path} on {executor.description}: install the "
            f"export tools with `scripts/job-env.sh {venv}` there"
        )


def log_disk(
    run: RunRecord, files: list[Path], trainer: ExportTrainer, block: TargetBlock, where: str
) -> ExportDisk | None:
    """Logs the disk the export of `run` needs (base, merged copy, GGUF), and
    warns when the target's known disk is smaller; returns the estimate (None
    when the base model is not a directory here)."""
    logger = get_run_logger()
    need = export_disk(files[0].parent, trainer.base_model, trainer.spec.quant)
    if need is None:
        logger.info(
            "run %s: cannot estimate the disk of its export (its base model %s is not a "
            "directory here)",
            run.id,
            trainer.base_model,
        )
        return None
    logger.info("run %s: %s", run.id, need.describe())
    warning = disk_warning(need, target_disk(block), where)
    if warning is not None:
        logger.warning("%s", warning)
    return need


@task(name="create-export", cache_policy=NO_CACHE, persist_result=False)
async def create_export(
    exports: Runs, run: RunRecord, target_ref: str, block: TargetBlock, spec: ExportSpec
) -> RunRecord:
    """Creates the export's record, `preparing`, under its run."""
    executor = block.executor(target_ref)
    record = lifecycle.create(
        exports,
        target=target_ref,
        target_kind=block.kind,
        workdir=f"{executor.workdir.rstrip('/')}/exports",
        trainer=EXPORT,
        spec=spec.model_dump(mode="json"),
        flow_run_id=flow_run.id,
        parent=run.id,
    )
    get_run_logger().info(
        "%s (%s) created on %s (files in %s)",
        subject(record),
        spec.quant,
        executor.description,
        exports.run_dir(record.id),
    )
    return record


@task(name="follow-export", cache_policy=NO_CACHE, persist_result=False)
async def follow_export(ctx: RunContext, trainer: ExportTrainer, record: RunRecord) -> Outcome:
    """Follows the export's job to its end, then retrieves and verifies its GGUF."""
    return await lifecycle.watch(ctx, trainer, record)


async def _finish(
    exports: Runs, outcome: Outcome, where: str, *, cancelling: bool = False
) -> ExportResult | State[Any]:
    """Publishes the export summary and turns the outcome into the flow's result:
    a failed export fails the flow, a cancelled one cancels it."""
    record = outcome.record
    result = result_of(exports, record, outcome.files)
    await publish_export_summary(record.id, summary_markdown(result, where, record))
    if record.state == RunState.FAILED:
        raise RunFailed(f"{subject(record)} failed: {record.message}")
    if record.state == RunState.CANCELLED and not cancelling:
        return Cancelled(message=f"{subject(record)} was cancelled", data=result)
    _log_result(result, record)
    return result


def _log_result(result: ExportResult, record: RunRecord) -> None:
    steps = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in result.phases.items())
    if result.gguf is None:
        get_run_logger().info("%s %s. %s", subject(record), record.state, result.next)
        return
    get_run_logger().info(
        "%s %s%s: %s (%s, sha256 %s)%s. %s",
        subject(record),
        record.state,
        " (reused)" if result.reused else "",
        result.gguf.path,
        _size(result.gguf.size),
        result.gguf.sha256,
        f"; {steps}" if steps else "",
        result.next,
    )


async def _trainer_of(runs: Runs, record: RunRecord, block: TargetBlock) -> ExportTrainer:
    """The trainer of an export, rebuilt from its record and its run's."""
    return export_trainer_of(runs)(record, block)


def export_trainer_of(runs: Runs) -> Callable[[RunRecord, TargetBlock], ExportTrainer]:
    """Rebuilds the trainer of an export of a run of `runs` from its record and
    its run's (raises RunError when its record holds no export spec)."""

    def rebuild(record: RunRecord, block: TargetBlock) -> ExportTrainer:
        if record.parent is None or record.spec is None:
            raise RunError(
                f"{subject(record)} has no export spec in its record: it cannot be followed"
            )
        run = runs.load(record.parent)
        spec = ExportSpec.model_validate(record.spec)
        return ExportTrainer(run, runs.run_dir(run.id), spec, cpu_threads=block.cpu_threads)

    return rebuild


async def _follow_again(runs: Runs, run_id: str, export_id: str) -> ExportResult | State[Any]:
    """Follows a started export again until its job ends, then retrieves its GGUF;
    for one ended whose files were not retrieved, retrieves them again."""
    exports = runs.children(run_id, EXPORT)
    record = exports.load(export_id)
    target_ref, block = await load_target(record.target)
    if isinstance(block, RunpodTarget):
        from overbrainer_prefect.flows.podjob import follow_again_on_pod

        logger = get_run_logger()
        trainer = await _trainer_of(runs, record, block)
        outcome, where = await follow_again_on_pod(
            exports, record, trainer, block, ExportReporter(logger, record), logger
        )
        return await _finish(exports, outcome, where)
    executor = block.executor(target_ref)
    try:
        trainer = await _trainer_of(runs, record, block)
        ctx = run_context(exports, block, executor, ExportReporter(get_run_logger(), record))
        try:
            with follow_lock(exports.run_dir(export_id), flow_run.id):
                record = exports.load(export_id)
                if record.state.ended and lifecycle.artifacts_missing(record):
                    record, _ = await lifecycle.collect(ctx, trainer, record)
                outcome = await follow_export(ctx, trainer, record)
                return await _finish(exports, outcome, executor.description)
        except RunBusy as busy:
            raise RunError(
                f"{subject(record)} is already followed by {busy.holder}: it records the "
                "outcome; follow it again only once that follower has ended"
            ) from None
    finally:
        await executor.close()


async def on_export_cancelled(flow: Flow[Any, Any], flow_run: FlowRun, state: State[Any]) -> None:
    """`on_cancellation` hook of the export flow: the exports it created that have
    not ended are ended too: one not started is failed, a started job cancelled
    and what it left retrieved (bounded in time)."""
    logger = flow_run_logger(flow_run, flow)
    parameters = flow_run.parameters or {}
    runs = Runs(parameters.get("runs_dir"))
    try:
        exports = runs.children(str(parameters.get("run_id")), EXPORT)
        records = [
            r
            for r in exports.list(skipped=lambda _name, _error: None)
            if r.flow_run_id == str(flow_run.id) and not r.state.ended
        ]
    except Exception as error:  # a hook must not fail the cancellation itself
        logger.warning("cannot find the exports of this flow run: %s", error)
        return
    for record in records:
        if record.target_kind == "runpod":
            await cancel_pod_job_hook(
                exports, record, str(flow_run.id), logger, trainer_of=export_trainer_of(runs)
            )
            continue
        if record.job is None:
            record.state = RunState.FAILED
            record.message = "interrupted before the job started"
            record.ended = rfc3339()
            exports.save(record)
            logger.info("%s: interrupted before its job started; nothing runs", subject(record))
            continue
        _, block = await load_target(record.target)
        executor = block.executor(record.target)
        ctx = RunContext(runs=exports, executor=executor, python=block.python)
        try:
            trainer = await _trainer_of(runs, record, block)
            with follow_lock(exports.run_dir(record.id), str(flow_run.id)):
                _, status, retrieved = await asyncio.wait_for(
                    lifecycle.cancel(ctx, trainer, record), HOOK_CANCEL_S
                )
            logger.info(
                "%s: job %s; its files were %sretrieved",
                subject(record),
                status,
                "" if retrieved else "not ",
            )
        except (ExecError, TimeoutError, RunBusy, RunError) as error:
            logger.warning(
                "%s: cannot cancel its job on %s (%s); follow it again with the export flow "
                "(run_id=%s, export_id=%s)",
                subject(record),
                executor.description,
                error,
                record.parent,
                record.id,
            )
        finally:
            await executor.close()


async def on_export_crashed(flow: Flow[Any, Any], flow_run: FlowRun, state: State[Any]) -> None:
    """`on_crashed` hook of the export flow: a started export keeps running (bounded
    by its target's max_hours); says how to follow it again."""
    logger = flow_run_logger(flow_run, flow)
    parameters = flow_run.parameters or {}
    try:
        exports = Runs(parameters.get("runs_dir")).children(str(parameters.get("run_id")), EXPORT)
        records = exports.list(skipped=lambda _name, _error: None)
    except Exception:
        return
    for record in records:
        mine = record.flow_run_id == str(flow_run.id)
        if mine and record.target_kind == "runpod" and not record.state.ended:
            await crashed_pod_job_hook(exports, record, logger)
            continue
        if mine and record.job is not None and not record.state.ended:
            logger.warning(
                "%s keeps running on its target; follow it again with the export flow "
                "(run_id=%s, export_id=%s)",
                subject(record),
                record.parent,
                record.id,
            )


@flow(
    name="export",
    persist_result=True,
    on_cancellation=[on_export_cancelled],
    on_crashed=[on_export_crashed],
)
async def export(
    run_id: str,
    quant: str = DEFAULT_QUANT,
    target: str | None = None,
    runs_dir: str | None = None,
    export_id: str | None = None,
    keep_intermediate: bool = False,
) -> ExportResult | State[Any]:
    """Exports the model of the succeeded run `run_id` to a GGUF of type `quant`
    (q4_k_m, q5_k_m, q8_0 or f16): on the run's own target, or on `target` (a
    target block's name), its LoRA merged into its base, converted and quantized
    with llama.cpp; the GGUF retrieved and verified by SHA-256 into
    `runs/<run_id>/exports/<export-id>/gguf/`.

    An export of the same run and quant that already succeeded is returned as it
    is (`reused`). With `export_id`, follows that export again (after its first
    follower died, or its files could not be retrieved). `keep_intermediate`
    leaves the merged model and the f16 GGUF on the target.

    Fails with one line, before anything is created, for an unknown quant type,
    a run that has not succeeded, has no model or whose files are not here; fails
    with the export's message when its job fails.
    """
    runs = Runs(runs_dir)
    if export_id is not None:
        return await _follow_again(runs, run_id, export_id)
    spec = ExportSpec(quant=check_quant(quant), keep_intermediate=keep_intermediate)
    run = runs.load(run_id)
    files = check_exportable(runs, run)
    exports = runs.children(run_id, EXPORT)
    logger = get_run_logger()
    done = reusable(exports, spec.quant)
    if done is not None:
        result = result_of(exports, done, lifecycle.load_manifest(exports.run_dir(done.id)))
        result.reused = True
        logger.info(
            "reused %s (%s), which succeeded on %s: nothing exported again",
            subject(done),
            spec.quant,
            done.ended,
        )
        _log_result(result, done)
        return result
    busy = running(exports, spec.quant)
    if busy is not None:
        raise NotExportable(
            f"{subject(busy)} ({spec.quant}) is already running: follow it with the export flow "
            f"(run_id={run_id}, export_id={busy.id})"
        )
    target_ref, block = await load_target(target or run.target)
    trainer = ExportTrainer(run, runs.run_dir(run_id), spec, cpu_threads=block.cpu_threads)
    if isinstance(block, RunpodTarget):
        from overbrainer_prefect.flows.pod_exports import export_on_pod

        need = log_disk(run, files, trainer, block, f"Runpod target {target_ref!r}")
        written = need.total - need.base if need is not None else None  # in the run dir
        return await export_on_pod(runs, run, spec, trainer, target_ref, block, written)
    executor = block.executor(target_ref)
    try:
        log_disk(run, files, trainer, block, executor.description)
        await check_converter(executor, block.python)
        record = await create_export(exports, run, target_ref, block, spec)
        with follow_lock(exports.run_dir(record.id), flow_run.id):
            ctx = run_context(exports, block, executor, ExportReporter(logger, record))
            record = await start_job(ctx, trainer, record, block)
            outcome = await follow_export(ctx, trainer, record)
            return await _finish(exports, outcome, executor.description)
    finally:
        await executor.close()
