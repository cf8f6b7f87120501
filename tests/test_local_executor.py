"""The local executor, with real processes and real files: jobs that outlive
their spawner, statuses read from /proc, cancels of whole process groups,
secrets kept to the job's environment, tails, manifests and downloads."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import secrets as tokens
import select
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from pathlib import Path
from typing import TypeVar

import pytest
from pydantic import SecretStr

from overbrainer_prefect.executors import (
    CANCEL_FILE,
    EXIT_FILE,
    JOB_LOG,
    ExecError,
    Executor,
    JobId,
    JobSpec,
    JobStatus,
    LocalExecutor,
    verify,
)
from overbrainer_prefect.executors.jobscript import JOB_SCRIPT, parse_launch
from tests import procs
from tests.procs import alive
from tests.shelljobs import ESCAPED

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[1]
WAIT_S = 15.0  # seconds any wait in these tests may take at most (a loaded 2-core machine)


def run(awaitable: Awaitable[T]) -> T:
    async def main() -> T:
        return await awaitable

    return asyncio.run(main())


def wait_until(condition: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def finished(executor: LocalExecutor, job: JobId) -> JobStatus:
    """The status of `job` once it has ended (bounded wait)."""
    statuses: list[JobStatus] = []

    def ended() -> bool:
        statuses.append(run(executor.status(job)))
        return statuses[-1].is_finished

    wait_until(ended, "the job to end")
    return statuses[-1]


def wait_for_go(seconds: int = 15) -> str:
    """A shell snippet that waits (bounded) for the file `go` in the run directory."""
    return f"i=0; while [ ! -e go ] && [ $i -lt {seconds * 10} ]; do sleep 0.1; i=$((i+1)); done"


@pytest.fixture
def executor(tmp_path: Path) -> LocalExecutor:
    return LocalExecutor(tmp_path / "work", name="laptop")


@pytest.fixture
def jobs() -> Iterator[list[JobId]]:
    """Jobs a test started: whatever is left of them is killed by process group."""
    started: list[JobId] = []
    yield started
    for job in started:
        try:
            now = parse_launch(job.dir, Path(f"/proc/{job.pid}/stat").read_text())
        except (OSError, ValueError):
            continue
        if now.started == job.started:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(job.pid, signal.SIGKILL)


def spawn(
    executor: LocalExecutor,
    jobs: list[JobId],
    commands: list[list[str]],
    env: Mapping[str, str] | None = None,
    secrets: Mapping[str, SecretStr] | None = None,
) -> JobId:
    run_dir = Path(executor.workdir) / "r1"
    run_dir.mkdir(parents=True, exist_ok=True)
    spec = JobSpec("r1", str(run_dir), commands, env=env or {}, secrets=secrets or {})
    job = run(executor.spawn(spec))
    jobs.append(job)
    return job


def test_the_local_executor_is_an_executor_named_for_its_target(executor: LocalExecutor) -> None:
    assert isinstance(executor, Executor)
    assert executor.description == "local target 'laptop'"
    assert Path(executor.workdir).is_absolute()


def test_upload_copies_the_tree_less_the_skipped_names_and_keeps_modes(
    executor: LocalExecutor, tmp_path: Path
) -> None:
    local = tmp_path / "local"
    (local / "data" / "sub").mkdir(parents=True)
    (local / "data" / "sub" / "train.jsonl").write_text('{"q": 1}\n')
    (local / "data" / "pod.json").write_text("nested, so kept")
    (local / "run.sh").write_text("echo hi\n")
    (local / "run.sh").chmod(0o750)
    (local / ".ssh").mkdir()
    (local / ".ssh" / "id_ed25519").write_text("private key")
    (local / "pod.json").write_text("{}")
    remote = Path(executor.workdir) / "r1"

    run(executor.upload(local, str(remote), skip=[".ssh", "pod.json"]))

    assert (remote / "data" / "sub" / "train.jsonl").read_text() == '{"q": 1}\n'
    assert (remote / "data" / "pod.json").exists()
    assert (remote / "run.sh").stat().st_mode & 0o777 == 0o750
    assert not (remote / ".ssh").exists()
    assert not (remote / "pod.json").exists()


def test_upload_of_a_run_directory_onto_itself_copies_nothing(executor: LocalExecutor) -> None:
    run_dir = Path(executor.workdir) / "r1"
    run_dir.mkdir(parents=True)
    (run_dir / "pod.json").write_text("{}")
    run(executor.upload(run_dir, str(run_dir), skip=["pod.json"]))
    assert sorted(path.name for path in run_dir.iterdir()) == ["pod.json"]


def test_nothing_outside_the_work_directory_is_written(
    executor: LocalExecutor, tmp_path: Path, jobs: list[JobId]
) -> None:
    local = tmp_path / "local"
    local.mkdir()
    (local / "file").write_text("x")
    outside = tmp_path / "outside"
    outside.mkdir()
    Path(executor.workdir).mkdir()
    (Path(executor.workdir) / "link").symlink_to(outside)

    attempts: list[Awaitable[object]] = [
        executor.upload(local, str(outside)),
        executor.upload(local, str(Path(executor.workdir) / ".." / "outside")),
        executor.upload(local, str(Path(executor.workdir) / "link")),
        executor.spawn(JobSpec("r1", str(outside), [["touch", "x"]])),
        executor.spawn(JobSpec("r1", executor.workdir, [["touch", "x"]])),
        executor.touch(str(outside / "marker")),
        executor.touch("link/marker"),
        executor.cancel(JobId(dir=str(outside), pid=os.getpid(), started="1")),
    ]
    for attempt in attempts:
        with pytest.raises(ExecError, match="is not inside the work directory"):
            run(attempt)
    assert list(outside.iterdir()) == []


def test_touch_creates_a_marker_and_leaves_an_existing_file_alone(
    executor: LocalExecutor,
) -> None:
    run(executor.touch("r1/retrieved"))
    marker = Path(executor.workdir) / "r1" / "retrieved"
    assert marker.read_bytes() == b""
    marker.write_text("kept")
    run(executor.touch(str(marker)))
    assert marker.read_text() == "kept"


def test_a_job_runs_detached_and_exits_0_with_its_output_in_the_job_log(
    executor: LocalExecutor, jobs: list[JobId]
) -> None:
    job = spawn(executor, jobs, [["sh", "-c", f"echo hello; {wait_for_go()}"], ["echo", "world"]])
    run_dir = Path(job.dir)
    assert job.started is not None
    assert run(executor.status(job)) == JobStatus.running()
    assert "step echo world" in (run_dir / JOB_SCRIPT).read_text()

    (run_dir / "go").touch()
    assert finished(executor, job) == JobStatus.exited(0)
    assert (run_dir / JOB_LOG).read_text() == "hello\nworld\n"
    assert (run_dir / EXIT_FILE).read_text() == "0\n"


def test_a_follows_wait_for_a_local_job_ends_when_the_job_exits_not_at_its_poll(
    executor: LocalExecutor, jobs: list[JobId]
) -> None:
    """`wait_exit` waits its seconds while the job runs, and returns once its
    exit file appears: a follow sees a local job's end then, not a poll later."""
    job = spawn(executor, jobs, [["sh", "-c", wait_for_go()]])
    run(executor.wait_exit(job, 0.3))  # a running job: the wait runs out
    assert run(executor.status(job)) == JobStatus.running()

    async def ended_while_waiting() -> JobStatus:
        waiting = asyncio.create_task(executor.wait_exit(job, 3600.0))  # a whole poll, and more
        (Path(job.dir) / "go").touch()
        await asyncio.wait_for(waiting, WAIT_S)  # returned at the exit, not after an hour
        return await executor.status(job)

    assert run(ended_while_waiting()) == JobStatus.exited(0)


