"""The `fine_tune` flow run's own summary: one markdown artifact with each step's
result (train: steps, losses, duration, spend; export: quant, size, SHA-256;
compare: the answers, and the evaluation's verdict when there is one; delivery:
its links), each step linking to the flow run that did it in the Prefect UI.

`publish_pipeline_summary(result, runs, spent)` is the one call the pipeline
makes, once its steps are done. The steps are read from the result, the
records (`run.json`, `metrics.jsonl`), what the run's place cost (asked of its
target) and the subflow runs of this flow run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Protocol
from uuid import UUID

from prefect.artifacts import acreate_markdown_artifact
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
from prefect.runtime import flow_run as this_flow_run

from overbrainer_prefect.artifacts import artifact_key
from overbrainer_prefect.cells import code_cell, run_duration, sig, size_text, table_cell
from overbrainer_prefect.evaluation.gate import GateDecision
from overbrainer_prefect.evaluation.results import EvaluationResult
from overbrainer_prefect.kinds.compare import CompareResult
from overbrainer_prefect.kinds.export import ExportResult
from overbrainer_prefect.nightly.decision import NightFacts, night_facts
from overbrainer_prefect.runs.metrics import MetricsSummary, stored_summary
from overbrainer_prefect.runs.store import RunRecord, Runs, RunsError
from overbrainer_prefect.store.records import RecordError
from overbrainer_prefect.trainers.base import METRICS_FILE


class PipelineOutcome(Protocol):
    """What the summary reads of the `fine_tune` flow's result."""

    @property
    def run_id(self) -> str: ...
    @property
    def export(self) -> ExportResult | None: ...
    @property
    def compare(self) -> CompareResult | None: ...
    @property
    def evaluation(self) -> EvaluationResult | None: ...
    @property
    def verdict(self) -> str | None: ...
    @property
    def gate(self) -> GateDecision | None: ...
    @property
    def reused(self) -> list[str]: ...
    @property
    def next(self) -> str: ...
    @property
    def night(self) -> NightFacts | None: ...


@dataclass
class StepLine:
    """One step of the pipeline as its summary shows it: its name, how it ended,
    the flow run that did it, and what it gave (label, markdown value) pairs."""

    name: str
    state: str
    flow_run_id: str | None = None
    facts: list[tuple[str, str]] = field(default_factory=list)
    reused: bool = False


def flow_run_link(flow_run_id: str | UUID | None, text: str) -> str:
    """A markdown link to a flow run's page in the Prefect UI
    (`/runs/flow-run/<id>`, relative, so it opens on whichever server shows
    the artifact); the plain text when there is no flow run."""
    if flow_run_id is None:
        return text
    return f"[{text}](/runs/flow-run/{flow_run_id})"


def pipeline_markdown(
    run_id: str, steps: list[StepLine], next_step: str = "", dollars: float | None = None
) -> str:
    """The summary: what its places cost (`dollars`, when any bills), a table
    of the steps (state, reused or not, link to its flow run), then a section
    for each with what it gave."""
    lines = [
        f"# Fine-tune of run {run_id}",
        "",
        *(
            [f"Dollars: **${dollars:.4f}** (every pod of this fine-tune: rate × uptime)", ""]
            if dollars is not None
            else []
        ),
        "| step | state | flow run |",
        "|---|---|---|",
    ]
    for step in steps:
        state = f"**{step.state}**" + (" (reused)" if step.reused else "")
        link = flow_run_link(step.flow_run_id, f"{step.name} flow run")
        lines.append(f"| {step.name} | {state} | {link} |")
    for step in steps:
        lines += ["", f"## {flow_run_link(step.flow_run_id, step.name.capitalize())}", ""]
        if not step.facts:
            lines.append("Nothing to show.")
            continue
        lines += ["| | |", "|---|---|"]
        lines += [f"| {label} | {value} |" for label, value in step.facts]
    if next_step:
        lines += ["", "## Next", "", next_step]
    lines.append("")
    return "\n".join(lines)


def train_step(
    runs: Runs, run_id: str, flow_run_id: str | None, reused: bool, spent: float | None = None
) -> StepLine:
    """The training step from the run's record and files: steps, first and final
    loss, duration and, on a pod, what it cost (`spent`, asked of its target)."""
    try:
        record = runs.load(run_id)
    except (RunsError, RecordError) as error:
        return StepLine("train", "unknown", flow_run_id, [("record", table_cell(str(error)))])
    summary = _metrics(runs, record)
    steps = str(summary.last.step if summary.last else 0)
    if summary.max_steps:
        steps += f" / {summary.max_steps}"
    facts = [
        ("run", code_cell(record.id)),
        ("steps", steps),
        ("first loss", _loss(summary.first_loss)),
        ("final loss", _loss(summary.final_loss)),
        ("duration", run_duration(record)),
    ]
    if spent is not None:
        facts.append(("spend", f"${spent:.2f} (estimated: rate × uptime)"))
    return StepLine(
        "train", str(record.state), flow_run_id or record.flow_run_id, facts, reused=reused
    )


