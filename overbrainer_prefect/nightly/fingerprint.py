"""The fingerprint of a fine-tune: what goes into it, not what comes out.

A nightly fine-tune whose data and settings did not change since the last
model it delivered trains nothing. What it would train is keyed by its parts:

- each dataset: the SHA-256 of a local file (of every file, for a directory),
  or the commit of a Hub dataset, resolved now (a full 40-hex `revision` is
  taken as it is);
- the base model: the commit of a Hub model (`extra.revision_of_model` when
  given), the SHA-256 of a directory on this machine, or the path itself for
  a directory that is only on the target;
- the training settings (each field of the `TrainingSpec` but the datasets'
  paths and the base model, which are keyed above by content), the export
  settings and the evaluation settings (its eval and controls files by
  content);
- the package's version.

The key is the SHA-256 of the parts. Training on a CPU is not bit-for-bit
repeatable, so the GGUF it gives is no key: two trainings of the same parts
are the same night. `differences` says which parts changed, in words.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterator, Mapping
from importlib import metadata
from pathlib import Path
from typing import Literal

from huggingface_hub import HfApi
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from pydantic import BaseModel, ConfigDict, Field

from overbrainer_prefect.executors.manifest import sha256_file
from overbrainer_prefect.trainers.spec import HUB_ID, TrainingSpec

PACKAGE = "overbrainer-prefect"
FULL_COMMIT = re.compile(r"^[0-9a-f]{40}$")
"""A Hub commit as the Hub names it: taken as it is, never resolved."""

DATASET_REVISION = "revision"  # axolotl's dataset key for a Hub dataset's revision
MODEL_REVISION = "revision_of_model"  # axolotl's config key for the base model's revision
SHOWN_VALUE = 40  # characters of a setting's value shown in a difference, at most
SHOWN_HASH = 12  # hex digits of a hash or commit shown in a difference

HubKind = Literal["model", "dataset"]
Resolver = Callable[[HubKind, str, str | None], str]
"""Resolves (kind, repository id, revision or None) to the Hub commit it names now."""


class FingerprintError(ValueError):
    """What would be trained cannot be fingerprinted (a file cannot be read, a
    Hub repository cannot be resolved). The message is one line saying what to do."""


class Fingerprint(BaseModel):
    """What a fine-tune would train, part by part, and the key of it all."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    key: str = Field(description="The SHA-256 of the parts.")
    parts: dict[str, str] = Field(
        description="Each part by name: `dataset 1`, `base model`, `training.learning_rate`..."
    )
    sources: dict[str, str] = Field(
        default_factory=dict,
        description="Where a part came from (a dataset's path), shown but not keyed: a "
        "prepared file whose path changes every night keys by its content.",
    )

    @property
    def short(self) -> str:
        """The key's first 12 hex digits."""
        return self.key[:SHOWN_HASH]


def package_version() -> str:
    """The installed version of this package (`unknown` when it is not installed)."""
    try:
        return metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:
        return "unknown"


def fingerprint(
    training: TrainingSpec,
    export: BaseModel | None,
    evaluation: BaseModel | None,
    resolve: Resolver,
    version: str | None = None,
) -> Fingerprint:
    """The fingerprint of training `training`, exporting with `export` and
    evaluating with `evaluation`, Hub repositories resolved with `resolve`.

    Raises FingerprintError with one line when a local dataset, eval file or
    base model directory cannot be read, or `resolve` cannot resolve a Hub
    repository.
    """
    parts: dict[str, str] = {}
    sources: dict[str, str] = {}
    for number, dataset in enumerate(training.datasets, 1):
        name = f"dataset {number}"
        sources[name] = dataset.path
        if dataset.is_local:
            parts[name] = _content(Path(dataset.path).expanduser(), f"dataset {dataset.path}")
        else:
            revision = dataset.options.get(DATASET_REVISION)
            commit = resolve("dataset", dataset.path, str(revision) if revision else None)
            parts[name] = f"{dataset.path}@{commit}"
        given = dataset.model_dump(mode="json", exclude={"path"}, exclude_none=True)
        given.pop(DATASET_REVISION, None)
        parts[f"{name} settings"] = _json(given)
    parts["base model"] = _base_model(training, resolve)
    sources["base model"] = training.base_model
    settings = training.model_dump(mode="json", exclude={"datasets", "base_model"})
    settings["extra"] = {k: v for k, v in settings["extra"].items() if k != MODEL_REVISION}
    parts.update(_flat("training", settings))
    if export is not None:
        parts.update(_flat("export", export.model_dump(mode="json")))
    if evaluation is not None:
        values = evaluation.model_dump(mode="json")
        for field in ("eval_file", "controls_file"):
            path = values.pop(field, None)
            if path:
                sources[f"evaluation.{field}"] = path
                parts[f"evaluation.{field}"] = _content(Path(path).expanduser(), path)
        parts.update(_flat("evaluation", values))
    parts["package"] = version if version is not None else package_version()
    key = hashlib.sha256(_json(parts).encode()).hexdigest()
    return Fingerprint(key=key, parts=parts, sources=sources)


def pinned(training: TrainingSpec, print_: Fingerprint) -> TrainingSpec:
    """`training` with each Hub dataset and a Hub base model pinned to the commit
    its fingerprint resolved (the datasets' `revision`, `extra.revision_of_model`),
    so the training reads exactly what was keyed, even if the Hub moves meanwhile."""
    datasets = []
    for number, dataset in enumerate(training.datasets, 1):
        value = print_.parts.get(f"dataset {number}", "")
        if not dataset.is_local and "@" in value:
            commit = value.rsplit("@", 1)[1]
            dataset = dataset.model_validate({**dataset.model_dump(), DATASET_REVISION: commit})
        datasets.append(dataset)
    extra = dict(training.extra)
    base = print_.parts.get("base model", "")
    if base.startswith(f"{training.base_model}@"):
        extra[MODEL_REVISION] = base.rsplit("@", 1)[1]
    return training.model_copy(update={"datasets": datasets, "extra": extra})


