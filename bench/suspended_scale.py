"""What one follower for every job costs (issue 28): 100 concurrent runs of
the `train/local` deployment on a real `prefect server` (on a private
PostgreSQL cluster, tests/postgres.py; SQLite where PostgreSQL is not
installed, see `prefect_database`) with a real process worker, the
deployments of `deployments/prefect.yaml` deployed with the CLI and the
`follow/always` follower (tests/prefect_server.py's stack).
Each flow run starts its job, suspends (its process exits), the one follower
follows every job, posting its live metrics into the suspended run's own log
and artifacts, retrieves and verifies its files when it ends and resumes the
flow run, which a worker runs again and which finds its job final and
completes. All of that is the product, unchanged.

The training program is a stand-in: 100 real axolotl trainings cannot run at
once on a 2-core machine, and what is measured here is the orchestration
around a job, not the job. The target is a `LocalTarget` whose job venv is
made here: a Python venv holding only a tiny `axolotl` (dist metadata
0.21.0, the release line the trainer writes configs for) and `torch` (a CPU
build's `version.py`), which the trainer's probe and checks accept. Its
`python -m axolotl.cli.train axolotl.yaml` reads the config the trainer
wrote, waits to be told to go (a file per job, so that every job is held
until all its flow runs have suspended), writes the metrics plugin's lines
(`begin`, one `log` a step every PACE_S, `end`, each with its `time`) to the
metrics file the config names, until it is told to end, then an adapter in
`output/` (what the retrieval verifies and a succeeded run must have).

Done in two steps, so that the follower's memory is read with 10 and with
100 jobs training: REFERENCE_RUNS runs are started, suspend and train; then
the other runs are started while those train, and once all have suspended
and the follower holds each job, all of them train for WINDOW_S. Then the
jobs are told to end one at a time, END_EVERY_S apart (nightlies do not all
end in the same second), and every flow run is waited for to complete.
END_EVERY_S was 2 s while each resumed run needed a new flow-run process; the
follower now runs them again itself (the `#` line says how many, MAX_HERE at
once; the others go to the worker, a new process each), so they end 0.75 s
apart: a job's end costs the follower, the server and PostgreSQL about 0.8 s
of a core (retrieve, verify, resume, run the flow run again; measured
2026-12-05 on a quiet machine: follower 0.37, server 0.61 cores at 0.75 s
apart), so the 100 ends take 75 s instead of 150 s at 1.5 s apart, with every
flow run run again in the follower and resume-p95 3.2 s (1.7 s at 1.5 s
apart). An earlier try at 1 s gave 54 s, and at 0.75 s 117 s, measured
beside other engineers' work (load 2 to 13), where the follower fell behind
and MAX_HERE filled: read this figure on a quiet machine, as `make bench`
runs it. On a host slower by a tenth (2026-12-05, the whole bench's scripts
10-20% slower than an hour before), 0.75 s apart left no margin: 20 and 31
of the 100 resumed runs went to the worker and resume-p95 was 30 s and 72 s
(0.6 s apart: 21.5 s; 0.5 s: 8.8 s and 12.4 s at most); 1 s apart, the same
hour: every resumed run ran again in the follower and resume-p95 was
2.58 s. So 1 s: the ends take 25 s more and keep their margin. Then the
follower stopped asking the server about each followed job's cancel one
request at a time (one request a pass for all of them, 2026-12-06: with 100
jobs, 50 requests a second fewer; the server's CPU while they train 0.35 ->
0.15 of a core): 0.75 s apart again, twice, 97 and 100 of the 100 resumed
runs ran again in the follower and resume-p95 was 4.28 and 2.12 s, the
second on a machine slower than any before (a fixed loop's 0.29-0.34 CPU s,
0.12-0.26 the day before). So 0.75 s: the ends take 75 s. Then a whole
`make bench` (2026-12-06, 23:01, nothing else running, a fixed loop's 0.13
CPU s) at 0.75 s: 64 of the 100 ran again in the follower, resume-p95 45.9 s,
the machine 1.81 cores busy while they ended: once its MAX_HERE threads are
busy, each further resumed run goes to the worker, a new process of about 3
CPU seconds, which slows the follower's next ones (a cliff, not a slope). So 1 s
again (98 and 100 of the 100 in the follower, resume-p95 5.66 and 2.58 s in
earlier runs): 25 s more, and the figure keeps its margin. Then the
follower's cliff went (2026-12-07, resume_here.ROOM_WAIT_S): a resumed run
that finds its MAX_HERE threads busy waits up to 5 s for one of them
instead of going to the worker at once. Alone, nothing else running: 0.75 s
apart, 100 of 100 in the follower, resume-p95 2.47 s, the whole script 373 s;
0.5 s apart, 100 of 100, resume-p95 2.38 s (p50 1.61, max 2.67), 323 s (the
starts 187 s of it). But in a whole `make bench` the same hour (b10, nothing
else running) 0.5 s apart sent 23 of the 100 to the worker and resume-p95 to
43.9 s: a run here takes about 1.8 s of wall time (mostly the server's
answers), so MAX_HERE (4) threads run about 2.2 a second, and jobs ending 2 a
second leave no margin; past ROOM_WAIT_S the cliff is back. So 1 s apart, as
every bench before 0.75 read within the goal. Then a whole `make bench` at 0.75 s
apart (b13, 2026-12-07, nothing else running, on a host where the 90 starts took 111 s
instead of about 190): 100 of the 100 ran again in the follower, resume-p95 1.42 s (max
2.16), the machine 0.70 cores busy while they ended (0.56 at 1 s apart, alone, the same
hour: resume-p95 1.33 s): 0.75 s, the ends 75 s instead of 100.
`SUSP_END_EVERY_S` sets it for a try.

The work pool runs POOL_LIMIT flow runs at once (the follower's included),
so that the flow-run processes start in batches; the deployment's own limit
of one run at a time is lifted for the bench. Its base job template's
`command` is set to ENGINE_COMMAND (`<this Python> -m prefect.engine`, what
Prefect runs anyway), which makes Prefect 3.9's process worker start the
engine alone (`EngineCommandStarter`) instead of a workspace supervisor that
imports Prefect (1.3 s of a core) before it starts the engine: a pool setting
a user may choose (`prefect work-pool create --base-job-template`); the
resumed runs still run again in the follower (its `Here` compares the pull
steps, job variables and environment, which the command does not change).
`SUSP_ENGINE_COMMAND=0` keeps Prefect's default for a comparison. The worker polls every 2 s
(the tests' stack; Prefect's default is 10 s, which resume-p95 would pay).
A flow run the worker fails to submit (the server answering 503 under this
load) is replaced by a new one, MAX_REPLACED at most, and said in a `#` line.
The flow-run processes import the package from the working tree: a tree
being edited meanwhile breaks them (run it from a clean checkout).

Prints:
- `follow-processes-n100`: the processes of the worker's tree while the 100
  jobs train (the worker, the follower, any flow-run process; the jobs, in
  sessions of their own, and the Prefect server are not counted), the most
  seen over the window; goal <= 3. And the peak while the runs start.
- `follow-rss-per-run`: the follower process's resident memory with 100 jobs
  training less with 10, / 90; goal <= 2 MB.
- `follow-first-metric-p95`: from a job's first `log` line (its `time`) to
  that step's line in the suspended flow run's log on the server (the log's
  `created`, the server's time of its insertion); goal <= 3 s (the target's
  poll_seconds, 2, + 1).
- `resume-p95`: from a job's record final and verified (its `ended`, saved
  once its files are verified) to its flow run `Completed` (its end time);
  goal <= 10 s.

Most of it is the 100 flow-run starts (the resumed runs are run again in
the follower, no new process each). Neither the worker's poll (2 s) nor the
pool's limit bounds those starts: the CPU does. A start was about 4 s of a
core: 1.3 s the workspace supervisor's imports of Prefect, then the engine's
2.1 s (Prefect's 1.2 s, and every flow of this package with the libraries
of all of them: the flows package imported them all); now the engine alone,
which imports Prefect and the one flow it runs (0.4 s of a core after
Prefect's, measured alone). Measured under `make bench` at load 3 to 10:
758 s, 847 CPU seconds (Prefect's supervisor, 1.5 s apart); 546 s, 735 CPU
seconds (then the supervisor, 1.5 s apart); the engine alone and one flow's
imports, 1 s apart, at load 2 to 11: 508 s, 641 CPU seconds (10 runs in 32 s,
90 more in 263 s); alone on a quiet machine, 1.5 s apart: 432 s (90 runs in
192 s), 0.75 s apart: 345 s, 495 CPU seconds (90 in 190 s). Of a flow-run
process's start (py-spy, 2026-12-05), half is imports (this package's flow a
seventh, Prefect the rest) and a tenth is `ssl.create_default_context`: each
Prefect client makes an httpx client, which loads certifi's bundle, also
for an `http://` server. 20 runs side by side at load 7 to 15: 191 CPU seconds with
the supervisor and every flow imported, 151 with the engine alone. `python
bench/suspended_scale.py 20` runs 20 runs (5 of them the reference) to try
it. Every process is stopped by its PID or process group; everything listens
on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from follow_scale import METRIC_LOG, percentile  # noqa: E402
from kit.lines import bench, note, progress, run_main  # noqa: E402
from kit.process import (  # noqa: E402
    cpu_seconds,
    machine_busy_s,
    rss_bytes,
    tree_cpu_seconds,
)

RUNS = 100  # train deployment runs at once
REFERENCE_RUNS = 10  # the first ones: the follower's memory with them alone is the reference
POOL_LIMIT = 8  # flow runs of the work pool running at once, the follower's included
PACE_S = 1.5  # seconds between two metric lines of a job (a training step's pace)
MAX_STEPS = 2000  # the spec's max_steps: a job writes at most that many lines (50 min)
WINDOW_S = 20.0  # all jobs training: the processes and the follower's memory sampled
REFERENCE_WINDOW_S = 8.0  # the reference runs training alone: the follower's memory
END_EVERY_S = float(os.environ.get("SUSP_END_EVERY_S", "0.75"))  # between two jobs told to end
HOLD_S = 1800  # a stand-in job never told to go exits (failed) after this long
SUSPEND_TIMEOUT_S = 600.0  # for a step's runs to start, suspend and be followed
FOLLOWER_TIMEOUT_S = 240.0  # for the follower's flow run to start and hold the runs directory
RESUME_TIMEOUT_S = 300.0  # for every flow run to complete once the last job was told to end
MAX_REPLACED = 10  # runs that ended before their job started, replaced by new ones
SAMPLE_EVERY_S = 0.5  # between two looks at the processes while waiting
CHECK_EVERY_S = 2.0  # between two asks of the server and the runs whether a wait is over
ENGINE_COMMAND = f"{sys.executable} -m prefect.engine"  # the pool's job command: no supervisor

STANDIN_TRAIN = '''\
"""Stand-in of `axolotl.cli.train` made by bench/suspended_scale.py: reads the
config, waits to be told to go, writes the metrics plugin's lines at a pace
until told to end, then an adapter and the end line."""
import json, os, sys, time
from pathlib import Path

CONTROL = Path(@CONTROL@)
PACE_S = @PACE@
HOLD_S = @HOLD@
name = Path.cwd().name  # the run directory: named after the run
config = {}
for line in Path(sys.argv[1]).read_text().splitlines():
    key, sep, value = line.partition(": ")
    if sep and line[:1].strip():
        config[key] = value.strip().strip("'\\"")
print("overbrainer metrics plugin loaded", file=sys.stderr, flush=True)
max_steps = int(config["max_steps"])
out = open(config["overbrainer_metrics_file"], "a", encoding="utf-8")

def write(event):
    out.write(json.dumps({**event, "time": time.time()}) + "\\n")
    out.flush()

held = time.monotonic()
while not (CONTROL / f"go-{name}").exists():
    if time.monotonic() - held > HOLD_S:
        sys.exit("never told to go")
    time.sleep(0.2)
began = time.time()
write({"event": "begin", "step": 0, "max_steps": max_steps, "processes": 1, "gpus": 0})
step = 0
while step < max_steps and not (CONTROL / f"end-{name}").exists():
    time.sleep(PACE_S)
    step += 1
    write({"event": "log", "step": step, "loss": 2.0 / (1 + 0.05 * step),
           "learning_rate": 2e-4, "grad_norm": 1.0, "epoch": step / max_steps,
           "max_steps": max_steps})
output = Path(config["output_dir"])
output.mkdir(exist_ok=True)
(output / "adapter_config.json").write_text(json.dumps({"r": 8, "peft_type": "LORA"}))
(output / "adapter_model.safetensors").write_bytes(os.urandom(4096))
write({"event": "end", "step": step, "stopped": False, "checkpoint": None,
       "train_loss": 2.0 / (1 + 0.05 * step), "train_runtime": time.time() - began})
'''


def standin_venv(root: Path, control: Path) -> Path:
    """A venv whose Python has the stand-in `axolotl` (0.21.0) and `torch`
    (a CPU build) and nothing else; returns it."""
    venv = root / "job-venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    (site,) = (venv / "lib").glob("python3*/site-packages")
    for dist, version in (("axolotl", "0.21.0"), ("torch", "2.8.0+cpu")):
        info = site / f"{dist}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n"
            "Summary: stand-in made by bench/suspended_scale.py\n"
        )
        (site / dist).mkdir()
        (site / dist / "__init__.py").write_text('"""Stand-in: see bench/suspended_scale.py."""\n')
    (site / "torch" / "version.py").write_text(
        "__version__ = '2.8.0+cpu'\ncuda = None\nhip = None\n"
    )
    (site / "axolotl" / "cli").mkdir()
    (site / "axolotl" / "cli" / "__init__.py").write_text("")
    program = (
        STANDIN_TRAIN.replace("@CONTROL@", repr(str(control)))
        .replace("@PACE@", repr(PACE_S))
        .replace("@HOLD@", repr(HOLD_S))
    )
    (site / "axolotl" / "cli" / "train.py").write_text(program)
    return venv


@dataclass
class Seen:
    """What was seen: the most processes of the worker's tree at once while
    the runs started and while all jobs trained, and the follower's most
    resident memory by the number of jobs training."""

    peak_start: int = 0
    peak_training: int = 0
    training_samples: int = 0
    breakdown: str = ""
    follower_rss: dict[int, int] = field(default_factory=dict)  # jobs training -> most RSS
    cpu: dict[str, str] = field(default_factory=dict)  # phase -> cores used by each part


def postgres_cpu_s() -> float:
    """CPU seconds of the live PostgreSQL processes of this machine."""
    from tests import procs

    total = 0.0
    for pid, proc in procs.table().items():
        if proc.name.startswith("postgres"):
            try:
                total += cpu_seconds(pid, reaped=False)
            except OSError:
                continue
    return total


class Bench:
    """The stack, the stand-in target and the runs started on it."""

    def __init__(self, stack: Any, target: str, control: Path, training: dict[str, Any]) -> None:
        self.stack = stack
        self.training = training
        self.replaced: list[str] = []  # why each replaced flow run ended
        self.target = target
        self.control = control
        self.flow_runs: list[uuid.UUID] = []
        self.follower: uuid.UUID | None = None
        self.follower_pid: int | None = None
        self.seen = Seen()

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(client, *args)` with a Prefect client of the stack's server."""
        return self.stack.server.call(fn, *args)

    def runs(self) -> Any:
        """The shared runs directory of the stack."""
        from overbrainer_prefect.runs.store import Runs

        return Runs(self.stack.runs)

    def job_sessions(self) -> set[int]:
        """The sessions of the jobs started so far (each job leads its own)."""
        return {r.job.pid for r in self.runs().list() if r.job is not None}

    def processes(self) -> tuple[int, str]:
        """How many processes the worker's tree holds now, the jobs left out,
        and which they are."""
        from tests import procs

        worker = self.stack.workers[0]  # the stack's one worker (never another started here)
        assert worker.process is not None
        sessions = self.job_sessions()
        table = procs.table()
        below = [
            p
            for p in procs.descendants(worker.process.pid, zombies=False)
            if p in table and table[p].session not in sessions and table[p].pgid not in sessions
        ]
        followers = [p for p in below if p == self.follower_pid]
        others = len(below) - len(followers)
        shown = f"worker 1, follower {len(followers)}, flow-run and other processes {others}"
        return 1 + len(below), shown

    def wait(self, what: str, done: Callable[[], bool], timeout: float, phase: str) -> None:
        """Samples the processes every SAMPLE_EVERY_S until `done()`, asked every
        CHECK_EVERY_S (each ask reads every flow run from the server and every
        run record: asked as often, it took a share of the 2 cores the flow-run
        starts need); RuntimeError naming `what` after `timeout`."""
        deadline = time.monotonic() + timeout
        checked = time.monotonic()
        while not done():
            while time.monotonic() - checked < CHECK_EVERY_S:  # the processes more often
                count, _ = self.processes()
                if phase == "start":
                    self.seen.peak_start = max(self.seen.peak_start, count)
                time.sleep(SAMPLE_EVERY_S)
            checked = time.monotonic()
            if checked > deadline:
                worker = self.stack.workers[0].log_tail(3)
                raise RuntimeError(f"{what}: not within {timeout:.0f} s; worker: {worker}")

    def start_follower(self) -> None:
        """A run of the follower deployment, once it holds the runs directory."""
        from overbrainer_prefect.runs.lock import follower_of
        from tests.prefect_server import FOLLOWER

        async def make(client: Any) -> uuid.UUID:
            found = await client.read_deployment_by_name(FOLLOWER)
            run = await client.create_flow_run_from_deployment(found.id)
            return uuid.UUID(str(run.id))

        self.follower = self.call(make)
        self.wait(
            "the follower holding the runs directory",
            lambda: follower_of(self.runs()) is not None and self._follower_pid() is not None,
            FOLLOWER_TIMEOUT_S,
            "start",
        )

    def _follower_pid(self) -> int | None:
        found = self.stack.flow_run(self.follower).infrastructure_pid
        self.follower_pid = int(str(found).rsplit(":", 1)[-1]) if found else None
        return self.follower_pid

    def start_runs(self, count: int) -> list[uuid.UUID]:
        """`count` runs of train/local on the stand-in target."""

        async def make(client: Any) -> list[uuid.UUID]:
            found = await client.read_deployment_by_name("train/local")
            made = []
            for _ in range(count):
                run = await client.create_flow_run_from_deployment(
                    found.id, parameters={"target": self.target, "training": self.training}
                )
                made.append(uuid.UUID(str(run.id)))
            return made

        made: list[uuid.UUID] = self.call(make)
        self.flow_runs += made
        return made

    def records_of(self, flow_runs: list[uuid.UUID]) -> dict[uuid.UUID, Any]:
        """The run records the flow runs created, by flow run (those started)."""
        wanted = {str(f): f for f in flow_runs}
        return {wanted[r.flow_run_id]: r for r in self.runs().list() if r.flow_run_id in wanted}

    def all_suspended_and_followed(self, flow_runs: list[uuid.UUID]) -> bool:
        """Whether every flow run of `flow_runs` waits suspended and the follower
        holds its job. One that ended before starting its job (the worker could
        not submit it: a `503` of the SQLite server under this load) is
        replaced in `flow_runs` by a new run, MAX_REPLACED in all; RuntimeError
        beyond, or for one that ended after starting its job."""
        from overbrainer_prefect.runs.lock import holder_of

        states = self.call(_states, flow_runs)
        records = self.records_of(flow_runs)
        for flow_run_id, (kind, message) in states.items():
            if kind not in ("FAILED", "CRASHED", "CANCELLED", "COMPLETED"):
                continue
            record = records.get(flow_run_id)
            if (record is not None and record.job is not None) or len(
                self.replaced
            ) >= MAX_REPLACED:
                raise RuntimeError(
                    f"flow run {flow_run_id} ended {kind} before suspending: {message}"
                )
            self.replaced.append(f"{kind}: {message}")
            self.flow_runs.remove(flow_run_id)
            flow_runs.remove(flow_run_id)  # `flow_runs` is a part of `self.flow_runs`
            flow_runs += self.start_runs(1)
            return False
        if any(kind != "PAUSED" for kind, _ in states.values()):
            return False
        if len(records) < len(flow_runs) or any(r.job is None for r in records.values()):
            return False
        runs = self.runs()
        return all(str(self.follower) in holder_of(runs, r.id) for r in records.values())

    def go(self, flow_runs: list[uuid.UUID]) -> None:
        """Tells the jobs of the flow runs to train."""
        for record in self.records_of(flow_runs).values():
            (self.control / f"go-{Path(record.remote_dir).name}").touch()

    def cpu_now(self) -> dict[str, float]:
        """CPU seconds so far of the parts: the follower, the worker (itself),
        the Prefect server (its tree), PostgreSQL, the whole machine."""
        server = self.stack.server.process
        worker = self.stack.workers[0].process
        assert server is not None and worker is not None and self.follower_pid is not None
        found = {
            "follower": cpu_seconds(self.follower_pid, reaped=False),
            "worker": cpu_seconds(worker.pid, reaped=False),
            "flow-run processes": cpu_seconds(worker.pid) - cpu_seconds(worker.pid, reaped=False),
            "server": tree_cpu_seconds(server.pid),
            "postgres": postgres_cpu_s(),
            "machine": machine_busy_s(),
            "wall": time.monotonic(),
        }
        return found

    def cpu_since(self, phase: str, before: dict[str, float]) -> None:
        """Records the cores each part used since `before` (`cpu_now`), as `phase`."""
        now = self.cpu_now()
        wall = now["wall"] - before["wall"]
        self.seen.cpu[phase] = (
            ", ".join(
                f"{name} {(now[name] - before[name]) / wall:.2f}"
                for name in (
                    "follower",
                    "worker",
                    "flow-run processes",
                    "server",
                    "postgres",
                    "machine",
                )
            )
            + f" cores over {wall:.0f} s"
        )

    def sample_training(self, jobs: int, seconds: float, count_processes: bool) -> None:
        """Samples the follower's memory (and the processes) for `seconds`
        while `jobs` jobs train."""
        assert self.follower_pid is not None
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            rss = rss_bytes(self.follower_pid)
            self.seen.follower_rss[jobs] = max(self.seen.follower_rss.get(jobs, 0), rss)
            if count_processes:
                count, shown = self.processes()
                self.seen.training_samples += 1
                if count >= self.seen.peak_training:
                    self.seen.peak_training, self.seen.breakdown = count, shown
            time.sleep(SAMPLE_EVERY_S)


