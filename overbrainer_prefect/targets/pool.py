"""A pool of machines you own reached over SSH, as one target: each job goes
to a free machine of it, one that answers, has what the job needs (its probe)
and holds no job of this product, decided on the machine itself
(`targets.host_claim`), so two workers never put two jobs on one box.

Machines are tried in the pool's order; one that does not answer is skipped
with one line. When none is free the job waits, up to the pool's `wait_s`,
then fails in one line naming each machine and why. The machine a job got is
recorded in its run directory (`pool.json`, before its files leave this
side), so attach, stop, cancel and collect reach the same machine from the
record alone; on it, everything is as on a single SSH target. The machine is
given back once the job's files are retrieved, or it ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace

from pydantic import ConfigDict, Field, SecretStr

from overbrainer_prefect.executors.base import ExecError, Executor, JobId
from overbrainer_prefect.executors.nodes import NodesExecutor
from overbrainer_prefect.runs.store import RunRecord, Runs, follow_again, subject
from overbrainer_prefect.steps import follow
from overbrainer_prefect.steps import start as start_step
from overbrainer_prefect.steps.context import Outcome, RunContext
from overbrainer_prefect.steps.errors import TargetError
from overbrainer_prefect.steps.reporters import Reporter
from overbrainer_prefect.store.records import StoredRecord, read_record, write_record
from overbrainer_prefect.targets import host_claim
from overbrainer_prefect.targets.base import Budget, JobNeed, Logger, Reservation
from overbrainer_prefect.targets.host import BlockTarget, Bounds, HostPlaced
from overbrainer_prefect.timestamps import rfc3339
from overbrainer_prefect.trainers.base import TargetFacts, Trainer, TrainError

POOL_RECORD = "pool.json"
"""In a run's directory: the machine of its pool its job was placed on."""
FREE_POLL_S = 5.0  # seconds between two looks for a free machine while a job waits for one


class PoolError(TargetError):
    """A pool could not place a job, or cannot reach the machine a job was
    placed on; the message is one line naming each machine and why."""


@dataclass(frozen=True)
class PoolHost:
    """One machine of a pool: its name in the pool, how messages show it
    (`user@host:port`), its work directory and how it is reached."""

    name: str
    address: str
    workdir: str
    executor: Callable[[], Executor]
    """A new executor to the machine (closed by whoever made it)."""
    reach_at: str = ""
    """Where the other nodes of a training across nodes reach it (its host)."""

    @property
    def shown(self) -> str:
        """`name (user@host:port)`, for messages."""
        return f"{self.name} ({self.address})"


class PoolPlacement(StoredRecord):
    """`runs/<id>/pool.json`: the machine of its pool a job was placed on,
    written before the job's files leave this side. It holds no secret: the
    machine's keys stay in the pool's block."""

    model_config = ConfigDict(extra="ignore")

    run_id: str
    host: str
    """The machine's name in its pool."""
    address: str
    """`user@host:port`, as it was when the job was placed."""
    remote_dir: str
    """The job's run directory on it."""
    claimed: str
    """When the machine was claimed for the job, RFC 3339."""
    nodes: list[str] = Field(default_factory=list)
    """A training across nodes: its machines' names, rank 0 first (`host`)."""
    jobs: list[JobId] = Field(default_factory=list)
    """A training across nodes: each node's job, by rank, once all started."""
    lost: str | None = None
    """A training across nodes: the node lost under it and why (its job was
    then ended on every node), written before the other nodes' jobs were
    cancelled; None while none was."""

    @classmethod
    def load(cls, store: Runs, run_id: str) -> PoolPlacement | None:
        """The placement of the run `run_id`, None when it has none. Raises
        InvalidRunId, RecordIoError or InvalidRecord when it cannot be read."""
        store.run_dir(run_id)  # validates the ID before it names a key
        found = read_record(store.store, store.key(run_id, POOL_RECORD), cls, "pool placement")
        return found[0] if found is not None else None

    def save(self, store: Runs) -> None:
        """Writes `pool.json`. Raises RecordIoError when it cannot be written."""
        store.run_dir(self.run_id)
        self._etag = write_record(
            store.store, store.key(self.run_id, POOL_RECORD), self, self._etag
        )


