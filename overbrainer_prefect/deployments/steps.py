"""Pull steps of the deployments in `deployments/prefect.yaml`.

Prefect resolves `{{ $VAR }}` placeholders in `prefect.yaml` when you deploy,
on your machine; a step that must look at the worker's machine has to read
its environment when it runs. This module holds those steps. It does not
import Prefect.
"""

from __future__ import annotations

import os
from pathlib import Path

PROJECT_DIR_ENV = "OVERBRAINER_PROJECT_DIR"
"""Set on a worker to the root of its clone of this repository, when that is
not where the deployments were made from."""


class ProjectDirError(RuntimeError):
    """The clone a flow run should run in is not there."""


def set_project_directory(default: str) -> dict[str, str]:
    """Moves a flow run into its worker's clone of this repository: the directory
    `$OVERBRAINER_PROJECT_DIR` names on the worker, else `default` (the clone the
    deployments were made from: `{{ $PWD }}` at deploy time). Returns it as
    `directory`, as Prefect's `set_working_directory` does.

    Raises ProjectDirError with one line when the directory does not exist or
    holds no `flows/` (not a clone of this repository).
    """
    chosen = os.environ.get(PROJECT_DIR_ENV) or default
    source = f"${PROJECT_DIR_ENV}" if os.environ.get(PROJECT_DIR_ENV) else "the deployment"
    directory = Path(chosen).expanduser()
    if not chosen or not directory.is_dir():
        raise ProjectDirError(
            f"no clone of overbrainer-prefect at {chosen!r} ({source}): clone it there, or set "
            f"{PROJECT_DIR_ENV} on the worker to the root of its clone"
        )
    if not (directory / "flows").is_dir():
        raise ProjectDirError(
            f"{chosen} ({source}) holds no flows/ directory: set {PROJECT_DIR_ENV} on the "
            "worker to the root of its clone of overbrainer-prefect"
        )
    os.chdir(directory)
    return {"directory": os.getcwd()}