async def _flow_runs(client: Any, flow_runs: list[uuid.UUID]) -> list[Any]:
    """The flow runs as the server has them now."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    return list(
        await client.read_flow_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=flow_runs)),
            limit=len(flow_runs),
        )
    )


async def _states(client: Any, flow_runs: list[uuid.UUID]) -> dict[uuid.UUID, tuple[str, str]]:
    """The state type of each flow run and the first line of its message, by ID."""
    return {
        r.id: (r.state.type.value, (r.state.message or "").strip().split("\n")[0][:300])
        if r.state
        else ("NONE", "")
        for r in await _flow_runs(client, flow_runs)
    }


async def _after_pause(
    client: Any, flow_runs: list[uuid.UUID]
) -> dict[uuid.UUID, dict[str, float]]:
    """For each flow run, when it entered each state type after its last
    pause (the resume's Scheduled, Pending, Running, Completed), by type;
    IN_FOLLOWER when the follower claimed it."""
    from overbrainer_prefect.resume_here import CLAIM

    found: dict[uuid.UUID, dict[str, float]] = {}
    for flow_run_id in flow_runs:
        states = sorted(await client.read_flow_run_states(flow_run_id), key=lambda s: s.timestamp)
        paused = [n for n, s in enumerate(states) if s.type.value == "PAUSED"]
        after = states[paused[-1] + 1 :] if paused else []
        times: dict[str, float] = {}
        for state in after:
            times.setdefault(state.type.value, state.timestamp.timestamp())
            if state.type.value == "PENDING" and state.name == CLAIM:
                times["IN_FOLLOWER"] = 1.0  # claimed by the follower: run again in its process
        found[flow_run_id] = times
    return found


async def _first_metric_logged(
    client: Any, flow_runs: list[uuid.UUID]
) -> dict[str, tuple[float, float]]:
    """When each run's first step line was logged (its `timestamp`, the
    follower's clock) and reached the server (its `created`), in the log of
    the flow run that started it, by run ID."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    found: dict[str, tuple[float, float]] = {}
    offset = 0
    while True:
        page = await client.read_logs(
            log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=flow_runs)),
            limit=200,
            offset=offset,
        )
        if not page:
            return found
        offset += len(page)
        for log in page:
            step = METRIC_LOG.search(log.message)
            if step and int(step[2]) == 1:
                at = (log.timestamp.timestamp(), (log.created or log.timestamp).timestamp())
                found[step[1]] = min(found.get(step[1], at), at)


