"""The Prefect flows of overbrainer-prefect."""

from overbrainer_prefect.flows.export import ExportResult, export
from overbrainer_prefect.flows.train import RunFailed, RunResult, attach, cancel, stop, train

__all__ = ["ExportResult", "RunFailed", "RunResult", "attach", "cancel", "export", "stop", "train"]
