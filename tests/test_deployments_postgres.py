"""The train deployment on a Prefect server backed by PostgreSQL, with a real
process worker, to completion: suspended while the follower follows its job,
then resumed (issue 28). A module of its own (not in the `deployed`
unit of tests/scheduling.py): it starts its own stack, so it runs beside the
deployment tests on another worker."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from overbrainer_prefect.runs import Runs, RunState
from tests.prefect_server import FOLLOWER, start_stack, tiny_training
from tests.procs import alive
from tests.test_deployments import assert_verified
from tests.test_suspended_runs import start_follower

pytest_plugins = ["tests.prefect_server", "tests.postgres"]
pytestmark = pytest.mark.slow


def test_the_train_deployment_runs_to_completion_on_postgresql(
    postgres: Any, tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    stack = start_stack(tmp_path / "pg", postgres.url, names=["train/local", FOLLOWER])
    try:
        start_follower(stack)
        flow_run_id = stack.run_deployment(
            "train/local", target=stack.target, training=tiny_training(*tiny, max_steps=2)
        )
        flow_run = stack.wait_final(flow_run_id)
        assert flow_run.state.is_completed(), flow_run.state
        (run_id,) = [r.id for r in Runs(stack.runs).list()]
        assert Runs(stack.runs).load(run_id).state == RunState.SUCCEEDED
        assert_verified(stack.runs, run_id)
        # the server kept it in PostgreSQL
        assert postgres.query(f"select state_type from flow_run where id = '{flow_run_id}'") == [
            "COMPLETED"
        ]
        # it waited suspended while its job trained, and was resumed
        states = postgres.query(
            "select name from flow_run_state "
            f"where flow_run_id = '{flow_run_id}' order by timestamp"
        )
        assert "Suspended" in states and states.index("Suspended") < len(states) - 1, states
    finally:
        stack.stop()
    assert not any(alive(w.process.pid) for w in stack.workers if w.process is not None)