async def _lift_limits(client: Any) -> None:
    """The deployment's one-at-a-time lifted, the work pool's POOL_LIMIT set."""
    from prefect.client.schemas.actions import DeploymentUpdate, WorkPoolUpdate

    from tests.prefect_server import POOL

    found = await client.read_deployment_by_name("train/local")
    await client.update_deployment(found.id, DeploymentUpdate(concurrency_limit=None))
    pool = await client.read_work_pool(POOL)
    template = json.loads(json.dumps(pool.base_job_template))
    if os.environ.get("SUSP_ENGINE_COMMAND", "1") == "1":
        template["variables"]["properties"]["command"]["default"] = ENGINE_COMMAND
    await client.update_work_pool(
        POOL, WorkPoolUpdate(concurrency_limit=POOL_LIMIT, base_job_template=template)
    )
    again = await client.read_deployment_by_name("train/local")
    if again.global_concurrency_limit is not None:
        raise RuntimeError("train/local still has its concurrency limit")


def first_metric_written(run_dir: Path) -> float:
    """The `time` of the first `log` line of a run's retrieved metrics."""
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        event = json.loads(line)
        if event.get("event") == "log":
            return float(event["time"])
    raise RuntimeError(f"{run_dir.name} wrote no metric line")


def end_jobs(b: Bench) -> None:
    """Tells the jobs to end, END_EVERY_S apart, oldest first."""
    records = sorted(b.records_of(b.flow_runs).values(), key=lambda r: r.id)
    for number, record in enumerate(records):
        (b.control / f"end-{Path(record.remote_dir).name}").touch()
        if number % 20 == 19:
            progress(f"{number + 1} jobs told to end")
        time.sleep(END_EVERY_S)


