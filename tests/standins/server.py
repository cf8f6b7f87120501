"""What the stand-in servers share: a threaded HTTP/1.1 server on 127.0.0.1
(a free port the kernel picks), started in a thread and shut down by its
owner, which reads request bodies sent with a length or chunked, answers JSON
or a chunked stream, and keeps a log of the requests it saw."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self
from urllib.parse import urlsplit

STOP_TIMEOUT_S = 10.0  # seconds a stop waits for the serving thread to end
MAX_BODY = 1 << 30  # bytes a request body may have: the test GGUFs are a few KiB


@dataclass
class Seen:
    """A request as the server saw it."""

    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes = b""


@dataclass
class Reply:
    """An answer: status, headers and body (bytes, or chunks sent as a stream)."""

    status: int
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    chunks: list[bytes] | None = None


def json_reply(status: int, value: Any, **headers: str) -> Reply:
    """A JSON answer."""
    return Reply(
        status, json.dumps(value).encode(), {"Content-Type": "application/json", **headers}
    )


class StandIn:
    """A stand-in server: subclasses implement `handle`. Use it as a context
    manager, or `start` and `stop` it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seen: list[Seen] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The server's base URL, `http://127.0.0.1:<port>`."""
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> Self:
        """Starts serving in a thread of its own."""
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops serving, closes the socket and waits for the thread (bounded)."""
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(STOP_TIMEOUT_S)
            assert not self._thread.is_alive(), "the stand-in did not stop"
            self._thread = None
        self._server.server_close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    def handle(self, request: Seen) -> Reply:
        """The answer to `request`."""
        raise NotImplementedError


def _handler_for(owner: StandIn) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # quiet
            return

        def _serve(self) -> None:
            parts = urlsplit(self.path)
            headers = {k.lower(): v for k, v in self.headers.items()}
            body = b"" if self.command == "HEAD" else self._body(headers)
            request = Seen(self.command, parts.path, parts.query, headers, body)
            with owner.lock:
                owner.seen.append(request)
            try:
                reply = owner.handle(request)
            except Exception as error:  # a stand-in bug shows as a 500, as a server's would
                reply = json_reply(500, {"error": f"stand-in failed: {error!r}"})
            self.send_response(reply.status)
            for key, value in reply.headers.items():
                self.send_header(key, value)
            if reply.chunks is not None:
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for chunk in reply.chunks:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
            else:
                self.send_header("Content-Length", str(len(reply.body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(reply.body)

        def _body(self, headers: dict[str, str]) -> bytes:
            if headers.get("transfer-encoding", "").lower() == "chunked":
                parts: list[bytes] = []
                total = 0
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass
                        return b"".join(parts)
                    total += size
                    if total > MAX_BODY:
                        raise ValueError("request body too large")
                    parts.append(self.rfile.read(size))
                    self.rfile.readline()
            length = int(headers.get("content-length", "0"))
            if length > MAX_BODY:
                raise ValueError("request body too large")
            return self.rfile.read(length) if length else b""

        do_GET = do_POST = do_PUT = do_HEAD = do_DELETE = _serve

    return Handler
