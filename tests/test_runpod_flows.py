"""The run flows on a Runpod target, against the Runpod simulator whose pods
are real local process trees (the package's real bootstrap + watchdog, a real
sshd on 127.0.0.1) and real axolotl fine-tunes of the tiny model inside them,
on the real (ephemeral) Prefect server.

What is shown: a pod is deleted only after the run's files are verified, and
its deletion is confirmed; GPU types without capacity, a 500 after a create
and 429s are handled with exactly one pod; whatever dies, the watchdog
deletes the pod at its bound and `attach` tells the truth; cancellation
through the Prefect API deletes the pod; no secret lands in a file, a log, a
result or an artifact; bad input fails in one line before any pod exists.
"""

from __future__ import annotations

import base64
import json
import logging
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterKey,
    LogFilter,
    LogFilterFlowRunId,
)
from prefect.states import Cancelling

from overbrainer_prefect.blocks import RunpodCredentials, RunpodTarget
from overbrainer_prefect.driver import on_cancelled
from overbrainer_prefect.flows import RunResult, attach, cancel, pods, stop, train
from overbrainer_prefect.runpod import PodRequest
from overbrainer_prefect.runpod.bootstrap import TIMING_ENV
from overbrainer_prefect.runpod.pod import PodRecord, PodState
from overbrainer_prefect.runs.store import Runs, RunState
from overbrainer_prefect.steps import start as start_step
from overbrainer_prefect.targets.runpod.keys import CLIENT_KEY, SSH_DIR
from overbrainer_prefect.targets.runpod.listing import PodsError
from overbrainer_prefect.trainers.spec import TrainingSpec
from tests.flowrun import run
from tests.procs import held_stopped
from tests.runpod_fixtures import A4000, A5000, FAST, fast, pods_of, sim, target
from tests.runpod_sim import RunpodSim, running_sim
from tests.runpod_sim.pods import SimPods, deleted_once_verified
from tests.test_train_flow import kill, spec, wait_until

__all__ = ["fast", "pods_of", "sim"]  # the simulator's fixtures (tests/runpod_fixtures.py)

pytestmark = pytest.mark.slow

LONG = 100_000  # steps of a job that runs until something ends it (the tiny model is quick)


def only_run(runs_dir: Path) -> Any:
    records = Runs(runs_dir).list()
    assert len(records) == 1, records
    return records[0]


def secrets_of(sim: RunpodSim) -> list[bytes]:
    """Every secret the account and its pods ever had: the account key, each
    pod's key, each pod's host key (as given, base64, and decoded)."""
    found = [sim.api_key.encode()]
    for pod in sim.pods(include_deleted=True):
        found.append(pod.api_key.encode())
        host = pod.env.get("OVERBRAINER_HOST_KEY", "")
        if host:
            found.append(host.encode())
            body = base64.b64decode(host).decode()
            found.append(body.encode())
            found += [line.encode() for line in body.splitlines() if len(line) > 40]
    return found


def assert_no_secret_in_files(root: Path, secrets: list[bytes]) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert b"PRIVATE KEY" not in data, path
            for secret in secrets:
                assert secret not in data, path


def flow_logs(flow_run_id: str) -> list[str]:
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=10)

    async def go() -> list[str]:
        async with get_client() as client:
            logs = await client.read_logs(
                log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[uuid.UUID(flow_run_id)]))
            )
            return [log.message for log in logs]

    return run(go())


def artifacts_of(run_id: str) -> list[Any]:
    async def go() -> list[Any]:
        async with get_client() as client:
            return await client.read_artifacts(
                artifact_filter=ArtifactFilter(key=ArtifactFilterKey(like_=run_id))
            )

    return run(go())


def leave_an_orphan(sim: RunpodSim) -> str:
    """Creates a pod named like ours for a run that is not here; returns its id."""

    async def go() -> str:
        async with RunpodCredentials(
            api_key=sim.api_key, rest_url=sim.rest_url, graphql_url=sim.graphql_url
        ).client() as client:
            pod = await client.create_pod(
                PodRequest(name="ob-20250101-000000-gone-a1", image="x:1", gpu_type_id=A5000)
            )
            return pod.id

    return run(go())


