"""The SSH executor's transfers against `scp`, over the same loopback sshd,
side by side (interleaved, best of three each): upload and download of a 1 GiB
file, and the retrieval's check (manifest hashed on the target + local verify)
against `sha256sum` run on both sides.

Prints:
    BENCH ssh-upload-vs-scp <ratio> ratio goal >= 0.9            (scp time / ours)
    BENCH ssh-download-vs-scp <ratio> ratio goal >= 0.9
    BENCH ssh-manifest-verify-vs-sha256sum <ratio> ratio goal <= 1.1   (ours / reference)

The sshd it starts is stopped by its PID and every file it wrote is removed.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pydantic import SecretStr  # noqa: E402

from overbrainer_prefect.executors.manifest import verify  # noqa: E402
from overbrainer_prefect.executors.ssh import SshExecutor  # noqa: E402
from tests.sshd import Sshd  # noqa: E402

SIZE = 1 << 30  # bytes in the file moved both ways
TRIES = 3  # timings per side; the best one counts (a shared, noisy machine)


async def timed(action: Callable[[], Awaitable[object]]) -> float:
    """Seconds `action` takes."""
    start = time.perf_counter()
    await action()
    return time.perf_counter() - start


def scp_command(server: Sshd, known_hosts: Path, source: str, target: str) -> list[str]:
    """`scp` between here and `server`, as a user would run it (default ciphers)."""
    return [
        "scp",
        "-q",
        "-B",
        "-i",
        str(server.client_key_path),
        "-P",
        str(server.port),
        "-o",
        f"UserKnownHostsFile={known_hosts}",
        "-o",
        "StrictHostKeyChecking=yes",
        source,
        target,
    ]


async def shell(argv: list[str]) -> None:
    """Runs `argv`, output discarded; raises CalledProcessError when it fails."""
    process = await asyncio.create_subprocess_exec(*argv, stdout=subprocess.DEVNULL)
    if await process.wait() != 0:
        raise subprocess.CalledProcessError(process.returncode or 1, argv)


async def measure(root: Path, server: Sshd) -> None:
    """Times both sides of each figure and prints them."""
    source = root / "source"
    source.mkdir()
    with open(source / "weights.bin", "wb") as file:
        for _ in range(SIZE >> 24):
            file.write(os.urandom(16 << 20))
    known_hosts = root / "known_hosts"
    known_hosts.write_text(f"[127.0.0.1]:{server.port} {server.host_key_line}\n")
    remote = root / "remote"
    executor = SshExecutor(
        "127.0.0.1",
        port=server.port,
        user=server.user,
        client_key=SecretStr(server.client_key_text),
        known_host_key=server.host_key_line,
        workdir=str(remote),
        name="bench",
    )
    ours_dir, scp_dir = remote / "ours", remote / "scp"
    back_ours, back_scp = root / "back-ours", root / "back-scp"
    scp_dir.mkdir(parents=True)
    back_scp.mkdir()
    up: dict[str, list[float]] = {"ours": [], "scp": []}
    down: dict[str, list[float]] = {"ours": [], "scp": []}
    check: dict[str, list[float]] = {"ours": [], "ref": []}
    try:
        await executor.run(["true"])  # connected once, as a run's executor is
        for _ in range(TRIES):
            shutil.rmtree(ours_dir, ignore_errors=True)
            up["scp"].append(
                await timed(
                    lambda: shell(
                        scp_command(
                            server,
                            known_hosts,
                            str(source / "weights.bin"),
                            f"{server.user}@127.0.0.1:{scp_dir}/weights.bin",
                        )
                    )
                )
            )
            up["ours"].append(await timed(lambda: executor.upload(source, str(ours_dir))))
            shutil.rmtree(back_ours, ignore_errors=True)
            down["scp"].append(
                await timed(
                    lambda: shell(
                        scp_command(
                            server,
                            known_hosts,
                            f"{server.user}@127.0.0.1:{scp_dir}/weights.bin",
                            str(back_scp / "weights.bin"),
                        )
                    )
                )
            )
            down["ours"].append(
                await timed(lambda: executor.download(str(ours_dir), back_ours, ["."]))
            )

            async def ours_check() -> None:
                manifest = await executor.manifest(str(ours_dir), ["."])
                await asyncio.to_thread(verify, back_ours, ["."], [], manifest)

            async def reference_check() -> None:
                await shell(["sha256sum", str(scp_dir / "weights.bin")])
                await shell(["sha256sum", str(back_scp / "weights.bin")])

            check["ref"].append(await timed(reference_check))
            check["ours"].append(await timed(ours_check))
    finally:
        await executor.close()
    gib = SIZE / (1 << 30)
    for label, times in (("upload", up), ("download", down)):
        ours, scp = min(times["ours"]), min(times["scp"])
        print(
            f"# {label} {gib:g} GiB: ours {ours:.2f} s ({gib / ours * 1024:.0f} MiB/s), "
            f"scp {scp:.2f} s ({gib / scp * 1024:.0f} MiB/s); all: ours "
            + " ".join(f"{t:.2f}" for t in times["ours"])
            + ", scp "
            + " ".join(f"{t:.2f}" for t in times["scp"])
        )
        print(f"BENCH ssh-{label}-vs-scp {scp / ours:.2f} ratio goal >= 0.9")
    ours, ref = min(check["ours"]), min(check["ref"])
    print(
        f"# manifest on the target + local verify {ours:.2f} s, sha256sum on both sides {ref:.2f} s"
    )
    print(f"BENCH ssh-manifest-verify-vs-sha256sum {ours / ref:.2f} ratio goal <= 1.1")


def main() -> None:
    """Starts a loopback sshd, measures, then stops it and removes every file."""
    root = Path(tempfile.mkdtemp(prefix="bench-ssh-"))
    try:
        server = Sshd.create(root / "sshd")
        with server:
            asyncio.run(measure(root, server))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
