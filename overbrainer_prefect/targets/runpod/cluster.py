"""The instant cluster of a training across nodes: `nodes` pods made at once
on one private network (`POST /v2/clusters`), each a pod as any other (the
bootstrap and its watchdog, the run's keys, the pinned host key), the job
on every pod with torchrun's rendezvous at the primary's private address.

Its record is the run's `pod.json`, as for one pod: `cluster_id`, its pods
by rank (`nodes`: each pod's SSH address, private address and work
directory) and each node's job once started (`node_jobs`); `pod_id` is the
primary's (rank 0). Its rate is the cluster's (every pod's), so its cost
cap, the budget and the ledger count every pod, and every watchdog is armed
at that rate. A pod of a cluster cannot be deleted alone: every delete of
the record (`ending.remove`), and every bound of a watchdog (told the
cluster's id in `.pod/cluster`), deletes the cluster, and each of its pods
is confirmed gone.

Provisioning, each step recorded before it is taken, as for a pod: the
cluster created on the first GPU type of the plan Runpod can place it on
(all its pods or none; an ambiguous answer is looked up by the cluster's
unique name), then every pod ready at once (its SSH, its claim of the run
directory, its private address from its claim, its cost cap armed).
Whatever fails, the cluster is deleted (confirmed) and the run fails.
"""

from __future__ import annotations

import asyncio
import posixpath
import shlex
import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from overbrainer_prefect import executors  # its SshExecutor (asyncssh) imported on first use
from overbrainer_prefect.executors.base import ExecError, JobId
from overbrainer_prefect.executors.nodes import NodesExecutor
from overbrainer_prefect.runpod.bootstrap import (
    CLUSTER_FILE,
    NODE_FILE,
    START_COMMAND,
    Armed,
    disk_per_hour,
    pod_env,
)
from overbrainer_prefect.runpod.deletion import look_up
from overbrainer_prefect.runpod.errors import NoCapacity, PodError, RunpodError
from overbrainer_prefect.runpod.gpus import LaunchPlan, overpriced
from overbrainer_prefect.runpod.models import ClusterRequest, Pod, secret_ref
from overbrainer_prefect.runpod.pod import ClusterNode, PodRecord, PodState, SshAddress
from overbrainer_prefect.runpod.settings import RunpodTargetSettings
from overbrainer_prefect.runs.store import RunRecord
from overbrainer_prefect.targets.runpod.context import PodContext
from overbrainer_prefect.targets.runpod.ending import fetch_watchdog_log, is_gone
from overbrainer_prefect.targets.runpod.fate import runpod_agrees
from overbrainer_prefect.targets.runpod.keys import PodKeys, write_ssh_config
from overbrainer_prefect.targets.runpod.names import pod_name
from overbrainer_prefect.targets.runpod.provision import (
    Provisioned,
    arm_cost_cap,
    check_claim,
    pod_executor,
    pod_workdir,
    store_host_key,
    wait_ready,
)
from overbrainer_prefect.timestamps import rfc3339

if TYPE_CHECKING:
    from overbrainer_prefect.executors.ssh import SshExecutor  # asyncssh: where SSH is used

NODE_READS = 20  # reads of a node's claim for its private address (written with its claim)
NODE_READ_S = 0.25  # between two of them


