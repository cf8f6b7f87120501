"""The fault proxy of the chaos tests, on the real S3 server: it forwards as
it is, holds every byte while it stalls, loses the answer of a request the
server applied, answers a burst 503 itself, and ends within its bound."""

from __future__ import annotations

import time

import boto3
import botocore.exceptions
import pytest
from botocore.config import Config

from tests.faultproxy import FaultProxy
from tests.s3server import REGION, S3Server


def _client(endpoint: str):  # type: ignore[no-untyped-def]
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name=REGION,
        config=Config(
            signature_version="s3v4",
            s3={"addressing_style": "path"},
            retries={"total_max_attempts": 1},
            connect_timeout=2,
            read_timeout=2,
        ),
    )


def test_the_proxy_stalls_drops_answers_fails_and_forwards(s3: S3Server) -> None:
    bucket = s3.bucket()
    with FaultProxy(s3.port, max_s=60) as proxy:
        client = _client(proxy.endpoint)
        client.put_object(Bucket=bucket, Key="a", Body=b"one")  # forwarded as it is
        assert client.get_object(Bucket=bucket, Key="a")["Body"].read() == b"one"

        proxy.drop_answers(1)
        with pytest.raises(botocore.exceptions.HTTPClientError):
            client.put_object(Bucket=bucket, Key="b", Body=b"applied")
        assert proxy.dropped == 1
        assert client.get_object(Bucket=bucket, Key="b")["Body"].read() == b"applied"

        proxy.fail(2)
        for _ in range(2):
            with pytest.raises(botocore.exceptions.ClientError) as refused:
                client.put_object(Bucket=bucket, Key="c", Body=b"never")
            assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] == 503
        assert proxy.failed == 2
        with pytest.raises(botocore.exceptions.ClientError):  # the 503s never reached it
            client.head_object(Bucket=bucket, Key="c")

        proxy.stall()
        started = time.monotonic()
        with pytest.raises(botocore.exceptions.ReadTimeoutError):
            client.get_object(Bucket=bucket, Key="a")
        assert time.monotonic() - started >= 2
        proxy.stall(0.5)
        started = time.monotonic()
        assert client.get_object(Bucket=bucket, Key="a")["Body"].read() == b"one"
        assert 0.5 <= time.monotonic() - started < 2

        proxy.latency(0.3)
        started = time.monotonic()
        client.head_object(Bucket=bucket, Key="a")
        assert time.monotonic() - started >= 0.3


def test_the_proxy_ends_within_its_bound(s3: S3Server) -> None:
    proxy = FaultProxy(s3.port, max_s=0.5)
    proxy.stall()
    time.sleep(1.0)
    with pytest.raises(botocore.exceptions.BotoCoreError):
        _client(proxy.endpoint).list_buckets()
    proxy.stop()
