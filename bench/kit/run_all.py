"""`make bench`: the package, its flows, tests and benches compiled to
bytecode (as `make test` does: where PYTHONDONTWRITEBYTECODE is set, each
flow-run process would otherwise compile them again), then every
`bench/*.py` against one shared Prefect server (kit/server.py's
`started_server`, started once here instead of once per script: its URL and
PID in SHARED_ENV and SHARED_PID_ENV, and the scripts that call flows with
no server of their own get it as PREFECT_API_URL instead of each starting
Prefect's temporary one). The steps whose scripts use it run first and the
server is stopped after the last of them (`needs_server`): it idled
through the 11 minutes of the scripts that never call it (suspended_scale's
among them), at 9.3 CPU seconds a minute with every service on and 3.4
with tests/prefect_server.py's UNUSED_SERVICES off (2026-12-06), beside
the figures of train_job, compare_speed and store_transfer.

Every script runs alone, in turn, except the scripts of each block of
BLOCKS (TOGETHER, then those of PAIRS): a block runs at the place of the
first of its scripts, with nothing else beside it: each of its lanes is a
sequence of scripts run in turn, and the lanes run at the same time. The
scripts of TOGETHER take about three minutes that way, against eight in
turn. They are the scripts that mostly wait (on simulated boots, store
stalls, leases, fixed windows: from a tenth of a core to four fifths each,
measured alone) and whose figures another script's load beside them cannot
bias:
- counts of broken guarantees, which a slower machine does not make
  (chaos-violations, two-followers-under-stall, ledger-entries-*): their
  faults are timed by their own clocks, and a count is the same whenever a
  step takes place;
- a request count over a fixed window (store-requests-per-idle-minute-
  history10k), and seconds against a goal at least twice what they measure
  alone: follow-pass-s-history10k (0.28 s, goal 1), the seconds a pod bills
  outside its jobs (pod-billed-before-job-* 1.4 s, goal 5;
  pod-billed-after-retrieval-* 0.02 s, goal 10; fine-tune-pod-seconds-outside-
  jobs 11 s, goal 25, deployed too) and the pod counts;
- ratios of two sides timed in turn, alternating, within one script
  (pool-placement-s, multinode-overhead: no goal): both sides see the same
  neighbours, so the ratio stays side by side (multinode-overhead was 1.26
  beside the block at a load average of 19, 1.25 alone). Its
  multinode-last-node-to-first-step-s (no goal) is a time of its own, read
  beside the block: a torchrun's start, longer on a busier machine.
A neighbour's load can only lengthen a time, never shorten it: a bound met
beside the block is met alone, and one missed beside it says to run that
script alone (`run_all.py <name>`) before reading it as a regression. Read
twice beside the block at load averages of 15 to 20 (other engineers' work
and a whole suspended_scale beside it too): the counts the same, the pods'
bounds met (fine-tune-pod-seconds-outside-jobs 20.6 and 16.5 s, goal 25;
pod-billed-before-job-* at most 3.0 s, goal 5), and only
follow-pass-s-history10k missed (1.9 and 1.8 s, 0.28 s on a quiet machine
alone); so follow_history runs last in its lane, after the others' starts.
The block keeps the machine's two cores busy (348 CPU seconds of the
machine in 192 s, 2026-12-05): another script beside it would only share them.

The blocks of PAIRS are two lanes each, of scripts that use about a core or
less, measured alone by the machine's busy seconds (/proc/stat), so that
each keeps about a core of its own, and whose figures came out as alone
each time they were read side by side (2026-12-05): store_transfer (0.94 of
a core: the S3 server answers one request at a time) beside compare_speed
(one thread), twice: compare-vs-bare 1.02 and evaluate-vs-bare 1.01 (goal
>= 0.95), store-record-update-p95 0.060 and 0.033 s (goal 0.2):
compare_speed ends before the record updates begin. About 20 s saved.
Tried and dropped, each in a whole `make bench` (2026-12-05):
- lost_pod (0.64) beside follow_scale (0.78): every figure met once (resume
  29.1 s, goal 35; the delays' p95 at most 2.39 s, goal 3), then on a host
  slower by a tenth lost-pod-resume-s 38.6 s and collect-first-metric-
  delay-p95-n100 4.72 s: both wait on a job's start, a core of imports;
- store_transfer beside axolotl_cloud, ollama_blob and manifest_verify:
  store-record-update-p95 0.204 s (0.056 alone: the S3 server, saturated
  alone by those updates, needs its core);
- follow_scale beside those three: collect-first-metric-delay-p95-n100
  3.39 s (axolotl's CLI start is a core of imports);
- three lanes at once, follow_scale beside flows_vs_jobs and lost_pod then
  axolotl_cloud: fine-tune-overhead 8.6 s (goal 5), lost-pod-resume-s 34.3 s.

The second pair: train_job (one training job at a time, 0.8 of a core:
its two sides alternate, so a neighbour's load falls on both; its ratio has
had room since the runner, 0.79 to 0.84 alone) beside axolotl_cloud, then
manifest_verify and ollama_blob (about a core each, in turn), whose goals
have room beside it: read on 2026-12-06, the block took 108 s against about
240 s in turn, train-job-vs-bare 0.84 (0.80 alone the same hour),
manifest-verify-vs-openssl 0.72 (0.45 alone: our side hashes with two
threads and the neighbour takes one core of them; goal <= 1.1), the ollama
ratios as alone (peak RSS 1.05, push 0.14, redeliver 0.01), and
axolotl-cloud-overhead 13.42 s (12.0 alone on a slower machine; it misses
its goal of 3 s alone too, by axolotl's own CLI start) with its launcher's
part 1.67 s (0.95 alone).

The scripts that need a core or more (ssh_transfer 1.5) or whose goal is
tight beside anything (flows_vs_jobs' overheads, lost_pod's resume and
follow_scale's delays), and suspended_scale (the machine's CPU is one of its
figures; its flow-run starts keep both cores busy) run alone, as before.

Prints each script's lines whole when it ends (a script of a block has
its stdout held until then, so that its lines stay together; a script run
alone prints them as it goes), a `BENCH-ERROR <script> exited <code>` line
for a script that failed without printing its own (any exit but 0 and
ERROR_EXIT), a `#` line with each script's seconds, and the total last:
`# make bench: <seconds> s`; on stderr, after each script, its seconds, the
CPU seconds of its process tree (its own and what it reaped, from wait4)
and the load average, each block's seconds, and the CPU seconds the
machine spent during each step (all its processes: /proc/stat). A server
that stops answering before a script or a block is started again (once
each time).

`python bench/kit/run_all.py <name> ...` runs only the scripts named (with or
without `.py`), in that order, the same way (those of one block named
together, in their lanes): to time a few as `make bench` runs them."""

