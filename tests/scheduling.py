"""How `make test` spreads the suite over pytest-xdist workers (`-n 3 --dist
loadgroup --no-loadscope-reorder`): most tests wait (on sshd, simulated boots,
Prefect servers, sleeps), so workers overlap the waits.

- Every test module is one xdist group, so a module's fixtures are made once,
  on one worker.
- The modules that use one of the session's costly shared things (`SHARED`:
  the tiny model's fine-tune, the deployed Prefect stack) form one group, so
  that thing is made once per session, on one worker, and what it left in that
  worker's Prefect database (artifacts, flow runs) is there for every user.
- Groups go out longest first (`MEASURED_S`, seconds measured on this 2-core
  machine with 3 workers), so the long ones do not start last.
- A module marked `alone` (it loads every core on purpose) is left out of the
  parallel run; the Makefile runs those afterwards, on their own.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest

SHARED = {
    "tiny_run": "tiny-run",  # the tiny model's fine-tune and export (tests/tiny_runs.py)
    "deployed": "deployed",  # the Prefect server with every deployment (tests/prefect_server.py)
}
"""Session fixture -> the group of every module that uses it."""

MEASURED_S: dict[str, float] = {
    "deployed": 600,
    "tiny-run": 500,
    "test_runpod_flows": 400,
    "test_watchdog": 200,
    "test_recovery": 150,
    "test_readme": 75,
    "test_pipeline": 90,
    "test_evaluate_flow": 90,
    "test_runpod_gpus": 90,
}
"""Group -> its seconds in the last measured parallel run; a group not listed
counts 5 s a test (most modules of fast tests)."""

UNMEASURED_S_PER_TEST = 5.0


def group_of(module: str, fixtures: Iterable[str]) -> str:
    """The xdist group of a module whose tests use `fixtures` (their closure):
    the first SHARED fixture's group, else the module's own name."""
    for fixture, group in SHARED.items():
        if fixture in fixtures:
            return group
    return module


def assign(items: list[pytest.Item]) -> None:
    """Marks every item with its module's xdist group and orders the items by
    group, the longest groups first (the order loadgroup hands them out in);
    within a group, items keep their collection order."""
    used: dict[str, set[str]] = {}
    for item in items:
        used.setdefault(module_of(item), set()).update(getattr(item, "fixturenames", ()))
    groups = {module: group_of(module.rsplit(".", 1)[-1], names) for module, names in used.items()}
    sizes: dict[str, int] = {}
    first_seen: dict[str, int] = {}
    for index, item in enumerate(items):
        group = groups[module_of(item)]
        item.add_marker(pytest.mark.xdist_group(group))
        sizes[group] = sizes.get(group, 0) + 1
        first_seen.setdefault(group, index)

    def order(item: pytest.Item) -> tuple[float, int]:
        group = groups[module_of(item)]
        return (-MEASURED_S.get(group, sizes[group] * UNMEASURED_S_PER_TEST), first_seen[group])

    items.sort(key=order)


def module_of(item: pytest.Item) -> str:
    """The dotted name of the item's module (its node ID for an item without one)."""
    module = getattr(item, "module", None)
    return str(module.__name__) if module is not None else item.nodeid
