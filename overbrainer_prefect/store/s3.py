"""A store in an S3-compatible bucket (AWS, MinIO, R2...), through boto3: every
record change a conditional put (`If-None-Match: *` to create, `If-Match:
<ETag>` to replace), files put by targets themselves with presigned URLs whose
parts' SHA-256 the store checks (or, where it only computes them, reports),
and a lock a lease object renewed by compare-and-swap (`store/lease.py`),
whose requests go through a client of their own with short timeouts and no
retries, and whose expiry is the store's clock (its `Date`): a store whose
`Date` is missing or absurd is refused.

A store that does not answer is tried again with backoff for
`OVERBRAINER_STORE_OUTAGE_S` seconds before StoreUnreachable; a conditional
write tried again after a lost answer is checked against what it wrote, so a
retry never reports a race it did not lose.
"""

from __future__ import annotations

import logging
import os
import random
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypeVar

import boto3
import botocore.exceptions
import urllib3.exceptions
from botocore.awsrequest import AWSRequest
from botocore.config import Config
from botocore.credentials import RefreshableCredentials
from botocore.httpsession import URLLib3Session
from botocore.utils import get_environ_proxies

from overbrainer_prefect.store.base import (
    AlreadyExists,
    Changed,
    ObjectInfo,
    SignedPart,
    SignedPut,
    StoreError,
    StoreRefused,
    StoreUnreachable,
    Versioned,
    check_key,
    join,
    part_length,
    parts_of,
)
from overbrainer_prefect.store.check import check_s3
from overbrainer_prefect.store.digest import b64_sha256, expected_checksum, hex_sha256
from overbrainer_prefect.store.lease import Dated, Lease, lease_holder

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client
    from mypy_boto3_s3.type_defs import ListObjectsV2OutputTypeDef, ObjectIdentifierTypeDef

log = logging.getLogger(__name__)

T = TypeVar("T")

OUTAGE_ENV = "OVERBRAINER_STORE_OUTAGE_S"
OUTAGE_S = 600.0
"""How long a store that does not answer is tried again before StoreUnreachable:
a night's run waits out a short outage of its store instead of failing."""
BACKOFF_FIRST_S = 0.5  # the first pause before a store is tried again; doubled each time
BACKOFF_MAX_S = 15.0  # the longest pause between two tries

PART_ENV = "OVERBRAINER_STORE_PART_MB"
PART_SIZE = 512 << 20
"""The most bytes a part of a presigned put holds: a file of at most as many
(an adapter, a checkpoint's shard) is one PUT, its store SHA-256 its own,
checkable from the manifest alone; a bigger one (a GGUF) is put in parts of
`base.CHUNK` (16 MiB), so a 16 GB GGUF is 954 parts."""
MIN_PART = 5 << 20  # S3's smallest part (but the last)

SIGNED_MIN_S = 900  # how long a presigned URL is valid at least
SLOWEST_BPS = 1 << 20  # the slowest transfer a URL's lifetime allows for (1 MiB/s)
SIGNED_MAX_S = 7 * 24 * 3600  # SigV4's longest presigned URL
SIGN_MARGIN_S = 14 * 60
"""URLs signed by temporary credentials are used until the credentials have
this long left, then signed again: inside botocore's 15 minutes before
their expiry, where it refreshes them as it signs, so the new URLs are
signed by fresh ones, and a part begun just before still has minutes."""
SIGN_MARGIN_ENV = "OVERBRAINER_STORE_SIGN_MARGIN_S"  # overrides SIGN_MARGIN_S
MIN_SIGNED_FOR_S = 0.0  # credentials past their margin: each put sends its first part only

WRITE_TOKEN = "overbrainer-write"
"""Metadata each conditional put carries: a token of that write's own."""

CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 60.0
READ_TIMEOUT_ENV = "OVERBRAINER_STORE_READ_TIMEOUT_S"
"""How long a request waits for the store's answer before it is tried again."""

PROBE_S = 5.0
"""How long the first contact with a store waits for it to answer at all
before the flow is refused: a store that is not there when a flow starts is
a wrong URL or network, not an outage to wait out (OUTAGE_S is for those)."""
PROBE_CONNECT_S = 2.0  # a try of the first contact: its connect ...
PROBE_READ_S = 4.0  # ... and its wait for any answer

ChecksumMode = Literal["checked", "computed"]
"""How the store knows a put's SHA-256: `checked`, it refuses a part whose
`x-amz-checksum-sha256` is not its content's (AWS, MinIO); `computed`, it
computes it from what it received when asked (`x-amz-sdk-checksum-algorithm`)
and reports it, and the manifest is compared with that."""

