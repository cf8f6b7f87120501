"""The deployments of `deployments/prefect.yaml` on a real Prefect server with
real process workers: `prefect deploy`, `prefect deployment run` of the local
train deployment to completion, a cancel (asked as `prefect flow-run cancel`
asks it; the command itself: tests/test_suspended_runs.py) through the
cancellation hook (also on a simulated Runpod pod: its pod deleted), a worker
and its flow process SIGKILLed while their job trains on a simulated pod and
the run finished by the collector on a second worker (another clone, the same
runs root; its pod deleted), the nightly schedule, bad parameters and blocks
(once on PostgreSQL: tests/test_deployments_postgres.py)."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest
import yaml

from overbrainer_prefect.blocks import RunpodCredentials, RunpodTarget
from overbrainer_prefect.runpod.bootstrap import TIMING_ENV
from overbrainer_prefect.runpod.pod import PodRecord, PodState
from overbrainer_prefect.runs import Runs, RunState
from overbrainer_prefect.suspension import RESUME_LEAD_ENV
from tests.conftest import REPO, job_venv
from tests.prefect_server import (
    Stack,
    Trained,
    Worker,
    as_the_cli_reads,
    clone,
    followed,
    tiny_training,
    training_now,
    wait_until,
)
from tests.procs import group_alive, held_stopped
from tests.runpod_fixtures import A4000, FAST
from tests.runpod_sim import RunpodSim, running_sim
from tests.runpod_sim.pods import SimPods, deleted_once_verified

pytest_plugins = ["tests.prefect_server"]
pytestmark = pytest.mark.slow

SECRET = "hf_" + secrets.token_hex(16)  # made at test time, never committed


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def assert_verified(runs: Path, run_id: str) -> None:
    """The run's files are here, exactly as its manifest says."""
    local = Runs(runs).run_dir(run_id)
    manifest = json.loads((local / "manifest.json").read_text())
    paths = {entry["path"] for entry in manifest}
    assert {"job.log", "metrics.jsonl", "output/adapter_model.safetensors"} <= paths
    for entry in manifest:
        assert sha256(local / entry["path"]) == entry["sha256"], entry["path"]


def run_ids(stack: Stack) -> set[str]:
    return {p.name for p in stack.runs.glob("[!.]*")}  # runs, not the live index


def test_prefect_deploy_creates_every_deployment_of_the_yaml(deployed: Stack) -> None:
    config = yaml.safe_load((REPO / "deployments" / "prefect.yaml").read_text())
    expected = {d["name"] for d in config["deployments"]}

    async def read(client: Any) -> list[Any]:
        return list(await client.read_deployments())

    found = deployed.server.call(read)
    assert expected <= {d.name for d in found}
    assert len(found) == len(config["deployments"])
    train = next(d for d in found if d.name == "local")
    assert train.concurrency_limit == 1 or (
        train.global_concurrency_limit is not None and train.global_concurrency_limit.limit == 1
    )
    assert train.work_pool_name == "overbrainer"
    assert train.job_variables["env"]["OVERBRAINER_RUNS_DIR"] == str(deployed.runs)
    step = train.pull_steps[0]["overbrainer_prefect.deployments.steps.set_project_directory"]
    assert step["default"] == str(REPO)


def test_the_local_train_deployment_runs_a_fine_tune_to_completion(
    deployed: Stack, trained: Trained
) -> None:
    assert trained.flow_run.state.is_completed(), trained.flow_run.state
    record = Runs(deployed.runs).load(trained.run_id)
    assert record.state == RunState.SUCCEEDED and record.message is None
    assert record.flow_run_id == str(trained.flow_run.id)
    assert_verified(deployed.runs, trained.run_id)
    # the CLI sent what `Stack.run_deployment` sends through the client for the same values
    # (the other tests' runs are made so)
    sent = {key: as_the_cli_reads(value) for key, value in trained.parameters.items()}
    assert trained.flow_run.parameters == sent


def test_cancelling_a_deployment_run_cancels_its_job_through_the_hook(
    deployed: Stack, tiny: tuple[Path, Path]
) -> None:
    deployed.worker()
    known = run_ids(deployed)
    flow_run_id = deployed.run_deployment(
        "train/local", target=deployed.target, training=tiny_training(*tiny, max_steps=100000)
    )
    record = wait_until(lambda: training_now(deployed, known), 240, "the job to train")
    assert record.job is not None and group_alive(record.job.pid)
    deployed.cancel(flow_run_id)
    flow_run = deployed.wait_final(flow_run_id, timeout=180)
    assert flow_run.state.is_cancelled(), flow_run.state
    saved = Runs(deployed.runs).load(record.id)
    assert saved.state == RunState.CANCELLED, saved
    local = Runs(deployed.runs).run_dir(record.id)
    assert (local / "job.log").is_file() and (local / "metrics.jsonl").is_file()
    wait_until(lambda: not group_alive(record.job.pid), 30, "the job's process group to go")


