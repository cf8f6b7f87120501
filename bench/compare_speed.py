"""How fast the compare job decodes next to bare llama-cpp-python, on this CPU,
on the same GGUF, the same prompts and the same number of threads, side by
side: ROUNDS rounds, each running both, which goes first alternating; the
figure is the median of the rounds' ratios.

- the GGUF: the tiny test model (tests/tinymodel.py) converted with llama.cpp's
  converter and quantized to q8_0, bare (no flow: a fixture);
- ours: the real compare job script (`overbrainer_compare.py`, as the
  `compare` flow runs it on a target), the GGUF as both its base and tuned
  model, QUESTIONS asked, answers up to MAX_TOKENS tokens; its speed is the
  answers' tokens over their decoding time (each answer's `tokens_per_s`
  weighted by its tokens);
- bare: llama-cpp-python alone: each question through the GGUF's chat
  template (jinja2, as llama-cpp-python does), then `Llama.generate`
  greedily, MAX_TOKENS tokens at most, its decoding speed measured the same
  way (tokens after the first over the time since the first).

- the evaluation: the real evaluation job script (`overbrainer_evaluate.py`,
  as the `evaluate` flow runs it), the same questions as held-out items, the
  GGUF as both models, no perplexity and no judge (its decoding is what is
  measured), its speed taken from its answers the same way.

Prints `BENCH compare-tokens-per-s`, `BENCH bare-llama-tokens-per-s`,
`BENCH compare-vs-bare-tokens-per-s <ratio> ratio goal >= 0.95` and
`BENCH evaluate-vs-bare-tokens-per-s <ratio> ratio goal >= 0.95`. A couple of
minutes on a 2-core machine.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from kit.lines import bench, note, run_main  # noqa: E402
from kit.sides import median  # noqa: E402

JOB_PYTHON = REPO / ".venv-job" / "bin" / "python"
COMPARE_SCRIPT = REPO / "overbrainer_prefect" / "jobs" / "overbrainer_compare.py"
EVALUATE_SCRIPT = REPO / "overbrainer_prefect" / "jobs" / "overbrainer_evaluate.py"
TOPICS = ["a cat", "the sea", "a house", "bread", "a dragon", "the moon", "a garden", "a city"]
QUESTIONS = [  # answers enough that a round decodes for a second or more, not a scheduler tick
    template.format(topic)
    for template in ("Tell me a long story about {}.", "Describe {} in detail.", "Write about {}.")
    for topic in TOPICS
]
MAX_TOKENS = 256  # long enough for the decoding to dominate
THREADS = 1  # as the local target's cpu_threads in the other benches
ROUNDS = 9  # pairs of runs; the median of their ratios is the figure
JOB_TIMEOUT_S = 600.0

MAKE_GGUF = """
import ctypes, subprocess, sys
import llama_cpp
model, converter, work = sys.argv[1:4]
subprocess.run([sys.executable, converter, model, "--outtype", "f16", "--outfile",
                work + "/f16.gguf"], check=True, stdout=subprocess.DEVNULL,
               stderr=subprocess.DEVNULL)
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
code = llama_cpp.llama_model_quantize((work + "/f16.gguf").encode(),
                                      (work + "/tiny-q8_0.gguf").encode(), ctypes.byref(params))
sys.exit(code)
"""

BARE = """
import json, sys, time
import jinja2, llama_cpp
path, threads, cap = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
questions = json.loads(sys.argv[4])
vocab = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
template = jinja2.Template(vocab.metadata["tokenizer.chat_template"])
ctx_train = int(vocab.metadata.get(vocab.metadata["general.architecture"] + ".context_length", 0))
prompts = [vocab.tokenize(template.render(messages=[{"role": "user", "content": q}],
                                          add_generation_prompt=True, bos_token="",
                                          eos_token="").encode(), add_bos=True, special=True)
           for q in questions]
vocab.close()
n_ctx = max(max(len(p) for p in prompts) + cap + 1, 512)  # the context the compare job takes
n_ctx = min(n_ctx, ctx_train) if ctx_train else n_ctx
tokens_total = seconds_total = 0.0
for _model in ("base", "tuned"):  # the compare job answers with both (here the same GGUF)
    llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_threads=threads,
                          n_threads_batch=threads, seed=0, verbose=False)
    for prompt in prompts:
        limit = min(cap, n_ctx - len(prompt))
        llm.reset()
        decoded, first, last = 0, 0.0, 0.0
        for token in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, reset=True):
            last = time.perf_counter()
            if decoded == 0:
                first = last
            decoded += 1
            if llama_cpp.llama_vocab_is_eog(llm._model.vocab, token) or decoded > limit:
                break
        if decoded > 1:
            tokens_total += decoded - 1
            seconds_total += last - first
    llm.close()
print(json.dumps({"tokens_per_s": tokens_total / seconds_total, "tokens": tokens_total,
                  "n_ctx": n_ctx}))
"""


def env() -> dict[str, str]:
    """A plain environment for the job venv's Python, THREADS threads."""
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", "/root"),
        "OMP_NUM_THREADS": str(THREADS),
    }


