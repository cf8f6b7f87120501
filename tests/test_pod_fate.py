"""What becomes of a pod, told as it happened, against the Runpod simulator
whose pods are real process trees (the package's real bootstrap + watchdog,
a real sshd on 127.0.0.1): a start command that exits is found out while
the client waits for SSH, with its log; a pod whose job does not see the
GPUs it bills for runs no job; a delete refused once the files are verified
leaves the run succeeded and the pod to its watchdog; uptime, spend and who
deleted the pod match the simulator's ledger. Only the core: no Prefect
server.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr

from overbrainer_prefect.blocks import RunpodTarget
from overbrainer_prefect.executors.base import JobId
from overbrainer_prefect.runpod import Pod, PodRequest, RunpodClient
from overbrainer_prefect.runpod.boot import START_MARK, ContainerWatch, log_verdict
from overbrainer_prefect.runpod.bootstrap import TIMING_ENV, WATCHDOG_LOG
from overbrainer_prefect.runpod.errors import PodError
from overbrainer_prefect.runpod.pod import PodRecord, PodState
from overbrainer_prefect.runs.lock import follow_lock
from overbrainer_prefect.runs.store import Runs, RunState
from overbrainer_prefect.steps import reporters
from overbrainer_prefect.steps import start as start_step
from overbrainer_prefect.steps.context import Outcome
from overbrainer_prefect.targets.base import JobNeed, NoBudget, Target
from overbrainer_prefect.targets.runpod.context import PodContext
from overbrainer_prefect.targets.runpod.ending import remove
from overbrainer_prefect.targets.runpod.fate import (
    RESTART_REASON,
    RETRIEVED_REASON,
    found_gone,
    runpod_agrees,
)
from overbrainer_prefect.targets.runpod.follow import Silence
from overbrainer_prefect.targets.runpod.gpucheck import gpu_mismatch
from overbrainer_prefect.targets.runpod.keys import CLIENT_KEY, SSH_DIR
from overbrainer_prefect.targets.runpod.orphans import PodRow, orphan_warnings, pod_rows
from overbrainer_prefect.targets.runpod.reaper import BY, REAPER_LOG
from overbrainer_prefect.timestamps import rfc3339
from overbrainer_prefect.trainers.base import TargetFacts, TrainError
from tests.runpod_fixtures import target_values
from tests.runpod_sim import RunpodSim, running_sim
from tests.runpod_sim.pods import SimPods, deleted_once_verified
from tests.shelljobs import WRITE_METRICS, WRITE_OUTPUT, ShellTrainer
from tests.test_watchdog import A4000, FAST, STALLED, Bed, progressing, ready_pod, settings

LOG = logging.getLogger("pod-fate")
TRAINS = f"{WRITE_METRICS}; {WRITE_OUTPUT}"
"""A job that writes its metrics and its output, then ends."""

FOLLOWER = """
import asyncio, sys
from pydantic import SecretStr
from overbrainer_prefect.runpod import RunpodClient, RunpodTargetSettings, plan_from_api
from overbrainer_prefect.targets.runpod.context import PodContext
from overbrainer_prefect.targets.runpod.provision import provision
from overbrainer_prefect.runs.store import Runs
from overbrainer_prefect.steps import start as start_step
runs_dir, rest, graphql, grace = sys.argv[1:5]
key = sys.stdin.read().strip()
async def main():
    async with RunpodClient(SecretStr(key), rest, graphql) as client:
        ctx = PodContext(client=client, runs=Runs(runs_dir))
        wanted = RunpodTargetSettings(
            gpu_types=["NVIDIA RTX A4000"], image="x:1", max_hours=1.0, boot_grace_s=float(grace)
        )
        plan = await plan_from_api(client, wanted)
        record = start_step.create(ctx.runs, target="sim", target_kind="runpod", workdir="/w")
        await provision(ctx, record, plan, api_url=rest, name="sim")
