"""The follower: one long-running flow run that follows every job of a runs
directory, so that the flow runs that started them hold no process
(`suspension`): their live progress and loss curve go to their own
artifacts and log, a `prefect flow-run cancel` of one cancels its job, and
each is resumed once its job's files are verified and what it ran on ended.
It also does what the collector does, continuously: jobs whose follower died
are followed to their end, what a job left is ended.

One follower runs per runs directory (its lock there: another one ends at
once); one that dies is replaced by the next run of its deployment, and the
jobs it followed are taken over where they are, their flow runs still waiting.
At the end of its term (`minutes`) it hands over: it lets go of its jobs,
which keep running, and of the runs directory, and starts the next follower
of its deployment at once; it renews the GPU budget's leases of the jobs it
followed until that one holds the runs directory (no gap in which the
server could free their slots), and waits for the flow runs its own process
runs (`resume_here`: the next follower leaves them to it), so none runs twice.
"""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack

from prefect import flow, get_run_logger
from prefect.deployments.flow_runs import arun_deployment
from prefect.runtime import deployment, flow_run

from overbrainer_prefect.budget_leases import handed_over, renewed, taken_over
from overbrainer_prefect.flowruns import cancelled_among, job_logger, suspended
from overbrainer_prefect.flows.collect import candidates, collect_job
from overbrainer_prefect.flows.compare import compare
from overbrainer_prefect.flows.evaluate import evaluate
from overbrainer_prefect.flows.export import export
from overbrainer_prefect.flows.train import train
from overbrainer_prefect.kinds.collected import Collected
from overbrainer_prefect.resume_here import HERE, Here, recover, recover_again
from overbrainer_prefect.runs.lock import RunBusy, follower_lock
from overbrainer_prefect.runs.store import RunRecord, Runs, subject
from overbrainer_prefect.runs_dir import runs_at
from overbrainer_prefect.steps.context import COLLECTOR, ENDED_BY
from overbrainer_prefect.store import Held
from overbrainer_prefect.suspension import waited_for
from overbrainer_prefect.targets.base import Logger, Target

KEEP_ROWS = 200  # what a follower returns of the jobs it finished: the last ones

RUN_HERE = {f.name: f for f in (train, export, compare, evaluate)}
"""The flows whose resumed runs this follower runs again itself (`resume_here`)."""


class _Followed:
    """A job this follower follows: its store, record, target and task."""

    def __init__(
        self, store: Runs, record: RunRecord, target: Target | None, task: asyncio.Task[object]
    ) -> None:
        self.store, self.record, self.target, self.task = store, record, target, task
        self.cancel_sent = False
        self.waited = False  # whether its flow run was seen waiting suspended for it


@flow(name="follow", persist_result=True)
async def follow(
    runs_dir: str | None = None, minutes: float = 60.0, every_s: float = 2.0
) -> list[Collected]:
    """Follows every job of the runs directory for `minutes` (see the
    module), looking for new ones every `every_s` seconds; returns what it
    did with the jobs that ended meanwhile, once it handed over to the next
    follower. Ends at once, saying who follows, when another follower holds
    the runs directory, and as soon as it finds its lock there lost (another
    follower took it): it says so in one line, lets go of its jobs and starts
    no successor. Raises RecordIoError when the runs directory cannot be read
    at its start."""
    runs = await runs_at(runs_dir)
    logger = get_run_logger()
    here = Here(runs, RUN_HERE, str(flow_run.id))
    async with AsyncExitStack() as handing:  # the budget's leases, renewed across the hand-over
        try:
            rows, leases, lost = await _term(runs, here, minutes * 60, every_s, handing, logger)
        except RunBusy as busy:
            logger.info(
                "%s is followed by another follower (%s): this one ends", runs.where, busy.holder
            )
            return []
        except Exception:
            await handing.aclose()
            await here.wait_out(logger)
            raise
        # lost: the follower that took the runs directory is the one that goes on
        if not lost and await _successor(runs_dir, minutes, every_s, logger) and leases:
            await taken_over(runs, logger)
    await here.wait_out(logger)
    return rows


async def _term(
    runs: Runs,
    here: Here,
    seconds: float,
    every_s: float,
    handing: AsyncExitStack,
    logger: Logger,
) -> tuple[list[Collected], int, bool]:
    """Holds the runs directory's follower lock and follows every job for
    `seconds`, with `here` running resumed flow runs; before it lets go of
    the lock, the GPU budget's leases of the jobs it followed are renewed on
    `handing` (from then until its successor follows them). Returns what it
    did with the jobs that ended, how many leases it renews, and whether it
    lost the runs directory's lock to another follower. Raises RunBusy."""
    this = str(flow_run.id)
    with follower_lock(runs, this) as held:
        here.held = held
        logger.info("following every job of %s for %g min", runs.where, seconds / 60)
        said: set[str] = set()
        recovered = await recover(runs, this, logger, said, held)
        again = asyncio.create_task(recover_again(runs, this, logger, recovered, said, held))
        followed: list[_Followed] = []
        token = HERE.set(here)
        try:
            rows = await _follow_for(runs, seconds, every_s, logger, followed, held)
        finally:
            HERE.reset(token)
            again.cancel()
            await asyncio.gather(again, return_exceptions=True)
            held_by = [(job.store, job.record.id) for job in followed]  # the budget's leases:
            leases = await asyncio.to_thread(lambda: [x for j in held_by for x in handed_over(*j)])
            await handing.enter_async_context(
                renewed(leases, logger, at_once=True, last_on_exit=True)
            )
    return rows, len(leases), held.lost