from __future__ import annotations

import compileall
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
REPO = BENCH.parent
sys.path[:0] = [str(REPO), str(BENCH)]

from kit.lines import ERROR_EXIT  # noqa: E402
from kit.process import machine_busy_s  # noqa: E402
from kit.server import (  # noqa: E402
    SHARED_ENV,
    SHARED_PID_ENV,
    Server,
    healthy,
    server_env,
    started_server,
)

TOGETHER: tuple[tuple[str, ...], ...] = (  # seconds and CPU seconds alone, before the block
    ("chaos_soak",),  # 154 s, 54 CPU s
    ("multinode_overhead", "pool_placement", "ledger_held"),  # 41 s, 6 CPU s; 7 s, 6; 3 s, 3
    ("two_followers_under_stall", "follow_history"),  # 39 s, 8 CPU s; 42 s, 11 (see the docstring)
    ("fine_tune_pods", "pod_billing"),  # 47 s, 33 CPU s; 57 s, 36 CPU s
    ("fine_tune_deployed",),  # 109 s, 89 CPU s
)
"""The lanes of the block of scripts that mostly wait (see the docstring)."""

PAIRS: tuple[tuple[tuple[str, ...], ...], ...] = (  # alone: seconds, the machine's CPU seconds
    (("store_transfer",), ("compare_speed",)),  # 93 s, 87 CPU s; 32 s, 33
    # 92 s, 73 CPU s; then in turn 64 s, 63; 18 s, 21; 15 s, 15
    (("train_job",), ("axolotl_cloud", "manifest_verify", "ollama_blob")),
)
"""Blocks of two lanes that use about a core each, measured alone (see the docstring)."""

BLOCKS = (TOGETHER, *PAIRS)
"""Every block: its lanes run at the same time, at the place of its first script."""


def shared_env(server: Server, home: Path) -> dict[str, str]:
    """The environment of every script: the shared server's URL and PID, and
    Prefect's client pointed at it with its own home."""
    return server_env(home, server.api_url) | {
        SHARED_ENV: server.api_url,
        SHARED_PID_ENV: str(server.pid),
    }


def scripts(names: list[str]) -> list[Path]:
    """The scripts named (every `bench/*.py` when none is), in order; SystemExit
    naming the scripts there are for a name that is none of them."""
    every = sorted(BENCH.glob("*.py"))
    if not names:
        return every
    by_name = {script.stem: script for script in every}
    unknown = [name for name in names if name.removesuffix(".py") not in by_name]
    if unknown:
        raise SystemExit(
            f"no bench script {', '.join(unknown)}: choose among {', '.join(sorted(by_name))}"
        )
    return [by_name[name.removesuffix(".py")] for name in names]


