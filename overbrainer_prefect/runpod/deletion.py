"""Whether a pod is really gone, and deleting one until it is.

Runpod's answers lag: a pod just deleted may still show for a while, in its
look-up and in the list, and a pod just created may answer 404. So a pod is
declared gone only after `GONE_LOOKS` looks in a row answered 404 and the
pod list no longer shows it; any answer showing the pod means it is not
gone. Nothing here deletes a pod that only looks gone.
"""

from __future__ import annotations

import asyncio
import logging
import time

from overbrainer_prefect.runpod.client import RunpodClient
from overbrainer_prefect.runpod.errors import PodNotGone
from overbrainer_prefect.runpod.models import Pod

log = logging.getLogger(__name__)

GONE_LOOKS = 3  # 404s in a row before a pod is declared gone (then the list must agree)
GONE_INTERVAL_S = 2.0  # seconds between two looks at a pod that answered 404
CONFIRM_TIMEOUT_S = 180.0  # seconds a deletion may take to be confirmed before it is reported


async def look_up(
    client: RunpodClient, pod_id: str, *, interval_s: float = GONE_INTERVAL_S
) -> Pod | None:
    """The pod `pod_id` as Runpod shows it, or None when it is really gone:
    `GONE_LOOKS` looks in a row, `interval_s` apart, answered 404, and the pod
    list does not show it. Never deletes anything.

    Raises RunpodError when a look fails: the pod is then undetermined.
    """
    for look in range(GONE_LOOKS):
        if look:
            await asyncio.sleep(interval_s)
        pod = await client.get_pod(pod_id)
        if pod is not None:
            return pod
    for listed in await client.list_pods():
        if listed.id == pod_id:
            return listed
    return None


async def confirm_deleted(
    client: RunpodClient,
    pod_id: str,
    *,
    interval_s: float = GONE_INTERVAL_S,
    timeout_s: float = CONFIRM_TIMEOUT_S,
) -> None:
    """Waits until the deleted pod `pod_id` is confirmed gone: `GONE_LOOKS`
    404s in a row, `interval_s` apart, then absent from the pod list. A look
    that shows the pod starts the count again.

    Raises PodNotGone when that does not happen within `timeout_s` (the pod
    may still bill), and RunpodError when Runpod stays unreachable.
    """
    started = time.monotonic()
    deadline = started + timeout_s
    misses = 0
    while True:
        pod = await client.get_pod(pod_id)
        misses = misses + 1 if pod is None else 0
        if misses >= GONE_LOOKS:
            if all(listed.id != pod_id for listed in await client.list_pods()):
                log.info("pod %s is gone", pod_id)
                return
            misses = 0
        if time.monotonic() + interval_s > deadline:
            raise PodNotGone(pod_id, time.monotonic() - started)
        await asyncio.sleep(interval_s)


async def delete_node_or_pod(
    client: RunpodClient,
    pod_id: str,
    cluster_id: str | None,
    *,
    interval_s: float = GONE_INTERVAL_S,
    timeout_s: float = CONFIRM_TIMEOUT_S,
) -> bool:
    """Deletes the pod `pod_id`, or, when it is a node of the instant cluster
    `cluster_id`, that whole cluster (a node cannot be deleted alone), and
    confirms the pod is gone. True when this call deleted it, False when it
    was already gone. Raises as `delete_and_confirm`."""
    if cluster_id is None:
        return await delete_and_confirm(client, pod_id, interval_s=interval_s, timeout_s=timeout_s)
    deleted = await client.delete_cluster(cluster_id)
    await confirm_deleted(client, pod_id, interval_s=interval_s, timeout_s=timeout_s)
    return deleted


async def delete_and_confirm(
    client: RunpodClient,
    pod_id: str,
    *,
    interval_s: float = GONE_INTERVAL_S,
    timeout_s: float = CONFIRM_TIMEOUT_S,
) -> bool:
    """Deletes the pod `pod_id` and confirms it is gone (`confirm_deleted`).
    True when this call deleted it, False when it was already gone; both are
    success. Raises PodNotGone or RunpodError as `confirm_deleted` does, or
    RunpodError when the delete is refused."""
    deleted = await client.delete_pod(pod_id)
    await confirm_deleted(client, pod_id, interval_s=interval_s, timeout_s=timeout_s)
    return deleted
