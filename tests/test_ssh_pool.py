"""A pool of SSH machines as one target, on three real OpenSSH sshd of
127.0.0.1 (each its own port, keys and work directory): runs at once land on
different machines, never one; a machine killed mid-run is that run's loss
only; two workers racing for the last free machine: one gets it, the other
waits or fails in one line; a dead orchestrator's claim is taken over once
its job ended; a training across nodes that loses a node ends on every node
and goes on from its last complete checkpoint on machines that answer. Jobs
are shell scripts (`tests.shelljobs`); only the core is used (no Prefect
server)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from overbrainer_prefect.blocks import SshPool, SshPoolHost, SshTarget
from overbrainer_prefect.executors.base import JOB_LOG
from overbrainer_prefect.flows import attach, train
from overbrainer_prefect.kinds.base import Finished
from overbrainer_prefect.kinds.training import (
    LostRun,
    go_on_after_lost_machines,
    resume_path,
    stage_checkpoint,
)
from overbrainer_prefect.runpod.settings import SettingsError
from overbrainer_prefect.runs.checkpoints import last_kept
from overbrainer_prefect.runs.store import ResumedFrom, RunRecord, Runs, RunState
from overbrainer_prefect.steps import end as end_step
from overbrainer_prefect.steps import reporters, retrieve
from overbrainer_prefect.steps.context import Outcome
from overbrainer_prefect.steps.errors import Unreachable
from overbrainer_prefect.targets import host_claim
from overbrainer_prefect.targets.base import JobNeed, Target
from overbrainer_prefect.targets.pool import POOL_RECORD, PoolError, PoolPlacement, PoolTarget
from overbrainer_prefect.trainers.base import TrainError
from overbrainer_prefect.trainers.spec import TrainingSpec
from tests import procs
from tests.conftest import REPO, job_venv
from tests.ddpjob import DdpTrainer
from tests.shelljobs import WRITE_METRICS, WRITE_OUTPUT, ShellTrainer, started_job, wait_for
from tests.sshd import Sshd
from tests.test_train_flow import spec

pytestmark = pytest.mark.slow

LOG = logging.getLogger("pool")
QUICK = f"{WRITE_METRICS}; {WRITE_OUTPUT}"
"""A job that ends at once, with metrics and an output."""


def held_job(release: Path) -> str:
    """A job that runs until `release` exists (at most 60 s), then ends well."""
    wait = f"i=0; while [ ! -e {release} ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done"
    return f"{WRITE_METRICS}; {wait}; {WRITE_OUTPUT}"


@pytest.fixture
def boxes(tmp_path: Path) -> Iterator[list[Sshd]]:
    """Three sshd of the test's own, which it may stop."""
    with ExitStack() as stack:
        yield [stack.enter_context(Sshd.create(tmp_path / f"sshd{i}")) for i in range(3)]


def pool_block(boxes: list[Sshd], tmp_path: Path, **changes: Any) -> SshPool:
    values: dict[str, Any] = {
        "hosts": [
            SshPoolHost(
                name=f"box{i}",
                host="127.0.0.1",
                port=box.port,
                user=box.user,
                private_key=box.client_key_text,
                host_key=box.host_key_line,
                work_dir=str(work_of(tmp_path, i)),
            )
            for i, box in enumerate(boxes)
        ],
        "job_venv": str(job_venv()),
        "poll_seconds": 0.3,
        "connect_timeout": 5,
        "wait_minutes": 0,
    }
    values.update(changes)
    return SshPool.model_validate(values)


def work_of(tmp_path: Path, i: int) -> Path:
    return tmp_path / f"work{i}"


def pool(boxes: list[Sshd], tmp_path: Path, **changes: Any) -> PoolTarget:
    target = pool_block(boxes, tmp_path, **changes).target("overbrainer-ssh-pool/p", LOG)
    assert isinstance(target, PoolTarget)
    target.poll_s = 0.2
    return target


def machine_of(runs: Runs, record: RunRecord) -> str:
    placement = PoolPlacement.load(runs, record.id)
    assert placement is not None
    return placement.host


def started(target: Target, runs: Runs, script: str) -> Any:
    """Creates, places and starts a job; yields (placed, ctx, record)."""
    return started_job(target, runs, ShellTrainer(script), JobNeed(what="the pool's job"))


