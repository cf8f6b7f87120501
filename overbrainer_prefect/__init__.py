"""overbrainer-prefect: fine-tune LLMs with axolotl on this machine, an SSH box
or a Runpod pod, as Prefect flows.

The blocks and flows are imported lazily (`from overbrainer_prefect import
LocalTarget`), so that the core (runs, executors, trainers) can be imported
without Prefect.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

__version__ = "0.1.0"

EPHEMERAL_STARTUP_ENV = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
EPHEMERAL_STARTUP_S = 180
"""How long Prefect waits for its ephemeral server (the one a flow called
without PREFECT_API_URL starts) when the user's environment does not say: its
own default, 20 s, is not enough on a busy 2-core machine."""


def _ephemeral_server_patience() -> None:
    """Sets EPHEMERAL_STARTUP_ENV to EPHEMERAL_STARTUP_S unless it is set, and
    has an already imported Prefect read it again."""
    if os.environ.get(EPHEMERAL_STARTUP_ENV):
        return
    os.environ[EPHEMERAL_STARTUP_ENV] = str(EPHEMERAL_STARTUP_S)
    context = sys.modules.get("prefect.context")
    refresh = getattr(context, "refresh_global_settings_context", None)
    if refresh is not None:
        refresh()


_ephemeral_server_patience()

_LAZY = {
    "LocalTarget": "overbrainer_prefect.blocks",
    "SshTarget": "overbrainer_prefect.blocks",
    "SshPool": "overbrainer_prefect.blocks",
    "HuggingFaceCredentials": "overbrainer_prefect.blocks",
    "RunpodCredentials": "overbrainer_prefect.blocks",
    "RunpodTarget": "overbrainer_prefect.blocks",
    "pods": "overbrainer_prefect.flows",
    "OllamaServer": "overbrainer_prefect.blocks",
    "train": "overbrainer_prefect.flows",
    "attach": "overbrainer_prefect.flows",
    "stop": "overbrainer_prefect.flows",
    "cancel": "overbrainer_prefect.flows",
    "export": "overbrainer_prefect.flows",
    "compare": "overbrainer_prefect.flows",
    "fine_tune": "overbrainer_prefect.flows",
    "deliver": "overbrainer_prefect.flows",
    "collect": "overbrainer_prefect.flows",
    "TrainingSpec": "overbrainer_prefect.trainers.spec",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'overbrainer_prefect' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
