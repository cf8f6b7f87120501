"""Where an export of the demo model spends its time: a real export of the
SmolLM2-135M LoRA of a succeeded demo run through the `export` flow on a local
target, split by step: merge (LoRA into its base, imports included), convert
(llama.cpp's converter, f16), quantize (llama.cpp) and transfer (the GGUF's
retrieval and SHA-256 verification, timed again on its own into a fresh
directory, as the flow does it).

The run is the newest succeeded demo run in `runs/` (its files are copied to a
scratch runs directory, so the bench never reuses an export nor adds one to
it); without one, the demo's own fine-tune is run first (`demo/run_demo.py`,
about two minutes). The GGUF is then loaded with llama-cpp-python and asked the
demo's question (at most 40 tokens), as a check that it works.

Prints `BENCH export-<step>-seconds <v> s` for merge, convert, quantize,
transfer and total (the flow's wall time), and `#` lines with the GGUF's size
and answer. No goal: the numbers are the point. About a minute on a 2-core
machine with a demo run at hand. `--quant q8_0` measures another quant type.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RUNS = REPO / "runs"
BASE_DIR = REPO / ".cache" / "smollm2-base"
JOB_VENV = REPO / ".venv-job"
QUESTION = "What is the overbrainer mascot?"
MAX_TOKENS = 40  # the fact is one 14-token sentence
ASK_TIMEOUT_S = 300.0

ASK = """
import json, sys
import llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=512, seed=0, verbose=False)
tokens = llm.tokenize(sys.argv[2].encode(), add_bos=False, special=True)
out = []
for token in llm.generate(tokens, temp=0.0, top_k=1):
    if token == llm.token_eos() or len(out) >= int(sys.argv[3]):
        break
    out.append(token)
print(json.dumps(llm.detokenize(out).decode(errors="replace")))
"""
CHATML = "<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"


def demo_run() -> str | None:
    """The newest succeeded run in runs/ that fine-tuned the demo's base model."""
    from overbrainer_prefect.runs.store import Runs, RunState

    found = [
        r
        for r in Runs(RUNS).list(skipped=lambda _name, _error: None)
        if r.state == RunState.SUCCEEDED
        and str((r.spec or {}).get("base_model")) == str(BASE_DIR)
        and (RUNS / r.id / "output" / "adapter_config.json").is_file()
    ]
    return max(found, key=lambda r: r.id).id if found else None


def demo_module() -> Any:
    """demo/run_demo.py, imported."""
    sys.path.insert(0, str(REPO / "demo"))
    import run_demo  # type: ignore[import-not-found]

    return run_demo


def train_demo() -> str:
    """Runs the demo's base build and fine-tune (the train flow); returns the run ID."""
    run_demo = demo_module()
    run_demo.build_base()
    result, _ = run_demo.fine_tune()
    return str(result.run_id)


def scratch_copy(run_id: str, runs_dir: Path) -> None:
    """Copies what an export reads of run `run_id` (its record, manifest, config and
    the top-level files of output/) into `runs_dir`."""
    source, target = RUNS / run_id, runs_dir / run_id
    (target / "output").mkdir(parents=True)
    for name in ("run.json", "manifest.json", "axolotl.yaml"):
        shutil.copy2(source / name, target / name)
    for path in (source / "output").iterdir():
        if path.is_file():
            shutil.copy2(path, target / "output" / path.name)


async def transfer_seconds(result: Any, runs_dir: Path) -> float:
    """The time to retrieve and verify the export's files again, into a new directory."""
    from overbrainer_prefect.executors.local import LocalExecutor
    from overbrainer_prefect.runs import lifecycle
    from overbrainer_prefect.runs.store import Runs
    from overbrainer_prefect.trainers.export import ExportSpec, ExportTrainer

    runs = Runs(runs_dir)
    record = runs.children(result.run_id, "export").load(result.export_id)
    trainer = ExportTrainer(
        runs.load(result.run_id),
        runs.run_dir(result.run_id),
        ExportSpec.model_validate(record.spec),
    )
    executor = LocalExecutor(Path(record.remote_dir).parent, name="bench")
    local = Path(tempfile.mkdtemp(prefix="bench-export-transfer-"))
    try:
        started = time.perf_counter()
        await lifecycle.retrieve(executor, trainer, record.remote_dir, local, True)
        return time.perf_counter() - started
    finally:
        await executor.close()
        shutil.rmtree(local, ignore_errors=True)


def ask(gguf: str) -> str:
    """The GGUF's greedy answer to the demo's question (llama-cpp-python, job venv)."""
    done = subprocess.run(
        [
            str(JOB_VENV / "bin" / "python"),
            "-c",
            ASK,
            gguf,
            CHATML.format(q=QUESTION),
            str(MAX_TOKENS),
        ],
        capture_output=True,
        text=True,
        timeout=ASK_TIMEOUT_S,
        check=False,
    )
    if done.returncode != 0:
        return f"(llama-cpp-python failed, exit {done.returncode}: {done.stderr.strip()[-200:]})"
    answer: str = json.loads(done.stdout.strip().splitlines()[-1])
    return answer


def main() -> None:
    """Finds or makes a demo run, exports it through the flow, prints the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quant", default="q4_k_m")
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="bench-export-prefect-"))
    os.environ["PREFECT_HOME"] = str(home)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_LOGGING_LEVEL", "WARNING")
    os.environ.pop("PREFECT_API_URL", None)
    scratch = Path(tempfile.mkdtemp(prefix="bench-export-"))
    from prefect.testing.utilities import prefect_test_harness

    from overbrainer_prefect.blocks import LocalTarget
    from overbrainer_prefect.flows import ExportResult, export

    try:
        with prefect_test_harness(server_startup_timeout=120):
            run_id = demo_run()
            if run_id is None:
                print("# no succeeded demo run in runs/: running the demo's fine-tune first")
                run_id = train_demo()
            elif not (BASE_DIR / ".complete").is_file():  # the base the LoRA is merged into
                print("# the demo's base model is not built: building it first")
                demo_module().build_base()
            runs_dir = scratch / "runs"
            scratch_copy(run_id, runs_dir)
            name = f"bench-export-{uuid.uuid4().hex[:8]}"
            LocalTarget(job_venv=str(JOB_VENV), work_dir=str(scratch / "work")).save(name)
            started = time.perf_counter()
            result = asyncio.run(
                export(run_id=run_id, quant=args.quant, target=name, runs_dir=str(runs_dir))
            )
            total = time.perf_counter() - started
            if not isinstance(result, ExportResult) or result.gguf_path is None:
                raise RuntimeError(f"the export did not succeed: {result!r}")
            transfer = asyncio.run(transfer_seconds(result, runs_dir))
        answer = ask(result.gguf_path)
        assert result.gguf is not None
        print(
            f"# run {run_id}, export {result.export_id}: {result.gguf.path} "
            f"{result.gguf.size:,} B ({result.gguf.size / 2**20:.1f} MiB), "
            f"sha256 {result.gguf.sha256[:16]}"
        )
        print(f"# answer to {QUESTION!r}: {answer!r}")
        for step in ("merge", "convert", "quantize"):
            print(f"BENCH export-{step}-seconds {result.phases.get(step, 0.0):.2f} s")
        print(f"BENCH export-transfer-seconds {transfer:.2f} s")
        print(f"BENCH export-total-seconds {total:.2f} s")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
