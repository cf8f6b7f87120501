"""What a pod is started with: the bootstrap + watchdog script (`bootstrap.sh`,
shipped in this package), the start command that runs it, and the
environment that sets its bounds; where its files are in the run directory on
the pod; and how long the client and the watchdog wait for each other.

The script is the pod's start command. It needs nothing from the image but
POSIX sh, coreutils, awk, sshd, and curl or python3; see its header for what
it does.
"""

from __future__ import annotations

import base64
import gzip
import math
import os
from dataclasses import dataclass, fields, replace
from importlib import resources

from overbrainer_prefect.runpod.settings import RunpodTargetSettings

SCRIPT = "bootstrap.sh"
"""The bootstrap + watchdog script, next to this module."""

BOOTSTRAP_ENV = "OVERBRAINER_BOOTSTRAP"
"""The pod's environment variable holding the script (gzip, then base64: about
7 kB), which the start command runs."""

POD_DIR = ".pod"
"""The watchdog's directory in a run directory on the pod."""

WATCHDOG_LOG = f"{POD_DIR}/watchdog.log"
"""The watchdog's log: every decision with its reason."""

LEASE_FILE = f"{POD_DIR}/lease"
"""Touched by the client that follows a progressing job: while it was touched
less than the lease TTL ago, max_hours deletes nothing."""

RETRIEVED_MARKER = f"{POD_DIR}/retrieved"
"""Written by the client once every file of the run was retrieved and verified:
the watchdog then deletes the pod at once."""

CAP_FILE = f"{POD_DIR}/cap"
"""Written by the client before the job starts: the pod's rate and max_cost_usd."""

JOB_FILE = f"{POD_DIR}/job"
"""On a pod a pipeline shares: the run directory of the job the watchdog watches
(written by the client before each job after the pod's first)."""

BETWEEN_MARKER = f"{POD_DIR}/between"
"""On a pod a pipeline shares: written by the client once a job's files were
retrieved and verified and the pod stays for the pipeline's next job (it holds
that job's run directory); the watchdog deletes the pod `next_job_grace` after
it unless a next job started."""

OWNER_FILE = f"{POD_DIR}/owner"
"""The claim of the run directory by the pod: `run=<run id> pod=<pod id>`."""

NODE_FILE = f"{POD_DIR}/node"
"""On a node of an instant cluster, written at its claim: `rank=<r> addr=<its
private address> primary=<rank 0's> nodes=<N>` (Runpod's NODE_* env)."""

CLUSTER_FILE = f"{POD_DIR}/cluster"
"""On a node of an instant cluster, written by the client before the cost cap:
the cluster's id, which every bound of the watchdog deletes as one."""

ALIVE_FILE = f"{POD_DIR}/alive"
"""Touched by the watchdog at every check: when it last looked."""

POD_WORKSPACE = "/workspace"
"""A real pod's workspace; the bootstrap tells sshd sessions the real one
(`OVERBRAINER_WORKSPACE`), which the simulator moves."""

WORKDIR_NAME = "overbrainer"
"""The directory of the run directories, in the pod's workspace."""

START_COMMAND = [
    "sh",
    "-c",
    f'exec sh -c "$(printf %s "${BOOTSTRAP_ENV}" | base64 -d | gzip -dc)" overbrainer-bootstrap',
]
"""The pod's start command: unpacks the script from its environment and runs it
(needs base64 and gzip, in every common image)."""

TIMING_ENV = "OVERBRAINER_POD_TIMING"
"""Overrides `PodTiming` fields, `name=seconds` separated by commas (tests)."""


def bootstrap_script() -> str:
    """The text of the bootstrap + watchdog script."""
    return resources.files(__package__).joinpath(SCRIPT).read_text(encoding="utf-8")


