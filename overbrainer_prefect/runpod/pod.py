"""`runs/<id>/pod.json`: what is known of a run's pod, saved before each step
it describes (before the first create request, at every attempt, before a
delete), so that any process (a hook, `attach` on another day, the pods flow)
finds every pod of the run that may exist, and what it costs.

It never holds a secret: the pod's host key is only its public half, the
host key secret only its name.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field

from overbrainer_prefect.executors.base import JobId
from overbrainer_prefect.store import Store
from overbrainer_prefect.store.held import check_guarded
from overbrainer_prefect.store.records import StoredRecord, read_record, write_record
from overbrainer_prefect.timestamps import rfc3339

POD_RECORD = "pod.json"
"""The pod record of a run, in its local run directory (never uploaded)."""


class RecordHome(Protocol):
    """Where pod records are kept: the runs they were made for (the run store,
    `runs.store.Runs`), seen only through what a pod record needs of it."""

    @property
    def store(self) -> Store:
        """The store the runs are in."""
        ...

    def run_dir(self, run_id: str) -> Path:
        """The local run directory of `run_id`. Raises InvalidRunId when
        `run_id` is not a run ID."""
        ...

    def key(self, *parts: str) -> str:
        """The key in `store` of `parts` (a run ID, then names) of these runs."""
        ...


class PodState(StrEnum):
    """Where a run's pod stands, as last seen."""

    CREATING = "creating"
    """Create requests are being sent; a pod may exist (see `attempts`)."""
    BOOTING = "booting"
    """Created; waiting for its sshd."""
    READY = "ready"
    """Reachable with the pinned host key; its cost cap armed."""
    RUNNING = "running"
    """Its job started."""
    AWAITING_RETRIEVAL = "awaiting_retrieval"
    """Its job ended, its files not retrieved: its watchdog deletes it after the retrieve grace."""
    KEPT = "kept"
    """keep_pod: nothing deletes it but the pods flow."""
    DELETING = "deleting"
    """A delete was asked; not confirmed yet."""
    DELETED = "deleted"
    """Confirmed gone: 404s in a row, and absent from the pod list."""


class Attempt(BaseModel):
    """One create request: the unique name the pod was asked for (what it is
    looked up by after an ambiguous answer), its GPU type and what came of it."""

    model_config = ConfigDict(extra="ignore")

    name: str
    gpu_type_id: str
    at: str
    result: str = "sent"
    """`sent` (no answer yet), `created`, `no capacity`, `no access`, or why it failed."""
    pod_id: str | None = None


class SshAddress(BaseModel):
    """Where the pod's sshd answers."""

    model_config = ConfigDict(extra="ignore")

    host: str
    port: int
    user: str = "root"


class ClusterNode(BaseModel):
    """One pod of a run's instant cluster: its rank (0 is the primary, whose
    pod the record's `pod_id` names), where its sshd answers, its address on
    the cluster's private network and its run directories' directory."""

    model_config = ConfigDict(extra="ignore")

    pod_id: str
    rank: int
    ssh: SshAddress | None = None
    address: str | None = None
    workdir: str | None = None


