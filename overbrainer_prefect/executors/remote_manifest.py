"""The shell commands that list and hash a run's files on a remote target.

A manifest is taken in two commands so that every byte is read once, on the
target: the first lists the files under the wanted entries with their sizes
(`find -printf`), this side drops the excluded ones (the same `is_excluded`
rule as the local manifest), and the second hashes only the files kept, whose
names it reads from its stdin (with `python3` when the target has it, else
`sha256sum`). Names travel NUL-separated both ways, so any file name is safe.
Needs GNU find and coreutils on the target (any common Linux).
"""

from __future__ import annotations

import posixpath
import shlex
from collections.abc import Sequence

HASH_BATCH = 64  # files per sha256sum process: few processes, bounded argv


def checked_entries(entries: Sequence[str]) -> list[str]:
    """`entries` normalised (`./a/` is `a`), without duplicates, in order.

    Raises ValueError when an entry is absolute or climbs out of the run
    directory (`..`), since nothing outside a run directory is ever read.
    """
    checked: list[str] = []
    for entry in entries:
        normal = posixpath.normpath(entry) if entry else ""
        if not normal or normal.startswith("/") or normal == ".." or normal.startswith("../"):
            raise ValueError(
                f"{entry!r} is not a path inside the run directory; "
                "give paths relative to it, without '..'"
            )
        if normal not in checked:
            checked.append(normal)
    return checked


def list_command(remote: str, entries: Sequence[str]) -> str:
    """A shell command printing one record per file under `entries` of the
    directory `remote`, NUL-terminated: `f <size> <path>` for a regular file,
    `l 0 <path>` for a link to a regular file (see `links_command`); paths
    start with `./`. Entries that do not exist, or that are reached through a
    link leading out of `remote`, are skipped; links to directories are not
    descended. A missing `remote` exits 3.

    Raises ValueError on an entry outside the run directory (`checked_entries`).
    """
    quoted = " ".join(shlex.quote(entry) for entry in checked_entries(entries))
    return (
        f"cd {shlex.quote(remote)} || exit 3; root=$(pwd -P) || exit 3; set --; "
        f"for e in {quoted}; do "
        '{ [ -e "$e" ] || [ -L "$e" ]; } || continue; '
        "case $e in */*) p=${e%/*};; *) p=.;; esac; "
        'd=$(cd -- "$p" 2>/dev/null && pwd -P) || continue; '
        'case "$d/" in "${root%/}"/*) set -- "$@" "./$e";; esac; '
        "done; "
        '[ $# -eq 0 ] || exec find "$@" '
        "\\( -type f -printf 'f %s %p\\0' \\) -o \\( -type l -xtype f -printf 'l 0 %p\\0' \\)"
    )


def parse_listing(output: bytes) -> tuple[dict[str, int], list[str]]:
    """(regular files with their sizes, links to files) from the output of
    `list_command`, by path relative to the run directory.

    Raises ValueError when a record is not `f|l <size> <path>`.
    """
    files: dict[str, int] = {}
    links: list[str] = []
    for record in output.split(b"\0"):
        if not record:
            continue
        kind, size_text, raw_path = [*record.split(b" ", 2), b"", b""][:3]
        if kind not in (b"f", b"l") or not size_text.isdigit() or not raw_path:
            raise ValueError("the target's file listing is not `f|l <size> <path>` records")
        path = _relative(raw_path)
        if kind == b"f":
            files[path] = int(size_text)
        elif path not in links:
            links.append(path)
    return files, links


def links_command(remote: str, links: Sequence[str]) -> str:
    """A shell command printing the real path of `remote` on a line, then for
    each of `links` (relative to `remote`), NUL-terminated, `<size> <real path>`
    of the file it leads to, or nothing when it leads nowhere."""
    quoted = " ".join(shlex.quote("./" + link) for link in links)
    return (
        f"cd {shlex.quote(remote)} || exit 3; pwd -P || exit 3; "
        f"for f in {quoted}; do "
        't=$(realpath -e -- "$f" 2>/dev/null) && s=$(stat -L -c %s -- "$f" 2>/dev/null) '
        "&& printf '%s %s\\0' \"$s\" \"$t\" || printf '\\0'; done"
    )


