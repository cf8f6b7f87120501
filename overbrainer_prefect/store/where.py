"""Which store a runs directory names: a local path (as always), or an object
store URL `s3://bucket/prefix` (any S3-compatible endpoint: the URL's
`?endpoint_url=`, else boto3's own `AWS_ENDPOINT_URL_S3` / `AWS_ENDPOINT_URL`,
else AWS). Credentials never appear in the URL: they come from boto3's
chain, or from the credentials block the flows layer installs (`use_clients`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import parse_qs, urlsplit

from overbrainer_prefect.store.base import Store, StoreRefused
from overbrainer_prefect.store.local import LocalStore
from overbrainer_prefect.store.s3 import S3Store, default_client

if TYPE_CHECKING:
    from botocore.config import Config
    from mypy_boto3_s3 import S3Client

RUNS_ROOT_ENV = "OVERBRAINER_RUNS_DIR"
"""Environment variable naming the runs directory (a path or an `s3://` URL);
default `./runs`."""
RUNS_DIR = "runs"

ClientFactory = Callable[[str | None, "Config"], "S3Client"]
"""Makes an S3 client for an endpoint (None: boto3's own) with the given settings."""

_clients: ClientFactory = default_client
_opened: dict[str, S3Store] = {}
_lock = threading.Lock()


def use_clients(factory: ClientFactory) -> None:
    """Makes every object store opened from now on get its client from
    `factory` (the flows layer: a credentials block when one is named)."""
    global _clients
    with _lock:
        _clients = factory
        _opened.clear()


def is_url(where: str | Path | None) -> bool:
    """Whether `where` names an object store rather than a local directory."""
    return isinstance(where, str) and "://" in where


def runs_location(where: str | Path | None = None) -> str | Path:
    """What a runs directory names: `where`, else `$OVERBRAINER_RUNS_DIR`, else `./runs`."""
    if where is not None and str(where) != "":
        return where
    return os.environ.get(RUNS_ROOT_ENV) or RUNS_DIR


def open_store(where: str | Path | None = None) -> Store:
    """The store a runs directory names (see the module and `runs_location`);
    an object store is opened once per process and URL.

    Raises StoreRefused, with one line, for a URL that is not `s3://bucket[/prefix]`.
    """
    location = runs_location(where)
    if not is_url(location):
        return LocalStore(Path(location).absolute())
    text = str(location)
    parts = urlsplit(text)
    if parts.scheme != "s3" or not parts.netloc:
        raise StoreRefused(
            f"{text.split('?')[0]!r} is not a runs directory: give a local path or "
            "s3://bucket/prefix"
        )
    query = parse_qs(parts.query)
    unknown = sorted(set(query) - {"endpoint_url"})
    if unknown:
        raise StoreRefused(
            f"s3://{parts.netloc}{parts.path}: unknown setting {unknown[0]!r} "
            "(only endpoint_url is read from the URL)"
        )
    endpoint = query.get("endpoint_url", [None])[0]
    bucket, prefix = parts.netloc, parts.path.strip("/")
    key = f"{bucket}/{prefix}?{endpoint or ''}"
    with _lock:
        store = _opened.get(key)
        if store is None:
            factory = _clients
            store = S3Store(bucket, prefix, lambda config: factory(endpoint, config), endpoint)
            _opened[key] = store
        return store
