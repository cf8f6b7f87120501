"""The `pods` flow: what the Runpod account runs for us, and what it costs.

- `list`: every pod named like ours (`ob-<run id>-a<n>`), with its run, state,
  GPU, rate, uptime, estimated spend, and whether it is an orphan (its run is
  not in this runs directory, or has ended);
- `remove`: deletes the pods of one run (confirmed), sweeps its strays,
  forgets its keys; a run that is not a Runpod run deletes nothing; a run
  whose job's files were not retrieved says that they never will be;
- `sweep`: deletes (confirmed) the pods whose run has ended with its files
  retrieved and verified here; warns of the other orphans (a pod whose run
  is not here, or whose files were not retrieved, may hold results: it is
  never deleted by a sweep); deletes the host key secrets no pod needs.
"""

from __future__ import annotations

from typing import Literal

from prefect import flow, get_run_logger
from prefect.artifacts import acreate_table_artifact

from overbrainer_prefect.blocks import RunpodCredentials, RunpodTarget, load_target
from overbrainer_prefect.kinds.registry import KINDS
from overbrainer_prefect.runpod.deletion import delete_node_or_pod
from overbrainer_prefect.runpod.errors import PodError, RunpodError
from overbrainer_prefect.runpod.pod import PodRecord
from overbrainer_prefect.runs.store import RunRecord, Runs, RunState, subject
from overbrainer_prefect.runs_dir import runs_at
from overbrainer_prefect.steps import end as end_step
from overbrainer_prefect.targets.runpod.context import PodContext
from overbrainer_prefect.targets.runpod.ending import forget_if_gone, remove, sweep_others
from overbrainer_prefect.targets.runpod.listing import PodsError, PodsResult, pod_listing
from overbrainer_prefect.targets.runpod.names import run_of_pod_name
from overbrainer_prefect.targets.runpod.orphans import (
    PodRow,
    files_here,
    orphan_warnings,
    pod_rows,
    sweep_host_keys,
)
from overbrainer_prefect.timestamps import rfc3339


@flow(name="pods", persist_result=True)
async def pods(
    action: Literal["list", "remove", "sweep"] = "list",
    run_id: str | None = None,
    runs_dir: str | None = None,
    credentials: str | None = None,
) -> PodsResult:
    """Lists the pods of the Runpod account named like ours (`list`), removes
    the pods of the run `run_id` (`remove`), or (`sweep`) deletes the pods
    whose run ended with its files verified here, warns of the other orphans
    and sweeps the host key secrets no pod needs. `credentials` names a Runpod
    credentials block; by default, that of the run's target, or of the Runpod
    targets of the runs here.

    Fails with one line when `run_id` is missing or is not a Runpod run (then
    nothing is deleted), or when no credentials can be found.
    """
    runs = await runs_at(runs_dir)
    logger = get_run_logger()
    if action == "remove":
        if run_id is None:
            raise PodsError("give the run whose pods to remove: pods(action='remove', run_id=...)")
        return await _remove(runs, run_id, credentials)
    account = await _credentials(runs, credentials, None)
    async with account.client() as client:
        rows = await pod_rows(client, runs)
        result = PodsResult(action=action, pods=[pod_listing(row) for row in rows])
        for row in rows:
            logger.info("%s", row.line())
        if not rows:
            logger.info("no pod of ours in the Runpod account")
        if action == "sweep":
            ctx = PodContext(client=client, runs=runs, log=logger)
            result.removed = await _sweep_retrieved(ctx, rows)
            rows = [row for row in rows if row.pod_id not in result.removed]
        result.warnings = orphan_warnings(rows)
        if action == "sweep":
            result.warnings += await sweep_host_keys(client, runs, rows)
        for warning in result.warnings:
            logger.warning("%s", warning)
    await acreate_table_artifact(
        table=[listing.model_dump() for listing in result.pods],
        key="runpod-pods",
        description="The pods of the Runpod account named like overbrainer's",
    )
    return result


async def _sweep_retrieved(ctx: PodContext, rows: list[PodRow]) -> list[str]:
    """Deletes (confirmed) the pods whose run has ended with its files retrieved
    and verified here, recording each in its `pod.json`; returns their ids. A
    pod that cannot be deleted is logged and stays in the list."""
    removed = []
    for row in rows:
        if not row.retrieved:
            continue
        found = ctx.runs.find(row.run_id)
        store = found[0] if found is not None else ctx.runs
        local = PodRecord.load(store, row.run_id)
        mine = PodContext(client=ctx.client, runs=store, log=ctx.log, timing=ctx.timing)
        try:
            if local is not None and local.owns(row.pod_id, row.cluster_id):
                await remove(mine, local, f"swept: {row.why}")
                await forget_if_gone(mine, local)
                end_step.fail(store, row.run_id, "its job never started within boot_grace")
            else:  # an earlier attempt of the run, or a pod.json that lost track of it
                await delete_node_or_pod(ctx.client, row.pod_id, row.cluster_id)
        except (PodError, RunpodError) as error:
            ctx.log.warning("cannot delete pod %s of run %s: %s", row.pod_id, row.run_id, error)
            continue
        ctx.log.info(
            "pod %s of run %s deleted (its run ended, its files verified here): about $%.2f spent",
            row.pod_id,
            row.run_id,
            row.estimated_spend or 0.0,
        )
        removed.append(row.pod_id)
    return removed


