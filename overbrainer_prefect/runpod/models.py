"""What the Runpod API sends and answers: a pod request, a pod, an instant
cluster request and cluster, a GPU type, a data center, a secret.

The answers are read leniently (unknown fields are ignored, the v1 spellings
`costPerHr`, `desiredStatus`, `imageName` and `portMappings` are accepted
beside v2's `cost`, `status`, `image` and `ssh`), since Runpod's live answers
differ from its specification (research/runpod.md §2.3).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Literal, SupportsFloat, SupportsIndex, cast

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    field_validator,
    model_validator,
)

Cloud = Literal["SECURE", "COMMUNITY"]
"""Runpod's cloud tiers, as the API spells them."""

SECRET_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_.\-/]{0,190}$")
"""A Runpod secret name: letters, digits and `_.-/`, starting with a letter or
`_`, at most 191 characters; names starting with `runpod` are refused."""

ACTIVE_STATUSES = frozenset({"PROVISIONING", "STARTING", "RUNNING", "CREATED", "RESTARTING"})
"""Statuses of a pod that runs, or is about to: it bills compute."""


def secret_ref(name: str) -> str:
    """The pod environment value Runpod replaces with the account secret
    `name` when the pod boots: `{{ RUNPOD_SECRET_name }}`."""
    return f"{{{{ RUNPOD_SECRET_{name} }}}}"


def secret_name_problem(name: str) -> str | None:
    """One line saying why `name` cannot name a Runpod secret, or None."""
    if not SECRET_NAME.match(name):
        return (
            f"secret name {name!r} is not valid: use letters, digits and _.-/ (at most 191), "
            "starting with a letter or _"
        )
    if name.lower().startswith("runpod"):
        return f"secret name {name!r} starts with `runpod`, which Runpod reserves"
    return None


