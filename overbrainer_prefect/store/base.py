"""The store protocol: where the runs directory lives, a local directory or an
object store (`s3://bucket/prefix`), behind one interface, so that nothing
above it learns which.

A store holds objects by key (a relative POSIX path: `R/run.json`,
`.ledger/ledger.json`). Every record change is a compare-and-swap: `create`
refuses a key that exists, `replace` refuses a key whose version (`etag`) is
no longer the one read, so two writers on two machines never overwrite each
other: the loser re-reads and decides again (`update`). A lock (`lock`) is
held by one live holder at a time: a kernel lock on a local directory, a
lease with an expiry renewed by compare-and-swap on an object store.

An object store also hands a target short-lived URLs to put and get files
itself (`sign_put`, `sign_get`), so that a model's bytes go from the job to
the store and back without passing through the worker.
"""

from __future__ import annotations

import posixpath
import random
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

UPDATE_TRIES = 30  # compare-and-swap rounds an update makes before it gives up (a hot key)
RACE_PAUSE_S = 0.005  # the first pause after a lost race (doubled each time, randomised)
RACE_PAUSE_MAX_S = 0.5

CHUNK = 16 << 20
"""Bytes each part of a file put in several parts holds (the last may hold
fewer; at most the store's `part_size`): AWS's CLI puts 8 MiB parts, rclone
5 MiB ones. A part moves in well under a second at a pod's speeds, so a
failed try costs little to repeat; a target holds a few in memory while it
puts them over several connections at once (which hides each request's
round trip); a store handles it in buffers it reuses (moto concatenates the
parts, then hashes them again, when a put completes); and MAX_PARTS of them
still make a 160 GiB file (a bigger file gets bigger parts)."""
MAX_PARTS = 10_000  # S3's most parts of one file


class StoreError(Exception):
    """The store cannot do what was asked. The message is one line; it never
    quotes a credential or an object's content."""


class StoreUnreachable(StoreError):
    """The store did not answer (refused, timed out, a 5xx): transient, tried
    again with backoff within the store's outage bound."""


class StoreRefused(StoreError):
    """The store answered no for good: wrong credentials, no such bucket, no
    permission, an endpoint that ignores conditional writes."""


class AlreadyExists(StoreError):
    """A create over a key that exists: another writer made it first."""


class Changed(StoreError):
    """A replace whose version is no longer the one read (or whose key is
    gone): another writer changed it first."""


class Busy(StoreError):
    """A lock another live holder holds. `holder` says who, for messages."""

    def __init__(self, key: str, holder: str) -> None:
        super().__init__(f"{key} is held by {holder}")
        self.holder = holder


class LeaseLost(Exception):
    """A lock this process held is no longer its own: another process took it
    (`taken`), or it could not be renewed in time. Not a StoreError: nothing
    may go on as if the store had only failed once. `key`, `why` and `at`
    (RFC 3339) say which, why and when it was found lost."""

    def __init__(self, key: str, why: str, at: str, taken: bool) -> None:
        super().__init__(f"{key} is no longer held by this process since {at}: {why}")
        self.key, self.why, self.at, self.taken = key, why, at, taken


class Held(Protocol):
    """A lock held: whether it still is (a local lock always, a lease until
    another process takes it or it cannot be renewed in time)."""

    @property
    def lost(self) -> bool:
        """Whether this process no longer holds the lock."""
        ...

    @property
    def why(self) -> str | None:
        """Why it was lost, None while it is held."""
        ...

    @property
    def lost_at(self) -> str | None:
        """When it was found lost (RFC 3339), None while it is held."""
        ...

    @property
    def taken(self) -> bool:
        """Whether another process took it (not only: it could not be renewed)."""
        ...

    def check(self) -> None:
        """Raises LeaseLost when the lock is lost."""
        ...


class Kept:
    """A lock that stays held as long as its holder lives (a kernel lock)."""

    lost = False
    why: str | None = None
    lost_at: str | None = None
    taken = False

    def check(self) -> None:
        """Nothing: a kernel lock is not lost while its holder lives."""


@dataclass(frozen=True)
class Versioned:
    """An object's content and its version, read together (never a version of
    other content)."""

    data: bytes
    etag: str


@dataclass(frozen=True)
class ObjectInfo:
    """One object: its key (relative to the store), size, and the SHA-256 (lowercase
    hex) the store checked or computed for it, when it keeps one."""

    key: str
    size: int
    sha256: str | None = None


