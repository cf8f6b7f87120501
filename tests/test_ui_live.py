"""What a person sees in the Prefect UI, in headless Chromium against the real
server of the deployment tests: one `fine_tune` deployment run's train subflow
run's loss curve while its job trains and at its end (an image that loaded,
whose SVG holds the logged steps), the `fine_tune` flow run's own summary
linking each step to its subflow run, and its train subflow run's page with its
run summary, metrics table and progress artifacts
(`assert_the_ui_shows_a_finished_train_run`), the `runs`
flow's table, and table cells that show what they hold. Chromium is Debian's
`chromium` (`scripts/test-deps.sh`). Screenshots are kept in each test's directory."""

from __future__ import annotations

import base64
import contextlib
import html
import json
import os
import re
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from overbrainer_prefect.runs import Runs, RunState
from tests.browser import Browser
from tests.prefect_server import Stack, tiny_training, training_now, wait_until

pytest_plugins = ["tests.prefect_server"]
pytestmark = pytest.mark.slow

PAGE_TIMEOUT_S = 90.0  # the UI's scripts and API calls, on a loaded machine
RELOAD_S = 30.0  # a page that does not show what is looked for is opened again after this
LIVE_STEPS = 12  # the job is held stopped while the page is looked at mid-training

CURVE_IMAGE = """(() => {
  const img = [...document.querySelectorAll('.markdown-renderer img')]
    .find(i => i.src.startsWith('data:image/svg+xml;base64,'));
  if (!img || !img.complete || img.naturalWidth === 0) return null;
  const svg = atob(img.src.split(',')[1]);
  const points = [...svg.matchAll(/data-name="([a-z_]+)" data-points="(\\d+)"/g)]
    .map(m => [m[1], Number(m[2])]);
  return {width: img.naturalWidth, height: img.naturalHeight, points: points, svg: svg};
})()"""


def artifacts_by_key(stack: Stack, flow_run_id: Any) -> dict[str, Any]:
    """The flow run's artifacts, by key."""

    async def read(client: Any) -> dict[str, Any]:
        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

        found = await client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
        return {a.key: a for a in found if a.key}

    result: dict[str, Any] = stack.server.call(read)
    return result


def open_artifact(browser: Browser, ui: str, flow_run_id: Any, key: str) -> None:
    """Opens the flow run's page, its Artifacts tab, and the card of `key`, as a
    person would click through them."""
    browser.open(f"{ui}/runs/flow-run/{flow_run_id}")
    browser.wait_for("document.querySelector('li#artifacts') !== null", PAGE_TIMEOUT_S, "tabs")
    browser.evaluate("document.querySelector('li#artifacts').click()")
    find_card = (
        "[...document.querySelectorAll('#artifacts-content a')]"
        f".find(a => a.innerText.includes({json.dumps(key)}))"
    )
    browser.wait_for(f"!!{find_card}", PAGE_TIMEOUT_S, f"the card of artifact {key}")
    browser.evaluate(f"{find_card}.click()")
    browser.wait_for(
        "location.pathname.startsWith('/artifacts/artifact/') && "
        "!!document.querySelector('.markdown-renderer, .artifact-data-table')",
        PAGE_TIMEOUT_S,
        f"the page of artifact {key}",
    )


def curve(browser: Browser) -> dict[str, Any]:
    """The loss curve as the page shows it, once its image has loaded."""
    found: dict[str, Any] = browser.wait_for(CURVE_IMAGE, PAGE_TIMEOUT_S, "the loss curve image")
    return found


def steps_logged(stack: Stack, run_id: str) -> int:
    """How many log events the run's metrics file (retrieved) holds."""
    text = (Runs(stack.runs).run_dir(run_id) / "metrics.jsonl").read_text()
    return sum(1 for line in text.splitlines() if '"log"' in line)


def new_run_id(stack: Stack, before: set[str]) -> str | None:
    """The run the deployment made since `before`, once its record exists."""
    made = [p.name for p in stack.runs.glob("*-*-*") if p.name not in before]
    return made[0] if made and (stack.runs / made[0] / "run.json").is_file() else None


def subflows_of(stack: Stack, flow_run_id: Any) -> dict[str, str]:
    """The flow run's subflow runs, by their flow's name: their IDs."""

    async def children(client: Any) -> dict[str, str]:
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

        found = await client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id])
            )
        )
        return {(await client.read_flow(c.flow_id)).name: str(c.id) for c in found}

    return dict(stack.server.call(children))