async def _remove(runs: Runs, run_id: str, credentials: str | None) -> PodsResult:
    """Deletes every pod of the run `run_id` (its `pod.json`, or the account's
    pods named after it when the run is not here)."""
    logger = get_run_logger()
    located = runs.find(run_id)  # validates the ID: nothing outside runs/ is touched
    store: Runs = located[0] if located is not None else runs
    record: RunRecord | None = located[1] if located is not None else None
    if record is not None and record.target_kind != "runpod":
        raise PodsError(
            f"{subject(record)} is not a Runpod run (it ran on {record.target_kind} target "
            f"{record.target}): it has no pod, and nothing was deleted"
        )
    pod = PodRecord.load(store, run_id) if record is not None else None
    if record is not None and pod is None:
        raise PodsError(
            f"{subject(record)} never asked for a pod (no pod.json): nothing was deleted"
        )
    account = await _credentials(runs, credentials, record.target if record else None)
    result = PodsResult(action="remove")
    async with account.client() as client:
        ctx = PodContext(client=client, runs=store, log=logger)
        if pod is not None:
            had = pod.pod_id if pod.state != "deleted" else None
            await remove(ctx, pod, "removed with the pods flow", by="pods flow")
            await sweep_others(ctx, pod)
            await forget_if_gone(ctx, pod)
            if had is not None:
                result.removed.append(had)
            if pod.strays:
                result.warnings.append(
                    f"pods {', '.join(pod.strays)} of run {run_id} may still exist: remove them "
                    "in the Runpod console"
                )
            assert record is not None
            if had is not None:
                lost = _note_removed(store, run_id)
                if lost:
                    result.warnings.append(lost)
            elif not record.state.ended:
                end_step.fail(store, run_id, REMOVED)
        else:
            for found in await client.list_pods():
                if run_of_pod_name(found.name) != run_id or found.status == "TERMINATED":
                    continue
                try:  # a node of a cluster goes with its cluster
                    await delete_node_or_pod(client, found.id, found.cluster_id)
                    result.removed.append(found.id)
                except RunpodError as error:
                    result.warnings.append(f"pod {found.id} of run {run_id} may remain: {error}")
            if not result.removed and not result.warnings:
                raise PodsError(
                    f"no pod of run {run_id} here or in the Runpod account: nothing to remove"
                )
    for pod_id in result.removed:
        logger.info("pod %s of run %s deleted, its deletion confirmed", pod_id, run_id)
    if not result.removed:
        logger.info("run %s has no pod left", run_id)
    for warning in result.warnings:
        logger.warning("%s", warning)
    return result


REMOVED = "its pod was removed with the pods flow"
"""Why a run whose pod the pods flow removed fails."""


def _note_removed(store: Runs, run_id: str) -> str | None:
    """Records in the run `run_id` that the pods flow removed its pod: a run
    not ended is failed; a job whose files were not retrieved and verified
    here keeps, as its `not_retrieved` reason, that they never will be.
    Returns that reason (a warning), or None when nothing was lost. A record
    that cannot be read or saved is logged, not raised: the pod is gone."""
    try:
        record = store.load(run_id)
        lost = (
            None
            if files_here(store, record)
            else f"{REMOVED}: the job's files were never retrieved"
        )
        if record.state.ended and lost is None:
            return None
        if not record.state.ended:
            record.state = RunState.FAILED
            record.message = REMOVED
            record.ended = rfc3339()
        if lost is not None:
            record.not_retrieved = lost
        store.save(record)
    except Exception as error:  # the pod is gone; only its record's words are missing
        get_run_logger().warning("cannot record in run %s that %s: %s", run_id, REMOVED, error)
        return None
    return None if lost is None else f"{subject(record)}: {lost}"


async def _credentials(runs: Runs, name: str | None, target: str | None) -> RunpodCredentials:
    """The Runpod credentials block `name`; else that of the Runpod target
    `target`; else that of the first Runpod target of the runs here (or of
    their exports and compares). Raises
    PodsError with one line when there is none."""
    if name is not None:
        try:
            return await RunpodCredentials.aload(name)
        except ValueError:
            raise PodsError(
                f"no Runpod credentials block named {name!r}: create it in the Prefect UI"
            ) from None
    targets = [target] if target else []
    for record in runs.list(skipped=lambda *_: None):
        jobs = [record]
        for kind in KINDS:
            if kind.child:
                jobs += kind.store(runs, record.id).list(skipped=lambda *_: None)
        targets += [job.target for job in jobs if job.target_kind == "runpod"]
    for ref in dict.fromkeys(targets):
        try:
            _, block = await load_target(ref)
        except ValueError:
            continue
        if isinstance(block, RunpodTarget):
            return block.credentials
    raise PodsError("no Runpod credentials: name a Runpod credentials block with credentials=...")
