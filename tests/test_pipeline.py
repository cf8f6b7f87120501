"""The `fine_tune` pipeline on the local target, for real: the tiny model trained
(once for the module), exported to q8_0 and compared, each step a subflow linked
to the pipeline's flow run on the test server, its data prepared by a prefect-shell
`ShellOperation` block that writes a JSONL file and names it. Then the same run continued: a
compare that fails at job time stops the pipeline with its message and what was
kept, and a later `fine_tune` of the run reuses its training and export and
compares again; and bad input that starts nothing."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
from prefect.client.schemas.objects import FlowRun, StateType
from prefect_shell import ShellOperation

from overbrainer_prefect.blocks import LocalTarget
from overbrainer_prefect.finetune import CompareSettings, PipelineFailed
from overbrainer_prefect.flows import FineTuneResult, FineTuneSpec, fine_tune
from overbrainer_prefect.runs import RunNotFound, Runs, RunState
from overbrainer_prefect.trainers.compare import BadQuestions
from overbrainer_prefect.trainers.export import ExportSpec
from tests.conftest import job_venv
from tests.flowrun import run
from tests.test_train_flow import spec

QUESTIONS = ["What colour is the sky?", "Name a fruit."]


def children_of(flow_run_id: UUID) -> list[FlowRun]:
    """The flow runs the server links to `flow_run_id` as its subflows, oldest first."""

    async def go() -> list[FlowRun]:
        async with get_client() as client:
            found = await client.read_flow_runs(
                flow_run_filter=FlowRunFilter(
                    parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id])
                )
            )
            parents = {r.parent_task_run_id for r in found}
            for task_run_id in parents:
                assert task_run_id is not None
                task_run = await client.read_task_run(task_run_id)
                assert task_run.flow_run_id == flow_run_id
            return sorted(found, key=lambda r: r.start_time or r.created or 0)

    return run(go())


@dataclass
class Piped:
    """The module's pipeline: its spec, the flow run and its result."""

    spec: FineTuneSpec
    flow_run_id: UUID
    result: FineTuneResult
    prepare: str
    prepared: Path

    @property
    def runs(self) -> Runs:
        return Runs(self.spec.runs_dir)

    def entries(self) -> dict[str, list[str]]:
        """The run directories, and the exports and compares of the module's run."""
        runs, run_id = self.runs, self.result.run_id
        return {
            "runs": sorted(r.id for r in runs.list()),
            "exports": sorted(p.name for p in runs.children(run_id, "export").root.iterdir()),
            "compares": sorted(p.name for p in runs.children(run_id, "compare").root.iterdir()),
        }


