"""A real Prefect server and real process workers, for the tests of the
deployments: `prefect server start` on 127.0.0.1 (SQLite, or PostgreSQL), the
deployments of `deployments/prefect.yaml` deployed with the CLI, and `prefect
worker start --type process` processes that run them. Every process is started
in its own session and stopped by PID, flow-run processes included.

The session fixture `deployed` is one such stack, shared by the deployment and
UI tests; `trained` is a fine-tune of the tiny model run through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.metadata
import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from filelock import FileLock

from tests import procs
from tests.ports import free_port
from tests.procs import alive, descendants, kill_pids

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
POOL = "overbrainer"
START_TIMEOUT_S = 120.0  # a server's first start migrates its database
STOP_GRACE_S = 10.0  # SIGTERM, then SIGKILL after this long
RUN_TIMEOUT_S = 300.0  # a deployment run of the tiny model takes about 30 s alone
MIGRATE_TIMEOUT_S = 300.0  # Prefect's migrations of a new SQLite database: about 15 s alone


KEPT_SETTINGS = frozenset({"PREFECT_API_SSL_CERT_FILE"})
"""The Prefect settings `clean_env` passes on: the tests' one-certificate CA file
(tests/conftest.py; unset under `make bench`)."""


UNUSED_SERVICES = {
    "PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED": "false",
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED": "false",
}
"""The Prefect server services no test or bench uses, turned off in every server
they start (the stacks here, the session's harness by tests/conftest.py, the
bench's shared server): automations (triggers and their actions: none is made)
and the persisting of events (none is read; the events' live stream, which
workers and runners watch for cancellations, stays on). Measured on an idle
`prefect server start` (2026-12-06, 2 cores): 9.3 CPU seconds a minute with
every service, 3.4 without these two; a flow run's events are not written
either."""


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any Prefect setting but KEPT_SETTINGS,
    plus `extra`."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("PREFECT_") or k in KEPT_SETTINGS
    }
    env.update(
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        DO_NOT_TRACK="1",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        OMP_NUM_THREADS="1",
    )
    env.update(extra)
    return env


def stop(process: subprocess.Popen[bytes], grace: float = STOP_GRACE_S) -> None:
    """Stops a process started in its own session and everything below it:
    SIGTERM to its group and its descendants, SIGKILL to what is left after
    `grace` seconds."""
    below = descendants(process.pid)
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
    kill_pids(below, signal.SIGTERM)
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    kill_pids([p for p in below if alive(p)])


def wait_until(check: Any, timeout: float, what: str, every: float = 0.5) -> Any:
    """Calls `check` until it returns something true (returned), failing after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def migrated_sqlite(database: Path) -> Path:
    """Writes at `database` a SQLite database that Prefect's own migrations have
    brought to their head, so that a server started on it finds nothing to
    migrate (its start then costs about 6 s of a core instead of 19). The
    migrations run once per Prefect version and machine (`prefect server
    database upgrade`, under a file lock, kept in `.cache`); each database is a
    copy. Fails with the CLI's output when the migrations fail."""
    template = REPO / ".cache" / f"prefect-{importlib.metadata.version('prefect')}.db"
    template.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(template.with_suffix(".lock"), timeout=MIGRATE_TIMEOUT_S * 2):
        if not template.exists():
            with tempfile.TemporaryDirectory(prefix="prefect-migrate-") as scratch:
                fresh = Path(scratch) / "prefect.db"
                done = subprocess.run(
                    [str(BIN / "prefect"), "server", "database", "upgrade", "-y"],
                    env=clean_env(
                        PREFECT_HOME=scratch,
                        PREFECT_SERVER_DATABASE_CONNECTION_URL=f"sqlite+aiosqlite:///{fresh}",
                    ),
                    capture_output=True,
                    text=True,
                    timeout=MIGRATE_TIMEOUT_S,
                    check=False,
                )
                if done.returncode != 0:
                    raise AssertionError(
                        f"prefect server database upgrade failed: {done.stdout}{done.stderr}"
                    )
                partial = template.with_suffix(".partial")
                with sqlite3.connect(fresh) as source, sqlite3.connect(partial) as copy:
                    source.backup(copy)  # one file, whatever was left in the write-ahead log
                os.replace(partial, template)
    database.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(template, database)
    return database


class PrefectServer:
    """`prefect server start` on 127.0.0.1, on SQLite in `home` or on the database
    `database_url`."""

    def __init__(self, home: Path, database_url: str | None = None) -> None:
        self.home = home
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_url = f"{self.url}/api"
        self.sqlite = None if database_url else home / "prefect.db"
        self.database_url = database_url or f"sqlite+aiosqlite:///{self.sqlite}"
        self.log = home / "server.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Starts the server and waits until its API answers. Fails with the end
        of its log when it does not."""
        self.home.mkdir(parents=True, exist_ok=True)
        if self.sqlite is not None and not self.sqlite.exists():  # a restart keeps its data
            migrated_sqlite(self.sqlite)
        env = clean_env(
            PREFECT_HOME=str(self.home / "server-home"),
            PREFECT_SERVER_DATABASE_CONNECTION_URL=self.database_url,
            PREFECT_SERVER_LOGGING_LEVEL="WARNING",
            PREFECT_UI_ENABLED="true",
            PREFECT_UI_API_URL=self.api_url,
            # the scheduler makes the runs of schedules: look often, so a test sees them
            PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS="5",
            **UNUSED_SERVICES,
        )
        self.process = subprocess.Popen(
            [
                str(BIN / "prefect"),
                "server",
                "start",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
            ],
            cwd=self.home,
            env=env,
            stdout=self.log.open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

        def healthy() -> bool:
            assert self.process is not None
            if self.process.poll() is not None:
                raise AssertionError(f"prefect server exited: {self.log_tail()}")
            try:
                return httpx.get(f"{self.api_url}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(healthy, START_TIMEOUT_S, f"the Prefect server on {self.url}")

    def log_tail(self, lines: int = 30) -> str:
        """The end of the server's log."""
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        """Stops the server by PID."""
        if self.process is not None:
            stop(self.process)

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of a client of this server (the CLI, a worker)."""
        defaults = {
            "PREFECT_API_URL": self.api_url,
            "PREFECT_HOME": str(self.home / "client-home"),
            "PREFECT_CLI_PROMPT": "false",
        }
        return clean_env(**{**defaults, **extra})

    def cli(
        self, *args: str, cwd: Path = REPO, check: bool = True, timeout: float = 180, **env: str
    ) -> subprocess.CompletedProcess[str]:
        """Runs `prefect <args>` against this server; fails with its output when
        it fails and `check`."""
        result = subprocess.run(
            [str(BIN / "prefect"), *args],
            cwd=cwd,
            env=self.env(**{"PWD": str(cwd), **env}),
            capture_output=True,
            text=True,
            timeout=timeout,
            start_new_session=True,
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"prefect {' '.join(args)} failed ({result.returncode}):\n"
                f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
            )
        return result

    def call(self, coroutine_fn: Any, *args: Any) -> Any:
        """Runs `coroutine_fn(client, *args)` with a Prefect client of this server."""
        from prefect.client.orchestration import get_client
        from prefect.settings import PREFECT_API_URL, temporary_settings

        async def go() -> Any:
            async with get_client() as client:
                return await coroutine_fn(client, *args)

        with temporary_settings(updates={PREFECT_API_URL: self.api_url}):
            return asyncio.run(go())


HIDE_SCRIPT = (
    'while [ "$1" != -- ]; do mount -t tmpfs -o ro,size=64k hidden "$1" || exit 97; '
    'shift; done; shift; exec "$@"'
)
"""Covers each directory before `--` with an empty read-only tmpfs, then runs the rest."""


@functools.cache
def own_mounts_allowed() -> bool:
    """Whether this machine lets a process have a mount namespace of its own
    in which it mounts a tmpfs (`unshare --mount`: root, or a user namespace
    allowed), tried once on a directory of its own."""
    with tempfile.TemporaryDirectory(prefix="own-mounts-") as directory:
        try:
            done = subprocess.run(
                in_own_mounts(["true"], [Path(directory)]),
                capture_output=True,
                timeout=10,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired):
            return False
    return done.returncode == 0


def in_own_mounts(argv: list[str], hide: Sequence[Path]) -> list[str]:
    """`argv` run in a mount namespace of its own in which every directory of
    `hide` is an empty read-only tmpfs (the process keeps its PID: unshare and
    sh exec it)."""
    paths = [str(path) for path in hide]
    unshare = ["unshare", "--mount", "--propagation", "private"]
    return [*unshare, "sh", "-c", HIDE_SCRIPT, "hide", *paths, "--", *argv]


def hidden_from(pid: int) -> list[str]:
    """The mount points of the tmpfs `in_own_mounts` made in the namespace of
    the process `pid` (empty when it shares this one's)."""
    try:
        lines = Path(f"/proc/{pid}/mountinfo").read_text().splitlines()
    except OSError:
        return []
    return [line.split()[4] for line in lines if " - tmpfs hidden " in line]


class Worker:
    """`prefect worker start --pool <pool> --type process`, started in `directory`
    (the root of a clone of this repository) with `env` added."""

    def __init__(
        self,
        server: PrefectServer,
        name: str,
        directory: Path,
        hide: Sequence[Path] = (),
        **env: str,
    ) -> None:
        self.server = server
        self.name = name
        self.directory = directory
        self.hide = list(hide)
        """Directories this worker (and every process it starts) must not
        see: in a mount namespace of its own, where `unshare` is allowed,
        an empty read-only tmpfs covers each (see `in_own_mounts`)."""
        self.extra = env
        self.log = server.home / f"worker-{name}.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Starts the worker and waits until the server has seen it poll."""
        defaults = {
            "PWD": str(self.directory),
            "PREFECT_HOME": str(self.server.home / f"worker-home-{self.name}"),
            "PREFECT_WORKER_QUERY_SECONDS": "2",  # Prefect's default is 10: tests poll faster
            "PREFECT_WORKER_PREFETCH_SECONDS": "2",
            "PREFECT_LOGGING_LEVEL": "INFO",
        }
        env = self.server.env(**{**defaults, **self.extra})
        argv = [str(BIN / "prefect"), "worker", "start", "--pool", POOL, "--type", "process"]
        argv += ["--name", self.name]
        if self.hide and own_mounts_allowed():
            argv = in_own_mounts(argv, self.hide)
        self.process = subprocess.Popen(
            argv,
            cwd=self.directory,
            env=env,
            stdout=self.log.open("ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

        async def polled(client: Any) -> bool:
            workers = await client.read_workers_for_work_pool(POOL)
            return any(w.name == self.name for w in workers)

        def seen() -> bool:
            assert self.process is not None
            if self.process.poll() is not None:
                raise AssertionError(f"worker {self.name} exited: {self.log_tail()}")
            return bool(self.server.call(polled))

        wait_until(seen, START_TIMEOUT_S, f"worker {self.name} to poll", every=1.0)

    @property
    def running(self) -> bool:
        """Whether the worker process runs."""
        return self.process is not None and self.process.poll() is None

    def flow_processes(self, spare_sessions: set[int]) -> list[int]:
        """The worker's descendants (its flow-run processes and theirs), except
        those in `spare_sessions` (detached jobs, which must outlive it)."""
        if self.process is None:
            return []
        table = procs.table()
        return [
            pid
            for pid in descendants(self.process.pid)
            if pid in table and table[pid].session not in spare_sessions
        ]

    def kill(self, spare_sessions: set[int]) -> list[int]:
        """SIGKILLs the worker and its flow-run processes at once (no hook runs),
        sparing the jobs of `spare_sessions`; returns the PIDs killed."""
        assert self.process is not None
        victims = [self.process.pid, *self.flow_processes(spare_sessions)]
        kill_pids(victims)
        self.process.wait(timeout=30)
        wait_until(lambda: not any(alive(p) for p in victims), 30, "the killed processes to go")
        return victims

    def stop(self) -> None:
        """Stops the worker and its flow-run processes by PID."""
        if self.process is not None:
            stop(self.process)

    def log_tail(self, lines: int = 40) -> str:
        """The end of the worker's log."""
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def clone(into: Path) -> Path:
    """Another clone of this repository for a second worker: its flow entry
    points (the package itself is installed in the venv)."""
    into.mkdir(parents=True, exist_ok=True)
    shutil.copytree(REPO / "flows", into / "flows")
    return into


def cli_text(value: Any) -> str:
    """How `--param k=<text>` spells a parameter's value: a string as it is,
    anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value)


def as_the_cli_reads(value: Any) -> Any:
    """The value `prefect deployment run --param k=<cli_text(value)>` sends, read
    by the CLI's own parser (`load_json_key_values`). Fails where the CLI would."""
    from prefect.cli._utilities import load_json_key_values

    return load_json_key_values([f"k={cli_text(value)}"], "parameter")["k"]


DRAIN_S = 30.0
"""The most a stack's end waits for this process's queued logs and events to
reach its server (`Stack.stop`)."""


def drain_prefect_services() -> None:
    """Sends what this process still queues (Prefect's logs and events) and
    stops those services, DRAIN_S at most: the tests' harness's own drain at
    its exit (tests/conftest.py's `prefect_server`) waits for ever on a service
    that never finishes (a worker's session hung there once, after every test
    had passed, in a run where a stack ended with its unit before the harness
    did); a service stopped here is out of Prefect's cache, and the harness
    starts and drains a fresh one."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for service in (APILogWorker, EventsWorker):
        service.drain_all(timeout=DRAIN_S)


@dataclass
class Stack:
    """A server with the deployments of `deployments/prefect.yaml`, workers, the
    shared runs root they record runs in, and a saved local target block."""

    server: PrefectServer
    root: Path
    runs: Path | str  # a local directory, or the s3:// URL of a stack on a bucket
    target: str
    work_dir: Path
    workers: list[Worker] = field(default_factory=list)
    deploy_output: str = ""

    def worker(self) -> Worker:
        """A running worker of the pool, the first one started again if none runs."""
        for worker in self.workers:
            if worker.running:
                return worker
        # started in the clone deployed from: its flow runs go there by default
        worker = Worker(self.server, f"w{len(self.workers) + 1}", REPO)
        worker.start()
        self.workers.append(worker)
        return worker

    def stop(self) -> None:
        """Sends what this process still queues for the server (Prefect's logs and
        events, `drain_prefect_services`) while it answers, then stops every
        worker and the server."""
        drain_prefect_services()
        for worker in self.workers:
            worker.stop()
        self.server.stop()

    def run_deployment(self, name: str, **parameters: Any) -> uuid.UUID:
        """A flow run of the deployment `name` (`flow/deployment`) with `parameters`,
        scheduled now, made through the Prefect client as `prefect deployment run
        <name> --param k=v ...` makes it (each value as the CLI reads it back, an
        unknown parameter refused), without a Python process of its own that
        imports Prefect (3-9 s of a core each); returns the flow run's ID. Fails
        on an unknown parameter or when the server refuses the parameters.
        `run_deployment_with_cli` starts one with the CLI itself."""
        values = {key: as_the_cli_reads(value) for key, value in parameters.items()}

        async def create(client: Any) -> uuid.UUID:
            deployment = await client.read_deployment_by_name(name)
            schema = deployment.parameter_openapi_schema or {}
            unknown = set(values) - set(schema.get("properties", {}))
            assert not unknown, f"{name} has no parameter {sorted(unknown)}"
            flow_run = await client.create_flow_run_from_deployment(
                deployment.id, parameters=values
            )
            return uuid.UUID(str(flow_run.id))

        made: uuid.UUID = self.server.call(create)
        return made

    def run_deployment_with_cli(self, name: str, **parameters: Any) -> uuid.UUID:
        """`prefect deployment run <name> --param k=v ...`, as a person starts a
        run; returns the flow run's ID."""
        args = ["deployment", "run", name]
        for key, value in parameters.items():
            args += ["--param", f"{key}={cli_text(value)}"]
        result = self.server.cli(*args)
        found = re.search(r"UUID: ([0-9a-f-]{36})", result.stdout)
        assert found, result.stdout
        return uuid.UUID(found.group(1))

    def cancel(self, flow_run_id: uuid.UUID, check: bool = True) -> None:
        """Asks the server to cancel the flow run (the state Cancelling), as
        `prefect flow-run cancel <id>` does, through the client (no process that
        imports Prefect); fails, when `check`, where the server refuses it."""
        from prefect.client.schemas.objects import State, StateType
        from prefect.client.schemas.responses import SetStateStatus

        async def cancel(client: Any) -> Any:
            return await client.set_flow_run_state(
                flow_run_id=flow_run_id, state=State(type=StateType.CANCELLING)
            )

        result = self.server.call(cancel)
        if check:
            assert result.status != SetStateStatus.ABORT, result.details

    def flow_run(self, flow_run_id: uuid.UUID) -> Any:
        """The flow run as the server has it now."""

        async def read(client: Any) -> Any:
            return await client.read_flow_run(flow_run_id)

        return self.server.call(read)

    def wait_final(self, flow_run_id: uuid.UUID, timeout: float = RUN_TIMEOUT_S) -> Any:
        """Waits until the flow run is in a final state; returns it."""

        def final() -> Any:
            run = self.flow_run(flow_run_id)
            return run if run.state is not None and run.state.is_final() else None

        try:
            return wait_until(final, timeout, f"flow run {flow_run_id} to end", every=1.0)
        except AssertionError:
            logs = "\n".join(w.log_tail() for w in self.workers)
            raise AssertionError(f"flow run {flow_run_id} did not end; workers:\n{logs}") from None


def training_now(stack: Stack, known: set[str]) -> Any:
    """A run not in `known` whose job has logged a training step, if any."""
    from overbrainer_prefect.runs import Runs, RunState

    for record in Runs(stack.runs).list():
        if record.id in known or record.state != RunState.RUNNING or record.job is None:
            continue
        metrics = Path(record.remote_dir) / "metrics.jsonl"
        if metrics.exists() and '"log"' in metrics.read_text():
            return record
    return None


def followed(stack: Stack, run_id: str) -> bool:
    """Whether a live process holds the follow lock of the run `run_id` (a follower
    or a collect follows its job)."""
    from overbrainer_prefect.runs import Runs
    from overbrainer_prefect.runs.lock import LOCK_FILE

    runs = Runs(stack.runs)
    return runs.store.holder(runs.key(run_id, LOCK_FILE)) is not None


FOLLOWER = "follow/always"
"""The follower's deployment: its schedule is paused in a test stack, so that
a test chooses when one follows (flow runs suspend only while one does)."""


async def quiet_follower(client: Any) -> None:
    """Pauses the follower deployment's schedules and deletes the runs they
    made already (none when it was not deployed)."""
    from prefect.client.schemas.filters import (
        DeploymentFilter,
        DeploymentFilterId,
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.exceptions import ObjectNotFound

    try:
        found = await client.read_deployment_by_name(FOLLOWER)
    except ObjectNotFound:
        return
    for schedule in found.schedules:
        await client.update_deployment_schedule(found.id, schedule.id, active=False)
    made = await client.read_flow_runs(
        deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[found.id])),
        flow_run_filter=FlowRunFilter(
            state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.SCHEDULED]))
        ),
    )
    for run in made:
        await client.delete_flow_run(run.id)


