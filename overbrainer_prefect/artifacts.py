"""What a run shows in the Prefect UI: live progress while it trains, a table of
its metrics, and a summary of how it ended with its verified files."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from uuid import UUID

from prefect.artifacts import (
    acreate_markdown_artifact,
    acreate_progress_artifact,
    acreate_table_artifact,
    aupdate_progress_artifact,
)
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import ArtifactUpdate

from overbrainer_prefect.cells import (
    _duration,
    code_cell,
    run_duration,
    sci,
    sig,
    size_text,
    table_cell,
)
from overbrainer_prefect.executors.base import FileDigest, JobStatus
from overbrainer_prefect.losscurve import data_uri, loss_svg
from overbrainer_prefect.runs.metrics import Metric, MetricsSummary
from overbrainer_prefect.runs.store import RunRecord, Runs

PROGRESS_EVERY_S = 2.0  # the progress artifact is updated at most this often
CURVE_EVERY_S = 10.0  # the loss curve artifact is redrawn at most this often
PUMP_EVERY_S = 1.0  # how often a live run's artifacts are looked at (each at its own pace above)
LOG_EVERY_PERCENT = 10.0  # a progress line each time training passes another 10 %...
LOG_EVERY_S = 60.0  # ...or a minute after the last one, whichever comes first
JOB_LOG_EVERY_S = 30.0  # how often the job's log is read for the warnings that matter
LIVE_UPDATES_PER_S = 10.0
"""Progress artifacts a process updates per second at most, all its live runs
together: a follower of a hundred trainings updates each every 10 s, not 2 s,
and its Prefect server is not kept busy with them."""
LIVE_CURVES_PER_S = 1.0
"""Loss curves a process redraws per second at most, all its live runs together."""


class _Live:
    """How many runs' artifacts this process keeps live now (`live_progress`)."""

    runs = 0


def paced(every_s: float, per_s: float) -> float:
    """How often one live run's artifact is updated: every `every_s`, or less
    often when this process keeps so many live that all of them together
    would be updated more than `per_s` times a second."""
    return max(every_s, _Live.runs / per_s)


Spend = float | Callable[[], float | None] | None
"""Dollars spent so far on a run's pod: a value, a function that tells it now, or none."""

JobLog = Callable[[], Awaitable[str]]
"""Reads (the end of) a job's log, as `steps.follow.job_log_tail` does."""

NearEnd = Callable[[float], Awaitable[object]]
"""Called once with the seconds left when a training is that near its end."""

LIVE_ARTIFACTS_FILE = "prefect-artifacts.json"
"""In a job's run directory: the IDs of its live artifacts (progress, loss
curve), kept by a flow run that suspends, so that its follower updates them."""


@dataclass(frozen=True)
class NotableWarning:
    """A line of a job's log that a person should see in the flow's log, once:
    the pattern that finds it and what to tell them (`{0}`, `{1}`... its groups)."""

    pattern: re.Pattern[str]
    message: str


NOTABLE_WARNINGS: tuple[NotableWarning, ...] = (
    NotableWarning(
        re.compile(r"increasing model\.config\.max_position_embeddings from (\d+) to (\d+)"),
        "the job raised the model's max_position_embeddings from {0} to {1} (axolotl does "
        "this when sequence_len is longer than the base model's context): positions past {0} "
        "were never trained in the base model; lower sequence_len to {0} unless you mean to "
        "train a longer context",
    ),
)
"""The warnings of a job's own log (axolotl, transformers) surfaced in the flow's log."""


def notable_warnings(log_text: str) -> list[tuple[str, str]]:
    """The notable warnings found in `log_text`, each once, in the order they first
    appear: (the pattern that found it, what to tell the user)."""
    found: list[tuple[int, str, str]] = []
    for warning in NOTABLE_WARNINGS:
        match = warning.pattern.search(log_text)
        if match is not None:
            found.append(
                (match.start(), warning.pattern.pattern, warning.message.format(*match.groups()))
            )
    return [(pattern, message) for _, pattern, message in sorted(found)]


