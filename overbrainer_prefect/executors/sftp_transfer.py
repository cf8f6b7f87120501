"""Copying run directories to and from an SSH target over SFTP, fast.

Run directories hold multi-GB files (weights, checkpoints), so each file is
copied with many SFTP requests in flight (asyncssh's pipelined copy), the
largest the server accepts, and a few files at a time. Measured against `scp`
over the same sshd by `bench/ssh_transfer.py`.
"""

from __future__ import annotations

import asyncio
import os
import posixpath
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import asyncssh

BLOCK_SIZE = 256 * 1024  # bytes per SFTP read/write request, capped by the server's limits
MAX_REQUESTS = 32  # SFTP requests in flight per file: enough to fill a long fat pipe
PARALLEL_FILES = 4  # files copied at once: small files are bounded by round trips, not bytes


def block_size(sftp: asyncssh.SFTPClient) -> int:
    """The request size for `sftp`: `BLOCK_SIZE`, or less when the server says
    it accepts less (OpenSSH takes 255 KiB at most; a larger write would close
    the session)."""
    limits = sftp.limits
    size = BLOCK_SIZE
    for limit in (limits.max_read_len, limits.max_write_len):
        if limit:
            size = min(size, limit)
    return size


def local_tree(root: Path, skip: Sequence[str] = ()) -> tuple[list[str], list[str]]:
    """(directories, files) under `root`, as POSIX paths relative to it, parents
    before their children, leaving out the top-level entries named in `skip`.
    Symbolic links are followed (the target gets their content), each
    directory entered once.

    Raises OSError when `root` cannot be read.
    """
    dirs: list[str] = []
    files: list[str] = []
    seen = {os.path.realpath(root)}  # directories entered: a link cycle is entered once
    for current, subdirs, names in os.walk(root, followlinks=True, onerror=_raise):
        rel = Path(current).relative_to(root).as_posix()
        if rel == ".":
            subdirs[:] = [name for name in subdirs if name not in skip]
            names = [name for name in names if name not in skip]
            prefix = ""
        else:
            dirs.append(rel)
            prefix = rel + "/"
        fresh = []
        for name in sorted(subdirs):
            real = os.path.realpath(os.path.join(current, name))
            if real not in seen:
                seen.add(real)
                fresh.append(name)
        subdirs[:] = fresh
        files += [prefix + name for name in sorted(names)]
    return dirs, files


async def upload_tree(
    sftp: asyncssh.SFTPClient, local: Path, remote: str, skip: Sequence[str] = ()
) -> None:
    """Copies the directory `local` to `remote` (created, with its parents),
    less the top-level entries in `skip`; existing remote files are replaced.

    Raises OSError for a local file that cannot be read, SFTPError for a remote
    one that cannot be written.
    """
    dirs, files = await asyncio.to_thread(local_tree, local, skip)
    await sftp.makedirs(remote, exist_ok=True)
    for rel in dirs:
        target = posixpath.join(remote, rel)
        if not await sftp.isdir(target):
            await sftp.mkdir(target)
    size = block_size(sftp)

    async def put(rel: str) -> None:
        await sftp.put(
            str(local / rel),
            posixpath.join(remote, rel),
            preserve=True,  # keeps modes (scripts stay executable) and times
            follow_symlinks=True,
            sparse=False,  # a sparse copy could leave a trailing hole short
            block_size=size,
            max_requests=MAX_REQUESTS,
        )

    await _bounded(put, files)


async def download_files(
    sftp: asyncssh.SFTPClient, remote: str, local: Path, paths: Sequence[str]
) -> None:
    """Copies the files `paths` (relative to `remote`) into `local`, same
    layout, creating directories as needed and replacing existing files; each
    file is written under a temporary name and renamed, so none is ever half
    there.

    Raises SFTPError for a remote file that cannot be read, OSError for a local
    one that cannot be written.
    """
    size = block_size(sftp)

    async def get(rel: str) -> None:
        target = local / rel
        partial = target.with_name(f".{target.name}.part")
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            await sftp.get(
                posixpath.join(remote, rel),
                str(partial),
                preserve=True,
                sparse=False,
                block_size=size,
                max_requests=MAX_REQUESTS,
            )
            partial.replace(target)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise

    await _bounded(get, paths)


async def read_range(sftp: asyncssh.SFTPClient, path: str, offset: int, limit: int) -> bytes:
    """Up to `limit` bytes of the remote file `path` from `offset`, read in
    place (open, read at the offset, close); empty when the file does not
    exist or ends before `offset`.

    Raises SFTPError when the file exists but cannot be read.
    """
    if limit <= 0:
        return b""
    try:
        async with sftp.open(path, "rb", block_size=block_size(sftp)) as file:
            data: bytes = await file.read(limit, offset)
            return data
    except (asyncssh.SFTPNoSuchFile, asyncssh.SFTPNoSuchPath):
        return b""
    except asyncssh.SFTPEOFError:
        return b""


async def _bounded(copy: Callable[[str], Awaitable[None]], paths: Sequence[str]) -> None:
    """Runs `copy` on each of `paths`, `PARALLEL_FILES` at a time; the first
    failure cancels the others and is raised."""
    queue = list(reversed(paths))

    async def worker() -> None:
        while queue:
            await copy(queue.pop())

    workers = [asyncio.ensure_future(worker()) for _ in range(min(PARALLEL_FILES, len(paths)))]
    try:
        await asyncio.gather(*workers)
    except BaseException:
        for task in workers:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        raise


def _raise(error: OSError) -> None:
    raise error
