"""Export and compare on a Runpod target, against the simulator whose pods are
real local process trees (the real bootstrap + watchdog, a real sshd on
127.0.0.1) running the real jobs: axolotl's fine-tune, llama.cpp's merge,
convert and quantize, and llama-cpp-python's answers.

What is shown: `fine_tune` on a pod target runs every step (the training, the
run's export, the base model's export, the compare) on one pod, sized for its
largest job, each step verified, the pod deleted after the last; cancelling an
export while its pod boots deletes that pod; an export whose follower died is
followed again and its pod deleted; a fine-tune cancelled while its run trains
on a pod cancels the job and deletes the pod (its own hook runs its steps'); a
wrong compare image fails in one line before any pod exists.
"""

from __future__ import annotations

import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from prefect.client.orchestration import get_client
from prefect.states import Cancelling

from overbrainer_prefect.finetune import CompareSettings
from overbrainer_prefect.flows import (
    FineTuneResult,
    FineTuneSpec,
    compare,
    export,
    fine_tune,
    pods,
)
from overbrainer_prefect.money.store import LedgerFile
from overbrainer_prefect.runpod.bootstrap import TIMING_ENV
from overbrainer_prefect.runpod.pod import PodRecord, PodState
from overbrainer_prefect.runpod.settings import SettingsError
from overbrainer_prefect.runs.ids import new_run_id
from overbrainer_prefect.runs.store import BASES_DIR, Runs, RunState
from overbrainer_prefect.trainers.export import ExportSpec
from overbrainer_prefect.trainers.spec import TrainingSpec
from tests.runpod_fixtures import FAST, fast, pods_of, sim, target
from tests.runpod_sim import RunpodSim
from tests.runpod_sim.pods import SimPods, deleted_once_verified
from tests.test_runpod_flows import (
    assert_no_secret_in_files,
    cancel_through_prefect,
    flow_logs,
    run,
    secrets_of,
)
from tests.test_train_flow import kill, python_in_child, spec, wait_until
from tests.tiny_runs import TinyRun

__all__ = ["fast", "pods_of", "sim"]  # the simulator's fixtures (tests/runpod_fixtures.py)

pytestmark = pytest.mark.slow

QUESTIONS = ["What colour is the sky?", "Name a fruit."]
COMPARE_IMAGE = "overbrainer/compare:2"


def pods_of_store(store: Runs) -> list[PodRecord]:
    """The pod records of every record of a store."""
    found = []
    for record in store.list():
        pod = PodRecord.load(store, record.id)
        assert pod is not None, f"{record.id} has no pod.json"
        found.append(pod)
    return found


def fine_tune_steps(runs_dir: Path, run_id: str) -> dict[str, list[Any]]:
    """The records of each step of the fine-tune of `run_id`: the run, its
    export, the base model's export, the compare."""
    runs = Runs(runs_dir)
    bases = [
        Runs(path, record_file="export.json", kind="export")
        for path in sorted((runs_dir / BASES_DIR).glob("*/exports"))
    ]
    return {
        "run": [(runs, runs.load(run_id))],
        "export": [(s, r) for s in [runs.children(run_id, "export")] for r in s.list()],
        "base": [(s, r) for s in bases for r in s.list()],
        "compare": [(s, r) for s in [runs.children(run_id, "compare")] for r in s.list()],
    }


