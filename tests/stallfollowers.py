"""Two followers of one run and a store that stalls for one of them, on the
real S3 server through the fault proxy: what the chaos tests and the
`two-followers-under-stall` bench both run.

Follower A reaches the store through the proxy, B (another machine) directly;
both follow the same run in processes of their own: each takes the run's
follow lock when it can and, while it holds it, acts (a record write, which
checks the lock first) every 0.2 s, saying when on its stdout (the monotonic
clock, one for every process of this machine). Once A acts, the store stalls
for A longer than the lease's TTL while B waits for the run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from overbrainer_prefect.runs.store import RunRecord, Runs
from overbrainer_prefect.store.lease import TTL_ENV
from overbrainer_prefect.store.s3 import OUTAGE_ENV, READ_TIMEOUT_ENV
from overbrainer_prefect.timestamps import rfc3339
from tests.faultproxy import FaultProxy
from tests.s3server import S3Server

RUN = "20260101-000000-cafe"
REPO = Path(__file__).resolve().parents[1]
WAIT_S = 60.0  # the most a follower process is waited for past its own bound

FOLLOWER = """
import logging, sys, threading, time
from overbrainer_prefect.runs.lock import RunBusy, follow_lock, lost_line
from overbrainer_prefect.runs.store import Runs
from overbrainer_prefect.store import LeaseLost
from overbrainer_prefect.store.records import RecordChanged

logging.basicConfig(stream=sys.stdout, level=logging.ERROR, format="LOG %(message)s")
url, run_id, name, seconds = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
runs = Runs(url)
end = time.monotonic() + seconds


def say(*words):
    print(*words, flush=True)


def watch(held, done):  # what the holder knows of its lease, as soon as it knows it
    while not done.wait(0.05):
        if held.lost:
            say("LOST-SEEN", time.monotonic())
            return


def act():  # an act that assumes the lock: a record write (checks the lock first)
    while True:
        record = runs.load(run_id)
        record.message = f"{record.message or ''} {name}".strip()
        try:
            runs.save(record)
            return
        except RecordChanged:
            continue


while time.monotonic() < end:
    try:
        with follow_lock(runs, run_id, name) as held:
            done = threading.Event()
            threading.Thread(target=watch, args=(held, done), daemon=True).start()
            say("FOLLOWING", time.monotonic())
            try:
                while time.monotonic() < end:
                    act()
                    say("ACT", time.monotonic())
                    time.sleep(0.2)
            except LeaseLost as lost:
                say("STOPPED", time.monotonic(), lost_line(run_id, lost))
            done.set()
        break
    except RunBusy:
        time.sleep(0.3)
say("END", time.monotonic())
"""


@dataclass(frozen=True)
class Round:
    """What one round showed: when the stall began, each follower's lines,
    and the acts in the order the run record kept them."""

    stalled_at: float
    a_lines: list[str]
    b_lines: list[str]
    acts: list[str]

    def at(self, follower: str, word: str) -> list[float]:
        """When `follower` (A or B) said `word` (monotonic seconds)."""
        lines = self.a_lines if follower == "A" else self.b_lines
        return [float(line.split()[1]) for line in lines if line.startswith(word + " ")]

    @property
    def both_followed(self) -> bool:
        """Whether A and B followed the run at once: B took it before A let it
        go, or an act of A's came after one of B's (in time or in the record)."""
        lost, b_took = self.at("A", "LOST-SEEN"), self.at("B", "FOLLOWING")
        a_acts, b_acts = self.at("A", "ACT"), self.at("B", "ACT")
        if b_took and (not lost or b_took[0] <= lost[0]):
            return True
        if a_acts and b_acts and max(a_acts) >= min(b_acts):
            return True
        return self.acts != sorted(self.acts)


def follower(
    url: str, name: str, seconds: float, ttl_s: float, **env: str
) -> subprocess.Popen[str]:
    """Follower `name` of the run RUN in the store `url`, for `seconds` at most."""
    return subprocess.Popen(
        [sys.executable, "-c", FOLLOWER, url, RUN, name, str(seconds)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), TTL_ENV: str(ttl_s), **env},
    )


def lines_of(process: subprocess.Popen[str], timeout: float) -> list[str]:
    """What `process` said until it ended (killed past `timeout`)."""
    try:
        out, _ = process.communicate(timeout=timeout)
    finally:
        process.kill()
        process.wait(10)
    return out.splitlines()


def stall_round(s3: S3Server, proxy: FaultProxy, ttl_s: float, stall_s: float) -> Round:
    """One round in a new bucket (see the module): A follows and acts, B
    waits, the store stalls for A `stall_s` seconds. Raises AssertionError
    when A never followed."""
    bucket = s3.bucket()
    direct = s3.bucket_url(bucket=bucket)
    runs = Runs(direct)
    runs.save(RunRecord(id=RUN, target="local", created=rfc3339(), remote_dir="/tmp/r"))
    proxied = s3.bucket_url(bucket=bucket, endpoint=proxy.endpoint)
    a = follower(proxied, "A", stall_s + 6, ttl_s, **{READ_TIMEOUT_ENV: "1", OUTAGE_ENV: "60"})
    try:
        assert a.stdout is not None
        first = [a.stdout.readline(), a.stdout.readline()]
        assert first[0].startswith("FOLLOWING") and first[1].startswith("ACT"), first
        b = follower(direct, "B", stall_s + 2, ttl_s)
        time.sleep(1.0)  # B waits: A follows
        stalled_at = time.monotonic()
        proxy.stall(stall_s)
        b_lines = lines_of(b, stall_s + WAIT_S)
        a_lines = [line.strip() for line in first] + lines_of(a, WAIT_S)
    finally:
        a.kill()
        a.wait(10)
    proxy.release()
    acts = (runs.load(RUN).message or "").split()
    return Round(stalled_at, a_lines, b_lines, acts)
