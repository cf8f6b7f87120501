"""Executors: where a run's job runs (this machine, an SSH box, a pod).

`SshExecutor` is imported when first named (`lazy.lazy_exports`): a process
that reaches no SSH box (a flow run on a local target) does not import asyncssh."""

from __future__ import annotations

from typing import TYPE_CHECKING

from overbrainer_prefect.executors.base import (
    CANCEL_FILE,
    EXIT_FILE,
    JOB_LOG,
    MAX_TAIL_READ,
    CommandResult,
    ExecError,
    Executor,
    FileDigest,
    JobId,
    JobSpec,
    JobStatus,
    TargetUnreachable,
)
from overbrainer_prefect.executors.local import LocalExecutor
from overbrainer_prefect.executors.manifest import is_excluded, local_manifest, verify
from overbrainer_prefect.lazy import lazy_exports

if TYPE_CHECKING:
    from overbrainer_prefect.executors.ssh import SshExecutor

__all__ = [
    "CANCEL_FILE",
    "EXIT_FILE",
    "JOB_LOG",
    "MAX_TAIL_READ",
    "CommandResult",
    "ExecError",
    "Executor",
    "FileDigest",
    "JobId",
    "JobSpec",
    "JobStatus",
    "LocalExecutor",
    "SshExecutor",
    "TargetUnreachable",
    "is_excluded",
    "local_manifest",
    "verify",
]


lazy_exports(__name__, {"overbrainer_prefect.executors.ssh": ("SshExecutor",)})