def test_fine_tune_on_a_pod_target_runs_every_step_on_one_pod_deleted_after_the_last(
    prefect_server: None,
    sim: RunpodSim,
    pods_of: SimPods,
    tiny: tuple[Path, Path],
    tmp_path: Path,
) -> None:
    runs_dir = tmp_path / "runs"
    name = target(sim, gpu_types="auto")
    fine = FineTuneSpec(
        target=name,
        training=spec(*tiny),
        export=ExportSpec(quant="q8_0"),
        compare=CompareSettings(questions=QUESTIONS, max_tokens=4),
        runs_dir=str(runs_dir),
    )
    state = run(fine_tune(fine, return_state=True))
    result = state.result()
    assert isinstance(result, FineTuneResult), result
    runs = Runs(runs_dir)
    run_id = result.run_id
    assert result.export.state == RunState.SUCCEEDED and result.export.gguf is not None
    assert result.compare.state == RunState.SUCCEEDED
    assert [pair.question for pair in result.compare.answers] == QUESTIONS
    assert all(pair.base and pair.tuned for pair in result.compare.answers)

    # one pod: made for the run, its record the run's; every other step links to it
    (made,) = sim.pods(include_deleted=True)
    pod = PodRecord.load(runs, run_id)
    assert pod is not None and pod.pod_id == made.id
    assert deleted_once_verified(pod) and pod.secret_deleted, pod
    assert made.deleted and not pods_of.running(made.id)
    assert sim.pods() == [] and sim.secret_names() == []
    # its one ledger entry closed with the pipeline, at what the pod cost over all its jobs
    (entry,) = LedgerFile.of(runs).read().entries
    assert entry.pod_id == made.id and entry.run_id == run_id and entry.ended
    assert entry.cost_usd == pytest.approx(pod.estimated_spend(), rel=0.01)
    steps = fine_tune_steps(runs_dir, run_id)
    assert {step: len(found) for step, found in steps.items()} == {
        "run": 1,
        "export": 1,
        "base": 1,
        "compare": 1,
    }
    ended = []
    for step, [(store, record)] in steps.items():
        assert record.state == RunState.SUCCEEDED, (step, record.message)
        assert record.not_retrieved is None, step
        if step != "run":
            assert PodRecord.load(store, record.id) is None, step  # no pod of its own
            assert (store.run_dir(record.id) / "pod.link").is_file(), step
        ended.append((record.started, record.ended, step))
    # in order, one after another, on the one pod
    assert [step for _, _, step in sorted(ended)] == ["run", "export", "base", "compare"]

    # each job's files were verified: the GGUFs and the answers are here
    gguf = Path(result.export.gguf_path or "")
    assert gguf.is_file() and gguf.stat().st_size == result.export.gguf.size
    answers = Path(result.compare.answers_path or "")
    assert answers.is_file() and answers.read_text().count("\n") == 2 * len(QUESTIONS)

    # the pod was sized for the largest job, and the watchdog saw every job in turn
    train_logs = "\n".join(flow_logs(str(runs.load(run_id).flow_run_id)))
    assert "the merge into" in train_logs and "GB of VRAM" in train_logs
    # (a job quicker than one look of the watchdog may pass unseen: the export is not)
    watchdog = (runs.run_dir(run_id) / ".pod" / "watchdog.log").read_text()
    assert "job: the pipeline's job 2 on this pod" in watchdog, watchdog
    assert "between jobs: the files of" in watchdog, watchdog
    export_flow_run = steps["export"][0][1].flow_run_id
    assert export_flow_run is not None
    export_logs = "\n".join(flow_logs(export_flow_run))
    assert f"runs on pod {pod.name} of its pipeline" in export_logs, export_logs
    assert_no_secret_in_files(runs_dir, secrets_of(sim))


@pytest.fixture(scope="module")
def trained_here(tiny_run: TinyRun) -> tuple[Path, str]:
    """A succeeded run of the tiny model on a local target (the session's,
    tests/tiny_runs.py, only read here): its runs directory and its ID."""
    return tiny_run.runs_dir, tiny_run.run_id


def trained_locally(trained_here: tuple[Path, str], runs_dir: Path) -> str:
    """A copy of the module's succeeded run in `runs_dir`, under a new ID and
    without exports; returns its ID."""
    source, run_id = trained_here
    new_id = new_run_id()
    runs = Runs(runs_dir)
    shutil.copytree(
        Runs(source).run_dir(run_id), runs.run_dir(new_id), ignore=shutil.ignore_patterns("exports")
    )
    runs.save(Runs(source).load(run_id).model_copy(update={"id": new_id}))
    return new_id


