"""The shape of the package: the core never imports Prefect."""

from __future__ import annotations

import subprocess
import sys

CORE = [
    "overbrainer_prefect.runs.lifecycle",
    "overbrainer_prefect.runs.resume",
    "overbrainer_prefect.executors.local",
    "overbrainer_prefect.executors.jobscript",
    "overbrainer_prefect.trainers.axolotl",
    "overbrainer_prefect.executors.ssh",
    "overbrainer_prefect.runpod.client",
    "overbrainer_prefect.runpod.gpus",
    "overbrainer_prefect.runpod.deletion",
    "overbrainer_prefect.runpod.vram",
    "overbrainer_prefect.runpod.bootstrap",
    "overbrainer_prefect.runpod.provision",
    "overbrainer_prefect.runpod.follow",
    "overbrainer_prefect.runpod.ending",
    "overbrainer_prefect.runpod.reconnect",
    "overbrainer_prefect.runpod.orphans",
    "overbrainer_prefect.runpod.volume",
    "overbrainer_prefect.trainers.holdout",
    "overbrainer_prefect.trainers.evaluate",
    "overbrainer_prefect.evaluation.spec",
    "overbrainer_prefect.evaluation.items",
    "overbrainer_prefect.evaluation.scorers",
    "overbrainer_prefect.evaluation.stats",
    "overbrainer_prefect.evaluation.judge",
    "overbrainer_prefect.evaluation.results",
    "overbrainer_prefect.evaluation.verdict",
    "overbrainer_prefect.evaluation.gate",
]


def test_the_core_imports_without_prefect() -> None:
    code = (
        "import sys\n"
        + "".join(f"import {module}\n" for module in CORE)
        + "loaded = sorted(m for m in sys.modules if m == 'prefect' or m.startswith('prefect.'))\n"
        + "print(','.join(loaded))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == ""
