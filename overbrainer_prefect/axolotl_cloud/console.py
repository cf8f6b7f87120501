"""What `axolotl train config.yml --cloud cloud.yml` does in the orchestrator's
Python (`python -m overbrainer_prefect.axolotl_cloud train REQUEST`, started by
the launcher): checks everything before anything is created, runs the `train`
flow (in this process, or as a run of cloud.yml's deployment, its local datasets
and base model folder uploaded first into the deployment's runs directory for
its worker to read) and streams it to the terminal: the flow run's UI link, the
job's progress lines, then the verified files. Ctrl-C asks once "stop with a
checkpoint (s), cancel (c), or leave it running (l)?" and does that with the
`stop` and `cancel` flows (a preprocessing, which keeps no checkpoint, is
cancelled at `s`).
`axolotl preprocess --cloud` is the same with a spec that only prepares the
datasets; `axolotl lm-eval --cloud` runs the `evaluate` flow on a trained run
and prints its verdict (`lm_eval_from_axolotl`; Ctrl-C cancels it at once).

Exit codes: 0 the run succeeded; 1 it did not (failed, cancelled, stopped);
2 bad input, nothing created; 3 left running.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from uuid import UUID

import yaml
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId, LogFilterTimestamp
from prefect.client.schemas.objects import FlowRun, State
from prefect.client.schemas.sorting import LogSort
from prefect.deployments.flow_runs import arun_deployment
from prefect.exceptions import ObjectNotFound
from prefect.flow_engine import run_flow_async
from prefect.settings import (
    PREFECT_API_URL,
    PREFECT_LOGGING_TO_API_BATCH_INTERVAL,
    PREFECT_UI_URL,
)
from prefect.states import Cancelled, Cancelling
from pydantic import ValidationError

from overbrainer_prefect.axolotl_cloud.cloud import CloudConfig, CloudConfigError, read_cloud
from overbrainer_prefect.axolotl_cloud.mapping import MappingError, local_model, spec_from_axolotl
from overbrainer_prefect.blocks import AmbiguousTarget, UnknownTarget, target_named
from overbrainer_prefect.driver import on_cancelled
from overbrainer_prefect.evaluation.results import EvaluationResult
from overbrainer_prefect.evaluation.spec import BadEvaluationInput, EvaluationSpec
from overbrainer_prefect.evaluation.verdict import verdict
from overbrainer_prefect.executors.base import ExecError
from overbrainer_prefect.flows.evaluate import evaluate
from overbrainer_prefect.flows.train import RunResult, cancel, stop, train
from overbrainer_prefect.kinds.training import check_before_anything as training_checks
from overbrainer_prefect.runpod.settings import SettingsError
from overbrainer_prefect.runs.manifest import load_manifest
from overbrainer_prefect.runs.store import Runs, RunState
from overbrainer_prefect.runs_dir import runs_at
from overbrainer_prefect.store import StoreError, is_url
from overbrainer_prefect.store.where import RUNS_ROOT_ENV
from overbrainer_prefect.trainers.axolotl import AxolotlTrainer
from overbrainer_prefect.trainers.base import TrainError
from overbrainer_prefect.trainers.keys import CONFIG_KEYS
from overbrainer_prefect.trainers.spec import TrainingSpec
from overbrainer_prefect.trainers.uploads import Upload, UploadError, local_inputs, upload

SUCCEEDED, NOT_SUCCEEDED, BAD_INPUT, LEFT_RUNNING = 0, 1, 2, 3
"""The exit codes (see the module's docstring)."""

QUESTION = "stop with a checkpoint (s), cancel (c), or leave it running (l)? "
ANSWER_WAIT_S = 300.0  # no answer by then (or no terminal): the run goes on, followed here
ECHO_S = 2.0  # a second SIGINT this soon after the first is the same Ctrl-C (the launcher's)
POLL_S = 1.0  # between two looks at a deployment's flow run and its logs
LATE_LOGS_S = 30.0
"""The most a deployment's flow run, once final, is read again for its last
lines: its process (or the follower that ran it again) sends its log to the
server in batches (`PREFECT_LOGGING_TO_API_BATCH_INTERVAL`, 2 s), so the
state can reach the server before the line that says how the run ended ("run
R succeeded: ...", seen under load: a succeeded run's command ended 1, 'no
message'). A completed flow run is read until that line comes, at most this
long; another final state until one look finds nothing new two batch
intervals after it was first seen final."""
FOLLOW_BOUND_S = 31 * 24 * 3600.0  # the longest a deployment's run is followed here
RUN_ID = re.compile(r"\brun (\d{8}-\d{6}-[0-9a-z]{4})\b")
"""A run's ID in the flow's log lines (`run 20261205-031500-ab12: step 3/6 ...`)."""

RAISED = re.compile(r"^Flow run encountered an exception: \w+: ")
"""How Prefect words a flow's exception before its message (left out here)."""

TERMINAL = logging.getLogger("overbrainer.axolotl_cloud")
"""The checks' warnings, on the terminal as the launcher's own lines."""
_SAYS = logging.StreamHandler(sys.stderr)
_SAYS.setFormatter(logging.Formatter("overbrainer: %(message)s"))
TERMINAL.addHandler(_SAYS)
TERMINAL.setLevel(logging.WARNING)
TERMINAL.propagate = False


class BadInput(Exception):
    """What the user gave cannot be run; the message is one line."""


def say(line: str) -> None:
    """One line of this launcher's own on the terminal."""
    print(f"overbrainer: {line}", file=sys.stderr, flush=True)


@dataclass
class Request:
    """What the launcher handed over; with a deployment, the runs directory
    its worker records runs in (cloud.yml's, else the deployment's own when
    this machine can reach it: an object store or an absolute path) and the
    local inputs put there for it (`stage_inputs`)."""

    cloud: CloudConfig
    spec: TrainingSpec
    notes: list[str]
    runs_dir: str | None = None
    uploads: list[Upload] = field(default_factory=list)


def read_files(path: Path) -> tuple[CloudConfig, dict[str, object], dict[str, object]]:
    """The launcher's request file: cloud.yml checked, the axolotl YAML parsed,
    and the whole request. Raises BadInput with one line."""
    found = json.loads(path.read_text(encoding="utf-8"))
    try:
        cloud = read_cloud(found["cloud"])
    except CloudConfigError as error:
        raise BadInput(str(error)) from None
    try:
        config = yaml.safe_load(found["config_yaml"])
    except yaml.YAMLError as error:
        raise BadInput(f"the axolotl YAML does not parse: {error}".splitlines()[0]) from None
    if not isinstance(config, dict):
        raise BadInput("the axolotl YAML is not a mapping of keys")
    return cloud, config, found


def read_request(path: Path, *, preprocess: bool = False) -> Request:
    """The launcher's request file, checked: cloud.yml, then the axolotl YAML
    with the command line's overrides; with `preprocess`, a spec that only
    prepares the datasets (`axolotl.cli.preprocess`). Raises BadInput with one
    line."""
    cloud, config, found = read_files(path)
    if preprocess and cloud.resume_from is not None:
        raise BadInput(
            "cloud.yml: resume_from: a preprocessing starts from no checkpoint: remove it"
        )
    overrides: dict[str, object] = {}
    given = found.get("overrides")
    for key, value in (given if isinstance(given, dict) else {}).items():
        if key in CONFIG_KEYS:
            overrides[key] = value
        elif value not in (False, None, 0, "", []):
            raise BadInput(f"the option --{key.replace('_', '-')} is not carried by --cloud")
    try:
        spec, notes = spec_from_axolotl(config, overrides)
    except MappingError as error:
        raise BadInput(str(error)) from None
    if found.get("launcher_args"):
        notes.append("launcher arguments are not used: the target's GPUs decide the launch")
    if preprocess:
        try:
            spec = TrainingSpec.model_validate(spec.model_dump() | {"preprocess_only": True})
        except ValidationError as error:
            raise BadInput(f"the axolotl YAML: {error.errors()[0]['msg']}") from None
    return Request(cloud=cloud, spec=spec, notes=notes)


async def check_server() -> None:
    """Raises BadInput with one line when no Prefect server is set or answers."""
    if PREFECT_API_URL.value() is None:
        raise BadInput(
            "no Prefect server: start one (`prefect server start`) and set PREFECT_API_URL "
            "(`prefect config set PREFECT_API_URL=http://127.0.0.1:4200/api`)"
        )
    async with get_client() as client:
        problem = await client.api_healthcheck()
    if problem is not None:
        raise BadInput(
            f"no Prefect server answers at {PREFECT_API_URL.value()}: start it "
            "(`prefect server start`) or fix PREFECT_API_URL"
        )


async def check_before_anything(request: Request) -> None:
    """What must hold before a flow run exists: a Prefect server answers, the
    target block exists (with the bounds cloud.yml overrides), the deployment
    exists, and the `train` flow's own pre-flight checks pass (local datasets
    and their rows, the model's context, what the target's GPUs can run), and,
    on a machine you own, its job venv's axolotl knows every key (the probe).
    With a deployment, notes the runs directory its worker records runs in
    (`Request.runs_dir`): local inputs need one this machine reaches.
    Raises BadInput with one line."""
    await check_server()
    async with get_client() as client:
        if request.cloud.deployment is not None:
            try:
                found = await client.read_deployment_by_name(request.cloud.deployment)
            except ObjectNotFound:
                raise BadInput(
                    f"no deployment {request.cloud.deployment}: deploy it (`prefect deploy`) "
                    "or fix `deployment:` in cloud.yml"
                ) from None
            request.runs_dir = request.cloud.runs_dir or deployment_runs_dir(found.job_variables)
    try:
        place = await target_named(request.cloud.target, TERMINAL, request.cloud.bounds())
    except (UnknownTarget, AmbiguousTarget, SettingsError) as error:
        raise BadInput(str(error)) from None
    inputs = local_inputs(request.spec)
    if request.cloud.deployment is not None and inputs and request.runs_dir is None:
        raise BadInput(
            f"{inputs[0]} is here, which a deployment's worker cannot read, and the runs "
            f"directory of {request.cloud.deployment} is not known here: set `runs_dir:` in "
            "cloud.yml to the one its workers use (a bucket, or a directory both reach), and "
            "it is uploaded there"
        )
    try:  # the flow's own checks, then what the target's axolotl would refuse
        facts = await training_checks(request.spec, place, TERMINAL)
        if facts.modules:  # probed: a machine you own (a pod's is known once it exists)
            AxolotlTrainer(request.spec).check(facts)
    except (TrainError, ExecError) as error:
        raise BadInput(str(error).splitlines()[0]) from None


def deployment_runs_dir(job_variables: dict[str, Any] | None) -> str | None:
    """The runs directory a deployment's flow runs record runs in (its job
    variables' OVERBRAINER_RUNS_DIR) when this machine can reach it too: an
    object store's URL or an absolute path; else None (its worker's own
    `runs/`, or a path relative to its clone)."""
    env = (job_variables or {}).get("env")
    named = env.get(RUNS_ROOT_ENV) if isinstance(env, dict) else None
    if not isinstance(named, str) or not named.strip():
        return None
    named = named.strip()
    return named if is_url(named) or Path(named).is_absolute() else None


async def stage_inputs(request: Request) -> None:
    """With a deployment, puts the local datasets and base model folder of the
    request's spec into its runs directory (`trainers.uploads`), each checked
    there, for its worker to read (`Request.uploads`, the `train` flow's
    `uploads`); one line each on the terminal. Raises BadInput with one line
    when the store cannot be used or refuses one."""
    if request.cloud.deployment is None or request.runs_dir is None:
        return
    inputs = local_inputs(request.spec)
    if not inputs:
        return
    try:
        runs = await runs_at(request.runs_dir)
        for local in inputs:
            made = await asyncio.to_thread(upload, runs, local)
            request.uploads.append(made)
            size, count = sum(each.size for each in made.files), len(made.files)
            say(
                f"uploaded {local} ({count} file{'s' if count != 1 else ''}, {size} bytes, "
                f"SHA-256 checked) to {runs.store.where(made.key)}"
            )
    except (StoreError, UploadError) as error:
        raise BadInput(str(error).splitlines()[0]) from None


@dataclass
class Following:
    """The flow run being followed, what it said, and the Ctrl-C question."""

    cloud: CloudConfig
    preprocess: bool = False
    flow_run_id: UUID | None = None
    run_id: str | None = None
    asked_at: float | None = None
    answering: bool = False
    acting: asyncio.Task[None] | None = None
    flow_task: asyncio.Task[Any] | None = None
    actions: list[str] = field(default_factory=list)

    def heard(self, message: str) -> None:
        """Notes the run's ID from a log line of the flow."""
        if self.run_id is None:
            found = RUN_ID.search(message)
            if found is not None:
                self.run_id = found[1]

    def interrupted(self) -> None:
        """SIGINT: asks the question once (a SIGINT echoed by the launcher, or
        one while the question is open, is the same Ctrl-C)."""
        now = time.monotonic()
        if self.answering or (self.asked_at is not None and now - self.asked_at < ECHO_S):
            return
        self.asked_at = now
        self.answering = True
        self.acting = asyncio.get_running_loop().create_task(self._ask())

    async def _ask(self) -> None:
        try:
            print(f"\n{QUESTION}", end="", file=sys.stderr, flush=True)
            answer = await _read_answer()
        finally:
            self.answering = False
        if answer is None:
            say("no answer: the run goes on, followed here")
            return
        await self._do(answer)

    async def _do(self, answer: str) -> None:
        run_id = self.run_id
        if answer == "l":
            self._leave()
        if answer not in ("s", "c"):
            say(f"{answer!r} is none of s, c, l: the run goes on, followed here")
            return
        if run_id is None:
            say("no run exists yet: the flow run is cancelled before it creates one")
            await self._cancel_flow_run()
            return
        if answer == "s" and self.preprocess:
            say("a preprocessing keeps no checkpoint to go on from: it is cancelled instead")
            answer = "c"
        if answer == "c":
            say(f"cancelling run {run_id}: its job is cancelled, what it left retrieved")
            if self.cloud.deployment is not None:
                await self._cancel_flow_run()
                return
            await _in_own_thread(lambda: cancel(run_id=run_id, runs_dir=self.cloud.runs_dir))
            return
        say(f"asking run {run_id} for a checkpoint, then a stop")
        await _in_own_thread(lambda: stop(run_id=run_id, runs_dir=self.cloud.runs_dir))

    def _leave(self) -> None:
        if self.run_id is not None:
            say(
                f"left running: run {self.run_id} goes on on {self.cloud.target}; follow it "
                f"again with the attach flow (run_id={self.run_id}) or leave it to the collect "
                f"deployment; cancel it with the cancel flow (run_id={self.run_id})"
            )
        else:
            say(f"left running: the flow run {self.flow_run_id} goes on without this terminal")
        sys.stdout.flush()
        os._exit(LEFT_RUNNING)  # the job goes on detached; nothing here may end it

    async def _cancel_flow_run(self) -> None:
        if self.cloud.deployment is None:
            if self.flow_task is not None:
                self.flow_task.cancel()
            return
        if self.flow_run_id is not None:
            async with get_client() as client:
                await client.set_flow_run_state(self.flow_run_id, Cancelling(), force=True)


async def _read_answer() -> str | None:
    """The first letter of the terminal's answer; None at end of input or
    after ANSWER_WAIT_S."""
    loop = asyncio.get_running_loop()
    answered: asyncio.Future[str] = loop.create_future()

    def give(line: str) -> None:
        if not answered.done():
            answered.set_result(line)

    def read() -> None:  # a daemon thread: a read nobody answers never holds the exit
        line = sys.stdin.readline()
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(give, line)

    threading.Thread(target=read, name="overbrainer-answer", daemon=True).start()
    try:
        line = await asyncio.wait_for(answered, ANSWER_WAIT_S)
    except TimeoutError:
        return None
    line = line.strip().lower()
    return line[:1] if line else None


async def _in_own_thread(make: Callable[[], Coroutine[Any, Any, Any]]) -> None:
    """Runs the flow `make()` to its end in a thread of its own (its own loop
    and context: a flow run of its own, not a subflow of the one followed);
    one line when it fails."""
    failed: list[BaseException] = []

    def go() -> None:
        try:
            asyncio.run(make())
        except BaseException as error:
            failed.append(error)

    thread = threading.Thread(target=go, name="overbrainer-ctrl-c", daemon=True)
    thread.start()
    while thread.is_alive():
        await asyncio.sleep(0.2)
    if failed:
        say(f"that did not work: {str(failed[0]).splitlines()[0] if str(failed[0]) else failed[0]}")


class _RunIdHandler(logging.Handler):
    """Hands every flow log line to `Following.heard`."""

    def __init__(self, following: Following) -> None:
        super().__init__(logging.INFO)
        self.following = following

    def emit(self, record: logging.LogRecord) -> None:
        self.following.heard(record.getMessage())


def ui_link(flow_run_id: UUID) -> str:
    """The flow run's page in the Prefect UI."""
    base = PREFECT_UI_URL.value()
    if not base:
        api = str(PREFECT_API_URL.value() or "")
        base = api.removesuffix("/").removesuffix("/api")
    return f"{str(base).rstrip('/')}/runs/flow-run/{flow_run_id}"


def parameters(request: Request) -> dict[str, object]:
    """The `train` flow's parameters for `request`."""
    found: dict[str, object] = {
        "target": request.cloud.target,
        "training": request.spec.model_dump(mode="json"),
    }
    if request.cloud.runs_dir is not None:
        found["runs_dir"] = request.cloud.runs_dir
    if request.cloud.resume_from is not None:
        found["resume_from"] = request.cloud.resume_from
    if request.cloud.bounds():
        found["bounds"] = request.cloud.bounds()
    if request.uploads:
        found["uploads"] = [made.model_dump(mode="json") for made in request.uploads]
    return found


async def run_here(request: Request, following: Following) -> int:
    """The `train` flow in this process; its log lines reach the terminal
    through Prefect's console handler."""
    params = parameters(request)
    async with get_client() as client:
        flow_run = await client.create_flow_run(train, parameters=params)
    following.flow_run_id = flow_run.id
    say(f"the flow run: {ui_link(flow_run.id)}")
    handler = _RunIdHandler(following)
    flow_logs = logging.getLogger("prefect.flow_runs")
    flow_logs.addHandler(handler)
    try:
        following.flow_task = asyncio.create_task(
            run_flow_async(train, flow_run=flow_run, parameters=params, return_type="state")
        )
        try:
            state = await following.flow_task
        except asyncio.CancelledError:
            say("cancelled before any run existed: nothing was created on the target")
            return NOT_SUCCEEDED
    finally:
        flow_logs.removeHandler(handler)
    if following.acting is not None and not following.acting.done():
        await following.acting  # a stop or cancel flow still ending
    assert isinstance(state, State)
    return await _ended(state)


async def run_deployed(request: Request, following: Following) -> int:
    """A run of cloud.yml's deployment, its logs read back from the server and
    printed here until it ends."""
    assert request.cloud.deployment is not None
    flow_run = await arun_deployment(
        request.cloud.deployment, parameters=parameters(request), timeout=0
    )
    assert isinstance(flow_run, FlowRun)
    following.flow_run_id = flow_run.id
    say(f"the flow run: {ui_link(flow_run.id)}")
    return await follow_deployed(flow_run, request, following)


async def follow_deployed(flow_run: FlowRun, request: Request, following: Following) -> int:
    """Prints the log of a deployment's flow run as the server gets it, until
    the run is final and its log read whole (LATE_LOGS_S); the exit code of
    how it ended (`_deployed_end`). A server that cannot be reached raises
    what the Prefect client raises."""
    seen = flow_run.created
    printed: set[UUID] = set()
    succeeded_line = ended_line = False  # a line "run R succeeded: ...", "run R <end>: ..."
    final_at: float | None = None  # when its flow run was first seen final
    ends = time.monotonic() + FOLLOW_BOUND_S
    async with get_client() as client:
        while time.monotonic() < ends:
            logs = await client.read_logs(
                log_filter=LogFilter(
                    flow_run_id=LogFilterFlowRunId(any_=[flow_run.id]),
                    timestamp=LogFilterTimestamp(after_=seen),
                ),
                sort=LogSort.TIMESTAMP_ASC,
                limit=200,
            )
            logs = [log for log in logs if log.id not in printed]  # `after_` is inclusive
            for log in logs:
                if log.timestamp != seen:
                    printed.clear()  # only those of the newest timestamp can come again
                seen = log.timestamp
                printed.add(log.id)
                following.heard(log.message)
                succeeded_line |= f" {RunState.SUCCEEDED}:" in log.message
                ended_line |= any(f" {end}:" in log.message for end in RunState if end.ended)
                level = logging.getLevelName(log.level)
                print(f"{log.timestamp:%H:%M:%S} | {level:<7} | {log.message}", flush=True)
            current = await client.read_flow_run(flow_run.id)
            if current.state is not None and current.state.is_final():
                final_at = final_at or time.monotonic()
                if not logs and _no_more_logs(current.state, ended_line, final_at):
                    return await _deployed_end(current.state, succeeded_line, request, following)
            await asyncio.sleep(POLL_S)
    say(f"still running after {FOLLOW_BOUND_S / 86400:.0f} days: left to its worker")
    return LEFT_RUNNING


def _no_more_logs(state: State, run_ended: bool, final_at: float) -> bool:
    """Whether a final flow run's log is read whole (see LATE_LOGS_S):
    `run_ended`, whether its line saying how its run ended came."""
    waited = time.monotonic() - final_at
    if state.is_completed():
        return run_ended or waited >= LATE_LOGS_S
    return waited >= 2 * float(PREFECT_LOGGING_TO_API_BATCH_INTERVAL.value())


async def _deployed_end(
    state: State, succeeded: bool, request: Request, following: Following
) -> int:
    """How a deployment's run ended, with its verified files when it
    succeeded and its runs directory is reachable here; its exit code."""
    if not (state.is_completed() and succeeded):
        message = (state.message or "no message").strip().splitlines()[0]
        say(f"the flow run ended {state.name}: {RAISED.sub('', message)}")
        return NOT_SUCCEEDED
    run_id = following.run_id
    if request.runs_dir is None or run_id is None:
        say("the run succeeded; its files are in its run directory on the deployment's side")
        return SUCCEEDED
    try:
        runs = await runs_at(request.runs_dir)
        files = await asyncio.to_thread(load_manifest, runs, run_id)
    except StoreError as error:
        say(f"run {run_id} succeeded; its files cannot be listed here: {error}")
        return SUCCEEDED
    say(f"run {run_id} succeeded: {len(files)} files verified in {runs.where_of(run_id)}")
    for entry in files:
        print(f"  {entry.sha256}  {entry.size:>12}  {entry.path}", flush=True)
    return SUCCEEDED


async def _ended(state: State) -> int:
    """Prints how the run ended (its verified files when it succeeded); its exit code."""
    if not state.is_completed():
        message = (state.message or "no message").strip().splitlines()[0]
        say(f"the flow run ended {state.name}: {message}")
        return NOT_SUCCEEDED
    result = await state.result()
    if not isinstance(result, RunResult):
        say(f"the flow run ended {state.name} without a run's result")
        return NOT_SUCCEEDED
    if result.state == RunState.STOPPED:
        say(
            f"run {result.run_id} stopped with a checkpoint, retrieved in {result.run_dir}: "
            f"resume it with `resume_from: {result.run_id}` in cloud.yml and the same command"
        )
        return NOT_SUCCEEDED
    if result.state != RunState.SUCCEEDED:
        say(f"run {result.run_id} {result.state}: {result.message or ''} {result.next}".strip())
        return NOT_SUCCEEDED
    say(f"run {result.run_id} succeeded: {len(result.files)} files verified in {result.run_dir}")
    for entry in result.files:
        print(f"  {entry.sha256}  {entry.size:>12}  {entry.path}", flush=True)
    return SUCCEEDED


async def train_from_axolotl(request_file: Path, *, preprocess: bool = False) -> int:
    """The whole `axolotl train --cloud` (with `preprocess`, `axolotl preprocess
    --cloud`: a run of the `train` flow that only prepares the datasets, its
    `prepared/` retrieved and verified as the run's files): checks, runs,
    follows; the exit code."""
    try:
        request = read_request(request_file, preprocess=preprocess)
        for note in request.notes:
            say(note)
        await check_before_anything(request)
        await stage_inputs(request)
    except BadInput as error:
        say(str(error))
        return BAD_INPUT
    following = Following(cloud=request.cloud, preprocess=preprocess)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, following.interrupted)
    try:
        if request.cloud.deployment is not None:
            return await run_deployed(request, following)
        return await run_here(request, following)
    finally:
        loop.remove_signal_handler(signal.SIGINT)


