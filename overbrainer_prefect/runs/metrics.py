"""The metrics a job appends to `metrics.jsonl`, one JSON object a line, and
what they add up to: the steps, the losses, whether the job stopped on request
and where its checkpoint is."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from overbrainer_prefect.runs.store import Runs
from overbrainer_prefect.store.records import RecordError


@dataclass(frozen=True)
class Metric:
    """One `log` event: a training step and what was measured at it."""

    step: int
    loss: float | None = None
    eval_loss: float | None = None
    learning_rate: float | None = None
    grad_norm: float | None = None
    epoch: float | None = None
    max_steps: int | None = None
    time: float | None = None


@dataclass
class MetricsSummary:
    """What the metric lines of a run add up to. Lines that are not JSON objects
    (a line cut by a crash, a stray print) are counted apart and otherwise ignored."""

    lines: int = 0
    """Valid metric lines seen, of any event."""
    invalid: int = 0
    metrics: list[Metric] = field(default_factory=list)
    max_steps: int | None = None
    begin_time: float | None = None
    last_time: float | None = None
    ended: bool = False
    stopped: bool = False
    checkpoint: str | None = None
    """The checkpoint a stopped job saved, relative to its run directory."""
    end_step: int | None = None
    processes: int | None = None
    """How many processes trained (the begin event), None when it does not say."""
    gpus: int | None = None
    """On how many GPUs (0: the CPU), None when the begin event does not say."""

    def add(self, line: str) -> Metric | None:
        """Adds one line of the metrics file; returns the `Metric` it holds, if any."""
        try:
            event = json.loads(line)
        except ValueError:
            self.invalid += 1
            return None
        if not isinstance(event, dict):
            self.invalid += 1
            return None
        self.lines += 1
        when = _number(event.get("time"))
        if when is not None:
            self.last_time = when
        kind = event.get("event", "log")
        if _int(event.get("max_steps")) is not None:
            self.max_steps = _int(event.get("max_steps"))
        if kind == "begin":
            self.begin_time = when
            self.processes = _int(event.get("processes"))
            self.gpus = _int(event.get("gpus"))
            return None
        if kind == "end":
            self.ended = True
            self.stopped = bool(event.get("stopped"))
            checkpoint = event.get("checkpoint")
            self.checkpoint = checkpoint if isinstance(checkpoint, str) else None
            self.end_step = _int(event.get("step"))
            return None
        step = _int(event.get("step"))
        if kind != "log" or step is None:
            return None
        metric = Metric(
            step=step,
            loss=_number(event.get("loss")),
            eval_loss=_number(event.get("eval_loss")),
            learning_rate=_number(event.get("learning_rate")),
            grad_norm=_number(event.get("grad_norm")),
            epoch=_number(event.get("epoch")),
            max_steps=self.max_steps,
            time=when,
        )
        self.metrics.append(metric)
        return metric

    @property
    def last(self) -> Metric | None:
        """The latest metric, if any."""
        return self.metrics[-1] if self.metrics else None

    @property
    def first_loss(self) -> float | None:
        """The loss of the first step that has one."""
        return next((m.loss for m in self.metrics if m.loss is not None), None)

    @property
    def final_loss(self) -> float | None:
        """The loss of the last step that has one."""
        return next((m.loss for m in reversed(self.metrics) if m.loss is not None), None)

    @property
    def final_eval_loss(self) -> float | None:
        """The evaluation loss of the last step that has one (with val_set_size)."""
        return next((m.eval_loss for m in reversed(self.metrics) if m.eval_loss is not None), None)

    @property
    def launch(self) -> str | None:
        """`2 processes on 2 GPUs`, `1 process on the CPU`: what trained, from the
        begin event; None when it does not say."""
        if self.processes is None or self.gpus is None:
            return None
        where = "the CPU" if self.gpus == 0 else f"{self.gpus} GPU{'s' if self.gpus != 1 else ''}"
        return f"{self.processes} process{'es' if self.processes != 1 else ''} on {where}"

    def eta_seconds(self) -> float | None:
        """Seconds left until `max_steps`, from the pace since the first metric."""
        if len(self.metrics) < 2 or not self.max_steps:
            return None
        first, last = self.metrics[0], self.metrics[-1]
        if first.time is None or last.time is None or last.step <= first.step:
            return None
        pace = (last.time - first.time) / (last.step - first.step)
        return max(0.0, pace * (self.max_steps - last.step))

    @classmethod
    def of_text(cls, text: str) -> MetricsSummary:
        """The summary of a whole metrics file's text."""
        summary = cls()
        for line in text.splitlines():
            if line.strip():
                summary.add(line)
        return summary


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _int(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return int(value)


def stored_summary(runs: Runs, record_id: str, metrics_file: str) -> MetricsSummary:
    """What the metrics file `metrics_file` the store holds for `record_id`
    adds up to (nothing when there is none or it cannot be read)."""
    try:
        return MetricsSummary.of_text(runs.read_text(record_id, metrics_file))
    except (OSError, RecordError):
        return MetricsSummary()
