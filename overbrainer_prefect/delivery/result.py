"""What the deliver flow returns, and why it fails."""

from __future__ import annotations

import re

from pydantic import BaseModel, Field

from overbrainer_prefect.delivery.record import Delivery
from overbrainer_prefect.runs.store import RunRecord

DEFAULT_HF_BLOCK = "huggingface"
"""The Hugging Face credentials block a Hub delivery uses unless told otherwise."""


class DeliveryFailed(Exception):
    """A delivery was refused before anything was sent, or a destination failed.
    The message is one line saying what to do next."""


class DeliveryResult(BaseModel):
    """What the deliver flow returns (and Prefect persists): each delivery made."""

    run_id: str
    deliveries: list[Delivery] = Field(default_factory=list)


def ollama_model_name(
    record: RunRecord, quant: str, model_name: str | None, prefix: str | None
) -> str:
    """The Ollama model a run is created as: `model_name`, else `<base>-<run-id>`
    (`<base>`: the base model's last name, lowercase), after `prefix`, tagged
    `:<quant>` unless it has a tag."""
    if model_name:
        name = model_name.strip()
    else:
        base = str((record.spec or {}).get("base_model") or "model").rstrip("/")
        slug = re.sub(r"[^a-z0-9._-]+", "-", base.rsplit("/", 1)[-1].lower()).strip("-.")
        name = f"{slug or 'model'}-{record.id}"
    name = f"{prefix or ''}{name}"
    if ":" not in name.rsplit("/", 1)[-1]:
        name = f"{name}:{quant}"
    return name


def deliver_again(run_id: str, quant: str, **params: str | None) -> str:
    """The deliver flow with the parameters that deliver `run_id` again."""
    given = [f"{k}={v}" for k, v in params.items() if v is not None]
    return f"the deliver flow (run_id={run_id}, {', '.join(given)}, quant={quant})"
