"""A private `prefect server` for one bench script: its own PREFECT_HOME (a
copy of an already migrated SQLite database), 127.0.0.1 and a free port, its
own session, stopped by its process group. The script's own environment is
pointed at it before Prefect is imported.

Under `make bench` (bench/kit/run_all.py) one such server serves every
script: its API URL and PID are in SHARED_ENV and SHARED_PID_ENV, and
`prefect_server` points the script at it instead of starting one (a script
run alone still starts its own)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from tests.ports import free_port

START_TIMEOUT_S = 180.0  # a fresh server migrates its SQLite database first, on a busy machine
STOP_GRACE_S = 15.0  # between SIGTERM and SIGKILL of the server's process group
SHARED_ENV = "BENCH_PREFECT_API_URL"  # the API URL of the server of a whole `make bench`
SHARED_PID_ENV = "BENCH_PREFECT_SERVER_PID"  # and the PID leading its process group


def server_env(home: Path, api_url: str | None = None) -> dict[str, str]:
    """This process's environment for Prefect with home `home` (and the server
    at `api_url`): no analytics, no UI, quiet console, Hugging Face offline, and
    the server services no script uses off (tests/prefect_server.py's
    UNUSED_SERVICES)."""
    from tests.prefect_server import UNUSED_SERVICES

    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env |= UNUSED_SERVICES | {
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_UI_ENABLED": "false",
        "PREFECT_SERVER_LOGGING_LEVEL": "WARNING",
        "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL": "WARNING",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }
    if api_url is not None:
        env["PREFECT_API_URL"] = api_url
    return env


def stop_group(process: subprocess.Popen[bytes], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM to the process group led by `process` (started in its own session),
    SIGKILL after `grace_s`, then reaps it."""
    if process.poll() is None:
        with suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        with suppress(subprocess.TimeoutExpired):
            process.wait(timeout=grace_s)
    with suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # what the leader left behind, too
    process.wait(timeout=30)


def _tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return " | ".join(text[-lines:])


@dataclass(frozen=True)
class Server:
    """A running server: its API URL and the PID leading its process group."""

    api_url: str
    pid: int


def healthy(api_url: str) -> bool:
    """Whether the server at `api_url` answers its health check now."""
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=2) as answer:
            return bool(answer.status == 200)
    except (urllib.error.URLError, OSError):
        return False


@contextmanager
def started_server(root: Path) -> Iterator[Server]:
    """Starts a server under `root` on a copy of the migrated SQLite database
    (tests/prefect_server.py's `migrated_sqlite`: no migration at each start),
    waits for it to answer, yields it, then stops it. This process's
    environment is left as it is.

    Raises RuntimeError (with the end of its log) when it exits or does not
    answer within START_TIMEOUT_S."""
    from tests.prefect_server import migrated_sqlite

    home = root / "prefect-home"
    home.mkdir(parents=True, exist_ok=True)
    database = migrated_sqlite(root / "prefect-server.db")
    port = free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    log = root / "prefect-server.log"
    prefect = Path(sys.executable).parent / "prefect"
    env = server_env(home) | {
        "PREFECT_SERVER_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{database}"
    }
    with log.open("wb") as out:
        server = subprocess.Popen(
            [str(prefect), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not healthy(api_url):
            if server.poll() is not None:
                raise RuntimeError(f"prefect server exited ({server.returncode}): {_tail(log)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"prefect server not healthy after {START_TIMEOUT_S:.0f} s")
            time.sleep(0.5)
        yield Server(api_url, server.pid)
    finally:
        stop_group(server)


@contextmanager
def prefect_server(root: Path) -> Iterator[Server]:
    """Points this process's environment (PREFECT_HOME under `root`) at a
    server, yields it, then sends the flows' last logs: the shared server of
    a whole `make bench` where SHARED_ENV names one, else one started under
    `root` (`started_server`) and stopped after.

    Raises RuntimeError when the shared server does not answer, or as
    `started_server` does."""
    home = root / "prefect-home"
    home.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        shared = os.environ.get(SHARED_ENV)
        if shared:
            if not healthy(shared):
                raise RuntimeError(f"the shared prefect server {shared} does not answer")
            server = Server(shared, int(os.environ[SHARED_PID_ENV]))
        else:
            server = stack.enter_context(started_server(root))
        os.environ.clear()
        os.environ.update(server_env(home, server.api_url))  # SHARED_ENV kept, passed on
        yield server
        if "prefect.logging.handlers" in sys.modules:  # the flows' last logs, sent first
            from prefect.logging.handlers import APILogWorker

            APILogWorker.drain_all(timeout=10)
