"""Headless Chromium driven over the DevTools protocol, for the UI tests: a page
is opened, waited on until a script says it has rendered what the test looks
for, read by scripts run in it (an image's `naturalWidth`, an SVG's points,
the visible text), and screenshot. Debian's `chromium` (installed by `.ci/run`);
the tests that need it are skipped where it is not installed.

The browser runs in its own session and is stopped by its PID.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.sync.client import ClientConnection, connect

START_TIMEOUT_S = 60.0  # chromium's first start on a loaded machine
CALL_TIMEOUT_S = 60.0  # one DevTools call


HEADLESS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)
"""How these tests start Chromium as root on a machine with no network but loopback."""


def chromium() -> str:
    """The headless browser; the test is skipped where none is installed."""
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    pytest.skip("chromium is not installed: apt-get install chromium")


class Browser:
    """One headless Chromium with one page, driven over its DevTools websocket."""

    def __init__(self, profile: Path, width: int = 1400, height: int = 1800) -> None:
        self.profile = profile
        self.width, self.height = width, height
        self.process: subprocess.Popen[bytes] | None = None
        self.socket: ClientConnection | None = None
        self._ids = itertools.count(1)

    def __enter__(self) -> Browser:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def start(self) -> None:
        """Starts chromium and connects to its page."""
        self.profile.mkdir(parents=True, exist_ok=True)
        port_file = self.profile / "DevToolsActivePort"
        port_file.unlink(missing_ok=True)
        self.process = subprocess.Popen(
            [
                chromium(),
                *HEADLESS,
                "--remote-debugging-address=127.0.0.1",
                "--remote-debugging-port=0",
                f"--user-data-dir={self.profile}",
                f"--window-size={self.width},{self.height}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while not port_file.is_file() or not port_file.read_text().strip():
            if self.process.poll() is not None:
                raise AssertionError(f"chromium exited ({self.process.returncode}) at start")
            if time.monotonic() > deadline:
                raise AssertionError(f"chromium did not start in {START_TIMEOUT_S:g} s")
            time.sleep(0.2)
        port = int(port_file.read_text().split()[0])
        pages = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json()
        page = next(p for p in pages if p.get("type") == "page")
        # no keepalive pings: every call is bounded by CALL_TIMEOUT_S already, and a
        # Chromium busy rendering on a loaded machine may answer a ping late
        self.socket = connect(
            page["webSocketDebuggerUrl"], max_size=None, open_timeout=30, ping_interval=None
        )
        self.call("Page.enable")
        self.call("Runtime.enable")

    def stop(self) -> None:
        """Closes the connection and kills the browser's process group by PID."""
        if self.socket is not None:
            with contextlib.suppress(Exception):
                self.socket.close()
            self.socket = None
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """Calls a DevTools method; returns its result (events are skipped)."""
        assert self.socket is not None, "the browser is not started"
        call_id = next(self._ids)
        self.socket.send(json.dumps({"id": call_id, "method": method, "params": params}))
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"DevTools {method} did not answer in {CALL_TIMEOUT_S:g} s")
            message = json.loads(self.socket.recv(timeout=left))
            if message.get("id") != call_id:
                continue
            if "error" in message:
                raise AssertionError(f"DevTools {method} failed: {message['error']}")
            result: dict[str, Any] = message.get("result", {})
            return result

    def open(self, url: str) -> None:
        """Navigates the page to `url` (its scripts keep running after this returns)."""
        self.call("Page.navigate", url=url)

    def evaluate(self, script: str) -> Any:
        """The value of a JavaScript expression in the page (awaited when a promise)."""
        result = self.call(
            "Runtime.evaluate", expression=script, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            raise AssertionError(f"script failed: {result['exceptionDetails']}")
        return result.get("result", {}).get("value")

    def wait_for(self, script: str, timeout: float, what: str) -> Any:
        """Evaluates `script` until it returns something true (returned), failing
        with `what` and the page's text after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(AssertionError):
                value = self.evaluate(script)
                if value:
                    return value
            time.sleep(0.5)
        text = self.text()[:2000]
        raise AssertionError(f"timed out after {timeout:g} s waiting for {what}; page: {text}")

    def wait_for_text(self, needles: list[str], timeout: float, what: str) -> str:
        """The page's visible text once it holds every one of `needles`, read in
        the same look that finds them (a page that re-renders can drop its text
        between two looks); fails as `wait_for` does."""
        script = f"(t => {json.dumps(needles)}.every(n => t.includes(n)) ? t : null)" + (
            "(document.body ? document.body.innerText : '')"
        )
        return str(self.wait_for(script, timeout, what))

    def text(self) -> str:
        """The page's visible text."""
        value = self.evaluate("document.body ? document.body.innerText : ''")
        return str(value or "")

    def screenshot(self, path: Path, settle_s: float = 1.0) -> Path:
        """Saves a PNG of the page's window at `path`, once it has had `settle_s`
        seconds to finish re-rendering what its scripts just fetched."""
        time.sleep(settle_s)
        shot = self.call("Page.captureScreenshot", format="png")
        path.write_bytes(base64.b64decode(shot["data"]))
        return path
