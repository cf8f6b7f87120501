"""SHA-256 manifests of a run directory's files, and the check that a download
is exactly what the target holds.

Pure functions on local files, used by every executor (the target's side of a
manifest on this machine) and by the run flows (the local side of a
verification). Every file is hashed exactly once, in large chunks, a few files
at a time: hashlib releases the GIL while it hashes, so threads share the cores.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from fnmatch import fnmatchcase
from pathlib import Path, PurePosixPath

from overbrainer_prefect.executors.base import ExecError, FileDigest
from overbrainer_prefect.executors.nodes import node_dir, node_rank

HASH_CHUNK = 4 << 20  # bytes read per call: large enough that the syscalls cost nothing
HASH_THREADS = max(1, min(4, os.cpu_count() or 1))  # files hashed at once (hashlib drops the GIL)


def is_excluded(rel_path: str, exclude: Sequence[str]) -> bool:
    """Whether the POSIX relative path `rel_path` is left out by one of the glob
    patterns of `exclude` (fnmatch syntax, case-sensitive).

    A pattern is tried on each component of the path (`checkpoint-*` leaves out
    every file under any `checkpoint-10/` directory), on the whole path
    (`output/*.tmp`, where `*` also matches `/`) and on each directory leading
    to it (`output/logs` leaves out everything under that directory), so a
    directory that is excluded excludes everything under it. Never fails.
    """
    if not exclude:
        return False
    parts = rel_path.split("/")
    candidates = set(parts)
    candidates.update("/".join(parts[:end]) for end in range(2, len(parts) + 1))
    return any(fnmatchcase(candidate, pattern) for pattern in exclude for candidate in candidates)


def manifest_files(root: Path, entries: Sequence[str], exclude: Sequence[str]) -> list[str]:
    """The files under `entries` of `root`, as sorted POSIX paths relative to
    `root`, without duplicates, less those `exclude` matches (see `is_excluded`).

    An entry is a file or a directory relative to `root`; a missing one is
    skipped. Symbolic links are listed only when they lead to a regular file
    inside `root` (and then stand for that file's content); a link to a
    directory is not descended, and nothing outside `root` is ever listed.

    Raises ExecError (`manifest`) when an entry is absolute or climbs out of
    `root` with `..`, or when a directory cannot be read.
    """
    root_real = Path(os.path.realpath(root))
    found: set[str] = set()
    for entry in entries:
        rel = _checked_entry(entry)
        if rel is None:  # the entry is `root` itself
            found.update(_walk(root, root_real, "", exclude))
            continue
        path = root / rel
        if not Path(os.path.realpath(path.parent)).is_relative_to(root_real):
            continue  # reached through a link that leads out of the root
        try:
            mode = path.lstat().st_mode
        except FileNotFoundError:
            continue
        except OSError as error:
            raise ExecError("manifest", f"{rel!s}: {error.strerror}") from None
        if is_excluded(str(rel), exclude):
            continue
        if stat.S_ISDIR(mode):
            found.update(_walk(path, root_real, str(rel) + "/", exclude))
        elif _is_listed_file(path, mode, root_real):
            found.add(str(rel))
    return sorted(found)


def local_manifest(root: Path, entries: Sequence[str], exclude: Sequence[str]) -> list[FileDigest]:
    """The SHA-256 manifest of the files `manifest_files` lists under `entries`
    of `root`: each file hashed exactly once, sorted by path.

    Raises ExecError (`manifest`) on a bad entry (see `manifest_files`) or a
    file that cannot be read (it vanished or is not readable).
    """
    paths = manifest_files(root, entries, exclude)
    if len(paths) <= 1 or HASH_THREADS == 1:
        return [_digest(root, path) for path in paths]
    with ThreadPoolExecutor(max_workers=HASH_THREADS, thread_name_prefix="sha256") as pool:
        return list(pool.map(lambda path: _digest(root, path), paths))


def verify(
    local: Path, entries: Sequence[str], exclude: Sequence[str], manifest: list[FileDigest]
) -> None:
    """Checks that the local files under `entries` of `local` (less those
    `exclude` matches) are exactly the files `manifest` lists, each with the
    SHA-256 the target computed for it. Every local file is hashed once.

    Raises ExecError (`verify`) naming the first file, in manifest order, that is
    missing locally or differs from the target, else the first local file that
    is not on the target; ExecError (`manifest`) when the local files cannot be
    listed or read. The files of a job across nodes (`executors.nodes`) are
    checked under each node's `nodes/<rank>/` as under `local`.
    """
    ranks = sorted({node_rank(file.path) for file in manifest} - {0})
    listed = [*entries, *(node_dir(rank) + entry for rank in ranks for entry in entries)]
    local_files = {file.path: file.sha256 for file in local_manifest(local, listed, exclude)}
    for file in manifest:
        sha256 = local_files.get(file.path)
        if sha256 is None:
            raise ExecError("verify", f'"{file.path}" is missing locally')
        if sha256 != file.sha256:
            raise ExecError("verify", f'"{file.path}" differs from the target (SHA-256 mismatch)')
    on_target = {file.path for file in manifest}
    for path in sorted(local_files):
        if path not in on_target:
            raise ExecError("verify", f'"{path}" is not on the target')


def sha256_file(path: Path) -> tuple[int, str]:
    """(size in bytes, SHA-256 in lowercase hex) of the file `path`, read once in
    `HASH_CHUNK` pieces.

    Raises OSError when the file cannot be opened or read.
    """
    digest = hashlib.sha256()
    buffer = bytearray(HASH_CHUNK)
    view = memoryview(buffer)
    size = 0
    with open(path, "rb", buffering=0) as file:
        while count := file.readinto(buffer):
            digest.update(view[:count])
            size += count
    return size, digest.hexdigest()


def recheck(path: Path, size: int, sha256: str) -> str | None:
    """Hashes a retrieved file again: None when `path` still has the `size` and
    `sha256` it was verified with, else what is wrong, worded to follow the
    file's name in a message (it is missing, cannot be read, or differs).
    Never raises."""
    try:
        found = sha256_file(path)
    except FileNotFoundError:
        return "is missing on this machine (it was retrieved and verified, then removed)"
    except OSError as error:
        return f"cannot be read ({error.strerror or error})"
    if found != (size, sha256):
        return "differs from the file retrieved and verified (SHA-256)"
    return None


def _digest(root: Path, rel: str) -> FileDigest:
    try:
        size, sha256 = sha256_file(root / rel)
    except OSError as error:
        raise ExecError("manifest", f'"{rel}" cannot be read: {error.strerror}') from None
    return FileDigest(path=rel, size=size, sha256=sha256)


def _checked_entry(entry: str) -> PurePosixPath | None:
    """The entry as a clean relative path (None for the root itself), or an
    ExecError when it is absolute or climbs out with `..`."""
    path = PurePosixPath(entry)
    if path.is_absolute() or ".." in path.parts:
        raise ExecError(
            "manifest",
            f"the entry {entry!r} is not a path inside the run directory "
            "(use a relative path without '..')",
        )
    return None if path == PurePosixPath(".") else path


def _walk(directory: Path, root_real: Path, prefix: str, exclude: Sequence[str]) -> Iterator[str]:
    """The files under `directory` (relative paths starting with `prefix`),
    depth first, not descending into links or excluded directories."""
    try:
        with os.scandir(directory) as scan:
            items = list(scan)
    except FileNotFoundError:
        return
    except OSError as error:
        raise ExecError(
            "manifest", f'"{prefix or "."}" cannot be listed: {error.strerror}'
        ) from None
    for item in items:
        rel = prefix + item.name
        # Whatever excludes a directory excludes every path under it (see
        # `is_excluded`): an excluded directory prunes its whole subtree.
        if is_excluded(rel, exclude):
            continue
        if item.is_dir(follow_symlinks=False):
            yield from _walk(Path(item.path), root_real, rel + "/", exclude)
        else:
            try:
                mode = item.stat(follow_symlinks=False).st_mode
            except FileNotFoundError:
                continue
            if _is_listed_file(Path(item.path), mode, root_real):
                yield rel


def _is_listed_file(path: Path, mode: int, root_real: Path) -> bool:
    """A regular file, or a link to a regular file inside the root."""
    if stat.S_ISREG(mode):
        return True
    if not stat.S_ISLNK(mode):
        return False  # sockets, fifos, devices: never part of a run's files
    target = Path(os.path.realpath(path))
    if not target.is_relative_to(root_real):
        return False
    try:
        return stat.S_ISREG(target.stat().st_mode)
    except OSError:
        return False  # a dangling link
