"""A machine you own (this one, or an SSH box): nothing to reserve, price or
delete. A job is placed in a run directory of its work directory and bounded
by its `max_hours` deadline; what it leaves stays there."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from pydantic import SecretStr

from overbrainer_prefect.executors.base import Executor
from overbrainer_prefect.runs.store import RunRecord, Runs, follow_again, subject
from overbrainer_prefect.steps import follow
from overbrainer_prefect.steps import start as start_step
from overbrainer_prefect.steps.context import Outcome, RunContext
from overbrainer_prefect.steps.reporters import Reporter
from overbrainer_prefect.targets.base import Budget, JobNeed, Logger, Reservation
from overbrainer_prefect.trainers.base import TargetFacts, Trainer, TrainError


@dataclass(frozen=True)
class Bounds:
    """How a job's steps are bounded on a target: its deadline, the pace of
    its watch, when it counts as stalled."""

    python: str
    poll_s: float = 2.0
    max_hours: float | None = None
    stall_s: float = 900.0

    def context(self, store: Runs, executor: Executor, reporter: Reporter) -> RunContext:
        """The context of a job's steps with these bounds."""
        return RunContext(
            runs=store,
            executor=executor,
            reporter=reporter,
            python=self.python,
            poll_s=self.poll_s,
            max_hours=self.max_hours,
            stall_s=self.stall_s,
        )


@dataclass
class HostPlaced:
    """A job on a machine you own."""

    executor: Executor
    bounds: Bounds
    probed: dict[tuple[str, ...], TargetFacts] = field(default_factory=dict)
    """The machine's probes its target already took (see `RunContext.probed`)."""

    @property
    def description(self) -> str:
        """The executor's description (`local:/path`, `ssh user@host:port`)."""
        return self.executor.description

    def context(self, store: Runs, reporter: Reporter) -> RunContext:
        """The job's context, with the target's deadline and its probes."""
        ctx = self.bounds.context(store, self.executor, reporter)
        ctx.probed = self.probed
        return ctx

    async def follow(self, ctx: RunContext, trainer: Trainer, record: RunRecord) -> Outcome:
        """`follow.watch`: follows the job, retrieves and verifies its files."""
        return await follow.watch(ctx, trainer, record)

    async def end(self, outcome: Outcome) -> None:
        """Nothing: a machine you own is not deleted."""

    def started(self, store: Runs, record: RunRecord) -> None:
        """Nothing to record: the job's record says where it runs."""

    def remote_dir(self, record: RunRecord) -> str:
        """The job's run directory, as its record says."""
        return record.remote_dir

    def facts(self) -> list[tuple[str, str]]:
        """None: a machine you own costs nothing here."""
        return []

    def spend(self) -> float | None:
        """None: a machine you own costs nothing here."""
        return None

    def deadline(self, record: RunRecord) -> str | None:
        """The job's max_hours deadline, None without one."""
        return record.deadline


class BlockTarget:
    """What every target made from a target block holds: its name (`ref`), the
    job venv's Python and the bounds of its jobs, its CPU threads, its secrets
    (read when a job starts) and the log its warnings go to."""

    def __init__(
        self,
        ref: str,
        bounds: Bounds,
        *,
        secrets: Callable[[], Mapping[str, SecretStr]],
        cpu_threads: int | None,
        log: Logger,
    ) -> None:
        self.ref = ref
        self.python = bounds.python
        self.cpu_threads = cpu_threads
        self._bounds = bounds
        self._secrets = secrets
        self._log = log

    def secrets(self) -> Mapping[str, SecretStr]:
        """The target's secrets (env file, Hugging Face token). Raises ValueError
        with one line when its env file cannot be read."""
        return self._secrets()

    def one_node(self, need: JobNeed, where: str) -> None:
        """Refuses, with one line, a training across nodes on a target of one
        machine per job (`where` says which, and what to use instead)."""
        nodes = need.training.nodes if need.training is not None else 1
        if nodes > 1:
            raise TrainError(
                f"{need.what} asks for nodes={nodes}, but {self.ref} is {where}: run it on an "
                "SSH pool (SshPool) with at least that many machines, or set nodes=1"
            )

    @property
    def max_restarts(self) -> int:
        """0: a machine you own is not replaced by another."""
        return 0

    def lost_machine(self, store: Runs, record: RunRecord) -> str | None:
        """None: a machine you own is not lost under a job, only unreachable."""
        return None


class HostTarget(BlockTarget):
    """A `Target` over one machine reached by an executor."""

    def __init__(
        self,
        ref: str,
        kind: str,
        executor: Callable[[], Executor],
        bounds: Bounds,
        *,
        secrets: Callable[[], Mapping[str, SecretStr]],
        cpu_threads: int | None,
        log: Logger,
    ) -> None:
        super().__init__(ref, bounds, secrets=secrets, cpu_threads=cpu_threads, log=log)
        self.kind = kind
        self._executor = executor
        self._probed: dict[tuple[str, ...], TargetFacts] = {}

    @property
    def workdir(self) -> str:
        """The executor's work directory."""
        return self._executor().workdir

    def check(self, need: JobNeed) -> None:
        """Accepts any job on one machine (a training across nodes is refused
        in one line); an image asked for is said to be ignored."""
        self.one_node(need, "one machine")
        if need.image:
            self._log.warning(
                "image=%s is for a Runpod target's pod: %s runs on its own machine",
                need.image,
                self.ref,
            )

    async def facts(self, modules: Sequence[str]) -> TargetFacts:
        """A probe of the machine's job environment (kept: a job placed by this
        target starts without probing for the same modules again)."""
        executor = self._executor()
        try:
            facts = await start_step.probe(executor, self.python, modules)
        finally:
            await executor.close()
        self._probed[tuple(modules)] = facts
        return facts

    @asynccontextmanager
    async def reserve(
        self, store: Runs, need: JobNeed, budget: Budget
    ) -> AsyncIterator[Reservation[None]]:
        """Nothing to reserve on a machine you own."""
        yield Reservation(plan=None)

    @asynccontextmanager
    async def place(
        self, store: Runs, record: RunRecord, reservation: Reservation[None]
    ) -> AsyncIterator[HostPlaced]:
        """The job's executor, closed on exit."""
        executor = self._executor()
        try:
            yield HostPlaced(executor, self._bounds, self._probed)
        finally:
            await executor.close()

    @asynccontextmanager
    async def reach(self, store: Runs, record: RunRecord) -> AsyncIterator[HostPlaced | None]:
        """The machine again (it is never gone: its job's status says the rest)."""
        async with self.place(store, record, Reservation(plan=None)) as placed:
            yield placed

    async def abandon(self, store: Runs, record: RunRecord, reason: str) -> bool:
        """Nothing to end: nothing is held on a machine you own."""
        return True

    def lost(self, store: Runs, record: RunRecord) -> str:
        """A machine you own is never gone; said for completeness."""
        return f"{self.ref} no longer runs the job"

    def leftover(self, store: Runs, record: RunRecord) -> bool:
        """Never: nothing on a machine you own bills."""
        return False

    def holds(self, store: Runs, record: RunRecord) -> bool:
        """Never: a machine you own holds nothing for an ended job."""
        return False

    def detached(self, store: Runs, record: RunRecord) -> str:
        """How to follow again a job left running on its machine."""
        return (
            f"{subject(record)} keeps running on {self.ref} (bounded by max_hours); follow it "
            f"again with {follow_again(record)}, or cancel it with the cancel flow"
        )
