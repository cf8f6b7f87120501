"""The config keys axolotl knows, per axolotl release line, read from the lists
shipped with the package.

`axolotl_keys/<line>.json` (`0.19.json`, `0.21.json`) is generated from that
axolotl's own pydantic schema by `scripts/axolotl_keys.py` (run with a job
venv's Python), and a test checks that each still matches: the orchestrator
never imports axolotl, yet refuses a key axolotl would drop, suggesting the
nearest one it knows.

A spec is checked when it is made against every line's keys together (which
axolotl runs it is known only once its target is probed); the trainer checks it
again against the line the probe found (`keys_for`).
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from importlib import resources

KEYS_DIR = "axolotl_keys"


@dataclass(frozen=True)
class AxolotlKeys:
    """The keys of one axolotl release line."""

    version: str
    """The axolotl version the list was generated from (`0.21.0`)."""
    config: frozenset[str]
    """Every top-level key of its config schema."""
    dataset: frozenset[str]
    """Every key of its (SFT) dataset entry."""


def release_line(version: str) -> tuple[int, int] | None:
    """`(0, 21)` for `0.21.0`, `0.21` or `0.21.0.dev1`; None when `version` does
    not start with two numbers."""
    found = re.match(r"(\d+)\.(\d+)", version)
    return (int(found[1]), int(found[2])) if found else None


def _load() -> dict[tuple[int, int], AxolotlKeys]:
    shipped: dict[tuple[int, int], AxolotlKeys] = {}
    folder = resources.files("overbrainer_prefect.trainers").joinpath(KEYS_DIR)
    for entry in folder.iterdir():
        if not entry.name.endswith(".json"):
            continue
        found = json.loads(entry.read_text("utf-8"))
        keys = AxolotlKeys(
            version=str(found["axolotl"]),
            config=frozenset(str(k) for k in found["config"]),
            dataset=frozenset(str(k) for k in found["dataset"]),
        )
        line = release_line(keys.version)
        if line is None or entry.name != f"{line[0]}.{line[1]}.json":
            raise RuntimeError(f"{KEYS_DIR}/{entry.name} holds axolotl {keys.version}'s keys")
        shipped[line] = keys
    return dict(sorted(shipped.items()))


SHIPPED = _load()
"""Each release line's keys, oldest first."""

VERSIONS: tuple[str, ...] = tuple(k.version for k in SHIPPED.values())
"""The axolotl versions the lists were generated from, oldest first."""

AXOLOTL_VERSION = VERSIONS[-1]
"""The newest of them: the axolotl `scripts/job-env.sh` installs."""

OLDEST_LINE = next(iter(SHIPPED))
"""The oldest release line the trainer writes configs for."""

CONFIG_KEYS: frozenset[str] = frozenset().union(*(k.config for k in SHIPPED.values()))
"""Every top-level config key some shipped axolotl line knows."""

DATASET_KEYS: frozenset[str] = frozenset().union(*(k.dataset for k in SHIPPED.values()))
"""Every dataset key some shipped axolotl line knows."""


def keys_for(version: str) -> AxolotlKeys | None:
    """The keys of the release line of axolotl `version` (`0.19.1` reads 0.19's),
    None when none is shipped for it."""
    line = release_line(version)
    return None if line is None else SHIPPED.get(line)


def unknown_key(
    key: str, known: Collection[str], what: str, versions: Sequence[str] = VERSIONS
) -> str | None:
    """One line refusing `key` when it is not in `known` (the keys of axolotl
    `versions`), with the closest known key when there is one (`what` names the
    kind of key); None when it is known."""
    if key in known:
        return None
    near = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    hint = f"did you mean `{near[0]}`?" if near else "see axolotl's config reference"
    which = f"axolotl {' and '.join(versions)} {'does' if len(versions) == 1 else 'do'}"
    return f"unknown {what} `{key}` ({which} not know it): {hint}"
