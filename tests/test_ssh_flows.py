"""The run flows on an SSH target, against a real OpenSSH sshd on 127.0.0.1
(the remote is this machine, with its own work dir): a real axolotl
fine-tune, and what happens when the box goes away, a download is cut, a
host key does not match, or a file changes after its manifest."""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

from overbrainer_prefect.blocks import HuggingFaceCredentials, SshTarget
from overbrainer_prefect.executors.manifest import verify
from overbrainer_prefect.executors.ssh import SshExecutor
from overbrainer_prefect.flows import attach, train
from overbrainer_prefect.runs.manifest import load_manifest
from overbrainer_prefect.runs.store import Runs, RunState
from overbrainer_prefect.steps import follow
from overbrainer_prefect.steps import start as start_step
from overbrainer_prefect.steps.context import RunContext
from overbrainer_prefect.steps.errors import NotRetrieved, Unreachable
from tests.conftest import job_venv
from tests.shelljobs import WRITE_METRICS, ShellTrainer
from tests.sshd import Sshd
from tests.test_train_flow import spec

SECRET = "hf_" + secrets.token_hex(16)  # made at test time, never committed


@pytest.fixture
def sshd(tmp_path: Path) -> Iterator[Sshd]:
    """An sshd of the test's own, which the test may stop and start again."""
    server = Sshd.create(tmp_path / "sshd")
    with server:
        yield server


def ssh_target(sshd: Sshd, work: Path, **changes: Any) -> SshTarget:
    values: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": sshd.port,
        "user": sshd.user,
        "private_key": sshd.client_key_text,
        "host_key": sshd.host_key_line,
        "work_dir": str(work),
        "job_venv": str(job_venv()),
        "poll_seconds": 0.3,
        "cpu_threads": 1,
        "connect_timeout": 5,
    }
    values.update(changes)
    return SshTarget.model_validate(values)


def saved(block: SshTarget) -> str:
    name = f"ssh-{uuid.uuid4().hex[:8]}"
    block.save(name)
    return name


def executor(sshd: Sshd, work: Path) -> SshExecutor:
    return SshExecutor(
        "127.0.0.1",
        port=sshd.port,
        user=sshd.user,
        client_key=ssh_target(sshd, work).private_key,
        known_host_key=sshd.host_key_line,
        workdir=str(work),
        name="box",
        connect_timeout=5,
    )