def test_the_first_failing_command_ends_the_job_with_its_exit_code(
    executor: LocalExecutor, jobs: list[JobId]
) -> None:
    job = spawn(
        executor,
        jobs,
        [["sh", "-c", "echo first; exit 3"], ["touch", "second-ran"], ["echo", "third"]],
    )
    assert finished(executor, job) == JobStatus.exited(3)
    run_dir = Path(job.dir)
    assert not (run_dir / "second-ran").exists()
    assert (run_dir / JOB_LOG).read_text() == "first\n"


def test_a_cancelled_job_loses_its_whole_process_tree_and_reads_cancelled(
    executor: LocalExecutor, jobs: list[JobId]
) -> None:
    job = spawn(executor, jobs, [["sh", "-c", ESCAPED]])
    pid_files = [Path(job.dir) / name for name in ("child.pid", "escaped.pid")]
    wait_until(lambda: all(f.exists() and f.read_text().strip() for f in pid_files), "children")
    child, escaped = (int(f.read_text()) for f in pid_files)
    assert alive(child) and alive(escaped) and os.getpgid(escaped) != job.pid
    assert run(executor.status(job)) == JobStatus.running()

    run(executor.cancel(job))

    assert run(executor.status(job)) == JobStatus.cancelled()
    assert not alive(job.pid)
    wait_until(lambda: not alive(child), "the child to be gone", timeout=2)
    wait_until(lambda: not alive(escaped), "the escaped child to be gone", timeout=2)
    assert (Path(job.dir) / CANCEL_FILE).exists()
    run(executor.cancel(job))  # a job already gone is left alone
    assert run(executor.status(job)) == JobStatus.cancelled()