def assert_the_ui_shows_the_loss_curve_while_the_job_trains_and_at_its_end(
    deployed: Stack, flow_run_id: Any, before: set[str], tmp_path: Path
) -> str:
    """The train flow run `flow_run_id` (its run not in `before`) shows its loss
    curve on its artifact's page while its job trains (the job held stopped,
    SIGSTOP to its process group, while the page is looked at: mid-training
    however fast this machine trains) and every logged step once the flow run
    completed; returns the run's ID."""
    ui = deployed.server.url
    run_id: str = wait_until(lambda: new_run_id(deployed, before), 300, "the run's record")
    key = f"run-{run_id}-loss-curve"
    job = wait_until(lambda: training_now(deployed, before), 300, "the job's first step", every=0.2)
    assert job.id == run_id and job.job is not None
    group = job.job.pid

    def curve_has_points() -> bool:
        artifact = artifacts_by_key(deployed, flow_run_id).get(key)
        return artifact is not None and 'data-points="' in base64_svg(artifact.data)

    os.killpg(group, signal.SIGSTOP)
    try:
        wait_until(curve_has_points, 300, "the loss curve to show a first step", every=2.0)
        with Browser(tmp_path / "profile") as browser:
            open_artifact(browser, ui, flow_run_id, key)
            during = curve(browser)
            browser.screenshot(tmp_path / "loss-curve-training.png")
            state_then = Runs(deployed.runs).load(run_id).state
            os.killpg(group, signal.SIGCONT)
            final = deployed.wait_final(flow_run_id)
            assert final.state.is_completed(), final.state

            open_artifact(browser, ui, flow_run_id, key)
            at_end = curve(browser)
            browser.screenshot(tmp_path / "loss-curve-end.png")
            (tmp_path / "loss-curve-end.svg").write_text(at_end["svg"])
    finally:
        with contextlib.suppress(ProcessLookupError):  # a job that ended is gone
            os.killpg(group, signal.SIGCONT)  # when the test failed while it was held

    assert during["width"] == at_end["width"] == 720 and during["height"] == 320
    assert state_then == RunState.RUNNING  # the first picture was taken while it trained
    seen = dict(during["points"])["loss"]
    logged = steps_logged(deployed, run_id)
    assert 1 <= seen < logged  # part of the curve, mid-training
    assert dict(at_end["points"]) == {"loss": logged}  # every logged step at the end
    # (axolotl's "increasing max_position_embeddings" cannot be caused here any more:
    # the pre-flight refuses a sequence_len past the model's context; its surfacing is
    # shown on a real log line in tests/test_artifacts_text.py)
    return run_id


def text_of(dom: str) -> str:
    """The visible text of a DOM, whitespace collapsed."""
    dom = re.sub(r"<(script|style)\b.*?</\1>", " ", dom, flags=re.S)
    return html.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", dom)))


def page_text(browser: Browser, url: str, needles: list[str], what: str) -> str:
    """Opens `url` and returns the text of its DOM (`text_of`) once it holds every
    one of `needles`; the page is opened again every RELOAD_S (the UI may render
    before an artifact's markdown arrives). Fails after PAGE_TIMEOUT_S with the
    last text seen."""
    seen = [""]
    opened = [time.monotonic()]
    browser.open(url)

    def holds() -> str | None:
        if time.monotonic() - opened[0] > RELOAD_S:
            browser.open(url)
            opened[0] = time.monotonic()
        with contextlib.suppress(AssertionError):  # a script run while the page navigates
            seen[0] = text_of(str(browser.evaluate("document.documentElement.outerHTML")))
        return seen[0] if all(n in seen[0] for n in needles) else None

    try:
        return str(wait_until(holds, PAGE_TIMEOUT_S, what))
    except AssertionError as error:
        raise AssertionError(f"{error}; page: {seen[0][:2000]}") from None