def test_a_train_on_a_simulated_pod_deletes_the_pod_only_after_its_files_are_verified(
    prefect_server: None,
    sim: RunpodSim,
    pods_of: SimPods,
    tiny: tuple[Path, Path],
    tmp_path: Path,
) -> None:
    runs_dir = tmp_path / "runs"
    orphan = leave_an_orphan(sim)
    name = target(sim, gpu_types="auto")
    result = run(train(target=name, training=spec(*tiny), runs_dir=str(runs_dir)))
    assert isinstance(result, RunResult)
    assert result.state == RunState.SUCCEEDED, result.message
    assert "output/adapter_model.safetensors" in {f.path for f in result.files}
    runs = Runs(runs_dir)
    local = runs.run_dir(result.run_id)
    pod = PodRecord.load(runs, result.run_id)
    assert pod is not None and pod.pod_id is not None
    assert pod.state == PodState.DELETED and pod.gpu_type_id == A4000
    assert pod.cost_per_hour == pytest.approx(0.25)
    assert pod.deadline_unix is not None and pod.secret_deleted
    # deleted only after the files were verified: the manifest was written first
    simulated = sim.pod(pod.pod_id)
    assert simulated.deleted and simulated.deleted_at is not None
    assert (local / "manifest.json").stat().st_mtime <= simulated.deleted_at
    # the retrieved marker was written on the pod before the delete
    remote = pods_of.workspace_of(pod.pod_id) / "overbrainer" / result.run_id
    assert (remote / ".pod" / "retrieved").is_file()
    # its deletion confirmed: 404s in a row after the delete, then a list
    after = sim.requests[
        max(
            i
            for i, r in enumerate(sim.requests)
            if r.method == "DELETE" and r.path == f"/v2/pods/{pod.pod_id}"
        ) :
    ]
    gets = [r.status for r in after if r.method == "GET" and r.path == f"/v2/pods/{pod.pod_id}"]
    assert gets[-3:] == [404, 404, 404]
    assert any(r.method == "GET" and r.path == "/v2/pods" for r in after)
    assert not pods_of.running(pod.pod_id)
    # the watchdog's log came back, with its decisions
    log = (local / ".pod" / "watchdog.log").read_text()
    for said in ("claim:", "api: the Runpod API answers", "cost cap armed:", "job: started"):
        assert said in log, log
    # no key is left: the client key removed, the host key secret deleted
    assert not (local / SSH_DIR / CLIENT_KEY).exists()
    assert sim.secret_names() == []
    secrets = secrets_of(sim)
    assert_no_secret_in_files(runs_dir, secrets)
    record = runs.load(result.run_id)
    assert record.target_kind == "runpod" and record.flow_run_id is not None
    texts = flow_logs(record.flow_run_id)
    # auto: the cheapest type with the VRAM the tiny model needs
    assert any("Runpod: NVIDIA RTX A4000" in text for text in texts), texts
    assert any("the run needs about" in text for text in texts), texts
    # the orphan of the account was warned about at the start, and left alone
    assert any(f"pod {orphan} of run" in text and "is an orphan" in text for text in texts)
    assert not sim.pod(orphan).deleted
    assert any("deleted and its deletion confirmed" in text for text in texts), texts
    found = artifacts_of(result.run_id)
    assert any(a.key == f"run-{result.run_id}-pod" for a in found)
    shown = [*texts, result.model_dump_json(), *(json.dumps(a.data) for a in found)]
    for text in shown:
        for secret in secrets:
            assert secret.decode() not in text
        assert "PRIVATE KEY" not in text


def attempts_of(runs_dir: Path, run_id: str) -> list[tuple[str, str]]:
    pod = PodRecord.load(Runs(runs_dir), run_id)
    assert pod is not None
    return [(a.gpu_type_id, a.result) for a in pod.attempts]


def test_no_capacity_429s_and_a_500_to_a_create_whose_pod_the_list_shows_20_s_late_leave_one_pod(
    prefect_server: None,
    sim: RunpodSim,
    pods_of: SimPods,
    tiny: tuple[Path, Path],
    tmp_path: Path,
) -> None:
    runs_dir = tmp_path / "runs"
    sim.set_capacity(A4000, 0)  # the first type has no machine
    sim.rate_limit(times=2, retry_after=1.0, method="POST", path="/v2/pods")
    sim.fail_after_create(1)  # Runpod creates the pod, then answers 500...
    sim.lag_after_create(seconds=20.0)  # ...and its list shows the pod only 20 s later
    # boot grace counts from the last create: the list hides the pod 20 s of it, and a loaded
    # machine boots a simulated pod in tens of seconds more
    name = target(sim, gpu_types=[A4000, A5000], boot_grace_s=120.0)
    result = run(train(target=name, training=spec(*tiny, max_steps=3), runs_dir=str(runs_dir)))
    assert result.state == RunState.SUCCEEDED, result.message
    creates = [r.status for r in sim.requests if r.method == "POST" and r.path == "/v2/pods"]
    # the 500 is never followed by another create while the list could still hide its pod
    assert creates == [429, 429, 400, 500]
    (pod,) = sim.pods(include_deleted=True)
    assert pod.gpu_type_id == A5000 and pod.deleted and result.run_id in pod.name
    assert attempts_of(runs_dir, result.run_id) == [
        (A4000, "refused (no capacity or no access)"),
        (A5000, "created"),
    ]
    saved = PodRecord.load(Runs(runs_dir), result.run_id)
    assert saved is not None and saved.pod_id == pod.id and saved.state == PodState.DELETED
    assert saved.strays == []


def start_in_child(name: str, training: Any, runs_dir: Path, log: Path) -> Any:
    from tests.test_train_flow import start_in_child as start

    return start(name, training, runs_dir, log)


def follower_killed_while_training(
    name: str, tiny: tuple[Path, Path], runs_dir: Path, tmp_path: Path
) -> Any:
    """Trains on the target `name` in another process until its job logged a
    step on its pod, then SIGKILLs that process (no hook runs: the job and its
    pod keep going); returns the run's record."""
    child = start_in_child(name, spec(*tiny, max_steps=LONG), runs_dir, tmp_path / "child.log")
    return killed_once_training(child, runs_dir)


def killed_once_training(child: Any, runs_dir: Path, abandon: threading.Event | None = None) -> Any:
    """SIGKILLs the follower `child` once its job logged a step on its pod (or
    once `abandon` is set); returns the run's record (None when abandoned)."""
    given_up = abandon or threading.Event()
    try:
        wait_until(
            lambda: given_up.is_set() or running_on_pod(runs_dir) is not None,
            240,
            "the job to train",
        )
    finally:
        kill(child)
    return running_on_pod(runs_dir)


def running_on_pod(runs_dir: Path) -> Any:
    for record in Runs(runs_dir).list():
        if record.state == RunState.RUNNING and record.job is not None:
            metrics = Path(record.remote_dir) / "metrics.jsonl"
            if metrics.exists() and '"log"' in metrics.read_text():
                return record
    return None