def stop_when(check: Any, sshd: Sshd, timeout: float) -> threading.Thread:
    """Stops sshd (dropping its connections) as soon as `check()` holds."""

    def watch() -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if check():
                sshd.stop()
                return
            time.sleep(0.05)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_a_box_that_goes_away_leaves_the_job_running_and_attach_completes_it(
    prefect_server: None, sshd: Sshd, tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    """A real fine-tune over SSH, its box gone while it trains: the job keeps
    running, attach completes it, and its files are retrieved and verified, the
    token only ever in the job's environment."""
    remote = tmp_path / "remote"
    name = saved(ssh_target(sshd, remote, huggingface=HuggingFaceCredentials(token=SECRET)))
    runs_dir = tmp_path / "runs"

    def training() -> bool:
        return any('"log"' in p.read_text() for p in remote.glob("*/metrics.jsonl"))

    watcher = stop_when(training, sshd, 240)
    with pytest.raises(Unreachable) as caught:
        asyncio.run(train(target=name, training=spec(*tiny, max_steps=60), runs_dir=str(runs_dir)))
    watcher.join(timeout=10)
    message = str(caught.value)
    assert "keeps running" in message and "attach flow (run_id=" in message
    assert "ssh target" in message
    (record,) = Runs(runs_dir).list()
    assert record.state == RunState.RUNNING and record.job is not None
    sshd.start()
    result = asyncio.run(attach(run_id=record.id, runs_dir=str(runs_dir)))
    assert result.state == RunState.SUCCEEDED, result.message
    assert result.steps == 60
    local = Runs(runs_dir).run_dir(result.run_id)
    assert "output/adapter_model.safetensors" in {f.path for f in result.files}
    remote_dir = remote / result.run_id
    for entry in result.files:
        assert (local / entry.path).read_bytes() == (remote_dir / entry.path).read_bytes()
    record = Runs(runs_dir).load(result.run_id)
    assert record.target_kind == "ssh" and record.remote_dir == str(remote_dir)
    # the token reached the job's environment only
    for root in (runs_dir, remote):
        for path in root.rglob("*"):
            if path.is_file():
                assert SECRET.encode() not in path.read_bytes(), path

    async def artifacts() -> list[Any]:
        async with get_client() as client:
            return await client.read_artifacts(
                artifact_filter=ArtifactFilter(key=ArtifactFilterKey(like_=result.run_id))
            )

    found = asyncio.run(artifacts())
    assert found and all(SECRET not in str(a.data) for a in found)
    assert any("ssh target" in str(a.data) for a in found)


def test_a_download_cut_midway_leaves_the_run_running_and_attach_retrieves_it(
    sshd: Sshd, tmp_path: Path
) -> None:
    remote = tmp_path / "remote"
    runs = Runs(tmp_path / "runs")
    script = f"{WRITE_METRICS}; mkdir -p output && head -c 400000000 /dev/urandom > output/big.bin"

    async def go() -> None:
        ctx = RunContext(runs=runs, executor=executor(sshd, remote), python="python3", poll_s=0.2)
        trainer = ShellTrainer(script)
        record = start_step.create(
            runs, target="box", target_kind="ssh", workdir=ctx.executor.workdir
        )
        record = await start_step.start(ctx, trainer, record)
        local = runs.run_dir(record.id)

        def downloading() -> bool:
            return any(p.stat().st_size > 0 for p in local.rglob("*big.bin*") if p.is_file())

        watcher = stop_when(downloading, sshd, 120)
        with pytest.raises((NotRetrieved, Unreachable)) as caught:
            await follow.watch(ctx, trainer, record)
        watcher.join(timeout=10)
        assert sshd.pid is None, "the download finished before it could be cut"
        assert f"attach flow (run_id={record.id})" in str(caught.value)
        assert runs.load(record.id).state == RunState.RUNNING
        sshd.start()
        outcome = await follow.watch(ctx, trainer, runs.load(record.id))
        assert outcome.record.state == RunState.SUCCEEDED and outcome.retrieved
        assert (local / "output/big.bin").stat().st_size == 400_000_000
        await ctx.executor.close()

    asyncio.run(go())


def test_a_file_changed_after_its_manifest_is_never_reported_succeeded(
    sshd: Sshd, tmp_path: Path
) -> None:
    remote = tmp_path / "remote"
    runs = Runs(tmp_path / "runs")
    # the job leaves behind a stray process that keeps rewriting its output, until the
    # test asks it to stop (bounded: 6000 rewrites)
    script = (
        f"{WRITE_METRICS}; mkdir -p output; "
        "setsid sh -c 'i=0; while [ $i -lt 6000 ] && [ ! -e writer.stop ]; do "
        "echo $i > output/adapter.bin; i=$((i+1)); sleep 0.02; done' >/dev/null 2>&1 & sleep 0.3"
    )

    async def go() -> None:
        ctx = RunContext(runs=runs, executor=executor(sshd, remote), python="python3", poll_s=0.2)
        trainer = ShellTrainer(script)
        try:
            # each job's retrieval races its writer: one that falls between two writes rightly
            # verifies what it got (its files are its manifest's); one that loses stays running
            for _ in range(20):
                record = start_step.create(
                    runs, target="box", target_kind="ssh", workdir=ctx.executor.workdir
                )
                record = await start_step.start(ctx, trainer, record)
                try:
                    outcome = await follow.watch(ctx, trainer, record)
                except NotRetrieved as lost:
                    # changed between its manifest and its download, or during its download
                    why = ("differs from the target", "is not on the target", "cannot download")
                    assert any(text in str(lost) for text in why), lost
                    assert runs.load(record.id).state == RunState.RUNNING
                    return
                finally:
                    (Path(record.remote_dir) / "writer.stop").touch()  # the stray writer ends
                assert outcome.record.state == RunState.SUCCEEDED
                verify(
                    runs.run_dir(record.id),
                    ["output", "metrics.jsonl", "job.log"],
                    (),
                    load_manifest(runs, record.id),
                )
            pytest.fail("20 retrievals all fell between two writes of a file rewritten every 20 ms")
        finally:
            await ctx.executor.close()

    asyncio.run(go())


def test_a_host_whose_key_does_not_match_is_refused_before_anything_is_sent(
    prefect_server: None, sshd: Sshd, tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    other = Sshd.create(tmp_path / "other")  # its host key is not this sshd's
    remote = tmp_path / "remote"
    name = saved(ssh_target(sshd, remote, host_key=other.host_key_line))
    runs_dir = tmp_path / "runs"
    with pytest.raises(Exception, match="host key"):
        asyncio.run(train(target=name, training=spec(*tiny), runs_dir=str(runs_dir)))
    assert not runs_dir.exists()  # refused by the probe before any run exists
    assert not remote.exists()
    assert "Accepted publickey" not in sshd.log_text()


def test_a_target_without_a_pinned_host_key_is_refused_with_how_to_get_it(
    prefect_server: None, sshd: Sshd, tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    name = saved(ssh_target(sshd, tmp_path / "remote", host_key=None))
    with pytest.raises(Exception, match=f"ssh-keyscan -p {sshd.port} 127.0.0.1"):
        asyncio.run(train(target=name, training=spec(*tiny), runs_dir=str(tmp_path / "runs")))
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("change", "expected", "creates"),
    [
        ({"port": 1}, "cannot connect|unreachable|refused", False),
        ({"job_venv": "/nonexistent/venv"}, "/nonexistent/venv", False),
        ({"work_dir": "/proc/version/work"}, "work", True),
    ],
    ids=["unreachable-host", "missing-venv", "unwritable-work-dir"],
)
def test_a_target_that_cannot_run_the_job_fails_the_run_before_a_job_starts(
    prefect_server: None,
    sshd: Sshd,
    tiny: tuple[Path, Path],
    tmp_path: Path,
    change: dict[str, Any],
    expected: str,
    creates: bool,
) -> None:
    name = saved(ssh_target(sshd, tmp_path / "remote", **change))
    runs_dir = tmp_path / "runs"
    with pytest.raises(Exception, match=expected) as caught:
        asyncio.run(train(target=name, training=spec(*tiny), runs_dir=str(runs_dir)))
    assert "\n" not in str(caught.value)
    if not creates:  # the probe before anything exists refuses it
        assert not runs_dir.exists()
        return
    (record,) = Runs(runs_dir).list()  # the upload finds it out
    assert record.state == RunState.FAILED and record.job is None
    assert record.message is not None
