"""A private PostgreSQL cluster for the tests: `initdb` into a temporary
directory, `pg_ctl start` on a free port of 127.0.0.1 (trust authentication,
no password), stopped by its postmaster's PID.

The binaries come from Debian's `postgresql` package (`/usr/lib/postgresql/*/bin`,
installed by `.ci/run`). As root, the cluster runs as the `postgres` user, since
PostgreSQL refuses to run as root.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.ports import free_port
from tests.prefect_server import wait_until
from tests.procs import alive

START_TIMEOUT_S = 60.0


def postgres_bin() -> Path | None:
    """The newest PostgreSQL server binaries installed, or None."""
    candidates = sorted(
        Path("/usr/lib/postgresql").glob("*/bin"),
        key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0,
    )
    for directory in reversed(candidates):
        if (directory / "initdb").is_file() and (directory / "pg_ctl").is_file():
            return directory
    found = shutil.which("pg_ctl")
    if found and shutil.which("initdb"):
        return Path(found).resolve().parent
    return None


class Postgres:
    """A PostgreSQL cluster of its own, in a temporary directory."""

    def __init__(self, bin_dir: Path) -> None:
        self.bin = bin_dir
        self.port = free_port()
        self.user = "postgres"
        # not under pytest's tmp: its parents are private to root, and the
        # cluster runs as the postgres user
        self.dir = Path(tempfile.mkdtemp(prefix="overbrainer-test-pg-"))
        self.data = self.dir / "data"
        self.log = self.dir / "postgres.log"
        self.pid: int | None = None
        self._as: str | None = "postgres" if os.geteuid() == 0 else None

    @property
    def url(self) -> str:
        """The SQLAlchemy URL Prefect connects with (asyncpg driver)."""
        return f"postgresql+asyncpg://{self.user}@127.0.0.1:{self.port}/prefect"

    def _run(self, *args: str) -> None:
        subprocess.run(
            [str(self.bin / args[0]), *args[1:]],
            check=True,
            capture_output=True,
            timeout=120,
            user=self._as,
        )

    def start(self) -> None:
        """Creates the cluster and its `prefect` database and starts it. Fails
        with the end of its log when it does not start."""
        if self._as is not None:
            entry = pwd.getpwnam(self._as)
            os.chown(self.dir, entry.pw_uid, entry.pw_gid)
        self._run(
            "initdb",
            "-D",
            str(self.data),
            "--username",
            self.user,
            "--auth",
            "trust",
            "--encoding",
            "UTF8",
            "--no-sync",
        )
        options = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off"
        try:
            self._run(
                "pg_ctl",
                "-D",
                str(self.data),
                "-o",
                options,
                "-l",
                str(self.log),
                "-w",
                "-t",
                str(int(START_TIMEOUT_S)),
                "start",
            )
        except subprocess.CalledProcessError:
            raise AssertionError(f"postgres did not start: {self._log_tail()}") from None
        self.pid = int((self.data / "postmaster.pid").read_text().splitlines()[0])
        self._run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", self.user, "prefect")

    def query(self, sql: str) -> list[str]:
        """The rows `sql` returns from the `prefect` database, one line each."""
        result = subprocess.run(
            [
                str(self.bin / "psql"),
                "-h",
                "127.0.0.1",
                "-p",
                str(self.port),
                "-U",
                self.user,
                "-d",
                "prefect",
                "-At",
                "-c",
                sql,
            ],
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        )
        return result.stdout.splitlines()

    def _log_tail(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def stop(self) -> None:
        """Stops the postmaster by PID (fast shutdown, then SIGKILL) and removes the cluster."""
        if self.pid is not None:
            try:
                os.kill(self.pid, signal.SIGINT)
                wait_until(lambda: not alive(self.pid), 30, "postgres to stop")
            except ProcessLookupError:
                pass
            except AssertionError:
                os.kill(self.pid, signal.SIGKILL)
                time.sleep(0.5)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def postgres() -> Iterator[Postgres]:
    """A PostgreSQL cluster for the module; skipped where PostgreSQL or the
    asyncpg driver is not installed (`.ci/run` installs both)."""
    bin_dir = postgres_bin()
    if bin_dir is None:
        pytest.skip("PostgreSQL is not installed: apt-get install postgresql")
    try:
        import asyncpg  # noqa: F401
    except ImportError:
        pytest.skip("the asyncpg driver is not installed: pip install asyncpg")
    cluster = Postgres(bin_dir)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
