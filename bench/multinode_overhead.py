"""A training across 2 nodes of an SSH pool against the same steps on one
node, both on the CPU over real loopback sshd (tests/sshd.py): a plain torch
DDP training (gloo) under torchrun (tests/ddpjob.py), from the run's start
(placement) to its outcome with its files verified. PAIRS pairs,
alternating; the figures are medians. No goal: on the CPU of one machine,
two "nodes" share its cores and gloo's loopback says nothing of NCCL.

Prints:
    BENCH multinode-overhead <ratio> ratio           (2 nodes' time / 1 node's)
    BENCH multinode-last-node-to-first-step-s <s> s  (last node's job start to rank 0's first step)

Every sshd is stopped by its PID; every file written is removed. About a
minute on a 2-core machine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from kit.lines import bench, note, progress, run_main  # noqa: E402
from kit.sides import median, side_by_side  # noqa: E402

PAIRS = 3  # timings of each side
STEPS = 200  # training steps of each run


def measure(root: Path) -> None:
    """Starts the sshd, times both sides, prints the figures."""
    from overbrainer_prefect.blocks import SshPool, SshPoolHost
    from overbrainer_prefect.runs.store import Runs, RunState
    from overbrainer_prefect.targets.base import JobNeed
    from overbrainer_prefect.targets.pool import PoolPlacement
    from overbrainer_prefect.trainers.spec import TrainingSpec
    from tests.conftest import job_venv
    from tests.ddpjob import DdpTrainer
    from tests.shelljobs import started_job
    from tests.sshd import Sshd

    log = logging.getLogger("bench")
    runs = Runs(root / "runs")
    trainer = DdpTrainer(STEPS)
    gaps: list[float] = []

    with ExitStack() as stack:
        boxes = [stack.enter_context(Sshd.create(root / f"sshd{i}")) for i in range(2)]
        pool = SshPool(
            hosts=[
                SshPoolHost(
                    name=f"box{i}",
                    host="127.0.0.1",
                    port=box.port,
                    user=box.user,
                    private_key=box.client_key_text,
                    host_key=box.host_key_line,
                    work_dir=str(root / f"work{i}"),
                )
                for i, box in enumerate(boxes)
            ],
            job_venv=str(job_venv()),
            poll_seconds=0.2,
        )

        async def train(nodes: int) -> float:
            """Seconds from the run's start to its outcome, files verified."""
            target = pool.target("bench/pool", log)
            need = JobNeed(
                what="the bench's training",
                training=TrainingSpec(datasets=["data/train.jsonl"], nodes=nodes),
            )
            begin = time.perf_counter()
            async with started_job(target, runs, trainer, need) as (placed, ctx, record):
                outcome = await placed.follow(ctx, trainer, record)
            seconds = time.perf_counter() - begin
            if outcome.record.state != RunState.SUCCEEDED or not outcome.retrieved:
                raise RuntimeError(f"the {nodes}-node run {record.id} ended {outcome.record.state}")
            if nodes > 1:
                placement = PoolPlacement.load(runs, record.id)
                assert placement is not None
                last = max(Path(job.dir, "job.sh").stat().st_mtime for job in placement.jobs)
                first = json.loads(
                    next(
                        line
                        for line in (runs.run_dir(record.id) / "metrics.jsonl")
                        .read_text()
                        .splitlines()
                        if '"log"' in line
                    )
                )
                gaps.append(float(first["time"]) - last)
            return seconds

        def run(nodes: int) -> Any:
            return asyncio.run(train(nodes))

        progress(f"{PAIRS} pairs: {STEPS} DDP steps on 2 nodes against 1")
        sides = side_by_side(PAIRS, lambda: run(2), lambda: run(1))
        note(f"seconds from a run's start to its files verified: {sides.describe()}")
        note(f"seconds from the last node's job start to rank 0's first step: {gaps}")
        bench("multinode-overhead", median(sides.time_ratios()), "ratio")
        bench("multinode-last-node-to-first-step-s", median(gaps), "s")


def main() -> None:
    """Measures in a scratch directory, removed afterwards."""
    root = Path(tempfile.mkdtemp(prefix="bench-nodes-"))
    try:
        measure(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    run_main(__file__, main)