async def provision_cluster(
    ctx: PodContext,
    run: RunRecord,
    pod: PodRecord,
    keys: PodKeys,
    settings: RunpodTargetSettings,
    plan: LaunchPlan,
    *,
    api_url: str,
    name: str,
) -> Provisioned:
    """The `provision` steps of an instant cluster of `plan.pods` pods for
    the run `run` (its record `pod` saved, its keys made): created, then
    every pod ready, claimed and capped (see the module). Returns the
    primary's executor and run directory, and every node's executor by rank
    with the primary's private address.

    Raises NoCapacity (one line: no GPU type of the plan can place the
    cluster now), RunpodError or PodError; `provision` then deletes the
    cluster and fails the run."""
    host_secret = await store_host_key(ctx, pod, keys, f"the cluster of overbrainer run {run.id}")
    created, choice, refused = None, plan.first, []
    sent_at = time.monotonic()
    for choice in plan.choices:
        request = ClusterRequest(
            name=pod_name(run.id, len(pod.attempts) + 1),
            image=settings.image,
            gpu_type_id=choice.id,
            gpu_count_per_pod=settings.gpu_count,
            pod_count=plan.pods,
            container_disk_gb=settings.disk_gb,
            env=pod_env(
                run_id=run.id,
                api_url=api_url,
                authorized_key=keys.client_public,
                host_key_ref=secret_ref(host_secret),
                created_at=int(time.time()),
                settings=settings,
                timing=ctx.timing,
            ),
            data_center_ids=list(settings.data_center_ids),
            args=shlex.join(START_COMMAND),
        )
        if pod.attempts and pod.attempts[-1].result == "sent":
            pod.end_attempt("refused (no capacity or no access)")
        pod.begin_attempt(request.name, choice.id)
        pod.save(ctx.runs)
        sent_at = time.monotonic()
        try:
            created = await ctx.client.create_cluster(request)
            break
        except NoCapacity:
            refused.append(f"{choice.id} (no capacity)")
        except RunpodError as error:
            if error.status == 403:
                refused.append(f"{choice.id} (no access)")
                continue
            pod.end_attempt(error.run_message)
            if error.status is None or error.status >= 500:
                pod.strays.append(pod.attempts[-1].name)  # Runpod may have created it
            pod.save(ctx.runs)
            raise
    if created is None:
        pod.end_attempt("no capacity")
        pod.save(ctx.runs)
        tried = ", ".join(c.id for c in plan.choices)
        raise NoCapacity(
            tried,
            hint=f"Runpod cannot place an instant cluster of {plan.pods} pods of "
            f"{settings.gpu_count} × GPU on any GPU type tried ({tried}) right now: nothing was "
            "created; try again later, add GPU types, or ask for fewer nodes",
        )
    pods = sorted(
        created.pods or await ctx.client.cluster_pods(created.id),
        key=lambda p: p.cluster_rank if p.cluster_rank is not None else 0,
    )
    primary = next((p for p in pods if p.id == created.primary_pod_id), pods[0])
    pods = [primary, *(p for p in pods if p.id != primary.id)]
    pod.cluster_id = created.id
    pod.end_attempt("created", primary.id)
    pod.pod_id = primary.id
    pod.pod_name = primary.name or pod.attempts[-1].name
    pod.gpu_type_id = primary.gpu_type_id or choice.id
    pod.billed_gpus = primary.gpu_count if primary.gpu_type_id else settings.gpu_count
    rates = [p.cost_per_hr for p in pods]
    pod.cost_per_hour = (
        sum(r for r in rates if r)
        if all(rates) and len(pods) == plan.pods
        else choice.price_per_hour
    )
    pod.disk_per_hour = disk_per_hour(settings.disk_gb) * plan.pods
    pod.nodes = [ClusterNode(pod_id=p.id, rank=rank) for rank, p in enumerate(pods)]
    pod.strays = [s for s in pod.strays if s != pod.attempts[-1].name]
    pod.state = PodState.BOOTING
    pod.save(ctx.runs)
    ctx.log.info(
        "cluster %s of %d pods (%s) created for run %s: %s each, $%.2f/h in all%s",
        created.id,
        len(pods),
        ", ".join(p.id for p in pods),
        run.id,
        choice.label(),
        pod.cost_per_hour,
        f" (refused first: {', '.join(refused)})" if refused else "",
    )
    if len(pods) != plan.pods:
        raise PodError(
            f"cluster {created.id} shows {len(pods)} pods, not the {plan.pods} asked for: "
            "it is deleted"
        )
    for each in pods:
        problem = overpriced(each, settings, choice.price_per_hour / plan.pods)
        if problem:
            raise PodError(problem)
    within = settings.boot_grace_s - (time.monotonic() - sent_at)
    executors = await _all_ready(ctx, pod, run, within, name, settings)
    try:
        primary_node = pod.nodes[0]
        assert primary_node.ssh is not None and primary_node.workdir is not None
        pod.ssh, pod.workdir = primary_node.ssh, primary_node.workdir
        ssh = primary_node.ssh
        write_ssh_config(ctx.runs, run.id, ssh.host, ssh.port, ssh.user, pod.host_key)
        pod.save(ctx.runs)
        armed = await asyncio.gather(
            *(
                _arm(ctx, executor, pod, node, run, settings)
                for node, executor in zip(pod.nodes, executors, strict=True)
            )
        )
    except BaseException:
        for executor in executors:
            await executor.close()
        raise
    first = armed[0]
    pod.deadline_unix = first.deadline_unix
    pod.deadline = rfc3339_of(first.deadline_unix)
    pod.cost_deadline_unix = min(
        (a.cost_deadline_unix for a in armed if a.cost_deadline_unix is not None), default=None
    )
    pod.state = PodState.READY
    pod.save(ctx.runs)
    master = pod.nodes[0].address
    assert master is not None
    ctx.log.info(
        "cluster %s is ready: %s; every watchdog deletes the whole cluster: %s",
        created.id,
        ", ".join(f"node {n.rank} pod {n.pod_id} at {n.address}" for n in pod.nodes),
        first.line,
    )
    remote_dir = posixpath.join(pod.nodes[0].workdir or "", run.id)
    return Provisioned(
        pod=pod, executor=executors[0], remote_dir=remote_dir, nodes=executors, master_addr=master
    )


