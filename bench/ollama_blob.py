"""Pushing a GGUF to Ollama: our client (`delivery/ollama.py`: a `HEAD`, then
the file streamed in 1 MiB pieces under its verified SHA-256, then the create
through the official client) against the official `ollama` client alone
(`AsyncClient.create_blob`, which hashes the file then streams it in 32 KiB
pieces, then `create`), each in a fresh process, on the same 500 MiB GGUF
(its magic, then a sparse rest), to the Ollama stand-in of tests/standins
running in a process of its own on 127.0.0.1 (a fresh one for each side: it
keeps what it is sent in memory, and its body limit is 1 GiB).

Prints:
    BENCH ollama-push-peak-rss-vs-official <ratio> ratio goal <= 1.1
        (our process's peak RSS / the official client's: neither may hold the file)
    BENCH ollama-push-vs-official <ratio> ratio goal <= 1.0      (wall time, ours / official)
    BENCH ollama-redeliver-vs-official <ratio> ratio goal <= 0.1
        (the same GGUF delivered again to a server that has it)

About 15 s on a 2-core machine, and 1 GiB of memory for the stand-in.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from kit.lines import bench, note, progress, run_main  # noqa: E402

SIZE = 500 << 20  # bytes of the GGUF: ten times a client's RSS (it was 1,000 MiB: 27 s)

SERVE = """
import signal
from tests.standins.ollama_server import OllamaStandIn
server = OllamaStandIn().start()
print(server.url, flush=True)
signal.sigwait([signal.SIGTERM])
server.stop()
"""

PUSH = """
import asyncio, json, resource, sys, time
from pathlib import Path
import ollama
from overbrainer_prefect.delivery.ollama import OllamaClient, chat_settings

side, path, url, sha256, times = sys.argv[1], Path(sys.argv[2]), *sys.argv[3:5], int(sys.argv[5])

async def ours() -> None:
    async with OllamaClient(url) as client:
        await client.push_gguf(path, sha256, "bench", chat_settings(None))

async def official() -> None:
    client = ollama.AsyncClient(host=url)
    digest = await client.create_blob(path)
    [_ async for _ in await client.create(model="bench", files={path.name: digest}, stream=True)]

async def main() -> None:
    walls = []
    for _ in range(times):
        start = time.monotonic()
        await (ours() if side == "ours" else official())
        walls.append(time.monotonic() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"walls": walls, "peak_mib": peak}))

asyncio.run(main())
"""


def push(side: str, gguf: Path, sha256: str, times: int) -> dict[str, Any]:
    """Starts a stand-in, pushes `gguf` to it `times` times with `side`'s client
    in a fresh process, stops the stand-in; returns the walls and the peak RSS."""
    paths = [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    server = subprocess.Popen(
        [sys.executable, "-c", SERVE], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        url = server.stdout.readline().strip()
        argv = [sys.executable, "-c", PUSH, side, str(gguf), url, sha256, str(times)]
        done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, check=True)
        found: dict[str, Any] = json.loads(done.stdout)
        return found
    finally:
        server.terminate()
        server.wait(30)


def main() -> None:
    """Writes the GGUF, pushes it with each client (once, then once again to a
    server that has it), prints the figures, removes the GGUF."""
    import hashlib

    root = Path(tempfile.mkdtemp(prefix="bench-ollama-"))
    try:
        gguf = root / "bench.gguf"
        with open(gguf, "wb") as file:
            file.write(b"GGUF\x03\x00\x00\x00")
            file.truncate(SIZE)
        digest = hashlib.sha256()
        with open(gguf, "rb") as file:
            while chunk := file.read(1 << 20):
                digest.update(chunk)
        sha256 = digest.hexdigest()
        progress("ours")
        ours = push("ours", gguf, sha256, 2)
        progress("the official client")
        official = push("official", gguf, sha256, 2)
        note(f"{SIZE >> 20} MiB GGUF; ours: {ours}; official: {official}")
        bench(
            "ollama-push-peak-rss-vs-official",
            ours["peak_mib"] / official["peak_mib"],
            "ratio",
            "<=",
            1.1,
        )
        ours_walls, official_walls = ours["walls"], official["walls"]
        bench("ollama-push-vs-official", ours_walls[0] / official_walls[0], "ratio", "<=", 1.0)
        bench("ollama-redeliver-vs-official", ours_walls[1] / official_walls[1], "ratio", "<=", 0.1)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    run_main(__file__, main)
