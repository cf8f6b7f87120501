"""The pods of the account that are ours (named `ob-<run id>-a<n>`), what
each costs, and which of them are orphans: pods whose run is not in this runs
directory, or has ended. A pod whose job's files nobody follows (its job runs
with no follower, or ended unretrieved) is told with when its watchdog deletes
it with those files, and the command that saves them. Nothing here deletes a
pod; the host key secrets of runs whose pods are all gone are swept.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime

from overbrainer_prefect.runpod.client import RunpodClient
from overbrainer_prefect.runpod.errors import RunpodError
from overbrainer_prefect.runpod.models import Pod
from overbrainer_prefect.runpod.pod import PodRecord
from overbrainer_prefect.runs.lock import is_followed
from overbrainer_prefect.runs.manifest import has_manifest
from overbrainer_prefect.runs.store import RunRecord, Runs, RunsError, follow_again, subject
from overbrainer_prefect.store.records import RecordError
from overbrainer_prefect.targets.runpod.keys import HOST_KEY_SECRET_PREFIX
from overbrainer_prefect.targets.runpod.names import run_of_pod_name
from overbrainer_prefect.timestamps import parse_rfc3339, rfc3339


@dataclass(frozen=True)
class PodRow:
    """One pod of ours as the pods flow lists it."""

    pod_id: str
    name: str
    run_id: str
    status: str
    run_state: str
    """The run's state here, or `not here`."""
    gpu: str
    rate: float | None
    uptime_s: float
    estimated_spend: float | None
    orphan: bool
    why: str
    """Why it is an orphan, or what bounds it."""
    owner: str = ""
    """How messages name what the pod ran: `run R`, or `export E of run R`."""
    retrieved: bool = False
    """Its run has ended with every file retrieved and verified here, or its job
    never started within boot grace and nothing follows it; the pod is not
    kept: nothing is lost by deleting it (the sweep does)."""
    files_lost_at: float | None = None
    """When its watchdog deletes it with files nobody retrieved (Unix seconds),
    when it holds such files and that time is known."""
    save_with: str = ""
    cluster_id: str | None = None
    """The instant cluster it is a node of: deleted only with it."""
    """The command that saves the files its pod holds before they are lost,
    when nobody follows its job; empty otherwise."""

    @property
    def unfollowed(self) -> bool:
        """Whether its pod holds files of a job that nobody follows."""
        return bool(self.save_with)

    def line(self) -> str:
        """The row as one line of text."""
        rate = f"${self.rate:.2f}/h" if self.rate is not None else "$?/h"
        spend = f"~${self.estimated_spend:.2f}" if self.estimated_spend is not None else "~$?"
        flag = "ORPHAN" if self.orphan else "UNFOLLOWED" if self.unfollowed else "ok"
        save = f"; save them with {self.save_with}" if self.save_with else ""
        return (
            f"{self.pod_id}  {self.owner or 'run ' + self.run_id}  {self.status}/{self.run_state}  "
            f"{self.gpu}  "
            f"{rate}  up {self.uptime_s / 3600:.2f} h  {spend}  {flag}: {self.why}{save}"
        )


async def pod_rows(client: RunpodClient, runs: Runs) -> list[PodRow]:
    """Every pod of the account named like ours, with its run's state here and
    whether it is an orphan. Raises RunpodError when the pods cannot be listed."""
    rows = []
    now = time.time()
    for pod in await client.list_pods():
        run_id = run_of_pod_name(pod.name)
        if run_id is None or pod.status == "TERMINATED":
            continue
        rows.append(_row(pod, run_id, runs, now))
    return rows


