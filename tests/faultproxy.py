"""A TCP proxy on 127.0.0.1 that puts faults between the tests and a real
server (the moto S3 server of `tests/s3server.py`): it forwards bytes both
ways, and on command it stalls every connection (holds their bytes) for a
while or until released, drops the answer of a request the server applied
(the request is forwarded, the answer thrown away, the connection closed),
answers a burst of requests 503 itself, or adds latency to every chunk.

It runs in threads of the test's own process, is stopped by `stop` (or its
`with` block) and never lives longer than `max_s`: a stall ends with it.

    with FaultProxy(s3.port) as proxy:
        url = s3.bucket_url(endpoint=proxy.endpoint)
        proxy.stall(90)            # every connection holds its bytes for 90 s
        proxy.release()            # ... or until now
        proxy.drop_answers(1)      # the next request is applied, its answer lost
        proxy.drop_answers(1, rb"^PUT [^ ]*ledger")  # ... the next one whose request line matches
        proxy.fail(3)              # the next 3 requests are answered 503
        proxy.latency(0.2)         # every chunk waits 0.2 s
        proxy.date(None)           # answers come without a Date header (or with the one given)
"""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time
from types import TracebackType

MAX_S = 600.0  # the longest a proxy lives: a forgotten one ends with its test
POLL_S = 0.05  # how often a held connection looks whether it may go on
CHUNK = 65536
JOIN_S = 5.0  # how long `stop` waits for each of its threads
INTERIM = b"HTTP/1.1 1"  # an interim answer (`100 Continue`), not the request's answer
DATE = re.compile(rb"\r\nDate: [^\r]*", re.IGNORECASE)  # the Date header of an answer
UNAVAILABLE = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/xml\r\n"
    b"Content-Length: 113\r\nConnection: close\r\n\r\n"
    b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>ServiceUnavailable</Code>"
    b"<Message>fault proxy</Message></Error>"
)


