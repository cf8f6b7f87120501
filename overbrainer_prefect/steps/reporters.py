"""Where a job's progress goes: the `Reporter` protocol, a reporter that only
logs, and one for jobs that are not training runs."""

from __future__ import annotations

import logging
from typing import Protocol

from overbrainer_prefect.executors.base import (
    JobStatus,
)
from overbrainer_prefect.runs.metrics import Metric, MetricsSummary

log = logging.getLogger(__name__)


class Reporter(Protocol):
    """Where a run's progress goes (Prefect logs and artifacts, or a test's list)."""

    def metric(self, metric: Metric, summary: MetricsSummary) -> None:
        """A new metric line was read."""
        ...

    def status(self, status: JobStatus) -> None:
        """The job's status changed."""
        ...

    def warning(self, message: str) -> None:
        """Something the user should know (a retry, a stall, a job past its bound)."""
        ...

    def note(self, message: str) -> None:
        """A step the run made that the user may want to know (a checkpoint kept)."""
        ...


class LogReporter:
    """A `Reporter` that only logs, for callers with nothing to publish to."""

    def metric(self, metric: Metric, summary: MetricsSummary) -> None:
        """Logs the step and its loss."""
        log.info("step %s/%s loss %s", metric.step, summary.max_steps, metric.loss)

    def status(self, status: JobStatus) -> None:
        """Logs the status."""
        log.info("job %s", status)

    def warning(self, message: str) -> None:
        """Logs the warning."""
        log.warning("%s", message)

    def note(self, message: str) -> None:
        """Logs the note."""
        log.info("%s", message)


class JobReporter:
    """A `Reporter` for a job that is not a training run (an export, a
    compare): its status and warnings in the flow's log, named by `name`."""

    def __init__(
        self, logger: logging.Logger | logging.LoggerAdapter[logging.Logger], name: str
    ) -> None:
        self.logger = logger
        self.name = name

    def metric(self, metric: Metric, summary: MetricsSummary) -> None:
        """Logs a step (a compare's or an evaluation's answer), of how many."""
        of = f"/{summary.max_steps}" if summary.max_steps else ""
        self.logger.info("%s: step %s%s", self.name, metric.step, of)

    def status(self, status: JobStatus) -> None:
        """Logs the job's new status."""
        self.logger.info("%s: job %s", self.name, status)

    def warning(self, message: str) -> None:
        """Logs a warning."""
        self.logger.warning("%s", message)

    def note(self, message: str) -> None:
        """Logs a note."""
        self.logger.info("%s", message)