def parse_links(links: Sequence[str], output: bytes) -> dict[str, int]:
    """The links (from `links_command`'s output) that lead to a file inside the
    run directory, with that file's size: a link leading out of it, or
    nowhere, is not part of the run's files (as in `manifest.manifest_files`).

    Raises ValueError when the output does not hold one record per link.
    """
    root_raw, _, rest = output.partition(b"\n")
    root = root_raw.decode("utf-8", "surrogateescape").rstrip("/") + "/"
    records = rest.split(b"\0")
    if len(records) != len(links) + 1 or records[-1]:
        raise ValueError("the target's link listing does not hold one record per link")
    kept: dict[str, int] = {}
    for link, record in zip(links, records, strict=False):
        size_text, sep, target = record.partition(b" ")
        if not sep or not size_text.isdigit():
            continue
        if target.decode("utf-8", "surrogateescape").startswith(root):
            kept[link] = int(size_text)
    return kept


HASHER = """
import hashlib, os, sys
from concurrent.futures import ThreadPoolExecutor
def digest(name):
    sha, buf = hashlib.sha256(), bytearray(4 << 20)
    view = memoryview(buf)
    with open(name, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                return sha.hexdigest()
            sha.update(view[:n])
names = [n for n in sys.stdin.buffer.read().split(b"\\0") if n]
with ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1))) as pool:
    for name, hexd in zip(names, pool.map(digest, names)):
        sys.stdout.buffer.write(hexd.encode() + b"  " + name + b"\\0")
"""
"""The target's hasher when it has `python3` (any 3.x): OpenSSL's SHA-256
(SHA-NI where the CPU has it, about 4x coreutils' `sha256sum`), a few files at
a time since hashlib releases the GIL; same output as `sha256sum -z`."""


def hash_command(remote: str) -> str:
    """A shell command that hashes, in the directory `remote`, the files whose
    names it reads NUL-separated from stdin, printing `<sha256>  <path>\\0` for
    each: with `python3` (`HASHER`) when the target has it, else with
    `sha256sum -z` (no escaping of odd names either way)."""
    return (
        f"cd {shlex.quote(remote)} || exit 3; "
        "if command -v python3 >/dev/null 2>&1; "
        f"then exec python3 -I -c {shlex.quote(HASHER)}; "
        f"else exec xargs -0 -r -n {HASH_BATCH} sha256sum -z --; fi"
    )


def hash_input(paths: Sequence[str]) -> bytes:
    """What `hash_command` reads on stdin to hash `paths`."""
    return b"".join(b"./" + path.encode("utf-8", "surrogateescape") + b"\0" for path in paths)


def parse_hashes(output: bytes) -> dict[str, str]:
    """The SHA-256 (lowercase hex) `hash_command` printed, by path.

    Raises ValueError when a record is not `<64 hex digits>  <path>`.
    """
    digests: dict[str, str] = {}
    for record in output.split(b"\0"):
        if not record:
            continue
        digest = record[:64].decode("ascii", "replace").lower()
        if len(record) < 67 or record[64:66] != b"  " or not _is_hex(digest):
            raise ValueError("the target's sha256sum output is not `<sha256>  <path>` records")
        digests[_relative(record[66:])] = digest
    return digests


def _relative(raw_path: bytes) -> str:
    """A path as printed on the target (`./a/b`) as a run-relative path (`a/b`)."""
    return posixpath.normpath(raw_path.decode("utf-8", "surrogateescape"))


def _is_hex(text: str) -> bool:
    return all(char in "0123456789abcdef" for char in text)
