"""Who ended a pod that this process did not delete, and when: told from
what the pod left here (the copy of its watchdog's log in
`runs/<id>/.pod/watchdog.log`, the `retrieved` marker this client wrote on
it) and from the bounds its watchdog armed, so that `pod.json`'s
`deleted_by`, `delete_reason` and uptime say what happened, not "unknown".
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from overbrainer_prefect.runpod.bootstrap import WATCHDOG_LOG
from overbrainer_prefect.runpod.models import Pod
from overbrainer_prefect.runpod.pod import PodRecord, PodState
from overbrainer_prefect.runs.store import Runs, RunsError
from overbrainer_prefect.store.records import RecordError
from overbrainer_prefect.timestamps import parse_rfc3339

RETRIEVED_REASON = "the client retrieved and verified the run's files (.pod/retrieved)"
"""Why the watchdog deletes a pod at once once the client marked its files retrieved."""

_RESTARTED = re.compile(r"^(\S+) container: restarted(; the job it ran was lost[^:]*(?:: (.+))?)?$")
_DECISION = re.compile(r"^(\S+) decision: delete pod \S+: (.*)$")
_DELETED = re.compile(r"^(\S+) deleted: .*?(?:\[at=([0-9.]+)\])?$")


@dataclass(frozen=True)
class Fate:
    """Who deleted a pod (`client`, `watchdog`, or `unknown`), why, and when
    (Unix seconds, None when not known)."""

    by: str
    reason: str
    at: float | None = None


def watchdog_deletion(runs: Runs, run_id: str) -> Fate | None:
    """The deletion the pod's watchdog logged, from the local copy of its log:
    its reason and the time Runpod answered its delete; None when the copy
    shows no decision to delete."""
    reason: str | None = None
    at: float | None = None
    for line in _watchdog_log_lines(runs, run_id):
        decided = _DECISION.match(line)
        if decided:
            reason, at = decided[2], _unix(decided[1])
            continue
        done = _DELETED.match(line)
        if done and reason is not None:
            at = float(done[2]) if done[2] else _unix(done[1])
    return Fate("watchdog", reason, at) if reason is not None else None


def _watchdog_log_lines(runs: Runs, run_id: str) -> list[str]:
    """The lines of the stored copy of the run's watchdog log; none when it
    cannot be read (not copied yet)."""
    try:
        return runs.read_text(run_id, WATCHDOG_LOG).splitlines()
    except (OSError, RecordError):
        return []


def found_gone(
    runs: Runs, pod: PodRecord, now: float | None = None, *, unfollowed: bool = False
) -> Fate:
    """Who deleted a pod found gone (at `now`) without this process deleting
    it: its watchdog when the client had marked its files retrieved, when its
    log (the local copy) says so, or when one of the bounds it was armed with
    had passed (max_cost_usd, max_hours, next_job_grace, retrieve_grace,
    boot_grace: see `bound_passed`), at the time its log gives or the bound's;
    else nobody known (Runpod, or someone in the console). A pod whose job
    nobody followed for a while (`unfollowed`: reached again by a collect or an
    attach) may also have been deleted by its watchdog once that job ended
    unseen: the reason says both."""
    at_now = time.time() if now is None else now
    logged = watchdog_deletion(runs, pod.run_id)
    at = logged.at if logged is not None else None
    if pod.retrieved_marked:
        return Fate("watchdog", RETRIEVED_REASON, at)
    limit = pod.limit_reached(at_now)
    if limit is not None:
        return Fate("watchdog", limit, at)
    if logged is not None:
        return logged
    bound = bound_passed(runs, pod, at_now)
    if bound is not None:
        return bound
    if unfollowed and pod.state == PodState.RUNNING and pod.retrieve_grace_s is not None:
        return Fate("unknown", unseen_end_reason(pod))
    return Fate("unknown", terminated_reason(pod))


def unseen_end_reason(pod: PodRecord) -> str:
    """Why a pod is gone whose running job nobody followed, none of its other
    bounds passed: its job ended unseen and its watchdog's retrieve_grace
    passed, or Runpod terminated it (nothing here tells which)."""
    return (
        f"pod {pod.name} is gone while nobody followed its job, before its max_hours: its job "
        f"ended and its watchdog deleted it retrieve_grace ({pod.retrieve_grace_s:.0f}s) later "
        "with its files not retrieved, or Runpod terminated it (the account's balance ran out, "
        "its host was lost); what was on it is lost. Start the run again with the train flow"
    )


def next_job_reason(grace_s: float) -> str:
    """Why a watchdog deleted a pod between two jobs of a pipeline (its words)."""
    return (
        f"no next job of the pipeline started within next_job_grace ({grace_s:.0f}s after the "
        "files of its last job were verified)"
    )


def bound_passed(runs: Runs, pod: PodRecord, now: float) -> Fate | None:
    """The bound past which the pod's watchdog deletes it that had passed at
    `now`, told from `pod.json` and its run's record (for a pod whose
    watchdog's last words were not copied here: its follower died first):
    next_job_grace once the client told it the pipeline's next job follows,
    retrieve_grace after its job ended with files not retrieved, boot_grace
    while no job had started. The time is the bound's (its watchdog deletes
    it at its next look). None when none had passed."""
    if pod.keep:
        return None
    if pod.between_unix is not None and pod.next_job_grace_s is not None:
        bound = pod.between_unix + pod.next_job_grace_s
        if now >= bound:
            return Fate("watchdog", next_job_reason(pod.next_job_grace_s), bound)
        return None
    if pod.state == PodState.AWAITING_RETRIEVAL and pod.retrieve_grace_s is not None:
        ended = _ended_unix(runs, pod.run_id)
        if ended is not None and now >= ended + pod.retrieve_grace_s:
            grace = f"{pod.retrieve_grace_s:.0f}s"
            reason = f"the job ended {grace} ago and its files were not retrieved (retrieve_grace)"
            return Fate("watchdog", reason, ended + pod.retrieve_grace_s)
        return None
    if pod.state in NO_JOB_YET and pod.past_boot_bound(now) and pod.boot_grace_s is not None:
        reason = (
            f"no job started within boot_grace ({pod.boot_grace_s:.0f}s after the pod was created)"
        )
        return Fate("watchdog", reason, (pod.created_unix or now) + pod.boot_grace_s)
    return None


NO_JOB_YET = (PodState.CREATING, PodState.BOOTING, PodState.READY)
"""States of a pod on which no job has started (a pipeline's pod between jobs
has `between_unix`)."""


def _ended_unix(runs: Runs, run_id: str) -> float | None:
    """When the run `run_id` was seen ending (Unix seconds), if it was."""
    try:
        ended = runs.load(run_id).ended
    except (RunsError, RecordError):
        return None
    return _unix(ended) if ended else None


def terminated_reason(pod: PodRecord) -> str:
    """Why a pod is gone that neither this client nor its watchdog deleted
    (none of its bounds had passed): Runpod terminated it, or someone did."""
    return (
        f"pod {pod.name} is gone, deleted neither by this client nor by its watchdog (none of "
        "its bounds had passed): Runpod terminated it (the account's balance ran out, its host "
        "was lost) or someone deleted it in the console; what was on it is lost. Check the "
        "account's balance, then start the run again"
    )


def _unix(stamp: str) -> float | None:
    try:
        return parse_rfc3339(stamp).timestamp()
    except ValueError:
        return None


@dataclass(frozen=True)
class Restart:
    """The pod's container restarted at `at` (RFC 3339, as its watchdog logged
    it); `lost_job`: a job was running, and was lost with it (its run
    directory on the pod: `job_dir`, when the log names it)."""

    at: str
    lost_job: bool
    job_dir: str | None = None


def restarts_in(lines: list[str]) -> list[Restart]:
    """The restarts of the pod's container its watchdog logged in `lines`."""
    found = []
    for line in lines:
        match = _RESTARTED.match(line)
        if match:
            found.append(Restart(match[1], bool(match[2]), match[3] or None))
    return found