async def run_job(target: PoolTarget, runs: Runs, script: str) -> Outcome:
    async with started(target, runs, script) as (placed, ctx, record):
        return await placed.follow(ctx, ShellTrainer(script), record)


def test_runs_at_once_land_on_different_machines_and_a_full_pool_fails_in_one_line(
    boxes: list[Sshd], tmp_path: Path
) -> None:
    runs = Runs(tmp_path / "runs")
    target = pool(boxes, tmp_path)
    release = tmp_path / "release"
    script = held_job(release)

    async def go() -> list[Outcome]:
        jobs = [asyncio.create_task(run_job(target, runs, script)) for _ in range(3)]
        await wait_for(lambda: len(list(tmp_path.glob("work*/*/job.sh"))) == 3, 30, "3 jobs")
        with pytest.raises(PoolError) as full:
            await run_job(target, runs, QUICK)
        message = str(full.value)
        assert (
            "\n" not in message and "no machine of pool overbrainer-ssh-pool/p is free" in message
        )
        for i in range(3):
            assert f"box{i} (" in message
        assert message.count("whose job runs there") == 3
        release.touch()
        return await asyncio.gather(*jobs)

    outcomes = asyncio.run(go())
    assert all(o.record.state == RunState.SUCCEEDED and o.retrieved for o in outcomes)
    machines = [machine_of(runs, o.record) for o in outcomes]
    assert sorted(machines) == ["box0", "box1", "box2"]  # never two on one
    for outcome in outcomes:
        record = runs.load(outcome.record.id)
        i = int(machine_of(runs, record)[-1])
        assert record.remote_dir == str(work_of(tmp_path, i) / record.id)
        assert (work_of(tmp_path, i) / record.id / JOB_LOG).exists()
        assert not (work_of(tmp_path, i) / record.id / POOL_RECORD).exists()
    # the run that found the pool full was failed before a job started, holding nothing
    failed = [r for r in runs.list() if r.state != RunState.SUCCEEDED]
    assert [r.job for r in failed] == [None]
    for i in range(3):  # each machine given back once its job's files were retrieved
        assert not (work_of(tmp_path, i) / host_claim.LEASE_FILE).exists()


def test_a_machine_killed_mid_run_is_that_runs_loss_only(boxes: list[Sshd], tmp_path: Path) -> None:
    runs = Runs(tmp_path / "runs")
    target = pool(boxes[:2], tmp_path)
    release = tmp_path / "release"
    script = held_job(release)

    async def go() -> None:
        async with (
            started(target, runs, script) as (placed0, ctx0, record0),
            started(target, runs, script) as (placed1, ctx1, record1),
        ):
            assert {machine_of(runs, record0), machine_of(runs, record1)} == {"box0", "box1"}
            doomed, survivor = (record0, record1)
            box = boxes[int(machine_of(runs, doomed)[-1])]
            box.stop()  # the machine dies: its sshd, and its job
            assert doomed.job is not None
            os.killpg(doomed.job.pid, signal.SIGKILL)
            lost = asyncio.create_task(placed0.follow(ctx0, ShellTrainer(script), record0))
            kept = asyncio.create_task(placed1.follow(ctx1, ShellTrainer(script), record1))
            with pytest.raises(Unreachable):
                await lost
            release.touch()
            outcome = await kept
            assert outcome.record.state == RunState.SUCCEEDED and outcome.retrieved
            assert outcome.record.id == survivor.id
        assert runs.load(doomed.id).state == RunState.RUNNING  # attach settles it later
        # the next run skips the dead machine and lands on the free one
        outcome = await run_job(target, runs, QUICK)
        assert outcome.record.state == RunState.SUCCEEDED
        assert machine_of(runs, outcome.record) == machine_of(runs, survivor)

    asyncio.run(go())


