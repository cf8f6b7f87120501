"""The one look at a store before anything of a run exists: it answers, the
credentials are good, the bucket is there, it dates its answers with a sane
clock (its `Date`: a lease's expiry is the store's clock), it refuses a create over an
existing key and a replace of a changed one (without which two workers could
overwrite each other's records), and it checks or computes the SHA-256 of
what a target puts (without which nothing put could be verified). Each
failure is one line saying what to do; nothing is left behind but the probe's
own objects, which are deleted."""

from __future__ import annotations

import hashlib
import secrets
from typing import TYPE_CHECKING

import botocore.exceptions

from overbrainer_prefect.store.base import AlreadyExists, Changed, StoreRefused
from overbrainer_prefect.store.digest import b64_sha256, hex_sha256

if TYPE_CHECKING:
    from overbrainer_prefect.store.s3 import ChecksumMode, S3Store

PROBE_DIR = ".overbrainer-probe"
"""Where the check writes its probe objects (deleted after)."""

_CHECKED: dict[str, ChecksumMode] = {}
"""Stores this process checked already, by URL: a store is checked once."""


def check_s3(store: S3Store) -> None:
    """Checks an object store once per process (see the module), after a
    first contact that refuses within seconds a store that does not answer
    at all (`S3Store.probe`); sets how it
    knows a put's SHA-256 (`store.checksums`). Raises StoreUnreachable or
    StoreRefused with one line."""
    if store.url in _CHECKED:
        store.checksums = _CHECKED[store.url]
        return
    store.probe()  # a store not there at all: refused within seconds, not waited for
    try:
        found = store._call(
            "find the bucket", lambda: store.client.head_bucket(Bucket=store.bucket)
        )
    except botocore.exceptions.ClientError as error:
        raise store.refused(error, "show its bucket") from None
    store.store_clock(found)
    key = f"{PROBE_DIR}/{secrets.token_hex(8)}"
    try:
        first = store.create(key, b"first")
        try:
            store.create(key, b"second")
        except AlreadyExists:
            pass
        else:
            raise StoreRefused(
                f"the store {store.url} ignores conditional writes (a create over an existing "
                "key was not refused): two workers could overwrite each other's records; use "
                "a store that honours If-None-Match and If-Match (AWS S3, MinIO, R2)"
            )
        try:
            store.replace(key, b"third", '"0000"')
        except Changed:
            pass
        else:
            raise StoreRefused(
                f"the store {store.url} ignores If-Match (a replace of a changed object was "
                "not refused): use a store that honours conditional writes (AWS S3, MinIO, R2)"
            )
        store.replace(key, b"fourth", first)
        store.checksums = checksum_mode(store)
    finally:
        store.delete(key)  # its own probe only: another process may be checking the store too
    _CHECKED[store.url] = store.checksums


def checksum_mode(store: S3Store) -> ChecksumMode:
    """How the store knows the SHA-256 of a put: `checked` when it refuses a
    put whose `x-amz-checksum-sha256` is wrong; `computed` when it does not
    but computes one when asked and reports it. Raises StoreRefused when it
    does neither."""
    data = secrets.token_bytes(64)
    digest = hashlib.sha256(data).hexdigest()
    wrong = hashlib.sha256(data + b"!").hexdigest()
    key = store.full(f"{PROBE_DIR}/{secrets.token_hex(8)}")

    def put(**extra: str) -> bool:
        try:
            store._call(
                "check its checksums",
                lambda: store.client.put_object(
                    Bucket=store.bucket,
                    Key=key,
                    Body=data,
                    **extra,  # type: ignore[arg-type]
                ),
            )
        except botocore.exceptions.ClientError as error:
            code = error.response.get("Error", {}).get("Code", "")
            if code in ("BadDigest", "InvalidRequest", "XAmzContentChecksumMismatch", "400"):
                return False
            raise store.refused(error, "take a put with a checksum") from None
        return True

    def reported() -> str | None:
        answer = store._call(
            "check its checksums",
            lambda: store.client.head_object(Bucket=store.bucket, Key=key, ChecksumMode="ENABLED"),
        )
        value = answer.get("ChecksumSHA256")
        return hex_sha256(value) if value else None

    try:
        if not put(ChecksumSHA256=b64_sha256(wrong)):
            return "checked"
        if put(ChecksumAlgorithm="SHA256") and reported() == digest:
            return "computed"
    finally:
        store._call(
            "check its checksums",
            lambda: store.client.delete_object(Bucket=store.bucket, Key=key),
        )
    raise StoreRefused(
        f"the store {store.url} neither checks nor computes the SHA-256 of what it is given: "
        "nothing put there could be verified; use a store with S3 checksums (AWS S3, MinIO, R2)"
    )
