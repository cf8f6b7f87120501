"""The live index on the real S3 server: a follower's pass and a collect read
only the runs that are live (not ended, or still holding something), never
the history; an index is built once for a runs directory that had none; a
run whose creator was killed right after its index entry is still found;
an ended run that holds nothing leaves the index."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from prefect import flow

from overbrainer_prefect.blocks import LocalTarget
from overbrainer_prefect.flows.collect import candidates
from overbrainer_prefect.kinds.listing import unfinished_of
from overbrainer_prefect.runs import Runs, RunState, new_run_id
from overbrainer_prefect.runs.live import LIVE_DIR, STALE_S, mark_built, marker_key
from overbrainer_prefect.runs.lock import follow_lock
from overbrainer_prefect.runs.store import RunRecord
from overbrainer_prefect.store.records import record_bytes
from overbrainer_prefect.store.s3 import S3Store
from overbrainer_prefect.timestamps import rfc3339
from tests.s3server import S3Server

REPO = Path(__file__).resolve().parents[1]
HISTORY = 500  # ended runs written straight into the bucket, as an old runs directory holds


@pytest.fixture
def target(prefect_server: None, tmp_path: Path) -> str:
    name = f"live-{uuid.uuid4().hex[:8]}"
    LocalTarget(job_venv="/nonexistent", work_dir=str(tmp_path / "work")).save(name)
    return f"overbrainer-local-target/{name}"


@flow(name="live-pass")
async def one_pass(runs_dir: str, following: list[str]) -> list[str]:
    """What one pass of the follower (or a collect) finds to do: the keys of its candidates."""
    found = await candidates(Runs(runs_dir), following=set(following))
    return [store.key(record.id) for store, record, _ in found]


def record_of(target: str, state: RunState) -> RunRecord:
    return RunRecord(
        id=new_run_id(),
        target=target,
        created=rfc3339(),
        remote_dir="/nonexistent",
        state=state,
    )


def write_history(s3: S3Server, bucket: str, target: str, count: int) -> list[str]:
    """`count` ended runs written straight into the bucket (no index entry)."""
    client = s3.client()
    records = [record_of(target, RunState.SUCCEEDED) for _ in range(count)]
    records = list({r.id: r for r in records}.values())  # two IDs in one second may meet

    def put(record: RunRecord) -> None:
        key = f"runs/{record.id}/run.json"
        client.put_object(Bucket=bucket, Key=key, Body=record_bytes(record))

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(put, records))
    return [r.id for r in records]


@contextmanager
def requests_to(runs: Runs) -> Iterator[list[str]]:
    """The URLs of every request the runs directory's store sends in the block."""
    store = runs.store
    assert isinstance(store, S3Store)
    sent: list[str] = []

    def count(request: Any, **_: Any) -> None:
        sent.append(f"{request.method} {request.url}")

    store.client.meta.events.register("before-send.s3", count)
    try:
        yield sent
    finally:
        store.client.meta.events.unregister("before-send.s3", count)


def test_a_pass_reads_only_the_live_runs_never_the_history(s3: S3Server, target: str) -> None:
    bucket = s3.bucket()
    url = s3.bucket_url(bucket=bucket)
    runs = Runs(url)
    live = [record_of(target, RunState.RUNNING) for _ in range(3)]
    for record in live:
        runs.save(record)
    assert len(asyncio.run(one_pass(url, []))) == len(live)  # the index, built once
    history = write_history(s3, bucket, target, HISTORY)  # runs that ended and left it

    with follow_lock(runs, live[0].id, "another-flow-run"):
        with requests_to(runs) as sent:
            found = asyncio.run(one_pass(url, []))
        with requests_to(runs) as sent_following:
            following = asyncio.run(one_pass(url, [live[1].id]))
        with requests_to(runs) as sent_all_followed:  # a follower that follows them all
            assert asyncio.run(one_pass(url, [r.id for r in live[1:]])) == []

    assert found == sorted(r.id for r in live[1:])
    assert following == [live[2].id]
    assert len(sent) <= 1 + len(live) + len(found), sent  # list, locks, unfollowed records
    assert not [line for line in sent if any(run_id in line for run_id in history)]
    assert not [line for line in sent_following if live[1].id in line]
    assert len(sent_all_followed) == 2, sent_all_followed  # the listing, the other's lock


