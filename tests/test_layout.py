"""The shape of the package: the core never imports Prefect, the flows never
branch on which target they hold, nothing imports inside a function to break a
circle, and no import circle exists among the package's modules."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "overbrainer_prefect"

CORE_PACKAGES = (
    "runs",
    "steps",
    "kinds",
    "executors",
    "trainers",
    "runpod",
    "targets",
    "targets/runpod",
    "evaluation",
    "delivery",
    "nightly",
    "money",
    "store",
)
"""The packages that never import Prefect: every module of each."""

CORE_MODULES = ("overbrainer_prefect.finetune", "overbrainer_prefect.cells")
"""The top-level modules that never import Prefect."""

CORE = sorted(
    ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    for package in CORE_PACKAGES
    for path in (PACKAGE / package).glob("*.py")
    if path.name != "__init__.py"
) + list(CORE_MODULES)

TARGET_CLASSES = (
    "RunpodTarget",
    "SshTarget",
    "SshPool",
    "LocalTarget",
    "PodTarget",
    "HostTarget",
    "PoolTarget",
)


def test_the_core_imports_without_prefect() -> None:
    code = (
        "import sys\n"
        + "".join(f"import {module}\n" for module in CORE)
        + "loaded = sorted(m for m in sys.modules if m == 'prefect' or m.startswith('prefect.'))\n"
        + "print(','.join(loaded))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == ""


def _flow_modules() -> list[Path]:
    # the pods flow manages Runpod's own pods: it is Runpod's by definition
    return [p for p in sorted((PACKAGE / "flows").glob("*.py")) if p.name != "pods.py"]


def test_no_flow_module_branches_on_the_target_it_holds() -> None:
    found = []
    for path in _flow_modules():
        for node in ast.walk(ast.parse(path.read_text())):
            text = ast.unparse(node) if isinstance(node, ast.Call | ast.Compare) else ""
            is_isinstance = getattr(getattr(node, "func", None), "id", None) == "isinstance"
            if is_isinstance and any(name in text for name in TARGET_CLASSES):
                found.append(f"{path.name}: {text}")
            kinds = ("target_kind", "'runpod'", "'ssh'", "'local'")
            if isinstance(node, ast.Compare) and any(kind in text for kind in kinds):
                found.append(f"{path.name}: {text}")
            is_def = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            if is_def and node.name.endswith("_on_pod"):
                found.append(f"{path.name}: def {node.name}")
    assert found == []


def test_no_module_imports_the_package_inside_a_function() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "jobs" in path.parts:  # scripts that run in the job venv, not the package
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for inner in ast.walk(node):
                module = inner.module if isinstance(inner, ast.ImportFrom) else None
                names = [a.name for a in inner.names] if isinstance(inner, ast.Import) else []
                if (module or "").startswith("overbrainer_prefect") or any(
                    n.startswith("overbrainer_prefect") for n in names
                ):
                    found.append(f"{path.relative_to(PACKAGE)}: {node.name}")
    assert found == []


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The package modules `path` imports at module level (TYPE_CHECKING left out)."""
    found: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for inner in ast.walk(node):
            names: list[str] = []
            if isinstance(inner, ast.ImportFrom) and inner.module and inner.level == 0:
                names = [inner.module] + [f"{inner.module}.{a.name}" for a in inner.names]
            elif isinstance(inner, ast.Import):
                names = [a.name for a in inner.names]
            found |= {name for name in names if name in modules}
    return found


def test_no_import_circle_among_the_package_modules() -> None:
    paths = {}
    for path in PACKAGE.rglob("*.py"):
        if "jobs" in path.parts:
            continue
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            continue  # re-exports
        paths[".".join(parts)] = path
    graph = {m: _imports(p, set(paths)) - {m} for m, p in paths.items()}
    circles = []
    state: dict[str, int] = {}

    def visit(module: str, trail: list[str]) -> None:
        state[module] = 1
        for other in sorted(graph[module]):
            if state.get(other) == 1:
                circles.append(" -> ".join([*trail[trail.index(other) :], other]))
            elif other not in state:
                visit(other, [*trail, other])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert circles == []


def _package_of(module: str) -> str:
    """The subpackage (or top module) of the package that `module` is in."""
    return module.split(".")[1]


def test_no_import_circle_among_the_subpackages() -> None:
    paths = {}
    for path in PACKAGE.rglob("*.py"):
        if "jobs" in path.parts or path.name == "__init__.py":
            continue
        paths[".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)] = path
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        here = _package_of(module)
        graph.setdefault(here, set())
        graph[here] |= {_package_of(o) for o in _imports(path, set(paths))} - {here}

    def reaches(start: str, goal: str) -> bool:
        seen, pending = set(), [start]
        while pending:
            node = pending.pop()
            for other in graph.get(node, set()):
                if other == goal:
                    return True
                if other not in seen:
                    seen.add(other)
                    pending.append(other)
        return False

    circles = sorted(
        {" <-> ".join(sorted((a, b))) for a in graph for b in graph[a] if reaches(b, a)}
    )
    assert circles == []


def test_only_the_steps_and_the_driver_change_a_run_record() -> None:
    """A provider answers facts; `steps/` and the driver (and the store) write records."""
    allowed = {"runs", "steps", "flows", "driver"}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "jobs" in path.parts:
            continue
        package = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
        if package in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("end_step.fail"):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: fail()")
            if isinstance(node, ast.Assign | ast.AugAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    text = ast.unparse(target)
                    if (
                        isinstance(target, ast.Attribute)
                        and text.split(".")[-1] == "state"
                        and (text.startswith(("record.", "run.")))
                    ):
                        found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {text}")
    assert found == []


def test_the_runpod_provider_imports_neither_the_run_store_nor_the_trainers() -> None:
    """A provider answers facts: what works with a run on a pod is the target's
    (`targets/runpod/`), so a second provider could do as much."""
    found = []
    for path in sorted((PACKAGE / "runpod").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            module = node.module if isinstance(node, ast.ImportFrom) else None
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            for name in [module or "", *names]:
                if name.split(".")[:2] in (
                    ["overbrainer_prefect", "runs"],
                    ["overbrainer_prefect", "trainers"],
                ):
                    found.append(f"{path.relative_to(PACKAGE)}: {name}")
    assert found == []


def test_the_abstract_target_block_is_not_a_block_type_of_its_own() -> None:
    from abc import ABC

    from overbrainer_prefect.blocks import TargetBlock

    assert ABC in TargetBlock.__bases__  # Prefect registers no block type with ABC as a base
