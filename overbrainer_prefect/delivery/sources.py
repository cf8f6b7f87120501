"""What a run delivers, checked before it leaves: the GGUF of its export of a
quant type, and its adapter (the top-level files of `output/`), each file
hashed again and compared with the SHA-256 manifest it was retrieved with.

An export lives in `runs/<run-id>/exports/<export-id>/` (`export.json`, its
retrieved `gguf/<name>-<quant>.gguf` and the `manifest.json` of the
retrieval); the run's own `manifest.json` lists its `output/` files.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path

from overbrainer_prefect.delivery import DeliveryError
from overbrainer_prefect.executors.manifest import recheck
from overbrainer_prefect.runs.manifest import load_manifest
from overbrainer_prefect.runs.store import RunRecord, Runs, RunState
from overbrainer_prefect.store import StoreError

OUTPUT_DIR = "output"
"""Where a run's adapter (or full model) is, in its run directory."""

EXPORT_KIND = "export"
"""The kind of an export's record (`exports/<id>/export.json`)."""

NOT_DELIVERED = ("checkpoint-*", "README.md", "training_args.bin")
"""Files of `output/` never delivered: checkpoints (resumable training state),
axolotl's own card (the delivery writes its own) and the trainer's pickled
arguments (the card lists the settings instead)."""

_QUANT = re.compile(r"^[a-z0-9_]+$")


class SourceError(DeliveryError):
    """What a delivery needs is missing locally or does not match its manifest."""


@dataclass(frozen=True)
class LocalFile:
    """A file to deliver: where it is, its path in the run directory as messages
    name it (`runs/R/output/adapter_model.safetensors`), and its verified size
    and SHA-256."""

    path: Path
    shown: str
    size: int
    sha256: str

    @property
    def name(self) -> str:
        """The file's name."""
        return self.path.name


@dataclass(frozen=True)
class ExportedGguf:
    """The verified GGUF of a succeeded export of a run."""

    run_id: str
    export_id: str
    quant: str
    file: LocalFile


def normalize_quant(quant: str) -> str:
    """A quant type as exports name it (`Q4_K_M` → `q4_k_m`).

    Raises SourceError when it is not a quant type name.
    """
    value = quant.strip().lower()
    if not _QUANT.match(value):
        raise SourceError(
            f"{quant!r} is not a quant type: use one like q4_k_m, q5_k_m, q8_0 or f16"
        )
    return value


def find_gguf(runs: Runs, record: RunRecord, quant: str) -> ExportedGguf:
    """The GGUF of the latest succeeded export of run `record` of type `quant`,
    checked against the manifest of the export's retrieval.

    Raises SourceError with one line when the run has no such export (saying to
    run the export flow), or when its GGUF is missing or differs from its
    manifest (saying to export it again).
    """
    quant = normalize_quant(quant)
    exports = runs.children(record.id, EXPORT_KIND)
    candidates: list[tuple[str, RunRecord, str, int, str]] = []
    for export in exports.list(skipped=lambda _name, _error: None):
        if export.state != RunState.SUCCEEDED:
            continue
        spec_quant = str((export.spec or {}).get("quant", "")).lower()
        for entry in load_manifest(exports, export.id):
            if not (entry.path.startswith("gguf/") and entry.path.endswith(".gguf")):
                continue
            named = entry.path.lower().endswith(f"-{quant}.gguf")
            if spec_quant == quant or (not spec_quant and named):
                when = export.ended or export.created
                candidates.append((when, export, entry.path, entry.size, entry.sha256))
    if not candidates:
        raise SourceError(
            f"run {record.id} has no succeeded export of quant {quant}: run the export flow "
            f"(run_id={record.id}, quant={quant}) first"
        )
    _, export, rel, size, sha256 = max(candidates, key=lambda c: (c[0], c[1].id))
    shown = f"runs/{record.id}/exports/{export.id}/{rel}"
    again = f"export it again with the export flow (run_id={record.id}, quant={quant})"
    file = verified(local_copy(exports, export.id, rel, again), shown, size, sha256, again)
    return ExportedGguf(run_id=record.id, export_id=export.id, quant=quant, file=file)


def adapter_files(runs: Runs, record: RunRecord) -> list[LocalFile]:
    """The files a run's adapter (or full model) is delivered as: the top-level
    files of its `output/`, less `NOT_DELIVERED`, each checked against the run's
    manifest.

    Raises SourceError with one line when the run has no retrieved output or a
    file differs from its manifest.
    """
    manifest = {
        entry.path: entry
        for entry in load_manifest(runs, record.id)
        if entry.path.startswith(f"{OUTPUT_DIR}/") and entry.path.count("/") == 1
    }
    again = f"retrieve it again with the attach flow (run_id={record.id})"
    files = []
    for rel in sorted(manifest):
        name = rel.split("/", 1)[1]
        if any(fnmatchcase(name, pattern) for pattern in NOT_DELIVERED):
            continue
        entry = manifest[rel]
        path = local_copy(runs, record.id, rel, again)
        files.append(verified(path, f"runs/{record.id}/{rel}", entry.size, entry.sha256, again))
    if not files:
        raise SourceError(
            f"run {record.id} has no verified files in {OUTPUT_DIR}/ to deliver: {again}"
        )
    return files


def local_copy(runs: Runs, record_id: str, rel: str, again: str) -> Path:
    """The file `rel` of the record `record_id` on this machine: where it is,
    in a local runs directory; fetched from an object store into this
    process's staging directory otherwise (Ollama and the Hub take a model's
    bytes from the process that delivers it). Raises SourceError."""
    path = runs.run_dir(record_id) / rel
    if runs.store.local_path(runs.key(record_id, rel)) is not None:
        return path
    try:
        runs.store.get_file(runs.key(record_id, rel), path)
    except FileNotFoundError:
        raise SourceError(f"{runs.where_of(record_id, rel)} is not in the store: {again}") from None
    except StoreError as error:
        raise SourceError(f"cannot fetch {runs.where_of(record_id, rel)}: {error}") from None
    return path


def verified(path: Path, shown: str, size: int, sha256: str, again: str) -> LocalFile:
    """The file `path` once hashed again and found to have `size` and `sha256`.

    Raises SourceError naming it as `shown`, with `again` as the next step, when it
    is missing, unreadable or different.
    """
    if (wrong := recheck(path, size, sha256)) is not None:
        raise SourceError(f"{shown} {wrong}: {again}")
    return LocalFile(path=path, shown=shown, size=size, sha256=sha256)
