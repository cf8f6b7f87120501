"""Provisioning the pod of a new run, up to the moment its job may start.

In order, each step recorded in `pod.json` before it is taken:

1. the run's keys: a client key on disk (0600), a host key in memory;
2. `pod.json` saved (`creating`), then the host key's private half put in a
   Runpod account secret, which the pod reads through its environment;
3. the pod created on the first GPU type of the launch plan with capacity,
   each attempt recorded before it is sent (after an ambiguous answer the
   client finds the pod by its unique name); a pod billing above
   `max_price_per_hour` is refused;
4. readiness, within `boot_grace`: the pod's SSH endpoint, sshd's banner,
   then a connection that checks the pinned host key;
5. the run directory claimed: the bootstrap wrote `run=<id> pod=<pod id>`
   in it (network volumes are shared between pods);
6. the cost cap armed: the pod's rate and `max_cost_usd` written for the
   watchdog, which confirms them (and that it can reach the API) in its log.

Whatever fails, every pod of the run is deleted (confirmed), the run is saved
failed with the reason, and the error is raised: nothing bills that nothing
bounds.
"""

from __future__ import annotations

import asyncio
import posixpath
import shlex
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Protocol

from overbrainer_prefect import executors  # its SshExecutor (asyncssh) imported on first use
from overbrainer_prefect.executors.base import ExecError, TargetUnreachable
from overbrainer_prefect.runpod.boot import BootWatch
from overbrainer_prefect.runpod.bootstrap import (
    CAP_FILE,
    OWNER_FILE,
    POD_WORKSPACE,
    START_COMMAND,
    WATCHDOG_LOG,
    WORKDIR_NAME,
    Armed,
    cap_text,
    disk_per_hour,
    parse_armed,
    pod_env,
)
from overbrainer_prefect.runpod.errors import NoCapacity, PodError, RunpodError
from overbrainer_prefect.runpod.gpus import GpuChoice, LaunchPlan, create_with_fallback, overpriced
from overbrainer_prefect.runpod.models import PodRequest, secret_ref
from overbrainer_prefect.runpod.pod import PodRecord, PodState, SshAddress
from overbrainer_prefect.runpod.settings import RunpodTargetSettings
from overbrainer_prefect.runs.store import RunRecord
from overbrainer_prefect.targets.runpod.context import INTERRUPTED, PodContext, run_message
from overbrainer_prefect.targets.runpod.ending import fetch_watchdog_log, release, remove_hint
from overbrainer_prefect.targets.runpod.keys import (
    PodKeys,
    client_key_path,
    generate,
    host_key_secret,
    write_ssh_config,
)
from overbrainer_prefect.targets.runpod.names import pod_name
from overbrainer_prefect.targets.runpod.reaper import start_reaper
from overbrainer_prefect.timestamps import rfc3339

if TYPE_CHECKING:
    from overbrainer_prefect.executors.ssh import SshExecutor  # asyncssh: where SSH is used

BANNER_TIMEOUT_S = 5.0  # seconds to read sshd's banner on a starting pod
BANNER_POLL_S = 0.5  # between two knocks on a pod's sshd once Runpod shows its endpoint (billed)
ARM_POLL_S = 0.25  # between two reads of the watchdog's log for its cost cap (it looks every 0.2 s)
CONNECT_TIMEOUT_S = 15.0  # seconds to open the first SSH connection to a pod
DEFAULT_WORKDIR = f"{POD_WORKSPACE}/{WORKDIR_NAME}"
"""Where the run directories are on a real pod."""


@dataclass
class Provisioned:
    """A ready pod: its record, an executor reaching it (pinned host key) and
    the run directory on it. For an instant cluster: its primary's, and
    every node's executor by rank with the primary's private address."""

    pod: PodRecord
    executor: SshExecutor
    remote_dir: str
    nodes: list[SshExecutor] = field(default_factory=list)
    """An instant cluster's pods, by rank (rank 0's is `executor`)."""
    master_addr: str | None = None
    """An instant cluster's primary's address on its private network."""


