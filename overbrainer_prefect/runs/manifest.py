"""The verified manifest of a record's retrieved files (`manifest.json`, kept
beside them in its store), and the check that a stored file is still what
the manifest says."""

from __future__ import annotations

from pydantic import TypeAdapter

from overbrainer_prefect.executors.base import FileDigest
from overbrainer_prefect.executors.manifest import recheck
from overbrainer_prefect.runs.store import Runs
from overbrainer_prefect.store.records import RecordError

MANIFEST_FILE = "manifest.json"
"""The verified manifest of a run's retrieved files, kept beside them in its store."""

_MANIFEST = TypeAdapter(list[FileDigest])


def manifest_bytes(manifest: list[FileDigest]) -> bytes:
    """A manifest as it is kept."""
    return _MANIFEST.dump_json(manifest, indent=2) + b"\n"


def load_manifest(runs: Runs, record_id: str) -> list[FileDigest]:
    """The verified manifest saved by the last retrieval of the record
    `record_id` (empty when there was none or it cannot be read)."""
    try:
        return _MANIFEST.validate_json(runs.read_bytes(record_id, MANIFEST_FILE))
    except (OSError, RecordError, ValueError):
        return []


def has_manifest(runs: Runs, record_id: str) -> bool:
    """Whether a retrieval of the record `record_id` was verified (its manifest kept)."""
    try:
        return runs.exists(record_id, MANIFEST_FILE)
    except RecordError:
        return False


def stored_wrong(runs: Runs, record_id: str, entry: FileDigest) -> str | None:
    """What is wrong with the stored file `entry` of the record `record_id`
    (`is missing`, `has N bytes...`, `differs from...`), None when it is as
    the manifest says: hashed again in a local store; in an object store,
    its size and the SHA-256 the store keeps."""
    key = runs.key(record_id, entry.path)
    local = runs.store.local_path(key)
    if local is not None:
        return recheck(local, entry.size, entry.sha256)
    try:
        info = runs.store.head(key)
    except Exception as error:  # the store's own failure, said in one line
        return f"cannot be read ({error})"
    if info is None:
        return "is missing"
    if info.size != entry.size:
        return f"has {info.size} bytes, not the {entry.size} it was retrieved with"
    if (
        info.sha256 is not None
        and entry.size <= runs.store.part_size
        and info.sha256 != entry.sha256
    ):
        return "differs from the file that was retrieved (its SHA-256 changed)"
    return None