def trained_run(runs: Runs, base_model: str) -> str:
    """The newest succeeded training (not a preprocessing) of `base_model` in
    `runs`: the run `axolotl lm-eval --cloud` evaluates when cloud.yml names
    none. Raises BadInput with one line when there is none."""
    found = [
        record
        for record in runs.list()
        if record.state == RunState.SUCCEEDED
        and (record.spec or {}).get("base_model") == base_model
        and not (record.spec or {}).get("preprocess_only")
    ]
    if not found:
        raise BadInput(
            f"no succeeded training of {base_model} in {runs.where}: train it first "
            "(`axolotl train config.yml --cloud cloud.yml`) or name a run with `run_id:` in "
            "cloud.yml"
        )
    return max(found, key=lambda record: record.id).id


def evaluation_of(cloud: CloudConfig, config_dir: Path) -> EvaluationSpec | None:
    """cloud.yml's `evaluation:`, checked, its files made absolute from
    `config_dir` (cloud.yml's directory). Raises BadInput with one line."""
    if cloud.evaluation is None:
        return None
    values = dict(cloud.evaluation)
    for key in ("eval_file", "controls_file"):
        value = values.get(key)
        if isinstance(value, str) and value:
            values[key] = str((config_dir / Path(value).expanduser()).resolve())
    try:
        return EvaluationSpec.model_validate(values)
    except (ValidationError, BadEvaluationInput) as error:
        if isinstance(error, ValidationError):
            first = error.errors()[0]
            where = ".".join(str(part) for part in first["loc"])
            message = str(first["msg"]).removeprefix("Value error, ")
            raise BadInput(f"cloud.yml: evaluation.{where}: {message}") from None
        raise BadInput(f"cloud.yml: evaluation: {str(error).splitlines()[0]}") from None


