"""A lease is a promise, kept or let go, on the real S3 server through the
fault proxy (`tests/faultproxy.py`): a store that stalls longer than the TTL
while one follower holds a run leaves exactly one follower after it (the
first finds its lease lost before anyone could take it, stops at once and
says so; the other follows afterwards); a renewal whose answer was lost is
still its own; a holder whose clock is a minute off neither steals a live
lease nor keeps a dead one; a store whose `Date` is missing or absurd is
refused at its check in one line; a local runs directory's lock is never lost;
a resumed flow run whose lease lapses while it waits for room in the follower
(resume_here.ROOM_WAIT_S) is not resumed."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from prefect.client.schemas.objects import StateType

from overbrainer_prefect import resume_here
from overbrainer_prefect.blocks import LocalTarget
from overbrainer_prefect.flowruns import resume
from overbrainer_prefect.resume_here import HERE, HERE_DIR, Here, recover
from overbrainer_prefect.runpod.pod import PodRecord
from overbrainer_prefect.runs.lock import follow_lock, follower_lock, is_followed
from overbrainer_prefect.runs.store import RunRecord, Runs, RunState
from overbrainer_prefect.steps import context
from overbrainer_prefect.steps import start as start_step
from overbrainer_prefect.store import LeaseLost, S3Store, StoreRefused, open_store
from overbrainer_prefect.store.check import check_s3
from overbrainer_prefect.store.lease import TTL_ENV, Lease, lease_holder
from overbrainer_prefect.store.s3 import OUTAGE_ENV, READ_TIMEOUT_ENV
from overbrainer_prefect.timestamps import rfc3339
from tests import test_object_store as on_store
from tests.faultproxy import FaultProxy
from tests.flowrun import run
from tests.s3server import S3Server
from tests.shelljobs import WRITE_METRICS, WRITE_OUTPUT, ShellTrainer
from tests.stallfollowers import RUN, lines_of, stall_round
from tests.test_object_store import COLLECT, rows_of, worker_env
from tests.test_resume_here import GATE, LOG, ended_job, gated, state_of, suspended_in_pool
from tests.test_train_flow import kill, wait_until

local_target = on_store.local_target  # a local target block (the shared Prefect server's)

TTL_S = 4.0  # short leases keep the tests in seconds: lost within 3 s, taken after 5 to 6 s
STALL_S = 9.0  # longer than the TTL and than the time another process needs to take it
REPO = Path(__file__).resolve().parents[1]


def _record(runs: Runs) -> None:
    runs.save(RunRecord(id=RUN, target="local", created=rfc3339(), remote_dir="/tmp/r"))


def _lines(process: subprocess.Popen[str], timeout: float) -> list[str]:
    return lines_of(process, timeout)


@pytest.fixture
def proxy(s3: S3Server) -> Iterator[FaultProxy]:
    with FaultProxy(s3.port, max_s=120) as proxy:
        yield proxy


def test_a_stall_longer_than_the_ttl_leaves_exactly_one_follower(
    s3: S3Server, proxy: FaultProxy
) -> None:
    """Follower A reaches the store through the proxy, B (another machine)
    directly and waits for the run (`tests/stallfollowers.py`). The store
    stalls for A longer than the TTL: A finds its lease lost before anyone
    could take it (within 3/4 of the TTL), B takes it only after, A's acts all
    come before B's, and A stops and says so in one line."""
    seen = stall_round(s3, proxy, TTL_S, STALL_S)
    lost_seen, b_following = seen.at("A", "LOST-SEEN"), seen.at("B", "FOLLOWING")
    assert lost_seen and b_following, (seen.a_lines, seen.b_lines)
    # A let go before anyone could take it, by its own count of its last renewal
    assert seen.stalled_at < lost_seen[0] <= seen.stalled_at + TTL_S * 0.75 + 0.5
    assert b_following[0] > lost_seen[0]
    # by the store's clock, not before a TTL after A's last renewal (sent at most TTL/4 before)
    assert b_following[0] - seen.stalled_at >= TTL_S * 0.75
    # exactly one follows at a time: every act of A's before every act of B's
    assert "A" in seen.acts and "B" in seen.acts
    assert not seen.both_followed, (seen.a_lines, seen.b_lines, seen.acts)
    stopped = [line for line in seen.a_lines if line.startswith("STOPPED ")]
    assert len(stopped) == 1, seen.a_lines
    assert f"another follower took run {RUN} at " in stopped[0]
    assert stopped[0].endswith("this one stops following it")
    assert any("is lost since" in line for line in seen.a_lines)  # said as soon as it knew
    assert not any(line.startswith("STOPPED") for line in seen.b_lines)


