"""Checkpoints kept in the run's store as the job saves them (issue 29, item 2):
each one verified where it was put while the job still runs, recorded in the
run's `checkpoints.json`, and not copied again by the final retrieval.

- a real axolotl fine-tune (6 steps, a checkpoint every 2) through the train
  flow on the local target, into a local runs directory: the job is paused
  (SIGSTOP) at each checkpoint it saves until the follower says it kept it;
- a shell job on the local target into a real S3 store (moto's): each
  checkpoint put by the target itself, a file of two parts among them, and
  the final put leaves them out;
- a keep that fails is a warning: the run succeeds, its files retrieved.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from overbrainer_prefect.executors.base import CommandResult, ExecError, FileDigest
from overbrainer_prefect.executors.local import LocalExecutor
from overbrainer_prefect.executors.manifest import sha256_file
from overbrainer_prefect.runs.checkpoints import CHECKPOINTS_FILE, last_kept, load_kept
from overbrainer_prefect.runs.manifest import load_manifest
from overbrainer_prefect.runs.store import Runs, RunState
from overbrainer_prefect.steps import follow
from overbrainer_prefect.steps import start as start_step
from overbrainer_prefect.steps.checkpoints import keep, step_of
from overbrainer_prefect.steps.context import Outcome, RunContext
from overbrainer_prefect.steps.retrieve import retrieve
from overbrainer_prefect.store.digest import expected_checksum
from overbrainer_prefect.store.s3 import PART_ENV
from tests.s3server import S3Server
from tests.shelljobs import ShellTrainer, wait_for
from tests.test_run_lifecycle import Collected
from tests.test_train_flow import kill, spec, start_in_child, target, wait_until

__all__ = ["target"]  # the fixture, shared with test_train_flow

PART_MB = 5  # the store's part size in these tests: S3's smallest


class Noting(Collected):
    """A reporter that also keeps its notes."""

    def __init__(self) -> None:
        super().__init__()
        self.notes: list[str] = []

    def note(self, message: str) -> None:
        self.notes.append(message)


class RecordingTarget(LocalExecutor):
    """The real local target, noting the files each put of the store script was
    asked to put (its plan, on stdin)."""

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir, name="box")
        self.puts: list[list[str]] = []

    async def run(
        self, argv: Sequence[str], timeout: float = 60.0, stdin: bytes | None = None
    ) -> CommandResult:
        if len(argv) > 3 and argv[3] == "put" and stdin:
            self.puts.append([f["path"] for f in json.loads(stdin)["files"]])
        return await super().run(argv, timeout, stdin)


def saves(step: int) -> str:
    """Shell: saves `output/checkpoint-<step>/` (a 6 MiB optimizer state, two
    parts in the store, and trainer_state.json last), logs the step, then
    waits (at most 60 s) for `go-<step>`."""
    ckpt = f"output/checkpoint-{step}"
    return (
        f"mkdir -p {ckpt} && head -c {6 << 20} /dev/urandom > {ckpt}/optimizer.pt && "
        f"echo adapter-{step} > {ckpt}/adapter_model.safetensors && "
        f"echo '{{\"global_step\": {step}}}' > {ckpt}/trainer_state.json && "
        f'printf \'{{"event":"log","step":{step},"loss":1.{step}}}\\n\' >> metrics.jsonl && '
        f"i=0; while [ ! -f go-{step} ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done"
    )


SCRIPT = " && ".join(
    [
        "mkdir -p output",
        'printf \'%s\\n\' \'{"event":"begin","max_steps":4}\' >> metrics.jsonl',
        saves(2),
        saves(4),
        "echo weights > output/adapter_model.safetensors",
        'printf \'%s\\n\' \'{"event":"end","step":4}\' >> metrics.jsonl',
    ]
)


class CheckpointingShell(ShellTrainer):
    """A shell job that saves checkpoints in `output/`, like axolotl's."""

    checkpoint_dir = "output"


def kept_step(runs: Runs, record_id: str) -> int:
    """The step of the run's last kept checkpoint, -1 when none was kept."""
    last = last_kept(runs, record_id)
    return -1 if last is None else last.step


