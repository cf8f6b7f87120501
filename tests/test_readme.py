"""Every Python snippet of the README runs as written, twice (a second run must
work as well as the first), in a fresh Python process on Prefect's own
temporary server, as a new user would paste them. A fixture adapts only what
this machine cannot reach: the Hub's model and the user's dataset become the
tiny model and its chats, the job venv and work directory named in the README
become this checkout's job venv and a temporary directory."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, job_venv
from tests.prefect_server import clean_env, migrated_sqlite

pytestmark = pytest.mark.slow

README = REPO / "README.md"
SNIPPET = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
RUN_TIMEOUT_S = 1500.0  # two trainings of the tiny model and a temporary server

RUNNER = """
import json, sys
snippets = json.loads(sys.argv[1])
for round_ in (1, 2):
    for line, code in snippets:
        namespace = {"__name__": "__main__"}
        exec(compile(code, f"README.md:{line}", "exec"), namespace)
        print(f"SNIPPET-OK {round_} {line}", flush=True)
"""


def snippets() -> list[tuple[int, str]]:
    """The README's Python snippets with the line each starts on."""
    text = README.read_text(encoding="utf-8")
    return [(text[: m.start()].count("\n") + 2, m.group(1)) for m in SNIPPET.finditer(text)]


def adapted(code: str, tiny: tuple[Path, Path], work: Path) -> str:
    """`code` with what this machine cannot reach replaced; fails when the README
    no longer says what is replaced (the test would silently run something else)."""
    model, dataset = tiny
    replacements = {
        '"HuggingFaceTB/SmolLM2-135M-Instruct"': json.dumps(str(model)),
        '"data/train.jsonl"': json.dumps(str(dataset)),
        '"/opt/venvs/axolotl"': json.dumps(str(job_venv())),
        '"~/.overbrainer/work"': json.dumps(str(work)),
        "sequence_len=1024": "sequence_len=256",  # the tiny model's context
        "max_steps=200": "max_steps=6",  # what a real model needs; the tiny one shows it in 6
    }
    for old, new in replacements.items():
        if old in code:
            code = code.replace(old, new)
    return code


def test_every_readme_python_snippet_runs_as_written_twice(
    tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    found = snippets()
    assert len(found) >= 3, "the README's Python snippets"
    joined = "\n".join(code for _, code in found)
    for placeholder in ("HuggingFaceTB/SmolLM2-135M-Instruct", "/opt/venvs/axolotl"):
        assert placeholder in joined, f"the README no longer names {placeholder}"
    work = tmp_path / "work"
    runs = tmp_path / "runs"
    prepared = [(line, adapted(code, tiny, work)) for line, code in found]
    # Prefect's temporary server finds its database migrated (its own default path in
    # PREFECT_HOME); the demo's test starts one on a new database, as a new user's first run
    migrated_sqlite(tmp_path / "prefect-home" / "prefect.db")
    env = clean_env(
        PREFECT_HOME=str(tmp_path / "prefect-home"),
        OVERBRAINER_RUNS_DIR=str(runs),
        PYTHONPATH=str(REPO),
    )
    process = subprocess.Popen(
        [sys.executable, "-c", RUNNER, json.dumps(prepared)],
        cwd=tmp_path,
        env=env,
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
    ok = re.findall(r"SNIPPET-OK (\d) (\d+)", text)
    assert ok == [(str(r), str(line)) for r in (1, 2) for line, _ in found], text[-2000:]
    trained = [p for p in runs.iterdir() if (p / "run.json").is_file()]
    assert len(trained) == 2  # the train snippet, once a round
    for run in trained:
        record = json.loads((run / "run.json").read_text())
        assert record["state"] == "succeeded", record
        assert record["target"].endswith("/gpu-box")
        assert (run / "output" / "adapter_model.safetensors").is_file()
