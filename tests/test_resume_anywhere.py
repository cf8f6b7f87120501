"""Resume from anywhere: the spec a resumed run trains with reads the copy of
its data the stopped run uploaded, so it works from any working directory. (The
real resume from another directory, at the checkpoint's step + 1, is shown by
`test_train_flow`'s stop/resume test, with the same pair of trainings.)"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from overbrainer_prefect.kinds.training import resumed_spec
from overbrainer_prefect.runs.store import Runs
from overbrainer_prefect.steps import start as start_step
from overbrainer_prefect.trainers.spec import TrainingSpec


def test_the_resumed_spec_reads_the_stopped_runs_own_copy_of_its_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "chat.jsonl").write_text(
        '{"messages": [{"role": "user", "content": "x"}]}\n'
    )
    runs = Runs(tmp_path / "runs")
    spec = TrainingSpec.model_validate({"datasets": ["data/chat.jsonl", "org/hub"]})
    record = start_step.create(
        runs, target="box", target_kind="local", workdir="/w", spec=spec.model_dump(mode="json")
    )
    copy = runs.run_dir(record.id) / "data" / "chat.jsonl"
    copy.parent.mkdir(parents=True)
    shutil.copyfile(tmp_path / "data" / "chat.jsonl", copy)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    resumed = resumed_spec(runs, runs.load(record.id))
    assert [d.path for d in resumed.datasets] == [str(copy), "org/hub"]
    resumed.check_files_exist()
