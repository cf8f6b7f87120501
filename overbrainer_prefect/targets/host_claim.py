"""A run's claim on one machine of a pool, decided on the machine itself.

A machine holds at most one job of this product: its work directory keeps a
lease (`.overbrainer-host.lease`: the run, its run directory, when it was
claimed), read and written only under `flock` on `.overbrainer-host.lock`
there, so two workers on two machines that claim the same box at the same
moment are served one after the other by its kernel: one takes it, the other
finds it held.

A machine where a job of this product runs in the work directory (a run
directory whose wrapper runs, started by any target) is held too. A lease
held by another run is taken over only when that run holds nothing any
more, as the machine shows it: its job ended (its exit or cancel file is
written), its job is gone (its wrapper was written but no process runs in
its run directory: the box rebooted, the job was killed), or it never
started a job within `claim_s` of its claim (its orchestrator died while
placing it).
A run's own lease is given back (`release`) when its files are retrieved or
it ends; a dead orchestrator's lease is thus bounded by its job's own life.
"""

from __future__ import annotations

from dataclasses import dataclass

from overbrainer_prefect.executors.base import (
    CANCEL_FILE,
    EXIT_FILE,
    CommandResult,
    ExecError,
    Executor,
)
from overbrainer_prefect.executors.jobscript import JOB_SCRIPT

LEASE_FILE = ".overbrainer-host.lease"
"""In a pool machine's work directory: which run holds the machine."""
LOCK_FILE = ".overbrainer-host.lock"
"""In a pool machine's work directory: the `flock` that serializes claims."""
CLAIM_S = 3600.0  # a claim whose job has not started after this is free: an upload takes less
GUARD_WAIT_S = 20  # seconds a claim waits for another claim's look at the same machine
COMMAND_S = 60.0  # seconds a claim or a release may take over SSH

_CLAIM = f"""
w=$1 run=$2 dir=$3 grace=$4
mkdir -p "$w" 2>/dev/null || {{ echo "error: cannot create its work directory $w"; exit 3; }}
command -v flock >/dev/null 2>&1 || {{ echo "error: flock is not installed (util-linux)"; exit 3; }}
if [ -n "$run" ]; then  # a claim; a look (no run) takes no lock and writes nothing
  exec 9>>"$w/{LOCK_FILE}" || {{ echo "error: cannot write $w/{LOCK_FILE}"; exit 3; }}
  flock -w {GUARD_WAIT_S} 9 || {{ echo "held: by a claim still under way"; exit 1; }}
fi
lease="$w/{LEASE_FILE}"
now=$(date +%s) hrun= hdir= hat=0 was=
if [ -f "$lease" ]; then
  while IFS= read -r line; do
    case $line in
      run=*) hrun=${{line#run=}};; dir=*) hdir=${{line#dir=}};; at=*) hat=${{line#at=}};;
    esac
  done < "$lease"
fi
if [ -n "$hrun" ] && [ "$hrun" != "$run" ]; then
  if [ -n "$hdir" ] && [ -e "$hdir/{JOB_SCRIPT}" ]; then
    real=$(cd "$hdir" && pwd -P)  # what /proc shows as a job's working directory
    if [ -e "$hdir/{EXIT_FILE}" ] || [ -e "$hdir/{CANCEL_FILE}" ]; then was="its job ended"
    elif [ -z "$run" ]; then echo "held: by run $hrun, whose job may run there"; exit 1
    elif ls -l /proc/[0-9]*/cwd 2>/dev/null | sed -n 's/^.* -> //p' | grep -qxF -- "$real"; then
      echo "held: by run $hrun, whose job runs there"; exit 1
    else was="its job is gone"
    fi
  else
    case $hat in ''|*[!0-9]*) hat=0;; esac
    if [ $((now - hat)) -lt "$grace" ]; then
      echo "held: by run $hrun, placed there $((now - hat)) s ago"; exit 1
    fi
    was="no job started within $grace s of its claim"
  fi
fi
[ -n "$run" ] || {{ echo "free:"; exit 0; }}  # a look only: nothing written
realw=$(cd "$w" && pwd -P)  # a job of this product started otherwise (an SSH target) holds it too
other=$(ls -l /proc/[0-9]*/cwd 2>/dev/null | sed -n 's/^.* -> //p' | while IFS= read -r d; do
  name=${{d#"$realw"/}}
  case $name in "$d"|*/*|'') continue;; esac
  [ -e "$realw/$name/{JOB_SCRIPT}" ] && [ ! -e "$realw/$name/{EXIT_FILE}" ] \
    && [ ! -e "$realw/$name/{CANCEL_FILE}" ] && {{ echo "$name"; break; }}
done)
if [ -n "$other" ]; then echo "held: by the job of run $other, which runs there"; exit 1; fi
printf 'run=%s\\ndir=%s\\nat=%s\\n' "$run" "$dir" "$now" > "$lease.tmp" \\
  && mv -f "$lease.tmp" "$lease" || {{ echo "error: cannot write $lease"; exit 3; }}
if [ -n "$was" ]; then echo "taken: from run $hrun ($was)"; else echo "taken:"; fi
"""

