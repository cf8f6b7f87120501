"""What an export's outcome says: its result (what the export flow returns and
Prefect persists), built from its record and retrieved files, and its summary."""

from __future__ import annotations

from pydantic import BaseModel, Field

from overbrainer_prefect.cells import size_text, table_cell
from overbrainer_prefect.executors.base import FileDigest
from overbrainer_prefect.reports.files import FileEntry
from overbrainer_prefect.runs.ids import parse_rfc3339
from overbrainer_prefect.runs.store import RunRecord, Runs, RunState, local_path
from overbrainer_prefect.trainers.export import GGUF_DIR, phases


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


def gguf_entry(files: list[FileDigest]) -> FileDigest | None:
    """The GGUF among an export's retrieved files."""
    return next(
        (f for f in files if f.path.startswith(f"{GGUF_DIR}/") and f.path.endswith(".gguf")), None
    )


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
        gguf=FileEntry.of(entry) if entry else None,
        gguf_path=str(local / entry.path) if entry else None,
        phases=timings,
        files=[FileEntry.of(f) for f in files],
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
