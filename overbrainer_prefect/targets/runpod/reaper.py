"""The reaper: what ends a pod at its boot bound when nothing on the pod
can, whatever dies on this side.

A pod's own watchdog bounds it once its start command runs; before that (an
image that never starts, a pull that hangs), only this machine can delete
it. So before the first create request of a run, a process of its own is
started, detached from the process that asks for the pod (its own session:
it outlives a follower killed outright, a crashed worker, a plain
`asyncio.run(train(...))` interrupted). It reads `pod.json` every few
seconds and ends as soon as the pod's watchdog has shown it runs (the cost
cap armed) or the pod is gone; once the boot bound passes (`boot_grace_s`
after the pod was asked for, plus two looks of a watchdog and its delete:
a watchdog that runs deletes its pod itself) with neither, it deletes every pod of the run,
confirms it, and records in `pod.json` that the reaper deleted it and why.
Its log is `runs/<id>/.pod/reaper.log`.

The account key reaches it through its stdin, never its arguments or its
environment.

    python -m overbrainer_prefect.targets.runpod.reaper RUNS_DIR RUN_ID REST_URL GRAPHQL_URL < key
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time

from pydantic import SecretStr

from overbrainer_prefect.runpod.bootstrap import POD_DIR, PodTiming
from overbrainer_prefect.runpod.client import RunpodClient
from overbrainer_prefect.runpod.errors import RunpodError
from overbrainer_prefect.runpod.pod import PodRecord, PodState
from overbrainer_prefect.runs.store import Runs
from overbrainer_prefect.targets.runpod.context import PodContext
from overbrainer_prefect.targets.runpod.ending import release, remove_hint

REAPER_LOG = f"{POD_DIR}/reaper.log"
"""The reaper's log, in the local run directory."""

BY = "reaper"
"""`pod.json`'s `deleted_by` for a pod the reaper ended."""

LOOK_S = 2.0  # seconds between two reads of pod.json (the boot bound is minutes on Runpod)
LINGER_S = 120.0  # seconds it keeps trying to delete past the boot bound, then ends (logged)
CHECK_S = 30.0  # seconds between two looks at the API before the bound (is Runpod there?)


WATCHDOG_FIRST_S = 5.0  # beside two looks of a watchdog: the time its own delete takes


def boot_bound(pod: PodRecord, timing: PodTiming) -> float | None:
    """When the reaper deletes a pod whose watchdog has not shown it runs
    (Unix seconds): its boot grace after it was asked for, plus two looks of
    a watchdog and its delete (a watchdog that runs deletes the pod itself
    at its boot grace, and says why in its log); None before it was asked for."""
    if pod.created_unix is None or pod.boot_grace_s is None:
        return None
    return pod.created_unix + pod.boot_grace_s + 2 * timing.watch_interval_s + WATCHDOG_FIRST_S


def reaper_reason(pod: PodRecord) -> str:
    """Why the reaper deleted a pod."""
    return (
        f"its watchdog never showed it runs within boot_grace ({pod.boot_grace_s or 0:g} s "
        "after it was asked for): the reaper deleted it"
    )


def start_reaper(runs: Runs, run_id: str, client: RunpodClient) -> int | None:
    """Starts the reaper of the run `run_id` (see the module), detached, and
    returns its PID; None (logged) when it cannot start: the pod is then
    bounded by its watchdog and a collector only."""
    key, rest_url, graphql_url = client.credentials()
    log_path = runs.run_dir(run_id) / REAPER_LOG
    try:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab") as log_file:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    __name__,
                    runs.top.store.location,
                    run_id,
                    rest_url,
                    graphql_url,
                ],
                stdin=subprocess.PIPE,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
            )
        assert proc.stdin is not None
        proc.stdin.write(key.get_secret_value().encode())
        proc.stdin.close()
    except OSError as error:
        logging.getLogger(__name__).warning(
            "cannot start the reaper of run %s (%s): until its watchdog runs, only a collect "
            "deletes its pod at its boot bound",
            run_id,
            error,
        )
        return None
    return proc.pid


async def reap(runs: Runs, run_id: str, client: RunpodClient, timing: PodTiming) -> str:
    """Watches `pod.json` of the run until its pod's watchdog shows it runs,
    or the pod is gone, or its boot bound passes, when every pod of the run
    is deleted (confirmed) and recorded deleted by the reaper. Returns what
    happened, in words. Never raises for a pod it could not delete: it says so."""
    ctx = PodContext(client=client, runs=runs, timing=timing)
    give_up: float | None = None
    answered = checked = began = time.time()
    while True:
        try:
            pod = PodRecord.load(runs, run_id)
        except Exception as error:  # the run directory went away
            return f"pod.json of run {run_id} cannot be read ({error}): nothing to watch"
        if pod is None:
            return f"run {run_id} has no pod.json: nothing to watch"
        if pod.watchdog_shown:
            return f"the watchdog of pod {pod.name} shows it runs: it bounds the pod"
        if not pod.attempts:  # no create request sent yet
            if time.time() - began > (pod.boot_grace_s or 0.0) + LINGER_S:
                return f"run {run_id} never asked for its pod: nothing to watch"
            await asyncio.sleep(LOOK_S)
            continue
        if pod.gone:
            return f"pod {pod.name} of run {run_id} is gone"
        bound = boot_bound(pod, timing)
        now = time.time()
        if pod.pod_id is not None and now - checked >= CHECK_S:
            checked = now
            try:
                await client.get_pod(pod.pod_id)
                answered = now
            except RunpodError as error:
                if error.status is not None:
                    answered = now
        if now - answered >= timing.reaper_unreachable_s:
            return (
                f"the Runpod API at {client.rest_url} gave no answer for "
                f"{timing.reaper_unreachable_s:g} s: "
                f"the reaper of run {run_id} ends; {remove_hint(run_id)} if its pod is left"
            )
        if bound is not None and now >= bound:
            await release(ctx, pod, reaper_reason(pod), by=BY)
            if pod.gone:
                if pod.swept and pod.state != PodState.DELETED:
                    # created, its answer never recorded (its follower died): swept by name
                    pod.mark_deleted(BY, reaper_reason(pod))
                    pod.save(runs)
                gone = ", ".join(([pod.pod_id] if pod.pod_id else []) + pod.swept)
                return f"pod {gone or '(none)'} of run {run_id} deleted at its boot bound"
            give_up = give_up or now + LINGER_S
            if now >= give_up:
                return f"pod {pod.name} of run {run_id} may still exist: {remove_hint(run_id)}"
        await asyncio.sleep(LOOK_S)


def main(argv: list[str]) -> int:
    """The reaper's process: `RUNS_DIR RUN_ID REST_URL GRAPHQL_URL`, the key on stdin."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stdout, force=True
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    runs_dir, run_id, rest_url, graphql_url = argv
    key = sys.stdin.read().strip()
    os.close(0)

    async def go() -> str:
        async with RunpodClient(SecretStr(key), rest_url, graphql_url) as client:
            return await reap(Runs(runs_dir), run_id, client, PodTiming.from_env())

    logging.getLogger(__name__).info("reaper of run %s: %s", run_id, asyncio.run(go()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
