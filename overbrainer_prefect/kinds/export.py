"""A run's export: its model merged, converted to GGUF and quantized on a
target, `<run dir>/exports/<id>/export.json`. What it asks (`ExportSpec`),
whether a run can be exported, a finished or running export found for reuse,
its result (what the export flow returns and Prefect persists) and its
summary, and how its trainer is made again from its record."""

from __future__ import annotations

from pydantic import Field, JsonValue

from overbrainer_prefect.cells import size_text, table_cell
from overbrainer_prefect.executors.base import Executor, FileDigest
from overbrainer_prefect.kinds.base import Check, ChildResult, JobKind, NewJob, child_next_step
from overbrainer_prefect.kinds.files import FileEntry
from overbrainer_prefect.runs.manifest import load_manifest, stored_wrong
from overbrainer_prefect.runs.store import RunRecord, Runs, RunState, local_path, subject
from overbrainer_prefect.sizing import DiskJob, export_disk
from overbrainer_prefect.steps.errors import RunError
from overbrainer_prefect.store.records import RecordError
from overbrainer_prefect.targets.base import JobNeed, Logger
from overbrainer_prefect.timestamps import parse_rfc3339
from overbrainer_prefect.trainers.base import METRICS_FILE, Trainer, TrainError
from overbrainer_prefect.trainers.export import (
    CONFIG_FILE,
    GGUF_DIR,
    OUTPUT_DIR,
    ExportSpec,
    ExportTrainer,
    converter_path,
    is_lora,
    model_files,
    phases,
    run_config,
)

NAME = "export"
"""An export's records: `<run dir>/exports/<id>/export.json` (a base model's:
`.bases/<key>/exports/<id>/export.json`)."""


class ExportResult(ChildResult):
    """What the export flow returns (and Prefect persists): the export, and its GGUF."""

    export_id: str
    quant: str
    gguf: FileEntry | None = Field(
        default=None, description="The GGUF, its path relative to the export directory."
    )
    gguf_path: str | None = Field(default=None, description="The GGUF on this machine.")
    phases: dict[str, float] = Field(
        default_factory=dict, description="Seconds of each step: merge, convert, quantize."
    )
    export_dir: str


def gguf_entry(files: list[FileDigest]) -> FileDigest | None:
    """The GGUF among an export's retrieved files."""
    return next(
        (f for f in files if f.path.startswith(f"{GGUF_DIR}/") and f.path.endswith(".gguf")), None
    )


def result_of(
    exports: Runs, record: RunRecord, files: list[FileDigest], *, reused: bool = False
) -> ExportResult:
    """The flow's result for the export `record`, from its retrieved `files` and
    its stored metrics file."""
    try:
        timings = phases(exports.read_text(record.id, METRICS_FILE))
    except (OSError, RecordError):
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
        gguf=FileEntry.of(entry) if entry else None,
        gguf_path=exports.where_of(record.id, entry.path) if entry else None,
        phases=timings,
        files=[FileEntry.of(f) for f in files],
        export_dir=exports.where_of(record.id),
        next=child_next_step(
            record,
            f"The GGUF is in `{local_path(record)}/{GGUF_DIR}/`; deliver it to Ollama or the "
            "Hugging Face Hub with the delivery flows.",
            "export again",
        ),
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
            f"| size | {size_text(result.gguf.size)} |",
            f"| SHA-256 | `{result.gguf.sha256}` |",
        ]
    for name in ("merge", "convert", "quantize"):
        if name in result.phases:
            lines.append(f"| {name} | {result.phases[name]:.1f} s |")
    if result.message:
        lines.append(f"| message | {table_cell(result.message)} |")
    lines += ["", f"## Files ({len(result.files)}, verified by SHA-256)", ""]
    if result.files:
        lines += ["| file | size | SHA-256 |", "|---|---:|---|"]
        lines += [f"| `{f.path}` | {size_text(f.size)} | `{f.sha256}` |" for f in result.files]
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
            f"| `exports/{result.export_id}/{result.gguf.path}` | {size_text(result.gguf.size)} "
            f"| `{result.gguf.sha256}` |",
            "",
        ]
    )


