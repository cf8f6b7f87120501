"""What the flows add to their jobs, on a local target with the tiny model
(tests/tinymodel.py), against a private `prefect server`:

- a job: `train` of a LoRA fine-tune (STEPS steps), once; its wall time from
  the call to the return, less its job's (the job process's kernel start
  time to its exit file);
- the pipeline: `fine_tune` (train, export to q8_0, compare with two
  questions), its wall time less the sum of its jobs' (the training, the
  base model's export, the run's export, the compare);
- the export steps: the export job of that run (staged by its trainer, run
  with its command and environment) against the same steps run bare (peft's
  merge, llama.cpp's converter, llama_cpp's quantize, in one plain script,
  in the export job's own environment, so each step times the same work on
  both sides), PAIRS pairs, alternating.

Prints `BENCH train-flow-overhead <s> s goal <= 2`, `BENCH fine-tune-overhead
<s> s goal <= 5`, `BENCH export-<step>-vs-bare <ratio> ratio` and
`BENCH export-vs-bare <ratio> ratio` (ours / bare; no goal set). About four minutes on a
2-core machine. The server and every job are stopped by PID; files removed.
"""

from __future__ import annotations

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

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from kit.lines import bench, note, progress, run_main  # noqa: E402
from kit.process import started_unix  # noqa: E402
from kit.server import prefect_server  # noqa: E402
from kit.sides import median, side_by_side  # noqa: E402

JOB_VENV = REPO / ".venv-job"
STEPS = 6  # steps of a timed fine-tune of the tiny model
TRAINS = 1  # timed train flows before the pipeline (which trains once more)
QUANT = "q8_0"
QUESTIONS = ["What is a cat?", "Name three colours."]
MAX_TOKENS = 32
PAIRS = 1  # export job / bare steps: each takes half a minute or more
JOB_TIMEOUT_S = 600.0
JOB_ENV: dict[str, str] = {}  # the export job's environment, once it ran

BARE_EXPORT = """
import ctypes, json, os, runpy, sys, time
base, adapter, converter, work = sys.argv[1:5]
seconds = {}
mark = time.monotonic()
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained(base, dtype="auto", device_map="cpu")
PeftModel.from_pretrained(model, adapter).merge_and_unload().save_pretrained(work + "/merged")
AutoTokenizer.from_pretrained(base).save_pretrained(work + "/merged")
seconds["merge"] = time.monotonic() - mark
mark = time.monotonic()
# the converter in this process, as the export job runs it: the imports the merge paid
# for are not paid again on either side, so both sides time the same conversion
sys.argv = [converter, work + "/merged", "--outtype", "f16", "--outfile", work + "/f16.gguf"]
sys.path.insert(0, os.path.dirname(converter))
try:
    runpy.run_path(converter, run_name="__main__")
except SystemExit as exited:
    assert not exited.code, exited.code
seconds["convert"] = time.monotonic() - mark
mark = time.monotonic()
import llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
params.nthread = 1
code = llama_cpp.llama_model_quantize((work + "/f16.gguf").encode(),
                                      (work + "/q8_0.gguf").encode(), ctypes.byref(params))
assert code == 0, code
seconds["quantize"] = time.monotonic() - mark
print(json.dumps(seconds))
"""


def job_seconds(record: Any) -> float:
    """How long the job of `record` ran: its process's start to its exit file."""
    from overbrainer_prefect.executors.base import EXIT_FILE

    if record.job is None or record.job.started is None:
        raise RuntimeError(f"{record.id} has no job")
    start = started_unix(record.job.started)
    return Path(record.remote_dir, EXIT_FILE).stat().st_mtime - start


def all_jobs(runs_dir: Path) -> list[tuple[str, Any]]:
    """Every run, export, compare and base model export under `runs_dir`."""
    from overbrainer_prefect.runs.store import BASES_DIR, Runs
    from overbrainer_prefect.trainers.compare import base_exports

    runs = Runs(runs_dir)
    found: list[tuple[str, Any]] = []
    for record in runs.list():
        found.append(("train", record))
        for kind in ("export", "compare"):
            found += [(kind, child) for child in runs.children(record.id, kind).list()]
    bases = runs.root / BASES_DIR
    if bases.is_dir():
        for key in sorted(bases.iterdir()):
            found += [("base export", r) for r in base_exports(runs, key.name).list()]
    return found


def training(model: Path, dataset: Path) -> Any:
    """The tiny model's LoRA fine-tune."""
    from overbrainer_prefect.trainers.spec import TrainingSpec

    return TrainingSpec.model_validate(
        {
            "base_model": str(model),
            "datasets": [str(dataset)],
            "sequence_len": 64,
            "micro_batch_size": 4,
            "max_steps": STEPS,
            "learning_rate": 5e-3,
            "lora_r": 8,
            "lora_alpha": 16,
            "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
            "warmup_steps": 0,
            "seed": 0,
        }
    )


def export_job(runs_dir: Path, run_id: str, scratch: Path) -> dict[str, float]:
    """The export job of run `run_id`, staged by its trainer in `scratch` and
    run with its command and environment; its steps' seconds."""
    from overbrainer_prefect.executors.local import SAFE_ENV
    from overbrainer_prefect.runs.store import Runs
    from overbrainer_prefect.trainers.base import JobContext, TargetFacts
    from overbrainer_prefect.trainers.export import ExportSpec, ExportTrainer, phases

    runs = Runs(runs_dir)
    trainer = ExportTrainer(runs.load(run_id), runs, ExportSpec(quant=QUANT), cpu_threads=1)
    ctx = JobContext(
        run_id=scratch.name,
        run_dir=str(scratch),
        cache_dir=str(scratch.parent / ".hf-cache"),
        facts=TargetFacts(python=str(JOB_VENV / "bin" / "python"), gpus=0, modules={}),
    )
    trainer.prepare(scratch, ctx)
    env = {k: v for k, v in os.environ.items() if k in SAFE_ENV or k.startswith("LC_")}
    env |= trainer.env(ctx)
    JOB_ENV.clear()
    JOB_ENV.update(env)  # the bare steps run in it too
    for command in trainer.commands(ctx):
        done = subprocess.run(
            command, cwd=scratch, env=env, capture_output=True, timeout=JOB_TIMEOUT_S, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"the export job failed ({done.returncode}): {done.stderr[-200:]!r}")
    return phases((scratch / "metrics.jsonl").read_text())