@dataclass(frozen=True)
class PodTiming:
    """How long the client and the pod's watchdog wait for each other, in
    seconds. The standard values suit real pods; tests shorten them with
    `OVERBRAINER_POD_TIMING` (see `from_env`)."""

    watch_interval_s: float = 30.0
    """Between two looks of the watchdog."""
    lease_ttl_s: float = 900.0
    """How long a renewed lease holds max_hours off (the watchdog's LEASE_TTL)."""
    lease_renew_s: float = 300.0
    """How often the following client renews the lease."""
    lease_tick_s: float = 60.0
    """How often the lease holder looks at the time."""
    deadline_margin_s: float = 300.0
    """How long after the watchdog's deadline the client deletes the pod itself."""
    arm_timeout_s: float = 120.0
    """How long the client waits for the watchdog to confirm the cost cap."""
    ready_poll_s: float = 5.0
    """Between two looks at a starting pod."""
    ssh_late_s: float = 30.0
    """How long after a starting pod first shows RUNNING its SSH is late: from
    then on its log is read for a start command that cannot run (see `boot`)."""
    gone_interval_s: float = 2.0
    """Between two looks at a pod that answered 404."""
    confirm_timeout_s: float = 180.0
    """How long a deletion may take to be confirmed."""
    checkpoint_lead_s: float = 600.0
    """How long before max_hours (or max_cost_usd) the watchdog asks the job for a
    checkpoint; at most a tenth of max_hours."""
    checkpoint_hold_s: float = 900.0
    """How long past max_hours a pod whose job ended after the watchdog asked it
    for a checkpoint stays, so that a collector retrieves that checkpoint (three
    runs of a collector scheduled every five minutes); counted in the plan's
    most the pod can cost."""
    next_job_grace_s: float = 300.0
    """How long a pod a pipeline shares stays between two of its jobs, once a
    job's files were verified, for the next job to start (the watchdog's
    OVERBRAINER_NEXT_JOB_GRACE): past it, the follower is taken for dead."""
    lost_host_s: float = 180.0
    """How long a pod whose job could not be reached (the follower's tries
    spent) may go on not answering SSH while Runpod shows it running before
    its host is taken for lost: the client deletes it, and a training goes on
    from its last kept checkpoint on a new pod (`max_restarts`)."""
    reaper_unreachable_s: float = 600.0
    """How long the reaper (see `targets.runpod.reaper`) goes on without any answer from the
    Runpod API before it ends."""

    @classmethod
    def from_env(cls) -> PodTiming:
        """The standard timing with the overrides of `OVERBRAINER_POD_TIMING`
        (`lease_ttl_s=10,watch_interval_s=1`). Raises ValueError with one line
        on an unknown name or a value that is not a positive number."""
        text = os.environ.get(TIMING_ENV, "").strip()
        timing = cls()
        if not text:
            return timing
        known = {field.name for field in fields(cls)}
        changes: dict[str, float] = {}
        for item in text.split(","):
            name, _, value = item.partition("=")
            name = name.strip()
            if name not in known:
                raise ValueError(f"{TIMING_ENV}: unknown setting {name!r}")
            try:
                seconds = float(value)
            except ValueError:
                raise ValueError(f"{TIMING_ENV}: {name} is not a number of seconds") from None
            if not math.isfinite(seconds) or seconds <= 0:
                raise ValueError(f"{TIMING_ENV}: {name} must be a positive number of seconds")
            changes[name] = seconds
        return replace(timing, **changes)

    def checkpoint_lead(self, max_hours: float) -> int:
        """Seconds before max_hours the job is asked for a checkpoint."""
        return max(1, int(min(self.checkpoint_lead_s, max_hours * 3600 / 10)))

    @property
    def renew_every_s(self) -> float:
        """How often the lease is renewed: often enough to never lapse while held."""
        return min(self.lease_renew_s, self.lease_ttl_s / 3)

    @property
    def tick_s(self) -> float:
        """How often the lease holder looks at the time."""
        return min(self.lease_tick_s, self.renew_every_s)


