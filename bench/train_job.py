"""The training job we run against axolotl run bare, on the tiny model
(tests/tinymodel.py), side by side:

- ours: the run directory as `AxolotlTrainer` stages it (its config, its data,
  the metrics plugin), run with the trainer's command and environment;
- bare: the same directory and environment, its config without the plugin
  (`plugins:` and the plugin's keys removed), run with `python -m
  axolotl.cli.train` (not through `overbrainer_run`): what `axolotl train`
  does with that config alone.

Each side is timed from its process's start to its exit; PAIRS pairs,
alternating which goes first, after one bare job left untimed: the first job
of the script also fills the jobs' shared HF cache and reads the job env from
disk after the step before it (2026-12-06: its first pair gave ours 16.43 s
against bare 14.38, its second 13.72 against 14.34). The plugin writes the
metrics and makes axolotl's save of the prepared dataset stay in the job's
process, which bare axolotl spawns a pool of one and its manager for (two
more Pythons).

Prints `BENCH train-job-vs-bare <ratio> ratio goal <= 1` (ours / bare: the
job must cost no more than axolotl alone). About three minutes on a 2-core
machine. Every job is a child process waited for; files removed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from kit.lines import bench, note, progress, run_main  # noqa: E402
from kit.sides import median, side_by_side  # noqa: E402

JOB_VENV = REPO / ".venv-job"
PAIRS = 2  # each side trains once a pair: about forty seconds here
JOB_TIMEOUT_S = 600.0
PLUGIN_KEYS = ("plugins", "overbrainer_metrics_file", "overbrainer_stop_file")


def staged(root: Path, name: str, bare: bool) -> tuple[Path, list[list[str]], dict[str, str]]:
    """A run directory `root/name` staged by the trainer (without the plugin
    when `bare`), its commands and its environment."""
    from flows_vs_jobs import training

    from overbrainer_prefect.executors.local import SAFE_ENV
    from overbrainer_prefect.trainers.axolotl import AxolotlTrainer
    from overbrainer_prefect.trainers.base import JobContext, TargetFacts
    from tests.tinymodel import tiny_dataset, tiny_model

    spec = training(tiny_model(REPO / ".cache"), tiny_dataset(REPO / ".cache"))
    run_dir = root / name
    run_dir.mkdir()
    trainer = AxolotlTrainer(spec, cpu_threads=1)
    ctx = JobContext(
        run_id=name,
        run_dir=str(run_dir),
        cache_dir=str(root / ".hf-cache"),
        facts=TargetFacts(python=str(JOB_VENV / "bin" / "python"), gpus=0, modules={}),
    )
    trainer.prepare(run_dir, ctx)
    if bare:
        config_path = run_dir / "axolotl.yaml"
        config = yaml.safe_load(config_path.read_text())
        for key in PLUGIN_KEYS:
            config.pop(key, None)
        config_path.write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if k in SAFE_ENV or k.startswith("LC_")}
    commands = trainer.commands(ctx)
    if bare:  # axolotl's own command, without the runner that skips Python's teardown
        commands = [[ctx.facts.python, "-m", "axolotl.cli.train", "axolotl.yaml"]]
    return run_dir, commands, env | trainer.env(ctx)


def job_seconds(root: Path, bare: bool, count: list[int]) -> float:
    """Stages and runs one training job; the seconds from its start to its exit."""
    count[0] += 1
    run_dir, commands, env = staged(root, f"{'bare' if bare else 'ours'}-{count[0]}", bare)
    began = time.perf_counter()
    for command in commands:
        done = subprocess.run(
            command, cwd=run_dir, env=env, capture_output=True, timeout=JOB_TIMEOUT_S, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"a training job failed ({done.returncode}): {done.stderr[-300:]!r}")
    seconds = time.perf_counter() - began
    if not (run_dir / "output" / "adapter_model.safetensors").is_file():
        raise RuntimeError(f"the training job in {run_dir} left no adapter")
    if (run_dir / "metrics.jsonl").exists() == bare:
        raise RuntimeError(f"the metrics file of {run_dir} says the wrong side ran")
    return seconds


def main() -> None:
    """Times our training job against bare axolotl, prints the figure."""
    root = Path(tempfile.mkdtemp(prefix="bench-train-job-"))
    count = [0]
    try:
        progress(f"training jobs: one bare untimed, then ours and bare, {PAIRS} pairs")
        job_seconds(root, True, count)
        sides = side_by_side(
            PAIRS, lambda: job_seconds(root, False, count), lambda: job_seconds(root, True, count)
        )
        note(f"training job of the tiny model (s), {PAIRS} pairs: {sides.describe()}")
        bench("train-job-vs-bare", median(sides.time_ratios()), "ratio", "<=", 1.0)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    run_main("train_job", main)
