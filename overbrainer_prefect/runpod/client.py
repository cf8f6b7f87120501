"""The Runpod API client: pods, the GPU catalog, data centers and account
secrets, over REST v2 (`https://api.runpod.io/v2`), with GraphQL's `gpuTypes`
as the catalog of last resort.

It never imports Prefect. Every request carries an explicit User-Agent and
the key only in its `Authorization` header; no error or log line ever holds
the key, a secret's value or an answer's body (see `errors`).

What it does for the caller:

- 429 is waited out as `Retry-After` says, within a bounded total wait;
- a 5xx or a lost answer is retried a bounded number of times, except on a
  create: there the pod is first looked up by its unique name, since Runpod
  has created billing pods while answering 500; exactly one pod of that name
  is left;
- Runpod's capacity refusal raises `NoCapacity`, so the caller moves to its
  next GPU type;
- a 404 on a look is `None`, and on a delete "already gone" (`False`).

    async with RunpodClient(api_key) as client:
        pod = await client.create_pod(PodRequest(name="ob-r1-a1", image=..., gpu_type_id=...))
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import ssl
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from types import TracebackType
from typing import Generic, Protocol, TypeVar
from urllib.parse import quote

import httpx
from pydantic import JsonValue, SecretStr

from overbrainer_prefect import __version__
from overbrainer_prefect.runpod.errors import (
    NoCapacity,
    RunpodError,
    is_capacity_text,
    short_detail,
)
from overbrainer_prefect.runpod.models import (
    Cloud,
    Cluster,
    ClusterRequest,
    DataCenter,
    GpuType,
    NetworkVolume,
    Pod,
    PodRequest,
    Secret,
    secret_name_problem,
)

log = logging.getLogger(__name__)

_Row = TypeVar("_Row")  # what a catalog row is read as

DEFAULT_REST_URL = "https://api.runpod.io/v2"
"""REST v2: pods, secrets, catalog. (REST v1 answers 410 since 2026-11-15.)"""

DEFAULT_GRAPHQL_URL = "https://api.runpod.io/graphql"
"""GraphQL: only its `gpuTypes` and `dataCenters`, when the v2 catalog is missing."""

USER_AGENT = f"overbrainer-prefect/{__version__}"
"""Sent on every request: Cloudflare refuses some default client agents (403, 1010)."""

LOGS_READ_S = 5.0  # seconds a pod's log stream is read: it may stay open for new lines
MAX_PAGES = 100  # pages of a pod list followed at most: a cursor that never ends is a bug
GPU_TYPES_QUERY = (
    "query GpuTypes { gpuTypes { id displayName memoryInGb secureCloud communityCloud "
    "securePrice communityPrice maxGpuCount } }"
)
DATA_CENTERS_QUERY = "query DataCenters { dataCenters { id name } }"


@dataclass(frozen=True)
class RetryPolicy:
    """How long the client keeps trying before it gives up.

    `attempts` tries of a call that may be repeated (a look, a list, a delete),
    `backoff_s` before the second (doubled each time, at most `max_backoff_s`);
    429s are waited out for `rate_limit_budget_s` in all, one `Retry-After`
    above `max_retry_after_s` is not waited; a create is sent at most
    `create_attempts` times, each ambiguous answer (a 5xx, a lost answer)
    followed by looks for the pod by name, `reconcile_interval_s` apart, for
    `reconcile_window_s` (and at least `reconcile_looks` looks): Runpod's pod
    list may lag a create by tens of seconds, and a create sent again while
    the list still hides the first pod would leave two billing.
    """

    attempts: int = 4
    backoff_s: float = 0.5
    max_backoff_s: float = 8.0
    rate_limit_budget_s: float = 120.0
    max_retry_after_s: float = 60.0
    create_attempts: int = 3
    reconcile_looks: int = 3
    reconcile_interval_s: float = 2.0
    reconcile_window_s: float = 60.0  # a list ~20 s behind a create was seen: three times that

    def backoff(self, failures: int) -> float:
        """Seconds to wait after the `failures`-th failure in a row."""
        return float(min(self.max_backoff_s, self.backoff_s * (2 ** max(0, failures - 1))))


@functools.cache
def tls_context() -> ssl.SSLContext:
    """The TLS context of every Runpod client of this process: httpx's default
    (the CA bundle of SSL_CERT_FILE or SSL_CERT_DIR when set, else certifi's),
    made once. Each client made its own before: loading the bundle took about
    20 ms of a core, and a client is made for each look at the account."""
    return httpx.create_ssl_context()


class RunpodClient:
    """An async client of the Runpod API for one account key.

    `rest_url` and `graphql_url` default to Runpod's; tests and private
    gateways point them elsewhere. `transport` replaces httpx's network
    transport (tests only). Close it with `aclose()`, or use it as an async
    context manager. Raises ValueError when the key is empty.
    """

    def __init__(
        self,
        api_key: SecretStr,
        rest_url: str = DEFAULT_REST_URL,
        graphql_url: str = DEFAULT_GRAPHQL_URL,
        transport: httpx.AsyncBaseTransport | None = None,
        *,
        retry: RetryPolicy | None = None,
        timeout_s: float = 30.0,
    ) -> None:
        key = api_key.get_secret_value().strip()
        if not key:
            raise ValueError(
                "the Runpod API key is empty: set api_key in the RunpodCredentials block"
            )
        self.rest_url = rest_url.rstrip("/")
        self.graphql_url = graphql_url
        self._key = SecretStr(key)
        self.retry = retry or RetryPolicy()
        self._secrets: set[str] = {key, api_key.get_secret_value()}
        self._http = httpx.AsyncClient(
            headers={
                "Authorization": f"Bearer {key}",
                "User-Agent": USER_AGENT,
                "Accept": "application/json",
            },
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0)),
            transport=transport,
            follow_redirects=False,
            verify=tls_context(),
        )

    def credentials(self) -> tuple[SecretStr, str, str]:
        """The account key and the REST and GraphQL URLs this client uses: for
        a process of its own that must reach the same account (the reaper)."""
        return self._key, self.rest_url, self.graphql_url

    async def __aenter__(self) -> RunpodClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Closes the connections."""
        await self._http.aclose()

    # Pods

    async def create_pod(self, request: PodRequest) -> Pod:
        """Creates the pod `request` describes, and returns it as Runpod shows it.

        After a 5xx or a lost answer, the pod is looked up by its name before
        the create is sent again; when a retry succeeds, any other pod of the
        same name is deleted, so exactly one pod of that name is left.

        Raises NoCapacity when Runpod has no machine for the GPU type, and
        RunpodError for any other refusal, or when Runpod stays unreachable
        (its hint then says a pod of that name may exist).
        """
        return await self._create_one(
            self._pods, request.name, request.to_api(), request.gpu_type_id, request.gpu_type_id
        )

    async def get_pod(self, pod_id: str) -> Pod | None:
        """The pod `pod_id`, or None when Runpod answers 404 (it may still exist:
        a pod just created or deleted can answer 404 for a while; see
        `deletion.look_up`). Raises RunpodError on any other failure."""
        response = await self._request("GET", self._url(f"/pods/{_segment(pod_id)}"))
        if response.status_code == 404:
            return None
        if response.status_code != 200:
            raise self._error(response)
        return Pod.model_validate(self._json(response))

    async def list_pods(self) -> list[Pod]:
        """Every pod of the account (all pages). Raises RunpodError on failure."""
        pods: list[Pod] = []
        params: dict[str, str] = {}
        for _ in range(MAX_PAGES):
            response = await self._request("GET", self._url("/pods"), params=params or None)
            if response.status_code != 200:
                raise self._error(response)
            data = self._json(response)
            rows = _rows(data, "pods")
            pods.extend(Pod.model_validate(row) for row in rows if isinstance(row, Mapping))
            page = data.get("pagination") if isinstance(data, Mapping) else None
            if not isinstance(page, Mapping):
                return pods
            cursor = page.get("nextCursor")
            if not cursor or not page.get("hasNextPage", True):
                return pods
            params = {"cursor": str(cursor)}
        raise RunpodError(200, "endless pod list", f"stopped after {MAX_PAGES} pages")

    async def pod_logs(self, pod_id: str, source: str = "container", tail: int = 20) -> list[str]:
        """The last `tail` lines of the pod's log: what its start command printed
        (`container`) or what Runpod did with its container (`system`), from
        `GET /pods/{id}/logs` (Server-Sent Events, read until the answer ends
        or `LOGS_READ_S` passed). Empty when the pod has no such log (404).
        Raises RunpodError on any other failure."""
        url = self._url(f"/pods/{_segment(pod_id)}/logs")
        params = {"source": source, "tail": str(tail)}
        lines: list[str] = []
        try:
            async with asyncio.timeout(LOGS_READ_S):
                async with self._http.stream(
                    "GET", url, params=params, headers={"Accept": "text/event-stream"}
                ) as response:
                    if response.status_code == 404:
                        return []
                    if response.status_code != 200:
                        await response.aread()
                        raise self._error(response)
                    async for line in response.aiter_lines():
                        text = _event_line(line)
                        if text is not None:
                            lines.append(short_detail(text, self._secrets, limit=300))
        except TimeoutError:
            pass  # a stream that stays open: what came is what there is
        except httpx.TransportError as exc:
            if not lines:
                raise _transport_error(exc) from None
        return lines[-tail:] if tail > 0 else lines

    async def pods_named(self, name: str) -> list[Pod]:
        """The pods of the account named exactly `name`."""
        return [pod for pod in await self.list_pods() if pod.name == name]

    async def delete_pod(self, pod_id: str) -> bool:
        """Deletes the pod `pod_id`: True when this call deleted it, False when it
        was already gone (Runpod's 404), which is success too. The deletion is
        not confirmed here: see `deletion.confirm_deleted`. Raises RunpodError
        when Runpod refuses or stays unreachable."""
        response = await self._request("DELETE", self._url(f"/pods/{_segment(pod_id)}"))
        if response.status_code in (200, 202, 204):
            log.info("deleted pod %s", pod_id)
            return True
        if response.status_code == 404 or "not found to terminate" in response.text.lower():
            log.info("pod %s was already gone", pod_id)
            return False
        raise self._error(response)

    # Instant clusters

    async def create_cluster(self, request: ClusterRequest) -> Cluster:
        """Creates the instant cluster `request` describes (all its pods at
        once), and returns it as Runpod shows it.

        As for a pod, after a 5xx or a lost answer the cluster is looked up by
        its name before the create is sent again, and any other cluster of
        that name is deleted: exactly one cluster of that name is left.

        Raises NoCapacity when Runpod cannot place the cluster on the GPU
        type, and RunpodError for any other refusal, or when Runpod stays
        unreachable (its hint then says a cluster of that name may exist).
        """
        return await self._create_one(
            self._clusters,
            request.name,
            request.to_api(),
            request.gpu_type_id,
            f"{request.gpu_type_id} ({request.pod_count} pods)",
        )

    async def get_cluster(self, cluster_id: str) -> Cluster | None:
        """The cluster `cluster_id`, or None when Runpod answers 404. Raises
        RunpodError on any other failure."""
        response = await self._request("GET", self._url(f"/clusters/{_segment(cluster_id)}"))
        if response.status_code == 404:
            return None
        if response.status_code != 200:
            raise self._error(response)
        return Cluster.model_validate(self._json(response))

    async def list_clusters(self) -> list[Cluster]:
        """Every instant cluster of the account. Raises RunpodError on failure."""
        response = await self._request("GET", self._url("/clusters"))
        if response.status_code != 200:
            raise self._error(response)
        rows = _rows(self._json(response), "clusters")
        return [Cluster.model_validate(row) for row in rows if isinstance(row, Mapping)]

    async def cluster_pods(self, cluster_id: str) -> list[Pod]:
        """The pods of the cluster `cluster_id`, by rank (rank 0, the primary,
        first); empty when Runpod answers 404. Raises RunpodError on any other
        failure."""
        response = await self._request("GET", self._url(f"/clusters/{_segment(cluster_id)}/pods"))
        if response.status_code == 404:
            return []
        if response.status_code != 200:
            raise self._error(response)
        rows = _rows(self._json(response), "pods")
        pods = [Pod.model_validate(row) for row in rows if isinstance(row, Mapping)]
        return sorted(pods, key=lambda pod: pod.cluster_rank if pod.cluster_rank is not None else 0)

    async def delete_cluster(self, cluster_id: str) -> bool:
        """Deletes the cluster `cluster_id`, every pod of it: True when this
        call deleted it, False when it was already gone (404), which is success
        too. The pods' deletion is not confirmed here (see
        `deletion.confirm_deleted`, for each). Raises RunpodError when Runpod
        refuses or stays unreachable."""
        response = await self._request("DELETE", self._url(f"/clusters/{_segment(cluster_id)}"))
        if response.status_code in (200, 202, 204):
            log.info("deleted cluster %s", cluster_id)
            return True
        if response.status_code == 404:
            log.info("cluster %s was already gone", cluster_id)
            return False
        raise self._error(response)

    # Billing

    async def pod_billing(self, start: datetime, end: datetime | None = None) -> dict[str, float]:
        """What Runpod billed each pod (by id) from `start` to `end` (default
        now): REST v2's `/billing/pods`, day buckets grouped by pod, their
        `totalAmount` (GPU, CPU and disk) summed. Raises RunpodError when the
        account does not answer it (404, 405 or 410 included)."""
        params = {
            "bucketSize": "day",
            "grouping": "podId",
            "startTime": start.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        }
        if end is not None:
            params["endTime"] = end.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        response = await self._request("GET", self._url("/billing/pods"), params=params)
        if response.status_code != 200:
            raise self._error(response)
        data = self._json(response)
        billed: dict[str, float] = {}
        for row in _rows(data, "records"):
            if not isinstance(row, Mapping) or not row.get("podId"):
                continue
            amount = row.get("totalAmount", row.get("amount", 0.0))
            if isinstance(amount, int | float):
                pod_id = str(row["podId"])
                billed[pod_id] = billed.get(pod_id, 0.0) + float(amount)
        return billed

    # Catalog

    async def gpu_types(self, cloud: Cloud = "SECURE", gpu_count: int = 1) -> list[GpuType]:
        """The GPU types of Runpod's catalog with their VRAM, prices and stock on
        `cloud` for pods of `gpu_count` GPUs: REST v2's `/catalog/gpus`, or
        GraphQL's `gpuTypes` when that answers 404, 405 or 410. Raises
        RunpodError on failure."""
        params = {"include": "AVAILABILITY", "product": "POD", "cloud": cloud}
        params["count"] = str(gpu_count)
        response = await self._request("GET", self._url("/catalog/gpus"), params=params)
        if response.status_code == 400:  # availability filters refused: the plain list
            response = await self._request("GET", self._url("/catalog/gpus"))
        return await self._catalog(
            response,
            ("gpus", GpuType.from_catalog),
            (GPU_TYPES_QUERY, "gpuTypes", GpuType.from_graphql),
        )

    async def data_centers(self) -> list[DataCenter]:
        """Runpod's data centers (REST v2's `/catalog/datacenters`, or GraphQL's
        `dataCenters`). Raises RunpodError on failure."""
        response = await self._request("GET", self._url("/catalog/datacenters"))
        return await self._catalog(
            response,
            ("dataCenters", DataCenter.model_validate),
            (DATA_CENTERS_QUERY, "dataCenters", DataCenter.model_validate),
        )

    # Secrets

    async def create_secret(
        self, name: str, value: SecretStr, description: str | None = None
    ) -> Secret:
        """Creates the account secret `name` holding `value`, for pods to read
        through `models.secret_ref(name)`. Raises ValueError for a name Runpod
        refuses, RunpodError when Runpod refuses (409: the name is taken) or
        stays unreachable; after an ambiguous answer, a 409 means this
        client's own earlier try created it."""
        problem = secret_name_problem(name)
        if problem:
            raise ValueError(problem)
        raw = value.get_secret_value()
        self._secrets.add(raw)
        body: dict[str, JsonValue] = {"name": name, "value": raw}
        if description:
            body["description"] = description
        url = self._url("/account/secrets")
        ambiguous = False
        for attempt in range(1, self.retry.attempts + 1):
            try:
                response = await self._request("POST", url, json=body, retry=False)
            except RunpodError as error:
                if error.status is not None or attempt == self.retry.attempts:
                    raise
                ambiguous = True
                await asyncio.sleep(self.retry.backoff(attempt))
                continue
            if response.status_code in (200, 201):
                return Secret.model_validate(self._json(response))
            if response.status_code == 409 and ambiguous:
                for secret in await self.list_secrets(name):
                    if secret.name == name:
                        return secret
            if response.status_code < 500 or attempt == self.retry.attempts:
                hint = f"a secret named {name} exists: delete it first, or use another name"
                raise self._error(response, hint=hint if response.status_code == 409 else None)
            ambiguous = True
            await asyncio.sleep(self.retry.backoff(attempt))
        raise RunpodError(None, "no answer", "cannot create the secret")  # not reached

    async def list_secrets(self, name: str | None = None) -> list[Secret]:
        """The account's secrets (their names, never their values); only the one
        named `name` when given. Raises RunpodError on failure."""
        params = {"name": name} if name else None
        response = await self._request("GET", self._url("/account/secrets"), params=params)
        if response.status_code != 200:
            raise self._error(response)
        data = self._json(response)
        rows = _rows(data, "secrets")
        return [Secret.model_validate(row) for row in rows if isinstance(row, Mapping)]

    async def delete_secret(self, name: str) -> bool:
        """Deletes the account secret `name`: True when this call deleted it,
        False when there was none. Raises RunpodError on failure."""
        deleted = False
        for secret in await self.list_secrets(name):
            if secret.name != name:
                continue
            url = self._url(f"/account/secrets/{_segment(secret.id)}")
            response = await self._request("DELETE", url)
            if response.status_code in (200, 202, 204):
                deleted = True
            elif response.status_code != 404:
                raise self._error(response)
        return deleted

    # Network volumes

    async def get_network_volume(self, volume_id: str) -> NetworkVolume | None:
        """The network volume `volume_id`, or None when Runpod answers 404.
        Raises RunpodError on any other failure."""
        url = self._url(f"/network-volumes/{_segment(volume_id)}")
        response = await self._request("GET", url)
        if response.status_code == 404:
            return None
        if response.status_code != 200:
            raise self._error(response)
        return NetworkVolume.model_validate(self._json(response))

    async def grow_network_volume(self, volume_id: str, size_gb: int) -> NetworkVolume:
        """Grows the network volume `volume_id` to `size_gb` GB (a volume only
        grows; it bills by its size from then on). Raises RunpodError when
        Runpod refuses (a smaller size, the volume gone)."""
        url = self._url(f"/network-volumes/{_segment(volume_id)}")
        response = await self._request("PATCH", url, json={"size": size_gb}, retry=False)
        if response.status_code != 200:
            raise self._error(response)
        return NetworkVolume.model_validate(self._json(response))

    # Plumbing

    def _url(self, path: str) -> str:
        return f"{self.rest_url}{path}"

    async def _request(
        self,
        method: str,
        url: str,
        *,
        json: JsonValue = None,
        params: Mapping[str, str] | None = None,
        retry: bool = True,
    ) -> httpx.Response:
        """Sends one request. 429 is waited out (`Retry-After`, within the
        budget) even when `retry` is off: Runpod answers it before doing
        anything. With `retry`, a 5xx or a lost answer is tried again.

        Raises RunpodError (status None) when no answer came and no retry is
        left, and RunpodError 429 when the rate-limit budget is spent."""
        policy = self.retry
        rate_waited = 0.0
        failures = 0
        what = f"{method} {_path(url)}"
        while True:
            try:
                response = await self._http.request(method, url, json=json, params=params)
            except httpx.TransportError as exc:
                failures += 1
                error = _transport_error(exc)
                if not retry or failures >= policy.attempts:
                    raise error from None
                wait = policy.backoff(failures)
                log.warning("%s: %s; trying again in %.1f s", what, error, wait)
                await asyncio.sleep(wait)
                continue
            status = response.status_code
            log.debug("%s -> %d", what, status)
            if status == 429:
                asked = _retry_after(response)
                wait = policy.backoff(failures + 1) if asked is None else asked
                if (
                    wait > policy.max_retry_after_s
                    or rate_waited + wait > policy.rate_limit_budget_s
                ):
                    raise self._error(
                        response,
                        hint=f"rate limited for {rate_waited + wait:.0f} s: try again later",
                    )
                rate_waited += wait
                log.warning("%s: rate limited; waiting %.1f s as Runpod asks", what, wait)
                await asyncio.sleep(wait)
                continue
            if status >= 500 and retry and failures + 1 < policy.attempts:
                failures += 1
                wait = policy.backoff(failures)
                log.warning("%s: Runpod answered %d; trying again in %.1f s", what, status, wait)
                await asyncio.sleep(wait)
                continue
            return response

    async def _catalog(
        self,
        response: httpx.Response,
        rest: tuple[str, Callable[[Mapping[str, JsonValue]], _Row]],
        graphql: tuple[str, str, Callable[[Mapping[str, JsonValue]], _Row]],
    ) -> list[_Row]:
        """The rows of a REST v2 catalog `response` (the list under `rest`'s
        key, each read by its function), or, when it answered 404, 405 or 410,
        those of GraphQL's query (`graphql`: the query, its field, and how a
        row is read), the rows without an id left out. Raises RunpodError
        when either answer is an error."""
        if response.status_code in (404, 405, 410):
            query, field, read_graphql = graphql
            rows = await self._graphql(query, field)
            return [read_graphql(row) for row in rows if row.get("id")]
        if response.status_code != 200:
            raise self._error(response)
        key, read = rest
        found = _rows(self._json(response), key)
        return [read(row) for row in found if isinstance(row, Mapping)]

    async def _graphql(self, query: str, field: str) -> list[Mapping[str, JsonValue]]:
        """The list `data.<field>` of a GraphQL `query`; GraphQL's errors come
        with status 200 and raise RunpodError."""
        response = await self._request("POST", self.graphql_url, json={"query": query})
        if response.status_code != 200:
            raise self._error(response)
        data = self._json(response)
        errors = data.get("errors") if isinstance(data, Mapping) else None
        if errors:
            first = errors[0] if isinstance(errors, list) else errors
            message = str(first.get("message", "")) if isinstance(first, Mapping) else ""
            raise RunpodError(
                200,
                "GraphQL error",
                "check the API key and the graphql_url of the RunpodCredentials block",
                detail=short_detail(message, self._secrets),
            )
        inner = data.get("data") if isinstance(data, Mapping) else None
        rows = _rows(inner, field) if isinstance(inner, Mapping) else []
        return [row for row in rows if isinstance(row, Mapping)]

    def _json(self, response: httpx.Response) -> JsonValue:
        """The JSON of a 2xx answer; RunpodError when it is not JSON."""
        try:
            answer: JsonValue = response.json()
            return answer
        except ValueError:
            raise RunpodError(
                response.status_code,
                "unreadable answer",
                "Runpod's answer is not JSON: check the RunpodCredentials URLs",
            ) from None

    def _error(
        self,
        response: httpx.Response,
        *,
        gpu_type: str | None = None,
        hint: str | None = None,
    ) -> RunpodError:
        """The error of a failed answer: NoCapacity for Runpod's capacity text
        on a create (`gpu_type` given), else RunpodError with the status."""
        detail = short_detail(_problem_text(response), self._secrets)
        if gpu_type is not None and response.status_code in (400, 500) and is_capacity_text(detail):
            return NoCapacity(gpu_type, response.status_code, detail=detail)
        retry_after = _retry_after(response) if response.status_code == 429 else None
        return RunpodError.for_status(
            response.status_code, detail=detail, retry_after=retry_after, hint=hint
        )

    @property
    def _pods(self) -> _Kind[Pod]:
        async def live(name: str) -> list[Pod]:
            return [pod for pod in await self.pods_named(name) if pod.status != "TERMINATED"]

        return _Kind("pod", "/pods", Pod.model_validate, live, self.delete_pod)

    @property
    def _clusters(self) -> _Kind[Cluster]:
        async def named(name: str) -> list[Cluster]:
            return [cluster for cluster in await self.list_clusters() if cluster.name == name]

        return _Kind("cluster", "/clusters", Cluster.model_validate, named, self.delete_cluster)

    async def _create_one(
        self, kind: _Kind[_Thing], name: str, body: JsonValue, gpu_type_id: str, where: str
    ) -> _Thing:
        """Creates one `kind` named `name` (a pod, a cluster) and returns it.

        After a 5xx or a lost answer, the thing is looked up by its name
        (`_reconcile`) before the create is sent again, and when a retry
        succeeds the other things of that name are deleted: exactly one of
        that name is left. Raises NoCapacity when Runpod has no machine for
        `gpu_type_id`, and RunpodError for any other refusal, or when Runpod
        stays unreachable (its hint then says one of that name may exist).
        """
        ambiguous = 0
        while True:
            capacity_detail = ""
            try:
                response = await self._request("POST", self._url(kind.path), json=body, retry=False)
            except RunpodError as error:
                if error.status is not None:
                    raise
                last: RunpodError = error
            else:
                if response.status_code in (200, 201):
                    made = kind.parse(self._json(response))
                    if ambiguous:
                        await self._delete_twins(kind, name, keep=made.id)
                    log.info("created %s %s (%s) on %s", kind.word, made.id, made.name, where)
                    return made
                last = self._error(response, gpu_type=gpu_type_id)
                if response.status_code < 500:
                    raise last
                if isinstance(last, NoCapacity):
                    capacity_detail = last.detail
            ambiguous += 1
            found = await self._reconcile(kind, name, last)
            if found is not None:
                log.warning(
                    "%s to the create of %s %s, but the %s exists: %s",
                    last.run_message,
                    kind.word,
                    name,
                    kind.word,
                    found.id,
                )
                return found
            if capacity_detail:
                raise NoCapacity(gpu_type_id, 500, detail=capacity_detail)
            if ambiguous >= self.retry.create_attempts:
                raise RunpodError(
                    last.status,
                    last.reason,
                    f"no {kind.word} named {name} shows after {ambiguous} tries: try again "
                    "later, and check with the pods flow that no pod of the run is left",
                    detail=last.detail,
                )
            wait = self.retry.backoff(ambiguous)
            log.warning(
                "%s to the create of %s %s, which does not show; sending it again in %.1f s",
                last.run_message,
                kind.word,
                name,
                wait,
            )
            await asyncio.sleep(wait)

    async def _reconcile(self, kind: _Kind[_Thing], name: str, cause: RunpodError) -> _Thing | None:
        """The `kind` named `name` after an ambiguous create, looked for until
        the reconcile window has passed (lists can lag behind a create); the
        others of that name are deleted. Raises RunpodError when they cannot be
        listed: sending the create again could then leave two."""
        policy = self.retry
        loop = asyncio.get_running_loop()
        until = loop.time() + policy.reconcile_window_s
        look = 0
        while look < policy.reconcile_looks or loop.time() < until:
            if look:
                await asyncio.sleep(policy.reconcile_interval_s)
            look += 1
            try:
                named = await kind.named(name)
            except RunpodError as error:
                raise RunpodError(
                    cause.status,
                    cause.reason,
                    f"the create of {kind.word} {name} got no clear answer and the "
                    f"{kind.word}s cannot be listed ({error.run_message}): a {kind.word} of "
                    "that name may exist; check with the pods flow",
                    detail=cause.detail,
                ) from None
            if named:
                await self._delete_twins(kind, name, keep=named[0].id, listed=named)
                return named[0]
        return None

    async def _delete_twins(
        self, kind: _Kind[_Thing], name: str, keep: str, listed: list[_Thing] | None = None
    ) -> None:
        """Deletes every `kind` named `name` but `keep`: earlier tries of one create."""
        for twin in listed if listed is not None else await kind.named(name):
            if twin.id != keep:
                log.warning(
                    "deleting %s %s, a second %s named %s", kind.word, twin.id, kind.word, name
                )
                await kind.delete(twin.id)


class _Named(Protocol):
    """What `_create_one` needs of what it creates."""

    @property
    def id(self) -> str: ...

    @property
    def name(self) -> str: ...


_Thing = TypeVar("_Thing", bound=_Named)


@dataclass(frozen=True)
class _Kind(Generic[_Thing]):
    """What a create of exactly one thing of a name needs to know of its kind."""

    word: str  # "pod", "cluster": in log lines and messages
    path: str  # the REST path its create is POSTed to
    parse: Callable[[JsonValue], _Thing]
    named: Callable[[str], Awaitable[list[_Thing]]]  # the live ones of a name
    delete: Callable[[str], Awaitable[bool]]


def _segment(value: str) -> str:
    """`value` as one URL path segment."""
    return quote(value, safe="")


def _path(url: str) -> str:
    """The path of `url`, for log lines (never its query: it may hold a name)."""
    return httpx.URL(url).path


def _event_line(line: str) -> str | None:
    """The text of one line of a log stream: an SSE `data:` field (its JSON
    `message` or `line` when it is JSON), a plain line as it is; None for the
    other SSE fields and blank lines."""
    if not line.strip():
        return None
    if line.startswith(("event:", "id:", "retry:", ":")):
        return None
    if line.startswith("data:"):
        line = line[5:].removeprefix(" ")
        if line.startswith("{"):
            try:
                data = json.loads(line)
            except ValueError:
                return line
            if isinstance(data, Mapping):
                for key in ("message", "line", "log", "msg"):
                    if isinstance(data.get(key), str):
                        return str(data[key])
    return line


def _retry_after(response: httpx.Response) -> float | None:
    """Seconds `Retry-After` asks to wait (its seconds form), or None."""
    value = response.headers.get("Retry-After")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


def _problem_text(response: httpx.Response) -> str:
    """Runpod's explanation in an error answer: v2's `detail` and `errors`,
    v1's `error` or `message`, GraphQL's `errors[0].message`, or the text."""
    try:
        data = response.json()
    except ValueError:
        return response.text[:500]
    if not isinstance(data, Mapping):
        return ""
    parts: list[str] = []
    for key in ("detail", "error", "message", "title"):
        value = data.get(key)
        if isinstance(value, str) and value:
            parts.append(value)
            break
    errors = data.get("errors")
    if isinstance(errors, list):
        for item in errors[:3]:
            if isinstance(item, str):
                parts.append(item)
            elif isinstance(item, Mapping) and isinstance(item.get("message"), str):
                parts.append(item["message"])
    return "; ".join(parts)


def _transport_error(exc: httpx.TransportError) -> RunpodError:
    """The error of a request that got no answer; never quotes the request."""
    if isinstance(exc, httpx.TimeoutException):
        reason = "timed out"
    elif isinstance(exc, httpx.ConnectError):
        reason = "connection failed"
    else:
        reason = "connection lost"
    return RunpodError(
        None, reason, "check the network and the URLs of the RunpodCredentials block"
    )


def _rows(data: JsonValue, key: str) -> list[JsonValue]:
    """The rows of an answer: the answer itself when it is a list, else the
    list under `key` of an answer that is an object; none otherwise."""
    rows = data.get(key, []) if isinstance(data, Mapping) else data
    return rows if isinstance(rows, list) else []
