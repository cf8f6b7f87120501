"""What axolotl's `--cloud` adds to a training, on a local target with the tiny
model (tests/tinymodel.py), against a private `prefect server`, in one run:

- direct: the `train` flow called directly, from a script (a Python process of
  the orchestrator's venv, as a user runs it);
- axolotl: `axolotl train config.yml --cloud cloud.yml` (the job venv's axolotl
  CLI, `provider: overbrainer`) for the same training, the package made
  visible to axolotl's Python by PYTHONPATH and a dist-info holding its entry
  points (as tests/test_axolotl_cloud.py does).

Each side's wall time less its job's (the job process's kernel start time to
its exit file), so that the jobs' own noise cancels, PAIRS times, alternating
which goes first; the overhead is the least of the axolotl side's less the
least of the direct side's. axolotl's own CLI start (its imports:
torch, its config schema) is timed alone too and noted.

One pair (it was two, 53 s each): the figure misses its goal by axolotl's own
CLI start alone (about 9 s here, against a goal of 3), which no second pair
changes; two pairs gave 9.38 s and 0.33 s, each pair within half a second of
the other (the job's time is taken off each side).

Prints `BENCH axolotl-cloud-overhead <s> s goal <= 3` and `BENCH
axolotl-cloud-launcher-overhead <s> s` (the same less axolotl's CLI start: what
the launcher and the orchestrator's process add). About a minute on a
2-core machine. The server and every job are stopped by PID; files removed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
import uuid
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from flows_vs_jobs import job_seconds, training  # noqa: E402
from kit.lines import bench, note, progress, run_main  # noqa: E402
from kit.server import prefect_server  # noqa: E402

JOB_VENV = REPO / ".venv-job"
COMMAND_TIMEOUT_S = 600.0
PAIRS = 1  # each side runs once a pair: about 53 s a pair here (see the docstring)
DIRECT = """
import asyncio, sys
from overbrainer_prefect.flows import train
from overbrainer_prefect.trainers.spec import TrainingSpec
target, spec, runs_dir = sys.argv[1:4]
training = TrainingSpec.model_validate_json(spec)
asyncio.run(train(target=target, training=training, runs_dir=runs_dir))
"""
"""The train flow called directly, as a user's script does."""


def visible(root: Path) -> Path:
    """A directory with this package's dist-info (its entry points from
    pyproject.toml), for axolotl's PYTHONPATH."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    info = root / "visible" / f"overbrainer_prefect-{project['version']}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n"
    )
    lines = []
    for group, points in project["entry-points"].items():
        lines += [f"[{group}]"] + [f"{name} = {value}" for name, value in points.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return info.parent


def axolotl_config(model: Path, dataset: Path) -> dict[str, object]:
    """The axolotl YAML of `training(model, dataset)`."""
    spec = training(model, dataset)
    return {
        "base_model": spec.base_model,
        "datasets": [{"path": spec.datasets[0].path, "type": "chat_template"}],
        "adapter": "lora",
        "lora_r": spec.lora_r,
        "lora_alpha": spec.lora_alpha,
        "lora_target_modules": spec.lora_target_modules,
        "sequence_len": spec.sequence_len,
        "micro_batch_size": spec.micro_batch_size,
        "gradient_accumulation_steps": spec.gradient_accumulation_steps,
        "max_steps": spec.max_steps,
        "learning_rate": spec.learning_rate,
        "lr_scheduler": spec.lr_scheduler,
        "seed": spec.seed,
    }


def axolotl_cli_start_s(env: dict[str, str]) -> float:
    """Seconds axolotl's CLI takes to import what `train --cloud` imports."""
    began = time.perf_counter()
    subprocess.run(
        [str(JOB_VENV / "bin" / "python"), "-c", "import axolotl.cli.main, axolotl.cli.config"],
        env=env,
        check=True,
        capture_output=True,
        timeout=COMMAND_TIMEOUT_S,
    )
    return time.perf_counter() - began


