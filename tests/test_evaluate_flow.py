"""The evaluation as one more job of the driver, for real on the local target:
the tiny model fine-tuned with rows held out of training, exported, then its
shipped GGUF and its base model's GGUF asked the held-out items and the
controls by llama.cpp; scored here into a verdict, recorded under the run,
shown in an artifact whose first line is the verdict. Then the nightly gate:
a model no better than the last delivered one is kept and reported but not
delivered; one that passes is delivered to an Ollama stand-in and becomes
the model the next night is measured against, and the next night with the same
data trains nothing."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterKey,
    FlowRunFilter,
    FlowRunFilterParentFlowRunId,
)

from overbrainer_prefect.blocks import LocalTarget
from overbrainer_prefect.delivery.record import load_deliveries
from overbrainer_prefect.evaluation.gate import (
    Delivered,
    GateRule,
    last_delivered,
    remember_delivered,
)
from overbrainer_prefect.evaluation.results import SCORED_FILE
from overbrainer_prefect.evaluation.spec import BadEvaluationInput, EvalItem, EvaluationSpec
from overbrainer_prefect.finetune import CompareSettings, DeliverSettings
from overbrainer_prefect.flows import FineTuneResult, FineTuneSpec, evaluate, fine_tune
from overbrainer_prefect.flows.runs import runs as runs_flow
from overbrainer_prefect.runs import Runs
from overbrainer_prefect.timestamps import rfc3339
from overbrainer_prefect.trainers.export import ExportSpec
from tests.conftest import job_venv
from tests.flowrun import run
from tests.standins.ollama_server import OllamaStandIn
from tests.test_runpod_flows import flow_logs
from tests.test_train_flow import spec

pytestmark = pytest.mark.slow

NEVER = EvalItem.model_validate(
    {
        "messages": [{"role": "user", "content": "Say the secret word."}],
        "expected": "^ZZZ never said$",
        "scorer": "regex",
    }
)
"""A held-out item no model passes: the gate's outcome does not hang on the tiny model."""


@dataclass
class Evaluated:
    """The module's pipeline with an evaluation: its spec, its result, and its
    flow run's final state (name and message) and ID."""

    spec: FineTuneSpec
    result: FineTuneResult
    message: str | None
    state_name: str | None
    flow_run_id: UUID
    ollama_block: str


@pytest.fixture(scope="module")
def ollama() -> Iterator[OllamaStandIn]:
    with OllamaStandIn() as server:
        yield server


@pytest.fixture(scope="module")
def evaluated(
    prefect_server: None,
    tiny: tuple[Path, Path],
    ollama: OllamaStandIn,
    tmp_path_factory: pytest.TempPathFactory,
) -> Evaluated:
    """One `fine_tune` of the tiny model with 8 rows held out, an evaluation of
    them and the controls, a gate, and a delivery to the Ollama stand-in; the
    last delivered model says 1 of 1 held-out items passed, so this one fails."""
    from overbrainer_prefect.blocks import OllamaServer

    root = tmp_path_factory.mktemp("evaluate")
    name = f"local-{uuid.uuid4().hex[:8]}"
    LocalTarget(
        job_venv=str(job_venv()), work_dir=str(root / "work"), poll_seconds=0.5, cpu_threads=1
    ).save(name)
    server = f"ollama-{uuid.uuid4().hex[:8]}"
    OllamaServer(url=ollama.url).save(server)
    runs_dir = root / "runs"
    remember_delivered(
        Runs(runs_dir),
        Delivered(
            deployment="fine-tune",
            run_id="20260101-000000-last",
            gguf_path="elsewhere.gguf",
            gguf_sha256="0" * 64,
            heldout_passed=1,
            heldout_total=1,
            delivered=rfc3339(),
        ),
        None,
    )
    fine = FineTuneSpec(
        target=name,
        training=spec(*tiny, holdout=8),
        export=ExportSpec(quant="q8_0"),
        compare=CompareSettings(questions=["Hello?"], max_tokens=4),
        evaluation=EvaluationSpec(items=[NEVER], max_tokens=8, quant="q8_0"),
        gate=GateRule(),
        deliver=DeliverSettings(ollama=server, model_name="tuned"),
        runs_dir=str(runs_dir),
    )
    state = run(fine_tune(fine, return_state=True))
    result = state.result()
    assert isinstance(result, FineTuneResult), result
    return Evaluated(
        spec=fine,
        result=result,
        message=state.message,
        state_name=state.name,
        flow_run_id=state.state_details.flow_run_id,
        ollama_block=server,
    )