_RELEASE = f"""
w=$1 run=$2 lease="$1/{LEASE_FILE}"
[ -f "$lease" ] || {{ echo "free:"; exit 0; }}
exec 9>>"$w/{LOCK_FILE}" || {{ echo "error: cannot write $w/{LOCK_FILE}"; exit 3; }}
flock -w {GUARD_WAIT_S} 9 || {{ echo "error: a claim still under way"; exit 3; }}
if grep -qxF -- "run=$run" "$lease" 2>/dev/null; then rm -f "$lease" && echo "released:"; exit 0; fi
echo "other:"
"""

_HOLDER = f"""
lease="$1/{LEASE_FILE}"
[ -f "$lease" ] && sed -n 's/^run=//p' "$lease"; exit 0
"""


@dataclass(frozen=True)
class Claim:
    """What a claim found: whether the run now holds the machine, and why
    (`held by run R, whose job runs there`, or, taken over, `from run R
    (its job ended)`; empty when the machine was free)."""

    taken: bool
    why: str = ""


async def claim(
    executor: Executor, workdir: str, run_id: str, run_dir: str, claim_s: float = CLAIM_S
) -> Claim:
    """Claims the machine of `executor` for the run `run_id` (its run
    directory `run_dir`), atomically on the machine (see the module): taken
    when it was free, already this run's, or held by a run that holds nothing
    any more; not taken, with the holder, otherwise.

    Raises ExecError (`claim`) when the machine cannot keep a lease (no
    `flock`, a work directory it cannot write); TargetUnreachable when it
    does not answer.
    """
    result = await executor.run(
        ["sh", "-c", _CLAIM, "sh", workdir, run_id, run_dir, str(int(claim_s))], timeout=COMMAND_S
    )
    word, why = _answer(result, "claim")
    return Claim(taken=word == "taken", why=why if word == "taken" else f"held {why}")


async def is_free(executor: Executor, workdir: str, claim_s: float = CLAIM_S) -> Claim:
    """Whether a claim on the machine of `executor` would be taken now (a
    quick look: no lock taken, nothing written, and a job started is taken
    to run without looking for its processes; the answer may be stale at
    once). `taken` says it would; `why` who holds it otherwise.

    Raises ExecError (`claim`) when the machine cannot keep a lease;
    TargetUnreachable when it does not answer.
    """
    result = await executor.run(
        ["sh", "-c", _CLAIM, "sh", workdir, "", "", str(int(claim_s))], timeout=COMMAND_S
    )
    word, why = _answer(result, "claim")
    return Claim(taken=word in ("taken", "free"), why=why if word != "held" else f"held {why}")


async def release(executor: Executor, workdir: str, run_id: str) -> bool:
    """Gives back the machine of `executor` when the run `run_id` holds it.
    Returns whether its lease is gone (it was this run's, or there was none);
    False when another run holds the machine now.

    Raises ExecError (`release`) when the lease cannot be removed;
    TargetUnreachable when the machine does not answer.
    """
    result = await executor.run(["sh", "-c", _RELEASE, "sh", workdir, run_id], timeout=COMMAND_S)
    word, _ = _answer(result, "release")
    return word != "other"


async def holder(executor: Executor, workdir: str) -> str | None:
    """The run whose lease the machine of `executor` keeps, None when none
    does (whether or not that run still holds anything). Raises ExecError,
    TargetUnreachable when the machine does not answer."""
    result = await executor.run(["sh", "-c", _HOLDER, "sh", workdir], timeout=COMMAND_S)
    found = result.stdout.strip()
    return found or None


def _answer(result: CommandResult, action: str) -> tuple[str, str]:
    lines = result.stdout.strip().splitlines()
    word, _, why = (lines[-1] if lines else "").partition(":")
    if word == "error" or word not in ("taken", "held", "released", "free", "other"):
        detail = why.strip() or (result.stderr.strip().splitlines() or [f"exit {result.code}"])[-1]
        raise ExecError(action, f"the machine cannot keep its lease: {detail}")
    return word, why.strip()
