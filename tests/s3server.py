"""A real S3 server on 127.0.0.1 for tests and benchmarks: moto's server
(`moto[server]`, its S3 API as moto_server serves it), one process started by
PID and stopped by PID.

It runs single-threaded: moto's threaded server checks `If-None-Match` and
`If-Match` and then writes without a lock, so two racing conditional puts can
both succeed there, where AWS and MinIO make them atomic; one request at a
time, its conditional writes are what a real store's are, and the races the
tests provoke are decided by the store, as in production.

    with S3Server.start() as s3:
        url = s3.bucket_url("runs")   # s3://<new bucket>/runs?endpoint_url=http://127.0.0.1:PORT

`auth=True` makes moto check credentials against its own IAM (as AWS does),
for the tests of wrong credentials; presigned URLs do not work there.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

from tests.ports import free_port

START_TIMEOUT_S = 30.0  # time for moto to import and answer before it is declared broken
STOP_TIMEOUT_S = 5.0
KEY_ID = "AKIAOVERBRAINERTEST0"  # the conftest's AWS_ACCESS_KEY_ID
SECRET = "overbrainer-test-secret"  # moto without auth takes any credentials
REGION = "us-east-1"


def credentials_env() -> dict[str, str]:
    """The AWS environment a test process gives boto3 (moto's own test keys)."""
    return {
        "AWS_ACCESS_KEY_ID": KEY_ID,
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_DEFAULT_REGION": REGION,
        "AWS_REGION": REGION,
    }


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


class S3Server:
    """moto's S3 server on 127.0.0.1:`port` (see the module)."""

    def __init__(self, port: int, process: subprocess.Popen[bytes], log: Path) -> None:
        self.port = port
        self.process = process
        self.log = log
        self.keys: tuple[str, str] = (KEY_ID, SECRET)

    @property
    def endpoint(self) -> str:
        """`http://127.0.0.1:PORT`."""
        return f"http://127.0.0.1:{self.port}"

    @classmethod
    def start(
        cls, log: Path | None = None, auth: bool = False, port: int | None = None
    ) -> S3Server:
        """Starts a server and waits until it answers. Raises RuntimeError with
        its log when it does not within START_TIMEOUT_S."""
        port = port or free_port()
        log = log or Path(os.environ.get("TMPDIR", "/tmp")) / f"moto-{port}.log"
        env = {**os.environ, **credentials_env()}
        if auth:
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = "3"  # the IAM user, its key and its policy
        with open(log, "wb") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "tests.s3server", str(port)],
                cwd=Path(__file__).resolve().parents[1],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        server = cls(port, process, log)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _answers(port):
            if process.poll() is not None or time.monotonic() > deadline:
                server.stop()
                raise RuntimeError(f"moto did not start on {port}: {log.read_text()[-2000:]}")
            time.sleep(0.1)
        if auth:
            server.keys = server._iam_user()
        return server

    def _iam_user(self) -> tuple[str, str]:
        import boto3

        iam = boto3.client(
            "iam",
            endpoint_url=self.endpoint,
            region_name=REGION,
            aws_access_key_id=KEY_ID,
            aws_secret_access_key=SECRET,
        )
        iam.create_user(UserName="runs")
        key = iam.create_access_key(UserName="runs")["AccessKey"]
        policy = {
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}],
        }
        iam.put_user_policy(UserName="runs", PolicyName="all", PolicyDocument=json.dumps(policy))
        return key["AccessKeyId"], key["SecretAccessKey"]

    def client(self):  # type: ignore[no-untyped-def]
        """A boto3 S3 client of this server, with its keys."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=REGION,
            aws_access_key_id=self.keys[0],
            aws_secret_access_key=self.keys[1],
            config=Config(signature_version="s3v4", s3={"addressing_style": "path"}),
        )

    def bucket(self, name: str | None = None) -> str:
        """Creates a new bucket (a random name unless given) and returns its name."""
        name = name or f"runs-{secrets.token_hex(6)}"
        self.client().create_bucket(Bucket=name)
        return name

    def bucket_url(
        self, prefix: str = "runs", bucket: str | None = None, endpoint: str | None = None
    ) -> str:
        """`s3://<bucket>/<prefix>?endpoint_url=...` of a new bucket (or `bucket`),
        reached at `endpoint` when given (a `tests/faultproxy.py` in front of it)."""
        name = bucket or self.bucket()
        return f"s3://{name}/{prefix}?endpoint_url={endpoint or self.endpoint}"

    def stop(self) -> None:
        """Stops the server by its PID (SIGTERM, then SIGKILL)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> S3Server:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _serve(port: int) -> None:
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import run_simple

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    run_simple(
        "127.0.0.1",
        port,
        DomainDispatcherApplication(create_backend_app),
        threaded=False,
        request_handler=MotoRequestHandler,
    )


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
