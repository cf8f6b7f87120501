"""Every stage a job on a pod can be left at, recovered by one `collect`.

The process following a training run on a simulated pod (a real process tree
running the real bootstrap and watchdog, a real sshd, real axolotl) is
SIGKILLed at each stage it can die in: no hook runs, as when a worker's
machine is lost. Then `collect` runs once (twice where the account's pod
list lags behind a create), and each test asserts what bills and for how
long, that the record is final, that the dead flow run is settled, that no
client key or host key secret is left, and that every verified file is
intact.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest
from prefect.client.orchestration import get_client

from overbrainer_prefect.executors.manifest import sha256_file
from overbrainer_prefect.flows import collect
from overbrainer_prefect.runpod.pod import PodRecord, PodState
from overbrainer_prefect.runs.manifest import MANIFEST_FILE
from overbrainer_prefect.runs.store import RunRecord, Runs, RunState
from overbrainer_prefect.targets.runpod.keys import CLIENT_KEY, SSH_DIR, host_key_secret
from tests import runpod_fixtures as on_pods
from tests.conftest import job_venv
from tests.flowrun import run
from tests.runpod_fixtures import target
from tests.runpod_sim import RunpodSim
from tests.runpod_sim.pods import SimPods
from tests.test_runpod_flows import start_in_child
from tests.test_train_flow import kill, spec, wait_until

fast, sim, pods_of = on_pods.fast, on_pods.sim, on_pods.pods_of  # the simulator's fixtures

pytestmark = pytest.mark.slow

COLLECT_GRACE_S = 11.0  # the collector leaves a record this young alone (its creator may lock it)


def only(runs_dir: Path) -> RunRecord | None:
    records = Runs(runs_dir).list() if runs_dir.exists() else []
    return records[0] if records else None


def pod_of(runs_dir: Path) -> PodRecord | None:
    record = only(runs_dir)
    return PodRecord.load(Runs(runs_dir), record.id) if record is not None else None


def killed_when(
    name: str, training: Any, runs_dir: Path, tmp_path: Path, stage: Any, what: str
) -> RunRecord:
    """Trains on `name` in another process and SIGKILLs it (its whole session)
    as soon as `stage()` holds; returns the record as the dead process left it."""
    child = start_in_child(name, training, runs_dir, tmp_path / "child.log")
    try:
        wait_until(stage, 300, what)
    finally:
        kill(child)
    record = only(runs_dir)
    assert record is not None
    return record


def collect_now(runs_dir: Path, since_created: RunRecord | None = None) -> Any:
    """One `collect`, once the record is older than the collector's grace."""
    if since_created is not None:
        from overbrainer_prefect.timestamps import parse_rfc3339

        age = time.time() - parse_rfc3339(since_created.created).timestamp()
        time.sleep(max(0.0, COLLECT_GRACE_S - age))
    return run(collect(runs_dir=str(runs_dir)))


def flow_run_state(record: RunRecord) -> str:
    async def read() -> str:
        async with get_client() as client:
            found = await client.read_flow_run(UUID(str(record.flow_run_id)))
        assert found.state is not None
        return found.state.name

    return str(run(read()))


def assert_nothing_left(sim: RunpodSim, runs_dir: Path, record: RunRecord) -> PodRecord:
    """Every pod of the run deleted (the account shows none alive), its client
    key and its host key secret gone, its dead flow run settled."""
    runs = Runs(runs_dir)
    pod = PodRecord.load(runs, record.id)
    assert pod is not None and pod.gone, pod
    alive = [p for p in sim.pods() if p.name.startswith(f"ob-{record.id}-")]
    assert alive == [], alive
    assert not (runs.run_dir(record.id) / SSH_DIR / CLIENT_KEY).exists()
    assert host_key_secret(record.id) not in sim.secret_names()
    assert flow_run_state(record) in ("Crashed", "Failed", "Completed", "Cancelled")
    return pod


def billed_s(sim: RunpodSim, pod_id: str) -> float:
    simulated = sim.pod(pod_id)
    assert simulated.deleted_at is not None
    return simulated.deleted_at - simulated.created_at