def plan(chosen: list[Path]) -> list[list[list[Path]]]:
    """The steps in order: each a list of lanes, each lane scripts run in
    turn; a script alone is a step of one lane of one script. The chosen
    scripts of each block of BLOCKS make one step, at the place of the first
    of them. The steps that use the shared server (`needs_server`) go first,
    each group in that order, so that the server is stopped once they end."""
    by_name = {script.stem: script for script in chosen}
    blocks = [
        [lane for lane in ([by_name[n] for n in lane if n in by_name] for lane in block) if lane]
        for block in BLOCKS
    ]
    block_of = {
        script: number for number, block in enumerate(blocks) for lane in block for script in lane
    }
    steps: list[list[list[Path]]] = []
    for script in chosen:
        if script not in block_of:
            steps.append([[script]])
        elif blocks[block_of[script]]:
            steps.append(blocks[block_of[script]])
            blocks[block_of[script]] = []
    return sorted(steps, key=lambda step: not needs_server(step))


SERVED = re.compile(r"\b(prefect_server|simulated_pods_and_target)\(")
"""A script that calls kit/server.py's `prefect_server`, itself or through
pod_billing.py's `simulated_pods_and_target`, uses the shared server (one
that calls it otherwise, unseen here, starts a private server of its own:
slower, never wrong)."""


def needs_server(step: list[list[Path]]) -> bool:
    """Whether a script of the step uses the shared Prefect server (`SERVED`)."""
    return any(SERVED.search(script.read_text()) for lane in step for script in lane)


@dataclass
class Ran:
    """One script's end: its exit code, wall and CPU seconds, held stdout."""

    code: int
    seconds: float
    cpu: float
    out: bytes | None


def run_script(script: Path, env: dict[str, str], hold: bool) -> Ran:
    """Runs `script` and waits for it; its stdout held (returned) when `hold`,
    else printed as it goes. The CPU seconds are its process's and those of
    every process it reaped (wait4's rusage)."""
    start = time.monotonic()
    process = subprocess.Popen(
        [sys.executable, str(script)],
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE if hold else None,
    )
    out = process.stdout.read() if process.stdout is not None else None
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
    if process.stdout is not None:
        process.stdout.close()
    return Ran(process.returncode, time.monotonic() - start, usage.ru_utime + usage.ru_stime, out)


def main() -> int:
    """Runs every script (or those named on the command line); returns 0 (a
    failed script has its BENCH-ERROR line)."""
    chosen = scripts(sys.argv[1:])
    began = time.monotonic()
    for tree in ("overbrainer_prefect", "flows", "tests", "bench"):
        compileall.compile_dir(REPO / tree, quiet=1)
    root = Path(tempfile.mkdtemp(prefix="bench-shared-"))
    took: dict[str, float] = {}
    printing = threading.Lock()

    def ended(script: Path, ran: Ran) -> None:
        with printing:
            if ran.out is not None:
                sys.stdout.buffer.write(ran.out)
            if ran.code not in (0, ERROR_EXIT):
                sys.stdout.buffer.write(f"BENCH-ERROR {script.name} exited {ran.code}\n".encode())
            sys.stdout.flush()
            took[script.stem] = ran.seconds
            print(  # on stderr, as the scripts' own progress lines
                f"[run_all] {script.name}: {ran.seconds:.0f} s, {ran.cpu:.0f} CPU s,"
                f" load average {os.getloadavg()[0]:.1f}",
                file=sys.stderr,
                flush=True,
            )

    try:
        with ExitStack() as stack:
            server: Server | None = None
            steps = plan(chosen)
            served = [needs_server(step) for step in steps]  # each script read once
            for number, lanes in enumerate(steps):
                if not any(served[number:]):
                    stack.close()  # no step left uses it: idle, it still takes CPU
                    server = None
                elif server is None or not healthy(server.api_url):
                    stack.close()  # stops one that no longer answers
                    server = stack.enter_context(started_server(root / f"server-{number}"))
                env = (  # never the caller's own Prefect profile or server
                    shared_env(server, root / "client-home")
                    if server is not None
                    else server_env(root / "client-home")
                )
                busy = machine_busy_s()
                if len(lanes) == 1 and len(lanes[0]) == 1:
                    ended(lanes[0][0], run_script(lanes[0][0], env, hold=False))
                    print(
                        f"[run_all] the machine: {machine_busy_s() - busy:.0f} CPU s",
                        file=sys.stderr,
                        flush=True,
                    )
                    continue
                start = time.monotonic()

                def lane_of(lane: list[Path], env: dict[str, str] = env) -> None:
                    for script in lane:
                        ended(script, run_script(script, env, hold=True))

                threads = [threading.Thread(target=lane_of, args=(lane,)) for lane in lanes]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
                names = " | ".join(", ".join(s.stem for s in lane) for lane in lanes)
                print(
                    f"[run_all] together ({names}): {time.monotonic() - start:.0f} s,"
                    f" the machine {machine_busy_s() - busy:.0f} CPU s",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    shown = ", ".join(f"{name} {seconds:.0f}" for name, seconds in sorted(took.items()))
    print(f"# seconds of each script: {shown}", flush=True)
    print(f"# make bench: {time.monotonic() - began:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
