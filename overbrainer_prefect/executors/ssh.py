"""The SSH executor: runs a run's job on a box reached with asyncssh.

One connection serves every call (opened on the first, opened again on the
next call after it was lost). The host's key is pinned: a host that shows
another key is refused during the key exchange, before a single byte of
authentication or data is sent. Commands are the shared ones of `jobscript`,
so a job behaves exactly as on the local target; files travel over SFTP with
many requests in flight (`sftp_transfer`); manifests are hashed on the target
(`remote_manifest`), each byte read once there.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import os
import posixpath
import shlex
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TypeVar

import asyncssh
from asyncssh.constants import MSG_IGNORE
from asyncssh.known_hosts import KnownHostsArg
from asyncssh.packet import SSHPacketLogger, String
from pydantic import SecretStr

from overbrainer_prefect.executors import remote_manifest, sftp_transfer
from overbrainer_prefect.executors.base import (
    MAX_TAIL_READ,
    CommandResult,
    ExecError,
    FileDigest,
    JobId,
    JobSpec,
    JobStatus,
    TargetUnreachable,
)
from overbrainer_prefect.executors.jobscript import (
    CANCEL_GRACE_S,
    JOB_SCRIPT,
    cancel_command,
    job_script,
    launch_command,
    parse_launch,
    parse_status,
    status_command,
)
from overbrainer_prefect.executors.manifest import is_excluded

T = TypeVar("T")

CONNECT_TIMEOUT_S = 15.0  # seconds to open and authenticate a connection
KEEPALIVE_S = 15.0  # seconds between keepalives, so a dead link is noticed mid-command
KEEPALIVE_MISSES = 4  # keepalives unanswered before the connection is declared lost
COMMAND_TIMEOUT_S = 60.0  # seconds a short command (status, launch, listing) may take
SFTP_ANSWER_S = COMMAND_TIMEOUT_S  # seconds a small SFTP call (a read, a touch) may take
HASH_TIMEOUT_S = 6 * 3600.0  # hashing 100s of GB takes minutes; keepalives catch a dead link
WINDOW = 16 << 20  # bytes in flight per channel: keeps a long fat pipe full
MAX_PACKET = 256 << 10  # largest SSH packet we accept: fewer packets per GB downloaded
ENCRYPTION = (  # fastest first where AES-NI exists (every x86 server), all standard
    "aes128-gcm@openssh.com",
    "aes256-gcm@openssh.com",
    "chacha20-poly1305@openssh.com",
    "aes128-ctr",
    "aes256-ctr",
)

_SECRETS_READER = (
    # Reads `NAME=<base64>` lines from stdin up to an empty line and exports
    # them: secrets reach the job's environment without touching a file or a
    # process argument (printf and export are shell builtins). The `x` keeps a
    # value's trailing newlines, which `$(...)` would strip.
    'while IFS= read -r line && [ -n "$line" ]; do '
    'v=$(printf %s "${line#*=}" | base64 -d && printf x) || exit 98; '
    'export "${line%%=*}=${v%x}"; done; '
)

_LOST = (
    asyncssh.DisconnectError,  # ConnectionLost among them
    asyncssh.ChannelOpenError,
    asyncssh.SFTPConnectionLost,
    asyncssh.SFTPNoConnection,
    BrokenPipeError,
    ConnectionResetError,
    ConnectionAbortedError,
)
"""What a call raises when the connection went away under it."""


class SshExecutor:
    """Runs jobs on `user@host:port`, in run directories under `workdir`.

    `client_key` is an OpenSSH private key (its text; or `key_path`, a file
    holding one). `known_host_key` is the host's public key, the line
    `ssh-keyscan -p PORT HOST` prints (`<type> <base64>`, with or without the
    host in front; several lines pin several keys): the only key accepted.

    Paths on the host are absolute, or relative to `workdir`; nothing outside
    `workdir` is ever written. Every method raises ExecError, TargetUnreachable
    when the host cannot be reached or the connection is lost; the next call
    connects again. The
    constructor raises ExecError (`connect`) when no host key is pinned or a
    key cannot be read. No message ever quotes a key.
    """

    def __init__(
        self,
        host: str,
        *,
        port: int = 22,
        user: str = "root",
        client_key: SecretStr | None = None,
        key_path: str | Path | None = None,
        known_host_key: str | None = None,
        workdir: str,
        name: str | None = None,
        connect_timeout: float = CONNECT_TIMEOUT_S,
    ) -> None:
        self._host = host
        self._port = port
        self._user = user
        self._name = name or host
        self._connect_timeout = connect_timeout
        if not posixpath.isabs(workdir):
            raise ExecError(
                "connect", f"the workdir {workdir!r} of {self.description} must be absolute"
            )
        self._workdir = posixpath.normpath(workdir)
        self._host_keys = _pinned_keys(known_host_key, self.description, host, port)
        self._client_key = _client_key(client_key, key_path, self.description)
        self._conn: asyncssh.SSHClientConnection | None = None
        self._sftp: asyncssh.SFTPClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock: asyncio.Lock | None = None

    @property
    def workdir(self) -> str:
        """The absolute directory on the host that holds the run directories."""
        return self._workdir

    @property
    def description(self) -> str:
        """How messages name this target: `ssh target '<name>' (user@host:port)`."""
        return f"ssh target '{self._name}' ({self._user}@{self._host}:{self._port})"

    def __repr__(self) -> str:
        return f"SshExecutor({self.description}, workdir={self._workdir!r})"

    async def run(
        self, argv: Sequence[str], timeout: float = 60.0, stdin: bytes | None = None
    ) -> CommandResult:
        """Runs `argv` on the host (quoted for its shell), `stdin` written to
        it, and returns its exit code and output. A command is never retried, since it may not be
        idempotent: on a connection found lost it raises TargetUnreachable, and
        the next call connects again.

        Raises ExecError (`run`) when it runs past `timeout` seconds, and
        TargetUnreachable when the host cannot be reached.
        """
        if not argv:
            raise ExecError("run", "no command was given")
        late = f"{argv[0]!r} did not finish within {timeout:g} s on {self.description}"
        result = await self._command(
            "run",
            shlex.join(argv),
            ExecError("run", late),
            stdin=stdin,
            timeout=timeout,
            retry=False,
        )
        return CommandResult(
            code=_code(result),
            stdout=_text(result.stdout),
            stderr=_text(result.stderr),
        )

    async def upload(self, local: Path, remote: str, skip: Sequence[str] = ()) -> None:
        """Copies the directory `local` to `remote` on the host (created with its
        parents; files replaced, modes and times kept), less the top-level
        entries named in `skip`, over SFTP with many requests in flight.

        Raises ExecError (`upload`) when `remote` is outside the work directory,
        a local file cannot be read or a remote one written; TargetUnreachable
        when the host cannot be reached.
        """
        if not local.is_dir():
            raise ExecError("upload", f"{local} is not a directory")
        remote = self._inside("upload", remote)
        await self._transfer(
            "upload", lambda sftp: sftp_transfer.upload_tree(sftp, local, remote, skip), remote
        )

    async def spawn(self, job: JobSpec) -> JobId:
        """Starts `job` detached in its run directory on the host: writes its
        wrapper script (`job.sh`, without the secrets) over SFTP, then launches
        it in a new session. Its secrets are written, base64-encoded, to the
        launching shell's stdin, which exports them: they reach the job's
        environment only, never a file, a process argument or sshd's
        `AcceptEnv`. The job outlives the connection.

        Raises ExecError (`spawn`) when the run directory is outside the work
        directory, on a bad secret name or a failed launch; TargetUnreachable
        when the host cannot be reached.
        """
        run_dir = self._inside("spawn", job.run_dir, strictly=True)
        job = dataclasses.replace(job, run_dir=run_dir)
        try:
            script = job_script(job)
        except ValueError as error:
            raise ExecError("spawn", str(error)) from None
        secrets = _secrets_input(job)
        script_path = posixpath.join(run_dir, JOB_SCRIPT)

        async def write_script(sftp: asyncssh.SFTPClient) -> None:
            await sftp.makedirs(run_dir, exist_ok=True)
            async with sftp.open(script_path, "wb") as file:
                await file.write(script.encode())

        # The script is written first, on a connection then known to be alive:
        # the launch itself is never retried, so a job never starts twice.
        await self._sftp_call("spawn", write_script, script_path)
        command = "sh -c " + shlex.quote(_SECRETS_READER + launch_command(run_dir))
        late = f"the launch of run {job.run_id} took over {COMMAND_TIMEOUT_S:g} s"
        result = await self._command(
            "spawn", command, ExecError("spawn", late), stdin=secrets, retry=False
        )
        try:
            return parse_launch(run_dir, _text(result.stdout))
        except ValueError:
            detail = _text(result.stderr).strip().splitlines()
            reason = "its secrets could not be read" if _code(result) == 98 else ""
            raise ExecError(
                "spawn",
                f"the job of run {job.run_id} did not start on {self.description}"
                + (f": {reason or detail[-1]}" if reason or detail else ""),
            ) from None

    async def status(self, job: JobId) -> JobStatus:
        """Where `job` stands, read on the host from its exit file, its process
        and its cancel marker (see `jobscript.parse_status`).

        Raises TargetUnreachable when the host cannot be reached, does not
        answer within `COMMAND_TIMEOUT_S`, or cuts its answer short (its sshd
        gone while it answered: the job is not lost for that).
        """
        result = await self._short("status", status_command(job))
        text = _text(result.stdout)
        if "cancelled:" not in text:  # the last section: an answer without it was cut
            raise TargetUnreachable("status", f"{self.description} cut its answer short")
        return parse_status(job, text)

    async def wait_exit(self, job: JobId, seconds: float) -> None:
        """Waits `seconds`: a look at the job costs a command on the host, made
        once a poll. Raises nothing."""
        await asyncio.sleep(seconds)

    async def cancel(self, job: JobId) -> None:
        """Cancels `job` when it is still the process it was: writes its cancel
        marker, sends SIGTERM to its process group, waits up to `CANCEL_GRACE_S`
        for the group to end, then sends SIGKILL (see `jobscript.cancel_command`).
        A job already ended is left alone; of a lost one, what still runs in
        its run directory is killed, and it still reads lost.

        Raises ExecError (`cancel`) when the run directory is outside the work
        directory or the command fails, TargetUnreachable
        when the host cannot be reached.
        """
        self._inside("cancel", job.dir, strictly=True)
        result = await self._short(
            "cancel", cancel_command(job), timeout=CANCEL_GRACE_S + COMMAND_TIMEOUT_S
        )
        if _code(result) != 0:
            raise ExecError("cancel", f"job {job.pid} in {job.dir}: {_last_line(result)}")

    async def read_from(self, path: str, offset: int, limit: int = MAX_TAIL_READ) -> bytes:
        """Up to `limit` bytes of the file `path` on the host from `offset`, read
        in place over SFTP; empty when the file does not exist yet or ends
        before `offset`.

        Raises ExecError (`read`) on a negative offset or limit, or a file that
        cannot be read; TargetUnreachable when the host cannot be reached.
        """
        if offset < 0 or limit < 0:
            raise ExecError("read", f"offset {offset} and limit {limit} must not be negative")
        path = self._path(path)
        return await self._sftp_call(
            "read", lambda sftp: sftp_transfer.read_range(sftp, path, offset, limit), path
        )

    async def manifest(
        self, remote: str, entries: Sequence[str], exclude: Sequence[str] = ()
    ) -> list[FileDigest]:
        """The SHA-256 manifest of the files under `entries` of `remote`, less
        those `exclude` matches (`manifest.is_excluded`), computed on the host:
        one command lists the files, a second hashes those kept, each byte read
        once there. The same files as `manifest.local_manifest` would list.

        Raises ExecError (`manifest`) on a bad entry, a missing `remote` or a
        file that cannot be read; TargetUnreachable when the host cannot be
        reached.
        """
        remote = self._path(remote)
        files = await self._files("manifest", remote, entries, exclude)
        if not files:
            return []
        paths = sorted(files)
        result = await self._short(
            "manifest",
            remote_manifest.hash_command(remote),
            stdin=remote_manifest.hash_input(paths),
            timeout=HASH_TIMEOUT_S,
        )
        if _code(result) != 0:
            raise ExecError("manifest", f"cannot hash the files of {remote}: {_last_line(result)}")
        try:
            digests = remote_manifest.parse_hashes(_bytes(result.stdout))
        except ValueError as error:
            raise ExecError("manifest", str(error)) from None
        missing = [path for path in paths if path not in digests]
        if missing:
            raise ExecError("manifest", f'"{missing[0]}" was listed but not hashed on the target')
        return [FileDigest(path=path, size=files[path], sha256=digests[path]) for path in paths]

    async def download(
        self, remote: str, local: Path, entries: Sequence[str], exclude: Sequence[str] = ()
    ) -> None:
        """Copies the files under `entries` of `remote` (less those `exclude`
        matches: the files `manifest` lists) into `local`, same layout, over
        SFTP with many requests in flight, a few files at a time.

        Raises ExecError (`download`) when a file cannot be read or written,
        TargetUnreachable when the host cannot be reached.
        """
        remote = self._path(remote)
        files = await self._files("download", remote, entries, exclude)
        paths = sorted(files)
        if not paths:
            return
        await self._transfer(
            "download",
            lambda sftp: sftp_transfer.download_files(sftp, remote, local, paths),
            remote,
        )

    async def touch(self, path: str) -> None:
        """Creates the file `path` on the host (and its directories) if it does
        not exist; an existing file is left as it is.

        Raises ExecError (`touch`) when `path` is outside the work directory or
        cannot be created, TargetUnreachable when the host cannot be reached.
        """
        path = self._inside("touch", path, strictly=True)

        async def touch(sftp: asyncssh.SFTPClient) -> None:
            await sftp.makedirs(posixpath.dirname(path), exist_ok=True)
            async with sftp.open(path, "ab"):
                pass

        await self._sftp_call("touch", touch, path)

    async def close(self) -> None:
        """Closes the connection, if any; the next call opens a new one."""
        conn, sftp = self._conn, self._sftp
        self._conn = self._sftp = None
        if conn is None or self._loop is not asyncio.get_running_loop():
            return
        if sftp is not None:
            sftp.exit()
        conn.close()
        try:
            await asyncio.wait_for(conn.wait_closed(), self._connect_timeout)
        except (TimeoutError, *_LOST):
            conn.abort()

    # -- connection -----------------------------------------------------------------

    async def _connection(self, action: str) -> tuple[asyncssh.SSHClientConnection, bool]:
        """The open connection, and whether it was opened by this call."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop or self._lock is None:
            # A connection belongs to the event loop that opened it; one from a
            # loop since closed is dropped (its socket goes with it).
            self._conn = self._sftp = None
            self._loop, self._lock = loop, asyncio.Lock()
        async with self._lock:
            if self._conn is not None and not self._conn.is_closed():
                return self._conn, False
            self._conn = self._sftp = None
            self._conn = await self._connect(action)
            return self._conn, True

    async def _connect(self, action: str) -> asyncssh.SSHClientConnection:
        known_hosts: KnownHostsArg = (self._host_keys, [], [], [], [], [], [])
        try:
            conn = await asyncssh.connect(
                self._host,
                self._port,
                username=self._user,
                client_keys=[self._client_key],
                known_hosts=known_hosts,
                agent_path=None,  # only the given key: never one from an agent
                config=None,  # nor options from ~/.ssh/config
                preferred_auth="publickey",
                connect_timeout=self._connect_timeout,
                keepalive_interval=KEEPALIVE_S,
                keepalive_count_max=KEEPALIVE_MISSES,
                encryption_algs=list(ENCRYPTION),
                window=WINDOW,
                max_pktsize=MAX_PACKET,
            )
        except asyncssh.HostKeyNotVerifiable:
            raise ExecError(
                action,
                f"the host key of {self.description} does not match the pinned one; "
                "nothing was sent. If the host was reinstalled, check its new key out of band "
                f"(`ssh-keyscan -p {self._port} {self._host}`) and pin it",
            ) from None
        except asyncssh.PermissionDenied:
            raise ExecError(
                action,
                f"{self.description} refused the client key; add its public key to "
                f"~{self._user}/.ssh/authorized_keys on the host",
            ) from None
        except (asyncssh.DisconnectError, OSError) as error:  # TimeoutError is an OSError
            raise TargetUnreachable(
                action, f"{self.description} cannot be reached: {_reason(error)}"
            ) from None
        _without_ignore_packets(conn)
        return conn

    def _drop(self, conn: asyncssh.SSHClientConnection) -> None:
        """Forgets `conn` after it failed, so that the next call connects again."""
        if self._conn is conn:
            self._conn = self._sftp = None
        conn.abort()

    async def _attempt(
        self,
        action: str,
        call: Callable[[asyncssh.SSHClientConnection], Awaitable[T]],
        retry: bool = True,
    ) -> T:
        """`call` on the connection. When a connection kept from an earlier call
        turns out lost, it is dropped and, with `retry` (idempotent calls), the
        call is made once more on a new one; otherwise TargetUnreachable."""
        for attempt in (1, 2):
            conn, fresh = await self._connection(action)
            try:
                return await call(conn)
            except _LOST as error:
                self._drop(conn)
                if fresh or not retry or attempt == 2:
                    raise TargetUnreachable(
                        action, f"lost the connection to {self.description}: {_reason(error)}"
                    ) from None
        raise AssertionError("unreachable")

    async def _command(
        self,
        action: str,
        command: str,
        late: ExecError,
        stdin: bytes | None = None,
        timeout: float = COMMAND_TIMEOUT_S,
        retry: bool = True,
    ) -> asyncssh.SSHCompletedProcess:
        """Runs the shell command `command` on the host, `stdin` written to it.

        Raises `late` past `timeout`, TargetUnreachable when the host is out of
        reach.
        """

        async def call(conn: asyncssh.SSHClientConnection) -> asyncssh.SSHCompletedProcess:
            try:
                return await conn.run(
                    command, input=stdin or b"", encoding=None, timeout=timeout, check=False
                )
            except asyncssh.TimeoutError:
                raise late from None

        return await self._attempt(action, call, retry=retry)

    async def _short(
        self,
        action: str,
        command: str,
        stdin: bytes | None = None,
        timeout: float = COMMAND_TIMEOUT_S,
    ) -> asyncssh.SSHCompletedProcess:
        """A command of ours, in `sh` (whatever the user's login shell), retried
        once on a stale connection; no answer within `timeout` is TargetUnreachable."""
        late = TargetUnreachable(action, f"{self.description} did not answer within {timeout:g} s")
        return await self._command(
            action, "sh -c " + shlex.quote(command), late, stdin=stdin, timeout=timeout
        )

    async def _sftp_call(
        self,
        action: str,
        call: Callable[[asyncssh.SFTPClient], Awaitable[T]],
        subject: str,
        bounded: bool = True,
    ) -> T:
        """`call` with the connection's SFTP session (started once per
        connection); an SFTP or local file error is ExecError(`action`), naming
        the file, else `subject`. A `bounded` call (its session's start
        included) that gets no answer within `SFTP_ANSWER_S` is
        TargetUnreachable, and its connection is dropped: a host whose
        keepalives still answer while its SFTP server is stuck never holds a
        watch. Transfers are not bounded: their size is, and keepalives catch a
        dead link."""
        timeout = SFTP_ANSWER_S if bounded else None

        async def with_sftp(conn: asyncssh.SSHClientConnection) -> T:
            bound = asyncio.timeout(timeout)
            try:
                async with bound:
                    sftp = await self._sftp_of(conn)
                    return await call(sftp)
            except TimeoutError as error:
                if not bound.expired():  # a socket's own timeout: an OSError like the others
                    raise ExecError(action, f"{subject}: {_reason(error)}") from None
                self._drop(conn)
                raise TargetUnreachable(
                    action, f"{self.description} did not answer within {timeout:g} s"
                ) from None
            except _LOST:
                raise
            except asyncssh.SFTPError as error:
                path = _sftp_path(error) or subject
                raise ExecError(action, f"{path}: {error.reason}") from None
            except OSError as error:
                raise ExecError(action, f"{subject}: {_reason(error)}") from None

        return await self._attempt(action, with_sftp)

    async def _transfer(
        self, action: str, call: Callable[[asyncssh.SFTPClient], Awaitable[None]], subject: str
    ) -> None:
        """A transfer over SFTP: `_sftp_call` without its bound (a transfer's
        size bounds it, and keepalives catch a dead link)."""
        await self._sftp_call(action, call, subject, bounded=False)

    async def _sftp_of(self, conn: asyncssh.SSHClientConnection) -> asyncssh.SFTPClient:
        assert self._lock is not None
        async with self._lock:
            if self._sftp is None or self._conn is not conn:
                self._sftp = await conn.start_sftp_client()
            return self._sftp

    async def _files(
        self, action: str, remote: str, entries: Sequence[str], exclude: Sequence[str]
    ) -> dict[str, int]:
        """The files under `entries` of `remote` on the host, less those
        `exclude` matches, with their sizes (see `remote_manifest`)."""
        try:
            command = remote_manifest.list_command(remote, entries)
        except ValueError as error:
            raise ExecError(action, str(error)) from None
        if not remote_manifest.checked_entries(entries):
            return {}
        result = await self._short(action, command)
        if _code(result) == 3:
            raise ExecError(action, f"{remote} does not exist on {self.description}")
        if _code(result) != 0:
            raise ExecError(action, f"cannot list the files of {remote}: {_last_line(result)}")
        try:
            files, links = remote_manifest.parse_listing(_bytes(result.stdout))
        except ValueError as error:
            raise ExecError(action, str(error)) from None
        files = {path: size for path, size in files.items() if not is_excluded(path, exclude)}
        links = [path for path in links if not is_excluded(path, exclude)]
        if links:
            linked = await self._short(action, remote_manifest.links_command(remote, links))
            try:
                files.update(remote_manifest.parse_links(links, _bytes(linked.stdout)))
            except ValueError as error:
                raise ExecError(action, str(error)) from None
        return files

    def _path(self, path: str) -> str:
        """`path` made absolute (a relative path is taken under the work directory)."""
        return posixpath.normpath(posixpath.join(self._workdir, path))

    def _inside(self, action: str, path: str, strictly: bool = False) -> str:
        """`path` made absolute and checked to lie under the work directory (and
        not to be the work directory itself when `strictly`): nothing outside it
        is ever written."""
        resolved = self._path(path)
        inside = resolved.startswith(self._workdir.rstrip("/") + "/")
        if not inside and (strictly or resolved != self._workdir):
            raise ExecError(
                action,
                f"{path} is not inside the work directory {self._workdir} of {self.description}",
            )
        return resolved


