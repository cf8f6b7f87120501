"""What a Runpod pod bills outside its job, on the project's Runpod simulator
(tests/runpod_sim: REST v2 with a billing clock, each pod a real local process
tree running the package's bootstrap and watchdog with its own sshd), with a
real axolotl fine-tune of the tiny model (tests/tinymodel.py) as the job,
through the public flows against a private `prefect server`:

- happy path: `train` on the pod target, followed to its end;
- recovered: `train` in another process, SIGKILLed once its job logged a
  step (no hook runs: job and pod keep going), then `collect` in this one,
  which follows the job to its end, retrieves it and deletes the pod.

For each, in seconds of the billing clock:
- before the job: pod created -> job process started (its kernel start
  time), less the simulated image boot (BOOT_S);
- after the job: job exited (its exit file) -> pod deleted (the delete the
  simulator bills until); and after verified retrieval (the run's local
  manifest written) -> pod deleted.

Prints `BENCH pod-billed-before-job-<case> <s> s goal <= 5` (issue 19: what
the network needs, beyond the boot), `pod-billed-after-job-<case>` and
`pod-billed-after-retrieval-<case> <s> s goal <= 10`. The pods' timings are
the package's defaults. About three minutes on a 2-core machine.
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
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from kit.lines import bench, note, progress, run_main  # noqa: E402
from kit.process import started_unix  # noqa: E402
from kit.server import prefect_server  # noqa: E402

BOOT_S = 5.0  # the simulated image's boot: billed by Runpod, not ours to shorten
STEPS = 2  # steps of the happy path's fine-tune (the job's length is not what is measured)
LONG_STEPS = 40  # steps of the recovered one: still training when its follower is killed
TRAIN_TIMEOUT_S = 300.0
GPU = "NVIDIA RTX A4000"
TRAIN_IN_CHILD = """
import asyncio, json, sys
from overbrainer_prefect.flows import train
from overbrainer_prefect.trainers.spec import TrainingSpec
spec = TrainingSpec.model_validate(json.loads(sys.argv[2]))
asyncio.run(train(target=sys.argv[1], training=spec, runs_dir=sys.argv[3]))
"""


@dataclass
class Bill:
    """Where one pod's billed seconds went."""

    before_job: float
    after_job: float
    after_retrieval: float
    job: float
    total: float


def bill_of(sim: Any, runs_dir: Path, run_id: str) -> Bill:
    """The billed seconds of the pod of run `run_id`, from the simulator and the files."""
    from overbrainer_prefect.executors.base import EXIT_FILE
    from overbrainer_prefect.runpod.pod import PodRecord
    from overbrainer_prefect.runs.store import Runs
    from overbrainer_prefect.steps.retrieve import MANIFEST_FILE

    runs = Runs(runs_dir)
    record = runs.load(run_id)
    pod_record = PodRecord.load(runs, run_id)
    if pod_record is None or pod_record.pod_id is None:
        raise RuntimeError(f"run {run_id} has no pod")
    pod = sim.pod(pod_record.pod_id)
    if pod.deleted_at is None:
        raise RuntimeError(f"the pod of run {run_id} was not deleted: {record.message}")
    if record.job is None or record.job.started is None:
        raise RuntimeError(f"run {run_id} has no job start")
    offset = sim.now() - time.time()  # the billing clock against this machine's
    job_start = started_unix(record.job.started) + offset
    job_end = Path(record.remote_dir, EXIT_FILE).stat().st_mtime + offset
    verified = (runs.run_dir(run_id) / MANIFEST_FILE).stat().st_mtime + offset
    return Bill(
        before_job=job_start - pod.created_at - BOOT_S,
        after_job=pod.deleted_at - job_end,
        after_retrieval=pod.deleted_at - verified,
        job=job_end - job_start,
        total=pod.deleted_at - pod.created_at,
    )


def training(model: Path, dataset: Path, steps: int) -> Any:
    """The tiny model's LoRA fine-tune of `steps` steps."""
    from overbrainer_prefect.trainers.spec import TrainingSpec

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


def happy(target: str, spec: Any, runs_dir: Path) -> str:
    """A train on the pod target, followed to its end; returns the run ID."""
    from overbrainer_prefect.flows import RunResult, train

    result = asyncio.run(train(target=target, training=spec, runs_dir=str(runs_dir)))
    if not isinstance(result, RunResult) or result.state != "succeeded":
        raise RuntimeError(f"the happy train did not succeed: {result}")
    return result.run_id


def training_run(runs_dir: Path) -> Any:
    """The run whose job has logged a training step, or None."""
    from overbrainer_prefect.runs.store import Runs, RunState

    for record in Runs(runs_dir).list(skipped=lambda _name, _error: None):
        if record.state == RunState.RUNNING and record.job is not None:
            metrics = Path(record.remote_dir) / "metrics.jsonl"
            if metrics.exists() and '"log"' in metrics.read_text():
                return record
    return None