def _row(pod: Pod, run_id: str, runs: Runs, now: float) -> PodRow:
    record = None
    local: PodRecord | None = None
    retrieved = False
    store = runs
    try:
        found = runs.find(run_id)
        if found is not None:
            store, record = found
            local = PodRecord.load(store, run_id)
            retrieved = _retrieved(store, record) and not (local is not None and local.keep)
    except (RunsError, RecordError):
        pass
    started = _unix(pod.created_at) or (local.created_unix if local else None)
    uptime = max(0.0, now - started) if started else 0.0
    rate = pod.cost_per_hr if pod.cost_per_hr else (local.cost_per_hour if local else None)
    spend = rate * uptime / 3600 if rate is not None else None
    lost_at: float | None = None
    save_with = ""
    if record is None:
        orphan, why, state = True, "its run is not in this runs directory", "not here"
    else:
        state = str(record.state)
        kept = local is not None and local.keep
        if record.state.ended and local is not None and local.pipeline_job and not local.gone:
            orphan, retrieved = False, False
            why = (
                f"runs the jobs of its pipeline (the last placed: {local.pipeline_job}); bounded "
                "by its watchdog, which deletes it when no next job starts within its grace"
            )
            if local.between_unix is not None and local.next_job_grace_s is not None:
                at = datetime.fromtimestamp(local.between_unix + local.next_job_grace_s, UTC)
                why += f" (next_job_grace: at {rfc3339(at)}, unless the next job starts)"
        elif record.state.ended:
            orphan = True
            deleted_at = _ended_plus_grace(record, local)
            why = f"its run has ended ({record.state})" + (
                "; kept (keep_pod)"
                if kept
                else "; its files are retrieved and verified: the sweep deletes it"
                if retrieved
                else "; its files were not retrieved: its watchdog deletes it with them "
                + _unretrieved_end(deleted_at, local, now)
            )
            if not kept and not retrieved and record.job is not None:
                lost_at = deleted_at
                save_with = _save_with(record)
        elif kept:
            orphan, why = False, "kept (keep_pod)"
        elif record.job is None and local is not None and local.past_boot_bound(now):
            orphan = True
            retrieved = not is_followed(store, record.id)
            why = "its job never started within boot_grace of its create: " + (
                "the sweep deletes it" if retrieved else "its follower is still there"
            )
        elif local is not None and local.watchdog_shown:
            orphan = False
            if record.job is None:
                why = "bounded by its watchdog (its job has not started)"
            elif is_followed(store, record.id):
                why = "followed; bounded by its watchdog"
            else:
                lost_at = _deadline(local)
                why = _unfollowed_why(local, lost_at, now)
                save_with = _save_with(record)
        else:
            orphan = False
            why = (
                "starting: its watchdog has not shown it runs yet; the collector or the sweep "
                "deletes it once boot_grace has passed without a job"
            )
    return PodRow(
        pod_id=pod.id,
        name=pod.name,
        run_id=run_id,
        status=pod.status,
        run_state=state,
        gpu=pod.gpu_type_id or (local.gpu_type_id if local and local.gpu_type_id else "?"),
        rate=rate,
        uptime_s=uptime,
        estimated_spend=spend,
        orphan=orphan,
        why=why,
        owner=subject(record) if record is not None else f"run {run_id}",
        retrieved=retrieved,
        files_lost_at=lost_at,
        save_with=save_with,
        cluster_id=pod.cluster_id,
    )


def _save_with(record: RunRecord) -> str:
    """The commands that retrieve the files of `record`'s job nobody follows."""
    return f"the collect flow (its deployment, or `collect()`), or {follow_again(record)}"


def _when(unix: float, now: float) -> str:
    """`2026-12-02T11:40:00Z (in 52 min)`, or `(… ago)` for a past time."""
    left = unix - now
    span = abs(left)
    amount = f"{span / 3600:.1f} h" if span >= 5400 else f"{max(1, round(span / 60))} min"
    relative = f"in {amount}" if left >= 0 else f"{amount} ago"
    return f"{rfc3339(datetime.fromtimestamp(unix, UTC))} ({relative})"


def _grace(local: PodRecord | None) -> str:
    """`retrieve_grace (1 h)`, with its length when `pod.json` has it."""
    if local is None or local.retrieve_grace_s is None:
        return "retrieve_grace"
    seconds = local.retrieve_grace_s
    length = f"{seconds / 3600:g} h" if seconds >= 3600 else f"{seconds:g} s"
    return f"retrieve_grace ({length})"


def _deadline(local: PodRecord) -> float | None:
    """The earlier of the watchdog's max_hours and max_cost_usd deadlines
    (Unix seconds): a job nobody follows renews no lease, so it applies."""
    ends = [t for t in (local.deadline_unix, local.cost_deadline_unix) if t is not None]
    return float(min(ends)) if ends else None


def _unfollowed_why(local: PodRecord, deadline: float | None, now: float) -> str:
    """What becomes of the files of a job that runs with nobody following it."""
    bound = ""
    if deadline is not None:
        which = (
            "max_cost_usd"
            if local.cost_deadline_unix is not None
            and (local.deadline_unix is None or local.cost_deadline_unix <= local.deadline_unix)
            else "max_hours"
        )
        bound = f", and with its job at {which}: {_when(deadline, now)}"
    return (
        "its job runs with nobody following it: its watchdog deletes the pod with the job's "
        f"files {_grace(local)} after the job ends{bound}"
    )


