"""Shared fixtures: a real Prefect server for the session (the ephemeral test
harness on a temporary SQLite database), the job venv, and the tiny model."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# Before Prefect is imported anywhere: a private home, no analytics, no Hub.
_HOME = tempfile.mkdtemp(prefix="overbrainer-test-prefect-")
os.environ["PREFECT_HOME"] = _HOME
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_LOGGING_LEVEL", "WARNING")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.pop("PREFECT_API_URL", None)


def job_venv() -> Path:
    """The job venv the tests run jobs in (`make setup` creates it)."""
    return Path(os.environ.get("OVERBRAINER_TEST_JOB_VENV", REPO / ".venv-job"))


@pytest.fixture(scope="session")
def prefect_server() -> Iterator[None]:
    """A real Prefect API server on a temporary database, for the whole session,
    with flow heartbeats off (they add a second to every flow)."""
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    with (
        prefect_test_harness(server_startup_timeout=120),
        temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}),
    ):
        yield


@pytest.fixture(scope="session")
def job_python() -> str:
    """The job venv's Python; the session fails at once without it."""
    python = job_venv() / "bin" / "python"
    if not python.exists():
        pytest.fail(f"no job venv at {job_venv()}: run `make setup` first")
    return str(python)


@pytest.fixture(scope="session")
def tiny(job_python: str) -> tuple[Path, Path]:
    """The tiny model and its chat dataset, built once in the job venv and cached."""
    from tests.tinymodel import tiny_dataset, tiny_model

    cache = REPO / ".cache"
    return tiny_model(cache), tiny_dataset(cache)
