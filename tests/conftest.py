"""Shared fixtures: a real Prefect server for the session (the ephemeral test
harness on a temporary SQLite database), the job venv, the tiny model, and its
fine-tune with a q8_0 export and a first compare, each made once for the session
(see tests/tiny_runs.py)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from tests.s3server import S3Server
    from tests.tiny_runs import TinyCompared, TinyRun

REPO = Path(__file__).resolve().parent.parent

# Before Prefect is imported anywhere: a private home, no analytics, no Hub.
_HOME = tempfile.mkdtemp(prefix="overbrainer-test-prefect-")
os.environ["PREFECT_HOME"] = _HOME
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_LOGGING_LEVEL", "WARNING")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.pop("PREFECT_API_URL", None)
# boto3 finds these before any other source (it never asks an instance's metadata service);
# they are moto's own test keys, and every store of the tests is on 127.0.0.1.
os.environ.update(
    AWS_ACCESS_KEY_ID="AKIAOVERBRAINERTEST0",
    AWS_SECRET_ACCESS_KEY="overbrainer-test-secret",
    AWS_DEFAULT_REGION="us-east-1",
    AWS_REGION="us-east-1",
    AWS_EC2_METADATA_DISABLED="true",
)
for _name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
    os.environ.pop(_name, None)


def _one_certificate_bundle(directory: Path) -> Path:
    """A CA file of one certificate (certifi's first) in `directory`.

    Every Prefect client (and Prefect makes one for each block it saves, each
    result store it sets up, each runtime lookup) builds a TLS context from
    PREFECT_API_SSL_CERT_FILE, else from certifi's whole bundle: about 16 ms of a
    core each, also for an `http://` server. Every Prefect server of the tests is
    plain HTTP on 127.0.0.1, so no test uses the bundle; with one certificate a
    context costs 0.3 ms (py-spy of an in-process module: half of the pytest
    process's own CPU went to those contexts). `make bench` does not set it: its
    figures are Prefect's real cost."""
    import certifi

    bundle = Path(certifi.where()).read_text()
    end = "-----END CERTIFICATE-----"
    path = directory / "one-ca.pem"
    path.write_text(bundle[: bundle.index(end) + len(end)] + "\n")
    return path


# kept by tests.prefect_server.clean_env for the servers, workers and flow runs it starts
os.environ["PREFECT_API_SSL_CERT_FILE"] = str(_one_certificate_bundle(Path(_HOME)))

from tests.prefect_server import UNUSED_SERVICES, drain_prefect_services  # noqa: E402  (imports no Prefect)

os.environ.update(UNUSED_SERVICES)  # the session's harness server (prefect_server below)


def job_venv() -> Path:
    """The job venv the tests run jobs in (`make setup` creates it)."""
    return Path(os.environ.get("OVERBRAINER_TEST_JOB_VENV", REPO / ".venv-job"))


@pytest.fixture(scope="session")
def prefect_server() -> Iterator[None]:
    """A real Prefect API server on a temporary database, for the whole session,
    with flow heartbeats off (they add a second to every flow). Its database is
    migrated before the server starts (`migrated_sqlite`): the harness names it
    `prefect-test.db` in a directory of its own `mkdtemp`, which makes it there."""
    from unittest import mock

    import prefect.testing.utilities as harness
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    from tests.prefect_server import migrated_sqlite

    def seeded_mkdtemp() -> str:
        directory = tempfile.mkdtemp(prefix="prefect-test-")
        migrated_sqlite(Path(directory) / "prefect-test.db")
        return directory

    with (
        mock.patch.object(harness, "mkdtemp", seeded_mkdtemp),
        harness.prefect_test_harness(server_startup_timeout=120),
        temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}),
    ):
        yield
        drain_prefect_services()


@pytest.fixture(scope="session")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A real S3 server (moto's) on 127.0.0.1 for this worker's session; each
    test takes a bucket of its own (`s3.bucket_url()`)."""
    from tests.s3server import S3Server

    server = S3Server.start(tmp_path_factory.mktemp("s3") / "moto.log")
    try:
        yield server
    finally:
        server.stop()


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


@pytest.fixture(scope="session")
def tiny_run(
    prefect_server: None, tiny: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> TinyRun:
    """The session's fine-tune of the tiny model (6 steps, the `train` flow on a
    local target) with its q8_0 export. Read it, or change a copy (`copied`)."""
    from tests.tiny_runs import train_tiny

    return train_tiny(*tiny, tmp_path_factory.mktemp("tiny-run"))


@pytest.fixture(scope="session")
def tiny_compared(tiny_run: TinyRun, tmp_path_factory: pytest.TempPathFactory) -> TinyCompared:
    """A copy of `tiny_run` and its first compare, made once for the session: the
    compare and evaluation tests share it."""
    from tests.tiny_runs import compare_tiny

    return compare_tiny(tiny_run.copied(tmp_path_factory.mktemp("tiny-compared")))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Checks that the modules sharing a costly session fixture share a unit of
    work and, on an xdist worker, puts the longest units first (tests/scheduling.py)."""
    from tests.scheduling import order

    order(items, sort=hasattr(config, "workerinput"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """After pytest's own teardown of `item`: a unit's stack ends with the unit
    (tests/scheduling.py's `end_unit_fixtures`)."""
    from tests.scheduling import end_unit_fixtures

    result = yield
    end_unit_fixtures(item, nextitem)
    return result


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadscope` with the modules that share a session fixture in one
    scope (tests/scheduling.py)."""
    from tests.scheduling import make_scheduler

    return make_scheduler(config, log)
