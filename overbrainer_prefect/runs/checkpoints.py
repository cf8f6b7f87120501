"""The checkpoints of a run kept while its job trains (`checkpoints.json`,
beside its record): each one's step, its directory (relative to the run
directory, where the final retrieval puts it too) and its files as the
store was verified to hold them, or, for one left on a pod's network volume
(a Runpod target's `checkpoints_on: volume`), as the pod hashed them there.
The last one is where a run lost with its machine can go on from."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import PurePosixPath
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from overbrainer_prefect.executors.base import FileDigest
from overbrainer_prefect.executors.nodes import node_dir, node_rank
from overbrainer_prefect.runs.store import Runs
from overbrainer_prefect.store.records import RecordError

CHECKPOINTS_FILE = "checkpoints.json"
"""The checkpoints of a run kept in its store, in its directory."""


def _inside(path: str) -> str:
    """`path` if it names something inside a run directory (relative, no `..`)."""
    parts = PurePosixPath(path).parts
    if not parts or path.startswith("/") or ".." in parts:
        raise ValueError(f"{path!r} is not a path inside a run directory")
    return path


RunPath = Annotated[str, AfterValidator(_inside)]
"""A path relative to a run directory, never outside it."""


class KeptFile(BaseModel):
    """One file of a kept checkpoint: its path relative to the run directory,
    its size and SHA-256, and the SHA-256 of each part an object store holds
    it in (empty in a local store)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: RunPath
    size: int = Field(ge=0)
    sha256: str
    parts: list[str] = Field(default_factory=list)

    def digest(self) -> FileDigest:
        """The file as a manifest lists it."""
        return FileDigest(path=self.path, size=self.size, sha256=self.sha256)


class KeptCheckpoint(BaseModel):
    """A checkpoint whose every file the store was verified to hold."""

    model_config = ConfigDict(extra="forbid")

    step: int = Field(ge=0, description="The step it was saved at.")
    path: RunPath = Field(description="Its directory, relative to the run directory.")
    kept: str = Field(description="When it was verified where it was kept, RFC 3339.")
    files: list[KeptFile]
    volume: str | None = Field(
        default=None,
        description="The network volume it was kept on, where the job wrote it (not copied "
        "into the store), its files hashed there; None: kept in the store.",
    )
    remote: str | None = Field(
        default=None,
        description="On `volume`: its directory, absolute, as a pod mounting the volume sees it.",
    )


class KeptCheckpoints(BaseModel):
    """`checkpoints.json`: the checkpoints kept so far, in the order they were kept."""

    model_config = ConfigDict(extra="forbid")

    checkpoints: list[KeptCheckpoint] = Field(default_factory=list)

    @property
    def last(self) -> KeptCheckpoint | None:
        """The kept checkpoint of the highest step, None when none was kept."""
        return max(self.checkpoints, key=lambda point: point.step, default=None)

    def in_store(self) -> KeptCheckpoints:
        """The checkpoints kept in the store (not those left on a volume)."""
        return KeptCheckpoints(checkpoints=[p for p in self.checkpoints if p.volume is None])

    def add(self, point: KeptCheckpoint) -> None:
        """Adds `point`, replacing one kept before at the same path."""
        self.checkpoints = [p for p in self.checkpoints if p.path != point.path] + [point]


def load_kept(runs: Runs, record_id: str) -> KeptCheckpoints:
    """The checkpoints of the record `record_id` kept in the store of `runs`
    (none when it has no `checkpoints.json` or it cannot be read)."""
    try:
        return KeptCheckpoints.model_validate_json(runs.read_bytes(record_id, CHECKPOINTS_FILE))
    except (OSError, RecordError, ValueError):
        return KeptCheckpoints()


def save_kept(runs: Runs, record_id: str, kept: KeptCheckpoints) -> None:
    """Writes the `checkpoints.json` of the record `record_id` (its follower
    is its one writer). Raises RecordError when it cannot be written."""
    runs.write_bytes(record_id, CHECKPOINTS_FILE, kept.model_dump_json(indent=2).encode() + b"\n")


def in_checkpoint(path: str, checkpoint: str) -> bool:
    """Whether the run's file `path` belongs to the checkpoint directory
    `checkpoint`: under it, or, for a training across nodes, under it in a
    node's `nodes/<rank>/` (that node's part)."""
    return path[len(node_dir(node_rank(path))) :].startswith(checkpoint.rstrip("/") + "/")


def last_kept(runs: Runs, record_id: str) -> KeptCheckpoint | None:
    """The last checkpoint of the record `record_id` kept in its store, None
    when none was."""
    return load_kept(runs, record_id).last


def sorted_against(
    kept: KeptCheckpoints, manifest: Sequence[FileDigest]
) -> tuple[list[str], list[str], list[str]]:
    """The directories of the kept checkpoints as a final retrieval with
    `manifest` finds them (across nodes, every node's part): (the same,
    every file as kept: not copied again; gone from the target, e.g. removed
    by `save_total_limit`: left as kept; changed since they were kept:
    copied again)."""
    same: list[str] = []
    gone: list[str] = []
    changed: list[str] = []
    for point in kept.checkpoints:
        listed = {f for f in manifest if in_checkpoint(f.path, point.path)}
        if not listed:
            gone.append(point.path)
        elif listed == {f.digest() for f in point.files}:
            same.append(point.path)
        else:
            changed.append(point.path)
    return same, gone, changed
