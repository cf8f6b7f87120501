"""One place for the jobs of a pipeline: a fine-tune's training, export, base
model's export, compare and evaluation run one after another on what its
target placed for the first of them (a pod), instead of a place each.

The pipeline enters `shared` once, around its jobs; a target that places a
machine per job (a pod) keeps what it placed in the sharing (`held`, by its
target's name) and places every later job there; when the block ends, each
held place is closed by how the pipeline ended (a pod deleted once the last
job's files are verified, or when the pipeline failed). A target that owns its
machine (this machine, an SSH box) holds nothing: sharing is a no-op there.

The sharing is found through a context variable, so the pipeline's subflows
(in the same process) see it without a parameter; a job run alone sees none
and keeps a place of its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Protocol

from overbrainer_prefect.runs.store import Runs
from overbrainer_prefect.sizing import DiskJob
from overbrainer_prefect.targets.base import JobNeed
from overbrainer_prefect.trainers.export import ExportSpec
from overbrainer_prefect.trainers.spec import TrainingSpec


class Held(Protocol):
    """What a target keeps for the jobs of a pipeline (a pod)."""

    async def close(self, error: BaseException | None) -> None:
        """Ends what is held once the pipeline ended: with `error` None, after
        its last job's files were verified; else because it failed or was
        cancelled. Never raises: a failure is logged with what may be left."""
        ...


@dataclass
class Sharing:
    """The jobs of one pipeline, sharing their places."""

    later: Sequence[JobNeed] = ()
    """What the pipeline's later jobs need: the first place is sized for the largest."""
    anchor: tuple[Runs, str] | None = None
    """The record a continued pipeline's place may still live with (its run)."""
    held: dict[str, Held] = field(default_factory=dict)
    """What each target (by its name) holds for the pipeline's next jobs."""
    handed_over: bool = False
    """Set when another process takes over what is held (the pipeline's flow
    run waits suspended while its follower follows its job): nothing is closed
    here, its watchdog's bounds and its next follower end it."""


def after_training(
    training: TrainingSpec,
    export: ExportSpec | None = None,
    compare_image: str | None = None,
    evaluated: bool = False,
) -> list[JobNeed]:
    """What a fine-tune's jobs after its training need, in order (the merge
    into its base model is the largest in VRAM; each says what it writes on
    the disk): a pod made for the fine-tune is sized for them too, except a
    compare on an image of its own (it gets a pod of its own)."""
    model = training.base_model
    full = training.adapter == "full"
    export = export or ExportSpec()
    quant, keep = export.quant, export.keep_intermediate
    return [
        JobNeed(
            what=f"the merge into {model} (the export)",
            merge_model=model,
            disk=DiskJob("export", model=model, quant=quant, full=full, keep=keep),
        ),
        JobNeed(
            what=f"the {quant} export of the base model {model}",
            disk=DiskJob("base_export", model=model, quant=quant),
        ),
        JobNeed(what="the compare", image=compare_image, disk=DiskJob("ggufs")),
    ] + ([JobNeed(what="the evaluation", disk=DiskJob("ggufs"))] if evaluated else [])


_CURRENT: ContextVar[Sharing | None] = ContextVar("overbrainer_sharing", default=None)


def current() -> Sharing | None:
    """The sharing of the pipeline this code runs in, None outside one."""
    return _CURRENT.get()


@asynccontextmanager
async def shared(
    later: Sequence[JobNeed] = (), anchor: tuple[Runs, str] | None = None
) -> AsyncIterator[Sharing]:
    """Shares the places of the jobs run within the block (see the module);
    on exit, closes what the targets held, by how the block ended (its error
    is raised again), unless it was handed over. Never raises of its own."""
    sharing = Sharing(later=tuple(later), anchor=anchor)
    token = _CURRENT.set(sharing)
    error: BaseException | None = None
    try:
        yield sharing
    except BaseException as raised:
        error = raised
        raise
    finally:
        _CURRENT.reset(token)
        if not sharing.handed_over:
            for held in reversed(list(sharing.held.values())):  # the last held, first closed
                await asyncio.shield(held.close(error))
        sharing.held.clear()