def _duration(record: RunRecord) -> str:
    if not record.started or not record.ended:
        return "-"
    seconds = (parse_rfc3339(record.ended) - parse_rfc3339(record.started)).total_seconds()
    return f"{seconds:.0f} s"


class NotExportable(RunError):
    """A run that cannot be exported as it is; nothing was started. One line."""


def check_exportable(runs: Runs, run: RunRecord) -> list[FileDigest]:
    """The files of a run's model, once the run is found exportable: succeeded, its
    files retrieved, its model (the top-level files of `output/`) and, for a LoRA,
    its `axolotl.yaml` present in its store and matching the SHA-256 manifest they
    were retrieved with.

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
    if run.not_retrieved is not None:
        raise NotExportable(
            f"the files of run {run.id} were not retrieved: retrieve them with the attach flow "
            f"(run_id={run.id}), then export it"
        )
    manifest = {entry.path: entry for entry in load_manifest(runs, run.id)}
    for rel, entry in manifest.items():
        top_level_model = rel.startswith(f"{OUTPUT_DIR}/") and rel.count("/") == 1
        if (top_level_model or rel == CONFIG_FILE) and (
            wrong := stored_wrong(runs, run.id, entry)
        ) is not None:
            raise NotExportable(f"{where}/{rel} {wrong}: restore it, or train the run again")
    try:
        files = model_files(runs, run.id)
    except TrainError:
        raise NotExportable(
            f"run {run.id} has no model in {where}/{OUTPUT_DIR}/ (no adapter_config.json, no "
            "config.json): only a run that saved its model can be exported"
        ) from None
    if is_lora(runs, run.id) and run_config(runs, run.id) is None:
        raise NotExportable(
            f"{where}/{CONFIG_FILE} is missing: the LoRA of run {run.id} cannot be merged "
            "without the base model it names"
        )
    return files


def reusable(exports: Runs, quant: str) -> RunRecord | None:
    """The latest succeeded export of `quant` whose GGUF is in its store, as
    retrieved (its size checked; delivery hashes it again before it leaves), or None."""
    found: list[RunRecord] = []
    for record in exports.list(skipped=lambda _name, _error: None):
        if record.state != RunState.SUCCEEDED or record.not_retrieved is not None:
            continue
        if str((record.spec or {}).get("quant", "")).lower() != quant:
            continue
        entry = gguf_entry(load_manifest(exports, record.id))
        if entry is not None and _has_size(exports, record.id, entry):
            found.append(record)
    return max(found, key=lambda r: (r.ended or r.created, r.id)) if found else None


def _has_size(store: Runs, record_id: str, entry: FileDigest) -> bool:
    try:
        info = store.store.head(store.key(record_id, entry.path))
    except Exception:  # a store that cannot say: not reusable
        return False
    return info is not None and info.size == entry.size


def running(exports: Runs, quant: str) -> RunRecord | None:
    """An export of `quant` whose job runs (or ran unwatched) now, if any."""
    for record in exports.list(skipped=lambda _name, _error: None):
        same = str((record.spec or {}).get("quant", "")).lower() == quant
        if same and record.state == RunState.RUNNING and record.job is not None:
            return record
    return None


def _rebuild(runs: Runs, record: RunRecord, cpu_threads: int | None) -> Trainer:
    assert record.parent is not None  # a child kind
    run = runs.load(record.parent)
    return ExportTrainer(run, runs, ExportSpec.model_validate(record.spec), cpu_threads=cpu_threads)


KIND = JobKind(name=NAME, child=True, rebuild=_rebuild)
"""A run's export: `<run dir>/exports/<id>/export.json`."""


