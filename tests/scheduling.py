"""How `make test` spreads the suite over pytest-xdist workers (`-n 4 --dist
loadscope --no-loadscope-reorder`): most tests wait (on sshd, simulated boots,
Prefect servers, sleeps), so workers overlap the waits.

- Every test module is one unit of work, so its module fixtures are made once,
  on one worker (`GroupScheduling`, the conftest's `pytest_xdist_make_scheduler`).
- The modules that use one of the session's costly shared fixtures (`SHARED`:
  the tiny model's fine-tune, the deployed Prefect stack) are grouped in units
  (`GROUPS`), so that fixture is made once per unit, on one worker, and what it
  left in that worker's Prefect database (artifacts, flow runs) is there for
  every module of the unit that reads it. Collection fails, naming the fix,
  when a module uses a SHARED fixture and is in none of its units.
- Units go out longest first (`MEASURED_S`), so the long ones do not start last.

(`--dist loadgroup` cannot do this: from pytest 9.2 on, the group suffix xdist
writes into node IDs is lost, pytest-dev/pytest-xdist#1386.)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest
from xdist.scheduler import LoadScopeScheduling

SHARED = {
    "tiny_run": frozenset({"tiny-run"}),  # the tiny model's fine-tune and export (tiny_runs.py)
    # the Prefect server with every deployment (prefect_server.py): two units, each its own
    # stack, since one unit of both the deployments' and the UI's tests was the suite's
    # critical path (its stack costs about a minute; its tests, about fifteen)
    "deployed": frozenset({"deployed", "deployed-ui"}),
}
"""Session fixture -> the units its modules may be in (each unit makes it once)."""

ENDED_WITH_UNIT = frozenset({"deployed"})
"""The SHARED fixtures that hold processes (a stack: its Prefect server, with its
services, and its workers) and that an xdist worker ends as soon as it leaves the
unit that made them (`end_unit_fixtures`), instead of keeping them to the
session's end: no later unit of that worker uses them (each unit makes its own),
and each stack idled there for about ten minutes, at about 3.4 CPU seconds a
minute for its server alone (tests/prefect_server.py's UNUSED_SERVICES), on the
two cores the whole suite shares."""

GROUPS = {
    "tests/test_compare.py": "tiny-run",
    "tests/test_axolotl_cloud_lm_eval.py": "tiny-run",  # + one evaluation, about 25 s
    "tests/test_evaluation_job.py": "tiny-run",
    "tests/test_export.py": "tiny-run",
    "tests/test_runpod_pipeline.py": "tiny-run",
    "tests/test_deployments.py": "deployed",
    # two tiny trainings through axolotl's CLI as runs of the local train deployment (~100 s)
    "tests/test_axolotl_cloud_deployed.py": "deployed",
    "tests/test_ui_live.py": "deployed-ui",
    "tests/test_suspended_runs.py": "deployed-ui",
}
"""Module -> its unit, for the modules that share one (every other module is its own)."""

MEASURED_S: dict[str, float] = {
    # the demo on a busy machine: first, while the rest of the suite keeps every core busy (129 s)
    "tests/test_demo_busy.py": 1000,
    # one fine-tune serves both UI looks; flow runs made and cancelled through the client
    "deployed-ui": 644,
    # + axolotl --cloud with deployment: and its Ctrl-C then l
    "deployed": 553,
    "tiny-run": 491,
    # the killed flow's 144 s of pod life run beside its other tests
    "tests/test_runpod_flows.py": 375,
    # axolotl's CLI imports torch; five commands start together (a module fixture)
    "tests/test_axolotl_cloud.py": 298,
    # + a restart from step 0
    "tests/test_lost_pod.py": 248,
    # a stop and its resume: two real trainings in a row
    "tests/test_train_flow.py": 242,
    "tests/test_recovery.py": 199,
    "tests/test_watchdog.py": 168,
    "tests/test_deployments_postgres.py": 144,
    # the collects wait on the follow leases, not fixed sleeps
    "tests/test_object_store.py": 140,
    # three sshd, shell jobs, 2-node DDP trainings and one tiny training on a saved pool
    "tests/test_ssh_pool.py": 135,
    "tests/test_pod_fate.py": 114,
    "tests/test_readme.py": 112,
    # three 2-pod clusters of the simulator, one a 2-node DDP training under torchrun
    "tests/test_runpod_cluster.py": 90,
    "tests/test_pipeline.py": 79,
    "tests/test_ssh_flows.py": 60,
    "tests/test_store.py": 58,
    # + about 100 s when the 0.19 venv is built (cached outside the clone)
    "tests/test_axolotl_versions.py": 55,
    "tests/test_collect_final.py": 50,
    "tests/test_evaluate_flow.py": 49,
    # stalls longer than a (4 s) lease, waited out
    "tests/test_lease_chaos.py": 45,
    "tests/test_gpu_spec.py": 45,
    "tests/test_checkpoints.py": 30,
    "tests/test_target_contract.py": 27,
    "tests/test_money_flows.py": 25,
    "tests/test_ssh_executor.py": 23,
    "tests/test_preflight.py": 20,
    "tests/test_axolotl_trainer.py": 19,
    "tests/test_collect.py": 17,
    "tests/test_resume_here.py": 15,
    "tests/test_local_executor.py": 12,
    "tests/test_resume_anywhere.py": 11,
    # 500 ended runs put into moto, a Prefect server
    "tests/test_live_index.py": 9,
    "tests/test_money_ledger.py": 9,
    "tests/test_runpod_client.py": 9,
    "tests/test_nightly.py": 8,
    "tests/test_delivery.py": 8,
    "tests/test_pod_disk.py": 7,
    "tests/test_run_lifecycle.py": 7,
    "tests/test_budget.py": 7,
    "tests/test_faultproxy.py": 7,
}
"""Unit -> its seconds (setup, call and teardown of its tests): junit times of
a quiet run of the suite on 4 workers (2026-12-05, 4,814 worker-seconds in
all); a unit not listed counts 5 s a test. Only their order matters (and the
demo's place: first). Ordered by the earlier, stale figures, a simulation of
xdist's loadscope over that run's times gave the workers 1,189-1,236 s; by
these, 1,203-1,204 s (the ideal split: 1,204 s)."""

UNMEASURED_S_PER_TEST = 5.0


def unit_of(path: str) -> str:
    """The unit of work of a test module, by its path from the repository root."""
    return GROUPS.get(path, path)


class GroupScheduling(LoadScopeScheduling):
    """xdist's `loadscope` with one scope per unit (`unit_of`) instead of per module."""

    def _split_scope(self, nodeid: str) -> str:
        return unit_of(nodeid.split("::", 1)[0])


def make_scheduler(config: pytest.Config, log: Any) -> GroupScheduling | None:
    """The scheduler for `--dist loadscope`; None (xdist's own) for any other mode."""
    if config.getvalue("dist") != "loadscope":
        return None
    return GroupScheduling(config, log)


def path_of(item: pytest.Item) -> str:
    """The item's module path as node IDs spell it (`tests/test_x.py`)."""
    return item.nodeid.split("::", 1)[0]


def misplaced(path: str, fixtures: Iterable[str]) -> str | None:
    """What is wrong with the unit of a module whose tests use `fixtures`, or None."""
    for fixture, units in SHARED.items():
        if fixture in fixtures and unit_of(path) not in units:
            return (
                f"{path} uses the session fixture `{fixture}`: add it to GROUPS in "
                f"tests/scheduling.py as one of {sorted(units)}, so that `{fixture}` is made "
                "once per unit"
            )
    return None


def order(items: list[pytest.Item], sort: bool) -> None:
    """Checks every module's unit (pytest.UsageError naming the fix when a module
    using a SHARED fixture is outside its unit) and, when `sort`, orders the
    items by unit, the longest units first; within a unit, items keep their
    collection order."""
    used: dict[str, set[str]] = {}
    for item in items:
        used.setdefault(path_of(item), set()).update(getattr(item, "fixturenames", ()))
    for path, fixtures in used.items():
        wrong = misplaced(path, fixtures)
        if wrong is not None:
            raise pytest.UsageError(wrong)
    if not sort:
        return
    sizes: dict[str, int] = {}
    first_seen: dict[str, int] = {}
    for index, item in enumerate(items):
        unit = unit_of(path_of(item))
        sizes[unit] = sizes.get(unit, 0) + 1
        first_seen.setdefault(unit, index)

    def key(item: pytest.Item) -> tuple[float, int]:
        unit = unit_of(path_of(item))
        return (-MEASURED_S.get(unit, sizes[unit] * UNMEASURED_S_PER_TEST), first_seen[unit])

    items.sort(key=key)


def end_unit_fixtures(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Ends (tears down, as pytest would at the session's end) every
    ENDED_WITH_UNIT fixture of `item`'s unit when `nextitem` is of another unit,
    on an xdist worker (where a unit's tests run together and each unit makes
    its own; a run without xdist keeps collection order, in which the modules
    of a unit are apart, and its one stack to the end). A later item that asks
    for it again gets a new one. At the session's end (`nextitem` None) pytest
    ends them itself."""
    unit = unit_of(path_of(item))
    if nextitem is None or unit_of(path_of(nextitem)) == unit:
        return
    if not hasattr(item.config, "workerinput"):
        return
    for name in sorted(ENDED_WITH_UNIT):
        if unit not in SHARED[name]:
            continue
        # pytest has no public call to end one fixture early; `finish` is what its
        # own teardown calls, and runs the finalizers of the fixtures made from it
        # (tests/prefect_server.py's `trained`) first
        for fixturedef in item.session._fixturemanager.getfixturedefs(name, item) or ():
            fixturedef.finish(item._request)
