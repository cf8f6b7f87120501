"""A Runpod pod made for each job: the plan priced and logged before anything
is spent, the GPU budget held while the pod lives, the pod provisioned for
the job's record, its lease renewed while the job progresses, and the pod
deleted once the job's files are verified (or left to its watchdog's bounds).

Every step with a pod is in `overbrainer_prefect.runpod`; this module is
what the job driver sees of them. A job's record lives in its own store,
and so do its `pod.json`, keys and watchdog log: every pod belongs to
exactly one record.

Within a pipeline that shares its places (`targets.sharing`: a fine-tune),
the pod made for its first job is sized for its largest job and runs every
later job too (a new run directory on it each, the same keys), each job
with its own record, follow, retrieval and verification; those jobs' records
link to the pod's owner (`targets.runpod.shared`). Between two jobs the pod stays for
the next, bounded by its watchdog's next-job grace; once the pipeline ends the
pod is deleted (its last job's files verified, or the pipeline failed).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import TYPE_CHECKING

from pydantic import SecretStr

from overbrainer_prefect.executors.base import ExecError, Executor
from overbrainer_prefect.executors.nodes import NodesExecutor
from overbrainer_prefect.money.limits import BudgetError
from overbrainer_prefect.money.pods import ask_of, capped, cost_facts_of
from overbrainer_prefect.runpod.bootstrap import POD_DIR, PodTiming
from overbrainer_prefect.runpod.client import RunpodClient
from overbrainer_prefect.runpod.errors import PodError, PodGone, RunpodError
from overbrainer_prefect.runpod.gpus import LaunchPlan, for_pods, plan_from_api
from overbrainer_prefect.runpod.models import CLUSTER_PODS
from overbrainer_prefect.runpod.pod import POD_RECORD, PodRecord, PodState
from overbrainer_prefect.runpod.settings import RunpodTargetSettings, settings_from
from overbrainer_prefect.runpod.volume import ensure_volume
from overbrainer_prefect.runpod.vram import (
    GB,
    VramEstimateError,
    merge_vram_bytes,
    model_shape,
    training_vram,
)
from overbrainer_prefect.runs.store import RunRecord, Runs, subject
from overbrainer_prefect.steps import retrieve
from overbrainer_prefect.steps.context import COLLECTOR, Outcome, RunContext
from overbrainer_prefect.steps.errors import NotRetrieved, RunError, failure_reason
from overbrainer_prefect.steps.reporters import Reporter
from overbrainer_prefect.store.records import RecordIoError
from overbrainer_prefect.targets.base import Budget, JobNeed, Logger, Reservation
from overbrainer_prefect.targets.disk import fit_disk
from overbrainer_prefect.targets.host import BlockTarget, Bounds
from overbrainer_prefect.targets.runpod.cluster import (
    node_gone,
    nodes_executor,
    provision_cluster,
    reach_nodes,
    reachable,
)
from overbrainer_prefect.targets.runpod.context import INTERRUPTED, PodContext
from overbrainer_prefect.targets.runpod.ending import (
    detached_message,
    end_pod,
    fetch_watchdog_log,
    is_gone,
    kept_message,
    look_up_pod,
    release,
    remove_hint,
    sweep_others,
)
from overbrainer_prefect.targets.runpod.follow import settle, watch_pod
from overbrainer_prefect.targets.runpod.gpucheck import check_gpus
from overbrainer_prefect.targets.runpod.keys import SSH_DIR
from overbrainer_prefect.targets.runpod.orphans import orphan_warnings, pod_rows, sweep_host_keys
from overbrainer_prefect.targets.runpod.provision import DEFAULT_WORKDIR, provision
from overbrainer_prefect.targets.runpod.reconnect import reconnect
from overbrainer_prefect.targets.runpod.shared import (
    LINK_FILE,
    PIPELINE_LINK,
    home_of,
    job_dir,
    mark_between,
    name_job,
    write_link,
)
from overbrainer_prefect.targets.sharing import current
from overbrainer_prefect.trainers.axolotl import launch_summary
from overbrainer_prefect.trainers.base import TargetFacts, Trainer, TrainError
from overbrainer_prefect.trainers.compare import vram_floor

if TYPE_CHECKING:
    from overbrainer_prefect.executors.ssh import SshExecutor  # asyncssh: where SSH is used

LOCAL_RECORDS = (POD_RECORD, POD_DIR, SSH_DIR, LINK_FILE, PIPELINE_LINK)
"""What this machine keeps of a job's pod in its run directory: never uploaded."""


def plan_price(plan: LaunchPlan) -> float:
    """The most a pod of `plan` may cost an hour: the dearest type it may fall back to."""
    return max(choice.price_per_hour for choice in plan.choices)


def cents(price_per_hour: float) -> int:
    """A price in whole cents an hour, rounded up."""
    return max(1, math.ceil(round(price_per_hour * 100, 6)))