def test_a_job_killed_by_someone_else_reads_lost(
    executor: LocalExecutor, jobs: list[JobId]
) -> None:
    job = spawn(executor, jobs, [["sleep", "30"]])
    assert run(executor.status(job)) == JobStatus.running()
    os.kill(job.pid, signal.SIGKILL)
    assert finished(executor, job) == JobStatus.lost()
    with contextlib.suppress(ProcessLookupError):  # none where sh had not forked it yet
        os.killpg(job.pid, signal.SIGKILL)  # its orphaned `sleep`


def test_a_pid_now_held_by_another_process_is_not_the_job(
    executor: LocalExecutor, tmp_path: Path
) -> None:
    run_dir = Path(executor.workdir) / "r1"
    run_dir.mkdir(parents=True)
    stranger = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        job = JobId(dir=str(run_dir), pid=stranger.pid, started="1")
        assert run(executor.status(job)) == JobStatus.lost()
        run(executor.cancel(job))
        assert alive(stranger.pid)
        assert not (run_dir / CANCEL_FILE).exists()
        (run_dir / EXIT_FILE).write_text("0\n")
        assert run(executor.status(job)) == JobStatus.exited(0)
    finally:
        stranger.kill()
        stranger.wait()


def test_secrets_reach_the_job_environment_only(
    executor: LocalExecutor, jobs: list[JobId], monkeypatch: pytest.MonkeyPatch
) -> None:
    token = "hf_" + tokens.token_hex(16)
    monkeypatch.setenv("RUNPOD_API_KEY", "the orchestrator's own secret")
    script = (
        'test -n "$HF_TOKEN"; echo $? > token.set; '
        "printenv HF_TOKEN | tr -d '\\n' | sha256sum | cut -d' ' -f1 > token.sha256; "
        'test -z "${RUNPOD_API_KEY-}"; echo $? > orchestrator.unset; '
        'echo "job started with MODE=$MODE"; touch ready; ' + wait_for_go()
    )
    job = spawn(
        executor,
        jobs,
        [["sh", "-c", script]],
        env={"MODE": "lora"},
        secrets={"HF_TOKEN": SecretStr(token)},
    )
    run_dir = Path(job.dir)
    wait_until(lambda: (run_dir / "ready").exists(), "the job to start")

    secret = token.encode()
    assert secret in Path(f"/proc/{job.pid}/environ").read_bytes()
    assert procs.with_argv(secret) == []  # in no process's command line
    assert os.environ.get("HF_TOKEN") != token

    (run_dir / "go").touch()
    assert finished(executor, job) == JobStatus.exited(0)
    assert (run_dir / "token.set").read_text() == "0\n"
    assert (run_dir / "token.sha256").read_text().strip() == hashlib.sha256(secret).hexdigest()
    assert (run_dir / "orchestrator.unset").read_text() == "0\n"
    assert (run_dir / JOB_LOG).read_text() == "job started with MODE=lora\n"
    for path in run_dir.iterdir():
        assert secret not in path.read_bytes(), f"the token is in {path.name}"


def test_read_from_tails_a_growing_file_from_an_offset(executor: LocalExecutor) -> None:
    path = Path(executor.workdir) / "r1" / "metrics.jsonl"
    assert run(executor.read_from(str(path), 0)) == b""  # not there yet
    path.parent.mkdir(parents=True)
    path.write_bytes(b'{"step": 1}\n{"st')  # the second line is being written

    chunk = run(executor.read_from(str(path), 0))
    assert chunk == b'{"step": 1}\n{"st'
    offset = chunk.rindex(b"\n") + 1  # a follower keeps the partial line for later
    assert run(executor.read_from(str(path), offset)) == b'{"st'
    assert run(executor.read_from(str(path), offset, limit=2)) == b'{"'
    with path.open("ab") as file:
        file.write(b'ep": 2}\n')
    assert run(executor.read_from("r1/metrics.jsonl", offset)) == b'{"step": 2}\n'
    assert run(executor.read_from(str(path), path.stat().st_size)) == b""
    assert run(executor.read_from(str(path), 10_000)) == b""
    with pytest.raises(ExecError, match="must not be negative"):
        run(executor.read_from(str(path), -1))


