"""The config keys axolotl knows, read from the list shipped with the package.

`axolotl_keys.json` is generated from the pinned axolotl's own pydantic
schema by `scripts/axolotl_keys.py` (run with the job venv's Python), and a
test checks that it still matches: the orchestrator never imports axolotl,
yet refuses a key axolotl would drop, suggesting the nearest one it knows.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Collection
from importlib import resources

KEYS_FILE = "axolotl_keys.json"


def _load() -> dict[str, object]:
    text = resources.files("overbrainer_prefect.trainers").joinpath(KEYS_FILE).read_text("utf-8")
    loaded: dict[str, object] = json.loads(text)
    return loaded


_KEYS = _load()

AXOLOTL_VERSION = str(_KEYS["axolotl"])
"""The axolotl version the key list was generated from."""

CONFIG_KEYS: frozenset[str] = frozenset(str(k) for k in _KEYS["config"])  # type: ignore[attr-defined]
"""Every top-level key of axolotl's config schema."""

DATASET_KEYS: frozenset[str] = frozenset(str(k) for k in _KEYS["dataset"])  # type: ignore[attr-defined]
"""Every key of an axolotl (SFT) dataset entry."""


def unknown_key(key: str, known: Collection[str], what: str) -> str | None:
    """One line refusing `key` when it is not in `known`, with the closest known
    key when there is one (`what` names the kind of key); None when it is known."""
    if key in known:
        return None
    near = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    hint = f"did you mean `{near[0]}`?" if near else "see axolotl's config reference"
    return f"unknown {what} `{key}` (axolotl {AXOLOTL_VERSION} does not know it): {hint}"
