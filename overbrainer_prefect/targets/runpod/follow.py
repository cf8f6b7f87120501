"""Following a job on its pod: the lease that holds max_hours off while the
job makes progress, the client's own guard at the watchdog's deadline plus a
margin, the warning when the job's pace cannot end it in time, and what a
watch that ended badly means for the run when its pod is gone.

The lease is a file on the pod (`.pod/lease`) that this client touches every
few minutes while the job makes progress (a new metric, or its end being
retrieved, within the target's stall time). The watchdog skips its max_hours
deadline while the lease is fresh, and so does the client's guard. Once the
job stalls, or this client dies, the lease runs out and the deadline applies.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from overbrainer_prefect.cancelling import cancel_and_wait
from overbrainer_prefect.executors.base import ExecError, Executor, JobStatus
from overbrainer_prefect.executors.nodes import NodesExecutor
from overbrainer_prefect.runpod.bootstrap import LEASE_FILE, WATCHDOG_LOG, PodTiming
from overbrainer_prefect.runpod.errors import PodError, PodGone
from overbrainer_prefect.runpod.models import Pod
from overbrainer_prefect.runpod.pod import MAX_HOURS_REACHED, PodRecord
from overbrainer_prefect.runs.metrics import Metric, MetricsSummary
from overbrainer_prefect.runs.store import RunRecord, RunsError, RunState, subject
from overbrainer_prefect.steps import follow
from overbrainer_prefect.steps.context import Outcome, RunContext
from overbrainer_prefect.steps.errors import Unreachable
from overbrainer_prefect.steps.reporters import Reporter
from overbrainer_prefect.store.records import RecordError
from overbrainer_prefect.targets.runpod.cluster import lost_node
from overbrainer_prefect.targets.runpod.context import PodContext
from overbrainer_prefect.targets.runpod.ending import is_gone, look_up_pod, remove
from overbrainer_prefect.targets.runpod.fate import (
    Restart,
    lost_to_restart,
    restart_lost_message,
    runpod_agrees,
)
from overbrainer_prefect.timestamps import rfc3339
from overbrainer_prefect.trainers.base import Trainer


class LeaseReporter:
    """A `Reporter` that passes everything on to `inner` and notes when the
    job last made progress (a metric, or a change of status); it warns once
    when the job's pace would end it after the pod's deadline."""

    def __init__(self, inner: Reporter, pod: PodRecord) -> None:
        self.inner = inner
        self.pod = pod
        self.last_progress = time.monotonic()
        self.last_step: int | None = None
        self.warned = False

    def metric(self, metric: Metric, summary: MetricsSummary) -> None:
        """Passes the metric on; notes the progress; warns once of an overrun."""
        self.inner.metric(metric, summary)
        self.last_progress = time.monotonic()
        self.last_step = metric.step
        if not self.warned:
            note = overrun(summary.eta_seconds(), self.pod, time.time())
            if note is not None:
                self.warned = True
                self.inner.warning(note)

    def status(self, status: JobStatus) -> None:
        """Passes the status on; a change is progress (an ended job is retrieved next)."""
        self.inner.status(status)
        self.last_progress = time.monotonic()

    def warning(self, message: str) -> None:
        """Passes the warning on."""
        self.inner.warning(message)

    def note(self, message: str) -> None:
        """Passes the note on."""
        self.inner.note(message)


def overrun(eta_s: float | None, pod: PodRecord, now: float) -> str | None:
    """The note when, `eta_s` seconds from `now`, the job would end after the
    watchdog's deadline; None when it ends in time, for a kept pod, or while
    the pace is unknown. Followed, the pod stays: it is only a note."""
    if pod.keep or pod.deadline_unix is None or eta_s is None:
        return None
    if now + eta_s <= pod.deadline_unix:
        return None
    return (
        f"at this pace the job needs about {eta_s / 3600:.1f} h more, past max_hours "
        f"({pod.deadline}): the pod stays while this flow follows the job and renews its lease; "
        "if it stops following, the pod's watchdog deletes the pod (raise max_hours, or set "
        "keep_pod, to let the job finish unfollowed)"
    )


def renewal_due(
    renewed_at: float | None, idle_s: float, now: float, timing: PodTiming, stall_s: float
) -> bool:
    """Whether the lease (last renewed at `renewed_at`, wall clock) is renewed
    at `now`: once `timing.renew_every_s` passed, and only while the job made
    progress in the last `stall_s` seconds (`idle_s` since its last progress)."""
    if idle_s >= stall_s:
        return False
    return renewed_at is None or now - renewed_at >= timing.renew_every_s


def guard_fires(pod: PodRecord, renewed_at: float | None, now: float, timing: PodTiming) -> bool:
    """Whether the client's own guard deletes `pod` at `now`: the watchdog's
    deadline plus the margin passed, and no lease renewed within its TTL. Never
    for a kept pod, or one without a deadline."""
    if pod.keep or pod.deadline_unix is None:
        return False
    held = renewed_at is not None and now - renewed_at < timing.lease_ttl_s
    return not held and now >= pod.deadline_unix + timing.deadline_margin_s


@dataclass
class Watched:
    """How a watch on a pod ended: with the watch's outcome or error, or with
    the client's deadline passing first (nothing deleted yet)."""

    outcome: Outcome | None = None
    error: Exception | None = None
    deadline_passed: bool = False
    restart: Restart | None = None
    """The restart of the pod's container that lost the job, when one did."""
    last_step: int | None = None
    """The last step the watch saw the job log."""
    host_lost: str | None = None
    """Why the pod was deleted as a lost host (its SSH silent while Runpod
    showed it running), when it was."""