@dataclass
class PodPlaced:
    """A job on its pod: the pod's record, an executor over SSH with the pinned
    host key, the account, and the bounds of the job's steps (no deadline of
    its own: the pod's watchdog and the client's guard bound it)."""

    ctx: PodContext
    pod: PodRecord
    ssh: SshExecutor
    bounds: Bounds
    retrieve_grace_s: float
    remote_dir_here: str | None = None
    """The job's run directory on the pod, once provisioned for it."""
    job_started: bool = False
    """Whether the job started here (`started` was called)."""
    pod_dir: str | None = None
    """Where the pod's state (`.pod`) is on it: its owner's run directory, when
    the job runs on a pod made for another job of its pipeline (None: its own)."""
    owner: RunRecord | None = None
    """The record the pod was made for, when that is another job's."""
    share: PodShare | None = None
    """The pipeline that shares the pod: the pod stays for its next job."""
    checkpoints_volume: str | None = None
    """The network volume the job's checkpoints are kept on (see
    `RunContext.checkpoints_volume`), when the target keeps them there."""
    nodes: NodesExecutor | None = None
    """On an instant cluster: every pod's executor as one (`ssh` is the primary's)."""
    nodes_lost: dict[int, str] = field(default_factory=dict)
    """On an instant cluster: the node whose job the follower's SSH lost (its
    rank: how), told by `nodes` (see `cluster.node_gone`)."""

    @property
    def executor(self) -> Executor:
        """The pod's executor; a cluster's, over every pod of it."""
        return self.nodes or self.ssh

    def remote_dir(self, record: RunRecord) -> str:
        """The job's run directory on its pod (the pod's own work directory)."""
        return self.remote_dir_here or record.remote_dir

    @property
    def description(self) -> str:
        """`<target>: pod <id>` (a cluster's: `N nodes: ...`)."""
        return self.executor.description

    def context(self, store: Runs, reporter: Reporter) -> RunContext:
        """The job's context on its pod (its pod record, keys and watchdog log
        never uploaded): its probe must see the GPUs the pod bills for
        (`targets.runpod.gpucheck`), and a job found lost is asked of Runpod: a pod
        deleted under it (on a cluster, any of its pods gone or not running)
        ends the watch unreachable, `settle` says why."""
        pod = self.pod
        return replace(
            self.bounds.context(store, self.executor, reporter),
            local_only=LOCAL_RECORDS,
            check_facts=lambda facts: check_gpus(pod, facts),
            host_gone=lambda: (
                node_gone(self.ctx, pod, self.nodes_lost)
                if self.nodes is not None
                else is_gone(self.ctx, pod)
            ),
            checkpoints_volume=self.checkpoints_volume,
        )

    async def follow(self, ctx: RunContext, trainer: Trainer, record: RunRecord) -> Outcome:
        """Follows the job with the pod's lease renewed while it progresses and
        the client's guard at the deadline, retrieves and verifies its files,
        then ends the pod. A pod gone under the watch gives the outcome of the
        local files, with the reason (`lost`) the caller fails the record with."""
        try:
            watched = await watch_pod(ctx, self.ctx, trainer, record, self.pod, self.pod_dir)
            outcome = await settle(self.ctx, self.pod, record.id, watched)
        except PodGone as gone:
            self.ctx.log.warning("%s", gone)
            outcome = retrieve.recorded(ctx.runs, trainer, ctx.runs.load(record.id))
            outcome.lost = gone.kept
            return outcome
        except NotRetrieved as error:
            self.pod.state = PodState.AWAITING_RETRIEVAL
            self.pod.save(self.ctx.runs)
            await fetch_watchdog_log(ctx.runs, self.executor, record)
            raise RunError(
                f"{error}; its pod {self.pod.name}{self.pod.rate_text()} stays until its "
                f"watchdog's retrieve grace ends, or {remove_hint(record.id)}"
            ) from None
        except (RunError, ExecError) as error:
            detached = detached_message(
                ctx.runs, self.pod, record, self.retrieve_grace_s, self.ctx.timing.lease_ttl_s
            )
            raise RunError(f"{error}. {detached}") from None
        await self.end(outcome)
        return outcome

    async def end(self, outcome: Outcome) -> None:
        """Deletes the pod (confirmed) once the job's files are verified, else
        leaves it to its watchdog's retrieve grace (see `targets.runpod.ending.end_pod`).
        On a pod a pipeline shares, the pod stays for the pipeline's next job."""
        if self.share is not None and not self.pod.gone:
            await self.share.between(self.ctx, self.ssh, outcome.record, outcome.retrieved)
            return
        await end_pod(
            self.ctx, self.pod, self.executor, self.owner or outcome.record, outcome.retrieved
        )

    def started(self, store: Runs, record: RunRecord) -> None:
        """Records the pod running its job, and logs what bounds it. Raises
        PodError (with how to remove the pod) when `pod.json` cannot be saved."""
        self.job_started = True
        if self.share is not None:
            self.share.running = (store, record.id)
        pod = self.pod
        pod.state = PodState.RUNNING
        try:
            pod.save(self.ctx.runs)
        except Exception as error:
            raise PodError(
                f"the job of {subject(record)} runs on pod {pod.name}{pod.rate_text()}, but "
                f"pod.json cannot be saved ({error}); {remove_hint(record.id)}"
            ) from None
        if pod.keep:
            self.ctx.log.warning("%s", kept_message(store, pod, record.id))
        else:
            self.ctx.log.info(
                "%s: its job runs on pod %s%s; the pod's watchdog deletes it at max_hours (%s) "
                "unless this flow renews its lease while the job progresses",
                subject(record),
                pod.name,
                pod.rate_text(),
                pod.deadline,
            )

    def facts(self) -> list[tuple[str, str]]:
        """The pod's GPU, rate, uptime, spend, deadline and how it ended."""
        return pod_facts(self.pod)

    def spend(self) -> float | None:
        """What the pod has cost so far (its GPUs and its disk, by its uptime)."""
        return self.pod.estimated_spend()

    def deadline(self, record: RunRecord) -> str | None:
        """The pod watchdog's max_hours deadline (the job's, when it has one)."""
        return record.deadline or self.pod.deadline


@dataclass
class BudgetKept:
    """A pipeline pod's budget hold and ledger entry (a `targets.sharing.Held`),
    kept past the job that made the pod until the pipeline ends; the entry is
    then brought up to date with what the pod cost over all its jobs."""

    stack: AsyncExitStack
    log: Logger

    async def close(self, error: BaseException | None) -> None:
        """Releases the hold and records what the pod cost. Never raises: a
        failure is logged (the ledger keeps the entry at the pod's most)."""
        try:
            await self.stack.aclose()
        except Exception as failure:
            self.log.warning("budget: cannot close the pipeline pod's entry: %s", failure)


