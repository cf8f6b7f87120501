"""The Runpod client against the simulator over real HTTP on 127.0.0.1:
pods, secrets, the catalog, retries, reconciliation after an ambiguous
create, deletion confirmation, and keys that never leak."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import httpx
import pytest
from pydantic import SecretStr

from overbrainer_prefect import __version__
from overbrainer_prefect.runpod import (
    GONE_LOOKS,
    ClusterRequest,
    GpuType,
    NoCapacity,
    PodNotGone,
    PodRequest,
    RetryPolicy,
    RunpodClient,
    RunpodError,
    confirm_deleted,
    delete_and_confirm,
    delete_node_or_pod,
    look_up,
    secret_ref,
)
from tests.ports import free_port
from tests.runpod_sim import RunpodSim, SimPod, running_sim

T = TypeVar("T")

FAST = RetryPolicy(
    attempts=4,
    backoff_s=0.02,
    max_backoff_s=0.1,
    rate_limit_budget_s=10.0,
    max_retry_after_s=5.0,
    create_attempts=3,
    reconcile_looks=3,
    reconcile_interval_s=0.05,
    reconcile_window_s=0.3,
)
"""The default policy's shape with waits short enough for tests."""


@pytest.fixture
def sim() -> Iterator[RunpodSim]:
    with running_sim() as simulator:
        yield simulator


def client_of(sim: RunpodSim, key: str | None = None) -> RunpodClient:
    return RunpodClient(
        SecretStr(sim.api_key if key is None else key), sim.rest_url, sim.graphql_url, retry=FAST
    )


def run(sim: RunpodSim, body: Callable[[RunpodClient], Awaitable[T]], key: str | None = None) -> T:
    """Runs `body` with a client of `sim` (with `key`), closed at the end."""

    async def main() -> T:
        async with client_of(sim, key) as client:
            return await body(client)

    return asyncio.run(main())


def request(name: str = "ob-r1-a1", gpu: str = "NVIDIA A40", **env: str) -> PodRequest:
    return PodRequest(name=name, image="img:1", gpu_type_id=gpu, env=dict(env))


def test_a_pod_is_created_looked_up_listed_and_deleted(sim: RunpodSim) -> None:
    async def body(client: RunpodClient) -> None:
        pod = await client.create_pod(request())
        assert pod.name == "ob-r1-a1"
        assert pod.status == "RUNNING"
        assert pod.cost_per_hr == pytest.approx(0.44)
        assert pod.gpu_type_id == "NVIDIA A40"
        seen = await client.get_pod(pod.id)
        assert seen is not None and seen.id == pod.id
        assert [p.id for p in await client.list_pods()] == [pod.id]
        assert await client.delete_pod(pod.id) is True
        assert await client.delete_pod(pod.id) is False  # already gone: success
        assert await client.get_pod(pod.id) is None

    run(sim, body)
    assert sim.pods() == []
    assert {r.user_agent for r in sim.requests} == {f"overbrainer-prefect/{__version__}"}
    assert sim.spend() > 0  # billed from create to delete


def test_a_500_after_the_pod_was_created_leaves_exactly_one_pod(sim: RunpodSim) -> None:
    sim.fail_after_create(1)
    sim.lag_after_create(lists=2)  # the list shows it only on the third look
    pod = run(sim, lambda client: client.create_pod(request("ob-r1-a1")))
    assert [p.id for p in sim.pods_named("ob-r1-a1")] == [pod.id]
    assert len(sim.requests_to("POST", "/v2/pods")) == 1  # never sent again
    assert len(sim.pods()) == 1