def assert_the_ui_shows_a_finished_train_run(
    deployed: Stack, flow_run: Any, run_id: str, tmp_path: Path
) -> None:
    """The train flow run's page (its name, Completed, its log line with the run
    ID, a screenshot), and its run summary, metrics table (the last step's row,
    rounded as a person reads it) and progress (100 %) artifacts, each as
    Chromium renders its page (one browser, each page waited on until it shows
    what is looked for)."""
    ui = deployed.server.url
    local = Runs(deployed.runs).run_dir(run_id)
    logged = [
        json.loads(line)
        for line in (local / "metrics.jsonl").read_text().splitlines()
        if '"log"' in line
    ]
    last = logged[-1]
    # the last step's row, rounded as a person reads it
    loss = float(format(last["loss"], ".4g"))
    artifacts = artifacts_by_key(deployed, flow_run.id)
    with Browser(tmp_path / "chromium-profile", width=1400, height=2000) as browser:
        page = page_text(
            browser,
            f"{ui}/runs/flow-run/{flow_run.id}",
            [flow_run.name, "Completed", f"run {run_id} succeeded"],
            "the train flow run's page",
        )
        (tmp_path / "flow-run.txt").write_text(page)
        assert flow_run.name in page and "Completed" in page
        assert f"run {run_id} succeeded" in page  # its log, with the run ID
        shot = browser.screenshot(tmp_path / "flow-run.png")
        assert shot.stat().st_size > 20_000

        summary = artifacts[f"run-{run_id}-summary"]
        text = page_text(
            browser,
            f"{ui}/artifacts/artifact/{summary.id}",
            [f"Run {run_id}", "final loss", "succeeded", "output/adapter_model.safetensors"],
            "the run summary's page",
        )
        (tmp_path / "summary.txt").write_text(text)
        assert f"Run {run_id}" in text and "final loss" in text and "succeeded" in text
        assert "output/adapter_model.safetensors" in text
        browser.screenshot(tmp_path / "summary.png")

        metrics = artifacts[f"run-{run_id}-metrics"]
        row, rate = f"{last['step']} {loss} ", f"{last['learning_rate']:.2e}"
        text = page_text(
            browser,
            f"{ui}/artifacts/artifact/{metrics.id}",
            ["step", "loss", "learning_rate", row, rate],
            "the metrics table's last row",
        )
        (tmp_path / "metrics.txt").write_text(text)
        assert "step" in text and "loss" in text and "learning_rate" in text
        assert row in text
        assert rate in text
        if len(str(last["loss"])) > 6:  # the unrounded float is not shown
            assert str(last["loss"]) not in text

        progress = artifacts[f"run-{run_id}-progress"]
        text = page_text(
            browser,
            f"{ui}/artifacts/artifact/{progress.id}",
            [f"Training progress of run {run_id}"],
            "the progress artifact's page",
        )
        (tmp_path / "progress.txt").write_text(text)
        assert f"Training progress of run {run_id}" in text
        assert "Progress: 100%" in text


def base64_svg(markdown: Any) -> str:
    """The SVG a loss curve artifact's markdown carries."""
    found = re.search(r"data:image/svg\+xml;base64,([A-Za-z0-9+/=]+)", str(markdown))
    return base64.b64decode(found.group(1)).decode() if found else ""


