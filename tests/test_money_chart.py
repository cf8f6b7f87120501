"""The spend view's charts: well-formed SVG whose bars are the totals, drawn
as images by headless Chromium (the way the Prefect UI shows a markdown
artifact's `data:` image, as for the loss curve)."""

from __future__ import annotations

import base64
import re
import xml.etree.ElementTree as ET
from datetime import date, timedelta
from pathlib import Path

import pytest

from overbrainer_prefect.money.view import LeftRow, SpendView, spend_markdown
from tests.browser import Browser

SVG = "{http://www.w3.org/2000/svg}"


def a_month() -> SpendView:
    first = date(2026, 11, 3)
    days = {(first + timedelta(days=i)).isoformat(): (i % 7) * 0.37 for i in range(30)}
    return SpendView(
        runs_dir="/runs",
        days=30,
        total_usd=sum(days.values()),
        by_day=days,
        by_deployment={"fine-tune/nightly": 30.0, "train/local": 4.5, "export": 0.35},
        by_target={"overbrainer-runpod-target/runpod": 33.0, "overbrainer-runpod-target/a40": 1.85},
        left=[
            LeftRow(period="day", budget_usd=5, spent_usd=2.22, left_usd=2.78, resets="x"),
            LeftRow(period="month", budget_usd=60, spent_usd=34.85, left_usd=25.15, resets="y"),
        ],
    )


def images(markdown: str) -> list[str]:
    return re.findall(r"\((data:image/svg\+xml;base64,[A-Za-z0-9+/=]+)\)", markdown)


def test_the_spend_charts_are_svg_whose_bars_are_the_totals() -> None:
    view = a_month()
    markdown = spend_markdown(view)
    charts = [ET.fromstring(base64.b64decode(uri.split(",", 1)[1])) for uri in images(markdown)]
    found = [
        {
            r.attrib["data-label"]: float(r.attrib["data-usd"])
            for r in svg.iter(f"{SVG}rect")
            if r.attrib.get("class") == "bar"
        }
        for svg in charts
    ]
    expected = [view.by_day, view.by_deployment, view.by_target]
    assert found == [pytest.approx(totals, abs=1e-6) for totals in expected]
    assert "| day: $5.00 | $2.22 | **$2.78** | x |" in markdown
    assert "| fine-tune/nightly | $30.00 |" in markdown


def test_the_spend_charts_render_as_images_in_chromium(tmp_path: Path) -> None:
    page = tmp_path / "spend.html"
    page.write_text(
        "<html><body>"
        + "".join(f'<img src="{uri}"><br>' for uri in images(spend_markdown(a_month())))
        + "</body></html>"
    )
    with Browser(tmp_path / "profile", width=760, height=1100) as browser:
        browser.open(page.as_uri())
        widths = browser.wait_for(
            "(() => { const i = [...document.images];"
            " return i.length === 3 && i.every(x => x.complete && x.naturalWidth > 0)"
            " && i.map(x => x.naturalWidth); })()",
            60,
            "the three charts drawn",
        )
        browser.screenshot(tmp_path / "spend.png")
    assert widths == [720, 720, 720]