def check_converter(python: str) -> Check:
    """The check, before an export's job starts, that its machine has
    llama.cpp's converter in the job venv of `python`: it raises TrainError with
    one line when the converter is not there (ExecError when the machine cannot
    be reached)."""

    async def check(executor: Executor) -> None:
        path = converter_path(python)
        result = await executor.run(["test", "-f", path], timeout=60)
        if result.code != 0:
            venv = path.rsplit("/share/", 1)[0]
            raise TrainError(
                f"llama.cpp's converter is not at {path} on {executor.description}: install "
                f"the export tools with `scripts/job-env.sh {venv}` there"
            )

    return check


def export_job(
    store: Runs,
    trainer: Trainer,
    spec: dict[str, JsonValue],
    model: str,
    python: str,
    *,
    what: str,
    parent: str | None,
    subdir: str,
    disk_bytes: int | None = None,
    disk: DiskJob | None = None,
) -> NewJob:
    """The new job of an export (of a run's model, or of a base model) by
    `trainer`, whose merge loads `model` and which writes `disk` on its
    machine: its machine checked for the converter."""
    return NewJob(
        store=store,
        need=JobNeed(what=what, merge_model=model, disk_bytes=disk_bytes, disk=disk),
        kind=NAME,
        prepare=lambda _record: trainer,
        spec=spec,
        parent=parent,
        subdir=subdir,
        check=check_converter(python),
    )


def run_export(
    runs: Runs,
    run: RunRecord,
    spec: ExportSpec,
    python: str,
    cpu_threads: int | None,
    logger: Logger,
) -> NewJob:
    """The new export of the model of `run` (checked exportable) to `spec`'s
    quant, on a target whose job venv runs `python`; logs the disk it needs
    (base, merged copy, GGUF) when it can be sized here."""
    trainer = ExportTrainer(run, runs, spec, cpu_threads=cpu_threads)
    output = runs.store.local_path(runs.key(run.id, OUTPUT_DIR))
    merged = trainer.base_model or (str(output) if output is not None else None)
    full = trainer.base_model is None  # full weights: staged as they are, nothing merged
    need = export_disk(output, trainer.base_model, spec.quant) if output is not None else None
    if need is None:
        logger.info(
            "run %s: cannot estimate the disk of its export (its model or its base model %s "
            "is not a directory here)",
            run.id,
            trainer.base_model,
        )
    else:
        logger.info("run %s: %s", run.id, need.describe())
    return export_job(
        runs.children(run.id, NAME),
        trainer,
        spec.model_dump(mode="json"),
        trainer.base_model or runs.where_of(run.id, OUTPUT_DIR),  # full weights: no merge
        python,
        what=f"the {spec.quant} export of run {run.id}",
        parent=run.id,
        subdir="exports",
        disk_bytes=need.total - need.base if need is not None else None,  # in the run dir
        disk=DiskJob(
            "export", model=merged, quant=spec.quant, full=full, keep=spec.keep_intermediate
        )
        if merged
        else None,
    )


def reused_export(exports: Runs, run_id: str, quant: str) -> tuple[RunRecord, ExportResult] | None:
    """The latest succeeded export of `quant` whose GGUF is here and its result
    (`reused`), None when there is none. Raises NotExportable with one line
    when an export of `quant` is running now (follow that one)."""
    done = reusable(exports, quant)
    if done is not None:
        result = result_of(exports, done, load_manifest(exports, done.id))
        result.reused = True
        return done, result
    busy = running(exports, quant)
    if busy is not None:
        raise NotExportable(
            f"{subject(busy)} ({quant}) is already running: follow it with the export flow "
            f"(run_id={run_id}, export_id={busy.id})"
        )
    return None


def result_line(result: ExportResult, record: RunRecord) -> str:
    """The line an ended export is logged with: its GGUF, size, SHA-256 and
    phases, and what to do next."""
    steps = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in result.phases.items())
    if result.gguf is None:
        return f"{subject(record)} {record.state}. {result.next}"
    return (
        f"{subject(record)} {record.state}{' (reused)' if result.reused else ''}: "
        f"{result.gguf.path} ({size_text(result.gguf.size)}, sha256 {result.gguf.sha256})"
        f"{f'; {steps}' if steps else ''}. {result.next}"
    )
