"""The run store: IDs, atomic records, listing, and records that cannot be trusted."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from overbrainer_prefect.runs import (
    RECORD_FILE,
    InvalidRecord,
    InvalidRunId,
    RecordIoError,
    RunNotFound,
    RunRecord,
    Runs,
    RunState,
    is_valid_run_id,
    new_run_id,
)
from overbrainer_prefect.store.records import RecordChanged


def record(run_id: str, **changes: object) -> RunRecord:
    values: dict[str, object] = {
        "id": run_id,
        "target": "overbrainer-local-target/box",
        "created": "2026-09-22T14:30:05Z",
        "remote_dir": f"/w/{run_id}",
    }
    values.update(changes)
    return RunRecord.model_validate(values)


def leftover_temp_files(directory: Path) -> list[str]:
    return [p.name for p in directory.iterdir() if p.name.startswith(".") and p.suffix == ".tmp"]


def test_new_ids_are_valid_and_distinct() -> None:
    ids = {new_run_id() for _ in range(50)}
    assert len(ids) == 50
    assert all(is_valid_run_id(i) for i in ids)


@pytest.mark.parametrize(
    "bad", ["../etc", "/tmp/x", "a/b", "", "20260922-143005-ABCD", "20260922-143005-abcd/..", "."]
)
def test_invalid_ids_are_rejected_everywhere_and_touch_nothing(tmp_path: Path, bad: str) -> None:
    runs = Runs(tmp_path / "runs")
    with pytest.raises(InvalidRunId, match="is not a valid run ID"):
        runs.run_dir(bad)
    with pytest.raises(InvalidRunId):
        runs.load(bad)
    with pytest.raises(InvalidRunId):
        runs.save(record(bad))
    assert not (tmp_path / "runs").exists()


def test_records_round_trip_and_list_oldest_first(tmp_path: Path) -> None:
    runs = Runs(tmp_path / "runs")
    assert runs.list() == []
    runs.save(record("20260922-143005-bbbb"))
    first = record("20260921-000000-aaaa", state=RunState.SUCCEEDED)
    runs.save(first)
    (runs.root / ".hf-cache").mkdir()
    (runs.root / "20260923-000000-cccc").mkdir()  # a directory without a record
    assert [r.id for r in runs.list()] == ["20260921-000000-aaaa", "20260922-143005-bbbb"]
    assert runs.load("20260921-000000-aaaa") == first
    text = (runs.run_dir(first.id) / RECORD_FILE).read_text()
    assert '"state": "succeeded"' in text


def test_unknown_ids_are_not_found(tmp_path: Path) -> None:
    runs = Runs(tmp_path / "runs")
    with pytest.raises(RunNotFound, match="no run 20260101-000000-zzzz"):
        runs.load("20260101-000000-zzzz")


def test_a_malformed_run_json_is_reported_by_position_only(tmp_path: Path) -> None:
    marker = "MARKER-0d4a8e52-never-printed"
    runs = Runs(tmp_path / "runs")
    run_id = "20260922-143005-bbbb"
    directory = runs.run_dir(run_id)
    directory.mkdir(parents=True)
    (directory / RECORD_FILE).write_text(f'{{\n  "id": "{run_id}",\n  "state": "{marker}"\n}}\n')
    with pytest.raises(InvalidRecord) as caught:
        runs.load(run_id)
    text = str(caught.value) + repr(caught.value)
    assert marker not in text
    assert "is not a valid run record" in text
    assert "line 3" in text
    assert caught.value.__cause__ is None and caught.value.__context__ is None


def test_a_record_that_is_not_json_is_reported_by_position(tmp_path: Path) -> None:
    runs = Runs(tmp_path / "runs")
    run_id = "20260922-143005-bbbb"
    runs.run_dir(run_id).mkdir(parents=True)
    (runs.run_dir(run_id) / RECORD_FILE).write_text('{\n  "id": SECRET-VALUE\n}')
    with pytest.raises(InvalidRecord, match=r"line 2, column 9") as caught:
        runs.load(run_id)
    assert "SECRET-VALUE" not in str(caught.value)


def test_concurrent_saves_never_overwrite_each_other(tmp_path: Path) -> None:
    """Eight writers each append to one record's message 40 times, reading it,
    changing it and saving it over the version read: a save over a version
    that changed since is refused (RecordChanged) and read again, so every
    change is in the final record and no save was lost. A record made anew
    over an existing one is refused the same way."""
    runs = Runs(tmp_path / "runs")
    run_id = "20260922-143005-bbbb"
    runs.save(record(run_id, message=""))
    with pytest.raises(RecordChanged):
        runs.save(record(run_id, message="made anew"))
    errors: list[BaseException] = []
    lost = [0]

    def writer(number: int) -> None:
        try:
            for save in range(40):
                while True:
                    current = runs.load(run_id)
                    current.message = f"{current.message}{number}.{save};"
                    try:
                        runs.save(current)
                        break
                    except RecordChanged:
                        lost[0] += 1
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert errors == []
    saved = runs.load(run_id)
    assert saved.message is not None
    assert sorted(saved.message.split(";")[:-1]) == sorted(
        f"{n}.{s}" for n in range(8) for s in range(40)
    )
    assert lost[0] > 0  # the writers did race, and the losers read again
    assert leftover_temp_files(runs.run_dir(run_id)) == []


def test_a_failed_save_leaves_no_temporary_file(tmp_path: Path) -> None:
    runs = Runs(tmp_path / "runs")
    run = record("20260922-143005-bbbb")
    directory = runs.run_dir(run.id)
    (directory / RECORD_FILE).mkdir(parents=True)  # nothing can be renamed over a directory
    with pytest.raises(RecordIoError):
        runs.save(run)
    assert leftover_temp_files(directory) == []


def test_records_are_private_files(tmp_path: Path) -> None:
    runs = Runs(tmp_path / "runs")
    run = record("20260922-143005-bbbb")
    runs.save(run)
    assert (runs.run_dir(run.id) / RECORD_FILE).stat().st_mode & 0o077 == 0


def with_pid(run_id: str, pid: int) -> str:
    data = record(run_id).model_dump(mode="json")
    data["job"] = {"dir": "/w/run", "pid": pid}
    data["state"] = "running"
    return json.dumps(data, indent=2)


def test_a_run_json_with_pid_0_or_1_fails_to_load(tmp_path: Path) -> None:
    runs = Runs(tmp_path / "runs")
    for run_id, pid in [("20260922-143005-cccc", 1), ("20260922-143005-dddd", 0)]:
        runs.run_dir(run_id).mkdir(parents=True)
        (runs.run_dir(run_id) / RECORD_FILE).write_text(with_pid(run_id, pid))
        with pytest.raises(InvalidRecord, match="line"):
            runs.load(run_id)


def test_list_skips_unreadable_records_and_keeps_the_rest(tmp_path: Path) -> None:
    runs = Runs(tmp_path / "runs")
    runs.save(record("20260921-000000-good"))
    bad = runs.run_dir("20260922-000000-badd")
    bad.mkdir(parents=True)
    (bad / RECORD_FILE).write_text("not json")
    pid1 = runs.run_dir("20260923-000000-pid1")
    pid1.mkdir(parents=True)
    (pid1 / RECORD_FILE).write_text(with_pid("20260923-000000-pid1", 1))
    skipped: list[str] = []
    listed = runs.list(skipped=lambda run_id, error: skipped.append(run_id))
    assert [r.id for r in listed] == ["20260921-000000-good"]
    assert skipped == ["20260922-000000-badd", "20260923-000000-pid1"]


def test_the_runs_root_comes_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OVERBRAINER_RUNS_DIR", str(tmp_path / "shared"))
    assert Runs().root == tmp_path / "shared"
