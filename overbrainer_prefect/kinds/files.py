"""A verified file as results list it."""

from __future__ import annotations

from pydantic import BaseModel

from overbrainer_prefect.executors.base import FileDigest


class FileEntry(BaseModel):
    """A retrieved file, verified by SHA-256."""

    path: str
    size: int
    sha256: str

    @classmethod
    def of(cls, digest: FileDigest) -> FileEntry:
        """The entry of a verified file of a manifest."""
        return cls(path=digest.path, size=digest.size, sha256=digest.sha256)
