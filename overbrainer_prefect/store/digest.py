"""SHA-256 digests as this package writes them (lowercase hex) and as S3
spells them (base64; a multipart object's is the SHA-256 of its parts' digests)."""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Sequence


def b64_sha256(hex_digest: str) -> str:
    """A SHA-256 in lowercase hex as S3 spells it (base64)."""
    return base64.b64encode(bytes.fromhex(hex_digest)).decode()


def hex_sha256(b64_digest: str) -> str | None:
    """A SHA-256 as S3 reports it (base64, a multipart object's with `-N`) in
    lowercase hex; None when it is not one."""
    try:
        raw = base64.b64decode(b64_digest.split("-")[0], validate=True)
    except (binascii.Error, ValueError):
        return None
    return raw.hex() if len(raw) == 32 else None


def expected_checksum(part_sha256: Sequence[str]) -> str:
    """The SHA-256 (hex) the store reports for a file put in parts whose
    SHA-256s are `part_sha256`: the file's own for one part, the SHA-256 of
    the parts' digests for several (S3's composite checksum)."""
    if len(part_sha256) == 1:
        return part_sha256[0]
    return hashlib.sha256(b"".join(bytes.fromhex(p) for p in part_sha256)).hexdigest()