@dataclass
class PodShare:
    """A pod the jobs of a pipeline share (a `targets.sharing.Held`): the
    record it was made for (its owner: `pod.json`, keys, watchdog log), the
    pod, the image it runs, and how its last job ended."""

    target: PodTarget
    home: Runs
    """The store of the pod's owner."""
    owner_id: str
    pod: PodRecord
    image: str
    plan: LaunchPlan | None
    """The plan it was made by (None for a pod a continued pipeline found)."""
    jobs: int = 1
    retrieved: bool = True
    """Whether its last job's files were retrieved and verified."""
    running: tuple[Runs, str] | None = None
    """The job started on it and not yet ended here (its store and ID)."""

    def owner(self) -> RunRecord:
        """The record the pod was made for. Raises when it cannot be read."""
        return self.home.load(self.owner_id)

    @property
    def pod_dir(self) -> str:
        """The owner's run directory on the pod, where the watchdog's state is."""
        return job_dir(self.pod.workdir or DEFAULT_WORKDIR, self.owner_id)

    async def between(
        self, ctx: PodContext, executor: Executor, record: RunRecord, retrieved: bool
    ) -> None:
        """Keeps the pod for the pipeline's next job once the job `record`
        ended: its watchdog is told its files were verified (it deletes the pod
        at its next-job grace unless a next job starts) and the lease renewed.
        A job whose files were not retrieved leaves the pod to its watchdog's
        retrieve grace. Never raises: a pod that cannot be told is logged."""
        self.retrieved = retrieved
        self.running = None
        owner = self.owner()
        await fetch_watchdog_log(self.home, executor, owner)
        if retrieved:
            self.pod.between_unix = time.time()  # recorded first: a follower may die next
            self.pod.next_job_grace_s = ctx.timing.next_job_grace_s
            self.pod.save(self.home)
            try:
                await mark_between(executor, self.pod_dir, record.remote_dir)
            except ExecError as error:
                self.pod.between_unix = None
                ctx.log.warning("cannot tell the watchdog of pod %s: %s", self.pod.name, error)
        self.pod.state = PodState.READY if retrieved else PodState.AWAITING_RETRIEVAL
        self.pod.save(self.home)
        pod = f"pod {self.pod.name}{self.pod.rate_text()}"
        if retrieved:
            ctx.log.info(
                "%s: its files are verified; %s stays for the next job of the pipeline (its "
                "watchdog deletes it %.0f s after this unless that job starts)",
                subject(record),
                pod,
                ctx.timing.next_job_grace_s,
            )
        else:
            ctx.log.warning(
                "the files of %s were not retrieved: %s stays until its watchdog's retrieve "
                "grace ends, or %s",
                subject(record),
                pod,
                remove_hint(self.owner_id),
            )

    def _still_running(self) -> bool:
        """Whether a job started on the pod has not ended (its follower gave up)."""
        if self.running is None:
            return False
        store, record_id = self.running
        try:
            return not store.load(record_id).state.ended
        except Exception:
            return False

    async def close(self, error: BaseException | None) -> None:
        """Ends the pod once its pipeline ended: deleted (the `retrieved` marker
        first, deletion confirmed, keys forgotten) after its last job's files
        were verified, or because the pipeline failed; left to its watchdog's
        bounds when its last job's files were not retrieved, or that job keeps
        running with nobody following it (the pipeline's message says how to
        follow it again). Never
        raises: a pod that may be left is logged with how to remove it."""
        pod = self.pod
        if pod.gone:
            return
        try:
            async with self.target.account(self.home) as ctx:
                if error is not None and self._still_running():
                    return  # its job keeps running unfollowed: the message said how; it is bounded
                if error is not None:
                    reason = f"its pipeline ended: {failure_reason(error)}"
                    await release(ctx, pod, reason)
                    return
                if not self.retrieved:
                    return  # its watchdog's retrieve grace bounds it; the warning was logged
                owner = self.owner()
                executor = await reconnect(ctx, pod, owner, self.target.ref)
                if executor is None:
                    return
                try:
                    await end_pod(ctx, pod, executor, owner, True)
                finally:
                    await executor.close()
                ctx.log.info(
                    "pod %s ran %d jobs of the pipeline; up %.0f s, about $%.4f",
                    pod.name,
                    self.jobs,
                    pod.uptime_s(),
                    pod.estimated_spend() or 0.0,
                )
        except Exception as failure:
            self.target._log.warning(
                "pod %s of the pipeline may be left (%s); %s",
                pod.name,
                failure,
                remove_hint(self.owner_id),
            )


def pod_spent(store: Runs, record: RunRecord) -> float | None:
    """The estimated dollars the pod of `record` cost (its rate × uptime), or
    None when it had no pod, its record cannot be read or its rate is unknown."""
    try:
        pod = PodRecord.load(store, record.id)
    except Exception:
        return None
    return None if pod is None else pod.estimated_spend()


def cluster_pods(pod: PodRecord) -> str:
    """An instant cluster's pods in one line: `2 pods (node 0 abc, node 1 def)`."""
    shown = ", ".join(f"node {n.rank} {n.pod_id}" for n in pod.nodes)
    return f"{pod.cluster_pods} pods" + (f" ({shown})" if shown else "")


