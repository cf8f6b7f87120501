"""How the `collect` flow scales: one collect flow run (one process, against a
private `prefect server`) following N = 10, 50 and 100 runs at once, each a
real shell job on a local target writing a metric line every PACE_S seconds
(a training step's pace), LINES lines, then its output.

The runs are written the way the job steps write them (`start_step.create`,
then `start_step.start` through a saved `LocalTarget`), with no flow run and no
follower, so the collect picks every one up and follows it (`follow_job`, as
after a crash). The jobs wait, blocked on a FIFO, until the collect holds the
follow lock of every run, then all write their metrics at the same pace.

Measured on the collect's process (from /proc), for each N:
- resident memory while it follows all N runs, and its CPU over the lines'
  window; the figures per followed run are the increments from N = 10 to
  N = 100 divided by the 90 runs added (the process's own cost, Prefect and
  its imports, is no followed run's);
- the delay from a metric line written (its `time`, from `date` in the job)
  to the line's record in the flow run's log (its timestamp, read back from
  the server's API): p50, p95 and max, all lines and the first line of each
  run (the follows starting together).

Prints `BENCH collect-rss-per-run`, `BENCH collect-cpu-per-run`,
`BENCH collect-metric-delay-p95-n<N>` and `...-first-p95-n<N>` with the goals
(<= 2 MB and <= 0.5 % of a core per run; p95 <= poll_seconds + 1 s). About four
minutes on a 2-core machine. Every job ends by itself; any left is killed by
its process group.
"""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from kit.lines import bench, note, progress, run_main  # noqa: E402
from kit.process import tree_cpu_seconds, tree_rss_bytes  # noqa: E402
from kit.server import prefect_server  # noqa: E402

COUNTS = (10, 50, 100)  # runs followed at once
PACE_S = 1.5  # seconds between two metric lines (not a multiple of the poll: phases vary)
LINES = 10  # metric lines a job writes
LOCKS_TIMEOUT_S = 180.0  # for the collect to take every run's follow lock
COLLECT_TIMEOUT_S = 300.0  # for it to follow every run to its end and retrieve it
START_BATCH = 20  # runs started at once (each start probes the venv's Python)
SPEC = {  # a valid training spec: the record's trainer is rebuilt from it (never run)
    "base_model": "/nonexistent/tiny",
    "datasets": ["/nonexistent/chat.jsonl"],
    "max_steps": LINES,
}
METRIC_LOG = re.compile(r"run (\S+): step (\d+)")
FIRST_POLL_LOG = re.compile(r"run (\S+): job running$")  # a follow's first look at its job

COLLECT = """
import asyncio, sys
from overbrainer_prefect.flows import collect
rows = asyncio.run(collect(runs_dir=sys.argv[1]))
bad = [r for r in rows if r.state != "succeeded"]
print(f"collected {len(rows)} runs, {len(bad)} not succeeded: {bad[:1]}")
sys.exit(1 if bad or not rows else 0)
"""


def job_script(go: Path) -> str:
    """The job: waits for the go FIFO to be opened, writes LINES metric lines at
    PACE_S, then its output (what a training leaves)."""
    stamp = "$(date +%s.%N)"
    return (
        f"cat {shlex.quote(str(go))} >/dev/null; "
        f'printf \'{{"event":"begin","max_steps":{LINES},"time":%s}}\\n\' {stamp} '
        ">> metrics.jsonl; "
        f"s=1; while [ $s -le {LINES} ]; do sleep {PACE_S:g}; "
        f'printf \'{{"event":"log","step":%s,"loss":1.5,"time":%s}}\\n\' $s {stamp} '
        ">> metrics.jsonl; s=$((s+1)); done; "
        "mkdir -p output && echo weights > output/adapter_model.safetensors"
    )


@dataclass
class Round:
    """What one collect of N runs cost and how late its log was."""

    count: int
    rss: int = 0
    cpu_share: float = 0.0  # of one core, over the lines' window
    delays: list[float] = field(default_factory=list)
    first: list[float] = field(default_factory=list)
    wall: float = 0.0
    later: list[float] = field(default_factory=list)  # lines 3 on: the follows under way
    polls: list[float] = field(default_factory=list)  # go -> each follow's first look
    server_share: float = 0.0  # of one core, the Prefect server's, over the same window
    load: float = 0.0  # the machine's 1-minute load average at the window's end


