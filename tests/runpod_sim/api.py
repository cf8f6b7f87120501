"""A simulator of Runpod's API on 127.0.0.1, for tests: REST v2 pods, account
secrets, the catalog (GPU types, data centers) and pod billing, GraphQL's `gpuTypes` and
`dataCenters`, and REST v1 answering 410 as it does since 2026-11-15.

Pods are records with a billing clock (`cost` × time from create to delete),
the env Runpod gives them (`RUNPOD_POD_ID`, a pod-scoped `RUNPOD_API_KEY`
that may only look at and delete its own pod, `{{ RUNPOD_SECRET_name }}`
replaced by the secret's value) and their ports. Faults are knobs set from
Python (or `POST /_sim/knobs`): capacity per GPU type, 429 with
`Retry-After`, 5xx, a 500 after the pod was created, 404 lag after a create,
and a pod still shown after its delete (look-ups and list apart).

A pod's container, as Runpod shows it: `startedAt` and `runtime.uptime`
count from the container's last start (a container whose start command
exits is restarted: `startedAt` moves, `uptime` starts again from 0;
with `hide_restarts()`, as some views do, both count from the pod's create
whatever its container does), and
`GET /v2/pods/{id}/logs?source=container|system&tail=N` serves what its
start command printed and the container's own events, as Server-Sent
Events, from the files a create hook names (`SimPod.log_files`,
`SimPod.container_file`). A simulated pod is a process of this CPU
machine: it shows `gpu.count` 0 (a job on it sees no GPU) unless the
simulator is made with `gpu_pods=True`, where it shows the GPUs it bills for.

    with RunpodSim() as sim:
        client = RunpodClient(SecretStr(sim.api_key), sim.rest_url, sim.graphql_url)
        sim.set_capacity("NVIDIA A40", 0)

`on_pod_create(pod)`, `on_pod_delete(pod)` and `on_pod_restart(pod)` are called (in a worker thread,
before the API answers) when a pod is created or deleted: the place to make
each pod a real process (see `pods.SimPods`). A create hook may set
`pod.public_ip`, `pod.ssh_port` and `pod.ssh_user` (the pod then shows
`ssh.direct`), add to `pod.env`, or set
`pod.status`. Hooks may call the simulator's HTTP API.

Instant clusters (`POST /v2/clusters`, type TRAINING, 2-8 pods): one create
makes `podCount` pods at once (each through the create hook, so each is a
real process tree), all or none (a cluster it cannot place is the capacity
refusal a pod gets). Its pods are on a private network of their own: each
has a loopback address of its cluster (`127.77.<k>.<rank + 1>`, all of
127/8 reaches this machine) and the env Runpod gives a cluster's nodes
(`PRIMARY_ADDR`, `MASTER_ADDR`, `NODE_ADDR`, `NODE_RANK`, `NUM_NODES`,
`NUM_TRAINERS`, `WORLD_SIZE`...). A pod of a cluster cannot be deleted
alone (409): `DELETE /v2/clusters/{id}` deletes them all, for the account or
the pod-scoped key of one of its pods (a watchdog).
"""

from __future__ import annotations

import json
import re
import secrets
import string
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

CAPACITY_TEXT = (
    "There are no longer any instances available with the requested specifications. "
    "Please refresh and try again."
)
"""v2's capacity refusal: 400, this text in `detail` (research/runpod.md §6)."""

SECRET_REF = re.compile(r"\{\{\s*RUNPOD_SECRET_([A-Za-z0-9_.\-/]+)\s*\}\}")
SECRET_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_.\-/]{0,190}$")
START_TIMEOUT_S = 15.0  # seconds uvicorn may take to listen
STOP_TIMEOUT_S = 10.0  # seconds it may take to stop before it is forced


@dataclass
class SimGpu:
    """A GPU type of the simulated catalog; `stock` GPUs free (None: no limit)."""

    id: str
    name: str
    memory: int
    secure_price: float
    community_price: float
    secure: bool = True
    community: bool = True
    max_count: int = 8
    stock: int | None = None

    def price(self, cloud: str) -> float | None:
        """Its price per GPU and hour on `cloud`, None when not offered there."""
        if cloud == "COMMUNITY":
            return self.community_price if self.community else None
        return self.secure_price if self.secure else None


def default_gpus() -> list[SimGpu]:
    """A small catalog with Runpod's ids, VRAM and typical list prices."""
    return [
        SimGpu("NVIDIA RTX A4000", "RTX A4000", 16, 0.25, 0.17),
        SimGpu("NVIDIA RTX A5000", "RTX A5000", 24, 0.27, 0.16),
        SimGpu("NVIDIA GeForce RTX 4090", "RTX 4090", 24, 0.69, 0.34),
        SimGpu("NVIDIA L40S", "L40S", 48, 0.86, 0.79),
        SimGpu("NVIDIA A40", "A40", 48, 0.44, 0.40),
        SimGpu("NVIDIA RTX 6000 Ada Generation", "RTX 6000 Ada", 48, 0.77, 0.74),
        SimGpu("NVIDIA A100 80GB PCIe", "A100 PCIe", 80, 1.64, 1.19),
        SimGpu("NVIDIA H100 80GB HBM3", "H100 SXM", 80, 2.99, 2.69),
        SimGpu("NVIDIA H200", "H200 SXM", 141, 3.99, 3.59, community=False),
        SimGpu("AMD Instinct MI300X OAM", "MI300X", 192, 2.49, 2.49, community=False),
    ]


CREATE_FIELDS = frozenset(
    {
        "name",
        "image",
        "gpu",
        "cpu",
        "cloud",
        "disk",
        "env",
        "ports",
        "args",
        "registry",
        "dataCenterIds",
        "mounts",
        "templateId",
        "globalNetworking",
        "startSsh",
        "startJupyter",
    }
)
"""The properties REST v2's `POST /pods` takes; any other is a 422."""

DEFAULT_DATA_CENTERS = ("EU-RO-1", "EU-SE-1", "US-KS-2", "US-TX-3", "CA-MTL-1")


DISK_USD_PER_GB_MONTH = 0.10  # Runpod's published price of a running pod's container disk