async def renew_lease(executor: Executor, path: str) -> None:
    """Touches the lease file `path` on the pod (its time is the pod's clock);
    on every pod of a cluster (each watchdog reads its own). Raises ExecError
    when a pod cannot be reached."""
    if isinstance(executor, NodesExecutor):
        await asyncio.gather(
            *(renew_lease(node, executor.on(k, path)) for k, node in enumerate(executor.nodes))
        )
        return
    script = 'mkdir -p "$(dirname "$1")" && touch "$1"'
    result = await executor.run(["sh", "-c", script, "lease", path], timeout=30)
    if result.code != 0:
        raise ExecError("renew the lease", result.stderr.strip()[:200] or f"exit {result.code}")


async def hold_lease(
    ctx: RunContext,
    path: str,
    progress: LeaseReporter,
    pod: PodRecord,
    timing: PodTiming,
    stall_s: float,
) -> None:
    """Renews the lease at `path` while the job progresses; returns once the
    client's guard fires (its deadline passed with no lease held)."""
    renewed: float | None = None
    while True:
        now = time.time()
        idle = time.monotonic() - progress.last_progress
        if renewal_due(renewed, idle, now, timing, stall_s):
            try:
                await renew_lease(ctx.executor, path)
                renewed = now
            except ExecError as error:
                ctx.reporter.warning(f"cannot renew the lease of pod {pod.name}: {error}")
        if guard_fires(pod, renewed, now, timing):
            return
        await asyncio.sleep(timing.tick_s)


async def watch_leased(
    ctx: RunContext,
    trainer: Trainer,
    record: RunRecord,
    pod: PodRecord,
    timing: PodTiming,
    stall_s: float,
    pod_dir: str | None = None,
) -> Watched:
    """Follows the started run `record` with `follow.watch` until its job
    ends, renewing the pod's lease while the job progresses, until the client's
    own guard fires. Never calls the Runpod API: what it found is acted on by
    `settle`. A kept pod, or one without a deadline, needs no lease. The lease
    is in `pod_dir` on a pod made for another job of the pipeline (else in
    the job's own run directory)."""
    progress = LeaseReporter(ctx.reporter, pod)
    leased = dataclasses.replace(ctx, reporter=progress)
    watching = asyncio.create_task(follow.watch(leased, trainer, record))
    tasks: set[asyncio.Task[Any]] = {watching}
    if not pod.keep and pod.deadline_unix is not None:
        path = f"{pod_dir or record.remote_dir}/{LEASE_FILE}"
        tasks.add(asyncio.create_task(hold_lease(leased, path, progress, pod, timing, stall_s)))
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()
        for task in tasks:  # cancelled again while one runs on (a cancel Python 3.11 lost)
            await cancel_and_wait(task)
    if not watching.done() or watching.cancelled():
        return Watched(deadline_passed=True, last_step=progress.last_step)
    error = watching.exception()
    if error is None:
        outcome = watching.result()
        restart = await told_restart(ctx, record, pod, outcome, pod_dir)
        return Watched(outcome=outcome, restart=restart, last_step=progress.last_step)
    if not isinstance(error, Exception):
        raise error
    return Watched(error=error, last_step=progress.last_step)