def export_in_child(run_id: str, target_name: str, runs_dir: Path, log: Path) -> Any:
    """Runs the export flow in another Python process, against this session's server."""
    code = (
        "import asyncio, sys\n"
        "from overbrainer_prefect.flows import export\n"
        "asyncio.run(export(run_id=sys.argv[1], quant='q8_0', target=sys.argv[2], "
        "runs_dir=sys.argv[3]))\n"
    )
    return python_in_child(code, [run_id, target_name, str(runs_dir)], log)


async def export_hook(flow_run: Any) -> None:
    """The export flow's cancellation hook, as a runner runs it."""
    from overbrainer_prefect.driver import on_cancelled
    from overbrainer_prefect.flows.export import export as export_flow

    await on_cancelled(export_flow, flow_run, flow_run.state)


def test_an_export_cancelled_while_its_pod_boots_deletes_that_pod(
    prefect_server: None,
    sim: RunpodSim,
    pods_of: SimPods,
    trained_here: tuple[Path, str],
    tmp_path: Path,
) -> None:
    runs_dir = tmp_path / "runs"
    run_id = trained_locally(trained_here, runs_dir)
    exports = Runs(runs_dir).children(run_id, "export")
    pods_of.boot_delay_s = 3.0
    name = target(sim)
    child = export_in_child(run_id, name, runs_dir, tmp_path / "child.log")

    def created() -> Any:
        for record in exports.list():
            pod = PodRecord.load(exports, record.id)
            if pod is not None and pod.pod_id is not None:
                return record
        return None

    try:
        wait_until(lambda: created() is not None, 120, "the export's pod to be created")
        record = created()
        cancel_through_prefect(record.flow_run_id, child, export_hook)
    finally:
        kill(child)
    saved = exports.load(record.id)
    assert saved.state == RunState.FAILED and saved.message == "interrupted before the job started"
    pod = PodRecord.load(exports, record.id)
    assert pod is not None and pod.state == PodState.DELETED and pod.pod_id is not None
    assert sim.pod(pod.pod_id).deleted and not pods_of.running(pod.pod_id)
    assert sim.pods() == [] and sim.secret_names() == []
    assert Runs(runs_dir).load(run_id).state == RunState.SUCCEEDED  # the run is untouched


def test_a_wrong_compare_image_fails_in_one_line_before_any_pod(
    prefect_server: None,
    sim: RunpodSim,
    pods_of: SimPods,
    tiny_run: TinyRun,
    tmp_path: Path,
) -> None:
    exported = tiny_run.copied(tmp_path)  # a succeeded run with its q8_0 export
    runs_dir, run_id = exported.runs_dir, exported.run_id
    name = target(sim)
    with pytest.raises(SettingsError) as refused:
        run(
            compare(
                run_id=run_id,
                questions=QUESTIONS,
                quant="q8_0",
                target=name,
                runs_dir=str(runs_dir),
                image="  ",
            )
        )
    assert "\n" not in str(refused.value) and "the image is missing" in str(refused.value)
    assert sim.pods(include_deleted=True) == []
    assert not Runs(runs_dir).children(run_id, "compare").root.exists()


def between_jobs(exports: Runs, pods: SimPods) -> tuple[str, str] | None:
    """The export and pod of a fine-tune whose pod was told that the export's
    files were verified and the next job follows (`.pod/between` on the pod)."""
    for record in exports.list(skipped=lambda _name, _error: None):
        pod = PodRecord.load(exports, record.id)
        if pod is None or pod.pod_id is None:
            continue
        marker = pods.workspace_of(pod.pod_id) / "overbrainer" / record.id / ".pod" / "between"
        if marker.exists():
            return record.id, pod.pod_id
    return None


