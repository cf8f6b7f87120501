"""What the artifacts and logs say, as text: the loss curve's SVG, the pace of
the progress lines, the job warnings surfaced once, the rounded metrics table,
table cells that keep what they hold, the pipeline summary's links, and the
names of a tuned GGUF. (How the Prefect UI renders them: tests/test_ui_live.py.)"""

from __future__ import annotations

import asyncio
import json
import logging
import re

import pytest

from overbrainer_prefect import artifacts
from overbrainer_prefect.artifacts import (
    LIVE_CURVES_PER_S,
    LIVE_UPDATES_PER_S,
    PROGRESS_EVERY_S,
    PrefectReporter,
    code_cell,
    curve_markdown,
    metric_rows,
    notable_warnings,
    paced,
    table_cell,
)
from overbrainer_prefect.losscurve import data_uri, loss_svg, nice_ticks, thin
from overbrainer_prefect.pipeline_summary import StepLine, pipeline_markdown
from overbrainer_prefect.runs.metrics import MetricsSummary
from overbrainer_prefect.trainers.export import model_title, tuned_gguf_name

AXOLOTL_WARNING = (
    "[2026-12-01 21:40:02,118] [WARNING] [axolotl.loaders.model._adjust_model_config:413] "
    "increasing model.config.max_position_embeddings from 256 to 320"
)
"""The line axolotl 0.19 logs (axolotl/loaders/model.py, _adjust_model_config)."""


def summary_of(steps: int, max_steps: int | None = None, eval_every: int = 0) -> MetricsSummary:
    summary = MetricsSummary()
    summary.add(json.dumps({"event": "begin", "step": 0, "max_steps": max_steps, "time": 0}))
    for step in range(1, steps + 1):
        event = {"event": "log", "step": step, "loss": 6 / (1 + step), "time": step}
        event["learning_rate"] = 1e-3 * (1 - step / (steps + 1))
        if eval_every and step % eval_every == 0:
            event["eval_loss"] = 7 / (1 + step)
        summary.add(json.dumps(event))
    return summary


def polylines(svg: str) -> dict[str, int]:
    return {m[0]: int(m[1]) for m in re.findall(r'data-name="(\w+)" data-points="(\d+)"', svg)}


def test_the_loss_curve_draws_one_point_a_logged_step_and_eval_loss_when_there_is_one() -> None:
    summary = summary_of(30, 30, eval_every=10)
    svg = loss_svg(summary.metrics, summary.max_steps)
    assert polylines(svg) == {"loss": 30, "eval_loss": 3}
    assert svg.startswith('<svg xmlns="http://www.w3.org/2000/svg" width="720" height="320"')
    assert polylines(loss_svg(summary_of(5).metrics)) == {"loss": 5}
    assert "no loss logged yet" in loss_svg([])


def test_a_long_curve_is_thinned_keeping_its_first_and_last_points() -> None:
    points = [(i, float(i)) for i in range(10_000)]
    kept = thin(points, 400)
    assert len(kept) == 400 and kept[0] == points[0] and kept[-1] == points[-1]
    assert polylines(loss_svg(summary_of(2000).metrics))["loss"] == 400


def test_the_y_ticks_cover_every_value() -> None:
    for low, high in [(0.5, 3.846), (5.2, 5.9), (1e-5, 3e-5), (2.0, 2.0), (0.0, 1.0)]:
        ticks = nice_ticks(low, high)
        assert ticks[0] <= low and ticks[-1] >= high and 2 <= len(ticks) <= 8, (low, high, ticks)


def test_the_curve_artifact_carries_its_svg_and_the_latest_step_learning_rate_and_spend() -> None:
    summary = summary_of(12, 30)
    markdown = curve_markdown("20261201-120000-abcd", summary, spent=0.4242)
    svg = loss_svg(summary.metrics, 30, "run 20261201-120000-abcd: loss against step")
    assert f"]({data_uri(svg)})" in markdown
    row = markdown.strip().splitlines()[-1]
    assert row == f"| 12 / 30 | 0.4615 | - | {summary.metrics[-1].learning_rate:.2e} | $0.42 |"


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def reporter_lines(**pace: float) -> tuple[PrefectReporter, Lines]:
    logger = logging.getLogger(f"test-pace-{len(pace)}-{sorted(pace.items())}")
    logger.propagate = False
    handler = Lines()
    logger.handlers = [handler]
    logger.setLevel(logging.INFO)
    return PrefectReporter(logger, "20261201-120000-abcd", **pace), handler


def test_progress_lines_come_every_ten_percent_with_the_first_last_and_every_eval() -> None:
    reporter, handler = reporter_lines(log_every_percent=10, log_every_s=3600)
    summary = MetricsSummary()
    summary.add(json.dumps({"event": "begin", "step": 0, "max_steps": 200, "time": 0}))
    for step in range(1, 201):
        event = {"event": "log", "step": step, "loss": 1.0, "time": step}
        if step == 55:
            event["eval_loss"] = 2.0
        metric = summary.add(json.dumps(event))
        assert metric is not None
        reporter.metric(metric, summary)
    steps = [int(re.search(r"step (\d+)/", line).group(1)) for line in handler.lines]  # type: ignore[union-attr]
    assert steps == [1, 20, 40, 55, 60, 80, 100, 120, 140, 160, 180, 200]
    assert handler.lines[3].startswith("run 20261201-120000-abcd: step 55/200 (28 %), loss 1, ")
    assert "eval_loss 2, ETA " in handler.lines[3]