def rfc3339_of(unix: int | None) -> str | None:
    """`unix` (seconds) as RFC 3339, None for None."""
    return rfc3339(datetime.fromtimestamp(unix, UTC)) if unix is not None else None


def node_view(pod: PodRecord, node: ClusterNode) -> PodRecord:
    """The record of the cluster `pod` as one of its pods (`node`) sees it: its
    own id and SSH address, the cluster's keys and rate. Never saved."""
    return pod.model_copy(update={"pod_id": node.pod_id, "ssh": node.ssh, "workdir": node.workdir})


async def _all_ready(
    ctx: PodContext,
    pod: PodRecord,
    run: RunRecord,
    within_s: float,
    name: str,
    settings: RunpodTargetSettings,
) -> list[SshExecutor]:
    """Every pod of the cluster ready at once (`_ready`), by rank; when one
    is not, the others' connections are closed and its error raised."""
    found = await asyncio.gather(
        *(_ready(ctx, pod, node, run, within_s, name, settings) for node in pod.nodes),
        return_exceptions=True,
    )
    ready = [f for f in found if isinstance(f, executors.SshExecutor)]
    failed = next((f for f in found if isinstance(f, BaseException)), None)
    if failed is not None:
        for executor in ready:
            await executor.close()
        raise failed
    pod.save(ctx.runs)
    return ready


async def _ready(
    ctx: PodContext,
    pod: PodRecord,
    node: ClusterNode,
    run: RunRecord,
    within_s: float,
    name: str,
    settings: RunpodTargetSettings,
) -> SshExecutor:
    """One pod of the cluster reached (pinned host key), its run directory's
    claim checked and its private address read from it. Raises PodError."""
    view = node_view(pod, node)
    executor = await wait_ready(ctx, view, within_s, name, settings.image)
    node.ssh = view.ssh
    try:
        workdir = await pod_workdir(executor)
        if workdir != executor.workdir:
            await executor.close()
            executor = pod_executor(ctx, view, workdir, node_name(name, node))
        node.workdir = workdir
        remote = posixpath.join(workdir, run.id)
        await check_claim(executor, remote, run.id, node.pod_id)
        node.address = await _private_address(executor, remote, node)
    except BaseException:
        await executor.close()
        raise
    return executor


def node_name(name: str, node: ClusterNode) -> str:
    """How messages name a pod of a cluster: `<target>: pod <id> (node <rank>)`."""
    return f"{name}: pod {node.pod_id} (node {node.rank})"


async def _private_address(executor: SshExecutor, remote: str, node: ClusterNode) -> str:
    """The pod's address on its cluster's private network, as its bootstrap
    wrote it at its claim (Runpod's NODE_ADDR, NODE_RANK). Raises PodError
    when it wrote none, or another rank than Runpod shows."""
    fields: dict[str, str] = {}
    for _ in range(NODE_READS):
        try:
            text = (await executor.read_from(f"{remote}/{NODE_FILE}", 0, 4096)).decode(
                errors="replace"
            )
        except ExecError:
            text = ""
        fields = dict(w.split("=", 1) for w in text.split() if "=" in w)
        if fields.get("addr"):
            break
        await asyncio.sleep(NODE_READ_S)
    address = fields.get("addr", "")
    if not address:
        raise PodError(
            f"pod {node.pod_id} (node {node.rank}) shows no address on its cluster's private "
            "network (no NODE_ADDR in its environment): its cluster is deleted"
        )
    if fields.get("rank", str(node.rank)) != str(node.rank):
        raise PodError(
            f"pod {node.pod_id} says it is node {fields.get('rank')}, Runpod shows it as node "
            f"{node.rank}: its cluster is deleted"
        )
    return address