@asynccontextmanager
async def live_progress(reporter: object) -> AsyncIterator[None]:
    """While the block runs, a `PrefectReporter`'s progress and loss curve
    artifacts are opened and pushed (at their pace, and once more at the end),
    and its job log is read for the warnings that matter; any other reporter
    is left as it is."""
    if not isinstance(reporter, PrefectReporter):
        yield
        return
    await reporter.open()
    updating = asyncio.Lock()
    _Live.runs += 1

    async def pump() -> None:
        while True:
            await asyncio.sleep(PUMP_EVERY_S)
            async with updating:
                await reporter.flush()
                await reporter.scan_job_log()
            await reporter.near_end_check()

    pumping = asyncio.create_task(pump())
    try:
        yield
    finally:
        _Live.runs -= 1
        # the pump is cancelled between two updates, never in one: a cancelled
        # request may still reach the server after the last one, and a finished
        # run would then show the progress of a moment before its end
        async with updating:
            pumping.cancel()
        await asyncio.gather(pumping, return_exceptions=True)
        await reporter.scan_job_log(force=True)
        await reporter.flush(force=True)


def artifact_key(run_id: str, what: str) -> str:
    """An artifact key for a run (`run-20260922-143005-ab1c-metrics`): lowercase
    letters, digits and dashes, as Prefect requires."""
    return f"run-{run_id}-{what}".lower()


