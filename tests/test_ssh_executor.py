"""The SSH executor against a real OpenSSH sshd on 127.0.0.1 (this machine is
the remote, with its work directory under tmp_path): transfers verified by
SHA-256, detached jobs and their statuses, cancels of whole process groups,
secrets kept to the job's environment, tails, manifests hashed on the target,
a pinned host key, and what happens when the sshd goes away and comes back."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import secrets as tokens
import shutil
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import asyncssh
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
    TargetUnreachable,
    local_manifest,
    remote_manifest,
    ssh,
    verify,
)
from overbrainer_prefect.executors.jobscript import JOB_SCRIPT
from overbrainer_prefect.executors.ssh import SshExecutor
from tests import procs
from tests.procs import alive
from tests.shelljobs import ESCAPED, wait_for
from tests.sshd import SSH_KEYGEN, Sshd

T = TypeVar("T")
WAIT_S = 15.0  # seconds any wait in these tests may take at most (a loaded 2-core machine)


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sshd]:
    """One sshd for the module's tests that leave it running."""
    server = Sshd.create(tmp_path_factory.mktemp("sshd"))
    with server:
        yield server


@pytest.fixture
def own_sshd(tmp_path: Path) -> Iterator[Sshd]:
    """An sshd of the test's own, which the test may stop and start."""
    server = Sshd.create(tmp_path / "sshd")
    with server:
        yield server


def executor_for(server: Sshd, workdir: Path, **overrides: object) -> SshExecutor:
    """An executor for `server`, its host key pinned, its work directory `workdir`."""
    options: dict[str, object] = {
        "port": server.port,
        "user": server.user,
        "client_key": SecretStr(server.client_key_text),
        "known_host_key": server.host_key_line,
        "workdir": str(workdir),
        "name": "loopback",
    }
    options.update(overrides)
    return SshExecutor("127.0.0.1", **options)  # type: ignore[arg-type]


def with_executor(
    server: Sshd, workdir: Path, scenario: Callable[[SshExecutor], Awaitable[T]]
) -> T:
    """Runs `scenario` with a new executor in its own event loop, then closes it."""

    async def main() -> T:
        executor = executor_for(server, workdir)
        try:
            return await scenario(executor)
        finally:
            await executor.close()

    return asyncio.run(main())