def test_two_workers_racing_for_the_last_free_machine_one_gets_it_the_other_fails_or_waits(
    boxes: list[Sshd], tmp_path: Path
) -> None:
    runs = Runs(tmp_path / "runs")
    boxes[1].stop()  # a machine that does not answer

    async def race(waits: bool, stop: Path) -> list[Outcome | BaseException]:
        """Two workers (each its own pool target and connections) at once."""
        workers = [pool(boxes, tmp_path, wait_minutes=1 if waits else 0) for _ in range(2)]
        tasks = [asyncio.create_task(run_job(w, runs, held_job(stop))) for w in workers]
        await wait_for(lambda: (work_of(tmp_path, 2) / host_claim.LEASE_FILE).exists(), 30)
        await asyncio.sleep(1.0)  # both have looked at every machine
        stop.touch()
        return list(await asyncio.gather(*tasks, return_exceptions=True))

    async def go() -> None:
        first = pool(boxes, tmp_path)
        release = tmp_path / "release"
        async with started(first, runs, held_job(release)) as (placed, ctx, holding):
            assert machine_of(runs, holding) == "box0"
            for n in range(3):
                got = await race(False, tmp_path / f"stop{n}")
                errors = [g for g in got if isinstance(g, BaseException)]
                assert len(errors) == 1, got
                message = str(errors[0])
                assert isinstance(errors[0], PoolError) and "\n" not in message
                assert "box0 (" in message and "whose job runs there" in message
                assert "box1 (" in message and "does not answer" in message
                assert "box2 (" in message and "held by run" in message
                (won,) = [g for g in got if isinstance(g, Outcome)]
                assert won.record.state == RunState.SUCCEEDED
                assert machine_of(runs, won.record) == "box2"
            got = await race(True, tmp_path / "stop-waits")
            outcomes = [g for g in got if isinstance(g, Outcome)]
            assert len(outcomes) == 2, got  # the second waited for the first to end
            assert [machine_of(runs, o.record) for o in outcomes] == ["box2", "box2"]
            spans = sorted(
                ((d / "job.sh").stat().st_mtime_ns, (d / "job.exit").stat().st_mtime_ns)
                for d in (Path(o.record.remote_dir) for o in outcomes)
            )
            first_end, second_start = spans[0][1], spans[1][0]
            assert first_end <= second_start  # never two jobs at once on one box
            release.touch()
            outcome = await placed.follow(ctx, ShellTrainer(held_job(release)), holding)
            assert outcome.record.state == RunState.SUCCEEDED

    asyncio.run(go())


def test_a_dead_orchestrators_claim_is_taken_over_only_once_its_job_holds_nothing(
    boxes: list[Sshd], tmp_path: Path
) -> None:
    target = pool(boxes[:1], tmp_path)
    host = target.hosts[0]
    work = Path(host.workdir)
    dead = work / "20260101-000000-dead"

    async def go() -> None:
        executor = host.executor()
        job_pid = 0
        try:
            claim = host_claim.claim
            assert (await claim(executor, host.workdir, "r1", str(dead), 3600)).taken
            # placed but not started: held until its claim expires
            late = await claim(executor, host.workdir, "r2", str(work / "r2"), 3600)
            assert not late.taken and "held by run r1, placed there" in late.why
            expired = await claim(executor, host.workdir, "r2", str(work / "r2"), 0)
            assert expired.taken and "no job started within 0 s" in expired.why
            assert (await host_claim.release(executor, host.workdir, "r2")) is True
            # a job that runs holds it; once gone or ended, it is free
            assert (await claim(executor, host.workdir, "r1", str(dead), 0)).taken
            dead.mkdir(parents=True)
            (dead / "job.sh").write_text("sleep 30\n")
            started = await executor.run(
                ["sh", "-c", f"cd {dead} && setsid sh job.sh >/dev/null 2>&1 & echo $!"]
            )
            job_pid = int(started.stdout)
            await wait_for(lambda: procs.leads_group(job_pid), 10)
            busy = await claim(executor, host.workdir, "r3", str(work / "r3"), 0)
            assert not busy.taken and busy.why == "held by run r1, whose job runs there"
            os.killpg(job_pid, signal.SIGKILL)
            job_pid = 0
            await wait_for(lambda: not procs.alive(int(started.stdout)), 10)
            gone = await claim(executor, host.workdir, "r3", str(work / "r3"), 0)
            assert gone.taken and gone.why == "from run r1 (its job is gone)"
            (work / "r3").mkdir()
            (work / "r3" / "job.sh").write_text("true\n")
            (work / "r3" / "job.exit").write_text("0\n")
            ended = await claim(executor, host.workdir, "r4", str(work / "r4"), 3600)
            assert ended.taken and ended.why == "from run r3 (its job ended)"
            # a run gives back only its own claim
            assert (await host_claim.release(executor, host.workdir, "r3")) is False
            assert await host_claim.holder(executor, host.workdir) == "r4"
        finally:
            if job_pid:
                os.killpg(job_pid, signal.SIGKILL)
            await executor.close()

    asyncio.run(go())


