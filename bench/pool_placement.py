"""A run's start to its job starting on a free machine of a 3-machine SSH pool,
against the same on a single SSH target, side by side over real loopback sshd
(tests/sshd.py): the probe of the job environment (the pre-flight's), the
record, the placement (the pool's claim on each machine it looks at, on the
machine) and the job's start. Two of the pool's machines hold a running job
of their own, so each run looks at two held machines before the free one.
PAIRS pairs, alternating; the figure is the median of the pairs' ratios.

Prints:
    BENCH pool-placement-s <ratio> ratio goal <= 1.2   (pool's time / single target's)

Every sshd is stopped by its PID; every file written is removed. About half
a minute on a 2-core machine.
"""

from __future__ import annotations

import asyncio
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

PAIRS = 7  # timings of each side
MACHINES = 3  # in the pool
HELD = 2  # of them, each running a job of its own all along
JOB_BOUND_S = 300  # the held jobs end by themselves after this, whatever happens here


def measure(root: Path) -> None:
    """Starts the sshd, times both sides, prints the figure."""
    from overbrainer_prefect.blocks import SshPool, SshPoolHost, SshTarget
    from overbrainer_prefect.runs.store import Runs
    from overbrainer_prefect.targets.base import JobNeed, Target
    from tests.conftest import job_venv
    from tests.shelljobs import WRITE_METRICS, WRITE_OUTPUT, ShellTrainer, started_job
    from tests.sshd import Sshd

    log = logging.getLogger("bench")
    runs = Runs(root / "runs")
    release = root / "release"
    held = ShellTrainer(
        f"{WRITE_METRICS}; i=0; while [ ! -e {release} ] && [ $i -lt {JOB_BOUND_S * 10} ]; "
        f"do sleep 0.1; i=$((i+1)); done; {WRITE_OUTPUT}"
    )
    quick = ShellTrainer(f"{WRITE_METRICS}; {WRITE_OUTPUT}")

    async def started(target: Target, trainer: ShellTrainer, follow: bool) -> float:
        """Seconds from the run's start to its job started; then, with
        `follow`, the job followed to its end (its machine given back)."""
        begin = time.perf_counter()
        await target.facts(trainer.probe_modules)
        need = JobNeed(what="the bench's job")
        async with started_job(target, runs, trainer, need) as (placed, ctx, record):
            seconds = time.perf_counter() - begin
            if follow:
                await placed.follow(ctx, trainer, record)
            return seconds

    with ExitStack() as stack:
        boxes = [stack.enter_context(Sshd.create(root / f"sshd{i}")) for i in range(MACHINES)]

        def machine(i: int, box: Sshd) -> SshPoolHost:
            return SshPoolHost(
                name=f"box{i}",
                host="127.0.0.1",
                port=box.port,
                user=box.user,
                private_key=box.client_key_text,
                host_key=box.host_key_line,
                work_dir=str(root / f"work{i}"),
            )

        common: dict[str, Any] = {"job_venv": str(job_venv()), "poll_seconds": 0.2}
        pool = SshPool(hosts=[machine(i, b) for i, b in enumerate(boxes)], **common)
        single = SshTarget(
            host="127.0.0.1",
            port=boxes[-1].port,
            user=boxes[-1].user,
            private_key=boxes[-1].client_key_text,
            host_key=boxes[-1].host_key_line,
            work_dir=str(root / "single"),
            **common,
        )

        async def hold() -> list[asyncio.Task[float]]:
            """A job running on each of the first HELD machines of the pool."""
            holders = []
            for i in range(HELD):
                only = SshPool(hosts=[machine(i, boxes[i])], **common)
                task = asyncio.create_task(started(only.target("bench/hold", log), held, True))
                holders.append(task)
            return holders

        def run_pool() -> float:
            return asyncio.run(started(pool.target("bench/pool", log), quick, True))

        def run_single() -> float:
            return asyncio.run(started(single.target("bench/ssh", log), quick, True))

        async def go() -> Any:
            holders = await hold()
            while not all((root / f"work{i}").glob("*/job.sh") for i in range(HELD)):
                await asyncio.sleep(0.1)
            try:
                sides = await asyncio.to_thread(
                    side_by_side, PAIRS, lambda: run_pool(), lambda: run_single()
                )
            finally:
                release.touch()
                await asyncio.gather(*holders, return_exceptions=True)
            return sides

        progress(f"{PAIRS} pairs: a {MACHINES}-machine pool ({HELD} held) against one SSH target")
        sides = asyncio.run(go())
        note(f"seconds from a run's start to its job started: {sides.describe()}")
        bench("pool-placement-s", median(sides.time_ratios()), "ratio", "<=", 1.2)


def main() -> None:
    """Measures in a scratch directory, removed afterwards."""
    root = Path(tempfile.mkdtemp(prefix="bench-pool-"))
    try:
        measure(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    run_main(__file__, main)
