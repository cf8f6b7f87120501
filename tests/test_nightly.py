"""A night with nothing new costs nothing, and its data prepared by a prefect-shell
step: the fingerprint of what a fine-tune would train (datasets by content or Hub
commit, the base model, the settings, the version) and what changed, as fast
unit tests; then the `fine_tune` flow on the real Prefect test server up to the
point where it would train: the same night as the last delivered one ends
`Completed` with "nothing changed" and creates nothing, a changed row or
force=True goes on to train, and a prepare block (a real `ShellOperation` run by
prefect-shell) feeds it, or stops it with its own last lines.

The fine-tunes themselves are the pipeline's and the evaluation's modules':
`test_pipeline.py` trains on a prepared file, `test_evaluate_flow.py` delivers
and then runs the same night again."""

from __future__ import annotations

import json
import secrets
import uuid
from pathlib import Path
from typing import Any

import pytest
from huggingface_hub import constants as hf_constants
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
from prefect_shell import ShellOperation

from overbrainer_prefect.blocks import LocalTarget
from overbrainer_prefect.evaluation.spec import EvaluationSpec
from overbrainer_prefect.finetune import CompareSettings, PipelineFailed
from overbrainer_prefect.flows import FineTuneSpec, fine_tune
from overbrainer_prefect.nightly.decision import (
    night_facts,
    plan_night,
    remember_delivered,
    remember_trained,
)
from overbrainer_prefect.nightly.fingerprint import (
    Fingerprint,
    FingerprintError,
    differences,
    fingerprint,
    hub_resolver,
    pinned,
)
from overbrainer_prefect.nightly.prepared import (
    Prepared,
    PrepareError,
    apply,
    check_rows,
    parse_output,
)
from overbrainer_prefect.nightly.record import NightlyRecordError, night_key
from overbrainer_prefect.runs.store import Runs
from overbrainer_prefect.trainers.export import ExportSpec
from overbrainer_prefect.trainers.spec import TrainingSpec
from tests.flowrun import run
from tests.standins.hub_server import Commit, HubStandIn, Repo

ROW = {"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hi."}]}
COMMIT = "c0ffee" + "0" * 34


def rows(path: Path, *answers: str) -> Path:
    path.write_text(
        "".join(
            json.dumps({"messages": [ROW["messages"][0], {"role": "assistant", "content": a}]})
            + "\n"
            for a in answers
        )
    )
    return path


def training(dataset: Path, **changes: Any) -> TrainingSpec:
    values: dict[str, Any] = {
        "base_model": "/models/on-the-target",
        "datasets": [str(dataset)],
        "max_steps": 6,
    }
    return TrainingSpec.model_validate({**values, **changes})


def no_hub(kind: str, repo: str, revision: str | None) -> str:
    raise AssertionError(f"the Hub was asked for {kind} {repo}")


def print_of(train: TrainingSpec, export: ExportSpec | None = None) -> Fingerprint:
    return fingerprint(train, export or ExportSpec(), None, no_hub, version="1.0")


# the fingerprint and its differences


def test_the_same_inputs_give_the_same_key_and_a_changed_row_names_its_dataset(
    tmp_path: Path,
) -> None:
    data = rows(tmp_path / "chats.jsonl", "Hi.", "Hello.")
    first = print_of(training(data))
    assert first == print_of(training(data))
    rows(data, "Hi.", "Hello!")
    changed = print_of(training(data))
    assert changed.key != first.key
    (line,) = differences(first, changed)
    assert line.startswith(f"dataset 1 ({data}): sha256 ")
    assert first.parts["dataset 1"][7:19] in line and changed.parts["dataset 1"][7:19] in line


def test_a_prepared_file_keys_by_its_content_not_its_path(tmp_path: Path) -> None:
    monday = rows(tmp_path / "export-monday.jsonl", "Hi.")
    tuesday = rows(tmp_path / "export-tuesday.jsonl", "Hi.")
    assert print_of(training(monday)).key == print_of(training(tuesday)).key


def test_a_changed_setting_names_the_setting_and_both_values(tmp_path: Path) -> None:
    data = rows(tmp_path / "chats.jsonl", "Hi.")
    before = print_of(training(data))
    after = print_of(training(data, learning_rate=5e-4, extra={"weight_decay": 0.1}))
    assert differences(before, after) == [
        "training.learning_rate: 0.0002 → 0.0005",
        "training.extra.weight_decay: new, 0.1",
    ]
    quant = print_of(training(data), ExportSpec(quant="q8_0"))
    assert differences(before, quant) == ['export.quant: "q4_k_m" → "q8_0"']
    newer = fingerprint(training(data), ExportSpec(), None, no_hub, version="1.1")
    assert differences(before, newer) == ["package: 1.0 → 1.1"]