def test_a_follower_killed_right_after_its_create_leaves_one_pod_billing_until_collect(
    prefect_server: None, sim: RunpodSim, pods_of: SimPods, tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    runs_dir = tmp_path / "runs"
    sim.fail_after_create(1)  # the pod is created, the answer is a 500...
    sim.lag_after_create(seconds=20.0)  # ...and the pod list hides it for 20 s
    name = target(sim)

    def sent() -> bool:  # the create reached Runpod; its answer was a 500
        return any(r.method == "POST" and r.path == "/v2/pods" for r in sim.requests)

    record = killed_when(name, spec(*tiny), runs_dir, tmp_path, sent, "the create request")
    assert record.state == RunState.PREPARING and record.job is None
    rows = collect_now(runs_dir, record)
    assert [r.run_id for r in rows] == [record.id]
    saved = Runs(runs_dir).load(record.id)
    assert saved.state == RunState.FAILED and saved.message == "interrupted before the job started"
    pod = PodRecord.load(Runs(runs_dir), record.id)
    assert pod is not None and not pod.gone  # the list still hides what the create made
    assert len(sim.pods_named(f"ob-{record.id}-a1")) == 1  # created, not yet listed
    deadline = time.monotonic() + 60
    while not pod.gone and time.monotonic() < deadline:  # the next collects look again
        time.sleep(2.0)
        collect_now(runs_dir)
        pod = PodRecord.load(Runs(runs_dir), record.id)
        assert pod is not None
    made = sim.pods(include_deleted=True)
    assert len(made) == 1, made  # never two pods for one job
    assert_nothing_left(sim, runs_dir, record)
    assert billed_s(sim, made[0].id) < 20.0 + 30.0  # the list's lag, then the next collects


def test_a_pod_that_never_boots_is_deleted_by_one_collect_once_its_follower_is_gone(
    prefect_server: None, sim: RunpodSim, pods_of: SimPods, tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    runs_dir = tmp_path / "runs"
    pods_of.boot_delay_s = 3600.0  # its start command never runs: no watchdog bounds it
    name = target(sim, boot_grace_s=3000.0)

    def created() -> bool:
        pod = pod_of(runs_dir)
        return pod is not None and pod.pod_id is not None

    record = killed_when(name, spec(*tiny), runs_dir, tmp_path, created, "the pod's create")
    pod = pod_of(runs_dir)
    assert pod is not None and pod.pod_id is not None and pod.state == PodState.BOOTING
    rows = collect_now(runs_dir, record)
    assert [(r.run_id, r.state) for r in rows] == [(record.id, RunState.FAILED)]
    assert billed_s(sim, pod.pod_id) < COLLECT_GRACE_S + 30.0  # nothing else would have ended it
    assert Runs(runs_dir).load(record.id).message == "interrupted before the job started"
    assert assert_nothing_left(sim, runs_dir, record).deleted_by == "collector"


def test_a_follower_killed_with_ssh_ready_and_no_job_started_leaves_nothing_after_collect(
    prefect_server: None, sim: RunpodSim, pods_of: SimPods, tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    runs_dir = tmp_path / "runs"
    # the job venv's Python takes 60 s to answer the probe: the follower is killed in
    # that window, with SSH ready and no job started (however fast this machine is)
    slow = tmp_path / "slow-venv"
    (slow / "bin").mkdir(parents=True)
    (slow / "bin" / "python").write_text(
        f'#!/bin/sh\nsleep 60\nexec {job_venv()}/bin/python "$@"\n'
    )
    (slow / "bin" / "python").chmod(0o755)
    name = target(sim, boot_grace_s=3000.0, job_venv=str(slow))

    def ready() -> bool:
        pod = pod_of(runs_dir)
        record = only(runs_dir)
        return pod is not None and pod.state == PodState.READY and record is not None

    record = killed_when(name, spec(*tiny), runs_dir, tmp_path, ready, "the pod to be ready")
    rows = collect_now(runs_dir, record)
    saved = Runs(runs_dir).load(record.id)
    pod = assert_nothing_left(sim, runs_dir, record)
    assert pod.pod_id is not None
    if saved.job is None:  # killed before its job started: abandoned at once
        assert saved.state == RunState.FAILED
        assert billed_s(sim, pod.pod_id) < COLLECT_GRACE_S + 60.0
    else:  # the job had just started: followed to its end, its files verified
        assert saved.state == RunState.SUCCEEDED and rows[0].retrieved
    assert rows and rows[0].run_id == record.id


def test_a_follower_killed_while_its_job_trains_is_finished_by_one_collect(
    prefect_server: None, sim: RunpodSim, pods_of: SimPods, tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    runs_dir = tmp_path / "runs"
    name = target(sim)

    def training() -> bool:
        record = only(runs_dir)
        if record is None or record.job is None:
            return False
        metrics = Path(record.remote_dir) / "metrics.jsonl"
        return metrics.exists() and '"log"' in metrics.read_text()

    record = killed_when(
        name, spec(*tiny, max_steps=40), runs_dir, tmp_path, training, "the job to train"
    )
    (row,) = collect_now(runs_dir)
    saved = Runs(runs_dir).load(record.id)
    assert saved.state == RunState.SUCCEEDED and row.retrieved and row.files > 0
    assert_nothing_left(sim, runs_dir, record)
    _assert_files_intact(runs_dir, saved)


def test_a_follower_killed_once_its_files_are_verified_has_its_pod_deleted_by_collect(
    prefect_server: None, sim: RunpodSim, pods_of: SimPods, tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    runs_dir = tmp_path / "runs"
    sim.fail(500, times=1000, method="DELETE", path="/v2/pods/")  # its follower cannot delete it
    name = target(sim, retrieve_grace_s=3000.0)

    def verified() -> bool:  # its manifest is written, then its record saved succeeded
        record = only(runs_dir)
        return (
            record is not None
            and record.state == RunState.SUCCEEDED
            and (Runs(runs_dir).run_dir(record.id) / MANIFEST_FILE).exists()
        )

    record = killed_when(name, spec(*tiny), runs_dir, tmp_path, verified, "the verified files")
    saved = Runs(runs_dir).load(record.id)
    assert saved.state == RunState.SUCCEEDED
    pod = pod_of(runs_dir)
    assert pod is not None and pod.pod_id is not None and not pod.gone
    sim.clear_faults()
    (row,) = collect_now(runs_dir)  # (its watchdog may see the retrieved marker first)
    assert row.run_id == record.id and row.state == RunState.SUCCEEDED
    assert_nothing_left(sim, runs_dir, record)
    assert Runs(runs_dir).load(record.id).state == RunState.SUCCEEDED
    _assert_files_intact(runs_dir, saved)


def test_a_follower_killed_after_its_delete_was_sent_has_the_delete_confirmed_by_collect(
    prefect_server: None, sim: RunpodSim, pods_of: SimPods, tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    runs_dir = tmp_path / "runs"
    sim.lag_after_delete(gets=10_000, lists=10_000)  # a deleted pod shows for a long while
    name = target(sim, retrieve_grace_s=3000.0)

    def deleting() -> bool:
        pod = pod_of(runs_dir)
        return pod is not None and pod.state == PodState.DELETING

    record = killed_when(name, spec(*tiny), runs_dir, tmp_path, deleting, "the delete")
    sim.lag_after_delete(gets=0, lists=0)
    for simulated in sim.pods(include_deleted=True):  # the lag ends
        simulated.lingering_gets = simulated.lingering_lists = 0
    (row,) = collect_now(runs_dir)
    assert row.run_id == record.id and row.state == RunState.SUCCEEDED
    pod = assert_nothing_left(sim, runs_dir, record)
    assert pod.state == PodState.DELETED
    _assert_files_intact(runs_dir, Runs(runs_dir).load(record.id))


def _assert_files_intact(runs_dir: Path, record: RunRecord) -> None:
    """Every file of the run's verified manifest is here, with its SHA-256."""
    local = Runs(runs_dir).run_dir(record.id)
    manifest = json.loads((local / MANIFEST_FILE).read_text())
    assert manifest
    for entry in manifest:
        assert sha256_file(local / entry["path"]) == (entry["size"], entry["sha256"])
