"""`axolotl lm-eval config.yml --cloud cloud.yml`'s work in the orchestrator's
Python, to its verdict: the session's tiny fine-tune (`tiny_compared`: the
`tiny_run` with its first compare, shared with the other modules of its unit,
see tests/scheduling.py) evaluated by the `evaluate` flow on its local target;
the base model's q8_0 GGUF its compare made is reused, as every evaluation of
a run of that base does (`overbrainer_prefect/kinds/base_export.py`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.test_axolotl_cloud import COMMAND_BOUND_S, orchestrate, ours, tiny_config
from tests.tiny_runs import TinyCompared


@pytest.mark.slow
def test_lm_eval_prints_the_evaluate_flows_verdict_on_the_run_axolotl_trained(
    tiny_compared: TinyCompared, tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    """The session's tiny fine-tune (with its q8_0 export) found by its YAML's
    base model, asked an eval file's item against its base model on the local
    target: the verdict is the command's last line, recorded under the run."""
    from prefect.settings import PREFECT_API_URL

    from overbrainer_prefect.evaluation.results import SCORED_FILE, EvaluationResult
    from overbrainer_prefect.evaluation.verdict import verdict

    copy = tiny_compared.run.copied(tmp_path)
    item = {"prompt": "Say hi.", "expected": "hi", "scorer": "contains"}
    (tmp_path / "evals.jsonl").write_text(json.dumps(item) + "\n")
    evaluation = {"eval_file": "evals.jsonl", "quant": "q8_0", "max_tokens": 4}
    done = orchestrate(
        tmp_path,
        tiny_config(*tiny),
        {"target": copy.target, "runs_dir": str(copy.runs_dir), "evaluation": evaluation},
        "lm_eval",
        timeout_s=COMMAND_BOUND_S,
        PREFECT_API_URL=str(PREFECT_API_URL.value()),
    )
    assert done.returncode == 0, done.stderr[-4000:]
    lines = ours(done.stderr)
    assert lines[0].startswith(f"overbrainer: evaluating run {copy.run_id}: http"), lines
    assert lines[-1].startswith(f"overbrainer: run {copy.run_id}: "), lines
    [scored] = copy.runs_dir.glob(f"{copy.run_id}/**/{SCORED_FILE}")
    result = EvaluationResult.model_validate_json(scored.read_text())
    assert result.heldout.tuned.total >= 1
    assert lines[-1] == f"overbrainer: run {copy.run_id}: {verdict(result)}"


@pytest.mark.slow
def test_ctrl_c_during_lm_eval_cancels_the_evaluations_job_in_one_line(
    tiny_compared: TinyCompared, tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    """An evaluation keeps nothing to go on from: Ctrl-C cancels its job at
    once (the cancellation hook a worker would run), exit 1, and its record
    says so."""
    from prefect.settings import PREFECT_API_URL

    from overbrainer_prefect.runs import Runs, RunState
    from tests.test_axolotl_cloud import REPO
    from tests.test_train_flow import kill, wait_until

    copy = tiny_compared.run.copied(tmp_path)
    items = [{"prompt": f"Count to {n}.", "expected": "1", "scorer": "contains"} for n in range(40)]
    (tmp_path / "evals.jsonl").write_text("".join(json.dumps(item) + "\n" for item in items))
    cloud = {
        "target": copy.target,
        "runs_dir": str(copy.runs_dir),
        "evaluation": {"eval_file": "evals.jsonl", "quant": "q8_0", "max_tokens": 64},
    }
    request = {
        "cloud": cloud,
        "config_dir": str(tmp_path),
        "config_yaml": yaml.safe_dump(tiny_config(*tiny)),
    }
    (tmp_path / "request.json").write_text(json.dumps(request))
    err = tmp_path / "stderr.txt"
    env = dict(os.environ, PYTHONPATH=str(REPO), PREFECT_API_URL=str(PREFECT_API_URL.value()))
    evaluations = Runs(copy.runs_dir).children(copy.run_id, "evaluation")

    def started() -> Any:
        found = [r for r in evaluations.list() if r.job is not None]
        return found[0] if found else None

    with err.open("w") as stderr:
        command = subprocess.Popen(
            [sys.executable, "-m", "overbrainer_prefect.axolotl_cloud", "lm_eval", "request.json"],
            cwd=tmp_path,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            text=True,
            start_new_session=True,
        )
    try:
        wait_until(started, 240, "the evaluation's job to start")
        record = started()
        command.send_signal(signal.SIGINT)
        code = command.wait(timeout=240)
    finally:
        kill(command)
    said = err.read_text()
    assert code == 1, said[-3000:]
    assert ours(said)[-2:] == [
        "overbrainer: Ctrl-C: cancelling the evaluation: its job is cancelled, what it ran on "
        "ended",
        "overbrainer: the evaluation was cancelled: run `axolotl lm-eval` again to evaluate the "
        "run",
    ], said[-3000:]
    assert evaluations.load(record.id).state == RunState.CANCELLED
