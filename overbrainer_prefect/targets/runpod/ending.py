"""The end of a run's pod: deleting it and confirming it is gone, sweeping the
other pods of the run, forgetting its keys and its host key secret, and the
messages that say what still bills.

A pod is declared gone only once its deletion is confirmed (404s in a row,
then absent from the pod list); "already gone" is success, never an error.
A pod that only looks gone is never deleted on a guess: it may be kept, or
hold files not retrieved yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from enum import StrEnum

from overbrainer_prefect.executors.base import ExecError, Executor
from overbrainer_prefect.runpod.bootstrap import RETRIEVED_MARKER, WATCHDOG_LOG
from overbrainer_prefect.runpod.deletion import confirm_deleted, delete_node_or_pod, look_up
from overbrainer_prefect.runpod.errors import PodError, RunpodError
from overbrainer_prefect.runpod.models import Pod
from overbrainer_prefect.runpod.pod import PodRecord, PodState, usd
from overbrainer_prefect.runs.store import RunRecord, Runs, follow_again, subject
from overbrainer_prefect.steps.context import ENDED_BY
from overbrainer_prefect.store.records import RecordError
from overbrainer_prefect.targets.runpod.context import PodContext
from overbrainer_prefect.targets.runpod.fate import (
    RETRIEVED_REASON,
    Fate,
    container_restart,
    found_gone,
    restart_message,
    restart_reason,
)
from overbrainer_prefect.targets.runpod.keys import forget_client_key, ssh_command
from overbrainer_prefect.targets.runpod.names import run_of_pod_name
from overbrainer_prefect.timestamps import parse_rfc3339


class DeleteRefused(PodError):
    """A pod's delete was refused, or its deletion not confirmed; `why` says
    how Runpod answered (its status, never its body)."""

    def __init__(self, message: str, why: str) -> None:
        super().__init__(message)
        self.why = why


class Ending(StrEnum):
    """What became of a pod once its job ended."""

    DELETED = "deleted"
    """Deleted after its files were retrieved and verified, deletion confirmed."""
    KEPT = "kept"
    """keep_pod: only the pods flow deletes it."""
    AWAITING_RETRIEVAL = "awaiting_retrieval"
    """Its files were not retrieved: it stays for its watchdog's retrieve grace."""


VERIFIED_REASON = "its run's files were retrieved and verified"
"""Why the client's ending deletes a pod whose run's files it verified (and why
the pod is recorded deleted when its watchdog acted on that ending's marker first)."""


def remove_hint(run_id: str) -> str:
    """How to remove a run's pod by hand."""
    return f"remove the pod with the pods flow (action=remove, run_id={run_id})"


def attach_hint(record: RunRecord) -> str:
    """How to follow a run (or an export, a compare) again."""
    return f"follow it again with {follow_again(record)}"