class SshEndpoint(BaseModel):
    """Where a pod's sshd answers: its public address and port."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    host: str
    port: int
    username: str = "root"


class Pod(BaseModel):
    """A pod as Runpod shows it.

    `status` is v2's (`PROVISIONING`, `STARTING`, `RUNNING`, `EXITED`, `ERROR`,
    `TERMINATED`; v1's `desiredStatus` otherwise); `cost_per_hr` is what the
    pod bills per hour, all GPUs together (0 once stopped); `ssh` is set once
    its `22/tcp` port is published (None while it starts).
    """

    model_config = ConfigDict(frozen=True, extra="ignore", populate_by_name=True)

    id: str
    name: str = ""
    status: str = "UNKNOWN"
    cost_per_hr: float | None = Field(default=None, alias="cost")
    gpu_type_id: str | None = None
    gpu_count: int = 0
    image: str = ""
    env: dict[str, str] = Field(default_factory=dict)
    ports: list[str] = Field(default_factory=list)
    data_center_id: str | None = Field(default=None, alias="dataCenterId")
    created_at: str | None = Field(default=None, alias="createdAt")
    started_at: str | None = Field(default=None, alias="startedAt")
    """When its container last started: it moves when the container restarts."""
    uptime_s: float | None = None
    """Seconds since its container last started (`runtime.uptime`), while it runs."""
    ssh: SshEndpoint | None = None
    cluster_id: str | None = None
    """The instant cluster it is a node of (`cluster.id`), None for a pod alone."""
    cluster_rank: int | None = None
    """Its rank in that cluster (`cluster.rank`; 0 is the primary)."""

    @model_validator(mode="before")
    @classmethod
    def _from_api(cls, data: object) -> object:
        if not isinstance(data, Mapping):
            return data
        return normalize_pod(data)

    @field_validator("env", mode="before")
    @classmethod
    def _env_strings(cls, env: object) -> dict[str, str]:
        if isinstance(env, Mapping):
            return {str(k): "" if v is None else str(v) for k, v in env.items()}
        if isinstance(env, list):  # GraphQL: [{key, value}]
            return {
                str(item.get("key")): str(item.get("value", ""))
                for item in env
                if isinstance(item, Mapping)
            }
        return {}

    @property
    def active(self) -> bool:
        """Whether the pod runs or is about to: it bills compute."""
        return self.status in ACTIVE_STATUSES


def normalize_pod(data: Mapping[str, object]) -> dict[str, object]:
    """A v1, v2 or GraphQL pod answer as the field names `Pod` reads."""
    out: dict[str, object] = dict(data)
    if "status" not in out and "desiredStatus" in out:
        out["status"] = out["desiredStatus"]
    if "cost" not in out:
        cost = out.get("costPerHr", out.get("adjustedCostPerHr"))
        if cost is not None:
            out["cost"] = cost
    if "image" not in out and "imageName" in out:
        out["image"] = out["imageName"]
    gpu = out.get("gpu")
    if isinstance(gpu, Mapping):
        out.setdefault("gpu_type_id", gpu.get("id"))
        out.setdefault("gpu_count", gpu.get("count", 1))
    else:
        if "gpuCount" in out:
            out.setdefault("gpu_count", out["gpuCount"])
        machine = out.get("machine")
        if isinstance(machine, Mapping) and machine.get("gpuTypeId"):
            out.setdefault("gpu_type_id", machine["gpuTypeId"])
    runtime = out.get("runtime")
    if isinstance(runtime, Mapping):
        uptime = runtime.get("uptime", runtime.get("uptimeInSeconds"))
        if isinstance(uptime, int | float):
            out.setdefault("uptime_s", float(uptime))
    if "startedAt" not in out and isinstance(out.get("lastStartedAt"), str):
        out["startedAt"] = out["lastStartedAt"]
    ports = out.get("ports")
    if ports is None:
        out["ports"] = []
    elif isinstance(ports, str):  # GraphQL: "22/tcp,8888/http"
        out["ports"] = [p.strip() for p in ports.split(",") if p.strip()]
    ssh = out.get("ssh")
    if not (isinstance(ssh, SshEndpoint) or (isinstance(ssh, Mapping) and "host" in ssh)):
        out["ssh"] = _ssh_endpoint(data)
    cluster = out.get("cluster")
    if isinstance(cluster, Mapping):
        out.setdefault("cluster_id", cluster.get("id"))
        out.setdefault("cluster_rank", cluster.get("rank"))
    return out


def _ssh_endpoint(data: Mapping[str, object]) -> dict[str, object] | None:
    """The direct SSH endpoint of a v2 pod (`ssh.direct`), else of a v1 pod
    (`publicIp` and `portMappings["22"]`), else from `runtime.ports`."""
    ssh = data.get("ssh")
    if isinstance(ssh, Mapping):
        direct = ssh.get("direct")
        if isinstance(direct, Mapping) and direct.get("host") and direct.get("port"):
            return {
                "host": direct["host"],
                "port": int(direct["port"]),
                "username": direct.get("username") or "root",
            }
    public_ip = data.get("publicIp")
    mappings = data.get("portMappings")
    if public_ip and isinstance(mappings, Mapping) and mappings.get("22"):
        return {"host": public_ip, "port": int(mappings["22"])}
    runtime = data.get("runtime")
    if isinstance(runtime, Mapping):
        for port in runtime.get("ports") or []:
            if not isinstance(port, Mapping):
                continue
            private = port.get("private", port.get("privatePort"))
            public = port.get("public", port.get("publicPort"))
            address = port.get("ip")
            if private == 22 and public and address and port.get("isIpPublic", True):
                return {"host": address, "port": int(public)}
    return None


class GpuType(BaseModel):
    """A GPU type of Runpod's catalog: its id (the one pods are created with),
    its VRAM and its list price per GPU and hour on each cloud."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    id: str
    display_name: str
    memory_gb: float
    secure: bool = True
    community: bool = True
    secure_price: float | None = None
    community_price: float | None = None
    max_count_secure: int | None = None
    max_count_community: int | None = None
    availability: str | None = None
    """`NONE`, `LOW`, `MEDIUM` or `HIGH` when the catalog said; stock is a hint,
    never a reservation."""

    def price(self, cloud: Cloud) -> float | None:
        """The list price of one GPU per hour on `cloud`; None when the type is
        not offered there or has no price."""
        if cloud == "SECURE":
            offered, price = self.secure, self.secure_price
        else:
            offered, price = self.community, self.community_price
        if not offered or price is None or price <= 0:
            return None
        return price

    def max_count(self, cloud: Cloud) -> int | None:
        """The most GPUs of this type one pod may have on `cloud`, when known."""
        return self.max_count_secure if cloud == "SECURE" else self.max_count_community

    @classmethod
    def from_catalog(cls, row: Mapping[str, JsonValue]) -> GpuType:
        """A row of REST v2's `GET /catalog/gpus`. Raises KeyError for a row
        without an `id`, TypeError or ValueError for a `memory` that is no number."""
        price = _object(row.get("price"))
        max_count = _object(row.get("maxCount"))
        return cls(
            id=str(row["id"]),
            display_name=str(row.get("name") or row["id"]),
            memory_gb=_float(row.get("memory") or 0),
            secure=bool(row.get("secure", True)),
            community=bool(row.get("community", True)),
            secure_price=_number(price.get("secure")),
            community_price=_number(price.get("community")),
            max_count_secure=_integer(max_count.get("secure")),
            max_count_community=_integer(max_count.get("community")),
            availability=cast(str | None, row.get("availability")),
        )

    @classmethod
    def from_graphql(cls, row: Mapping[str, JsonValue]) -> GpuType:
        """A row of GraphQL's `gpuTypes`, read as the row of REST v2's catalog
        it stands for; raises as `from_catalog` does."""
        lowest = row.get("lowestPrice") or {}
        stock = lowest.get("stockStatus") if isinstance(lowest, Mapping) else None
        max_count = row.get("maxGpuCount")
        return cls.from_catalog(
            {
                "id": row["id"],
                "name": row.get("displayName"),
                "memory": row.get("memoryInGb"),
                "secure": row.get("secureCloud", True),
                "community": row.get("communityCloud", True),
                "price": {"secure": row.get("securePrice"), "community": row.get("communityPrice")},
                "maxCount": {"secure": max_count, "community": max_count},
                "availability": str(stock).upper() if stock else None,
            }
        )


