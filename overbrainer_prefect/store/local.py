"""A store in a local directory (the runs directory as it always was): each key
a file under the root, replaced atomically; a compare-and-swap runs under an
advisory `flock` on the file's directory, and a lock is a `flock` on its own
file, which the kernel (or the NFS server, on a shared volume) drops when its
holder dies, however it dies."""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import secrets
import shutil
import socket
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from overbrainer_prefect.store.base import (
    AlreadyExists,
    Busy,
    Changed,
    Kept,
    ObjectInfo,
    SignedPut,
    StoreError,
    Versioned,
    check_key,
    holder_text,
)

log = logging.getLogger(__name__)

WHOLE_FILE = 1 << 62  # a local store hashes a file as one part


class LocalIoError(StoreError):
    """A file or directory of a local store could not be read or written."""

    def __init__(self, path: Path, error: OSError) -> None:
        super().__init__(f"cannot access {path}: {error.strerror or error}")
        self.path = path


def write_atomic(directory: Path, name: str, content: bytes) -> None:
    """Replaces `directory/name` with `content` atomically: writes a private
    temporary file of its own in `directory` (`.<name>.<random>.tmp`, mode 0600,
    never shared with a concurrent save), flushes it to disk, then renames it
    over `directory/name`, so a reader sees either the old or the new content.
    The temporary file is removed when the write or the rename fails.

    Raises LocalIoError when the file cannot be written or renamed.
    """
    tmp = directory / f".{name}.{secrets.token_hex(8)}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as error:
        raise LocalIoError(tmp, error) from None
    try:
        try:
            view = memoryview(content)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, directory / name)
    except OSError as error:
        try:
            tmp.unlink()
        except OSError as unlink_error:
            log.warning("cannot remove %s: %s", tmp, unlink_error)
        raise LocalIoError(directory / name, error) from None


def _etag(data: bytes) -> str:
    # the content's own digest: an inode and a time can come back, a digest only with its content
    return hashlib.sha256(data).hexdigest()


