"""The compare job: a base model and its fine-tune asked the same questions with llama.cpp.

Runs inside the job venv on the target (llama-cpp-python), in the compare's
directory, which holds:

    models/base.gguf    the base model, as a GGUF of the same quant type as the tuned one
    models/tuned.gguf   the fine-tuned model
    questions.json      the questions, a JSON list of strings
    scripts/            this script and `overbrainer_generate.py`, the generation it
                        shares with the evaluation job

Each model is loaded once and asks every question through its own chat
template, greedily, with a fixed seed, each question from an empty context
(see `overbrainer_generate.py`): an answer cut at `--max-tokens` is marked
`"cut": true`, never a crash.

One JSON object a line is appended to `answers.jsonl`, one per question and model:

    {"index": 0, "question": "...", "model": "base", "answer": "...", "tokens": 12,
     "prompt_tokens": 20, "seconds": 0.4, "prompt_seconds": 0.05, "tokens_per_s": 31.2,
     "cut": false, "template": true}

and to `metrics.jsonl`: `begin`, a `model` event per load, a `log` event per
answer (`step` counts the answers, so a follower shows the progress), `end`.

`models/` is removed when the job ends (unless `--keep-models`): the GGUFs stay
where they were exported, and a compare of large models would otherwise hold
two more copies of them on the target.

`tokens_per_s` is the decoding speed alone (llama-bench's `tg`).

usage: python scripts/overbrainer_compare.py --max-tokens N --seed S [--threads N]
           [--gpu-layers N] [--keep-models]

Exits 2 with one line on stderr when an input is missing or unusable (no GGUF,
questions that are not a list of strings, a question longer than the model's
context), 3 when llama.cpp cannot load a model.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from overbrainer_generate import MODELS, JobFailed, Lines, Model, answers_of, job_main

QUESTIONS_FILE = Path("questions.json")


class CompareFailed(JobFailed):
    """An input is missing or a model cannot be loaded; the message is one line."""


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


def compare(args: argparse.Namespace, answers: Lines, metrics: Lines) -> None:
    """Loads each model in turn and answers every question with it."""
    questions = read_questions()
    conversations = [[{"role": "user", "content": q}] for q in questions]
    models = [Model(name, path, conversations) for name, path in MODELS]
    for model in models:
        model.close()
    contexts = [model.check_context(args.max_tokens) for model in models]
    total = len(models) * len(questions)
    metrics.write(event="begin", questions=len(questions), max_steps=total, time=time.time())
    step = 0
    started = time.monotonic()
    for model, n_ctx in zip(models, contexts, strict=True):
        for index, result in answers_of("compare", model, n_ctx, args, metrics):
            answers.write(
                index=index,
                question=questions[index],
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
    metrics.write(
        event="end", answers=step, seconds=round(time.monotonic() - started, 3), time=time.time()
    )


def main() -> int:
    """Entry point: parses the arguments, compares, and returns the exit code."""
    return job_main("compare", "Asks a base and a tuned GGUF the same questions.", compare)


if __name__ == "__main__":
    sys.exit(main())