def killed_between_jobs(
    sim: RunpodSim,
    pods: SimPods,
    trained_here: tuple[Path, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    grace_s: int,
) -> tuple[FineTuneSpec, str, str, str]:
    """The fine-tune of a run trained here continued on a pod target
    (`run_id`), in another process killed once its export's files were
    verified on the pod and before the base model's export started; the
    watchdog's grace between jobs is `grace_s`. Returns the spec, the run's,
    the export's and the pod's IDs."""

    monkeypatch.setenv(TIMING_ENV, f"{FAST},next_job_grace_s={grace_s}")  # the child's, the pod's
    runs_dir = tmp_path / "runs"
    run_id = trained_locally(trained_here, runs_dir)
    source, trained_id = trained_here
    fine = FineTuneSpec(
        target=target(sim),
        training=TrainingSpec.model_validate(Runs(source).load(trained_id).spec),
        export=ExportSpec(quant="q8_0"),
        compare=CompareSettings(questions=QUESTIONS, max_tokens=4),
        runs_dir=str(runs_dir),
    )
    code = (
        "import asyncio, sys\n"
        "from overbrainer_prefect.flows import FineTuneSpec, fine_tune\n"
        "spec = FineTuneSpec.model_validate_json(sys.argv[1])\n"
        "asyncio.run(fine_tune(spec, run_id=sys.argv[2]))\n"
    )
    log = tmp_path / "child.log"
    child = python_in_child(code, [fine.model_dump_json(), run_id], log)
    exports = Runs(runs_dir).children(run_id, "export")
    try:
        deadline = time.monotonic() + 300
        while (found := between_jobs(exports, pods)) is None:
            assert child.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the export's files were never verified"
            time.sleep(0.05)
    finally:
        kill(child)  # the follower dies between two jobs: no hook runs
    return fine, run_id, *found


def test_a_fine_tune_killed_between_jobs_leaves_a_pod_ended_at_its_grace_and_continues_on_a_new_one(
    prefect_server: None,
    sim: RunpodSim,
    pods_of: SimPods,
    trained_here: tuple[Path, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:

    fine, run_id, export_id, pod_id = killed_between_jobs(
        sim, pods_of, trained_here, tmp_path, monkeypatch, grace_s=5
    )
    killed = time.time()
    wait_until(lambda: sim.pod(pod_id).deleted, 30, "the watchdog to end the pod between jobs")
    assert (sim.pod(pod_id).deleted_at or 0) <= killed + 5 + 3  # its grace, a look, a delete
    log = pods_of.watchdog_log(pod_id, export_id)
    assert "no next job of the pipeline started within next_job_grace (5s" in log, log

    result = run(fine_tune(fine, run_id=run_id))
    assert isinstance(result, FineTuneResult) and result.run_id == run_id
    assert result.export.export_id == export_id and result.compare.state == RunState.SUCCEEDED
    (other,) = [p for p in sim.pods(include_deleted=True) if p.id != pod_id]
    assert other.deleted and sim.pods() == [] and sim.secret_names() == []
    steps = fine_tune_steps(tmp_path / "runs", run_id)
    [(bases, base)] = steps["base"]
    pod = PodRecord.load(bases, base.id)  # the new pod was made for the base model's export
    assert pod is not None and pod.pod_id == other.id and pod.state == PodState.DELETED
    [(compares, compared)] = steps["compare"]
    assert compared.state == RunState.SUCCEEDED and PodRecord.load(compares, compared.id) is None
    # the first pod's fate as its watchdog told it, though its follower died before the delete
    first = PodRecord.load(Runs(tmp_path / "runs").children(run_id, "export"), export_id)
    assert first is not None and first.state == PodState.DELETED, first
    assert first.deleted_by == "watchdog", first
    assert "no next job of the pipeline started within next_job_grace (5s" in (
        first.delete_reason or ""
    )
    at = sim.pod(pod_id).deleted_at or 0  # its bound's time: a look and a delete early
    assert first.deleted_unix is not None and at - 10 <= first.deleted_unix <= at + 1


def test_a_fine_tune_killed_between_jobs_continues_on_its_pod_while_it_lives(
    prefect_server: None,
    sim: RunpodSim,
    pods_of: SimPods,
    trained_here: tuple[Path, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fine, run_id, export_id, pod_id = killed_between_jobs(
        sim, pods_of, trained_here, tmp_path, monkeypatch, grace_s=120
    )
    assert not sim.pod(pod_id).deleted
    listed = run(pods(action="list", runs_dir=str(tmp_path / "runs"), credentials=None))
    (row,) = [r for r in listed.pods if r.pod_id == pod_id]  # its export ended: not left over
    assert not row.orphan and "runs the jobs of its pipeline" in row.why
    assert "(next_job_grace: at " in row.why, row.why  # when its watchdog deletes it
    result = run(fine_tune(fine, run_id=run_id))
    assert isinstance(result, FineTuneResult) and result.compare.state == RunState.SUCCEEDED
    (made,) = sim.pods(include_deleted=True)  # the same pod ran the rest of the fine-tune
    assert made.id == pod_id and made.deleted and sim.secret_names() == []
    exports = Runs(tmp_path / "runs").children(run_id, "export")
    pod = PodRecord.load(exports, export_id)
    assert pod is not None and deleted_once_verified(pod), pod
    log = pods_of.watchdog_log(pod_id, export_id)
    assert "job: the pipeline's job 2 on this pod" in log, log  # the base model's export


def fine_tune_in_child(fine: FineTuneSpec, log: Path) -> Any:
    """Runs the fine_tune flow in another Python process, against this session's server."""
    code = (
        "import asyncio, sys\n"
        "from overbrainer_prefect.flows import FineTuneSpec, fine_tune\n"
        "asyncio.run(fine_tune(FineTuneSpec.model_validate_json(sys.argv[1])))\n"
    )
    return python_in_child(code, [fine.model_dump_json()], log)


def test_a_fine_tune_cancelled_while_its_run_trains_on_a_pod_cancels_the_job_and_deletes_the_pod(
    prefect_server: None,
    sim: RunpodSim,
    pods_of: SimPods,
    tiny: tuple[Path, Path],
    tmp_path: Path,
) -> None:
    from overbrainer_prefect.driver import on_cancelled
    from tests.test_runpod_flows import LONG, running_on_pod

    runs_dir = tmp_path / "runs"
    fine = FineTuneSpec(
        target=target(sim),
        training=spec(*tiny, max_steps=LONG),
        compare=CompareSettings(questions=QUESTIONS),
        runs_dir=str(runs_dir),
    )
    child = fine_tune_in_child(fine, tmp_path / "child.log")
    try:
        wait_until(lambda: running_on_pod(runs_dir) is not None, 240, "the job to train")
        record = running_on_pod(runs_dir)

        async def cancel() -> Any:
            async with get_client() as client:
                train_run = await client.read_flow_run(uuid.UUID(record.flow_run_id))
                assert train_run.parent_task_run_id is not None  # a subflow of the fine-tune
                task_run = await client.read_task_run(train_run.parent_task_run_id)
                parent = task_run.flow_run_id
                assert parent is not None
                await client.set_flow_run_state(parent, Cancelling(), force=True)
                return parent

        parent = run(cancel())
    finally:
        kill(child)  # as a runner kills the process of a cancelled flow run

    async def hook() -> Any:
        from overbrainer_prefect.flows.pipeline import fine_tune as fine_tune_flow

        async with get_client() as client:
            flow_run = await client.read_flow_run(parent)
            await on_cancelled(fine_tune_flow, flow_run, flow_run.state)
            return await client.read_flow_run(uuid.UUID(record.flow_run_id))

    train_run = run(hook())
    saved = Runs(runs_dir).load(record.id)
    assert saved.state == RunState.CANCELLED, saved.message
    assert (Runs(runs_dir).run_dir(record.id) / "job.log").is_file()
    pod = PodRecord.load(Runs(runs_dir), record.id)
    assert pod is not None and pod.state == PodState.DELETED and pod.pod_id is not None
    assert sim.pod(pod.pod_id).deleted and not pods_of.running(pod.pod_id)
    assert sim.pods() == [] and sim.secret_names() == []
    assert train_run.state is not None and train_run.state.is_cancelled()


def test_an_export_on_a_pod_whose_follower_died_is_followed_again_and_its_pod_deleted(
    prefect_server: None,
    sim: RunpodSim,
    pods_of: SimPods,
    trained_here: tuple[Path, str],
    tmp_path: Path,
) -> None:
    runs_dir = tmp_path / "runs"
    run_id = trained_locally(trained_here, runs_dir)
    exports = Runs(runs_dir).children(run_id, "export")
    name = target(sim)
    child = export_in_child(run_id, name, runs_dir, tmp_path / "child.log")

    def started() -> Any:
        return next((r for r in exports.list() if r.job is not None), None)

    try:
        wait_until(lambda: started() is not None, 180, "the export's job to start on its pod")
    finally:
        kill(child)  # its follower dies; the job and its pod are left to the watchdog
    export_id = started().id
    pod = PodRecord.load(exports, export_id)
    assert pod is not None and pod.pod_id is not None and not sim.pod(pod.pod_id).deleted
    listed = run(pods(action="list", runs_dir=str(runs_dir), credentials=None))
    (row,) = [r for r in listed.pods if r.pod_id == pod.pod_id]
    assert row.run_id == export_id and not row.orphan  # found under its run, bounded
    assert row.owner == f"export {export_id} of run {run_id}"
    result = run(export(run_id=run_id, export_id=export_id, runs_dir=str(runs_dir)))
    assert result.state == RunState.SUCCEEDED and result.export_id == export_id
    assert result.gguf is not None and Path(result.gguf_path or "").is_file()
    pod = PodRecord.load(exports, export_id)
    assert pod is not None and deleted_once_verified(pod), pod
    assert sim.pod(pod.pod_id).deleted and sim.pods() == [] and sim.secret_names() == []  # type: ignore[arg-type]


def test_an_export_on_a_pod_with_a_network_volume_checks_the_volume_before_any_pod(
    prefect_server: None,
    sim: RunpodSim,
    pods_of: SimPods,
    trained_here: tuple[Path, str],
    tmp_path: Path,
) -> None:
    from overbrainer_prefect.runpod.volume import VolumeError

    runs_dir = tmp_path / "runs"
    run_id = trained_locally(trained_here, runs_dir)
    exports = Runs(runs_dir).children(run_id, "export")
    on_volume = {"data_center_ids": ["EU-RO-1"], "max_volume_gb": 20}
    missing = target(sim, network_volume_id="nosuchvol0", **on_volume)
    with pytest.raises(VolumeError) as refused:
        run(export(run_id=run_id, quant="q8_0", target=missing, runs_dir=str(runs_dir)))
    assert str(refused.value) == (
        "no network volume nosuchvol0 in this Runpod account: check network_volume_id"
    )
    assert exports.list() == [] and sim.pods(include_deleted=True) == []

    volume_id = sim.add_volume(10, "EU-RO-1")
    name = target(sim, network_volume_id=volume_id, **on_volume)
    state = run(
        export(run_id=run_id, quant="q8_0", target=name, runs_dir=str(runs_dir), return_state=True)
    )
    result = state.result()
    assert result.state == RunState.SUCCEEDED and result.gguf is not None
    (pod,) = sim.pods(include_deleted=True)
    assert pod.deleted and pod.request["mounts"]["network"][0]["volumeId"] == volume_id
    assert sim.volume(volume_id).size == 10  # a tiny export fits: nothing grown
    logs = "\n".join(flow_logs(str(state.state_details.flow_run_id)))
    assert f"network volume {volume_id}: 10 GB, the q8_0 export of run {run_id} needs" in logs