def recovered(target: str, spec: Any, runs_dir: Path, log: Path) -> str:
    """A train in a child process killed mid-job, then `collect`; returns the run ID."""
    from overbrainer_prefect.flows import collect

    with log.open("wb") as out:
        child = subprocess.Popen(
            [sys.executable, "-c", TRAIN_IN_CHILD, target, spec.model_dump_json(), str(runs_dir)],
            env={**os.environ, "PYTHONPATH": str(REPO)},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + TRAIN_TIMEOUT_S
        while training_run(runs_dir) is None:
            if child.poll() is not None or time.monotonic() > deadline:
                text = log.read_text(errors="replace").strip().splitlines()[-2:]
                raise RuntimeError(f"the child's job never trained: {' | '.join(text)}")
            time.sleep(0.2)
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)  # no hook: the job and its pod keep going
        child.wait(timeout=30)
    record = training_run(runs_dir)
    progress(f"follower killed while run {record.id} trains: collect")
    rows = asyncio.run(collect(runs_dir=str(runs_dir)))
    done = [row for row in rows if row.run_id == record.id]
    if not done or done[0].state != "succeeded" or not done[0].retrieved:
        raise RuntimeError(f"the collect did not finish run {record.id}: {rows}")
    return str(record.id)


@contextmanager
def simulated_pods(root: Path, prefix: str) -> Iterator[tuple[Any, str]]:
    """A private Prefect server, the Runpod simulator with its pods (booting in
    BOOT_S) under `root`, and a saved Runpod target block on it; yields the
    simulator and the block's name. Everything is stopped on exit."""
    with simulated_pods_and_target(root, prefix) as (sim, _pods, target):
        yield sim, target


@contextmanager
def simulated_pods_and_target(
    root: Path, prefix: str, api_url: str | None = None, **pod_options: Any
) -> Iterator[tuple[Any, Any, str]]:
    """`simulated_pods`, yielding the simulated pods too (`SimPods`, made
    with `pod_options`: a restart delay...). With `api_url`, the block is saved
    on that Prefect server (a deployed stack's) instead of a private one."""
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from pydantic import SecretStr

    from overbrainer_prefect.blocks import RunpodCredentials, RunpodTarget
    from tests.runpod_sim import running_sim
    from tests.runpod_sim.pods import SimPods

    with ExitStack() as context:
        if api_url is None:
            context.enter_context(prefect_server(root))
        else:
            context.enter_context(temporary_settings(updates={PREFECT_API_URL: api_url}))
        sim = context.enter_context(running_sim())
        pods = context.enter_context(
            SimPods(root / "pods", boot_delay_s=BOOT_S, **pod_options).attached(sim)
        )
        target = f"{prefix}-{uuid.uuid4().hex[:8]}"
        RunpodTarget(
            credentials=RunpodCredentials(
                api_key=SecretStr(sim.api_key),
                rest_url=sim.rest_url,
                graphql_url=sim.graphql_url,
            ),
            job_venv=str(REPO / ".venv-job"),
            gpu_types=[GPU],
            image="overbrainer/bench:1",
            max_hours=1.0,
            cpu_threads=1,
        ).save(target)
        yield sim, pods, target


def main() -> None:
    """Starts the simulator, its pods and a server; bills both cases; prints them."""
    from tests.tinymodel import tiny_dataset, tiny_model

    root = Path(tempfile.mkdtemp(prefix="bench-pods-"))
    model, dataset = tiny_model(REPO / ".cache"), tiny_dataset(REPO / ".cache")
    try:
        with simulated_pods(root, "bench-pod") as (sim, target):
            bills = {}
            progress("happy path: train on a pod")
            runs_dir = root / "runs-happy"
            bills["happy"] = bill_of(
                sim, runs_dir, happy(target, training(model, dataset, STEPS), runs_dir)
            )
            progress("recovered: train in a child, killed mid-job, then collect")
            runs_dir = root / "runs-recovered"
            run_id = recovered(
                target, training(model, dataset, LONG_STEPS), runs_dir, root / "child.log"
            )
            bills["recovered"] = bill_of(sim, runs_dir, run_id)
        for case, b in bills.items():
            note(
                f"{case}: billed {b.total:.1f} s = {BOOT_S:g} s simulated boot + "
                f"{b.before_job:.1f} s to the job's start + {b.job:.1f} s of job + "
                f"{b.after_job:.1f} s to the delete ({b.after_retrieval:.1f} s after the "
                "verified retrieval)"
            )
            bench(f"pod-billed-before-job-{case}", b.before_job, "s", "<=", 5.0)
            bench(f"pod-billed-after-job-{case}", b.after_job, "s")
            bench(f"pod-billed-after-retrieval-{case}", b.after_retrieval, "s", "<=", 10.0)
    finally:
        with suppress(Exception):
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    run_main(__file__, main)
