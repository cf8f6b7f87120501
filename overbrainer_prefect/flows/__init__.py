"""The Prefect flows of overbrainer-prefect."""

from overbrainer_prefect.flows.collect import Collected, collect
from overbrainer_prefect.flows.compare import compare
from overbrainer_prefect.flows.deliver import deliver
from overbrainer_prefect.flows.evaluate import evaluate
from overbrainer_prefect.flows.export import export
from overbrainer_prefect.flows.pipeline import FineTuneResult, FineTuneSpec, fine_tune
from overbrainer_prefect.flows.pods import PodsResult, pods
from overbrainer_prefect.flows.runs import RunsListing, runs
from overbrainer_prefect.flows.train import RunFailed, attach, cancel, stop, train
from overbrainer_prefect.kinds.compare import CompareResult
from overbrainer_prefect.kinds.export import ExportResult
from overbrainer_prefect.kinds.training import RunResult

__all__ = [
    "Collected",
    "CompareResult",
    "ExportResult",
    "FineTuneResult",
    "FineTuneSpec",
    "PodsResult",
    "RunFailed",
    "RunResult",
    "RunsListing",
    "attach",
    "cancel",
    "collect",
    "compare",
    "deliver",
    "evaluate",
    "export",
    "fine_tune",
    "pods",
    "runs",
    "stop",
    "train",
]
