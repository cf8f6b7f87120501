"""The compare job: a base model and its fine-tune asked the same questions with llama.cpp.

Runs inside the job venv on the target (llama-cpp-python), in the compare's
directory, which holds:

    models/base.gguf    the base model, as a GGUF of the same quant type as the tuned one
    models/tuned.gguf   the fine-tuned model
    questions.json      the questions, a JSON list of strings
    scripts/            this script

Each model is loaded once and asks every question through its own chat
template (the GGUF's `tokenizer.chat_template`, rendered as llama-cpp-python
renders it), greedily (temperature 0, a fixed seed), each question from an
empty context so an answer never depends on the one before. Generation is
driven here, token by token, and stops at an end-of-generation token or at
`--max-tokens`: a model that never ends its answer (a tiny or broken one
emitting byte tokens, which llama-cpp-python's own `max_tokens` may not stop)
is cut at the limit and its answer marked `"cut": true`, never a crash.

One JSON object a line is appended to `answers.jsonl`, one per question and model:

    {"index": 0, "question": "...", "model": "base", "answer": "...", "tokens": 12,
     "prompt_tokens": 20, "seconds": 0.4, "prompt_seconds": 0.05, "tokens_per_s": 31.2,
     "cut": false, "template": true}

and to `metrics.jsonl`: `begin`, a `model` event per load, a `log` event per
answer (`step` counts the answers, so a follower shows the progress), `end`.

`models/` is removed when the job ends (unless `--keep-models`): the GGUFs stay
where they were exported, and a compare of large models would otherwise hold
two more copies of them on the target.

`tokens_per_s` is the decoding speed alone: the tokens evaluated after the first
one was sampled, over the time they took (the prompt's evaluation is in
`prompt_seconds`), which is what llama.cpp's `llama-bench` calls `tg`.

usage: python scripts/overbrainer_compare.py --max-tokens N --seed S [--threads N]
           [--gpu-layers N] [--keep-models]

Exits 2 with one line on stderr when an input is missing or unusable (no GGUF,
questions that are not a list of strings, a question longer than the model's
context), 3 when llama.cpp cannot load a model.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

MODELS_DIR = Path("models")
MODELS = (("base", MODELS_DIR / "base.gguf"), ("tuned", MODELS_DIR / "tuned.gguf"))
QUESTIONS_FILE = Path("questions.json")
ANSWERS_FILE = Path("answers.jsonl")
METRICS_FILE = Path("metrics.jsonl")

MIN_CTX = 512  # the smallest context a model is loaded with: room for a prompt and its answer


class CompareFailed(Exception):
    """An input is missing or a model cannot be loaded; the message is one line."""

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


def read_questions() -> list[str]:
    """The questions of questions.json. Raises CompareFailed when it is not a
    non-empty JSON list of strings."""
    try:
        questions = json.loads(QUESTIONS_FILE.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CompareFailed(
            f"no {QUESTIONS_FILE} in {Path.cwd()}: the questions were not staged"
        ) from None
    except ValueError:
        raise CompareFailed(f"{QUESTIONS_FILE} is not valid JSON") from None
    if (
        not isinstance(questions, list)
        or not questions
        or not all(isinstance(q, str) and q.strip() for q in questions)
    ):
        raise CompareFailed(f"{QUESTIONS_FILE} is not a non-empty list of non-empty strings")
    return questions


class Model:
    """One GGUF: its chat template, and the prompts of the questions in it."""

    def __init__(self, name: str, path: Path, questions: list[str]) -> None:
        import llama_cpp
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        if not path.is_file():
            raise CompareFailed(f"no {path} in {Path.cwd()}: the {name} model was not staged")
        self.name = name
        self.path = path
        try:
            vocab = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        except (ValueError, RuntimeError) as error:
            raise CompareFailed(
                f"llama.cpp cannot load the {name} model {path}: {error}", 3
            ) from None
        metadata = vocab.metadata
        arch = metadata.get("general.architecture", "")
        self.ctx_train = int(metadata.get(f"{arch}.context_length", 0) or 0)
        self.template = metadata.get("tokenizer.chat_template")
        eos, bos = vocab.token_eos(), vocab.token_bos()
        self.prompts: list[list[int]] = []
        for question in questions:
            if self.template:
                formatter = Jinja2ChatFormatter(
                    template=self.template,
                    eos_token=vocab._model.token_get_text(eos) if eos != -1 else "",
                    bos_token=vocab._model.token_get_text(bos) if bos != -1 else "",
                    stop_token_ids=[eos],
                )
                rendered = formatter(messages=[{"role": "user", "content": question}])
                tokens = vocab.tokenize(
                    rendered.prompt.encode("utf-8"),
                    add_bos=not rendered.added_special,
                    special=True,
                )
            else:  # no template: the question as it is, as a plain completion
                tokens = vocab.tokenize(question.encode("utf-8"), add_bos=True, special=False)
            self.prompts.append(tokens)
        vocab.close()

    def check_context(self, max_tokens: int) -> int:
        """The context to load the model with: the longest prompt and its answer,
        within the model's trained context. Raises CompareFailed naming the first
        question whose prompt leaves no room for an answer."""
        for index, prompt in enumerate(self.prompts):
            if self.ctx_train and len(prompt) >= self.ctx_train:
                raise CompareFailed(
                    f"question {index + 1} is {len(prompt)} tokens through the {self.name} "
                    f"model's chat template, and its context holds {self.ctx_train}: shorten it"
                )
        needed = max(len(p) for p in self.prompts) + max_tokens + 1
        return min(max(needed, MIN_CTX), self.ctx_train) if self.ctx_train else max(needed, MIN_CTX)


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


def compare(args: argparse.Namespace, answers: Lines, metrics: Lines) -> None:
    """Loads each model in turn and answers every question with it."""
    import llama_cpp

    questions = read_questions()
    models = [Model(name, path, questions) for name, path in MODELS]
    contexts = [model.check_context(args.max_tokens) for model in models]
    total = len(models) * len(questions)
    metrics.write(event="begin", questions=len(questions), max_steps=total, time=time.time())
    step = 0
    started = time.monotonic()
    for model, n_ctx in zip(models, contexts, strict=True):
        mark = time.monotonic()
        try:
            llm = llama_cpp.Llama(
                model_path=str(model.path),
                n_ctx=n_ctx,
                n_threads=args.threads or None,
                n_threads_batch=args.threads or None,
                n_gpu_layers=args.gpu_layers,
                seed=args.seed,
                verbose=False,
            )
        except (ValueError, RuntimeError) as error:
            raise CompareFailed(
                f"llama.cpp cannot load the {model.name} model: {error}", 3
            ) from None
        metrics.write(
            event="model",
            model=model.name,
            n_ctx=n_ctx,
            template=bool(model.template),
            seconds=round(time.monotonic() - mark, 3),
            time=time.time(),
        )
        for index, (question, prompt) in enumerate(zip(questions, model.prompts, strict=True)):
            cap = min(args.max_tokens, n_ctx - len(prompt))
            result = answer(llm, prompt, cap, args.seed)
            answers.write(
                index=index,
                question=question,
                model=model.name,
                **result,
                template=bool(model.template),
            )
            step += 1
            metrics.write(
                event="log",
                step=step,
                max_steps=total,
                model=model.name,
                question=index,
                tokens=result["tokens"],
                tokens_per_s=result["tokens_per_s"],
                cut=result["cut"],
                time=time.time(),
            )
            print(
                f"compare: {model.name} answered question {index + 1}/{len(questions)}: "
                f"{result['tokens']} tokens{' (cut at the limit)' if result['cut'] else ''}",
                flush=True,
            )
        llm.close()
    metrics.write(
        event="end", answers=step, seconds=round(time.monotonic() - started, 3), time=time.time()
    )


def main() -> int:
    """Entry point: parses the arguments, compares, and returns the exit code."""
    parser = argparse.ArgumentParser(description="Asks a base and a tuned GGUF the same questions.")
    parser.add_argument("--max-tokens", type=int, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--threads", type=int, default=0, help="0: llama.cpp decides")
    parser.add_argument("--gpu-layers", type=int, default=0, help="-1: every layer on the GPU")
    parser.add_argument("--keep-models", action="store_true", help="leave models/ in place")
    args = parser.parse_args()
    if args.max_tokens < 1:
        print(f"compare: --max-tokens is {args.max_tokens}: give 1 or more", file=sys.stderr)
        return 2
    answers, metrics = Lines(ANSWERS_FILE), Lines(METRICS_FILE)
    try:
        compare(args, answers, metrics)
    except CompareFailed as failure:
        print(f"compare failed: {failure}", file=sys.stderr, flush=True)
        return failure.code
    finally:
        if not args.keep_models:  # copies of GGUFs kept where they were exported
            shutil.rmtree(MODELS_DIR, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