@dataclass
class PoolPlaced(HostPlaced):
    """A job on the machine (or, across nodes, the machines) of its pool that
    hold it: as on a single SSH target, and each machine given back once the
    job's files are retrieved or it ended."""

    claims: list[tuple[PoolHost, Executor]] = field(default_factory=list)
    """Each machine the job holds and its connection, rank 0 first."""
    run_id: str = ""
    remote_dir_here: str = ""
    job_started: bool = False
    log: Logger | None = None
    released: bool = False

    @property
    def description(self) -> str:
        """`ssh target '<pool>:<machine>' (user@host:port)` (each node's)."""
        return self.executor.description

    def context(self, store: Runs, reporter: Reporter) -> RunContext:
        """The job's context on its machine (`pool.json` never uploaded)."""
        return replace(super().context(store, reporter), local_only=(POOL_RECORD,))

    def remote_dir(self, record: RunRecord) -> str:
        """The job's run directory on its machine (rank 0's)."""
        return self.remote_dir_here or record.remote_dir

    def started(self, store: Runs, record: RunRecord) -> None:
        """Notes that the job started: its machines stay held by it."""
        self.job_started = True

    def facts(self) -> list[tuple[str, str]]:
        """The machine (or each node's) of the pool the job ran on."""
        if len(self.claims) == 1:
            return [("machine", self.claims[0][0].shown)]
        return [(f"node {rank}", host.shown) for rank, (host, _) in enumerate(self.claims)]

    async def follow(self, ctx: RunContext, trainer: Trainer, record: RunRecord) -> Outcome:
        """`follow.watch`, then the machines given back once the job ended
        (its files retrieved, or not retrievable: the ended job holds them no
        more). Raises what `follow.watch` raises; the machines stay held."""
        outcome = await follow.watch(ctx, trainer, record)
        await self.end(outcome)
        return outcome

    async def end(self, outcome: Outcome) -> None:
        """Gives the machines back once the job ended (never raises: a machine
        that does not answer keeps a lease that the job's end frees anyway)."""
        if outcome.record.state.ended:
            await self.release()

    async def release(self) -> None:
        """Gives back each machine this job holds; a failure is logged (its
        lease is free once its job ended)."""
        if self.released:
            return
        self.released = True
        for host, executor in self.claims:
            try:
                await host_claim.release(executor, host.workdir, self.run_id)
            except ExecError as error:
                if self.log is not None:
                    self.log.warning(
                        "run %s: cannot give back machine %s of its pool (%s); it is free once "
                        "its job ended",
                        self.run_id,
                        host.shown,
                        error.message,
                    )


