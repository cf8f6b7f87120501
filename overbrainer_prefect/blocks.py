"""Prefect blocks: where runs run (targets) and the credentials they use.

A target block names a machine and how jobs run there; it builds the executor
the run flows drive. Training settings are not here: they are flow parameters.
"""

from __future__ import annotations

from abc import abstractmethod
from pathlib import Path
from typing import ClassVar

from prefect.blocks.core import Block
from pydantic import Field, HttpUrl, SecretStr

from overbrainer_prefect.envfile import read_env_file
from overbrainer_prefect.executors.base import Executor
from overbrainer_prefect.executors.local import LocalExecutor

DOCS_URL = "https://github.com/overbrainer/overbrainer-prefect#readme"
LOGO_URL = "https://raw.githubusercontent.com/overbrainer/overbrainer-prefect/main/logo.png"


class TargetBlock(Block):
    """What every target has: the job environment, the bounds of a job, and
    how to build its executor."""

    _logo_url = HttpUrl(LOGO_URL)
    _documentation_url = HttpUrl(DOCS_URL)
    kind: ClassVar[str] = "target"

    job_venv: str = Field(
        description="The virtual environment on the target that runs jobs (torch, axolotl).",
    )
    env_file: str | None = Field(
        default=None,
        description="A KEY=VALUE file on this machine whose values reach the job through its "
        "environment only (never a file on the target).",
    )
    max_hours: float = Field(
        default=24.0,
        gt=0,
        description="How long a job may run before it is cancelled and its run failed.",
    )
    stall_minutes: float = Field(
        default=15.0,
        gt=0,
        description="Minutes without a new metric before a job is reported as stalled.",
    )
    poll_seconds: float = Field(
        default=2.0, gt=0, description="Seconds between two looks at a running job."
    )
    cpu_threads: int | None = Field(
        default=None,
        ge=1,
        description="Threads a job may use on a target without a GPU (OMP_NUM_THREADS); "
        "unset lets torch decide.",
    )

    @property
    def python(self) -> str:
        """The job venv's Python on the target."""
        return f"{self.job_venv.rstrip('/')}/bin/python"

    def secrets(self) -> dict[str, SecretStr]:
        """The values of `env_file`, for the job's environment. Raises ValueError
        with one line when the file cannot be read or is malformed."""
        return read_env_file(Path(self.env_file).expanduser()) if self.env_file else {}

    @abstractmethod
    def executor(self, name: str) -> Executor:
        """The executor of this target, named `name` in messages."""


class LocalTarget(TargetBlock):
    """This machine: jobs run as detached processes in a venv, in a work
    directory of their own, and their files are copied back and verified like
    any target's.

    Example:
        Load a saved local target:
        ```python
        from overbrainer_prefect import LocalTarget

        local_target_block = LocalTarget.load("BLOCK_NAME")
        ```
    """

    _block_type_name = "Overbrainer Local Target"
    _block_type_slug = "overbrainer-local-target"
    kind: ClassVar[str] = "local"

    work_dir: str = Field(
        default="~/.overbrainer/work",
        description="The directory that holds the run directories of the jobs.",
    )

    def executor(self, name: str) -> Executor:
        """A `LocalExecutor` over `work_dir`."""
        return LocalExecutor(Path(self.work_dir).expanduser(), name=name)