async def _follow_for(
    runs: Runs,
    seconds: float,
    every_s: float,
    logger: Logger,
    followed_at_end: list[_Followed],
    held: Held,
) -> list[Collected]:
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    followed: dict[str, _Followed] = {}
    rows: list[Collected] = []
    acting = ENDED_BY.set(COLLECTOR)  # what it deletes is recorded deleted by the collector
    try:
        while loop.time() < end:
            if held.lost:
                logger.warning(
                    "another follower took the runs directory %s at %s (%s): this one stops "
                    "following it",
                    runs.where,
                    held.lost_at,
                    held.why,
                )
                break
            await _take_new(runs, followed, logger)
            await _cancel_asked(followed, logger)
            for key in [k for k, job in followed.items() if job.task.done()]:
                job = followed.pop(key)
                try:
                    row = job.task.result()
                except Exception as error:
                    logger.warning("%s: cannot finish it: %s", subject(job.record), error)
                    continue
                if isinstance(row, Collected):
                    rows = [*rows, row][-KEEP_ROWS:]
            await asyncio.sleep(every_s)
    finally:
        ENDED_BY.reset(acting)
        followed_at_end.extend(followed.values())
        for job in followed.values():  # they keep running: the next follower takes them
            job.task.cancel()
        await asyncio.gather(*(job.task for job in followed.values()), return_exceptions=True)
    return rows


async def _take_new(runs: Runs, followed: dict[str, _Followed], logger: Logger) -> None:
    """Starts following the jobs nobody follows that this follower does not
    (the live ones alone are read, and not those it follows: `candidates`)."""
    try:
        found = await candidates(runs, following=set(followed))
    except Exception as error:  # the store or the server is away: the next pass tries again
        logger.warning("cannot look for jobs to follow now: %s", error)
        return
    for store, record, target in found:
        key = store.key(record.id)
        if key in followed:
            continue
        try:
            waiting = await suspended(record.flow_run_id)
        except Exception:  # the server is away: its lines go to this flow run's log
            waiting = None
        task = asyncio.create_task(
            collect_job(runs, store, record, target, job_logger(waiting, logger))
        )
        followed[key] = _Followed(store, record, target, task)


async def _cancel_asked(followed: dict[str, _Followed], logger: Logger) -> None:
    """Cancels the jobs whose suspended flow run was cancelled (`prefect
    flow-run cancel`): no process of theirs is left to do it. The job's
    follow records it, retrieves what it left and ends what it ran on. The
    server is asked about all of them at once (`cancelled_among`)."""
    asked: list[_Followed] = []
    for job in followed.values():
        record = job.record
        if job.cancel_sent or record.job is None or job.target is None:
            continue
        if not job.waited:  # read once it says so: a flow run that suspended stays so
            job.waited = await asyncio.to_thread(waited_for, job.store, record)
        if job.waited:
            asked.append(job)
    if not asked:
        return
    try:
        cancelled = await cancelled_among([job.record.flow_run_id for job in asked])
    except Exception as error:  # the next pass asks again; each job's own follow reads it too
        logger.warning("cannot ask the server which flow runs were cancelled now: %s", error)
        return
    for job in asked:
        record, target = job.record, job.target
        if record.flow_run_id not in cancelled or record.job is None or target is None:
            continue
        try:
            job.cancel_sent = True
            async with target.reach(job.store, record) as placed:
                if placed is not None:
                    await placed.executor.cancel(record.job)
        except Exception as error:  # tried again by the job's own follow (its flow run's state)
            logger.warning("%s: cannot cancel its job now: %s", subject(record), error)
            continue
        logger.info(
            "%s: its flow run %s was cancelled: job cancelled", subject(record), record.flow_run_id
        )


async def _successor(runs_dir: str | None, minutes: float, every_s: float, logger: Logger) -> bool:
    """Starts the next follower of this deployment, at once (its schedule is
    the fallback when this one dies); returns whether it did."""
    if deployment.id is None or deployment.name is None:
        return False
    name = f"{flow_run.flow_name}/{deployment.name}"
    try:
        await arun_deployment(
            name,
            parameters={"runs_dir": runs_dir, "minutes": minutes, "every_s": every_s},
            timeout=0,
            as_subflow=False,
        )
    except Exception as error:
        logger.warning("cannot start the next follower (%s): its schedule will: %s", name, error)
        return False
    return True
