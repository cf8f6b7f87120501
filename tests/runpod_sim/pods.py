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

`lose_host` freezes a pod and cuts its SSH, as a host lost under a running
pod looks from outside; `find_host` brings it back. Knobs: `boot_delay_s`
(the image takes that long to start), `never_ssh` (the pod's sshd never
starts: the watchdog still runs, and its boot grace deletes the pod),
`start_command` (the image runs this instead of the start command asked for:
one that exits is restarted, as Runpod restarts a container, after
`restart_delay_s`), `restart_delay_s` (the least and the most seconds
between an exit and the restart: 2-4 s as on Runpod).

A pod that mounts a network volume has the volume's directory as its
`/workspace` (`volumes/<id>`, shared by every pod that mounts it, kept when
the pod is deleted). A pod's directory holds `console.log` (what its start command printed: the
`container` log of the API), `system.log` (its container's starts and exits:
the `system` log) and `container.json` (its last start, its restarts).
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
    "import ctypes, json, os, random, signal, subprocess, sys, time\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans of the pod come here\n"
    "delay, argv = float(sys.argv[1]), json.loads(sys.argv[2])\n"
    "low, high, state, system = float(sys.argv[3]), float(sys.argv[4]), sys.argv[5], sys.argv[6]\n"
    "def event(text):\n"
    "    stamp = time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())\n"
    "    with open(system, 'a') as out:\n"
    "        out.write(stamp + ' ' + text + '\\n')\n"
    "def children():\n"
    "    found = []\n"
    "    for entry in os.listdir('/proc'):\n"
    "        try:\n"
    "            fields = open('/proc/' + entry + '/stat').read().rpartition(')')[2].split()\n"
    "        except (OSError, ValueError):\n"
    "            continue\n"
    "        if entry.isdigit() and len(fields) > 1 and int(fields[1]) == os.getpid():\n"
    "            found.append(int(entry))\n"
    "    return found\n"
    "def end_all():  # a container's processes end with its main process: SIGTERM, then SIGKILL\n"
    "    # (this machine's login shells share its home: a pyenv rehash must release its lock)\n"
    "    term_until = time.monotonic() + 3.0\n"
    "    for _ in range(250):\n"
    "        left = children()\n"
    "        if not left:\n"
    "            return\n"
    "        sig = signal.SIGTERM if time.monotonic() < term_until else signal.SIGKILL\n"
    "        for pid in left:\n"
    "            try:\n"
    "                os.kill(pid, sig)\n"
    "            except OSError:\n"
    "                pass\n"
    "        while True:\n"
    "            try:\n"
    "                if os.waitpid(-1, os.WNOHANG)[0] == 0:\n"
    "                    break\n"
    "            except ChildProcessError:\n"
    "                break\n"
    "        time.sleep(0.02)\n"
    "if delay > 0:\n"
    "    time.sleep(delay)\n"
    "restarts = 0\n"
    "while True:\n"
    "    started, main = time.time(), None\n"
    "    try:\n"
    "        main = subprocess.Popen(argv)\n"
    "    except OSError as error:  # the image has no such command\n"
    "        print(f'exec {argv[0]}: {error.strerror}', file=sys.stderr, flush=True)\n"
    "    with open(state + '.tmp', 'w') as out:\n"
    "        pid = main.pid if main else None\n"
    "        json.dump({'started_at': started, 'restarts': restarts, 'main': pid}, out)\n"
    "    os.replace(state + '.tmp', state)\n"
    "    event('container started')\n"
    "    if main is None:\n"
    "        code = 127\n"
    "    else:\n"
    "        while True:\n"
    "            pid, status = os.waitpid(-1, 0)\n"
    "            if pid == main.pid:\n"
    "                break\n"
    "        code = os.waitstatus_to_exitcode(status)\n"
    "    end_all()\n"
    "    pause = random.uniform(low, high)\n"
    "    event(f'container exited with code {code}; restarting in {pause:.1f} s')\n"
    "    time.sleep(pause)\n"
    "    restarts += 1\n"
)
"""The pod's root process, its container: a child subreaper that (after the
boot delay) runs the start command, and when that exits, ends what is left of
the container's processes and starts it again 2-4 s later (Runpod's restart
policy), noting each start and exit in the system log and the last start and
the restarts in `container.json`."""


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
        start_command: list[str] | None = None,
        restart_delay_s: tuple[float, float] = (2.0, 4.0),
        sshd_outlives_s: float = 0.0,
    ) -> None:
        self.root = root
        self.sshd_outlives_s = sshd_outlives_s
        self.boot_delay_s = boot_delay_s
        self.never_ssh = never_ssh
        self.start_command = start_command
        self.restart_delay_s = restart_delay_s
        self.sshd = sshd
        self._lock = threading.Lock()
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._volumes: dict[str, str] = {}  # pod ID -> the network volume it mounts

    @contextmanager
    def attached(self, sim: RunpodSim) -> Iterator[SimPods]:
        """Makes every pod `sim` creates from now on a real process tree."""
        sim.on_pod_create = self.create
        sim.on_pod_delete = self.delete
        sim.on_pod_restart = self.restart
        try:
            yield self
        finally:
            sim.on_pod_create = None
            sim.on_pod_delete = None
            sim.on_pod_restart = None
            self.stop_all()

    def dir_of(self, pod_id: str) -> Path:
        """The pod's directory: its root."""
        return self.root / pod_id

    def home_of(self, pod_id: str) -> Path:
        """The pod's `/root`: the home of its processes and of its SSH sessions."""
        return self.dir_of(pod_id) / "root"

    def workspace_of(self, pod_id: str) -> Path:
        """The pod's `/workspace`: its network volume's directory, shared by
        every pod that mounts the volume, when it mounts one."""
        volume = self._volumes.get(pod_id)
        if volume is not None:
            return self.root / "volumes" / volume
        return self.dir_of(pod_id) / "workspace"

    def watchdog_log(self, pod_id: str, run_id: str) -> str:
        """The watchdog's log of the run `run_id` on the pod (empty while none)."""
        path = self.workspace_of(pod_id) / "overbrainer" / run_id / ".pod" / "watchdog.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def output_of(self, pod_id: str) -> str:
        """What the pod's start command printed."""
        path = self.dir_of(pod_id) / "console.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def restart(self, pod: SimPod) -> None:
        """The simulator's restart hook (Runpod's `restart` action, or a host
        that restarts the container): kills the pod's start command, so its
        container ends its processes and starts it again."""
        path = self.dir_of(pod.id) / "container.json"
        try:
            main = int(json.loads(path.read_text())["main"])
        except (OSError, ValueError, KeyError):
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(main, signal.SIGKILL)

    def lose_host(self, pod: SimPod) -> None:
        """The pod's host is lost while Runpod still shows the pod running:
        every process of the pod is frozen (SIGSTOP: its job, its watchdog,
        which would start sshd again), then its sshd processes are killed, so
        that SSH to it is refused. Its deletion (SIGKILL) ends them all.
        Runpod's view of it stalls: its uptime stays as its host last reported it."""
        with self._lock:
            proc = self._procs.get(pod.id)
        if proc is None:
            return
        pod.host_lost_at = time.time()
        frozen = [proc.pid, *descendants(proc.pid)]
        kill_pids([pid for pid in frozen if not _is_sshd(pid)], signal.SIGSTOP)
        kill_pids([pid for pid in descendants(proc.pid) if _is_sshd(pid)], signal.SIGKILL)

    def cut_ssh(self, pod: SimPod, job_pid: int) -> None:
        """This side's network loses the pod's SSH while its host runs on: its
        job (`job_pid` and below) goes on and Runpod's view of the pod too,
        but SSH to it is refused (its sshd processes killed; the rest of the
        pod, its watchdog that would start sshd again, frozen). `find_host`
        ends it."""
        with self._lock:
            proc = self._procs.get(pod.id)
        if proc is None:
            return
        spared = {job_pid, *descendants(job_pid)}
        below = descendants(proc.pid)
        frozen = [pid for pid in [proc.pid, *below] if pid not in spared and not _is_sshd(pid)]
        kill_pids(frozen, signal.SIGSTOP)
        kill_pids([pid for pid in below if _is_sshd(pid)], signal.SIGKILL)

    def find_host(self, pod: SimPod) -> None:
        """The lost host of `lose_host` comes back: the pod's processes go on
        (SIGCONT), and its watchdog starts its sshd again."""
        pod.host_lost_at = None
        with self._lock:
            proc = self._procs.get(pod.id)
        if proc is not None:
            kill_pids([proc.pid, *descendants(proc.pid)], signal.SIGCONT)

    def restarts(self, pod_id: str) -> int:
        """How often the pod's container was restarted (its start command exited)."""
        path = self.dir_of(pod_id) / "container.json"
        try:
            return int(json.loads(path.read_text())["restarts"])
        except (OSError, ValueError, KeyError):
            return 0

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
        network = (pod.request.get("mounts") or {}).get("network") or [{}]
        if network[0].get("volumeId"):
            self._volumes[pod.id] = str(network[0]["volumeId"])
        workspace = self.workspace_of(pod.id)
        workspace.mkdir(parents=True, exist_ok=True)
        own_home(self.home_of(pod.id))
        port = free_port()
        pod.public_ip = "127.0.0.1"
        pod.ssh_port = port
        pod.ssh_user = getpass.getuser()
        args = pod.request.get("args")  # v2: one string, split like a shell (Docker's CMD)
        command = shlex.split(args) if args else ["sh", "-c", "while :; do sleep 3600; done"]
        if self.start_command is not None:
            command = list(self.start_command)
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
        low, high = self.restart_delay_s
        state, system = directory / "container.json", directory / "system.log"
        pod.log_files = {"container": directory / "console.log", "system": system}
        pod.container_file = state
        with (directory / "console.log").open("ab") as console:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    _WRAPPER,
                    str(self.boot_delay_s),
                    json.dumps(command),
                    str(low),
                    str(high),
                    str(state),
                    str(system),
                ],
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
            kill_tree(proc, sshd_outlives_s=self.sshd_outlives_s)
        with self._lock:
            self._procs.pop(pod.id, None)

    def stop_all(self) -> None:
        """Kills every pod still running, by PID."""
        with self._lock:
            procs = list(self._procs.values())
            self._procs.clear()
        for proc in procs:
            kill_tree(proc)