@dataclass
class SimPod:
    """A pod of the simulator. `spend(now)` is its bill so far."""

    id: str
    name: str
    image: str
    gpu_type_id: str
    gpu_count: int
    cloud: str
    cost_per_hr: float
    env: dict[str, str]
    ports: list[str]
    data_center_id: str
    api_key: str
    created_at: float
    request: dict[str, Any]
    status: str = "RUNNING"
    deleted_at: float | None = None
    public_ip: str | None = None
    ssh_port: int | None = None
    ssh_user: str = "root"
    missing_secrets: list[str] = field(default_factory=list)
    hidden_gets: int = 0
    hidden_lists: int = 0
    hidden_until: float = 0.0
    """Monotonic time until which the pod is missing from lists (a lagging list)."""
    lingering_gets: int = 0
    lingering_lists: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    """Free room for hooks (a process, a directory)."""
    log_files: dict[str, Path] = field(default_factory=dict)
    """The pod's logs by source (`container`, `system`), served by `/logs`."""
    container_file: Path | None = None
    """JSON `{"started_at": unix, "restarts": n}` of its container, kept by a hook."""
    shows_gpus: bool = True
    """Whether `gpu.count` shows the GPUs it bills for (else 0: a CPU machine)."""
    shows_restarts: bool = True
    """Whether `startedAt` and `runtime.uptime` count from its container's last start
    (else from its create: a view that does not show the container restarting)."""
    host_lost_at: float | None = None
    """When its host was lost (`SimPods.lose_host`): Runpod still shows it RUNNING,
    but its `runtime.uptime` stays as the host last reported it."""
    cluster_id: str | None = None
    """The instant cluster it is a node of (its rank in `cluster_rank`)."""
    cluster_rank: int | None = None
    private_ip: str | None = None
    """Its address on its cluster's private network (a loopback address of its own)."""

    def container(self) -> tuple[float | None, int]:
        """When its container last started (Unix seconds; None while a hook
        keeps it and it has not started yet) and how often it restarted."""
        if self.container_file is None:
            return self.created_at, 0
        try:
            data = json.loads(self.container_file.read_text())
            return float(data["started_at"]), int(data["restarts"])
        except (OSError, ValueError, KeyError, TypeError):
            return None, 0

    def log_lines(self, source: str, tail: int) -> list[str]:
        """The last `tail` lines of its log `source` (none when it has none)."""
        path = self.log_files.get(source)
        if path is None or not path.exists():
            return []
        lines = path.read_text(errors="replace").splitlines()
        return lines[-tail:] if tail > 0 else lines

    @property
    def deleted(self) -> bool:
        """Whether the pod was deleted."""
        return self.deleted_at is not None

    def spend(self, now: float) -> float:
        """What the pod billed from its create until its delete (or `now`): its
        GPUs at `cost_per_hr`, and its container disk at Runpod's price for a
        running pod ($0.10/GB/month), which `cost` does not include."""
        end = self.deleted_at if self.deleted_at is not None else now
        disk_per_hr = float(self.request.get("disk", 50)) * DISK_USD_PER_GB_MONTH / (30 * 24)
        return (self.cost_per_hr + disk_per_hr) * max(0.0, end - self.created_at) / 3600.0

    def billed(self, start: float, end: float, now: float) -> tuple[float, float]:
        """What the pod billed between `start` and `end`: its GPUs, its disk."""
        stop = min(end, self.deleted_at if self.deleted_at is not None else now)
        hours = max(0.0, stop - max(start, self.created_at)) / 3600.0
        disk_per_hr = float(self.request.get("disk", 50)) * DISK_USD_PER_GB_MONTH / (30 * 24)
        return self.cost_per_hr * hours, disk_per_hr * hours

    def _reported(self, now: float) -> float:
        """The last time its host reported to Runpod: `now`, unless its host was lost."""
        return now if self.host_lost_at is None else min(now, self.host_lost_at)

    def to_api(self, now: float) -> dict[str, Any]:
        """The pod as REST v2 shows it."""
        status = "EXITED" if self.deleted else self.status
        running = status == "RUNNING"
        direct = None
        ports: list[dict[str, Any]] = []
        if running and self.public_ip and self.ssh_port:
            direct = {
                "host": self.public_ip,
                "port": self.ssh_port,
                "username": self.ssh_user,
                "command": f"ssh {self.ssh_user}@{self.public_ip} -p {self.ssh_port}",
            }
            ports.append(
                {"private": 22, "public": self.ssh_port, "type": "tcp", "ip": self.public_ip}
            )
        started_at = self.container()[0] if self.shows_restarts else self.created_at
        return {
            "id": self.id,
            "name": self.name,
            "image": self.image,
            "args": "",
            "disk": self.request.get("disk", 50),
            "ports": list(self.ports),
            "env": {k: v for k, v in self.request.get("env", {}).items()},
            "registry": None,
            "status": status,
            "actions": ["stop", "restart", "terminate"] if running else ["start", "terminate"],
            "mounts": self.request.get("mounts", {}),
            "gpu": {
                "id": self.gpu_type_id,
                "count": self.gpu_count if self.shows_gpus else 0,
                "vcpuCount": 8,
                "memory": 62,
            },
            "cloud": self.cloud,
            "dataCenterId": self.data_center_id,
            "cudaVersion": "12.8",
            "ssh": {"proxy": None, "direct": direct},
            "template": None,
            "cost": 0.0 if not running else self.cost_per_hr,
            "locked": False,
            "globalNetworking": {"enabled": False},
            "runtime": {
                "uptime": int(max(0.0, self._reported(now) - (started_at or now))),
                "ports": ports,
            }
            if running
            else None,
            "createdAt": _iso(self.created_at),
            "startedAt": _iso(started_at, millis=True) if running and started_at else None,
            **(
                {"cluster": {"id": self.cluster_id, "rank": self.cluster_rank}}
                if self.cluster_id is not None
                else {}
            ),
        }


@dataclass
class SimVolume:
    """A network volume: its size (GB) only grows."""

    id: str
    name: str
    size: int
    data_center: str


@dataclass
class SimSecret:
    """An account secret; the value never leaves the simulator's API."""

    id: str
    name: str
    value: str
    description: str | None
    created_at: float


@dataclass
class SimRequest:
    """One request the simulator answered: never its body or its key."""

    method: str
    path: str
    status: int
    user_agent: str
    scope: str
    """`account`, `pod:<id>` or `none`."""


@dataclass
class _Fault:
    status: int
    remaining: int
    method: str | None
    path: str | None
    retry_after: float | None = None
    detail: str = "upstream failure"
    account_only: bool = False

    def matches(self, method: str, path: str, scope: str) -> bool:
        return (
            (self.method is None or self.method == method)
            and (self.path is None or path.startswith(self.path))
            and (not self.account_only or scope == "account")
        )


PodHook = Callable[[SimPod], None]

CLUSTER_FIELDS = frozenset(
    {
        "name",
        "type",
        "compute",
        "image",
        "args",
        "env",
        "ports",
        "disk",
        "dataCenterIds",
        "mounts",
        "startSsh",
    }
)
"""The properties `POST /v2/clusters` takes here; any other is a 422."""
CLUSTER_PODS = (2, 8)  # the self-serve instant clusters' sizes
CLUSTER_PORT = 29500  # PRIMARY_PORT / MASTER_PORT ("all ports are available")


