"""The Prefect flows of overbrainer-prefect."""

from overbrainer_prefect.finetune import FineTuneResult, FineTuneSpec
from overbrainer_prefect.flows.collect import collect
from overbrainer_prefect.flows.compare import compare
from overbrainer_prefect.flows.deliver import deliver
from overbrainer_prefect.flows.evaluate import evaluate
from overbrainer_prefect.flows.export import export
from overbrainer_prefect.flows.follow import follow
from overbrainer_prefect.flows.pipeline import fine_tune
from overbrainer_prefect.flows.pods import pods
from overbrainer_prefect.flows.runs import runs
from overbrainer_prefect.flows.spend import spend
from overbrainer_prefect.flows.train import RunFailed, attach, cancel, stop, train
from overbrainer_prefect.kinds.collected import Collected
from overbrainer_prefect.kinds.compare import CompareResult
from overbrainer_prefect.kinds.export import ExportResult
from overbrainer_prefect.kinds.listing import RunsListing
from overbrainer_prefect.kinds.training import RunResult
from overbrainer_prefect.money.view import SpendView
from overbrainer_prefect.targets.runpod.listing import PodsResult

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
    "SpendView",
    "attach",
    "cancel",
    "collect",
    "compare",
    "deliver",
    "evaluate",
    "export",
    "fine_tune",
    "follow",
    "pods",
    "runs",
    "spend",
    "stop",
    "train",
]