async def start_runs(root: Path, target: str, count: int, go: Path) -> tuple[Path, list[str]]:
    """Creates and starts `count` runs, as the job steps do; returns the runs
    directory and their IDs."""
    from overbrainer_prefect.blocks import LocalTarget
    from overbrainer_prefect.runs.store import Runs
    from overbrainer_prefect.steps import context
    from overbrainer_prefect.steps import start as start_step
    from tests.shelljobs import ShellTrainer

    loaded: object = await LocalTarget.aload(target)
    assert isinstance(loaded, LocalTarget)
    block = loaded
    runs = Runs(root / f"runs-{count}")
    executor = block.executor(target)
    ctx = context.RunContext(runs=runs, executor=executor, python=block.python)
    trainer = ShellTrainer(job_script(go))
    ids: list[str] = []

    async def one() -> None:
        record = start_step.create(
            runs, target=target, target_kind=block.kind, workdir=executor.workdir, spec=SPEC
        )
        await start_step.start(ctx, trainer, record)
        ids.append(record.id)

    for first in range(0, count, START_BATCH):
        await asyncio.gather(*(one() for _ in range(min(START_BATCH, count - first))))
    return runs.root, ids


def log_delays(
    ids: list[str], runs_root: Path, go: float, since: float
) -> tuple[list[float], list[float], list[float], list[float]]:
    """(every line's delay, each run's first line's delay, the delays of the
    lines from the third on, each follow's first look at its job after `go`),
    from the metric files and the flow run logs since `since` (Unix time: a
    server shared with other scripts holds theirs too)."""
    import json
    from datetime import UTC, datetime

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterTimestamp

    after = LogFilter(timestamp=LogFilterTimestamp(after_=datetime.fromtimestamp(since, UTC)))

    written: dict[tuple[str, int], float] = {}
    for run_id in ids:
        for line in (runs_root / run_id / "metrics.jsonl").read_text().splitlines():
            event = json.loads(line)
            if event.get("event") == "log":
                written[(run_id, int(event["step"]))] = float(event["time"])

    polled: dict[str, float] = {}

    async def read() -> dict[tuple[str, int], float]:
        logged: dict[tuple[str, int], float] = {}
        async with get_client() as client:
            offset = 0
            while True:
                page = await client.read_logs(log_filter=after, limit=200, offset=offset)
                if not page:
                    return logged
                offset += len(page)
                for log in page:
                    polls = FIRST_POLL_LOG.search(log.message)
                    if polls:
                        polled.setdefault(polls[1], log.timestamp.timestamp())
                    found = METRIC_LOG.search(log.message)
                    if found:
                        key = (found[1], int(found[2]))
                        logged.setdefault(key, log.timestamp.timestamp())

    logged = asyncio.run(read())
    missing = [key for key in written if key not in logged]
    if missing:
        raise RuntimeError(f"{len(missing)} metric lines never reached the log, e.g. {missing[0]}")
    delays = [logged[key] - at for key, at in written.items()]
    later = [logged[key] - at for key, at in written.items() if key[1] >= 3]
    first = [logged[(run_id, 1)] - written[(run_id, 1)] for run_id in ids]
    return delays, first, later, [polled[run_id] - go for run_id in ids if run_id in polled]


