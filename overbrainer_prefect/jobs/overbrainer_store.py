"""Moves a job's files between its run directory and the runs' object store,
on the target itself, by presigned URLs: nothing of a model passes through
the worker, and no store key ever reaches the target (each URL is good for
one object or part, for a short while).

Runs with any Python 3.8+ on the target (the standard library only), in the
run directory `DIR`. Its input, a JSON object, comes on stdin (or, for `get`
as a job's first command, from the environment variable `--plan-env NAME`,
which reaches the job like its secrets): URLs are never in an argument, a
log line or a message.

    parts DIR             stdin: {"path": <bytes of each part>, ...}
                          stdout: {"path": ["<sha256 of each part>", ...]}
    put DIR               stdin: {"files": [{"path", "parts": [{"url", "headers",
                          "offset", "length"}]}], "deadline_s": N, "valid_s": V}
                          stdout: {"path": {"etags": [<each part's ETag>], "parts":
                          [<each part's SHA-256>], "sha256": <the parts' in order,
                          the file's when they are all of it>}}, the digests of the
                          bytes sent, hashed as they were read; a part not begun
                          within V seconds (its URL's credentials expire) is not
                          sent: its ETag is null (its digest is the bytes' on disk)
    reach DIR             stdin: {"url", "deadline_s": N}: one byte of an object
                          the store holds, got by its URL: whether this machine
                          reaches the store (exit 2 with one line when not)
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
import queue
import shutil
import sys
import threading
import time
import urllib.parse

BLOCK = 1 << 20  # bytes read, hashed and sent at a time
READ_AHEAD = 1  # parts read and hashed ahead of the senders (each held in memory until put)
HOLD = 64 << 20  # the biggest part held in memory; a file with bigger ones is streamed
SENDERS = 4  # connections that put a file's parts at once (rclone's default too)
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


class _Part:
    """One part of a file as it was read: its bytes (in blocks, the request
    body, sent again as they are when a try fails) and their SHA-256."""

    def __init__(self, index: int, blocks: list, sha256: str) -> None:  # type: ignore[type-arg]
        self.index = index
        self.blocks = blocks
        self.sha256 = sha256


class _Reader(threading.Thread):
    """Reads the parts of one file in order, each byte once, hashing it into
    its part's SHA-256 and the whole file's, and hands each part to the
    senders (at most READ_AHEAD parts waiting): a part is read and hashed
    while the store takes the one before."""

    def __init__(self, file, path: str, parts: list, stop: threading.Event) -> None:  # type: ignore[no-untyped-def,type-arg]
        super().__init__(daemon=True)
        self.file, self.path, self.parts, self.stop = file, path, parts, stop
        self.ready: queue.Queue = queue.Queue(READ_AHEAD)  # type: ignore[type-arg]
        self.whole = hashlib.sha256()
        self.error: BaseException | None = None

    def _hand(self, item) -> None:  # type: ignore[no-untyped-def]
        while not self.stop.is_set():
            try:
                self.ready.put(item, timeout=0.2)
                return
            except queue.Full:
                continue

    def run(self) -> None:
        try:
            for index, part in enumerate(self.parts):
                if self.stop.is_set():
                    return
                self.file.seek(part["offset"])
                digest, blocks, left = hashlib.sha256(), [], part["length"]
                while left > 0:
                    block = self.file.read(min(BLOCK, left))
                    if not block:
                        raise Failed(
                            f"{self.path} (part {index + 1} of {len(self.parts)}): "
                            "the file is shorter than when it was listed"
                        )
                    digest.update(block)
                    self.whole.update(block)
                    blocks.append(block)
                    left -= len(block)
                self._hand(_Part(index, blocks, digest.hexdigest()))
        except BaseException as error:  # handed to the senders, raised by put
            self.error = error
        self._hand(None)


class _Sender:
    """Sends parts by their URLs on a connection of its own, kept open from
    one part to the next where the store allows it."""

    def __init__(self) -> None:
        self.connection: http.client.HTTPConnection | None = None
        self.netloc = ""

    def _open(self, url: str) -> tuple[http.client.HTTPConnection, str]:
        parts = urllib.parse.urlsplit(url)
        if self.connection is None or self.netloc != f"{parts.scheme}://{parts.netloc}":
            self.close()
            self.connection, _ = _connection(url)
            self.netloc = f"{parts.scheme}://{parts.netloc}"
        return self.connection, parts.path + (f"?{parts.query}" if parts.query else "")

    def close(self) -> None:
        if self.connection is not None:
            self.connection.close()
            self.connection = None

    def send(
        self, part: dict, blocks: list, what: str, deadline: float, valid: float
    ) -> str | None:  # type: ignore[type-arg]
        """The ETag of the part, put with `blocks` as its body; None when its
        URL is no longer `valid` (a monotonic time) before a try begins."""

        def attempt() -> str:
            connection, target = self._open(part["url"])
            headers = dict(part["headers"])
            headers["Content-Length"] = str(part["length"])
            put = False
            try:
                connection.request("PUT", target, body=iter(blocks), headers=headers)
                response = connection.getresponse()
                _answer(response, what)
                response.read()
                put = True
                return response.getheader("ETag") or ""
            except (OSError, http.client.HTTPException) as error:
                raise Retry(type(error).__name__) from None
            finally:
                if not put:  # a try that failed leaves nothing behind on the next one's connection
                    self.close()

        tag = _retried(what, deadline, attempt, valid)
        return None if tag is None else str(tag)


def _connection(
    url: str, timeout: float = REQUEST_TIMEOUT_S
) -> tuple[http.client.HTTPConnection, str]:
    parts = urllib.parse.urlsplit(url)
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    target = parts.path + (f"?{parts.query}" if parts.query else "")
    return kind(parts.netloc, timeout=timeout, blocksize=BLOCK), target


def _retried(what: str, deadline: float, attempt, valid: float = float("inf")):  # type: ignore[no-untyped-def]
    pause = FIRST_PAUSE_S
    while True:
        if time.monotonic() > valid:
            return None  # its URL's credentials are about to expire: it is signed again
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


def parts(root: str, lengths: dict[str, int]) -> dict[str, list[str]]:
    """The SHA-256 of each part of each file of `lengths` (path: bytes of each
    part but the last; one part for an empty file). Raises OSError when a file
    cannot be read."""
    found: dict[str, list[str]] = {}
    for path, part_size in lengths.items():
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


def _put_streamed(file, path: str, parts: list, deadline: float, valid: float, first: bool) -> dict:  # type: ignore[no-untyped-def,type-arg]
    """Puts the `parts` of one open file one after the other, each read from
    the file as it is sent and hashed as it is read (a part sent again is
    hashed again from where the file's digest stood before it): for a file
    whose parts are too big to hold in memory (a single PUT of up to
    `part_size`)."""
    tags, digests, whole = [], [], hashlib.sha256()
    for number, part in enumerate(parts, start=1):
        what = f"{path} (part {number} of {len(parts)})"
        body: list[_Span] = []

        def attempt(part=part, what=what, body=body, before=whole) -> str:  # type: ignore[no-untyped-def]
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

        good = float("inf") if first and number == 1 else valid
        tags.append(_retried(what, deadline, attempt, good))
        if tags[-1] is None:  # not sent: read and hashed all the same
            body[:] = [_Span(file, part["offset"], part["length"], whole)]
            while body[0].read(BLOCK):
                pass
        span = body[0]
        if span.left:
            raise Failed(f"{what}: the file is shorter than when it was listed")
        digests.append(span.digest.hexdigest())
        whole = span.whole
    return {"etags": tags, "parts": digests, "sha256": whole.hexdigest()}


def _put_file(file, path: str, parts: list, deadline: float, valid: float, first: bool) -> dict:  # type: ignore[no-untyped-def,type-arg]
    """Puts the `parts` of one open file: a reader hashes them in order while
    SENDERS put them, each on its own connection (streamed instead where a
    part is bigger than HOLD)."""
    if any(part["length"] > HOLD for part in parts):
        return _put_streamed(file, path, parts, deadline, valid, first)
    stop = threading.Event()
    reader = _Reader(file, path, parts, stop)
    tags: list[str | None] = [""] * len(parts)
    digests: list[str] = [""] * len(parts)
    failures: list[BaseException] = []
    lock = threading.Lock()

    def sender() -> None:
        own = _Sender()
        try:
            while not stop.is_set():
                with lock:  # one sender at a time takes the next part
                    try:
                        item = reader.ready.get(timeout=0.2)
                    except queue.Empty:
                        continue
                    if item is None:
                        reader.ready.put(None)  # the end, for the other senders too
                        return
                what = f"{path} (part {item.index + 1} of {len(parts)})"
                good = float("inf") if first and item.index == 0 else valid
                tags[item.index] = own.send(parts[item.index], item.blocks, what, deadline, good)
                digests[item.index] = item.sha256
        except BaseException as error:  # raised by put
            failures.append(error)
            stop.set()
        finally:
            own.close()

    reader.start()
    senders = [threading.Thread(target=sender, daemon=True) for _ in range(SENDERS)]
    for thread in senders:
        thread.start()
    for thread in senders:
        thread.join()
    stop.set()
    reader.join()
    if failures:
        raise failures[0]
    if reader.error is not None:
        raise reader.error
    return {"etags": tags, "parts": digests, "sha256": reader.whole.hexdigest()}


def put(root: str, plan: dict) -> dict[str, dict]:  # type: ignore[type-arg]
    """Puts each part of each file of `plan` by its URL; the ETag and SHA-256
    of each part sent, and the file's SHA-256. Each file is read once, in
    order, every byte hashed into its part's digest and the file's as it is
    read; a part tried again is sent from the very bytes hashed (or, for a
    part too big to hold, read and hashed again). A part not begun within the
    plan's `valid_s` is not sent (its ETag None), read and hashed all the
    same: its URL is signed again by fresh credentials (the plan's first part
    is sent all the same: its URL is good for minutes more). Raises Failed when a
    part cannot be put before the plan's deadline, the store refuses it, or a
    file is shorter than its parts."""
    began = time.monotonic()
    deadline = began + float(plan.get("deadline_s", 3600))
    valid_s = plan.get("valid_s")  # None: URLs as good as the deadline; 0: one part a run
    valid = began + (float(valid_s) if valid_s is not None else float("inf"))
    sent: dict[str, dict] = {}  # type: ignore[type-arg]
    for number, entry in enumerate(plan["files"]):
        with open(os.path.join(root, entry["path"]), "rb") as file:
            sent[entry["path"]] = _put_file(
                file, entry["path"], entry["parts"], deadline, valid, first=number == 0
            )
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


def reach(plan: dict) -> None:  # type: ignore[type-arg]
    """Gets the first byte of the object `plan["url"]` names: this machine
    reaches the store, and the store takes its URLs. Raises Failed when the
    store does not answer before the plan's deadline, or refuses the URL."""
    limit = float(plan.get("deadline_s", 30))
    deadline = time.monotonic() + limit
    what = "reach the store from this machine"

    def attempt() -> None:
        connection, target = _connection(plan["url"], min(REQUEST_TIMEOUT_S, limit / 2))
        try:
            connection.request("GET", target, headers={"Range": "bytes=0-0"})
            response = connection.getresponse()
            _answer(response, what)
            response.read()
        except (OSError, http.client.HTTPException) as error:
            raise Retry(type(error).__name__) from None
        finally:
            connection.close()

    _retried(what, deadline, attempt)


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in ("parts", "put", "reach", "get"):
        print("usage: overbrainer_store.py parts|put|reach|get DIR [...]", file=sys.stderr)
        return 2
    command, root = argv[0], argv[1]
    try:
        if command == "parts":
            print(json.dumps(parts(root, json.load(sys.stdin))))
        elif command == "put":
            print(json.dumps(put(root, json.load(sys.stdin))))
        elif command == "reach":
            reach(json.load(sys.stdin))
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