def test_near_its_end_a_training_calls_near_end_once_with_the_seconds_left() -> None:
    """The follower's cue to resume a pipeline's suspended flow run: once the
    ETA (the pace since the first step, to max_steps) is within near_end_s."""
    called: list[float] = []

    async def near_end(left_s: float) -> None:
        called.append(left_s)

    reporter, _ = reporter_lines()
    reporter.near_end, reporter.near_end_s = near_end, 30.0
    summary = MetricsSummary()
    summary.add(json.dumps({"event": "begin", "step": 0, "max_steps": 100, "time": 0}))
    for step in range(1, 101):  # 2 s a step: 198 s left after the first, 30 s at step 85
        metric = summary.add(
            json.dumps({"event": "log", "step": step, "loss": 1.0, "time": 2 * step})
        )
        assert metric is not None
        reporter.metric(metric, summary)
        asyncio.run(reporter.near_end_check())
        assert len(called) == (1 if step >= 85 else 0), (step, called)
    assert called == [30.0]


def test_without_max_steps_a_progress_line_comes_at_the_pace_in_seconds() -> None:
    reporter, handler = reporter_lines(log_every_s=0)
    summary = summary_of(0)
    for step in range(1, 6):
        metric = summary.add(json.dumps({"event": "log", "step": step, "loss": 1.0}))
        assert metric is not None
        reporter.metric(metric, summary)
    assert len(handler.lines) == 5  # 0 s apart: every one
    reporter, handler = reporter_lines(log_every_s=3600)
    for metric in summary.metrics:
        reporter.metric(metric, summary)
    assert len(handler.lines) == 1  # an hour apart: only the first


def test_a_job_warning_that_matters_is_surfaced_once_with_what_to_do() -> None:
    log = f"loading\n{AXOLOTL_WARNING}\ntraining\n{AXOLOTL_WARNING}\n"
    found = notable_warnings(log)
    assert len(found) == 1
    assert "from 256 to 320" in found[0][1] and "lower sequence_len to 256" in found[0][1]
    reporter, handler = reporter_lines()
    assert reporter.surface(log) == [found[0][1]]
    assert reporter.surface(log) == []
    assert handler.lines == [f"run 20261201-120000-abcd: {found[0][1]}"]
    assert notable_warnings("all fine\n") == []


def test_the_metrics_table_is_rounded_to_what_a_person_reads() -> None:
    summary = MetricsSummary()
    summary.add(
        json.dumps(
            {
                "event": "log",
                "step": 3,
                "loss": 5.776554584503174,
                "learning_rate": 0.000987654,
                "grad_norm": 1.23456789,
                "epoch": 0.1875001,
                "eval_loss": float("nan"),
            }
        ).replace("NaN", "null")
    )
    assert metric_rows(summary) == [
        {
            "step": 3,
            "loss": 5.777,
            "eval_loss": None,
            "learning_rate": "9.88e-04",
            "grad_norm": 1.235,
            "epoch": 0.188,
        }
    ]


@pytest.mark.parametrize(
    ("text", "cell"),
    [
        ("a|b", "a\\|b"),
        ("line1\nline2", "line1<br>line2"),
        ("back`tick", "back\\`tick"),
        ("<b>", "\\<b\\>"),
        ("", " "),
    ],
)
def test_a_table_cell_escapes_what_would_break_it(text: str, cell: str) -> None:
    assert table_cell(text) == cell


def test_a_code_cell_is_fenced_longer_than_any_backticks_inside() -> None:
    assert code_cell("plain") == "`plain`"
    assert code_cell("a `b` c") == "``a `b` c``"
    assert code_cell("```x```") == "```` ```x``` ````"
    assert code_cell("a|b\nc") == "`a\\|b c`"


def test_the_pipeline_summary_links_each_step_to_its_flow_run() -> None:
    steps = [
        StepLine("train", "succeeded", "11111111-1111-1111-1111-111111111111", [("steps", "6")]),
        StepLine("export", "succeeded", None, [("quant", "`q8_0`")], reused=True),
    ]
    markdown = pipeline_markdown("20261201-120000-abcd", steps, "Deliver it.")
    assert "| train | **succeeded** | [train flow run](/runs/flow-run/1111" in markdown
    assert "| export | **succeeded** (reused) | export flow run |" in markdown
    assert "## [Train](/runs/flow-run/11111111-1111-1111-1111-111111111111)" in markdown
    assert markdown.rstrip().endswith("Deliver it.")


def test_a_tuned_gguf_is_named_for_its_run_and_says_its_base() -> None:
    run_id = "20261130-184143-h2vk"
    assert tuned_gguf_name(run_id) == "run-20261130-184143-h2vk"
    assert model_title(run_id, "/work/.cache/smollm2-base/") == (
        "run 20261130-184143-h2vk, tuned from smollm2-base"
    )
    assert model_title(run_id, None) == "run 20261130-184143-h2vk"


def test_a_process_keeping_many_runs_live_updates_each_less_often(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(artifacts._Live, "runs", 1)
    assert paced(PROGRESS_EVERY_S, LIVE_UPDATES_PER_S) == PROGRESS_EVERY_S
    assert paced(10.0, LIVE_CURVES_PER_S) == 10.0
    monkeypatch.setattr(artifacts._Live, "runs", 100)  # a follower of a hundred trainings
    assert paced(PROGRESS_EVERY_S, LIVE_UPDATES_PER_S) == 100 / LIVE_UPDATES_PER_S
    assert paced(10.0, LIVE_CURVES_PER_S) == 100 / LIVE_CURVES_PER_S