class PodRecord(StoredRecord):
    """The record of a run's pod (`pod.json`). For a training across nodes it
    is the record of its instant cluster: `cluster_id` and its `nodes` (rank 0,
    the primary, is `pod_id`); its rate is the whole cluster's, and every
    delete deletes the cluster."""

    model_config = ConfigDict(extra="ignore", validate_assignment=True)

    run_id: str
    state: PodState = PodState.CREATING
    keep: bool = False
    gpu_count: int = 1
    billed_gpus: int | None = Field(
        default=None,
        description="The GPUs Runpod shows for the pod (`gpu.count`, 0 without GPUs): what "
        "it bills for, and what its job must see.",
    )
    attempts: list[Attempt] = Field(default_factory=list)
    strays: list[str] = Field(
        default_factory=list,
        description="Other pods of the run that may exist (names or ids): swept at its end.",
    )
    swept: list[str] = Field(
        default_factory=list,
        description="Other pods of the run found and deleted (a create answered twice).",
    )
    pod_id: str | None = None
    pod_name: str | None = None
    gpu_type_id: str | None = None
    cost_per_hour: float | None = None
    disk_per_hour: float = Field(
        default=0.0, description="What its container disk bills an hour, beside its GPUs."
    )
    created: str | None = Field(default=None, description="When the pod was asked for, RFC 3339.")
    created_unix: float | None = Field(
        default=None, description="When the pod was asked for (Unix seconds): it bills from there."
    )
    deadline: str | None = Field(default=None, description="The watchdog's max_hours deadline.")
    deadline_unix: int | None = None
    cost_deadline_unix: int | None = Field(
        default=None, description="When the watchdog's max_cost_usd is reached."
    )
    max_cost_usd: float | None = None
    boot_grace_s: float | None = Field(
        default=None,
        description="How long after it was asked for the pod may run without a job "
        "(its watchdog's boot grace, and the bound the collector and the sweep apply "
        "when its start command never ran).",
    )
    retrieve_grace_s: float | None = Field(
        default=None,
        description="How long after its job ended the pod's watchdog keeps it (and the job's "
        "files) for a retrieval: the `pods` flow says when unfollowed files are lost.",
    )
    host_key: str = Field(description="The pod's public host key, pinned.")
    host_key_secret: str | None = Field(
        default=None, description="The Runpod secret holding the host key (its name)."
    )
    secret_deleted: bool = False
    client_key_removed: bool = Field(
        default=False,
        description="Whether the run's private client key was removed (here and from its "
        "store) once no pod of it could be left.",
    )
    ssh: SshAddress | None = None
    workdir: str | None = Field(
        default=None, description="The run directories' directory on the pod."
    )
    deleted: str | None = None
    deleted_unix: float | None = Field(
        default=None,
        description="When Runpod took its delete (Unix seconds): it bills until there, not "
        "until the deletion was confirmed.",
    )
    deleted_by: str | None = Field(
        default=None,
        description="Who deleted it: `client` (the flow that followed it), `collector` (the "
        "collect flow), `watchdog` (its reason in delete_reason), `reaper` (its boot bound, "
        "nothing else alive), `pods flow`, or `unknown` (Runpod terminated it, or the console).",
    )
    delete_reason: str | None = None
    pipeline_job: str | None = Field(
        default=None,
        description="For a pod made for the jobs of a pipeline (a fine-tune): the last of them "
        "placed on it (its ID). The pod stays for the pipeline once its own job ended, bounded "
        "by its watchdog (its next-job grace between jobs): no sweep takes it for left over.",
    )
    retrieved_marked: bool = Field(
        default=False,
        description="The client wrote the `retrieved` marker on the pod: its watchdog deletes it.",
    )
    between_unix: float | None = Field(
        default=None,
        description="On a pod a pipeline shares: when the client told its watchdog that the "
        "files of its last job were verified and the next job follows (`.pod/between`); "
        "unless that job starts, the watchdog deletes the pod `next_job_grace_s` later.",
    )
    next_job_grace_s: float | None = Field(
        default=None, description="The watchdog's next-job grace, for `between_unix`."
    )
    restarted: str | None = Field(
        default=None,
        description="When its container last restarted under a job (RFC 3339, as its watchdog "
        "logged it): every process of the pod ended, the job with them.",
    )
    lost_step: int | None = Field(
        default=None,
        description="The last step the job it lost (a restart, a lost host) had logged.",
    )
    host_lost: str | None = Field(
        default=None,
        description="When the client took its host for lost and deleted it (RFC 3339): its "
        "SSH stayed silent for the timing's `lost_host_s` while Runpod showed it running.",
    )
    node_lost: str | None = Field(
        default=None,
        description="Of an instant cluster: why a node of it was lost (the follower's SSH lost "
        "its job, and Runpod showed its pod gone or not running); the job was then ended on "
        "every node and the whole cluster deleted.",
    )
    cluster_id: str | None = Field(
        default=None,
        description="The instant cluster made for a training across nodes: deleted as one "
        "(a node of it cannot be deleted alone); `pod_id` is its primary's pod.",
    )
    cluster_pods: int = Field(
        default=0,
        description="The pods its cluster was asked with (0: a pod alone); its rate and cost "
        "cap count them all.",
    )
    nodes: list[ClusterNode] = Field(
        default_factory=list, description="Its cluster's pods, by rank, once created."
    )
    node_jobs: list[JobId] = Field(
        default_factory=list,
        description="A training across the cluster's pods: each node's job, by rank, once all "
        "started.",
    )

    @classmethod
    def load(cls, runs: RecordHome, run_id: str) -> PodRecord | None:
        """The pod record of the run `run_id`, or None when it has none.

        Raises InvalidRunId, RecordIoError or InvalidRecord (with a line and
        column, never the content) when it cannot be read."""
        runs.run_dir(run_id)  # validates the ID before it names a key
        found = read_record(runs.store, runs.key(run_id, POD_RECORD), cls, "pod")
        if found is None:
            return None
        record, etag = found
        record._etag = etag
        return record

    def save(self, runs: RecordHome) -> None:
        """Writes `pod.json`: created when new, else only over the version it
        was read at. Raises RecordChanged when another process wrote it
        since, RecordIoError when it cannot be written, LeaseLost when this
        task lost the run's follow lock, before the write (nothing written)
        or while it was written: what follows a pod record's write (a create,
        a delete) is never done then."""
        runs.run_dir(self.run_id)
        check_guarded(self.run_id)
        self._etag = write_record(runs.store, runs.key(self.run_id, POD_RECORD), self, self._etag)
        check_guarded(self.run_id)  # lost while it was written: no create, no delete after it

    @property
    def name(self) -> str:
        """The pod's id, or `(none)` before it exists; a cluster's id (its pods follow)."""
        if self.cluster_id is not None:
            return f"{self.cluster_id} (cluster of {self.cluster_pods} pods)"
        return self.pod_id or "(none)"

    def owns(self, pod_id: str, cluster_id: str | None) -> bool:
        """Whether pod `pod_id` (a node of cluster `cluster_id`, if any) is this
        record's: its pod, or a node of its cluster (deleted as one)."""
        return self.pod_id == pod_id or (cluster_id is not None and self.cluster_id == cluster_id)

    @property
    def is_cluster(self) -> bool:
        """Whether this is the record of an instant cluster (asked for, or made)."""
        return self.cluster_pods > 1

    @property
    def forgotten(self) -> bool:
        """Whether the run's keys are gone: its host key secret deleted (or
        never made) and its private client key removed."""
        return (self.host_key_secret is None or self.secret_deleted) and self.client_key_removed

    @property
    def gone(self) -> bool:
        """Whether no pod of the run may be left: none was ever created (no
        attempt) or it is confirmed deleted, and no stray remains."""
        if self.strays:
            return False
        if self.pod_id is None:
            return not any(a.result in ("sent", "created") for a in self.attempts)
        return self.state == PodState.DELETED

    def begin_attempt(self, name: str, gpu_type_id: str) -> None:
        """Records a create request about to be sent."""
        self.attempts.append(Attempt(name=name, gpu_type_id=gpu_type_id, at=rfc3339()))
        self.created_unix = time.time()  # a pod bills from the request that created it
        self.created = rfc3339()

    def end_attempt(self, result: str, pod_id: str | None = None) -> None:
        """Records what came of the last create request."""
        if self.attempts:
            last = self.attempts[-1]
            self.attempts[-1] = last.model_copy(update={"result": result, "pod_id": pod_id})

    def uptime_s(self, now: float | None = None) -> float:
        """Seconds the pod has billed: from its create until its deletion (or now)."""
        if self.created_unix is None:
            return 0.0
        end = self.deleted_unix if self.deleted_unix is not None else (now or time.time())
        return max(0.0, end - self.created_unix)

    def estimated_spend(self, now: float | None = None) -> float | None:
        """What the pod cost so far (its GPUs' and its disk's rate × its uptime),
        when its rate is known."""
        if self.cost_per_hour is None:
            return None
        return (self.cost_per_hour + self.disk_per_hour) * self.uptime_s(now) / 3600

    @property
    def rate(self) -> float | None:
        """Everything the pod bills an hour, its GPUs and its container disk:
        the rate its watchdog's cost cap is armed at; None when unknown."""
        if self.cost_per_hour is None:
            return None
        return self.cost_per_hour + self.disk_per_hour

    def rate_text(self) -> str:
        """` ($0.44/h)`, its GPUs and its disk (the rate its cost cap is armed
        at), or nothing when the rate is unknown."""
        return "" if self.rate is None else f" (${self.rate:.2f}/h)"

    def mark_deleted(self, by: str, reason: str, at: float | None = None) -> None:
        """Records the pod confirmed gone, deleted by `by` for `reason` at `at`
        (Unix seconds: when Runpod took the delete; now when not known)."""
        self.state = PodState.DELETED
        if self.deleted_unix is None:
            self.deleted_unix = at if at is not None else time.time()
            self.deleted = rfc3339(datetime.fromtimestamp(self.deleted_unix, UTC))
        self.deleted_by = by
        self.delete_reason = reason
        if self.pod_id is not None:
            self.strays = [s for s in self.strays if s != self.pod_id]

    def past_boot_bound(self, now: float | None = None) -> bool:
        """Whether the pod was asked for longer ago than its boot grace: one
        that has no job by then will never run one."""
        if self.created_unix is None or self.boot_grace_s is None:
            return False
        return (now or time.time()) >= self.created_unix + self.boot_grace_s

    @property
    def watchdog_shown(self) -> bool:
        """Whether the pod's watchdog has shown it runs (it confirmed the cost
        cap, so the pod reached `ready`)."""
        return self.deadline_unix is not None or self.state in (
            PodState.READY,
            PodState.RUNNING,
            PodState.AWAITING_RETRIEVAL,
        )

    def limit_reached(self, now: float | None = None) -> str | None:
        """Why the watchdog deleted this pod when it is found gone at `now`:
        max_cost_usd or max_hours once one passed (the earlier), else None."""
        at = now or time.time()
        if self.keep:
            return None
        cost = self.cost_deadline_unix
        hours = self.deadline_unix
        if cost is not None and at >= cost and (hours is None or cost <= hours):
            return max_cost_reached(self.max_cost_usd, self.rate)
        if hours is not None and at >= hours:
            return MAX_HOURS_REACHED
        if cost is not None and at >= cost:
            return max_cost_reached(self.max_cost_usd, self.rate)
        return None


MAX_HOURS_REACHED = "max_hours reached: the pod was deleted before the job ended"
"""Why a run fails when its pod was deleted on max_hours, by the client's own
guard or by the pod's watchdog."""


def max_cost_reached(max_cost_usd: float | None, rate: float | None) -> str:
    """Why a run fails when its pod's watchdog deleted it on max_cost_usd."""
    cap = usd(max_cost_usd) if max_cost_usd is not None else "its cap"
    at = f" at {usd(rate)}/h" if rate is not None else ""
    return f"max_cost_usd reached ({cap}{at}): the pod was deleted before the job ended"


def usd(amount: float) -> str:
    """`$0.44`, or `$0.0025` below a cent."""
    return f"${amount:.2f}" if amount >= 0.01 or amount == 0 else f"${amount:.2g}"
