"""The session's fine-tune of the tiny model, shared by the export, compare,
evaluation and Runpod pipeline tests: trained once (6 steps) by the real `train`
flow on a local target and exported to q8_0, then copied for each user, so that
what one module adds to its runs directory (exports, compares, broken copies)
is never seen by another. The conftest fixtures `tiny_run` and `tiny_compared`
hand them out.

    copy = tiny_run.copied(tmp_path_factory.mktemp("export"))
    export(run_id=copy.run_id, runs_dir=str(copy.runs_dir))
"""

from __future__ import annotations

import asyncio
import shutil
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tests.conftest import job_venv

QUESTIONS = ["What colour is the sky?", "What is two plus two?"]
"""The questions of the session's first compare."""
COMPARE_MAX_TOKENS = 6  # the tiny model never ends its answers: every one is cut at the limit


@dataclass(frozen=True)
class TinyRun:
    """A succeeded fine-tune of the tiny model with its q8_0 export: the local
    target block it ran on, its runs directory, the target's work directory and
    the `train` flow's result (a `RunResult`)."""

    target: str
    runs_dir: Path
    work: Path
    result: Any

    @property
    def run_id(self) -> str:
        """The run's ID."""
        return str(self.result.run_id)

    def copied(self, into: Path) -> TinyRun:
        """A copy of the runs directory (the run, its export and whatever else it
        holds) in `into/runs`, same IDs, same target; the result's local paths
        point into the copy. The jobs' directories on the target stay shared:
        nothing a test does changes them."""
        runs_dir = into / "runs"
        shutil.copytree(self.runs_dir, runs_dir)
        moved = self.result.model_validate_json(
            self.result.model_dump_json().replace(str(self.runs_dir), str(runs_dir))
        )
        return replace(self, runs_dir=runs_dir, result=moved)


@dataclass(frozen=True)
class TinyCompared:
    """A copy of the session's fine-tune and its first compare (a `CompareResult`):
    `QUESTIONS`, q8_0, `COMPARE_MAX_TOKENS`, with the base model's GGUF made on the way."""

    run: TinyRun
    first: Any


def train_tiny(model: Path, dataset: Path, root: Path) -> TinyRun:
    """Trains the tiny model (6 steps) on a new local target whose jobs run in
    `root/work`, exporting it to q8_0, into `root/runs`. Fails unless it succeeded."""
    from overbrainer_prefect.blocks import LocalTarget
    from overbrainer_prefect.flows import RunResult, train
    from overbrainer_prefect.runs import RunState
    from overbrainer_prefect.trainers.export import ExportSpec
    from tests.test_train_flow import spec

    name = f"local-{uuid.uuid4().hex[:8]}"
    LocalTarget(
        job_venv=str(job_venv()), work_dir=str(root / "work"), poll_seconds=0.5, cpu_threads=1
    ).save(name)
    runs_dir = root / "runs"
    result = asyncio.run(
        train(
            target=name,
            training=spec(model, dataset),
            runs_dir=str(runs_dir),
            export=ExportSpec(quant="q8_0"),
        )
    )
    assert isinstance(result, RunResult), result
    assert result.state == RunState.SUCCEEDED and result.gguf is not None, result.message
    return TinyRun(target=name, runs_dir=runs_dir, work=root / "work", result=result)


def compare_tiny(run: TinyRun) -> TinyCompared:
    """The first compare of `run` (which it changes: a copy is expected):
    `QUESTIONS` asked of the base and tuned q8_0 GGUFs. Fails unless it returned."""
    from overbrainer_prefect.flows import CompareResult, compare

    first = asyncio.run(
        compare(
            run_id=run.run_id,
            questions=QUESTIONS,
            quant="q8_0",
            max_tokens=COMPARE_MAX_TOKENS,
            runs_dir=str(run.runs_dir),
        )
    )
    assert isinstance(first, CompareResult), first
    return TinyCompared(run=run, first=first)