_EMPTY_IGNORE = String(b"")  # the payload of the SSH_MSG_IGNORE asyncssh sends before each packet


def _without_ignore_packets(conn: asyncssh.SSHClientConnection) -> None:
    """Stops `conn` sending the empty SSH_MSG_IGNORE that asyncssh puts before
    every packet it encrypts. No implementation is required to send them (RFC
    4253 §11.2): they blur the timing of an interactive session's keystrokes,
    and this connection carries none (commands, SFTP). Without them a transfer
    sends half the packets, which the 2 cores of both ends otherwise spend on:
    about a fifth less client CPU a GiB uploaded (bench/ssh_transfer.py). Every
    other packet, a non-empty ignore included, goes as it did."""
    send = conn.send_packet

    def send_packet(pkttype: int, *args: bytes, handler: SSHPacketLogger | None = None) -> None:
        if pkttype == MSG_IGNORE and args == (_EMPTY_IGNORE,):
            return
        send(pkttype, *args, handler=handler)

    conn.send_packet = send_packet  # type: ignore[method-assign]


def _pinned_keys(
    known_host_key: str | None, description: str, host: str, port: int
) -> list[asyncssh.SSHKey]:
    """The host keys of `known_host_key`: one per line, `<type> <base64>`,
    with or without a host pattern in front (known_hosts / ssh-keyscan lines)."""
    how = f"get it with `ssh-keyscan -p {port} {host}` and pass its line as known_host_key"
    keys: list[asyncssh.SSHKey] = []
    for line in (known_host_key or "").splitlines():
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        key = None
        for start in (0, 1):
            try:
                key = asyncssh.import_public_key(" ".join(fields[start : start + 2]))
                break
            except (asyncssh.KeyImportError, ValueError):
                continue
        if key is None:
            raise ExecError(
                "connect",
                f"the pinned host key of {description} is not a public key line "
                f"(`<type> <base64>`); {how}",
            )
        keys.append(key)
    if not keys:
        raise ExecError(
            "connect",
            f"no host key is pinned for {description}, so it cannot be told from an "
            f"impostor; {how}",
        )
    return keys