Client = Callable[[Config], "S3Client"]
"""Makes a boto3 S3 client of a store with the given settings (credentials
and endpoint inside): `client_config` for its records and files,
`lease_config` for its leases."""

CLOCK_ABSURD_S = 24 * 3600.0
"""A store whose `Date` is this far from this machine's clock is refused: one
of the two clocks is wrong, and a lease's expiry is the store's."""

_REFUSED = {
    "InvalidAccessKeyId": "its access key is not known: check the credentials",
    "SignatureDoesNotMatch": "its secret key does not match: check the credentials",
    "AccessDenied": "access denied: check the credentials and the bucket's policy",
    "Forbidden": "access denied: check the credentials and the bucket's policy",
    "403": "access denied: check the credentials and the bucket's policy",
    "ExpiredToken": "its session token expired: renew the credentials",
    "InvalidToken": "its session token is not valid: check the credentials",
    "NoSuchUpload": "it no longer knows that put in parts (aborted, or expired): put it again",
    "NoSuchBucket": "there is no such bucket: create it, or fix the runs directory's URL",
    "404": "there is no such bucket: create it, or fix the runs directory's URL",
    "InvalidBucketName": "the bucket name is not valid: fix the runs directory's URL",
    "PermanentRedirect": "the bucket is in another region: set AWS_REGION to its region",
    "AuthorizationHeaderMalformed": "the bucket is in another region: set AWS_REGION to it",
}


def _seconds(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name) or default)
    except ValueError:
        return default


def outage_s() -> float:
    """`$OVERBRAINER_STORE_OUTAGE_S`, else OUTAGE_S."""
    return _seconds(OUTAGE_ENV, OUTAGE_S)


def sign_margin_s() -> float:
    """`$OVERBRAINER_STORE_SIGN_MARGIN_S`, else SIGN_MARGIN_S."""
    return _seconds(SIGN_MARGIN_ENV, SIGN_MARGIN_S)


def part_size() -> int:
    """`$OVERBRAINER_STORE_PART_MB` MiB (at least S3's 5), else PART_SIZE: the
    most bytes a part holds (see `base.part_length`)."""
    try:
        wanted = int(float(os.environ.get(PART_ENV) or 0) * (1 << 20))
    except ValueError:
        wanted = 0
    return max(wanted, MIN_PART) if wanted else PART_SIZE


def client_config() -> Config:
    """The boto3 client settings of every store: SigV4, path-style addressing
    (MinIO, R2 and local endpoints), bounded connects and reads, botocore's own
    retries kept short (the store's backoff does the rest), and checksums only
    where this code asks for them."""
    return Config(
        signature_version="s3v4",
        s3={"addressing_style": "path"},
        connect_timeout=CONNECT_TIMEOUT_S,
        read_timeout=_seconds(READ_TIMEOUT_ENV, READ_TIMEOUT_S),
        retries={"total_max_attempts": 1},  # one try a call: the store's own backoff retries
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )


def lease_config(timeout_s: float) -> Config:
    """`client_config` for lease requests: one try that gives up within
    `timeout_s` (half to connect, half to read), so a renewal is bounded
    well under its lease's TTL."""
    return client_config().merge(Config(connect_timeout=timeout_s / 2, read_timeout=timeout_s / 2))


def default_client(endpoint_url: str | None, config: Config | None = None) -> S3Client:
    """An S3 client from boto3's own credential chain (environment, profile,
    the instance's or pod's role), at `endpoint_url` when given (else boto3's:
    `AWS_ENDPOINT_URL_S3`, `AWS_ENDPOINT_URL`, or AWS), with `config` (else
    `client_config`)."""
    session = boto3.session.Session()
    client: S3Client = session.client(
        "s3", endpoint_url=endpoint_url, config=config or client_config()
    )
    return client


@dataclass(frozen=True)
class _Failure:
    code: str
    status: int


def _failure(error: botocore.exceptions.ClientError) -> _Failure:
    err = error.response.get("Error", {})
    meta = error.response.get("ResponseMetadata", {})
    return _Failure(str(err.get("Code", "")), int(meta.get("HTTPStatusCode", 0) or 0))