async def remove(
    ctx: PodContext,
    pod: PodRecord,
    reason: str,
    by: str | None = None,
    *,
    after_marking: bool = False,
) -> None:
    """Deletes the run's pod and confirms it is gone (an "already gone" is
    success), recording each step in `pod.json`: `deleting` before the
    delete, `deleted` once confirmed, by `by` (by default who this process
    is: `client`, or `collector` in the collect flow). Does nothing when
    there is no pod or it is already recorded deleted. The record of an
    instant cluster deletes the cluster, and confirms each of its pods gone.
    `after_marking`: this process just marked the run's files retrieved on the
    pod for this ending, so a pod its watchdog deleted first on that marker is
    recorded deleted by the watchdog for `reason` (why the pod ended: its
    container's restart, say), not for the marker alone.

    Raises PodError when the delete is refused or cannot be confirmed: the pod
    then stays `deleting` in `pod.json`, and may still bill.
    """
    if pod.pod_id is None or pod.state == PodState.DELETED:
        return
    before = pod.model_copy()  # what it was: a pod found gone is told by the bound it was under
    pod.state = PodState.DELETING
    pod.save(ctx.runs)
    try:
        if pod.cluster_id is not None:  # a node of a cluster is deleted only with it
            deleted = await ctx.client.delete_cluster(pod.cluster_id)
        else:
            deleted = await ctx.client.delete_pod(pod.pod_id)
        taken_at = time.time()  # it bills until Runpod took the delete, not until confirmed
        for pod_id in [pod.pod_id, *(n.pod_id for n in pod.nodes if n.pod_id != pod.pod_id)]:
            await confirm_deleted(
                ctx.client,
                pod_id,
                interval_s=ctx.timing.gone_interval_s,
                timeout_s=ctx.timing.confirm_timeout_s,
            )
    except RunpodError as error:
        raise DeleteRefused(
            f"pod {pod.pod_id} of run {pod.run_id}{pod.rate_text()} may still exist ({error}); "
            f"{remove_hint(pod.run_id)}",
            str(error),
        ) from None
    fate = Fate(by or ENDED_BY.get(), reason, taken_at) if deleted else found_gone(ctx.runs, before)
    if not deleted and after_marking and fate.reason == RETRIEVED_REASON:
        fate = Fate(fate.by, reason, fate.at)  # the watchdog acted on this ending's marker
    pod.mark_deleted(fate.by, fate.reason, fate.at)
    pod.save(ctx.runs)
    reason = fate.reason
    ctx.log.info(
        "pod %s of run %s %s (%s, by the %s); up %s, %s spent%s",
        pod.pod_id,
        pod.run_id,
        "deleted and its deletion confirmed" if deleted else "was already gone",
        reason,
        pod.deleted_by,
        _duration(pod.uptime_s()),
        usd(pod.estimated_spend() or 0.0),
        f" at {usd(pod.rate)}/h (GPUs and container disk)" if pod.rate is not None else "",
    )


async def sweep_others(ctx: PodContext, pod: PodRecord) -> None:
    """Deletes every other pod of the run the account shows (named
    `ob-<run id>-a<n>`: an earlier attempt Runpod created while answering an
    error), confirming each; the strays of `pod.json` are replaced by those
    whose deletion could not be confirmed, and the create requests that got no
    answer are settled by what the list shows. A pod list that fails keeps the
    strays as they are (logged). A pod created after the list (its create was
    in flight) is bounded by its watchdog's boot grace: no job will start on it."""
    try:
        listed = await ctx.client.list_pods()
    except RunpodError as error:
        ctx.log.warning("cannot list the pods to sweep those of run %s: %s", pod.run_id, error)
        return
    left: list[str] = []
    names = {other.name for other in listed}
    # a cluster's pods are named for it (`<its name>-<rank>`)
    names |= {other.name.rpartition("-")[0] for other in listed if other.cluster_id is not None}
    own = {node.pod_id for node in pod.nodes}
    twins: set[str] = set()
    for index, attempt in enumerate(pod.attempts):
        if attempt.result == "sent" and attempt.pod_id is None:
            if attempt.name in names:
                seen = "swept"
            elif _sent_ago_s(attempt.at) < ctx.client.retry.reconcile_window_s:
                left.append(attempt.name)  # the list may lag behind its create: look again
                continue
            else:
                seen = "no pod shown (swept)"
            pod.attempts[index] = attempt.model_copy(update={"result": seen})
    for other in listed:
        if run_of_pod_name(other.name) != pod.run_id or other.id == pod.pod_id:
            continue
        if other.status == "TERMINATED" or other.id in own:
            continue
        if other.cluster_id is not None:  # another cluster of the run: deleted as one
            if other.cluster_id == pod.cluster_id or other.cluster_id in twins:
                continue
            twins.add(other.cluster_id)
        try:
            await delete_node_or_pod(
                ctx.client,
                other.id,
                other.cluster_id,
                interval_s=ctx.timing.gone_interval_s,
                timeout_s=ctx.timing.confirm_timeout_s,
            )
            pod.swept.append(other.cluster_id or other.id)
            ctx.log.warning(
                "deleted %s, another %s of run %s (%s)",
                f"cluster {other.cluster_id}" if other.cluster_id else f"pod {other.id}",
                "cluster" if other.cluster_id else "pod",
                pod.run_id,
                other.name,
            )
        except RunpodError as error:
            ctx.log.warning("cannot delete pod %s of run %s: %s", other.id, pod.run_id, error)
            left.append(other.id)
    pod.strays = left
    pod.save(ctx.runs)


