"""Run IDs: `YYYYMMDD-HHMMSS-xxxx`, the UTC time a run was created and four
random characters. An ID is also a directory name under `runs/`, so nothing
that is not an ID is ever used to build a path."""

from __future__ import annotations

import re
import secrets
import string
from datetime import UTC, datetime

_ID = re.compile(r"^[0-9]{8}-[0-9]{6}-[a-z0-9]{4}$")
_SUFFIX = string.ascii_lowercase + string.digits


def new_run_id(now: datetime | None = None) -> str:
    """A new run ID for `now` (default: the current time), in UTC."""
    moment = (now or datetime.now(UTC)).astimezone(UTC)
    suffix = "".join(secrets.choice(_SUFFIX) for _ in range(4))
    return f"{moment:%Y%m%d-%H%M%S}-{suffix}"


def is_valid_run_id(value: str) -> bool:
    """Whether `value` is a run ID: `YYYYMMDD-HHMMSS-xxxx`, lowercase letters and
    digits, never a path (no `/`, no `..`)."""
    return bool(_ID.match(value))
