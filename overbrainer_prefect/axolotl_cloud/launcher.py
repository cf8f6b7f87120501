"""The `overbrainer` launcher of axolotl's `--cloud` (its `axolotl.cloud_providers`
entry point): `axolotl train config.yml --cloud cloud.yml` with `provider:
overbrainer` in cloud.yml.

It runs in axolotl's environment, which need not have Prefect (a laptop's
axolotl on Python 3.12 with torch; Prefect and this package in another venv):
it imports only the standard library and axolotl's launcher contract, and hands
the work to the orchestrator's Python, `python -m overbrainer_prefect.axolotl_cloud
COMMAND REQUEST` (COMMAND: train, preprocess or lm_eval), in the same terminal
(its output, its Ctrl-C question, its exit code). The orchestrator's Python is, first found:

1. `python:` in cloud.yml (`~` expanded, relative to cloud.yml's directory);
2. `$OVERBRAINER_PYTHON`;
3. the Python beside the `prefect` command on the PATH.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from types import FrameType
from typing import Any

import click
import yaml
from axolotl.cli.cloud.base import CloudLauncher

PYTHON_ENV = "OVERBRAINER_PYTHON"
"""Names the orchestrator's Python when cloud.yml has no `python:`."""

MODULE = "overbrainer_prefect.axolotl_cloud"
"""What the orchestrator's Python runs (`-m`)."""