async def _arm(
    ctx: PodContext,
    executor: SshExecutor,
    pod: PodRecord,
    node: ClusterNode,
    run: RunRecord,
    settings: RunpodTargetSettings,
) -> Armed:
    """Tells the pod's watchdog its cluster (every bound deletes the whole
    cluster), then arms its cost cap at the cluster's rate. Raises PodError."""
    remote = posixpath.join(node.workdir or "", run.id)
    path = f"{remote}/{CLUSTER_FILE}"
    script = 'printf "%s\\n" "$2" > "$1.tmp" && mv -f "$1.tmp" "$1"'
    result = await executor.run(["sh", "-c", script, "cluster", path, pod.cluster_id or ""])
    if result.code != 0:
        raise PodError(
            f"cannot tell pod {node.pod_id} its cluster: {result.stderr.strip()[:200]}; its "
            "cluster is deleted"
        )
    at_node = run.model_copy(update={"remote_dir": remote})
    try:
        return await arm_cost_cap(ctx, executor, node_view(pod, node), at_node, settings)
    except BaseException:
        await fetch_watchdog_log(ctx.runs, executor, at_node)
        raise


def nodes_executor(
    ctx: PodContext,
    pod: PodRecord,
    executors: Sequence[SshExecutor],
    python: str,
    said: dict[int, str] | None = None,
) -> NodesExecutor:
    """One executor over every pod of the cluster `pod` (rank 0 first), its
    rendezvous at the primary's private address; the nodes' jobs, once all
    started, are recorded in `pod.json` (`node_jobs`) before the job's record;
    a node whose job the follower's SSH lost is told in `said` (its rank: how),
    for `node_gone`."""
    master = pod.nodes[0].address if pod.nodes else None
    if master is None:
        raise PodError(f"cluster {pod.cluster_id} of run {pod.run_id} has no private address")

    def spawned(jobs: list[JobId]) -> None:
        pod.node_jobs = jobs
        pod.save(ctx.runs)

    lost = said.__setitem__ if said is not None else None
    return NodesExecutor(executors, master, python, jobs=pod.node_jobs, spawned=spawned, lost=lost)


async def node_gone(ctx: PodContext, pod: PodRecord, said: Mapping[int, str]) -> bool:
    """Whether the job across the cluster `pod`, found lost by the follower's
    SSH (`said`: the node it lost, and how), is lost with a pod of it: a
    lost node (`lost_node`), or the whole cluster gone (`is_gone`: its
    record then says by whom). False while Runpod shows every pod of it
    running on, or cannot be asked (logged)."""
    ssh = " ".join("; ".join(said[rank] for rank in sorted(said)).split()) or "its job is gone"
    return await lost_node(ctx, pod, ssh, silent=sorted(said)) or await is_gone(ctx, pod)


async def lost_node(ctx: PodContext, pod: PodRecord, ssh: str, silent: Sequence[int] = ()) -> bool:
    """Whether a pod of the cluster `pod` whose job the follower's SSH lost
    (`ssh`: how; `silent`: the ranks of the nodes it lost) is a lost node:
    Runpod, the second witness, shows that pod gone or not RUNNING while
    another pod of the cluster still runs, or, when it shows them all
    RUNNING, the runtime of a `silent` node stalled over the timing's
    `lost_host_s` (its host frozen: `fate.runpod_agrees`). Its loss, both
    witnesses in one line, is then recorded in `pod.json` (`node_lost`), and
    its follower ends the job on every node and deletes the whole cluster.
    False when Runpod shows every pod running on, or none (the whole cluster
    gone: its record says by whom, see `is_gone`), or cannot be asked
    (logged). Raises RecordIoError when `pod.json` cannot be saved."""
    if not pod.nodes or pod.state == PodState.DELETED:
        return False
    shown = await _nodes_shown(ctx, pod)
    if shown is None:
        return False
    gone = [(node, found) for node, found in shown if found is None or found.status != "RUNNING"]
    if len(gone) == len(shown):
        return False
    if gone:
        node, found = gone[0]
        status = "no longer exists" if found is None else f"is {found.status}"
        why = f"Runpod shows its pod {node.pod_id} {status}"
    else:
        stalled = await _stalled_node(ctx, pod, shown, silent)
        if stalled is None:
            return False
        node, why = stalled
    pod.node_lost = (
        f"node {node.rank} of cluster {pod.cluster_id} was lost: the follower's SSH lost its "
        f"job ({ssh}) and {why}"
    )
    pod.save(ctx.runs)
    return True


