"""The demo's flow succeeds on a machine made busy on purpose: one CPU-bound
process per core (started by the test, stopped by PID) while `demo/run_demo.py`
saves its block and runs the `fine_tune` flow on Prefect's own temporary server,
whose start is what a busy machine slowed past Prefect's 20 s default. It runs
the demo's code (its `fine_tune()`, block, flow and settings) with the tiny
model in place of SmolLM2 (too slow for the test suite) and short answers; the
tuned GGUF it makes is named for its run. Also: the demo's failures are one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO, job_venv
from tests.prefect_server import clean_env
from tests.procs import kill_pids

pytestmark = [pytest.mark.slow, pytest.mark.alone]

RUN_TIMEOUT_S = 1800.0  # train, two exports and a compare of the tiny model, on a busy machine

DRIVER = """
import importlib.util, json, sys
from pathlib import Path
spec = importlib.util.spec_from_file_location("run_demo", sys.argv[1])
demo = importlib.util.module_from_spec(spec)
spec.loader.exec_module(demo)
model, dataset, work, runs = map(Path, sys.argv[2:6])
demo.WORK_DIR, demo.RUNS_DIR = work, runs
demo.MAX_TOKENS = 8
real_spec = demo.training_spec
def tiny_spec():
    spec = real_spec()
    return spec.model_copy(update={
        "base_model": str(model),
        "datasets": [spec.datasets[0].model_copy(update={"path": str(dataset)})],
        "max_steps": 6, "sequence_len": 64, "lora_r": 8, "lora_alpha": 16,
    })
demo.training_spec = tiny_spec
demo.quiet_tracebacks()
result, seconds = demo.fine_tune()
print("RESULT " + json.dumps({
    "run_id": result.run_id,
    "gguf": result.export.gguf_path,
    "answers": result.compare.answers_path,
    "seconds": seconds,
}), flush=True)
"""

GENERAL_NAME = """
import sys
from gguf import GGUFReader
field = GGUFReader(sys.argv[1]).fields["general.name"]
print(bytes(field.parts[field.data[0]]).decode())
"""


@pytest.fixture
def busy_machine() -> Iterator[list[int]]:
    """One CPU-bound process per core, stopped by PID at the end."""
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", "while True: pass"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        for _ in range(os.cpu_count() or 2)
    ]
    try:
        yield [p.pid for p in processes]
    finally:
        kill_pids([p.pid for p in processes])
        for process in processes:
            process.wait(timeout=30)


def demo_env(tmp_path: Path) -> dict[str, str]:
    """A new user's environment: no Prefect setting at all (so no API URL: the
    flow starts Prefect's temporary server), a fresh Prefect home."""
    env = clean_env(PREFECT_HOME=str(tmp_path / "prefect-home"), PYTHONPATH=str(REPO))
    env.pop("OMP_NUM_THREADS", None)
    return env


def test_the_demo_flow_succeeds_with_every_core_kept_busy(
    tiny: tuple[Path, Path], busy_machine: list[int], tmp_path: Path
) -> None:
    model, dataset = tiny
    runs = tmp_path / "runs"
    process = subprocess.Popen(
        [
            sys.executable,
            "-c",
            DRIVER,
            str(REPO / "demo" / "run_demo.py"),
            str(model),
            str(dataset),
            str(tmp_path / "work"),
            str(runs),
        ],
        cwd=REPO,
        env=demo_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    text = output.decode(errors="replace")
    (tmp_path / "output.txt").write_text(text)
    assert process.returncode == 0, text[-4000:]
    assert all(os.path.exists(f"/proc/{pid}") for pid in busy_machine)  # busy all along
    assert "Traceback" not in text
    result = json.loads(text.split("RESULT ", 1)[1].splitlines()[0])
    run_id = result["run_id"]
    gguf = Path(result["gguf"])
    assert gguf.name == f"run-{run_id}-q8_0.gguf"
    name = subprocess.run(
        [str(job_venv() / "bin" / "python"), "-c", GENERAL_NAME, str(gguf)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout.strip()
    assert name == f"run {run_id}, tuned from model"  # the tiny model's directory is `model`
    answers = [json.loads(line) for line in Path(result["answers"]).read_text().splitlines()]
    assert {a["model"] for a in answers} == {"base", "tuned"}


def test_a_demo_failure_is_one_line_without_a_traceback(tmp_path: Path) -> None:
    script = (
        "import importlib.util, sys\n"
        "spec = importlib.util.spec_from_file_location('run_demo', sys.argv[1])\n"
        "demo = importlib.util.module_from_spec(spec); spec.loader.exec_module(demo)\n"
        "def broken():\n"
        "    raise RuntimeError('Timed out while attempting to connect to ephemeral Prefect "
        "API server.\\nmore detail')\n"
        "demo.demo = broken\n"
        "demo.main()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(REPO / "demo" / "run_demo.py")],
        env=demo_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert lines[-1].startswith("demo FAILED: RuntimeError: Timed out while attempting")
    assert "prefect server start" in lines[-1] and "more detail" not in lines[-1]
    assert "Traceback" not in done.stdout + done.stderr
