"""Generation shared by the compare and evaluation jobs: a GGUF's prompts through its
own chat template, greedy answers driven token by token, and JSON lines.

Runs inside the job venv on the target (llama-cpp-python), imported by its
sibling job scripts under `scripts/` (`overbrainer_compare.py`,
`overbrainer_evaluate.py`), which share its entry point (`job_main`) and its
answering loop (`answers_of`). The orchestrator imports only `render` from it
(`evaluation/template.py`), so that the judge's prompt is rendered alike at
both ends; llama_cpp is imported where it is used, in the job venv only.

Each conversation is rendered through the GGUF's `tokenizer.chat_template` as
llama-cpp-python renders it (a GGUF without one gets the text as a plain
completion), and answered greedily (temperature 0, top-k 1, a fixed seed) from
an empty context, so an answer never depends on the one before. Generation stops
at an end-of-generation token or at the cap: a model that never ends its answer
(a tiny or broken one emitting byte tokens, which llama-cpp-python's own
`max_tokens` may not stop) is cut there and its answer marked `"cut": true`.

`tokens_per_s` is the decoding speed alone: the tokens evaluated after the first
one was sampled, over the time they took (the prompt's evaluation is in
`prompt_seconds`), which is what llama.cpp's `llama-bench` calls `tg`.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

MIN_CTX = 512  # the smallest context a model is loaded with: room for a prompt and its answer

MODELS_DIR = Path("models")
MODELS = (("base", MODELS_DIR / "base.gguf"), ("tuned", MODELS_DIR / "tuned.gguf"))
"""The two GGUFs a job asks, by name: staged hard links, removed when it ends."""
ANSWERS_FILE = Path("answers.jsonl")
METRICS_FILE = Path("metrics.jsonl")

PLACEHOLDER = re.compile(r"\{(question|expected|answer_a|answer_b)\}")
"""The judge template's placeholders (see `overbrainer_prefect.evaluation.template`)."""

Messages = list[dict[str, str]]
"""A conversation: `{"role": ..., "content": ...}` messages, the last one the user's."""


class JobFailed(Exception):
    """An input is missing or a model cannot be loaded; the message is one line.
    `code` is the job's exit code: 2 for an input, 3 for a model llama.cpp refuses."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


class Lines:
    """Appends JSON objects to a file, one flushed line each."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("a", encoding="utf-8")

    def write(self, **fields: Any) -> None:
        """Appends one object."""
        self.file.write(json.dumps(fields, ensure_ascii=False) + "\n")
        self.file.flush()


def render(template: str, question: str, expected: str, answer_a: str, answer_b: str) -> str:
    """The judge's prompt: `template` with its placeholders replaced in one pass, so
    an answer that itself holds `{answer_b}` is never expanded again. The package's
    `evaluation.template` renders with this same function."""
    values = {
        "question": question,
        "expected": expected,
        "answer_a": answer_a,
        "answer_b": answer_b,
    }
    return PLACEHOLDER.sub(lambda match: values[match.group(1)], template)


def plain_text(messages: Messages) -> str:
    """A conversation as a plain completion, for a GGUF without a chat template: a
    single user message as it is, several as `role: content` lines."""
    if len(messages) == 1:
        return messages[0]["content"]
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\nassistant:"


class Model:
    """One GGUF: its chat template, and the prompt tokens of each conversation in it.
    `what` names a conversation in messages (`question`, `item`).

    Raises JobFailed when the file is missing (2) or llama.cpp cannot read it (3)."""

    def __init__(
        self, name: str, path: Path, conversations: list[Messages], what: str = "question"
    ) -> None:
        import llama_cpp  # type: ignore[import-not-found]  # the job venv only
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter  # type: ignore[import-not-found]

        if not path.is_file():
            raise JobFailed(f"no {path} in {Path.cwd()}: the {name} model was not staged")
        self.name = name
        self.path = path
        self.what = what
        try:
            vocab = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        except (ValueError, RuntimeError) as error:
            raise JobFailed(f"llama.cpp cannot load the {name} model {path}: {error}", 3) from None
        metadata = vocab.metadata
        arch = metadata.get("general.architecture", "")
        self.ctx_train = int(metadata.get(f"{arch}.context_length", 0) or 0)
        self.template = metadata.get("tokenizer.chat_template")
        eos, bos = vocab.token_eos(), vocab.token_bos()
        self.prompts: list[list[int]] = []
        formatter = None
        if self.template:
            formatter = Jinja2ChatFormatter(
                template=self.template,
                eos_token=vocab._model.token_get_text(eos) if eos != -1 else "",
                bos_token=vocab._model.token_get_text(bos) if bos != -1 else "",
                stop_token_ids=[eos],
            )
        for messages in conversations:
            if formatter is not None:
                rendered = formatter(messages=messages)
                tokens = vocab.tokenize(
                    rendered.prompt.encode("utf-8"),
                    add_bos=not rendered.added_special,
                    special=True,
                )
            else:  # no template: the text as it is, as a plain completion
                text = plain_text(messages)
                tokens = vocab.tokenize(text.encode("utf-8"), add_bos=True, special=False)
            self.prompts.append(tokens)
        self.vocab = vocab

    def tokenize_answer(self, text: str) -> list[int]:
        """The tokens of `text` as an answer following a prompt (no BOS, no special
        tokens parsed from it)."""
        return list(self.vocab.tokenize(text.encode("utf-8"), add_bos=False, special=False))

    def close(self) -> None:
        """Frees the vocabulary-only model."""
        self.vocab.close()

    def check_context(self, max_tokens: int, extra: list[int] | None = None) -> int:
        """The context to load the model with: the longest prompt (plus `extra[i]`
        tokens after prompt i, when given) and its answer, within the model's trained
        context. Raises JobFailed naming the first conversation whose prompt leaves
        no room for an answer."""
        for index, prompt in enumerate(self.prompts):
            if self.ctx_train and len(prompt) >= self.ctx_train:
                raise JobFailed(
                    f"{self.what} {index + 1} is {len(prompt)} tokens through the {self.name} "
                    f"model's chat template, and its context holds {self.ctx_train}: shorten it"
                )
        lengths = [len(p) + (extra[i] if extra else 0) for i, p in enumerate(self.prompts)]
        needed = max(max(lengths) + 1, max(len(p) for p in self.prompts) + max_tokens + 1)
        return min(max(needed, MIN_CTX), self.ctx_train) if self.ctx_train else max(needed, MIN_CTX)


