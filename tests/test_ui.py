"""The Prefect UI, served by the real server of the deployment tests, shows a
fine-tune run through the train deployment: its flow run page, and its run
summary, metrics table and progress artifacts, as headless Chromium renders
them (Debian's `chromium`, installed by `.ci/run`)."""

from __future__ import annotations

import html
import json
import os
import re
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from overbrainer_prefect.runs import Runs
from tests.browser import HEADLESS, chromium
from tests.prefect_server import Stack, Trained

pytest_plugins = ["tests.prefect_server"]
pytestmark = pytest.mark.slow

BROWSER_TIMEOUT_S = 120.0  # one page, its scripts and API calls, on a loaded machine
RENDER_BUDGET_MS = 15000  # virtual time the page gets to fetch and render


def browse(url: str, profile: Path, *, screenshot: Path | None = None) -> str:
    """Renders `url` in headless Chromium; returns its DOM (or takes a screenshot).
    The browser is killed by PID if it runs past BROWSER_TIMEOUT_S."""
    args = [
        chromium(),
        *HEADLESS,
        f"--user-data-dir={profile}",
        "--window-size=1400,2000",
        f"--virtual-time-budget={RENDER_BUDGET_MS}",
    ]
    args += [f"--screenshot={screenshot}"] if screenshot else ["--dump-dom"]
    process = subprocess.Popen(
        [*args, url],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        out, _ = process.communicate(timeout=BROWSER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise AssertionError(f"chromium ran past {BROWSER_TIMEOUT_S:g} s on {url}") from None
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 0, f"chromium failed ({process.returncode}) on {url}"
    return out.decode(errors="replace")


def text_of(dom: str) -> str:
    """The visible text of a DOM, whitespace collapsed."""
    dom = re.sub(r"<(script|style)\b.*?</\1>", " ", dom, flags=re.S)
    return html.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", dom)))


def artifacts_of(stack: Stack, flow_run_id: Any) -> dict[str, Any]:
    async def read(client: Any) -> dict[str, Any]:
        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

        found = await client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
        return {a.key: a for a in found if a.key}

    result: dict[str, Any] = stack.server.call(read)
    return result


def test_the_ui_shows_the_run_its_summary_metrics_table_and_progress(
    deployed: Stack, trained: Trained, tmp_path: Path
) -> None:
    run_id = trained.run_id
    flow_run = trained.flow_run
    profile = tmp_path / "chromium-profile"
    ui = deployed.server.url

    page = text_of(browse(f"{ui}/runs/flow-run/{flow_run.id}", profile))
    (tmp_path / "flow-run.txt").write_text(page)
    assert flow_run.name in page and "Completed" in page
    assert f"run {run_id} succeeded" in page  # its log, with the run ID
    shot = tmp_path / "flow-run.png"
    browse(f"{ui}/runs/flow-run/{flow_run.id}", profile, screenshot=shot)
    assert shot.stat().st_size > 20_000

    artifacts = artifacts_of(deployed, flow_run.id)
    summary = artifacts[f"run-{run_id}-summary"]
    text = text_of(browse(f"{ui}/artifacts/artifact/{summary.id}", profile))
    (tmp_path / "summary.txt").write_text(text)
    assert f"Run {run_id}" in text and "final loss" in text and "succeeded" in text
    assert "output/adapter_model.safetensors" in text
    browse(f"{ui}/artifacts/artifact/{summary.id}", profile, screenshot=tmp_path / "summary.png")

    metrics = artifacts[f"run-{run_id}-metrics"]
    text = text_of(browse(f"{ui}/artifacts/artifact/{metrics.id}", profile))
    (tmp_path / "metrics.txt").write_text(text)
    local = Runs(deployed.runs).run_dir(run_id)
    logged = [
        json.loads(line)
        for line in (local / "metrics.jsonl").read_text().splitlines()
        if '"log"' in line
    ]
    assert "step" in text and "loss" in text and "learning_rate" in text
    last = logged[-1]
    # the last step's row, rounded as a person reads it
    loss = float(format(last["loss"], ".4g"))
    assert f"{last['step']} {loss} " in text
    assert f"{last['learning_rate']:.2e}" in text
    if len(str(last["loss"])) > 6:  # the unrounded float is not shown
        assert str(last["loss"]) not in text

    progress = artifacts[f"run-{run_id}-progress"]
    text = text_of(browse(f"{ui}/artifacts/artifact/{progress.id}", profile))
    (tmp_path / "progress.txt").write_text(text)
    assert f"Training progress of run {run_id}" in text
    assert "Progress: 100%" in text
