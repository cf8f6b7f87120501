"""The prepare step of a nightly fine-tune (what prefect-shell adds to
`nightly/prepared.py`): a saved prefect-shell `ShellOperation` block (the
user's export script: a SQL dump, a dbt run, a `curl`), run on the worker
before anything else, its output streamed to the flow run's log line by line.
What it says it wrote (`OVERBRAINER_DATASET=` and `OVERBRAINER_EVAL=` lines)
becomes the night's data.

Create the block once, in Python or in the UI under Blocks, Shell Operation:

    from prefect_shell import ShellOperation
    ShellOperation(
        commands=["python export.py --out /data/nightly.jsonl",
                  "echo OVERBRAINER_DATASET=/data/nightly.jsonl"],
        working_dir="/srv/exports",
    ).save("nightly-export")
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from pathlib import Path
from typing import Protocol, cast

from prefect.blocks.core import Block
from prefect.client.orchestration import get_client
from prefect_shell import ShellOperation

from overbrainer_prefect.nightly.prepared import PREPARE_TIMEOUT_S, PrepareError, last_lines

KILL_GRACE_S = 5.0  # after SIGTERM, how long the step's processes have before SIGKILL
MERGING_SHELLS = frozenset({"bash", "sh", "zsh", "dash", "ksh"})
"""Shells in which `exec 2>&1` sends the step's stderr to its output, so a
failure's last lines hold its error."""


async def load_prepare(name: str) -> ShellOperation:
    """The saved `ShellOperation` block `name` (a bare name, or
    `shell-operation/<name>`).

    Raises PrepareError with one line when there is no such block, or the
    block of that name is of another type.
    """
    try:
        block = await (Block.aload(name) if "/" in name else ShellOperation.aload(name))
    except (ValueError, KeyError):
        other = await _other_type(name)
        if other is not None:
            raise PrepareError(
                f"block {name!r} is of type {other}, not a Shell Operation: name a prefect-shell "
                "ShellOperation block (see the README's nightly section)"
            ) from None
        raise PrepareError(
            f"no Shell Operation block named {name!r}: create it with "
            f"ShellOperation(commands=[...]).save({name!r}) or in the UI under Blocks "
            "(see the README's nightly section)"
        ) from None
    if not isinstance(block, ShellOperation):
        raise PrepareError(
            f"block {name!r} is of type {block.get_block_type_slug()}, not a Shell Operation: "
            "name a prefect-shell ShellOperation block"
        )
    return block


async def run_prepare(
    block: ShellOperation, name: str, timeout_s: float = PREPARE_TIMEOUT_S
) -> tuple[list[str], Path]:
    """Runs the prepare block `block` (named `name`) on this worker, its output
    (stderr too, under bash and sh) streamed to the flow run's log line by line;
    stopped (its whole process group) past `timeout_s`. Returns its output lines
    and its working directory.

    Raises PrepareError with one line ending with its last output lines when it
    fails or runs past `timeout_s`.
    """
    shell = (block.shell or "bash").rsplit("/", 1)[-1].lower()
    if shell in MERGING_SHELLS and block.extension in (None, ".sh"):
        block = block.model_copy(update={"commands": ["exec 2>&1", *block.commands]})
    lines, code, timed_out = await asyncio.to_thread(_run, block, timeout_s)
    if timed_out:
        raise PrepareError(
            f"prepare block {name!r} ran past {timeout_s:g} s and was stopped: nothing trained; "
            f"its last output lines: {last_lines(lines)}"
        )
    if code != 0:
        raise PrepareError(
            f"prepare block {name!r} failed with exit code {code}: nothing trained; its last "
            f"output lines: {last_lines(lines)}"
        )
    return lines, Path(block.working_dir) if block.working_dir else Path.cwd()


def _run(block: ShellOperation, timeout_s: float) -> tuple[list[str], int | None, bool]:
    """(output lines, exit code, whether it was stopped for time): the block run
    with prefect-shell's line-reading sync path, in this thread."""
    shell = cast(_SyncShell, block)  # prefect-shell's sync/async dispatch takes `_sync`
    process = shell.trigger(_sync=True)
    stopped = threading.Event()

    def stop() -> None:
        stopped.set()
        _signal_group(process.pid, signal.SIGTERM)  # its own session: the whole group
        deadline = time.monotonic() + KILL_GRACE_S
        while process.return_code is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if process.return_code is None:
            _signal_group(process.pid, signal.SIGKILL)

    timer = threading.Timer(timeout_s, stop)
    timer.daemon = True
    timer.start()
    try:
        with contextlib.suppress(RuntimeError):  # a non-zero exit: its code is read below
            process.wait_for_completion(_sync=True)
    finally:
        timer.cancel()
        shell.close(_sync=True)
    return process.fetch_result(_sync=True), process.return_code, stopped.is_set()


class _SyncProcess(Protocol):
    """What `_run` uses of prefect-shell's `ShellProcess`, called with `_sync=True`."""

    @property
    def pid(self) -> int: ...
    @property
    def return_code(self) -> int | None: ...
    def wait_for_completion(self, *, _sync: bool) -> None: ...
    def fetch_result(self, *, _sync: bool) -> list[str]: ...


class _SyncShell(Protocol):
    """What `_run` uses of a `ShellOperation`, called with `_sync=True`."""

    def trigger(self, *, _sync: bool) -> _SyncProcess: ...
    def close(self, *, _sync: bool) -> None: ...


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)


async def _other_type(name: str) -> str | None:
    """The block type of a saved block named `name`, when one exists."""
    bare = name.rsplit("/", 1)[-1]
    async with get_client() as client:
        found = await client.read_block_documents(include_secrets=False)
    for document in found:
        if document.name != bare or document.block_type is None:
            continue
        if document.block_type.slug != "shell-operation":
            return document.block_type.slug
    return None