def test_an_eval_file_is_keyed_by_its_content(tmp_path: Path) -> None:
    data = rows(tmp_path / "chats.jsonl", "Hi.")
    items = tmp_path / "eval.jsonl"
    items.write_text('{"prompt": "2+2?", "expected": "4"}\n')
    evaluation = EvaluationSpec(eval_file=str(items))
    before = fingerprint(training(data), ExportSpec(), evaluation, no_hub, version="1")
    items.write_text('{"prompt": "2+2?", "expected": "four"}\n')
    after = fingerprint(training(data), ExportSpec(), evaluation, no_hub, version="1")
    (line,) = differences(before, after)
    assert line.startswith(f"evaluation.eval_file ({items}): sha256 ")


def test_a_dataset_that_cannot_be_read_is_one_line(tmp_path: Path) -> None:
    spec = training(rows(tmp_path / "chats.jsonl", "Hi."))
    (tmp_path / "chats.jsonl").unlink()
    with pytest.raises(FingerprintError, match=r"^dataset .*chats.jsonl cannot be read") as caught:
        print_of(spec)
    assert "\n" not in str(caught.value)


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The Hub stand-in holding a public model and huggingface_hub allowed to reach it."""
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    with HubStandIn("hf_" + secrets.token_hex(8)) as server:
        server.repos["org/base"] = Repo("org/base", private=False, commits=[Commit(COMMIT, "", [])])
        yield server


def test_a_hub_base_model_is_resolved_to_its_commit_and_pinned(hub: Any, tmp_path: Path) -> None:
    spec = training(rows(tmp_path / "chats.jsonl", "Hi."), base_model="org/base")
    resolve = hub_resolver(endpoint=hub.url)
    print_ = fingerprint(spec, ExportSpec(), None, resolve, version="1")
    assert print_.parts["base model"] == f"org/base@{COMMIT}"
    assert pinned(spec, print_).extra["revision_of_model"] == COMMIT
    # a new commit on the Hub is a new night, named by both commits
    hub.repos["org/base"].commits.append(Commit("d" * 40, "", []))
    moved = fingerprint(spec, ExportSpec(), None, resolve, version="1")
    assert differences(print_, moved) == [
        f"base model (org/base): org/base@{COMMIT[:12]} → org/base@dddddddddddd"
    ]
    # a pinned full commit is taken as it is: the Hub is not asked
    asked = len(hub.seen)
    fixed = spec.model_copy(update={"extra": {"revision_of_model": COMMIT}})
    assert fingerprint(fixed, ExportSpec(), None, resolve, version="1").parts["base model"] == (
        f"org/base@{COMMIT}"
    )
    assert len(hub.seen) == asked


def test_a_hub_model_that_does_not_exist_is_one_line(hub: Any, tmp_path: Path) -> None:
    spec = training(rows(tmp_path / "chats.jsonl", "Hi."), base_model="org/missing")
    with pytest.raises(
        FingerprintError, match=r"^the Hub model org/missing is not found: "
    ) as caught:
        fingerprint(spec, ExportSpec(), None, hub_resolver(endpoint=hub.url), version="1")
    assert "\n" not in str(caught.value)


def test_a_hub_dataset_is_keyed_by_its_commit_and_pinned(tmp_path: Path) -> None:
    spec = training(tmp_path, datasets=["org/chats"])
    asked: list[tuple[str, str, str | None]] = []

    def resolve(kind: str, repo: str, revision: str | None) -> str:
        asked.append((kind, repo, revision))
        return COMMIT

    print_ = fingerprint(spec, ExportSpec(), None, resolve, version="1")
    assert asked == [("dataset", "org/chats", None)]
    assert print_.parts["dataset 1"] == f"org/chats@{COMMIT}"
    assert pinned(spec, print_).datasets[0].options["revision"] == COMMIT


# what a prepare step wrote


def test_the_prepare_output_names_the_datasets_and_the_eval_file(tmp_path: Path) -> None:
    lines = ["exporting...", "OVERBRAINER_DATASET=a.jsonl", "OVERBRAINER_DATASET=/x/b.jsonl"]
    prepared = parse_output([*lines, "OVERBRAINER_EVAL=eval.jsonl"], tmp_path, "export")
    assert prepared.datasets == (tmp_path / "a.jsonl", Path("/x/b.jsonl"))
    assert prepared.eval_file == tmp_path / "eval.jsonl"


def test_a_prepare_output_naming_no_file_is_one_line_with_its_last_lines(tmp_path: Path) -> None:
    with pytest.raises(PrepareError) as caught:
        parse_output(["exported 0 rows", "done"], tmp_path, "export")
    assert str(caught.value) == (
        "prepare block 'export' named no file it wrote: end its commands with "
        "`echo OVERBRAINER_DATASET=<path>` for each dataset; its last output lines: "
        '"exported 0 rows" / "done"'
    )


def test_a_prepared_file_without_rows_or_missing_is_one_line(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(PrepareError, match=r"wrote no rows to .*empty.jsonl: nothing to train on"):
        check_rows(Prepared(datasets=(empty,)), "export")
    with pytest.raises(PrepareError, match=r"named .*gone.jsonl, which does not exist"):
        check_rows(Prepared(datasets=(tmp_path / "gone.jsonl",)), "export")
    check_rows(Prepared(datasets=(rows(tmp_path / "ok.jsonl", "Hi."),)), "export")


def test_prepared_files_take_the_datasets_place_with_the_first_datasets_settings(
    tmp_path: Path,
) -> None:
    spec = training(tmp_path, datasets=[{"path": "given.jsonl", "field_messages": "chat"}])
    prepared = Prepared(datasets=(tmp_path / "a.jsonl",), eval_file=tmp_path / "eval.jsonl")
    train, evaluation = apply(spec, EvaluationSpec(), prepared, "export")
    assert [(d.path, d.field_messages) for d in train.datasets] == [
        (str(tmp_path / "a.jsonl"), "chat")
    ]
    assert evaluation is not None and evaluation.eval_file == str(tmp_path / "eval.jsonl")
    with pytest.raises(PrepareError, match=r"has no evaluation: set evaluation"):
        apply(spec, None, prepared, "export")


# the decision and its records


def test_a_night_like_the_last_delivered_is_skipped_unless_forced(tmp_path: Path) -> None:
    data = rows(tmp_path / "chats.jsonl", "Hi.")
    print_ = print_of(training(data))
    root = Runs(tmp_path / "runs")
    first = plan_night(root, "fine-tune/nightly", print_)
    assert first.skipped is None and first.delivered is None
    remember_trained(root, first, "20260101-000000-aaaa", None)
    remember_delivered(root, first, "20260101-000000-aaaa", None)
    again = plan_night(root, "fine-tune/nightly", print_)
    assert again.skipped is not None and again.skipped.startswith(
        "nothing changed since run 20260101-000000-aaaa (delivered 20"
    )
    assert "): nothing trained" in again.skipped
    assert plan_night(root, "fine-tune/nightly", print_, force=True).skipped is None
    assert plan_night(root, "fine-tune/other", print_).skipped is None  # per deployment
    rows(data, "Hello.")
    changed = plan_night(root, "fine-tune/nightly", print_of(training(data)))
    assert changed.skipped is None
    assert changed.since_last is not None and changed.since_last[0].startswith(
        f"dataset 1 ({data}): sha256 "
    )
    facts = dict(night_facts(changed))
    since = next(v for k, v in facts.items() if k.startswith("changed since the last night"))
    assert since.startswith("dataset 1 (") and "sha256 " in since
    assert "changed since run 20260101-000000-aaaa" in facts["trained because"]


def test_an_unreadable_night_record_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / night_key("fine-tune", "delivered")
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    with pytest.raises(NightlyRecordError, match=r"remove it, the next night then trains$"):
        plan_night(
            Runs(tmp_path), "fine-tune", print_of(training(rows(tmp_path / "d.jsonl", "Hi.")))
        )


# the flow, up to where it would train


def subflows(flow_run_id: Any) -> list[Any]:
    async def go() -> list[Any]:
        async with get_client() as client:
            return await client.read_flow_runs(
                flow_run_filter=FlowRunFilter(
                    parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id])
                )
            )

    return run(go())


@pytest.fixture
def night(prefect_server: None, tmp_path: Path) -> FineTuneSpec:
    """A fine-tune whose training would start on a target block that does not
    exist: it fails at once where it would train, so each test sees whether it
    got there without training anything."""
    return FineTuneSpec(
        target=f"missing-{uuid.uuid4().hex[:8]}",
        training=training(rows(tmp_path / "chats.jsonl", "Hi.", "Hello.")),
        compare=CompareSettings(questions=["Hi?"]),
        runs_dir=str(tmp_path / "runs"),
    )


def deliver_night(spec: FineTuneSpec) -> None:
    """Records `spec`'s night as the deployment's last delivered one, as a
    delivery does."""
    root = Runs(spec.runs_dir or "")
    print_ = fingerprint(spec.training, spec.export, spec.evaluation, no_hub)
    remember_delivered(root, plan_night(root, "fine-tune", print_), "20260101-000000-last", None)


def test_the_same_night_as_the_last_delivered_ends_completed_and_creates_nothing(
    night: FineTuneSpec,
) -> None:
    deliver_night(night)
    state = run(fine_tune(night, return_state=True))
    assert state.is_completed()
    assert state.message.startswith("nothing changed since run 20260101-000000-last (delivered 20")
    assert "): nothing trained" in state.message
    assert [p.name for p in Path(night.runs_dir or "").iterdir()] == [".nightly"]
    assert subflows(state.state_details.flow_run_id) == []


def test_a_changed_row_or_force_goes_on_to_train(night: FineTuneSpec) -> None:
    deliver_night(night)
    training_starts = rf"^the fine-tune stopped at training: no target block named '{night.target}'"
    with pytest.raises(PipelineFailed, match=training_starts):
        run(fine_tune(night, force=True))
    rows(Path(night.training.datasets[0].path), "Hi.", "Hello!")
    with pytest.raises(PipelineFailed, match=training_starts):
        run(fine_tune(night))


def shell_block(*commands: str) -> str:
    name = f"prepare-{uuid.uuid4().hex[:8]}"
    ShellOperation(commands=list(commands)).save(name)
    return name


def test_the_night_is_keyed_after_its_prepare_step(night: FineTuneSpec, tmp_path: Path) -> None:
    exported = rows(tmp_path / "export.jsonl", "Hi.", "Hello.")
    block = shell_block("echo exporting", f"echo OVERBRAINER_DATASET={exported}")
    prepared = night.model_copy(update={"training": training(exported)})
    deliver_night(prepared)  # what the prepare writes was delivered last night
    given = night.model_copy(
        update={"training": training(tmp_path / "placeholder.jsonl")}  # replaced by the prepare
    )
    state = run(fine_tune(given, prepare=block, return_state=True))
    assert state.is_completed() and state.message.startswith("nothing changed since run ")


@pytest.mark.parametrize(
    ("commands", "expected"),
    [
        (
            ["echo dumping", "echo 'psql: connection refused' >&2", "exit 3"],
            r"^prepare block '.*' failed with exit code 3: nothing trained; its last output "
            r'lines: "dumping" / "psql: connection refused"$',
        ),
        (["echo exported 0 rows"], r"named no file it wrote: .*\"exported 0 rows\"$"),
        (["sleep 30"], r"ran past 1 s and was stopped: nothing trained"),
    ],
)
def test_a_failing_silent_or_slow_prepare_ends_the_flow_with_its_output_and_creates_nothing(
    night: FineTuneSpec, commands: list[str], expected: str
) -> None:
    with pytest.raises(PrepareError, match=expected) as caught:
        run(fine_tune(night, prepare=shell_block(*commands), prepare_timeout_s=1))
    assert "\n" not in str(caught.value)
    assert not Path(night.runs_dir or "").exists()


def test_a_prepare_that_writes_no_rows_creates_nothing(night: FineTuneSpec, tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    block = shell_block(f": > {empty}", f"echo OVERBRAINER_DATASET={empty}")
    with pytest.raises(PrepareError, match=r"wrote no rows to .*empty.jsonl"):
        run(fine_tune(night, prepare=block))
    assert not Path(night.runs_dir or "").exists()


def test_a_prepare_block_that_is_missing_or_of_another_type_is_one_line(
    night: FineTuneSpec, tmp_path: Path
) -> None:
    with pytest.raises(PrepareError, match=r"^no Shell Operation block named 'nope-\w+': create"):
        run(fine_tune(night, prepare=f"nope-{uuid.uuid4().hex[:6]}"))
    other = f"other-{uuid.uuid4().hex[:8]}"
    LocalTarget(job_venv=str(tmp_path)).save(other)
    with pytest.raises(
        PrepareError, match=rf"^block '{other}' is of type overbrainer-local-target, not a"
    ):
        run(fine_tune(night, prepare=other))
    assert not Path(night.runs_dir or "").exists()
