"""Reaching a run's pod again, from `run.json` and `pod.json` alone: for the
attach, stop and cancel flows and the cancellation hook, in another process,
on another day."""

from __future__ import annotations

from typing import TYPE_CHECKING

from overbrainer_prefect.executors.base import ExecError
from overbrainer_prefect.runpod.bootstrap import ALIVE_FILE
from overbrainer_prefect.runpod.errors import PodError
from overbrainer_prefect.runpod.pod import PodRecord, SshAddress
from overbrainer_prefect.runs.store import RunRecord
from overbrainer_prefect.targets.runpod.context import PodContext
from overbrainer_prefect.targets.runpod.ending import look_up_pod, remove_hint
from overbrainer_prefect.targets.runpod.keys import client_key_path, write_ssh_config
from overbrainer_prefect.targets.runpod.provision import pod_executor

if TYPE_CHECKING:
    from overbrainer_prefect.executors.ssh import SshExecutor  # asyncssh: where SSH is used


async def reconnect(
    ctx: PodContext, pod: PodRecord, record: RunRecord, name: str
) -> SshExecutor | None:
    """An executor reaching the pod of the run `record` again (the pod is
    looked up first: its public port may have changed), or None when the pod
    no longer exists (confirmed by repeated looks, never by a delete), which
    `pod.json` then records. `name` names the target in messages.

    Raises PodError when the pod is stopped, has no SSH endpoint, the run's
    client key is gone, Runpod cannot be asked, or the pod cannot be reached.
    """
    named = f"pod {pod.pod_id} of run {pod.run_id}"
    remote = await look_up_pod(ctx, pod, named, unfollowed=record.job is not None)
    if remote is None:
        return None
    if remote.status == "EXITED":
        raise PodError(
            f"pod {pod.pod_id} of run {pod.run_id} is stopped (EXITED): start it again in the "
            f"Runpod console to reach its files, or {remove_hint(pod.run_id)}"
        )
    if remote.ssh is None:
        raise PodError(
            f"pod {pod.pod_id} of run {pod.run_id} has no SSH endpoint right now "
            f"({remote.status}): try again in a minute"
        )
    key = client_key_path(ctx.runs, pod.run_id)
    if not key.is_file():
        raise PodError(
            f"the client key of run {pod.run_id} ({key}) is gone, so its pod {pod.pod_id} cannot "
            f"be reached; {remove_hint(pod.run_id)}"
        )
    pod.ssh = SshAddress(host=remote.ssh.host, port=remote.ssh.port, user=remote.ssh.username)
    workdir = pod.workdir or record.remote_dir.rsplit("/", 1)[0]
    executor = pod_executor(ctx, pod, workdir, f"{name}: pod {pod.pod_id}")
    try:
        await executor.run(["true"], timeout=30)
    except ExecError as error:
        await executor.close()
        raise PodError(f"cannot reach pod {pod.pod_id} of run {pod.run_id}: {error}") from None
    write_ssh_config(
        ctx.runs, pod.run_id, remote.ssh.host, remote.ssh.port, remote.ssh.username, pod.host_key
    )
    pod.save(ctx.runs)
    await _check_watchdog(ctx, pod, record, executor)
    return executor


async def _check_watchdog(
    ctx: PodContext, pod: PodRecord, record: RunRecord, executor: SshExecutor
) -> None:
    """Warns when the pod's watchdog has not looked for a while: then nothing
    but this flow bounds the pod."""
    script = 'date -r "$1" +%s 2>/dev/null || stat -c %Y "$1" 2>/dev/null; date +%s'
    path = f"{record.remote_dir}/{ALIVE_FILE}"
    try:
        result = await executor.run(["sh", "-c", script, "alive", path], timeout=30)
    except ExecError:
        return
    numbers = [int(word) for word in result.stdout.split() if word.isdigit()]
    if len(numbers) != 2:
        ctx.log.warning("the watchdog of pod %s has left no trace: is it running?", pod.name)
        return
    seen, now = numbers
    quiet = now - seen
    if quiet > max(120.0, 4 * ctx.timing.watch_interval_s):
        ctx.log.warning(
            "the watchdog of pod %s has not looked for %d s: nothing but this flow may bound "
            "the pod; %s if in doubt",
            pod.name,
            quiet,
            remove_hint(pod.run_id),
        )