def container_restart(runs: Runs, run_id: str) -> Restart | None:
    """The last restart of the pod's container its watchdog logged (the local
    copy of its log), or None."""
    found = restarts_in(_watchdog_log_lines(runs, run_id))
    return found[-1] if found else None


def lost_to_restart(lines: list[str], job_dir: str, only_job: bool) -> Restart | None:
    """The restart of the pod's container (its watchdog's log `lines`) that
    lost the job in `job_dir` on the pod; a log that does not name the job
    counts on a pod that ran `only_job`. None when no restart lost it."""
    for restart in reversed(restarts_in(lines)):
        if restart.lost_job and (restart.job_dir == job_dir or (only_job and not restart.job_dir)):
            return restart
    return None


def lost_step_text(step: int | None) -> str:
    """`at step N`, or `before its first step` when the job logged none."""
    return f"at step {step}" if step is not None else "before its first step"


def restart_lost_message(
    pod_name: str, restart: Restart, what: str, step: int | None, retrieved: bool, again: str
) -> str:
    """Why a job lost to a restart of its pod's container failed (the run
    record's message): when, at which step, whether what it left was
    retrieved, and what to run next (`again`)."""
    left = "what it left was retrieved" if retrieved else "what it left could not be retrieved"
    return (
        f"the container of pod {pod_name} restarted at {restart.at} (its host, or Runpod's "
        f"restart action) and the job of {what} was lost with it {lost_step_text(step)}; {left}. "
        f"Start it again with {again}"
    )


