"""What a pod lost under a training costs (issue 29), on the project's Runpod
simulator (tests/runpod_sim: each pod a real local process tree running the
package's bootstrap and watchdog with its own sshd, booting in BOOT_S) through
the public `train` flow against a private `prefect server`: the tiny model's
fine-tune of STEPS steps saving a checkpoint every SAVE_STEPS; once a
checkpoint is kept in the runs store, the pod's container is restarted by its
host (as Runpod's hosts do), which loses the job; the run goes on from that
checkpoint in a new run on a new pod.

Measured from the records and the jobs' own metric lines (their `time`):
- the steps lost: the last step the lost job logged, less the step of the
  checkpoint the next run went on from (goal: at most SAVE_STEPS);
- the resume: from the loss recorded (the lost run's end) to the first step
  the new pod's job logged (goal: one boot, BOOT_S, plus 30 s).

Prints `BENCH lost-pod-steps-lost <n> steps goal <= SAVE_STEPS` and
`BENCH lost-pod-resume-s <s> s goal <= BOOT_S + 30`. About three minutes on a
2-core machine.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import tempfile
import threading
import time
from contextlib import suppress
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from kit.lines import bench, note, progress, run_main  # noqa: E402
from pod_billing import BOOT_S, simulated_pods_and_target  # noqa: E402
from pod_billing import training as training_of  # noqa: E402

STEPS = 40  # steps of the fine-tune: still training when its pod is lost
SAVE_STEPS = 5  # a checkpoint every this many steps
RESUME_GOAL_S = BOOT_S + 30.0
WATCH_BOUND_S = 300.0  # for a checkpoint to be kept, then the container restarted


def restart_once_kept(sim: Any, pods: Any, runs_dir: Path, lost: list[str]) -> threading.Thread:
    """Restarts the container of the first run's pod once a checkpoint of it
    is kept in the runs store; notes the run."""
    from overbrainer_prefect.runpod.pod import PodRecord
    from overbrainer_prefect.runs.checkpoints import last_kept
    from overbrainer_prefect.runs.store import Runs

    def watch() -> None:
        deadline = time.monotonic() + WATCH_BOUND_S
        while time.monotonic() < deadline:
            runs = Runs(runs_dir)
            for record in runs.list(skipped=lambda _name, _error: None):
                pod = PodRecord.load(runs, record.id)
                if last_kept(runs, record.id) is not None and pod and pod.pod_id:
                    pods.restart(sim.pod(pod.pod_id))
                    lost.append(record.id)
                    return
            time.sleep(0.2)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def logged(path: Path) -> list[dict[str, Any]]:
    """The metric lines of a job (`metrics.jsonl`) that log a step."""
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [e for e in lines if e.get("event") == "log"]


def main() -> None:
    """Trains on a simulated pod, loses its container once a checkpoint is
    kept, and measures what the loss cost."""
    from overbrainer_prefect.flows import RunResult, train
    from overbrainer_prefect.runpod.pod import PodRecord
    from overbrainer_prefect.runs.store import Runs
    from overbrainer_prefect.timestamps import parse_rfc3339
    from tests.tinymodel import tiny_dataset, tiny_model

    root = Path(tempfile.mkdtemp(prefix="bench-lost-pod-"))
    model, dataset = tiny_model(REPO / ".cache"), tiny_dataset(REPO / ".cache")
    training = training_of(model, dataset, STEPS).model_copy(update={"save_steps": SAVE_STEPS})
    try:
        with simulated_pods_and_target(root, "bench-lost", restart_delay_s=(0.2, 0.4)) as (
            sim,
            pods,
            target,
        ):
            progress(f"a {STEPS}-step fine-tune whose pod's container restarts once a checkpoint")
            runs_dir = root / "runs"
            lost: list[str] = []
            watcher = restart_once_kept(sim, pods, runs_dir, lost)
            result = asyncio.run(train(target=target, training=training, runs_dir=str(runs_dir)))
            watcher.join(timeout=5)
            if not lost or not isinstance(result, RunResult) or result.state != "succeeded":
                raise RuntimeError(f"the run did not go on to its end: {lost} {result}")
            runs = Runs(runs_dir)
            first, went_on = runs.load(lost[0]), runs.load(result.run_id)
            pod = PodRecord.load(runs, first.id)
            if went_on.resumed_from is None or pod is None or pod.lost_step is None:
                raise RuntimeError(f"run {went_on.id} did not go on from run {first.id}")
            if first.ended is None:
                raise RuntimeError(f"run {first.id} has no end recorded")
            steps_lost = pod.lost_step - went_on.resumed_from.step
            again = logged(runs.run_dir(went_on.id) / "metrics.jsonl")[0]
            resume_s = float(again["time"]) - parse_rfc3339(first.ended).timestamp()
        note(
            f"run {first.id} lost its pod's container at step {pod.lost_step}; run {went_on.id} "
            f"went on from {went_on.resumed_from.checkpoint} (step {went_on.resumed_from.step}) "
            f"on a new pod, its first step logged {resume_s:.1f} s after the loss was recorded "
            f"(a simulated boot is {BOOT_S:g} s; {len(sim.pods(include_deleted=True))} pods)"
        )
        bench("lost-pod-steps-lost", steps_lost, "steps", "<=", SAVE_STEPS, digits=0)
        bench("lost-pod-resume-s", resume_s, "s", "<=", RESUME_GOAL_S)
    finally:
        with suppress(Exception):
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    run_main(__file__, main)
