"""The held-out split at training time: rows of a run's training data kept out of
the file it uploads, recorded with the run, the same for the same spec, and
asked by the evaluation; and a split the data cannot give refused in one line."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from overbrainer_prefect.evaluation.items import heldout_items
from overbrainer_prefect.evaluation.spec import BadEvaluationInput
from overbrainer_prefect.executors.local import LocalExecutor
from overbrainer_prefect.runs.store import RECORD_FILE, Runs
from overbrainer_prefect.steps.start import LOCAL_ONLY
from overbrainer_prefect.trainers.axolotl import AxolotlTrainer
from overbrainer_prefect.trainers.base import JobContext, TargetFacts, TrainError
from overbrainer_prefect.trainers.holdout import holdout_count, holdout_problem, read_split
from overbrainer_prefect.trainers.spec import TrainingSpec
from tests.tinymodel import write_dataset

RUN = "20260101-000000-rone"  # the run whose rows are held out
CPU = TargetFacts(python="/venv/bin/python", gpus=0, modules={"torch": "2", "axolotl": "0.19"})


def spec_of(*datasets: str | Path, **changes: Any) -> TrainingSpec:
    values: dict[str, Any] = {"base_model": "/models/tiny", "datasets": [str(d) for d in datasets]}
    return TrainingSpec.model_validate(values | changes)


def prepare(spec: TrainingSpec, run_dir: Path) -> None:
    ctx = JobContext(run_id="r1", run_dir=str(run_dir), cache_dir="/hf", facts=CPU)
    AxolotlTrainer(spec).prepare(run_dir, ctx)


def lines(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture
def chats(tmp_path: Path) -> Path:
    return write_dataset(tmp_path / "chat.jsonl")


def test_held_out_rows_are_never_in_the_uploaded_training_file(tmp_path: Path, chats: Path) -> None:
    spec = spec_of(chats, holdout=0.25, seed=3)
    local = tmp_path / "runs" / RUN
    prepare(spec, local)
    original = lines(chats)
    kept, held = lines(local / "data" / "chat.jsonl"), lines(local / "heldout" / "chat.jsonl")
    assert len(held) == holdout_count(0.25, len(original)) == 16
    assert not set(held) & set(kept)
    assert sorted(kept + held) == sorted(original)
    assert [r for r in original if r in kept] == kept  # the training rows keep their order
    # the real upload of a run leaves heldout/ on this machine
    remote = tmp_path / "work" / "r1"
    executor = LocalExecutor(tmp_path / "work")
    asyncio.run(executor.upload(local, str(remote), (*LOCAL_ONLY, RECORD_FILE)))
    uploaded = lines(remote / "data" / "chat.jsonl")
    assert uploaded == kept and not set(held) & set(uploaded)
    assert not (remote / "heldout").exists()
    assert not any(row in p.read_text() for p in remote.rglob("*") if p.is_file() for row in held)
    # the split is recorded with the run: which lines of which file
    split = read_split(Runs(tmp_path / "runs"), RUN)
    assert split is not None and split.held_out == 16 and split.rows == 64 and split.seed == 3
    (entry,) = split.files
    assert entry.data == "data/chat.jsonl" and entry.heldout == "heldout/chat.jsonl"
    assert [original[n - 1] for n in entry.lines] == held


def test_the_same_spec_and_data_always_hold_out_the_same_rows(tmp_path: Path, chats: Path) -> None:
    prepare(spec_of(chats, holdout=10, seed=1), tmp_path / "a")
    prepare(spec_of(chats, holdout=10, seed=1), tmp_path / "a")  # prepared twice: same split
    prepare(spec_of(chats, holdout=10, seed=1), tmp_path / "b")
    prepare(spec_of(chats, holdout=10, seed=2), tmp_path / "c")
    held = {d: lines(tmp_path / d / "heldout" / "chat.jsonl") for d in "abc"}
    assert held["a"] == held["b"] and held["a"] != held["c"] and len(held["a"]) == 10
    assert len(lines(tmp_path / "a" / "data" / "chat.jsonl")) == 54


def test_rows_are_held_out_across_every_local_dataset_and_hub_ones_are_trained_whole(
    tmp_path: Path, chats: Path
) -> None:
    other = tmp_path / "more.jsonl"
    other.write_text("".join(json.dumps({"n": n}) + "\n" for n in range(16)))
    prepare(spec_of(chats, "org/hub-chats", other, holdout=0.5), tmp_path / RUN)
    split = read_split(Runs(tmp_path), RUN)
    assert split is not None and split.rows == 80 and split.held_out == 40
    assert [f.data for f in split.files] == ["data/chat.jsonl", "data/more.jsonl"]
    assert sum(len(f.lines) for f in split.files) == 40
    for f in split.files:
        held = lines(tmp_path / RUN / f.heldout)
        assert len(held) == len(f.lines) and not set(held) & set(lines(tmp_path / RUN / f.data))


def test_no_holdout_leaves_the_training_data_whole_and_records_no_split(
    tmp_path: Path, chats: Path
) -> None:
    prepare(spec_of(chats), tmp_path / RUN)
    assert lines(tmp_path / RUN / "data" / "chat.jsonl") == lines(chats)
    assert not (tmp_path / RUN / "heldout").exists() and read_split(Runs(tmp_path), RUN) is None


def test_a_held_out_split_larger_than_the_data_is_refused_in_one_line(
    tmp_path: Path, chats: Path
) -> None:
    too_many = spec_of(chats, holdout=64)
    assert holdout_problem(too_many) == (
        "holdout keeps 64 rows out of training, and the local datasets hold 64: keep fewer out "
        "(a share below 1, or fewer rows) or add data"
    )
    with pytest.raises(TrainError, match="holdout keeps 64 rows out of training"):
        prepare(too_many, tmp_path / RUN)
    assert not (tmp_path / RUN / "heldout").exists()
    hub = spec_of("org/chats", holdout=0.1)
    assert "every dataset is on the Hub" in (holdout_problem(hub) or "")
    parquet = tmp_path / "chats.parquet"
    parquet.write_bytes(b"PAR1")
    assert "is not one: convert it to .jsonl" in (
        holdout_problem(spec_of(parquet, holdout=2)) or ""
    )
    with pytest.raises(ValidationError, match="holdout 2.5 is neither a share below 1"):
        spec_of(chats, holdout=2.5)


def test_the_evaluation_asks_the_held_out_rows_expecting_their_answers(
    tmp_path: Path, chats: Path
) -> None:
    prepare(spec_of(chats, holdout=4, seed=0), tmp_path / RUN)
    items, split = heldout_items(Runs(tmp_path), RUN, "contains")
    assert split is not None and len(items) == 4
    rows = [json.loads(line) for line in lines(tmp_path / RUN / "heldout" / "chat.jsonl")]
    for item, row in zip(items, rows, strict=True):
        assert item.group == "heldout" and item.scorer == "contains"
        assert item.expected == item.reference == row["messages"][-1]["content"]
        assert [m.model_dump() for m in item.messages] == row["messages"][:-1]
        assert item.source is not None and item.source.startswith("heldout/chat.jsonl:")
    (tmp_path / RUN / "heldout" / "split.json").write_text("{")
    with pytest.raises(BadEvaluationInput, match="is not a valid record: train the run again"):
        heldout_items(Runs(tmp_path), RUN, "contains")
