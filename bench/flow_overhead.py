"""What the `train` flow adds to an axolotl job: a real LoRA fine-tune of the
tiny test model through the flow (local target with its default poll_seconds,
a real `prefect server` warmed by one small run), against the very job the flow
prepared, copied to a fresh directory and run bare with the trainer's command
and environment. Flow and bare runs alternate (flow, bare, flow, bare) and the
best of each is kept, so the noise of a shared machine hurts less.

Prints `BENCH train-flow-overhead <seconds> s goal <= 3`,
`BENCH train-flow-vs-bare <ratio> ratio`, a `#` line with both times, and `#`
lines saying where the best flow run spent its time beyond the job's own (its
steps are timed by pass-through wrappers, see `instrumented`). About three
minutes on a 2-core machine. Everything it starts (the server, the jobs) is
stopped by PID, and its files removed.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PREFECT = REPO / ".venv" / "bin" / "prefect"
JOB_VENV = REPO / ".venv-job"
MAX_STEPS = 10  # steps of a timed fine-tune: 20-30 s of job here, mostly imports and loading
WARM_STEPS = 2  # steps of the untimed run that warms the server, the flow and the caches
ROUNDS = 2  # flow, bare, flow, bare
SERVER_START_TIMEOUT_S = 180.0  # a fresh server migrates its SQLite database first
SERVER_STOP_TIMEOUT_S = 20.0  # between SIGTERM and SIGKILL of the server's process group
JOB_TIMEOUT_S = 900.0  # a bare job longer than this is killed and the bench fails
MAX_HOURS = 0.5  # the flow's own bound on a job (the target block's max_hours)


@dataclass
class Span:
    """One timed call made while a flow ran (seconds since the epoch)."""

    name: str
    start: float
    end: float
    note: str = ""


@dataclass
class FlowRun:
    """A timed flow run: its wall time, the calls it made, and its job's files."""

    wall: float
    start: float
    end: float
    spans: list[Span] = field(default_factory=list)
    local_dir: Path = Path()
    remote_dir: Path = Path()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def start_server(home: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    """`prefect server start` on 127.0.0.1:`port`, in its own session, with its own
    PREFECT_HOME (a fresh SQLite database) and no analytics."""
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_UI_ENABLED": "false",
        "PREFECT_SERVER_LOGGING_LEVEL": "WARNING",
    }
    env.pop("PREFECT_API_URL", None)
    with log.open("wb") as out:
        return subprocess.Popen(
            [str(PREFECT), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def wait_healthy(api_url: str, server: subprocess.Popen[bytes], log: Path) -> None:
    """Waits (at most SERVER_START_TIMEOUT_S) until the server answers `/api/health`.
    Raises RuntimeError with the end of its log when it exits or never answers."""
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"prefect server exited ({server.returncode}): {tail(log)}")
        try:
            with urllib.request.urlopen(f"{api_url}/health", timeout=2) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"prefect server not healthy after {SERVER_START_TIMEOUT_S:.0f} s")


