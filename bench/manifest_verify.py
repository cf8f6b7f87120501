"""Manifest + verify of 1 GiB of files against `sha256sum` over the same files,
side by side (best of three each): the retrieval's hashing cost, as a ratio.

Prints `BENCH local-manifest-verify-vs-sha256sum <ratio> ratio goal <= 1.1`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from overbrainer_prefect.executors.manifest import local_manifest, verify

SIZES = [512 << 20, 256 << 20, 128 << 20] + [16 << 20] * 8  # 1 GiB: large and small files
TRIES = 3


def best(action: Callable[[], object]) -> float:
    """The shortest of TRIES timings of `action`."""
    times = []
    for _ in range(TRIES):
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    """Writes the files, times both sides, prints the figures, removes the files."""
    root = Path(tempfile.mkdtemp(prefix="bench-manifest-"))
    try:
        out = root / "output"
        out.mkdir()
        for number, size in enumerate(SIZES):
            with open(out / f"f{number}.bin", "wb") as file:
                for _ in range(size >> 24):
                    file.write(os.urandom(16 << 20))
        files = sorted(str(p) for p in out.iterdir())
        # the reference computes one hash per file, as the manifest does, then checks them again
        reference = best(
            lambda: [
                subprocess.run(["sha256sum", *files], check=True, stdout=subprocess.DEVNULL)
                for _ in range(2)
            ]
        )
        ours = best(lambda: verify(root, ["output"], [], local_manifest(root, ["output"], [])))
        print(f"# sha256sum twice {reference:.2f} s, manifest + verify {ours:.2f} s over 1 GiB")
        print(f"BENCH local-manifest-verify-vs-sha256sum {ours / reference:.2f} ratio goal <= 1.1")
    finally:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
