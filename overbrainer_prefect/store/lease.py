"""A lock on an object store: a lease object naming its holder and its TTL,
taken by a conditional create (or by a conditional replace of an expired or
released one) and renewed by compare-and-swap from a thread of its holder's.

A lease is a promise, kept or let go:

- **Expiry is the store's clock.** A lease has expired when the store's own
  time (the `Date` of its answer) is past its last write (the object's
  `Last-Modified`, also the store's) by more than its TTL (plus the second
  both are rounded to), so a machine whose clock is off neither steals a
  live lease nor keeps a dead one. No holder's clock is ever compared.
- **A renewal is bounded well under the TTL.** Each is one request with its
  own short timeouts (`CALL_PARTS`: a quarter of the TTL from send to
  give-up), never the store's long outage retries. The holder counts its
  lease from when it *sent* its last renewal that landed (the store applied
  it later, so the lease lasts at least that long in the store's time), and
  calls it lost once `KEEP_PART` of the TTL passed since without another:
  before any other process can take it.
- **A lost lease is said, and checked.** `lost` turns true at once (it is
  judged on each look, not by the renewing thread), `check` raises LeaseLost;
  the holder checks before every act it could not take back.

A renewal whose answer was lost (it landed) is recognised by the write's own
nonce in the lease, never taken for a race lost.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol, runtime_checkable

from overbrainer_prefect.store.base import (
    AlreadyExists,
    Busy,
    Changed,
    LeaseLost,
    StoreError,
    StoreUnreachable,
    Versioned,
    holder_text,
)
from overbrainer_prefect.timestamps import rfc3339

log = logging.getLogger(__name__)

TTL_ENV = "OVERBRAINER_LEASE_TTL_S"
TTL_S = 60.0
"""How long a lease outlives its last renewal: a dead holder's run is taken
over by another process within this (and a second)."""
CALL_PARTS = 4  # a lease request gives up after TTL/4 (connect and read: TTL/8 each)
RENEWALS_PER_TTL = 4  # a lease is renewed every TTL/4, so one lost renewal costs nothing
KEEP_PART = 0.75  # a holder keeps its lease this part of the TTL after its last renewal's send
CLOCK_ROUNDING_S = 1.0  # `Date` and `Last-Modified` are whole seconds (RFC 7231)
TAKE_TRIES = 5  # rounds of read-and-decide before a lease that keeps changing is called busy
TAKE_PAUSE_S = 0.5  # the first pause before a take whose store did not answer tries again
TAKE_PAUSE_MAX_S = 10.0


def ttl_s() -> float:
    """`$OVERBRAINER_LEASE_TTL_S`, else TTL_S (at least 2 s: the store's clock is in seconds)."""
    try:
        return max(2.0, float(os.environ.get(TTL_ENV) or TTL_S))
    except ValueError:
        return TTL_S


@dataclass(frozen=True)
class Dated:
    """A lease object read with the store's clock: the object and its version
    (None: none), the store's time when it answered (its `Date`, Unix
    seconds) and when the object was last written (its `Last-Modified`)."""

    found: Versioned | None
    store_now: float
    modified: float | None


@runtime_checkable
class LeaseStore(Protocol):
    """What a lease needs of its store: reads that carry the store's clock, and
    conditional writes that give up within a timeout of their own."""

    @property
    def outage_s(self) -> float:
        """How long the store is tried again, at most, before StoreUnreachable."""
        ...

    def where(self, key: str) -> str:
        """How messages name `key`."""
        ...

    def read_dated(self, key: str, timeout_s: float | None = None) -> Dated:
        """`key` with the store's clock; one try within `timeout_s` (None: the
        store's own retries). Raises StoreUnreachable, and StoreRefused when
        the store gives no usable `Date` or `Last-Modified`."""
        ...

    def put_quick(self, key: str, data: bytes, etag: str | None, timeout_s: float) -> str:
        """Creates `key` (`etag` None) or replaces its version `etag`, in one try
        that gives up within `timeout_s`. Raises AlreadyExists, Changed,
        StoreUnreachable (no answer: it may have landed), StoreRefused."""
        ...


def _parse(data: bytes) -> dict[str, object]:
    try:
        parsed = json.loads(data)
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _live(lease: Mapping[str, object], dated: Dated) -> bool:
    """Whether `lease`, read as `dated`, is held now, by the store's clock alone."""
    if lease.get("released") or dated.modified is None:
        return False
    ttl = lease.get("ttl")
    ttl = float(ttl) if isinstance(ttl, int | float) else TTL_S
    return dated.store_now - dated.modified < ttl + CLOCK_ROUNDING_S


def _holder(lease: Mapping[str, object]) -> str:
    holder = lease.get("holder")
    return holder_text(holder) if isinstance(holder, dict) else "another process"


def lease_holder(store: LeaseStore, key: str) -> str | None:
    """Who holds the lease `key` now, None when nobody does (none, released,
    expired by the store's clock). Raises StoreError."""
    held = lease_held(store, key)
    return held[0] if held is not None else None


def lease_held(store: LeaseStore, key: str) -> tuple[str, float] | None:
    """Who holds the lease `key` now and when it lapses unless renewed (Unix
    seconds, by the store's clock: its last write plus its TTL), from one
    read; None when nobody holds it. Raises StoreError."""
    dated = store.read_dated(key)
    if dated.found is None or dated.modified is None:
        return None
    lease = _parse(dated.found.data)
    if not _live(lease, dated):
        return None
    ttl = lease.get("ttl")
    return _holder(lease), dated.modified + (float(ttl) if isinstance(ttl, int | float) else TTL_S)


class Lease:
    """The lease `key` of `store`, held by this process for the length of a
    `with` block (see the module); the block gets the lease itself, whose
    `lost` and `check` say whether it still holds. Raises Busy on entering
    when another live holder has it."""

    def __init__(
        self, store: LeaseStore, key: str, holder: Mapping[str, object], ttl: float | None = None
    ) -> None:
        self.store = store
        self.key = key
        self.ttl = ttl if ttl is not None else ttl_s()
        self.call_s = self.ttl / CALL_PARTS
        """How long one lease request waits, from send to give-up."""
        self.holder = {"pid": os.getpid(), "host": socket.gethostname(), **holder}
        self.token = secrets.token_hex(16)
        self._etag: str | None = None
        self._kept_from: float | None = None  # monotonic send of the last write that landed
        self._sends: dict[str, float] = {}  # nonce → monotonic send, of writes not yet answered
        self._why: str | None = None
        self._lost_at: str | None = None
        self._taken = False
        self._looked = False  # whether a check looked who took the lease
        self._guard = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- what the holder looks at ------------------------------------------------------

    @property
    def lost(self) -> bool:
        """Whether this process no longer holds the lease: another took it, or
        it could not be renewed in time (another may take it any moment)."""
        with self._guard:
            kept = self._kept_from
            late = kept is not None and time.monotonic() >= kept + self.ttl * KEEP_PART
            if self._why is None and late:
                self._lose_locked(
                    f"not renewed for {self.ttl * KEEP_PART:g} s of its {self.ttl:g} s TTL"
                )
            return self._why is not None

    @property
    def why(self) -> str | None:
        """Why the lease was lost (None while it is held)."""
        return self._why if self.lost else None

    @property
    def lost_at(self) -> str | None:
        """When this process found the lease lost (RFC 3339; the store's time
        when it answered, else this machine's), None while it is held."""
        return self._lost_at if self.lost else None

    @property
    def taken(self) -> bool:
        """Whether another process took the lease (not only: it could not be renewed)."""
        return self._taken

    def check(self) -> None:
        """Raises LeaseLost (saying why, and who took it when another process
        did: the first check after the loss looks, once, within `call_s`)
        when the lease is lost; nothing while held."""
        if not self.lost:
            return
        if not self._taken and not self._looked:
            self._looked = True
            self._watch()
        raise LeaseLost(self.key, self._why or "", self._lost_at or rfc3339(), self._taken)

    def _lose_locked(self, why: str, at: float | None = None, taken: bool = False) -> None:
        if self._why is not None:
            return
        self._why = why
        self._taken = taken
        self._lost_at = rfc3339() if at is None else _rfc3339_of(at)
        log.error("the lease %s is lost since %s: %s", self.key, self._lost_at, why)

    def _lose(self, why: str, at: float | None = None, taken: bool = False) -> None:
        with self._guard:
            self._lose_locked(why, at, taken)

    # -- taking, renewing, releasing ---------------------------------------------------

    def _content(self, nonce: str, released: bool = False) -> bytes:
        lease = {
            "holder": self.holder,
            "token": self.token,
            "nonce": nonce,
            "ttl": self.ttl,
            "released": released,
        }
        return json.dumps(lease).encode()

    def _landed(self, sent: float, etag: str) -> None:
        with self._guard:
            self._etag = etag
            if self._kept_from is None or sent > self._kept_from:
                self._kept_from = sent
            self._sends = {n: s for n, s in self._sends.items() if s > sent}

    def _put(self, etag: str | None) -> None:
        """One conditional write of the lease (see `put_quick`), remembered by its nonce."""
        nonce = secrets.token_hex(8)
        sent = time.monotonic()
        with self._guard:
            self._sends[nonce] = sent
        new = self.store.put_quick(self.key, self._content(nonce), etag, self.call_s)
        self._landed(sent, new)

    def _mine(self, dated: Dated) -> bool:
        """Whether the lease read is a write of this holder's whose answer was
        lost; then it is kept from that write's send."""
        if dated.found is None:
            return False
        lease = _parse(dated.found.data)
        nonce = lease.get("nonce")
        if lease.get("token") != self.token or not isinstance(nonce, str):
            return False
        with self._guard:
            sent = self._sends.get(nonce)
        if sent is None or lease.get("released"):
            return False
        self._landed(sent, dated.found.etag)
        return True

    def take(self) -> None:
        """Takes the lease: creates it, or replaces one that expired or was
        released (by the store's clock). Raises Busy when a live holder has
        it; StoreUnreachable when the store does not answer for its outage
        bound."""
        deadline = time.monotonic() + self.store.outage_s
        pause = TAKE_PAUSE_S
        for _ in range(TAKE_TRIES):
            while True:
                try:
                    dated = self.store.read_dated(self.key, self.call_s)
                    if self._mine(dated):
                        return
                    if dated.found is not None:
                        lease = _parse(dated.found.data)
                        if _live(lease, dated):
                            raise Busy(self.key, _holder(lease))
                    self._put(dated.found.etag if dated.found is not None else None)
                    return
                except (AlreadyExists, Changed):
                    break  # another process wrote it meanwhile: decide again
                except StoreUnreachable as error:
                    if time.monotonic() + pause > deadline:
                        raise
                    log.warning("cannot take the lease %s now (%s); again", self.key, error)
                    time.sleep(pause)
                    pause = min(pause * 2, TAKE_PAUSE_MAX_S)
        raise Busy(self.key, "another process (its lease keeps changing)")

    def renew(self) -> bool:
        """Pushes the lease one TTL ahead, in one request bounded by `call_s`.
        False (and `lost`) when another process took it or it could not be
        renewed in time; True when held (a renewal the store did not answer
        is tried again at the next turn, while the lease is kept)."""
        if self.lost:
            return False
        with self._guard:
            etag = self._etag
        try:
            self._put(etag)
            return not self.lost
        except Changed:
            pass
        except StoreError as error:  # no answer: the next turn tries again, within the TTL
            log.warning("cannot renew the lease %s now: %s", self.key, error)
            return not self.lost
        try:  # a race lost, or a renewal of this holder's that landed with its answer lost
            dated = self.store.read_dated(self.key, self.call_s)
        except StoreError as error:
            log.warning("cannot read the lease %s now: %s", self.key, error)
            return not self.lost
        if self._mine(dated):
            return not self.lost
        self._taken_by(dated)
        return False

    def _taken_by(self, dated: Dated) -> None:
        """Records the lease lost to whoever holds it as `dated` read it."""
        taker = _holder(_parse(dated.found.data)) if dated.found is not None else "nobody"
        why = (
            f"it was taken by {taker} (it was not renewed for longer than its TTL, {self.ttl:g} s)"
        )
        with self._guard:
            if self._why is None or not self._taken:
                self._why = None  # a lease found late is said taken, by whom and when
                self._lose_locked(why, dated.store_now, taken=dated.found is not None)

    def _watch(self) -> bool:
        """Once the lease is lost for want of renewal: whether another process
        took it since (then it is said taken, by whom and when). A renewal of
        this holder's that landed late (its answer never came) is released,
        so the next process need not wait a TTL more for a lease nobody holds.
        False when it was taken or the lease is gone: nothing more to watch."""
        try:
            dated = self.store.read_dated(self.key, self.call_s)
        except StoreError:
            return True
        if dated.found is None:
            return False
        lease = _parse(dated.found.data)
        if lease.get("token") == self.token:
            if _live(lease, dated):  # a failed release: the next look tries again
                with contextlib.suppress(StoreError):
                    released = self._content("released", released=True)
                    self.store.put_quick(self.key, released, dated.found.etag, self.call_s)
            return True
        if not _live(lease, dated):
            return True
        self._taken_by(dated)
        return False

    def release(self) -> None:
        """Marks the lease released (a compare-and-swap: a lease taken
        meanwhile is left to its new holder). Never raises."""
        if self.lost or self._etag is None:
            return
        try:
            self.store.put_quick(
                self.key, self._content("released", released=True), self._etag, self.call_s
            )
        except Changed:
            pass
        except StoreError as error:
            log.warning("cannot release %s (it expires by itself): %s", self.key, error)

    def _renewing(self) -> None:
        while not self._stop.wait(self.ttl / RENEWALS_PER_TTL):
            if self.lost:  # let go: watch only whether another process takes it, to say so
                if self._taken or not self._watch():
                    return
            else:
                self.renew()

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
            self._thread.join(self.call_s * 2)  # a renewal gives up within call_s
        self.release()


def _rfc3339_of(seconds: float) -> str:
    from datetime import UTC, datetime

    return rfc3339(datetime.fromtimestamp(seconds, UTC))