def export_step(exported: ExportResult, flow_run_id: str | None) -> StepLine:
    """The export step from the export flow's result: quant, the GGUF's name,
    size and SHA-256, and how long each phase took."""
    facts = [("export", code_cell(exported.export_id)), ("quant", code_cell(exported.quant))]
    gguf = exported.gguf
    if gguf is not None:
        facts += [
            ("GGUF", code_cell(gguf.path)),
            ("size", size_text(gguf.size)),
            ("SHA-256", code_cell(gguf.sha256)),
        ]
    phases = exported.phases
    if phases:
        facts.append(("phases", ", ".join(f"{k} {v:.1f} s" for k, v in phases.items())))
    return StepLine("export", str(exported.state), flow_run_id, facts, reused=bool(exported.reused))


def compare_step(compared: CompareResult, flow_run_id: str | None) -> StepLine:
    """The compare step from the compare flow's result: how many questions were
    answered and where the answers are."""
    facts = [
        ("compare", code_cell(compared.compare_id)),
        ("questions", str(len(compared.answers))),
    ]
    if compared.answers_path:
        facts.append(("answers", code_cell(str(compared.answers_path))))
    return StepLine(
        "compare", str(compared.state), flow_run_id, facts, reused=bool(compared.reused)
    )


def evaluation_step(result: PipelineOutcome, flow_run_id: str | None) -> StepLine:
    """The evaluation step: its verdict, and what the gate decided from it."""
    facts = [("verdict", table_cell(str(result.verdict)))]
    gate = result.gate
    if gate is not None:
        facts.append(("gate", table_cell(gate.line)))
    return StepLine("evaluate", "completed", flow_run_id, facts)


def delivery_step(links: list[tuple[str, str]], flow_run_id: str | None) -> StepLine:
    """A delivery step: each place the model went to, as (name, URL) links."""
    facts = [(table_cell(name), f"[{table_cell(url)}]({url})") for name, url in links]
    return StepLine("deliver", "completed", flow_run_id, facts)


async def subflow_ids(parent: UUID | str) -> dict[str, str]:
    """The newest subflow run of each flow below the flow run `parent` (one
    level), by flow name: `{"train": "<flow run id>", ...}`."""
    found: dict[str, tuple[datetime | None, str]] = {}
    async with get_client() as client:
        children = await client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[UUID(str(parent))])
            )
        )
        names: dict[UUID, str] = {}
        for child in children:
            if child.flow_id not in names:
                names[child.flow_id] = (await client.read_flow(child.flow_id)).name
            name = names[child.flow_id]
            created = child.created
            newest = found[name][0] if name in found else None
            if name not in found or (created is not None and (newest is None or created > newest)):
                found[name] = (created, str(child.id))
    return {name: flow_run_id for name, (_, flow_run_id) in found.items()}


async def publish_pipeline_summary(
    result: PipelineOutcome,
    runs: Runs,
    deliveries: list[tuple[str, str]] | None = None,
    spent: float | None = None,
    dollars: float | None = None,
) -> None:
    """Publishes the summary of the `fine_tune` flow run that is running now, from
    its result, what the run's place cost (`spent`, None on a machine you
    own) and what every place of the fine-tune cost (`dollars`): a markdown
    artifact keyed `run-<run id>-pipeline`. A subflow run that cannot be
    found leaves its step without a link; the summary never fails the
    pipeline's result (what cannot be published is raised as the Prefect
    API's error)."""
    children = await subflow_ids(this_flow_run.id) if this_flow_run.id else {}
    reused = set(result.reused)
    steps = [train_step(runs, result.run_id, children.get("train"), "training" in reused, spent)]
    if result.night is not None:  # its fingerprint and what changed
        steps.insert(0, StepLine("night", "trained", this_flow_run.id, night_facts(result.night)))
    if result.export is not None:
        steps.append(export_step(result.export, children.get("export")))
    if result.compare is not None:
        steps.append(compare_step(result.compare, children.get("compare")))
    if result.evaluation is not None:
        steps.append(evaluation_step(result, children.get("evaluate")))
    if deliveries:
        steps.append(delivery_step(deliveries, children.get("deliver")))
    await acreate_markdown_artifact(
        markdown=pipeline_markdown(result.run_id, steps, result.next, dollars),
        key=artifact_key(result.run_id, "pipeline"),
        description=f"The fine-tune of run {result.run_id}: each step, linked to its flow run",
    )


def _metrics(runs: Runs, record: RunRecord) -> MetricsSummary:
    return stored_summary(runs, record.id, METRICS_FILE)


def _loss(value: float | None) -> str:
    return "-" if value is None else sig(value)
