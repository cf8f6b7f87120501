"""A trainer whose job is a shell script: real jobs on a real target, with
outcomes chosen by the test (exit codes, metrics or none, output or none, a
hang), to show the run rules without the minutes a fine-tune takes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from overbrainer_prefect.trainers.base import (
    METRICS_FILE,
    Artifacts,
    JobContext,
    TargetFacts,
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