def _sent_ago_s(at: str) -> float:
    """Seconds since an attempt recorded at `at` (RFC 3339) was sent."""
    try:
        return float(time.time() - parse_rfc3339(at).timestamp())
    except ValueError:
        return float("inf")


async def forget_if_gone(ctx: PodContext, pod: PodRecord) -> None:
    """Once no pod of the run may be left: deletes its host key secret and
    removes its private client key, best effort (failures are logged; `pod.json`
    says what is gone, so that a collect tries the rest again)."""
    if not pod.gone or pod.forgotten:
        return
    if pod.host_key_secret and not pod.secret_deleted:
        try:
            await ctx.client.delete_secret(pod.host_key_secret)
            pod.secret_deleted = True
            pod.save(ctx.runs)
        except RunpodError as error:
            ctx.log.warning(
                "cannot delete the secret %s of run %s: %s", pod.host_key_secret, pod.run_id, error
            )
    if forget_client_key(ctx.runs, pod.run_id) and not pod.client_key_removed:
        pod.client_key_removed = True
        pod.save(ctx.runs)


async def release(ctx: PodContext, pod: PodRecord, reason: str, by: str | None = None) -> None:
    """Ends every pod of a run that will not run a job (or no longer needs its
    pod): deletes its pod (confirmed; `by` in `pod.json`), sweeps the others,
    then forgets its keys. A failure is logged with how to remove what may be
    left; never raised."""
    try:
        await remove(ctx, pod, reason, by)
    except PodError as error:
        ctx.log.warning("%s", error)
    await sweep_others(ctx, pod)
    await forget_if_gone(ctx, pod)


async def is_gone(ctx: PodContext, pod: PodRecord) -> bool:
    """Whether the run's pod no longer exists (404s in a row and absent from
    the list); if so `pod.json` records it deleted, by its watchdog when one of
    its bounds passed. Never deletes anything. False, with a warning logged,
    when Runpod cannot be asked: the pod is undetermined."""
    try:
        return await look_up_pod(ctx, pod, f"pod {pod.pod_id}") is None
    except PodError as error:
        ctx.log.warning("%s", error)
        return False


async def look_up_pod(
    ctx: PodContext, pod: PodRecord, named: str, *, unfollowed: bool = False
) -> Pod | None:
    """The run's pod as Runpod shows it, or None when it no longer exists
    (none recorded, already recorded deleted, terminated, or 404s in a row and
    absent from the list): then `pod.json` records it deleted, by its watchdog
    when one of its bounds passed, and the run's keys are forgotten. Never
    deletes anything. `named` names the pod in the error; `unfollowed`: its
    job went unfollowed for a while (see `found_gone`).

    Raises PodError when Runpod cannot be asked: the pod is undetermined.
    """
    if pod.pod_id is None or pod.state == PodState.DELETED:
        await forget_if_gone(ctx, pod)  # what an earlier end could not remove
        return None
    try:
        found = await look_up(ctx.client, pod.pod_id, interval_s=ctx.timing.gone_interval_s)
    except RunpodError as error:
        raise PodError(f"cannot look {named} up: {error}") from None
    if found is not None and found.status != "TERMINATED":
        return found
    _record_found_gone(ctx, pod, unfollowed=unfollowed)
    await forget_if_gone(ctx, pod)
    return None


def _record_found_gone(ctx: PodContext, pod: PodRecord, *, unfollowed: bool = False) -> Fate:
    """Records in `pod.json` the pod found gone without this process deleting
    it, by whom `found_gone` tells; returns that fate."""
    fate = found_gone(ctx.runs, pod, unfollowed=unfollowed)
    pod.mark_deleted(fate.by, fate.reason, fate.at)
    pod.save(ctx.runs)
    return fate


