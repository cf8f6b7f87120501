"""Values in one markdown table cell, as a person reads them: text shown as
written, sizes, significant digits; what every summary and table of the package
writes its cells with (no Prefect)."""

from __future__ import annotations

import re

from overbrainer_prefect.runs.store import RunRecord
from overbrainer_prefect.timestamps import parse_rfc3339


def table_cell(text: str) -> str:
    """`text` as one markdown table cell that shows it as written: backslashes,
    pipes, backticks and the characters that would start markup or HTML escaped,
    line breaks as `<br>`; an empty text as a space."""
    escaped = re.sub(r"([\\`*_\[\]<>|#~])", r"\\\1", text)
    return "<br>".join(escaped.splitlines()) or " "


def code_cell(text: str) -> str:
    """`text` as a code span in one markdown table cell: fenced by more backticks
    than any run of them inside it (padded with spaces when it starts or ends
    with one), pipes escaped, line breaks as spaces. A text holding a backslash
    before a pipe is written as `table_cell` writes it (no code span can hold it)."""
    flat = " ".join(text.splitlines()) or " "
    if "\\|" in flat:  # a backslash before a pipe cannot be written in a code span of a cell
        return table_cell(flat)
    longest = max((len(run) for run in re.findall(r"`+", flat)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if flat.startswith("`") or flat.endswith("`") else ""
    return f"{fence}{pad}{flat.replace('|', chr(92) + '|')}{pad}{fence}"


def sig(value: float, digits: int = 4) -> str:
    """`value` written with `digits` significant digits (`5.777`, `0.01234`)."""
    return f"{value:.{digits}g}"


def sci(value: float | None) -> str:
    """A learning rate as a person reads it: `2.00e-04` (`-` for none)."""
    return "-" if value is None else f"{value:.2e}"


def size_text(size: int) -> str:
    """A size in bytes as a person reads it: `512 B`, `1.5 MiB`."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{size} B"


def run_duration(record: RunRecord) -> str:
    """How long a record's job ran (`1:02:03`, `4:05`), `running`, or `-` before it started."""
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