def pod_facts(pod: PodRecord) -> list[tuple[str, str]]:
    """A pod's summary rows: GPU, rate, uptime, spend, deadline, how it ended."""
    spend = pod.estimated_spend()
    gpu = f"{pod.gpu_count} × {pod.gpu_type_id}" if pod.gpu_count > 1 else str(pod.gpu_type_id)
    rows = [
        ("Pod", pod.name),
        ("GPU", gpu),
        ("Rate", f"${pod.rate:.2f}/h (GPUs and disk)" if pod.rate is not None else "unknown"),
        ("Uptime", f"{pod.uptime_s() / 60:.1f} min"),
        ("Estimated spend", f"${spend:.4f}" if spend is not None else "unknown"),
        ("Watchdog deadline (max_hours)", pod.deadline or "none"),
        ("State", str(pod.state)),
    ]
    if pod.cluster_id is not None:
        rows.insert(1, ("Cluster", f"{pod.cluster_id}: {cluster_pods(pod)}"))
    if pod.deleted_by:
        rows.append(("Deleted by", f"{pod.deleted_by} ({pod.delete_reason})"))
    if pod.attempts:
        rows.append(
            ("Create attempts", "; ".join(f"{a.gpu_type_id}: {a.result}" for a in pod.attempts))
        )
    return rows