async def end_pod(
    ctx: PodContext, pod: PodRecord, executor: Executor, record: RunRecord, retrieved: bool
) -> Ending:
    """Ends the pod of a run whose job ended, after copying the watchdog's log
    into `runs/<id>/.pod/`.

    Only when every file was retrieved and verified is the `retrieved` marker
    written on the pod (first, so that its watchdog deletes it even if this
    delete fails), then the pod deleted unless kept and its deletion confirmed,
    the other pods of the run swept, its keys and host key secret forgotten.
    Otherwise the pod stays for its watchdog's retrieve grace (a kept pod stays
    kept), and a warning says what bills and how to retrieve or remove it.

    Raises PodError when the delete fails or cannot be confirmed; the pod then
    stays `deleting` in `pod.json`.
    """
    await fetch_watchdog_log(ctx.runs, executor, record)
    restart = container_restart(ctx.runs, record.id)
    if restart is not None and restart.lost_job:
        ctx.log.warning("%s", restart_message(pod, subject(record), restart))
    if not retrieved:
        pod.state = PodState.KEPT if pod.keep else PodState.AWAITING_RETRIEVAL
        pod.save(ctx.runs)
        ctx.log.warning("%s", unretrieved_message(pod, record))
        return Ending.KEPT if pod.keep else Ending.AWAITING_RETRIEVAL
    try:
        await executor.touch(f"{record.remote_dir}/{RETRIEVED_MARKER}")
        pod.retrieved_marked = True
        pod.save(ctx.runs)
    except ExecError as error:
        ctx.log.warning(
            "cannot mark the files of run %s retrieved on its pod: %s", record.id, error
        )
    if pod.keep:
        pod.state = PodState.KEPT
        pod.save(ctx.runs)
        ctx.log.warning("%s", kept_message(ctx.runs, pod, record.id))
        return Ending.KEPT
    try:
        await remove(
            ctx,
            pod,
            restart_reason(restart, pod.lost_step)
            if restart is not None and restart.lost_job
            else VERIFIED_REASON,
            after_marking=pod.retrieved_marked,
        )
    except DeleteRefused as refused:
        if not pod.retrieved_marked:
            raise
        await watchdog_deletes(ctx, pod, refused.why)
    await sweep_others(ctx, pod)
    await forget_if_gone(ctx, pod)
    return Ending.DELETED


WATCHDOG_LOOKS = 3  # looks of the watchdog a pod marked retrieved is given to delete itself


async def watchdog_deletes(ctx: PodContext, pod: PodRecord, refused: str) -> None:
    """Checks that the pod's watchdog deletes a pod whose own delete was
    refused (an API outage, a key refused) once the `retrieved` marker is on
    it (`refused`: how Runpod answered): the watchdog deletes it at its next
    look, with the pod's own key.
    The pod is looked up until it is gone, for `WATCHDOG_LOOKS` looks of the
    watchdog plus the deletion confirm timeout; `pod.json` then says its
    watchdog deleted it.

    Raises PodError (the pod may still bill, stays `deleting`) when it is
    still there past that bound.
    """
    assert pod.pod_id is not None
    bound = WATCHDOG_LOOKS * ctx.timing.watch_interval_s + ctx.timing.confirm_timeout_s
    ctx.log.warning(
        "the delete of pod %s of run %s was refused (%s); its watchdog saw the `retrieved` "
        "marker and deletes it itself: checking that it is gone within %.0f s",
        pod.pod_id,
        pod.run_id,
        refused,
        bound,
    )
    deadline = time.monotonic() + bound
    while True:
        try:
            found = await look_up(ctx.client, pod.pod_id, interval_s=ctx.timing.gone_interval_s)
        except RunpodError:
            found = Pod(id=pod.pod_id)  # Runpod does not answer: not known gone
        if found is None or found.status == "TERMINATED":
            fate = _record_found_gone(ctx, pod)
            ctx.log.info(
                "pod %s of run %s is gone: deleted by its %s (%s); up %s, about %s spent",
                pod.pod_id,
                pod.run_id,
                fate.by,
                fate.reason,
                _duration(pod.uptime_s()),
                usd(pod.estimated_spend() or 0.0),
            )
            return
        if time.monotonic() >= deadline:
            raise PodError(
                f"pod {pod.pod_id} of run {pod.run_id}{pod.rate_text()} may still exist: its "
                f"delete was refused ({refused}) and its watchdog did not delete it within "
                f"{bound:.0f} s; {remove_hint(pod.run_id)}"
            )
        await asyncio.sleep(ctx.timing.gone_interval_s)


