"""`axolotl lm-eval config.yml --cloud cloud.yml`'s work in the orchestrator's
Python, to its verdict: the session's tiny fine-tune (`tiny_run`, shared with
the other modules of its unit, see tests/scheduling.py) evaluated by the
`evaluate` flow on its local target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_axolotl_cloud import COMMAND_BOUND_S, orchestrate, ours, tiny_config
from tests.tiny_runs import TinyRun


@pytest.mark.slow
def test_lm_eval_prints_the_evaluate_flows_verdict_on_the_run_axolotl_trained(
    tiny_run: TinyRun, tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    """The session's tiny fine-tune (with its q8_0 export) found by its YAML's
    base model, asked an eval file's item against its base model on the local
    target: the verdict is the command's last line, recorded under the run."""
    from prefect.settings import PREFECT_API_URL

    from overbrainer_prefect.evaluation.results import SCORED_FILE, EvaluationResult
    from overbrainer_prefect.evaluation.verdict import verdict

    copy = tiny_run.copied(tmp_path)
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
