"""Where runs live: a local directory or an object store, behind one interface
(`Store`); records changed by compare-and-swap, locks held by one live holder."""

from overbrainer_prefect.store.base import (
    AlreadyExists,
    Busy,
    Changed,
    Held,
    LeaseLost,
    ObjectInfo,
    SignedPut,
    Store,
    StoreError,
    StoreRefused,
    StoreUnreachable,
    Versioned,
    update,
)
from overbrainer_prefect.store.local import LocalStore
from overbrainer_prefect.store.s3 import S3Store
from overbrainer_prefect.store.where import is_url, open_store, use_clients

__all__ = [
    "AlreadyExists",
    "Busy",
    "Changed",
    "Held",
    "LeaseLost",
    "LocalStore",
    "ObjectInfo",
    "S3Store",
    "SignedPut",
    "Store",
    "StoreError",
    "StoreRefused",
    "StoreUnreachable",
    "Versioned",
    "is_url",
    "open_store",
    "update",
    "use_clients",
]
