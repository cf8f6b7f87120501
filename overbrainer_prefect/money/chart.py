"""Where the money went, as pictures: SVG bar charts of dollars (by day, by
deployment, by target), small enough to travel in a markdown artifact as a
`data:` URI image, like the loss curve. Each bar carries its label and its
dollars (`data-label`, `data-usd`), so what it shows can be checked.

Pure Python, no Prefect, no plotting library.
"""

from __future__ import annotations

from collections.abc import Sequence
from xml.sax.saxutils import escape, quoteattr

from overbrainer_prefect.losscurve import GRID_COLOUR, TEXT_COLOUR, nice_ticks
from overbrainer_prefect.money.ledger import usd

WIDTH = 720
BAR_COLOUR = "#2563eb"
LEFT, RIGHT, TOP = 64, 24, 36
COLUMN_HEIGHT = 240  # the plot area of a chart by day
ROW_HEIGHT = 22  # one bar of a chart by deployment or target
LABEL_WIDTH = 220  # the names left of a chart's rows
MAX_LABEL = 32  # characters of a name shown (the table has it whole)


def _head(height: int, title: str) -> list[str]:
    return [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="12">',
        f'<rect width="{WIDTH}" height="{height}" fill="#ffffff"/>',
        f'<text x="{LEFT}" y="20" fill="{TEXT_COLOUR}" font-size="14">{escape(title)}</text>',
    ]


def _bar(x: float, y: float, w: float, h: float, label: str, dollars: float) -> str:
    return (
        f'<rect class="bar" data-label={quoteattr(label)} data-usd="{dollars:.6f}" '
        f'x="{x:.1f}" y="{y:.1f}" width="{max(w, 0.0):.1f}" height="{max(h, 0.0):.1f}" '
        f'fill="{BAR_COLOUR}"><title>{escape(label)}: {usd(dollars)}</title></rect>'
    )


def columns_svg(bars: Sequence[tuple[str, float]], title: str) -> str:
    """Vertical bars, one a label (a day, oldest first), dollars on round ticks."""
    height = TOP + COLUMN_HEIGHT + 56
    top = max((dollars for _, dollars in bars), default=0.0)
    ticks = nice_ticks(0.0, top if top > 0 else 1.0)
    high = ticks[-1] if ticks and ticks[-1] > 0 else 1.0
    plot_w = WIDTH - LEFT - RIGHT
    slot = plot_w / max(1, len(bars))
    out = _head(height, title)
    for tick in ticks:
        y = TOP + COLUMN_HEIGHT * (1 - tick / high)
        out.append(
            f'<line x1="{LEFT}" y1="{y:.1f}" x2="{WIDTH - RIGHT}" y2="{y:.1f}" '
            f'stroke="{GRID_COLOUR}"/>'
        )
        out.append(
            f'<text x="{LEFT - 6}" y="{y + 4:.1f}" fill="{TEXT_COLOUR}" '
            f'text-anchor="end">${tick:g}</text>'
        )
    for index, (label, dollars) in enumerate(bars):
        h = COLUMN_HEIGHT * dollars / high
        x = LEFT + slot * index + slot * 0.15
        out.append(_bar(x, TOP + COLUMN_HEIGHT - h, slot * 0.7, h, label, dollars))
        if index % max(1, len(bars) // 6) == 0 or index == len(bars) - 1:
            out.append(
                f'<text x="{x + slot * 0.35:.1f}" y="{TOP + COLUMN_HEIGHT + 16}" '
                f'fill="{TEXT_COLOUR}" text-anchor="middle">{escape(label[5:])}</text>'
            )
    out.append(
        f'<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{COLUMN_HEIGHT}" fill="none" '
        f'stroke="{TEXT_COLOUR}"/>'
    )
    if top <= 0:
        out.append(
            f'<text x="{LEFT + plot_w / 2:.0f}" y="{TOP + COLUMN_HEIGHT / 2:.0f}" '
            f'fill="{TEXT_COLOUR}" text-anchor="middle">nothing spent</text>'
        )
    out.append("</svg>")
    return "\n".join(out)


def rows_svg(bars: Sequence[tuple[str, float]], title: str) -> str:
    """Horizontal bars, one a name (dearest first), each with its dollars."""
    height = TOP + ROW_HEIGHT * max(1, len(bars)) + 16
    top = max((dollars for _, dollars in bars), default=0.0) or 1.0
    width = WIDTH - LABEL_WIDTH - RIGHT - 70
    out = _head(height, title)
    for index, (label, dollars) in enumerate(bars):
        y = TOP + ROW_HEIGHT * index
        shown = label if len(label) <= MAX_LABEL else label[: MAX_LABEL - 1] + "…"
        w = width * dollars / top
        out.append(
            f'<text x="{LABEL_WIDTH - 8}" y="{y + 15}" fill="{TEXT_COLOUR}" '
            f'text-anchor="end">{escape(shown)}</text>'
        )
        out.append(_bar(LABEL_WIDTH, y + 3, w, ROW_HEIGHT - 6, label, dollars))
        out.append(
            f'<text x="{LABEL_WIDTH + w + 6:.1f}" y="{y + 15}" fill="{TEXT_COLOUR}">'
            f"{escape(usd(dollars))}</text>"
        )
    if not bars:
        out.append(f'<text x="{LABEL_WIDTH}" y="{TOP + 15}" fill="{TEXT_COLOUR}">nothing</text>')
    out.append("</svg>")
    return "\n".join(out)