@pytest.mark.parametrize(
    ("twice", "expected"),
    [
        ("name", "lists the machine name 'box0' twice"),
        ("port", "lists box.example:22 twice (box0 and box1): two jobs would share one box"),
    ],
)
def test_a_machine_listed_twice_is_refused_in_one_line_before_anything(
    twice: str, expected: str
) -> None:
    hosts = [
        SshPoolHost(name=f"box{i}", host="box.example", port=22 + i, work_dir="/w")
        for i in range(2)
    ]
    if twice == "name":
        hosts[1].name = "box0"
    else:
        hosts[1].port = 22
        hosts[1].host = "BOX.example"
    block = SshPool(hosts=hosts, job_venv="/v")
    with pytest.raises(SettingsError, match=re.escape(expected)) as caught:
        block.target("overbrainer-ssh-pool/p", LOG)
    assert "\n" not in str(caught.value)
    with pytest.raises(SettingsError, match="lists no machine"):
        SshPool(hosts=[], job_venv="/v").target("overbrainer-ssh-pool/p", LOG)


def test_a_job_is_cancelled_on_its_machine_from_its_record_alone_and_the_machine_freed(
    boxes: list[Sshd], tmp_path: Path
) -> None:
    runs = Runs(tmp_path / "runs")
    script = held_job(tmp_path / "never")

    async def leave() -> RunRecord:
        async with started(pool(boxes, tmp_path), runs, script) as (_, _, record):
            return record  # its follower goes: the job keeps running

    record = asyncio.run(leave())
    i = int(machine_of(runs, record)[-1])
    assert (work_of(tmp_path, i) / host_claim.LEASE_FILE).exists()
    again = pool(boxes, tmp_path)  # another process, from the record alone
    assert f"machine box{i} (" in again.detached(runs, record)

    async def cancel() -> RunRecord:
        async with again.reach(runs, runs.load(record.id)) as placed:
            assert placed is not None and f"box{i}" in placed.description
            ctx = placed.context(runs, reporters.LogReporter())
            ended, status, _ = await end_step.cancel(
                ctx, ShellTrainer(script), runs.load(record.id)
            )
            assert status.kind == "cancelled"
            outcome = retrieve.recorded(runs, ShellTrainer(script), ended)
            await placed.end(outcome)
            return ended

    assert asyncio.run(cancel()).state == RunState.CANCELLED
    assert not (work_of(tmp_path, i) / host_claim.LEASE_FILE).exists()