def direct_side(root: Path, env: dict[str, str], target: str, spec: str, number: int) -> float:
    """The train flow from a script: its wall time less its job's."""
    from overbrainer_prefect.runs.store import Runs

    runs_dir = root / f"runs-direct-{number}"
    began = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", DIRECT, target, spec, str(runs_dir)],
        env=env,
        check=True,
        capture_output=True,
        timeout=COMMAND_TIMEOUT_S,
    )
    wall = time.perf_counter() - began
    [record] = Runs(runs_dir).list()
    if record.state != "succeeded":
        raise RuntimeError(f"the train flow did not succeed: {record.message}")
    job = job_seconds(record)
    note(f"train flow from a script: {wall:.1f} s, its job {job:.1f} s")
    return wall - job


def cloud_side(
    root: Path, env: dict[str, str], target: str, config: dict[str, object], number: int
) -> float:
    """`axolotl train --cloud`: its wall time less its job's."""
    from overbrainer_prefect.runs.store import Runs

    where = root / f"axolotl-{number}"
    where.mkdir()
    runs_dir = root / f"runs-cloud-{number}"
    (where / "config.yml").write_text(yaml.safe_dump(config))
    cloud = {
        "provider": "overbrainer",
        "target": target,
        "runs_dir": str(runs_dir),
        "python": sys.executable,
    }
    (where / "cloud.yml").write_text(yaml.safe_dump(cloud))
    began = time.perf_counter()
    done = subprocess.run(
        [str(JOB_VENV / "bin" / "axolotl"), "train", "config.yml", "--cloud", "cloud.yml"],
        cwd=where,
        env=env,
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )
    wall = time.perf_counter() - began
    if done.returncode != 0:
        raise RuntimeError(
            f"axolotl train --cloud exited {done.returncode}: "
            f"{done.stderr.strip().splitlines()[-1:]}"
        )
    [record] = Runs(runs_dir).list()
    job = job_seconds(record)
    note(f"axolotl train --cloud: {wall:.1f} s, its job {job:.1f} s")
    return wall - job


def main() -> None:
    """Starts the server, times both sides PAIRS times (alternating which goes
    first), prints the figures: the least time outside the job of each side
    (the machine is shared: noise only adds)."""
    from tests.tinymodel import tiny_dataset, tiny_model

    root = Path(tempfile.mkdtemp(prefix="bench-axolotl-cloud-"))
    model, dataset = tiny_model(REPO / ".cache"), tiny_dataset(REPO / ".cache")
    try:
        with prefect_server(root) as server:
            from overbrainer_prefect.blocks import LocalTarget

            target = f"bench-{uuid.uuid4().hex[:8]}"
            LocalTarget(job_venv=str(JOB_VENV), work_dir=str(root / "work"), cpu_threads=1).save(
                target
            )
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join([str(visible(root)), str(REPO)])
            env["PREFECT_API_URL"] = server.api_url
            spec = training(model, dataset).model_dump_json()
            config = axolotl_config(model, dataset)
            direct: list[float] = []
            cloud: list[float] = []
            starts: list[float] = []
            for number in range(PAIRS):
                progress(f"pair {number + 1}/{PAIRS}")
                for side in ("direct", "cloud") if number % 2 == 0 else ("cloud", "direct"):
                    if side == "direct":
                        direct.append(direct_side(root, env, target, spec, number))
                    else:
                        cloud.append(cloud_side(root, env, target, config, number))
                starts.append(axolotl_cli_start_s(env))
        overhead = min(cloud) - min(direct)
        note(f"axolotl's CLI start alone: {', '.join(f'{s:.1f}' for s in starts)} s")
        bench("axolotl-cloud-overhead", overhead, "s", "<=", 3.0)
        bench("axolotl-cloud-launcher-overhead", overhead - min(starts), "s")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    run_main(__file__, main)