def test_read_from_follows_a_running_jobs_log(executor: LocalExecutor, jobs: list[JobId]) -> None:
    job = spawn(executor, jobs, [["sh", "-c", f"echo one; {wait_for_go()}; echo two"]])
    log = str(Path(job.dir) / JOB_LOG)
    wait_until(lambda: run(executor.read_from(log, 0)) == b"one\n", "the first line")
    (Path(job.dir) / "go").touch()
    assert finished(executor, job) == JobStatus.exited(0)
    assert run(executor.read_from(log, 4)) == b"two\n"


def test_the_manifest_and_download_bring_back_exactly_the_targets_files(
    executor: LocalExecutor, tmp_path: Path
) -> None:
    remote = Path(executor.workdir) / "r1"
    (remote / "output" / "checkpoint-5").mkdir(parents=True)
    (remote / "output" / "adapter.safetensors").write_bytes(os.urandom(1 << 16))
    (remote / "output" / "run.sh").write_text("#!/bin/sh\n")
    (remote / "output" / "run.sh").chmod(0o755)
    (remote / "output" / "checkpoint-5" / "optimizer.pt").write_bytes(b"big")
    (remote / JOB_LOG).write_text("done\n")
    entries, exclude = ["output", JOB_LOG, "absent"], ["checkpoint-*"]

    manifest = run(executor.manifest(str(remote), entries, exclude))
    assert [file.path for file in manifest] == [
        JOB_LOG,
        "output/adapter.safetensors",
        "output/run.sh",
    ]
    local = tmp_path / "runs" / "r1"
    run(executor.download(str(remote), local, entries, exclude))
    verify(local, entries, exclude, manifest)
    assert not (local / "output" / "checkpoint-5").exists()
    assert (local / "output" / "run.sh").stat().st_mode & 0o777 == 0o755

    run(executor.download(str(remote), remote, entries, exclude))  # its own directory: no copy
    verify(remote, entries, exclude, manifest)


def test_run_returns_a_commands_code_and_output_and_kills_it_past_its_timeout(
    executor: LocalExecutor, tmp_path: Path
) -> None:
    result = run(executor.run(["sh", "-c", "echo out; echo err >&2; exit 4"]))
    assert (result.code, result.stdout, result.stderr) == (4, "out\n", "err\n")

    pid_file = tmp_path / "child.pid"
    with pytest.raises(ExecError, match=r"did not finish within 0\.5 s"):
        run(executor.run(["sh", "-c", f"sleep 30 & echo $! > {pid_file}; wait"], timeout=0.5))
    wait_until(lambda: not alive(int(pid_file.read_text())), "the command's child to be killed")

    with pytest.raises(ExecError, match="cannot be started"):
        run(executor.run(["/nonexistent/program"]))


SPAWNER = """
import asyncio, sys, time
from overbrainer_prefect.executors import JobSpec, LocalExecutor
executor = LocalExecutor(sys.argv[1])
job = asyncio.run(executor.spawn(JobSpec("r1", sys.argv[2], [["sh", "-c", sys.argv[3]]])))
print(job.model_dump_json(), flush=True)
time.sleep(60)
"""


def test_a_job_outlives_the_process_that_spawned_it(
    executor: LocalExecutor, jobs: list[JobId]
) -> None:
    run_dir = Path(executor.workdir) / "r1"
    run_dir.mkdir(parents=True)
    script = f"{wait_for_go()}; echo survived"
    spawner = subprocess.Popen(
        [sys.executable, "-c", SPAWNER, executor.workdir, str(run_dir), script],
        stdout=subprocess.PIPE,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert spawner.stdout is not None
        ready, _, _ = select.select([spawner.stdout], [], [], WAIT_S)
        assert ready, "the spawner printed no job"
        job = JobId.model_validate_json(spawner.stdout.readline())
        jobs.append(job)
    finally:
        spawner.send_signal(signal.SIGKILL)
        spawner.wait()
        if spawner.stdout is not None:
            spawner.stdout.close()

    assert run(executor.status(job)) == JobStatus.running()
    (run_dir / "go").touch()
    assert finished(executor, job) == JobStatus.exited(0)
    assert (run_dir / JOB_LOG).read_text() == "survived\n"
