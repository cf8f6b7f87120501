"""Runs in an object store: a job's output put in the store by its target, and
the store's records under many writers at once. A real S3 server (moto's, on
127.0.0.1, as the tests run it) and a loopback sshd standing for a pod
(tests/sshd.py).

- A 1 GiB output (random bytes, as weights are) in the "pod"'s run directory
  is retrieved to the store the way a run is (`steps.direct.put_files`: the
  pod puts it by presigned URLs in parts, the store checks each part, this
  side compares the store's SHA-256 with the manifest) and the way it would
  go without that (the worker downloads it over SSH, then uploads it to the
  store), PAIRS pairs, alternating. Measured on the worker's process: the
  bytes it read and wrote (`/proc/self/io` rchar + wchar) while the file went
  to the store, and the two paths' times.
- 100 runs' records changed at once, each by its own writer, CHANGES times a
  PACE_S apart (a run's record changes at its steps, far less often; its
  lease, every TTL/3), by compare-and-swap (`Runs.load` then `Runs.save`,
  read again after a lost race), every change appending to the record; a
  second writer of each run changes it at the same time (a follower and a
  hook): the p95 of one change, and the changes missing from the final
  records (lost updates). CHANGES was 10 (40 s of the bench); 5 give 1,000
  changes at the same 50 a second, 50 of them above the p95 (0.022 s
  measured against the goal's 0.2), and 1,000 chances to lose one.

Prints:
    BENCH store-bytes-through-worker <KiB> KiB goal <= 1024   (a 1 GiB output)
    BENCH store-retrieve-vs-worker-path <ratio> ratio goal <= 0.6
    BENCH store-record-update-p95 <s> s goal <= 0.2
    BENCH store-lost-updates <count> count goal <= 0

The servers are stopped by their PIDs; every file is removed. About two
minutes on a 2-core machine (107 s at load 3.8: the retrieval 73 s, the
records 27 s).
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from kit.lines import bench, note, progress, run_main  # noqa: E402
from kit.sides import median, side_by_side, timed  # noqa: E402

SIZE = 1 << 30  # bytes of the output retrieved
PAIRS = 2  # timings of each path
RUN_ID = "20261204-000000-bnch"
WRITERS = 100  # runs whose records change at once
CHANGES = 5  # changes of each record by each of its two writers (see the docstring)
PACE_S = 4.0  # between two changes of one writer: 100 req/s at the store in all


def io_bytes() -> int:
    """Bytes this process read and wrote through system calls (files, sockets, pipes)."""
    fields = dict(
        line.split(": ") for line in Path("/proc/self/io").read_text().splitlines() if ": " in line
    )
    return int(fields["rchar"]) + int(fields["wchar"])


def write_random(path: Path, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as file:
        for _ in range(size >> 24):
            file.write(os.urandom(16 << 20))


def retrieval(root: Path) -> None:
    """The 1 GiB output, both paths side by side; the worker's bytes."""
    from pydantic import SecretStr

    from overbrainer_prefect.executors.ssh import SshExecutor
    from overbrainer_prefect.runs.store import Runs
    from overbrainer_prefect.steps.direct import put_files
    from overbrainer_prefect.store.check import check_s3
    from tests.s3server import S3Server
    from tests.sshd import Sshd

    remote = root / "pod" / RUN_ID
    write_random(remote / "gguf" / "model.gguf", SIZE)
    python = str(REPO / ".venv-job" / "bin" / "python")
    if not Path(python).exists():
        python = sys.executable
    with S3Server.start(root / "moto.log") as s3, Sshd.create(root / "sshd") as server:
        executor = SshExecutor(
            "127.0.0.1",
            port=server.port,
            user=server.user,
            client_key=SecretStr(server.client_key_text),
            known_host_key=server.host_key_line,
            workdir=str(root / "pod"),
            name="bench pod",
        )
        loop = asyncio.new_event_loop()
        loop.run_until_complete(executor.run(["true"]))  # connected once
        manifest = loop.run_until_complete(executor.manifest(str(remote), ["gguf"]))
        worker_bytes: list[int] = []
        rounds = [0]

        def direct() -> float:
            rounds[0] += 1
            runs = Runs(s3.bucket_url())
            check_s3(
                runs.store
            )  # as a flow does when it starts: the client made, the store checked
            before = io_bytes()
            seconds = timed(
                lambda: loop.run_until_complete(
                    put_files(executor, python, runs, RUN_ID, str(remote), manifest)
                )
            )
            worker_bytes.append(io_bytes() - before)
            return seconds

        def through_worker() -> float:
            runs = Runs(s3.bucket_url())
            local = root / "worker" / RUN_ID

            def both() -> None:
                loop.run_until_complete(executor.download(str(remote), local, ["gguf"]))
                runs.store.put_file(
                    local / "gguf" / "model.gguf", runs.key(RUN_ID, "gguf/model.gguf")
                )

            seconds = timed(both)
            shutil.rmtree(local)
            return seconds

        progress("1 GiB: the pod puts it in the store / it goes through the worker, in turn")
        sides = side_by_side(PAIRS, direct, through_worker)
        loop.run_until_complete(executor.close())
        loop.close()
    note(f"retrieval of a 1 GiB output, {PAIRS} pairs: {sides.describe(SIZE / (1 << 20))}")
    note(
        "the worker's own reads and writes while the pod put it: "
        + " ".join(f"{b / 1024:.0f} KiB" for b in worker_bytes)
    )
    bench("store-bytes-through-worker", max(worker_bytes) / 1024, "KiB", "<=", 1024, digits=0)
    bench("store-retrieve-vs-worker-path", median(sides.time_ratios()), "ratio", "<=", 0.6)


