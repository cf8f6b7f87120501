"""Executors: where a run's job runs (this machine, an SSH box, a pod)."""

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
