"""Simulated pods that are real: each pod of a `RunpodSim` becomes a local
process tree running the pod's real start command (the bootstrap + watchdog
of the package) with Runpod's pod environment, in a directory of its own
(its root: workspace, `/root/.ssh`, `/etc/ssh`), with its sshd on
127.0.0.1:<a free port>. The watchdog reaches the simulator over HTTP to
delete its own pod; a deleted pod's processes are killed by PID, the job's
included (a deleted pod's job dies with it).

    with running_sim() as sim, SimPods(tmp_path / "pods").attached(sim) as pods:
        ...  # create pods through the API: each one boots for real

The pod's root process is made a child subreaper, as a container's PID 1 is
for the processes of the container: a job started detached over SSH (its own
session) is reparented to it, so the pod's processes are exactly the root
process and its descendants. They get SIGTERM, then SIGKILL. As in a
container, the pod's SSH sessions have a home of their own, the pod's `/root`
(the bootstrap's sshd sets `HOME`): nothing they run reads this machine's
profile or leaves a file or a lock in its home.

Knobs: `boot_delay_s` (the image takes that long to start), `never_ssh`
(the pod's sshd never starts: the watchdog still runs, and its boot grace
deletes the pod).
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.ports import free_port
from tests.procs import descendants as _descendants
from tests.procs import kill_pids
from tests.runpod_sim.api import RunpodSim, SimPod
from tests.sshd import SSHD, own_home

KILL_ROUNDS = 20  # passes over the pod's process tree, until nothing of it is left
TERM_GRACE_S = 3.0  # how long the pod's processes get to end on SIGTERM before SIGKILL
WAIT_S = 10.0  # how long the root process may take to be reaped once killed

_WRAPPER = (
    "import ctypes, json, os, sys, time\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans of the pod come here\n"
    "delay = float(sys.argv[1])\n"
    "if delay > 0:\n"
    "    time.sleep(delay)\n"
    "argv = json.loads(sys.argv[2])\n"
    "os.execvp(argv[0], argv)\n"
)
"""The pod's root process: a child subreaper, then (after the boot delay) the
start command, with `exec` so the command itself is the root."""


class SimPods:
    """The real processes of a simulator's pods, under `root/<pod id>/`.

    `attached(sim)` sets the simulator's pod hooks for the duration of a
    `with` block and stops every pod still running at its end, by PID.
    """

    def __init__(
        self,
        root: Path,
        *,
        boot_delay_s: float = 0.0,
        never_ssh: bool = False,
        sshd: str = SSHD,
    ) -> None:
        self.root = root
        self.boot_delay_s = boot_delay_s
        self.never_ssh = never_ssh
        self.sshd = sshd
        self._lock = threading.Lock()
        self._procs: dict[str, subprocess.Popen[bytes]] = {}

    @contextmanager
    def attached(self, sim: RunpodSim) -> Iterator[SimPods]:
        """Makes every pod `sim` creates from now on a real process tree."""
        sim.on_pod_create = self.create
        sim.on_pod_delete = self.delete
        try:
            yield self
        finally:
            sim.on_pod_create = None
            sim.on_pod_delete = None
            self.stop_all()

    def dir_of(self, pod_id: str) -> Path:
        """The pod's directory: its root."""
        return self.root / pod_id

    def home_of(self, pod_id: str) -> Path:
        """The pod's `/root`: the home of its processes and of its SSH sessions."""
        return self.dir_of(pod_id) / "root"

    def workspace_of(self, pod_id: str) -> Path:
        """The pod's `/workspace`."""
        return self.dir_of(pod_id) / "workspace"

    def watchdog_log(self, pod_id: str, run_id: str) -> str:
        """The watchdog's log of the run `run_id` on the pod (empty while none)."""
        path = self.workspace_of(pod_id) / "overbrainer" / run_id / ".pod" / "watchdog.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def output_of(self, pod_id: str) -> str:
        """What the pod's start command printed."""
        path = self.dir_of(pod_id) / "console.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def running(self, pod_id: str) -> bool:
        """Whether the pod's root process is alive (a deleted pod's, until all of
        its processes are killed)."""
        with self._lock:
            proc = self._procs.get(pod_id)
        return proc is not None and proc.poll() is None

    def create(self, pod: SimPod) -> None:
        """The simulator's create hook: publishes the pod's SSH endpoint and
        starts its start command as a process tree of its own."""
        if pod.status != "RUNNING":  # a secret it references is missing: it never starts
            return
        directory = self.dir_of(pod.id)
        workspace = self.workspace_of(pod.id)
        workspace.mkdir(parents=True, exist_ok=True)
        own_home(self.home_of(pod.id))
        port = free_port()
        pod.public_ip = "127.0.0.1"
        pod.ssh_port = port
        pod.ssh_user = getpass.getuser()
        args = pod.request.get("args")  # v2: one string, split like a shell (Docker's CMD)
        command = shlex.split(args) if args else ["sh", "-c", "while :; do sleep 3600; done"]
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "LANG": "C.UTF-8",
            "HOME": str(self.home_of(pod.id)),
            **pod.env,
            "RUNPOD_PUBLIC_IP": "127.0.0.1",
            "RUNPOD_TCP_PORT_22": str(port),
            "OVERBRAINER_POD_ROOT": str(directory),
            "OVERBRAINER_WORKSPACE": str(workspace),
            "OVERBRAINER_SSH_PORT": str(port),
            "OVERBRAINER_SSH_ADDRESS": "127.0.0.1",
            "OVERBRAINER_SSHD": "/bin/false" if self.never_ssh else self.sshd,
        }
        with (directory / "console.log").open("ab") as console:
            proc = subprocess.Popen(
                [sys.executable, "-c", _WRAPPER, str(self.boot_delay_s), json.dumps(command)],
                cwd=directory,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=console,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        with self._lock:
            self._procs[pod.id] = proc
        pod.extra["pid"] = proc.pid
        pod.extra["dir"] = str(directory)

    def delete(self, pod: SimPod) -> None:
        """The simulator's delete hook: kills every process of the pod by PID;
        `running` says True until they are all gone."""
        with self._lock:
            proc = self._procs.get(pod.id)
        if proc is not None:
            kill_tree(proc)
        with self._lock:
            self._procs.pop(pod.id, None)

    def stop_all(self) -> None:
        """Kills every pod still running, by PID."""
        with self._lock:
            procs = list(self._procs.values())
            self._procs.clear()
        for proc in procs:
            kill_tree(proc)


def kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """Stops `proc` and every process below it, by PID. `proc` (the pod's
    root, its child subreaper) is frozen first, so that it starts nothing
    more and what it holds stays below it; the others get SIGTERM; after `TERM_GRACE_S`,
    what is left gets SIGKILL, `proc` last; then `proc` is reaped."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGSTOP)
    kill_pids(descendants(proc.pid), signal.SIGTERM)
    deadline = time.monotonic() + TERM_GRACE_S
    while time.monotonic() < deadline and descendants(proc.pid):
        time.sleep(0.05)
    for _ in range(KILL_ROUNDS):
        left = descendants(proc.pid)
        if not left:
            break
        kill_pids(left, signal.SIGKILL)
        time.sleep(0.05)
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=WAIT_S)


def descendants(root: int) -> list[int]:
    """The PIDs below `root` (children first), from /proc; zombies left out."""
    return _descendants(root, zombies=False)
