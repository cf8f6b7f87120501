"""Moves a job's files between its run directory and the runs' object store,
on the target itself, by presigned URLs: nothing of a model passes through
the worker, and no store key ever reaches the target (each URL is good for
one object or part, for a short while).

Runs with any Python 3.8+ on the target (the standard library only), in the
run directory `DIR`. Its input, a JSON object, comes on stdin (or, for `get`
as a job's first command, from the environment variable `--plan-env NAME`,
which reaches the job like its secrets): URLs are never in an argument, a
log line or a message.

    parts DIR PART_SIZE   stdin: ["path", ...]
                          stdout: {"path": ["<sha256 of each part>", ...]}
    put DIR               stdin: {"files": [{"path", "parts": [{"url", "headers",
                          "offset", "length"}]}], "deadline_s": N}
                          stdout: {"path": {"etags": [<each part's ETag>], "parts":
                          [<each part's SHA-256>], "sha256": <the file's>}}, the
                          digests of the bytes sent, hashed as they were read
    get DIR [--plan-env NAME]
                          {"files": [{"path", "url", "size", "sha256"}], "deadline_s": N}
                          each file fetched beside its place, checked (size and
                          SHA-256), then renamed into it

A request the store does not answer, or answers with a 5xx, is tried again
with backoff until the plan's deadline; any other answer fails at once. Exits
2 with one line on stderr naming the file (never its URL) when a file cannot
be moved.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import shutil
import sys
import time
import urllib.parse

BLOCK = 1 << 20  # bytes read, hashed and sent at a time
FIRST_PAUSE_S = 1.0  # the first pause before a request is tried again; doubled each time
MAX_PAUSE_S = 30.0
REQUEST_TIMEOUT_S = 120.0  # a connection that moves nothing for this long is dropped


class Failed(Exception):
    """A file could not be moved; the message names it, never its URL."""


class Retry(Exception):
    """A request worth trying again (no answer, a 5xx)."""


class _Span:
    """`length` bytes of an open file from `offset`, read as a request body and
    hashed as they are read (the part's digest, and the whole file's when the
    parts are sent in order)."""

    def __init__(self, file, offset: int, length: int, before) -> None:  # type: ignore[no-untyped-def]
        file.seek(offset)
        self.file = file
        self.left = length
        self.digest = hashlib.sha256()
        self.whole = before.copy()  # the file's digest up to this part, this try's own

    def read(self, size: int = -1) -> bytes:
        if self.left <= 0:
            return b""
        size = self.left if size < 0 else min(size, self.left)
        data = self.file.read(min(size, BLOCK))
        self.left -= len(data)
        self.digest.update(data)
        self.whole.update(data)
        return data


def _connection(url: str) -> tuple[http.client.HTTPConnection, str]:
    parts = urllib.parse.urlsplit(url)
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    target = parts.path + (f"?{parts.query}" if parts.query else "")
    return kind(parts.netloc, timeout=REQUEST_TIMEOUT_S, blocksize=BLOCK), target


def _retried(what: str, deadline: float, attempt):  # type: ignore[no-untyped-def]
    pause = FIRST_PAUSE_S
    while True:
        try:
            return attempt()
        except Retry as error:
            if time.monotonic() + pause > deadline:
                raise Failed(f"{what}: the store did not answer in time ({error})") from None
            print(f"{what}: the store did not answer ({error}); trying again", file=sys.stderr)
            time.sleep(pause)
            pause = min(pause * 2, MAX_PAUSE_S)


def _answer(response: http.client.HTTPResponse, what: str) -> None:
    if response.status >= 500 or response.status in (408, 429):
        raise Retry(f"HTTP {response.status}")
    if response.status >= 300:
        code = ""
        body = response.read(2048).decode(errors="replace")
        if "<Code>" in body:
            code = " " + body.split("<Code>", 1)[1].split("</Code>", 1)[0][:60]
        raise Failed(f"{what}: the store answered HTTP {response.status}{code}")


def parts(root: str, part_size: int, paths: list[str]) -> dict[str, list[str]]:
    """The SHA-256 of each `part_size` part of each file (one part for an empty file)."""
    found: dict[str, list[str]] = {}
    for path in paths:
        full = os.path.join(root, path)
        count = max(1, -(-os.path.getsize(full) // part_size))
        digests = []
        with open(full, "rb") as file:
            for _ in range(count):
                digest = hashlib.sha256()
                left = part_size
                while left > 0:
                    block = file.read(min(BLOCK, left))
                    if not block:
                        break
                    digest.update(block)
                    left -= len(block)
                digests.append(digest.hexdigest())
        found[path] = digests
    return found


def put(root: str, plan: dict) -> dict[str, dict]:  # type: ignore[type-arg]
    """Puts each part of each file of `plan` by its URL; the ETag and SHA-256
    of each part sent, and the file's SHA-256, hashed as its bytes were read
    (one read of the file; a part sent again is hashed again from where the
    file's digest stood before it)."""
    deadline = time.monotonic() + float(plan.get("deadline_s", 3600))
    sent: dict[str, dict] = {}  # type: ignore[type-arg]
    for entry in plan["files"]:
        path = entry["path"]
        tags, digests, whole = [], [], hashlib.sha256()
        with open(os.path.join(root, path), "rb") as file:
            for number, part in enumerate(entry["parts"], start=1):
                what = f"{path} (part {number} of {len(entry['parts'])})"
                body: list[_Span] = []

                def attempt(part=part, what=what, file=file, body=body, before=whole) -> str:  # type: ignore[no-untyped-def]
                    connection, target = _connection(part["url"])
                    headers = dict(part["headers"])
                    headers["Content-Length"] = str(part["length"])
                    body[:] = [_Span(file, part["offset"], part["length"], before)]
                    try:
                        connection.request("PUT", target, body=body[0], headers=headers)
                        response = connection.getresponse()
                        _answer(response, what)
                        response.read()
                        return response.getheader("ETag") or ""
                    except (OSError, http.client.HTTPException) as error:
                        raise Retry(type(error).__name__) from None
                    finally:
                        connection.close()

                tags.append(_retried(what, deadline, attempt))
                span = body[0]
                if span.left:
                    raise Failed(f"{what}: the file is shorter than when it was listed")
                digests.append(span.digest.hexdigest())
                whole = span.whole
        sent[path] = {"etags": tags, "parts": digests, "sha256": whole.hexdigest()}
    return sent


def link_in(entry: dict, target_path: str) -> None:  # type: ignore[type-arg]
    """Links the file `entry["source"]` (on this machine's network volume) at
    `target_path` (copies it where it cannot be linked), after checking its
    size and SHA-256 where it is."""
    path, source = entry["path"], entry["source"]
    digest, size = hashlib.sha256(), 0
    try:
        with open(source, "rb") as file:
            while block := file.read(BLOCK):
                digest.update(block)
                size += len(block)
    except OSError as error:
        raise Failed(
            f"{path}: {source} cannot be read ({error.strerror}): it was kept on a network "
            "volume this machine does not mount, or was removed from it"
        ) from None
    if size != entry["size"] or digest.hexdigest() != entry["sha256"]:
        raise Failed(
            f"{path}: {source} holds {size} bytes that are not the ones recorded "
            f"({entry['size']} bytes, SHA-256 {entry['sha256'][:12]}...)"
        )
    partial = f"{target_path}.linking"
    if os.path.lexists(partial):
        os.unlink(partial)
    try:
        os.link(source, partial)
    except OSError:
        shutil.copyfile(source, partial)
    os.replace(partial, target_path)


def get(root: str, plan: dict) -> None:  # type: ignore[type-arg]
    """Fetches each file of `plan` (or links it in from this machine's
    network volume), checks its size and SHA-256, and renames it in."""
    deadline = time.monotonic() + float(plan.get("deadline_s", 3600))
    for entry in plan["files"]:
        path = entry["path"]
        target_path = os.path.join(root, path)
        os.makedirs(os.path.dirname(target_path) or ".", exist_ok=True)
        if "source" in entry:
            link_in(entry, target_path)
            continue
        partial = f"{target_path}.fetching"

        def attempt(entry=entry, path=path, partial=partial) -> None:  # type: ignore[no-untyped-def]
            connection, target = _connection(entry["url"])
            digest = hashlib.sha256()
            size = 0
            try:
                connection.request("GET", target)
                response = connection.getresponse()
                _answer(response, path)
                with open(partial, "wb") as out:
                    while True:
                        block = response.read(BLOCK)
                        if not block:
                            break
                        out.write(block)
                        digest.update(block)
                        size += len(block)
            except (OSError, http.client.HTTPException) as error:
                raise Retry(type(error).__name__) from None
            finally:
                connection.close()
            if size != entry["size"] or digest.hexdigest() != entry["sha256"]:
                os.unlink(partial)
                raise Failed(
                    f"{path}: the store gave {size} bytes that are not the ones recorded "
                    f"({entry['size']} bytes, SHA-256 {entry['sha256'][:12]}...)"
                )

        _retried(path, deadline, attempt)
        os.replace(partial, target_path)


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in ("parts", "put", "get"):
        print("usage: overbrainer_store.py parts|put|get DIR [...]", file=sys.stderr)
        return 2
    command, root = argv[0], argv[1]
    try:
        if command == "parts":
            print(json.dumps(parts(root, int(argv[2]), json.load(sys.stdin))))
        elif command == "put":
            print(json.dumps(put(root, json.load(sys.stdin))))
        else:
            if len(argv) == 4 and argv[2] == "--plan-env":
                plan = json.loads(os.environ.pop(argv[3], "{}") or "{}")
            else:
                plan = json.load(sys.stdin)
            get(root, plan)
    except Failed as error:
        print(f"overbrainer_store: {error}", file=sys.stderr)
        return 2
    except (OSError, ValueError, KeyError) as error:
        print(f"overbrainer_store: {type(error).__name__}: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
