"""The one interface every place where jobs run implements: this machine, an
SSH box, a Runpod pod made for the job. Nothing above it asks which one it
holds: a new place (another cloud, a cluster) is one new `Target`.

The verbs, in a job's order (after SkyPilot's `sky/provision/`):

- `check`: refuse a job the target can never run, before anything exists;
- `reserve`: what the job needs before anything exists (a plan, its price,
  the GPU budget, a network volume), held for the length of the block;
- `place`: the job's record placed (a pod provisioned for it), an executor
  yielded; on exit, what was placed for a job that never started is ended;
- `reach`: a placed job reached again from its record alone (or None when
  what it ran on is gone);
- `abandon`: whatever the target holds for a job deleted, its keys and
  secrets cleaned, the record failed;
- `leftover`: whether the target still holds something for an ended job.

A `Placed` job is followed (`follow`, to its end, files retrieved and
verified, then ended by its outcome) or ended (`end`) by the caller.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from pydantic import SecretStr

from overbrainer_prefect.executors.base import Executor
from overbrainer_prefect.money.ledger import Ask
from overbrainer_prefect.money.store import Admission, Facts
from overbrainer_prefect.runs.store import RunRecord, Runs
from overbrainer_prefect.sizing import DiskJob
from overbrainer_prefect.steps.context import Outcome, RunContext
from overbrainer_prefect.steps.reporters import Reporter
from overbrainer_prefect.trainers.base import TargetFacts, Trainer
from overbrainer_prefect.trainers.spec import TrainingSpec

Logger = logging.Logger | logging.LoggerAdapter[logging.Logger]


@dataclass(frozen=True)
class JobNeed:
    """What a job needs of the place it runs on, for a target that sizes and
    prices its machine per job (a pod): the GPU memory of its kind of job, the
    disk it writes, another image. A machine you own ignores all of it."""

    what: str
    """The job in messages: `the run`, `the q8_0 export of run R`."""
    training: TrainingSpec | None = None
    """A training run: its VRAM is estimated from its base model and settings."""
    merge_model: str | None = None
    """An export: its VRAM is what merging into this model (a directory or a Hub id) takes."""
    gguf_bytes: int | None = None
    """A job that loads a GGUF of this size (a compare, an evaluation)."""
    disk_bytes: int | None = None
    """What the job writes where a volume holds it (estimated)."""
    image: str | None = None
    """Another image for this job's machine (a compare's own)."""
    disk: DiskJob | None = None
    """What the job writes on its machine's disk, for a target that sizes it (a pod)."""
    spent_usd: float = 0.0
    """What the machines lost under this job's earlier runs cost (a training
    going on after a lost pod): a pod's max_cost_usd counts them too."""


PlanT = TypeVar("PlanT")


@dataclass(frozen=True)
class Reservation(Generic[PlanT]):
    """What `reserve` set aside for one job: the plan it will be placed by
    (a pod's launch plan; nothing on a machine you own), read only by the
    target that made it."""

    plan: PlanT
    need: JobNeed | None = None
    """What it was reserved for (a pod is made with the job's own image)."""
    admission: Admission | None = None
    """Its place's entry in the day's and month's ledger (issue 20), bound to its record."""


class Budget(Protocol):
    """A bound on what pods cost together (the GPU budget), held while a pod lives."""

    async def spend_limit_cents(self) -> int | None:
        """The whole budget's hourly spend in cents, None when there is none."""
        ...

    def hold(self, price_per_hour: float) -> AbstractAsyncContextManager[None]:
        """Holds one pod at `price_per_hour` for the length of the block,
        waiting until it fits. Raises BudgetError when it never can."""
        ...

    def admit(
        self, store: Runs, ask: Ask, facts: Facts
    ) -> AbstractAsyncContextManager[Admission | None]:
        """Admits a pod's most into the day's and month's ledger for the
        length of the block (its cap: what is left, when lower), then brings
        its entry up to date with `facts`. Yields None where nothing is
        recorded. Raises BudgetRefused with one line (nothing created)."""
        ...


class NoBudget:
    """A `Budget` that bounds nothing (no server, or a machine you own)."""

    async def spend_limit_cents(self) -> int | None:
        """None: there is no budget."""
        return None

    def hold(self, price_per_hour: float) -> AbstractAsyncContextManager[None]:
        """A block that holds nothing."""
        return _Nothing()

    def admit(
        self, store: Runs, ask: Ask, facts: Facts
    ) -> AbstractAsyncContextManager[Admission | None]:
        """A block that records nothing (yields None)."""
        return _Nothing()


class _Nothing:
    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> None:
        return None