def test_a_flow_killed_before_the_job_leaves_nothing_billing_past_boot_grace(
    prefect_server: None,
    sim: RunpodSim,
    pods_of: SimPods,
    tiny: tuple[Path, Path],
    tmp_path: Path,
) -> None:
    runs_dir = tmp_path / "runs"
    pods_of.boot_delay_s = 4.0  # the image takes a while: the flow waits for sshd
    name = target(sim, boot_grace_s=8.0)
    child = start_in_child(name, spec(*tiny), runs_dir, tmp_path / "child.log")

    def booting() -> PodRecord | None:
        for record in Runs(runs_dir).list():
            pod = PodRecord.load(Runs(runs_dir), record.id)
            if pod is not None and pod.pod_id is not None:
                return pod
        return None

    try:
        wait_until(lambda: booting() is not None, 120, "the pod to be created")
    finally:
        kill(child)
    pod = booting()
    assert pod is not None and pod.pod_id is not None
    wait_until(lambda: sim.pod(pod.pod_id).deleted, 60, "the boot grace")
    simulated = sim.pod(pod.pod_id)
    assert simulated.deleted_at is not None
    assert simulated.deleted_at - simulated.created_at <= 8.0 + 3.0
    assert "no job started within boot_grace" in pods_of.watchdog_log(pod.pod_id, pod.run_id)


