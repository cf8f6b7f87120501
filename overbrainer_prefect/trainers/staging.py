"""How a trainer puts what its job reads into the local run directory: the
job script this package ships (`overbrainer_prefect/jobs/<module>.py`, under
`scripts/`), and the files it is given (a model, GGUFs) from the runs' store:
hard-linked from a local one so that a multi-GB file is not copied, fetched
by the job itself from an object store (`stage_stored`)."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Self

from pydantic import BaseModel, ConfigDict, TypeAdapter, model_validator

from overbrainer_prefect.runs.store import Runs
from overbrainer_prefect.store import StoreError
from overbrainer_prefect.trainers.base import TrainError

SCRIPTS_DIR = "scripts"
"""Where a run directory holds its job scripts."""
RUNNER_MODULE = "overbrainer_run"
"""The job script that runs a job's module and, once it ended well, ends its
process without the interpreter's teardown (jobs/overbrainer_run.py): a
training's axolotl CLI module, an export's job script."""


def copy_job_script(local_run_dir: Path, module: str, directory: str = SCRIPTS_DIR) -> None:
    """Copies the job script `overbrainer_prefect/jobs/<module>.py` under
    `directory` of the run directory (`scripts/` unless told)."""
    scripts = local_run_dir / directory
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
    """A file a job reads before it starts: where it goes in the job's run
    directory, where it comes from (the store key under the runs directory,
    or the absolute path of a file on the network volume the job's machine
    mounts: linked in), its size and SHA-256 (what the job checks it
    against)."""

    model_config = ConfigDict(extra="forbid")

    path: str
    key: str | None = None
    source: str | None = None
    size: int
    sha256: str

    @model_validator(mode="after")
    def _one_origin(self) -> Self:
        if (self.key is None) == (self.source is None):
            raise ValueError(f"{self.path}: give either the store key or the source on a volume")
        return self


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
    _add_inputs(local_run_dir, [StoredInput(path=dest, key=key, size=size, sha256=sha256)])


def stage_on_volume(local_run_dir: Path, files: Sequence[StoredInput]) -> None:
    """Lists `files` (each with its `source`, an absolute path on the network
    volume the job's machine mounts) in the job's inputs: its first command
    links each in (copies it where it cannot) and checks its size and
    SHA-256 there, so that nothing passes through this machine. Raises
    OSError when the inputs cannot be written."""
    _add_inputs(local_run_dir, files)


def _add_inputs(local_run_dir: Path, items: Sequence[StoredInput]) -> None:
    """Adds `items` to the job's inputs (replacing those for the same paths),
    with the script that fetches them."""
    paths = {item.path for item in items}
    inputs = [known for known in stored_inputs(local_run_dir) if known.path not in paths]
    inputs.extend(items)
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