def _ended_plus_grace(record: RunRecord, local: PodRecord | None) -> float | None:
    """When the watchdog deletes the pod of an ended, unretrieved run: about its
    end (as seen here) plus its retrieve grace; None when either is unknown."""
    if record.ended is None or local is None or local.retrieve_grace_s is None:
        return None
    try:
        return parse_rfc3339(record.ended).timestamp() + local.retrieve_grace_s
    except ValueError:
        return None


def _unretrieved_end(at: float | None, local: PodRecord | None, now: float) -> str:
    """When (`at`, from `_ended_plus_grace`) the watchdog deletes the pod of an
    ended run whose files were not retrieved, in words."""
    if at is None:
        return f"{_grace(local)} after its job ended"
    return f"at about {_when(at, now)}, {_grace(local)} after its job ended"


def _retrieved(store: Runs, record: RunRecord) -> bool:
    """Whether an ended run's pod holds nothing that is not here."""
    return record.state.ended and files_here(store, record)


def files_here(store: Runs, record: RunRecord) -> bool:
    """Whether the run's pod holds nothing of its job that is not here: its job
    never started, or its files were retrieved and verified (its manifest is
    here, and no `not_retrieved` reason since)."""
    if record.job is None:
        return True
    return record.not_retrieved is None and has_manifest(store, record.id)


def orphan_warnings(rows: list[PodRow]) -> list[str]:
    """One warning per orphan, and per pod whose job's files nobody follows:
    what it costs, why, and the command that saves its files (when it holds
    some nobody retrieved) or removes it."""
    warnings = []
    for row in rows:
        if not row.orphan and not row.unfollowed:
            continue
        rate = f" (${row.rate:.2f}/h" if row.rate is not None else " ($?/h"
        spend = (
            f", up {row.uptime_s / 3600:.1f} h, about ${row.estimated_spend:.2f} spent)"
            if (row.estimated_spend is not None)
            else ")"
        )
        remove = f"remove it with the pods flow (action=remove, run_id={row.run_id})"
        if row.unfollowed:
            then = f"save its files with {row.save_with}" + (
                f"; or, to lose them, {remove}" if row.orphan else ""
            )
        else:
            then = remove
        what = "is an orphan" if row.orphan else "holds a job nobody follows"
        warnings.append(
            f"pod {row.pod_id} of {row.owner or 'run ' + row.run_id}{rate}{spend} {what}: "
            f"{row.why}; {then}"
        )
    return warnings


async def sweep_host_keys(client: RunpodClient, runs: Runs, rows: list[PodRow]) -> list[str]:
    """Deletes the host key secrets of runs here whose pods are all gone
    (`pod.json` says so and the account shows none); a secret of a run not
    here is only warned about (its pod may be booting for another machine).
    Returns the warnings. Raises RunpodError when the secrets cannot be listed."""
    alive = {row.run_id for row in rows}
    warnings = []
    for secret in await client.list_secrets():
        if not secret.name.startswith(HOST_KEY_SECRET_PREFIX):
            continue
        run_id = secret.name[len(HOST_KEY_SECRET_PREFIX) :]
        if run_id in alive:
            continue
        try:
            found = runs.find(run_id)
            store = found[0] if found is not None else runs
            local = PodRecord.load(store, run_id) if found is not None else None
        except (RunsError, RecordError):
            local, store = None, runs
        if local is None:
            warnings.append(
                f"the Runpod secret {secret.name} belongs to run {run_id}, which is not here: "
                "delete it in the Runpod console once that run has no pod"
            )
            continue
        if not local.gone:
            continue
        try:
            await client.delete_secret(secret.name)
            local.secret_deleted = True
            local.save(store)
        except RunpodError as error:
            warnings.append(f"cannot delete the Runpod secret {secret.name}: {error}")
    return warnings


def _unix(text: str | None) -> float | None:
    """Unix seconds of a Runpod time (`2026-08-20T06:16:19Z`, or v1's
    `2026-08-20 06:16:19.436 +0000 UTC`); None when it cannot be read."""
    if not text:
        return None
    value = text.strip().replace(" UTC", "")
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        pass
    for form in ("%Y-%m-%d %H:%M:%S.%f %z", "%Y-%m-%d %H:%M:%S %z"):
        try:
            return datetime.strptime(value, form).timestamp()
        except ValueError:
            continue
    return None
