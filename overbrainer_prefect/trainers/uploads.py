"""Local inputs handed to a run started elsewhere: a deployment's worker
cannot read the files of the machine that asks for the run, so the datasets
and a local base model folder a training names are put into the runs' store
first (`upload`, under `.uploads/<digest>/`, by the content's SHA-256: the
same files put twice are one upload), and the worker reads them from there
(`fetch`: from a local store where they are; from an object store into its
staging directory), each file checked against its SHA-256 before the spec
names it (`fetched_spec`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from overbrainer_prefect.executors.manifest import recheck, sha256_file
from overbrainer_prefect.runs.store import Runs
from overbrainer_prefect.store import StoreError
from overbrainer_prefect.store.base import join
from overbrainer_prefect.trainers.spec import DatasetSpec, TrainingSpec

UPLOADS_DIR = ".uploads"
"""Under the runs directory: the local inputs of runs started elsewhere."""


class UploadError(Exception):
    """An input cannot be put into the store or read back from it as it was
    put; the message is one line saying what to do."""


class UploadedFile(BaseModel):
    """One file of an upload: its path under the upload's key, size and SHA-256."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str
    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class Upload(BaseModel):
    """A local file or folder a training names, put into the runs' store: the
    path the spec names it by (`local`), the store directory holding it
    (`key`, `.uploads/<digest>`), its name there, and every file of it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    local: str = Field(description="The dataset path or base_model the spec names.")
    key: str = Field(pattern=rf"^{UPLOADS_DIR}/[0-9a-f]{{32}}$")
    name: str = Field(min_length=1)
    files: list[UploadedFile] = Field(min_length=1)


def local_inputs(spec: TrainingSpec) -> list[str]:
    """What `spec` names on this machine, to upload for a run started
    elsewhere: its local datasets (files or folders), and its base model when
    it is a folder here."""
    found = [dataset.path for dataset in spec.local_datasets()]
    if Path(spec.base_model).expanduser().is_dir():
        found.append(spec.base_model)
    return list(dict.fromkeys(found))


def upload(runs: Runs, local: str) -> Upload:
    """Puts the local file or folder `local` into the store of `runs` (each of
    its files hashed here first; one already there with its size is not put
    again) and checks what the store holds: its size, and its SHA-256 where
    the store keeps one of the whole file (a local store: hashed again).

    Raises UploadError with one line when it cannot be read here, or the store
    refuses it or holds something else."""
    path = Path(local).expanduser()
    try:
        found = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        files = [
            UploadedFile(path=_below(path, each), size=size, sha256=sha256)
            for each in found
            for size, sha256 in [sha256_file(each)]
        ]
    except OSError as error:
        raise UploadError(f"cannot read {local} to upload it: {error.strerror or error}") from None
    if not files:
        raise UploadError(f"{local} holds no file to upload: name a folder with its files")
    listed = json.dumps([[f.path, f.sha256] for f in files]).encode()
    made = Upload(
        local=local,
        key=join(UPLOADS_DIR, hashlib.sha256(listed).hexdigest()[:32]),
        name=path.name,
        files=files,
    )
    sources = [path.parent / each.path for each in files]
    for each, source in zip(files, sources, strict=True):
        key = join(made.key, each.path)
        try:
            info = runs.store.head(key)
            if info is None or info.size != each.size:
                runs.store.put_file(source, key)
                info = runs.store.head(key)
        except (StoreError, OSError) as error:
            where = runs.store.where(key)
            raise UploadError(f"cannot upload {source} to {where}: {error}") from None
        stored = runs.store.local_path(key)
        wrong = (
            info is None
            or info.size != each.size
            or (stored is not None and recheck(stored, each.size, each.sha256) is not None)
        )
        if wrong:
            raise UploadError(
                f"{runs.store.where(key)} differs from {source} once uploaded: run the command "
                "again"
            )
    return made


def _below(uploaded: Path, file: Path) -> str:
    """`file`'s path under the upload's key: its name (a file uploaded), or
    the folder's name, then its path in it."""
    if file == uploaded:
        return uploaded.name
    return f"{uploaded.name}/{file.relative_to(uploaded).as_posix()}"


def fetch(runs: Runs, made: Upload) -> Path:
    """The local path of the upload `made`, every file of it checked against
    its SHA-256: in a local store, where it is; from an object store, read
    into this process's staging directory (a copy already there and still
    the same is kept).

    Raises UploadError with one line for a file that is not in the store or
    differs from what was uploaded."""
    base = runs.top.root / made.key
    again = f"upload {made.local} again (start the run again from the machine that has it)"
    for each in made.files:
        key = join(made.key, each.path)
        stored = runs.store.local_path(key)
        where = stored if stored is not None else base / each.path
        if stored is None and recheck(where, each.size, each.sha256) is not None:
            try:
                runs.store.get_file(key, where)
            except FileNotFoundError:
                raise UploadError(f"{runs.store.where(key)} is missing: {again}") from None
            except StoreError as error:
                raise UploadError(f"cannot read {runs.store.where(key)}: {error}") from None
        if not where.is_file():
            raise UploadError(f"{runs.store.where(key)} is missing: {again}")
        if recheck(where, each.size, each.sha256) is not None:
            raise UploadError(
                f"{runs.store.where(key)} differs from the file uploaded (SHA-256): {again}"
            )
    stored_root = runs.store.local_path(join(made.key, made.name))
    return stored_root if stored_root is not None else base / made.name


def fetched_spec(runs: Runs, spec: TrainingSpec, uploads: list[Upload]) -> TrainingSpec:
    """`spec` with each dataset and the base model that `uploads` carry named
    by its verified local copy (`fetch`). Raises UploadError with one line."""
    copies = {made.local: str(fetch(runs, made)) for made in uploads}
    datasets = [
        DatasetSpec.model_validate(d.model_dump() | {"path": copies[d.path]})
        if d.path in copies
        else d
        for d in spec.datasets
    ]
    return spec.model_copy(
        update={"datasets": datasets, "base_model": copies.get(spec.base_model, spec.base_model)}
    )