UNREACHED = "the follower could not reach it"
"""How the follower's SSH lost the job of a cluster whose primary went silent."""
LOOK_AGAIN_S = 5.0  # between two tries of a silent pod's SSH
MAX_WATCHES = 20  # watches of one job whose pod fell silent and answered again


class Silence:
    """The pods this process follows now, and which of them are silent (their
    SSH does not answer): when every one of several went silent at once, the
    fault is this side's network, not their hosts."""

    def __init__(self) -> None:
        self.silent: dict[str, bool] = {}

    @contextlib.contextmanager
    def following(self, pod_id: str) -> Iterator[None]:
        """Counts the pod `pod_id` as followed (answering) for the block."""
        self.silent[pod_id] = False
        try:
            yield
        finally:
            self.silent.pop(pod_id, None)

    def mark(self, pod_id: str, silent: bool) -> None:
        """Notes whether the followed pod `pod_id` answers SSH now."""
        if pod_id in self.silent:
            self.silent[pod_id] = silent

    def all_at_once(self) -> int:
        """How many pods went silent together when every pod followed (two
        or more) is silent; 0 otherwise."""
        count = len(self.silent)
        return count if count >= 2 and all(self.silent.values()) else 0


SILENCE = Silence()
"""The pods this process follows (one event loop follows them all)."""


async def _looked_up(pod_ctx: PodContext, pod: PodRecord) -> Pod | None:
    """The pod as Runpod shows it now, None when it is gone (recorded);
    raises PodError when Runpod cannot be asked."""
    return await look_up_pod(pod_ctx, pod, f"pod {pod.name}")


async def watch_pod(
    ctx: RunContext,
    pod_ctx: PodContext,
    trainer: Trainer,
    record: RunRecord,
    pod: PodRecord,
    pod_dir: str | None = None,
) -> Watched:
    """`watch_leased`, and when the job could not be reached on a pod that
    Runpod still shows: the pod's SSH tried again for the timing's
    `lost_host_s`. Answering again, the job is watched again (its metrics
    read from the start, up to MAX_WATCHES watches). Still silent, its host
    is taken for lost only with two witnesses: Runpod's own view agrees
    (`runpod_agrees`) and not every pod this process follows went silent at
    once (`SILENCE`: this side's network); then the pod is deleted
    (confirmed), `pod.json` says when and at which step (`host_lost`,
    `lost_step`), and the Watched says why. Otherwise the follower says why
    it waits, and watches the job again. On a cluster, a node lost with both
    witnesses (the follower's SSH lost its job, or the job could not be
    reached; Runpod shows its pod gone or not RUNNING while another runs:
    `cluster.lost_node`, `pod.node_lost`) has the whole cluster deleted at
    once (`drop_lost_node`). Raises PodError when that delete is refused (the pod
    may still bill)."""
    timing = pod_ctx.timing
    with SILENCE.following(pod.name):
        watched = await watch_leased(ctx, trainer, record, pod, timing, ctx.stall_s, pod_dir)
        for _ in range(MAX_WATCHES):
            if not isinstance(watched.error, Unreachable) or pod.keep:
                return watched
            if pod.is_cluster and pod.node_lost is None:  # its primary silent: Runpod's view
                await lost_node(pod_ctx, pod, UNREACHED)
            if pod.node_lost is not None:  # a node of its cluster: both witnesses agreed
                return await drop_lost_node(pod_ctx, pod, watched, pod.node_lost)
            SILENCE.mark(pod.name, True)
            try:
                first = await _looked_up(pod_ctx, pod)
            except PodError as error:
                first, waits = None, f"{error}: Runpod cannot witness a lost host"
            else:
                if first is None:
                    return watched  # gone (recorded): `settle` tells why
                ctx.reporter.warning(
                    f"pod {pod.name} does not answer SSH while Runpod shows it: trying it again "
                    f"for {timing.lost_host_s:g} s before its host is taken for lost"
                )
                began = time.monotonic()
                if await answers(ctx.executor, timing.lost_host_s):
                    waits = ""
                else:
                    verdict = await _lost_host(pod_ctx, pod, first, time.monotonic() - began)
                    if verdict.gone:
                        return watched
                    if verdict.lost:
                        return await drop_lost_host(pod_ctx, pod, watched, verdict.why)
                    waits = verdict.why
            if waits:
                ctx.reporter.warning(
                    f"{waits}; pod {pod.name} is not deleted: its job is followed again"
                )
            else:
                SILENCE.mark(pod.name, False)
                ctx.reporter.warning(f"pod {pod.name} answers SSH again: its job is followed again")
            watched = await watch_leased(ctx, trainer, record, pod, timing, ctx.stall_s, pod_dir)
        return watched


