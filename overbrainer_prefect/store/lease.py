"""A lock on an object store: a lease object naming its holder and when it
expires, taken by a conditional create (or by a conditional replace of an
expired or released one) and renewed by compare-and-swap from a thread of
its holder's. A holder that dies stops renewing: its lease expires within
its TTL and the next process takes it. A holder that finds its lease taken
(it stopped renewing for longer than the TTL) says so and stops renewing;
the record writes it still makes are compare-and-swaps that then fail.

Expiries are in the holders' wall-clock time: machines that share a store keep
their clocks synchronised (NTP) to well within the TTL.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Mapping
from types import TracebackType
from typing import TYPE_CHECKING

from overbrainer_prefect.store.base import (
    AlreadyExists,
    Busy,
    Changed,
    StoreError,
    holder_text,
)

if TYPE_CHECKING:
    from overbrainer_prefect.store.base import Store

log = logging.getLogger(__name__)

TTL_ENV = "OVERBRAINER_LEASE_TTL_S"
TTL_S = 60.0
"""How long a lease outlives its last renewal: a dead holder's run is taken
over by another process within this."""
RENEWALS_PER_TTL = 3  # a lease is renewed this many times a TTL, so one lost renewal costs nothing
TAKE_TRIES = 5  # rounds of read-and-decide before a lease that keeps changing is called busy


def ttl_s() -> float:
    """`$OVERBRAINER_LEASE_TTL_S`, else TTL_S."""
    try:
        return max(1.0, float(os.environ.get(TTL_ENV) or TTL_S))
    except ValueError:
        return TTL_S


def _parse(data: bytes) -> dict[str, object]:
    try:
        parsed = json.loads(data)
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _live(lease: Mapping[str, object], now: float) -> bool:
    expires = lease.get("expires")
    return not lease.get("released") and isinstance(expires, int | float) and float(expires) > now


def lease_holder(store: Store, key: str) -> str | None:
    """Who holds the lease `key` now, None when nobody does (none, released, expired)."""
    current = store.read(key)
    if current is None:
        return None
    lease = _parse(current.data)
    if not _live(lease, time.time()):
        return None
    holder = lease.get("holder")
    return holder_text(holder) if isinstance(holder, dict) else "another process"


class Lease:
    """The lease `key` of `store`, held by this process for the length of a
    `with` block (see the module). Raises Busy on entering when another live
    holder has it."""

    def __init__(
        self, store: Store, key: str, holder: Mapping[str, object], ttl: float | None = None
    ) -> None:
        self.store = store
        self.key = key
        self.ttl = ttl if ttl is not None else ttl_s()
        self.holder = {"pid": os.getpid(), "host": socket.gethostname(), **holder}
        self.token = secrets.token_hex(16)
        self.lost = False
        """Whether another process took the lease while this one held it."""
        self._etag: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _content(self, released: bool = False) -> bytes:
        lease = {
            "holder": self.holder,
            "token": self.token,
            "expires": time.time() + self.ttl,
            "released": released,
        }
        return json.dumps(lease).encode()

    def take(self) -> None:
        """Takes the lease: creates it, or replaces one that expired or was
        released. Raises Busy when a live holder has it."""
        for _ in range(TAKE_TRIES):
            current = self.store.read(self.key)
            try:
                if current is None:
                    self._etag = self.store.create(self.key, self._content())
                    return
                lease = _parse(current.data)
                if _live(lease, time.time()) and lease.get("token") != self.token:
                    holder = lease.get("holder")
                    raise Busy(
                        self.key,
                        holder_text(holder) if isinstance(holder, dict) else "another process",
                    )
                self._etag = self.store.replace(self.key, self._content(), current.etag)
                return
            except (AlreadyExists, Changed):
                continue
        raise Busy(self.key, "another process (its lease keeps changing)")

    def renew(self) -> bool:
        """Pushes the lease's expiry one TTL ahead; False (and `lost`) when
        another process took it."""
        if self._etag is None or self.lost:
            return False
        try:
            self._etag = self.store.replace(self.key, self._content(), self._etag)
            return True
        except Changed:
            self.lost = True
            log.error(
                "the lease %s was taken by another process (%s): this one stopped renewing it "
                "for longer than its TTL (%g s); it no longer follows what the lease guards",
                self.store.where(self.key),
                lease_holder(self.store, self.key) or "nobody now",
                self.ttl,
            )
            return False

    def release(self) -> None:
        """Marks the lease released (a compare-and-swap: a lease taken
        meanwhile is left to its new holder)."""
        if self._etag is None or self.lost:
            return
        try:
            self.store.replace(self.key, self._content(released=True), self._etag)
        except Changed:
            pass
        except StoreError as error:
            log.warning("cannot release %s (it expires by itself): %s", self.key, error)

    def _renewing(self) -> None:
        while not self._stop.wait(self.ttl / RENEWALS_PER_TTL):
            try:
                if not self.renew():
                    return
            except StoreError as error:  # the next renewal tries again, within the TTL
                log.warning("cannot renew the lease %s: %s", self.key, error)

    def __enter__(self) -> Lease:
        self.take()
        self._thread = threading.Thread(
            target=self._renewing, name=f"lease {self.key}", daemon=True
        )
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.ttl)  # a renewal stuck in an outage is left to expire
        self.release()