@pytest.fixture(scope="module")
def piped(
    prefect_server: None, tiny: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Piped:
    """One `fine_tune` of the tiny model: its data written by a prepare block,
    train (6 steps), export q8_0, compare."""
    root = tmp_path_factory.mktemp("pipeline")
    name = f"local-{uuid.uuid4().hex[:8]}"
    LocalTarget(
        job_venv=str(job_venv()), work_dir=str(root / "work"), poll_seconds=0.5, cpu_threads=1
    ).save(name)
    fine = FineTuneSpec(
        target=name,
        training=spec(*tiny),
        export=ExportSpec(quant="q8_0"),
        compare=CompareSettings(questions=QUESTIONS, max_tokens=4),
        runs_dir=str(root / "runs"),
    )
    prepared = root / "export" / "tonight.jsonl"
    prepared.parent.mkdir()
    prepare = f"prepare-{uuid.uuid4().hex[:8]}"
    ShellOperation(
        commands=[
            f"cp {tiny[1]} {prepared}",
            "echo exported",
            f"echo OVERBRAINER_DATASET={prepared.name}",
        ],
        working_dir=prepared.parent,
    ).save(prepare)
    state = run(fine_tune(fine, prepare=prepare, return_state=True))
    result = state.result()
    assert isinstance(result, FineTuneResult), result
    return Piped(fine, state.state_details.flow_run_id, result, prepare, prepared)


@pytest.mark.slow
def test_fine_tune_trains_exports_and_compares_as_three_linked_subflows(piped: Piped) -> None:
    result = piped.result
    assert result.reused == []
    assert result.run is not None and result.run.state == RunState.SUCCEEDED
    assert result.export.state == RunState.SUCCEEDED and result.export.quant == "q8_0"
    assert result.export.run_id == result.run_id == result.compare.run_id
    assert result.compare.state == RunState.SUCCEEDED
    assert [p.question for p in result.compare.answers] == QUESTIONS
    assert all(p.base is not None and p.tuned is not None for p in result.compare.answers)
    assert result.compare.tuned_gguf.sha256 == result.export.gguf.sha256  # type: ignore[union-attr]
    children = children_of(piped.flow_run_id)
    assert len(children) == 3
    assert all(c.state_type == StateType.COMPLETED for c in children)

    async def flow_names() -> list[str]:
        async with get_client() as client:
            return [(await client.read_flow(c.flow_id)).name for c in children]

    assert run(flow_names()) == ["train", "export", "compare"]

    async def state_name() -> str | None:
        async with get_client() as client:
            state = (await client.read_flow_run(piped.flow_run_id)).state
            return state.name if state is not None else None

    assert run(state_name()) == "Completed"  # no gate: not a "Not delivered" night
    assert children[0].parameters["training"]["max_steps"] == 6
    assert children[2].parameters["run_id"] == result.run_id


@pytest.mark.slow
def test_a_prepare_block_that_writes_a_jsonl_feeds_the_training(piped: Piped) -> None:
    (train_run,) = [c for c in children_of(piped.flow_run_id) if c.parameters.get("training")]
    datasets = train_run.parameters["training"]["datasets"]
    assert [d["path"] for d in datasets] == [str(piped.prepared)]  # relative to its working dir
    uploaded = (Path(piped.runs.load(piped.result.run_id).remote_dir) / "data").rglob("*.jsonl")
    assert [p.read_bytes() for p in uploaded] == [piped.prepared.read_bytes()]
    night = piped.result.night
    assert night is not None and night.prepared_by == piped.prepare
    assert night.fingerprint.sources["dataset 1"] == str(piped.prepared)


@pytest.mark.slow
def test_a_fine_tune_whose_compare_fails_is_continued_and_reuses_train_and_export(
    piped: Piped,
) -> None:
    run_id = piped.result.run_id
    before = piped.entries()
    # a question the model's context cannot hold: known only on the target, at job time
    breaking = piped.spec.model_copy(
        update={"compare": CompareSettings(questions=["Hi?", "why " * 400], max_tokens=4)}
    )
    with pytest.raises(PipelineFailed) as caught:
        run(fine_tune(breaking, run_id=run_id))
    message = str(caught.value)
    assert message.startswith("the fine-tune stopped at the compare: compare ")
    assert "failed: the job exited with code 2" in message
    assert f"kept run {run_id} (succeeded" in message
    assert f"its export {piped.result.export.export_id}" in message
    assert message.endswith(f"continue with the fine_tune flow (run_id={run_id})")
    after_failure = piped.entries()
    assert after_failure["runs"] == before["runs"] and after_failure["exports"] == before["exports"]
    (failed,) = set(after_failure["compares"]) - set(before["compares"])
    assert piped.runs.children(run_id, "compare").load(failed).state == RunState.FAILED

    fixed = piped.spec.model_copy(
        update={"compare": CompareSettings(questions=["Hi?", "Why?"], max_tokens=4)}
    )
    result = run(fine_tune(fixed, run_id=run_id))
    assert isinstance(result, FineTuneResult)
    assert result.run_id == run_id and result.run is None
    assert result.reused == ["training", "export"]
    assert result.export.export_id == piped.result.export.export_id
    assert result.compare.state == RunState.SUCCEEDED and not result.compare.reused
    assert [p.question for p in result.compare.answers] == ["Hi?", "Why?"]
    after = piped.entries()
    assert after["runs"] == before["runs"] and after["exports"] == before["exports"]
    assert len(after["compares"]) == len(before["compares"]) + 2

    # and once more: nothing is left to do, every step is reused
    again = run(fine_tune(fixed, run_id=run_id))
    assert again.reused == ["training", "export", "compare"]
    assert again.compare.compare_id == result.compare.compare_id
    assert piped.entries() == after


@pytest.mark.slow
@pytest.mark.parametrize(
    ("compare", "run_id", "error", "expected"),
    [
        ({"questions": []}, None, BadQuestions, r"^no questions: give questions="),
        ({"questions_file": "/nonexistent/q.yaml"}, None, BadQuestions, r"does not exist"),
        ({"questions": ["Hi?"]}, "20260101-000000-zzzz", RunNotFound, r"no run 20260101"),
    ],
)
def test_bad_fine_tune_input_is_refused_in_one_line_before_anything_starts(
    piped: Piped,
    tmp_path: Path,
    compare: dict[str, Any],
    run_id: str | None,
    error: type[Exception],
    expected: str,
) -> None:
    runs_dir = tmp_path / "runs"
    bad = piped.spec.model_copy(
        update={"compare": CompareSettings(**compare), "runs_dir": str(runs_dir)}
    )
    with pytest.raises(error, match=expected) as caught:
        run(fine_tune(bad, run_id=run_id))
    assert "\n" not in str(caught.value)
    assert not runs_dir.exists()
