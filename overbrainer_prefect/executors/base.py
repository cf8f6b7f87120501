"""The executor protocol: what a target must do for a run, whatever it is.

An executor copies a run directory to the target, starts its job detached (it
outlives the process that started it), reads the job's status and files back,
and lists the SHA-256 of what the job left so that every download can be
verified. The local machine, an SSH box and a Runpod pod (through SSH) all
implement it; the run flows never branch on which one they hold.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, SecretStr

JOB_LOG = "job.log"
"""The job's stdout and stderr, in its run directory."""

EXIT_FILE = "job.exit"
"""The job's exit code, written by the wrapper once its commands end."""

CANCEL_FILE = "job.cancelled"
"""Written by `cancel` before it signals the job: a job gone with this file
present was cancelled, not lost."""

MAX_TAIL_READ = 1 << 20  # bytes one `read_from` returns at most, so a huge file is read in pieces


class ExecError(Exception):
    """A target failed to do something, or could not be reached.

    `action` names what was asked (`upload`, `spawn`, `verify`...). The message
    never quotes a secret or a file's content.
    """

    def __init__(self, action: str, message: str) -> None:
        super().__init__(f"cannot {action}: {message}")
        self.action = action
        self.message = message


class TargetUnreachable(ExecError):
    """The target could not be reached at all (connection refused, timed out,
    lost): a transient failure that a follower retries a bounded number of times."""


class JobId(BaseModel):
    """How to find a started job again, from another process or another day."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    dir: str = Field(description="The run directory on the target.")
    pid: int = Field(gt=1, description="PID of the job's wrapper, leader of its process group.")
    started: str | None = Field(
        default=None,
        description="The process's start time as the target's kernel reports it, so that a "
        "reused PID is never taken for the job.",
    )


@dataclass(frozen=True)
class JobStatus:
    """Where a job stands: `running`, `exited` (with its code), `cancelled`, or
    `lost` (gone without an exit code and without being cancelled)."""

    kind: Literal["running", "exited", "cancelled", "lost"]
    code: int | None = None

    @classmethod
    def running(cls) -> JobStatus:
        """A job still running."""
        return cls("running")

    @classmethod
    def exited(cls, code: int) -> JobStatus:
        """A job whose commands ended with `code`."""
        return cls("exited", code)

    @classmethod
    def cancelled(cls) -> JobStatus:
        """A job stopped by `cancel`."""
        return cls("cancelled")

    @classmethod
    def lost(cls) -> JobStatus:
        """A job gone without an exit code and without a cancel."""
        return cls("lost")

    @property
    def is_finished(self) -> bool:
        """Whether the job has ended, one way or another."""
        return self.kind != "running"

    def __str__(self) -> str:
        return f"exited({self.code})" if self.kind == "exited" else self.kind


@dataclass(frozen=True)
class JobSpec:
    """What to run for a run: its commands in order (the first failure ends the
    job with its exit code), in the run directory, with `env` and `secrets` in
    its environment. Secrets reach the job through its environment only: never a
    file, a log line or a process argument."""

    run_id: str
    run_dir: str
    commands: Sequence[Sequence[str]]
    env: Mapping[str, str] = field(default_factory=dict)
    secrets: Mapping[str, SecretStr] = field(default_factory=dict)


@dataclass(frozen=True)
class FileDigest:
    """One file of a manifest: its path relative to the run directory (POSIX
    separators), its size in bytes and its SHA-256 in lowercase hex."""

    path: str
    size: int
    sha256: str


@dataclass(frozen=True)
class CommandResult:
    """What a short command run on the target returned."""

    code: int
    stdout: str
    stderr: str


@runtime_checkable
class Executor(Protocol):
    """A place where jobs run. Every path on the target is absolute; every
    method raises `ExecError` (`TargetUnreachable` when the target cannot be
    reached) and never leaves a secret in its message."""

    @property
    def workdir(self) -> str:
        """The directory on the target that holds its run directories."""
        ...

    @property
    def description(self) -> str:
        """How messages name this target, e.g. `local target 'laptop'`."""
        ...

    async def run(
        self, argv: Sequence[str], timeout: float = 60.0, stdin: bytes | None = None
    ) -> CommandResult:
        """Runs a command on the target (`stdin` written to it: what must not be
        in its arguments) and returns its exit code and output."""
        ...

    async def upload(self, local: Path, remote: str, skip: Sequence[str] = ()) -> None:
        """Copies the local directory `local` to `remote` (created if needed), leaving
        out the entries whose names are in `skip` (at the top level)."""
        ...

    async def spawn(self, job: JobSpec) -> JobId:
        """Starts the job detached, in its own session and process group, with its
        output in `JOB_LOG` and its exit code in `EXIT_FILE` of its run directory."""
        ...

    async def status(self, job: JobId) -> JobStatus:
        """Where the job stands now."""
        ...

    async def wait_exit(self, job: JobId, seconds: float) -> None:
        """Waits `seconds` before the next look at the job; returns sooner once
        its `EXIT_FILE` exists where that is cheap to see (a local target).
        Raises nothing."""
        ...

    async def cancel(self, job: JobId) -> None:
        """Cancels the job's whole process group: writes `CANCEL_FILE`, sends
        SIGTERM, then SIGKILL after a grace. A job already ended is left alone."""
        ...

    async def read_from(self, path: str, offset: int, limit: int = MAX_TAIL_READ) -> bytes:
        """Up to `limit` bytes of the file `path` from `offset`; empty when the file
        does not exist yet or holds nothing past `offset`."""
        ...

    async def manifest(
        self, remote: str, entries: Sequence[str], exclude: Sequence[str] = ()
    ) -> list[FileDigest]:
        """The files under `entries` (paths relative to `remote`; missing ones are
        skipped) less those `exclude` matches, each hashed once on the target,
        sorted by path."""
        ...

    async def download(
        self, remote: str, local: Path, entries: Sequence[str], exclude: Sequence[str] = ()
    ) -> None:
        """Copies the files under `entries` of `remote` into `local`, same layout."""
        ...

    async def touch(self, path: str) -> None:
        """Creates the file `path` (a marker or a request) if it does not exist."""
        ...

    async def close(self) -> None:
        """Releases connections; the executor may be used again afterwards."""
        ...