def test_a_training_on_a_saved_pool_skips_a_machine_that_does_not_answer_in_one_line(
    prefect_server: None,
    boxes: list[Sshd],
    tiny: tuple[Path, Path],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    name = f"pool-{uuid.uuid4().hex[:8]}"
    pool_block(boxes[:2], tmp_path).save(name)
    boxes[0].stop()
    runs_dir = tmp_path / "runs"
    with caplog.at_level(logging.WARNING):
        result = asyncio.run(
            train(target=name, training=spec(*tiny, max_steps=2), runs_dir=str(runs_dir))
        )
    assert result.state == RunState.SUCCEEDED and result.retrieved, result.message
    runs = Runs(runs_dir)
    record = runs.load(result.run_id)
    assert machine_of(runs, record) == "box1" and record.target_kind == "pool"
    assert record.remote_dir == str(work_of(tmp_path, 1) / record.id)
    skipped = [r.getMessage() for r in caplog.records if "box0 (" in r.getMessage()]
    assert len(skipped) == 1 and "skipped" in skipped[0], skipped
    assert not (work_of(tmp_path, 1) / host_claim.LEASE_FILE).exists()
    # its keys came back from the server: attach reaches the same machine
    again = asyncio.run(attach(run_id=result.run_id, runs_dir=str(runs_dir)))
    assert again.state == RunState.SUCCEEDED


def test_a_job_an_ssh_target_started_in_the_work_directory_holds_the_machine_too(
    boxes: list[Sshd], tmp_path: Path
) -> None:
    runs = Runs(tmp_path / "runs")
    box = boxes[0]
    single = SshTarget(
        host="127.0.0.1",
        port=box.port,
        user=box.user,
        private_key=box.client_key_text,
        host_key=box.host_key_line,
        work_dir=str(work_of(tmp_path, 0)),
        job_venv=str(job_venv()),
        poll_seconds=0.3,
    ).target("overbrainer-ssh-target/box0", LOG)
    release = tmp_path / "release"

    async def go() -> None:
        async with started(single, runs, held_job(release)) as (placed, ctx, record):
            with pytest.raises(PoolError, match=f"held by the job of run {record.id}, which runs"):
                await run_job(pool(boxes[:1], tmp_path), runs, QUICK)
            release.touch()
            await placed.follow(ctx, ShellTrainer(QUICK), record)
        outcome = await run_job(pool(boxes[:1], tmp_path), runs, QUICK)  # ended: free
        assert outcome.record.state == RunState.SUCCEEDED

    asyncio.run(go())


RACER = """
import asyncio, os, sys, time
from pydantic import SecretStr
from overbrainer_prefect.executors.ssh import SshExecutor
from overbrainer_prefect.targets import host_claim

port, key, host_key, work, tag, rounds = sys.argv[1:]

async def main() -> None:
    executor = SshExecutor("127.0.0.1", port=int(port), key_path=key, known_host_key=host_key,
                           user=os.environ["USER"], workdir=work, connect_timeout=5)
    inside = os.path.join(work, "inside")
    taken = 0
    deadline = time.monotonic() + 60
    while taken < int(rounds) and time.monotonic() < deadline:
        run = f"{tag}{taken}"
        got = await host_claim.claim(executor, work, run, os.path.join(work, run), 3600)
        if not got.taken:
            await asyncio.sleep(0.01)
            continue
        fd = os.open(inside, os.O_CREAT | os.O_EXCL | os.O_WRONLY)  # fails if two hold it
        os.close(fd)
        await asyncio.sleep(0.02)
        os.unlink(inside)
        assert await host_claim.release(executor, work, run)
        taken += 1
    await executor.close()
    print(f"TAKEN {taken}")

asyncio.run(main())
"""


def test_two_worker_processes_claiming_one_machine_never_hold_it_at_once(
    boxes: list[Sshd], tmp_path: Path
) -> None:
    box, work = boxes[0], work_of(tmp_path, 0)
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "USER": box.user}
    args = [str(box.port), str(box.client_key_path), box.host_key_line, str(work)]
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, *args, tag, "10"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for tag in ("a", "b")
    ]
    try:
        answers = [racer.communicate(timeout=120) for racer in racers]
    finally:
        for racer in racers:
            if racer.poll() is None:
                racer.kill()
    for (out, err), racer in zip(answers, racers, strict=True):
        assert racer.returncode == 0, err[-2000:]
        assert "TAKEN 10" in out


def nodes_need(nodes: int) -> JobNeed:
    training = TrainingSpec(datasets=["data/train.jsonl"], nodes=nodes)
    return JobNeed(what="the training", training=training)


def started_on_nodes(target: Target, runs: Runs, trainer: ShellTrainer, nodes: int) -> Any:
    """Creates, places and starts a job across `nodes`; yields (placed, ctx, record)."""
    return started_job(target, runs, trainer, nodes_need(nodes))


