"""The Prefect flows of overbrainer-prefect.

Each is imported when it is first named (`from overbrainer_prefect.flows
import train`), not with the package: a flow-run process, whose entry point
(`flows/train.py:train`) imports one flow's module and so this package first,
then imports only that flow and what it needs, not every flow's libraries (the
Hub's client, Ollama's, the evaluation, the pipeline): each flow-run start
costs a second less of a core.

A flow keeps its name here once its module is imported: the import system
names a submodule in its package (`overbrainer_prefect.flows.train`), and
`train` here stays the flow, as when every flow was imported with the package.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

_WHERE = {
    "Collected": "overbrainer_prefect.kinds.collected",
    "CompareResult": "overbrainer_prefect.kinds.compare",
    "ExportResult": "overbrainer_prefect.kinds.export",
    "FineTuneResult": "overbrainer_prefect.finetune",
    "FineTuneSpec": "overbrainer_prefect.finetune",
    "PodsResult": "overbrainer_prefect.targets.runpod.listing",
    "RunFailed": "overbrainer_prefect.flows.train",
    "RunResult": "overbrainer_prefect.kinds.training",
    "RunsListing": "overbrainer_prefect.kinds.listing",
    "SpendView": "overbrainer_prefect.money.view",
    "attach": "overbrainer_prefect.flows.train",
    "cancel": "overbrainer_prefect.flows.train",
    "collect": "overbrainer_prefect.flows.collect",
    "compare": "overbrainer_prefect.flows.compare",
    "deliver": "overbrainer_prefect.flows.deliver",
    "evaluate": "overbrainer_prefect.flows.evaluate",
    "export": "overbrainer_prefect.flows.export",
    "fine_tune": "overbrainer_prefect.flows.pipeline",
    "follow": "overbrainer_prefect.flows.follow",
    "pods": "overbrainer_prefect.flows.pods",
    "runs": "overbrainer_prefect.flows.runs",
    "spend": "overbrainer_prefect.flows.spend",
    "stop": "overbrainer_prefect.flows.train",
    "train": "overbrainer_prefect.flows.train",
}
"""Each name this package exports, and the module it is imported from."""

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


def __getattr__(name: str) -> Any:
    """The exported `name`, imported from its module on first use (then kept
    here); AttributeError for a name this package does not export."""
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(where), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The names of this package, the exported ones included before their import."""
    return sorted({*globals(), *__all__})


class _Flows(types.ModuleType):
    """This package's module type: the import system's naming of a submodule
    (`flows.train`, the module) never replaces the flow of that name."""

    def __setattr__(self, name: str, value: object) -> None:
        if name in _WHERE and isinstance(value, types.ModuleType):
            return  # `train` stays the flow; the module is in sys.modules
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Flows
