"""The evaluation job: a base model and its fine-tune asked the evaluation's items,
their perplexity measured on the held-out answers, and optionally judged.

Runs inside the job venv on the target (llama-cpp-python), in the evaluation's
directory, which holds:

    models/base.gguf    the model the tuned one is measured against (same quant)
    models/tuned.gguf   the fine-tuned model
    models/judge.gguf   a judge GGUF, when the judge runs here
    inputs.json         {"items": [{"id", "messages", "group", "expected"}],
                         "perplexity": [{"id", "messages", "answer"}],
                         "judge": {"template", "max_tokens", "items": [id...]} | null}
    scripts/            this script and `overbrainer_generate.py`, the generation
                        it shares with the compare job

Each model is loaded once and answers every item through its own chat template,
greedily, with a fixed seed, each from an empty context (the compare's
generation: see `overbrainer_generate.py`). Then, when `perplexity` lists
answers, the model is loaded again with every position's logits and scores
each held-out answer given its prompt: the perplexity is exp of the mean
negative log-likelihood of the answer tokens, the same text for both models.
With a judge, each judged item is asked twice of `models/judge.gguf`, the base
answer first (`base_first`), then the tuned one first (`tuned_first`); the
replies are written as they are (the orchestrator reads them).

Written here: `answers.jsonl`, one line per item and model as it is answered
(the compare's fields and the item's `id`); `metrics.jsonl`: `begin`, a `model`
event per load, a `log` event per answer, perplexity text and judge call
(`step` counts them), `end`; and last `results.json`: the answers, the
perplexity, the judge's replies, the SHA-256 and size of each GGUF loaded, the
seed and the versions.

`models/` is removed when the job ends (unless `--keep-models`).

usage: python scripts/overbrainer_evaluate.py --max-tokens N --seed S [--threads N]
           [--gpu-layers N] [--keep-models]

Exits 2 with one line on stderr when an input is missing or unusable, 3 when
llama.cpp cannot load a model.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any

from overbrainer_generate import (
    MODELS,
    MODELS_DIR,
    JobFailed,
    Lines,
    Model,
    answer,
    answers_of,
    job_main,
    load,
    render,
)

JUDGE_GGUF = MODELS_DIR / "judge.gguf"
INPUTS_FILE = Path("inputs.json")
RESULTS_FILE = Path("results.json")
ORDERS = ("base_first", "tuned_first")


def read_inputs() -> dict[str, Any]:
    """inputs.json, checked. Raises JobFailed when it is missing or not its shape."""
    try:
        inputs = json.loads(INPUTS_FILE.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise JobFailed(f"no {INPUTS_FILE} in {Path.cwd()}: the items were not staged") from None
    except ValueError:
        raise JobFailed(f"{INPUTS_FILE} is not valid JSON") from None
    items = inputs.get("items") if isinstance(inputs, dict) else None
    if not isinstance(items, list) or not items:
        raise JobFailed(f"{INPUTS_FILE} holds no items")
    for number, item in enumerate(items, start=1):
        messages = item.get("messages") if isinstance(item, dict) else None
        if not (isinstance(messages, list) and messages and isinstance(item.get("id"), str)):
            raise JobFailed(f"{INPUTS_FILE}: item {number} has no id and messages")
    ids = {item["id"] for item in items}
    for text in inputs.get("perplexity") or []:
        if text.get("id") not in ids or not isinstance(text.get("answer"), str):
            raise JobFailed(f"{INPUTS_FILE}: a perplexity text names no item or has no answer")
    judge = inputs.get("judge")
    if judge is not None:
        if not JUDGE_GGUF.is_file():
            raise JobFailed(f"no {JUDGE_GGUF} in {Path.cwd()}: the judge was not staged")
        if any(i not in ids for i in judge.get("items", [])):
            raise JobFailed(f"{INPUTS_FILE}: the judge names an item that is not there")
    return inputs


def sha256(path: Path) -> dict[str, Any]:
    """The SHA-256 and size of the file at `path`."""
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while block := file.read(1 << 20):
            digest.update(block)
    return {"sha256": digest.hexdigest(), "size": path.stat().st_size}


def perplexity(llm: Any, texts: list[tuple[list[int], list[int]]]) -> dict[str, Any]:
    """exp of the mean negative log-likelihood of each answer's tokens given its
    prompt, over every (prompt, answer) in `texts`, with the sums it came from."""
    import numpy as np

    nll = 0.0
    count = 0
    for prompt, tokens in texts:
        llm.reset()
        llm.eval(prompt + tokens)
        logits = np.asarray(llm.scores[: len(prompt) + len(tokens)], dtype=np.float64)
        for offset, token in enumerate(tokens):
            row = logits[len(prompt) - 1 + offset]
            top = row.max()
            log_z = top + math.log(float(np.exp(row - top).sum()))
            nll += log_z - float(row[token])
            count += 1
    return {
        "perplexity": math.exp(nll / count),
        "nll": round(nll, 6),
        "tokens": count,
        "texts": len(texts),
    }


class Progress:
    """The metrics file's `log` events: one step per answer, text or judge call."""

    def __init__(self, metrics: Lines, total: int) -> None:
        self.metrics = metrics
        self.total = total
        self.step = 0

    def log(self, **fields: Any) -> None:
        """Writes the next step's `log` event with `fields`."""
        self.step += 1
        self.metrics.write(
            event="log", step=self.step, max_steps=self.total, **fields, time=time.time()
        )


