"""What every step with a run's pod shares (the API client, the runs, the
timing, where messages go), and what a run record keeps of the errors those
steps raise (`PodError`, in the provider's `runpod.errors`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from overbrainer_prefect.runpod.bootstrap import PodTiming
from overbrainer_prefect.runpod.client import RunpodClient
from overbrainer_prefect.runpod.errors import NoCapacity, PodError, PodNotGone, RunpodError
from overbrainer_prefect.runpod.gpus import GpuChoiceError
from overbrainer_prefect.runs.store import Runs
from overbrainer_prefect.steps.errors import INTERRUPTED

log = logging.getLogger("overbrainer_prefect.runpod")


@dataclass
class PodContext:
    """The Runpod account (`client`), the runs store, the timing, and the
    logger messages go to (the flow run's, in a flow)."""

    client: RunpodClient
    runs: Runs
    timing: PodTiming = field(default_factory=PodTiming.from_env)
    log: logging.Logger | logging.LoggerAdapter[Any] = log


def run_message(error: BaseException) -> str:
    """What `run.json` keeps of an error: our own messages as they are, an
    answer of the Runpod API only as its status ("Runpod answered 500")."""
    if isinstance(error, PodError | NoCapacity | PodNotGone | GpuChoiceError):
        return str(error)
    if isinstance(error, RunpodError):
        return error.run_message
    return str(error) or type(error).__name__


__all__ = ["INTERRUPTED", "PodContext", "run_message"]