@dataclass(frozen=True)
class SignedPart:
    """One request a target makes to put part of a file: the URL, the headers
    it must send as they are, and the bytes of the file it carries."""

    url: str
    headers: Mapping[str, str]
    offset: int
    length: int


@dataclass(frozen=True)
class SignedPut:
    """How a target puts one file into the store: one request per part (one
    part below the store's part size). `upload_id` names a multipart upload
    the store completes once every part is in."""

    key: str
    parts: Sequence[SignedPart]
    upload_id: str | None = None


@runtime_checkable
class Store(Protocol):
    """Objects by key, changed only by compare-and-swap. Every method raises
    StoreUnreachable when the store stays unreachable past its outage bound,
    StoreRefused when it refuses for good; keys are checked (`check_key`)."""

    @property
    def url(self) -> str:
        """How messages name the store (`/path/runs`, `s3://bucket/prefix`), never
        with a credential."""
        ...

    @property
    def location(self) -> str:
        """What opens this store again in another process (`open_store`): its
        path, or its URL with its endpoint; never a credential."""
        ...

    @property
    def direct(self) -> bool:
        """Whether a target puts and gets files itself by signed URLs (an
        object store); otherwise they pass through this machine (a local one)."""
        ...

    def local_path(self, key: str) -> Path | None:
        """The file that holds `key` on this machine (a local store), else None."""
        ...

    def where(self, key: str) -> str:
        """How messages name `key` (a path, or an `s3://` URL)."""
        ...

    def read(self, key: str) -> Versioned | None:
        """The object `key` and its version, None when there is none."""
        ...

    def create(self, key: str, data: bytes) -> str:
        """Creates `key`; returns its version. Raises AlreadyExists when it exists."""
        ...

    def replace(self, key: str, data: bytes, etag: str) -> str:
        """Replaces `key` if its version is still `etag`; returns the new version.
        Raises Changed when it is not (or the key is gone)."""
        ...

    def write(self, key: str, data: bytes) -> None:
        """Writes `key` whatever it holds: only for a file one writer owns (a
        log, a manifest), never a record two processes change."""
        ...

    def delete(self, key: str) -> None:
        """Deletes `key`; nothing when it is not there."""
        ...

    def head(self, key: str) -> ObjectInfo | None:
        """What the store knows of `key` (its size and checked SHA-256), None
        when it is not there."""
        ...

    def objects(self, prefix: str) -> list[ObjectInfo]:
        """Every object under the directory `prefix` (`''`: all), by key."""
        ...

    def names(self, prefix: str) -> list[str]:
        """The names directly below the directory `prefix` (files and
        directories alike), sorted."""
        ...

    def put_file(self, path: Path, key: str) -> None:
        """Copies the local file `path` to `key`."""
        ...

    def get_file(self, key: str, path: Path) -> None:
        """Copies `key` to the local file `path` (replaced atomically). Raises
        FileNotFoundError when there is no such object."""
        ...

    def signs_digests(self) -> bool:
        """Whether a put's URLs carry its parts' SHA-256, so they must be known
        before it (a store that checks them); else the store computes each
        part's and reports it, and the target reports its own as it sends."""
        ...

    def sign_put(self, key: str, size: int, part_sha256: Sequence[str] | None) -> SignedPut:
        """The requests that put a file of `size` bytes at `key`, each part's
        SHA-256 (lowercase hex, one per `part_size` bytes; None where the store
        does not sign them, see `signs_digests`) checked or computed by the
        store. Raises StoreError on a store that is not `direct`, or without
        the digests it signs."""
        ...

    def sign_again(
        self, signed: SignedPut, part_sha256: Sequence[str] | None, indexes: Iterable[int]
    ) -> SignedPut:
        """`signed` with its parts at `indexes` (from 0) signed anew, by the
        store's credentials as they are now, for the same put. Raises
        StoreError on a store that is not `direct`."""
        ...

    def signed_for_s(self) -> float | None:
        """How long URLs signed now may be used (the temporary credentials
        that sign them expire), None when only by their own lifetime."""
        ...

    def complete(self, signed: SignedPut, etags: Sequence[str], part_sha256: Sequence[str]) -> None:
        """Completes a multipart put once its parts are in (`etags` and their
        SHA-256s, in order); nothing for a single-part one."""
        ...

    def abort(self, signed: SignedPut) -> None:
        """Gives up a multipart put that will not be completed, so that none
        of its parts stays in the store (they bill); nothing for a
        single-part one. Never raises: a put it cannot abort is aborted by the
        next put of its key."""
        ...

    def sign_get(self, key: str) -> str:
        """A URL that gets `key` for a short while. Raises StoreError on a store
        that is not `direct`."""
        ...

    @property
    def part_size(self) -> int:
        """The most bytes a part of a signed put holds: a file of at most as
        many is put whole (one part, its store SHA-256 its own), a bigger one
        in parts of `part_length` bytes (a file is hashed in such parts)."""
        ...

    def lock(self, key: str, holder: Mapping[str, object]) -> AbstractContextManager[Held]:
        """Holds the lock `key` for the length of the block, as `holder`
        (said in messages); the block gets what says whether it still holds
        it (`Held`). Raises Busy, at once, when another live holder holds
        it. A holder that dies loses it (a local store's at once, an object
        store's lease when it expires); a lease is also lost when it cannot
        be renewed in time."""
        ...

    def holder(self, key: str) -> str | None:
        """Who holds the lock `key` now (`pid P on H, ...`), None when nobody live does."""
        ...