def test_the_evaluation_scores_held_out_rows_never_trained_on_and_the_controls(
    evaluated: Evaluated,
) -> None:
    result = evaluated.result.evaluation
    assert result is not None
    runs = Runs(evaluated.spec.runs_dir)
    run_id = evaluated.result.run_id
    heldout = [i for i in result.plan.items if i.group == "heldout"]
    controls = [i for i in result.plan.items if i.group == "control"]
    assert len(heldout) == 8 + 1 and len(controls) == 10  # the run's rows, the item, the set
    uploaded = (Path(runs.load(run_id).remote_dir) / "data").rglob("*.jsonl")
    trained = "".join(p.read_text() for p in uploaded)
    for item in heldout[:8]:  # the held-out rows never reached the target
        assert item.messages[-1].content not in trained
    assert result.models["base"].sha256 == result.plan.base.sha256
    assert result.models["tuned"].sha256 == evaluated.result.export.gguf.sha256  # type: ignore[union-attr]
    assert result.heldout.tuned.total == 9 and result.heldout.base.total == 9
    assert result.perplexity is not None and set(result.perplexity) == {"base", "tuned"}
    (evaluation_dir,) = runs.children(run_id, "evaluation").root.iterdir()
    scored = json.loads((evaluation_dir / SCORED_FILE).read_text())
    assert scored["heldout"]["tuned"]["total"] == 9


def test_the_verdict_leads_the_evaluation_artifact_and_the_pipeline_summary(
    evaluated: Evaluated,
) -> None:
    verdict = evaluated.result.verdict
    assert verdict is not None and "held-out" in verdict and "controls" in verdict

    async def artifacts() -> dict[str, Any]:
        async with get_client() as client:
            found = await client.read_artifacts(
                artifact_filter=ArtifactFilter(key=ArtifactFilterKey(like_="%"))
            )
        return {a.key: a for a in found if a.key}

    found = run(artifacts())
    runs = Runs(evaluated.spec.runs_dir)
    (evaluation_dir,) = runs.children(evaluated.result.run_id, "evaluation").root.iterdir()
    evaluation = found[f"evaluation-{evaluation_dir.name}".lower()]  # its own, not another's
    first = next(line for line in str(evaluation.data).splitlines() if line.strip())
    assert verdict in first
    pipeline = found[f"run-{evaluated.result.run_id}-pipeline".lower()]
    assert "evaluate" in str(pipeline.data) and "failed: held-out " in str(pipeline.data)
    assert "not delivered: " not in str(pipeline.data)  # the gate's line says what it measured


def flow_run_state(flow_run_id: UUID) -> tuple[str, str | None]:
    """The type and name of a flow run's state, as the server keeps it."""

    async def go() -> tuple[str, str | None]:
        async with get_client() as client:
            state = (await client.read_flow_run(flow_run_id)).state
            assert state is not None
            return str(state.type.value), state.name

    found: tuple[str, str | None] = run(go())
    return found


def listed_delivery(runs_dir: str | None, run_id: str) -> str | None:
    """What the `runs` flow lists as run `run_id`'s delivery."""
    listing = run(runs_flow(runs_dir=runs_dir))
    [row] = [r for r in listing.rows if r.id == run_id]
    delivery: str | None = row.delivery
    return delivery


def test_a_model_worse_than_the_last_delivered_is_kept_and_reported_but_not_delivered(
    evaluated: Evaluated, ollama: OllamaStandIn
) -> None:
    gate = evaluated.result.gate
    run_id = evaluated.result.run_id
    assert gate is not None and not gate.passed
    assert re.fullmatch(
        r"held-out \d/9 = \d+%, below the last delivered model's 1/1 = 100% "
        r"\(run 20260101-000000-last\)",
        gate.reason,
    ), gate.reason
    (evaluation_dir,) = Runs(evaluated.spec.runs_dir).children(run_id, "evaluation").root.iterdir()
    assert gate.evaluation_id == evaluation_dir.name
    assert evaluated.message == (
        f"not delivered: {gate.reason} (evaluation {gate.evaluation_id}); run {run_id} and its "
        f"GGUF are kept: deliver it anyway with the deliver flow (run_id={run_id}, "
        f"ollama={evaluated.ollama_block}, quant=q8_0)"
    )
    assert evaluated.message.count("delivered:") == 1  # said once, not "not delivered: not ..."
    # told apart at a glance: a Completed state of its own name, on the server
    assert evaluated.state_name == "Not delivered"
    assert flow_run_state(evaluated.flow_run_id) == ("COMPLETED", "Not delivered")
    assert evaluated.result.delivered is None
    assert ollama.count("POST", "/api/create") == 0
    kept = Runs(evaluated.spec.runs_dir).load(run_id)
    assert kept.state == "succeeded"  # kept
    last = last_delivered(Runs(evaluated.spec.runs_dir), "fine-tune")
    assert last is not None and last.run_id == "20260101-000000-last"
    record = load_deliveries(Runs(evaluated.spec.runs_dir), run_id)
    assert record.deliveries == []
    [refused] = record.not_delivered
    assert refused.reason == gate.reason and refused.evaluation_id == gate.evaluation_id
    assert refused.flow_run_id == str(evaluated.flow_run_id)
    assert listed_delivery(evaluated.spec.runs_dir, run_id) == f"not delivered: {gate.reason}"


