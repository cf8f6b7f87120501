"""A pod shared by the jobs of a pipeline: where its record is, and what the
client tells its watchdog between the jobs.

The pod's record (`pod.json`), keys and watchdog log belong to the record of
the job it was made for (its owner, the pipeline's run); every other job run
on it keeps a `pod.link` in its local run directory naming that owner, so
that its pod is found from its own record alone (attach, cancel, collect); the
link names the owner by its place in the runs directory, so it holds in any store.
On the pod, the watchdog is told of each job after the first in the owner's
`.pod/job`, and of a job whose files were verified with another to follow in
`.pod/between` (see bootstrap.sh).
"""

from __future__ import annotations

import json
import posixpath
from pathlib import Path

from overbrainer_prefect.executors.base import ExecError, Executor
from overbrainer_prefect.runpod.bootstrap import BETWEEN_MARKER, JOB_FILE, LEASE_FILE
from overbrainer_prefect.runs.ids import is_valid_run_id
from overbrainer_prefect.runs.store import Runs, RunsError
from overbrainer_prefect.store.records import RecordError

LINK_FILE = "pod.link"
"""In the local run directory of a job run on another record's pod: that record."""

PIPELINE_LINK = "pipeline-pod.link"
"""In the local run directory of a fine-tune's run: the record whose pod the
fine-tune's later jobs ran on, when it is not the run's own (a continued
fine-tune whose run had trained elsewhere, or on a pod that is gone)."""


def write_link(
    store: Runs, record_id: str, home: Runs, owner_id: str, name: str = LINK_FILE
) -> None:
    """Records that the job `record_id` of `store` runs on the pod of
    `owner_id` (of `home`) (`name`: which link). Raises RecordIoError when
    it cannot be written."""
    text = json.dumps({"prefix": home.prefix, "id": owner_id})
    store.write_bytes(record_id, name, (text + "\n").encode())


def home_of(store: Runs, record_id: str, name: str = LINK_FILE) -> tuple[Runs, str]:
    """The store and ID of the record whose `pod.json` is the pod of the job
    `record_id`: its own, unless it runs on another record's pod (`name`:
    which link). A link that cannot be read names the job itself."""
    try:
        data = json.loads(store.read_bytes(record_id, name))
        owner = str(data["id"])
        if "prefix" in data:
            prefix = str(data["prefix"])
        else:  # a link written before runs had a store: an absolute path of a local one
            prefix = Path(str(data["root"])).relative_to(store.top.root).as_posix()
        home = store.at("" if prefix == "." else prefix)
    except (OSError, RecordError, RunsError, ValueError, KeyError, TypeError):
        return store, record_id
    if not is_valid_run_id(owner):
        return store, record_id
    return home, owner


def job_dir(workdir: str, record_id: str) -> str:
    """The run directory of a job on a pod whose run directories are in `workdir`."""
    return posixpath.join(workdir, record_id)


async def _write(executor: Executor, path: str, text: str, lease: str) -> None:
    script = (
        'mkdir -p "$(dirname "$1")" && printf %s "$2" > "$1.tmp" && mv -f "$1.tmp" "$1" '
        '&& touch "$3"'
    )
    result = await executor.run(["sh", "-c", script, "mark", path, text, lease], timeout=30)
    if result.code != 0:
        raise ExecError("tell the pod's watchdog", result.stderr.strip()[:200] or "failed")


async def name_job(executor: Executor, pod_dir: str, job: str) -> None:
    """Tells the watchdog of the pod whose state is in `pod_dir` that the job
    in `job` (its run directory there) is the one it watches from now on, and
    renews the pod's lease. Raises ExecError when the pod cannot be reached."""
    await _write(executor, f"{pod_dir}/{JOB_FILE}", job, f"{pod_dir}/{LEASE_FILE}")


async def mark_between(executor: Executor, pod_dir: str, job: str) -> None:
    """Tells the pod's watchdog that the files of the job in `job` were
    verified and the pipeline's next job follows (the pod is deleted at its
    next-job grace unless one starts), and renews its lease. Raises ExecError
    when the pod cannot be reached."""
    await _write(executor, f"{pod_dir}/{BETWEEN_MARKER}", job, f"{pod_dir}/{LEASE_FILE}")
