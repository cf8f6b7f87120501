"""The Prefect flows of overbrainer-prefect."""

from overbrainer_prefect.flows.train import RunFailed, RunResult, attach, cancel, stop, train

__all__ = ["RunFailed", "RunResult", "attach", "cancel", "stop", "train"]