def test_an_instant_cluster_is_created_listed_by_rank_and_deleted_as_one(sim: RunpodSim) -> None:
    wanted = ClusterRequest(
        name="ob-r1-a1", image="img:1", gpu_type_id="NVIDIA A40", pod_count=2, env={"A": "1"}
    )

    async def body(client: RunpodClient) -> None:
        cluster = await client.create_cluster(wanted)
        assert cluster.name == "ob-r1-a1" and cluster.cidr is not None
        pods = await client.cluster_pods(cluster.id)
        assert [p.cluster_rank for p in pods] == [0, 1]
        assert {p.cluster_id for p in pods} == {cluster.id}
        assert pods[0].id == cluster.primary_pod_id
        assert [c.id for c in await client.list_clusters()] == [cluster.id]
        with pytest.raises(RunpodError) as alone:  # a node is deleted only with its cluster
            await client.delete_pod(pods[1].id)
        assert alone.value.status == 409
        # a node found on the account (the pods flow, a sweep) goes with its whole cluster
        node = pods[1]
        assert await delete_node_or_pod(client, node.id, node.cluster_id, interval_s=0.01) is True
        assert await client.delete_cluster(cluster.id) is False  # already gone: success
        assert await client.get_cluster(cluster.id) is None
        assert [await client.get_pod(p.id) for p in pods] == [None, None]

    run(sim, body)
    [made] = sim.clusters(include_deleted=True)
    envs = [sim.pod(pod_id).env for pod_id in made.pod_ids]
    primary = envs[0]["NODE_ADDR"]
    for rank, env in enumerate(envs):  # Runpod's env of a cluster's node
        assert (env["NODE_RANK"], env["NUM_NODES"], env["WORLD_SIZE"]) == (str(rank), "2", "2")
        assert env["PRIMARY_ADDR"] == env["MASTER_ADDR"] == primary and env["A"] == "1"
    assert envs[1]["NODE_ADDR"] != primary


def test_a_500_after_the_cluster_was_created_leaves_exactly_one_cluster(sim: RunpodSim) -> None:
    sim.fail_after_create(1)
    wanted = ClusterRequest(name="ob-r1-a1", image="img:1", gpu_type_id="NVIDIA A40", pod_count=3)
    cluster = run(sim, lambda client: client.create_cluster(wanted))
    assert [c.id for c in sim.clusters()] == [cluster.id]
    assert len(sim.requests_to("POST", "/v2/clusters")) == 1  # never sent again
    assert len(sim.pods()) == 3


def test_a_cluster_runpod_cannot_place_is_its_capacity_refusal_and_creates_nothing(
    sim: RunpodSim,
) -> None:
    sim.set_capacity("NVIDIA A40", 3)
    wanted = ClusterRequest(name="ob-r1-a1", image="img:1", gpu_type_id="NVIDIA A40", pod_count=4)
    with pytest.raises(NoCapacity):
        run(sim, lambda client: client.create_cluster(wanted))
    assert sim.pods(include_deleted=True) == [] and sim.clusters(include_deleted=True) == []


def test_a_5xx_on_a_create_that_created_nothing_is_sent_again_once(sim: RunpodSim) -> None:
    sim.fail(503, times=1, method="POST", path="/v2/pods")
    pod = run(sim, lambda client: client.create_pod(request("ob-r1-a1")))
    assert [p.id for p in sim.pods()] == [pod.id]
    assert [r.status for r in sim.requests_to("POST", "/v2/pods")] == [503, 201]


def test_a_create_that_keeps_failing_says_a_pod_may_exist(sim: RunpodSim) -> None:
    sim.fail(502, times=10, method="POST", path="/v2/pods")
    with pytest.raises(RunpodError) as caught:
        run(sim, lambda client: client.create_pod(request("ob-r1-a1")))
    assert caught.value.status == 502
    assert "no pod named ob-r1-a1 shows after 3 tries" in str(caught.value)
    assert len(sim.requests_to("POST", "/v2/pods")) == FAST.create_attempts
    assert sim.pods() == []


def test_no_capacity_raises_its_own_error_and_creates_nothing(sim: RunpodSim) -> None:
    sim.set_capacity("NVIDIA A40", 0)
    with pytest.raises(NoCapacity) as caught:
        run(sim, lambda client: client.create_pod(request()))
    assert caught.value.gpu_type == "NVIDIA A40"
    assert str(caught.value) == (
        "Runpod answered 400 (no capacity): no NVIDIA A40 is available right now: try another "
        "GPU type, or later"
    )
    assert sim.pods() == []