def wait_completed(b: Bench) -> tuple[list[Any], float]:
    """The flow runs once every one is final, or as they are RESUME_TIMEOUT_S
    after the call (a machine too loaded to run them all again by then);
    and when they were read (Unix time)."""
    deadline = time.monotonic() + RESUME_TIMEOUT_S
    while True:
        found = b.call(_flow_runs, b.flow_runs)
        read = time.time()
        final = [f for f in found if f.state is not None and f.state.is_final()]
        if len(final) == len(b.flow_runs) or time.monotonic() > deadline:
            return list(found), read
        time.sleep(2.0)


def kill_jobs(b: Bench) -> None:
    """Kills, by process group, the job of every run not ended."""
    from tests.procs import group_alive

    for record in b.runs().list(skipped=lambda _name, _error: None):
        if record.job is not None and group_alive(record.job.pid):
            with suppress(OSError):
                os.killpg(record.job.pid, signal.SIGKILL)


@contextmanager
def prefect_database() -> Iterator[str | None]:
    """The URL of a private PostgreSQL cluster (tests/postgres.py) for the
    Prefect server, stopped after; None (SQLite) where PostgreSQL is not
    installed. SQLite's one writer answers 503 for a minute at a time under
    this load on a 2-core machine, and a team with a hundred runs at once
    runs Prefect on PostgreSQL."""
    from tests.postgres import Postgres, postgres_bin

    bin_dir = postgres_bin()
    if bin_dir is None:
        yield None
        return
    cluster = Postgres(bin_dir)
    try:
        cluster.start()
        yield cluster.url
    finally:
        cluster.stop()


