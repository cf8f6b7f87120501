"""The job's wrapper script and how its status is read back, shared by every
executor: the job runs as `sh job.sh` in its own session, detached from the
process that started it, and its status is read from the target's `/proc` and
two files, so another process on another day reads the same answer.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping

from overbrainer_prefect.executors.base import (
    CANCEL_FILE,
    EXIT_FILE,
    JOB_LOG,
    JobId,
    JobSpec,
    JobStatus,
)

JOB_SCRIPT = "job.sh"
"""The wrapper, written into the run directory next to the job's files."""

CANCEL_GRACE_S = 10.0  # seconds between SIGTERM and SIGKILL of a cancelled job
LEFTOVER_WAIT_S = 5.0  # seconds a lost job's killed leftovers are waited for


def job_script(job: JobSpec) -> str:
    """The wrapper script of `job`: runs its commands in order in the run
    directory with their output appended to `JOB_LOG`, stops at the first that
    fails, and writes the exit code to `EXIT_FILE` (atomically) once they end.

    Only `job.env` is written into the script; `job.secrets` never are (they
    reach the job through the environment of the process that starts it).
    """
    lines = [
        "#!/bin/sh",
        "# Written by overbrainer-prefect: runs the job's commands, then records their exit code.",
        f"cd {shlex.quote(job.run_dir)} || exit 97",
        f"exec >>{JOB_LOG} 2>&1 </dev/null",
        "finish() {",
        f"  printf '%s\\n' \"$1\" > {EXIT_FILE}.tmp && mv -f {EXIT_FILE}.tmp {EXIT_FILE}",
        '  exit "$1"',
        "}",
        'step() { "$@"; code=$?; [ "$code" -eq 0 ] || finish "$code"; }',
    ]
    lines += [f"export {name}={shlex.quote(value)}" for name, value in _checked(job.env).items()]
    lines += ["step " + shlex.join(command) for command in job.commands]
    lines.append("finish 0")
    return "\n".join(lines) + "\n"


def launch_command(run_dir: str) -> str:
    """A shell command that starts `sh job.sh` in `run_dir` in a new session,
    detached (reparented away from the caller), and prints the job's
    `/proc/<pid>/stat` line, from which `parse_launch` reads its identity."""
    quoted = shlex.quote(run_dir)
    return (
        f"cd {quoted} || exit 1; rm -f {EXIT_FILE} {CANCEL_FILE}; "
        f"setsid sh {JOB_SCRIPT} </dev/null >/dev/null 2>&1 & "
        # `read`, a builtin: the shell reaps no child before the line is read, so a
        # job that ends at once is still a zombie with a stat line (`cat` forks, and
        # the shell's wait for it could reap the job first)
        'pid=$!; read -r line < /proc/"$pid"/stat && printf \'%s\\n\' "$line"'
    )


def parse_launch(run_dir: str, stat_line: str) -> JobId:
    """The `JobId` of a job from the `/proc/<pid>/stat` line `launch_command` printed.

    Raises ValueError when the line is not a stat line.
    """
    pid, _state, started = _parse_stat(stat_line)
    return JobId(dir=run_dir, pid=pid, started=started)


def status_command(job: JobId) -> str:
    """A shell command printing what `parse_status` needs: the job's stat
    line, the exit file and whether it was cancelled, one section each. The
    stat line is read first: a job that ends between the reads has written
    its exit file (or the cancel file) before it died, so a dead job's exit
    code is never missed (read the other way round, a job ending between the
    reads looked lost)."""
    run_dir = shlex.quote(job.dir)
    return (
        f"cd {run_dir} 2>/dev/null; printf 'stat:'; cat /proc/{job.pid}/stat 2>/dev/null; echo; "
        f"printf 'exit:'; cat {EXIT_FILE} 2>/dev/null; echo; "
        f"printf 'cancelled:'; [ -e {CANCEL_FILE} ] && printf yes; echo"
    )


def parse_status(job: JobId, output: str) -> JobStatus:
    """The status of `job` from the output of `status_command`.

    A job with an exit code has exited; otherwise it runs while its PID is alive
    with the same start time (a reused PID is not the job); gone, it was
    cancelled when `CANCEL_FILE` exists, and is lost otherwise.
    """
    sections = {}
    for line in output.splitlines():
        key, _, value = line.partition(":")
        sections[key] = value.strip()
    exit_text = sections.get("exit", "")
    if exit_text.lstrip("-").isdigit():
        return JobStatus.exited(int(exit_text))
    if _alive(job, sections.get("stat", "")):
        return JobStatus.running()
    if sections.get("cancelled") == "yes":
        return JobStatus.cancelled()
    return JobStatus.lost()


_LEFTOVERS = (
    # in the run directory: the processes whose working directory it is (zombies have none)
    'real=$(pwd -P); cd /; left() { ls -l /proc/[0-9]*/cwd 2>/dev/null | R="$real" awk '
    + shlex.quote(
        '{n = index($0, " -> "); if (n && substr($0, n + 4) == ENVIRON["R"]) '
        '{split(substr($0, 1, n - 1), a, "/"); print a[3]}}'
    )
    + '; }; p=$(left); [ -n "$p" ] || exit 0; kill -KILL $p 2>/dev/null; i=0; '
    + f'while [ -n "$(left)" ] && [ $i -lt {int(LEFTOVER_WAIT_S * 10)} ]; do '
    + "sleep 0.1; i=$((i+1)); done"
)
"""Run in a lost job's run directory: kills what still runs there, and waits
for it to be gone (see `cancel_command`)."""