def test_429s_are_waited_out_as_retry_after_says(sim: RunpodSim) -> None:
    sim.rate_limit(times=1, retry_after=1.0, method="POST", path="/v2/pods")
    started = time.monotonic()
    run(sim, lambda client: client.create_pod(request()))
    assert time.monotonic() - started >= 1.0
    assert [r.status for r in sim.requests_to("POST", "/v2/pods")] == [429, 201]
    assert len(sim.pods()) == 1


def test_a_retry_after_beyond_the_budget_is_not_waited(sim: RunpodSim) -> None:
    sim.rate_limit(times=1, retry_after=600.0)
    started = time.monotonic()
    with pytest.raises(RunpodError) as caught:
        run(sim, lambda client: client.list_pods())
    assert time.monotonic() - started < 5.0
    assert caught.value.status == 429
    assert str(caught.value).startswith("Runpod answered 429 (rate limited): ")


def test_5xx_on_a_look_is_retried_a_bounded_number_of_times(sim: RunpodSim) -> None:
    pod = run(sim, lambda client: client.create_pod(request()))
    sim.fail(503, times=2, method="GET")
    assert run(sim, lambda client: client.get_pod(pod.id)) is not None
    sim.fail(500, times=100, method="GET")
    with pytest.raises(RunpodError) as caught:
        run(sim, lambda client: client.get_pod(pod.id))
    assert caught.value.status == 500
    assert str(caught.value) == (
        "Runpod answered 500 (server error): Runpod is having trouble: try again later"
    )
    answered = [r.status for r in sim.requests_to("GET", f"/v2/pods/{pod.id}")]
    assert answered[-FAST.attempts :] == [500] * FAST.attempts


def test_an_invalid_api_key_fails_with_one_line(sim: RunpodSim) -> None:
    with pytest.raises(RunpodError) as caught:
        run(sim, lambda client: client.list_pods(), key="rpa_" + secrets.token_hex(12))
    assert caught.value.status == 401
    assert str(caught.value) == (
        "Runpod answered 401 (unauthorized): check the API key of the RunpodCredentials block"
    )
    assert caught.value.run_message == "Runpod answered 401"


def test_runpod_unreachable_fails_with_one_line() -> None:
    port = free_port()  # nothing listens there

    async def main() -> None:
        async with RunpodClient(
            SecretStr("rpa_k"), f"http://127.0.0.1:{port}/v2", retry=FAST
        ) as client:
            await client.list_pods()

    with pytest.raises(RunpodError) as caught:
        asyncio.run(main())
    assert caught.value.status is None
    assert str(caught.value) == (
        "cannot reach Runpod (connection failed): check the network and the URLs of the "
        "RunpodCredentials block"
    )


def test_the_retired_v1_api_says_to_use_v2(sim: RunpodSim) -> None:
    async def main() -> None:
        async with RunpodClient(SecretStr(sim.api_key), f"{sim.base_url}/v1", retry=FAST) as client:
            await client.list_pods()

    with pytest.raises(RunpodError) as caught:
        asyncio.run(main())
    assert caught.value.status == 410
    assert "REST v2" in str(caught.value)


