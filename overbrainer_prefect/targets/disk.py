"""The container disk of a pod, sized before the pod is asked for: what every
job it will run (its own, and a pipeline's later jobs on the same pod) holds
at its peak (`sizing.disk_peak`), from the weights of the models they load
(the Hub's safetensors metadata, or a local model's headers; nothing is
downloaded).

A target that fixes `container_disk_gb` smaller than that is refused in one
line, before anything exists; one that says `auto` gets that need with
headroom, rounded up. A pod on a network volume keeps its run directories
there: its container disk holds only the Hub cache.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pydantic import SecretStr

from overbrainer_prefect.runpod.settings import (
    AUTO,
    DEFAULT_DISK_GB,
    MIN_DISK_GB,
    RunpodTargetSettings,
    SettingsError,
)
from overbrainer_prefect.sizing import (
    DiskJob,
    DiskPeak,
    SizingError,
    Weights,
    disk_peak,
    model_weights,
    train_job,
)
from overbrainer_prefect.targets.base import JobNeed, Logger

GB = 1_000_000_000  # Runpod's disk sizes are decimal GB
HEADROOM = 0.10
"""What a sized disk is given beyond its jobs' peak, as a share of it..."""
HEADROOM_GB = 5
"""... and in GB: the image's own writes, logs, the datasets, a LoRA's adapter
and checkpoints, the tokenizer files beside the weights."""
ROUND_GB = 5
"""A sized disk is rounded up to a multiple of this."""


class DiskTooSmall(SettingsError):
    """A pod's fixed container disk that cannot hold its jobs; the message is one line."""


def disk_jobs(need: JobNeed, later: Sequence[JobNeed]) -> list[tuple[str, DiskJob]] | None:
    """The disk jobs of `need` and the `later` jobs on the same pod, in order;
    None when one of them says nothing of its disk."""
    jobs: list[tuple[str, DiskJob]] = []
    for job in (need, *later):
        if job.training is not None:
            jobs.append((job.what, train_job(job.training)))
        elif job.disk is not None:
            jobs.append((job.what, job.disk))
        elif job.gguf_bytes is not None:
            jobs.append((job.what, DiskJob("ggufs", gguf_bytes=job.gguf_bytes)))
        else:
            return None
    return jobs


def sized_gb(need_bytes: int) -> int:
    """A disk for `need_bytes` with headroom, in GB rounded up to `ROUND_GB`
    (at least `MIN_DISK_GB`)."""
    gb = need_bytes * (1 + HEADROOM) / GB + HEADROOM_GB
    return max(MIN_DISK_GB, ROUND_GB * math.ceil(gb / ROUND_GB))


def fit_disk(
    settings: RunpodTargetSettings,
    need: JobNeed,
    later: Sequence[JobNeed],
    name: str,
    token: SecretStr | None,
    endpoint: str | None,
    log: Logger,
) -> RunpodTargetSettings:
    """`settings` with the container disk the pod of `need` (and of the
    pipeline's `later` jobs on it) needs, for the target `name` (`token`
    and `endpoint` reach the Hub; `log` tells what it found): `auto` sized (`sized_gb`), a fixed
    size kept when it holds the jobs' peak. A disk that cannot be sized (a
    model the Hub shows no safetensors for, the Hub out of reach) is logged:
    a fixed size is kept, `auto` takes the default. Asks the Hub (blocking).

    Raises DiskTooSmall, one line naming the need and the setting, when a
    fixed size is smaller than the peak.
    """
    jobs = disk_jobs(need, later)
    fixed = settings.container_disk_gb
    kept = (
        f"container_disk_gb {fixed} is kept"
        if fixed != AUTO
        else (f"container_disk_gb auto takes {DEFAULT_DISK_GB} GB")
    )
    if jobs is None:
        log.info("the disk of %s's pod is not sized here: %s", need.what, kept)
        return settings if fixed != AUTO else _with_disk(settings, DEFAULT_DISK_GB)
    secret = token.get_secret_value() if token is not None else None
    known: dict[str, Weights] = {}

    def weights(model: str) -> Weights:
        if model not in known:
            known[model] = model_weights(model, token=secret, endpoint=endpoint)
        return known[model]

    try:
        peak = disk_peak(jobs, weights)
    except SizingError as error:
        log.warning("cannot size the disk of the pod for %s (%s): %s", need.what, error, kept)
        return settings if fixed != AUTO else _with_disk(settings, DEFAULT_DISK_GB)
    return _fitted(settings, peak, name, log)


def _fitted(
    settings: RunpodTargetSettings, peak: DiskPeak, name: str, log: Logger
) -> RunpodTargetSettings:
    volume = settings.network_volume_id is not None
    need = peak.cached if volume else peak.total
    where = (
        "for the Hub cache (their run directories are on the network volume)"
        if volume
        else f"at the peak of {peak.largest.what}"
    )
    wanted = sized_gb(need)
    fixed = settings.container_disk_gb
    if fixed == AUTO:
        log.info(
            "container_disk_gb auto: the pod gets %d GB of disk; its jobs need %.1f GB %s",
            wanted,
            need / GB,
            where,
        )
        return _with_disk(settings, wanted)
    if fixed * GB < need:
        raise DiskTooSmall(
            f"{name}: container_disk_gb is {fixed} GB, but the pod's jobs need about "
            f"{math.ceil(need / GB)} GB, {where}: set container_disk_gb to {wanted}, or to auto"
        )
    if fixed < wanted:
        log.warning(
            "container_disk_gb %d leaves little room: the pod's jobs need %.1f GB %s; %d or auto "
            "is safer",
            fixed,
            need / GB,
            where,
            wanted,
        )
    return settings


def _with_disk(settings: RunpodTargetSettings, gb: int) -> RunpodTargetSettings:
    return settings.model_copy(update={"container_disk_gb": gb})