class PoolTarget(BlockTarget):
    """A `Target` over several machines you own reached over SSH (see the module)."""

    kind = "pool"

    def __init__(
        self,
        ref: str,
        hosts: Sequence[PoolHost],
        bounds: Bounds,
        *,
        wait_s: float,
        secrets: Callable[[], Mapping[str, SecretStr]],
        cpu_threads: int | None,
        log: Logger,
        claim_s: float = host_claim.CLAIM_S,
        poll_s: float = FREE_POLL_S,
        max_restarts: int = 0,
    ) -> None:
        super().__init__(ref, bounds, secrets=secrets, cpu_threads=cpu_threads, log=log)
        self.hosts = list(hosts)
        self._max_restarts = max_restarts
        problem = pool_problem(ref, [(h.name, h.address) for h in self.hosts])
        if problem is not None:
            raise ValueError(problem)
        self.wait_s = wait_s
        self.claim_s = claim_s
        self.poll_s = poll_s
        self._probed: dict[str, dict[tuple[str, ...], TargetFacts]] = {}
        self._wanted: tuple[tuple[str, ...], TargetFacts] | None = None
        self._told: set[str] = set()
        """The machines already said to be skipped (one line each)."""
        self._kept: tuple[PoolHost, Executor] | None = None
        """The free machine the last `facts` probed, and its open connection."""

    @property
    def workdir(self) -> str:
        """The first machine's work directory (a job's own is its machine's)."""
        return self.hosts[0].workdir

    def check(self, need: JobNeed) -> None:
        """Refuses, in one line, a training across more nodes than the pool
        has machines; an image asked for is said to be ignored."""
        nodes = _nodes(need)
        if nodes > len(self.hosts):
            raise PoolError(
                f"{need.what} asks for nodes={nodes}, but pool {self.ref} has "
                f"{len(self.hosts)} machines: add machines to the pool, or ask for fewer nodes"
            )
        if need.image:
            self._log.warning(
                "image=%s is for a Runpod target's pod: %s runs on its own machines",
                need.image,
                self.ref,
            )

    async def facts(self, modules: Sequence[str]) -> TargetFacts:
        """What the machine a job would get now offers: every machine is
        looked at (at once), and the first free one (in the pool's order) is
        probed, its connection kept for the job's placement, which tries it
        first; when none is free, the first that answers is probed (the job
        will wait for a free one). A job is then placed only on a machine
        with as many GPUs and the same modules. A machine that does not
        answer or cannot be probed is skipped with one line.

        Raises PoolError (one line, each machine and why) when none can be probed."""
        key = tuple(modules)
        await self._forget()
        executors = [host.executor() for host in self.hosts]
        looks = await asyncio.gather(
            *(
                host_claim.is_free(executor, host.workdir, self.claim_s)
                for host, executor in zip(self.hosts, executors, strict=True)
            ),
            return_exceptions=True,
        )
        free = [
            i for i, look in enumerate(looks) if isinstance(look, host_claim.Claim) and look.taken
        ]
        held = [
            i
            for i, look in enumerate(looks)
            if isinstance(look, host_claim.Claim) and not look.taken
        ]
        why: list[str] = []
        try:
            for i, look in enumerate(looks):
                if isinstance(look, BaseException):
                    why.append(f"{self.hosts[i].shown} does not answer ({look})")
                    self._skipped(self.hosts[i], f"does not answer ({look})")
            for i in free + held:
                host, executor = self.hosts[i], executors[i]
                try:
                    facts = await self._probe_on(host, executor, key)
                except (TrainError, ExecError) as error:
                    why.append(f"{host.shown} cannot be probed ({error})")
                    self._skipped(host, f"cannot be probed ({error})")
                    continue
                self._wanted = (key, facts)
                if i in free:
                    self._kept = (host, executors.pop(i))
                return facts
        finally:
            for executor in executors:
                await executor.close()
        raise PoolError(f"no machine of pool {self.ref} can be probed: {'; '.join(why)}")

    async def _forget(self) -> None:
        """Closes the connection kept for a placement that did not come."""
        if self._kept is not None:
            _, executor = self._kept
            self._kept = None
            await executor.close()

    async def _probe_on(
        self, host: PoolHost, executor: Executor, key: tuple[str, ...]
    ) -> TargetFacts:
        kept = self._probed.setdefault(host.name, {})
        if key not in kept:
            kept[key] = await start_step.probe(executor, self.python, key)
        return kept[key]

    @asynccontextmanager
    async def reserve(
        self, store: Runs, need: JobNeed, budget: Budget
    ) -> AsyncIterator[Reservation[int]]:
        """Nothing to reserve: machines are claimed once the job's record
        exists; the plan is how many (the training's nodes)."""
        yield Reservation(plan=_nodes(need), need=need)

    @asynccontextmanager
    async def place(
        self, store: Runs, record: RunRecord, reservation: Reservation[int]
    ) -> AsyncIterator[PoolPlaced]:
        """Claims a free machine for the job `record` (one per node for a
        training across nodes, all or none; waiting up to `wait_s` while too
        few are free), records them in `pool.json`, and yields the job's
        place on them. On exit, a job that never started gives them back.

        Raises PoolError (one line naming each machine and why; nothing
        held) when too few are free in time, or the placement cannot be
        recorded."""
        count = reservation.plan if isinstance(reservation.plan, int) else 1
        claims = await self._claim(record, count)
        host = claims[0][0]
        remote = self._remote_dir(host, record)
        placement = PoolPlacement(
            run_id=record.id,
            host=host.name,
            address=host.address,
            remote_dir=remote,
            claimed=rfc3339(),
            nodes=[h.name for h, _ in claims] if count > 1 else [],
        )
        placed = PoolPlaced(
            self._executor_of(store, placement, claims),
            self._bounds,
            self._probed.get(host.name, {}),
            claims=claims,
            run_id=record.id,
            remote_dir_here=remote,
            log=self._log,
        )
        try:
            try:
                placement.save(store)
            except Exception as error:
                raise PoolError(
                    f"{subject(record)} cannot record its machines of pool {self.ref} "
                    f"({error}): nothing was started there"
                ) from None
            self._log.info(
                "%s placed on %s of pool %s",
                subject(record),
                " and ".join(f"machine {h.shown}" for h, _ in claims),
                self.ref,
            )
            try:
                yield placed
            finally:
                if not placed.job_started:
                    await asyncio.shield(placed.release())
        finally:
            for _, executor in claims:
                await executor.close()

    def _executor_of(
        self, store: Runs, placement: PoolPlacement, claims: list[tuple[PoolHost, Executor]]
    ) -> Executor:
        """The job's executor: its machine's; across nodes, one over every
        node (`executors.nodes`) whose nodes' jobs are recorded in `pool.json`
        once all started."""
        if len(claims) == 1:
            return claims[0][1]

        def spawned(jobs: list[JobId]) -> None:
            placement.jobs = jobs
            placement.save(store)

        def lost(rank: int, why: str) -> None:
            placement.lost = f"{why}; it was machine {claims[rank][0].shown} of pool {self.ref}"
            placement.save(store)

        return NodesExecutor(
            [executor for _, executor in claims],
            claims[0][0].reach_at or claims[0][0].address.rpartition("@")[2].rpartition(":")[0],
            self.python,
            jobs=placement.jobs,
            spawned=spawned,
            lost=lost,
        )

    async def _claim(self, record: RunRecord, count: int) -> list[tuple[PoolHost, Executor]]:
        """`count` machines claimed for `record`, with their executors (open):
        the machine the last `facts` probed first, then the pool's order. With
        too few free, those claimed are given back and the claim tried again
        (up to `wait_s`)."""
        deadline = time.monotonic() + self.wait_s
        waiting = False
        while True:
            why: list[str] = []
            kept, self._kept = self._kept, None
            first = [kept[0]] if kept is not None else []
            order = first + [h for h in self.hosts if h not in first]
            claims: list[tuple[PoolHost, Executor]] = []
            for host in order:
                if len(claims) == count:
                    break
                executor = kept[1] if kept is not None and host is kept[0] else host.executor()
                answer = await self._try(host, executor, record)
                if answer is None:
                    claims.append((host, executor))
                    continue
                await executor.close()
                why.append(f"{host.shown} {answer}")
            if len(claims) == count:
                return claims
            for host, executor in claims:  # too few: all or none
                with contextlib.suppress(ExecError):
                    await host_claim.release(executor, host.workdir, record.id)
                await executor.close()
                why.append(f"{host.shown} is free")
            left = deadline - time.monotonic()
            wanted = "a free machine" if count == 1 else f"{count} free machines"
            if left <= 0:
                if count == 1:
                    short = f"no machine of pool {self.ref} is free for {subject(record)}"
                    again = "one is free"
                else:
                    short = (
                        f"pool {self.ref} has {len(claims)} of the {count} free machines "
                        f"{subject(record)} needs"
                    )
                    again = "they are free"
                raise PoolError(
                    f"{short}: {'; '.join(why)}. Try again once {again}, or raise the pool's "
                    "wait_minutes"
                )
            if not waiting:
                waiting = True
                self._log.info(
                    "%s waits up to %.0f s for %s of pool %s: %s",
                    subject(record),
                    left,
                    wanted,
                    self.ref,
                    "; ".join(why),
                )
            await asyncio.sleep(min(self.poll_s, left))

    def _skipped(self, host: PoolHost, why: str) -> None:
        """Says once that `host` is skipped, and why."""
        if host.name not in self._told:
            self._told.add(host.name)
            self._log.warning("pool %s: machine %s skipped: %s", self.ref, host.shown, why)

    async def _try(self, host: PoolHost, executor: Executor, record: RunRecord) -> str | None:
        """Claims `host` for `record`: None when it did and the machine has
        what the job needs, else why not (a machine that lacks it is given
        back at once)."""
        remote = self._remote_dir(host, record)
        try:
            got = await host_claim.claim(executor, host.workdir, record.id, remote, self.claim_s)
        except ExecError as error:
            why = f"does not answer ({error})"
            self._skipped(host, why)
            return why
        if not got.taken:
            return f"is {got.why}"
        lacks: str | None = None
        if self._wanted is not None:
            key, wanted = self._wanted
            try:
                lacks = _lacks(await self._probe_on(host, executor, key), wanted)
            except (TrainError, ExecError) as error:
                lacks = f"cannot be probed ({error})"
                self._skipped(host, lacks)
        if lacks is not None:
            with contextlib.suppress(ExecError):
                await host_claim.release(executor, host.workdir, record.id)
            return lacks
        if got.why:
            self._log.info("pool %s: machine %s taken %s", self.ref, host.shown, got.why)
        return None

    def _remote_dir(self, host: PoolHost, record: RunRecord) -> str:
        """The job's run directory on `host`: its place under that machine's work directory."""
        base = self.workdir.rstrip("/")
        if record.remote_dir.startswith(base + "/"):
            return host.workdir.rstrip("/") + record.remote_dir[len(base) :]
        return record.remote_dir

    def _hosts_of(self, store: Runs, record: RunRecord) -> tuple[list[PoolHost], PoolPlacement]:
        """The machines the job `record` was placed on (rank 0 first), from
        `pool.json`. Raises PoolError when it has none or a machine left the pool."""
        placement = PoolPlacement.load(store, record.id)
        if placement is None:
            raise PoolError(
                f"{subject(record)} has no {POOL_RECORD}: it was never placed on a machine "
                f"of pool {self.ref}, so there is nothing to reach"
            )
        named = {host.name: host for host in self.hosts}
        found = []
        for name in placement.nodes or [placement.host]:
            if name not in named:
                raise PoolError(
                    f"{subject(record)} ran on machine {name} of pool {self.ref}, which is no "
                    "longer in the pool: put it back in the pool's block to follow it again"
                )
            found.append(named[name])
        return found, placement

    @asynccontextmanager
    async def reach(self, store: Runs, record: RunRecord) -> AsyncIterator[PoolPlaced | None]:
        """The machines the job was placed on, from `pool.json` (never gone:
        its job's status says the rest). Raises PoolError when the job was
        never placed, or a machine of it left the pool."""
        hosts, placement = self._hosts_of(store, record)
        claims = [(host, host.executor()) for host in hosts]
        try:
            yield PoolPlaced(
                self._executor_of(store, placement, claims),
                self._bounds,
                {},
                claims=claims,
                run_id=record.id,
                remote_dir_here=placement.remote_dir,
                job_started=record.job is not None,
                log=self._log,
            )
        finally:
            for _, executor in claims:
                await executor.close()

    async def abandon(self, store: Runs, record: RunRecord, reason: str) -> bool:
        """Gives back the machines a job that never started was placed on.
        Returns whether nothing is left held (a machine that does not answer
        keeps its lease until its claim expires)."""
        try:
            hosts, _ = self._hosts_of(store, record)
        except PoolError:
            return True
        freed = True
        for host in hosts:
            executor = host.executor()
            try:
                freed = await host_claim.release(executor, host.workdir, record.id) and freed
            except ExecError as error:
                self._log.warning(
                    "%s: cannot give back machine %s of pool %s (%s); it is free %.0f s after "
                    "its claim",
                    subject(record),
                    host.shown,
                    self.ref,
                    error.message,
                    self.claim_s,
                )
                freed = False
            finally:
                await executor.close()
        return freed

    @property
    def max_restarts(self) -> int:
        """How many times a training across nodes that lost a node goes on
        from its last complete checkpoint on free machines of the pool."""
        return self._max_restarts

    def lost_machine(self, store: Runs, record: RunRecord) -> str | None:
        """Why the ended training across nodes `record` was lost with a node
        (its job gone, or its machine silent), from `pool.json`; None for
        one that ended otherwise, a job on one machine (a machine you own
        is not replaced), or a placement that cannot be read."""
        try:
            placement = PoolPlacement.load(store, record.id)
        except Exception:  # an unreadable placement: not resumed on a guess
            return None
        if placement is None or len(placement.nodes) < 2 or placement.lost is None:
            return None
        return f"a node of the training was lost ({placement.lost})"

    def lost(self, store: Runs, record: RunRecord) -> str:
        """A machine you own is never gone; said for completeness."""
        return f"its machine of pool {self.ref} no longer runs the job"

    def leftover(self, store: Runs, record: RunRecord) -> bool:
        """Never: nothing on a machine you own bills, and an ended job's lease is free."""
        return False

    def holds(self, store: Runs, record: RunRecord) -> bool:
        """Never: a machine you own holds nothing for an ended job (its lease
        is free once its job ended)."""
        return False

    def detached(self, store: Runs, record: RunRecord) -> str:
        """How to follow again a job left running on its machines of the pool."""
        try:
            hosts, _ = self._hosts_of(store, record)
            where = f"{' and '.join(f'machine {h.shown}' for h in hosts)} of pool {self.ref}"
        except Exception:
            where = f"pool {self.ref}"
        return (
            f"{subject(record)} keeps running on {where} (bounded by max_hours); follow it "
            f"again with {follow_again(record)}, or cancel it with the cancel flow"
        )