def test_max_cost_usd_reached_deletes_the_pod_and_fails_the_run_with_that_reason(
    prefect_server: None,
    sim: RunpodSim,
    tiny: tuple[Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runs_dir = tmp_path / "runs"
    # the watchdog asks the job for a checkpoint a second (a look) before the cap, not a tenth
    # of it: the job cannot stop and have its files retrieved first, so the cap deletes the pod
    # (with 3.5 s, an idle machine's job stopped with its checkpoint, retrieved, before the cap)
    monkeypatch.setenv(TIMING_ENV, f"{FAST},checkpoint_lead_s=1")
    name = target(sim, max_cost_usd=0.0025)  # 35 s at $0.26/h (GPU and container disk)
    # the pod's sshd outlives its job by 5 s (a loaded machine): the follower finds the
    # job lost on a host that still answers, and asks Runpod whether the pod is gone
    pods = SimPods(tmp_path / "pods", sshd_outlives_s=5.0)
    with (
        pods.attached(sim) as pods_of,
        pytest.raises(Exception, match=r"max_cost_usd reached \(\$0\.0025 at \$0\.26/h\)"),
    ):
        run(train(target=name, training=spec(*tiny, max_steps=LONG), runs_dir=str(runs_dir)))
    record = only_run(runs_dir)
    assert record.state == RunState.FAILED
    assert record.message.startswith("max_cost_usd reached ($0.0025 at $0.26/h)")
    pod = PodRecord.load(Runs(runs_dir), record.id)
    assert pod is not None and pod.state == PodState.DELETED and pod.deleted_by == "watchdog"
    assert pod.pod_id is not None
    log = pods_of.watchdog_log(pod.pod_id, record.id)
    assert "asked the job for a checkpoint (stop.request): max_cost_usd" in log, log
    assert "max_cost_usd reached: $0.0025 at $0.256944/h" in log, log
    assert sim.spend(pod.pod_id) <= 0.0025  # GPUs and container disk, at deletion


def cancel_through_prefect(flow_run_id: str, child: Any, hook_of: Any = None) -> None:
    """Sets the flow run Cancelling through the API, kills its process as a
    runner does, then runs the cancellation hook's work from the records (the
    train flow's, or `hook_of(flow_run)`)."""

    async def cancelling() -> None:
        async with get_client() as client:
            await client.set_flow_run_state(uuid.UUID(flow_run_id), Cancelling(), force=True)

    run(cancelling())
    kill(child)

    async def hook() -> None:
        async with get_client() as client:
            flow_run = await client.read_flow_run(uuid.UUID(flow_run_id))
        assert flow_run.state is not None and flow_run.state.name == "Cancelling"
        if hook_of is None:
            await on_cancelled(train, flow_run, flow_run.state)
        else:
            await hook_of(flow_run)

    run(hook())


def test_a_flow_run_cancelled_while_provisioning_deletes_its_pod(
    prefect_server: None,
    sim: RunpodSim,
    pods_of: SimPods,
    tiny: tuple[Path, Path],
    tmp_path: Path,
) -> None:
    runs_dir = tmp_path / "runs"
    pods_of.boot_delay_s = 3.0
    name = target(sim)
    child = start_in_child(name, spec(*tiny), runs_dir, tmp_path / "child.log")

    def created() -> Any:
        for record in Runs(runs_dir).list():
            pod = PodRecord.load(Runs(runs_dir), record.id)
            if pod is not None and pod.pod_id is not None:
                return record
        return None

    try:
        wait_until(lambda: created() is not None, 120, "the pod to be created")
        record = created()
        cancel_through_prefect(record.flow_run_id, child)
    finally:
        kill(child)
    saved = Runs(runs_dir).load(record.id)
    assert saved.state == RunState.FAILED and saved.message == "interrupted before the job started"
    pod = PodRecord.load(Runs(runs_dir), record.id)
    assert pod is not None and pod.state == PodState.DELETED and pod.pod_id is not None
    assert sim.pod(pod.pod_id).deleted
    assert [p.id for p in sim.pods() if record.id in p.name] == []
    assert sim.secret_names() == []
    assert not (Runs(runs_dir).run_dir(record.id) / SSH_DIR / CLIENT_KEY).exists()


def test_a_flow_run_cancelled_while_training_cancels_the_job_and_deletes_its_pod(
    prefect_server: None,
    sim: RunpodSim,
    pods_of: SimPods,
    tiny: tuple[Path, Path],
    tmp_path: Path,
) -> None:
    runs_dir = tmp_path / "runs"
    name = target(sim)
    child = start_in_child(name, spec(*tiny, max_steps=LONG), runs_dir, tmp_path / "child.log")
    try:
        wait_until(lambda: running_on_pod(runs_dir) is not None, 240, "the job to train")
        record = running_on_pod(runs_dir)
        cancel_through_prefect(record.flow_run_id, child)
    finally:
        kill(child)
    saved = Runs(runs_dir).load(record.id)
    assert saved.state == RunState.CANCELLED, saved.message
    local = Runs(runs_dir).run_dir(record.id)
    assert (local / "job.log").is_file() and (local / "metrics.jsonl").is_file()
    pod = PodRecord.load(Runs(runs_dir), record.id)
    assert pod is not None and pod.state == PodState.DELETED and pod.pod_id is not None
    assert sim.pod(pod.pod_id).deleted and not pods_of.running(pod.pod_id)
    assert sim.secret_names() == []


def test_auto_picks_the_cheapest_gpu_type_that_fits_the_estimated_vram(
    sim: RunpodSim, tmp_path: Path
) -> None:
    from overbrainer_prefect.runpod.vram import estimate_vram, read_local_shape
    from overbrainer_prefect.targets.base import JobNeed, NoBudget

    model = tmp_path / "model"
    model.mkdir()
    config = {  # a 7B Llama's shape; no weights: the count comes from the shape
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "intermediate_size": 11008,
        "vocab_size": 32000,
    }
    (model / "config.json").write_text(json.dumps(config))
    training = TrainingSpec.model_validate(
        {"base_model": str(model), "datasets": ["org/data"], "adapter": "lora"}
    )
    need = estimate_vram(
        read_local_shape(model),
        "lora",
        sequence_len=training.sequence_len,
        micro_batch_size=training.micro_batch_size,
        lora_r=training.lora_r,
    ).floor_gb
    block = RunpodTarget(
        credentials=RunpodCredentials(
            api_key=sim.api_key, rest_url=sim.rest_url, graphql_url=sim.graphql_url
        ),
        gpu_types="auto",
    )

    async def go() -> Any:
        place = block.target("overbrainer-runpod-target/auto", logging.getLogger("plan"))
        need = JobNeed(what="the run", training=training)
        async with place.reserve(Runs(tmp_path / "runs"), need, NoBudget()) as reserved:
            return reserved.plan

    plan = run(go())
    fitting = sorted((gpu.secure_price, gpu.id) for gpu in sim.gpus.values() if gpu.memory >= need)
    assert plan.first.id == fitting[0][1]
    assert plan.vram_floor_gb == need and need > 16  # the cheapest type of all is too small
    assert plan.first.id != min(sim.gpus.values(), key=lambda g: g.secure_price).id
    assert [c.price_per_hour for c in plan.choices] == sorted(
        c.price_per_hour for c in plan.choices
    )


@pytest.mark.parametrize(
    ("changes", "said"),
    [
        ({"credentials": "bad key"}, "Runpod answered 401 (unauthorized): check the API key"),
        ({"gpu_types": ["NVIDIA RTX 9999"]}, 'unknown GPU type "NVIDIA RTX 9999" in gpu_types'),
        ({"data_center_ids": ["EU-XX-9"]}, "unknown data center EU-XX-9 in data_center_ids"),
        ({"max_price_per_hour": 0.1}, "costs at most $0.10/h: the cheapest is NVIDIA RTX A4000"),
        ({"min_vram_gb": 500, "gpu_types": "auto"}, "has 500 GB of VRAM (min_vram_gb)"),
    ],
)
def test_bad_input_fails_in_one_line_before_any_pod_is_created(
    prefect_server: None,
    sim: RunpodSim,
    tiny: tuple[Path, Path],
    tmp_path: Path,
    changes: dict[str, Any],
    said: str,
) -> None:
    if changes.get("credentials") == "bad key":
        changes = {
            "credentials": RunpodCredentials(
                api_key="rpa_NOTAKEY", rest_url=sim.rest_url, graphql_url=sim.graphql_url
            )
        }
    name = target(sim, **changes)
    runs_dir = tmp_path / "runs"
    with pytest.raises(Exception) as raised:
        run(train(target=name, training=spec(*tiny), runs_dir=str(runs_dir)))
    message = str(raised.value)
    assert said in message and "\n" not in message, message
    assert sim.pods(include_deleted=True) == []
    assert not [r for r in sim.requests if r.method == "POST"]
    assert not runs_dir.exists()


def test_the_runpod_target_block_holds_its_settings_with_their_constraints(
    sim: RunpodSim,
) -> None:
    from pydantic import ValidationError

    from overbrainer_prefect.runpod.settings import RunpodTargetSettings

    credentials = RunpodCredentials(api_key=sim.api_key, rest_url=sim.rest_url)
    for bad, said in [
        ({"image": " "}, "the image is missing"),
        ({"gpu_count": 17}, "less than or equal to 16"),
        ({"gpu_count": 0}, "greater than or equal to 1"),
        ({"container_disk_gb": 5}, "greater than or equal to 20"),
        ({"max_volume_gb": 100}, "max_volume_gb needs a network_volume_id"),
        ({"checkpoints_on": "volume"}, "checkpoints_on 'volume' needs a network_volume_id"),
        ({"checkpoints_on": "disk"}, "'store' or 'volume'"),
    ]:
        with pytest.raises(ValidationError, match=said):
            RunpodTarget(credentials=credentials, **bad)
    block = RunpodTarget(credentials=credentials, gpu_count=2, gpu_types="NVIDIA A40, NVIDIA L40S")
    assert block.settings() == RunpodTargetSettings(
        gpu_count=2, gpu_types=["NVIDIA A40", "NVIDIA L40S"]
    )
    schema = RunpodTarget.model_json_schema()["properties"]["gpu_count"]
    assert (schema["minimum"], schema["maximum"]) == (1, 16)  # the UI form shows the bounds


def test_a_pod_dearer_than_the_whole_gpu_budget_is_refused_before_any_run_or_pod_exists(
    prefect_server: None, sim: RunpodSim, tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    from overbrainer_prefect.server_budget import POD_LIMIT, SPEND_LIMIT, BudgetError, set_budget

    runs_dir = tmp_path / "runs"
    run(set_budget(2, 0.10))  # ten cents an hour: an A4000 at $0.25/h never fits
    try:
        with pytest.raises(BudgetError) as refused:
            run(train(target=target(sim), training=spec(*tiny), runs_dir=str(runs_dir)))
    finally:

        async def drop() -> None:
            async with get_client() as client:
                for name in (POD_LIMIT, SPEND_LIMIT):
                    await client.delete_global_concurrency_limit_by_name(name)

        run(drop())
    message = str(refused.value)
    assert "\n" not in message and "$0.25/h costs more than the whole GPU budget" in message
    assert f"prefect gcl update {SPEND_LIMIT} --limit 25" in message
    assert Runs(runs_dir).list() == [] and sim.pods(include_deleted=True) == []


def test_the_gpu_types_dearer_than_the_whole_budget_are_left_out_of_the_plan(
    prefect_server: None, sim: RunpodSim
) -> None:
    from overbrainer_prefect.server_budget import POD_LIMIT, SPEND_LIMIT, PrefectBudget, set_budget
    from overbrainer_prefect.targets.base import JobNeed, NoBudget
    from overbrainer_prefect.targets.pod import plan_price

    name = target(sim, gpu_types="auto")
    place = RunpodTarget.load(name).target(name, logging.getLogger("budget-test"))
    need = JobNeed(what="the job")

    async def plans() -> tuple[Any, Any]:
        async with place.reserve(Runs(), need, NoBudget()) as reserved:
            plan = reserved.plan
        await set_budget(2, 0.30)
        try:
            async with place.reserve(Runs(), need, PrefectBudget()) as held:
                return plan, held.plan
        finally:
            async with get_client() as client:
                for name in (POD_LIMIT, SPEND_LIMIT):
                    await client.delete_global_concurrency_limit_by_name(name)

    plan, kept = run(plans())
    assert plan_price(plan) > 0.30 and len(kept.choices) < len(plan.choices)
    assert kept.first == plan.first and plan_price(kept) <= 0.30
    assert [c for c in plan.choices if c.price_per_hour <= 0.30] == list(kept.choices)


def test_pods_remove_of_a_run_that_is_not_a_runpod_run_deletes_nothing(
    prefect_server: None, sim: RunpodSim, pods_of: SimPods, tmp_path: Path
) -> None:
    runs_dir = tmp_path / "runs"
    local = start_step.create(Runs(runs_dir), target="laptop", target_kind="local", workdir="/w")
    leave_an_orphan(sim)
    credentials = f"creds-{uuid.uuid4().hex[:8]}"
    RunpodCredentials(api_key=sim.api_key, rest_url=sim.rest_url, graphql_url=sim.graphql_url).save(
        credentials
    )
    with pytest.raises(PodsError, match=f"run {local.id} is not a Runpod run") as raised:
        run(pods(action="remove", run_id=local.id, runs_dir=str(runs_dir), credentials=credentials))
    assert "nothing was deleted" in str(raised.value) and "\n" not in str(raised.value)
    assert not [r for r in sim.requests if r.method == "DELETE"]


def ended_run_with_pod(sim: RunpodSim, runs_dir: Path, retrieved: bool) -> str:
    """A failed run here whose job ran and whose pod is still up: its files
    retrieved and verified (a manifest), or not (the note); returns the pod's id."""
    from overbrainer_prefect.executors.base import JobId
    from overbrainer_prefect.runs.ids import new_run_id
    from overbrainer_prefect.runs.store import RunRecord
    from overbrainer_prefect.timestamps import rfc3339

    run_id = new_run_id()
    runs = Runs(runs_dir)
    runs.save(
        RunRecord(
            id=run_id,
            target="gone",
            target_kind="runpod",
            created=rfc3339(),
            remote_dir=f"/workspace/overbrainer/{run_id}",
            job=JobId(dir=f"/workspace/overbrainer/{run_id}", pid=1234),
            state=RunState.FAILED,
            message="the job failed",
            not_retrieved=None if retrieved else "the pod did not answer",
            ended=rfc3339(),
        )
    )
    if retrieved:
        (runs.run_dir(run_id) / "manifest.json").write_text("[]\n")

    async def go() -> str:
        async with RunpodCredentials(
            api_key=sim.api_key, rest_url=sim.rest_url, graphql_url=sim.graphql_url
        ).client() as client:
            pod = await client.create_pod(
                PodRequest(name=f"ob-{run_id}-a1", image="x:1", gpu_type_id=A5000)
            )
            return pod.id

    return str(run(go()))


def test_pods_lists_and_sweeps_orphans_and_removes_them_by_run_id(
    prefect_server: None, sim: RunpodSim, pods_of: SimPods, tmp_path: Path
) -> None:
    runs_dir = tmp_path / "runs"
    orphan = leave_an_orphan(sim)
    credentials = f"creds-{uuid.uuid4().hex[:8]}"
    RunpodCredentials(api_key=sim.api_key, rest_url=sim.rest_url, graphql_url=sim.graphql_url).save(
        credentials
    )
    listed = run(pods(action="list", runs_dir=str(runs_dir), credentials=credentials))
    (row,) = listed.pods
    assert row.pod_id == orphan and row.run_id == "20250101-000000-gone" and row.orphan
    assert row.gpu == A5000 and row.rate_per_hour == pytest.approx(0.27)
    assert row.run_state == "not here" and row.estimated_spend is not None
    # two ended runs here, each with a pod left: one retrieved and verified, one not
    done, lost = ended_run_with_pod(sim, runs_dir, True), ended_run_with_pod(sim, runs_dir, False)
    swept = run(pods(action="sweep", runs_dir=str(runs_dir), credentials=credentials))
    assert swept.removed == [done] and sim.pod(done).deleted  # nothing is lost by deleting it
    assert any(orphan in warning and "action=remove" in warning for warning in swept.warnings)
    assert any(lost in warning and "not retrieved" in warning for warning in swept.warnings)
    assert not sim.pod(orphan).deleted and not sim.pod(lost).deleted  # they may hold results
    removed = run(
        pods(
            action="remove",
            run_id="20250101-000000-gone",
            runs_dir=str(runs_dir),
            credentials=credentials,
        )
    )
    assert removed.removed == [orphan] and sim.pod(orphan).deleted


def test_stop_from_another_process_checkpoints_a_run_whose_follower_died_and_ends_its_pod(
    prefect_server: None,
    sim: RunpodSim,
    pods_of: SimPods,
    tiny: tuple[Path, Path],
    tmp_path: Path,
) -> None:
    runs_dir = tmp_path / "runs"
    name = target(sim)
    # the follower dies; the job and its pod go on
    record = follower_killed_while_training(name, tiny, runs_dir, tmp_path)
    stopped = run(stop(run_id=record.id, runs_dir=str(runs_dir)))
    assert stopped.state == RunState.STOPPED, stopped.message
    saved = Runs(runs_dir).load(record.id)
    assert saved.checkpoint is not None and saved.checkpoint.startswith("output/checkpoint-")
    assert (Runs(runs_dir).run_dir(record.id) / saved.checkpoint / "trainer_state.json").is_file()
    pod = PodRecord.load(Runs(runs_dir), record.id)
    assert pod is not None and deleted_once_verified(pod), pod
    assert pod.pod_id is not None and sim.pod(pod.pod_id).deleted


def test_keep_pod_keeps_the_pod_reachable_with_its_ssh_command_until_pods_remove(
    prefect_server: None,
    sim: RunpodSim,
    pods_of: SimPods,
    tiny: tuple[Path, Path],
    tmp_path: Path,
) -> None:
    runs_dir = tmp_path / "runs"
    name = target(sim, keep_pod=True, boot_grace_s=60.0)
    result = run(train(target=name, training=spec(*tiny, max_steps=3), runs_dir=str(runs_dir)))
    assert result.state == RunState.SUCCEEDED, result.message
    pod = PodRecord.load(Runs(runs_dir), result.run_id)
    assert pod is not None and pod.state == PodState.KEPT and pod.pod_id is not None
    assert not sim.pod(pod.pod_id).deleted
    record = Runs(runs_dir).load(result.run_id)
    assert record.flow_run_id is not None
    warned = [text for text in flow_logs(record.flow_run_id) if text.startswith("keep_pod:")]
    assert warned and "$0.25/h" in warned[-1], warned
    command = warned[-1].split("`")[1]
    assert command.startswith("ssh -F ") and command.endswith(f"overbrainer-{result.run_id}")
    reached = subprocess.run(
        [*command.split(), "-o", "BatchMode=yes", "cat", f"{record.remote_dir}/.pod/owner"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert reached.returncode == 0, reached.stderr
    assert reached.stdout.strip() == f"run={result.run_id} pod={pod.pod_id}"
    # the watchdog of a kept pod deletes nothing, even with its files retrieved
    time.sleep(3)
    assert not sim.pod(pod.pod_id).deleted
    removed = run(pods(action="remove", run_id=result.run_id, runs_dir=str(runs_dir)))
    assert removed.removed == [pod.pod_id] and sim.pod(pod.pod_id).deleted
    after = PodRecord.load(Runs(runs_dir), result.run_id)
    assert after is not None and after.state == PodState.DELETED
    assert not (Runs(runs_dir).run_dir(result.run_id) / SSH_DIR / CLIENT_KEY).exists()
    assert sim.secret_names() == []


def test_the_cancel_flow_cancels_a_job_on_its_pod_retrieves_what_it_left_and_ends_the_pod(
    prefect_server: None,
    sim: RunpodSim,
    pods_of: SimPods,
    tiny: tuple[Path, Path],
    tmp_path: Path,
) -> None:
    runs_dir = tmp_path / "runs"
    name = target(sim)
    record = follower_killed_while_training(name, tiny, runs_dir, tmp_path)
    result = run(cancel(run_id=record.id, runs_dir=str(runs_dir)))
    assert result.state == RunState.CANCELLED and result.retrieved
    local = Runs(runs_dir).run_dir(record.id)
    assert (local / "job.log").is_file() and (local / ".pod" / "watchdog.log").is_file()
    pod = PodRecord.load(Runs(runs_dir), record.id)
    assert pod is not None and pod.state == PodState.DELETED and pod.pod_id is not None
    assert sim.pod(pod.pod_id).deleted
    assert record.job is not None and not pods_of.running(pod.pod_id)


def test_the_sweep_deletes_a_pod_whose_job_never_started_within_boot_grace_and_no_other(
    prefect_server: None, sim: RunpodSim, pods_of: SimPods, tmp_path: Path
) -> None:
    from overbrainer_prefect.runs.ids import new_run_id
    from overbrainer_prefect.runs.store import RunRecord
    from overbrainer_prefect.timestamps import rfc3339

    runs_dir = tmp_path / "runs"
    runs = Runs(runs_dir)
    pods_of.boot_delay_s = 3600.0  # their start commands never run: no watchdog bounds them

    def preparing_with_pod(asked_ago_s: float) -> tuple[str, str]:
        """A record whose follower died before its job started, and its pod."""
        run_id = new_run_id()
        runs.save(
            RunRecord(
                id=run_id,
                target="gone",
                target_kind="runpod",
                created=rfc3339(),
                remote_dir=f"/workspace/overbrainer/{run_id}",
            )
        )

        async def create() -> str:
            async with RunpodCredentials(
                api_key=sim.api_key, rest_url=sim.rest_url, graphql_url=sim.graphql_url
            ).client() as client:
                made = await client.create_pod(
                    PodRequest(name=f"ob-{run_id}-a1", image="x:1", gpu_type_id=A5000)
                )
                return made.id

        pod_id = str(run(create()))
        PodRecord(
            run_id=run_id,
            state=PodState.BOOTING,
            pod_id=pod_id,
            host_key="ssh-ed25519 AAAA",
            created_unix=int(time.time() - asked_ago_s),
            boot_grace_s=30.0,
        ).save(runs)
        return run_id, pod_id

    late_run, late_pod = preparing_with_pod(asked_ago_s=120)  # past its boot bound
    young_run, young_pod = preparing_with_pod(asked_ago_s=5)  # may still boot
    credentials = f"creds-{uuid.uuid4().hex[:8]}"
    RunpodCredentials(api_key=sim.api_key, rest_url=sim.rest_url, graphql_url=sim.graphql_url).save(
        credentials
    )
    listed = run(pods(action="list", runs_dir=str(runs_dir), credentials=credentials))
    why = {row.pod_id: row.why for row in listed.pods}
    assert "never started within boot_grace" in why[late_pod]
    assert "its watchdog has not shown it runs yet" in why[young_pod]
    assert "bounded by its watchdog" not in why[young_pod]  # it has shown nothing
    swept = run(pods(action="sweep", runs_dir=str(runs_dir), credentials=credentials))
    assert swept.removed == [late_pod] and sim.pod(late_pod).deleted
    assert not sim.pod(young_pod).deleted
    assert runs.load(late_run).state == RunState.FAILED
    assert runs.load(young_run).state == RunState.PREPARING


def test_pods_tells_when_the_files_of_a_job_nobody_follows_are_lost_and_remove_says_they_were_never_retrieved(  # noqa: E501
    prefect_server: None, sim: RunpodSim, pods_of: SimPods, tmp_path: Path
) -> None:
    from tests.test_pod_fate import pod_of_a_run_here

    runs = Runs(tmp_path / "runs")
    run_id, pod_id = pod_of_a_run_here(sim, runs, None)  # its job runs; its follower is gone
    credentials = f"creds-{uuid.uuid4().hex[:8]}"
    RunpodCredentials(api_key=sim.api_key, rest_url=sim.rest_url, graphql_url=sim.graphql_url).save(
        credentials
    )
    swept = run(pods(action="sweep", runs_dir=str(runs.root), credentials=credentials))
    (row,) = swept.pods
    assert row.unfollowed and not row.orphan and row.files_lost_at is not None
    assert "nobody following it" in row.why and f"run_id={run_id}" in row.save_with
    assert swept.removed == [] and not sim.pod(pod_id).deleted  # its files are not here
    (warning,) = swept.warnings
    assert pod_id in warning and "save its files with the collect flow" in warning
    removed = run(
        pods(action="remove", run_id=run_id, runs_dir=str(runs.root), credentials=credentials)
    )
    assert removed.removed == [pod_id] and sim.pod(pod_id).deleted
    record = runs.load(run_id)
    assert record.state == RunState.FAILED
    assert record.message == "its pod was removed with the pods flow"
    assert record.not_retrieved == (
        "its pod was removed with the pods flow: the job's files were never retrieved"
    )
    assert any("never retrieved" in w for w in removed.warnings)
    pod = PodRecord.load(runs, run_id)
    assert pod is not None and pod.deleted_by == "pods flow"


# The killed flow's pod waits 252 s for its watchdog's max_hours: that wait runs beside the
# module's other tests (started by `killed_flow` at the module's first test), and the test
# that reads what came of it is the module's last.

KILLED = "test_a_killed_flow_leaves_its_pod_to_the_watchdog_and_attach_tells_the_truth"
KILLED_TIMING = f"{FAST},checkpoint_hold_s=1800"
"""The killed flow's pod's timings: its checkpoint hold lasts until the module's last
test attaches (a test in between may take minutes)."""


@dataclass
class KilledFlow:
    """A train flow on the simulator killed once its job trained, its pod left to its
    watchdog, followed in a thread of its own (`follow`) until the watchdog held the
    pod for the checkpoint it asked for past max_hours."""

    sim: RunpodSim
    pods: SimPods
    runs_dir: Path
    abandon: threading.Event = field(default_factory=threading.Event)
    record: Any = None
    error: BaseException | None = None
    thread: threading.Thread | None = None

    def follow(self, child: Any) -> None:
        """What the test saw of the killed flow's pod until its hold, noted in
        `record` (or the failure in `error`)."""
        try:
            self.watch(child)
        except BaseException as error:  # re-raised by the test
            self.error = error

    def watch(self, child: Any) -> None:
        # SIGKILL: no hook runs, the job and its pod keep going
        record = killed_once_training(child, self.runs_dir, self.abandon)
        if self.abandon.is_set():
            return
        sim, pods_of = self.sim, self.pods
        pod = PodRecord.load(Runs(self.runs_dir), record.id)
        assert pod is not None and pod.pod_id is not None and not sim.pod(pod.pod_id).deleted
        assert pod.deadline_unix is not None
        # Until the watchdog asks for its checkpoint, the job waits stopped (SIGSTOP to its
        # process group), as a job in one long step would: nothing on the pod waits on its
        # steps before then, and the cores it leaves go to the rest of the suite.
        assert record.job is not None
        with held_stopped(record.job.pid):  # a deleted pod's job is gone: no error then
            wait_until(
                lambda: (
                    self.abandon.is_set()
                    or "asked the job for a checkpoint"
                    in pods_of.watchdog_log(str(pod.pod_id), record.id)
                ),
                240,
                "the watchdog to ask for a checkpoint before max_hours",
            )

        def held() -> bool:
            log = pods_of.watchdog_log(str(pod.pod_id), record.id)
            # the job did not end within the checkpoint lead: say what the watchdog did
            assert "decision: delete pod" not in log, log[-2000:]
            return self.abandon.is_set() or "hold: max_hours passed" in log

        wait_until(held, 150, "max_hours, and the checkpoint the watchdog asked for")
        assert not sim.pod(pod.pod_id).deleted  # the checkpoint is not destroyed seconds after
        self.record = record


@pytest.fixture(scope="module", autouse=True)
def killed_flow(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[KilledFlow | None]:
    """At the module's first test, when `KILLED` is among the tests to run: a
    train flow on a simulator of its own (max_hours 252 s after the create, a
    checkpoint asked 25 s before: the job must train by then, and on a busy
    machine its first step comes about 90 s after the create; then end within
    those 25 s, which takes it 4 s on a quiet machine and took more than 14 s
    on a loaded one), in a child process that a thread kills and follows
    (`KilledFlow`)."""
    if not any(item.name == KILLED for item in request.session.items):
        yield None
        return
    request.getfixturevalue("prefect_server")
    tiny = request.getfixturevalue("tiny")
    root = tmp_path_factory.mktemp("killed-flow")
    runs_dir = root / "runs"
    with (
        running_sim() as simulator,
        SimPods(root / "pods").attached(simulator) as simulated,
        pytest.MonkeyPatch.context() as patch,
    ):
        patch.setenv(TIMING_ENV, KILLED_TIMING)  # the child's, and the pod's it creates
        # retrieve_grace as long as the hold: the job ended minutes before the last test
        name = target(simulator, max_hours=0.07, retrieve_grace_s=1800.0)
        child = start_in_child(name, spec(*tiny, max_steps=LONG), runs_dir, root / "child.log")
        patch.undo()
        killed = KilledFlow(sim=simulator, pods=simulated, runs_dir=runs_dir)
        killed.thread = threading.Thread(target=killed.follow, args=(child,), daemon=True)
        killed.thread.start()
        try:
            yield killed
        finally:
            killed.abandon.set()
            kill(child)
            killed.thread.join(timeout=30)


def test_a_killed_flow_leaves_its_pod_to_the_watchdog_and_attach_tells_the_truth(
    killed_flow: KilledFlow | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert killed_flow is not None and killed_flow.thread is not None
    monkeypatch.setenv(TIMING_ENV, KILLED_TIMING)
    killed_flow.thread.join(timeout=700)  # its own waits are bounded: 630 s at most
    assert not killed_flow.thread.is_alive(), "the killed flow's pod was not held in time"
    if killed_flow.error is not None:
        raise killed_flow.error
    sim, pods_of, runs_dir = killed_flow.sim, killed_flow.pods, killed_flow.runs_dir
    record = killed_flow.record
    assert record is not None
    pod = PodRecord.load(Runs(runs_dir), record.id)
    assert pod is not None and pod.pod_id is not None and not sim.pod(pod.pod_id).deleted
    log = pods_of.watchdog_log(pod.pod_id, record.id)
    assert log.index("asked the job for a checkpoint") < log.index("hold: max_hours passed")
    result = run(attach(run_id=record.id, runs_dir=str(runs_dir)))  # within the hold
    assert isinstance(result, RunResult) and result.state == RunState.STOPPED
    saved = Runs(runs_dir).load(record.id)
    assert saved.checkpoint and (Runs(runs_dir).run_dir(record.id) / saved.checkpoint).is_dir()
    assert saved.message is not None and f"resume_from={record.id}" in saved.message
    pod = PodRecord.load(Runs(runs_dir), record.id)
    assert pod is not None and deleted_once_verified(pod), pod
    assert not (Runs(runs_dir).run_dir(record.id) / SSH_DIR / CLIENT_KEY).exists()
