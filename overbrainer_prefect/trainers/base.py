"""The trainer protocol: what a job needs, how it runs and what it leaves.

A trainer prepares the files of a run in its local directory (they are
uploaded as they are), names the commands and environment of its job, the
metrics file the job appends one JSON line per event to, and the artifacts a
run must bring back. The run flows drive any trainer the same way: a training
run (axolotl), an export, a compare.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

METRICS_FILE = "metrics.jsonl"
"""One JSON object a line, appended by the job: begin, log, end events."""

STOP_FILE = "stop.request"
"""Created in the run directory to ask the job for a resumable checkpoint and a stop."""


class TrainError(Exception):
    """A run's files cannot be prepared, or its target cannot run it. The message
    is one line saying what is wrong and what to do."""


@dataclass(frozen=True)
class Artifacts:
    """What a run brings back: `entries` (paths relative to the run directory),
    less what `exclude` matches (glob patterns tried on each path component and
    on the whole relative path). A succeeded run must hold at least one file
    under `required`, when set."""

    entries: Sequence[str]
    exclude: Sequence[str] = ()
    required: str | None = None


@dataclass(frozen=True)
class TargetFacts:
    """What a probe of the job environment on the target found."""

    python: str
    """The job venv's Python on the target."""
    gpus: int
    """CUDA devices torch sees there: 0 means a CPU-only target."""
    modules: Mapping[str, str | None] = field(default_factory=dict)
    """Version of each module the trainer asked about, None when it does not import."""
    compute_capability: tuple[int, int] | None = None
    """The lowest CUDA compute capability of those GPUs (9.0 for an H100), None
    when there is no GPU or it is not known."""


@dataclass(frozen=True)
class JobContext:
    """Where the job of a run runs: what a trainer needs to know of the target."""

    run_id: str
    run_dir: str
    """The run directory on the target (the job's working directory)."""
    cache_dir: str
    """The Hugging Face cache on the target, shared by its runs."""
    facts: TargetFacts


@runtime_checkable
class Trainer(Protocol):
    """A kind of job. Every method raises `TrainError` with one line when the
    run cannot work; none of them starts anything."""

    @property
    def name(self) -> str:
        """What the job is, in messages: `training`, `export`, `compare`."""
        ...

    @property
    def metrics_file(self) -> str:
        """The metrics file, relative to the run directory."""
        ...

    @property
    def probe_modules(self) -> Sequence[str]:
        """Modules the job needs in its environment; a probe checks them first."""
        ...

    def check(self, facts: TargetFacts) -> None:
        """Raises `TrainError` when the target's job environment cannot run the job."""
        ...

    def prepare(self, local_run_dir: Path, ctx: JobContext) -> None:
        """Writes the job's files (configs, datasets, plugin) into the local run directory."""
        ...

    def commands(self, ctx: JobContext) -> list[list[str]]:
        """The job's commands, run in order in the run directory."""
        ...

    def env(self, ctx: JobContext) -> dict[str, str]:
        """The job's environment variables (never a secret: those come from the target)."""
        ...

    def artifacts(self) -> Artifacts:
        """What a run of this trainer brings back and verifies."""
        ...


class TrainerBase:
    """What the trainers of this package share: the metrics file their job
    appends to (`metrics.jsonl`), the modules it imports (`modules`, probed on
    the target before anything starts) and the check that names the first one
    the job venv lacks. A subclass sets `name` and `modules`, and says how to
    install a missing module in `install_hint`."""

    name: str
    """What the job is, in messages: `training`, `export`, `compare`, `evaluation`."""
    modules: Sequence[str] = ()
    """What the job imports in the job venv."""

    @property
    def metrics_file(self) -> str:
        """`metrics.jsonl`, appended to by the job."""
        return METRICS_FILE

    @property
    def probe_modules(self) -> Sequence[str]:
        """The modules the job imports: `modules`."""
        return self.modules

    def install_hint(self, module: str, python: str) -> str:
        """How to install `module` in the job venv of `python`, in a message: the
        script that installs this job's tools."""
        return f"install the {self.name} tools with `scripts/job-env.sh <job venv>`"

    def check(self, facts: TargetFacts) -> None:
        """Raises TrainError naming the first of `probe_modules` the job venv
        lacks, and how to install it there."""
        for module in self.probe_modules:
            if facts.modules.get(module) is None:
                raise TrainError(
                    f"{module} is not installed in the job venv {facts.python}: "
                    f"{self.install_hint(module, facts.python)} there"
                )