def pool_problem(ref: str, hosts: Sequence[tuple[str, str]]) -> str | None:
    """Why the machines `hosts` (name, `user@host:port`) cannot make pool
    `ref`, in one line: none, or one listed twice (by name, or by host and
    port: two jobs would share a box). None when they can."""
    if not hosts:
        return f"pool {ref} lists no machine: add at least one to its hosts"
    names: set[str] = set()
    boxes: dict[str, str] = {}
    for name, address in hosts:
        box = address.rpartition("@")[2].lower()
        if name in names:
            return f"pool {ref} lists the machine name {name!r} twice: give each machine its own"
        if box in boxes:
            return (
                f"pool {ref} lists {box} twice ({boxes[box]} and {name}): two jobs would share "
                "one box; list each machine once"
            )
        names.add(name)
        boxes[box] = name
    return None


def _lacks(facts: TargetFacts, wanted: TargetFacts) -> str | None:
    """Why a machine probed as `facts` cannot run a job checked against
    `wanted` (fewer GPUs, a module that does not import), None when it can."""
    if facts.gpus < wanted.gpus:
        return f"has {facts.gpus} GPUs, the job needs {wanted.gpus}"
    for module, version in wanted.modules.items():
        if version is not None and facts.modules.get(module) is None:
            return f"lacks {module} in its job venv"
    return None


def _nodes(need: JobNeed) -> int:
    """The machines a job needs at once: a training's nodes, else one."""
    return need.training.nodes if need.training is not None else 1