def make_gguf(work: Path) -> Path:
    """The tiny model as a q8_0 GGUF, made bare with llama.cpp."""
    from overbrainer_prefect.trainers.export import converter_path
    from tests.tinymodel import tiny_model

    model = tiny_model(REPO / ".cache")
    done = subprocess.run(
        [str(JOB_PYTHON), "-c", MAKE_GGUF, str(model), converter_path(str(JOB_PYTHON)), str(work)],
        env=env(),
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT_S,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the GGUF could not be made ({done.returncode}): {done.stderr[-200:]}")
    return work / "tiny-q8_0.gguf"


def compare_round(gguf: Path, scratch: Path) -> tuple[float, int]:
    """One run of the compare job on `gguf`: its token-weighted decoding speed
    and the tokens it decoded."""
    job = Path(tempfile.mkdtemp(prefix="compare-", dir=scratch))
    (job / "models").mkdir()
    for name in ("base", "tuned"):
        (job / "models" / f"{name}.gguf").hardlink_to(gguf)
    (job / "questions.json").write_text(json.dumps(QUESTIONS), encoding="utf-8")
    done = subprocess.run(
        [str(JOB_PYTHON), str(COMPARE_SCRIPT), "--max-tokens", str(MAX_TOKENS), "--seed", "0",
         "--threads", str(THREADS)],
        cwd=job, capture_output=True, text=True, timeout=JOB_TIMEOUT_S, env=env(), check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"the compare job failed ({done.returncode}): {done.stderr[-200:]}")
    answers = [json.loads(line) for line in (job / "answers.jsonl").read_text().splitlines()]
    timed = [a for a in answers if a["tokens_per_s"]]
    tokens = sum(a["tokens"] for a in timed)
    seconds = sum(a["tokens"] / a["tokens_per_s"] for a in timed)
    return tokens / seconds, tokens


def evaluate_round(gguf: Path, scratch: Path) -> tuple[float, int]:
    """One run of the evaluation job on `gguf` (both models), the questions as
    held-out items: its token-weighted decoding speed and the tokens it decoded."""
    job = Path(tempfile.mkdtemp(prefix="evaluate-", dir=scratch))
    (job / "models").mkdir()
    for name in ("base", "tuned"):
        (job / "models" / f"{name}.gguf").hardlink_to(gguf)
    items = [
        {"id": f"H{n}", "messages": [{"role": "user", "content": q}], "group": "heldout",
         "expected": "-"}
        for n, q in enumerate(QUESTIONS, start=1)
    ]  # fmt: skip
    inputs = {"items": items, "perplexity": [], "judge": None}
    (job / "inputs.json").write_text(json.dumps(inputs), encoding="utf-8")
    done = subprocess.run(
        [str(JOB_PYTHON), str(EVALUATE_SCRIPT), "--max-tokens", str(MAX_TOKENS), "--seed", "0",
         "--threads", str(THREADS)],
        cwd=job, capture_output=True, text=True, timeout=JOB_TIMEOUT_S, env=env(), check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"the evaluation job failed ({done.returncode}): {done.stderr[-200:]}")
    answers = [json.loads(line) for line in (job / "answers.jsonl").read_text().splitlines()]
    timed = [a for a in answers if a.get("tokens_per_s")]
    tokens = sum(a["tokens"] for a in timed)
    seconds = sum(a["tokens"] / a["tokens_per_s"] for a in timed)
    return tokens / seconds, tokens


def bare_round(gguf: Path) -> tuple[float, int]:
    """One bare llama-cpp-python run on the same questions: its speed and tokens."""
    done = subprocess.run(
        [str(JOB_PYTHON), "-c", BARE, str(gguf), str(THREADS), str(MAX_TOKENS),
         json.dumps(QUESTIONS)],
        capture_output=True, text=True, timeout=JOB_TIMEOUT_S, env=env(), check=False,
    )  # fmt: skip
    if done.returncode != 0:
        why = done.stderr.strip()[-200:]
        raise RuntimeError(f"bare llama-cpp-python failed ({done.returncode}): {why}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return float(result["tokens_per_s"]), int(result["tokens"])


def main() -> None:
    """Makes the GGUF, measures the three in rounds, prints the figures."""
    root = Path(tempfile.mkdtemp(prefix="bench-compare-"))
    try:
        gguf = make_gguf(root)
        speeds: dict[str, list[float]] = {"ours": [], "evaluate": [], "bare": []}
        tokens = {"ours": 0, "evaluate": 0, "bare": 0}
        rounds = {
            "ours": lambda: compare_round(gguf, root),
            "evaluate": lambda: evaluate_round(gguf, root),
            "bare": lambda: bare_round(gguf),
        }
        for number in range(ROUNDS):
            order = list(rounds)
            order = order[number % 3 :] + order[: number % 3]  # each goes first in turn
            for side in order:
                speed, count = rounds[side]()
                speeds[side].append(speed)
                tokens[side] = count
        ours, evaluated, bare = speeds["ours"], speeds["evaluate"], speeds["bare"]
        note(
            f"{gguf.name} ({gguf.stat().st_size / 2**20:.1f} MiB), {THREADS} thread(s), "
            f"{ROUNDS} rounds; tokens decoded a round: compare {tokens['ours']}, evaluation "
            f"{tokens['evaluate']} ({len(QUESTIONS)} questions x 2 models), bare {tokens['bare']}"
        )
        for side, label in (("ours", "compare"), ("evaluate", "evaluation"), ("bare", "bare")):
            note(f"{label} tokens/s by round: {' '.join(f'{v:.0f}' for v in speeds[side])}")
        bench("compare-tokens-per-s", median(ours), "tokens/s", digits=0)
        bench("evaluate-tokens-per-s", median(evaluated), "tokens/s", digits=0)
        bench("bare-llama-tokens-per-s", median(bare), "tokens/s", digits=0)
        ratios = [o / b for o, b in zip(ours, bare, strict=True)]
        bench("compare-vs-bare-tokens-per-s", median(ratios), "ratio", ">=", 0.95)
        ratios = [e / b for e, b in zip(evaluated, bare, strict=True)]
        bench("evaluate-vs-bare-tokens-per-s", median(ratios), "ratio", ">=", 0.95)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    run_main(__file__, main)
