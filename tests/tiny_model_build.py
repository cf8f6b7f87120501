"""Builds the tiny model and chat dataset the tests fine-tune, with no Hub access.

Run in the job venv (it needs sentencepiece, transformers and torch):

    .venv-job/bin/python tests/tiny_model_build.py OUT_DIR

It writes `OUT_DIR/chat.jsonl` (64 conversations in the `messages` format) and
`OUT_DIR/model/`: a 2-layer Llama (hidden 64) with a 320-piece SentencePiece
tokenizer (byte fallback, the ChatML tokens as user symbols) and a ChatML chat
template, about 120k parameters. Deterministic: the same script builds the same
files. `write_dataset` needs nothing but the standard library, so the tests can
import it from the orchestrator venv.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROWS = 64  # conversations in the dataset: 16 steps of batch 4 per epoch
VOCAB = 320  # SentencePiece pieces: 256 bytes + 3 specials + 2 ChatML symbols + merges
CHATML = ["<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
THINGS = ["sky", "grass", "sun", "snow", "sea", "coal", "rose", "lemon"]
COLOURS = ["blue", "green", "yellow", "white", "blue", "black", "red", "yellow"]
ASKS = [
    "What colour is the {thing}?",
    "Tell me the colour of the {thing}.",
    "Which colour has the {thing}?",
    "Name the colour of the {thing}, please.",
    "I wonder what colour the {thing} is.",
    "Colour of the {thing}?",
    "Do you know the colour of the {thing}?",
    "Say the colour of the {thing}.",
]


def conversations() -> list[dict[str, list[dict[str, str]]]]:
    """The dataset's rows: a question and a short answer, short enough for
    `sequence_len: 64`."""
    rows = []
    for i in range(ROWS):
        thing, colour = THINGS[i % len(THINGS)], COLOURS[i % len(COLOURS)]
        ask = ASKS[(i // len(THINGS)) % len(ASKS)].format(thing=thing)
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": ask},
                    {"role": "assistant", "content": f"The {thing} is {colour}."},
                ]
            }
        )
    return rows


def write_dataset(path: Path) -> Path:
    """Writes the chat dataset as JSON lines at `path` and returns it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in conversations()))
    return path


def build_model(model_dir: Path, dataset: Path) -> None:
    """Trains the tokenizer on the dataset's text and saves a randomly initialised
    tiny Llama with it in `model_dir`. Fails when sentencepiece, transformers,
    torch or protobuf are missing from this interpreter."""
    import sentencepiece as spm
    import torch
    import transformers.convert_slow_tokenizer as convert_slow
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaTokenizer
    from transformers.utils import sentencepiece_model_pb2_new

    # sentencepiece 0.2.3 ships a protobuf 7 parser; the job venv has protobuf 6 (modal
    # pins <7), so transformers' own parser reads tokenizer.model for the conversion.
    convert_slow.import_protobuf = lambda *_: sentencepiece_model_pb2_new

    model_dir.mkdir(parents=True, exist_ok=True)
    texts = []
    for line in dataset.read_text().splitlines():
        texts.extend(m["content"] for m in json.loads(line)["messages"])
    corpus = model_dir / "corpus.txt"
    corpus.write_text("\n".join(texts * 4) + "\n")
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(model_dir / "tokenizer"),
        vocab_size=VOCAB,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        user_defined_symbols=CHATML,
        num_threads=1,
        minloglevel=2,
    )
    corpus.unlink()
    (model_dir / "tokenizer.vocab").unlink()
    tokenizer = LlamaTokenizer.from_pretrained(str(model_dir))
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.pad_token = "</s>"
    tokenizer.save_pretrained(str(model_dir))

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(str(model_dir))


def main(out: Path) -> None:
    """Writes `out/chat.jsonl` and `out/model/`."""
    dataset = write_dataset(out / "chat.jsonl")
    build_model(out / "model", dataset)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: tiny_model_build.py OUT_DIR")
    main(Path(sys.argv[1]))