def one_round(root: Path, target: str, count: int, server_pid: int) -> Round:
    """Starts `count` runs, has one collect follow them, measures it."""
    go = root / f"go-{count}"
    os.mkfifo(go)
    from overbrainer_prefect.runs.lock import is_followed
    from overbrainer_prefect.runs.store import Runs

    progress(f"N={count}: starting the runs")
    runs_root, ids = asyncio.run(start_runs(root, target, count, go))
    progress(f"N={count}: collect")
    result = Round(count)
    log = root / f"collect-{count}.log"
    began, since = time.monotonic(), time.time()
    with log.open("wb") as out:
        child = subprocess.Popen(
            [sys.executable, "-c", COLLECT, str(runs_root)],
            env={**os.environ, "PYTHONPATH": str(REPO)},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + LOCKS_TIMEOUT_S
        runs = Runs(runs_root)
        while sum(is_followed(runs, run_id) for run_id in ids) < count:
            if child.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the collect did not follow all {count} runs: {tail(log)}")
            time.sleep(0.1)
        with open(go, "wb"):  # every job blocked on the FIFO goes on at once
            went = time.time()
        time.sleep(2 * PACE_S)  # the follows are past their first lines
        server_start = tree_cpu_seconds(server_pid)
        cpu_start, clock_start = tree_cpu_seconds(child.pid), time.monotonic()
        rss = 0
        while time.monotonic() - clock_start < (LINES - 3) * PACE_S:
            rss = max(rss, tree_rss_bytes(child.pid))
            time.sleep(0.5)
        window = time.monotonic() - clock_start
        result.cpu_share = (tree_cpu_seconds(child.pid) - cpu_start) / window
        result.server_share = (tree_cpu_seconds(server_pid) - server_start) / window
        result.load = os.getloadavg()[0]
        result.rss = rss
        code = child.wait(timeout=COLLECT_TIMEOUT_S)
        result.wall = time.monotonic() - began
        if code != 0:
            raise RuntimeError(f"the collect of {count} runs failed: {tail(log)}")
    finally:
        if child.poll() is None:
            with suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.wait()
    progress(f"N={count}: reading the log back")
    result.delays, result.first, result.later, result.polls = log_delays(
        ids, runs_root, went, since
    )
    return result


def tail(path: Path) -> str:
    """The last lines of a log, on one line."""
    lines = path.read_text(errors="replace").strip().splitlines() if path.exists() else []
    return " | ".join(lines[-3:]) or "(no output)"


def percentile(values: list[float], share: float) -> float:
    """The `share` quantile of `values` (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(share * len(ordered)) - 1))]


def kill_leftovers(root: Path) -> None:
    """Kills, by process group, the job of any run under `root` not ended."""
    from overbrainer_prefect.runs.store import Runs

    for runs_dir in root.glob("runs-*"):
        for record in Runs(runs_dir).list(skipped=lambda _name, _error: None):
            if record.job is not None and not record.state.ended:
                with suppress(OSError):
                    os.killpg(record.job.pid, signal.SIGKILL)


def main() -> None:
    """Starts the server, runs the rounds, prints the figures."""
    root = Path(tempfile.mkdtemp(prefix="bench-scale-"))
    work = root / "work"
    try:
        with prefect_server(root) as server:
            from overbrainer_prefect.blocks import LocalTarget

            target = f"bench-scale-{uuid.uuid4().hex[:8]}"
            venv = Path(sys.executable).parent.parent  # any Python does for a shell job
            block = LocalTarget(job_venv=str(venv), work_dir=str(work))
            block.save(target)
            goal_s = block.poll_seconds + 1.0
            counts = [int(n) for n in sys.argv[1:]] or list(COUNTS)  # e.g. `2 5` to try it
            rounds = [one_round(root, target, count, server.pid) for count in counts]
        for r in rounds:
            note(
                f"N={r.count}: collect RSS {r.rss / 2**20:.0f} MiB, CPU {100 * r.cpu_share:.1f} % "
                f"of a core; delay p50 {statistics.median(r.delays):.2f} s, p95 "
                f"{percentile(r.delays, 0.95):.2f}, max {max(r.delays):.2f} (from the third line "
                f"on: p95 {percentile(r.later, 0.95):.2f}); first line p50 "
                f"{statistics.median(r.first):.2f}, p95 {percentile(r.first, 0.95):.2f}, max "
                f"{max(r.first):.2f} (written {PACE_S:g} s after the go); the follows' first "
                f"looks at their jobs {statistics.median(r.polls):+.2f} s after the go (p50), "
                f"{max(r.polls):+.2f} s (max); {r.wall:.0f} s from start to end; the Prefect "
                f"server used {100 * r.server_share:.0f} % of a core, load average {r.load:.1f} "
                f"on {os.cpu_count()} cores"
            )
        low, high = rounds[0], rounds[-1]
        added = high.count - low.count
        note(f"per followed run: the increments from N={low.count} to N={high.count}, / {added}")
        bench("collect-rss-per-run", (high.rss - low.rss) / added / 1e6, "MB", "<=", 2.0)
        bench(
            "collect-cpu-per-run",
            100 * (high.cpu_share - low.cpu_share) / added,
            "%-of-a-core",
            "<=",
            0.5,
            digits=3,
        )
        for r in rounds:
            all_p95 = percentile(r.delays, 0.95)
            bench(f"collect-metric-delay-p95-n{r.count}", all_p95, "s", "<=", goal_s)
            first_p95 = percentile(r.first, 0.95)
            bench(f"collect-first-metric-delay-p95-n{r.count}", first_p95, "s", "<=", goal_s)
    finally:
        kill_leftovers(root)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    run_main(__file__, main)
