"""The store, one contract over a local directory and a real S3 server (moto's,
on 127.0.0.1): compare-and-swap records, no lost update under real races,
locks held by one live holder (a killed holder's lease expires and another
takes it), files put by signed URLs and checked by the store, and a store that
cannot be used refused at once, in one line."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from overbrainer_prefect.executors.base import CommandResult, ExecError
from overbrainer_prefect.executors.local import LocalExecutor
from overbrainer_prefect.runs.store import Runs, RunState
from overbrainer_prefect.steps import start as start_step
from overbrainer_prefect.steps.context import RunContext
from overbrainer_prefect.steps.direct import REACH_ENV, put_files, script_argv
from overbrainer_prefect.store import (
    AlreadyExists,
    Busy,
    Changed,
    LocalStore,
    S3Store,
    Store,
    StoreRefused,
    StoreUnreachable,
    open_store,
    update,
)
from overbrainer_prefect.store.base import join
from overbrainer_prefect.store.check import check_s3
from overbrainer_prefect.store.digest import expected_checksum
from overbrainer_prefect.store.lease import TTL_ENV
from overbrainer_prefect.store.s3 import OUTAGE_ENV, PART_ENV, READ_TIMEOUT_ENV, SIGN_MARGIN_ENV
from tests.ports import free_port
from tests.s3server import S3Server
from tests.shelljobs import ShellTrainer


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    if request.param == "local":
        yield LocalStore(tmp_path / "runs")
    else:
        s3: S3Server = request.getfixturevalue("s3")
        yield open_store(s3.bucket_url())


def test_a_record_is_created_once_and_replaced_only_on_the_version_read(store: Store) -> None:
    etag = store.create("r1/run.json", b"one")
    with pytest.raises(AlreadyExists):
        store.create("r1/run.json", b"two")
    read = store.read("r1/run.json")
    assert read is not None and read.data == b"one" and read.etag == etag
    new = store.replace("r1/run.json", b"three", etag)
    with pytest.raises(Changed):
        store.replace("r1/run.json", b"stale", etag)
    assert store.read("r1/run.json") == type(read)(b"three", new)
    assert store.read("r1/none.json") is None
    with pytest.raises(Changed):
        store.replace("r1/none.json", b"x", etag)


def test_racing_updates_lose_nothing(store: Store) -> None:
    """Four writers each add ten to one counter at once: every addition counts."""

    def add_ten() -> None:
        for _ in range(10):
            update(store, "counter", lambda data: str(int(data or b"0") + 1).encode())

    writers = [threading.Thread(target=add_ten) for _ in range(4)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(60)
    read = store.read("counter")
    assert read is not None and read.data == b"40"


def test_listing_files_and_deleting(store: Store, tmp_path: Path) -> None:
    store.write("r1/run.json", b"{}")
    store.write("r1/output/adapter.bin", b"x" * 10)
    store.write("r2/run.json", b"{}")
    assert store.names("") == ["r1", "r2"]
    assert store.names("r1") == ["output", "run.json"]
    assert [(o.key, o.size) for o in store.objects("r1")] == [
        ("r1/output/adapter.bin", 10),
        ("r1/run.json", 2),
    ]
    info = store.head("r1/output/adapter.bin")
    assert info is not None and info.size == 10
    source = tmp_path / "model.gguf"
    source.write_bytes(b"gguf" * 1000)
    store.put_file(source, "r2/gguf/model.gguf")
    store.get_file("r2/gguf/model.gguf", tmp_path / "back" / "model.gguf")
    assert (tmp_path / "back" / "model.gguf").read_bytes() == source.read_bytes()
    with pytest.raises(FileNotFoundError):
        store.get_file("r2/gguf/none.gguf", tmp_path / "none")
    store.delete("r1")
    assert store.names("") == ["r2"]
    for bad in ("/etc/passwd", "../x", "a/../../b", ""):
        with pytest.raises(ValueError):
            store.read(bad)


def test_a_lock_has_one_live_holder(store: Store) -> None:
    with store.lock("r1/.follow.lock", {"flow_run_id": "f1", "since": "now"}):
        assert "flow run f1" in (store.holder("r1/.follow.lock") or "")
        with pytest.raises(Busy) as busy, store.lock("r1/.follow.lock", {"flow_run_id": "f2"}):
            pass
        assert "flow run f1" in busy.value.holder
    assert store.holder("r1/.follow.lock") is None
    with store.lock("r1/.follow.lock", {"flow_run_id": "f3"}):
        assert "flow run f3" in (store.holder("r1/.follow.lock") or "")


HOLD = """
import sys, time
from overbrainer_prefect.store import open_store
store = open_store(sys.argv[1])
with store.lock("r1/.follow.lock", {"flow_run_id": "killed"}):
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_killed_holders_lease_expires_and_another_takes_it(
    s3: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A holder SIGKILLed while it holds the follow lease: nobody can take it
    while it is live; within its TTL (3 s here) it expires, and another
    process takes it."""
    url = s3.bucket_url()
    env = {**os.environ, TTL_ENV: "3"}
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, url], stdout=subprocess.PIPE, env=env, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        store = open_store(url)
        time.sleep(3.5)  # renewed while it lives: past one TTL, still held
        with pytest.raises(Busy) as busy, store.lock("r1/.follow.lock", {"flow_run_id": "b"}):
            pass
        assert "flow run killed" in busy.value.holder
        os.kill(holder.pid, signal.SIGKILL)
        killed = time.monotonic()
        holder.wait(10)
        deadline = killed + 3 + 2
        while True:
            try:
                with store.lock("r1/.follow.lock", {"flow_run_id": "taker"}):
                    taken = time.monotonic() - killed
                    assert "flow run taker" in (store.holder("r1/.follow.lock") or "")
                break
            except Busy:
                assert time.monotonic() < deadline, "the dead holder's lease did not expire"
                time.sleep(0.2)
        assert taken <= 3 + 2
    finally:
        holder.kill()
        holder.wait(10)


def test_a_target_puts_a_file_in_parts_by_signed_urls_and_the_store_checks_each(
    s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file of 11 MiB in parts of 5 MiB: three signed part puts, completed;
    the store's SHA-256 is the parts' composite. A part whose bytes are not the
    ones hashed leaves a checksum that is not the expected one."""
    monkeypatch.setenv(PART_ENV, "5")
    store = open_store(s3.bucket_url())
    assert isinstance(store, S3Store)
    data = os.urandom(11 << 20)
    parts = [data[i : i + (5 << 20)] for i in range(0, len(data), 5 << 20)]
    digests = [hashlib.sha256(part).hexdigest() for part in parts]
    signed = store.sign_put("r1/gguf/model.gguf", len(data), digests)
    assert len(signed.parts) == 3 and signed.upload_id
    etags = []
    with httpx.Client() as http:
        for part in signed.parts:
            body = data[part.offset : part.offset + part.length]
            answer = http.put(part.url, content=body, headers=dict(part.headers))
            assert answer.status_code == 200
            etags.append(answer.headers["etag"])
    store.complete(signed, etags, digests)
    info = store.head("r1/gguf/model.gguf")
    assert info is not None and info.size == len(data)
    assert info.sha256 == expected_checksum(digests)

    one = b"the adapter"
    signed = store.sign_put("r1/output/adapter.bin", len(one), [hashlib.sha256(one).hexdigest()])
    part = signed.parts[0]
    answer = httpx.put(part.url, content=b"not the adapter", headers=dict(part.headers))
    info = store.head("r1/output/adapter.bin")
    # a store that checks refuses the put; one that computes reports another SHA-256
    assert answer.status_code != 200 or (
        info is not None and info.sha256 != hashlib.sha256(one).hexdigest()
    )
    got = httpx.get(store.sign_get("r1/gguf/model.gguf"))
    assert got.status_code == 200 and got.content == data


def test_a_store_that_cannot_be_used_is_refused_in_one_line(
    s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(OUTAGE_ENV, "1")
    nobody = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(StoreUnreachable) as unreachable:
        check_s3(_s3(f"s3://runs-x/p?endpoint_url={nobody}"))
    assert "did not answer" in str(unreachable.value) and "\n" not in str(unreachable.value)

    with pytest.raises(StoreRefused) as missing:
        check_s3(_s3(f"s3://no-such-bucket/p?endpoint_url={s3.endpoint}"))
    assert "no such bucket" in str(missing.value)

    with pytest.raises(StoreRefused) as scheme:
        open_store("gs://bucket/p")
    assert "s3://bucket/prefix" in str(scheme.value)

    with S3Server.start(tmp_path / "auth.log", auth=True) as guarded:
        key_id, secret = guarded.keys
        guarded.client().create_bucket(Bucket="runs-guarded")
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-" + secret)
        with pytest.raises(StoreRefused) as wrong:
            check_s3(_s3(f"s3://runs-guarded/p?endpoint_url={guarded.endpoint}"))
        assert "check the credentials" in str(wrong.value)
        assert secret not in str(wrong.value) and "\n" not in str(wrong.value)


def _s3(url: str) -> S3Store:
    store = open_store(url)
    assert isinstance(store, S3Store)
    return store


def test_a_store_that_stops_answering_loses_no_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store freezes (SIGSTOP) for 6 s while a record is created and a
    counter changed: each request times out (2 s), is tried again with
    backoff, and goes through once the store answers; a create whose first
    try the store took late is known for this write's own (its token), not
    reported as a race it lost. Nothing is lost, nothing written twice."""
    monkeypatch.setenv(OUTAGE_ENV, "60")
    monkeypatch.setenv(READ_TIMEOUT_ENV, "2")
    with S3Server.start(tmp_path / "moto.log") as frozen:
        store = open_store(frozen.bucket_url())
        store.create("r1/run.json", b"before")
        results: list[object] = []

        def writes() -> None:
            try:
                results.append(store.create("r2/run.json", b"created in the outage"))
                results.append(
                    update(store, "counter", lambda data: str(int(data or b"0") + 1).encode())
                )
            except BaseException as error:  # reported below
                results.append(error)

        os.kill(frozen.process.pid, signal.SIGSTOP)
        try:
            writer = threading.Thread(target=writes)
            writer.start()
            time.sleep(6)
        finally:
            os.kill(frozen.process.pid, signal.SIGCONT)
        writer.join(60)
        assert len(results) == 2 and not isinstance(results[0], BaseException), results
        assert results[1] == b"1"
        assert store.read("r2/run.json").data == b"created in the outage"  # type: ignore[union-attr]
        assert store.read("counter").data == b"1"  # type: ignore[union-attr]
        assert store.read("r1/run.json").data == b"before"  # type: ignore[union-attr]


def test_the_target_puts_a_file_of_many_parts_over_several_connections_reading_it_once(
    s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The job script's `put` of a file of more parts than it has senders: the
    store holds it whole, each part's SHA-256 and the file's are those of the
    bytes on disk. A store that does not answer fails it after the plan's
    deadline, in a last line naming the file and part, never its URL."""
    monkeypatch.setenv(PART_ENV, "5")
    store = _s3(s3.bucket_url())
    data = os.urandom((4 * 5 + 3) << 20)  # five parts of at most 5 MiB
    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf" / "model.gguf").write_bytes(data)
    chunks = [data[i : i + (5 << 20)] for i in range(0, len(data), 5 << 20)]
    digests = [hashlib.sha256(chunk).hexdigest() for chunk in chunks]
    signed = store.sign_put(
        "r1/gguf/model.gguf", len(data), digests if store.signs_digests() else None
    )
    assert len(signed.parts) == 5

    def plan(urls: list[str], deadline_s: float) -> bytes:
        parts = [
            {"url": url, "headers": dict(p.headers), "offset": p.offset, "length": p.length}
            for url, p in zip(urls, signed.parts, strict=True)
        ]
        files = [{"path": "gguf/model.gguf", "parts": parts}]
        return json.dumps({"deadline_s": deadline_s, "files": files}).encode()

    argv = script_argv(sys.executable, "put", str(tmp_path))
    done = subprocess.run(
        argv, input=plan([p.url for p in signed.parts], 120), capture_output=True, timeout=180
    )
    assert done.returncode == 0, done.stderr.decode()
    sent = json.loads(done.stdout)["gguf/model.gguf"]
    assert sent["sha256"] == hashlib.sha256(data).hexdigest() and sent["parts"] == digests
    store.complete(signed, sent["etags"], sent["parts"])
    info = store.head("r1/gguf/model.gguf")
    assert info is not None and info.size == len(data)
    assert info.sha256 == expected_checksum(digests)

    nobody = f"http://127.0.0.1:{free_port()}/runs/r1/gguf/model.gguf?X-Amz-Signature=s3cr3t"
    failed = subprocess.run(argv, input=plan([nobody] * 5, 3), capture_output=True, timeout=120)
    said = failed.stderr.decode()
    last = said.strip().splitlines()[-1]
    assert failed.returncode == 2 and "gguf/model.gguf (part" in last, said
    assert "did not answer in time" in last
    assert "s3cr3t" not in said and "127.0.0.1" not in said


def _uploads(s3: S3Server, bucket: str) -> list[str]:
    """The keys of the multipart uploads begun and neither completed nor aborted."""
    answer = s3.client().list_multipart_uploads(Bucket=bucket)
    return [upload["Key"] for upload in answer.get("Uploads", [])]


def test_a_put_in_parts_that_fails_is_aborted_and_leaves_no_part_billing(
    s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file of three parts changed on the target after it was listed: its
    put is refused (what was sent is not what was listed) and its upload
    aborted, so none of its parts stays in the bucket; an upload a dead
    process began for the same file is aborted when it is put again."""
    monkeypatch.setenv(PART_ENV, "5")
    bucket = s3.bucket()
    runs = Runs(s3.bucket_url(bucket=bucket))
    executor = LocalExecutor(tmp_path / "target", name="box")
    remote = tmp_path / "target" / "r1"
    (remote / "gguf").mkdir(parents=True)
    (remote / "gguf" / "model.gguf").write_bytes(os.urandom(11 << 20))
    manifest = asyncio.run(executor.manifest(str(remote), ["gguf"]))
    (remote / "gguf" / "model.gguf").write_bytes(os.urandom(11 << 20))  # changed since
    with pytest.raises(ExecError, match="changed on the target after it was listed"):
        asyncio.run(put_files(executor, sys.executable, runs, "r1", str(remote), manifest))
    assert _uploads(s3, bucket) == []

    key = runs.store.full(runs.key("r1", "gguf/model.gguf"))  # type: ignore[attr-defined]
    s3.client().create_multipart_upload(Bucket=bucket, Key=key, ChecksumAlgorithm="SHA256")
    manifest = asyncio.run(executor.manifest(str(remote), ["gguf"]))
    asyncio.run(put_files(executor, sys.executable, runs, "r1", str(remote), manifest))
    assert _uploads(s3, bucket) == []


class StoreFront:
    """An HTTP front of the S3 server, for faults moto alone does not make:
    it passes every request on, but answers the first complete of each
    upload only after `late_s` (past the client's read timeout: the client
    tries again, its first answer lost), and a complete of an upload
    completed before with `404 NoSuchUpload`, as MinIO and R2 do (moto and
    AWS answer it again). While `blocked`, it drops every connection
    unanswered (a network that does not reach the store)."""

    def __init__(self, backend: str, late_s: float = 0.0) -> None:
        import http.client
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        from urllib.parse import parse_qs, urlsplit

        completed: set[str] = set()
        port = int(backend.rsplit(":", 1)[1])
        self.blocked = False
        front = self

        class Handler(BaseHTTPRequestHandler):
            def _pass(self) -> None:
                if front.blocked:
                    self.close_connection = True
                    return
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                upload = parse_qs(urlsplit(self.path).query).get("uploadId", [""])[0]
                if self.command == "POST" and upload in completed:
                    error = b"<Error><Code>NoSuchUpload</Code></Error>"
                    self.send_response(404)
                    self.send_header("Content-Length", str(len(error)))
                    self.end_headers()
                    self.wfile.write(error)
                    return
                server = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
                server.request(self.command, self.path, body, dict(self.headers))
                answer = server.getresponse()
                data = answer.read()
                if self.command == "POST" and upload and answer.status == 200:
                    completed.add(upload)
                    time.sleep(late_s)  # the client gave up on this answer
                self.send_response(answer.status)
                for name, value in answer.getheaders():
                    if name.lower() not in ("content-length", "connection", "transfer-encoding"):
                        self.send_header(name, value)
                length = answer.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length or str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                server.close()

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _pass

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> str:
        """`http://127.0.0.1:PORT`."""
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        """Stops serving."""
        self.server.shutdown()
        self.server.server_close()


def test_a_complete_tried_again_after_its_answer_was_lost_is_recognised(
    s3: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store completes a put in parts, but its answer comes too late (the
    client's read timeout, 1 s here): the complete is tried again, and the
    store, which no longer knows the upload, answers NoSuchUpload. The retry
    finds the very file its parts make: the put counts, never "no such
    bucket"."""
    monkeypatch.setenv(PART_ENV, "5")
    monkeypatch.setenv(READ_TIMEOUT_ENV, "1")
    monkeypatch.setenv(OUTAGE_ENV, "20")
    bucket = s3.bucket()
    front = StoreFront(s3.endpoint, late_s=2.0)
    try:
        store = _s3(f"s3://{bucket}/runs?endpoint_url={front.endpoint}")
        data = os.urandom(11 << 20)
        digests = [
            hashlib.sha256(data[i : i + (5 << 20)]).hexdigest()
            for i in range(0, len(data), 5 << 20)
        ]
        signed = store.sign_put("r1/gguf/model.gguf", len(data), digests)
        etags = []
        with httpx.Client() as http:
            for part in signed.parts:
                body = data[part.offset : part.offset + part.length]
                answer = http.put(part.url, content=body, headers=dict(part.headers))
                assert answer.status_code == 200
                etags.append(answer.headers["etag"])
        store.complete(signed, etags, digests)
        info = store.head("r1/gguf/model.gguf")
        assert info is not None and info.sha256 == expected_checksum(digests)
    finally:
        front.close()


def test_a_store_that_does_not_answer_at_the_first_contact_is_refused_within_seconds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At a flow's start, nothing listening at the endpoint, or a listener
    that never answers, is refused in one line within seconds (the outage
    bound, minutes, is for a store that stops answering mid-run)."""
    import socket

    monkeypatch.delenv(OUTAGE_ENV, raising=False)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # connections are taken, never answered
    try:
        for endpoint in (
            f"http://127.0.0.1:{free_port()}",
            f"http://127.0.0.1:{silent.getsockname()[1]}",
        ):
            began = time.monotonic()
            with pytest.raises(StoreUnreachable) as unreachable:
                check_s3(_s3(f"s3://runs-y/p?endpoint_url={endpoint}"))
            said = str(unreachable.value)
            assert time.monotonic() - began < 20, said
            assert "did not answer" in said and endpoint in said and "\n" not in said
    finally:
        silent.close()


class BlockedFromStore(LocalExecutor):
    """The real local target, which does not reach the store while it runs
    the file-moving script's `reach` (its network to the store blocked)."""

    def __init__(self, workdir: Path, front: StoreFront) -> None:
        super().__init__(workdir, name="box")
        self.front = front

    async def run(
        self, argv: Sequence[str], timeout: float = 60.0, stdin: bytes | None = None
    ) -> CommandResult:
        reach = len(argv) > 3 and argv[3] == "reach"
        self.front.blocked = reach
        try:
            return await super().run(argv, timeout, stdin)
        finally:
            self.front.blocked = False


def test_a_target_that_cannot_reach_the_store_is_refused_in_one_line_before_its_job_starts(
    s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker reaches the store, the target does not: the start asks the
    target to get one byte by a signed URL, and refuses the run in one line
    naming the store (never the URL) before anything is uploaded or
    spawned; the record says why. A target that reaches it starts its job."""
    monkeypatch.setenv(REACH_ENV, "2")
    front = StoreFront(s3.endpoint)
    try:
        runs = Runs(f"s3://{s3.bucket()}/runs?endpoint_url={front.endpoint}")
        target = BlockedFromStore(tmp_path / "target", front)
        ctx = RunContext(runs=runs, executor=target, python=sys.executable)
        record = start_step.create(runs, target="box", target_kind="local", workdir=target.workdir)
        with pytest.raises(ExecError) as refused:
            asyncio.run(start_step.start(ctx, ShellTrainer("true"), record))
        said = str(refused.value)
        assert "the target cannot reach s3://" in said and "\n" not in said, said
        assert "X-Amz" not in said and front.endpoint not in said
        assert not Path(record.remote_dir).exists()  # nothing uploaded, nothing spawned
        failed = runs.load(record.id)
        assert failed.state == RunState.FAILED and failed.job is None
        assert "cannot reach" in (failed.message or "")

        plain = LocalExecutor(tmp_path / "target", name="box")
        ctx = RunContext(runs=runs, executor=plain, python=sys.executable)
        record = start_step.create(runs, target="box", target_kind="local", workdir=plain.workdir)
        started = asyncio.run(start_step.start(ctx, ShellTrainer("true"), record))
        assert started.state == RunState.RUNNING and started.job is not None
    finally:
        front.close()


CREDENTIAL_PROCESS = """
import datetime, json, sys
from pathlib import Path
count = Path(sys.argv[1])
n = int(count.read_text() if count.exists() else "0") + 1
count.write_text(str(n))
now = datetime.datetime.now(datetime.timezone.utc)
expires = now + datetime.timedelta(seconds=float(sys.argv[2]))
print(json.dumps({"Version": 1, "AccessKeyId": f"ASIATEMPORARY{n:07d}", "SecretAccessKey": "s",
                  "SessionToken": f"token-{n}", "Expiration": expires.isoformat()}))
"""


class RecordingPuts(LocalExecutor):
    """The real local target, keeping the plan of each put of the file-moving script."""

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir, name="box")
        self.plans: list[dict[str, Any]] = []

    async def run(
        self, argv: Sequence[str], timeout: float = 60.0, stdin: bytes | None = None
    ) -> CommandResult:
        if len(argv) > 3 and argv[3] == "put" and stdin:
            self.plans.append(json.loads(stdin))
        return await super().run(argv, timeout, stdin)


def test_a_put_outlives_the_temporary_credentials_that_signed_its_urls(
    s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker's credentials are temporary (a `credential_process`, as a
    pod's or task's role gives them) and about to expire: the target puts
    the parts it can begin while they are good, the rest are signed again by
    the refreshed credentials and put by another run. The store holds the
    file whole, as the manifest lists it, and no unfinished put."""
    bucket = s3.bucket()  # with the tests' keys, before the credentials change
    count, script = tmp_path / "issued", tmp_path / "credentials.py"
    script.write_text(CREDENTIAL_PROCESS)
    config = tmp_path / "aws-config"
    left_s = 900 + 0.4  # botocore refreshes them 900 s before they expire: 0.4 s from now
    config.write_text(
        f"[profile temporary]\ncredential_process = {sys.executable} {script} {count} {left_s}\n"
    )
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_PROFILE", "temporary")
    monkeypatch.setenv(SIGN_MARGIN_ENV, str(left_s))  # URLs good for no time: one part a put
    monkeypatch.setenv(PART_ENV, "5")
    runs = Runs(s3.bucket_url(bucket=bucket))
    target = RecordingPuts(tmp_path / "target")
    remote = tmp_path / "target" / "r1"
    (remote / "gguf").mkdir(parents=True)
    (remote / "gguf" / "model.gguf").write_bytes(os.urandom(6 * (5 << 20)))
    manifest = asyncio.run(target.manifest(str(remote), ["gguf"]))
    asyncio.run(put_files(target, sys.executable, runs, "r1", str(remote), manifest))
    assert len(target.plans) >= 2, target.plans  # put again by URLs signed again
    assert int(count.read_text()) >= 2  # ... by refreshed credentials
    last = target.plans[-1]["files"][0]["parts"]
    assert len(last) < 6 and all("ASIATEMPORARY0000001" not in p["url"] for p in last)
    back = tmp_path / "back.gguf"
    runs.store.get_file(runs.key("r1", "gguf/model.gguf"), back)
    assert hashlib.sha256(back.read_bytes()).hexdigest() == manifest[0].sha256
    unfinished = runs.store.client.list_multipart_uploads(Bucket=bucket)  # type: ignore[attr-defined]
    assert not unfinished.get("Uploads")


def test_a_key_joins_its_parts_and_no_part_at_all_is_the_stores_root() -> None:
    """Keys join their parts with `/`, empty parts and their slashes dropped;
    a key of only empty parts (a runs directory at a bucket's root asked for
    its own key) is the root, "", where it raised TypeError."""
    assert join("runs", "", "/r1/", "run.json") == "runs/r1/run.json"
    assert join("", "") == "" and join("") == "" and join() == ""