@dataclass(frozen=True)
class HostVerdict:
    """Whether a pod whose SSH stayed silent is taken for a lost host, and why
    (Runpod's view that agrees, or why the follower waits); `gone`: the pod
    is gone meanwhile (recorded)."""

    lost: bool
    why: str
    gone: bool = False


async def _lost_host(
    pod_ctx: PodContext, pod: PodRecord, first: Pod, elapsed_s: float
) -> HostVerdict:
    """The two witnesses of a lost host for a pod whose SSH stayed silent
    `elapsed_s` seconds since Runpod showed it as `first`: not every pod this
    process follows went silent at once, and Runpod's view agrees."""
    together = SILENCE.all_at_once()
    if together:
        why = f"every pod this process follows ({together}) went silent at once: this side's "
        return HostVerdict(False, why + "network, not their hosts")
    try:
        last = await _looked_up(pod_ctx, pod)
    except PodError as error:
        return HostVerdict(False, f"{error}: Runpod cannot witness a lost host")
    if last is None:
        return HostVerdict(False, "gone", gone=True)
    agrees = runpod_agrees(first, last, elapsed_s)
    if agrees is None:
        return HostVerdict(
            False,
            f"pod {pod.name} does not answer SSH, but Runpod shows its container running on "
            f"(uptime {last.uptime_s or 0:.0f} s): this side's network, not its host",
        )
    return HostVerdict(True, agrees)


async def answers(executor: Executor, within_s: float) -> bool:
    """Whether the host of `executor` runs a command over SSH within
    `within_s` seconds, tried every LOOK_AGAIN_S. Never raises."""
    end = time.monotonic() + within_s
    while (left := end - time.monotonic()) > 0:
        try:
            async with asyncio.timeout(left):
                await executor.run(["true"], timeout=max(1.0, min(left, 30.0)))
            return True
        except (ExecError, TimeoutError):
            pass
        await asyncio.sleep(min(LOOK_AGAIN_S, max(0.0, end - time.monotonic())))
    return False


async def drop_lost_host(
    ctx: PodContext, pod: PodRecord, watched: Watched, runpod: str | None = None
) -> Watched:
    """Deletes the pod of a lost host (confirmed), then records when and the
    last step its job logged; returns `watched` with why (`runpod`: what of
    Runpod's view agreed). Raises PodError when the delete is refused
    (nothing recorded lost: it may still bill)."""
    step = f", its job lost at step {watched.last_step}" if watched.last_step is not None else ""
    agreed = f"; {runpod}" if runpod else ""
    reason = (
        f"the host of pod {pod.name} stopped answering SSH while Runpod showed the pod "
        f"(silent {ctx.timing.lost_host_s:g} s more after the follower's tries{agreed}){step}: "
        "a lost host"
    )
    await remove(ctx, pod, reason)
    pod.host_lost = rfc3339()
    pod.lost_step = watched.last_step
    pod.save(ctx.runs)
    return dataclasses.replace(watched, host_lost=reason)