def test_the_key_and_secret_values_never_appear_in_errors_or_logs(
    sim: RunpodSim, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    value = "hf_supersecretvalue_0123456789"
    errors: list[BaseException] = []

    async def body(client: RunpodClient) -> None:
        await client.create_secret("ob_hf_token", SecretStr(value))
        try:
            await client.create_secret("ob_hf_token", SecretStr(value))  # 409: taken
        except RunpodError as error:
            errors.append(error)
        sim.fail(400, method="POST", path="/v2/pods", detail=f"bad {sim.api_key} and {value}")
        try:
            await client.create_pod(request(HF=secret_ref("ob_hf_token")))
        except RunpodError as error:
            errors.append(error)
        sim.fail(503, times=2)
        sim.rate_limit(times=1, retry_after=0.1)
        assert await client.get_pod("nope") is None

    run(sim, body)
    async_errors: list[BaseException] = []
    try:
        run(sim, lambda client: client.list_pods(), key=sim.api_key + "x")
    except RunpodError as error:
        async_errors.append(error)
    assert len(errors) == 2 and len(async_errors) == 1
    scrubbed = errors[1]
    assert isinstance(scrubbed, RunpodError) and scrubbed.status == 400
    assert "[redacted]" in scrubbed.detail
    texts = [caplog.text] + [f"{e} {e!r} {getattr(e, 'detail', '')}" for e in errors + async_errors]
    for text in texts:
        assert sim.api_key not in text
        assert value not in text
    assert "Runpod answered 409 (conflict): a secret named ob_hf_token exists" in str(errors[0])


def test_a_deleted_pod_that_still_shows_is_confirmed_gone_only_once_it_is(sim: RunpodSim) -> None:
    sim.lag_after_delete(gets=2, lists=2)

    async def body(client: RunpodClient) -> tuple[str, bool]:
        pod = await client.create_pod(request())
        deleted = await delete_and_confirm(client, pod.id, interval_s=0.02, timeout_s=10)
        return pod.id, deleted

    pod_id, deleted = run(sim, body)
    assert deleted is True
    looks = [r.status for r in sim.requests_to("GET", f"/v2/pods/{pod_id}")]
    # Shown twice, then 404s; each time the list still showed it, the count began again.
    assert looks[:2] == [200, 200]
    assert looks[-GONE_LOOKS:] == [404] * GONE_LOOKS
    assert len(looks) >= 2 + 3 * GONE_LOOKS
    assert [r.status for r in sim.requests_to("GET", "/v2/pods")][-1] == 200


def test_a_pod_that_does_not_go_is_reported_not_gone(sim: RunpodSim) -> None:
    async def body(client: RunpodClient) -> None:
        pod = await client.create_pod(request())
        await confirm_deleted(client, pod.id, interval_s=0.02, timeout_s=0.3)

    with pytest.raises(PodNotGone) as caught:
        run(sim, body)
    assert str(caught.value).startswith("cannot confirm that pod ")
    assert "it may still bill" in str(caught.value)
    assert len(sim.pods()) == 1


def test_a_pod_just_created_that_answers_404_is_not_taken_for_gone(sim: RunpodSim) -> None:
    sim.lag_after_create(gets=2)

    async def body(client: RunpodClient) -> None:
        pod = await client.create_pod(request())
        assert await client.get_pod(pod.id) is None  # 404 for a while
        found = await look_up(client, pod.id, interval_s=0.02)
        assert found is not None and found.id == pod.id
        assert await delete_and_confirm(client, pod.id, interval_s=0.02) is True
        assert await look_up(client, pod.id, interval_s=0.02) is None

    run(sim, body)


def test_a_pod_key_reaches_only_its_own_pod(sim: RunpodSim) -> None:
    mine, other = run(
        sim,
        lambda client: asyncio.gather(
            client.create_pod(request("ob-a")), client.create_pod(request("ob-b"))
        ),
    )
    key = sim.pod(mine.id).env["RUNPOD_API_KEY"]
    assert sim.pod(mine.id).env["RUNPOD_POD_ID"] == mine.id

    async def body(client: RunpodClient) -> None:
        assert (await client.get_pod(mine.id)) is not None
        for denied in (client.list_pods(), client.delete_pod(other.id)):
            with pytest.raises(RunpodError) as caught:
                await denied
            assert caught.value.status == 403
        assert await client.delete_pod(mine.id) is True

    run(sim, body, key=key)
    assert [p.id for p in sim.pods()] == [other.id]


def test_secrets_reach_the_pod_env_and_never_the_api(sim: RunpodSim) -> None:
    value = "-----BEGIN OPENSSH " + "PRIVATE KEY-----\nabc\n-----END OPENSSH " + "PRIVATE KEY-----"

    async def body(client: RunpodClient) -> tuple[str, dict[str, str]]:
        secret = await client.create_secret("ob_r1_host_key", SecretStr(value))
        assert secret.name == "ob_r1_host_key"
        pod = await client.create_pod(request(HOST_KEY=secret_ref("ob_r1_host_key")))
        assert await client.delete_secret("ob_r1_host_key") is True
        assert await client.delete_secret("ob_r1_host_key") is False
        return pod.id, pod.env

    pod_id, shown_env = run(sim, body)
    assert sim.pod(pod_id).env["HOST_KEY"] == value  # substituted when the pod boots
    assert shown_env["HOST_KEY"] == "{{ RUNPOD_SECRET_ob_r1_host_key }}"
    assert sim.secret_names() == []


def test_a_secret_name_runpod_refuses_is_one_line(sim: RunpodSim) -> None:
    with pytest.raises(ValueError, match="starts with `runpod`, which Runpod reserves"):
        run(sim, lambda client: client.create_secret("RUNPOD_X", SecretStr("v")))
    assert sim.requests == []


def test_the_gpu_catalog_reads_the_same_over_rest_and_graphql(sim: RunpodSim) -> None:
    rest = run(sim, lambda client: client.gpu_types("SECURE"))
    sim.set_catalog(False)
    graphql = run(sim, lambda client: client.gpu_types("SECURE"))
    assert len(sim.requests_to("POST", "/graphql")) == 1

    def key(gpus: list[GpuType]) -> list[tuple[str, float, float | None]]:
        return [(g.id, g.memory_gb, g.price("SECURE")) for g in gpus]

    assert key(rest) == key(graphql)
    h200 = next(g for g in rest if g.id == "NVIDIA H200")
    assert (h200.memory_gb, h200.price("SECURE"), h200.price("COMMUNITY")) == (141, 3.99, None)
    centers = run(sim, lambda client: client.data_centers())
    assert "EU-RO-1" in [dc.id for dc in centers]


def test_credentials_build_a_client_and_never_show_the_key(sim: RunpodSim) -> None:
    from overbrainer_prefect.blocks import RunpodCredentials

    credentials = RunpodCredentials(
        api_key=SecretStr(sim.api_key), rest_url=sim.rest_url, graphql_url=sim.graphql_url
    )
    assert sim.api_key not in repr(credentials) + str(credentials.model_dump())

    async def main() -> list[str]:
        async with credentials.client() as client:
            return [pod.id for pod in await client.list_pods()]

    assert asyncio.run(main()) == []
    with pytest.raises(ValueError, match="the Runpod API key is empty"):
        RunpodCredentials(api_key=SecretStr(" ")).client()


def test_every_runpod_client_of_a_process_verifies_tls_with_one_context_made_once() -> None:
    """A client is made for each look at the account: they share httpx's default
    TLS context (certificates and host names checked), made once."""
    import ssl

    import httpx

    from overbrainer_prefect.runpod.client import RunpodClient, tls_context

    contexts = {
        id(RunpodClient(SecretStr("k"))._http._transport._pool._ssl_context) for _ in range(3)
    }
    assert contexts == {id(tls_context())}
    context = tls_context()
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    fresh = httpx.create_ssl_context()
    assert len(context.get_ca_certs()) == len(fresh.get_ca_certs()) > 0


def test_the_simulator_calls_its_hooks_and_takes_knobs_over_http(sim: RunpodSim) -> None:
    created: list[str] = []
    deleted: list[str] = []

    def on_create(pod: SimPod) -> None:
        created.append(pod.id)
        pod.public_ip, pod.ssh_port = "127.0.0.1", 2222
        pod.env["RUNPOD_TCP_PORT_22"] = "2222"

    sim.on_pod_create = on_create
    sim.on_pod_delete = lambda pod: deleted.append(pod.id)
    knobs = httpx.post(f"{sim.base_url}/_sim/knobs", json={"capacity": {"NVIDIA L40S": 0}})
    assert knobs.status_code == 200

    async def body(client: RunpodClient) -> str:
        with pytest.raises(NoCapacity):
            await client.create_pod(request(gpu="NVIDIA L40S"))
        pod = await client.create_pod(request())
        assert pod.ssh is not None and (pod.ssh.host, pod.ssh.port) == ("127.0.0.1", 2222)
        await client.delete_pod(pod.id)
        return pod.id

    pod_id = run(sim, body)
    assert created == deleted == [pod_id]
    state = httpx.get(f"{sim.base_url}/_sim/state").json()
    assert [(p["id"], p["deleted"]) for p in state["pods"]] == [(pod_id, True)]


def volume_settings(volume_id: str, **changes: Any) -> Any:
    from overbrainer_prefect.runpod.settings import settings_from

    values: dict[str, Any] = {
        "gpu_types": ["NVIDIA RTX A4000"],
        "image": "x:1",
        "job_venv": "/opt/venv",
        "network_volume_id": volume_id,
        "data_center_ids": ["EU-RO-1"],
    }
    values.update(changes)
    return settings_from(values)


def test_a_network_volume_grows_to_what_a_job_needs_within_max_volume_gb_and_never_past_it(
    sim: RunpodSim, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    from overbrainer_prefect.runpod.volume import VolumeError, ensure_volume

    volume_id = sim.add_volume(10, "EU-RO-1")
    log = logging.getLogger("volume-test")
    caplog.set_level(logging.INFO, "volume-test")
    roomy = volume_settings(volume_id, max_volume_gb=50)

    # 30 GB to write: a tenth of headroom, grown to 33 GB
    assert run(sim, lambda c: ensure_volume(c, roomy, 30 * 10**9, "the export", log)) == 33
    assert sim.volume(volume_id).size == 33
    assert "grown from 10 to 33 GB for the export (max_volume_gb 50)" in caplog.text
    # what fits is left as it is; what is not estimated is only logged
    assert run(sim, lambda c: ensure_volume(c, roomy, 5 * 10**9, "the compare", log)) == 33
    assert run(sim, lambda c: ensure_volume(c, roomy, None, "the run", log)) == 33
    assert sim.volume(volume_id).size == 33 and "is not estimated" in caplog.text
    # past max_volume_gb, or without it, a warning and no grow: it bills for good
    assert run(sim, lambda c: ensure_volume(c, roomy, 80 * 10**9, "the export", log)) == 33
    assert "needs about 88 GB, and max_volume_gb is 50: it is not grown" in caplog.text
    unbounded = volume_settings(volume_id)
    assert run(sim, lambda c: ensure_volume(c, unbounded, 40 * 10**9, "the export", log)) == 33
    assert sim.volume(volume_id).size == 33 and "max_volume_gb is unset" in caplog.text
    # a volume that is not there, or not in the pod's data center: one line, nothing grown
    with pytest.raises(VolumeError, match="no network volume nosuchvol0 in this Runpod account"):
        run(sim, lambda c: ensure_volume(c, volume_settings("nosuchvol0"), 1, "the run", log))
    elsewhere = volume_settings(volume_id, data_center_ids=["US-KS-2"], max_volume_gb=50)
    with pytest.raises(VolumeError, match=r"is in EU-RO-1, not in US-KS-2: set data_center_ids"):
        run(sim, lambda c: ensure_volume(c, elsewhere, 40 * 10**9, "the run", log))
    assert sim.volume(volume_id).size == 33


def test_a_network_volume_only_grows(sim: RunpodSim) -> None:
    from overbrainer_prefect.runpod.errors import RunpodError

    volume_id = sim.add_volume(20, "EU-RO-1")
    grown = run(sim, lambda c: c.grow_network_volume(volume_id, 25))
    assert grown.size == 25 and grown.data_center == "EU-RO-1"
    with pytest.raises(RunpodError, match="Runpod answered 400"):
        run(sim, lambda c: c.grow_network_volume(volume_id, 12))
    assert run(sim, lambda c: c.get_network_volume("nosuchvol0")) is None


def test_the_start_command_is_v2s_args_string_and_any_other_create_property_is_refused(
    sim: RunpodSim,
) -> None:
    import shlex

    from overbrainer_prefect.runpod.bootstrap import START_COMMAND

    request = PodRequest(
        name="ob-20260101-000000-args-a1",
        image="x:1",
        gpu_type_id="NVIDIA RTX A4000",
        args=shlex.join(START_COMMAND),
    )
    body = request.to_api()
    assert shlex.split(body["args"]) == START_COMMAND  # split back as a shell (Docker) does
    assert "cmd" not in body and "entrypoint" not in body
    pod = run(sim, lambda c: c.create_pod(request))
    assert sim.pod(pod.id).request["args"] == body["args"]

    async def with_cmd(client: RunpodClient) -> Any:
        return await client._request("POST", client._url("/pods"), json={**body, "cmd": ["sh"]})

    answer = run(sim, with_cmd)
    assert answer.status_code == 422 and "additional properties 'cmd'" in answer.text
