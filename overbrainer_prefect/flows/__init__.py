"""The Prefect flows of overbrainer-prefect.

Each is imported when it is first named (`from overbrainer_prefect.flows
import train`), not with the package (`lazy.lazy_exports`): a flow-run
process, whose entry point (`flows/train.py:train`) imports this package
first, imports only the flow it runs and what that needs, not every flow's
libraries (the Hub's client, Ollama's, the evaluation, the pipeline)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from overbrainer_prefect.lazy import lazy_exports

if TYPE_CHECKING:
    from overbrainer_prefect.finetune import FineTuneResult as FineTuneResult
    from overbrainer_prefect.finetune import FineTuneSpec as FineTuneSpec
    from overbrainer_prefect.flows.collect import collect as collect
    from overbrainer_prefect.flows.compare import compare as compare
    from overbrainer_prefect.flows.deliver import deliver as deliver
    from overbrainer_prefect.flows.evaluate import evaluate as evaluate
    from overbrainer_prefect.flows.export import export as export
    from overbrainer_prefect.flows.follow import follow as follow
    from overbrainer_prefect.flows.pipeline import fine_tune as fine_tune
    from overbrainer_prefect.flows.pods import pods as pods
    from overbrainer_prefect.flows.runs import runs as runs
    from overbrainer_prefect.flows.spend import spend as spend
    from overbrainer_prefect.flows.train import RunFailed as RunFailed
    from overbrainer_prefect.flows.train import attach as attach
    from overbrainer_prefect.flows.train import cancel as cancel
    from overbrainer_prefect.flows.train import stop as stop
    from overbrainer_prefect.flows.train import train as train
    from overbrainer_prefect.kinds.collected import Collected as Collected
    from overbrainer_prefect.kinds.compare import CompareResult as CompareResult
    from overbrainer_prefect.kinds.export import ExportResult as ExportResult
    from overbrainer_prefect.kinds.listing import RunsListing as RunsListing
    from overbrainer_prefect.kinds.training import RunResult as RunResult
    from overbrainer_prefect.money.view import SpendView as SpendView
    from overbrainer_prefect.targets.runpod.listing import PodsResult as PodsResult

__all__ = lazy_exports(
    __name__,
    {
        "overbrainer_prefect.finetune": ("FineTuneResult", "FineTuneSpec"),
        "overbrainer_prefect.flows.collect": ("collect",),
        "overbrainer_prefect.flows.compare": ("compare",),
        "overbrainer_prefect.flows.deliver": ("deliver",),
        "overbrainer_prefect.flows.evaluate": ("evaluate",),
        "overbrainer_prefect.flows.export": ("export",),
        "overbrainer_prefect.flows.follow": ("follow",),
        "overbrainer_prefect.flows.pipeline": ("fine_tune",),
        "overbrainer_prefect.flows.pods": ("pods",),
        "overbrainer_prefect.flows.runs": ("runs",),
        "overbrainer_prefect.flows.spend": ("spend",),
        "overbrainer_prefect.flows.train": ("RunFailed", "attach", "cancel", "stop", "train"),
        "overbrainer_prefect.kinds.collected": ("Collected",),
        "overbrainer_prefect.kinds.compare": ("CompareResult",),
        "overbrainer_prefect.kinds.export": ("ExportResult",),
        "overbrainer_prefect.kinds.listing": ("RunsListing",),
        "overbrainer_prefect.kinds.training": ("RunResult",),
        "overbrainer_prefect.money.view": ("SpendView",),
        "overbrainer_prefect.targets.runpod.listing": ("PodsResult",),
    },
)
