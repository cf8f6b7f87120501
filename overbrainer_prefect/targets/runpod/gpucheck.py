"""A pod has the GPUs it bills for: before its job starts, the GPUs the job's
environment sees (the probe, `trainers.probe`) are checked against the GPUs
Runpod shows for the pod (`gpu.count`, what it bills for; 0 for a pod
without GPUs). A pod whose image cannot see its GPUs (a CUDA build its
host's driver does not run) would train on the CPU at GPU prices: it is
deleted, and its run failed with both numbers.
"""

from __future__ import annotations

from overbrainer_prefect.runpod.pod import PodRecord
from overbrainer_prefect.trainers.base import TargetFacts, TrainError


def gpu_mismatch(pod: PodRecord, facts: TargetFacts) -> str | None:
    """Why the job must not start on `pod` when its environment (`facts`)
    sees another number of GPUs than the pod bills for; None when they agree
    or the pod's GPUs are not known."""
    billed = pod.billed_gpus
    if billed is None or facts.gpus == billed:
        return None
    what = f"{billed} × {pod.gpu_type_id}" if pod.gpu_type_id else f"{billed} GPUs"
    rate = f" at {pod.rate_text().strip(' ()')}" if pod.cost_per_hour is not None else ""
    return (
        f"pod {pod.name} bills for {billed} GPU{'s' if billed != 1 else ''} ({what}{rate}) "
        f"but its job sees {facts.gpus} (the probe of {facts.python}): the pod is deleted and "
        "no job started. Check that the image's CUDA build runs on the pod's driver "
        "(choose another image, or other gpu_types), then start the run again"
    )


def check_gpus(pod: PodRecord, facts: TargetFacts) -> None:
    """Raises TrainError (see `gpu_mismatch`) when the job on `pod` would not
    see the GPUs the pod bills for."""
    problem = gpu_mismatch(pod, facts)
    if problem:
        raise TrainError(problem)