def bare_export(base: Path, adapter: Path, scratch: Path) -> dict[str, float]:
    """The same three steps, bare, in the export job's environment (its
    threads, caches and bytecode settings: the same work on both sides); their
    seconds. Raises RuntimeError before the export job ran once."""
    from overbrainer_prefect.trainers.export import converter_path

    if not JOB_ENV:
        raise RuntimeError("the bare steps run in the export job's environment: run it first")
    python = str(JOB_VENV / "bin" / "python")
    scratch.mkdir(parents=True)
    done = subprocess.run(
        [python, "-c", BARE_EXPORT, str(base), str(adapter), converter_path(python), str(scratch)],
        env=dict(JOB_ENV),
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT_S,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the bare export failed ({done.returncode}): {done.stderr[-200:]!r}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    """Starts the server, times the flows against their jobs, prints the figures."""
    from tests.tinymodel import tiny_dataset, tiny_model

    root = Path(tempfile.mkdtemp(prefix="bench-flows-"))
    model, dataset = tiny_model(REPO / ".cache"), tiny_dataset(REPO / ".cache")
    try:
        with prefect_server(root):
            from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

            from overbrainer_prefect.blocks import LocalTarget
            from overbrainer_prefect.finetune import CompareSettings, FineTuneSpec
            from overbrainer_prefect.flows import FineTuneResult, RunResult, fine_tune, train
            from overbrainer_prefect.runs.store import Runs
            from overbrainer_prefect.trainers.export import ExportSpec

            target = f"bench-{uuid.uuid4().hex[:8]}"
            block = LocalTarget(job_venv=str(JOB_VENV), work_dir=str(root / "work"), cpu_threads=1)
            block.save(target)
            spec = training(model, dataset)
            trains: list[tuple[float, float]] = []
            with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
                for number in range(TRAINS):
                    progress(f"train flow {number + 1}/{TRAINS}")
                    runs_dir = root / f"runs-train-{number}"
                    began = time.perf_counter()
                    flow = train(target=target, training=spec, runs_dir=str(runs_dir))
                    result = asyncio.run(flow)
                    wall = time.perf_counter() - began
                    if not isinstance(result, RunResult) or result.state != "succeeded":
                        raise RuntimeError(f"the train flow did not succeed: {result}")
                    trains.append((wall, job_seconds(Runs(runs_dir).load(result.run_id))))
                runs_dir = root / "runs-pipeline"
                pipeline = FineTuneSpec(
                    target=target,
                    training=spec,
                    export=ExportSpec(quant=QUANT),
                    compare=CompareSettings(questions=QUESTIONS, max_tokens=MAX_TOKENS),
                    runs_dir=str(runs_dir),
                )
                progress("fine_tune flow")
                began = time.perf_counter()
                done = asyncio.run(fine_tune(spec=pipeline))
                pipeline_wall = time.perf_counter() - began
                if not isinstance(done, FineTuneResult):
                    raise RuntimeError(f"the fine_tune flow did not succeed: {done}")
        jobs = [(kind, job_seconds(record)) for kind, record in all_jobs(runs_dir)]
        note(
            "train flow / its job (s): "
            + ", ".join(f"{wall:.1f} / {job:.1f}" for wall, job in trains)
            + f" ({STEPS} steps, poll_seconds {block.poll_seconds:g})"
        )
        bench("train-flow-overhead", min(w - j for w, j in trains), "s", "<=", 2.0)
        note(
            f"fine_tune {pipeline_wall:.1f} s; its jobs: "
            + ", ".join(f"{kind} {seconds:.1f} s" for kind, seconds in jobs)
        )
        bench("fine-tune-overhead", pipeline_wall - sum(s for _, s in jobs), "s", "<=", 5.0)

        ours_steps: list[dict[str, float]] = []
        bare_steps: list[dict[str, float]] = []

        def ours() -> float:
            steps = export_job(runs_dir, done.run_id, Path(tempfile.mkdtemp(dir=root)))
            ours_steps.append(steps)
            return sum(steps.values())

        def bare() -> float:
            adapter = Runs(runs_dir).run_dir(done.run_id) / "output"
            steps = bare_export(model, adapter, root / f"bare-{len(bare_steps)}")
            bare_steps.append(steps)
            return sum(steps.values())

        progress("export steps: the export job and bare, in turn")
        sides = side_by_side(PAIRS, ours, bare)
        note(f"export steps (merge + convert + quantize), {PAIRS} pairs: {sides.describe()}")
        for step in ("merge", "convert", "quantize"):
            ratios = [o[step] / b[step] for o, b in zip(ours_steps, bare_steps, strict=True)]
            note(
                f"  {step}: ours "
                + " ".join(f"{o[step]:.2f}" for o in ours_steps)
                + " s, bare "
                + " ".join(f"{b[step]:.2f}" for b in bare_steps)
                + " s"
            )
            bench(f"export-{step}-vs-bare", median(ratios), "ratio")
        bench("export-vs-bare", median(sides.time_ratios()), "ratio")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    run_main(__file__, main)
