"""Asks the base model and the fine-tuned one the same questions, greedily.

usage: ask.py BASE_DIR ADAPTER_DIR QUESTION [QUESTION...]

Runs in the job venv (torch, transformers, peft), on the CPU. Each question is
put through the tokenizer's chat template and answered with greedy decoding
(at most MAX_NEW_TOKENS), first by the base model, then by the base with the
LoRA adapter applied. Prints one JSON line per question on stdout:
`{"question": ..., "base": ..., "tuned": ...}`.

Exits 1 with one line when a directory is missing; raises what transformers or
peft raise when a model cannot be loaded.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

MAX_NEW_TOKENS = 40  # the fact is one 14-token sentence; room for the base model to ramble a bit


def answer(model: Any, tokenizer: Any, question: str) -> str:
    """The model's greedy answer to `question`, without the prompt or special tokens."""
    import torch

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(
            **prompt,
            max_new_tokens=MAX_NEW_TOKENS,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
        )
    new = out[0, prompt["input_ids"].shape[1] :]
    return str(tokenizer.decode(new, skip_special_tokens=True)).strip()


def main() -> None:
    """Entry point: loads both models once and answers every question with each."""
    if len(sys.argv) < 4:
        sys.exit("usage: ask.py BASE_DIR ADAPTER_DIR QUESTION [QUESTION...]")
    base_dir, adapter_dir, questions = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
    for d in (base_dir, adapter_dir):
        if not d.is_dir():
            sys.exit(f"{d} is not a directory: give the base model and the run's adapter")

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model.eval()
    base = [answer(model, tokenizer, q) for q in questions]
    tuned_model = PeftModel.from_pretrained(model, adapter_dir)
    tuned_model.eval()
    tuned = [answer(tuned_model, tokenizer, q) for q in questions]
    for q, b, t in zip(questions, base, tuned, strict=True):
        print(json.dumps({"question": q, "base": b, "tuned": t}), flush=True)


if __name__ == "__main__":
    main()