class Placed(Protocol):
    """A job's place once it exists: the executor that reaches it, how its
    steps are bounded there, how it is followed and how it ends."""

    @property
    def executor(self) -> Executor:
        """Reaches the job's machine."""
        ...

    @property
    def description(self) -> str:
        """Where the job runs, for messages and summaries."""
        ...

    def context(self, store: Runs, reporter: Reporter) -> RunContext:
        """The context of the job's steps here (its bounds: a deadline on a
        machine you own, the pod's watchdog on a pod)."""
        ...

    async def follow(self, ctx: RunContext, trainer: Trainer, record: RunRecord) -> Outcome:
        """Follows the started job to its end, retrieves and verifies its
        files, then ends what it ran on by the outcome (a pod is deleted once
        its files are verified). When what it ran on is gone under the
        follower, the outcome comes from the local files and says why
        (`Outcome.lost`): the caller fails the record with it. Raises
        RunError when the job cannot be followed to its end: it keeps
        running, and the message says how to follow it again or remove what
        bills."""
        ...

    def remote_dir(self, record: RunRecord) -> str:
        """The job's run directory there (a pod's is known once it booted);
        the caller records it before the job starts."""
        ...

    def started(self, store: Runs, record: RunRecord) -> None:
        """Records that the job `record` started here, and logs what bounds
        it. Raises when that cannot be recorded (the job is then cancelled)."""
        ...

    async def end(self, outcome: Outcome) -> None:
        """Ends what the job ran on once it ended with `outcome` (a pod
        deleted when its files are verified, else left to its watchdog's
        retrieve grace). Raises PodError when a delete cannot be confirmed."""
        ...

    def facts(self) -> list[tuple[str, str]]:
        """What the job's place cost and how it ended (a pod's GPU, rate,
        uptime, spend), for its summary; empty for a machine you own."""
        ...

    def spend(self) -> float | None:
        """Dollars its place has cost so far (a pod's), None for a machine you own."""
        ...

    def deadline(self, record: RunRecord) -> str | None:
        """When the job `record` is ended at the latest (RFC 3339): its own
        max_hours deadline, or the pod watchdog's; None when nothing bounds it."""
        ...


class Target(Protocol):
    """Where jobs run. See the module for the verbs."""

    ref: str
    """The target's name (`<block type>/<name>`), kept in every record."""
    kind: str
    """What it is (`local`, `ssh`, `runpod`), for records and messages only."""
    python: str
    """The job venv's Python there."""
    cpu_threads: int | None
    """Threads a job may use where there is no GPU."""

    @property
    def workdir(self) -> str:
        """The directory of the run directories there."""
        ...

    def secrets(self) -> Mapping[str, SecretStr]:
        """What reaches the job through its environment only. Raises
        ValueError with one line when it cannot be read."""
        ...

    def check(self, need: JobNeed) -> None:
        """Refuses, with one line, a job this target can never run (before
        anything exists)."""
        ...

    async def facts(self, modules: Sequence[str]) -> TargetFacts:
        """What a job's machine will offer, known before anything exists: a
        probe of a machine you own (its GPUs, their compute capability, the
        versions of `modules`); the GPU count of a pod (nothing else is known
        before it exists: `modules` is left empty). Raises TrainError or
        ExecError with one line when a machine you own cannot be probed."""
        ...

    def reserve(
        self, store: Runs, need: JobNeed, budget: Budget
    ) -> AbstractAsyncContextManager[Reservation[Any]]:
        """Sets aside what the job needs before anything exists, for the
        length of the block. Raises (one line, nothing created) when it
        cannot be had."""
        ...

    def place(
        self, store: Runs, record: RunRecord, reservation: Reservation[Any]
    ) -> AbstractAsyncContextManager[Placed]:
        """Places the new job `record` (saved `preparing`, its follow lock
        held): yields its place. On exit, a job that never started has what
        was placed for it ended (the caller fails its record). Raises
        (nothing left billing; a `TargetError`'s `kept` is what the record
        keeps) when it cannot be placed."""
        ...

    def reach(self, store: Runs, record: RunRecord) -> AbstractAsyncContextManager[Placed | None]:
        """Reaches a placed job again from its record alone, or yields None
        when what it ran on is gone (`lost` says why: the caller fails a
        record that had not ended). Raises when it cannot be reached now (try
        again later)."""
        ...

    async def abandon(self, store: Runs, record: RunRecord, reason: str) -> bool:
        """Ends what the target holds for a job that will not (or no longer)
        run: deletes it (`reason` says why), cleans its keys and secrets; the
        caller fails the record. Returns whether nothing is left."""
        ...

    @property
    def max_restarts(self) -> int:
        """How many times a training whose machine was lost goes on from its
        last kept checkpoint on a new one (0: never)."""
        ...

    def lost_machine(self, store: Runs, record: RunRecord) -> str | None:
        """Why the ended job `record` was lost with what it ran on (a pod
        terminated under it, its container restarted), from the target's own
        records; None when it ended otherwise (its own exit, a bound, a
        cancel): only a job lost that way is resumed on a new machine."""
        ...

    def lost(self, store: Runs, record: RunRecord) -> str:
        """Why what the job `record` ran on is gone (a pod deleted at its
        watchdog's bound), from the target's own records."""
        ...

    def leftover(self, store: Runs, record: RunRecord) -> bool:
        """Whether the target may still hold something for `record` (a pod not
        confirmed deleted), from the local records alone."""
        ...

    def holds(self, store: Runs, record: RunRecord) -> bool:
        """Whether the target may hold something for the ended job `record`
        now or later (a pod not confirmed deleted, even one its pipeline still
        holds; its secret), from the local records alone: while it does, the
        job stays in the live index (runs/live.py). True when that cannot be
        read."""
        ...

    def detached(self, store: Runs, record: RunRecord) -> str:
        """The message of a started job left running with nobody following it:
        what bounds it, how to follow it again or remove what bills."""
        ...