async def create_pool(client: Any) -> None:
    """Creates the process work pool POOL with the process worker's default
    job template, as `prefect work-pool create POOL --type process` does
    (without a Python process of its own that imports Prefect)."""
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.workers.process import ProcessWorker

    template = ProcessWorker.get_default_base_job_template()
    await client.create_work_pool(
        work_pool=WorkPoolCreate(name=POOL, type="process", base_job_template=template)
    )


def start_stack(
    root: Path,
    database_url: str | None = None,
    names: list[str] | None = None,
    runs: str | None = None,
    worker: bool = True,
) -> Stack:
    """A server on `database_url` (SQLite by default), the deployments deployed
    from the repository root with the shared runs root `root/runs` (or `runs`,
    an `s3://` URL) (all of them, or those `names` selects), a local target
    block and one worker (none with `worker=False`: the test starts its own)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from overbrainer_prefect.blocks import LocalTarget
    from tests.conftest import job_venv

    server = PrefectServer(root / "server", database_url)
    stack = Stack(
        server=server,
        root=root,
        runs=runs or root / "runs",
        target=f"local-{uuid.uuid4().hex[:6]}",
        work_dir=root / "work",
    )
    try:
        server.start()
        server.call(create_pool)
        # as the README says: from the repository root, whose prefect.yaml is
        # deployments/prefect.yaml
        selection = ["--all"] if names is None else [a for n in names for a in ("-n", n)]
        deployed = server.cli(
            "--no-prompt", "deploy", *selection, OVERBRAINER_RUNS_DIR=str(stack.runs), timeout=300
        )
        stack.deploy_output = deployed.stdout + deployed.stderr
        server.call(quiet_follower)
        # saved from this process (as `save_runpod_target` does): a Python process of its own
        # to import Prefect and save one block cost seconds of every stack's start
        with temporary_settings(updates={PREFECT_API_URL: server.api_url}):
            LocalTarget(
                job_venv=str(job_venv()),
                work_dir=str(stack.work_dir),
                poll_seconds=0.5,
                cpu_threads=1,
            ).save(stack.target)
        if worker:
            stack.worker()
    except BaseException:
        stack.stop()
        raise
    return stack


@pytest.fixture(scope="session")
def deployed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A real Prefect server (SQLite) with every deployment of
    `deployments/prefect.yaml` and a process worker, for the session."""
    stack = start_stack(tmp_path_factory.mktemp("deployed"))
    try:
        yield stack
    finally:
        stack.stop()