async def lm_eval_from_axolotl(request_file: Path) -> int:
    """The whole `axolotl lm-eval --cloud`: the `evaluate` flow, in this
    process, on cloud.yml's `run_id` (else the newest succeeded training of the
    YAML's base model in the runs directory) on cloud.yml's target; prints the
    flow run's UI link, its log lines, then the verdict. Exit code 0 when the
    evaluation ended with a verdict, 1 when it did not, 2 for bad input
    (nothing created)."""
    try:
        cloud, config, found = read_files(request_file)
        evaluation = evaluation_of(cloud, Path(str(found.get("config_dir") or ".")))
        if not config.get("base_model") and cloud.run_id is None:
            raise BadInput("the axolotl YAML has no base_model: name the run with `run_id:`")
        await check_server()
        try:
            runs = await runs_at(cloud.runs_dir)
        except StoreError as error:
            raise BadInput(str(error).splitlines()[0]) from None
        run_id = cloud.run_id or trained_run(runs, local_model(str(config["base_model"])))
        if cloud.deployment is not None:
            say(f"lm-eval runs the evaluate flow here, not as a run of {cloud.deployment}")
    except BadInput as error:
        say(str(error))
        return BAD_INPUT
    params: dict[str, object] = {"run_id": run_id, "target": cloud.target}
    if evaluation is not None:
        params["evaluation"] = evaluation.model_dump(mode="json")
    if cloud.runs_dir is not None:
        params["runs_dir"] = cloud.runs_dir
    async with get_client() as client:
        flow_run = await client.create_flow_run(evaluate, parameters=params)
    say(f"evaluating run {run_id}: {ui_link(flow_run.id)}")
    running = run_flow_async(evaluate, flow_run=flow_run, parameters=params, return_type="state")
    flow_task: asyncio.Task[Any] = asyncio.create_task(running)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, _cancel_at_ctrl_c, flow_task)
    try:
        state = await flow_task
    except asyncio.CancelledError:
        return await _evaluation_cancelled(flow_run.id)
    finally:
        loop.remove_signal_handler(signal.SIGINT)
    assert isinstance(state, State)
    if not state.is_completed():
        message = (state.message or "no message").strip().splitlines()[0]
        say(f"the evaluation ended {state.name}: {RAISED.sub('', message)}")
        return NOT_SUCCEEDED
    result = await state.result()
    if not isinstance(result, EvaluationResult):
        say(f"the evaluation ended {state.name} without a verdict")
        return NOT_SUCCEEDED
    say(f"run {run_id}: {verdict(result)}")
    return SUCCEEDED