asyncio.run(main())
"""
"""A follower in a process of its own: provisions a pod (and is killed)."""

CRASHES = ["sh", "-c", "echo 'bootstrap: gzip: not found' >&2; exit 2"]
"""A start command that cannot run: it prints why and exits with code 2."""


@pytest.fixture
def bed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Bed]:
    monkeypatch.setenv(TIMING_ENV, FAST)
    with running_sim() as sim, SimPods(tmp_path / "pods").attached(sim) as pods:
        yield Bed(sim, pods, Runs(tmp_path / "runs"))


def pod_target(sim: RunpodSim, **changes: Any) -> Target:
    """A Runpod target on the simulator (its block not saved: no Prefect)."""
    values = target_values(sim, **{"poll_seconds": 0.3, **changes})
    return RunpodTarget(**values).target("overbrainer-runpod-target/fate", LOG)


async def train_on(place: Target, runs: Runs, script: str, meanwhile: Any = None) -> Outcome:
    """Reserves, places, starts and follows a shell job on `place`; with
    `meanwhile(pod)`, that is run in a thread once the job started."""
    need = JobNeed(what="the job")
    async with place.reserve(runs, need, NoBudget()) as reservation:
        record = start_step.create(
            runs, target=place.ref, target_kind=place.kind, workdir=place.workdir, trainer="shell"
        )
        async with place.place(runs, runs.load(record.id), reservation) as placed:
            record = runs.load(record.id)
            record.remote_dir = placed.remote_dir(record)  # the caller records it (a pod's)
            runs.save(record)
            ctx = placed.context(runs, reporters.LogReporter())
            started = await start_step.start(ctx, ShellTrainer(script), record)
            placed.started(runs, started)
            if meanwhile is not None:
                await asyncio.to_thread(meanwhile, PodRecord.load(runs, record.id))
            return await placed.follow(ctx, ShellTrainer(script), started)


def the_pod(runs: Runs) -> PodRecord:
    (record,) = runs.list()
    pod = PodRecord.load(runs, record.id)
    assert pod is not None and pod.pod_id is not None
    return pod


def assert_ledger(pod: PodRecord, sim: RunpodSim, slack_s: float) -> None:
    """The pod's uptime and spend in `pod.json` are the simulator's bill,
    within `slack_s` seconds (of uptime, and of the bill's rate)."""
    billed = sim.pod(pod.pod_id or "")
    assert billed.deleted_at is not None
    up = billed.deleted_at - billed.created_at
    assert abs(pod.uptime_s() - up) <= slack_s, (pod.uptime_s(), up)
    rate = billed.spend(billed.deleted_at) / up * 3600
    spend = pod.estimated_spend()
    assert spend is not None and abs(spend - billed.spend(sim.now())) <= rate * slack_s / 3600
    assert pod.rate == pytest.approx(rate, rel=1e-6)


# -- a pod that cannot start ------------------------------------------------------------


def test_a_container_counts_as_restarted_when_its_start_moves_not_when_it_first_shows() -> None:
    watch = ContainerWatch()
    assert not watch.look(Pod.model_validate({"id": "p", "status": "RUNNING", "startedAt": None}))
    first = {"id": "p", "status": "RUNNING", "startedAt": "2026-12-02T06:00:00.100Z"}
    assert not watch.look(Pod.model_validate({**first, "runtime": {"uptime": 0}}))
    assert not watch.look(Pod.model_validate({**first, "runtime": {"uptime": 3}}))
    again = {**first, "startedAt": "2026-12-02T06:00:03.400Z", "runtime": {"uptime": 0}}
    assert watch.look(Pod.model_validate(again)) and watch.restarts == 1
    by_uptime = ContainerWatch()  # an answer without startedAt: its uptime going back
    assert not by_uptime.look(Pod.model_validate({"id": "p", "runtime": {"uptime": 5}}))
    assert by_uptime.look(Pod.model_validate({"id": "p", "runtime": {"uptime": 1}}))


def test_who_deleted_a_pod_is_read_from_its_watchdogs_log(tmp_path: Path) -> None:
    runs = Runs(tmp_path / "runs")
    pod = PodRecord(run_id="20261202-060000-abcd", host_key="k", pod_id="p1", created_unix=1.0)
    assert found_gone(runs, pod).by == "unknown"
    assert "Runpod terminated it" in found_gone(runs, pod).reason
    log = runs.run_dir(pod.run_id) / WATCHDOG_LOG
    log.parent.mkdir(parents=True)
    log.write_text(
        "2026-12-02T06:00:01Z job: ended (exit code 0)\n"
        "2026-12-02T06:00:09Z decision: delete pod p1: the job ended 120s ago and its files were "
        "not retrieved (retrieve_grace)\n"
        "2026-12-02T06:00:10Z deleted: Runpod answered 204 to the delete of pod p1 "
        "[at=1796191210.25]\n"
    )
    fate = found_gone(runs, pod)
    assert fate.by == "watchdog" and fate.reason.startswith("the job ended 120s ago")
    assert fate.at == 1796191210.25
    pod.retrieved_marked = True
    assert found_gone(runs, pod).reason == RETRIEVED_REASON


def test_a_pod_found_gone_past_a_bound_its_follower_did_not_see_is_told_by_that_bound(
    tmp_path: Path,
) -> None:
    runs = Runs(tmp_path / "runs")
    record = start_step.create(runs, target="sim", target_kind="runpod", workdir="/w")
    made = float(int(time.time()) - 3600)  # whole seconds, as records keep them
    pod = PodRecord(
        run_id=record.id, host_key="k", pod_id="p1", created_unix=made, boot_grace_s=600.0
    )
    pod.state = PodState.READY  # its job's files verified, the pipeline's next job to follow
    pod.between_unix, pod.next_job_grace_s = made + 1200, 300.0
    fate = found_gone(runs, pod, now=made + 1400)  # within its grace: not the watchdog's bound
    assert fate.by == "unknown" and "account's balance" in fate.reason
    fate = found_gone(runs, pod, now=made + 1600)
    assert fate.by == "watchdog" and fate.at == made + 1500
    assert "within next_job_grace (300s after the files of its last job" in fate.reason
    assert "balance" not in fate.reason

    pod.between_unix = None  # no job started: its boot grace
    fate = found_gone(runs, pod, now=made + 700)
    assert fate.by == "watchdog" and "no job started within boot_grace (600s" in fate.reason

    record.state, record.ended = RunState.FAILED, rfc3339(datetime.fromtimestamp(made + 60, UTC))
    runs.save(record)  # its job ended, its files not retrieved: its retrieve grace
    pod.state, pod.retrieve_grace_s = PodState.AWAITING_RETRIEVAL, 120.0
    assert found_gone(runs, pod, now=made + 150).by == "unknown"
    fate = found_gone(runs, pod, now=made + 200)
    assert fate.by == "watchdog" and fate.at == made + 180
    assert fate.reason.endswith("its files were not retrieved (retrieve_grace)")


@pytest.mark.slow
def test_a_start_command_that_exits_ends_the_boot_wait_with_its_log_and_the_pod_is_deleted(
    bed: Bed,
) -> None:
    bed.pods.start_command = CRASHES
    bed.pods.restart_delay_s = (0.3, 0.6)

    async def body(ctx: PodContext) -> PodError:
        try:
            await ready_pod(ctx, bed, settings(boot_grace_s=900.0))
        except PodError as error:
            return error
        raise AssertionError("a pod whose start command exits was made ready")

    async def main() -> PodError:
        client = RunpodClient(SecretStr(bed.sim.api_key), bed.sim.rest_url, bed.sim.graphql_url)
        async with client:
            return await body(PodContext(client=client, runs=bed.runs))

    error = asyncio.run(main())
    assert "start command exited" in str(error) and "gzip: not found" in str(error)
    assert "Runpod restarted its container" in str(error)
    assert "gzip: not found" in (error.kept or "")  # what the driver fails the run with
    (billed,) = bed.sim.pods(include_deleted=True)
    assert billed.deleted and bed.pods.restarts(billed.id) >= 1
    # ended at its first restarts, not at the end of its 900 s boot grace
    assert billed.deleted_at is not None and billed.deleted_at - billed.created_at < 120
    pod = the_pod(bed.runs)
    assert pod.state == PodState.DELETED and pod.deleted_by == "client"


def test_a_start_that_cannot_run_is_told_from_the_pods_log() -> None:
    started = f"{START_MARK} for run r on pod p"
    assert log_verdict([], []) is None  # an image still being pulled
    assert log_verdict([started], ["2026-12-02T06:00:00Z container started"]) is None
    banner = ["== CUDA ==", "sh: 1: nvidia-smi: not found", started]  # before the bootstrap
    assert log_verdict(banner, []) is None
    twice = log_verdict([started, "x", started], [])
    assert twice is not None and "started 2 times" in twice
    missing = log_verdict(["sh: 1: gzip: not found"] * 3, [])
    assert missing is not None and "missing" in missing
    sshd = log_verdict([started, "overbrainer-bootstrap: sshd: /usr/sbin/sshd refuses"], [])
    assert sshd is not None and "sshd cannot start" in sshd
    exited = log_verdict([], ["T container started", "T container exited with code 0"])
    assert exited is not None and "1 exit in its events" in exited
    again = log_verdict([], ["T start container for x:1", "T start container for x:1"])
    assert again is not None and "started more than once" in again


@pytest.mark.slow
def test_a_crash_looping_start_the_pod_view_hides_is_told_from_its_log_within_a_minute(
    bed: Bed,
) -> None:
    bed.sim.hide_restarts()  # startedAt and uptime count from the create, whatever happens
    bed.pods.start_command = CRASHES
    bed.pods.restart_delay_s = (0.3, 0.6)

    async def main() -> PodError:
        client = RunpodClient(SecretStr(bed.sim.api_key), bed.sim.rest_url, bed.sim.graphql_url)
        async with client:
            try:
                await ready_pod(
                    PodContext(client=client, runs=bed.runs), bed, settings(boot_grace_s=300.0)
                )
            except PodError as error:
                return error
        raise AssertionError("a pod whose start command exits was made ready")

    error = asyncio.run(main())
    told = str(error)
    assert "a tool its start command needs is missing" in told and "gzip: not found" in told
    assert "restart seen" not in told and "\n" not in told  # the log told it, not the view
    assert "gzip: not found" in (error.kept or "")  # what the driver fails the run with
    (billed,) = bed.sim.pods(include_deleted=True)
    assert not billed.shows_restarts and bed.pods.restarts(billed.id) >= 2
    # deleted from the log, not at the end of its 300 s boot grace (the simulator's clock)
    assert billed.deleted_at is not None and billed.deleted_at - billed.created_at < 60
    pod = the_pod(bed.runs)
    assert pod.state == PodState.DELETED and pod.deleted_by == "client"
    (record,) = bed.runs.list()
    assert record.state == RunState.FAILED and "gzip: not found" in (record.message or "")


@pytest.mark.slow
def test_a_pod_whose_sshd_cannot_start_is_told_from_the_bootstraps_own_log_line(
    bed: Bed, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(TIMING_ENV, f"{FAST},ssh_late_s=3")  # SSH late after 3 s, not 30
    bed.pods.never_ssh = True  # the real bootstrap runs; its sshd refuses to start

    async def main() -> PodError:
        client = RunpodClient(SecretStr(bed.sim.api_key), bed.sim.rest_url, bed.sim.graphql_url)
        async with client:
            ctx = PodContext(client=client, runs=bed.runs)
            try:
                await ready_pod(ctx, bed, settings(boot_grace_s=300.0))
            except PodError as error:
                return error
        raise AssertionError("a pod without sshd was made ready")

    told = str(asyncio.run(main()))
    assert "its sshd cannot start, so nothing will answer SSH" in told, told
    assert f"{START_MARK} for run" in told and "refuses to start" in told  # its log's last lines
    (billed,) = bed.sim.pods(include_deleted=True)
    assert billed.deleted_at is not None and billed.deleted_at - billed.created_at < 60


def test_the_pod_log_is_served_as_runpod_streams_it(bed: Bed) -> None:
    bed.pods.start_command = CRASHES
    bed.pods.restart_delay_s = (0.1, 0.2)

    async def main() -> tuple[list[str], list[str]]:
        client = RunpodClient(SecretStr(bed.sim.api_key), bed.sim.rest_url, bed.sim.graphql_url)
        async with client:
            pod = await client.create_pod(
                PodRequest(name="ob-x-a1", image="x:1", gpu_type_id=A4000)
            )
            while bed.pods.restarts(pod.id) < 2:
                await asyncio.sleep(0.1)
            return (
                await client.pod_logs(pod.id, "container", tail=2),
                await client.pod_logs(pod.id, "system", tail=50),
            )

    container, system = asyncio.run(main())
    assert container == ["bootstrap: gzip: not found"] * 2
    assert any("container exited with code 2" in line for line in system)


# -- a pod has what it bills for ----------------------------------------------------------


def test_a_job_must_see_the_gpus_its_pod_bills_for() -> None:
    pod = PodRecord(run_id="r", host_key="k", pod_id="p1", gpu_type_id=A4000, billed_gpus=2)
    pod.cost_per_hour = 0.5
    assert gpu_mismatch(pod, TargetFacts(python="/v/bin/python", gpus=2)) is None
    problem = gpu_mismatch(pod, TargetFacts(python="/v/bin/python", gpus=0))
    assert problem is not None and "bills for 2 GPUs" in problem and "sees 0" in problem
    cpu = pod.model_copy(update={"billed_gpus": 0})
    assert gpu_mismatch(cpu, TargetFacts(python="/v/bin/python", gpus=0)) is None


@pytest.mark.slow
def test_a_pod_whose_job_sees_fewer_gpus_than_it_bills_for_is_deleted_with_both_numbers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(TIMING_ENV, FAST)
    runs = Runs(tmp_path / "runs")
    with running_sim(gpu_pods=True) as sim, SimPods(tmp_path / "pods").attached(sim):
        place = pod_target(sim, gpu_count=2)
        with pytest.raises(TrainError) as raised:
            asyncio.run(train_on(place, runs, TRAINS))
        (billed,) = sim.pods(include_deleted=True)
        assert billed.deleted and billed.gpu_count == 2
    assert "bills for 2 GPUs" in str(raised.value) and "sees 0" in str(raised.value)
    (record,) = runs.list()
    assert record.state == RunState.FAILED and record.job is None
    assert "bills for 2 GPUs" in (record.message or "")
    pod = the_pod(runs)
    assert pod.state == PodState.DELETED and pod.billed_gpus == 2


# -- the end of a pod, and its bill ---------------------------------------------------------


@pytest.mark.slow
def test_uptime_spend_and_who_deleted_the_pod_match_the_simulators_ledger(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(TIMING_ENV, FAST)
    runs = Runs(tmp_path / "runs")
    with running_sim() as sim, SimPods(tmp_path / "pods").attached(sim):
        sim.lag_after_delete(gets=10)  # its deletion takes seconds to confirm: not billed
        outcome = asyncio.run(train_on(pod_target(sim), runs, TRAINS))
        assert outcome.record.state == RunState.SUCCEEDED and outcome.retrieved
        pod = the_pod(runs)
        assert deleted_once_verified(pod), pod
        assert_ledger(pod, sim, slack_s=1.0)
        reaper_log = runs.run_dir(pod.run_id) / REAPER_LOG
        wait_for(lambda: "shows it runs" in reaper_log.read_text(), 30, "the reaper to end")


@pytest.mark.slow
@pytest.mark.parametrize("status", [502, 401])
def test_a_verified_run_whose_delete_is_refused_succeeds_and_its_watchdog_deletes_the_pod(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, status: int
) -> None:
    monkeypatch.setenv(TIMING_ENV, FAST)
    runs = Runs(tmp_path / "runs")
    with running_sim() as sim, SimPods(tmp_path / "pods").attached(sim):
        # the account's deletes are refused (an outage, a key turned off); the pod's own key works
        sim.fail(status, times=1000, method="DELETE", account_only=True)
        outcome = asyncio.run(train_on(pod_target(sim), runs, TRAINS))
        assert outcome.record.state == RunState.SUCCEEDED and outcome.retrieved
        (billed,) = sim.pods(include_deleted=True)
        assert billed.deleted
        deletes = sim.requests_to("DELETE", f"/v2/pods/{billed.id}")
        assert {r.scope for r in deletes if r.status == 204} == {f"pod:{billed.id}"}
        pod = the_pod(runs)
        assert pod.state == PodState.DELETED
        assert pod.deleted_by == "watchdog" and pod.delete_reason == RETRIEVED_REASON
        # its watchdog's delete is seen when this client looks, after its own delete's
        # retries (about 3.5 s on a 502): the uptime recorded is the bill's upper bound
        assert_ledger(pod, sim, slack_s=6.0 if status == 502 else 3.0)


# -- a pod bounded whatever dies here -------------------------------------------------------


def pod_json_missing() -> PodRecord:
    raise AssertionError("the run has no pod.json")


def wait_for(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.2)


@pytest.mark.slow
def test_a_pod_that_never_boots_with_its_follower_killed_is_deleted_at_its_boot_bound(
    bed: Bed,
) -> None:
    bed.pods.boot_delay_s = 3600.0  # its start command never runs: no watchdog bounds it
    grace = 6.0
    argv = [str(bed.runs.root), bed.sim.rest_url, bed.sim.graphql_url, str(grace)]
    follower = subprocess.Popen(
        [sys.executable, "-c", FOLLOWER, *argv],
        stdin=subprocess.PIPE,
    )
    assert follower.stdin is not None
    follower.stdin.write(bed.sim.api_key.encode())
    follower.stdin.close()
    try:
        wait_for(lambda: bed.sim.pods(), 60, "the pod's create")
    finally:
        follower.kill()  # no hook, no collect: nothing on this side but the reaper
        follower.wait()
    (billed,) = bed.sim.pods(include_deleted=True)
    wait_for(lambda: billed.deleted, 90, "the pod's delete")
    (record,) = bed.runs.list()
    wait_for(
        lambda: (PodRecord.load(bed.runs, record.id) or pod_json_missing()).deleted_by == BY,
        30,
        "pod.json to say the reaper deleted the pod",
    )
    pod = PodRecord.load(bed.runs, record.id)
    assert pod is not None and pod.state == PodState.DELETED and pod.gone
    assert billed.id in [pod.pod_id, *pod.swept]  # recorded, or found by its name
    assert "boot_grace" in (pod.delete_reason or "")
    assert billed.deleted_at is not None and billed.deleted_at - billed.created_at >= grace
    wait_for(
        lambda: (
            "deleted at its boot bound" in (bed.runs.run_dir(record.id) / REAPER_LOG).read_text()
        ),
        30,
        "the reaper to end",
    )
    assert bed.sim.secret_names() == []  # its host key secret went with it


# -- a pod's end, told as it happened ---------------------------------------------------


def metrics_written(sim_pods: SimPods, pod: PodRecord) -> bool:
    run_dir = sim_pods.workspace_of(pod.pod_id or "") / "overbrainer" / pod.run_id
    return (run_dir / "metrics.jsonl").is_file()


@pytest.mark.slow
def test_a_container_restarted_mid_job_is_told_and_what_its_job_left_is_retrieved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(TIMING_ENV, FAST)
    runs = Runs(tmp_path / "runs")
    with running_sim() as sim, SimPods(tmp_path / "pods").attached(sim) as sim_pods:
        sim_pods.restart_delay_s = (0.2, 0.4)

        def restart(pod: PodRecord) -> None:
            wait_for(lambda: metrics_written(sim_pods, pod), 30, "the job's first metric")
            sim_pods.restart(sim.pod(pod.pod_id or ""))  # its host restarts the container

        with caplog.at_level(logging.WARNING, logger=LOG.name):
            outcome = asyncio.run(train_on(pod_target(sim), runs, STALLED, restart))
        (billed,) = sim.pods(include_deleted=True)
        assert billed.deleted and sim_pods.restarts(billed.id) == 1
    assert outcome.record.state == RunState.FAILED and outcome.retrieved
    assert "metrics.jsonl" in {f.path for f in outcome.files}
    pod = the_pod(runs)
    assert pod.state == PodState.DELETED and pod.restarted is not None and pod.lost_step == 1
    assert pod.delete_reason == f"{RESTART_REASON} (at {pod.restarted}, at step 1); what the " + (
        "job left was retrieved"
    )
    told = runs.load(pod.run_id).message or ""  # the run record says what happened
    assert f"the container of pod {pod.pod_id} restarted at {pod.restarted}" in told, told
    assert "was lost with it at step 1; what it left was retrieved" in told, told
    assert "without an exit code" not in told
    assert outcome.record.message == told
    assert any("restarted at" in r.getMessage() for r in caplog.records), caplog.text
    log = (runs.run_dir(pod.run_id) / ".pod" / "watchdog.log").read_text()
    assert "container: restarted; the job it ran was lost with it" in log
    assert "job: ended (lost: the container restarted)" in log


@pytest.mark.slow
def test_a_pod_terminated_by_runpod_mid_job_fails_its_run_with_that_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(TIMING_ENV, FAST)
    runs = Runs(tmp_path / "runs")
    with running_sim() as sim, SimPods(tmp_path / "pods").attached(sim) as sim_pods:

        def terminate(pod: PodRecord) -> None:
            wait_for(lambda: metrics_written(sim_pods, pod), 30, "the job's first metric")
            sim.terminate(pod.pod_id or "")  # the account's balance ran out

        outcome = asyncio.run(train_on(pod_target(sim), runs, STALLED, terminate))
    assert "Runpod terminated it" in (outcome.lost or "")  # what the driver fails the run with
    pod = the_pod(runs)
    assert pod.state == PodState.DELETED and pod.deleted_by == "unknown"
    assert "Runpod terminated it" in (pod.delete_reason or "")


# -- a pod whose job nobody follows ---------------------------------------------------------


def pod_of_a_run_here(sim: RunpodSim, runs: Runs, ended_ago_s: float | None) -> tuple[str, str]:
    """A run here whose job started on a pod that its watchdog shows it runs
    (max_hours in an hour, retrieve_grace 2 min): still running, or (with
    `ended_ago_s`) ended that long ago with its files not retrieved. Returns
    the run's and the pod's ids."""
    record = start_step.create(runs, target="sim", target_kind="runpod", workdir="/w")
    record.job = JobId(dir=record.remote_dir, pid=4321)
    record.state = RunState.RUNNING
    if ended_ago_s is not None:
        record.state = RunState.FAILED
        record.ended = rfc3339(datetime.fromtimestamp(time.time() - ended_ago_s, UTC))
        record.not_retrieved = "the pod did not answer"
    runs.save(record)

    async def create() -> str:
        client = RunpodClient(SecretStr(sim.api_key), sim.rest_url, sim.graphql_url)
        async with client:
            made = await client.create_pod(
                PodRequest(name=f"ob-{record.id}-a1", image="x:1", gpu_type_id=A4000)
            )
            return made.id

    pod_id = asyncio.run(create())
    PodRecord(
        run_id=record.id,
        state=PodState.RUNNING,
        pod_id=pod_id,
        host_key="ssh-ed25519 AAAA",
        created_unix=time.time() - 600,
        deadline_unix=int(time.time() + 3600),
        retrieve_grace_s=120.0,
        cost_per_hour=0.25,
    ).save(runs)
    return record.id, pod_id


def test_a_pod_its_watchdog_deleted_on_the_retrieved_marker_first_keeps_the_endings_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client marks a run's files retrieved, then deletes the pod: a watchdog
    that looks between the two deletes it first (seen under load in a `make
    test`, with a container restart's reason lost). The pod is already gone
    at the client's delete: it is recorded deleted by the watchdog, for the
    reason this ending gave, where the marker alone says less."""
    monkeypatch.setenv(TIMING_ENV, FAST)
    runs = Runs(tmp_path / "runs")
    why = "its container restarted and lost its job (at X, at step 1); what the job left was kept"
    with running_sim() as sim:
        ended = {}
        for after_marking in (True, False):
            run_id, pod_id = pod_of_a_run_here(sim, runs, None)
            pod = PodRecord.load(runs, run_id)
            assert pod is not None
            pod.retrieved_marked = True
            sim.terminate(pod_id)  # gone before the client's delete, as its watchdog deletes

            async def end(pod: PodRecord = pod, after_marking: bool = after_marking) -> None:
                client = RunpodClient(SecretStr(sim.api_key), sim.rest_url, sim.graphql_url)
                async with client:
                    ctx = PodContext(client=client, runs=runs, log=LOG)
                    await remove(ctx, pod, why, after_marking=after_marking)

            asyncio.run(end())
            ended[after_marking] = PodRecord.load(runs, run_id)
    told, other = ended[True], ended[False]
    assert told is not None and told.state == PodState.DELETED
    assert (told.deleted_by, told.delete_reason) == ("watchdog", why)
    # another ending (a guard, the pods flow) keeps the watchdog's own reason
    assert other is not None and (other.deleted_by, other.delete_reason) == (
        "watchdog",
        RETRIEVED_REASON,
    )


def listed(sim: RunpodSim, runs: Runs) -> dict[str, PodRow]:
    async def rows() -> list[PodRow]:
        client = RunpodClient(SecretStr(sim.api_key), sim.rest_url, sim.graphql_url)
        async with client:
            return await pod_rows(client, runs)

    return {row.run_id: row for row in asyncio.run(rows())}


def test_the_pods_list_says_when_unfollowed_files_are_lost_and_the_command_that_saves_them(
    tmp_path: Path,
) -> None:
    runs = Runs(tmp_path / "runs")
    with running_sim() as sim:
        running, _ = pod_of_a_run_here(sim, runs, None)
        ended, _ = pod_of_a_run_here(sim, runs, 60.0)
        rows = listed(sim, runs)
        with follow_lock(runs, running):  # a live follower: nothing to tell
            followed = listed(sim, runs)[running]
    row = rows[running]
    assert row.unfollowed and not row.orphan and "nobody following it" in row.why
    assert "retrieve_grace (120 s) after the job ends" in row.why
    pod = PodRecord.load(runs, running)
    assert pod is not None and pod.deadline_unix is not None
    assert row.files_lost_at == pod.deadline_unix
    assert f"max_hours: {rfc3339(datetime.fromtimestamp(pod.deadline_unix, UTC))}" in row.why
    assert "collect flow" in row.save_with and f"attach flow (run_id={running})" in row.save_with
    assert "UNFOLLOWED" in row.line() and "save them with the collect flow" in row.line()
    gone = rows[ended]
    assert gone.orphan and gone.unfollowed and gone.files_lost_at is not None
    assert abs(gone.files_lost_at - (time.time() + 60)) < 5  # ended 60 s ago, 120 s of grace
    assert "its files were not retrieved: its watchdog deletes it with them at about" in gone.why
    warnings = orphan_warnings(list(rows.values()))
    assert len(warnings) == 2
    assert all("save its files with the collect flow" in w for w in warnings), warnings
    assert any(f"pod {row.pod_id}" in w and "holds a job nobody follows" in w for w in warnings)
    assert not followed.unfollowed and followed.why == "followed; bounded by its watchdog"
    assert orphan_warnings([followed]) == []


# -- a lost host needs two witnesses --------------------------------------------------------


def seen(status: str, uptime_s: float | None) -> Pod:
    return Pod.model_validate({"id": "p1", "status": status, "runtime": None}).model_copy(
        update={"uptime_s": uptime_s}
    )


def test_runpods_view_agrees_with_a_silent_ssh_only_when_the_pods_runtime_stalled_or_ended() -> (
    None
):
    assert runpod_agrees(seen("RUNNING", 100), seen("RUNNING", 160), 60.0) is None  # it runs on
    assert "stalled (5 s of uptime in 60 s)" in (
        runpod_agrees(seen("RUNNING", 100), seen("RUNNING", 105), 60.0) or ""
    )
    assert runpod_agrees(seen("RUNNING", 100), seen("EXITED", None), 60.0) == (
        "Runpod shows it EXITED"
    )
    assert runpod_agrees(seen("RUNNING", 100), seen("RUNNING", None), 60.0) == (
        "Runpod shows no runtime for it"
    )
    assert "started again" in (runpod_agrees(seen("RUNNING", 100), seen("RUNNING", 3), 60.0) or "")


def test_every_followed_pod_silent_at_once_is_this_sides_network() -> None:
    silence = Silence()
    with silence.following("a"):
        silence.mark("a", True)
        assert silence.all_at_once() == 0  # one pod alone: Runpod's view decides
        with silence.following("b"):
            assert silence.all_at_once() == 0
            silence.mark("b", True)
            assert silence.all_at_once() == 2
        assert silence.all_at_once() == 0


@pytest.mark.slow
def test_a_pod_whose_ssh_is_cut_on_this_side_while_runpod_shows_it_running_is_not_deleted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """This side's network loses the pod's SSH while its host runs on (Runpod
    shows its uptime going on): past lost_host_s the follower says so and
    follows the job again; once SSH is back, the job is followed to its end
    and its files retrieved. One pod, never deleted as a lost host."""
    monkeypatch.setenv(TIMING_ENV, f"{FAST},lost_host_s=6")
    runs = Runs(tmp_path / "runs")
    with running_sim() as sim, SimPods(tmp_path / "pods").attached(sim) as sim_pods:

        def cut(pod: PodRecord) -> None:
            wait_for(lambda: metrics_written(sim_pods, pod), 30, "the job's first metric")
            job = runs.load(pod.run_id).job
            assert job is not None and job.pid is not None
            sim_pods.cut_ssh(sim.pod(pod.pod_id or ""), job.pid)

            def back() -> None:  # once the follower said it waits, SSH comes back
                wait_for(lambda: "this side's network" in caplog.text, 120, "the follower to wait")
                sim_pods.find_host(sim.pod(pod.pod_id or ""))

            threading.Thread(target=back, daemon=True).start()

        with caplog.at_level(logging.WARNING):
            outcome = asyncio.run(train_on(pod_target(sim), runs, progressing(20, 0.5), cut))
        (billed,) = sim.pods(include_deleted=True)
    assert outcome.record.state == RunState.SUCCEEDED and outcome.retrieved, outcome.record
    pod = the_pod(runs)
    assert pod.host_lost is None and deleted_once_verified(pod), pod
    said = [r.getMessage() for r in caplog.records if "this side's network" in r.getMessage()]
    assert said and "Runpod shows its container running on" in said[0], said
    assert f"pod {billed.id} is not deleted: its job is followed again" in said[0], said


@pytest.mark.slow
def test_every_pod_a_follower_follows_going_silent_at_once_deletes_none_of_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Two pods followed by one process lose their hosts at the same moment
    (Runpod's view of each stalls too): that is this side's network, so
    neither is deleted and the follower says so; once they answer again,
    both jobs are followed to their end."""
    monkeypatch.setenv(TIMING_ENV, f"{FAST},lost_host_s=6")
    runs = [Runs(tmp_path / "runs-a"), Runs(tmp_path / "runs-b")]
    with running_sim() as sim, SimPods(tmp_path / "pods").attached(sim) as sim_pods:
        ready: list[PodRecord] = []
        lock = threading.Lock()

        def lose_both() -> None:
            wait_for(lambda: len(ready) == 2, 60, "both jobs' first metric")
            for pod in ready:
                sim_pods.lose_host(sim.pod(pod.pod_id or ""))
            wait_for(lambda: "went silent at once" in caplog.text, 120, "the follower to wait")
            for pod in ready:
                sim_pods.find_host(sim.pod(pod.pod_id or ""))

        def first_metric(pod: PodRecord) -> None:
            wait_for(lambda: metrics_written(sim_pods, pod), 30, "the job's first metric")
            with lock:
                ready.append(pod)

        async def both() -> list[Outcome]:
            place = pod_target(sim)
            return list(
                await asyncio.gather(
                    *(train_on(place, r, progressing(20, 0.5), first_metric) for r in runs)
                )
            )

        threading.Thread(target=lose_both, daemon=True).start()
        with caplog.at_level(logging.WARNING):
            outcomes = asyncio.run(both())
        assert len(sim.pods(include_deleted=True)) == 2
    assert [o.record.state for o in outcomes] == [RunState.SUCCEEDED] * 2, outcomes
    for store in runs:
        pod = the_pod(store)
        assert pod.host_lost is None and deleted_once_verified(pod), pod
    said = [r.getMessage() for r in caplog.records if "went silent at once" in r.getMessage()]
    assert said and "every pod this process follows (2) went silent at once" in said[0], said


def test_a_followed_pod_reached_again_by_another_task_is_still_ended_by_its_follower(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runs directory's follower reaches a pod again to cancel the job of
    a suspended run while that job's own follow holds the pod: the follow
    still records the pod's end (the second reach left pod.json as it was),
    and its host key secret and client key go."""
    monkeypatch.setenv(TIMING_ENV, FAST)
    runs = Runs(tmp_path / "runs")
    with running_sim() as sim, SimPods(tmp_path / "pods").attached(sim):
        place = pod_target(sim)

        def reach_again(pod: PodRecord) -> None:
            async def reach() -> None:
                async with place.reach(runs, runs.load(pod.run_id)) as placed:
                    assert placed is not None

            asyncio.run(reach())

        outcome = asyncio.run(train_on(place, runs, TRAINS, reach_again))
        assert sim.secret_names() == []
    assert outcome.record.state == RunState.SUCCEEDED and outcome.retrieved, outcome.record
    pod = the_pod(runs)
    assert pod.state == PodState.DELETED and pod.secret_deleted, pod
    assert not (runs.run_dir(pod.run_id) / SSH_DIR / CLIENT_KEY).exists()
