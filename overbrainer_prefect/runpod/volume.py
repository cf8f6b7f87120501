"""The network volume a Runpod target mounts at `/workspace`: checked before
a pod is asked for, and grown (within `max_volume_gb`) when what a job will
write there does not fit. A volume only grows, and bills by its size from
then on, so it is grown only as far as the job needs and never past the
target's bound."""

from __future__ import annotations

import logging

from overbrainer_prefect.runpod.client import RunpodClient
from overbrainer_prefect.runpod.errors import PodError, RunpodError
from overbrainer_prefect.runpod.settings import RunpodTargetSettings

GB = 10**9
HEADROOM_TENTHS = 11  # a tenth more than the estimate: logs, caches, a temporary copy


class VolumeError(PodError):
    """The target's network volume cannot be used; nothing was asked for. One line."""


def needed_gb(need_bytes: int) -> int:
    """The whole GB a job that writes `need_bytes` needs on the volume, with headroom."""
    return max(1, -(-need_bytes * HEADROOM_TENTHS // (10 * GB)))


async def ensure_volume(
    client: RunpodClient,
    settings: RunpodTargetSettings,
    need_bytes: int | None,
    what: str,
    log: logging.Logger | logging.LoggerAdapter[logging.Logger],
) -> int | None:
    """Checks the target's network volume before a pod of `what` (a job that
    writes about `need_bytes` there; None: not known) is asked for: grows it
    to what the job needs when it is smaller and `max_volume_gb` allows it,
    and warns when it does not. Returns the volume's size in GB, or None
    without a network volume.

    Raises VolumeError with one line when the volume does not exist, is in
    another data center than the pod's, or cannot be read or grown.
    """
    volume_id = settings.network_volume_id
    if volume_id is None:
        return None
    try:
        volume = await client.get_network_volume(volume_id)
    except RunpodError as error:
        raise VolumeError(f"cannot read the network volume {volume_id}: {error}") from None
    if volume is None:
        raise VolumeError(
            f"no network volume {volume_id} in this Runpod account: check network_volume_id"
        )
    wanted_dc = settings.data_center_ids[0] if settings.data_center_ids else None
    if volume.data_center and wanted_dc and volume.data_center != wanted_dc:
        raise VolumeError(
            f"the network volume {volume_id} is in {volume.data_center}, not in {wanted_dc}: set "
            f"data_center_ids to [{volume.data_center}]"
        )
    if need_bytes is None:
        log.info(
            "network volume %s: %d GB; what %s writes there is not estimated",
            volume_id,
            volume.size,
            what,
        )
        return volume.size
    need = needed_gb(need_bytes)
    if volume.size >= need:
        log.info(
            "network volume %s: %d GB, %s needs about %d GB", volume_id, volume.size, what, need
        )
        return volume.size
    bound = settings.max_volume_gb
    if bound is None or need > bound:
        limit = "max_volume_gb is unset" if bound is None else f"max_volume_gb is {bound}"
        log.warning(
            "network volume %s has %d GB but %s needs about %d GB, and %s: it is not grown; grow "
            "it in the Runpod console or raise max_volume_gb",
            volume_id,
            volume.size,
            what,
            need,
            limit,
        )
        return volume.size
    try:
        grown = await client.grow_network_volume(volume_id, need)
    except RunpodError as error:
        raise VolumeError(
            f"cannot grow the network volume {volume_id} from {volume.size} to {need} GB: {error}"
        ) from None
    log.warning(
        "network volume %s grown from %d to %d GB for %s (max_volume_gb %d): a volume only grows, "
        "and bills by its size",
        volume_id,
        volume.size,
        grown.size,
        what,
        bound,
    )
    return grown.size