class DataCenter(BaseModel):
    """A Runpod data center (`EU-RO-1`)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    id: str
    name: str = ""


class Secret(BaseModel):
    """An account secret as Runpod shows it: never its value."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    id: str
    name: str


class NetworkVolume(BaseModel):
    """A network volume as REST v2 shows it: its size in GB and its data center."""

    model_config = ConfigDict(frozen=True, extra="ignore", populate_by_name=True)

    id: str
    name: str = ""
    size: int = Field(ge=0, description="GB.")
    data_center: str | None = Field(default=None, alias="dataCenterId")

    @model_validator(mode="before")
    @classmethod
    def _v2_names(cls, data: object) -> object:
        """REST v2 names the data center `dataCenter`; v1 `dataCenterId`."""
        if isinstance(data, Mapping) and "dataCenter" in data and "dataCenterId" not in data:
            data = {**data, "dataCenterId": data["dataCenter"]}
        return data


class PodRequest(BaseModel):
    """A pod to create, as REST v2's `POST /pods` takes it.

    `name` must be unique to this attempt: after an ambiguous answer (a 5xx or
    a timeout) the client looks the pod up by it before it tries again. `env`
    values may reference account secrets with `secret_ref(name)`.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1, max_length=191)
    image: str = Field(min_length=1)
    gpu_type_id: str = Field(min_length=1)
    gpu_count: int = Field(default=1, ge=1)
    cloud: Cloud = "SECURE"
    container_disk_gb: int = Field(default=50, ge=1)
    env: dict[str, str] = Field(default_factory=dict)
    ports: list[str] = Field(default_factory=lambda: ["22/tcp"])
    data_center_ids: list[str] = Field(default_factory=list)
    network_volume_id: str | None = None
    network_volume_path: str = "/workspace"
    volume_gb: int | None = Field(default=None, ge=10)
    volume_path: str = "/workspace"
    args: str | None = None
    """The container's start command, one shell-quoted string (REST v2's only
    start-command field, "arguments passed to the container entrypoint"; the
    image's CMD when it has no ENTRYPOINT)."""

    def to_api(self) -> dict[str, JsonValue]:
        """The JSON body of REST v2's `POST /pods`."""
        body: dict[str, JsonValue] = {
            "name": self.name,
            "image": self.image,
            "gpu": {"id": self.gpu_type_id, "count": self.gpu_count},
            "cloud": self.cloud,
            "disk": self.container_disk_gb,
            "env": {key: value for key, value in self.env.items()},
            "ports": [port for port in self.ports],
        }
        if self.data_center_ids:
            body["dataCenterIds"] = [center for center in self.data_center_ids]
        if self.network_volume_id:
            body["mounts"] = {
                "network": [{"volumeId": self.network_volume_id, "path": self.network_volume_path}]
            }
        elif self.volume_gb:
            body["mounts"] = {"persistent": {"size": self.volume_gb, "path": self.volume_path}}
        if self.args is not None:
            body["args"] = self.args
        return body