class OverbrainerLauncher(CloudLauncher):  # type: ignore[misc]  # axolotl's, untyped here
    """axolotl's launcher for this product's targets (local, SSH, Runpod): the
    training (or the datasets' preprocessing) runs as the `train` flow, an
    lm-eval as the `evaluate` flow, followed in this terminal."""

    def __init__(self, config: dict[str, object], config_dir: Path | None = None) -> None:
        super().__init__(config)
        self.config_dir = config_dir or Path.cwd()

    @classmethod
    def from_config(
        cls, config: dict[str, object], *, config_dir: Path | None = None
    ) -> OverbrainerLauncher:
        """The launcher of cloud.yml's `config` (read from `config_dir`). It is
        checked by the orchestrator, in one line per problem, when it trains."""
        return cls(dict(config), config_dir)

    def get_local_dirs(self, cwd: Path | str | None) -> dict[str, str]:
        """What the axolotl YAML of the running command (`axolotl train
        config.yml`: click's context names it) names on this machine, uploaded
        with the run (see `local_dirs_of`); empty when no such YAML is known.
        The working directory itself is not mounted anywhere."""
        context = click.get_current_context(silent=True)
        named = context.params.get("config") if context is not None else None
        if not isinstance(named, str) or not Path(named).is_file():
            return {}
        try:
            config = yaml.safe_load(Path(named).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            return {}  # the orchestrator says what is wrong with it, in one line
        return local_dirs_of(config, Path(cwd) if cwd else Path.cwd())

    def train(
        self,
        config_yaml: str,
        launcher: str = "accelerate",
        launcher_args: list[str] | None = None,
        local_dirs: dict[str, str] | None = None,
        **kwargs: Any,
    ) -> None:
        """Trains axolotl's `config_yaml` (with the command line's overrides
        `kwargs`) as the `train` flow on cloud.yml's target, in the orchestrator's
        Python, streaming it here. Returns when the run succeeded.

        Raises SystemExit with the orchestrator's exit code when the run did not
        succeed, or one line when no orchestrator Python is found."""
        self._hand_over(
            "train",
            config_yaml,
            overrides={k: v for k, v in kwargs.items() if v is not None},
            launcher_args=list(launcher_args or []),
            local_dirs=dict(local_dirs or {}),
        )

    def preprocess(self, config_yaml: str, *args: Any, **kwargs: Any) -> None:
        """Prepares axolotl's `config_yaml`'s datasets (`axolotl.cli.preprocess`)
        on cloud.yml's target as a run of the `train` flow, in the orchestrator's
        Python, streaming it here; the tokenized datasets come back as the run's
        files (`prepared/`), retrieved and verified. Returns when it succeeded.

        Raises SystemExit with the orchestrator's exit code when it did not, or
        one line when no orchestrator Python is found."""
        self._hand_over("preprocess", config_yaml)

    def lm_eval(self, config_yaml: str) -> None:
        """Evaluates a trained run with this package's `evaluate` flow, in the
        orchestrator's Python, and prints its verdict: cloud.yml's `run_id`, else
        the newest succeeded training of `config_yaml`'s base model in the runs
        directory. Returns when the evaluation ended with a verdict.

        Raises SystemExit with the orchestrator's exit code when it did not, or
        one line when no orchestrator Python is found."""
        self._hand_over("lm_eval", config_yaml)

    def _hand_over(self, command: str, config_yaml: str, **more: object) -> None:
        """Runs `python -m MODULE command REQUEST` in this terminal, the request
        being cloud.yml, its folder, `config_yaml` and `more`; a SIGINT sent to
        this process alone is passed on (the orchestrator asks what to do; one
        that the terminal sent both gets is asked once). Returns when it ended 0.

        Raises SystemExit with its exit code otherwise, or one line when no
        orchestrator Python is found."""
        request = {
            "cloud": self.config,
            "config_dir": str(self.config_dir),
            "config_yaml": config_yaml,
            **more,
        }
        python = orchestrator_python(self.config, self.config_dir)
        with tempfile.TemporaryDirectory(prefix="overbrainer-axolotl-") as scratch:
            path = Path(scratch) / "request.json"
            path.write_text(json.dumps(request), encoding="utf-8")
            sys.stdout.flush()
            sys.stderr.flush()
            child = subprocess.Popen([python, "-m", MODULE, command, str(path)])

            def pass_on(signum: int, frame: FrameType | None) -> None:
                if child.poll() is None:
                    child.send_signal(signal.SIGINT)

            previous = signal.signal(signal.SIGINT, pass_on)
            try:
                code = child.wait()
            finally:
                signal.signal(signal.SIGINT, previous)
        if code != 0:
            raise SystemExit(code)


def local_dirs_of(config: object, cwd: Path) -> dict[str, str]:
    """The files and folders the axolotl YAML `config` names that exist on
    this machine (relative paths from `cwd`), by where they land in the run:
    `datasets/<index>` for a local dataset (a file or a folder), `base_model`
    for a local model folder. The same the orchestrator uploads for a
    deployment's worker (`trainers.uploads.local_inputs`); a Hub id is none
    of them."""
    if not isinstance(config, dict):
        return {}
    found: dict[str, str] = {}
    datasets = config.get("datasets")
    for index, entry in enumerate(datasets if isinstance(datasets, list) else []):
        path = entry.get("path") if isinstance(entry, dict) else entry
        if isinstance(path, str) and path.strip():
            local = cwd / Path(path.strip()).expanduser()
            if local.exists():
                found[f"datasets/{index}"] = str(local.resolve())
    model = config.get("base_model")
    if isinstance(model, str) and model.strip():
        local = cwd / Path(model.strip()).expanduser()
        if local.is_dir():
            found["base_model"] = str(local.resolve())
    return found


def orchestrator_python(cloud: dict[str, object], config_dir: Path) -> str:
    """The orchestrator's Python (see the module's docstring for the order).

    Raises SystemExit with one line when none is found, or the one named does
    not exist."""
    named = cloud.get("python") or os.environ.get(PYTHON_ENV)
    if named:
        path = Path(str(named)).expanduser()
        if not path.is_absolute():
            path = config_dir / path
        if not path.exists():
            raise SystemExit(
                f"overbrainer: the orchestrator's Python {path} does not exist: set `python:` "
                "in cloud.yml to the Python of the venv that has overbrainer-prefect"
            )
        return str(path)
    prefect = shutil.which("prefect")
    if prefect is not None:
        beside = Path(prefect).parent / "python"
        if beside.exists():
            return str(beside)
    raise SystemExit(
        "overbrainer: no orchestrator Python found: set `python:` in cloud.yml (or "
        f"${PYTHON_ENV}) to the Python of the venv that has overbrainer-prefect, e.g. "
        "~/venvs/prefect/bin/python"
    )
