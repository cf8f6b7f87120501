"""How a trainer puts what its job reads into the local run directory: the
job script this package ships (`overbrainer_prefect/jobs/<module>.py`, under
`scripts/`), and the files it is given (a model, GGUFs) from the runs' store:
hard-linked from a local one so that a multi-GB file is not copied, fetched
by the job itself from an object store (`stage_stored`)."""

from __future__ import annotations

import shutil
from importlib import resources
from pathlib import Path

from pydantic import BaseModel, ConfigDict, TypeAdapter

from overbrainer_prefect.runs.store import Runs
from overbrainer_prefect.store import StoreError
from overbrainer_prefect.trainers.base import TrainError

SCRIPTS_DIR = "scripts"
"""Where a run directory holds its job scripts."""


def copy_job_script(local_run_dir: Path, module: str) -> None:
    """Copies the job script `overbrainer_prefect/jobs/<module>.py` under `scripts/`."""
    scripts = local_run_dir / SCRIPTS_DIR
    scripts.mkdir(parents=True, exist_ok=True)
    script = resources.files("overbrainer_prefect.jobs").joinpath(f"{module}.py")
    (scripts / f"{module}.py").write_bytes(script.read_bytes())


def link_or_copy(source: Path, target: Path) -> None:
    """A hard link to `source` at `target` (free for a multi-GB file), else a
    copy (another file system). Raises OSError when neither can be made."""
    target.unlink(missing_ok=True)
    try:
        target.hardlink_to(source)
    except OSError:
        shutil.copyfile(source, target)


INPUTS_FILE = ".inputs.json"
"""In a staged run directory whose runs are in an object store: the stored
files its job fetches first (`StoredInput`s), by URLs its start signs."""
STORE_MODULE = "overbrainer_store"
"""The job script that fetches them (`overbrainer_prefect/jobs/overbrainer_store.py`)."""


class StoredInput(BaseModel):
    """A file a job reads from the runs' store: where it goes in the job's run
    directory, the store key it comes from (under the runs directory), its
    size and SHA-256 (what the job checks it against)."""

    model_config = ConfigDict(extra="forbid")

    path: str
    key: str
    size: int
    sha256: str


_INPUTS = TypeAdapter(list[StoredInput])


def stage_stored(
    runs: Runs, key: str, local_run_dir: Path, dest: str, size: int, sha256: str, missing: str
) -> None:
    """Puts the stored file `key` (of the runs directory of `runs`) at `dest`
    of the job's staged directory: hard-linked (or copied) from a local
    store; for an object store, listed in the job's inputs (INPUTS_FILE),
    which its first command fetches on the target and checks by SHA-256, so
    that the file never passes through this machine.

    Raises TrainError with `missing` (what to do) when the store has no such file.
    """
    local = runs.store.local_path(key)
    if local is not None:
        if not local.is_file():
            raise TrainError(missing)
        target = local_run_dir / dest
        target.parent.mkdir(parents=True, exist_ok=True)
        link_or_copy(local, target)
        return
    try:
        info = runs.store.head(key)
    except StoreError as error:
        raise TrainError(f"cannot look at {runs.store.where(key)}: {error}") from None
    if info is None:
        raise TrainError(missing)
    inputs = stored_inputs(local_run_dir)
    inputs = [item for item in inputs if item.path != dest]
    inputs.append(StoredInput(path=dest, key=key, size=size, sha256=sha256))
    local_run_dir.mkdir(parents=True, exist_ok=True)
    (local_run_dir / INPUTS_FILE).write_bytes(_INPUTS.dump_json(inputs, indent=2))
    copy_job_script(local_run_dir, STORE_MODULE)


def stored_inputs(local_run_dir: Path) -> list[StoredInput]:
    """The stored files the job staged in `local_run_dir` fetches first (none
    when its runs are in a local directory)."""
    try:
        return _INPUTS.validate_json((local_run_dir / INPUTS_FILE).read_bytes())
    except FileNotFoundError:
        return []
