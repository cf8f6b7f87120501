"""A real OpenSSH `sshd` on 127.0.0.1 for tests and benchmarks.

Each `Sshd` has its own directory holding a host key, a client key, its
`authorized_keys`, its config and its log. It listens on a free port of
127.0.0.1 only, runs in the foreground (`-D -e`) as a child of this process and
is stopped by its PID. It can be stopped and started again on the same port
with the same keys, to test what a client does when its target goes away.

    sshd = Sshd.create(tmp_path / "sshd")
    sshd.start()
    ...  # connect to 127.0.0.1:sshd.port as sshd.user with sshd.client_key_path
    sshd.stop()
"""

from __future__ import annotations

import contextlib
import getpass
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType

from tests import procs
from tests.ports import free_port

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
SSH_KEYGEN = shutil.which("ssh-keygen") or "/usr/bin/ssh-keygen"
PRIVSEP_DIR = Path("/run/sshd")  # sshd refuses to start without its privilege-separation dir
START_TIMEOUT_S = 10.0  # time for sshd to print its banner before it is declared broken
STOP_TIMEOUT_S = 5.0  # time for sshd to exit after SIGTERM before it is killed


class SshdError(RuntimeError):
    """The test sshd could not be set up, started or stopped."""


def banner_ready(port: int, timeout: float = 0.5) -> bool:
    """Whether an SSH server on 127.0.0.1:`port` answers with its `SSH-` banner."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            return sock.recv(4).startswith(b"SSH-")
    except OSError:
        return False


class Sshd:
    """One OpenSSH daemon on 127.0.0.1:`port`, with its keys and files under `root`.

    `start` raises SshdError when sshd is not installed, its config is refused
    or it does not answer within `START_TIMEOUT_S`; the message quotes its log.
    """

    def __init__(self, root: Path, port: int) -> None:
        self.root = root
        self.port = port
        self.user = getpass.getuser()
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: object = None

    @classmethod
    def create(cls, root: Path, port: int | None = None) -> Sshd:
        """Writes a fresh host key, client key, authorized_keys and config under
        `root` (created) for an sshd on `port` (a free one by default).

        Raises SshdError when `sshd` or `ssh-keygen` is missing.
        """
        if not Path(SSHD).exists():
            raise SshdError(
                f"{SSHD} not found; install it with "
                "`apt-get install -y openssh-server` (Debian/Ubuntu)"
            )
        root.mkdir(parents=True, exist_ok=True)
        root.chmod(0o700)
        sshd = cls(root, port if port is not None else free_port())
        for key in (sshd.host_key_path, sshd.client_key_path):
            key.unlink(missing_ok=True)  # ssh-keygen would ask before replacing it
            key.with_suffix(".pub").unlink(missing_ok=True)
            subprocess.run(
                [SSH_KEYGEN, "-q", "-t", "ed25519", "-N", "", "-C", key.name, "-f", str(key)],
                check=True,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=30,
            )
        shutil.copyfile(sshd.client_key_path.with_suffix(".pub"), sshd.authorized_keys_path)
        sshd.authorized_keys_path.chmod(0o600)
        own_home(sshd.home)
        sshd.config_path.write_text(sshd._config())
        return sshd

    @property
    def host_key_path(self) -> Path:
        """The host's private key (its public half is next to it, `.pub`)."""
        return self.root / "host_ed25519"

    @property
    def client_key_path(self) -> Path:
        """The client's private key, the one `authorized_keys` accepts."""
        return self.root / "client_ed25519"

    @property
    def authorized_keys_path(self) -> Path:
        """The keys this sshd accepts, for every user."""
        return self.root / "authorized_keys"

    @property
    def home(self) -> Path:
        """The home of this sshd's sessions (their `HOME` and working directory),
        so that nothing they run reads or writes this machine's home."""
        return self.root / "home"

    @property
    def config_path(self) -> Path:
        """This sshd's config file."""
        return self.root / "sshd_config"

    @property
    def log_path(self) -> Path:
        """Where this sshd logs (its stderr), appended across restarts."""
        return self.root / "sshd.log"

    @property
    def host_key_line(self) -> str:
        """The host's public key as `ssh-keyscan` prints it: `ssh-ed25519 <base64>`."""
        kind, body, *_ = self.host_key_path.with_suffix(".pub").read_text().split()
        return f"{kind} {body}"

    @property
    def client_key_text(self) -> str:
        """The client's private key, in OpenSSH format."""
        return self.client_key_path.read_text()

    @property
    def pid(self) -> int | None:
        """The PID of the running sshd, or None when it is stopped."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def log_text(self) -> str:
        """Everything this sshd has logged so far."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def _config(self) -> str:
        return "\n".join(
            [
                f"Port {self.port}",
                "ListenAddress 127.0.0.1",
                f"HostKey {self.host_key_path}",
                f"PidFile {self.root / 'sshd.pid'}",
                f"AuthorizedKeysFile {self.authorized_keys_path}",
                "PubkeyAuthentication yes",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "UsePAM no",
                "StrictModes no",
                "PermitRootLogin prohibit-password",
                "Subsystem sftp internal-sftp",
                "LogLevel VERBOSE",  # logs every authentication attempt, failed ones too
                "MaxStartups 100",
                "MaxSessions 100",
                # the sessions' shells get a home of their own, as on a box of their own:
                # bash started by sshd reads $HOME/.bashrc, never this machine's
                f"SetEnv HOME={self.home}",
                "",
            ]
        )

    def start(self) -> None:
        """Starts sshd and waits for its banner on 127.0.0.1:`port`.

        Raises SshdError when it exits or stays silent for `START_TIMEOUT_S`
        (it is then stopped); the message holds the end of its log.
        """
        if self.pid is not None:
            return
        with contextlib.suppress(PermissionError):  # a non-root sshd does not need it
            PRIVSEP_DIR.mkdir(mode=0o755, parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        try:
            self._proc = subprocess.Popen(
                [SSHD, "-D", "-e", "-f", str(self.config_path)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )
        finally:
            log.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                break
            if banner_ready(self.port):
                return
            time.sleep(0.02)
        code = self._proc.poll()
        self.stop()
        tail = self.log_text()[-2000:]
        raise SshdError(
            f"sshd on 127.0.0.1:{self.port} did not start "
            f"({'exited ' + str(code) if code is not None else 'no banner'}); its log:\n{tail}"
        )

    def stop(self, drop_sessions: bool = True) -> None:
        """Stops sshd by its PID (SIGTERM, then SIGKILL after `STOP_TIMEOUT_S`) and
        waits for it. With `drop_sessions`, the per-connection sshd processes it
        forked are killed too (by PID), so open connections are lost as when a
        box goes away; jobs started through them (detached) keep running."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            sessions = session_pids(proc.pid) if drop_sessions else []
            proc.terminate()
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=STOP_TIMEOUT_S)
            for pid in sessions:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def restart(self) -> None:
        """Stops then starts sshd again, on the same port with the same keys."""
        self.stop()
        self.start()

    def __enter__(self) -> Sshd:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def own_home(home: Path) -> None:
    """Makes `home` a home of its own for the shells sshd starts with
    `SetEnv HOME=<home>`: sshd still starts them in the user's home of
    /etc/passwd, and bash (started by sshd) reads `$HOME/.bashrc`, which moves
    them to `home`. Nothing of this machine's home is read (its profile
    would run `pyenv rehash`, whose lock a killed session leaves behind)."""
    home.mkdir(parents=True, exist_ok=True)
    (home / ".bashrc").write_text('cd "$HOME" 2>/dev/null\n')


def session_pids(sshd_pid: int) -> list[int]:
    """PIDs of the sshd processes below the daemon `sshd_pid`: one or two per
    open connection. Other descendants (a session's shell and the commands it
    runs) are not listed."""
    table = procs.table()
    found: list[int] = []
    pending = [sshd_pid]
    while pending:
        for child in procs.children(pending.pop(), table):
            if child.name == "sshd":
                found.append(child.pid)
                pending.append(child.pid)
    return found
