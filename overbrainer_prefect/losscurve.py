"""A run's loss curve as a picture: an SVG of loss (and eval loss, when the job
evaluates) against step, small enough to travel inside a markdown artifact as
a `data:` URI image, which the Prefect UI renders as an `<img>`.

Pure Python, no Prefect and no plotting library: the orchestrator venv has
neither matplotlib nor numpy, and a few polylines do not need them.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Sequence
from dataclasses import dataclass
from xml.sax.saxutils import escape

from overbrainer_prefect.runs.metrics import Metric

WIDTH, HEIGHT = 720, 320
LEFT, RIGHT, TOP, BOTTOM = 64, 24, 36, 44  # the margins around the plot area
MAX_POINTS = 400  # a longer series is thinned to about this many points
LOSS_COLOUR = "#2563eb"
EVAL_COLOUR = "#ea580c"
GRID_COLOUR = "#e5e7eb"
TEXT_COLOUR = "#374151"


@dataclass(frozen=True)
class Series:
    """One line of the curve: its name, colour and (step, value) points."""

    name: str
    colour: str
    points: list[tuple[int, float]]


def series_of(metrics: Sequence[Metric]) -> list[Series]:
    """The loss and eval-loss series of `metrics` (non-finite values left out);
    the eval series only when some metric has an eval loss."""
    loss = [(m.step, m.loss) for m in metrics if m.loss is not None and math.isfinite(m.loss)]
    evals = [
        (m.step, m.eval_loss)
        for m in metrics
        if m.eval_loss is not None and math.isfinite(m.eval_loss)
    ]
    found = [Series("loss", LOSS_COLOUR, loss)]
    if evals:
        found.append(Series("eval_loss", EVAL_COLOUR, evals))
    return found


def thin(points: list[tuple[int, float]], most: int = MAX_POINTS) -> list[tuple[int, float]]:
    """At most about `most` of `points`, evenly spread, the first and last kept."""
    if len(points) <= most:
        return points
    stride = len(points) / (most - 1)
    kept = [points[int(i * stride)] for i in range(most - 1)]
    return [*kept, points[-1]]


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """About `count` round tick values from at or below `low` to at or above
    `high`, spaced by 1, 2 or 5 times a power of ten."""
    if not math.isfinite(low) or not math.isfinite(high):
        return []
    if high <= low:
        high = low + (abs(low) or 1.0)
    raw = (high - low) / max(1, count - 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    ticks = [round(math.floor(low / step) * step, 12)]
    while ticks[-1] < high - step * 1e-9:
        ticks.append(round(ticks[-1] + step, 12))
    return ticks


def loss_svg(metrics: Sequence[Metric], max_steps: int | None = None, title: str = "") -> str:
    """The SVG of `metrics`' loss (and eval loss) against step, x from 0 to
    `max_steps` (or the last step), y on round ticks around the values. With no
    loss yet, an empty plot that says so."""
    lines = series_of(metrics)
    values = [v for s in lines for _, v in s.points]
    steps = [st for s in lines for st, _ in s.points]
    last_step = max(steps, default=0)
    x_high = float(max(max_steps or 0, last_step, 1))
    y_ticks = nice_ticks(min(values), max(values)) if values else [0.0, 1.0]
    y_low, y_high = y_ticks[0], y_ticks[-1]
    if y_high <= y_low:
        y_high = y_low + 1.0
    x_ticks = [t for t in nice_ticks(0.0, x_high) if t <= x_high + 1e-9]
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def x_of(step: float) -> float:
        return LEFT + plot_w * step / x_high

    def y_of(value: float) -> float:
        return TOP + plot_h * (1 - (value - y_low) / (y_high - y_low))

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">',
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="#ffffff"/>',
    ]
    if title:
        out.append(
            f'<text x="{LEFT}" y="20" fill="{TEXT_COLOUR}" font-size="14">{escape(title)}</text>'
        )
    for tick in y_ticks:
        y = y_of(tick)
        out.append(
            f'<line x1="{LEFT}" y1="{y:.1f}" x2="{WIDTH - RIGHT}" y2="{y:.1f}" '
            f'stroke="{GRID_COLOUR}"/>'
        )
        out.append(
            f'<text x="{LEFT - 6}" y="{y + 4:.1f}" fill="{TEXT_COLOUR}" '
            f'text-anchor="end">{_tick(tick)}</text>'
        )
    for tick in x_ticks:
        x = x_of(tick)
        out.append(
            f'<line x1="{x:.1f}" y1="{TOP}" x2="{x:.1f}" y2="{HEIGHT - BOTTOM}" '
            f'stroke="{GRID_COLOUR}"/>'
        )
        out.append(
            f'<text x="{x:.1f}" y="{HEIGHT - BOTTOM + 16}" fill="{TEXT_COLOUR}" '
            f'text-anchor="middle">{_tick(tick)}</text>'
        )
    out.append(
        f'<text x="{LEFT + plot_w / 2:.0f}" y="{HEIGHT - 8}" fill="{TEXT_COLOUR}" '
        'text-anchor="middle">step</text>'
    )
    out.append(
        f'<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="none" '
        f'stroke="{TEXT_COLOUR}"/>'
    )
    for series in lines:
        points = thin(series.points)
        if not points:
            continue
        coords = " ".join(f"{x_of(s):.1f},{y_of(v):.1f}" for s, v in points)
        out.append(
            f'<polyline class="series" data-name="{series.name}" data-points="{len(points)}" '
            f'fill="none" stroke="{series.colour}" stroke-width="2" points="{coords}"/>'
        )
        if len(points) <= 60:
            out += [
                f'<circle cx="{x_of(s):.1f}" cy="{y_of(v):.1f}" r="2.5" fill="{series.colour}"/>'
                for s, v in points
            ]
    legend_x = WIDTH - RIGHT - 110 * len(lines)
    for index, series in enumerate(lines):
        x = legend_x + 110 * index
        out.append(
            f'<line x1="{x}" y1="16" x2="{x + 18}" y2="16" stroke="{series.colour}" '
            'stroke-width="3"/>'
        )
        out.append(f'<text x="{x + 24}" y="20" fill="{TEXT_COLOUR}">{series.name}</text>')
    if not values:
        out.append(
            f'<text x="{LEFT + plot_w / 2:.0f}" y="{TOP + plot_h / 2:.0f}" fill="{TEXT_COLOUR}" '
            'text-anchor="middle">no loss logged yet</text>'
        )
    out.append("</svg>")
    return "\n".join(out)


def data_uri(svg: str) -> str:
    """`svg` as a base64 `data:image/svg+xml` URI (what a markdown image can carry)."""
    return "data:image/svg+xml;base64," + base64.b64encode(svg.encode()).decode("ascii")


def _tick(value: float) -> str:
    if value == int(value) and abs(value) < 1e6:
        return str(int(value))
    return f"{value:.4g}"