def test_a_training_across_two_nodes_of_the_pool_is_one_group_stopped_and_retrieved_per_node(
    boxes: list[Sshd], tmp_path: Path
) -> None:
    runs = Runs(tmp_path / "runs")
    trainer = DdpTrainer(steps=600, pause_s=0.1)  # a minute at most, stopped at step 3 or so

    async def go() -> Outcome:
        target = pool(boxes, tmp_path)
        async with started_on_nodes(target, runs, trainer, 2) as (placed, ctx, record):
            metrics = Path(record.remote_dir) / "metrics.jsonl"  # rank 0's
            watching = asyncio.create_task(placed.follow(ctx, trainer, record))
            await wait_for(
                lambda: metrics.exists() and '"step": 3' in metrics.read_text(), 60, "step 3"
            )
            await end_step.request_stop(ctx, record)
            return await watching

    outcome = asyncio.run(go())
    assert outcome.record.state == RunState.STOPPED and outcome.retrieved, outcome.record
    placement = PoolPlacement.load(runs, outcome.record.id)
    assert placement is not None and len(set(placement.nodes)) == 2
    assert len(placement.jobs) == 2
    told = []
    for rank, name in enumerate(placement.nodes):  # each node a real member of the group
        run_dir = work_of(tmp_path, int(name[-1])) / outcome.record.id
        told.append(json.loads((run_dir / f"rank-{rank}.json").read_text()))
        assert (told[rank]["rank"], told[rank]["world_size"]) == (rank, 2)
        assert told[rank]["node_rank"] == rank and told[rank]["backend"] == "gloo"
    assert told[0]["weights_sha256"] == told[1]["weights_sha256"]  # DDP made them one
    steps = [m.step for m in outcome.summary.metrics]  # rank 0's progress
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 3
    # a stop checkpoints every node: each rank's part, retrieved from its node and verified
    point = outcome.summary.checkpoint
    assert point == f"output/checkpoint-{len(steps)}"
    paths = {f.path for f in outcome.files}
    assert {f"{point}/rank-0.pt", f"nodes/1/{point}/rank-1.pt", "nodes/1/job.log"} <= paths
    assert "output/adapter_model.safetensors" in paths
    local = runs.run_dir(outcome.record.id)
    assert (local / point / "rank-0.pt").is_file()
    assert (local / "nodes" / "1" / point / "rank-1.pt").is_file()
    listed = json.loads((local / "nodes.json").read_text())  # which node each file came from
    assert [n["rank"] for n in listed["nodes"]] == [0, 1]
    for node in listed["nodes"]:
        assert placement.nodes[node["rank"]] in node["node"]
    by_path = {f["path"]: f for f in listed["files"]}
    assert set(by_path) == paths
    assert by_path[f"nodes/1/{point}/rank-1.pt"]["rank"] == 1
    assert placement.nodes[1] in by_path[f"nodes/1/{point}/rank-1.pt"]["node"]
    assert by_path[f"{point}/rank-0.pt"]["rank"] == 0
    for i in range(3):
        assert not (work_of(tmp_path, i) / host_claim.LEASE_FILE).exists()


