"""The runs directory a flow works in, as Prefect users give it: a path, or an
object store URL (`s3://bucket/prefix`) whose credentials come from a
prefect-aws block named by `OVERBRAINER_STORE_CREDENTIALS` (an
`AwsCredentials`, a `MinIOCredentials`, or an `S3Bucket` whose credentials
are used), else from boto3's own chain (the environment, a profile, the
worker's role). An object store is checked once per process, before
anything of a run exists (`store/check.py`): a store that cannot be used
stops the flow in one line, having created nothing.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefect.blocks.core import Block

from overbrainer_prefect.runs.store import Runs
from overbrainer_prefect.store import S3Store, StoreRefused, use_clients
from overbrainer_prefect.store.check import check_s3
from overbrainer_prefect.store.s3 import client_config, default_client

if TYPE_CHECKING:
    from botocore.config import Config
    from mypy_boto3_s3 import S3Client

CREDENTIALS_ENV = "OVERBRAINER_STORE_CREDENTIALS"
"""Names the prefect-aws block (`aws-credentials/NAME`, `minio-credentials/NAME`,
`s3-bucket/NAME`) whose credentials open the runs' object store."""


def block_client(endpoint_url: str | None, config: Config | None = None) -> S3Client:
    """The S3 client of the runs' object store, with `config` (else
    `client_config`): from the credentials block
    `$OVERBRAINER_STORE_CREDENTIALS` names (its own endpoint unless the URL
    gives one), else from boto3's chain. Raises StoreRefused with one line
    when the block cannot be loaded or holds no credentials."""
    name = os.environ.get(CREDENTIALS_ENV)
    if not name:
        return default_client(endpoint_url, config)
    # here, not at the top: prefect-aws imports its workers too (about a second of a
    # core), which every flow process would pay without a credentials block to load
    from prefect_aws import AwsCredentials, MinIOCredentials, S3Bucket

    try:
        block: Any = Block.load(name, _sync=True)  # type: ignore[call-arg]
    except Exception as error:  # Prefect's own one-line reasons (no such block, no server)
        raise StoreRefused(
            f"cannot load the store's credentials block {name!r} ({type(error).__name__}): "
            f"create it, or fix {CREDENTIALS_ENV}"
        ) from None
    if isinstance(block, S3Bucket):
        block = block.credentials
    if not isinstance(block, AwsCredentials | MinIOCredentials):
        raise StoreRefused(
            f"the block {name!r} holds no AWS or MinIO credentials: name an aws-credentials, "
            f"minio-credentials or s3-bucket block in {CREDENTIALS_ENV}"
        )
    endpoint = endpoint_url or block.aws_client_parameters.endpoint_url
    client: S3Client = block.get_boto3_session().client(
        "s3", endpoint_url=endpoint, config=config or client_config()
    )
    return client


use_clients(block_client)


async def runs_at(runs_dir: str | Path | None) -> Runs:
    """The runs directory `runs_dir` names (see `Runs`); an object store
    checked first, once per process (its client made here, off the event
    loop). Raises StoreRefused or StoreUnreachable with one line, before
    anything exists."""
    runs = Runs(runs_dir)
    if isinstance(runs.store, S3Store):
        await asyncio.to_thread(check_s3, runs.store)
    return runs
