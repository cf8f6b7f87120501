"""The pod's bootstrap + watchdog, and the provisioning and following around
it, on simulated pods that are real local process trees (the real script,
a real sshd on 127.0.0.1) with shell jobs, without Prefect.

Each bound of the watchdog deletes its pod at its time, with the decision
and its reason in its log: the `retrieved` marker at once, the retrieve
grace, the boot grace, max_hours (the job asked for a checkpoint first)
unless a lease was renewed, and max_cost_usd. A pod that cannot delete itself
runs no job; a pod that never answers SSH is deleted; the client's own guard
deletes a pod whose watchdog could not.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
from pydantic import SecretStr

from overbrainer_prefect.runpod import RunpodClient, RunpodTargetSettings, plan_from_api
from overbrainer_prefect.runpod.bootstrap import (
    RETRIEVED_MARKER,
    TIMING_ENV,
    PodTiming,
    bootstrap_script,
    parse_armed,
)
from overbrainer_prefect.runpod.errors import PodError, PodGone
from overbrainer_prefect.runpod.pod import MAX_HOURS_REACHED, PodRecord, PodState
from overbrainer_prefect.runs.store import RunRecord, Runs, RunState
from overbrainer_prefect.steps import end as end_step
from overbrainer_prefect.steps import follow
from overbrainer_prefect.steps import start as start_step
from overbrainer_prefect.steps.context import RunContext
from overbrainer_prefect.targets.runpod.context import PodContext
from overbrainer_prefect.targets.runpod.ending import is_gone
from overbrainer_prefect.targets.runpod.follow import (
    guard_fires,
    overrun,
    renewal_due,
    settle,
    watch_leased,
)
from overbrainer_prefect.targets.runpod.keys import CLIENT_KEY, SSH_DIR
from overbrainer_prefect.targets.runpod.provision import DEFAULT_WORKDIR, Provisioned, provision
from tests.procs import alive
from tests.runpod_sim import RunpodSim, running_sim
from tests.runpod_sim.pods import SimPods, descendants
from tests.shelljobs import ShellTrainer

T = TypeVar("T")

A4000 = "NVIDIA RTX A4000"
FAST = (
    "watch_interval_s=1,lease_ttl_s=4,lease_renew_s=1,lease_tick_s=0.3,deadline_margin_s=3,"
    "arm_timeout_s=20,ready_poll_s=0.2,gone_interval_s=0.2,confirm_timeout_s=20,"
    "checkpoint_hold_s=6"
)


def progressing(steps: int, every_s: float) -> str:
    """A job writing a metric every `every_s` seconds for `steps` steps, then its output."""
    return (
        'printf \'%s\\n\' \'{"event":"begin","max_steps":' + str(steps) + "}' >> metrics.jsonl; "
        f"i=1; while [ $i -le {steps} ]; do "
        'printf \'{"event":"log","step":%s,"loss":1.0}\\n\' $i >> metrics.jsonl; '
        f"sleep {every_s}; i=$((i+1)); done; "
        "mkdir -p output && echo weights > output/adapter_model.safetensors; "
        "printf '%s\\n' '{\"event\":\"end\"}' >> metrics.jsonl"
    )


STALLED = (
    'printf \'%s\\n\' \'{"event":"begin","max_steps":100}\' >> metrics.jsonl; '
    'printf \'%s\\n\' \'{"event":"log","step":1,"loss":1.0}\' >> metrics.jsonl; '
    "sleep 600"
)
"""A job that makes progress once, then hangs."""

CHECKPOINTS_ON_REQUEST = (
    'printf \'%s\\n\' \'{"event":"begin","max_steps":1000}\' >> metrics.jsonl; i=1; '
    "while [ ! -e stop.request ]; do "
    'printf \'{"event":"log","step":%s,"loss":1.0}\\n\' $i >> metrics.jsonl; '
    "i=$((i+1)); sleep 0.2; done; "
    "mkdir -p output/checkpoint-1 && echo state > output/checkpoint-1/state; "
    "echo saved > checkpoint.saved; sleep 600"
)
"""A job that saves a checkpoint when asked (then lingers, as a slow save would)."""

CHECKPOINTS_AND_ENDS = CHECKPOINTS_ON_REQUEST.replace("sleep 600", "exit 0")
"""A job that saves a checkpoint when asked, then ends."""


@dataclass
class Bed:
    """A simulator with real pods, a runs directory and a client."""

    sim: RunpodSim
    pods: SimPods
    runs: Runs


@pytest.fixture
def bed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Bed]:
    monkeypatch.setenv(TIMING_ENV, FAST)
    with running_sim() as sim, SimPods(tmp_path / "pods").attached(sim) as pods:
        yield Bed(sim, pods, Runs(tmp_path / "runs"))


def run(bed: Bed, body: Callable[[PodContext], Awaitable[T]]) -> T:
    async def main() -> T:
        client = RunpodClient(SecretStr(bed.sim.api_key), bed.sim.rest_url, bed.sim.graphql_url)
        async with client:
            return await body(PodContext(client=client, runs=bed.runs))

    return asyncio.run(main())


def settings(**changes: Any) -> RunpodTargetSettings:
    values: dict[str, Any] = {
        "gpu_types": [A4000],
        "image": "overbrainer/test:1",
        "max_hours": 1.0,
        "boot_grace_s": 30.0,
        "retrieve_grace_s": 120.0,
    }
    values.update(changes)
    return RunpodTargetSettings(**values)


async def ready_pod(ctx: PodContext, bed: Bed, wanted: RunpodTargetSettings) -> Provisioned:
    plan = await plan_from_api(ctx.client, wanted)
    record = start_step.create(
        ctx.runs, target="sim", target_kind="runpod", workdir=DEFAULT_WORKDIR
    )
    try:
        ready = await provision(ctx, record, plan, api_url=bed.sim.rest_url, name="sim")
    except PodError as error:
        end_step.fail(ctx.runs, record.id, error.kept)  # the driver's part: it fails the record
        raise
    record = ctx.runs.load(record.id)
    record.remote_dir = ready.remote_dir  # the driver records where the job's directory is
    ctx.runs.save(record)
    return ready


async def start(ctx: PodContext, ready: Provisioned, script: str) -> tuple[RunContext, RunRecord]:
    # a job found lost is asked of Runpod, as the pod target's own context does
    run_ctx = RunContext(
        runs=ctx.runs,
        executor=ready.executor,
        poll_s=0.3,
        host_gone=lambda: is_gone(ctx, ready.pod),
    )
    record = ctx.runs.load(ready.pod.run_id)
    record = await start_step.start(run_ctx, ShellTrainer(script), record)
    ready.pod.state = PodState.RUNNING
    ready.pod.save(ctx.runs)
    return run_ctx, record


async def until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def log_of(bed: Bed, pod: PodRecord) -> str:
    assert pod.pod_id is not None
    return bed.pods.watchdog_log(pod.pod_id, pod.run_id)


def deleted(bed: Bed, pod: PodRecord) -> bool:
    """Whether the pod was deleted and its processes are gone (the simulator marks
    it deleted first, then kills them)."""
    assert pod.pod_id is not None
    return bed.sim.pod(pod.pod_id).deleted and not bed.pods.running(pod.pod_id)


# -- the script itself ----------------------------------------------------------------


def test_the_bootstrap_is_posix_sh_that_dash_accepts() -> None:
    shell = shutil.which("dash") or shutil.which("sh")
    assert shell is not None
    checked = subprocess.run(
        [shell, "-n"], input=bootstrap_script(), text=True, capture_output=True, timeout=30
    )
    assert checked.returncode == 0, checked.stderr
    if shutil.which("shellcheck"):
        lint = subprocess.run(
            ["shellcheck", "-s", "sh", "-S", "error", "-"],
            input=bootstrap_script(),
            text=True,
            capture_output=True,
            timeout=60,
        )
        assert lint.returncode == 0, lint.stdout


def test_the_watchdog_holds_the_lease_as_long_as_the_client_counts_on() -> None:
    script = bootstrap_script()
    assert f"OVERBRAINER_LEASE_TTL:-{PodTiming().lease_ttl_s:.0f}}}" in script
    assert "OVERBRAINER_SSH_PORT:-22}" in script
    assert "OVERBRAINER_WORKSPACE:-/workspace}" in script
    assert "OVERBRAINER_POD_ROOT:-/}" in script
    assert "OVERBRAINER_API_URL:-https://api.runpod.io/v2}" in script


def test_the_armed_line_is_read_back_with_both_deadlines() -> None:
    log = (
        "2026-01-01T00:00:00Z api: the Runpod API answers\n"
        "2026-01-01T00:00:01Z cost cap armed: max_cost_usd $1 at $0.25/h is reached at X; "
        "max_hours deletes the pod at Y [deadline_unix=100 cost_deadline_unix=200]\n"
    )
    armed = parse_armed(log)
    assert not isinstance(armed, str) and armed is not None
    assert (armed.deadline_unix, armed.cost_deadline_unix) == (100, 200)
    refused = parse_armed("t cannot arm the cost cap: the Runpod API does not answer\n")
    assert refused == "the Runpod API does not answer"
    assert parse_armed("t claim: ok\n") is None


def test_the_lease_is_renewed_only_while_the_job_progresses() -> None:
    timing = PodTiming(lease_ttl_s=900, lease_renew_s=300)
    now = 10_000.0
    assert renewal_due(None, 0, now, timing, stall_s=1800)
    assert not renewal_due(now - 60, 60, now, timing, stall_s=1800)
    assert renewal_due(now - 300, 60, now, timing, stall_s=1800)
    # no new metric for the stall time: the lease is left to run out
    assert not renewal_due(now - 300, 1800, now, timing, stall_s=1800)
    assert not renewal_due(None, 1900, now, timing, stall_s=1800)


def test_the_client_guard_waits_for_the_lease_to_run_out() -> None:
    timing = PodTiming(lease_ttl_s=900, deadline_margin_s=300)
    now = 100_000.0
    late = PodRecord(run_id="r", host_key="k", deadline_unix=int(now - 3600))
    assert not guard_fires(late, now - 60, now, timing)
    assert not guard_fires(late, now - 899, now, timing)
    assert guard_fires(late, now - 900, now, timing)
    assert guard_fires(late, None, now, timing)
    early = PodRecord(run_id="r", host_key="k", deadline_unix=int(now + 3600))
    assert not guard_fires(early, None, now, timing)
    kept = late.model_copy(update={"keep": True})
    assert not guard_fires(kept, None, now, timing)
    # within the margin after the deadline, the watchdog acts first
    just = PodRecord(run_id="r", host_key="k", deadline_unix=int(now - 100))
    assert not guard_fires(just, None, now, timing)


def test_a_job_whose_pace_passes_the_deadline_is_noted_once_followed() -> None:
    pod = PodRecord(run_id="r", host_key="k", deadline_unix=10_000, deadline="2026-09-29T19:54:50Z")
    note = overrun(72_000.0, pod, 5_000.0)
    assert note is not None
    assert note.startswith("at this pace the job needs about 20.0 h more, past max_hours")
    assert "2026-09-29T19:54:50Z" in note and "renews its lease" in note
    assert overrun(100.0, pod, 5_000.0) is None
    assert overrun(None, pod, 5_000.0) is None
    assert overrun(72_000.0, pod.model_copy(update={"keep": True}), 5_000.0) is None


# -- on simulated pods ----------------------------------------------------------------


@pytest.mark.slow
def test_a_ready_pod_has_claimed_its_run_directory_and_armed_its_cap_before_any_job(
    bed: Bed,
) -> None:
    async def body(ctx: PodContext) -> Provisioned:
        ready = await ready_pod(ctx, bed, settings(max_cost_usd=5.0))
        await ready.executor.close()
        return ready

    ready = run(bed, body)
    pod = ready.pod
    assert pod.state == PodState.READY and pod.pod_id is not None
    saved = PodRecord.load(bed.runs, pod.run_id)
    assert saved is not None and saved.pod_id == pod.pod_id
    assert saved.deadline_unix is not None and saved.cost_deadline_unix is not None
    # the cost cap: $5 at $0.25/h and 50 GB of disk at $0.10/GB/month, less a look and a delete
    to_cap = 5 / (0.25 + 50 * 0.10 / 720) * 3600 - (1 + 5)
    assert saved.cost_deadline_unix - saved.deadline_unix == pytest.approx(to_cap - 3600, abs=5)
    log = log_of(bed, pod)
    lines = [line.split(" ", 1)[1] for line in log.splitlines()]
    kinds = [line.split(":", 1)[0] for line in lines]
    assert kinds[:2] == ["claim", "bootstrap"], log
    assert "api" in kinds and "cost cap armed" in kinds, log
    assert (
        "run=" + pod.run_id
        in (
            bed.pods.workspace_of(pod.pod_id) / "overbrainer" / pod.run_id / ".pod" / "owner"
        ).read_text()
    )
    record = bed.runs.load(pod.run_id)
    assert record.remote_dir == str(bed.pods.workspace_of(pod.pod_id) / "overbrainer" / pod.run_id)
    key = bed.runs.run_dir(pod.run_id) / SSH_DIR / CLIENT_KEY
    assert key.stat().st_mode & 0o777 == 0o600
    # the pod's own key never reached the environment of what it runs
    assert (
        bed.sim.pod(pod.pod_id).api_key
        not in (bed.pods.dir_of(pod.pod_id) / "var" / "log" / "overbrainer-sshd.log").read_text()
    )


@pytest.mark.slow
def test_a_pod_whose_job_never_starts_deletes_itself_at_boot_grace(bed: Bed) -> None:
    async def body(ctx: PodContext) -> PodRecord:
        ready = await ready_pod(
            ctx, bed, settings(boot_grace_s=12.0)
        )  # sshd starts slowly on a busy machine
        await ready.executor.close()
        await until(lambda: deleted(bed, ready.pod), 40, "the watchdog to delete its pod")
        return ready.pod

    pod = run(bed, body)
    assert "no job started within boot_grace (12s after the pod was created)" in log_of(bed, pod)
    rate = 0.25 + 50 * 0.10 / 720  # its GPU and its container disk
    assert bed.sim.pod(pod.pod_id or "").spend(bed.sim.now()) <= rate * (12 + 3) / 3600


@pytest.mark.slow
def test_the_retrieved_marker_deletes_the_pod_at_once(bed: Bed) -> None:
    async def body(ctx: PodContext) -> tuple[PodRecord, float]:
        ready = await ready_pod(ctx, bed, settings())
        run_ctx, record = await start(ctx, ready, progressing(2, 0.1))
        outcome = await follow.watch(run_ctx, ShellTrainer(""), record)
        assert outcome.retrieved and outcome.record.state == RunState.SUCCEEDED
        marked = time.time()
        await ready.executor.touch(f"{record.remote_dir}/{RETRIEVED_MARKER}")
        await ready.executor.close()
        await until(lambda: deleted(bed, ready.pod), 15, "the watchdog to delete its pod")
        return ready.pod, marked

    pod, marked = run(bed, body)
    assert bed.sim.pod(pod.pod_id or "").deleted_at <= marked + 5  # type: ignore[operator]
    log = log_of(bed, pod)
    assert "job: ended (exit code 0)" in log
    assert "decision: delete pod" in log and "(.pod/retrieved)" in log


@pytest.mark.slow
def test_a_job_that_ended_unretrieved_keeps_its_pod_for_the_retrieve_grace(bed: Bed) -> None:
    async def body(ctx: PodContext) -> tuple[PodRecord, float, float]:
        ready = await ready_pod(ctx, bed, settings(retrieve_grace_s=6.0))
        await start(ctx, ready, "true")
        await ready.executor.close()
        ended = time.time()
        await until(lambda: deleted(bed, ready.pod), 30, "the retrieve grace to end")
        return ready.pod, ended, time.time()

    pod, ended, gone = run(bed, body)
    assert gone - ended >= 5
    log = log_of(bed, pod)
    assert "unless its files are retrieved, the pod is deleted at" in log
    assert "the job ended 6s ago and its files were not retrieved (retrieve_grace)" in log


@pytest.mark.slow
def test_max_hours_asks_the_job_for_a_checkpoint_and_keeps_it_retrievable_for_the_hold(
    bed: Bed,
) -> None:
    async def body(ctx: PodContext) -> tuple[PodRecord, RunRecord, float]:
        # 0.006 h is 21.6 s after the create; the checkpoint is asked 2 s before
        ready = await ready_pod(ctx, bed, settings(max_hours=0.006))
        _, record = await start(ctx, ready, CHECKPOINTS_AND_ENDS)
        await ready.executor.close()
        assert ready.pod.deadline_unix is not None
        await until(lambda: time.time() > ready.pod.deadline_unix + 2, 40, "max_hours")  # type: ignore[operator]
        assert not deleted(bed, ready.pod)  # the checkpoint it saved is still there
        await until(lambda: deleted(bed, ready.pod), 30, "the checkpoint hold")
        return ready.pod, record, time.time()

    pod, record, gone = run(bed, body)
    log = log_of(bed, pod)
    assert "decision: asked the job for a checkpoint (stop.request): max_hours ends at" in log
    assert "hold: max_hours passed" in log and "the pod stays until" in log
    assert "its files were not retrieved within checkpoint_hold (6s)" in log
    assert log.index("asked the job for a checkpoint") < log.index("hold: max_hours passed")
    remote = Path(record.remote_dir)
    assert (remote / "checkpoint.saved").is_file()
    assert pod.deadline_unix is not None and gone <= pod.deadline_unix + 6 + 5


@pytest.mark.slow
def test_max_hours_deletes_the_pod_and_its_job_when_the_job_ignores_the_checkpoint_request(
    bed: Bed,
) -> None:
    async def body(ctx: PodContext) -> tuple[PodRecord, RunRecord]:
        ready = await ready_pod(ctx, bed, settings(max_hours=0.006))
        _, record = await start(ctx, ready, STALLED)
        await ready.executor.close()
        await until(lambda: deleted(bed, ready.pod), 40, "max_hours")
        return ready.pod, record

    pod, record = run(bed, body)
    log = log_of(bed, pod)
    assert "max_hours reached (0.006 h" in log and "no lease was renewed" in log
    assert log.index("asked the job for a checkpoint") < log.index("max_hours reached")
    # the job died with its pod
    assert record.job is not None
    assert not alive(record.job.pid)


@pytest.mark.slow
def test_max_cost_usd_deletes_the_pod_once_reached(bed: Bed) -> None:
    async def body(ctx: PodContext) -> PodRecord:
        # $0.001 at $0.25/h is 14.4 s after the create
        ready = await ready_pod(ctx, bed, settings(max_cost_usd=0.001))
        await start(ctx, ready, STALLED)
        await ready.executor.close()
        await until(lambda: deleted(bed, ready.pod), 40, "max_cost_usd")
        return ready.pod

    pod = run(bed, body)
    log = log_of(bed, pod)
    assert "cost cap armed: max_cost_usd $0.001 at $0.256944/h (GPUs and container disk)" in log
    assert "decision: delete pod" in log and "max_cost_usd reached: $0.001 at $0.256944/h" in log
    spent = bed.sim.pod(pod.pod_id or "").spend(bed.sim.now())
    assert spent <= 0.001  # GPUs and disk, one look and the delete counted in: never past it


@pytest.mark.slow
def test_a_renewed_lease_keeps_a_progressing_job_alive_past_max_hours(bed: Bed) -> None:
    async def body(ctx: PodContext) -> tuple[PodRecord, Any]:
        # 0.004 h is 14.4 s; the job progresses for about 24 s
        ready = await ready_pod(ctx, bed, settings(max_hours=0.004))
        run_ctx, record = await start(ctx, ready, progressing(60, 0.4))
        watched = await watch_leased(
            run_ctx, ShellTrainer(""), record, ready.pod, ctx.timing, stall_s=3.0
        )
        outcome = await settle(ctx, ready.pod, record.id, watched)
        await ready.executor.close()
        return ready.pod, outcome

    pod, outcome = run(bed, body)
    assert outcome.record.state == RunState.SUCCEEDED
    assert pod.deadline_unix is not None and time.time() > pod.deadline_unix + 5
    log = log_of(bed, pod)
    assert "lease: max_hours passed" in log and "renewed the lease at" in log
    assert "decision: delete pod" not in log


@pytest.mark.slow
def test_a_stalled_job_loses_its_lease_and_its_pod_at_max_hours(bed: Bed) -> None:
    # the pod's sshd outlives its job by 5 s (a loaded machine, as in a CI run): the
    # follower finds the job lost on a host that still answers, and asks Runpod
    bed.pods.sshd_outlives_s = 5.0

    async def body(ctx: PodContext) -> tuple[PodRecord, BaseException]:
        ready = await ready_pod(ctx, bed, settings(max_hours=0.004))
        run_ctx, record = await start(ctx, ready, STALLED)
        watched = await watch_leased(
            run_ctx, ShellTrainer(""), record, ready.pod, ctx.timing, stall_s=2.0
        )
        try:
            await settle(ctx, ready.pod, record.id, watched)
        except PodGone as gone:
            return ready.pod, gone
        finally:
            await ready.executor.close()
        raise AssertionError("the stalled job's pod was not deleted")

    pod, gone = run(bed, body)
    assert MAX_HOURS_REACHED in str(gone) and gone.kept == MAX_HOURS_REACHED
    record = bed.runs.load(pod.run_id)
    assert record.state == RunState.RUNNING  # the provider answers why; the driver fails it
    saved = PodRecord.load(bed.runs, pod.run_id)
    assert saved is not None and saved.state == PodState.DELETED
    assert "max_hours reached" in log_of(bed, pod)


@pytest.mark.slow
def test_the_client_guard_deletes_a_pod_its_watchdog_could_not(bed: Bed) -> None:
    async def body(ctx: PodContext) -> tuple[PodRecord, BaseException]:
        ready = await ready_pod(ctx, bed, settings(max_hours=0.003))
        run_ctx, record = await start(ctx, ready, STALLED)
        bed.sim.revoke_pod_keys()  # the pod's own deletes now answer 401
        watched = await watch_leased(
            run_ctx, ShellTrainer(""), record, ready.pod, ctx.timing, stall_s=2.0
        )
        assert watched.deadline_passed
        try:
            await settle(ctx, ready.pod, record.id, watched)
        except PodGone as gone:
            return ready.pod, gone
        finally:
            await ready.executor.close()
        raise AssertionError("the guard did not fire")

    pod, gone = run(bed, body)
    assert MAX_HOURS_REACHED in str(gone)
    assert deleted(bed, pod)
    saved = PodRecord.load(bed.runs, pod.run_id)
    assert saved is not None and saved.deleted_by == "client"
    assert "delete failed: Runpod answered 401" in log_of(bed, pod)


@pytest.mark.slow
def test_a_pod_that_cannot_delete_itself_runs_no_job(bed: Bed) -> None:
    bed.sim.revoke_pod_keys()

    async def body(ctx: PodContext) -> PodError:
        try:
            await ready_pod(ctx, bed, settings())
        except PodError as error:
            return error
        raise AssertionError("an uncapped pod was made ready")

    error = run(bed, body)
    assert "cannot arm the cost cap" in str(error) and "\n" not in str(error)
    (record,) = bed.runs.list()
    assert record.state == RunState.FAILED and record.job is None
    pod = PodRecord.load(bed.runs, record.id)
    assert pod is not None and pod.state == PodState.DELETED
    assert all(p.deleted for p in bed.sim.pods(include_deleted=True))
    assert bed.sim.secret_names() == []
    assert not (bed.runs.run_dir(record.id) / SSH_DIR / CLIENT_KEY).exists()


@pytest.mark.slow
def test_a_pod_that_never_answers_ssh_is_deleted_at_boot_grace(bed: Bed) -> None:
    bed.pods.never_ssh = True

    async def body(ctx: PodContext) -> PodError:
        try:
            await ready_pod(ctx, bed, settings(boot_grace_s=4.0))
        except PodError as error:
            return error
        raise AssertionError("a pod without sshd was made ready")

    started = time.monotonic()
    error = run(bed, body)
    assert time.monotonic() - started < 30
    assert "did not answer SSH within boot_grace" in str(error)
    (record,) = bed.runs.list()
    assert record.state == RunState.FAILED and "did not answer SSH" in (record.message or "")
    assert all(p.deleted for p in bed.sim.pods(include_deleted=True))


@pytest.mark.slow
def test_a_pod_billing_above_the_price_limit_is_deleted(bed: Bed) -> None:
    async def body(ctx: PodContext) -> PodError:
        wanted = settings(max_price_per_hour=0.3)
        plan = await plan_from_api(ctx.client, wanted)
        bed.sim.gpus[A4000].secure_price = 0.5  # the scheduler placed a pricier machine
        record = start_step.create(ctx.runs, target="sim", target_kind="runpod", workdir="/w")
        try:
            await provision(ctx, record, plan, api_url=bed.sim.rest_url, name="sim")
        except PodError as error:
            return error
        raise AssertionError("an overpriced pod was kept")

    error = run(bed, body)
    assert "bills $0.50/h, above max_price_per_hour ($0.30/h)" in str(error)
    assert all(p.deleted for p in bed.sim.pods(include_deleted=True))


@pytest.mark.slow
def test_a_deleted_pod_takes_its_job_with_it(bed: Bed) -> None:
    async def body(ctx: PodContext) -> tuple[RunRecord, list[int]]:
        ready = await ready_pod(ctx, bed, settings())
        _, record = await start(ctx, ready, STALLED)
        await ready.executor.close()
        pid = bed.sim.pod(ready.pod.pod_id or "").extra["pid"]
        tree = descendants(pid)
        await ctx.client.delete_pod(ready.pod.pod_id or "")
        return record, tree

    record, tree = run(bed, body)
    assert record.job is not None and record.job.pid in tree
    assert not any(alive(pid) for pid in tree)


@pytest.mark.slow
def test_a_pod_shared_by_a_pipeline_watches_each_job_and_ends_at_the_next_job_grace(
    bed: Bed, monkeypatch: pytest.MonkeyPatch
) -> None:
    from overbrainer_prefect.targets.runpod.shared import job_dir, mark_between, name_job

    monkeypatch.setenv(TIMING_ENV, FAST + ",next_job_grace_s=5")

    async def body(ctx: PodContext) -> tuple[PodRecord, float, float]:
        ready = await ready_pod(ctx, bed, settings())
        # a first job of 3 s: several of the watchdog's 1 s looks see it run
        run_ctx, first = await start(ctx, ready, progressing(6, 0.5))
        outcome = await follow.watch(run_ctx, ShellTrainer(""), first)
        assert outcome.record.state == RunState.SUCCEEDED
        pod_dir = first.remote_dir
        await mark_between(ready.executor, pod_dir, first.remote_dir)
        # the pipeline's next job, in its own run directory on the same pod
        second = start_step.create(
            ctx.runs, target="sim", target_kind="runpod", workdir=DEFAULT_WORKDIR
        )
        second.remote_dir = job_dir(ready.pod.workdir or DEFAULT_WORKDIR, second.id)
        ctx.runs.save(second)
        await name_job(ready.executor, pod_dir, second.remote_dir)
        second = await start_step.start(run_ctx, ShellTrainer(progressing(30, 0.3)), second)
        outcome = await follow.watch(run_ctx, ShellTrainer(""), second)
        assert outcome.record.state == RunState.SUCCEEDED  # longer than the grace: not ended
        assert not bed.sim.pod(ready.pod.pod_id or "").deleted
        await asyncio.sleep(3)  # ended, its files not yet verified: the retrieve grace holds
        assert not bed.sim.pod(ready.pod.pod_id or "").deleted
        await mark_between(ready.executor, pod_dir, second.remote_dir)
        marked = time.time()
        await ready.executor.close()
        await until(lambda: deleted(bed, ready.pod), 30, "the next-job grace to end")
        return ready.pod, marked, time.time()

    pod, marked, gone = run(bed, body)
    assert gone - marked >= 4
    deleted_at = bed.sim.pod(pod.pod_id or "").deleted_at
    assert deleted_at is not None and deleted_at <= marked + 5 + 3
    log = log_of(bed, pod)
    assert "job: the pipeline's job 2 on this pod is in" in log
    assert log.count("job: started (job.sh is there)") == 2
    assert "between jobs: the files of" in log
    assert (
        "no next job of the pipeline started within next_job_grace (5s after the files of its "
        "last job were verified)" in log
    )


# -- the records and messages -------------------------------------------------------


def a_pod(**changes: Any) -> PodRecord:
    values: dict[str, Any] = {
        "run_id": "20260101-000000-r1r1",
        "host_key": "ssh-ed25519 AAAAhost",
        "pod_id": "k3x9abc",
        "cost_per_hour": 0.53,
        "deadline": "2026-09-29T19:54:50Z",
        "deadline_unix": 10_000,
    }
    values.update(changes)
    return PodRecord(**values)


def test_a_pod_found_gone_is_blamed_on_the_bound_that_passed_first() -> None:
    pod = a_pod(cost_deadline_unix=8_000, max_cost_usd=1.0)
    assert pod.limit_reached(7_000) is None
    cost = pod.limit_reached(9_000)
    assert cost == (
        "max_cost_usd reached ($1.00 at $0.53/h): the pod was deleted before the job ended"
    )
    assert pod.limit_reached(11_000) == cost  # the cost cap came first
    assert a_pod().limit_reached(11_000) == MAX_HOURS_REACHED
    assert a_pod(keep=True).limit_reached(11_000) is None


def test_pods_are_named_after_their_run_and_found_back_by_name() -> None:
    from overbrainer_prefect.targets.runpod.names import pod_name, run_of_pod_name

    name = pod_name("20260101-000000-r1r1", 2)
    assert name == "ob-20260101-000000-r1r1-a2"
    assert run_of_pod_name(name) == "20260101-000000-r1r1"
    assert run_of_pod_name(f"{name}-1") == "20260101-000000-r1r1"  # node 1 of a cluster
    for other in ("my pod", "ob-../etc-a1", "ob-20260101-000000-r1r1", "ob-x-a1", f"{name}-x"):
        assert run_of_pod_name(other) is None


def test_a_detached_run_names_attach_the_pods_flow_and_what_bounds_its_pod(
    tmp_path: Path,
) -> None:
    from overbrainer_prefect.runs.store import RunRecord
    from overbrainer_prefect.targets.runpod.ending import (
        detached_message,
        kept_message,
        unretrieved_message,
    )

    runs = Runs(tmp_path / "runs")
    run_id = "20260101-000000-r1r1"
    record = RunRecord(
        id=run_id, target="t", created="2026-01-01T00:00:00Z", remote_dir=f"/w/{run_id}"
    )
    assert detached_message(runs, a_pod(), record, 3600, 900) == (
        f"run {run_id} keeps running on pod k3x9abc ($0.53/h); follow it again with the attach "
        f"flow (run_id={run_id}), or remove the pod with the pods flow (action=remove, "
        f"run_id={run_id}). The watchdog deletes the pod 60 min after the job ends if its files "
        "are not retrieved, and at 2026-09-29T19:54:50Z or 15 min after the lease was last "
        "renewed, whichever is later."
    )
    ssh = f"ssh -F {runs.run_dir(run_id)}/.ssh/config overbrainer-{run_id}"
    assert detached_message(runs, a_pod(keep=True), record, 3600, 900).endswith(
        f"The pod is kept with no time limit (keep_pod): `{ssh}`."
    )
    assert kept_message(runs, a_pod(keep=True), run_id) == (
        "keep_pod: pod k3x9abc is kept with no time limit, at $0.53/h, even once the run ends; "
        f"reach it with `{ssh}`; nothing deletes it but the pods flow (action=remove, "
        f"run_id={run_id})"
    )
    assert unretrieved_message(a_pod(), record) == (
        f"the files of run {run_id} were not retrieved: pod k3x9abc ($0.53/h) stays until its "
        f"watchdog's retrieve grace ends; retrieve them with the attach flow (run_id={run_id}), "
        f"or remove the pod with the pods flow (action=remove, run_id={run_id})"
    )
    export_id = "20260101-000100-e1e1"
    export = record.model_copy(update={"id": export_id, "parent": run_id, "trainer": "export"})
    assert detached_message(runs, a_pod(), export, 3600, 900).startswith(
        f"export {export_id} of run {run_id} keeps running on pod k3x9abc ($0.53/h); follow it "
        f"again with the export flow (run_id={run_id}, export_id={export_id}), or remove the pod "
        f"with the pods flow (action=remove, run_id={export_id})."
    )


def test_a_failed_run_keeps_only_the_status_of_an_api_answer() -> None:
    from overbrainer_prefect.runpod.errors import RunpodError
    from overbrainer_prefect.targets.runpod.context import INTERRUPTED, run_message

    answered = RunpodError(500, "server error", "try later", detail="server text with rpa_KEY")
    assert run_message(answered) == "Runpod answered 500"
    assert run_message(PodError(INTERRUPTED)) == "interrupted before the job started"