_NO_ANSWER = (
    botocore.exceptions.EndpointConnectionError,
    botocore.exceptions.ConnectionError,
    botocore.exceptions.ConnectTimeoutError,
    botocore.exceptions.HTTPClientError,  # a read timeout, a connection closed before its answer
    botocore.exceptions.ResponseStreamingError,
    # a stall or a cut after an answer's headers, before its body: botocore reads the body of
    # an answer it parses (`convert_to_response_dict`) without wrapping urllib3's errors
    urllib3.exceptions.ReadTimeoutError,
    urllib3.exceptions.ProtocolError,
)
"""What botocore raises when the store did not answer (or not all of it)."""


def _transient(error: Exception) -> str | None:
    """Why `error` is worth trying again (no answer, a 5xx, SlowDown), None
    when it is the store's answer for good."""
    if isinstance(error, botocore.exceptions.ClientError):
        failure = _failure(error)
        if failure.status >= 500 or failure.code in ("SlowDown", "RequestTimeout"):
            return f"it answered {failure.status or failure.code}"
        return None
    if isinstance(error, _NO_ANSWER):
        return type(error).__name__
    return None


class S3Store:
    """A `Store` in `bucket` under `prefix` (see the module)."""

    direct = True

    def __init__(
        self, bucket: str, prefix: str, client: Client, endpoint_url: str | None = None
    ) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.endpoint_url = endpoint_url
        self._make_client = client
        self._client: S3Client | None = None
        self._quick: dict[float, S3Client] = {}
        self._quick_lock = threading.Lock()
        self.checksums: ChecksumMode | None = None
        """How the store knows a put's SHA-256, once `store.check` found out."""
        self.outage_s = outage_s()
        self._part_size = part_size()

    def __repr__(self) -> str:
        return f"S3Store({self.url!r})"

    @property
    def url(self) -> str:
        """`s3://bucket/prefix`."""
        return f"s3://{join(self.bucket, self.prefix)}"

    @property
    def location(self) -> str:
        """`s3://bucket/prefix`, with `?endpoint_url=` when it was given so."""
        return self.url + (f"?endpoint_url={self.endpoint_url}" if self.endpoint_url else "")

    @property
    def part_size(self) -> int:
        """The most bytes a part of a presigned put holds, the biggest file put
        whole (`$OVERBRAINER_STORE_PART_MB`; see `base.part_length`)."""
        return self._part_size

    @property
    def client(self) -> S3Client:
        """The boto3 client, made on first use."""
        if self._client is None:
            self._client = self._make_client(client_config())
        return self._client

    def quick_client(self, timeout_s: float) -> S3Client:
        """A client of this store whose every request is one try that gives up
        within `timeout_s` (`lease_config`), made once per timeout."""
        with self._quick_lock:
            client = self._quick.get(timeout_s)
            if client is None:
                client = self._quick[timeout_s] = self._make_client(lease_config(timeout_s))
            return client

    def local_path(self, key: str) -> None:
        """None: nothing of an object store is a local file."""
        return None

    def full(self, key: str) -> str:
        """The object's key in the bucket."""
        return join(self.prefix, check_key(key))

    def where(self, key: str) -> str:
        """`s3://bucket/prefix/key`."""
        return f"s3://{join(self.bucket, self.full(key))}"

    def _call(self, what: str, call: Callable[[], T]) -> T:
        """`call`, tried again with backoff while the store does not answer,
        for at most `outage_s`; a refusal raises StoreRefused at once."""
        deadline = time.monotonic() + self.outage_s
        pause = BACKOFF_FIRST_S
        while True:
            try:
                return call()
            except (botocore.exceptions.ClientError, *_NO_ANSWER) as error:
                reason = _transient(error)
                if reason is None:
                    raise
            except botocore.exceptions.NoCredentialsError:
                raise self._no_credentials() from None
            if time.monotonic() + pause > deadline:
                raise StoreUnreachable(
                    f"the store {self.url} did not answer for {self.outage_s:g} s "
                    f"({what}: {reason}); everything it did not take is left where it was"
                ) from None
            log.warning("the store %s did not answer (%s: %s); again", self.url, what, reason)
            time.sleep(pause * (0.5 + random.random() / 2))
            pause = min(pause * 2, BACKOFF_MAX_S)

    def _no_credentials(self) -> StoreRefused:
        return StoreRefused(
            f"no credentials for {self.url}: give a credentials block "
            "(OVERBRAINER_STORE_CREDENTIALS) or the AWS environment variables"
        )

    def _once(self, what: str, call: Callable[[], T]) -> T:
        """`call`, tried once: StoreUnreachable when the store did not answer
        (or answered a 5xx), the ClientError of a refusal as it is."""
        try:
            return call()
        except (botocore.exceptions.ClientError, *_NO_ANSWER) as error:
            reason = _transient(error)
            if reason is None:
                raise
        except botocore.exceptions.NoCredentialsError:
            raise self._no_credentials() from None
        raise StoreUnreachable(f"the store {self.url} did not answer in time ({what}: {reason})")

    def store_clock(self, response: Mapping[str, object]) -> float:
        """The store's time when it sent `response` (its `Date`, Unix seconds).
        Raises StoreRefused, in one line, when the answer has no `Date` or one
        more than CLOCK_ABSURD_S from this machine's clock: a lease's expiry
        is the store's clock."""
        meta = response.get("ResponseMetadata")
        headers = meta.get("HTTPHeaders") if isinstance(meta, Mapping) else None
        date = headers.get("date") if isinstance(headers, Mapping) else None
        why = "it sends no Date header"
        if isinstance(date, str):
            try:
                moment = parsedate_to_datetime(date).timestamp()
            except (TypeError, ValueError):
                why = "its Date header is not a date"
            else:
                if abs(moment - time.time()) <= CLOCK_ABSURD_S:
                    return moment
                why = f"its Date header ({date}) is more than a day from this machine's clock"
        raise StoreRefused(
            f"the store {self.url} cannot hold leases: {why}; a lease's expiry is the store's "
            "clock: fix the store's (or this machine's) clock, or use a store that dates its "
            "answers (AWS S3, MinIO, R2)"
        )

    def probe(self) -> None:
        """The first contact with the store: one unsigned HEAD of its bucket
        at its endpoint (through the same proxies), whose any answer, even a
        refusal, means it is there; a connection refused is tried again for
        at most PROBE_S seconds, a listener that does not answer is not.
        Raises StoreUnreachable with one line when nothing answers (nothing
        listens, or a listener that never answers): within seconds, where a
        store that stops answering mid-run is waited for `outage_s`."""
        endpoint = self.client.meta.endpoint_url
        url = f"{endpoint.rstrip('/')}/{self.bucket}"
        configured = self.client.meta.config.proxies  # type: ignore[attr-defined]  # not in the stubs
        session = URLLib3Session(
            proxies=configured or get_environ_proxies(url),
            timeout=(PROBE_CONNECT_S, PROBE_READ_S),  # type: ignore[arg-type]  # (connect, read)
        )
        deadline = time.monotonic() + PROBE_S
        try:
            while True:
                try:
                    session.send(AWSRequest(method="HEAD", url=url).prepare())
                    return
                except botocore.exceptions.SSLError:
                    return  # something answers: the real calls say what is wrong with it
                except (
                    botocore.exceptions.ConnectionError,
                    botocore.exceptions.HTTPClientError,
                ) as error:
                    reason = type(error).__name__
                    waited = isinstance(error, botocore.exceptions.ReadTimeoutError)
                if waited or time.monotonic() + BACKOFF_FIRST_S > deadline:
                    raise StoreUnreachable(
                        f"the store {self.url} did not answer at {endpoint} within "
                        f"{PROBE_S:g} s ({reason}): "
                        "check its endpoint (the runs directory's ?endpoint_url=, "
                        "AWS_ENDPOINT_URL), that it runs, and this machine's network; "
                        "nothing was made"
                    )
                time.sleep(BACKOFF_FIRST_S)
        finally:
            session.close()

    def refused(self, error: botocore.exceptions.ClientError, what: str) -> StoreRefused:
        """The one-line refusal of a client error (its code and status, never its body)."""
        failure = _failure(error)
        why = _REFUSED.get(failure.code) or _REFUSED.get(str(failure.status))
        if why is None:
            why = f"it answered {failure.code or failure.status}"
        return StoreRefused(f"the store {self.url} refused to {what}: {why}")

    def read(self, key: str) -> Versioned | None:
        """The object and its ETag, from one GET."""
        full = self.full(key)

        def get() -> Versioned | None:
            try:
                answer = self.client.get_object(Bucket=self.bucket, Key=full)
            except botocore.exceptions.ClientError as error:
                if _failure(error).code in ("NoSuchKey", "404"):
                    return None
                raise
            return Versioned(answer["Body"].read(), answer["ETag"])

        try:
            return self._call(f"read {key}", get)
        except botocore.exceptions.ClientError as error:
            raise self.refused(error, f"read {key}") from None

    def _put(
        self, key: str, data: bytes, condition: Literal["create", "replace", ""], etag: str = ""
    ) -> str:
        """PUT with `condition`, tagged with a token of this write's own: a
        conditional put tried again after an answer was lost is this write's
        when the object carries its token, a lost race otherwise."""
        full = self.full(key)
        token = secrets.token_hex(12)
        tries = 0

        def put() -> str:
            nonlocal tries
            tries += 1
            meta = {WRITE_TOKEN: token}
            if condition == "create":
                answer = self.client.put_object(
                    Bucket=self.bucket, Key=full, Body=data, Metadata=meta, IfNoneMatch="*"
                )
            elif condition == "replace":
                answer = self.client.put_object(
                    Bucket=self.bucket, Key=full, Body=data, Metadata=meta, IfMatch=etag
                )
            else:
                answer = self.client.put_object(Bucket=self.bucket, Key=full, Body=data)
            return answer["ETag"]

        try:
            return self._call(f"write {key}", put)
        except botocore.exceptions.ClientError as error:
            failure = _failure(error)
            lost = failure.status in (409, 412) or failure.code in (
                "PreconditionFailed",
                "ConditionalRequestConflict",
                "NoSuchKey",
            )
            if not lost or not condition:
                raise self.refused(error, f"write {key}") from None
            if tries > 1:
                mine = self._written_by(full, token)
                if mine is not None:
                    return mine
            if condition == "create":
                raise AlreadyExists(f"{self.where(key)} exists") from None
            raise Changed(f"{self.where(key)} changed since it was read") from None

    def _written_by(self, full: str, token: str) -> str | None:
        """The object's ETag when the write `token` made it, else None."""
        try:
            answer = self._call(
                "look at a write", lambda: self.client.head_object(Bucket=self.bucket, Key=full)
            )
        except botocore.exceptions.ClientError:
            return None
        return answer["ETag"] if answer.get("Metadata", {}).get(WRITE_TOKEN) == token else None

    def create(self, key: str, data: bytes) -> str:
        """PUT with `If-None-Match: *`. Raises AlreadyExists."""
        return self._put(key, data, "create")

    def replace(self, key: str, data: bytes, etag: str) -> str:
        """PUT with `If-Match: <etag>`. Raises Changed."""
        return self._put(key, data, "replace", etag)

    def write(self, key: str, data: bytes) -> None:
        """PUT, whatever the key holds."""
        self._put(key, data, "")

    def delete(self, key: str) -> None:
        """DELETE the object, and every object under it as a directory."""
        keys = [self.full(key)] + [self.full(info.key) for info in self.objects(key)]
        for chunk in range(0, len(keys), 1000):
            batch: list[ObjectIdentifierTypeDef] = [{"Key": k} for k in keys[chunk : chunk + 1000]]

            def delete(batch: list[ObjectIdentifierTypeDef] = batch) -> None:
                self.client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True}
                )

            try:
                self._call(f"delete {key}", delete)
            except botocore.exceptions.ClientError as error:
                raise self.refused(error, f"delete {key}") from None

    def head(self, key: str) -> ObjectInfo | None:
        """HEAD with the checksum asked for: size and the store's SHA-256
        (hex; for a multipart object, the SHA-256 of its parts' digests)."""
        full = self.full(key)

        def head() -> ObjectInfo | None:
            try:
                answer = self.client.head_object(
                    Bucket=self.bucket, Key=full, ChecksumMode="ENABLED"
                )
            except botocore.exceptions.ClientError as error:
                if _failure(error).code in ("NoSuchKey", "404", "NotFound"):
                    return None
                raise
            checksum = answer.get("ChecksumSHA256")
            digest = hex_sha256(checksum) if checksum else None
            return ObjectInfo(key, int(answer["ContentLength"]), digest)

        try:
            return self._call(f"look at {key}", head)
        except botocore.exceptions.ClientError as error:
            raise self.refused(error, f"look at {key}") from None

    def _pages(self, prefix: str, delimiter: bool) -> Iterator[ListObjectsV2OutputTypeDef]:
        full = join(self.prefix, prefix)
        start = f"{full}/" if full else ""
        token = ""

        def page() -> ListObjectsV2OutputTypeDef:
            return (
                self.client.list_objects_v2(
                    Bucket=self.bucket,
                    Prefix=start,
                    Delimiter="/" if delimiter else "",
                    ContinuationToken=token,
                )
                if token
                else self.client.list_objects_v2(
                    Bucket=self.bucket, Prefix=start, Delimiter="/" if delimiter else ""
                )
            )

        while True:
            try:
                answer = self._call(f"list {prefix or 'the store'}", page)
            except botocore.exceptions.ClientError as error:
                raise self.refused(error, f"list {prefix or 'the store'}") from None
            yield answer
            if not answer.get("IsTruncated"):
                return
            token = answer.get("NextContinuationToken", "")

    def _relative(self, full: str) -> str:
        return full[len(self.prefix) + 1 :] if self.prefix else full

    def objects(self, prefix: str) -> list[ObjectInfo]:
        """Every object under `prefix/`."""
        found: list[ObjectInfo] = []
        for page in self._pages(prefix, delimiter=False):
            for item in page.get("Contents", []):
                found.append(ObjectInfo(self._relative(item["Key"]), int(item["Size"])))
        return sorted(found, key=lambda info: info.key)

    def names(self, prefix: str) -> list[str]:
        """The names directly below `prefix/` (objects and common prefixes)."""
        names: set[str] = set()
        for page in self._pages(prefix, delimiter=True):
            for item in page.get("Contents", []):
                names.add(item["Key"].rsplit("/", 1)[-1])
            for common in page.get("CommonPrefixes", []):
                names.add(common["Prefix"].rstrip("/").rsplit("/", 1)[-1])
        return sorted(n for n in names if n)

    def put_file(self, path: Path, key: str) -> None:
        """Uploads the local file `path` (boto3's managed transfer, in parts)."""
        full = self.full(key)
        try:
            self._call(
                f"write {key}",
                lambda: self.client.upload_file(str(path), self.bucket, full),
            )
        except botocore.exceptions.ClientError as error:
            raise self.refused(error, f"write {key}") from None
        except boto3.exceptions.S3UploadFailedError as error:
            raise StoreUnreachable(f"cannot write {self.where(key)}: {error}") from None

    def get_file(self, key: str, path: Path) -> None:
        """Downloads `key` to `path` (replaced atomically). Raises FileNotFoundError."""
        full = self.full(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp"
        try:
            self._call(
                f"read {key}", lambda: self.client.download_file(self.bucket, full, str(tmp))
            )
            os.replace(tmp, path)
        except botocore.exceptions.ClientError as error:
            if _failure(error).code in ("NoSuchKey", "404"):
                raise FileNotFoundError(self.where(key)) from None
            raise self.refused(error, f"read {key}") from None
        finally:
            tmp.unlink(missing_ok=True)

    def _expires(self, size: int) -> int:
        return min(SIGNED_MAX_S, SIGNED_MIN_S + size // SLOWEST_BPS)

    def signs_digests(self) -> bool:
        """Whether the store checks the SHA-256 a URL carries (`checked`); one
        that computes its own (`computed`) is told only the algorithm."""
        if self.checksums is None:
            check_s3(self)
        return self.checksums == "checked"

    def _checksum_params(self, sha256_hex: str | None) -> tuple[dict[str, str], dict[str, str]]:
        """(presign parameters, headers the target sends) that make the store
        check (or compute) a part's SHA-256."""
        if sha256_hex is None:
            return {"ChecksumAlgorithm": "SHA256"}, {"x-amz-sdk-checksum-algorithm": "SHA256"}
        value = b64_sha256(sha256_hex)
        return {"ChecksumSHA256": value}, {"x-amz-checksum-sha256": value}

    def sign_put(self, key: str, size: int, part_sha256: Sequence[str] | None) -> SignedPut:
        """One presigned PUT per part: a single PUT for one part, else a
        multipart upload (created here, completed by `complete`). A store that
        checks digests signs each part's; one that computes them is told the
        algorithm only."""
        signs = self.signs_digests()
        full = self.full(key)
        spans = list(parts_of(size, self.part_size))
        if not signs:
            part_sha256 = None
        elif part_sha256 is None or len(spans) != len(part_sha256):
            raise StoreError(
                f"{key}: {len(part_sha256 or ())} part digests for {len(spans)} parts of "
                f"{part_length(size, self.part_size)} bytes"
            )
        upload: str | None = None
        if len(spans) > 1:
            self._abort_earlier(key)
            try:
                started = self._call(
                    f"start a multipart put of {key}",
                    lambda: self.client.create_multipart_upload(
                        Bucket=self.bucket, Key=full, ChecksumAlgorithm="SHA256"
                    ),
                )
            except botocore.exceptions.ClientError as error:
                raise self.refused(error, f"write {key}") from None
            upload = started["UploadId"]
        spanned = [SignedPart("", {}, offset, length) for offset, length in spans]
        return self.sign_again(SignedPut(key, spanned, upload), part_sha256, range(len(spans)))

    def sign_again(
        self, signed: SignedPut, part_sha256: Sequence[str] | None, indexes: Iterable[int]
    ) -> SignedPut:
        """`signed` with the parts at `indexes` (from 0) signed anew by the
        store's credentials now (refreshed first when they are about to
        expire), for the same upload; `part_sha256` as for `sign_put`. Never
        calls the store."""
        full = self.full(signed.key)
        if not self.signs_digests():
            part_sha256 = None
        size = sum(part.length for part in signed.parts)
        expires = self._expires(size)
        parts = list(signed.parts)
        for index in indexes:
            part = parts[index]
            params, headers = self._checksum_params(part_sha256[index] if part_sha256 else None)
            if signed.upload_id is None:
                url = self.client.generate_presigned_url(
                    "put_object",
                    Params={"Bucket": self.bucket, "Key": full, **params},
                    ExpiresIn=expires,
                )
            else:
                url = self.client.generate_presigned_url(
                    "upload_part",
                    Params={
                        "Bucket": self.bucket,
                        "Key": full,
                        "UploadId": signed.upload_id,
                        "PartNumber": index + 1,
                        **params,
                    },
                    ExpiresIn=expires,
                )
            parts[index] = SignedPart(url, headers, part.offset, part.length)
        return SignedPut(signed.key, parts, signed.upload_id)

    def signed_for_s(self) -> float | None:
        """How long URLs signed now stay good before the temporary credentials
        that sign them (a pod's or task's role: IRSA, ECS) expire, less
        SIGN_MARGIN_S; None for credentials that do not expire (keys), whose
        URLs last their own lifetime."""
        credentials = self.client._get_credentials()  # type: ignore[attr-defined]  # botocore's own
        if not isinstance(credentials, RefreshableCredentials):
            return None
        credentials.get_frozen_credentials()  # refreshed first when they are about to expire
        left = float(credentials._seconds_remaining())  # type: ignore[attr-defined]
        return max(MIN_SIGNED_FOR_S, left - sign_margin_s())

    def _abort_earlier(self, key: str) -> None:
        """Aborts the multipart puts of `key` begun before and never completed
        nor aborted (a process that died while it put the file): their parts
        bill until then. Raises StoreRefused when the store refuses to list them."""
        full = self.full(key)
        try:
            answer = self._call(
                f"list the unfinished puts of {key}",
                lambda: self.client.list_multipart_uploads(Bucket=self.bucket, Prefix=full),
            )
        except botocore.exceptions.ClientError as error:
            raise self.refused(error, f"list the unfinished puts of {key}") from None
        for upload in answer.get("Uploads", []):
            if upload.get("Key") == full and upload.get("UploadId"):
                self.abort(SignedPut(key, [], upload["UploadId"]))

    def abort(self, signed: SignedPut) -> None:
        """Aborts a multipart put that will not be completed (its parts bill
        until then); nothing for a single-part one. One try, never raises: a
        put it cannot abort is aborted by the next put of its key."""
        if signed.upload_id is None:
            return
        upload_id = signed.upload_id
        try:
            self.client.abort_multipart_upload(
                Bucket=self.bucket, Key=self.full(signed.key), UploadId=upload_id
            )
        except botocore.exceptions.ClientError as error:
            if _failure(error).code in ("NoSuchUpload", "404"):
                return  # completed, or aborted already
            log.warning(
                "cannot abort the unfinished put of %s (%s): its parts stay in the store "
                "until the next put of that file aborts it",
                self.where(signed.key),
                _failure(error).code or _failure(error).status,
            )
        except botocore.exceptions.BotoCoreError as error:
            log.warning(
                "cannot abort the unfinished put of %s (%s): its parts stay in the store "
                "until the next put of that file aborts it",
                self.where(signed.key),
                type(error).__name__,
            )

    def _landed(self, signed: SignedPut, part_sha256: Sequence[str]) -> bool:
        """Whether the store holds at `signed.key` the very file its parts
        make (their size, their composite SHA-256): a complete whose answer was
        lost, tried again on a store that forgets a completed upload."""
        info = self.head(signed.key)
        size = sum(part.length for part in signed.parts)
        return (
            info is not None
            and info.size == size
            and info.sha256 == expected_checksum(list(part_sha256))
        )

    def complete(self, signed: SignedPut, etags: Sequence[str], part_sha256: Sequence[str]) -> None:
        """Completes a multipart put with its parts' ETags and SHA-256s. A
        complete tried again after its answer was lost, on a store that no
        longer knows the upload, is recognised by the file it made. Raises
        StoreRefused when the store refuses it, or no longer knows an upload
        that did not land (aborted, or expired)."""
        if signed.upload_id is None:
            return
        parts = [
            {"PartNumber": number, "ETag": etag, "ChecksumSHA256": b64_sha256(digest)}
            for number, (etag, digest) in enumerate(zip(etags, part_sha256, strict=True), start=1)
        ]
        full = self.full(signed.key)
        upload_id = signed.upload_id
        try:
            self._call(
                f"complete the put of {signed.key}",
                lambda: self.client.complete_multipart_upload(
                    Bucket=self.bucket,
                    Key=full,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": parts},  # type: ignore[typeddict-item]
                ),
            )
        except botocore.exceptions.ClientError as error:
            if _failure(error).code not in ("NoSuchUpload", "404"):
                raise self.refused(error, f"complete the put of {signed.key}") from None
            if self._landed(signed, part_sha256):
                return  # this very put, completed by a try whose answer was lost
            raise StoreRefused(
                f"the store {self.url} no longer knows the put of {signed.key} in parts "
                "(it was aborted, or expired): put the file again (the retrieval that put "
                "it, or attach, tries again)"
            ) from None

    def sign_get(self, key: str) -> str:
        """A presigned GET of `key`, valid SIGNED_MIN_S seconds at least."""
        info = self.head(key)
        size = info.size if info is not None else 0
        return self.client.generate_presigned_url(
            "get_object",
            Params={"Bucket": self.bucket, "Key": self.full(key)},
            ExpiresIn=self._expires(size),
        )

    def read_dated(self, key: str, timeout_s: float | None = None) -> Dated:
        """The object `key` with the store's clock (its `Date`) and its
        `Last-Modified`, from one GET: tried once within `timeout_s` by the
        quick client, or with the store's retries when None. Raises
        StoreUnreachable; StoreRefused when the store refuses, or gives no
        usable `Date` (`store_clock`)."""
        full = self.full(key)
        client = self.client if timeout_s is None else self.quick_client(timeout_s)

        def get() -> Dated:
            try:
                answer = client.get_object(Bucket=self.bucket, Key=full)
            except botocore.exceptions.ClientError as error:
                if _failure(error).code in ("NoSuchKey", "404"):
                    return Dated(None, self.store_clock(error.response), None)
                raise
            data = answer["Body"].read()
            now = self.store_clock(answer)
            return Dated(Versioned(data, answer["ETag"]), now, answer["LastModified"].timestamp())

        try:
            if timeout_s is None:
                return self._call(f"read {key}", get)
            return self._once(f"read {key}", get)
        except botocore.exceptions.ClientError as error:
            raise self.refused(error, f"read {key}") from None

    def put_quick(self, key: str, data: bytes, etag: str | None, timeout_s: float) -> str:
        """Creates `key` (`etag` None) or replaces its version `etag`, in one
        try by the quick client (a lease's write). Raises AlreadyExists,
        Changed, StoreUnreachable (no answer: it may have landed), StoreRefused."""
        full = self.full(key)
        client = self.quick_client(timeout_s)

        def put() -> str:
            if etag is None:
                answer = client.put_object(Bucket=self.bucket, Key=full, Body=data, IfNoneMatch="*")
            else:
                answer = client.put_object(Bucket=self.bucket, Key=full, Body=data, IfMatch=etag)
            return answer["ETag"]

        try:
            return self._once(f"write {key}", put)
        except botocore.exceptions.ClientError as error:
            failure = _failure(error)
            if failure.status in (409, 412) or failure.code in (
                "PreconditionFailed",
                "ConditionalRequestConflict",
                "NoSuchKey",
            ):
                if etag is None:
                    raise AlreadyExists(f"{self.where(key)} exists") from None
                raise Changed(f"{self.where(key)} changed since it was read") from None
            raise self.refused(error, f"write {key}") from None

    @contextmanager
    def lock(self, key: str, holder: Mapping[str, object]) -> Iterator[Lease]:
        """A lease on `key` (see `store/lease.py`); the block gets it, to ask
        whether it still holds it (`lost`, `check`). Raises Busy."""
        with Lease(self, key, holder) as lease:
            yield lease

    def holder(self, key: str) -> str | None:
        """Who holds the lease `key`, None when it is free or expired."""
        return lease_holder(self, key)