async def follow_releasing(
    ctx: RunContext, trainer: ShellTrainer, steps: list[int], inodes: dict[str, int] | None = None
) -> Outcome:
    """Starts the job and follows it; at each step of `steps`, once the run's
    store says that checkpoint is kept, checks the job still runs, notes the
    inode of each kept file in `inodes` (a local store) and lets it go on."""
    inodes = {} if inodes is None else inodes
    record = start_step.create(
        ctx.runs, target="box", target_kind="local", workdir=ctx.executor.workdir
    )
    record = await start_step.start(ctx, trainer, record)
    remote = Path(record.remote_dir)

    async def release() -> None:
        for step in steps:
            await wait_for(
                lambda step=step: kept_step(ctx.runs, record.id) == step,
                60,
                f"checkpoint-{step} to be kept",
            )
            assert not (remote / "job.exit").exists()  # kept while the job runs
            if not ctx.runs.store.direct:
                local = ctx.runs.run_dir(record.id)
                for point in load_kept(ctx.runs, record.id).checkpoints:
                    for file in point.files:
                        inodes.setdefault(file.path, (local / file.path).stat().st_ino)
            (remote / f"go-{step}").touch()

    outcome, _ = await asyncio.gather(follow.watch(ctx, trainer, record), release())
    return outcome


