"""`make bench`: the package, its flows, tests and benches compiled to
bytecode (as `make test` does: where PYTHONDONTWRITEBYTECODE is set, each
flow-run process would otherwise compile them again), then every
`bench/*.py` in turn, alone, against one shared Prefect server
(kit/server.py's `started_server`, started once here instead of once per
script: its URL and PID in SHARED_ENV and SHARED_PID_ENV, and the scripts
that call flows with no server of their own get it as PREFECT_API_URL
instead of each starting Prefect's temporary one).

Prints each script's lines as it goes, a `BENCH-ERROR <script> exited <code>`
line for a script that failed without printing its own (any exit but 0 and
ERROR_EXIT), a `#` line with each script's seconds, and the total last:
`# make bench: <seconds> s`; on stderr, after each script, its seconds, the
CPU seconds of the processes it reaped and the load average. A server that
stops answering between two scripts is started again (once each time).

`python bench/kit/run_all.py <name> ...` runs only the scripts named (with or
without `.py`), in that order, the same way: to time a few as `make bench`
runs them."""

from __future__ import annotations

import compileall
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
REPO = BENCH.parent
sys.path[:0] = [str(REPO), str(BENCH)]

from kit.lines import ERROR_EXIT  # noqa: E402
from kit.process import children_cpu_seconds  # noqa: E402
from kit.server import (  # noqa: E402
    SHARED_ENV,
    SHARED_PID_ENV,
    Server,
    healthy,
    server_env,
    started_server,
)


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


def main() -> int:
    """Runs every script (or those named on the command line); returns 0 (a
    failed script has its BENCH-ERROR line)."""
    chosen = scripts(sys.argv[1:])
    began = time.monotonic()
    for tree in ("overbrainer_prefect", "flows", "tests", "bench"):
        compileall.compile_dir(REPO / tree, quiet=1)
    root = Path(tempfile.mkdtemp(prefix="bench-shared-"))
    took: list[str] = []
    try:
        with ExitStack() as stack:
            server = stack.enter_context(started_server(root / "server"))
            for number, script in enumerate(chosen):
                if not healthy(server.api_url):
                    stack.close()  # stops the one that no longer answers
                    server = stack.enter_context(started_server(root / f"server-{number}"))
                start, cpu = time.monotonic(), children_cpu_seconds()
                code = subprocess.call(
                    [sys.executable, str(script)],
                    cwd=REPO,
                    env=shared_env(server, root / "client-home"),
                )
                seconds = time.monotonic() - start
                took.append(f"{script.stem} {seconds:.0f}")
                print(  # on stderr, as the scripts' own progress lines
                    f"[run_all] {script.name}: {seconds:.0f} s, {children_cpu_seconds() - cpu:.0f}"
                    f" CPU s reaped, load average {os.getloadavg()[0]:.1f}",
                    file=sys.stderr,
                    flush=True,
                )
                if code not in (0, ERROR_EXIT):
                    print(f"BENCH-ERROR {script.name} exited {code}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"# seconds of each script: {', '.join(took)}", flush=True)
    print(f"# make bench: {time.monotonic() - began:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