class _ListLogger:
    """A logger that keeps its lines (the reporter's lines, read by the test)."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def info(self, message: str, *args: Any) -> None:
        self.lines.append(message % args)

    def warning(self, message: str, *args: Any) -> None:
        self.lines.append(message % args)


def test_a_fine_tune_shows_its_loss_curve_while_it_trains_and_its_summary_linking_its_steps(
    deployed: Stack, tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    ui = deployed.server.url
    before = {p.name for p in deployed.runs.glob("*")}
    spec = {
        "target": deployed.target,
        "training": tiny_training(*tiny, max_steps=LIVE_STEPS, sequence_len=128),
        "export": {"quant": "q8_0"},
        "compare": {"questions": ["Say | and `tick`?", "hello"], "max_tokens": 8},
    }
    flow_run_id = deployed.run_deployment("fine-tune/nightly", spec=spec)
    # its training is a train subflow run, a train flow run like any other: its loss curve
    # while its job trains and at its end (one training serves both looks)
    train_flow_run = wait_until(
        lambda: subflows_of(deployed, flow_run_id).get("train"), 300, "the train subflow run"
    )
    (tmp_path / "loss-curve").mkdir()
    trained_id = assert_the_ui_shows_the_loss_curve_while_the_job_trains_and_at_its_end(
        deployed, uuid.UUID(train_flow_run), before, tmp_path / "loss-curve"
    )

    final = deployed.wait_final(flow_run_id, timeout=900)
    assert final.state.is_completed(), final.state
    artifacts = artifacts_by_key(deployed, flow_run_id)
    key = next(k for k in artifacts if k.endswith("-pipeline"))
    run_id = key.removeprefix("run-").removesuffix("-pipeline")
    assert run_id == trained_id
    assert (deployed.runs / run_id / "exports").is_dir(), run_id

    subflows = subflows_of(deployed, flow_run_id)
    assert set(subflows) == {"train", "export", "compare"}
    assert subflows["train"] == train_flow_run

    with Browser(tmp_path / "profile") as browser:
        open_artifact(browser, ui, flow_run_id, key)
        links = browser.wait_for(
            "(() => { const a = [...document.querySelectorAll('.markdown-renderer a')]"
            ".map(a => a.getAttribute('href')); return a.length ? a : null })()",
            PAGE_TIMEOUT_S,
            "the summary's links",
        )
        text = browser.wait_for_text(
            [f"Fine-tune of run {run_id}", "final loss"], PAGE_TIMEOUT_S, "the summary's text"
        )
        browser.screenshot(tmp_path / "pipeline-summary.png")
        # each link opens its subflow run's page
        train_link = f"/runs/flow-run/{subflows['train']}"
        browser.open(ui + train_link)
        browser.wait_for(
            "document.body.innerText.includes('train')", PAGE_TIMEOUT_S, "the train run"
        )
        browser.screenshot(tmp_path / "train-subflow.png")

    for name, flow_id in subflows.items():
        assert f"/runs/flow-run/{flow_id}" in links, (name, links)
    exported = json.loads(
        next((deployed.runs / run_id / "exports").glob("*/export.json")).read_text()
    )
    assert f"Fine-tune of run {run_id}" in text
    assert "final loss" in text and "SHA-256" in text and "q8_0" in text
    gguf = next((deployed.runs / run_id / "exports" / exported["id"] / "gguf").glob("*.gguf"))
    assert gguf.name == f"run-{run_id}-q8_0.gguf"  # named for the run, not its base
    assert gguf.name in text

    # the train subflow run is a train flow run like any other, as the UI shows it
    async def train_run(client: Any) -> Any:
        return await client.read_flow_run(subflows["train"])

    trained = deployed.server.call(train_run)
    assert trained.state.is_completed(), trained.state
    (tmp_path / "train-run").mkdir()
    assert_the_ui_shows_a_finished_train_run(deployed, trained, run_id, tmp_path / "train-run")


def test_the_runs_flow_lists_the_runs_as_a_table_filtered_by_state(
    deployed: Stack, tmp_path: Path
) -> None:
    ui = deployed.server.url
    records = Runs(deployed.runs).list()
    assert records, "the other tests of this module ran first and left runs"
    flow_run_id = deployed.run_deployment("runs/default", state=["succeeded"])
    final = deployed.wait_final(flow_run_id)
    assert final.state.is_completed(), final.state
    with Browser(tmp_path / "profile") as browser:
        open_artifact(browser, ui, flow_run_id, "runs")
        # every row, once as many are drawn as the table says it holds ("8 Items"): on a
        # loaded machine the rows were read while the table was still being drawn
        rows = browser.wait_for(
            "(() => { const r = [...document.querySelectorAll('.artifact-data-table tbody tr')]"
            ".map(tr => [...tr.querySelectorAll('td')].map(td => td.innerText.trim()));"
            " const n = document.body.innerText.match(/(\\d+) Items?\\b/);"
            " return r.length && n && r.length === Number(n[1]) ? r : null })()",
            PAGE_TIMEOUT_S,
            "the runs table's rows, as many as its item count",
        )
        header = browser.evaluate(
            "[...document.querySelectorAll('.artifact-data-table thead th')]"
            ".map(th => th.innerText.trim())"
        )
        browser.screenshot(tmp_path / "runs-table.png")
    assert header[:9] == [
        "run",
        "kind",
        "state",
        "target",
        "steps",
        "final loss",
        "spend",
        "age",
        "next",
    ]
    succeeded = {r.id for r in records if r.state == RunState.SUCCEEDED}
    listed = {row[0] for row in rows if row[1] == "training"}
    assert listed == succeeded
    assert all(row[2] == "succeeded" for row in rows)
    assert any(row[1] == "export" for row in rows)  # the fine-tune's export, of its run


NASTY = [
    "a|b",
    "back`tick`s",
    "```fence```",
    "<script>alert(1)</script>",
    "line1\nline2",
    "*star* _under_ \\ back",
    "# not a heading",
    "a\\|b",
]
"""Texts that break a markdown table cell written as is."""


def test_table_cells_show_what_they_hold_in_the_ui(deployed: Stack, tmp_path: Path) -> None:
    import asyncio

    from prefect import flow
    from prefect.artifacts import acreate_markdown_artifact
    from prefect.runtime import flow_run
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from overbrainer_prefect.cells import code_cell, table_cell

    @flow(name="cells")
    async def cells() -> str:
        markdown = "| plain | code |\n|---|---|\n" + "".join(
            f"| {table_cell(t)} | {code_cell(t)} |\n" for t in NASTY
        )
        await acreate_markdown_artifact(markdown=markdown, key="cells")
        return str(flow_run.id)

    with temporary_settings(updates={PREFECT_API_URL: deployed.server.api_url}):
        flow_run_id = asyncio.run(cells())
    with Browser(tmp_path / "profile") as browser:
        open_artifact(browser, deployed.server.url, flow_run_id, "cells")
        rows = browser.wait_for(
            "(() => { const r = [...document.querySelectorAll('.markdown-renderer tr')]"
            ".slice(1).map(tr => [...tr.querySelectorAll('td')].map(td => td.innerText));"
            " return r.length ? r : null })()",
            PAGE_TIMEOUT_S,
            "the table's rows",
        )
        browser.screenshot(tmp_path / "cells.png")
    assert [row[0] for row in rows] == NASTY
    assert [row[1] for row in rows] == [" ".join(t.splitlines()) for t in NASTY]


SPEND_IMAGES = """(() => {
  const imgs = [...document.querySelectorAll('.markdown-renderer img')]
    .filter(i => i.src.startsWith('data:image/svg+xml;base64,'));
  if (imgs.length !== 3 || !imgs.every(i => i.complete && i.naturalWidth > 0)) return null;
  return imgs.map(i => [i.alt, i.naturalWidth]);
})()"""


SPEND_IMAGES_V2 = """(() => {
  const imgs = [...document.querySelectorAll('img')]
    .filter(i => i.src.startsWith('data:image/svg+xml;base64,'));
  if (imgs.length !== 3 || !imgs.every(i => i.complete && i.naturalWidth > 0)) return null;
  return imgs.map(i => [i.alt, i.naturalWidth]);
})()"""
"""The spend charts as the V2 UI's artifact page shows them, once loaded."""