def test_a_renewal_whose_answer_was_lost_is_still_its_own(
    s3: S3Server, proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(TTL_ENV, str(TTL_S))
    store = open_store(s3.bucket_url(endpoint=proxy.endpoint))
    assert isinstance(store, S3Store)
    lease = Lease(store, "r/.follow.lock", {"flow_run_id": "f"})
    lease.take()
    proxy.drop_answers(1)
    assert lease.renew()  # no answer: it may have landed, and the lease is kept
    assert proxy.dropped == 1
    assert lease.renew() and not lease.lost  # it landed: recognised as its own, not a race lost
    lease.check()
    lease.release()
    assert lease_holder(store, "r/.follow.lock") is None


SKEWED = """
import sys, time
skew = float(sys.argv[3])
real = time.time
time.time = lambda: real() + skew  # this machine's clock is a minute off
from overbrainer_prefect.store import Busy, open_store
store = open_store(sys.argv[1])
try:
    with store.lock(sys.argv[2], {"flow_run_id": "skewed"}) as held:
        print("TOOK", flush=True)
        time.sleep(float(sys.argv[4]))
        print("LOST" if held.lost else "HELD", flush=True)
except Busy as busy:
    print("BUSY", busy.holder, flush=True)
"""


SKEW_TTL_S = 10.0
"""The clock tests' TTL: a holder that cannot renew within 3/4 of it lets its lease go,
and a fresh process renewing every TTL/4 on a loaded machine (a lease chaos test beside
trainings on 2 cores) missed the 3 s that `TTL_S` leaves."""


def _skewed(url: str, key: str, skew: float, hold_s: float) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", SKEWED, url, key, str(skew), str(hold_s)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
        env={**os.environ, TTL_ENV: str(SKEW_TTL_S)},
    )