def _client_key(
    client_key: SecretStr | None, key_path: str | Path | None, description: str
) -> asyncssh.SSHKey:
    """The client's private key, from its text or its file; the error never
    quotes it."""
    if client_key is not None:
        try:
            return asyncssh.import_private_key(client_key.get_secret_value())
        except (asyncssh.KeyImportError, ValueError):
            raise ExecError(
                "connect",
                f"the client key of {description} is not an unencrypted OpenSSH or PEM private key",
            ) from None
    if key_path is not None:
        try:
            return asyncssh.read_private_key(Path(key_path).expanduser())
        except OSError as error:
            raise ExecError(
                "connect", f"cannot read the client key {key_path}: {_reason(error)}"
            ) from None
        except (asyncssh.KeyImportError, ValueError):
            raise ExecError(
                "connect",
                f"{key_path} is not an unencrypted OpenSSH or PEM private key",
            ) from None
    raise ExecError(
        "connect", f"no client key for {description}: give client_key (its text) or key_path"
    )


def _secrets_input(job: JobSpec) -> bytes:
    """The `NAME=<base64>` lines, then an empty line, that `_SECRETS_READER` reads."""
    lines = []
    for name, secret in job.secrets.items():
        if not name.isascii() or not name.isidentifier():
            raise ExecError("spawn", f"{name!r} is not a valid environment variable name")
        value = base64.b64encode(secret.get_secret_value().encode()).decode()
        lines.append(f"{name}={value}\n")
    return ("".join(lines) + "\n").encode()