class PrefectReporter:
    """A `Reporter` that writes a run's progress to the flow run's log at a pace a
    person follows (a line every `log_every_percent` % of the steps or every
    `log_every_s` seconds, whichever comes first; the first, the last and every
    eval always), and keeps two artifacts up to date: a progress bar, and the loss
    curve (a picture of loss and eval loss against step, with the learning rate
    and, given `spend`, the dollars spent so far), redrawn every `curve_every_s`.

    With `job_log` (a function reading the end of the job's log), the warnings of
    NOTABLE_WARNINGS found there are logged, each once. With `near_end`, it is
    called once when the training's ETA (its pace to `max_steps`) is at most
    `near_end_s`."""

    def __init__(
        self,
        logger: logging.Logger | logging.LoggerAdapter[logging.Logger],
        run_id: str,
        *,
        log_every_percent: float = LOG_EVERY_PERCENT,
        log_every_s: float = LOG_EVERY_S,
        curve_every_s: float = CURVE_EVERY_S,
        spend: Spend = None,
        job_log: JobLog | None = None,
        artifact_ids: tuple[UUID, UUID] | None = None,
        near_end: NearEnd | None = None,
        near_end_s: float = 0.0,
    ) -> None:
        self.logger = logger
        self.near_end = near_end
        self.near_end_s = near_end_s
        self.run_id = run_id
        self.log_every_percent = log_every_percent
        self.log_every_s = log_every_s
        self.curve_every_s = curve_every_s
        self.spend = spend
        self.job_log = job_log
        self.progress_id: UUID | None = artifact_ids[0] if artifact_ids else None
        self.curve_id: UUID | None = artifact_ids[1] if artifact_ids else None
        self._pending: float | None = None
        self._last_update = 0.0
        self._summary: MetricsSummary | None = None
        self._curve_dirty = False
        self._last_curve = 0.0
        self._last_line: float | None = None
        self._last_bucket = -1
        self._last_scan = 0.0
        self._surfaced: set[str] = set()
        self._artifact_failed = False

    async def open(self) -> None:
        """Creates the run's progress artifact at 0 % and its loss curve (empty
        until a loss is logged), in this flow run; artifacts it was given (a
        suspended flow run's) are updated instead."""
        if self.progress_id is not None and self.curve_id is not None:
            self._last_curve = time.monotonic()
            return
        self.progress_id = await acreate_progress_artifact(
            progress=0.0,
            key=artifact_key(self.run_id, "progress"),
            description=f"Training progress of run {self.run_id}",
        )
        self.curve_id = await acreate_markdown_artifact(
            markdown=curve_markdown(self.run_id, self._summary or MetricsSummary(), self.spent()),
            key=artifact_key(self.run_id, "loss-curve"),
            description=f"Loss curve of run {self.run_id}, redrawn while it trains",
        )
        self._last_curve = time.monotonic()

    def metric(self, metric: Metric, summary: MetricsSummary) -> None:
        """Notes the step for the artifacts; logs it (step, loss, eval loss,
        learning rate, ETA) when a line is due."""
        self._summary = summary
        self._curve_dirty = True
        if summary.max_steps:
            self._pending = min(100.0, 100.0 * metric.step / summary.max_steps)
        if self._line_due(metric, summary):
            self.logger.info(
                "run %s: %s", self.run_id, progress_line(metric, summary, self.spent())
            )

    def _line_due(self, metric: Metric, summary: MetricsSummary) -> bool:
        now = time.monotonic()
        bucket = -1
        if summary.max_steps and self.log_every_percent > 0:
            bucket = int(100.0 * metric.step / summary.max_steps // self.log_every_percent)
        due = (
            self._last_line is None
            or metric.eval_loss is not None
            or (summary.max_steps is not None and metric.step >= summary.max_steps)
            or bucket > self._last_bucket
            or now - self._last_line >= self.log_every_s
        )
        if due:
            self._last_line = now
            self._last_bucket = max(self._last_bucket, bucket)
        return due

    def status(self, status: JobStatus) -> None:
        """Logs the job's new status."""
        self.logger.info("run %s: job %s", self.run_id, status)

    def warning(self, message: str) -> None:
        """Logs a warning."""
        self.logger.warning("%s", message)

    def note(self, message: str) -> None:
        """Logs a note (a checkpoint kept)."""
        self.logger.info("%s", message)

    def spent(self) -> float | None:
        """The dollars spent so far, when a spend was given and is known."""
        if self.spend is None or isinstance(self.spend, float | int):
            return None if self.spend is None else float(self.spend)
        try:
            return self.spend()
        except Exception:  # a spend that cannot be told now is shown as unknown
            return None

    def surface(self, log_text: str) -> list[str]:
        """Logs the notable warnings of `log_text` not logged before; returns them."""
        new = []
        for pattern, message in notable_warnings(log_text):
            if pattern not in self._surfaced:
                self._surfaced.add(pattern)
                self.logger.warning("run %s: %s", self.run_id, message)
                new.append(message)
        return new

    async def near_end_check(self) -> None:
        """Calls `near_end` (once) when the training's ETA is at most
        `near_end_s`; what it raises is logged, never raised."""
        summary = self._summary
        eta = summary.eta_seconds() if summary is not None else None
        if self.near_end is None or eta is None or eta > self.near_end_s:
            return
        near_end, self.near_end = self.near_end, None
        try:
            await near_end(eta)
        except Exception as error:
            self.logger.warning("run %s: %s", self.run_id, error)

    async def scan_job_log(self, force: bool = False) -> None:
        """Reads the job's log (at most every JOB_LOG_EVERY_S) for notable
        warnings; a log that cannot be read is tried again later."""
        if self.job_log is None or len(self._surfaced) == len(NOTABLE_WARNINGS):
            return
        if not force and time.monotonic() - self._last_scan < JOB_LOG_EVERY_S:
            return
        self._last_scan = time.monotonic()
        try:
            text = await self.job_log()
        except Exception:  # the target may be busy or gone; the job's own log keeps it
            return
        self.surface(text)

    async def flush(self, force: bool = False) -> None:
        """Pushes the latest progress to its artifact (at most every
        PROGRESS_EVERY_S) and redraws the loss curve (at most every
        `curve_every_s`), each less often when this process keeps many runs
        live (`paced`). An artifact the API refuses is reported once in the
        log, and never fails the run."""
        try:
            await self._flush_progress(force)
            await self._flush_curve(force)
        except Exception as error:
            if not self._artifact_failed:
                self._artifact_failed = True
                self.logger.warning("run %s: cannot update its artifacts: %s", self.run_id, error)

    async def _flush_progress(self, force: bool) -> None:
        if self.progress_id is None:
            return
        progress = self._pending
        if force:  # the last word is the last step's, whatever an earlier update left
            progress = self._progress_now()
        if progress is None:
            return
        every_s = paced(PROGRESS_EVERY_S, LIVE_UPDATES_PER_S)
        if not force and time.monotonic() - self._last_update < every_s:
            return
        await aupdate_progress_artifact(artifact_id=self.progress_id, progress=progress)
        self._pending = None
        self._last_update = time.monotonic()

    def _progress_now(self) -> float | None:
        """The progress of the last step seen, in percent (None before any)."""
        summary = self._summary
        if summary is None or not summary.metrics or not summary.max_steps:
            return self._pending
        return min(100.0, 100.0 * summary.metrics[-1].step / summary.max_steps)

    async def _flush_curve(self, force: bool) -> None:
        if self.curve_id is None or self._summary is None:
            return
        if not (self._curve_dirty or (force and self.spend is not None)):
            return
        every_s = paced(self.curve_every_s, LIVE_CURVES_PER_S)
        if not force and time.monotonic() - self._last_curve < every_s:
            return
        markdown = curve_markdown(self.run_id, self._summary, self.spent())
        async with get_client() as client:
            await client.update_artifact(self.curve_id, ArtifactUpdate(data=markdown))
        self._curve_dirty = False
        self._last_curve = time.monotonic()


def remember_live_artifacts(store: Runs, run_id: str, reporter: PrefectReporter) -> None:
    """Keeps the IDs of `reporter`'s opened artifacts in the job's run
    directory (LIVE_ARTIFACTS_FILE). Raises RecordIoError."""
    ids = {"progress": str(reporter.progress_id), "curve": str(reporter.curve_id)}
    store.write_bytes(run_id, LIVE_ARTIFACTS_FILE, json.dumps(ids).encode())


def live_artifacts_of(store: Runs, run_id: str) -> tuple[UUID, UUID] | None:
    """The IDs of the live artifacts a suspended flow run kept for the job
    `run_id` (progress, loss curve), None when it kept none or they cannot be read."""
    try:
        ids = json.loads(store.read_bytes(run_id, LIVE_ARTIFACTS_FILE))
        return UUID(ids["progress"]), UUID(ids["curve"])
    except Exception:  # none kept (an in-process run), or unreadable: new ones are made
        return None


def progress_line(metric: Metric, summary: MetricsSummary, spent: float | None = None) -> str:
    """`step 12/30 (40 %), loss 1.234, lr 2.00e-04, ETA 0:42, $0.12 spent`."""
    step = f"step {metric.step}"
    if summary.max_steps:
        step += f"/{summary.max_steps} ({100 * metric.step / summary.max_steps:.0f} %)"
    parts = [step]
    if metric.loss is not None:
        parts.append(f"loss {sig(metric.loss)}")
    if metric.eval_loss is not None:
        parts.append(f"eval_loss {sig(metric.eval_loss)}")
    if metric.learning_rate is not None:
        parts.append(f"lr {sci(metric.learning_rate)}")
    eta = summary.eta_seconds()
    if eta is not None:
        parts.append(f"ETA {_duration(eta)}")
    if spent is not None:
        parts.append(f"${spent:.2f} spent")
    return ", ".join(parts)


def curve_markdown(run_id: str, summary: MetricsSummary, spent: float | None = None) -> str:
    """The loss curve artifact: a picture of loss (and eval loss) against step,
    carried as a `data:` URI SVG the Prefect UI renders as an image, and a line
    with the latest step, losses, learning rate and, on a pod, the dollars spent."""
    last = summary.last
    steps = "-" if last is None else str(last.step)
    if summary.max_steps:
        steps += f" / {summary.max_steps}"
    latest_eval = next(
        (m.eval_loss for m in reversed(summary.metrics) if m.eval_loss is not None), None
    )
    title = f"run {run_id}: loss against step"
    svg = loss_svg(summary.metrics, summary.max_steps, title)
    lines = [
        f"# Loss of run {run_id}",
        "",
        f"![loss against step of run {run_id}]({data_uri(svg)})",
        "",
        "| step | loss | eval loss | learning rate | spent so far |",
        "|---:|---:|---:|---:|---:|",
        f"| {steps} | {_fmt(summary.final_loss)} | {_fmt(latest_eval)} "
        f"| {sci(last.learning_rate) if last is not None else '-'} "
        f"| {'-' if spent is None else f'${spent:.2f}'} |",
        "",
    ]
    return "\n".join(lines)


async def publish_metrics_table(run_id: str, summary: MetricsSummary) -> None:
    """A table artifact of every metric of the run, one row a step, rounded to
    what a person reads: 4 significant digits for losses and the gradient norm,
    the learning rate in scientific notation, the epoch to 3 decimals."""
    await acreate_table_artifact(
        table=metric_rows(summary),
        key=artifact_key(run_id, "metrics"),
        description=f"Metrics of run {run_id}, one row a logged step",
    )


def metric_rows(summary: MetricsSummary) -> list[dict[str, float | str | None]]:
    """The rows of the metrics table: step, loss, eval_loss, learning_rate,
    grad_norm and epoch of each metric, rounded (None where not measured)."""
    return [
        {
            "step": m.step,
            "loss": round_sig(m.loss),
            "eval_loss": round_sig(m.eval_loss),
            "learning_rate": sci(m.learning_rate) if _finite(m.learning_rate) is not None else None,
            "grad_norm": round_sig(m.grad_norm),
            "epoch": _round(m.epoch, 3),
        }
        for m in summary.metrics
    ]


def round_sig(value: float | None, digits: int = 4) -> float | None:
    """`value` rounded to `digits` significant digits (5.776554 -> 5.777); None
    for None, NaN or infinity."""
    finite = _finite(value)
    return None if finite is None else float(f"{finite:.{digits}g}")


def summary_markdown(
    record: RunRecord,
    target_description: str,
    summary: MetricsSummary,
    files: Sequence[FileDigest],
    next_step: str,
    dollars: float | None = None,
) -> str:
    """The run summary: ID, target, state, duration, what its pod cost
    (`dollars`, when it ran on one), losses, each verified file with its size
    and SHA-256, and the command to run next."""
    lines = [
        f"# Run {record.id}",
        "",
        "| | |",
        "|---|---|",
        f"| state | **{record.state}** |",
        f"| target | {table_cell(target_description)} |",
        f"| created | {record.created} |",
        f"| duration | {run_duration(record)} |",
        *(
            [f"| dollars | ${dollars:.4f} (its pod: rate × uptime) |"]
            if dollars is not None
            else []
        ),
        f"| steps | {summary.last.step if summary.last else 0}"
        + (f" / {summary.max_steps}" if summary.max_steps else "")
        + " |",
        f"| first loss | {_fmt(summary.first_loss)} |",
        f"| final loss | {_fmt(summary.final_loss)} |",
    ]
    if summary.final_eval_loss is not None:
        lines.append(f"| final eval loss | {_fmt(summary.final_eval_loss)} |")
    if summary.launch is not None:
        lines.append(f"| trained by | {summary.launch} |")
    if record.resumed_from is not None:
        lines.append(
            f"| resumed from | run {record.resumed_from.run_id}, {record.resumed_from.checkpoint} |"
        )
    if record.message:
        lines.append(f"| message | {table_cell(record.message)} |")
    lines += ["", f"## Files ({len(files)}, verified by SHA-256)", ""]
    if files:
        lines += ["| file | size | SHA-256 |", "|---|---:|---|"]
        lines += [f"| {code_cell(f.path)} | {size_text(f.size)} | `{f.sha256}` |" for f in files]
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


def _fmt(value: float | None) -> str:
    return "-" if value is None else sig(value)


def _round(value: float | None, decimals: int) -> float | None:
    finite = _finite(value)
    return None if finite is None else round(finite, decimals)


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None
