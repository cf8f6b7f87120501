"""The local executor: runs a run's job on this machine, in a directory of its own.

The job is started exactly as on a remote target (the shared wrapper script,
launched detached in its own session), so it outlives the process that started
it and its status reads the same from any process. Files are copied with the
standard library; nothing outside the executor's work directory is ever written
by it, except the local directory a download is asked to fill.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import shutil
import signal
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from overbrainer_prefect.executors.base import (
    CANCEL_FILE,
    EXIT_FILE,
    MAX_TAIL_READ,
    CommandResult,
    ExecError,
    FileDigest,
    JobId,
    JobSpec,
    JobStatus,
)
from overbrainer_prefect.executors.jobscript import (
    CANCEL_GRACE_S,
    JOB_SCRIPT,
    LEFTOVER_WAIT_S,
    job_script,
    launch_command,
    parse_launch,
    parse_status,
)
from overbrainer_prefect.executors.manifest import local_manifest, manifest_files

SAFE_ENV = (
    "PATH",
    "HOME",
    "USER",
    "LOGNAME",
    "SHELL",
    "LANG",
    "LANGUAGE",
    "TZ",
    "TMPDIR",
    "CUDA_VISIBLE_DEVICES",
    "NVIDIA_VISIBLE_DEVICES",
    "HF_HOME",
    "HF_HUB_CACHE",
    "HF_HUB_OFFLINE",
    "HF_DATASETS_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "XDG_CACHE_HOME",
    "OMP_NUM_THREADS",
)
"""The variables of this process that jobs and commands inherit (plus `LC_*`):
what a program needs to run and find its caches, never a credential. Anything
else a job needs comes from its spec (`env` in its script, `secrets` in its
environment)."""

LAUNCH_TIMEOUT_S = 30.0  # seconds the detached launch may take before spawn gives up
POLL_S = 0.05  # seconds between checks that a cancelled job's process group is gone
EXIT_LOOK_S = 0.2  # seconds between two looks for a job's exit file while a follow waits


class LocalExecutor:
    """Runs jobs on this machine, in run directories under `workdir`.

    `name` is how messages call the target (`local target 'laptop'`). A run
    whose local directory is its run directory here (the usual case) is neither
    uploaded nor downloaded: the files are already where they belong. Every
    method raises ExecError when the file system or a command fails.
    """

    def __init__(self, workdir: Path | str, name: str = "local") -> None:
        self._workdir = Path(os.path.realpath(Path(workdir).expanduser()))
        self._name = name

    @property
    def workdir(self) -> str:
        """The absolute directory that holds the run directories."""
        return str(self._workdir)

    @property
    def description(self) -> str:
        """How messages name this target: `local target '<name>'`."""
        return f"local target '{self._name}'"

    async def run(
        self, argv: Sequence[str], timeout: float = 60.0, stdin: bytes | None = None
    ) -> CommandResult:
        """Runs `argv` (no shell) with the safe environment, `stdin` written to
        it, and returns its exit code and output.

        Raises ExecError (`run`) when the program cannot be started, or when it
        runs past `timeout` seconds (it is then killed with its process group).
        """
        if not argv:
            raise ExecError("run", "no command was given")
        try:
            process = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL if stdin is None else asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=_safe_env(),
                start_new_session=True,
            )
        except OSError as error:
            raise ExecError("run", f"{argv[0]!r} cannot be started: {error.strerror}") from None
        try:
            stdout, stderr = await asyncio.wait_for(process.communicate(stdin), timeout)
        except TimeoutError:
            _kill_group(process.pid)
            await process.wait()
            raise ExecError(
                "run", f"{argv[0]!r} did not finish within {timeout:g} s on {self.description}"
            ) from None
        except asyncio.CancelledError:
            _kill_group(process.pid)  # a command never outlives the task that ran it
            raise
        return CommandResult(
            code=process.returncode if process.returncode is not None else -1,
            stdout=stdout.decode(errors="replace"),
            stderr=stderr.decode(errors="replace"),
        )

    async def upload(self, local: Path, remote: str, skip: Sequence[str] = ()) -> None:
        """Copies the directory `local` into the run directory `remote` (created
        if needed, files overwritten, modes and times kept), leaving out the
        top-level entries named in `skip`. Nothing is copied when `remote` is
        `local` itself.

        Raises ExecError (`upload`) when `remote` is not under the work
        directory or inside `local`, or when a file cannot be copied.
        """
        source = Path(os.path.realpath(local))
        target = self._inside(remote, "upload")
        if target == source:
            return
        if not source.is_dir():
            raise ExecError("upload", f"{local} is not a directory")
        if target.is_relative_to(source):
            raise ExecError(
                "upload", f"{remote} is inside {local}: choose a run directory elsewhere"
            )
        skipped = set(skip)

        def ignore(directory: str, names: list[str]) -> set[str]:
            return skipped.intersection(names) if Path(directory) == source else set()

        try:
            await asyncio.to_thread(
                shutil.copytree, source, target, ignore=ignore, dirs_exist_ok=True
            )
        except (OSError, shutil.Error) as error:
            raise ExecError(
                "upload", f"{local} cannot be copied to {remote}: {_reason(error)}"
            ) from None

    async def spawn(self, job: JobSpec) -> JobId:
        """Starts `job` detached in its run directory (which must be under the
        work directory): writes its wrapper script, then launches it in a new
        session, with the safe environment and the job's secrets as its only
        environment. The job outlives this process.

        Raises ExecError (`spawn`) when the run directory is outside the work
        directory, a secret's name is not a variable name, or the launch fails.
        """
        run_dir = self._inside(job.run_dir, "spawn", strictly=True)
        job = dataclasses.replace(job, run_dir=str(run_dir))
        try:
            script = job_script(job)
        except ValueError as error:
            raise ExecError("spawn", str(error)) from None
        env = _safe_env()
        env.update(_secret_env(job))
        try:
            await asyncio.to_thread(_write_script, run_dir / JOB_SCRIPT, script)
            process = await asyncio.create_subprocess_exec(
                "sh",
                "-c",
                launch_command(str(run_dir)),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=env,
            )
        except OSError as error:
            raise ExecError(
                "spawn", f"the job of run {job.run_id} cannot start: {_reason(error)}"
            ) from None
        try:
            stdout, stderr = await asyncio.wait_for(process.communicate(), LAUNCH_TIMEOUT_S)
        except TimeoutError:
            process.kill()
            await process.wait()
            raise ExecError(
                "spawn", f"the launch of run {job.run_id} took over {LAUNCH_TIMEOUT_S:g} s"
            ) from None
        try:
            return parse_launch(str(run_dir), stdout.decode(errors="replace"))
        except ValueError:
            detail = stderr.decode(errors="replace").strip().splitlines()
            raise ExecError(
                "spawn",
                f"the job of run {job.run_id} did not start on {self.description}"
                + (f": {detail[-1]}" if detail else ""),
            ) from None

    async def status(self, job: JobId) -> JobStatus:
        """Where `job` stands, read from its exit file, its process and its
        cancel marker (see `jobscript.parse_status`): a PID now held by another
        process (a different start time) is not the job.

        Raises ExecError (`status`) when the run directory cannot be read.
        """
        try:
            output = await asyncio.to_thread(_status_output, job)
        except OSError as error:
            raise ExecError("status", f"{job.dir}: {_reason(error)}") from None
        return parse_status(job, output)

    async def wait_exit(self, job: JobId, seconds: float) -> None:
        """Waits up to `seconds`, looking for the job's exit file every
        EXIT_LOOK_S (a stat here): a job's end is seen within that, not
        within a whole poll. Raises nothing."""
        exit_file = Path(job.dir) / EXIT_FILE
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            try:
                if exit_file.exists():
                    return
            except OSError:  # a directory it cannot read: the next look (status) says why
                return
            await asyncio.sleep(min(EXIT_LOOK_S, left))

    async def cancel(self, job: JobId) -> None:
        """Cancels `job` when it is still the process it was: writes its cancel
        marker, sends SIGTERM to its process group, waits up to
        `CANCEL_GRACE_S` for the group to end, then sends SIGKILL. A job that
        already ended is left alone; of a lost one (its process gone, or its
        PID now another process's), what still runs in its run directory is
        killed, and it still reads lost.

        Raises ExecError (`cancel`) when its run directory is outside the work
        directory or the marker cannot be written.
        """
        run_dir = self._inside(job.dir, "cancel", strictly=True)
        try:
            await asyncio.to_thread(_cancel, job, run_dir, CANCEL_GRACE_S)
        except OSError as error:
            raise ExecError("cancel", f"{job.dir}: {_reason(error)}") from None

    async def read_from(self, path: str, offset: int, limit: int = MAX_TAIL_READ) -> bytes:
        """Up to `limit` bytes of the file `path` from byte `offset`: empty when
        the file does not exist yet or ends before `offset`.

        Raises ExecError (`read`) on a negative offset or limit, or a file that
        cannot be read.
        """
        if offset < 0 or limit < 0:
            raise ExecError("read", f"offset {offset} and limit {limit} must not be negative")
        try:
            return await asyncio.to_thread(_read_from, self._path(path), offset, limit)
        except OSError as error:
            raise ExecError("read", f"{path}: {_reason(error)}") from None

    async def manifest(
        self, remote: str, entries: Sequence[str], exclude: Sequence[str] = ()
    ) -> list[FileDigest]:
        """The SHA-256 manifest of the files under `entries` of `remote`, less
        those `exclude` matches (see `manifest.local_manifest`).

        Raises ExecError (`manifest`) on a bad entry or an unreadable file.
        """
        return await asyncio.to_thread(local_manifest, self._path(remote), entries, exclude)

    async def download(
        self, remote: str, local: Path, entries: Sequence[str], exclude: Sequence[str] = ()
    ) -> None:
        """Copies the files under `entries` of `remote` (less those `exclude`
        matches) into `local`, same layout, modes and times kept; each file is
        written under a temporary name and renamed, so none is ever half there.
        Nothing is copied when `local` is `remote` itself.

        Raises ExecError (`download`) when a file cannot be copied, or
        ExecError (`manifest`) on a bad entry.
        """
        source = self._path(remote)
        target = Path(os.path.realpath(local))
        if target == Path(os.path.realpath(source)):
            return
        await asyncio.to_thread(_download, source, target, entries, exclude)

    async def touch(self, path: str) -> None:
        """Creates the file `path` (and its directories) under the work
        directory if it does not exist.

        Raises ExecError (`touch`) when `path` is outside the work directory or
        cannot be created.
        """
        target = self._inside(path, "touch", strictly=True)
        try:
            await asyncio.to_thread(_touch, target)
        except OSError as error:
            raise ExecError("touch", f"{path}: {_reason(error)}") from None

    async def close(self) -> None:
        """Nothing to release: the executor holds no connection."""

    def _path(self, path: str) -> Path:
        """`path` made absolute (a relative path is taken under the work directory)."""
        return self._workdir / path

    def _inside(self, path: str, action: str, strictly: bool = False) -> Path:
        """`path` resolved, checked to lie under the work directory (and not to
        be the work directory itself when `strictly`)."""
        resolved = Path(os.path.realpath(self._path(path)))
        if not resolved.is_relative_to(self._workdir) or (strictly and resolved == self._workdir):
            raise ExecError(
                action,
                f"{path} is not inside the work directory {self._workdir} of {self.description}",
            )
        return resolved


def _safe_env() -> dict[str, str]:
    return {
        name: value
        for name, value in os.environ.items()
        if name in SAFE_ENV or name.startswith("LC_")
    }


def _secret_env(job: JobSpec) -> Mapping[str, str]:
    for name in job.secrets:
        if not name.replace("_", "a").isalnum() or name[0].isdigit():
            raise ExecError("spawn", f"{name!r} is not a valid environment variable name")
    return {name: secret.get_secret_value() for name, secret in job.secrets.items()}


def _write_script(path: Path, script: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(script)
    temporary.replace(path)


def _read_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def _status_output(job: JobId) -> str:
    """What `jobscript.status_command` prints for `job`, read directly (in
    its order: the stat line before the exit file)."""
    run_dir = Path(job.dir)
    stat_line = _read_text(Path(f"/proc/{job.pid}/stat")).strip()
    exit_text = _read_text(run_dir / EXIT_FILE).strip()
    cancelled = "yes" if (run_dir / CANCEL_FILE).exists() else ""
    return f"exit:{exit_text}\nstat:{stat_line}\ncancelled:{cancelled}\n"


def _cancel(job: JobId, run_dir: Path, grace_s: float) -> None:
    """`jobscript.cancel_command`, done directly (the job's tree, descendants in
    sessions of their own included, taken before the SIGTERM and again before
    the SIGKILL), except that a group whose processes are all zombies counts
    as ended (a PID 1 that does not reap orphans must not make every cancel
    wait out its grace). A lost job's leftovers are ended as there."""
    if (run_dir / EXIT_FILE).exists():
        return
    now = _stat_of(job.pid)
    if now is None or now.state in ("Z", "X") or job.started not in (None, now.start):
        _end_leftovers(run_dir)  # its process is gone, or the PID is another process's now
        return
    tree = _tree(job.pid)
    (run_dir / CANCEL_FILE).touch()
    _signal_group(job.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while (_group_alive(job.pid) or _still(tree)) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    tree |= _tree(job.pid)
    _signal_group(job.pid, signal.SIGKILL)
    for pid, _ in _still(tree):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _end_leftovers(run_dir: Path) -> None:
    """Kills whatever still runs in the lost job's `run_dir` (its working
    directory) and waits up to `LEFTOVER_WAIT_S` for it to be gone, as
    `jobscript.cancel_command` does."""
    real = str(run_dir.resolve())
    deadline = time.monotonic() + LEFTOVER_WAIT_S
    left = _working_in(real)
    for pid in left:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    while left and time.monotonic() < deadline:
        time.sleep(POLL_S)
        left = _working_in(real)


def _working_in(directory: str) -> list[int]:
    """The processes, other than this one, whose working directory is
    `directory` (a zombie has none)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                if os.readlink(entry / "cwd") == directory:
                    found.append(int(entry.name))
    return found


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _kill_group(pgid: int) -> None:
    _signal_group(pgid, signal.SIGKILL)


@dataclasses.dataclass(frozen=True)
class _Process:
    """A process as /proc/<pid>/stat shows it."""

    pid: int
    parent: int
    group: int
    state: str
    start: str  # its start time in clock ticks since boot: with the PID, which process it is


def _stat_of(pid: int) -> _Process | None:
    try:
        with open(f"/proc/{pid}/stat") as file:
            fields = file.read().rpartition(")")[2].split()
    except OSError:
        return None  # it ended while we looked
    # fields[0] is the state (field 3), [1] the parent (4), [2] the group (5), [19] the start (22)
    if len(fields) < 20:
        return None
    return _Process(pid, int(fields[1]), int(fields[2]), fields[0], fields[19])


def _processes() -> list[_Process]:
    """Every process of this machine that runs or is a zombie, now."""
    found = (_stat_of(int(e.name)) for e in os.scandir("/proc") if e.name.isdigit())
    return [p for p in found if p is not None]


def _tree(pgid: int) -> set[tuple[int, str]]:
    """The live processes of group `pgid` and all their descendants, as (PID, start)."""
    processes = _processes()
    members = {p.pid for p in processes if p.group == pgid}
    grown = True
    while grown:
        grown = False
        for process in processes:
            if process.pid not in members and process.parent in members:
                members.add(process.pid)
                grown = True
    return {(p.pid, p.start) for p in processes if p.pid in members and p.state not in ("Z", "X")}


def _still(tree: set[tuple[int, str]]) -> set[tuple[int, str]]:
    """The processes of `tree` still running (the same PID and start time, not a zombie)."""
    still = set()
    for pid, start in tree:
        now = _stat_of(pid)
        if now is not None and now.start == start and now.state not in ("Z", "X"):
            still.add((pid, start))
    return still


def _group_alive(pgid: int) -> bool:
    """Whether a process of group `pgid` runs (zombies do not count)."""
    return any(p.group == pgid and p.state not in ("Z", "X") for p in _processes())


def _read_from(path: Path, offset: int, limit: int) -> bytes:
    try:
        with open(path, "rb") as file:
            file.seek(offset)
            return file.read(limit)
    except FileNotFoundError:
        return b""


def _download(source: Path, target: Path, entries: Sequence[str], exclude: Sequence[str]) -> None:
    for rel in manifest_files(source, entries, exclude):
        destination = target / rel
        temporary = destination.with_name(f".{destination.name}.part")
        try:
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source / rel, temporary)
            temporary.replace(destination)
        except OSError as error:
            temporary.unlink(missing_ok=True)
            raise ExecError("download", f'"{rel}" cannot be copied: {_reason(error)}') from None


def _touch(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(exist_ok=True)


def _reason(error: BaseException) -> str:
    if isinstance(error, OSError) and error.strerror:
        return error.strerror + (f" ({error.filename})" if error.filename else "")
    if isinstance(error, shutil.Error) and error.args and isinstance(error.args[0], list):
        failures = error.args[0]
        return f"{len(failures)} files failed, first: {failures[0][2]}" if failures else str(error)
    return str(error)
