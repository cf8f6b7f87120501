"""The names of a run's pods: every pod asked for a run is named for it
(`ob-<run id>-a<attempt>`), so that the pods of a run are found on the account
even when no record of them was kept."""

from __future__ import annotations

from overbrainer_prefect.runs.ids import is_valid_run_id

POD_NAME_PREFIX = "ob-"
"""Every pod of a run is named `ob-<run id>-a<attempt>`."""


def pod_name(run_id: str, attempt: int) -> str:
    """The unique name of the `attempt`-th pod asked for the run `run_id`."""
    return f"{POD_NAME_PREFIX}{run_id}-a{attempt}"


def run_of_pod_name(name: str) -> str | None:
    """The run ID a pod named `ob-<run id>-a<n>` belongs to (or a node of a
    cluster of that name, `ob-<run id>-a<n>-<rank>`), or None."""
    if not name.startswith(POD_NAME_PREFIX):
        return None
    body, sep, attempt = name[len(POD_NAME_PREFIX) :].rpartition("-a")
    number, _, rank = attempt.partition("-")
    if not sep or not number.isdigit() or (rank and not rank.isdigit()):
        return None
    return body if is_valid_run_id(body) else None