def test_a_runs_directory_without_an_index_has_it_built_once_with_the_live_runs_alone(
    s3: S3Server, target: str
) -> None:
    bucket = s3.bucket()
    url = s3.bucket_url(bucket=bucket)
    runs = Runs(url)
    history = write_history(s3, bucket, target, 40)
    running = record_of(target, RunState.RUNNING)
    s3.client().put_object(
        Bucket=bucket, Key=f"runs/{running.id}/run.json", Body=record_bytes(running)
    )
    assert runs.live() is None

    assert asyncio.run(one_pass(url, [])) == [running.id]
    assert runs.store.names(LIVE_DIR) == [".built", running.id]
    with requests_to(runs) as sent:
        assert asyncio.run(one_pass(url, [])) == [running.id]
    assert not [line for line in sent if any(run_id in line for run_id in history)]


def test_a_run_killed_after_its_index_entry_is_still_found(s3: S3Server, target: str) -> None:
    url = s3.bucket_url()
    runs = Runs(url)
    asyncio.run(one_pass(url, []))  # a directory with nothing in it: no index yet
    assert runs.store.names("") == []
    run_id = new_run_id()
    created = kill_while_creating(url, target, run_id, before_record=False)
    assert created.returncode == -signal.SIGKILL, created.stderr

    assert asyncio.run(one_pass(url, [])) == [run_id]
    assert runs.load(run_id).state == RunState.PREPARING


def test_a_creator_killed_before_its_record_leaves_an_entry_dropped_once_stale(
    s3: S3Server, target: str
) -> None:
    url = s3.bucket_url()
    runs = Runs(url)
    run_id = new_run_id()
    created = kill_while_creating(url, target, run_id, before_record=True)
    assert created.returncode == -signal.SIGKILL, created.stderr
    assert runs.store.names(LIVE_DIR) == [run_id]

    assert asyncio.run(one_pass(url, [])) == []
    assert run_id in runs.store.names(LIVE_DIR)  # young: its creator may only be slow

    old = {"record": run_id, "since": "2000-01-01T00:00:00Z"}
    runs.store.write(marker_key(run_id), json.dumps(old).encode())
    assert STALE_S < 3600 * 24 * 365
    assert asyncio.run(one_pass(url, [])) == []
    assert runs.store.names(LIVE_DIR) == [".built"]


def kill_while_creating(
    url: str, target: str, run_id: str, before_record: bool
) -> subprocess.CompletedProcess[str]:
    """Creates the run `run_id` in another process, killed (SIGKILL) right
    after its record was created, or right before (after its index entry)."""
    script = f"""
import os, signal
from overbrainer_prefect.runs import Runs
from overbrainer_prefect.runs.store import RunRecord
from overbrainer_prefect.timestamps import rfc3339
runs = Runs({url!r})
record = RunRecord(id={run_id!r}, target={target!r}, created=rfc3339(), remote_dir="/x")
if {before_record!r}:
    runs.store.create = lambda *_: os.kill(os.getpid(), signal.SIGKILL)
else:
    runs.store.write = (
        lambda key, data, write=runs.store.write: write(key, data)
        if runs.store.head({run_id!r} + "/run.json") is None
        else os.kill(os.getpid(), signal.SIGKILL)
    )
runs.save(record)
"""
    return subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("where", ["s3", "local"])
def test_an_ended_run_that_holds_nothing_leaves_the_index(
    s3: S3Server, target: str, tmp_path: Path, where: str
) -> None:
    url = s3.bucket_url() if where == "s3" else str(tmp_path / "runs")
    runs = Runs(url)
    record = record_of(target, RunState.RUNNING)
    runs.save(record)
    assert asyncio.run(one_pass(url, [])) == [record.id]

    record.state = RunState.SUCCEEDED
    runs.save(record)
    assert asyncio.run(one_pass(url, [])) == []
    assert runs.store.names(LIVE_DIR) == [".built"]
    assert runs.load(record.id).state == RunState.SUCCEEDED


def test_the_jobs_a_cancelled_flow_run_left_are_found_in_the_live_index(tmp_path: Path) -> None:
    runs = Runs(tmp_path / "runs")
    mine, other, ended = (record_of("local/x", RunState.RUNNING) for _ in range(3))
    mine.flow_run_id = ended.flow_run_id = "flow-run-1"
    other.flow_run_id = "flow-run-2"
    ended.state = RunState.FAILED
    for record in (mine, other, ended):
        runs.save(record)
    export = record_of("local/x", RunState.PREPARING)
    export.flow_run_id, export.parent, export.trainer = "flow-run-1", mine.id, "export"
    runs.children(mine.id, "export").save(export)

    def unfinished() -> list[str]:
        return [record.id for _, record in unfinished_of(runs, ["flow-run-1"])]

    assert sorted(unfinished()) == sorted([mine.id, export.id])  # no index: every record
    mark_built(runs.store)
    assert unfinished() == [mine.id, export.id]  # the run first, then what is below it
    runs.unmark_live(mine.id)
    assert unfinished() == [export.id]  # the index alone is read