class PodTarget(BlockTarget):
    """A `Target` that makes a Runpod pod for each job (see the module)."""

    kind = "runpod"

    def __init__(
        self,
        ref: str,
        settings: RunpodTargetSettings,
        client: Callable[[], RunpodClient],
        *,
        api_url: str,
        bounds: Bounds,
        secrets: Callable[[], Mapping[str, SecretStr]],
        cpu_threads: int | None,
        hub_token: SecretStr | None,
        hub_endpoint: str | None,
        log: Logger,
    ) -> None:
        # the pod's watchdog bounds a job's hours, not the client
        bounds = replace(bounds, max_hours=None)
        super().__init__(ref, bounds, secrets=secrets, cpu_threads=cpu_threads, log=log)
        self.settings = settings
        self._client = client
        self._api_url = api_url
        self._hub = (hub_token, hub_endpoint)

    @property
    def workdir(self) -> str:
        """Where the run directories are on a real pod (a pod says its own once up)."""
        return DEFAULT_WORKDIR

    def check(self, need: JobNeed) -> None:
        """Refuses, with one line, settings (with the job's own image) that
        cannot make a pod (SettingsError), and a training across more nodes
        than a self-serve instant cluster has pods, or on a network volume
        (its pods would share one run directory) (TrainError)."""
        settings = self._settings(need)
        nodes = _nodes(need)
        if nodes <= 1:
            return
        low, high = CLUSTER_PODS
        if not low <= nodes <= high:
            raise TrainError(
                f"{need.what} asks for nodes={nodes}, but a Runpod instant cluster has {low} to "
                f"{high} pods: ask for at most {high} nodes"
            )
        if settings.network_volume_id or settings.checkpoints_volume:
            raise TrainError(
                f"{need.what} asks for nodes={nodes} on {self.ref}, whose pods mount a network "
                "volume: the pods of an instant cluster would share one run directory; use a "
                "target without network_volume_id and checkpoints_volume, or set nodes=1"
            )

    def _settings(self, need: JobNeed) -> RunpodTargetSettings:
        if not need.image:
            return self.settings
        return settings_from({**self.settings.model_dump(), "image": need.image})

    async def facts(self, modules: Sequence[str]) -> TargetFacts:
        """The pod's GPU count (its GPUs' capability and modules are known
        only once it exists)."""
        return TargetFacts(python=self.python, gpus=self.settings.gpu_count)

    @asynccontextmanager
    async def account(self, store: Runs) -> AsyncIterator[PodContext]:
        """The Runpod account for the length of the block, with `store` the
        store of the pod records it works on."""
        async with self._client() as client:
            yield PodContext(client=client, runs=store, log=self._log)

    @asynccontextmanager
    async def reserve(
        self, store: Runs, need: JobNeed, budget: Budget
    ) -> AsyncIterator[Reservation[LaunchPlan]]:
        """Checks the network volume (grown within `max_volume_gb` when the
        job needs it), plans the pod (the VRAM floor from the job's kind for
        `auto` types), logs the plan and its price, leaves out the types
        dearer than the whole budget, warns of the account's leftover pods,
        admits the pod's most into the day's and month's ledger (its cost cap
        lowered to what is left), and holds the budget for the pod's price
        for the length of the block.

        Raises SettingsError, GpuChoiceError, VolumeError, RunpodError,
        BudgetRefused or BudgetError with one line; nothing is created.
        """
        settings = self._settings(need)
        nodes = _nodes(need)
        held = await self._shared_pod(store, settings) if nodes == 1 else None
        if held is not None:  # the pipeline's pod is up: nothing new to plan, admit or hold
            self._log.info(
                "%s runs on pod %s of its pipeline (%s, job %d on it): no new pod",
                need.what,
                held.pod.name,
                f"{held.pod.gpu_type_id}{held.pod.rate_text()}",
                held.jobs + 1,
            )
            yield Reservation(plan=held.plan, need=need)  # type: ignore[arg-type]
            return
        later = self._later(settings) if nodes == 1 else []  # a cluster runs its training only
        # the pod's disk holds every job it will run (auto: sized), or the job is refused
        settings = await asyncio.to_thread(
            fit_disk, settings, need, later, self.ref, *self._hub, self._log
        )
        async with self.account(store) as ctx:
            disk = max([n.disk_bytes or 0 for n in (need, *later)]) or None
            await ensure_volume(ctx.client, settings, disk, need.what, ctx.log)
            floor = await self._vram_floor(settings, need)
            largest = need.what
            for other in later:  # a pod for a pipeline is sized for its largest job
                found = await self._vram_floor(settings, other)
                if found is not None and (floor is None or found > floor):
                    floor, largest = found, other.what
            if later:
                self._log.info(
                    "one pod runs every job of the pipeline: sized for its largest, %s (%s)",
                    largest,
                    f"at least {floor:g} GB of VRAM per GPU"
                    if floor is not None
                    else "by the target's GPU types",
                )
            launch = (
                launch_summary(need.training, settings.gpu_count)
                if need.training is not None
                else None
            )
            plan = await plan_from_api(ctx.client, settings, vram_floor_gb=floor, job_launch=launch)
            plan = for_pods(plan, nodes)  # an instant cluster: every price is its pods' together
            image = f" Its image: {settings.image}." if need.image else ""
            self._log.info("%s%s", plan.describe(), image)
            await self._warn_orphans(ctx, store)
        plan = await self._within(plan, budget)
        plan = _after_lost_pods(plan, need)
        sharing = current() if later else None
        async with AsyncExitStack() as stack:
            # issue 20: the day's and month's dollars admit the plan's most; its cap is what is left
            admitted = await stack.enter_async_context(
                budget.admit(store, ask_of(plan, need.what, self.ref), cost_facts_of(store))
            )
            plan = capped(plan, admitted.cap_usd if admitted is not None else None)
            await stack.enter_async_context(budget.hold(plan_price(plan)))
            if sharing is not None:
                # the pipeline's pod bills past this job: its budget hold and its ledger
                # entry last until the pod ends with the pipeline (closed after it)
                sharing.held[f"{self.ref} budget"] = BudgetKept(stack.pop_all(), self._log)
            yield Reservation(plan=plan, need=need, admission=admitted)

    def _later(self, settings: RunpodTargetSettings) -> list[JobNeed]:
        """What the later jobs of the pipeline this pod would be made for need
        (those on the same image), or nothing outside a pipeline."""
        sharing = current()
        if sharing is None or self.ref in sharing.held:
            return []
        return [n for n in sharing.later if self._settings(n).image == settings.image]

    def _held(self, settings: RunpodTargetSettings) -> PodShare | None:
        """The pod the pipeline this job is part of holds on this target, when
        it is up and runs the job's image."""
        sharing = current()
        held = sharing.held.get(self.ref) if sharing is not None else None
        if not isinstance(held, PodShare) or held.pod.gone or held.image != settings.image:
            return None
        return held

    async def _shared_pod(self, store: Runs, settings: RunpodTargetSettings) -> PodShare | None:
        """The pipeline's pod for a job of `settings`: the one it holds, or,
        for a pipeline continued (`fine_tune(run_id=...)`), the pod its run's
        records name while it lives (found again, then held). None when there
        is none: a new pod is made."""
        held = self._held(settings)
        sharing = current()
        if held is not None or sharing is None or sharing.anchor is None:
            return held
        if self.ref in sharing.held:
            return None
        anchor_store, anchor_id = sharing.anchor
        home, owner_id = home_of(anchor_store, anchor_id, PIPELINE_LINK)
        try:
            pod = PodRecord.load(home, owner_id)
            owner = home.load(owner_id)
        except Exception:
            return None
        if pod is None or pod.gone or pod.keep or owner.target != self.ref:
            return None
        async with self.account(home) as ctx:
            try:
                executor = await reconnect(ctx, pod, owner, self.ref)
            except PodError as error:
                ctx.log.warning("the pipeline's pod %s cannot be used again: %s", pod.name, error)
                return None
            if executor is None:
                ctx.log.info("the pipeline's pod %s is gone: a new pod is made", pod.name)
                return None
            await executor.close()
        if self._settings_image(owner) != settings.image:
            return None
        share = PodShare(self, home, owner_id, pod, settings.image, None)
        sharing.held[self.ref] = share
        self._log.info("the pipeline continues on its pod %s, still up", pod.name)
        return share

    def _settings_image(self, owner: RunRecord) -> str:
        """The image the pod made for `owner` runs (this target's, unless that
        job asked for its own)."""
        image = owner.spec.get("image") if isinstance(owner.spec, dict) else None
        return image if isinstance(image, str) and image.strip() else self.settings.image

    async def billed(self, since: datetime) -> dict[str, float]:
        """What Runpod billed each pod of the account since `since`, by pod id
        (see `RunpodClient.pod_billing`). Raises RunpodError."""
        async with self._client() as client:
            return await client.pod_billing(since)

    async def _vram_floor(self, settings: RunpodTargetSettings, need: JobNeed) -> float | None:
        """The VRAM per GPU the job needs, for `auto` types without `min_vram_gb`
        (logged with how it was found); None (with a warning) when unknown."""
        if not settings.is_auto or settings.min_vram_gb is not None:
            return None
        token, endpoint = self._hub
        try:
            if need.training is not None:
                spec = need.training
                shape = await asyncio.to_thread(
                    model_shape, spec.base_model, token=token, endpoint=endpoint
                )
                estimate = training_vram(shape, spec, gpus=settings.gpu_count)
                floor, why = (
                    float(estimate.floor_gb),
                    f"the run needs about {estimate} of VRAM per GPU (estimate)",
                )
            elif need.merge_model is not None:
                shape = await asyncio.to_thread(
                    model_shape, need.merge_model, token=token, endpoint=endpoint
                )
                bytes_ = merge_vram_bytes(shape)
                floor = float(math.ceil(bytes_ / GB))
                why = (
                    f"the merge into {need.merge_model} needs about {bytes_ / GB:.1f} GB of VRAM "
                    "(its 16-bit weights, a fifth more, the CUDA context)"
                )
            elif need.gguf_bytes is not None:
                bytes_ = vram_floor(need.gguf_bytes)
                floor = float(math.ceil(bytes_ / GB))
                why = (
                    f"{need.what} needs about {bytes_ / GB:.1f} GB of VRAM (the GGUF, "
                    f"{need.gguf_bytes / 1e6:.1f} MB, plus a fifth, plus 2 GB)"
                )
            else:
                return None
        except VramEstimateError as error:
            self._log.warning(
                "cannot estimate the VRAM %s needs (%s): gpu_types auto picks without a VRAM floor",
                need.what,
                error,
            )
            return None
        self._log.info("%s: gpu_types auto keeps the types with at least %g GB", why, floor)
        return floor

    async def _within(self, plan: LaunchPlan, budget: Budget) -> LaunchPlan:
        """`plan` without the GPU types dearer than the whole budget (logged),
        so that the pod is held at the price of the dearest type left."""
        spend = await budget.spend_limit_cents()
        if spend is None:
            return plan
        kept = tuple(c for c in plan.choices if cents(c.price_per_hour) <= spend)
        if not kept or len(kept) == len(plan.choices):
            return plan
        dropped = [c.label() for c in plan.choices if c not in kept]
        self._log.info(
            "the GPU budget allows $%.2f/h in all: %s left out of the GPU types to try",
            spend / 100,
            ", ".join(dropped),
        )
        return replace(plan, choices=kept)

    async def _warn_orphans(self, ctx: PodContext, store: Runs) -> None:
        """Warns of the account's pods nothing here follows, and sweeps the
        host key secrets no pod needs any more (best effort, never deletes a pod)."""
        try:
            rows = await pod_rows(ctx.client, store)
        except RunpodError as error:
            ctx.log.warning("cannot look for leftover pods: %s", error)
            return
        for warning in orphan_warnings(rows):
            ctx.log.warning("%s", warning)
        try:
            for warning in await sweep_host_keys(ctx.client, store, rows):
                ctx.log.warning("%s", warning)
        except RunpodError as error:
            ctx.log.warning("cannot look for leftover host key secrets: %s", error)

    @asynccontextmanager
    async def place(
        self, store: Runs, record: RunRecord, reservation: Reservation[LaunchPlan]
    ) -> AsyncIterator[PodPlaced]:
        """Provisions the job's pod (see `targets.runpod.provision`) and yields it. On
        exit, a job that never started has every pod of it deleted and its
        record failed with the reason; a started one keeps its pod (its
        follower ended it, or its watchdog bounds it).

        Within a pipeline that shares its places, the pipeline's pod (when it
        is up and runs the job's image) is placed on instead (the job's own
        run directory on it, its record linked to the pod's owner), and a pod
        made here stays for the pipeline's next jobs once this job started.

        Raises PodError (every pod deleted; `kept` is what the record keeps)
        when the pod cannot be had or readied."""
        plan = reservation.plan
        settings = self._settings(reservation.need) if reservation.need else self.settings
        held = self._held(settings)
        if held is not None:
            async with self.account(held.home) as ctx:
                rejoined = await self._rejoin(ctx, held, store, record)
                if rejoined is not None:
                    executor, remote = rejoined
                    try:
                        yield PodPlaced(
                            ctx,
                            held.pod,
                            executor,
                            self._bounds,
                            settings.retrieve_grace_s,
                            remote_dir_here=remote,
                            pod_dir=held.pod_dir,
                            owner=held.owner(),
                            share=held,
                            checkpoints_volume=settings.checkpoints_volume,
                        )
                    finally:
                        await executor.close()
                    return
        if plan is None:  # reserved on a pod that went since: no plan to make another by
            raise PodError(
                f"the pod of the pipeline is gone before {subject(record)} could start on it; "
                "continue the pipeline with fine_tune (run_id=...)",
                kept="its pipeline's pod is gone",
            )
        settings = plan.settings  # issue 20: with the cost cap the budget admitted
        if reservation.admission is not None:  # issue 20: the ledger's entry names this record
            reservation.admission.bind(store, record.id)
        async with self.account(store) as ctx:
            steps = provision_cluster if plan.pods > 1 else None
            ready = await provision(
                ctx, record, plan, api_url=self._api_url, name=self.ref, steps=steps
            )
            await sweep_others(ctx, ready.pod)  # a twin of an answer lost on the way: at once
            said: dict[int, str] = {}
            placed = PodPlaced(
                ctx,
                ready.pod,
                ready.executor,
                self._bounds,
                settings.retrieve_grace_s,
                remote_dir_here=ready.remote_dir,
                checkpoints_volume=settings.checkpoints_volume,
                nodes=nodes_executor(ctx, ready.pod, ready.nodes, self.python, said)
                if ready.nodes
                else None,
                nodes_lost=said,
            )
            sharing = current()
            if sharing is not None and self.ref not in sharing.held and not ready.nodes:
                placed.share = PodShare(self, store, record.id, ready.pod, settings.image, plan)
                sharing.held[self.ref] = placed.share
                ready.pod.pipeline_job = record.id  # once its job ended, the pod is not left over
                ready.pod.save(store)
                if sharing.anchor is not None and sharing.anchor[1] != record.id:
                    # a continued pipeline finds this pod again from its run
                    anchor_store, anchor_id = sharing.anchor
                    try:
                        write_link(anchor_store, anchor_id, store, record.id, PIPELINE_LINK)
                    except RecordIoError as error:  # the pipeline continued again: a new pod
                        ctx.log.warning("cannot link run %s to its pod: %s", anchor_id, error)
            try:
                yield placed
            except BaseException as error:
                if not placed.job_started:  # no job runs: the pod has nothing left to do
                    await asyncio.shield(release(ctx, placed.pod, failure_reason(error)))
                raise
            else:
                if not placed.job_started:
                    await release(ctx, placed.pod, INTERRUPTED)
            finally:
                for executor in ready.nodes or [ready.executor]:
                    await executor.close()

    async def _rejoin(
        self, ctx: PodContext, held: PodShare, store: Runs, record: RunRecord
    ) -> tuple[SshExecutor, str] | None:
        """Places the new job `record` on the pipeline's pod: the pod reached
        again, the job's record linked to the pod's owner, its watchdog told
        of the job's run directory (the lease renewed). Returns the executor
        and that directory, or None when the pod is gone (no longer held).

        Raises PodError when the pod cannot be reached or told now."""
        executor = await reconnect(ctx, held.pod, held.owner(), self.ref)
        if executor is None:
            sharing = current()
            if sharing is not None and sharing.held.get(self.ref) is held:
                del sharing.held[self.ref]
            ctx.log.info("the pipeline's pod %s is gone: a new pod is made", held.pod.name)
            return None
        remote = job_dir(held.pod.workdir or DEFAULT_WORKDIR, record.id)
        try:
            write_link(store, record.id, held.home, held.owner_id)
            await name_job(executor, held.pod_dir, remote)
        except (RecordIoError, ExecError) as error:
            await executor.close()
            raise PodError(
                f"{subject(record)} cannot be placed on pod {held.pod.name}: {error}"
            ) from None
        held.jobs += 1
        held.pod.pipeline_job = record.id
        held.pod.between_unix = None
        held.pod.save(held.home)
        return executor, remote

    @asynccontextmanager
    async def reach(self, store: Runs, record: RunRecord) -> AsyncIterator[PodPlaced | None]:
        """The job's pod reached again from `pod.json` (looked up first: its
        port may have changed), or None when it is gone (confirmed: `lost`
        says why). A job run on another job's pod (a pipeline's) reaches that
        pod; within a pipeline that shares its places, the pod stays for the
        pipeline's next job once this one ended.

        Raises RunError when the job never asked for a pod; PodError when the
        pod is stopped, has no SSH endpoint, or cannot be reached or looked up."""
        home, owner_id = home_of(store, record.id)
        pod = PodRecord.load(home, owner_id)
        if pod is None:
            raise RunError(
                f"{subject(record)} has no pod record ({record.id}/pod.json): it never asked "
                "for a pod, so there is nothing to reach"
            )
        owner = home.load(owner_id) if owner_id != record.id else record
        async with self.account(home) as ctx:
            if (
                record.state.ended
                and current() is None
                and _next_job_grace_passed(pod)
                and _held_by_its_pipeline(pod, record)
            ):
                # outside its pipeline (a collect, an attach): its watchdog deletes it at its
                # next-job grace, and a next job may have just started on it: only looked up
                if await look_up_pod(ctx, pod, f"pod {pod.pod_id} of {subject(record)}") is None:
                    yield None
                    return
                raise PodError(
                    f"pod {pod.name} of the pipeline of {subject(record)} is past its next-job "
                    "grace but still there: its pipeline's next job may run on it, or its "
                    f"watchdog deletes it within {BETWEEN_MARGIN_S:.0f} s; the next collect ends "
                    f"it if not, or {remove_hint(record.id)}"
                )
            if record.state.ended and pod.state == PodState.DELETING:
                # its files were settled before the delete was sent: confirm that delete
                await release(ctx, pod, pod.delete_reason or "its job ended")
                yield None
                return
            executor = await reconnect(ctx, pod, owner, record.target)
            if executor is None:
                ctx.log.info("%s: pod %s no longer exists", subject(record), pod.name)
                yield None
                return
            linked = owner_id != record.id
            cluster = reachable(pod)
            try:
                nodes = await reach_nodes(ctx, pod, executor, self.ref) if cluster else [executor]
            except BaseException:
                await executor.close()
                raise
            said: dict[int, str] = {}
            try:
                yield PodPlaced(
                    ctx,
                    pod,
                    executor,
                    self._bounds,
                    self.settings.retrieve_grace_s,
                    pod_dir=job_dir(pod.workdir or DEFAULT_WORKDIR, owner_id) if linked else None,
                    owner=owner if linked else None,
                    share=None if pod.is_cluster else self._share_of(home, owner, pod),
                    checkpoints_volume=self.settings.checkpoints_volume,
                    nodes=nodes_executor(ctx, pod, nodes, self.python, said) if cluster else None,
                    nodes_lost=said,
                )
            finally:
                for each in nodes:
                    await each.close()

    def _share_of(self, home: Runs, owner: RunRecord, pod: PodRecord) -> PodShare | None:
        """The pipeline's hold on `pod`, reached again within a pipeline that
        shares its places (held from now on); None outside one, or for a pod
        it does not hold."""
        sharing = current()
        if sharing is None or pod.keep:
            return None
        held = sharing.held.get(self.ref)
        if held is None:
            held = PodShare(self, home, owner.id, pod, self._settings_image(owner), None)
            sharing.held[self.ref] = held
        return held if isinstance(held, PodShare) and held.pod.pod_id == pod.pod_id else None

    def _pod_of(self, store: Runs, record: RunRecord) -> tuple[Runs, PodRecord | None]:
        """The store of the pod record of the job `record` (its own, or that of
        the job its pipeline's pod was made for) and that record."""
        home, owner_id = home_of(store, record.id)
        return home, PodRecord.load(home, owner_id)

    async def abandon(self, store: Runs, record: RunRecord, reason: str) -> bool:
        """Deletes every pod of the job (confirmed) with `reason`, sweeps its
        other pods, removes its client key and host key secret; a job run on
        its pipeline's pod ends that pod. Returns whether no pod may be left."""
        home, pod = self._pod_of(store, record)
        if pod is not None and pod.run_id != record.id and self._holds(pod):
            return False  # the pipeline's pod, for its next job: its end (or watchdog) ends it
        if pod is not None:
            async with self.account(home) as ctx:
                await release(ctx, pod, reason)
        return pod is None or pod.gone

    def _holds(self, pod: PodRecord) -> bool:
        """Whether the pipeline this code runs in holds `pod` for its next jobs."""
        sharing = current()
        held = sharing.held.get(self.ref) if sharing is not None else None
        return isinstance(held, PodShare) and held.pod.pod_id == pod.pod_id

    def lost(self, store: Runs, record: RunRecord) -> str:
        """Why the job's pod is gone: the bound its watchdog deleted it at, or
        that it no longer exists."""
        try:
            _, pod = self._pod_of(store, record)
        except Exception:
            pod = None
        if pod is None:
            return "its pod no longer exists"
        told = pod.delete_reason if pod.deleted_by not in (None, "client", COLLECTOR) else None
        return told or pod.limit_reached() or f"pod {pod.name} no longer exists"

    @property
    def max_restarts(self) -> int:
        """The target's `max_restarts`."""
        return self.settings.max_restarts

    def lost_machine(self, store: Runs, record: RunRecord) -> str | None:
        """Why the job `record` was lost with its pod: a node of its cluster
        lost (its cluster then deleted), its container restarted under it,
        or Runpod terminated the pod (not a bound of its watchdog, nor a
        delete of this side). None otherwise, or when unknown."""
        try:
            _, pod = self._pod_of(store, record)
        except Exception:  # an unreadable pod record: not resumed on a guess
            return None
        if pod is None or pod.keep:
            return None
        step = f" at step {pod.lost_step}" if pod.lost_step is not None else ""
        if pod.node_lost is not None and pod.gone:
            return f"{pod.node_lost}{step}"
        if pod.restarted is not None:
            return f"the container of pod {pod.name} restarted at {pod.restarted}{step}"
        if pod.host_lost is not None and pod.gone:
            lost = f"deleted at {pod.host_lost}"
            return f"the host of pod {pod.name} stopped answering SSH ({lost}){step}"
        if pod.gone and pod.deleted_by == "unknown":
            return (
                f"pod {pod.name} was terminated by neither this client nor its watchdog: Runpod "
                "terminated it (the account's balance ran out, its host was lost) or someone did "
                "in the console"
            )
        return None

    def leftover(self, store: Runs, record: RunRecord) -> bool:
        """Whether a pod of the job may still exist (`pod.json` not gone) or
        its keys and secret are still here. A pipeline's pod is not left over
        by a job of it while the pipeline holds it: once a later job of the
        pipeline was placed on it, or between two jobs within the watchdog's
        next-job grace (its pipeline's next job, or its watchdog, ends it)."""
        try:
            _, pod = self._pod_of(store, record)
        except Exception:
            return False
        if pod is None:
            return False
        if pod.pipeline_job is not None and not pod.gone and _held_by_its_pipeline(pod, record):
            return _next_job_grace_passed(pod)  # looked up (never deleted) once its bound passed
        return not pod.gone or not pod.forgotten

    def holds(self, store: Runs, record: RunRecord) -> bool:
        """Whether a pod of the job may still exist, its pipeline's or not
        (`pod.json` not gone), or its keys and secret are still here; True
        when its pod record cannot be read."""
        try:
            _, pod = self._pod_of(store, record)
        except Exception:
            return True
        if pod is None:
            return False
        return not pod.gone or not pod.forgotten

    def detached(self, store: Runs, record: RunRecord) -> str:
        """What bounds a started job's pod with nobody following it, and how
        to follow it again or remove the pod."""
        _, pod = self._pod_of(store, record)
        if pod is None:
            return f"{subject(record)} has no pod record: nothing of it bills"
        return detached_message(
            store, pod, record, self.settings.retrieve_grace_s, PodTiming.from_env().lease_ttl_s
        )