def artifact_id(stack: Stack, flow_run_id: Any, key: str) -> str:
    """The ID of the artifact `key` of a flow run, from the server's API."""
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        ArtifactFilterKey,
    )

    async def read(client: Any) -> str:
        found = await client.read_artifacts(
            artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=[key]),
                flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]),
            )
        )
        assert found, f"no artifact {key} of flow run {flow_run_id}"
        return str(found[0].id)

    return str(stack.server.call(read))


BUDGET_LINES = ["day: $20.00", "month: $300.00"]
"""What the spend artifact says of the day's and the month's budgets the test sets."""


def test_the_spend_flow_shows_its_charts_and_what_is_left_of_the_budgets(
    deployed: Stack, tmp_path: Path
) -> None:
    from prefect.client.schemas.actions import VariableCreate

    from overbrainer_prefect.server_budget import BUDGET_VARIABLE

    async def set_budget(client: Any) -> None:
        await client.create_variable(
            VariableCreate(name=BUDGET_VARIABLE, value={"day_usd": 20, "month_usd": 300})
        )

    async def unset_budget(client: Any) -> None:
        await client.delete_variable_by_name(BUDGET_VARIABLE)

    deployed.server.call(set_budget)
    try:
        flow_run_id = deployed.run_deployment("spend/default")
        final = deployed.wait_final(flow_run_id)
    finally:
        deployed.server.call(unset_budget)
    assert final.state.is_completed(), final.state
    with Browser(tmp_path / "profile") as browser:
        open_artifact(browser, deployed.server.url, flow_run_id, "spend")
        images = browser.wait_for(SPEND_IMAGES, PAGE_TIMEOUT_S, "the three spend charts")
        text = browser.wait_for_text(BUDGET_LINES, PAGE_TIMEOUT_S, "the budget line")
        browser.screenshot(tmp_path / "spend.png")
    assert [alt for alt, _ in images] == [
        "dollars by day",
        "dollars by deployment",
        "dollars by target",
    ]
    assert all(width == 720 for _, width in images)
    assert "left" in text
    # the same artifact in the V2 UI (`/v2`): its markdown sanitizer keeps the charts
    with Browser(tmp_path / "profile-v2") as browser:
        browser.open(
            f"{deployed.server.url}/v2/artifacts/artifact/"
            f"{artifact_id(deployed, flow_run_id, 'spend')}"
        )
        images_v2 = browser.wait_for(SPEND_IMAGES_V2, PAGE_TIMEOUT_S, "the V2 UI's spend charts")
        # its text may render after its images, and re-render: the wait is the check
        browser.wait_for_text(BUDGET_LINES, PAGE_TIMEOUT_S, "the V2 UI's budget line")
        browser.screenshot(tmp_path / "spend-v2.png")
    assert [alt for alt, _ in images_v2] == [alt for alt, _ in images]