@dataclass
class OnSim:
    """The Runpod simulator with real simulated pods, a Runpod target block on
    the stack's server naming it, and the worker that runs the flow runs."""

    sim: RunpodSim
    pods: SimPods
    target: str
    worker: Worker


def save_runpod_target(stack: Stack, sim: RunpodSim) -> str:
    """Saves a Runpod target on the simulator on the stack's server (where its
    flow runs load it); returns its name."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    name = f"pod-{uuid.uuid4().hex[:8]}"
    block = RunpodTarget(
        credentials=RunpodCredentials(
            api_key=sim.api_key, rest_url=sim.rest_url, graphql_url=sim.graphql_url
        ),
        job_venv=str(job_venv()),
        gpu_types=[A4000],
        image="overbrainer/test:1",
        max_hours=1.0,
        boot_grace_s=60.0,
        retrieve_grace_s=120.0,
        poll_seconds=0.5,
        stall_minutes=1.0,
        cpu_threads=1,
    )
    with temporary_settings(updates={PREFECT_API_URL: stack.server.api_url}):
        block.save(name)
    return name


@pytest.fixture
def on_sim(deployed: Stack, tmp_path: Path) -> Iterator[OnSim]:
    """The simulator and its pods (in this process: they outlive any worker),
    a Runpod target on it, and the only running worker of the stack, with the
    pods' short timings in its environment (its flow-run processes and their
    hooks inherit them). Every worker started meanwhile is stopped at the end,
    before the pods and the simulator."""
    with running_sim() as sim, SimPods(tmp_path / "pods").attached(sim) as pods:
        name = save_runpod_target(deployed, sim)
        for running in deployed.workers:
            if running.running:
                running.stop()  # a worker without the timings would take our runs
        first = len(deployed.workers)
        # a pipeline's flow run is resumed at its training's last step, not 30 s before: the
        # tests' trainings are shorter than that, and they see it wait suspended
        timings = {TIMING_ENV: FAST, RESUME_LEAD_ENV: "0"}
        worker = Worker(deployed.server, f"pods-{uuid.uuid4().hex[:6]}", REPO, **timings)
        deployed.workers.append(worker)
        try:
            worker.start()
            yield OnSim(sim=sim, pods=pods, target=name, worker=worker)
        finally:
            for started in deployed.workers[first:]:
                started.stop()


def pod_of(stack: Stack, run_id: str) -> PodRecord:
    pod = PodRecord.load(Runs(stack.runs), run_id)
    assert pod is not None and pod.pod_id is not None, run_id
    return pod


def test_cancelling_a_deployment_run_on_a_simulated_pod_cancels_its_job_and_deletes_its_pod(
    deployed: Stack, on_sim: OnSim, tiny: tuple[Path, Path]
) -> None:
    known = run_ids(deployed)
    flow_run_id = deployed.run_deployment(
        "train/local", target=on_sim.target, training=tiny_training(*tiny, max_steps=100000)
    )
    record = wait_until(lambda: training_now(deployed, known), 300, "the job to train on its pod")
    assert record.target_kind == "runpod" and record.job is not None
    pod_id = pod_of(deployed, record.id).pod_id
    assert on_sim.pods.running(pod_id) and group_alive(record.job.pid)

    deployed.cancel(flow_run_id)
    flow_run = deployed.wait_final(flow_run_id, timeout=240)
    assert flow_run.state.is_cancelled(), flow_run.state
    saved = Runs(deployed.runs).load(record.id)
    assert saved.state == RunState.CANCELLED, saved
    local = Runs(deployed.runs).run_dir(record.id)
    assert (local / "job.log").is_file() and (local / "metrics.jsonl").is_file()
    pod = pod_of(deployed, record.id)
    assert pod.pod_id == pod_id and deleted_once_verified(pod), pod
    assert on_sim.sim.pod(pod_id).deleted
    assert on_sim.sim.pods() == [] and on_sim.sim.secret_names() == []
    assert not on_sim.pods.running(pod_id)  # its sshd and its job went with it
    assert not group_alive(record.job.pid)


def test_a_run_on_a_simulated_pod_whose_worker_was_killed_is_finished_by_the_collector(
    deployed: Stack, on_sim: OnSim, tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    known = run_ids(deployed)
    flow_run_id = deployed.run_deployment(
        "train/local", target=on_sim.target, training=tiny_training(*tiny, max_steps=30)
    )
    record = wait_until(lambda: training_now(deployed, known), 300, "the job to train on its pod")
    assert record.target_kind == "runpod" and record.job is not None
    pod_id = pod_of(deployed, record.id).pod_id
    # its job held stopped from its first step until a collect follows it: still training
    # then, however long the worker's death and the collect's start take
    with held_stopped(record.job.pid):
        # the pod's processes are the simulator's, in this process: they outlive the worker
        killed = on_sim.worker.kill(spare_sessions={record.job.pid})
        assert len(killed) >= 2, "the worker and its flow-run process"
        assert on_sim.pods.running(pod_id) and group_alive(record.job.pid)
        assert not on_sim.sim.pod(pod_id).deleted
        assert Runs(deployed.runs).load(record.id).state == RunState.RUNNING
        assert not deployed.flow_run(flow_run_id).state.is_final()  # nobody is left to say

        # a second worker, on another clone, sharing the runs root through the deployment
        other = Worker(
            deployed.server,
            f"collector-{uuid.uuid4().hex[:6]}",
            clone(tmp_path / "clone"),
            OVERBRAINER_PROJECT_DIR=str(tmp_path / "clone"),
            **{TIMING_ENV: FAST},
        )
        deployed.workers.append(other)
        other.start()
        collect_id = deployed.run_deployment("collect/every-5-minutes")
        wait_until(lambda: followed(deployed, record.id), 300, "a collect to follow the job")
    collected = deployed.wait_final(collect_id, timeout=600)
    assert collected.state.is_completed(), collected.state
    # a scheduled collect may have taken the run first: it finishes it then
    wait_until(
        lambda: Runs(deployed.runs).load(record.id).state.ended, 300, "the run to be finished"
    )
    saved = Runs(deployed.runs).load(record.id)
    assert saved.state == RunState.SUCCEEDED, saved
    assert_verified(deployed.runs, record.id)
    # the run succeeds once its files are verified; its pod is deleted after that, and its
    # keys forgotten after the sweep of the run's other pods
    wait_until(
        lambda: (p := pod_of(deployed, record.id)).state == PodState.DELETED and p.forgotten,
        120,
        "the pod of the finished run to be deleted and its keys forgotten",
    )
    pod = pod_of(deployed, record.id)
    assert pod.state == PodState.DELETED and pod.deleted_by == "collector", pod
    assert on_sim.sim.pod(pod_id).deleted and not on_sim.pods.running(pod_id)
    assert on_sim.sim.pods() == [] and on_sim.sim.secret_names() == []
    assert not (tmp_path / "clone" / "runs").exists(), "runs go to the shared root"

    async def report(client: Any) -> str:
        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

        found = await client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["collected-runs"]))
        )
        return "\n".join(str(a.data) for a in found)

    reported = [row for row in deployed.server.call(report).splitlines() if record.id in row]
    assert any("followed to its end" in row and "succeeded" in row for row in reported), reported

    # the flow run its dead process left running is ended, which frees the deployment's slot
    def settled() -> Any:
        state = deployed.flow_run(flow_run_id).state
        return state if state.is_final() else None

    left = wait_until(settled, 60, "the killed flow run to be settled")
    assert left.is_crashed() and record.id in left.message and "succeeded" in left.message


def test_the_nightly_schedule_creates_the_next_run_at_its_time_in_its_timezone(
    deployed: Stack,
) -> None:
    config = yaml.safe_load((REPO / "deployments" / "prefect.yaml").read_text())
    nightly = next(
        d for d in config["deployments"] if any("cron" in s for s in d.get("schedules", []))
    )
    schedule = nightly["schedules"][0]
    hour = int(schedule["cron"].split()[1])
    minute = int(schedule["cron"].split()[0])
    zone = ZoneInfo(schedule["timezone"])

    async def scheduled(client: Any) -> list[Any]:
        from prefect.client.schemas.filters import (
            DeploymentFilter,
            DeploymentFilterName,
            FlowRunFilter,
            FlowRunFilterStateName,
        )

        return list(
            await client.read_flow_runs(
                deployment_filter=DeploymentFilter(
                    name=DeploymentFilterName(any_=[nightly["name"]])
                ),
                flow_run_filter=FlowRunFilter(
                    state=dict(name=FlowRunFilterStateName(any_=["Scheduled"]))
                ),
            )
        )

    runs = wait_until(lambda: deployed.server.call(scheduled), 90, "the scheduler's runs")
    first = min(run.next_scheduled_start_time or run.expected_start_time for run in runs)
    local = first.astimezone(zone)
    assert (local.hour, local.minute) == (hour, minute), local
    now = datetime.now(zone)
    assert now < local <= now + timedelta(days=1, minutes=1)
    assert all(run.parameters == nightly["parameters"] for run in runs)


def test_parameters_that_fail_validation_fail_the_flow_run_with_the_pydantic_message(
    deployed: Stack, tiny: tuple[Path, Path]
) -> None:
    deployed.worker()
    before = run_ids(deployed)
    # the schema lets it through; the training spec's own validator does not
    training = tiny_training(*tiny, extra={"output_dir": "/elsewhere"})
    flow_run_id = deployed.run_deployment("train/local", target=deployed.target, training=training)
    flow_run = deployed.wait_final(flow_run_id, timeout=180)
    assert flow_run.state.is_failed(), flow_run.state
    assert "extra sets output_dir, which the trainer sets itself" in flow_run.state.message
    assert run_ids(deployed) == before

    # what the parameter schema already refuses never becomes a flow run
    refused = deployed.server.cli(
        "deployment",
        "run",
        "train/local",
        "--param",
        "training=" + json.dumps(tiny_training(*tiny, max_steps=-1)),
        check=False,
    )
    assert refused.returncode != 0
    assert "training.max_steps" in refused.stdout + refused.stderr


def test_an_unknown_target_block_fails_the_run_with_one_line_saying_how_to_create_it(
    deployed: Stack, tiny: tuple[Path, Path]
) -> None:
    deployed.worker()
    before = run_ids(deployed)
    flow_run_id = deployed.run_deployment(
        "train/local", target="no-such-box", training=tiny_training(*tiny)
    )
    flow_run = deployed.wait_final(flow_run_id, timeout=180)
    assert flow_run.state.is_failed()
    message = flow_run.state.message
    assert "no target block named 'no-such-box'" in message
    assert "python blocks/create_blocks.py" in message
    assert run_ids(deployed) == before


def test_create_blocks_saves_the_blocks_from_the_environment_and_prints_no_secret(
    deployed: Stack, tmp_path: Path
) -> None:
    key = tmp_path / "id_ed25519"
    key.write_text("not a real key\n")
    env = deployed.server.env(HF_TOKEN=SECRET, RUNPOD_API_KEY=SECRET + "rp")
    result = subprocess.run(
        [
            sys.executable,
            "blocks/create_blocks.py",
            "--local-job-venv",
            "/opt/venv-job",
            "--local-name",
            "box-local",
            "--ssh-host",
            "gpu.example.com",
            "--ssh-port",
            "2222",
            "--ssh-user",
            "ubuntu",
            "--ssh-key-file",
            str(key),
            "--ssh-host-key",
            "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAA",
            "--ssh-work-dir",
            "/home/ubuntu/ob",
            "--job-venv",
            "/home/ubuntu/venv",
            "--ssh-name",
            "box-ssh",
            "--budget-pods",
            "2",
            "--budget-dollars-per-hour",
            "3.5",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert SECRET not in output
    assert "box-ssh" in output and "box-local" in output and "overbrainer-gpu-pods" in output

    code = (
        "from overbrainer_prefect.blocks import SshTarget, LocalTarget, HuggingFaceCredentials\n"
        "s = SshTarget.load('box-ssh'); l = LocalTarget.load('box-local')\n"
        "print(s.host, s.port, s.user, s.key_file, s.work_dir, s.job_venv, l.job_venv)\n"
        "print(s.huggingface.token.get_secret_value() == __import__('os').environ['HF_TOKEN'])\n"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.split() == [
        "gpu.example.com",
        "2222",
        "ubuntu",
        str(key),
        "/home/ubuntu/ob",
        "/home/ubuntu/venv",
        "/opt/venv-job",
        "True",
    ]

    async def limits(client: Any) -> dict[str, int]:
        return {
            name: (await client.read_global_concurrency_limit_by_name(name)).limit
            for name in ("overbrainer-gpu-pods", "overbrainer-gpu-cents-per-hour")
        }

    assert deployed.server.call(limits) == {
        "overbrainer-gpu-pods": 2,
        "overbrainer-gpu-cents-per-hour": 350,
    }


def test_register_sh_registers_the_block_types(deployed: Stack) -> None:
    result = subprocess.run(
        ["sh", "blocks/register.sh"],
        cwd=REPO,
        env=deployed.server.env(PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}"),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stdout + result.stderr

    async def slugs(client: Any) -> set[str]:
        return {block_type.slug for block_type in await client.read_block_types()}

    assert {
        "overbrainer-local-target",
        "overbrainer-ssh-target",
        "overbrainer-hugging-face-credentials",
    } <= deployed.server.call(slugs)


def test_create_blocks_refuses_an_ssh_target_without_a_pinned_host_key(deployed: Stack) -> None:
    result = subprocess.run(
        [sys.executable, "blocks/create_blocks.py", "--ssh-host", "gpu.example.com"],
        cwd=REPO,
        env=deployed.server.env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert "--ssh-host-key" in lines[-1] and "ssh-keyscan" in lines[-1]