def _gone(sock: socket.socket) -> bool:
    """Whether the peer of `sock` closed it (nothing more will come)."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, TimeoutError):  # nothing to read now: still there
        return False
    except OSError:
        return True


class _Connection:
    """One client connection and its own to the server, opened with its first
    bytes forwarded (the server, moto's, serves one connection at a time: a
    connection held open before its request came would hold every client)."""

    def __init__(self, client: socket.socket) -> None:
        self.client = client
        self.server: socket.socket | None = None
        self.in_flight = False  # a request was sent whose answer has not begun
        self.dropping = False  # the answer of the request in flight is to be lost
        self.closed = threading.Event()

    def close(self) -> None:
        self.closed.set()
        for sock in (self.client, self.server):
            if sock is None:
                continue
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


class FaultProxy:
    """A proxy of 127.0.0.1:`upstream_port` on a port of its own (see the module)."""

    def __init__(self, upstream_port: int, max_s: float = MAX_S) -> None:
        self.upstream_port = upstream_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(POLL_S * 4)
        self.port: int = self._listener.getsockname()[1]
        self._end = time.monotonic() + max_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._stalled_until = 0.0
        self._drops = 0
        self._drop_line: re.Pattern[bytes] | None = None
        self._fails = 0
        self._latency_s = 0.0
        self._date: bytes | bool | None = True  # True: the server's own
        self._connections: list[_Connection] = []
        self._threads: list[threading.Thread] = []
        self.requests = 0
        """Requests seen (the first bytes from a client after an answer began)."""
        self.dropped = 0
        """Answers thrown away after the server applied their request."""
        self.failed = 0
        """Requests answered 503 by the proxy, never forwarded."""
        self._start(self._accepting, "faultproxy accept")

    @property
    def endpoint(self) -> str:
        """`http://127.0.0.1:PORT` of the proxy."""
        return f"http://127.0.0.1:{self.port}"

    # -- controls ----------------------------------------------------------------------

    def stall(self, seconds: float | None = None) -> None:
        """Holds every connection's bytes, both ways, new ones included, for
        `seconds` (None: until `release` or the proxy's end)."""
        with self._lock:
            self._stalled_until = self._end if seconds is None else time.monotonic() + seconds

    def release(self) -> None:
        """Ends a stall: held bytes go on."""
        with self._lock:
            self._stalled_until = 0.0

    def drop_answers(self, count: int = 1, line: bytes | None = None) -> None:
        """The next `count` requests (whose request line matches the regular
        expression `line`, when given) reach the server; their answers are
        thrown away and their connections closed (the client sees a lost answer)."""
        with self._lock:
            self._drops += count
            self._drop_line = None if line is None else re.compile(line)

    def fail(self, count: int) -> None:
        """The next `count` requests are answered 503 by the proxy, never forwarded."""
        with self._lock:
            self._fails += count

    def latency(self, seconds: float) -> None:
        """Every chunk forwarded from now on waits `seconds` first (0: none)."""
        with self._lock:
            self._latency_s = seconds

    def date(self, value: bytes | None) -> None:
        """Every answer from now on carries `value` as its `Date` header (None: none)."""
        with self._lock:
            self._date = value

    def _dated(self, data: bytes) -> bytes:
        """An answer's first chunk with its Date header as `date` said."""
        if self._date is True or not data.startswith(b"HTTP/"):
            return data
        header = b"" if self._date is None else b"\r\nDate: " + bytes(self._date)
        return DATE.sub(lambda _: header, data, count=1)

    @property
    def stalled(self) -> bool:
        """Whether bytes are held now."""
        return time.monotonic() < self._stalled_until

    # -- the proxy ---------------------------------------------------------------------

    def _start(self, target: object, name: str, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)  # type: ignore[arg-type]
        self._threads.append(thread)
        thread.start()

    def _live(self) -> bool:
        return not self._stop.is_set() and time.monotonic() < self._end

    def _accepting(self) -> None:
        while self._live():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(POLL_S * 4)
            connection = _Connection(client)
            with self._lock:
                self._connections.append(connection)
            self._start(self._pump, "faultproxy up", connection, True)
        self._close_all()

    def _connect(self, connection: _Connection) -> socket.socket:
        """The connection's own to the server, opened now if it is not yet
        (and its answers' pump started). Raises OSError."""
        if connection.server is None:
            server = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=5)
            server.settimeout(POLL_S * 4)
            connection.server = server
            self._start(self._pump, "faultproxy down", connection, False)
        return connection.server

    def _held(self, connection: _Connection) -> bool:
        """Waits while the proxy stalls; False when the proxy or the connection
        ended, or its client gave up meanwhile (closed it: what it sent is
        lost with the stall, never delivered late)."""
        while self.stalled:
            if not self._live() or connection.closed.is_set() or _gone(connection.client):
                return False
            time.sleep(POLL_S)
        return self._live() and not connection.closed.is_set()

    def _pump(self, connection: _Connection, upward: bool) -> None:
        source = connection.client if upward else connection.server
        assert source is not None
        try:
            while self._live() and not connection.closed.is_set():
                try:
                    data = source.recv(CHUNK)
                except TimeoutError:
                    continue
                if not data:
                    break
                if not self._held(connection):
                    break
                if self._latency_s:
                    time.sleep(self._latency_s)
                if upward:
                    if not connection.in_flight:  # a new request
                        with self._lock:
                            self.requests += 1
                            fail = self._fails > 0
                            if fail:
                                self._fails -= 1
                                self.failed += 1
                            elif self._drops > 0 and (
                                self._drop_line is None or self._drop_line.search(data[:2048])
                            ):
                                self._drops -= 1
                                self.dropped += 1
                                connection.dropping = True
                        if fail:
                            connection.client.sendall(UNAVAILABLE)
                            break
                        connection.in_flight = True
                    self._connect(connection).sendall(data)
                elif data.startswith(INTERIM):  # `100 Continue`: the request goes on
                    connection.client.sendall(data)
                else:
                    connection.in_flight = False
                    if connection.dropping:  # applied by the server: its answer is lost
                        break
                    connection.client.sendall(self._dated(data))
        except OSError:
            pass
        finally:
            connection.close()

    def _close_all(self) -> None:
        with self._lock:
            connections, self._connections = self._connections, []
        for connection in connections:
            connection.close()

    def stop(self) -> None:
        """Closes the proxy and every connection through it; waits (bounded) for its threads."""
        self._stop.set()
        self._listener.close()
        self._close_all()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(JOIN_S)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
