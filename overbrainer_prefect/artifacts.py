"""What a run shows in the Prefect UI: live progress while it trains, a table of
its metrics, and a summary of how it ended with its verified files."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any
from uuid import UUID

from prefect.artifacts import (
    acreate_markdown_artifact,
    acreate_progress_artifact,
    acreate_table_artifact,
    aupdate_progress_artifact,
)

from overbrainer_prefect.executors.base import FileDigest, JobStatus
from overbrainer_prefect.runs.ids import parse_rfc3339
from overbrainer_prefect.runs.metrics import Metric, MetricsSummary
from overbrainer_prefect.runs.store import RunRecord, RunState

PROGRESS_EVERY_S = 2.0  # the progress artifact is updated at most this often


@asynccontextmanager
async def live_progress(reporter: object) -> AsyncIterator[None]:
    """While the block runs, a `PrefectReporter`'s progress artifact is opened
    and pushed every second (and once more at the end); any other reporter
    is left as it is."""
    if not isinstance(reporter, PrefectReporter):
        yield
        return
    await reporter.open()

    async def pump() -> None:
        while True:
            await asyncio.sleep(1.0)
            await reporter.flush()

    pumping = asyncio.create_task(pump())
    try:
        yield
    finally:
        pumping.cancel()
        await reporter.flush(force=True)


def artifact_key(run_id: str, what: str) -> str:
    """An artifact key for a run (`run-20260922-143005-ab1c-metrics`): lowercase
    letters, digits and dashes, as Prefect requires."""
    return f"run-{run_id}-{what}".lower()


class PrefectReporter:
    """A `Reporter` that writes each metric to the flow run's log (step, loss,
    ETA) and keeps a progress artifact up to date."""

    def __init__(self, logger: logging.Logger | logging.LoggerAdapter[Any], run_id: str) -> None:
        self.logger = logger
        self.run_id = run_id
        self.progress_id: UUID | None = None
        self._pending: float | None = None
        self._last_update = 0.0

    async def open(self) -> None:
        """Creates the run's progress artifact at 0 %."""
        self.progress_id = await acreate_progress_artifact(
            progress=0.0,
            key=artifact_key(self.run_id, "progress"),
            description=f"Training progress of run {self.run_id}",
        )

    def metric(self, metric: Metric, summary: MetricsSummary) -> None:
        """Logs the step with its loss, learning rate and ETA; queues a progress update."""
        parts = [f"step {metric.step}" + (f"/{summary.max_steps}" if summary.max_steps else "")]
        if metric.loss is not None:
            parts.append(f"loss {metric.loss:.4f}")
        if metric.eval_loss is not None:
            parts.append(f"eval_loss {metric.eval_loss:.4f}")
        if metric.learning_rate is not None:
            parts.append(f"lr {metric.learning_rate:.2e}")
        eta = summary.eta_seconds()
        if eta is not None:
            parts.append(f"ETA {_duration(eta)}")
        self.logger.info("run %s: %s", self.run_id, ", ".join(parts))
        if summary.max_steps:
            self._pending = min(100.0, 100.0 * metric.step / summary.max_steps)

    def status(self, status: JobStatus) -> None:
        """Logs the job's new status."""
        self.logger.info("run %s: job %s", self.run_id, status)

    def warning(self, message: str) -> None:
        """Logs a warning."""
        self.logger.warning("%s", message)

    async def flush(self, force: bool = False) -> None:
        """Pushes the latest progress to its artifact (at most every PROGRESS_EVERY_S)."""
        if self.progress_id is None or self._pending is None:
            return
        if not force and time.monotonic() - self._last_update < PROGRESS_EVERY_S:
            return
        await aupdate_progress_artifact(artifact_id=self.progress_id, progress=self._pending)
        self._pending = None
        self._last_update = time.monotonic()


async def publish_metrics_table(run_id: str, summary: MetricsSummary) -> None:
    """A table artifact of every metric of the run, one row a step."""
    rows: list[dict[str, Any]] = [
        {
            "step": m.step,
            "loss": _finite(m.loss),
            "eval_loss": _finite(m.eval_loss),
            "learning_rate": _finite(m.learning_rate),
            "grad_norm": _finite(m.grad_norm),
            "epoch": _finite(m.epoch),
        }
        for m in summary.metrics
    ]
    await acreate_table_artifact(
        table=rows,
        key=artifact_key(run_id, "metrics"),
        description=f"Metrics of run {run_id}, one row a logged step",
    )


def summary_markdown(
    record: RunRecord,
    target_description: str,
    summary: MetricsSummary,
    files: Sequence[FileDigest],
    next_step: str,
) -> str:
    """The run summary: ID, target, state, duration, losses, each verified file
    with its size and SHA-256, and the command to run next."""
    lines = [
        f"# Run {record.id}",
        "",
        "| | |",
        "|---|---|",
        f"| state | **{record.state}** |",
        f"| target | {target_description} |",
        f"| created | {record.created} |",
        f"| duration | {_run_duration(record)} |",
        f"| steps | {summary.last.step if summary.last else 0}"
        + (f" / {summary.max_steps}" if summary.max_steps else "")
        + " |",
        f"| first loss | {_fmt(summary.first_loss)} |",
        f"| final loss | {_fmt(summary.final_loss)} |",
    ]
    if record.resumed_from is not None:
        lines.append(
            f"| resumed from | run {record.resumed_from.run_id}, {record.resumed_from.checkpoint} |"
        )
    if record.message:
        lines.append(f"| message | {_cell(record.message)} |")
    lines += ["", f"## Files ({len(files)}, verified by SHA-256)", ""]
    if files:
        lines += ["| file | size | SHA-256 |", "|---|---:|---|"]
        lines += [f"| `{f.path}` | {_size(f.size)} | `{f.sha256}` |" for f in files]
    else:
        lines.append("No file was retrieved.")
    lines += ["", "## Next", "", next_step, ""]
    return "\n".join(lines)


async def publish_summary(run_id: str, markdown: str) -> None:
    """The run summary as a markdown artifact."""
    await acreate_markdown_artifact(
        markdown=markdown,
        key=artifact_key(run_id, "summary"),
        description=f"Summary of run {run_id}",
    )


def next_step(record: RunRecord) -> str:
    """What to run next for a run, as the summary and messages say it."""
    if record.state == RunState.STOPPED:
        return f"Resume it: run the `train` flow with `resume_from={record.id}`."
    if record.state in (RunState.RUNNING, RunState.PREPARING):
        return f"Follow it again: run the `attach` flow with `run_id={record.id}`."
    if record.state == RunState.SUCCEEDED:
        return f"Its files are in `runs/{record.id}/`; export it with the `export` flow."
    return f"See `runs/{record.id}/job.log`, fix the cause, and start a new run."


def _run_duration(record: RunRecord) -> str:
    if not record.started:
        return "-"
    start = parse_rfc3339(record.started)
    end = parse_rfc3339(record.ended) if record.ended else None
    return _duration((end - start).total_seconds()) if end else "running"


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def _size(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{size} B"


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