def record_updates(root: Path) -> None:
    """WRITERS runs' records, two writers each changing it CHANGES times, at once."""
    from overbrainer_prefect.runs.store import RunRecord, Runs
    from overbrainer_prefect.store.records import RecordChanged
    from tests.s3server import S3Server

    with S3Server.start(root / "moto-records.log") as s3:
        runs = Runs(s3.bucket_url())
        ids = [f"20261204-{n:06d}-rec{n % 10}" for n in range(WRITERS)]
        for run_id in ids:
            runs.save(
                RunRecord(id=run_id, target="t", created="2026-12-04T00:00:00Z", remote_dir="/r")
            )
        seconds: list[float] = []
        lost_races = [0]
        errors: list[BaseException] = []
        go = threading.Event()

        def writer(run_id: str, name: str) -> None:
            go.wait()
            time.sleep(random.random() * PACE_S)  # the runs do not all start in one instant
            try:
                for change in range(CHANGES):
                    start = time.perf_counter()
                    while True:
                        record = runs.load(run_id)
                        record.message = f"{record.message or ''}{name}{change};"
                        try:
                            runs.save(record)
                            break
                        except RecordChanged:
                            lost_races[0] += 1
                    seconds.append(time.perf_counter() - start)
                    time.sleep(PACE_S)
            except BaseException as error:  # counted below
                errors.append(error)

        threads = [
            threading.Thread(target=writer, args=(run_id, name)) for run_id in ids for name in "ab"
        ]
        for thread in threads:
            thread.start()
        progress(f"{WRITERS} runs, two writers each, {CHANGES} changes each")
        go.set()
        for thread in threads:
            thread.join(600)
        if errors:
            raise errors[0]
        lost = 0
        for run_id in ids:
            message = runs.load(run_id).message or ""
            lost += 2 * CHANGES - len({c for c in message.split(";") if c})
    seconds.sort()
    p95 = seconds[int(0.95 * (len(seconds) - 1))]
    p50 = seconds[len(seconds) // 2]
    note(
        f"{len(seconds)} changes of {WRITERS} runs, two writers each, one every {PACE_S:g} s: "
        f"p50 {p50:.3f} s, "
        f"p95 {p95:.3f} s, max {seconds[-1]:.3f} s; races lost and read again: {lost_races[0]}"
    )
    bench("store-record-update-p95", p95, "s", "<=", 0.2, digits=3)
    bench("store-lost-updates", lost, "count", "<=", 0, digits=0)


def main() -> None:
    from tests.s3server import credentials_env

    # moto's own test keys (boto3 then asks no metadata service); every store here is local
    os.environ.update(credentials_env(), AWS_EC2_METADATA_DISABLED="true")
    root = Path(tempfile.mkdtemp(prefix="bench-store-"))
    try:
        retrieval(root)
        record_updates(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    run_main(__file__, main)
