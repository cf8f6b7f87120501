"""The index of a runs directory's live records: one small object per record
that is not final or may still hold something (a pod, its secret, a lease),
`.live/<R>` for the run R, `.live/R+exports+E` for its export E,
`.live/.bases+K+exports+E` for a base model's export, so that a follower's
pass and a collect list one prefix and read only those records, never the
history.

A marker is written before its record is created and again once it is (see
`Runs.save`), so a creator that dies at any point leaves its record in the
index; a marker whose record never came is a stale entry, dropped once it
is STALE_S old. A marker is removed only by a pass that found its record
final and holding nothing, the one state a record never leaves. A runs
directory written before the index has no `.built` marker: the first pass
(or collect) lists everything once, marks what is live, then writes it.
"""

from __future__ import annotations

import json
import time

from overbrainer_prefect.store.base import Store, join
from overbrainer_prefect.timestamps import parse_rfc3339, rfc3339

LIVE_DIR = ".live"
"""Under the runs directory: one marker per live record."""
BUILT = ".built"
"""Under LIVE_DIR: written once the index holds every live record of the directory."""
SEP = "+"  # stands for `/` in a marker's name: no run ID, kind or base model key holds it
STALE_S = 3600.0  # a marker whose record is still missing this long after it was written
# belongs to a creator that died before it wrote it: far past the store outage (600 s) a
# creator rides out between its marker and its record, and past any clock skew between them


def marker_key(record_dir: str) -> str:
    """The marker of the record whose directory is `record_dir` (`R`,
    `R/exports/E`, `.bases/K/exports/E`)."""
    return join(LIVE_DIR, record_dir.replace("/", SEP))


def record_dir_of(name: str) -> str | None:
    """The record directory a marker's name stands for, None for a name that
    is no marker (BUILT, a local store's temporary file)."""
    if name == BUILT or name.endswith(".tmp") or not name:
        return None
    return name.replace(SEP, "/")


def mark(store: Store, record_dir: str) -> None:
    """Writes the marker of the record in `record_dir` (whatever it held:
    its time is now). Raises what the store raises."""
    body = {"record": record_dir, "since": rfc3339()}
    store.write(marker_key(record_dir), json.dumps(body).encode() + b"\n")


def unmark(store: Store, record_dir: str) -> None:
    """Removes the marker of the record in `record_dir` (nothing when there
    is none). Raises what the store raises."""
    store.delete(marker_key(record_dir))


def marker_age_s(store: Store, record_dir: str) -> float | None:
    """How long ago the marker of `record_dir` was written, by its own word;
    None when it is gone; 0 when it says nothing readable (kept, as if new).
    Raises what the store raises."""
    found = store.read(marker_key(record_dir))
    if found is None:
        return None
    try:
        since = json.loads(found.data)["since"]
        return max(0.0, time.time() - parse_rfc3339(str(since)).timestamp())
    except (ValueError, KeyError, TypeError):
        return 0.0


def mark_built(store: Store) -> None:
    """Says the index holds every live record of the store's runs directory.
    Raises what the store raises."""
    store.write(join(LIVE_DIR, BUILT), json.dumps({"since": rfc3339()}).encode() + b"\n")