def test_a_model_that_passes_its_gate_is_delivered_and_measured_against_next(
    evaluated: Evaluated, ollama: OllamaStandIn
) -> None:
    lenient = evaluated.spec.model_copy(
        update={"gate": GateRule(heldout_at_least_last=False, max_control_regressions=10)}
    )
    run_id = evaluated.result.run_id
    state = run(fine_tune(lenient, run_id=run_id, return_state=True))
    result = state.result()
    assert isinstance(result, FineTuneResult) and result.gate is not None and result.gate.passed
    assert state.name == "Completed"
    assert result.delivered is not None and ollama.count("POST", "/api/create") == 1
    assert "training" in result.reused and "export" in result.reused
    assert result.evaluation is not None and result.evaluation.evaluation_id is not None
    evaluation_id = result.evaluation.evaluation_id
    assert result.gate.evaluation_id == evaluation_id
    assert result.gate.line.startswith("passed: ") and "delivered:" not in result.gate.line
    last = last_delivered(Runs(evaluated.spec.runs_dir), "fine-tune")
    assert last is not None and last.run_id == run_id
    assert last.evaluation_id == evaluation_id  # the record names the evaluation that let it in
    assert last.gguf_sha256 == result.export.gguf.sha256  # type: ignore[union-attr]
    [delivery] = load_deliveries(Runs(evaluated.spec.runs_dir), run_id).deliveries
    assert delivery.evaluation_id == evaluation_id and delivery.name == "tuned:q8_0"
    # the gate's line says it passed, before the delivery; the delivery is said once made
    lines = flow_logs(str(state.state_details.flow_run_id))
    gate_line = next(i for i, m in enumerate(lines) if m.startswith("the gate ("))
    assert lines[gate_line].endswith(f") {result.gate.line}")
    assert gate_line < lines.index(f"run {run_id} delivered: ollama tuned:q8_0")
    assert not any("passed: delivered" in m for m in lines)
    assert listed_delivery(evaluated.spec.runs_dir, run_id) == "delivered: ollama tuned:q8_0"

    # the next night, with the same data and settings: nothing trained, nothing created
    runs = Runs(evaluated.spec.runs_dir)
    before = sorted(r.id for r in runs.list())
    state = run(fine_tune(lenient, return_state=True))
    assert state.is_completed()
    assert state.message.startswith(
        f"nothing changed since run {evaluated.result.run_id} (delivered 20"
    )
    assert "): nothing trained" in state.message
    assert sorted(r.id for r in runs.list()) == before
    assert run(_subflows(state.state_details.flow_run_id)) == []
    assert ollama.count("POST", "/api/create") == 1


async def _subflows(flow_run_id: Any) -> list[Any]:
    async with get_client() as client:
        return await client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id])
            )
        )


def test_an_eval_file_row_without_its_expected_answer_is_refused_before_anything_runs(
    evaluated: Evaluated, tmp_path: Path
) -> None:
    bad = tmp_path / "eval.jsonl"
    bad.write_text('{"prompt": "What is 2+2?", "expected": "4"}\n{"prompt": "Who?"}\n')
    runs = Runs(evaluated.spec.runs_dir)
    store = runs.children(evaluated.result.run_id, "evaluation").root
    before = sorted(p.name for p in store.iterdir())
    with pytest.raises(BadEvaluationInput, match=r"eval.jsonl line 2") as raised:
        run(
            evaluate(
                run_id=evaluated.result.run_id,
                evaluation=EvaluationSpec(eval_file=str(bad), quant="q8_0"),
                runs_dir=evaluated.spec.runs_dir,
            )
        )
    assert "\n" not in str(raised.value)
    assert sorted(p.name for p in store.iterdir()) == before