@dataclass
class SimCluster:
    """An instant cluster: its pods by rank (rank 0 the primary)."""

    id: str
    name: str
    type: str
    pod_ids: list[str]
    cidr: str
    vxlan_id: int
    created_at: float
    deleted_at: float | None = None

    def to_api(self, pods: dict[str, SimPod], now: float) -> dict[str, Any]:
        """The cluster as REST v2 shows it."""
        primary = pods[self.pod_ids[0]]
        endpoint = (
            f"{primary.public_ip}:{primary.ssh_port}"
            if primary.public_ip and primary.ssh_port
            else None
        )
        return {
            "id": self.id,
            "name": self.name,
            "type": self.type,
            "status": "TERMINATED" if self.deleted_at is not None else "RUNNING",
            "podCount": len(self.pod_ids),
            "network": {"cidr": self.cidr, "vxlanId": self.vxlan_id},
            "primary": {"podId": primary.id, "sshEndpoint": endpoint},
            "pods": [pods[pod_id].to_api(now) for pod_id in self.pod_ids],
            "createdAt": _iso(self.created_at),
        }


class RunpodSim:
    """Runpod's API on 127.0.0.1, served by uvicorn in a thread.

    `start()` listens on a free port (`base_url`), `stop()` stops it; as a
    context manager it does both. Knobs and inspection are thread-safe.
    """

    def __init__(
        self,
        *,
        api_key: str | None = None,
        gpus: Sequence[SimGpu] | None = None,
        data_centers: Sequence[str] = DEFAULT_DATA_CENTERS,
        on_pod_create: PodHook | None = None,
        on_pod_delete: PodHook | None = None,
        on_pod_restart: PodHook | None = None,
        clock: Callable[[], float] = time.time,
        gpu_pods: bool = False,
    ) -> None:
        self.api_key = api_key or "rpa_" + _token(32)
        self.gpus = {gpu.id: gpu for gpu in (gpus if gpus is not None else default_gpus())}
        self.data_centers = list(data_centers)
        self.on_pod_create = on_pod_create
        self.on_pod_delete = on_pod_delete
        self.on_pod_restart = on_pod_restart
        self._clock = clock
        self.gpu_pods = gpu_pods
        self._offset = 0.0
        self._lock = threading.RLock()
        self._pods: dict[str, SimPod] = {}
        self._clusters: dict[str, SimCluster] = {}
        self._secrets: dict[str, SimSecret] = {}
        self._volumes: dict[str, SimVolume] = {}
        self._faults: list[_Fault] = []
        self._fail_after_create = 0
        self._create_lag = (0, 0)
        self._create_lag_s = 0.0
        self._delete_lag = (0, 0)
        self._catalog_enabled = True
        self._pod_keys_revoked = False
        self._restarts_shown = True
        self.requests: list[SimRequest] = []
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    # Lifecycle

    def start(self) -> RunpodSim:
        """Listens on a free port of 127.0.0.1. Raises RuntimeError when the
        server does not start within START_TIMEOUT_S."""
        config = uvicorn.Config(
            self._app(),
            host="127.0.0.1",
            port=0,
            log_level="warning",
            lifespan="off",
            access_log=False,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="runpod-sim", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the Runpod simulator did not start")
            time.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        """Stops the server and waits for its thread (forced after STOP_TIMEOUT_S)."""
        server, thread = self._server, self._thread
        if server is None or thread is None:
            return
        server.should_exit = True
        thread.join(STOP_TIMEOUT_S)
        if thread.is_alive():
            server.force_exit = True
            thread.join(STOP_TIMEOUT_S)
        self._server = self._thread = None

    def __enter__(self) -> RunpodSim:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def base_url(self) -> str:
        """`http://127.0.0.1:<port>`."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def rest_url(self) -> str:
        """REST v2's base URL, for `RunpodCredentials.rest_url`."""
        return f"{self.base_url}/v2"

    @property
    def graphql_url(self) -> str:
        """GraphQL's URL, for `RunpodCredentials.graphql_url`."""
        return f"{self.base_url}/graphql"

    # Knobs

    def set_capacity(self, gpu_id: str, free: int | None) -> None:
        """`free` GPUs of `gpu_id` can be rented (None: no limit); 0 makes every
        create of it answer Runpod's capacity refusal."""
        with self._lock:
            self.gpus[gpu_id].stock = free

    def rate_limit(
        self,
        times: int = 1,
        retry_after: float = 1.0,
        *,
        method: str | None = None,
        path: str | None = None,
    ) -> None:
        """The next `times` requests (of `method` on a path starting with `path`)
        answer 429 with `Retry-After: retry_after`."""
        with self._lock:
            self._faults.append(_Fault(429, times, method, path, retry_after))

    def fail(
        self,
        status: int = 503,
        times: int = 1,
        *,
        method: str | None = None,
        path: str | None = None,
        detail: str = "upstream failure",
        account_only: bool = False,
    ) -> None:
        """The next `times` requests (of `method`, on a path starting with
        `path`; with `account_only`, only those made with the account's key,
        not a pod's own) answer `status` with `detail` without doing anything."""
        with self._lock:
            self._faults.append(
                _Fault(status, times, method, path, detail=detail, account_only=account_only)
            )

    def clear_faults(self) -> None:
        """Forgets the faults `fail` set that have not run out."""
        with self._lock:
            self._faults.clear()

    def fail_after_create(self, times: int = 1) -> None:
        """The next `times` creates create their pod (it bills), then answer 500."""
        with self._lock:
            self._fail_after_create = times

    def lag_after_create(self, gets: int = 0, lists: int = 0, seconds: float = 0.0) -> None:
        """Each new pod answers 404 to its next `gets` look-ups and is missing
        from the next `lists` lists, and from every list for its first
        `seconds` (a list that lags behind the creates)."""
        with self._lock:
            self._create_lag = (gets, lists)
            self._create_lag_s = seconds

    def lag_after_delete(self, gets: int = 0, lists: int = 0) -> None:
        """Each deleted pod still shows (as EXITED) to its next `gets` look-ups
        and in the next `lists` lists."""
        with self._lock:
            self._delete_lag = (gets, lists)

    def revoke_pod_keys(self, revoked: bool = True) -> None:
        """With True, every pod-scoped key answers 401, as a revoked key does:
        pods can no longer delete themselves."""
        with self._lock:
            self._pod_keys_revoked = revoked

    def hide_restarts(self, hidden: bool = True) -> None:
        """With True, the pods created from now on show `startedAt` and
        `runtime.uptime` counted from their create, whatever their container
        does: a pod view in which a crash-looping container does not show
        (its log still does)."""
        with self._lock:
            self._restarts_shown = not hidden

    def set_catalog(self, enabled: bool) -> None:
        """With False, REST's catalog answers 404 (GraphQL still serves it)."""
        with self._lock:
            self._catalog_enabled = enabled

    def terminate(self, pod_id: str) -> None:
        """Terminates the pod as Runpod does on its own (the account's balance
        ran out, its host was lost): deleted, its processes ended, nobody asked."""
        pod = self._delete(pod_id)
        if pod is not None and self.on_pod_delete is not None:
            self.on_pod_delete(pod)

    def advance_clock(self, seconds: float) -> None:
        """Moves the billing clock forward by `seconds`."""
        with self._lock:
            self._offset += seconds

    def now(self) -> float:
        """The billing clock."""
        return self._clock() + self._offset

    # Inspection

    def clusters(self, *, include_deleted: bool = False) -> list[SimCluster]:
        """The instant clusters, in creation order; the deleted ones too when asked."""
        with self._lock:
            return [c for c in self._clusters.values() if include_deleted or c.deleted_at is None]

    def pods(self, *, include_deleted: bool = False) -> list[SimPod]:
        """The pods, in creation order; the deleted ones too when asked."""
        with self._lock:
            return [p for p in self._pods.values() if include_deleted or not p.deleted]

    def pod(self, pod_id: str) -> SimPod:
        """The pod `pod_id`, deleted or not. Raises KeyError."""
        with self._lock:
            return self._pods[pod_id]

    def pods_named(self, name: str) -> list[SimPod]:
        """The live pods named `name`."""
        return [pod for pod in self.pods() if pod.name == name]

    def spend(self, pod_id: str | None = None) -> float:
        """What one pod, or every pod, billed so far."""
        now = self.now()
        with self._lock:
            pods = [self._pods[pod_id]] if pod_id else list(self._pods.values())
            return sum(pod.spend(now) for pod in pods)

    def add_volume(self, size: int, data_center: str) -> str:
        """Creates a network volume of `size` GB in `data_center`; returns its id."""
        with self._lock:
            volume = SimVolume(_token(10), f"volume-{len(self._volumes) + 1}", size, data_center)
            self._volumes[volume.id] = volume
            return volume.id

    def volume(self, volume_id: str) -> SimVolume:
        """The network volume `volume_id`. Raises KeyError."""
        with self._lock:
            return self._volumes[volume_id]

    def secret_names(self) -> list[str]:
        """The names of the account's secrets."""
        with self._lock:
            return [secret.name for secret in self._secrets.values()]

    def requests_to(self, method: str, path_prefix: str) -> list[SimRequest]:
        """The requests answered for `method` on paths starting with `path_prefix`."""
        with self._lock:
            return [
                r for r in self.requests if r.method == method and r.path.startswith(path_prefix)
            ]

    # The API

    def _app(self) -> Starlette:
        routes = [
            Route("/v2/pods", self._pods_endpoint, methods=["GET", "POST"]),
            Route("/v2/pods/{pod_id}", self._pod_endpoint, methods=["GET", "DELETE"]),
            Route("/v2/pods/{pod_id}/action", self._pod_action, methods=["POST"]),
            Route("/v2/pods/{pod_id}/logs", self._pod_logs, methods=["GET"]),
            Route("/v2/clusters", self._clusters_endpoint, methods=["GET", "POST"]),
            Route("/v2/clusters/{cluster_id}", self._cluster_endpoint, methods=["GET", "DELETE"]),
            Route("/v2/clusters/{cluster_id}/pods", self._cluster_pods, methods=["GET"]),
            Route("/v2/catalog/gpus", self._catalog_gpus, methods=["GET"]),
            Route("/v2/catalog/datacenters", self._catalog_dcs, methods=["GET"]),
            Route("/v2/account/secrets", self._secrets_endpoint, methods=["GET", "POST"]),
            Route("/v2/account/secrets/{secret_id}", self._secret_endpoint, methods=["DELETE"]),
            Route(
                "/v2/network-volumes/{volume_id}", self._volume_endpoint, methods=["GET", "PATCH"]
            ),
            Route("/v2/billing/pods", self._billing_pods, methods=["GET"]),
            Route("/graphql", self._graphql, methods=["POST"]),
            Route("/v1/{rest:path}", self._retired, methods=["GET", "POST", "DELETE", "PATCH"]),
            Route("/_sim/knobs", self._knobs, methods=["POST"]),
            Route("/_sim/state", self._state, methods=["GET"]),
        ]
        return Starlette(routes=routes)

    def _gate(self, request: Request) -> tuple[str, Response | None]:
        """Who calls (`account`, `pod:<id>`) and the answer that ends the call
        here: 401 for a bad key, an armed fault."""
        auth = request.headers.get("authorization", "")
        scope = "none"
        answer: Response | None = None
        with self._lock:
            if not auth.startswith("Bearer ") or not auth[7:].strip():
                answer = _problem(401, "missing bearer token")
            else:
                key = auth[7:].strip()
                if secrets.compare_digest(key.encode(), self.api_key.encode()):
                    scope = "account"
                else:
                    owner = next(
                        (p for p in self._pods.values() if not p.deleted and p.api_key == key),
                        None,
                    )
                    if owner is None or self._pod_keys_revoked:
                        answer = _problem(401, "invalid api key")
                    else:
                        scope = f"pod:{owner.id}"
            if answer is None:
                answer = self._armed_fault(request.method, request.url.path, scope)
        return scope, answer

    def _armed_fault(self, method: str, path: str, scope: str) -> Response | None:
        for fault in self._faults:
            if fault.remaining > 0 and fault.matches(method, path, scope):
                fault.remaining -= 1
                if fault.status == 429:
                    return _problem(
                        429,
                        "rate limit exceeded for the minute window",
                        headers={"Retry-After": f"{fault.retry_after:g}"},
                    )
                return _problem(fault.status, fault.detail)
        self._faults = [f for f in self._faults if f.remaining > 0]
        return None

    def _log(self, request: Request, status: int, scope: str) -> None:
        with self._lock:
            self.requests.append(
                SimRequest(
                    request.method,
                    request.url.path,
                    status,
                    request.headers.get("user-agent", ""),
                    scope,
                )
            )

    def _done(self, request: Request, response: Response, scope: str) -> Response:
        self._log(request, response.status_code, scope)
        return response

    async def _pods_endpoint(self, request: Request) -> Response:
        scope, answer = self._gate(request)
        if answer is None and scope != "account":
            answer = _problem(403, "access denied")
        if answer is not None:
            return self._done(request, answer, scope)
        if request.method == "GET":
            return self._done(request, self._list_pods(), scope)
        try:
            body = await request.json()
        except ValueError:
            return self._done(request, _problem(422, "body is not JSON"), scope)
        answer, pod, fail = self._create(body)
        if pod is not None and self.on_pod_create is not None:
            await anyio.to_thread.run_sync(self.on_pod_create, pod)
        if pod is not None:
            answer = (
                _problem(500, "create pod: Something went wrong. Please try again later.")
                if fail
                else JSONResponse(pod.to_api(self.now()), status_code=201)
            )
        assert answer is not None
        return self._done(request, answer, scope)

    def _create(
        self, body: Any, *, faults: bool = True
    ) -> tuple[Response | None, SimPod | None, bool]:
        if not isinstance(body, dict):
            return _problem(422, "body is not an object"), None, False
        unknown = sorted(set(body) - CREATE_FIELDS)
        if unknown:  # v2's CreatePodRequest: "unevaluatedProperties": false
            detail = f"$: additional properties '{unknown[0]}' not allowed"
            return _problem(422, "Request validation failed.", errors=[detail]), None, False
        errors = []
        name, image, gpu = body.get("name"), body.get("image"), body.get("gpu")
        if not isinstance(name, str) or not name:
            errors.append("$.name: required")
        if not isinstance(image, str) or not image:
            errors.append("$.image: required")
        if not isinstance(gpu, dict) or not isinstance(gpu.get("id"), str):
            errors.append("$.gpu.id: required")
        if errors:
            return _problem(422, "Request validation failed.", errors=errors), None, False
        assert isinstance(gpu, dict) and isinstance(name, str) and isinstance(image, str)
        count = int(gpu.get("count", 1))
        cloud = str(body.get("cloud", "SECURE"))
        with self._lock:
            sim_gpu = self.gpus.get(gpu["id"])
            if sim_gpu is None:
                return _problem(400, "gpu type is not valid"), None, False
            network = (body.get("mounts") or {}).get("network") or [{}]
            volume_id = network[0].get("volumeId")
            if volume_id is not None and volume_id not in self._volumes:
                return _problem(400, "network volume not found"), None, False
            wanted_dcs = body.get("dataCenterIds") or []
            unknown = [dc for dc in wanted_dcs if dc not in self.data_centers]
            if unknown:
                return _problem(400, "dataCenterIds holds an unknown data center"), None, False
            price = sim_gpu.price(cloud)
            no_stock = sim_gpu.stock is not None and sim_gpu.stock < count
            if price is None or count > sim_gpu.max_count or no_stock:
                return _problem(400, CAPACITY_TEXT), None, False
            if sim_gpu.stock is not None:
                sim_gpu.stock -= count
            pod_id = _pod_id()
            env = {str(k): str(v) for k, v in (body.get("env") or {}).items()}
            missing: list[str] = []

            def resolve(match: re.Match[str]) -> str:
                secret = next((s for s in self._secrets.values() if s.name == match[1]), None)
                if secret is None:
                    missing.append(match[1])
                    return ""
                return secret.value

            env = {key: SECRET_REF.sub(resolve, value) for key, value in env.items()}
            dc = wanted_dcs[0] if wanted_dcs else self.data_centers[0]
            pod = SimPod(
                id=pod_id,
                name=name,
                image=image,
                gpu_type_id=sim_gpu.id,
                gpu_count=count,
                cloud=cloud,
                cost_per_hr=round(price * count, 4),
                env=env,
                ports=[str(p) for p in body.get("ports") or []],
                data_center_id=dc,
                api_key="rpa_pod_" + _token(28),
                created_at=self.now(),
                request=body,
                status="ERROR" if missing else "RUNNING",
                shows_gpus=self.gpu_pods,
                shows_restarts=self._restarts_shown,
                missing_secrets=missing,
                hidden_gets=self._create_lag[0],
                hidden_lists=self._create_lag[1],
                hidden_until=time.monotonic() + self._create_lag_s,
            )
            pod.env.update(
                {
                    "RUNPOD_POD_ID": pod.id,
                    "RUNPOD_API_KEY": pod.api_key,
                    "RUNPOD_DC_ID": dc,
                    "RUNPOD_GPU_COUNT": str(count),
                    "RUNPOD_POD_HOSTNAME": f"{pod.id}-sim",
                }
            )
            self._pods[pod.id] = pod
            fail = faults and self._fail_after_create > 0
            if fail:
                self._fail_after_create -= 1
        return None, pod, fail

    def _list_pods(self) -> Response:
        now = self.now()
        shown = []
        with self._lock:
            for pod in self._pods.values():
                if pod.deleted:
                    if pod.lingering_lists > 0:
                        pod.lingering_lists -= 1
                        shown.append(pod.to_api(now))
                elif pod.hidden_lists > 0:
                    pod.hidden_lists -= 1
                elif time.monotonic() < pod.hidden_until:
                    pass
                else:
                    shown.append(pod.to_api(now))
        return JSONResponse({"pods": shown})

    async def _pod_endpoint(self, request: Request) -> Response:
        pod_id = request.path_params["pod_id"]
        scope, answer = self._gate(request)
        if answer is None and scope not in ("account", f"pod:{pod_id}"):
            answer = _problem(403, "access denied")
        if answer is not None:
            return self._done(request, answer, scope)
        if request.method == "GET":
            return self._done(request, self._get_pod(pod_id), scope)
        refused = self._cluster_refusal(pod_id)
        if refused is not None:
            return self._done(request, refused, scope)
        deleted = self._delete(pod_id)
        if deleted is None:
            return self._done(request, _problem(404, "resource not found"), scope)
        if self.on_pod_delete is not None:
            await anyio.to_thread.run_sync(self.on_pod_delete, deleted)
        return self._done(request, Response(status_code=204), scope)

    def _get_pod(self, pod_id: str) -> Response:
        with self._lock:
            pod = self._pods.get(pod_id)
            if pod is None:
                return _problem(404, "resource not found")
            if pod.deleted:
                if pod.lingering_gets <= 0:
                    return _problem(404, "resource not found")
                pod.lingering_gets -= 1
            elif pod.hidden_gets > 0:
                pod.hidden_gets -= 1
                return _problem(404, "resource not found")
            return JSONResponse(pod.to_api(self.now()))

    def _delete(self, pod_id: str) -> SimPod | None:
        with self._lock:
            pod = self._pods.get(pod_id)
            if pod is None or pod.deleted:
                return None
            pod.deleted_at = self.now()
            pod.status = "TERMINATED"
            pod.lingering_gets, pod.lingering_lists = self._delete_lag
            gpu = self.gpus.get(pod.gpu_type_id)
            if gpu is not None and gpu.stock is not None:
                gpu.stock += pod.gpu_count
            return pod

    def _cluster_refusal(self, pod_id: str) -> Response | None:
        """409 for a live pod of a cluster: only its cluster is deleted."""
        with self._lock:
            pod = self._pods.get(pod_id)
            if pod is None or pod.deleted or pod.cluster_id is None:
                return None
            return _problem(
                409, f"pod {pod_id} is a node of cluster {pod.cluster_id}: delete the cluster"
            )

    # Instant clusters

    def _cluster_scope(self, scope: str, cluster_id: str) -> bool:
        """Whether `scope` may look at or delete the cluster: the account, or
        the pod-scoped key of one of its pods."""
        if scope == "account":
            return True
        with self._lock:
            cluster = self._clusters.get(cluster_id)
            return cluster is not None and scope.removeprefix("pod:") in cluster.pod_ids

    async def _clusters_endpoint(self, request: Request) -> Response:
        scope, answer = self._gate(request)
        if answer is None and scope != "account":
            answer = _problem(403, "access denied")
        if answer is not None:
            return self._done(request, answer, scope)
        now = self.now()
        if request.method == "GET":
            with self._lock:
                shown = [
                    c.to_api(self._pods, now)
                    for c in self._clusters.values()
                    if c.deleted_at is None
                ]
            return self._done(request, JSONResponse({"clusters": shown}), scope)
        try:
            body = await request.json()
        except ValueError:
            return self._done(request, _problem(422, "body is not JSON"), scope)
        answer, cluster, fail = self._create_cluster(body)
        if cluster is not None:
            if self.on_pod_create is not None:
                for pod_id in cluster.pod_ids:
                    await anyio.to_thread.run_sync(self.on_pod_create, self._pods[pod_id])
            answer = (
                _problem(500, "create cluster: Something went wrong. Please try again later.")
                if fail
                else JSONResponse(cluster.to_api(self._pods, self.now()), status_code=201)
            )
        assert answer is not None
        return self._done(request, answer, scope)

    def _create_cluster(self, body: Any) -> tuple[Response | None, SimCluster | None, bool]:
        if not isinstance(body, dict):
            return _problem(422, "body is not an object"), None, False
        unknown = sorted(set(body) - CLUSTER_FIELDS)
        if unknown:
            detail = f"$: additional properties '{unknown[0]}' not allowed"
            return _problem(422, "Request validation failed.", errors=[detail]), None, False
        compute = body.get("compute")
        name = body.get("name")
        if not isinstance(compute, dict) or not isinstance(compute.get("gpuTypeId"), str):
            return (
                _problem(422, "Request validation failed.", errors=["$.compute: required"]),
                None,
                False,
            )
        if not isinstance(name, str) or not name:
            return (
                _problem(422, "Request validation failed.", errors=["$.name: required"]),
                None,
                False,
            )
        if body.get("type", "TRAINING") not in ("APPLICATION", "TRAINING", "SLURM", "RAY"):
            return (
                _problem(422, "Request validation failed.", errors=["$.type: unknown"]),
                None,
                False,
            )
        count = int(compute.get("podCount", 2))
        per_pod = int(compute.get("gpuCountPerPod", 1))
        low, high = CLUSTER_PODS
        if not low <= count <= high:
            detail = f"podCount must be {low} to {high} for a self-serve cluster"
            return _problem(400, detail), None, False
        with self._lock:
            gpu = self.gpus.get(compute["gpuTypeId"])
            if gpu is None:
                return _problem(400, "gpu type is not valid"), None, False
            cloud = str(body.get("cloud", "SECURE"))
            no_stock = gpu.stock is not None and gpu.stock < per_pod * count
            if gpu.price(cloud) is None or per_pod > gpu.max_count or no_stock:
                return _problem(400, CAPACITY_TEXT), None, False
            k = len(self._clusters) % 250 + 1
            cluster = SimCluster(
                id="cl" + _token(12),
                name=name,
                type=str(body.get("type", "TRAINING")),
                pod_ids=[],
                cidr=f"127.77.{k}.0/24",
                vxlan_id=1000 + k,
                created_at=self.now(),
            )
            primary = f"127.77.{k}.1"
            for rank in range(count):
                address = f"127.77.{k}.{rank + 1}"
                env = {
                    **{str(key): str(value) for key, value in (body.get("env") or {}).items()},
                    "PRIMARY_ADDR": primary,
                    "MASTER_ADDR": primary,
                    "PRIMARY_PORT": str(CLUSTER_PORT),
                    "MASTER_PORT": str(CLUSTER_PORT),
                    "HOST_NODE_ADDR": f"{primary}:{CLUSTER_PORT}",
                    "NODE_ADDR": address,
                    "NODE_RANK": str(rank),
                    "NUM_NODES": str(count),
                    "NUM_TRAINERS": str(per_pod),
                    "WORLD_SIZE": str(count * per_pod),
                }
                pod_body = {
                    key: value
                    for key, value in body.items()
                    if key in CREATE_FIELDS and key not in ("env", "name")
                }
                pod_body.update(
                    name=f"{name}-{rank}",
                    gpu={"id": gpu.id, "count": per_pod},
                    env=env,
                )
                answer, pod, _ = self._create(pod_body, faults=False)
                if pod is None:  # all or none
                    for made in cluster.pod_ids:
                        self._delete(made)
                        del self._pods[made]
                    return answer, None, False
                pod.cluster_id, pod.cluster_rank, pod.private_ip = cluster.id, rank, address
                cluster.pod_ids.append(pod.id)
            self._clusters[cluster.id] = cluster
            fail = self._fail_after_create > 0
            if fail:
                self._fail_after_create -= 1
        return None, cluster, fail

    def _cluster_gate(self, request: Request) -> tuple[str, str, Response | None]:
        """The cluster a call names, who calls, and the answer that ends it here
        (`_gate`'s, or 403 for a pod key of another cluster)."""
        cluster_id = request.path_params["cluster_id"]
        scope, answer = self._gate(request)
        if answer is None and not self._cluster_scope(scope, cluster_id):
            answer = _problem(403, "access denied")
        return cluster_id, scope, answer

    async def _cluster_endpoint(self, request: Request) -> Response:
        cluster_id, scope, answer = self._cluster_gate(request)
        if answer is not None:
            return self._done(request, answer, scope)
        with self._lock:
            cluster = self._clusters.get(cluster_id)
            if cluster is None or cluster.deleted_at is not None:
                return self._done(request, _problem(404, "resource not found"), scope)
            if request.method == "GET":
                shown = cluster.to_api(self._pods, self.now())
                return self._done(request, JSONResponse(shown), scope)
            cluster.deleted_at = self.now()
            deleted = [p for p in (self._delete(pod_id) for pod_id in cluster.pod_ids) if p]
        if self.on_pod_delete is not None:
            for pod in deleted:
                await anyio.to_thread.run_sync(self.on_pod_delete, pod)
        return self._done(request, Response(status_code=204), scope)

    async def _cluster_pods(self, request: Request) -> Response:
        cluster_id, scope, answer = self._cluster_gate(request)
        if answer is not None:
            return self._done(request, answer, scope)
        with self._lock:
            cluster = self._clusters.get(cluster_id)
            if cluster is None or cluster.deleted_at is not None:
                return self._done(request, _problem(404, "resource not found"), scope)
            now = self.now()
            shown = [self._pods[pod_id].to_api(now) for pod_id in cluster.pod_ids]
        return self._done(request, JSONResponse({"pods": shown}), scope)

    async def _pod_action(self, request: Request) -> Response:
        pod_id = request.path_params["pod_id"]
        scope, answer = self._gate(request)
        if answer is None and scope not in ("account", f"pod:{pod_id}"):
            answer = _problem(403, "access denied")
        if answer is not None:
            return self._done(request, answer, scope)
        try:
            action = (await request.json()).get("action")
        except (ValueError, AttributeError):
            action = None
        if action == "terminate":
            refused = self._cluster_refusal(pod_id)
            if refused is not None:
                return self._done(request, refused, scope)
            deleted = self._delete(pod_id)
            if deleted is None:
                return self._done(request, _problem(404, "resource not found"), scope)
            if self.on_pod_delete is not None:
                await anyio.to_thread.run_sync(self.on_pod_delete, deleted)
            return self._done(request, Response(status_code=204), scope)
        with self._lock:
            pod = self._pods.get(pod_id)
            if pod is None or pod.deleted:
                return self._done(request, _problem(404, "resource not found"), scope)
            if action == "stop":
                pod.status = "EXITED"
            elif action == "start":
                pod.status = "RUNNING"
            elif action != "restart":
                return self._done(request, _problem(422, "$.action: unknown"), scope)
        if action == "restart" and self.on_pod_restart is not None:
            await anyio.to_thread.run_sync(self.on_pod_restart, pod)
        return self._done(request, JSONResponse(pod.to_api(self.now())), scope)

    async def _pod_logs(self, request: Request) -> Response:
        """`GET /v2/pods/{id}/logs?source=container|system&tail=N`: the last
        lines of the pod's log as Server-Sent Events (`data: <line>`), for
        the account or the pod's own key."""
        pod_id = request.path_params["pod_id"]
        scope, answer = self._gate(request)
        if answer is None and scope not in ("account", f"pod:{pod_id}"):
            answer = _problem(403, "access denied")
        if answer is not None:
            return self._done(request, answer, scope)
        source = request.query_params.get("source", "container")
        if source not in ("container", "system"):
            return self._done(request, _problem(422, "$.source: container or system"), scope)
        try:
            tail = int(request.query_params.get("tail", "100"))
        except ValueError:
            return self._done(request, _problem(422, "$.tail: an integer"), scope)
        with self._lock:
            pod = self._pods.get(pod_id)
            if pod is None or pod.deleted:
                return self._done(request, _problem(404, "resource not found"), scope)
        lines = pod.log_lines(source, tail)
        body = "".join(f"data: {line}\n\n" for line in lines)
        return self._done(request, Response(body, media_type="text/event-stream"), scope)

    async def _catalog_gpus(self, request: Request) -> Response:
        scope, answer = self._account_only(request)
        if answer is None and not self._catalog_enabled:
            answer = _problem(404, "resource not found")
        if answer is not None:
            return self._done(request, answer, scope)
        cloud = request.query_params.get("cloud", "SECURE")
        with self._lock:
            rows = [_catalog_row(gpu, cloud) for gpu in self.gpus.values()]
        return self._done(request, JSONResponse({"gpus": rows}), scope)

    async def _catalog_dcs(self, request: Request) -> Response:
        scope, answer = self._account_only(request)
        if answer is None and not self._catalog_enabled:
            answer = _problem(404, "resource not found")
        if answer is not None:
            return self._done(request, answer, scope)
        rows = [{"id": dc, "name": dc, "region": "EUROPE"} for dc in self.data_centers]
        return self._done(request, JSONResponse({"dataCenters": rows}), scope)

    def _account_only(self, request: Request) -> tuple[str, Response | None]:
        scope, answer = self._gate(request)
        if answer is None and scope != "account":
            answer = _problem(403, "access denied")
        return scope, answer

    async def _secrets_endpoint(self, request: Request) -> Response:
        scope, answer = self._account_only(request)
        if answer is not None:
            return self._done(request, answer, scope)
        if request.method == "GET":
            wanted = request.query_params.get("name")
            with self._lock:
                rows = [
                    _secret_row(s)
                    for s in self._secrets.values()
                    if wanted is None or s.name.lower() == wanted.lower()
                ]
            return self._done(request, JSONResponse({"secrets": rows}), scope)
        try:
            body = await request.json()
        except ValueError:
            body = None
        if not isinstance(body, dict) or not isinstance(body.get("value"), str):
            return self._done(request, _problem(422, "Request validation failed."), scope)
        name = body.get("name")
        if not isinstance(name, str) or not SECRET_NAME.match(name):
            return self._done(request, _problem(422, "$.name: does not match the pattern"), scope)
        if name.lower().startswith("runpod"):
            return self._done(
                request, _problem(400, "names starting with RUNPOD are reserved"), scope
            )
        with self._lock:
            if any(s.name.lower() == name.lower() for s in self._secrets.values()):
                return self._done(request, _problem(409, "a secret with this name exists"), scope)
            secret = SimSecret(_token(12), name, body["value"], body.get("description"), self.now())
            self._secrets[secret.id] = secret
        return self._done(request, JSONResponse(_secret_row(secret), status_code=201), scope)

    async def _secret_endpoint(self, request: Request) -> Response:
        scope, answer = self._account_only(request)
        if answer is not None:
            return self._done(request, answer, scope)
        with self._lock:
            gone = self._secrets.pop(request.path_params["secret_id"], None)
        if gone is None:
            return self._done(request, _problem(404, "resource not found"), scope)
        return self._done(request, Response(status_code=204), scope)

    async def _volume_endpoint(self, request: Request) -> Response:
        scope, answer = self._account_only(request)
        if answer is not None:
            return self._done(request, answer, scope)
        body: Any = None
        if request.method == "PATCH":
            try:
                body = await request.json()
            except ValueError:
                body = None
        with self._lock:
            volume = self._volumes.get(request.path_params["volume_id"])
            if volume is None:
                return self._done(request, _problem(404, "network volume not found"), scope)
            if request.method == "PATCH":
                size = body.get("size") if isinstance(body, dict) else None
                if not isinstance(size, int) or size > 4096:
                    return self._done(request, _problem(422, "$.size: 10..4096"), scope)
                if size < volume.size:
                    return self._done(
                        request, _problem(400, "a network volume's size can only grow"), scope
                    )
                volume.size = size
            row = {
                "id": volume.id,
                "name": volume.name,
                "size": volume.size,
                "dataCenter": volume.data_center,
            }
        return self._done(request, JSONResponse(row), scope)

    async def _graphql(self, request: Request) -> Response:
        scope, answer = self._account_only(request)
        if answer is not None:
            return self._done(request, answer, scope)
        try:
            query = str((await request.json()).get("query", ""))
        except (ValueError, AttributeError):
            query = ""
        if "gpuTypes" in query:
            with self._lock:
                rows: list[dict[str, Any]] = [
                    {
                        "id": gpu.id,
                        "displayName": gpu.name,
                        "memoryInGb": gpu.memory,
                        "secureCloud": gpu.secure,
                        "communityCloud": gpu.community,
                        "securePrice": gpu.secure_price if gpu.secure else None,
                        "communityPrice": gpu.community_price if gpu.community else None,
                        "maxGpuCount": gpu.max_count,
                    }
                    for gpu in self.gpus.values()
                ]
            data: dict[str, Any] = {"data": {"gpuTypes": rows}}
        elif "dataCenters" in query:
            data = {"data": {"dataCenters": [{"id": dc, "name": dc} for dc in self.data_centers]}}
        else:
            data = {"errors": [{"message": "unsupported query"}]}
        return self._done(request, JSONResponse(data), scope)

    async def _retired(self, request: Request) -> Response:
        return self._done(request, JSONResponse({"error": "REST v1 is retired"}, 410), "none")

    async def _knobs(self, request: Request) -> Response:
        """Sets knobs from JSON: `capacity` {gpu: n}, `rate_limit` {times,
        retry_after, method, path}, `fail` {status, times, method, path},
        `fail_after_create` n, `lag_after_create` / `lag_after_delete` {gets,
        lists}, `advance_clock` seconds, `catalog` bool, `hide_restarts` bool."""
        body = await request.json()
        for gpu_id, free in (body.get("capacity") or {}).items():
            self.set_capacity(gpu_id, free)
        if "rate_limit" in body:
            self.rate_limit(**body["rate_limit"])
        if "fail" in body:
            self.fail(**body["fail"])
        if "fail_after_create" in body:
            self.fail_after_create(int(body["fail_after_create"]))
        if "lag_after_create" in body:
            self.lag_after_create(**body["lag_after_create"])
        if "lag_after_delete" in body:
            self.lag_after_delete(**body["lag_after_delete"])
        if "advance_clock" in body:
            self.advance_clock(float(body["advance_clock"]))
        if "catalog" in body:
            self.set_catalog(bool(body["catalog"]))
        if "hide_restarts" in body:
            self.hide_restarts(bool(body["hide_restarts"]))
        return JSONResponse({"ok": True})

    async def _billing_pods(self, request: Request) -> Response:
        """`GET /v2/billing/pods`: what each pod billed in each `bucketSize`
        (hour or day) bucket from `startTime` to `endTime` (default: the last
        30 days), `podId` narrowing it to one pod, answered from the
        simulator's own billing clock: GPU and container disk (`cpuAmount` 0)."""
        scope, answer = self._account_only(request)
        if answer is not None:
            return self._done(request, answer, scope)
        params = request.query_params
        size = {"hour": 3600, "day": 86400}.get(params.get("bucketSize", "day"))
        try:
            end = _parse_iso(params["endTime"]) if "endTime" in params else self.now()
            start = _parse_iso(params["startTime"]) if "startTime" in params else end - 30 * 86400
        except ValueError:
            return self._done(request, _problem(400, "startTime and endTime are RFC 3339"), scope)
        if size is None:
            return self._done(request, _problem(400, "bucketSize is hour or day here"), scope)
        start -= start % size
        now = self.now()
        with self._lock:
            pods = [p for p in self._pods.values() if params.get("podId") in (None, p.id)]
            records = []
            for pod in pods:
                bucket = start
                while bucket < end:
                    amounts = pod.billed(bucket, min(bucket + size, end), now)
                    if amounts[0] + amounts[1] > 0:
                        records.append(
                            {
                                "podId": pod.id,
                                "time": _iso(bucket),
                                "gpuAmount": amounts[0],
                                "cpuAmount": 0.0,
                                "diskAmount": amounts[1],
                                "totalAmount": amounts[0] + amounts[1],
                            }
                        )
                    bucket += size
        metadata = {
            "bucketSize": params.get("bucketSize", "day"),
            "startTime": _iso(start),
            "endTime": _iso(end),
            "totalAmount": sum(r["totalAmount"] for r in records),
        }
        return self._done(request, JSONResponse({"records": records, "metadata": metadata}), scope)

    async def _state(self, request: Request) -> Response:
        now = self.now()
        with self._lock:
            pods = [
                {
                    "id": p.id,
                    "name": p.name,
                    "status": p.status,
                    "cost": p.cost_per_hr,
                    "spend": p.spend(now),
                    "deleted": p.deleted,
                }
                for p in self._pods.values()
            ]
            names = [s.name for s in self._secrets.values()]
        return JSONResponse({"pods": pods, "secrets": names, "now": now})


@contextmanager
def running_sim(**kwargs: Any) -> Iterator[RunpodSim]:
    """A started simulator (`RunpodSim(**kwargs)`), stopped for sure at the end."""
    sim = RunpodSim(**kwargs)
    sim.start()
    try:
        yield sim
    finally:
        sim.stop()


def _catalog_row(gpu: SimGpu, cloud: str) -> dict[str, Any]:
    free = gpu.stock is None or gpu.stock > 0
    offered = gpu.price(cloud) is not None
    return {
        "id": gpu.id,
        "name": gpu.name,
        "pool": None,
        "manufacturer": "AMD" if gpu.id.startswith("AMD") else "NVIDIA",
        "memory": gpu.memory,
        "secure": gpu.secure,
        "community": gpu.community,
        "price": {
            "secure": gpu.secure_price if gpu.secure else 0.0,
            "community": gpu.community_price if gpu.community else 0.0,
        },
        "maxCount": {
            "secure": gpu.max_count if gpu.secure else 0,
            "community": gpu.max_count if gpu.community else 0,
        },
        "availability": "HIGH" if free and offered else "NONE",
    }


def _secret_row(secret: SimSecret) -> dict[str, Any]:
    return {
        "id": secret.id,
        "name": secret.name,
        "description": secret.description,
        "createdAt": _iso(secret.created_at),
        "valueLastUpdatedAt": _iso(secret.created_at),
    }


def _problem(
    status: int,
    detail: str,
    *,
    errors: list[str] | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    titles = {
        400: "Bad Request",
        401: "Unauthorized",
        403: "Forbidden",
        404: "Not Found",
        409: "Conflict",
        422: "Unprocessable Entity",
        429: "Too Many Requests",
    }
    body: dict[str, Any] = {
        "title": titles.get(status, "Internal Server Error" if status >= 500 else "Error"),
        "status": status,
        "detail": detail,
    }
    if errors:
        body["errors"] = errors
    return JSONResponse(
        body, status_code=status, headers=headers, media_type="application/problem+json"
    )


def _token(length: int) -> str:
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(length))


def _pod_id() -> str:
    return _token(14)


def _parse_iso(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def _iso(at: float, *, millis: bool = False) -> str:
    moment = datetime.fromtimestamp(at, UTC)
    if millis:
        return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")