def run_phases(
    b: Bench, root: Path, venv: Path, total: int, reference: int
) -> tuple[
    list[Any], float, dict[str, tuple[float, float]], dict[uuid.UUID, dict[str, float]], float
]:
    """The target, the follower, the runs in two steps, their jobs trained
    and ended; returns the flow runs once final (see `wait_completed`) and
    when they were read, when each first step was
    logged, each flow run's steps after its pause and how long the second
    step's runs took to suspend."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from overbrainer_prefect.blocks import LocalTarget

    b.call(_lift_limits)
    # saved from this process, as start_stack saves its own: a Python process of its own to
    # import Prefect and save one block cost seconds of a core
    with temporary_settings(updates={PREFECT_API_URL: b.stack.server.api_url}):
        LocalTarget(job_venv=str(venv), work_dir=str(root / "work"), cpu_threads=1).save(b.target)
    progress("the follower")
    b.start_follower()

    progress(f"{reference} runs, then their jobs train")
    first = b.start_runs(reference)
    b.wait(
        f"{reference} runs suspended",
        lambda: b.all_suspended_and_followed(first),
        SUSPEND_TIMEOUT_S,
        "start",
    )
    b.go(first)
    time.sleep(2 * PACE_S)
    b.sample_training(reference, REFERENCE_WINDOW_S, count_processes=False)

    progress(f"{total - reference} more runs while those train")
    began = time.monotonic()
    starting = b.cpu_now()
    rest = b.start_runs(total - reference)
    b.wait(
        f"{total} runs suspended",
        lambda: b.all_suspended_and_followed(rest),
        SUSPEND_TIMEOUT_S,
        "start",
    )
    started_s = time.monotonic() - began
    b.cpu_since(f"{total - reference} runs starting and suspending", starting)
    progress(f"all {total} suspended after {started_s:.0f} s; their jobs train")
    b.go(rest)
    time.sleep(2 * PACE_S)
    training = b.cpu_now()
    b.sample_training(total, WINDOW_S, count_processes=True)
    b.cpu_since(f"all {total} jobs training", training)

    progress(f"the jobs told to end, one every {END_EVERY_S:g} s")
    ending = b.cpu_now()
    end_jobs(b)
    b.cpu_since(f"the jobs ending, {END_EVERY_S:g} s apart", ending)
    progress("waiting for every flow run to complete")
    done, read = wait_completed(b)
    logged = b.call(_first_metric_logged, b.flow_runs)
    stages = b.call(_after_pause, b.flow_runs)
    return done, read, logged, stages, started_s


def measure(root: Path, total: int, reference: int) -> None:
    """Starts the stack, the follower and the runs; prints the figures."""
    from overbrainer_prefect.runs.store import RunState
    from overbrainer_prefect.timestamps import parse_rfc3339
    from tests.prefect_server import FOLLOWER, start_stack, tiny_training
    from tests.tinymodel import tiny_dataset, tiny_model

    control = root / "control"
    control.mkdir()
    venv = standin_venv(root, control)
    training = tiny_training(
        tiny_model(REPO / ".cache"), tiny_dataset(REPO / ".cache"), max_steps=MAX_STEPS
    )
    with prefect_database() as database_url:
        database = "PostgreSQL" if database_url else "SQLite"
        progress(f"a Prefect server on {database}, train/local and follow/always, a worker")
        stack = start_stack(root / "stack", database_url, names=["train/local", FOLLOWER])
        b = Bench(stack, f"bench-standin-{uuid.uuid4().hex[:6]}", control, training)
        try:
            done, read, logged, stages, started_s = run_phases(b, root, venv, total, reference)
        finally:
            kill_jobs(b)
            stack.stop()

    records = b.records_of(b.flow_runs)
    waiting = [f for f in done if not f.state.is_final()]  # still to run again when given up
    bad = [
        f"{f.id}: {f.state.name} ({(f.state.message or '').strip()[:200]})"
        for f in done
        if f.state.is_final()
        and (not f.state.is_completed() or records[f.id].state != RunState.SUCCEEDED)
    ]
    if len(bad) > MAX_REPLACED:
        raise RuntimeError(f"{len(bad)} runs did not complete and succeed: {bad[:2]}")
    unlogged = [r.id for r in records.values() if r.id not in logged]
    if unlogged:
        raise RuntimeError(f"{len(unlogged)} runs' first step never reached their flow run's log")
    runs = b.runs()
    written = {r.id: first_metric_written(runs.run_dir(r.id)) for r in records.values()}
    first_delays = [logged[run_id][1] - at for run_id, at in written.items()]
    first_logged = [logged[run_id][0] - at for run_id, at in written.items()]
    resumes = [  # one still waiting counts what it waited so far: at least that
        (f.end_time.timestamp() if f.state.is_final() else read)
        - parse_rfc3339(records[f.id].ended or records[f.id].created).timestamp()
        for f in done
        if f.state.is_completed() or not f.state.is_final()
    ]
    seen = b.seen
    steps = [("resumed", "SCHEDULED"), ("picked up", "PENDING"), ("running", "RUNNING")]
    shown, before = (
        [],
        {
            f.id: parse_rfc3339(records[f.id].ended or records[f.id].created).timestamp()
            for f in done
        },
    )
    for label, kind in [*steps, ("completed", "COMPLETED")]:
        gaps = [stages[f][kind] - before[f] for f in before if kind in stages[f]]
        shown.append(f"{label} +{statistics.median(gaps):.1f}" if gaps else f"{label} ?")
        before = {f: stages[f].get(kind, at) for f, at in before.items()}
    note(
        f"{total} train/local flow runs on a stand-in training program (see the script), Prefect "
        f"on {database}; the "
        f"work pool runs {POOL_LIMIT} flow runs at once (the follower's included), the worker "
        f"polls every 2 s; {total - reference} runs started and suspended in {started_s:.0f} s; "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores at the end"
    )
    if waiting:
        note(
            f"{len(waiting)} flow runs not run again {RESUME_TIMEOUT_S:.0f} s after the last job "
            "ended (the machine too loaded): counted in resume-p95 with what they waited so far"
        )
    if bad:
        note(
            f"{len(bad)} flow runs did not complete (left out of resume-p95): {'; '.join(bad[:3])}"
        )
    if b.replaced:
        note(
            f"{len(b.replaced)} flow runs ended before their job started and were replaced: "
            + "; ".join(b.replaced[:3])
        )
    note(
        f"processes of the worker's tree while all {total} jobs train (jobs and server not "
        f"counted): at most {seen.peak_training} over {seen.training_samples} looks "
        f"({seen.breakdown}); while the runs started: at most {seen.peak_start}"
    )
    rss_low, rss_high = seen.follower_rss[reference], seen.follower_rss[total]
    for phase, shares in seen.cpu.items():
        note(f"CPU while {phase}: {shares}")
    note(
        f"follower RSS {rss_low / 2**20:.0f} MiB with {reference} jobs training, "
        f"{rss_high / 2**20:.0f} MiB with {total}"
    )
    note(
        f"first metric line -> the suspended flow run's log on the server: p50 "
        f"{statistics.median(first_delays):.2f} s, max {max(first_delays):.2f} s; to the "
        f"follower's logging it (the record's timestamp): p50 {statistics.median(first_logged):.2f}"
        f" s, p95 {percentile(first_logged, 0.95):.2f} s, max {max(first_logged):.2f} s "
        f"({reference} of them with {reference} jobs followed, the others "
        f"{total - reference} at once)"
    )
    here = sum(1 for f in stages.values() if "IN_FOLLOWER" in f)
    note(
        f"{here} of {len(stages)} resumed flow runs ran again in the follower, "
        "the others by the worker"
    )
    note(
        f"job verified -> flow run Completed: p50 {statistics.median(resumes):.2f} s, "
        f"max {max(resumes):.2f} s (jobs ending {END_EVERY_S:g} s apart); medians of each "
        f"step after the previous: {', '.join(shown)} s"
    )
    bench(f"follow-processes-n{total}", seen.peak_training, "processes", "<=", 3, digits=0)
    bench(f"follow-processes-starting-n{total}", seen.peak_start, "processes", digits=0)
    added = total - reference
    bench("follow-rss-per-run", (rss_high - rss_low) / added / 1e6, "MB", "<=", 2.0)
    bench("follow-first-metric-p95", percentile(first_delays, 0.95), "s", "<=", 3.0)
    bench("resume-p95", percentile(resumes, 0.95), "s", "<=", 10.0)


def main() -> None:
    """Runs the bench in a temporary directory, removed after."""
    total = int(sys.argv[1]) if len(sys.argv) > 1 else RUNS  # e.g. `20` to try it
    reference = REFERENCE_RUNS if total >= 2 * REFERENCE_RUNS else max(1, total // 4)
    root = Path(tempfile.mkdtemp(prefix="bench-suspended-"))
    try:
        measure(root, total, reference)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    run_main(__file__, main)
