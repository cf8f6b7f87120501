"""How fast the compare job decodes next to llama.cpp itself, on this CPU, for the
demo's GGUF (SmolLM2-135M fine-tuned, q8_0).

Two measurements of the same GGUF with the same number of threads (`--threads`,
by default half the cores, as llama-cpp-python and so the demo's compare use),
side by side, in rounds (the machine is shared: each round runs both, one after the
other, and the ratio is the median of the rounds' ratios):

- the compare: the real compare job script (`overbrainer_compare.py`, as the
  `compare` flow runs it on a target), the GGUF as both its base and tuned model,
  asked questions that make it write at length, up to MAX_TOKENS tokens; its
  decoding speed is the answers' tokens over their decoding time (each answer's
  `tokens_per_s` weighted by its tokens);
- llama.cpp: a `llama-bench`-style `tg` run in the same job venv, one token
  evaluated at a time with `Llama.eval` after a prompt of the same length as the
  compare's, MAX_TOKENS times, without sampling.

The GGUF is the tuned GGUF of the newest succeeded demo compare in `runs/`;
without one, the demo is run first (`demo/run_demo.py`, a few minutes).

Prints `BENCH compare-tokens-per-s`, `BENCH llama-eval-tokens-per-s` and
`BENCH compare-vs-llama-tokens-per-s <ratio> ratio goal >= 0.9`, with `#` lines
saying what was measured. About a minute on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RUNS = REPO / "runs"
BASE_DIR = REPO / ".cache" / "smollm2-base"
DEMO_QUANT = "q8_0"  # what the demo exports and compares
JOB_PYTHON = REPO / ".venv-job" / "bin" / "python"
COMPARE_SCRIPT = REPO / "overbrainer_prefect" / "jobs" / "overbrainer_compare.py"
QUESTIONS = [  # the demo's fine-tune answers these at length (the first up to the limit)
    "List fifty animals.",
    "Write a long story about a dragon who learns to cook.",
]
MAX_TOKENS = 128  # tokens an answer may have: long enough for the decoding speed to dominate
ROUNDS = 5
JOB_TIMEOUT_S = 600.0

# llama-bench's `tg` test, in llama-cpp-python: a prompt, then one token at a time.
LLAMA_TG = """
import json, sys, time
import llama_cpp
path, threads, prompt_len, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
llm = llama_cpp.Llama(model_path=path, n_ctx=prompt_len + n + 16, n_threads=threads,
                      n_threads_batch=threads, seed=0, verbose=False)
token = llm.tokenize(b" the", add_bos=False)[0]
llm.eval([token] * 4)  # warm-up, as llama-bench does
llm.reset()
llm.eval([token] * prompt_len)
started = time.perf_counter()
for _ in range(n):
    llm.eval([token])