class ProvisionSteps(Protocol):
    """What makes and readies the pod (or cluster) of a run whose record and
    keys exist (`provision` wraps it: whatever it raises ends every pod)."""

    async def __call__(
        self,
        ctx: PodContext,
        run: RunRecord,
        pod: PodRecord,
        keys: PodKeys,
        settings: RunpodTargetSettings,
        plan: LaunchPlan,
        *,
        api_url: str,
        name: str,
    ) -> Provisioned: ...


async def provision(
    ctx: PodContext,
    run: RunRecord,
    plan: LaunchPlan,
    *,
    api_url: str,
    name: str,
    steps: ProvisionSteps | None = None,
) -> Provisioned:
    """Creates the pod of the new run `run` on the GPU types of `plan` and
    waits until it is ready, reachable and capped (see the module). `api_url`
    is the API the pod's watchdog deletes it through; `name` names the target
    in messages. The run directory on the pod is `Provisioned.remote_dir`:
    the run's record is not changed here. `steps` make something else than
    one pod (an instant cluster: `targets.runpod.cluster`).

    Raises PodError (NoCapacity, RunpodError as their one line; `kept` what
    the run's record keeps) with every pod of the run deleted; on
    cancellation, every pod deleted, and the cancellation goes on.
    """
    settings = plan.settings
    try:
        keys = generate(ctx.runs, run.id)
        pod = PodRecord(
            run_id=run.id,
            keep=settings.keep_pod,
            gpu_count=settings.gpu_count,
            host_key=keys.host_public,
            host_key_secret=host_key_secret(run.id),
            max_cost_usd=settings.max_cost_usd,
            boot_grace_s=settings.boot_grace_s,
            retrieve_grace_s=settings.retrieve_grace_s,
            cluster_pods=plan.pods if plan.pods > 1 else 0,
        )
        pod.save(ctx.runs)
        start_reaper(ctx.runs, run.id, ctx.client)  # bounds the pod until its watchdog runs
    except Exception as error:  # nothing was asked of Runpod yet
        why = f"cannot prepare the keys and pod record of the run: {error}"
        raise PodError(f"run {run.id} failed before its job started: {why}", kept=why) from None
    make = steps or _provision
    try:
        return await make(ctx, run, pod, keys, settings, plan, api_url=api_url, name=name)
    except asyncio.CancelledError:
        await asyncio.shield(_abandon(ctx, run, pod, INTERRUPTED))
        raise
    except KeyboardInterrupt:
        await asyncio.shield(_abandon(ctx, run, pod, INTERRUPTED))
        raise
    except Exception as error:
        message = run_message(error)
        await asyncio.shield(_abandon(ctx, run, pod, message))
        raise PodError(
            f"run {run.id} failed before its job started: {message}", kept=message
        ) from None


async def _abandon(ctx: PodContext, run: RunRecord, pod: PodRecord, message: str) -> None:
    """Deletes every pod of a run that will not start its job (the caller
    fails the run with `message`)."""
    await release(ctx, pod, message)
    if not pod.gone:
        ctx.log.warning(
            "a pod of run %s may be left (see runs/%s/pod.json): %s",
            run.id,
            run.id,
            remove_hint(run.id),
        )


async def store_host_key(ctx: PodContext, pod: PodRecord, keys: PodKeys, whose: str) -> str:
    """Puts the SSH host key of `whose` (a pod, a cluster) into the account's
    secret the pod record names, for the pods' sshd, and returns the secret's
    name. Raises RunpodError when Runpod refuses it."""
    assert pod.host_key_secret is not None
    await ctx.client.create_secret(
        pod.host_key_secret, keys.host_private_b64, description=f"SSH host key of {whose}"
    )
    return pod.host_key_secret