CLUSTER_PODS = (2, 8)
"""The pods of a self-serve instant cluster: at least, at most."""


class ClusterRequest(BaseModel):
    """An instant cluster to create, as REST v2's `POST /clusters` takes it:
    `pod_count` pods of `gpu_count_per_pod` GPUs each on one private network,
    every pod with the same image, start command and `env` (Runpod adds each
    node's `NODE_RANK`, `NODE_ADDR`, `PRIMARY_ADDR`...). `name` must be
    unique to this attempt, as a pod's (a create with no clear answer is
    looked up by it)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1, max_length=191)
    image: str = Field(min_length=1)
    gpu_type_id: str = Field(min_length=1)
    gpu_count_per_pod: int = Field(default=1, ge=1)
    pod_count: int = Field(ge=CLUSTER_PODS[0], le=CLUSTER_PODS[1])
    type: Literal["TRAINING"] = "TRAINING"
    container_disk_gb: int = Field(default=50, ge=1)
    env: dict[str, str] = Field(default_factory=dict)
    ports: list[str] = Field(default_factory=lambda: ["22/tcp"])
    data_center_ids: list[str] = Field(default_factory=list)
    args: str | None = None

    def to_api(self) -> dict[str, JsonValue]:
        """The JSON body of REST v2's `POST /clusters`."""
        body: dict[str, JsonValue] = {
            "name": self.name,
            "type": self.type,
            "compute": {
                "gpuTypeId": self.gpu_type_id,
                "gpuCountPerPod": self.gpu_count_per_pod,
                "podCount": self.pod_count,
            },
            "image": self.image,
            "disk": self.container_disk_gb,
            "env": {key: value for key, value in self.env.items()},
            "ports": [port for port in self.ports],
        }
        if self.data_center_ids:
            body["dataCenterIds"] = [center for center in self.data_center_ids[:1]]
        if self.args is not None:
            body["args"] = self.args
        return body


class Cluster(BaseModel):
    """An instant cluster as Runpod shows it: its private network (`cidr`),
    its primary pod (rank 0) and, when the answer lists them, its pods."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    id: str
    name: str = ""
    status: str = "UNKNOWN"
    cidr: str | None = None
    primary_pod_id: str | None = None
    pods: list[Pod] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _from_api(cls, data: object) -> object:
        if not isinstance(data, Mapping):
            return data
        out: dict[str, object] = dict(data)
        network, primary = out.get("network"), out.get("primary")
        if isinstance(network, Mapping):
            out.setdefault("cidr", network.get("cidr"))
        if isinstance(primary, Mapping):
            out.setdefault("primary_pod_id", primary.get("podId"))
        if out.get("pods") is None:
            out["pods"] = []
        return out


def _object(value: JsonValue) -> Mapping[str, JsonValue]:
    """A JSON object of an answer; an empty one for null (or another falsy value)."""
    return cast(Mapping[str, JsonValue], value or {})


def _float(value: JsonValue) -> float:
    """`float(value)`: TypeError or ValueError when the answer's value is no number."""
    return float(cast(SupportsFloat | str, value))


def _number(value: JsonValue) -> float | None:
    try:
        return None if value is None else _float(value)
    except (TypeError, ValueError):
        return None


def _integer(value: JsonValue) -> int | None:
    try:
        return None if value is None else int(cast(SupportsIndex | str, value))
    except (TypeError, ValueError):
        return None