def restart_message(pod: PodRecord, what: str, restart: Restart) -> str:
    """The warning of a pod whose container restarted under a job (`what`:
    the job's subject) as the pod is ended."""
    lost = (
        f"the job of {what} was lost with it {lost_step_text(pod.lost_step)}"
        if restart.lost_job
        else "no job ran then"
    )
    return (
        f"the container of pod {pod.name} restarted at {restart.at} (its host, or Runpod's "
        f"restart action): {lost}; what it left was retrieved, and the pod is deleted"
    )


RESTART_REASON = "its container restarted and lost its job"
"""Why a pod is deleted after its container restarted under its job (the
start of `restart_reason`)."""


def restart_reason(restart: Restart, step: int | None) -> str:
    """Why a pod is deleted after its container restarted under its job."""
    return (
        f"{RESTART_REASON} (at {restart.at}, {lost_step_text(step)}); what the job left was "
        "retrieved"
    )


STALLED_SHARE = 0.5  # a runtime that went on for less than this share of the wall clock stalled


def runpod_agrees(first: Pod, last: Pod, elapsed_s: float) -> str | None:
    """Why Runpod's own view of a pod whose SSH stayed silent `elapsed_s`
    seconds (looked up at the start, `first`, and at the end, `last`) agrees
    that its host is lost: the pod not RUNNING, no runtime shown, its
    container started again, or its uptime stalled (it went on for less than
    STALLED_SHARE of the wall clock). None when Runpod shows its container
    running on: the silence is this side's."""
    if last.status != "RUNNING":
        return f"Runpod shows it {last.status}"
    if last.uptime_s is None:
        return "Runpod shows no runtime for it"
    if first.uptime_s is None:
        return None  # nothing to compare yet: its runtime shows now
    went_on = last.uptime_s - first.uptime_s
    if went_on < 0:
        return "Runpod shows its container started again"
    if went_on < STALLED_SHARE * elapsed_s:
        return f"Runpod's runtime of it stalled ({went_on:.0f} s of uptime in {elapsed_s:.0f} s)"
    return None