def evaluate(args: argparse.Namespace, answers: Lines, metrics: Lines) -> dict[str, Any]:
    """Answers every item with each model, measures their perplexity, runs the judge;
    returns the results."""
    import llama_cpp

    inputs = read_inputs()
    items = inputs["items"]
    texts = inputs.get("perplexity") or []
    judge = inputs.get("judge")
    index_of = {item["id"]: index for index, item in enumerate(items)}
    conversations = [item["messages"] for item in items]
    models = [Model(name, path, conversations, what="item") for name, path in MODELS]
    scored = {
        model.name: [
            (model.prompts[index_of[t["id"]]], model.tokenize_answer(t["answer"])) for t in texts
        ]
        for model in models
    }
    for model in models:
        model.close()
    contexts = [model.check_context(args.max_tokens) for model in models]
    judged = judge["items"] if judge else []
    total = len(models) * (len(items) + (1 if texts else 0)) + 2 * len(judged)
    progress = Progress(metrics, total)
    metrics.write(event="begin", items=len(items), max_steps=total, time=time.time())
    files = {name: sha256(path) for name, path in MODELS}
    found: dict[str, dict[str, str]] = {}
    all_answers: list[dict[str, Any]] = []
    ppl: dict[str, Any] = {}
    started = time.monotonic()
    for model, n_ctx in zip(models, contexts, strict=True):
        for index, result in answers_of("evaluate", model, n_ctx, args, metrics):
            item = items[index]
            line = {
                "id": item["id"],
                "index": index,
                "question": item["messages"][-1]["content"],
                "model": model.name,
                **result,
                "template": bool(model.template),
            }
            answers.write(**line)
            all_answers.append(line)
            found.setdefault(item["id"], {})[model.name] = result["answer"]
            progress.log(
                model=model.name,
                item=item["id"],
                tokens=result["tokens"],
                tokens_per_s=result["tokens_per_s"],
                cut=result["cut"],
            )
        if texts:
            lengths = [len(p) + len(t) for p, t in scored[model.name]]
            longest = max(lengths)
            if model.ctx_train and longest >= model.ctx_train:
                text = texts[lengths.index(longest)]["id"]
                raise JobFailed(
                    f"the held-out answer of item {text} is {longest} tokens with its prompt, "
                    f"and the {model.name} model's context holds {model.ctx_train}: shorten it"
                )
            llm = load(model.path, model.name, max(longest + 1, 64), args, logits_all=True)
            ppl[model.name] = perplexity(llm, scored[model.name])
            llm.close()
            progress.log(model=model.name, perplexity=ppl[model.name]["perplexity"])
            print(
                f"evaluate: {model.name} perplexity {ppl[model.name]['perplexity']:.3f}", flush=True
            )
    replies = []
    if judge:
        files["judge"] = sha256(JUDGE_GGUF)
        by_id = {item["id"]: item for item in items}
        prompts, keys = [], []
        for item_id in judged:
            item = by_id[item_id]
            base, tuned = found[item_id]["base"], found[item_id]["tuned"]
            question, expected = item["messages"][-1]["content"], item.get("expected") or ""
            pairs = {"base_first": (base, tuned), "tuned_first": (tuned, base)}
            for order in ORDERS:
                first, second = pairs[order]
                prompts.append(
                    [
                        {
                            "role": "user",
                            "content": render(judge["template"], question, expected, first, second),
                        }
                    ]
                )
                keys.append((item_id, order))
        model = Model("judge", JUDGE_GGUF, prompts, what="judge prompt")
        model.close()
        n_ctx = model.check_context(int(judge["max_tokens"]))
        llm = load(JUDGE_GGUF, "judge", n_ctx, args)
        for (item_id, order), prompt in zip(keys, model.prompts, strict=True):
            result = answer(
                llm, prompt, min(int(judge["max_tokens"]), n_ctx - len(prompt)), args.seed
            )
            replies.append({"item": item_id, "order": order, "reply": result["answer"]})
            progress.log(model="judge", item=item_id, order=order, tokens=result["tokens"])
        llm.close()
    metrics.write(
        event="end",
        answers=len(all_answers),
        seconds=round(time.monotonic() - started, 3),
        time=time.time(),
    )
    return {
        "answers": all_answers,
        "perplexity": ppl or None,
        "judge": replies if judge else None,
        "judge_model": JUDGE_GGUF.name if judge else None,
        "models": files,
        "versions": {
            "llama_cpp_python": getattr(llama_cpp, "__version__", "?"),
            "python": platform.python_version(),
        },
        "seed": args.seed,
        "max_tokens": args.max_tokens,
    }


def evaluate_and_write(args: argparse.Namespace, answers: Lines, metrics: Lines) -> None:
    """Evaluates, then writes results.json, last and whole: its presence says the
    job finished."""
    results = evaluate(args, answers, metrics)
    tmp = RESULTS_FILE.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    tmp.replace(RESULTS_FILE)


def main() -> int:
    """Entry point: parses the arguments, evaluates, writes results.json, and returns
    the exit code."""
    return job_main("evaluate", "Evaluates a base and a tuned GGUF.", evaluate_and_write)


if __name__ == "__main__":
    sys.exit(main())