def differences(before: Fingerprint, after: Fingerprint) -> list[str]:
    """What changed from `before` to `after`, one phrase a part, in the order
    of `after`'s parts then the parts it no longer has: `dataset 1
    (data/chats.jsonl): sha256 1a2b3c4d5e6f → 9f8e7d6c5b4a`, `training.learning_rate:
    0.0002 → 0.0005`, `package: 0.1.0 → 0.2.0`. Empty when nothing changed."""
    changed = []
    for name, value in after.parts.items():
        was = before.parts.get(name)
        if was == value:
            continue
        where = after.sources.get(name)
        label = f"{name} ({where})" if where and not name.endswith("settings") else name
        if was is None:
            changed.append(f"{label}: new, {_shown(value)}")
        else:
            changed.append(f"{label}: {_shown(was)} → {_shown(value)}")
    changed += [f"{name}: removed" for name in before.parts if name not in after.parts]
    return changed


def hub_resolver(endpoint: str | None = None, token: str | None = None) -> Resolver:
    """A `Resolver` asking the Hub (`endpoint`, default huggingface_hub's:
    `$HF_ENDPOINT` or huggingface.co; `token`, default `$HF_TOKEN` or the
    cached login) for a repository's commit at a revision (default `main`).
    A full 40-hex revision is returned as it is, without asking.

    The resolver raises FingerprintError with one line when the repository or
    revision is not found, needs a token, or the Hub cannot be reached.
    """

    def resolve(kind: HubKind, repo: str, revision: str | None) -> str:
        if revision is not None and FULL_COMMIT.match(revision):
            return revision
        what = f"the Hub {kind} {repo}" + (f" at {revision}" if revision else "")
        api = HfApi(endpoint=endpoint, token=token)
        try:
            if kind == "model":
                sha = api.model_info(repo, revision=revision).sha
            else:
                sha = api.dataset_info(repo, revision=revision).sha
        except RevisionNotFoundError:
            raise FingerprintError(
                f"{what}: no such revision: give one the repository has"
            ) from None
        except GatedRepoError:
            raise FingerprintError(
                f"{what} is gated: accept its terms on the Hub and set HF_TOKEN on the worker"
            ) from None
        except RepositoryNotFoundError:
            raise FingerprintError(
                f"{what} is not found: check the id, or set HF_TOKEN on the worker for a "
                "private one"
            ) from None
        except OfflineModeIsEnabled:
            raise FingerprintError(
                f"{what} cannot be resolved: HF_HUB_OFFLINE is set; unset it, or pin "
                "a full 40-hex commit"
            ) from None
        except HfHubHTTPError as error:
            status = error.response.status_code if error.response is not None else "no answer"
            raise FingerprintError(
                f"{what} cannot be resolved (HTTP {status}): try again, or pin a full 40-hex commit"
            ) from None
        except OSError as error:
            raise FingerprintError(
                f"{what} cannot be resolved ({type(error).__name__}): check the worker's "
                "network, or pin a full 40-hex commit"
            ) from None
        if not sha:
            raise FingerprintError(f"{what}: the Hub answered no commit")
        return sha

    return resolve


def _base_model(training: TrainingSpec, resolve: Resolver) -> str:
    base = training.base_model
    local = Path(base).expanduser()
    if local.exists():
        return _content(local, f"base model {base}")
    if HUB_ID.match(base) and not base.startswith(("/", ".", "~")):
        revision = training.extra.get(MODEL_REVISION)
        return f"{base}@{resolve('model', base, str(revision) if revision else None)}"
    return f"path {base} (on the target, not read from here)"


def _content(path: Path, what: str) -> str:
    """`sha256:<hex>` of the file `path`, or of the sorted (relative path,
    SHA-256) list of every file below the directory `path`."""
    try:
        if path.is_dir():
            digest = hashlib.sha256()
            for file in sorted(_files(path)):
                digest.update(f"{file.relative_to(path).as_posix()}\0".encode())
                digest.update(sha256_file(file)[1].encode())
            return f"sha256:{digest.hexdigest()}"
        return f"sha256:{sha256_file(path)[1]}"
    except OSError as error:
        raise FingerprintError(
            f"{what} cannot be read ({error.strerror or type(error).__name__}): check the path"
        ) from None


def _files(directory: Path) -> Iterator[Path]:
    for path in directory.rglob("*"):
        if path.is_file():
            yield path


def _flat(prefix: str, values: Mapping[str, object]) -> dict[str, str]:
    """`values` as `prefix.key` → JSON, dictionaries flattened (`training.extra.x`)."""
    flat: dict[str, str] = {}
    for key, value in values.items():
        name = f"{prefix}.{key}"
        if isinstance(value, dict):  # an empty one adds nothing
            flat.update(_flat(name, value))
        elif value is not None:
            flat[name] = _json(value)
    return flat


def _json(value: object) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _shown(value: str) -> str:
    if value.startswith("sha256:"):
        return f"sha256 {value[7 : 7 + SHOWN_HASH]}"
    if "@" in value and FULL_COMMIT.match(value.rsplit("@", 1)[1]):
        repo, commit = value.rsplit("@", 1)
        return f"{repo}@{commit[:SHOWN_HASH]}"
    return value if len(value) <= SHOWN_VALUE else f"{value[: SHOWN_VALUE - 1]}…"