def _cancel_at_ctrl_c(flow_task: asyncio.Task[Any]) -> None:
    """SIGINT during an evaluation: it keeps nothing to go on from, so it is
    cancelled at once (a second SIGINT, the launcher's echo, does nothing)."""
    if flow_task.done() or flow_task.cancelling():
        return
    say("Ctrl-C: cancelling the evaluation: its job is cancelled, what it ran on ended")
    flow_task.cancel()


async def _evaluation_cancelled(flow_run_id: UUID) -> int:
    """Ends what the evaluation's flow run started (the `on_cancellation`
    hook a worker's cancellation runs: its jobs cancelled, what they ran on
    ended) and records the flow run cancelled; the exit code (1)."""
    async with get_client() as client:
        flow_run = await client.read_flow_run(flow_run_id)
    ended: State[Any] = Cancelled(message="cancelled at Ctrl-C in the terminal")
    await on_cancelled(evaluate, flow_run, ended)
    async with get_client() as client:
        await client.set_flow_run_state(flow_run_id, ended, force=True)
    say("the evaluation was cancelled: run `axolotl lm-eval` again to evaluate the run")
    return NOT_SUCCEEDED


COMMANDS = ("train", "preprocess", "lm_eval")
"""What the launcher hands over (axolotl's `train`, `preprocess`, `lm-eval`)."""


def main(argv: list[str]) -> int:
    """`python -m overbrainer_prefect.axolotl_cloud COMMAND REQUEST`: the exit code."""
    if len(argv) != 2 or argv[0] not in COMMANDS:
        say(f"usage: python -m overbrainer_prefect.axolotl_cloud {'|'.join(COMMANDS)} REQUEST")
        return BAD_INPUT
    if argv[0] == "lm_eval":
        return asyncio.run(lm_eval_from_axolotl(Path(argv[1])))
    return asyncio.run(train_from_axolotl(Path(argv[1]), preprocess=argv[0] == "preprocess"))