def load(path: Path, name: str, n_ctx: int, args: Any, logits_all: bool = False) -> Any:
    """`path` loaded by llama.cpp with `n_ctx`, the job's threads, GPU layers and seed
    (`args.threads`, `args.gpu_layers`, `args.seed`). Raises JobFailed (3) when
    llama.cpp cannot load it."""
    import llama_cpp

    try:
        return llama_cpp.Llama(
            model_path=str(path),
            n_ctx=n_ctx,
            n_threads=args.threads or None,
            n_threads_batch=args.threads or None,
            n_gpu_layers=args.gpu_layers,
            seed=args.seed,
            logits_all=logits_all,
            verbose=False,
        )
    except (ValueError, RuntimeError) as error:
        raise JobFailed(f"llama.cpp cannot load the {name} model: {error}", 3) from None


def load_model(model: Model, n_ctx: int, args: Any, metrics: Lines) -> Any:
    """`model` loaded as `load` does, its `model` event (context, template, load
    seconds) written to `metrics`. Raises JobFailed (3) when llama.cpp cannot load it."""
    mark = time.monotonic()
    llm = load(model.path, model.name, n_ctx, args)
    metrics.write(
        event="model",
        model=model.name,
        n_ctx=n_ctx,
        template=bool(model.template),
        seconds=round(time.monotonic() - mark, 3),
        time=time.time(),
    )
    return llm


def answer(llm: Any, prompt: list[int], cap: int, seed: int) -> dict[str, Any]:
    """The greedy answer to `prompt`, from an empty context, at most `cap` tokens."""
    import llama_cpp

    vocab = llm._model.vocab
    llm.reset()  # no prefix of the previous prompt is reused: each answer stands alone
    llm.set_seed(seed)
    tokens: list[int] = []
    decoded = 0
    ended = False
    started = time.perf_counter()
    first = last = started
    for token in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, reset=True):
        last = time.perf_counter()
        if decoded == 0:
            first = last
        decoded += 1
        if llama_cpp.llama_vocab_is_eog(vocab, token):
            ended = True
            break
        tokens.append(token)
        if len(tokens) >= cap:
            break
    text = llm.detokenize(tokens).decode("utf-8", errors="replace")
    speed = (decoded - 1) / (last - first) if decoded > 1 and last > first else None
    return {
        "answer": text.strip(),
        "tokens": len(tokens),
        "prompt_tokens": len(prompt),
        "seconds": round(last - started, 4),
        "prompt_seconds": round(first - started, 4),
        "tokens_per_s": round(speed, 2) if speed is not None else None,
        "cut": not ended,
    }


def answers_of(
    job: str, model: Model, n_ctx: int, args: Any, metrics: Lines
) -> Iterator[tuple[int, dict[str, Any]]]:
    """Loads `model` (its `model` event written to `metrics`) and yields the index
    and the greedy answer (see `answer`) of each of its prompts, each within
    `args.max_tokens` and the context, printing a line for each as `job`; frees
    the model after the last. Raises JobFailed (3) when llama.cpp cannot load it."""
    llm = load_model(model, n_ctx, args, metrics)
    try:
        for index, prompt in enumerate(model.prompts):
            result = answer(llm, prompt, min(args.max_tokens, n_ctx - len(prompt)), args.seed)
            cut = " (cut at the limit)" if result["cut"] else ""
            print(
                f"{job}: {model.name} answered {model.what} {index + 1}/{len(model.prompts)}: "
                f"{result['tokens']} tokens{cut}",
                flush=True,
            )
            yield index, result
    finally:
        llm.close()


def job_main(
    job: str, description: str, work: Callable[[argparse.Namespace, Lines, Lines], None]
) -> int:
    """The entry point of a job that asks the GGUFs of `models/`: parses its
    arguments (`--max-tokens N --seed S [--threads N] [--gpu-layers N]
    [--keep-models]`), runs `work` with them and the answers and metrics files,
    and removes `models/` at the end unless `--keep-models` (copies of GGUFs
    kept where they were exported). Returns the exit code: 0, 2 with one line
    on stderr for a bad input, 3 for a model llama.cpp refuses."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--max-tokens", type=int, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--threads", type=int, default=0, help="0: llama.cpp decides")
    parser.add_argument("--gpu-layers", type=int, default=0, help="-1: every layer on the GPU")
    parser.add_argument("--keep-models", action="store_true", help="leave models/ in place")
    args = parser.parse_args()
    if args.max_tokens < 1:
        print(f"{job}: --max-tokens is {args.max_tokens}: give 1 or more", file=sys.stderr)
        return 2
    try:
        work(args, Lines(ANSWERS_FILE), Lines(METRICS_FILE))
    except JobFailed as failure:
        print(f"{job} failed: {failure}", file=sys.stderr, flush=True)
        return failure.code
    finally:
        if not args.keep_models:
            shutil.rmtree(MODELS_DIR, ignore_errors=True)
    return 0