def _code(result: asyncssh.SSHCompletedProcess) -> int:
    code = result.returncode
    return code if code is not None else -1


def _bytes(data: object) -> bytes:
    return data if isinstance(data, bytes) else str(data or "").encode()


def _text(data: object) -> str:
    if isinstance(data, bytes):
        return data.decode(errors="replace")
    return str(data or "")


def _last_line(result: asyncssh.SSHCompletedProcess) -> str:
    lines = _text(result.stderr).strip().splitlines()
    return lines[-1] if lines else f"exit code {_code(result)}"


def _sftp_path(error: asyncssh.SFTPError) -> str:
    """The file an SFTP copy failed on, when asyncssh says."""
    path = getattr(error, "srcpath", None) or getattr(error, "dstpath", None)
    if isinstance(path, bytes):
        path = path.decode(errors="replace")
    return str(path or "")


def _reason(error: BaseException) -> str:
    if isinstance(error, asyncssh.Error):
        return error.reason or type(error).__name__
    if isinstance(error, TimeoutError):
        return "timed out"
    if isinstance(error, OSError) and error.errno:
        # asyncio's "Connect call failed (addr)" says less than the errno does
        return os.strerror(error.errno) + (f" ({error.filename})" if error.filename else "")
    return str(error) or type(error).__name__