class LocalStore:
    """A `Store` in the local directory `root` (see the module)."""

    direct = False

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root).absolute()

    def __repr__(self) -> str:
        return f"LocalStore({str(self.root)!r})"

    @property
    def url(self) -> str:
        """The root directory."""
        return str(self.root)

    @property
    def location(self) -> str:
        """The root directory."""
        return str(self.root)

    @property
    def part_size(self) -> int:
        """A local file is one part."""
        return WHOLE_FILE

    def local_path(self, key: str) -> Path:
        """The file of `key` under the root."""
        return self.root / check_key(key)

    def where(self, key: str) -> str:
        """The path of `key`."""
        return str(self.local_path(key))

    def read(self, key: str) -> Versioned | None:
        """The file `key` and its version (both from one open file)."""
        path = self.local_path(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        except OSError as error:
            raise LocalIoError(path, error) from None
        try:
            with os.fdopen(fd, "rb") as file:
                data = file.read()
        except IsADirectoryError:
            return None
        except OSError as error:
            raise LocalIoError(path, error) from None
        return Versioned(data, _etag(data))

    @contextmanager
    def _swap(self, path: Path) -> Iterator[None]:
        """Holds the compare-and-swap lock of `path`'s directory (created if needed)."""
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as error:
            raise LocalIoError(path.parent, error) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _version(self, path: Path) -> str | None:
        try:
            return _etag(path.read_bytes())
        except (FileNotFoundError, IsADirectoryError):
            return None
        except OSError as error:
            raise LocalIoError(path, error) from None

    def create(self, key: str, data: bytes) -> str:
        """Creates the file `key`. Raises AlreadyExists when it exists."""
        path = self.local_path(key)
        with self._swap(path):
            if self._version(path) is not None:
                raise AlreadyExists(f"{path} exists")
            write_atomic(path.parent, path.name, data)
            return _etag(data)

    def replace(self, key: str, data: bytes, etag: str) -> str:
        """Replaces the file `key` if it is still the version `etag`. Raises Changed."""
        path = self.local_path(key)
        with self._swap(path):
            if self._version(path) != etag:
                raise Changed(f"{path} changed since it was read")
            write_atomic(path.parent, path.name, data)
            return _etag(data)

    def write(self, key: str, data: bytes) -> None:
        """Replaces the file `key` atomically, whatever it holds."""
        path = self.local_path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise LocalIoError(path.parent, error) from None
        write_atomic(path.parent, path.name, data)

    def delete(self, key: str) -> None:
        """Removes the file (or directory) `key`."""
        path = self.local_path(key)
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
        except OSError as error:
            raise LocalIoError(path, error) from None

    def head(self, key: str) -> ObjectInfo | None:
        """The size of the file `key` (a local store keeps no checksum)."""
        path = self.local_path(key)
        try:
            return ObjectInfo(key, path.stat().st_size) if path.is_file() else None
        except OSError:
            return None

    def objects(self, prefix: str) -> list[ObjectInfo]:
        """Every regular file under the directory `prefix`, by key."""
        base = self.local_path(prefix) if prefix else self.root
        found: list[ObjectInfo] = []
        if not base.is_dir():
            return found
        for directory, dirs, files in os.walk(base):
            dirs.sort()
            for name in sorted(files):
                path = Path(directory) / name
                try:
                    stat = path.stat()
                except OSError:
                    continue
                key = path.relative_to(self.root).as_posix()
                found.append(ObjectInfo(key, stat.st_size))
        return sorted(found, key=lambda info: info.key)

    def names(self, prefix: str) -> list[str]:
        """The entries of the directory `prefix`."""
        base = self.local_path(prefix) if prefix else self.root
        try:
            return sorted(os.listdir(base))
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as error:
            raise LocalIoError(base, error) from None

    def put_file(self, path: Path, key: str) -> None:
        """Copies `path` to the file `key` (a hard link when it can)."""
        target = self.local_path(key)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.parent / f".{target.name}.{secrets.token_hex(8)}.tmp"
            try:
                tmp.hardlink_to(path)
            except OSError:
                shutil.copyfile(path, tmp)
            os.replace(tmp, target)
        except OSError as error:
            raise LocalIoError(target, error) from None

    def get_file(self, key: str, path: Path) -> None:
        """Copies the file `key` to `path`. Raises FileNotFoundError."""
        source = self.local_path(key)
        if not source.is_file():
            raise FileNotFoundError(str(source))
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp"
            shutil.copyfile(source, tmp)
            os.replace(tmp, path)
        except OSError as error:
            raise LocalIoError(path, error) from None

    def signs_digests(self) -> bool:
        """False: no target puts files here itself."""
        return False

    def sign_put(self, key: str, size: int, part_sha256: Sequence[str] | None) -> SignedPut:
        """Refused: a local store's files pass through this machine."""
        raise StoreError(f"{self.url} is a local directory: no target puts files there itself")

    def complete(self, signed: SignedPut, etags: Sequence[str], part_sha256: Sequence[str]) -> None:
        """Refused, as `sign_put`."""
        raise StoreError(f"{self.url} is a local directory: no target puts files there itself")

    def sign_again(
        self, signed: SignedPut, part_sha256: Sequence[str] | None, indexes: Iterable[int]
    ) -> SignedPut:
        """Refused, as `sign_put`."""
        raise StoreError(f"{self.url} is a local directory: no target puts files there itself")

    def signed_for_s(self) -> None:
        """None: nothing is signed for a local directory."""
        return None

    def abort(self, signed: SignedPut) -> None:
        """Nothing: no target puts files in a local directory itself."""

    def sign_get(self, key: str) -> str:
        """Refused: a local store's files pass through this machine."""
        raise StoreError(f"{self.url} is a local directory: no target gets files there itself")

    @contextmanager
    def lock(self, key: str, holder: Mapping[str, object]) -> Iterator[Kept]:
        """Holds an advisory `flock` on the file `key` (created if needed),
        which says who holds it; the kernel keeps it while this process
        lives (`Kept`: never lost). Raises Busy at once when another live
        process holds it."""
        path = self.local_path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as error:
            raise LocalIoError(path, error) from None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise Busy(key, self._holder_text(path)) from None
            me = {"pid": os.getpid(), "host": socket.gethostname(), **holder}
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(me).encode(), 0)
            yield Kept()
        finally:
            os.close(fd)  # closing the descriptor releases the lock

    def holder(self, key: str) -> str | None:
        """Who holds the `flock` of `key` now, None when no live process does."""
        path = self.local_path(key)
        try:
            fd = os.open(path, os.O_RDWR)
        except (FileNotFoundError, IsADirectoryError):
            return None
        except OSError as error:
            raise LocalIoError(path, error) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return self._holder_text(path)
        finally:
            os.close(fd)
        return None

    @staticmethod
    def _holder_text(path: Path) -> str:
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict):
                raise ValueError("not an object")
            return holder_text(data)
        except (OSError, ValueError):
            return "another process"