def kill_tree(proc: subprocess.Popen[bytes], sshd_outlives_s: float = 0.0) -> None:
    """Stops `proc` and every process below it, by PID. `proc` (the pod's
    root, its child subreaper) is frozen first, so that it starts nothing
    more and what it holds stays below it; the others get SIGTERM; after `TERM_GRACE_S`,
    what is left gets SIGKILL, `proc` last; then `proc` is reaped. With
    `sshd_outlives_s`, the pod's sshd processes get their SIGTERM that long after
    the others (a loaded machine ends a container's sshd late): its jobs are gone
    while it still answers."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGSTOP)
    if sshd_outlives_s > 0:
        kill_pids([pid for pid in descendants(proc.pid) if not _is_sshd(pid)], signal.SIGTERM)
        time.sleep(sshd_outlives_s)
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


def _is_sshd(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() == "sshd"
    except OSError:
        return False


def descendants(root: int) -> list[int]:
    """The PIDs below `root` (children first), from /proc; zombies left out."""
    return _descendants(root, zombies=False)


def deleted_once_verified(pod: object) -> bool:
    """Whether a run's pod (a `PodRecord`) was deleted after its client verified the
    run's files: by the client's delete, or by its watchdog at a look that came between
    the client's `retrieved` marker (written first, so that a refused delete still ends
    the pod) and that delete. Both are the design; which one wins is a race. The
    watchdog's deletion is recorded for the reason of the ending that marked the files
    (`VERIFIED_REASON`), or for the marker's own when no ending of this process saw it."""
    from overbrainer_prefect.runpod.pod import PodRecord, PodState
    from overbrainer_prefect.targets.runpod.ending import VERIFIED_REASON
    from overbrainer_prefect.targets.runpod.fate import RETRIEVED_REASON

    assert isinstance(pod, PodRecord), pod
    return pod.state == PodState.DELETED and (
        pod.deleted_by == "client"
        or (
            pod.deleted_by == "watchdog"
            and pod.retrieved_marked
            and pod.delete_reason in (VERIFIED_REASON, RETRIEVED_REASON)
        )
    )