async def _provision(
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
    host_secret = await store_host_key(ctx, pod, keys, f"the pod of overbrainer run {run.id}")
    sent_at = [time.monotonic()]  # when the last create request was sent: boot_grace counts from it

    def request(choice: GpuChoice) -> PodRequest:
        env = pod_env(
            run_id=run.id,
            api_url=api_url,
            authorized_key=keys.client_public,
            host_key_ref=secret_ref(host_secret),
            created_at=int(time.time()),
            settings=settings,
            timing=ctx.timing,
        )
        return PodRequest(
            name=pod_name(run.id, len(pod.attempts) + 1),
            image=settings.image,
            gpu_type_id=choice.id,
            gpu_count=settings.gpu_count,
            cloud=settings.api_cloud,
            container_disk_gb=settings.disk_gb,
            env=env,
            ports=["22/tcp"],
            data_center_ids=list(settings.data_center_ids),
            network_volume_id=settings.network_volume_id,
            args=shlex.join(START_COMMAND),
        )

    def before_attempt(choice: GpuChoice, sent: PodRequest) -> None:
        if pod.attempts and pod.attempts[-1].result == "sent":
            pod.end_attempt("refused (no capacity or no access)")
        pod.begin_attempt(sent.name, choice.id)
        pod.save(ctx.runs)
        sent_at[0] = time.monotonic()

    try:
        placed = await create_with_fallback(
            ctx.client, plan, request, before_attempt=before_attempt
        )
    except NoCapacity:
        pod.end_attempt("no capacity")
        pod.save(ctx.runs)
        raise
    except RunpodError as error:
        pod.end_attempt(error.run_message)
        if error.status is None or error.status >= 500:
            pod.strays.append(pod.attempts[-1].name)  # Runpod may have created it
        pod.save(ctx.runs)
        raise
    remote = placed.pod
    pod.end_attempt("created", remote.id)
    pod.pod_id = remote.id
    pod.pod_name = remote.name or pod.attempts[-1].name
    pod.gpu_type_id = remote.gpu_type_id or placed.choice.id
    # what Runpod shows it bills for (`gpu.count`); an answer without its GPUs: what was asked
    pod.billed_gpus = remote.gpu_count if remote.gpu_type_id else settings.gpu_count
    pod.cost_per_hour = remote.cost_per_hr if remote.cost_per_hr else placed.choice.price_per_hour
    pod.disk_per_hour = disk_per_hour(settings.disk_gb)
    pod.strays = [s for s in pod.strays if s != pod.attempts[-1].name]
    pod.state = PodState.BOOTING
    pod.save(ctx.runs)
    ctx.log.info(
        "pod %s created for run %s: %s at $%.2f/h%s",
        remote.id,
        run.id,
        placed.choice.label(),
        pod.cost_per_hour,
        f" (refused first: {', '.join(placed.refused)})" if placed.refused else "",
    )
    problem = overpriced(remote, settings, placed.choice.price_per_hour)
    if problem:
        raise PodError(problem)

    executor = await wait_ready(
        ctx, pod, settings.boot_grace_s - (time.monotonic() - sent_at[0]), name, settings.image
    )
    workdir = await pod_workdir(executor)
    if workdir != executor.workdir:
        await executor.close()
        executor = pod_executor(ctx, pod, workdir, f"{name}: pod {pod.name}")
    pod.workdir = workdir
    run = run.model_copy(update={"remote_dir": posixpath.join(workdir, run.id)})
    assert pod.ssh is not None
    write_ssh_config(ctx.runs, run.id, pod.ssh.host, pod.ssh.port, pod.ssh.user, pod.host_key)
    pod.save(ctx.runs)
    try:
        await check_claim(executor, run.remote_dir, run.id, remote.id)
        armed = await arm_cost_cap(ctx, executor, pod, run, settings)
    except BaseException:
        await fetch_watchdog_log(ctx.runs, executor, run)
        await executor.close()
        raise
    pod.deadline_unix = armed.deadline_unix
    pod.deadline = rfc3339(_utc(armed.deadline_unix)) if armed.deadline_unix is not None else None
    pod.cost_deadline_unix = armed.cost_deadline_unix
    pod.state = PodState.READY
    pod.save(ctx.runs)
    ctx.log.info("pod %s is ready; its watchdog: %s", remote.id, armed.line)
    return Provisioned(pod=pod, executor=executor, remote_dir=run.remote_dir)


def pod_executor(ctx: PodContext, pod: PodRecord, workdir: str, name: str) -> SshExecutor:
    """An executor reaching the pod at its SSH address in `pod.json` (which
    must be set) with the run's client key and the pod's pinned host key, in
    `workdir`; `name` names it in messages. It connects on its first command.

    Raises ExecError when `workdir` is not absolute, no host key is pinned or
    the client key cannot be read.
    """
    assert pod.ssh is not None
    return executors.SshExecutor(
        pod.ssh.host,
        port=pod.ssh.port,
        user=pod.ssh.user,
        key_path=client_key_path(ctx.runs, pod.run_id),
        known_host_key=pod.host_key,
        workdir=workdir,
        name=name,
        connect_timeout=CONNECT_TIMEOUT_S,
    )


async def wait_ready(
    ctx: PodContext, pod: PodRecord, within_s: float, name: str, image: str = "(its image)"
) -> SshExecutor:
    """Waits until the pod shows an SSH endpoint, its sshd answers with its
    banner, and a connection succeeds with the run's key against the pinned
    host key; returns an executor over that connection.

    Raises PodError when that does not happen within `within_s` seconds (the
    boot grace left), at once when its start command cannot run (its
    container restarted or stopped while starting, or its log says so once
    SSH is late: see `boot`; the message then ends with the last lines of
    its log), or when it shows another host
    key than the one generated for it (nothing is sent then).
    """
    assert pod.pod_id is not None
    deadline = time.monotonic() + max(0.0, within_s)
    why = "Runpod shows no SSH endpoint for it yet"
    boot = BootWatch(pod.pod_id, image, ctx.timing.ssh_late_s)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise PodError(
                f"pod {pod.pod_id} did not answer SSH within boot_grace ({why}); it is deleted"
            )
        try:
            remote = await ctx.client.get_pod(pod.pod_id)
        except RunpodError as error:
            remote, why = None, f"looking it up: {error.run_message}"
        if remote is not None:
            failure = await boot.look(ctx.client, remote)
            if failure is not None:
                raise PodError(failure)
            if remote.ssh is None:
                why = f"Runpod shows no SSH endpoint for it yet ({remote.status})"
            elif not await knock(
                remote.ssh.host,
                remote.ssh.port,
                min(ctx.timing.ready_poll_s, left),
                min(BANNER_TIMEOUT_S, left),
            ):
                why = f"nothing answers SSH at {remote.ssh.host}:{remote.ssh.port} yet"
                continue  # it knocked for a whole poll: look at the pod again at once
            else:
                pod.ssh = SshAddress(
                    host=remote.ssh.host, port=remote.ssh.port, user=remote.ssh.username
                )
                executor = pod_executor(ctx, pod, DEFAULT_WORKDIR, f"{name}: pod {pod.name}")
                try:
                    await executor.run(["true"], timeout=max(5.0, min(30.0, left)))
                    return executor
                except TargetUnreachable as error:
                    why = str(error)
                    await executor.close()
                except ExecError as error:
                    await executor.close()
                    raise PodError(f"pod {pod.pod_id}: {error}; it is deleted") from None
        await asyncio.sleep(max(0.05, min(ctx.timing.ready_poll_s, deadline - time.monotonic())))


async def knock(host: str, port: int, span_s: float, timeout: float) -> bool:
    """Whether an SSH server at `host:port` answers with its banner (each
    knock waiting up to `timeout` seconds for it) within about `span_s`
    seconds, knocking every `BANNER_POLL_S`: a pod bills while its sshd
    starts, so it is used as soon as it answers."""
    until = time.monotonic() + span_s
    while True:
        if await ssh_banner(host, port, timeout):
            return True
        rest = until - time.monotonic()
        if rest <= 0:
            return False
        await asyncio.sleep(min(BANNER_POLL_S, rest))


async def ssh_banner(host: str, port: int, timeout: float) -> bool:
    """Whether an SSH server at `host:port` answers with its `SSH-` banner
    within `timeout` seconds."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (OSError, TimeoutError):
        return False
    try:
        head = await asyncio.wait_for(reader.readexactly(4), timeout)
        return head == b"SSH-"
    except (OSError, TimeoutError, asyncio.IncompleteReadError):
        return False
    finally:
        writer.close()


async def pod_workdir(executor: SshExecutor) -> str:
    """The run directories' directory on the pod: `<its workspace>/overbrainer`
    (the bootstrap tells SSH sessions its workspace)."""
    script = f'printf %s "${{OVERBRAINER_WORKSPACE:-{POD_WORKSPACE}}}"'
    result = await executor.run(["sh", "-c", script], timeout=30)
    workspace = result.stdout.strip() or POD_WORKSPACE
    if not posixpath.isabs(workspace):
        workspace = POD_WORKSPACE
    return posixpath.join(posixpath.normpath(workspace), WORKDIR_NAME)


async def check_claim(executor: SshExecutor, remote_dir: str, run_id: str, pod_id: str) -> None:
    """Checks that the pod's bootstrap claimed the run directory for this run
    and this pod. Raises PodError when another run or pod owns it (a shared
    network volume), or the claim cannot be read."""
    expected = f"run={run_id} pod={pod_id}"
    try:
        found = (
            (await executor.read_from(f"{remote_dir}/{OWNER_FILE}", 0, 4096))
            .decode(errors="replace")
            .strip()
        )
    except ExecError as error:
        raise PodError(
            f"cannot read the claim of the run directory {remote_dir}: {error}"
        ) from None
    if found != expected:
        shown = found.splitlines()[0][:120] if found else "nobody"
        raise PodError(
            f"the run directory {remote_dir} on pod {pod_id} is claimed by {shown}, not by this "
            "run's pod: its pod is deleted, and nothing was copied"
        )


async def arm_cost_cap(
    ctx: PodContext,
    executor: SshExecutor,
    pod: PodRecord,
    run: RunRecord,
    settings: RunpodTargetSettings,
) -> Armed:
    """Writes the pod's rate and `max_cost_usd` for its watchdog, and waits
    until the watchdog confirms them in its log (which also says it can reach
    the API, so the pod can delete itself). Returns the watchdog's deadlines.

    Raises PodError when the watchdog refuses, or says nothing within the
    timing's `arm_timeout_s` (at least three of its looks): a pod that cannot
    be capped must not run a job.
    """
    rate = (pod.cost_per_hour or 0.0) + pod.disk_per_hour  # everything the pod bills
    cap = f"{run.remote_dir}/{CAP_FILE}"
    text = cap_text(rate, settings.max_cost_usd)
    script = (
        f"mkdir -p {shlex.quote(posixpath.dirname(cap))} && "
        f"printf %s {shlex.quote(text)} > {shlex.quote(cap)}.tmp && "
        f"mv -f {shlex.quote(cap)}.tmp {shlex.quote(cap)}"
    )
    result = await executor.run(["sh", "-c", script], timeout=30)
    if result.code != 0:
        raise PodError(
            f"cannot write the cost cap on pod {pod.name}: {result.stderr.strip()[:200]}"
        )
    timeout = max(ctx.timing.arm_timeout_s, 3 * ctx.timing.watch_interval_s)
    deadline = time.monotonic() + timeout
    log_path = f"{run.remote_dir}/{WATCHDOG_LOG}"
    while True:
        text_read = (await executor.read_from(log_path, 0, 1 << 20)).decode(errors="replace")
        armed = parse_armed(text_read)
        if isinstance(armed, Armed):
            return armed
        if isinstance(armed, str):
            raise PodError(
                f"the watchdog of pod {pod.name} cannot arm the cost cap ({armed}): a pod that "
                "cannot delete itself runs no job; it is deleted"
            )
        if time.monotonic() > deadline:
            raise PodError(
                f"the watchdog of pod {pod.name} did not confirm its cost cap within "
                f"{timeout:g} s (see runs/{run.id}/{WATCHDOG_LOG}): it is deleted"
            )
        await asyncio.sleep(min(ARM_POLL_S, ctx.timing.watch_interval_s / 2))


def _utc(unix: int) -> datetime:
    return datetime.fromtimestamp(unix, UTC)