def test_a_training_across_nodes_that_loses_a_node_goes_on_from_its_last_complete_checkpoint(
    boxes: list[Sshd], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Node 1's machine leaves the network (its sshd killed) once a checkpoint
    is kept: the run goes on from it on the free machines that answer; there,
    node 1's job is killed once a checkpoint of that run is kept: it goes on
    again (max_restarts 2), from that one, and succeeds."""
    runs = Runs(tmp_path / "runs")
    target = pool(boxes, tmp_path)  # max_restarts 2
    training = TrainingSpec(datasets=["data/train.jsonl"], nodes=2)
    recorded = training.model_dump(mode="json")
    steps = 30
    placements: list[PoolPlacement] = []

    async def lost_once_kept(
        record: RunRecord, watching: asyncio.Task[Outcome], lose: Callable[[PoolPlacement], None]
    ) -> Outcome:
        """`lose` node 1 once a checkpoint of `record` is kept; the run's end."""
        placement = PoolPlacement.load(runs, record.id)
        assert placement is not None and len(placement.jobs) == 2
        placements.append(placement)
        await wait_for(lambda: last_kept(runs, record.id) is not None, 60, "a kept checkpoint")
        lose(placement)
        outcome = await watching
        assert outcome.record.state == RunState.FAILED, outcome.record
        assert not procs.alive(placement.jobs[0].pid)  # rank 0 did not train alone
        return outcome

    def sshd_killed(placement: PoolPlacement) -> None:
        boxes[int(placement.nodes[1][-1])].stop()  # gone from the network; its job runs on

    def job_killed(placement: PoolPlacement) -> None:
        os.killpg(placement.jobs[1].pid, signal.SIGKILL)

    async def run(
        point: ResumedFrom | None, lose: Callable[[PoolPlacement], None] | None
    ) -> Finished:
        """A run of the training (from `point`): slow and losing node 1 with
        `lose`, else quick to its end with one checkpoint there."""
        pause, save = (0.5, 3) if lose is not None else (0.05, steps)  # 15 s at most: lost first
        trainer = DdpTrainer(steps, pause, save, resume_path(point) if point else None)

        def prepare(record: RunRecord) -> None:
            if point is not None:
                stage_checkpoint(runs, point, record)
                record.resumed_from = point
                runs.save(record)

        async with started_job(
            target,
            runs,
            trainer,
            JobNeed(what="the training", training=training),
            spec=recorded,
            prepare=prepare,
        ) as (placed, ctx, record):
            watching = asyncio.create_task(placed.follow(ctx, trainer, record))
            if lose is not None:
                return Finished(await lost_once_kept(record, watching, lose), placed.description)
            return Finished(await watching, placed.description)

    async def again(spec: TrainingSpec, point: Any, attempt: int, usd: float) -> Finished:
        assert point is not None and spec.nodes == 2
        return await run(point, job_killed if attempt == 1 else None)

    async def go() -> tuple[Finished, list[LostRun]]:
        finished = await run(None, sshd_killed)
        with caplog.at_level(logging.WARNING, logger="pool"):
            return await go_on_after_lost_machines(runs, target, finished, LOG, again)

    try:
        ended, lost = asyncio.run(go())
        orphan = placements[0].jobs[1].pid  # on the silent machine: it ends once its peer did
        asyncio.run(wait_for(lambda: not procs.alive(orphan), 70, "node 1's process to end"))
    finally:
        for placement in placements:
            for job in placement.jobs:
                if procs.alive(job.pid):
                    os.killpg(job.pid, signal.SIGKILL)
    first, second = placements[0], placements[1]
    gone = first.nodes[1]
    # each loss recorded by the pool, and the run went on from its last complete checkpoint
    whys = [PoolPlacement.load(runs, p.run_id) for p in (first, second)]
    assert whys[0] is not None and whys[0].lost is not None and gone in whys[0].lost
    assert whys[0].lost.startswith("node 1 (") and "does not answer" in whys[0].lost
    assert whys[1] is not None and whys[1].lost is not None
    assert "node 1 (" in whys[1].lost and "its job is gone without an exit code" in whys[1].lost
    assert [r.record.id for r in lost] == [first.run_id, second.run_id]
    said = [r.getMessage() for r in caplog.records if "goes on from" in r.getMessage()]
    assert len(said) == 2 and all("\n" not in line for line in said), said
    for n, run_lost in enumerate(lost, 1):
        kept = last_kept(runs, run_lost.record.id)
        assert kept is not None and run_lost.point is not None and run_lost.stop is None
        assert (run_lost.point.checkpoint, run_lost.point.step) == (kept.path, kept.step)
        assert {f.path for f in kept.files} >= {
            f"{kept.path}/rank-0.pt",
            f"{kept.path}/trainer_state.json",
            f"nodes/1/{kept.path}/rank-1.pt",
        }  # complete: every node's part
        on = f"{kept.path} (step {kept.step}) in a new run on new machines (restart {n} of 2)"
        assert f"goes on from {on}" in said[n - 1]
        message = runs.load(run_lost.record.id).message
        assert f"it went on from {kept.path} (step {kept.step}) in a new run" in message
    # the last run went on from the second's checkpoint, on the machines that answer
    outcome = ended.outcome
    assert outcome.record.state == RunState.SUCCEEDED and outcome.retrieved, outcome.record
    point = lost[1].point
    assert point is not None and outcome.record.resumed_from == point
    assert runs.load(second.run_id).resumed_from == lost[0].point
    last = PoolPlacement.load(runs, outcome.record.id)
    assert last is not None and last.lost is None
    answering = sorted(f"box{i}" for i in range(3) if f"box{i}" != gone)
    assert sorted(second.nodes) == answering and sorted(last.nodes) == answering
    told = []
    for rank, name in enumerate(last.nodes):
        run_dir = work_of(tmp_path, int(name[-1])) / outcome.record.id
        assert (run_dir / "resume" / f"checkpoint-{point.step}" / f"rank-{rank}.pt").is_file()
        told.append(json.loads((run_dir / f"rank-{rank}.json").read_text()))
        assert told[rank]["resumed_at"] == point.step and told[rank]["world_size"] == 2
        assert len(told[rank]["losses"]) == steps - point.step
    assert told[0]["weights_sha256"] == told[1]["weights_sha256"]
    progress = [m.step for m in outcome.summary.metrics]
    assert progress == list(range(point.step + 1, steps + 1))
    paths = {f.path for f in outcome.files}  # every node's files, each verified on its node
    end = f"output/checkpoint-{steps}"
    assert {f"{end}/rank-0.pt", f"nodes/1/{end}/rank-1.pt", "nodes/1/job.log"} <= paths
    listed = json.loads((runs.run_dir(outcome.record.id) / "nodes.json").read_text())
    assert {f["path"] for f in listed["files"]} == paths
    for i in range(3):
        if f"box{i}" != gone:  # the machines that answer are free again
            assert not (work_of(tmp_path, i) / host_claim.LEASE_FILE).exists()


def test_more_nodes_than_machines_is_refused_in_one_line_before_anything(
    boxes: list[Sshd], tmp_path: Path
) -> None:
    with pytest.raises(PoolError, match="asks for nodes=4, but pool .* has 3 machines") as caught:
        pool(boxes, tmp_path).check(nodes_need(4))
    assert "\n" not in str(caught.value)
    single = SshTarget(host="127.0.0.1", job_venv="/v", work_dir="/w").target("ssh/one", LOG)
    with pytest.raises(TrainError, match="asks for nodes=2, but ssh/one is one machine"):
        single.check(nodes_need(2))
    assert not (tmp_path / "runs").exists()


def test_a_training_across_nodes_is_cancelled_on_every_node_from_its_record_alone(
    boxes: list[Sshd], tmp_path: Path
) -> None:
    runs = Runs(tmp_path / "runs")
    trainer = DdpTrainer(steps=600, pause_s=0.1)  # a minute at most

    async def leave() -> RunRecord:
        async with started_on_nodes(pool(boxes, tmp_path), runs, trainer, 2) as (_, _, record):
            return record  # its follower goes: both nodes keep training

    record = asyncio.run(leave())
    placement = PoolPlacement.load(runs, record.id)
    assert placement is not None and len(placement.jobs) == 2
    again = pool(boxes, tmp_path)  # another process, from the records alone
    assert again.detached(runs, record).count("machine box") == 2

    async def cancel() -> RunRecord:
        async with again.reach(runs, runs.load(record.id)) as placed:
            assert placed is not None and placed.description.startswith("2 nodes: ")
            ctx = placed.context(runs, reporters.LogReporter())
            ended, status, _ = await end_step.cancel(ctx, trainer, runs.load(record.id))
            assert status.kind == "cancelled"
            await placed.end(retrieve.recorded(runs, trainer, ended))
            return ended

    assert asyncio.run(cancel()).state == RunState.CANCELLED
    for job in placement.jobs:  # every node's job cancelled, every machine given back
        assert (Path(job.dir) / "job.cancelled").exists() and not procs.alive(job.pid)
    for i in range(3):
        assert not (work_of(tmp_path, i) / host_claim.LEASE_FILE).exists()


def test_a_training_across_more_free_machines_than_there_are_holds_none_and_says_why(
    boxes: list[Sshd], tmp_path: Path
) -> None:
    runs = Runs(tmp_path / "runs")
    release = tmp_path / "release"

    async def go() -> str:
        async with started(pool(boxes, tmp_path), runs, held_job(release)) as (p, ctx, record):
            with pytest.raises(PoolError) as caught:
                async with started_on_nodes(pool(boxes, tmp_path), runs, DdpTrainer(3), 3):
                    pass
            held = machine_of(runs, record)
            for i in range(3):  # the two claimed were given back: all or none
                lease = work_of(tmp_path, i) / host_claim.LEASE_FILE
                assert lease.exists() == (f"box{i}" == held)
            release.touch()
            await p.follow(ctx, ShellTrainer(QUICK), record)
            return str(caught.value)

    message = asyncio.run(go())
    assert "\n" not in message and "has 2 of the 3 free machines" in message
    assert message.count(" is free") == 2 and "whose job runs there" in message
