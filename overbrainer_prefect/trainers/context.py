"""The context length a base model was trained for, from its `config.json`.

Read from the model's directory when `base_model` is one on this machine,
else from the Hugging Face Hub (the config file only). A model whose config
cannot be read is not an error: the caller gets a warning instead, and the
job's own checks apply.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
"""Where configs name their context length, in the order they are looked up."""


def context_of(config: Mapping[str, object]) -> int | None:
    """The context length a transformers `config.json` names (a multimodal
    model's text part), or None when it names none."""
    text = config.get("text_config")
    if isinstance(text, Mapping) and not any(k in config for k in CONTEXT_KEYS):
        config = text
    for key in CONTEXT_KEYS:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def context_length(base_model: str, token: str | None = None) -> tuple[int | None, str | None]:
    """The context length of `base_model` (a model directory, or a Hub id) and
    a warning when it cannot be read (no config.json, the Hub unreachable or
    `HF_HUB_OFFLINE` set): (length or None, warning or None). Never raises."""
    local = Path(base_model).expanduser()
    if local.is_dir():
        path = local / "config.json"
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            return None, f"cannot read {path} ({type(exc).__name__}): sequence_len is not checked"
    elif base_model.startswith(("/", ".", "~")):
        return None, f"{base_model} is not a directory here: sequence_len is not checked"
    else:
        try:
            from huggingface_hub import hf_hub_download

            downloaded = hf_hub_download(base_model, "config.json", token=token)
            config = json.loads(Path(downloaded).read_text(encoding="utf-8"))
        except Exception as exc:
            return None, (
                f"cannot read the config.json of {base_model} from the Hugging Face Hub "
                f"({type(exc).__name__}): sequence_len is not checked"
            )
    if not isinstance(config, Mapping):
        return None, f"the config.json of {base_model} is not a JSON object"
    return context_of(config), None