def test_each_checkpoint_is_put_in_the_object_store_as_it_is_saved_and_not_again_at_the_end(
    s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(PART_ENV, str(PART_MB))
    runs = Runs(s3.bucket_url())
    target = RecordingTarget(tmp_path / "target")
    reporter = Noting()
    ctx = RunContext(runs=runs, executor=target, reporter=reporter, python=sys.executable)
    ctx.poll_s = 0.1
    outcome = asyncio.run(follow_releasing(ctx, CheckpointingShell(SCRIPT), [2, 4]))
    record = outcome.record
    assert record.state == RunState.SUCCEEDED and outcome.retrieved, record.message
    kept = load_kept(runs, record.id)
    assert [(p.step, p.path) for p in kept.checkpoints] == [
        (2, "output/checkpoint-2"),
        (4, "output/checkpoint-4"),
    ]
    for point in kept.checkpoints:
        assert {Path(f.path).name for f in point.files} == {
            "optimizer.pt",
            "adapter_model.safetensors",
            "trainer_state.json",
        }
        for file in point.files:
            info = runs.store.head(runs.key(record.id, file.path))
            assert info is not None and info.size == file.size
            assert info.sha256 == expected_checksum(file.parts or [file.sha256])
            local = tmp_path / "target" / record.id / file.path
            assert sha256_file(local) == (file.size, file.sha256)  # the target's own
        big = next(f for f in point.files if f.path.endswith("optimizer.pt"))
        assert len(big.parts) == 2  # put in two parts, and its composite checked
    # a put for each checkpoint while the job ran; the final one leaves them out
    assert [sorted(p) for p in target.puts[:2]] == [
        sorted(f.path for f in point.files) for point in kept.checkpoints
    ]
    final = [path for put in target.puts[2:] for path in put]
    assert "output/adapter_model.safetensors" in final
    assert not [path for path in final if "checkpoint-" in path]
    # the final manifest lists them all the same
    assert {f.path for p in kept.checkpoints for f in p.files} <= {f.path for f in outcome.files}
    where = runs.where_of(record.id, "output/checkpoint-4")
    assert f"run {record.id}: checkpoint-4 (step 4) kept in {where}, verified" in reporter.notes


def test_a_kept_checkpoint_the_job_removes_stays_and_one_it_changes_is_copied_again(
    tmp_path: Path,
) -> None:
    """Into a local runs directory: checkpoint-2, removed by the job once kept
    (as `save_total_limit` does), stays as it was kept and the final
    retrieval still verifies; checkpoint-4, changed after it was kept, is
    copied again and verified."""
    runs = Runs(tmp_path / "runs")
    ctx = RunContext(
        runs=runs,
        executor=LocalExecutor(tmp_path / "target", name="box"),
        reporter=Noting(),
        python=sys.executable,
        poll_s=0.1,
    )
    script = SCRIPT.replace(
        "echo weights >",
        "rm -rf output/checkpoint-2 && echo changed > output/checkpoint-4/adapter_model.safetensors"
        " && echo weights >",
    )
    outcome = asyncio.run(follow_releasing(ctx, CheckpointingShell(script), [2, 4]))
    assert outcome.record.state == RunState.SUCCEEDED and outcome.retrieved
    local = runs.run_dir(outcome.record.id)
    kept = load_kept(runs, outcome.record.id)
    assert [p.step for p in kept.checkpoints] == [2, 4]
    for file in kept.checkpoints[0].files:
        assert sha256_file(local / file.path) == (file.size, file.sha256)
    listed = {f.path for f in outcome.files}
    assert not [path for path in listed if "checkpoint-2" in path]
    assert (local / "output/checkpoint-4/adapter_model.safetensors").read_text() == "changed\n"
    assert "output/checkpoint-4/adapter_model.safetensors" in listed


def test_checkpoints_of_a_job_on_an_ssh_box_are_downloaded_and_verified_as_saved(
    tmp_path: Path,
) -> None:
    """On a real sshd: each checkpoint listed, hashed on the box, downloaded
    and verified here while the job waits; the final retrieval leaves them."""
    from tests.sshd import Sshd
    from tests.test_ssh_executor import executor_for

    with Sshd.create(tmp_path / "sshd") as server:
        runs = Runs(tmp_path / "runs")
        reporter = Noting()
        inodes: dict[str, int] = {}

        async def go() -> Outcome:
            executor = executor_for(server, tmp_path / "box")
            ctx = RunContext(runs=runs, executor=executor, reporter=reporter, python=sys.executable)
            ctx.poll_s = 0.1
            try:
                return await follow_releasing(ctx, CheckpointingShell(SCRIPT), [2, 4], inodes)
            finally:
                await executor.close()

        outcome = asyncio.run(go())
    assert outcome.record.state == RunState.SUCCEEDED and outcome.retrieved
    local = runs.run_dir(outcome.record.id)
    kept = load_kept(runs, outcome.record.id)
    assert [p.step for p in kept.checkpoints] == [2, 4]
    for point in kept.checkpoints:
        for file in point.files:
            assert sha256_file(local / file.path) == (file.size, file.sha256)
    assert len(reporter.notes) == 2 and "checkpoint-2 (step 2) kept in" in reporter.notes[0]
    # the final retrieval verified them where they were: not downloaded again
    assert len(inodes) == 6
    for path, inode in inodes.items():
        assert (local / path).stat().st_ino == inode, f"{path} was downloaded again"


def test_a_checkpoint_that_cannot_be_kept_is_a_warning_and_the_run_goes_on(
    tmp_path: Path,
) -> None:
    runs = Runs(tmp_path / "runs")
    reporter = Noting()
    ctx = RunContext(
        runs=runs,
        executor=LocalExecutor(tmp_path / "target", name="box"),
        reporter=reporter,
        python=sys.executable,
        poll_s=0.1,
    )
    script = SCRIPT.replace("[ ! -f go-2 ]", "[ ! -f kept.warned ]").replace(
        "[ ! -f go-4 ]", "false"
    )

    async def go() -> Outcome:
        trainer = CheckpointingShell(script)
        record = start_step.create(
            runs, target="box", target_kind="local", workdir=ctx.executor.workdir
        )
        (runs.run_dir(record.id) / CHECKPOINTS_FILE).mkdir(parents=True)  # cannot be written
        record = await start_step.start(ctx, trainer, record)

        async def release() -> None:
            await wait_for(lambda: bool(reporter.warnings), 60, "the warning")
            (Path(record.remote_dir) / "kept.warned").touch()

        outcome, _ = await asyncio.gather(follow.watch(ctx, trainer, record), release())
        return outcome

    outcome = asyncio.run(go())
    assert outcome.record.state == RunState.SUCCEEDED and outcome.retrieved
    warning = reporter.warnings[0]
    assert "checkpoint-2 could not be kept in" in warning and "the job goes on" in warning
    assert not reporter.notes
    # the final retrieval brought both checkpoints all the same
    local = runs.run_dir(outcome.record.id)
    assert (local / "output/checkpoint-4/trainer_state.json").is_file()
    assert "output/checkpoint-2/optimizer.pt" in {f.path for f in outcome.files}


def complete_checkpoints(remote: Path) -> set[int]:
    found = set()
    for mark in remote.glob("output/checkpoint-*/trainer_state.json"):
        step = step_of(mark.parent.name)
        if step is not None:
            found.add(step)
    return found


@pytest.mark.slow
def test_a_real_fine_tune_keeps_each_checkpoint_in_its_runs_directory_while_it_trains(
    target: str, tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    """The job is paused (SIGSTOP of its process group) as soon as it has saved a
    checkpoint, and let go once the run's checkpoints.json says it was kept:
    each kept checkpoint was verified while its job ran. The final retrieval
    leaves the kept files as they were (same inode: not copied again)."""
    runs_dir = tmp_path / "runs"
    runs = Runs(runs_dir)
    training = spec(*tiny, max_steps=6, save_steps=2)
    child = start_in_child(target, training, runs_dir, tmp_path / "child.log")
    paused: list[int] = []  # the newest checkpoint saved, each time the job was paused
    handled: set[int] = set()
    kept_while_running: dict[str, int] = {}  # each kept file's inode, seen while the job ran
    try:
        wait_until(lambda: any(r.job for r in runs.list()), 240, "the job to start")
        record = next(r for r in runs.list() if r.job)
        assert record.job is not None
        remote, local = Path(record.remote_dir), runs.run_dir(record.id)
        deadline = time.monotonic() + 300
        while not (remote / "job.exit").exists() and time.monotonic() < deadline:
            saved = complete_checkpoints(remote) - handled
            if not saved:
                time.sleep(0.05)
                continue
            try:
                os.killpg(record.job.pid, signal.SIGSTOP)
            except ProcessLookupError:
                break  # the job ended as it saved its last checkpoint
            newest = max(saved)
            paused.append(newest)
            handled |= saved
            try:
                wait_until(
                    lambda newest=newest: kept_step(runs, record.id) >= newest,
                    60,
                    f"checkpoint-{newest} to be kept",
                )
                assert not (remote / "job.exit").exists()
                for point in load_kept(runs, record.id).checkpoints:
                    for file in point.files:
                        kept_while_running.setdefault(file.path, (local / file.path).stat().st_ino)
            finally:
                os.killpg(record.job.pid, signal.SIGCONT)
        assert child.wait(timeout=300) == 0, (tmp_path / "child.log").read_text()[-3000:]
    finally:
        kill(child)
    final = runs.load(record.id)
    assert final.state == RunState.SUCCEEDED, final.message
    kept = load_kept(runs, record.id)
    # every checkpoint the job was paused at was kept while it ran, each file verified
    assert len(paused) >= 2 and set(paused) <= {p.step for p in kept.checkpoints} <= {2, 4, 6}
    manifest = {f.path: f for f in load_manifest(runs, record.id)}
    for point in kept.checkpoints:
        assert point.path == f"output/checkpoint-{point.step}"
        assert any(Path(f.path).name == "trainer_state.json" for f in point.files)
        for file in point.files:
            assert file.path in kept_while_running
            assert sha256_file(local / file.path) == (file.size, file.sha256)
            assert manifest[file.path].sha256 == file.sha256  # the final retrieval's too
    # the final retrieval verified the kept files where they were: not copied again
    for path, inode in kept_while_running.items():
        assert (local / path).stat().st_ino == inode, f"{path} was copied again"


def test_a_checkpoint_kept_on_a_volume_is_linked_in_by_the_job_only_as_it_was_kept(
    tmp_path: Path,
) -> None:
    """The job's first command (the shipped `overbrainer_store.py get`) links a
    file kept on the machine's network volume into the new run directory, once
    its size and SHA-256 are the kept ones; a changed or missing file fails the
    job in one line, and nothing is linked in."""
    script = Path(start_step.__file__).parents[1] / "jobs" / "overbrainer_store.py"
    kept = tmp_path / "volume" / "overbrainer" / "old-run" / "output" / "checkpoint-5" / "a.bin"
    kept.parent.mkdir(parents=True)
    kept.write_bytes(os.urandom(3000))
    entry = {"path": "resume/checkpoint-5/a.bin", "size": 3000, "sha256": sha256_file(kept)[1]}

    def get(source: Path) -> subprocess.CompletedProcess[str]:
        plan = json.dumps({"files": [{**entry, "source": str(source)}]})
        argv = [sys.executable, str(script), "get", str(tmp_path / "new"), "--plan-env", "PLAN"]
        env = {**os.environ, "PLAN": plan}
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)

    linked = tmp_path / "new" / "resume" / "checkpoint-5" / "a.bin"
    missing = get(tmp_path / "elsewhere" / "a.bin")
    assert missing.returncode == 2 and "network volume this machine does not mount" in (
        missing.stderr
    ), missing.stderr
    done = get(kept)
    assert done.returncode == 0, done.stderr
    assert linked.stat().st_ino == kept.stat().st_ino  # a link: no second copy on the volume
    linked.unlink()
    kept.write_bytes(os.urandom(3000))  # changed since it was kept
    changed = get(kept)
    assert changed.returncode == 2 and "not the ones recorded" in changed.stderr, changed.stderr
    assert not linked.exists() and len(changed.stderr.strip().splitlines()) == 1


def saved_on_target(remote: Path, step: int, optimizer: bytes) -> str:
    """Writes a complete `output/checkpoint-<step>/` in `remote` (its optimizer
    state `optimizer`, trainer_state.json last); returns its path."""
    ckpt = remote / f"output/checkpoint-{step}"
    ckpt.mkdir(parents=True, exist_ok=True)
    (ckpt / "optimizer.pt").write_bytes(optimizer)
    (ckpt / "trainer_state.json").write_text(f'{{"global_step": {step}}}\n')
    return f"output/checkpoint-{step}"


def test_a_kept_file_of_several_parts_that_changed_since_is_not_verified_by_its_old_parts(
    s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint kept in the object store (its optimizer state in two
    parts), then changed on the target with the same size (the job saved
    again over it): the final retrieval compares the kept file with the
    manifest's SHA-256, finds it is not the target's, puts it again, and the
    store then holds the target's bytes, not the old parts."""
    monkeypatch.setenv(PART_ENV, str(PART_MB))
    runs = Runs(s3.bucket_url())
    executor = LocalExecutor(tmp_path / "target", name="box")
    record = start_step.create(runs, target="box", target_kind="local", workdir=executor.workdir)
    remote = Path(record.remote_dir)
    path = saved_on_target(remote, 2, os.urandom(6 << 20))
    point = asyncio.run(keep(executor, sys.executable, runs, record.id, record.remote_dir, path, 2))
    big = next(f for f in point.files if f.path.endswith("optimizer.pt"))
    assert len(big.parts) == 2
    saved_on_target(remote, 2, os.urandom(6 << 20))  # the same size, other bytes
    trainer = CheckpointingShell("true")
    manifest, _ = asyncio.run(
        retrieve(executor, sys.executable, trainer, runs, record.id, record.remote_dir, True)
    )
    listed = next(f for f in manifest if f.path == big.path)
    assert listed.sha256 != big.sha256 and listed.size == big.size
    back = tmp_path / "back.pt"
    runs.store.get_file(runs.key(record.id, big.path), back)
    assert sha256_file(back) == (listed.size, listed.sha256)  # the target's bytes, verified
    (point,) = load_kept(runs, record.id).checkpoints  # recorded as the store now holds it
    now = next(f for f in point.files if f.path == big.path)
    assert (now.size, now.sha256) == (listed.size, listed.sha256) and len(now.parts) == 2
    info = runs.store.head(runs.key(record.id, big.path))
    assert info is not None and info.sha256 == expected_checksum(now.parts)


class WrittenAfterListing(LocalExecutor):
    """The real local target, on which `path` is written again just after
    each manifest is taken (as a job still writing would): what is
    downloaded then is not what was listed."""

    def __init__(self, workdir: Path, path: Path) -> None:
        super().__init__(workdir, name="box")
        self.path = path

    async def manifest(self, *args: Any, **kwargs: Any) -> list[FileDigest]:
        listed = await super().manifest(*args, **kwargs)
        self.path.write_bytes(os.urandom(1000))
        return listed


def test_a_kept_checkpoint_in_a_local_store_is_replaced_only_by_a_verified_copy(
    tmp_path: Path,
) -> None:
    """A checkpoint kept in a local runs directory, then changed on the
    target: a final retrieval whose new copy does not verify fails and
    leaves the kept checkpoint as it was kept; one that verifies replaces
    it, and checkpoints.json then lists the new files."""
    runs = Runs(tmp_path / "runs")
    plain = LocalExecutor(tmp_path / "target", name="box")
    record = start_step.create(runs, target="box", target_kind="local", workdir=plain.workdir)
    remote = Path(record.remote_dir)
    path = saved_on_target(remote, 2, os.urandom(3000))
    asyncio.run(keep(plain, sys.executable, runs, record.id, record.remote_dir, path, 2))
    local = runs.run_dir(record.id)
    kept = load_kept(runs, record.id).checkpoints[0]
    saved_on_target(remote, 2, os.urandom(3000))  # saved again over it
    trainer = CheckpointingShell("true")
    racing = WrittenAfterListing(tmp_path / "target", remote / path / "optimizer.pt")
    with pytest.raises(ExecError, match="differs from the target"):
        asyncio.run(retrieve(racing, sys.executable, trainer, runs, record.id, str(remote), True))
    for file in kept.files:
        assert sha256_file(local / file.path) == (file.size, file.sha256), file.path
    assert sorted(p.name for p in local.iterdir() if p.name.startswith(".")) == []

    manifest, _ = asyncio.run(
        retrieve(plain, sys.executable, trainer, runs, record.id, str(remote), True)
    )
    listed = {f.path: f for f in manifest}
    (point,) = load_kept(runs, record.id).checkpoints
    for file in point.files:
        assert (
            sha256_file(local / file.path)
            == (file.size, file.sha256)
            == (
                listed[file.path].size,
                listed[file.path].sha256,
            )
        )