def tiny_training(model: Path, dataset: Path, **changes: Any) -> dict[str, Any]:
    """The training spec of a fine-tune of the tiny model, as deployment parameters."""
    values: dict[str, Any] = {
        "base_model": str(model),
        "datasets": [{"path": str(dataset)}],
        "sequence_len": 64,
        "micro_batch_size": 4,
        "max_steps": 6,
        "learning_rate": 5e-3,
        "lora_r": 8,
        "lora_alpha": 16,
        "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
        "warmup_steps": 0,
        "seed": 0,
    }
    values.update(changes)
    return values


@dataclass
class Trained:
    """A fine-tune run through the local train deployment."""

    flow_run: Any
    run_id: str
    parameters: dict[str, Any]
    """The parameters given to `prefect deployment run`, as Python values."""


@pytest.fixture(scope="session")
def trained(deployed: Stack, tiny: tuple[Path, Path]) -> Trained:
    """The local train deployment run once to its end, started as a person
    starts one: by `prefect deployment run` (the one run of the suite so
    started; the other tests make theirs through the client, `run_deployment`)."""
    before = set(p.name for p in deployed.runs.glob("[!.]*"))  # runs, not the live index
    parameters = {"target": deployed.target, "training": tiny_training(*tiny)}
    flow_run_id = deployed.run_deployment_with_cli("train/local", **parameters)
    flow_run = deployed.wait_final(flow_run_id)
    made = [p.name for p in deployed.runs.glob("[!.]*") if p.name not in before]
    assert len(made) == 1, (made, flow_run.state)
    return Trained(flow_run=flow_run, run_id=made[0], parameters=parameters)
