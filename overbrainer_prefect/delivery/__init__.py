"""Delivery: putting what a run made where people run models.

- `ollama`: pushes a verified GGUF to an Ollama server as a blob named by its
  SHA-256 and creates the model with its chat template and parameters;
- `hub`: creates a Hugging Face Hub repository (private by default) and
  commits the adapter and/or the GGUF with a model card, in one commit;
- `modelcard`: writes that card with huggingface_hub's `ModelCard` (base
  model, dataset files, settings, loss);
- `sources`: finds what a run delivers (the GGUF of its export, its adapter)
  and checks each file against the SHA-256 manifest it was retrieved with;
- `gguf_metadata`: reads a GGUF's header (its chat template) without loading it;
- `record`: keeps `runs/<run-id>/deliveries.json`;
- `deliver`: a delivery from its checks to its record (what the `deliver`
  flow calls).

None of it imports Prefect: the `deliver` flow adds the logs and the link
artifacts.
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit


class DeliveryError(Exception):
    """Something could not be delivered. The message is one line saying what
    happened and what to do; it never quotes a secret."""


def public_url(url: str) -> str:
    """`url` without a user name or password, as messages and records show it."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url.rstrip("/")
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment)).rstrip("/")