async def finished(executor: Executor, job: JobId) -> JobStatus:
    """The job's status once it has ended (bounded by WAIT_S)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        status = await executor.status(job)
        if status.is_finished:
            return status
        await asyncio.sleep(0.1)
    raise AssertionError(f"job {job.pid} still running after {WAIT_S} s")


def shell_job(run_dir: Path, script: str, **secrets: str) -> JobSpec:
    """A job that runs `script` with `sh -c` in `run_dir`."""
    return JobSpec(
        run_id="r1",
        run_dir=str(run_dir),
        commands=[["sh", "-c", script]],
        env={"GREETING": "hello"},
        secrets={name: SecretStr(value) for name, value in secrets.items()},
    )


def test_an_upload_then_download_round_trip_is_verified_and_leaves_skipped_names_out(
    sshd: Sshd, tmp_path: Path
) -> None:
    local = tmp_path / "local"
    (local / "data" / "nested").mkdir(parents=True)
    (local / "config.yml").write_text("base_model: tiny\n")
    (local / "data" / "nested" / "weights.bin").write_bytes(os.urandom(3 << 20))
    (local / "data" / "empty.txt").write_bytes(b"")
    (local / ".ssh").mkdir()
    (local / ".ssh" / "id_ed25519").write_text("private")
    (local / "pod.json").write_text("{}")
    remote = tmp_path / "remote" / "run1"
    back = tmp_path / "back"
    back.mkdir()
    (back / "config.yml").write_text("an older copy, replaced\n")

    async def scenario(executor: SshExecutor) -> None:
        await executor.upload(local, str(remote), skip=[".ssh", "pod.json"])
        manifest = await executor.manifest(str(remote), ["."])
        assert [file.path for file in manifest] == [
            "config.yml",
            "data/empty.txt",
            "data/nested/weights.bin",
        ]
        await executor.download(str(remote), back, ["."])
        verify(back, ["."], [], manifest)
        verify(local, ["."], [".ssh", "pod.json"], manifest)

    with_executor(sshd, tmp_path / "remote", scenario)
    assert not (remote / ".ssh").exists()
    assert not (remote / "pod.json").exists()
    assert not [path for path in back.rglob("*") if path.name.endswith(".part")]
    assert (back / "data" / "nested" / "weights.bin").read_bytes() == (
        local / "data" / "nested" / "weights.bin"
    ).read_bytes()


def test_an_upload_sends_its_data_without_an_empty_ignore_packet_before_each_packet(
    sshd: Sshd, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    local = tmp_path / "local"
    local.mkdir()
    data = os.urandom(300_000)  # several SFTP writes, each several SSH packets
    (local / "weights.bin").write_bytes(data)
    remote = tmp_path / "work" / "r1"
    asyncssh.set_debug_level(3)  # every packet sent is logged
    try:
        with caplog.at_level(logging.DEBUG, logger="asyncssh"):
            with_executor(sshd, tmp_path / "work", lambda e: e.upload(local, str(remote)))
    finally:
        asyncssh.set_debug_level(1)
    sent = [r.getMessage() for r in caplog.records if "Sent MSG_" in r.getMessage()]
    opened = next(i for i, message in enumerate(sent) if "Sent MSG_CHANNEL_OPEN" in message)
    # the handshake's ignores are asyncssh's own; from the first channel on, none
    assert sum("Sent MSG_CHANNEL_DATA" in message for message in sent) >= 10, sent[:5]
    assert not [message for message in sent[opened:] if "Sent MSG_IGNORE" in message]
    assert (remote / "weights.bin").read_bytes() == data


def test_a_spawned_job_exits_0_with_its_log_and_its_env(sshd: Sshd, tmp_path: Path) -> None:
    run_dir = tmp_path / "remote" / "run1"

    async def scenario(executor: SshExecutor) -> JobStatus:
        job = await executor.spawn(shell_job(run_dir, 'echo "$GREETING from the job"'))
        assert job.dir == str(run_dir)
        return await finished(executor, job)

    assert with_executor(sshd, tmp_path / "remote", scenario) == JobStatus.exited(0)
    assert (run_dir / JOB_LOG).read_text() == "hello from the job\n"
    assert (run_dir / EXIT_FILE).read_text().strip() == "0"


def test_a_failing_job_reads_exited_with_its_code(sshd: Sshd, tmp_path: Path) -> None:
    run_dir = tmp_path / "remote" / "run1"

    async def scenario(executor: SshExecutor) -> JobStatus:
        job = await executor.spawn(shell_job(run_dir, "echo failing; exit 3"))
        return await finished(executor, job)

    assert with_executor(sshd, tmp_path / "remote", scenario) == JobStatus.exited(3)
    assert (run_dir / JOB_LOG).read_text() == "failing\n"


def test_a_command_past_its_timeout_fails_naming_it_and_the_next_command_runs(
    sshd: Sshd, tmp_path: Path
) -> None:
    async def scenario(executor: SshExecutor) -> str:
        with pytest.raises(ExecError) as raised:
            await executor.run(["sleep", "5"], timeout=0.5)
        assert not isinstance(raised.value, TargetUnreachable)
        assert "'sleep' did not finish within 0.5 s on ssh target 'loopback'" in str(raised.value)
        return (await executor.run(["echo", "next"])).stdout

    assert with_executor(sshd, tmp_path / "remote", scenario) == "next\n"


def test_a_cancelled_job_reads_cancelled_and_its_whole_process_tree_is_gone(
    sshd: Sshd, tmp_path: Path
) -> None:
    run_dir = tmp_path / "remote" / "run1"
    child_pid = run_dir / "child.pid"
    escaped_pid = run_dir / "escaped.pid"  # in a session of its own, deaf to SIGTERM

    async def scenario(executor: SshExecutor) -> tuple[JobId, JobStatus]:
        job = await executor.spawn(shell_job(run_dir, ESCAPED))
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline and not all(
            f.exists() and f.read_text().strip() for f in (child_pid, escaped_pid)
        ):
            await asyncio.sleep(0.05)
        assert os.getpgid(int(escaped_pid.read_text())) != job.pid
        assert await executor.status(job) == JobStatus.running()
        await executor.cancel(job)
        return job, await executor.status(job)

    job, status = with_executor(sshd, tmp_path / "remote", scenario)
    assert status == JobStatus.cancelled()
    assert (run_dir / CANCEL_FILE).exists()
    assert not (run_dir / EXIT_FILE).exists()
    assert not alive(job.pid)
    assert not alive(int(child_pid.read_text()))
    assert not alive(int(escaped_pid.read_text()))


def test_a_lost_jobs_cancel_kills_what_it_left_running_and_it_still_reads_lost(
    sshd: Sshd, tmp_path: Path
) -> None:
    """The job's group is killed by someone else; its child in a session of
    its own (a torchrun worker) runs on in its run directory and holds the
    machine. A cancel kills it, writes no cancel marker, and leaves alone a
    process of the same user working elsewhere."""
    run_dir = tmp_path / "remote" / "run1"
    escaped_pid = run_dir / "escaped.pid"
    elsewhere = subprocess.Popen(["sleep", "60"], cwd=tmp_path, start_new_session=True)

    async def scenario(executor: SshExecutor) -> tuple[JobStatus, int]:
        job = await executor.spawn(shell_job(run_dir, ESCAPED))
        wrote = lambda: escaped_pid.exists() and escaped_pid.read_text().strip() != ""  # noqa: E731
        await wait_for(wrote, WAIT_S, "the escaped child's PID")
        escaped = int(escaped_pid.read_text())
        os.killpg(job.pid, signal.SIGKILL)
        await wait_for(lambda: not alive(job.pid), WAIT_S, "the job's own process to end")
        assert await executor.status(job) == JobStatus.lost() and alive(escaped)
        await executor.cancel(job)
        return await executor.status(job), escaped

    try:
        status, escaped = with_executor(sshd, tmp_path / "remote", scenario)
        assert status == JobStatus.lost()
        assert not (run_dir / CANCEL_FILE).exists()
        assert not alive(escaped)
        assert alive(elsewhere.pid)
    finally:
        elsewhere.kill()
        elsewhere.wait()


def test_secrets_reach_the_job_and_appear_in_no_file_log_or_process_argument(
    sshd: Sshd, tmp_path: Path
) -> None:
    token = "hf_" + tokens.token_hex(16)
    marker = tokens.token_hex(8)
    odd = f' it\'s "{marker}" $HOME `x` \\\n\n'  # quotes, $, newlines: all kept
    run_dir = tmp_path / "remote" / "run1"
    # The job checks each secret against its SHA-256, so that no secret is in
    # the job's own arguments either (the `x` keeps trailing newlines).
    script = "".join(
        f'[ "$(printf %sx "${name}" | sha256sum | cut -c1-64)" = '
        f"{hashlib.sha256((value + 'x').encode()).hexdigest()} ] || exit 1; "
        for name, value in (("HF_TOKEN", token), ("ODD_SECRET", odd))
    )
    script += "echo secrets seen; sleep 2"
    seen_in_argv: list[int] = []

    async def scenario(executor: SshExecutor) -> JobStatus:
        job = await executor.spawn(shell_job(run_dir, script, HF_TOKEN=token, ODD_SECRET=odd))
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:  # the job runs for 2 s: look at every process
            for secret in (token, marker):
                seen_in_argv.extend(procs.with_argv(secret.encode()))
            await asyncio.sleep(0.1)
        assert await executor.status(job) == JobStatus.running()
        return await finished(executor, job)

    status = with_executor(sshd, tmp_path / "remote", scenario)
    assert status == JobStatus.exited(0)
    assert (run_dir / JOB_LOG).read_text() == "secrets seen\n"
    assert seen_in_argv == []
    assert (run_dir / JOB_SCRIPT).is_file()
    for path in [*tmp_path.rglob("*"), sshd.log_path]:  # job.sh, job.log among them
        if path.is_file():
            for secret in (token, marker):
                assert secret.encode() not in path.read_bytes(), path


def test_read_from_returns_the_bytes_after_an_offset_and_nothing_for_a_missing_file(
    sshd: Sshd, tmp_path: Path
) -> None:
    remote = tmp_path / "remote"
    remote.mkdir()
    data = os.urandom(3 << 20)
    (remote / "metrics.jsonl").write_bytes(data)

    async def scenario(executor: SshExecutor) -> None:
        path = str(remote / "metrics.jsonl")
        assert await executor.read_from(path, 0, 10) == data[:10]
        assert await executor.read_from(path, 1000, 5000) == data[1000:6000]
        assert await executor.read_from(path, (3 << 20) - 7) == data[-7:]
        assert await executor.read_from(path, 2 << 20) == data[2 << 20 : 3 << 20]
        assert await executor.read_from(path, 3 << 20) == b""
        assert await executor.read_from(str(remote / "not-yet.jsonl"), 0) == b""
        with pytest.raises(ExecError, match="must not be negative"):
            await executor.read_from(path, -1)

    with_executor(sshd, remote, scenario)


def test_the_remote_manifest_equals_the_local_one_and_honours_excludes(
    sshd: Sshd, tmp_path: Path
) -> None:
    run = tmp_path / "remote" / "run1"
    (run / "output" / "checkpoint-10").mkdir(parents=True)
    (run / "output" / "adapter.safetensors").write_bytes(os.urandom(70_000))
    (run / "output" / "checkpoint-10" / "optimizer.pt").write_bytes(b"big")
    (run / "output" / "odd name\nwith newline.txt").write_text("odd")
    (run / "output" / "-dash.txt").write_text("dash")
    (run / "output" / "scratch.tmp").write_text("tmp")
    (run / "output" / "link-inside").symlink_to("adapter.safetensors")
    (run / "output" / "link-outside").symlink_to(tmp_path / "outside.txt")
    (tmp_path / "outside.txt").write_text("not the run's")
    (run / JOB_LOG).write_text("log\n")
    (run / "ignored.txt").write_text("not an entry")
    entries = ["output", JOB_LOG, "missing-entry"]
    exclude = ["checkpoint-*", "*.tmp"]

    async def scenario(executor: SshExecutor) -> None:
        remote = await executor.manifest(str(run), entries, exclude)
        assert remote == local_manifest(run, entries, exclude)
        assert [file.path for file in remote] == [
            JOB_LOG,
            "output/-dash.txt",
            "output/adapter.safetensors",
            "output/link-inside",
            "output/odd name\nwith newline.txt",
        ]
        assert await executor.manifest(str(run), ["missing-entry"]) == []
        with pytest.raises(ExecError, match="inside the run directory"):
            await executor.manifest(str(run), ["../outside.txt"])
        with pytest.raises(ExecError, match="does not exist"):
            await executor.manifest(str(tmp_path / "remote" / "nope"), ["."])

    with_executor(sshd, tmp_path / "remote", scenario)


def test_a_host_showing_another_key_is_refused_before_anything_is_sent(
    sshd: Sshd, tmp_path: Path
) -> None:
    impostor = tmp_path / "impostor"
    subprocess.run(
        [SSH_KEYGEN, "-q", "-t", "ed25519", "-N", "", "-f", str(impostor)],
        check=True,
        capture_output=True,
    )
    pinned = impostor.with_suffix(".pub").read_text()
    marker = tmp_path / "remote" / "marker"
    log_before = len(sshd.log_text())

    async def scenario() -> None:
        executor = executor_for(sshd, tmp_path / "remote", known_host_key=pinned)
        with pytest.raises(ExecError) as caught:
            await executor.touch(str(marker))
        assert not isinstance(caught.value, TargetUnreachable)
        assert "does not match the pinned one" in str(caught.value)
        assert f"ssh-keyscan -p {sshd.port} 127.0.0.1" in str(caught.value)

    asyncio.run(scenario())
    assert not marker.exists()
    log = wait_for_log(sshd, log_before, "[preauth]")
    for attempt in ("publickey", "Accepted", "Failed", "Postponed", "Starting session"):
        assert attempt not in log


def wait_for_log(server: Sshd, offset: int, text: str) -> str:
    """The sshd log after `offset` once it holds `text` (bounded by WAIT_S)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        log = server.log_text()[offset:]
        if text in log:
            return log
        time.sleep(0.05)
    raise AssertionError(f"the sshd log never showed {text!r}: {server.log_text()[offset:]}")