async def _nodes_shown(
    ctx: PodContext, pod: PodRecord
) -> list[tuple[ClusterNode, Pod | None]] | None:
    """Every node of the cluster `pod` with its pod as Runpod shows it now
    (None: gone); None when Runpod cannot be asked (logged)."""
    shown: list[tuple[ClusterNode, Pod | None]] = []
    for node in pod.nodes:
        try:
            found = await look_up(ctx.client, node.pod_id, interval_s=ctx.timing.gone_interval_s)
        except RunpodError as error:
            ctx.log.warning("cannot look pod %s (node %d) up: %s", node.pod_id, node.rank, error)
            return None
        shown.append((node, found))
    return shown


async def _stalled_node(
    ctx: PodContext,
    pod: PodRecord,
    first: Sequence[tuple[ClusterNode, Pod | None]],
    silent: Sequence[int],
) -> tuple[ClusterNode, str] | None:
    """A node among the `silent` ranks whose runtime, as Runpod shows it,
    stalled between `first` and a look the timing's `lost_host_s` later, and
    why; None when each went on (this side's network, not their hosts), or
    Runpod cannot be asked (logged)."""
    if not silent:
        return None
    wait = ctx.timing.lost_host_s
    ctx.log.warning(
        "node(s) %s of cluster %s do not answer SSH while Runpod shows every pod of it "
        "running: their runtime is looked at again in %g s before a node is taken for lost",
        ", ".join(map(str, silent)),
        pod.cluster_id,
        wait,
    )
    began = time.monotonic()
    await asyncio.sleep(wait)
    last = await _nodes_shown(ctx, pod)
    if last is None:
        return None
    elapsed = time.monotonic() - began
    for (node, before), (_, after) in zip(first, last, strict=True):
        if node.rank not in silent or before is None:
            continue
        if after is None:
            return node, f"Runpod shows its pod {node.pod_id} no longer exists"
        agrees = runpod_agrees(before, after, elapsed)
        if agrees is not None:
            return node, f"of its pod {node.pod_id}, {agrees}"
    return None


def reachable(pod: PodRecord) -> bool:
    """Whether the record `pod` is of a cluster whose every pod was readied
    (its private addresses known): its job runs on them all. A cluster that
    never got that far is reached as its primary alone (to be ended)."""
    return bool(pod.nodes) and all(n.address and n.workdir for n in pod.nodes)


async def reach_nodes(
    ctx: PodContext, pod: PodRecord, primary: SshExecutor, name: str
) -> list[SshExecutor]:
    """Every pod of the cluster `pod` reached again (the primary's executor
    `primary` first; each other pod looked up, its SSH address updated),
    connected on their first command. Raises PodError when a pod of it has
    no SSH endpoint now, RecordIoError when `pod.json` cannot be saved."""
    found: list[SshExecutor] = [primary]
    for node in pod.nodes[1:]:
        try:
            remote: Pod | None = await ctx.client.get_pod(node.pod_id)
        except RunpodError:
            remote = None
        if remote is not None and remote.ssh is not None:
            ssh = remote.ssh
            node.ssh = SshAddress(host=ssh.host, port=ssh.port, user=ssh.username)
        if node.ssh is None or node.workdir is None:
            for executor in found[1:]:
                await executor.close()
            raise PodError(
                f"pod {node.pod_id} (node {node.rank}) of cluster {pod.cluster_id} has no SSH "
                "endpoint right now: try again in a minute"
            )
        found.append(pod_executor(ctx, node_view(pod, node), node.workdir, node_name(name, node)))
    pod.save(ctx.runs)
    return found