def check_key(key: str) -> str:
    """`key` if it names an object inside a store: relative, POSIX, no `..`,
    no empty part. Raises ValueError otherwise, so nothing outside the store
    is ever read or written."""
    if not key or key.startswith("/") or "\\" in key or "\0" in key:
        raise ValueError(f"{key!r} is not a key inside the store")
    parts = key.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise ValueError(f"{key!r} is not a key inside the store")
    return key


def join(*parts: str) -> str:
    """The key of `parts` joined (empty parts dropped)."""
    kept = [p.strip("/") for p in parts if p.strip("/")]
    return posixpath.join(*kept) if kept else ""


Change = Callable[[bytes | None], bytes | None]
"""What an update makes of an object's content (None: absent), None to leave it."""


def update(store: Store, key: str, change: Change, tries: int = UPDATE_TRIES) -> bytes | None:
    """Changes `key` by compare-and-swap: reads it, asks `change` for its new
    content (None: leave it as it is), then creates or replaces it on the
    version read; a lost race reads again and asks `change` again, so
    `change` must decide from what it is given alone. Returns what was
    written (or left).

    Raises Changed after `tries` lost races in a row, and what the store raises.
    """
    for attempt in range(tries):
        if attempt:  # a lost race: the winners are writing now, let them finish
            time.sleep(random.uniform(0, min(RACE_PAUSE_MAX_S, RACE_PAUSE_S * 2**attempt)))
        current = store.read(key)
        new = change(current.data if current is not None else None)
        if new is None:
            return current.data if current is not None else None
        try:
            if current is None:
                store.create(key, new)
            else:
                store.replace(key, new, current.etag)
        except (AlreadyExists, Changed):
            continue
        return new
    raise Changed(f"{store.where(key)} changed {tries} times while this process changed it")


def holder_text(data: Mapping[str, object]) -> str:
    """A lock holder as messages say it: `pid P on H, flow run F, since T`."""
    text = f"pid {data.get('pid')} on {data.get('host')}"
    if data.get("flow_run_id"):
        text += f", flow run {data['flow_run_id']}"
    return f"{text}, since {data.get('since')}"


def part_length(size: int, part_size: int) -> int:
    """Bytes each part (but the last) of a file of `size` bytes holds in a
    store whose parts hold at most `part_size`: the whole file when it fits in
    one, else CHUNK (at most `part_size`; more, in whole MiB, where the file
    would need more than MAX_PARTS parts). Never fails."""
    if size <= part_size:
        return max(size, 1)
    fewest = -(-size // MAX_PARTS)
    return max(1, min(part_size, max(CHUNK, -(-fewest // (1 << 20)) << 20)))


def parts_of(size: int, part_size: int) -> Iterator[tuple[int, int]]:
    """(offset, length) of each part of a file of `size` bytes in a store
    whose parts hold at most `part_size` (see `part_length`; one empty part
    for an empty file). Never fails."""
    if size == 0:
        yield 0, 0
        return
    length = part_length(size, part_size)
    offset = 0
    while offset < size:
        yield offset, min(length, size - offset)
        offset += length