def test_an_executor_without_a_pinned_host_key_refuses_with_the_keyscan_command(
    sshd: Sshd, tmp_path: Path
) -> None:
    for missing in (None, "", "# nothing here\n"):
        with pytest.raises(ExecError) as caught:
            executor_for(sshd, tmp_path, known_host_key=missing)
        message = str(caught.value)
        assert "\n" not in message
        assert "no host key is pinned" in message
        assert f"ssh-keyscan -p {sshd.port} 127.0.0.1" in message
    with pytest.raises(ExecError, match="not a public key line"):
        executor_for(sshd, tmp_path, known_host_key="ssh-ed25519 not-base64")
    keyscan_line = f"[127.0.0.1]:{sshd.port} {sshd.host_key_line}"
    assert executor_for(sshd, tmp_path, known_host_key=keyscan_line).workdir == str(tmp_path)


def test_a_stopped_sshd_is_unreachable_and_once_restarted_the_same_executor_works_again(
    own_sshd: Sshd, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    remote = tmp_path / "remote"
    key_text = own_sshd.client_key_text

    async def scenario(executor: SshExecutor) -> None:
        assert (await executor.run(["echo", "up"])).stdout == "up\n"
        own_sshd.stop()
        for call in (
            lambda: executor.touch(str(remote / "a")),
            lambda: executor.run(["true"]),
            lambda: executor.read_from(str(remote / "a"), 0),
        ):
            with pytest.raises(TargetUnreachable) as caught:
                await call()
            assert f"127.0.0.1:{own_sshd.port}" in str(caught.value)
            assert key_text not in str(caught.value)
        own_sshd.start()
        await executor.touch(str(remote / "b"))
        own_sshd.restart()  # the connection is lost while nothing uses it
        await executor.touch(str(remote / "c"))
        assert (await executor.run(["echo", "again"])).stdout == "again\n"
        # an SFTP server that never answers, on a host whose keepalives and commands do
        stuck = own_sshd.config_path.read_text().replace(
            "Subsystem sftp internal-sftp", "Subsystem sftp cat > /dev/null"
        )
        own_sshd.config_path.write_text(stuck)
        own_sshd.restart()
        started = time.monotonic()
        with pytest.raises(TargetUnreachable, match="did not answer within 2 s"):
            await executor.read_from(str(remote / "b"), 0)
        assert time.monotonic() - started < WAIT_S
        assert (await executor.run(["echo", "still"])).stdout == "still\n"

    monkeypatch.setattr(ssh, "SFTP_ANSWER_S", 2.0)
    with_executor(own_sshd, remote, scenario)
    assert not (remote / "a").exists()
    assert (remote / "b").exists()
    assert (remote / "c").exists()


def test_a_job_keeps_running_after_its_connection_is_closed(own_sshd: Sshd, tmp_path: Path) -> None:
    run_dir = tmp_path / "remote" / "run1"

    async def spawn(executor: SshExecutor) -> JobId:
        return await executor.spawn(shell_job(run_dir, "sleep 1; echo done"))

    job = with_executor(own_sshd, tmp_path / "remote", spawn)
    own_sshd.restart()  # no session of the spawn's connection is left
    assert alive(job.pid)

    async def follow(executor: SshExecutor) -> JobStatus:
        return await finished(executor, job)

    assert with_executor(own_sshd, tmp_path / "remote", follow) == JobStatus.exited(0)
    assert (run_dir / JOB_LOG).read_text() == "done\n"


def test_writes_outside_the_work_directory_and_a_bad_client_key_are_refused(
    sshd: Sshd, tmp_path: Path
) -> None:
    with pytest.raises(ExecError, match="must be absolute"):
        executor_for(sshd, Path("relative/dir"))
    with pytest.raises(ExecError, match="not an unencrypted OpenSSH or PEM private key") as bad:
        executor_for(sshd, tmp_path, client_key=SecretStr("-----BEGIN nonsense-----"))
    assert "nonsense" not in str(bad.value)

    async def scenario(executor: SshExecutor) -> None:
        for outside in (str(tmp_path / "elsewhere"), "../escape", str(tmp_path / "remote")):
            with pytest.raises(ExecError, match="not inside the work directory"):
                await executor.touch(outside)
        with pytest.raises(ExecError, match="not inside the work directory"):
            await executor.upload(tmp_path, str(tmp_path / "elsewhere"))
        await executor.touch("relative/marker")

    with_executor(sshd, tmp_path / "remote", scenario)
    assert (tmp_path / "remote" / "relative" / "marker").is_file()
    assert not (tmp_path / "escape").exists()
    assert not (tmp_path / "elsewhere").exists()


def test_the_target_hashes_the_same_without_python(tmp_path: Path) -> None:
    bare = tmp_path / "bin"  # a PATH with the fallback's tools and no python3
    bare.mkdir()
    for tool in ("xargs", "sha256sum"):
        found = shutil.which(tool)
        assert found is not None
        (bare / tool).symlink_to(found)
    (tmp_path / "a b.bin").write_bytes(os.urandom(100_000))
    (tmp_path / "c").write_text("c")
    names = ["a b.bin", "c"]
    outputs = [
        subprocess.run(
            ["/bin/sh", "-c", remote_manifest.hash_command(str(tmp_path))],
            input=remote_manifest.hash_input(names),
            capture_output=True,
            check=True,
            env={"PATH": path},
        ).stdout
        for path in (str(bare), os.environ["PATH"])
    ]
    expected = {name: hashlib.sha256((tmp_path / name).read_bytes()).hexdigest() for name in names}
    assert [remote_manifest.parse_hashes(output) for output in outputs] == [expected, expected]


def test_concurrent_calls_share_one_connection(sshd: Sshd, tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    remote.mkdir()
    (remote / "log").write_text("line\n")
    log_before = len(sshd.log_text())

    async def scenario(executor: SshExecutor) -> list[object]:
        calls: list[Awaitable[object]] = [
            executor.read_from(str(remote / "log"), 0) for _ in range(8)
        ]
        calls += [executor.run(["echo", str(n)]) for n in range(8)]
        return await asyncio.gather(*calls)

    results = with_executor(sshd, remote, scenario)
    assert results[:8] == [b"line\n"] * 8
    assert sshd.log_text()[log_before:].count("Accepted publickey") == 1