TREE_AWK = (
    "{p[NR]=$1; q[NR]=$2; s[NR]=$4; t[NR]=$5; if ($3 == g) m[$1] = 1} "
    "END {do {c = 0; for (i = 1; i <= NR; i++) if (!(p[i] in m) && (q[i] in m)) "
    "{m[p[i]] = 1; c = 1}} while (c); "
    'for (i = 1; i <= NR; i++) if ((p[i] in m) && s[i] != "Z") print p[i] ":" t[i]}'
)
"""Of `pid ppid pgrp state start` lines: the live processes of group `g` and
every descendant of them, as `pid:start`."""


def cancel_command(job: JobId, grace_s: float = CANCEL_GRACE_S) -> str:
    """A shell command that cancels the job's process group, when the job is
    still the process it was: writes `CANCEL_FILE`, sends SIGTERM to the group,
    waits up to `grace_s` for every process of it to end (zombies count as
    ended: a container's PID 1 may never reap them), then sends SIGKILL.

    A descendant in a session of its own (torchrun starts each worker so: a
    SIGTERM reaches them through torchrun, which may itself be killed before
    they end) is part of the job too: the job's tree is taken before the
    SIGTERM (a child loses its parent when it dies) and again before the
    SIGKILL, and each of its processes still there (the same PID and start
    time) is waited for and killed with the group.

    A job whose process is gone without an exit code (lost: its group killed
    by someone else, or its PID now another process's) may have left such a
    descendant running in its run directory, holding the machine and its GPU:
    whatever still runs there is killed at once (the job is lost, nothing of
    it is waited for), and waited for up to `LEFTOVER_WAIT_S`; no cancel
    marker is written, so the job still reads lost."""
    run_dir = shlex.quote(job.dir)
    checks = int(grace_s * 10)
    started = shlex.quote(job.started or "")
    pgid = job.pid
    return (
        f"cd {run_dir} || exit 0; [ -e {EXIT_FILE} ] && exit 0; "
        f"set -- $(sed 's/.*) //' /proc/{pgid}/stat 2>/dev/null); s=${{20:-}}; "
        f'if [ -z "$s" ] || [ "$1" = Z ] || {{ [ -n {started} ] && [ "$s" != {started} ]; }}; then '
        f"{_LEFTOVERS}; exit 0; fi; "
        "alive() { for f in /proc/[0-9]*/stat; do "
        'read -r l < "$f" 2>/dev/null || continue; r=${l##*) }; set -- $r; '
        f'[ "$3" = {pgid} ] && [ "$1" != Z ] && return 0; done; return 1; }}; '
        "tree() { for f in /proc/[0-9]*/stat; do "
        'read -r l < "$f" 2>/dev/null || continue; p=${f#/proc/}; r=${l##*) }; set -- $r; '
        'echo "${p%/stat} $2 $3 $1 ${20}"; done | '
        f"awk -v g={pgid} {shlex.quote(TREE_AWK)}; }}; "
        "still() { for e in $*; do read -r l < /proc/${e%%:*}/stat 2>/dev/null || continue; "
        'r=${l##*) }; set -- $r; [ "$1" != Z ] && [ "${20}" = "${e#*:}" ] && echo "$e"; '
        "done; }; "
        f"t=$(tree); : > {CANCEL_FILE}; kill -TERM -{pgid} 2>/dev/null; i=0; "
        f'while {{ alive || [ -n "$(still $t)" ]; }} && [ $i -lt {checks} ]; do '
        "sleep 0.1; i=$((i+1)); done; "
        f't="$t $(tree)"; kill -KILL -{pgid} 2>/dev/null; '
        'for e in $(still $t); do kill -KILL "${e%%:*}" 2>/dev/null; done; exit 0'
    )


def _alive(job: JobId, stat_line: str) -> bool:
    if not stat_line:
        return False
    try:
        pid, state, started = _parse_stat(stat_line)
    except ValueError:
        return False
    if pid != job.pid or state in ("Z", "X"):
        return False
    return job.started is None or job.started == started


def _parse_stat(stat_line: str) -> tuple[int, str, str]:
    """(pid, state, start time) of a `/proc/<pid>/stat` line. The command name
    sits in parentheses and may hold spaces, so fields are counted after the
    last `)`."""
    head, sep, tail = stat_line.strip().rpartition(")")
    if not sep:
        raise ValueError("not a /proc stat line")
    pid_text = head.split("(", 1)[0].strip()
    fields = tail.split()
    if not pid_text.isdigit() or len(fields) < 20:
        raise ValueError("not a /proc stat line")
    # fields[0] is field 3 (state); field 22 (starttime) is fields[19]
    return int(pid_text), fields[0], fields[19]


def _checked(env: Mapping[str, str]) -> Mapping[str, str]:
    for name in env:
        if not name.replace("_", "a").isalnum() or name[0].isdigit():
            raise ValueError(f"{name!r} is not a valid environment variable name")
    return env