WATCHDOG_LOG_TIMEOUT_S = 60.0
"""The most a copy of the watchdog's log may take: it is small, and a transfer
has no bound of its own (a stuck SFTP server whose connection still answers
keepalives would hold the pipeline, and its pod billing, on a best effort)."""


async def fetch_watchdog_log(runs: Runs, executor: Executor, record: RunRecord) -> None:
    """Copies the watchdog's log of the run into `runs/<id>/.pod/` (its store),
    best effort within WATCHDOG_LOG_TIMEOUT_S: it is small, and says why the
    pod was deleted. Never raises."""
    local = runs.run_dir(record.id)
    with contextlib.suppress(ExecError, OSError, RecordError, TimeoutError):
        await asyncio.wait_for(
            executor.download(record.remote_dir, local, [WATCHDOG_LOG]), WATCHDOG_LOG_TIMEOUT_S
        )
        if runs.store.local_path(runs.key(record.id, WATCHDOG_LOG)) is None:
            runs.write_bytes(record.id, WATCHDOG_LOG, (local / WATCHDOG_LOG).read_bytes())


def unretrieved_message(pod: PodRecord, record: RunRecord) -> str:
    """The warning when a run's files were not retrieved and its pod stays."""
    stays = (
        "stays (keep_pod): nothing deletes it automatically"
        if pod.keep
        else "stays until its watchdog's retrieve grace ends"
    )
    return (
        f"the files of {subject(record)} were not retrieved: pod {pod.name}{pod.rate_text()} "
        f"{stays}; retrieve them with {follow_again(record)}, or {remove_hint(record.id)}"
    )


def kept_message(runs: Runs, pod: PodRecord, run_id: str) -> str:
    """The warning of keep_pod, once the job started or ended: the rate and the ssh command."""
    rate = (
        f"at ${pod.cost_per_hour:.2f}/h"
        if pod.cost_per_hour is not None
        else "at an hourly rate Runpod did not give"
    )
    return (
        f"keep_pod: pod {pod.name} is kept with no time limit, {rate}, even once the run ends; "
        f"reach it with `{ssh_command(runs, run_id)}`; nothing deletes it but the pods flow "
        f"(action=remove, run_id={run_id})"
    )


def detached_message(
    runs: Runs, pod: PodRecord, record: RunRecord, retrieve_grace_s: float, lease_ttl_s: float
) -> str:
    """The message of a run left running on its pod, its follower gone: how to
    follow it again or remove the pod, and what bounds the pod meanwhile."""
    if pod.keep:
        guard = f"The pod is kept with no time limit (keep_pod): `{ssh_command(runs, record.id)}`."
    else:
        guard = (
            f"The watchdog deletes the pod {retrieve_grace_s / 60:g} min after the job ends if "
            f"its files are not retrieved, and at {pod.deadline or 'its deadline'} or "
            f"{lease_ttl_s / 60:g} min after the lease was last renewed, whichever is later"
        )
        if pod.cost_deadline_unix is not None and pod.max_cost_usd is not None:
            guard += f", or once it cost ${pod.max_cost_usd:.2f} (max_cost_usd)"
        guard += "."
    return (
        f"{subject(record)} keeps running on pod {pod.name}{pod.rate_text()}; "
        f"{attach_hint(record)}, or {remove_hint(record.id)}. {guard}"
    )


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