BETWEEN_MARGIN_S = 60.0
"""Past a pipeline pod's next-job grace, how long its watchdog is given to
delete it before a collector looks at it."""


def _next_job_grace_passed(pod: PodRecord) -> bool:
    """Whether a pipeline's pod was told the files of its last job were
    verified longer ago than its next-job grace: its watchdog deletes it
    then, unless the pipeline's next job started on it."""
    if pod.between_unix is None:
        return False
    return time.time() >= pod.between_unix + (pod.next_job_grace_s or 0.0)


def _held_by_its_pipeline(pod: PodRecord, record: RunRecord) -> bool:
    """Whether the pipeline's pod `pod` is still its pipeline's for the job
    `record`: a later job was placed on it, or it waits for the next one
    within its grace."""
    if pod.pipeline_job != record.id:
        return True
    if pod.between_unix is None:
        return False
    return time.time() < pod.between_unix + (pod.next_job_grace_s or 0.0) + BETWEEN_MARGIN_S


def _after_lost_pods(plan: LaunchPlan, need: JobNeed) -> LaunchPlan:
    """`plan` with its cost cap lowered by what the pods lost under the job's
    earlier runs cost: max_cost_usd bounds them all together. Raises
    BudgetError (one line, nothing created) when nothing of it is left."""
    cap = plan.settings.max_cost_usd
    if not need.spent_usd or cap is None:
        return plan
    left = cap - need.spent_usd
    if left < 0.01:
        raise BudgetError(
            f"max_cost_usd (${cap:.2f}) is spent by the pods {need.what} lost "
            f"(${need.spent_usd:.2f}): no new pod; raise max_cost_usd to go on"
        )
    return capped(plan, left)


def _nodes(need: JobNeed) -> int:
    """The pods a job needs at once: a training's nodes (an instant cluster), else one."""
    return need.training.nodes if need.training is not None else 1
