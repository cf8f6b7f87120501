"""What a follower costs over a long history: a bucket on a real S3 server
(moto's, on 127.0.0.1, one process as the tests run it) holding HISTORY ended
runs and LIVE live ones, and a private `prefect server`.

The ended runs are put in moto's memory before it serves (a `run.json`
each, as a runs directory keeps them once they ended and left the live
index), so that filling the bucket takes seconds, not minutes of PUTs; the
live runs are created the way the job steps create them (`Runs.save`), each
followed by another process (its follow lock held, as a train flow run holds
it).

- One pass of the follower (`candidates`, what `follow` does every every_s
  seconds to find jobs nobody follows), the store's requests counted through
  its boto3 client's events: BENCH follow-pass-s-history10k, the wall time.
- The live runs then end (they hold nothing) and leave the index; the real
  `follow` flow runs for IDLE_S over the bucket, every store request it makes
  counted (its lock's renewals included), scaled to a minute:
  BENCH store-requests-per-idle-minute-history10k. Half a minute (it was a
  minute, unscaled): its passes are alike, and its start and end, counted
  too, weigh double in the figure, never less.

Prints:
    BENCH follow-pass-s-history10k <s> s goal <= 1
    BENCH store-requests-per-idle-minute-history10k <n> count goal <= 100

About a minute and a half on a 2-core machine. The servers are stopped by their
PIDs; every file is removed.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from kit.lines import bench, note, progress, run_main  # noqa: E402
from kit.server import prefect_server  # noqa: E402

HISTORY = 10_000  # ended runs in the bucket
LIVE = 100  # live runs, each followed by another process
IDLE_S = 30.0  # how long the idle follower runs: 15 passes, scaled to a minute
EVERY_S = 2.0  # the follower's pace (its default)
BUCKET = "history"
PREFIX = "runs"
TARGET = "overbrainer-local-target/bench-history"
SERVE = "--serve-history"  # this script as the S3 server: fills moto's memory, then serves


def serve(port: int, count: int) -> None:
    """moto's S3 server (as tests/s3server.py runs it) whose bucket already
    holds `count` ended runs."""
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    from overbrainer_prefect.runs.ids import new_run_id
    from overbrainer_prefect.runs.store import RunRecord, RunState
    from overbrainer_prefect.store.records import record_bytes
    from overbrainer_prefect.timestamps import rfc3339
    from tests.s3server import REGION, _serve

    backend = s3_backends[DEFAULT_ACCOUNT_ID]["aws"]
    backend.create_bucket(BUCKET, REGION)
    ids: set[str] = set()
    while len(ids) < count:
        ids.add(new_run_id())
    for run_id in sorted(ids):
        record = RunRecord(
            id=run_id,
            target=TARGET,
            created=rfc3339(),
            remote_dir=f"/nonexistent/{run_id}",
            state=RunState.SUCCEEDED,
            started=rfc3339(),
            ended=rfc3339(),
        )
        backend.put_object(BUCKET, f"{PREFIX}/{run_id}/run.json", record_bytes(record))
    print("filled", flush=True)
    _serve(port)


def start_s3(root: Path) -> tuple[subprocess.Popen[bytes], str]:
    """This script as moto's server with the history in it; its endpoint."""
    from tests.ports import free_port
    from tests.s3server import START_TIMEOUT_S, _answers

    port = free_port()
    log = root / "moto.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, __file__, SERVE, str(port), str(HISTORY)],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + START_TIMEOUT_S + 60  # the history is put in first
    while not _answers(port):
        if process.poll() is not None or time.monotonic() > deadline:
            stop(process)
            raise RuntimeError(f"moto did not start: {log.read_text()[-500:]}")
        time.sleep(0.2)
    return process, f"http://127.0.0.1:{port}"


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


class Requests:
    """Every request a store's boto3 client sends, counted by its kind."""

    def __init__(self, store: Any) -> None:
        self.client = store.client
        self.sent: list[str] = []

    def _count(self, request: Any, **_: Any) -> None:
        self.sent.append(request.method)

    def __enter__(self) -> Requests:
        self.client.meta.events.register("before-send.s3", self._count)
        return self

    def __exit__(self, *_: object) -> None:
        self.client.meta.events.unregister("before-send.s3", self._count)

    def by_kind(self) -> str:
        kinds = sorted(set(self.sent))
        return ", ".join(f"{self.sent.count(kind)} {kind}" for kind in kinds) or "none"