def test_a_holder_whose_clock_is_a_minute_off_neither_steals_nor_keeps_a_lease(
    s3: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A machine a minute ahead does not take a live lease (it would, were
    expiry its own clock's); a machine a minute behind holds its lease as
    long as it renews it, and once it dies its lease expires within the TTL
    by the store's clock (it would live a minute more, were expiry its own)."""
    monkeypatch.setenv(TTL_ENV, str(SKEW_TTL_S))
    url = s3.bucket_url()
    store = open_store(url)
    with store.lock("r/.follow.lock", {"flow_run_id": "here"}) as held:
        ahead = _skewed(url, "r/.follow.lock", 60.0, 0)
        assert _lines(ahead, 30)[0].startswith("BUSY"), "a clock ahead stole a live lease"
        assert not held.lost
    behind = _skewed(url, "r/.behind.lock", -60.0, SKEW_TTL_S * 2)
    assert behind.stdout is not None and behind.stdout.readline().strip() == "TOOK"
    time.sleep(SKEW_TTL_S + 2)
    holder = store.holder("r/.behind.lock") or ""
    behind.kill()
    said = behind.communicate(timeout=10)[0]
    killed = time.monotonic()
    assert "skewed" in holder, f"the lease lapsed while held: {said}"  # renewed: still held
    while store.holder("r/.behind.lock") is not None:
        assert time.monotonic() - killed < SKEW_TTL_S + 3, "a dead holder's lease outlived its TTL"
        time.sleep(0.2)


@pytest.mark.parametrize("date", [None, b"Mon, 01 Jan 1990 00:00:00 GMT", b"yesterday"])
def test_a_store_whose_date_is_missing_or_absurd_is_refused_at_its_check(
    s3: S3Server, proxy: FaultProxy, date: bytes | None
) -> None:
    proxy.date(date)
    store = open_store(s3.bucket_url(endpoint=proxy.endpoint))
    assert isinstance(store, S3Store)
    with pytest.raises(StoreRefused) as refused:
        check_s3(store)
    message = str(refused.value)
    assert "\n" not in message and "Date" in message and "clock" in message
    assert re.search(r"cannot hold leases", message)


def test_a_local_runs_directory_lock_is_never_lost(tmp_path: Path) -> None:
    runs = Runs(tmp_path / "runs")
    _record(runs)
    with follow_lock(runs, RUN) as held:
        time.sleep(0.1)
        assert not held.lost and held.why is None
        held.check()
        record = runs.load(RUN)
        record.message = "still ours"
        runs.save(record)


def test_a_lost_lease_refuses_every_write_of_its_run(
    s3: S3Server, proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once the follow lock of a run is lost, its record, its files and its
    pod record are written no more: LeaseLost, nothing written."""
    monkeypatch.setenv(TTL_ENV, "2")
    runs = Runs(s3.bucket_url(endpoint=proxy.endpoint))
    _record(runs)
    with follow_lock(runs, RUN) as held:
        proxy.stall(2.5)
        deadline = time.monotonic() + 3
        while not held.lost:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        proxy.release()
        record = runs.load(RUN)
        record.message = "after the loss"
        with pytest.raises(LeaseLost):
            runs.save(record)
        with pytest.raises(LeaseLost):
            runs.write_bytes(RUN, "manifest.json", b"{}")
        with pytest.raises(LeaseLost):
            runs.remove(RUN, "run.json")
        with pytest.raises(LeaseLost):  # no pod record, so no create or delete after it
            PodRecord(run_id=RUN, host_key="k").save(runs)
    assert runs.load(RUN).message is None
    assert PodRecord.load(runs, RUN) is None


def test_a_follower_that_lost_the_runs_directory_puts_back_no_flow_run(
    s3: S3Server, proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """recover() puts a dead follower's flow runs back to Scheduled only while
    this follower holds the runs directory: once its lock is lost it stops at
    once and says so, leaving the markers to the follower that took over."""
    monkeypatch.setenv(TTL_ENV, "2")
    runs = Runs(s3.bucket_url(endpoint=proxy.endpoint))
    marker = runs.top.key(HERE_DIR, f"{uuid.uuid4()}.json")
    runs.store.write(marker, json.dumps({"follower": "dead"}).encode())
    logger = logging.getLogger("test-recover")
    with follower_lock(runs, "me") as held, _captured(logger) as said:
        proxy.stall(2.5)
        deadline = time.monotonic() + 3
        while not held.lost:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        proxy.release()
        assert run(recover(runs, "me", logger, held=held)).put_back == 0
    assert runs.store.read(marker) is not None  # left to the follower that took over
    assert any("this one stops recovering" in line for line in said), said


def test_a_resumed_flow_run_whose_lease_lapses_while_it_waits_for_room_is_not_resumed(
    prefect_server: None,
    s3: S3Server,
    proxy: FaultProxy,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The follower already runs its most flow runs again (MAX_HERE, here 1);
    a verified job's flow run waits for room (resume_here.ROOM_WAIT_S) while
    the store stalls past the TTL and the job's follow lease lapses. When room
    comes, its flow run is not resumed: LeaseLost, the flow run still
    suspended for the follower that took the job over, its reservation in
    the follower released."""
    monkeypatch.setenv(TTL_ENV, "2")
    monkeypatch.setattr(resume_here, "MAX_HERE", 1)
    monkeypatch.setattr(resume_here, "ROOM_WAIT_S", 60.0)
    runs = Runs(s3.bucket_url(endpoint=proxy.endpoint))
    _record(runs)
    here = Here(Runs(tmp_path / "here"), {"gated-resumed": gated}, "live")

    async def scenario() -> None:
        first, second = await suspended_in_pool("lapsed-pool", gated, 2, monkeypatch)
        token = HERE.set(here)
        try:
            assert await resume(ended_job(tmp_path, first), LOG)  # holds the only room
            with follow_lock(runs, RUN) as held:
                waits = asyncio.create_task(resume(ended_job(tmp_path, second, RUN), LOG))
                await asyncio.sleep(0.5)
                assert not waits.done()
                proxy.stall(2.5)
                deadline = time.monotonic() + 3
                while not held.lost:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.05)
                proxy.release()
                GATE.release()  # the first ends: room for the second, whose lease is gone
                with pytest.raises(LeaseLost):
                    await asyncio.wait_for(waits, 60)
        finally:
            HERE.reset(token)
        assert await asyncio.to_thread(here.join, 60) == 0
        assert await state_of(first) == (StateType.COMPLETED, "Completed")
        assert (await state_of(second))[0] == StateType.PAUSED  # never resumed
        assert here.running() == 0 and here.runs.store.names(here.runs.key(HERE_DIR)) == []

    asyncio.run(scenario())


@contextmanager
def _captured(logger: logging.Logger) -> Iterator[list[str]]:
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler = Keep()
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)


def test_a_collect_that_lost_its_run_in_a_stall_stops_and_says_so_and_another_finishes_it(
    prefect_server: None, s3: S3Server, proxy: FaultProxy, local_target: str, tmp_path: Path
) -> None:
    """Collect A, whose store stalls (through the proxy), follows a running
    job; its lease lapses. A finds it lost at once (its job's status comes
    from the target, not the store), does nothing more with the run, says so
    in one line and ends without a traceback. Collect B, on another machine,
    starts meanwhile, takes the run and follows it to its end: the run is
    succeeded, as B recorded it."""
    bucket = s3.bucket()
    direct = s3.bucket_url(bucket=bucket)
    runs = Runs(direct)
    go = tmp_path / "go"

    async def start_one() -> str:
        loaded = await LocalTarget.aload(local_target)
        assert isinstance(loaded, LocalTarget)
        executor = loaded.executor(local_target)
        ctx = context.RunContext(runs=runs, executor=executor, python=loaded.python)
        trainer = ShellTrainer(
            f"while [ ! -e {go} ]; do sleep 0.2; done; {WRITE_METRICS}; {WRITE_OUTPUT}"
        )
        record = start_step.create(
            runs,
            target=local_target,
            target_kind="local",
            workdir=executor.workdir,
            spec={"base_model": "/none", "datasets": ["/none.jsonl"], "max_steps": 3},
        )
        await start_step.start(ctx, trainer, record)
        return record.id

    run_id = run(start_one())
    logs = {name: tmp_path / f"{name}.log" for name in "ab"}
    a = _collect(s3.bucket_url(bucket=bucket, endpoint=proxy.endpoint), tmp_path / "a", logs["a"])
    try:
        wait_until(lambda: is_followed(runs, run_id), 120, "collect A to follow the run")
        proxy.stall(STALL_S + 6)
        time.sleep(TTL_S + 2)  # A's lease lapses, by the store's clock
        b = _collect(direct, tmp_path / "b", logs["b"])
        wait_until(lambda: "following its job" in logs["b"].read_text(), 120, "B to follow")
        go.touch()
        assert b.wait(timeout=180) == 0, logs["b"].read_text()[-3000:]
        assert a.wait(timeout=120) == 0, logs["a"].read_text()[-3000:]
    finally:
        kill(a)
    assert rows_of(logs["b"]) == [[run_id, "followed to its end", "succeeded"]]
    assert rows_of(logs["a"]) == []
    a_log = logs["a"].read_text()
    said = [line for line in a_log.splitlines() if "this one stops following it" in line]
    assert len(said) == 1 and f"run {run_id}" in said[0], a_log[-3000:]
    assert "Traceback" not in a_log and "RecordChanged" not in a_log, a_log[-3000:]
    assert runs.load(run_id).state == RunState.SUCCEEDED


def _collect(url: str, home: Path, log: Path) -> subprocess.Popen[bytes]:
    """A `collect` of `url` in a worker process of its own; its store
    requests give up after 1 s (tried again for 120 s), its leases last TTL_S."""
    return subprocess.Popen(
        [sys.executable, "-c", COLLECT, url],
        cwd=home,
        env={
            **worker_env(home),  # makes `home`
            TTL_ENV: str(TTL_S),
            READ_TIMEOUT_ENV: "1",
            OUTAGE_ENV: "120",
        },
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