print(json.dumps({"tokens_per_s": n / (time.perf_counter() - started)}))
"""


def demo_gguf() -> Path | None:
    """The tuned GGUF of the newest succeeded q8_0 compare of a demo run in runs/."""
    found: list[tuple[str, Path]] = []
    for path in RUNS.glob("*/compares/*/compare.json"):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        spec = record.get("spec") or {}
        if record.get("state") != "succeeded" or spec.get("base_model") != str(BASE_DIR):
            continue
        if spec.get("quant") != DEMO_QUANT:
            continue
        gguf = RUNS / spec["tuned"]["path"]
        if gguf.is_file():
            found.append((record.get("ended") or record["id"], gguf))
    return max(found)[1] if found else None


def run_demo() -> None:
    """Runs the demo (train, export, compare), which leaves a demo GGUF in runs/."""
    print("# no demo compare in runs/: running the demo first", flush=True)
    done = subprocess.run([sys.executable, str(REPO / "demo" / "run_demo.py")], check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the demo failed (exit {done.returncode})")


def compare_round(gguf: Path, threads: int, scratch: Path) -> tuple[float, int, int]:
    """One run of the compare job on `gguf`; returns its token-weighted decoding
    speed, the tokens it decoded and its longest prompt."""
    job = Path(tempfile.mkdtemp(prefix="compare-", dir=scratch))
    (job / "models").mkdir()
    for name in ("base", "tuned"):
        (job / "models" / f"{name}.gguf").hardlink_to(gguf)
    (job / "questions.json").write_text(json.dumps(QUESTIONS), encoding="utf-8")
    done = subprocess.run(
        [
            str(JOB_PYTHON),
            str(COMPARE_SCRIPT),
            "--max-tokens",
            str(MAX_TOKENS),
            "--seed",
            "0",
            "--threads",
            str(threads),
        ],
        cwd=job,
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT_S,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "OMP_NUM_THREADS": str(threads)},
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the compare job failed ({done.returncode}): {done.stderr[-300:]}")
    answers = [json.loads(line) for line in (job / "answers.jsonl").read_text().splitlines()]
    timed = [a for a in answers if a["tokens_per_s"]]
    tokens = sum(a["tokens"] for a in timed)
    seconds = sum(a["tokens"] / a["tokens_per_s"] for a in timed)
    return tokens / seconds, tokens, max(a["prompt_tokens"] for a in answers)


def llama_round(gguf: Path, threads: int, prompt_len: int) -> float:
    """One llama-bench-style `tg` run of MAX_TOKENS tokens; returns its tokens/s."""
    done = subprocess.run(
        [
            str(JOB_PYTHON),
            "-c",
            LLAMA_TG,
            str(gguf),
            str(threads),
            str(prompt_len),
            str(MAX_TOKENS),
        ],
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT_S,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "OMP_NUM_THREADS": str(threads)},
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the llama.cpp run failed ({done.returncode}): {done.stderr[-300:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return float(result["tokens_per_s"])


def main() -> None:
    """Finds (or makes) the demo GGUF, measures both in rounds, prints the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--threads",
        type=int,
        default=max((os.cpu_count() or 2) // 2, 1),
        help="llama.cpp's threads, for both (default: half the cores, llama-cpp-python's own "
        "default, which the demo's compare runs with)",
    )
    args = parser.parse_args()
    threads = args.threads
    gguf = demo_gguf()
    if gguf is None:
        run_demo()
        gguf = demo_gguf()
        if gguf is None:
            raise RuntimeError("the demo left no compare in runs/")
    compare_speeds: list[float] = []
    llama_speeds: list[float] = []
    decoded = 0
    with tempfile.TemporaryDirectory(prefix="bench-compare-") as scratch:
        for _ in range(ROUNDS):
            speed, decoded, prompt_len = compare_round(gguf, threads, Path(scratch))
            compare_speeds.append(speed)
            llama_speeds.append(llama_round(gguf, threads, prompt_len))
    compare_tps, llama_tps = statistics.median(compare_speeds), statistics.median(llama_speeds)
    # each round's two runs are next to each other in time: their ratio is what holds
    ratios = [c / ll for c, ll in zip(compare_speeds, llama_speeds, strict=True)]
    print(
        f"# {gguf.relative_to(REPO)} ({gguf.stat().st_size / 2**20:.1f} MiB), {threads} threads, "
        f"{ROUNDS} rounds; compare: {decoded} tokens decoded a round over "
        f"{len(QUESTIONS) * 2} answers; llama.cpp: {MAX_TOKENS} tokens a round"
    )
    print(f"# compare tokens/s by round: {', '.join(f'{s:.1f}' for s in compare_speeds)}")
    print(f"# llama.cpp tokens/s by round: {', '.join(f'{s:.1f}' for s in llama_speeds)}")
    print(f"# ratio by round: {', '.join(f'{r:.2f}' for r in ratios)}")
    print(f"BENCH compare-tokens-per-s {compare_tps:.1f} tokens/s")
    print(f"BENCH llama-eval-tokens-per-s {llama_tps:.1f} tokens/s")
    ratio = statistics.median(ratios)
    print(f"BENCH compare-vs-llama-tokens-per-s {ratio:.2f} ratio goal >= 0.9")


if __name__ == "__main__":
    main()
