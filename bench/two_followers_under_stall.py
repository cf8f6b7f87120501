"""How many runs two followers followed at once when their store stalled for
one of them longer than a lease's TTL (issue 36): ROUNDS rounds of the chaos
tests' scenario (`tests/stallfollowers.py`) on the real S3 server (moto's)
through the fault proxy (`tests/faultproxy.py`): follower A holds a run and
acts on it, B (another machine) waits for it, the store stalls for A for
STALL_S seconds. A round counts when B took the run before A let it go, or an
act of A's came after one of B's.

Prints `BENCH two-followers-under-stall <count> count goal <= 0` and, as
`#` lines, how soon A let go and how soon B took over in each round. About
a minute on a 2-core machine.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from kit.lines import bench, note, progress, run_main  # noqa: E402

ROUNDS = 3
TTL_S = 4.0  # a short lease: the same guarantee as 60 s, in seconds
STALL_S = 9.0  # longer than the TTL and than the time B needs to take the run


def main() -> None:
    from tests.faultproxy import FaultProxy
    from tests.s3server import S3Server, credentials_env
    from tests.stallfollowers import stall_round

    os.environ.update(credentials_env(), AWS_EC2_METADATA_DISABLED="true")
    root = Path(tempfile.mkdtemp(prefix="bench-stall-"))
    both = 0
    try:
        with S3Server.start(root / "moto.log") as s3, FaultProxy(s3.port, max_s=600) as proxy:
            for number in range(1, ROUNDS + 1):
                progress(f"round {number}/{ROUNDS}")
                seen = stall_round(s3, proxy, TTL_S, STALL_S)
                lost, took = seen.at("A", "LOST-SEEN"), seen.at("B", "FOLLOWING")
                note(
                    f"round {number}: A let go {lost[0] - seen.stalled_at:.2f} s into the stall, "
                    f"B took the run {took[0] - seen.stalled_at:.2f} s into it; the record "
                    f"kept {seen.acts.count('A')} acts of A's, then {seen.acts.count('B')} of B's"
                    if lost and took
                    else f"round {number}: A let go at {lost}, B took at {took}"
                )
                both += seen.both_followed
    finally:
        shutil.rmtree(root, ignore_errors=True)
    bench("two-followers-under-stall", both, "count", "<=", 0, digits=0)


if __name__ == "__main__":
    run_main(__file__, main)
