"""A trainer whose job is a shell script: real jobs on a real target, with
outcomes chosen by the test (exit codes, metrics or none, output or none, a
hang), to show the run rules without the minutes a fine-tune takes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from overbrainer_prefect.runs.store import RunRecord, Runs
from overbrainer_prefect.steps import reporters
from overbrainer_prefect.steps import start as start_step
from overbrainer_prefect.steps.context import RunContext
from overbrainer_prefect.targets.base import JobNeed, NoBudget, Placed, Target
from overbrainer_prefect.trainers.base import (
    METRICS_FILE,
    Artifacts,
    JobContext,
    TargetFacts,
    Trainer,
)

WRITE_METRICS = (
    'printf \'%s\\n\' \'{"event":"begin","max_steps":3}\' >> metrics.jsonl; '
    'for s in 1 2 3; do printf \'{"event":"log","step":%s,"loss":1.%s}\\n\' $s $s '
    ">> metrics.jsonl; done"
)
WRITE_OUTPUT = "mkdir -p output && echo weights > output/adapter_model.safetensors"


@dataclass
class ShellTrainer:
    """A job that runs `script` with `sh -c` in its run directory."""

    script: str
    name: str = "shell"
    metrics_file: str = METRICS_FILE
    probe_modules: Sequence[str] = ()
    required: str | None = "output"

    def check(self, facts: TargetFacts) -> None:
        """Any target can run a shell script."""

    def prepare(self, local_run_dir: Path, ctx: JobContext) -> None:
        """Writes a small input file, uploaded with the run."""
        local_run_dir.mkdir(parents=True, exist_ok=True)
        (local_run_dir / "input.txt").write_text("input\n")

    def commands(self, ctx: JobContext) -> list[list[str]]:
        """The script."""
        return [["sh", "-c", self.script]]

    def env(self, ctx: JobContext) -> dict[str, str]:
        """Nothing."""
        return {}

    def artifacts(self) -> Artifacts:
        """`output/` and the metrics file."""
        return Artifacts(entries=("output", METRICS_FILE), required=self.required)


async def wait_for(
    check: Callable[[], bool | Awaitable[bool]], timeout: float = 30.0, what: str = "it"
) -> None:
    """Waits until `check()` holds, at most `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = check()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@asynccontextmanager
async def started_job(
    place: Target,
    runs: Runs,
    trainer: Trainer,
    need: JobNeed,
    record_trainer: str = "training",
    *,
    spec: dict[str, Any] | None = None,
    prepare: Callable[[RunRecord], None] | None = None,
) -> AsyncIterator[tuple[Placed, RunContext, RunRecord]]:
    """The job of `trainer` started on `place` as the driver starts it: `need`
    checked, a reservation, a record (`record_trainer`, with `spec`), what
    `prepare` does with it (a checkpoint staged), its place (the caller
    records its remote dir, as for a pod), then the start; yields (placed,
    ctx, record) while the place is held. Raises what those steps raise."""
    place.check(need)
    async with place.reserve(runs, need, NoBudget()) as reservation:
        record = start_step.create(
            runs,
            target=place.ref,
            target_kind=place.kind,
            workdir=place.workdir,
            trainer=record_trainer,
            spec=spec,
        )
        if prepare is not None:
            prepare(record)
        async with place.place(runs, runs.load(record.id), reservation) as placed:
            record = runs.load(record.id)
            record.remote_dir = placed.remote_dir(record)
            runs.save(record)
            ctx = placed.context(runs, reporters.LogReporter())
            record = await start_step.start(ctx, trainer, record)
            placed.started(runs, record)
            yield placed, ctx, record


ESCAPED = (
    # a child in a session of its own that ignores SIGTERM, as torchrun's workers are started
    "setsid sh -c 'trap \"\" TERM; sleep 60 & echo $! > escaped.pid; wait' & "
    "sleep 30 & echo $! > child.pid; wait"
)
"""A job whose tree leaves its process group: what a cancel must end too."""
