"""Writes (or checks) the axolotl config keys the orchestrator knows without axolotl.

Run with a job venv's Python, where axolotl is installed:

    .venv-job/bin/python scripts/axolotl_keys.py          # writes its release line's list
    .venv-job/bin/python scripts/axolotl_keys.py --check  # exit 1 when it is stale

The list (`overbrainer_prefect/trainers/axolotl_keys/<line>.json`, one for each
axolotl release line the trainer supports: `0.21.json` for 0.21.x) holds every key of
axolotl's config schema (`AxolotlInputConfig`, with its aliases) and of its SFT
dataset schema (`SFTDataset`), and the axolotl version they were read from. The
pre-flight checks read it to refuse an unknown `extra` or dataset key before a
run exists; the orchestrator never imports axolotl.
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
from pathlib import Path
from typing import Any

from axolotl.utils.schemas.config import AxolotlInputConfig
from axolotl.utils.schemas.datasets import SFTDataset

KEYS_DIR = Path(__file__).resolve().parents[1] / "overbrainer_prefect" / "trainers" / "axolotl_keys"


def keys_of(model: Any) -> list[str]:
    """The field names of a pydantic model, with their validation aliases."""
    names: set[str] = set()
    for name, field in model.model_fields.items():
        names.add(name)
        if isinstance(field.alias, str):
            names.add(field.alias)
        choices = getattr(field.validation_alias, "choices", None) or []
        names.update(c for c in choices if isinstance(c, str))
        if isinstance(field.validation_alias, str):
            names.add(field.validation_alias)
    return sorted(names)


def key_list() -> dict[str, Any]:
    """The key list of the installed axolotl."""
    return {
        "axolotl": importlib.metadata.version("axolotl"),
        "config": keys_of(AxolotlInputConfig),
        "dataset": keys_of(SFTDataset),
    }


def main() -> int:
    keys = key_list()
    major, minor = keys["axolotl"].split(".")[:2]
    out = KEYS_DIR / f"{major}.{minor}.json"
    text = json.dumps(keys, indent=1) + "\n"
    if "--check" in sys.argv[1:]:
        if not out.is_file() or out.read_text(encoding="utf-8") != text:
            print(f"{out} is stale: run {Path(__file__).name} with the job venv's Python")
            return 1
        print(f"{out} matches axolotl {keys['axolotl']}")
        return 0
    out.write_text(text, encoding="utf-8")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