def measure(root: Path, endpoint: str) -> None:
    from prefect import flow

    from overbrainer_prefect.blocks import LocalTarget
    from overbrainer_prefect.flows.collect import candidates
    from overbrainer_prefect.flows.follow import follow
    from overbrainer_prefect.runs.ids import new_run_id
    from overbrainer_prefect.runs.live import mark_built
    from overbrainer_prefect.runs.lock import follow_lock
    from overbrainer_prefect.runs.store import RunRecord, Runs, RunState
    from overbrainer_prefect.store.lease import TTL_ENV
    from overbrainer_prefect.store.s3 import S3Store, default_client
    from overbrainer_prefect.timestamps import rfc3339

    url = f"s3://{BUCKET}/{PREFIX}?endpoint_url={endpoint}"
    LocalTarget(job_venv="/nonexistent", work_dir=str(root / "work")).save("bench-history")
    runs = Runs(url)
    mark_built(runs.store)  # the ended runs left the index as they ended
    live = []
    for _ in range(LIVE):
        record = RunRecord(
            id=new_run_id(),
            target=TARGET,
            created=rfc3339(),
            remote_dir="/nonexistent",
            state=RunState.RUNNING,
        )
        runs.save(record)
        live.append(record)
        time.sleep(0.01)  # distinct IDs (one a second, four random letters)
    # their followers: another store (client) of this process, leases long enough to need
    # no renewal while the pass is measured
    others = Runs(
        S3Store(BUCKET, PREFIX, lambda config: default_client(endpoint, config), endpoint)
    )
    os.environ[TTL_ENV] = "3600"

    @flow(name="bench-follow-pass")
    async def one_pass() -> tuple[float, int]:
        started = time.perf_counter()
        found = await candidates(runs)
        return time.perf_counter() - started, len(found)

    with ExitStack() as held:
        for record in live:
            held.enter_context(follow_lock(others, record.id, "bench-train-flow-run"))
        del os.environ[TTL_ENV]
        asyncio.run(one_pass())  # Prefect's own first-flow costs, not the pass's
        with Requests(runs.store) as sent:
            seconds, found = asyncio.run(one_pass())
    note(
        f"one pass over {HISTORY} ended and {LIVE} live runs (each followed by another "
        f"process): {seconds:.3f} s, {len(sent.sent)} store requests ({sent.by_kind()}), "
        f"{found} job(s) to follow"
    )
    bench("follow-pass-s-history10k", seconds, "s", "<=", 1, digits=3)

    progress("the live runs end; the follower runs idle")
    for record in live:
        record.state = RunState.SUCCEEDED
        runs.save(record)
    asyncio.run(one_pass())  # they leave the index
    with Requests(runs.store) as sent:
        started = time.monotonic()
        asyncio.run(follow(runs_dir=url, minutes=IDLE_S / 60, every_s=EVERY_S))
        took = time.monotonic() - started
    per_minute = len(sent.sent) * 60 / took
    note(
        f"the follow flow over {HISTORY + LIVE} ended runs for {took:.0f} s (its start and "
        f"end included), one pass every {EVERY_S:g} s: {len(sent.sent)} store requests "
        f"({sent.by_kind()})"
    )
    bench("store-requests-per-idle-minute-history10k", per_minute, "count", "<=", 100, digits=0)


def main() -> None:
    from tests.s3server import credentials_env

    os.environ.update(credentials_env(), AWS_EC2_METADATA_DISABLED="true")
    root = Path(tempfile.mkdtemp(prefix="bench-history-"))
    moto = None
    try:
        progress(f"moto with {HISTORY} ended runs")
        moto, endpoint = start_s3(root)
        with prefect_server(root):
            os.environ.update(credentials_env(), AWS_EC2_METADATA_DISABLED="true")
            measure(root, endpoint)
    finally:
        if moto is not None:
            stop(moto)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == SERVE:
        serve(int(sys.argv[2]), int(sys.argv[3]))
    else:
        run_main(__file__, main)
