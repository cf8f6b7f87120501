"""The retrieval's check, a manifest of a run's files and the verification of
their copy (`local_manifest` + `verify`, which hash every byte twice: once on
the target's side, once on this side), over 1 GiB of files against the same
work done by `openssl dgst -sha256` (the hashing limit: OpenSSL's SHA-256, as
hashlib uses) and by coreutils' `sha256sum`, each run twice over the same
files, side by side: the sides alternate (three pairs against openssl, one against
sha256sum, four times slower); the figures are the medians of the pairs' ratios.

Prints:
    BENCH manifest-verify-vs-openssl <ratio> ratio goal <= 1.1   (ours / openssl)
    BENCH manifest-verify-vs-sha256sum <ratio> ratio              (ours / sha256sum)

The files (large and small, as a run's output is) are in the page cache for
every side. About 20 s on a 2-core machine (1 GiB: with 2 GiB, 38 s, the
ratios were the same, each side's time twice as long).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from kit.lines import bench, note, run_main  # noqa: E402
from kit.sides import median, side_by_side, timed  # noqa: E402

SIZES = [512 << 20, 256 << 20, 128 << 20, 64 << 20] + [8 << 20] * 8  # 1 GiB, large and small
PAIRS = 3  # pairs against openssl (the goal)
SHA256SUM_PAIRS = 1  # sha256sum takes 4x as long and has no goal: one pair says enough


def main() -> None:
    """Writes the files, times the three sides, prints the figures, removes the files."""
    from overbrainer_prefect.executors.manifest import local_manifest, verify

    root = Path(tempfile.mkdtemp(prefix="bench-manifest-"))
    try:
        out = root / "output"
        out.mkdir()
        for number, size in enumerate(SIZES):
            with open(out / f"f{number:02}.bin", "wb") as file:
                for offset in range(0, size, 16 << 20):
                    file.write(os.urandom(min(16 << 20, size - offset)))
        files = sorted(str(p) for p in out.iterdir())

        def twice(argv: list[str]) -> float:
            return timed(
                lambda: [
                    subprocess.run([*argv, *files], check=True, stdout=subprocess.DEVNULL)
                    for _ in range(2)
                ]
            )

        def ours() -> float:
            return timed(lambda: verify(root, ["output"], [], local_manifest(root, ["output"], [])))

        twice(["cat"])  # every file in the page cache before the first timing
        openssl = side_by_side(PAIRS, ours, lambda: twice(["openssl", "dgst", "-sha256"]))
        coreutils = side_by_side(SHA256SUM_PAIRS, ours, lambda: twice(["sha256sum"]))
        gib = sum(SIZES) / (1 << 30)
        note(f"{gib:g} GiB in {len(SIZES)} files, each hashed twice")
        note(f"vs openssl dgst: {openssl.describe()}")
        note(f"vs sha256sum: {coreutils.describe()}")
        bench("manifest-verify-vs-openssl", median(openssl.time_ratios()), "ratio", "<=", 1.1)
        bench("manifest-verify-vs-sha256sum", median(coreutils.time_ratios()), "ratio")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    run_main(__file__, main)
