"""The SSH executor's transfers against OpenSSH's `scp`, over the same loopback
sshd (tests/sshd.py), side by side: a 1 GiB file uploaded and downloaded,
PAIRS times each way, the two sides alternating (and which goes first
alternating too); the figure is the median of the pairs' ratios, so a burst of
load from the other users of the machine hurts one pair, not the figure.

Prints:
    BENCH ssh-upload-vs-scp <ratio> ratio goal >= 1     (scp's time / ours)
    BENCH ssh-download-vs-scp <ratio> ratio goal >= 1

`scp` runs as a user would run it (its default cipher, chacha20-poly1305, and
the SFTP protocol of OpenSSH 9); ours is `SshExecutor.upload`/`download` on a
connection opened once, as a run's executor is. The sshd is stopped by its PID
and every file it wrote is removed. About two minutes on a 2-core machine.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from kit.lines import bench, note, run_main  # noqa: E402
from kit.process import children_cpu_seconds, own_cpu_seconds, tree_cpu_seconds  # noqa: E402
from kit.sides import median, side_by_side, timed  # noqa: E402

SIZE = 1 << 30  # bytes of the file moved both ways
PAIRS = 3  # timings of each side each way
SCP_TIMEOUT_S = 300.0  # a copy this slow is broken, not slow


def write_random(path: Path, size: int) -> None:
    """A file of `size` random bytes (incompressible, as weights are)."""
    with open(path, "wb") as file:
        for _ in range(size >> 24):
            file.write(os.urandom(16 << 20))


def measure(root: Path) -> None:
    """Starts the sshd, times both sides both ways, prints the figures."""
    from pydantic import SecretStr

    from overbrainer_prefect.executors.ssh import SshExecutor
    from tests.sshd import Sshd

    source = root / "source"
    source.mkdir()
    write_random(source / "weights.bin", SIZE)
    server = Sshd.create(root / "sshd")
    known_hosts = root / "known_hosts"
    with server:
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
        login = f"{server.user}@127.0.0.1"
        assert server.pid is not None
        sshd_pid = server.pid
        cpu: dict[str, dict[str, list[float]]] = {
            way: {"ours": [], "scp": [], "sshd-ours": [], "sshd-scp": []}
            for way in ("upload", "download")
        }
        counting: list[str] = []  # the direction whose pairs' CPU is counted now, if any

        def accounted(side: str, client: Callable[[], float], action: Callable[[], float]) -> float:
            """`action`'s seconds; the CPU seconds of the client and of sshd noted."""
            client_before, sshd_before = client(), tree_cpu_seconds(sshd_pid)
            seconds = action()
            if counting:
                cpu[counting[0]][side].append(client() - client_before)
                cpu[counting[0]][f"sshd-{side}"].append(tree_cpu_seconds(sshd_pid) - sshd_before)
            return seconds

        def scp(source: str, target: str) -> float:
            argv = [
                "scp", "-q", "-B", "-i", str(server.client_key_path), "-P", str(server.port),
                "-o", f"UserKnownHostsFile={known_hosts}", "-o", "StrictHostKeyChecking=yes",
                source, target,
            ]  # fmt: skip
            return accounted(
                "scp",
                children_cpu_seconds,
                lambda: timed(
                    lambda: subprocess.run(
                        argv, check=True, stdin=subprocess.DEVNULL, timeout=SCP_TIMEOUT_S
                    )
                ),
            )

        def sftp_gcm(command: str) -> float:
            """OpenSSH's own sftp client with its cheapest cipher (AES-GCM, as ours)."""
            argv = [
                "sftp", "-q", "-b", "-", "-i", str(server.client_key_path), "-P", str(server.port),
                "-o", f"UserKnownHostsFile={known_hosts}", "-o", "StrictHostKeyChecking=yes",
                "-c", "aes128-gcm@openssh.com", login,
            ]  # fmt: skip
            return timed(
                lambda: subprocess.run(
                    argv,
                    input=command.encode(),
                    check=True,
                    stdout=subprocess.DEVNULL,
                    timeout=SCP_TIMEOUT_S,
                )
            )

        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(executor.run(["true"]))  # connected once

            def upload() -> float:
                return accounted(
                    "ours",
                    own_cpu_seconds,
                    lambda: timed(
                        lambda: loop.run_until_complete(executor.upload(source, str(ours_dir)))
                    ),
                )

            def download() -> float:
                return accounted(
                    "ours",
                    own_cpu_seconds,
                    lambda: timed(
                        lambda: loop.run_until_complete(
                            executor.download(str(ours_dir), back_ours, ["weights.bin"])
                        )
                    ),
                )

            def clean_up() -> None:
                shutil.rmtree(ours_dir, ignore_errors=True)
                (scp_dir / "weights.bin").unlink(missing_ok=True)

            def clean_down() -> None:
                shutil.rmtree(back_ours, ignore_errors=True)
                (back_scp / "weights.bin").unlink(missing_ok=True)

            counting[:] = ["upload"]
            up = side_by_side(
                PAIRS,
                upload,
                lambda: scp(str(source / "weights.bin"), f"{login}:{scp_dir}/weights.bin"),
                clean_up,
            )
            counting.clear()
            if not (ours_dir / "weights.bin").is_file():  # the last upload was scp's
                loop.run_until_complete(executor.upload(source, str(ours_dir)))
            if not (scp_dir / "weights.bin").is_file():
                scp(str(source / "weights.bin"), f"{login}:{scp_dir}/weights.bin")
            counting[:] = ["download"]
            down = side_by_side(
                PAIRS,
                download,
                lambda: scp(f"{login}:{scp_dir}/weights.bin", str(back_scp / "weights.bin")),
                clean_down,
            )
            counting.clear()
            # the ceiling on this machine: OpenSSH's sftp with AES-GCM against scp, one pair
            ceiling = {
                "upload": side_by_side(
                    1,
                    lambda: sftp_gcm(f'put "{source}/weights.bin" "{scp_dir}/sftp.bin"\n'),
                    lambda: scp(str(source / "weights.bin"), f"{login}:{scp_dir}/weights.bin"),
                ),
                "download": side_by_side(
                    1,
                    lambda: sftp_gcm(f'get "{scp_dir}/weights.bin" "{back_scp}/sftp.bin"\n'),
                    lambda: scp(f"{login}:{scp_dir}/weights.bin", str(back_scp / "weights.bin")),
                ),
            }
            same = (back_ours / "weights.bin").stat().st_size if back_ours.exists() else SIZE
            if same != SIZE:
                raise RuntimeError(f"the download is {same} bytes, not {SIZE}")
        finally:
            loop.run_until_complete(executor.close())
            loop.close()
    mib = SIZE / (1 << 20)
    for label, sides in (("upload", up), ("download", down)):
        used = cpu[label]
        note(f"{label} {mib:.0f} MiB, {PAIRS} pairs: {sides.describe(mib)}")
        note(
            f"  CPU seconds a GiB (median): ours {median(used['ours']):.2f} + sshd "
            f"{median(used['sshd-ours']):.2f}; scp {median(used['scp']):.2f} + sshd "
            f"{median(used['sshd-scp']):.2f} (the 2 cores, shared, are the bound)"
        )
        note(
            f"  OpenSSH's sftp with AES-GCM against scp, one pair: "
            f"{median(ceiling[label].speed_ratios()):.2f}x (what OpenSSH's own client gets here)"
        )
        bench(f"ssh-{label}-vs-scp", median(sides.speed_ratios()), "ratio", ">=", 1.0)


def main() -> None:
    """Measures in a scratch directory, removed afterwards."""
    root = Path(tempfile.mkdtemp(prefix="bench-ssh-"))
    try:
        measure(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    run_main(__file__, main)