def pod_env(
    *,
    run_id: str,
    api_url: str,
    authorized_key: str,
    host_key_ref: str,
    created_at: int,
    settings: RunpodTargetSettings,
    timing: PodTiming,
) -> dict[str, str]:
    """The environment a pod of the run `run_id` is created with: the script
    and its settings. `host_key_ref` is the reference to the Runpod secret
    holding the pod's host key (Runpod substitutes it when the pod boots), so
    no secret is ever in the request; `created_at` is when the pod was asked
    for (Unix seconds): its bounds count from there."""
    packed = gzip.compress(bootstrap_script().encode(), compresslevel=9, mtime=0)
    script = base64.b64encode(packed).decode()
    return {
        BOOTSTRAP_ENV: script,
        "OVERBRAINER_RUN_ID": run_id,
        "OVERBRAINER_API_URL": api_url,
        "OVERBRAINER_AUTHORIZED_KEY": authorized_key,
        "OVERBRAINER_HOST_KEY": host_key_ref,
        "OVERBRAINER_CREATED_AT": str(created_at),
        "OVERBRAINER_MAX_HOURS": f"{settings.max_hours:g}",
        "OVERBRAINER_BOOT_GRACE": str(math.ceil(settings.boot_grace_s)),
        "OVERBRAINER_RETRIEVE_GRACE": str(math.ceil(settings.retrieve_grace_s)),
        "OVERBRAINER_LEASE_TTL": str(math.ceil(timing.lease_ttl_s)),
        "OVERBRAINER_WATCH_INTERVAL": str(max(1, math.ceil(timing.watch_interval_s))),
        "OVERBRAINER_CHECKPOINT_LEAD": str(timing.checkpoint_lead(settings.max_hours)),
        "OVERBRAINER_CHECKPOINT_HOLD": str(math.ceil(timing.checkpoint_hold_s)),
        "OVERBRAINER_NEXT_JOB_GRACE": str(math.ceil(timing.next_job_grace_s)),
        "OVERBRAINER_KEEP_POD": "1" if settings.keep_pod else "0",
    }


CONTAINER_DISK_USD_PER_GB_MONTH = 0.10  # Runpod's price of a running pod's container disk
HOURS_A_MONTH = 30 * 24  # Runpod bills storage by the second at its price per 30-day month


def disk_per_hour(container_disk_gb: float) -> float:
    """What a running pod's container disk of `container_disk_gb` bills an hour
    (beside its GPUs' rate, which does not include it)."""
    return container_disk_gb * CONTAINER_DISK_USD_PER_GB_MONTH / HOURS_A_MONTH


def cap_text(rate: float, max_cost_usd: float | None) -> str:
    """The content of the cost cap file the watchdog arms itself with; `rate` is
    everything the pod bills an hour (its GPUs and its container disk)."""
    cost = "none" if max_cost_usd is None else f"{max_cost_usd:g}"
    return f"rate={rate:g} max_cost_usd={cost}\n"


@dataclass(frozen=True)
class Armed:
    """The watchdog's confirmation of its cost cap: its max_hours deadline and
    the time max_cost_usd is reached (Unix seconds; None when unset or kept)."""

    deadline_unix: int | None
    cost_deadline_unix: int | None
    line: str


ARMED_MARK = "cost cap armed:"
REFUSED_MARK = "cannot arm the cost cap:"


def parse_armed(log_text: str) -> Armed | str | None:
    """What the watchdog's log says of the cost cap: `Armed` once it is armed,
    the watchdog's reason (a str) when it refused, None while it said nothing."""
    found: Armed | str | None = None
    for line in log_text.splitlines():
        if ARMED_MARK in line:
            found = Armed(
                deadline_unix=_field(line, "deadline_unix"),
                cost_deadline_unix=_field(line, "cost_deadline_unix"),
                line=line.split(" ", 1)[-1],
            )
        elif REFUSED_MARK in line:
            found = line.split(REFUSED_MARK, 1)[1].strip()
    return found


def _field(line: str, name: str) -> int | None:
    marker = f"{name}="
    index = line.find(f" {marker}")
    if index < 0:
        index = line.find(f"[{marker}")
    if index < 0:
        return None
    value = line[index + 1 + len(marker) :].split()[0].rstrip("]")
    return int(value) if value.isdigit() else None