def stop_group(process: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM to the process group of `process` (started in its own session),
    SIGKILL after `grace_s`, then reaps it."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        with suppress(subprocess.TimeoutExpired):
            process.wait(timeout=grace_s)
    with suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # what the leader left behind, too
    process.wait(timeout=30)


def tail(path: Path, lines: int = 5) -> str:
    """The last `lines` lines of a log, on one line."""
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return " | ".join(text[-lines:])


@contextmanager
def instrumented(spans: list[Span]) -> Iterator[None]:
    """Wraps the steps a flow run takes (executor calls, the trainer's prepare, the
    retrieval, the block load, the artifacts) so that each call is appended to
    `spans` with its times; everything is put back on exit. The wrappers only
    time: arguments and results pass through unchanged."""
    from overbrainer_prefect.artifacts import PrefectReporter
    from overbrainer_prefect.executors.local import LocalExecutor
    from overbrainer_prefect.runs import lifecycle
    from overbrainer_prefect.trainers.axolotl import AxolotlTrainer

    train_module = sys.modules["overbrainer_prefect.flows.train"]
    targets: list[tuple[Any, str, str]] = [
        (train_module, "load_target", "load target block"),
        (LocalExecutor, "run", "probe (run)"),
        (AxolotlTrainer, "prepare", "prepare"),
        (LocalExecutor, "upload", "upload"),
        (LocalExecutor, "spawn", "spawn"),
        (LocalExecutor, "status", "status"),
        (LocalExecutor, "read_from", "read metrics"),
        (PrefectReporter, "open", "progress artifact"),
        (PrefectReporter, "flush", "progress update"),
        (lifecycle, "retrieve", "retrieve"),
        (LocalExecutor, "manifest", "manifest"),
        (LocalExecutor, "download", "download"),
        (train_module, "publish_metrics_table", "metrics table"),
        (train_module, "publish_summary", "summary"),
    ]
    saved: list[tuple[Any, str, Any]] = []
    for owner, attr, label in targets:
        original = getattr(owner, attr, None)
        if original is None:  # the library changed: time what is still there
            continue
        saved.append((owner, attr, original))
        setattr(owner, attr, _timing(original, label, spans))
    try:
        yield
    finally:
        for owner, attr, original in reversed(saved):
            setattr(owner, attr, original)


def _timing(original: Callable[..., Any], label: str, spans: list[Span]) -> Callable[..., Any]:
    if inspect.iscoroutinefunction(original):

        @functools.wraps(original)
        async def timed_async(*args: Any, **kwargs: Any) -> Any:
            start = time.time()
            note = ""
            try:
                result = await original(*args, **kwargs)
                note = str(getattr(result, "kind", ""))
                return result
            finally:
                spans.append(Span(label, start, time.time(), note))

        return timed_async

    @functools.wraps(original)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.time()
        try:
            return original(*args, **kwargs)
        finally:
            spans.append(Span(label, start, time.time()))

    return timed


def run_flow(target: str, training: Any, runs_dir: Path) -> FlowRun:
    """One `train` flow run, timed from the call to its return, with its spans.
    Raises RuntimeError when the run did not succeed."""
    from overbrainer_prefect.flows import RunResult, train
    from overbrainer_prefect.runs import Runs, RunState

    spans: list[Span] = []
    with instrumented(spans):
        start = time.time()
        begun = time.perf_counter()
        result = asyncio.run(train(target=target, training=training, runs_dir=str(runs_dir)))
        wall = time.perf_counter() - begun
        end = time.time()
    if not isinstance(result, RunResult) or result.state != RunState.SUCCEEDED:
        raise RuntimeError(f"the flow run did not succeed: {result}")
    record = Runs(runs_dir).load(result.run_id)
    return FlowRun(
        wall=wall,
        start=start,
        end=end,
        spans=spans,
        local_dir=Runs(runs_dir).run_dir(result.run_id),
        remote_dir=Path(record.remote_dir),
    )


def run_bare(flow_run: FlowRun, training: Any, bare_dir: Path, cache_dir: str) -> float:
    """The job `flow_run` ran, copied from its local run directory (config, data,
    plugin) to `bare_dir` and run there with the trainer's command and
    environment; its wall time from start to exit. Raises RuntimeError when the
    job fails or runs past JOB_TIMEOUT_S (its process group is then killed)."""
    from overbrainer_prefect.executors.local import SAFE_ENV
    from overbrainer_prefect.trainers.axolotl import (
        CONFIG_FILE,
        DATA_DIR,
        PLUGINS_DIR,
        AxolotlTrainer,
    )
    from overbrainer_prefect.trainers.base import JobContext, TargetFacts

    bare_dir.mkdir(parents=True)
    shutil.copyfile(flow_run.local_dir / CONFIG_FILE, bare_dir / CONFIG_FILE)
    for name in (DATA_DIR, PLUGINS_DIR):
        shutil.copytree(flow_run.local_dir / name, bare_dir / name)
    python = str(JOB_VENV / "bin" / "python")
    ctx = JobContext(
        run_id=bare_dir.name,
        run_dir=str(bare_dir),
        cache_dir=cache_dir,
        facts=TargetFacts(python=python, gpus=0, modules={}),
    )
    trainer = AxolotlTrainer(training, cpu_threads=1)
    env = {k: v for k, v in os.environ.items() if k in SAFE_ENV or k.startswith("LC_")}
    env |= trainer.env(ctx)
    log = bare_dir / "job.log"
    begun = time.perf_counter()
    for command in trainer.commands(ctx):
        with log.open("ab") as out:
            job = subprocess.Popen(
                command,
                cwd=bare_dir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            code = job.wait(timeout=JOB_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            stop_group(job, 0)
            raise RuntimeError(f"the bare job ran past {JOB_TIMEOUT_S:.0f} s") from None
        if code != 0:
            raise RuntimeError(f"the bare job exited {code}: {tail(log)}")
    wall = time.perf_counter() - begun
    if '"end"' not in (bare_dir / "metrics.jsonl").read_text():
        raise RuntimeError("the bare job wrote no end event: its metrics plugin did not run")
    return wall


def breakdown(run: FlowRun) -> list[tuple[str, float]]:
    """Where a flow run's wall time went, in order: the steps before its job, the
    job itself, the follow latency (job exit to the status call that saw it),
    and the steps after. Steps missing from the spans are left out."""
    from overbrainer_prefect.executors.base import EXIT_FILE

    first: dict[str, Span] = {}
    for span in sorted(run.spans, key=lambda s: s.start):
        first.setdefault(span.name, span)
    exited = (run.remote_dir / EXIT_FILE).stat().st_mtime
    seen = min(
        (s.end for s in run.spans if s.name == "status" and s.note not in ("", "running")),
        default=None,
    )
    marks: list[tuple[str, float | None]] = [
        ("flow engine start, flow run created", _at(first, "load target block", "start")),
        ("load target block (API)", _at(first, "load target block", "end")),
        ("create-run task, start-job task start", _at(first, "probe (run)", "start")),
        ("probe of the job venv (imports torch)", _at(first, "probe (run)", "end")),
        ("gap", _at(first, "prepare", "start")),
        ("prepare run dir", _at(first, "prepare", "end")),
        ("gap", _at(first, "upload", "start")),
        ("upload (copy to work dir)", _at(first, "upload", "end")),
        ("gap", _at(first, "spawn", "start")),
        ("spawn", _at(first, "spawn", "end")),
        ("JOB (spawn to job.exit written)", exited),
        ("follow latency (job.exit to status seen)", seen),
        ("final metrics drain", _at(first, "retrieve", "start")),
        ("retrieve (manifest, download, verify)", _at(first, "retrieve", "end")),
        ("follow-job task end, last progress update", _at(first, "metrics table", "start")),
        ("metrics table artifact", _at(first, "metrics table", "end")),
        ("gap", _at(first, "summary", "start")),
        ("summary artifact", _at(first, "summary", "end")),
        ("flow engine end (result persisted, state)", run.end),
    ]
    out: list[tuple[str, float]] = []
    last = run.start
    for name, moment in marks:
        if moment is None:
            continue
        out.append((name, moment - last))
        last = moment
    return out


def _at(first: dict[str, Span], name: str, edge: str) -> float | None:
    span = first.get(name)
    if span is None:
        return None
    return span.start if edge == "start" else span.end


def job_seconds(run: FlowRun) -> float:
    """How long the job of a flow run ran: from its spawn to its exit file."""
    from overbrainer_prefect.executors.base import EXIT_FILE

    spawned = min(s.end for s in run.spans if s.name == "spawn")
    return (run.remote_dir / EXIT_FILE).stat().st_mtime - spawned


def job_events(run: FlowRun) -> dict[str, float]:
    """The time of the first event of each kind in the job's metrics file."""
    from overbrainer_prefect.trainers.base import METRICS_FILE

    times: dict[str, float] = {}
    for line in (run.remote_dir / METRICS_FILE).read_text().splitlines():
        event = json.loads(line)
        times.setdefault(str(event.get("event")), float(event.get("time", 0.0)))
    return times


def report(flows: list[FlowRun], bares: list[float], poll_s: float) -> None:
    """Prints the figures and the breakdown of the best flow run."""
    best = min(flows, key=lambda f: f.wall)
    flow_s, bare_s = best.wall, min(bares)
    rounds = ", ".join(
        f"{f.wall:.1f} (job {job_seconds(f):.1f}) / {b:.1f}"
        for f, b in zip(flows, bares, strict=True)
    )
    print(
        f"# train flow {flow_s:.2f} s, bare job {bare_s:.2f} s (best of {ROUNDS}; "
        f"{MAX_STEPS} steps, poll_seconds {poll_s:g}); flow / bare by round: {rounds}"
    )
    print(f"BENCH train-flow-overhead {flow_s - bare_s:.2f} s goal <= 3")
    print(f"BENCH train-flow-vs-bare {flow_s / bare_s:.3f} ratio")
    print(f"# where the best flow run's {best.wall:.2f} s went (s):")
    parts = breakdown(best)
    for name, seconds in parts:
        if name != "gap" or seconds >= 0.05:
            print(f"#   {seconds:7.3f}  {name}")
    job = job_seconds(best)
    print(f"BENCH train-flow-time-outside-job {best.wall - job:.2f} s goal <= 3")
    print(
        f"#   {best.wall - job:7.3f}  outside the job; the job itself {job - bare_s:+.3f} "
        "against the best bare job"
    )
    events = job_events(best)
    if "begin" in events and "end" in events:
        spawned = min(s.end for s in best.spans if s.name == "spawn")
        print(
            f"#   inside the job: {events['begin'] - spawned:.2f} s to its first metric event "
            f"(imports, model, data), {events['end'] - events['begin']:.2f} s training, "
            f"{spawned + job - events['end']:.2f} s from its end event to its exit"
        )
    polls = [s for s in best.spans if s.name == "status"]
    reads = [s for s in best.spans if s.name == "read metrics"]
    updates = [s for s in best.spans if s.name == "progress update"]
    print(
        f"#   while it ran: {len(polls)} status polls ({sum(s.end - s.start for s in polls):.3f} s)"
        f", {len(reads)} metric reads ({sum(s.end - s.start for s in reads):.3f} s)"
        f", {len(updates)} progress flushes ({sum(s.end - s.start for s in updates):.3f} s)"
    )


def cancel_leftovers(runs_dir: Path) -> None:
    """Cancels (by PID, whole process group) the job of any run a failed flow left running."""
    from overbrainer_prefect.executors.local import LocalExecutor
    from overbrainer_prefect.runs import Runs

    if not runs_dir.exists():
        return
    for record in Runs(runs_dir).list():
        if record.job is not None and not record.state.ended:
            executor = LocalExecutor(Path(record.remote_dir).parent)
            asyncio.run(executor.cancel(record.job))


def main() -> None:
    """Starts the server, warms it, times flow and bare runs in turn, prints the
    figures, then stops the server and removes every file it made."""
    root = Path(tempfile.mkdtemp(prefix="bench-flow-"))
    server: subprocess.Popen[bytes] | None = None
    runs_dir = root / "runs"
    try:
        home, work = root / "prefect-home", root / "work"
        home.mkdir()
        port = free_port()
        api_url = f"http://127.0.0.1:{port}/api"
        server_log = root / "server.log"
        server = start_server(home, port, server_log)
        # before Prefect is imported: this server, a private home, flow logs only to the API
        os.environ |= {
            "PREFECT_HOME": str(home),
            "PREFECT_API_URL": api_url,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL": "WARNING",
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
        }
        sys.path.insert(0, str(REPO))
        from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

        from overbrainer_prefect.blocks import LocalTarget
        from overbrainer_prefect.runs.lifecycle import HF_CACHE_DIR
        from overbrainer_prefect.trainers.spec import TrainingSpec
        from tests.tinymodel import tiny_dataset, tiny_model

        model, dataset = tiny_model(REPO / ".cache"), tiny_dataset(REPO / ".cache")
        wait_healthy(api_url, server, server_log)

        def spec(steps: int) -> TrainingSpec:
            return TrainingSpec.model_validate(
                {
                    "base_model": str(model),
                    "datasets": [str(dataset)],
                    "sequence_len": 64,
                    "micro_batch_size": 4,
                    "max_steps": steps,
                    "learning_rate": 5e-3,
                    "lora_r": 8,
                    "lora_alpha": 16,
                    "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
                    "warmup_steps": 0,
                    "seed": 0,
                }
            )

        with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
            block = LocalTarget(
                job_venv=str(JOB_VENV), work_dir=str(work), cpu_threads=1, max_hours=MAX_HOURS
            )
            name = f"bench-{uuid.uuid4().hex[:8]}"
            block.save(name)
            run_flow(name, spec(WARM_STEPS), runs_dir)  # warm: server, flow, block, caches
            training = spec(MAX_STEPS)
            flows: list[FlowRun] = []
            bares: list[float] = []
            for number in range(ROUNDS):
                flows.append(run_flow(name, training, runs_dir))
                cache_dir = f"{work}/{HF_CACHE_DIR}"  # the HF_HOME of the flow's jobs
                bares.append(run_bare(flows[-1], training, root / f"bare-{number}", cache_dir))
        report(flows, bares, block.poll_seconds)
    finally:
        try:
            cancel_leftovers(runs_dir)
        finally:
            if server is not None:
                stop_group(server, SERVER_STOP_TIMEOUT_S)
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