async def drop_lost_node(ctx: PodContext, pod: PodRecord, watched: Watched, lost: str) -> Watched:
    """Deletes the whole cluster of a node lost (`lost`: why, both witnesses;
    its job already ended on every node), confirmed for each of its pods,
    then records when and the last step its job logged; returns `watched`
    with why. Raises PodError when the delete is refused (nothing recorded
    lost: it may still bill)."""
    step = f", its job lost at step {watched.last_step}" if watched.last_step is not None else ""
    reason = f"{lost}{step}: the job was ended on every node and the cluster deleted"
    await remove(ctx, pod, reason)
    pod.host_lost = rfc3339()
    pod.lost_step = watched.last_step
    pod.save(ctx.runs)
    return dataclasses.replace(watched, host_lost=reason)


async def settle(ctx: PodContext, pod: PodRecord, run_id: str, watched: Watched) -> Outcome:
    """Acts on what `watch_leased` found for the run `run_id`: past the client's
    deadline, deletes the pod (confirmed); after a watch that lost the pod,
    finds why (max_hours or max_cost_usd when one passed: its watchdog
    deleted it).

    Raises PodGone in both cases, `kept` the reason the run fails with; the
    watch's own error otherwise (the job may keep running: attach again);
    PodError when the pod cannot be deleted.
    """
    if watched.deadline_passed:
        await remove(ctx, pod, "max_hours reached: the client's guard")
        raise PodGone(f"run {run_id} failed: {MAX_HOURS_REACHED}", kept=MAX_HOURS_REACHED)
    if watched.host_lost is not None:
        raise PodGone(f"run {run_id} failed: {watched.host_lost}", kept=watched.host_lost)
    if watched.error is not None:
        error = watched.error
        if isinstance(error, Unreachable) and await is_gone(ctx, pod):
            reason = pod.delete_reason or pod.limit_reached() or f"pod {pod.name} is gone"
            raise PodGone(f"run {run_id} failed: {reason}", kept=reason) from None
        raise error
    assert watched.outcome is not None
    if watched.restart is not None:
        last = watched.outcome.summary.last
        pod.restarted = watched.restart.at
        pod.lost_step = last.step if last is not None else None
        pod.save(ctx.runs)
    return watched.outcome


WATCHDOG_TAIL = 400  # lines of the watchdog's log read for a restart that lost a job


async def told_restart(
    ctx: RunContext, record: RunRecord, pod: PodRecord, outcome: Outcome, pod_dir: str | None
) -> Restart | None:
    """For a job that failed: the restart of its pod's container that lost
    it, as the pod's watchdog logged it (its log in `pod_dir`, or in the
    job's run directory); the run record's message then says so (when, at
    which step) instead of a job that stopped without an exit code. None
    when no restart lost it, or the log cannot be read (the message stays)."""
    if outcome.record.state != RunState.FAILED:
        return None
    path = f"{pod_dir or record.remote_dir}/{WATCHDOG_LOG}"
    script = 'tail -n "$2" "$1" 2>/dev/null'
    try:
        result = await ctx.executor.run(
            ["sh", "-c", script, "watchdog", path, str(WATCHDOG_TAIL)], timeout=30
        )
    except ExecError:
        return None
    restart = lost_to_restart(result.stdout.splitlines(), record.remote_dir, pod_dir is None)
    if restart is None:
        return None
    last = outcome.summary.last
    again = "the train flow" if record.trainer == "training" else f"the {record.trainer} flow"
    try:
        saved = ctx.runs.load(record.id)
        if saved.state == RunState.FAILED:
            saved.message = restart_lost_message(
                pod.name,
                restart,
                subject(saved),
                last.step if last is not None else None,
                outcome.retrieved,
                again,
            )
            ctx.runs.save(saved)
            outcome.record = saved
    except (RecordError, RunsError) as error:
        ctx.reporter.warning(f"cannot record that pod {pod.name} restarted: {error}")
    return restart
