"""What a whole fine-tune bills on a Runpod target, on the project's Runpod
simulator (tests/runpod_sim: REST v2 with a billing clock, each pod a real
local process tree running the package's bootstrap and watchdog with its own
sshd), through the public `fine_tune` flow against a private `prefect server`:
the tiny model's axolotl fine-tune (tests/tinymodel.py), its q8_0 export, the
base model's export and the compare of two questions, without evaluation.

Measured from the simulator's ledger and the jobs' files:
- how many pods the fine-tune made (one: every job runs on the pod that trained);
- the pods' billed seconds outside the jobs: every pod's billed time (created
  to deleted, on the billing clock) less the time its jobs ran (each job's
  process start to its exit file), the simulated image boot (BOOT_S) included.

Prints `BENCH fine-tune-pods <n> pods goal <= 1` and
`BENCH fine-tune-pod-seconds-outside-jobs <s> s goal <= <one boot + 20>`.
About three minutes on a 2-core machine.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
import tempfile
import time
from contextlib import suppress
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from kit.lines import bench, note, progress, run_main  # noqa: E402
from kit.process import started_unix  # noqa: E402
from pod_billing import BOOT_S, simulated_pods  # noqa: E402
from pod_billing import training as training_of  # noqa: E402

OUTSIDE_GOAL_S = BOOT_S + 20.0  # one boot, plus what the pod's jobs need between them
STEPS = 2  # steps of the fine-tune (the jobs' length is not what is measured)
QUESTIONS = ["What colour is the sky?", "Name a fruit."]


def jobs_of(runs_dir: Path, run_id: str) -> list[Any]:
    """The records of every job of the fine-tune of `run_id`: the run, its
    exports, the base model's exports, its compares."""
    from overbrainer_prefect.runs.store import BASES_DIR, Runs

    runs = Runs(runs_dir)
    stores = [runs.children(run_id, "export"), runs.children(run_id, "compare")]
    stores += [
        Runs(path, record_file="export.json", kind="export")
        for path in sorted((runs_dir / BASES_DIR).glob("*/exports"))
    ]
    return [runs.load(run_id)] + [record for store in stores for record in store.list()]


def job_span(record: Any) -> tuple[float, float]:
    """When the job of `record` ran (this machine's clock): its process start
    and its exit file."""
    from overbrainer_prefect.executors.base import EXIT_FILE

    if record.job is None or record.job.started is None:
        raise RuntimeError(f"{record.id} has no job start")
    end = Path(record.remote_dir, EXIT_FILE).stat().st_mtime
    return started_unix(record.job.started), end


def fine_tune_once(target: str, model: Path, dataset: Path, runs_dir: Path) -> str:
    """The fine-tune on the pod target; returns its run ID."""
    from overbrainer_prefect.finetune import CompareSettings
    from overbrainer_prefect.flows import FineTuneResult, FineTuneSpec, fine_tune
    from overbrainer_prefect.trainers.export import ExportSpec

    training = training_of(model, dataset, STEPS)
    spec = FineTuneSpec(
        target=target,
        training=training,
        export=ExportSpec(quant="q8_0"),
        compare=CompareSettings(questions=QUESTIONS, max_tokens=4),
        runs_dir=str(runs_dir),
    )
    result = asyncio.run(fine_tune(spec))
    if not isinstance(result, FineTuneResult):
        raise RuntimeError(f"the fine-tune did not finish: {result}")
    return result.run_id


def report(sim: Any, runs_dir: Path, run_id: str, case: str = "") -> None:
    """Prints what the fine-tune of `run_id` billed outside its jobs: its pods,
    each job's span, the gaps (boot to the first job, between each two, the last
    to the delete) and the BENCH lines, suffixed `-<case>` when one is given.
    Raises RuntimeError when a pod was left."""
    pods = sim.pods(include_deleted=True)
    left = [pod.id for pod in pods if pod.deleted_at is None]
    if left:
        raise RuntimeError(f"pods left after the fine-tune: {', '.join(left)}")
    billed = sum(pod.deleted_at - pod.created_at for pod in pods)
    offset = sim.now() - time.time()  # the billing clock against this machine's
    spans = sorted(
        (start + offset, end + offset, record.trainer)
        for record in jobs_of(runs_dir, run_id)
        for start, end in [job_span(record)]
    )
    ran = sum(end - start for start, end, _ in spans)
    marks = [pods[0].created_at + BOOT_S] if len(pods) == 1 else []
    gaps = [spans[0][0] - marks[0]] if marks else []
    gaps += [spans[i + 1][0] - spans[i][1] for i in range(len(spans) - 1)]
    gaps += [pods[0].deleted_at - spans[-1][1]] if marks else []
    note(
        f"fine-tune of run {run_id}: {len(pods)} pod(s) billed {billed:.1f} s for "
        f"{len(spans)} jobs that ran {ran:.1f} s ("
        + ", ".join(f"{kind} {end - start:.1f}" for start, end, kind in spans)
        + f" s); a simulated boot is {BOOT_S:g} s"
    )
    if gaps:
        note(
            "outside the jobs: boot to the first job, between each two, last job to the "
            "delete: " + ", ".join(f"{gap:.1f}" for gap in gaps) + " s"
        )
    suffix = f"-{case}" if case else ""
    bench(f"fine-tune-pods{suffix}", len(pods), "pods", "<=", 1, digits=0)
    bench(f"fine-tune-pod-seconds-outside-jobs{suffix}", billed - ran, "s", "<=", OUTSIDE_GOAL_S)


def main() -> None:
    """Starts the simulator, its pods and a server; runs one fine-tune; prints its bill."""
    from tests.tinymodel import tiny_dataset, tiny_model

    root = Path(tempfile.mkdtemp(prefix="bench-fine-tune-pods-"))
    model, dataset = tiny_model(REPO / ".cache"), tiny_dataset(REPO / ".cache")
    try:
        with simulated_pods(root, "bench-fine-tune") as (sim, target):
            progress("a fine-tune (train, export, base export, compare) on a pod target")
            runs_dir = root / "runs"
            run_id = fine_tune_once(target, model, dataset, runs_dir)
            report(sim, runs_dir, run_id)
    finally:
        with suppress(Exception):
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    run_main(__file__, main)
