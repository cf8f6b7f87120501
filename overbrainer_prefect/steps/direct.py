"""A job's files moved between its target and an object store by the target
itself (`jobs/overbrainer_store.py`, run with the job venv's Python): this
side only signs short-lived URLs, one per file or part, and checks what the
store says it holds. No byte of a model passes through this process, and no
store key reaches the target.

- `put_files`: the job's outputs, each part's SHA-256 checked by the store
  (AWS, MinIO: signed in its URL) or computed by it and compared with the one
  the target hashed as it sent the part; the file's whole SHA-256, hashed in
  the same read, compared with the target's manifest: nothing counts as
  retrieved that the store does not hold.
- `fetch_plan`: what a job reads from the store (a run's adapter for its
  export, GGUFs for a compare), fetched and checked on the target by the job's
  first command.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
from collections.abc import Callable, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import ParamSpec, TypeVar

from overbrainer_prefect.executors.base import ExecError, Executor, FileDigest, TargetUnreachable
from overbrainer_prefect.executors.nodes import NodesExecutor, node_dir, node_rank
from overbrainer_prefect.runs.checkpoints import KeptFile
from overbrainer_prefect.runs.store import Runs
from overbrainer_prefect.store import SignedPut, Store, StoreError
from overbrainer_prefect.store.base import part_length
from overbrainer_prefect.store.digest import expected_checksum
from overbrainer_prefect.store.s3 import SLOWEST_BPS
from overbrainer_prefect.trainers.staging import SCRIPTS_DIR, STORE_MODULE, StoredInput

P = ParamSpec("P")
T = TypeVar("T")

SCRIPT = "overbrainer_store"
"""The job script that moves files (`overbrainer_prefect/jobs/overbrainer_store.py`)."""

MIN_PUT_S = 600.0  # the least time a put of a job's files is given
REACH_S = 20.0
"""How long a target tries to reach the store before its job is refused: a
job that could not put its files would train for nothing."""
REACH_ENV = "OVERBRAINER_STORE_REACH_S"  # overrides REACH_S
REACH_WHAT = "reach the store from this machine"  # how the job script's `reach` names its try


def reach_s() -> float:
    """`$OVERBRAINER_STORE_REACH_S`, else REACH_S."""
    try:
        return float(os.environ.get(REACH_ENV) or REACH_S)
    except ValueError:
        return REACH_S


FETCH_ENV = "OVERBRAINER_FETCH_PLAN"
"""The job's environment variable that carries its fetch plan (like a secret)."""


def script_source() -> str:
    """The source of the job script that moves files."""
    return resources.files("overbrainer_prefect.jobs").joinpath(f"{SCRIPT}.py").read_text()


def script_argv(python: str, command: str, *args: str) -> list[str]:
    """The command that runs the file-moving script with the target's `python`."""
    return [python, "-c", script_source(), command, *args]


async def _store(call: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """A call to the store in a thread, its failures as the target's (ExecError):
    a retrieval that cannot put its files is retried or noted like one that
    cannot reach its target."""
    try:
        return await asyncio.to_thread(call, *args, **kwargs)
    except StoreError as error:
        raise ExecError("put the files in the store", str(error)) from None


async def _run(executor: Executor, argv: list[str], stdin: bytes, timeout: float) -> str:
    result = await executor.run(argv, timeout=timeout, stdin=stdin)
    if result.code != 0:
        lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
        raise ExecError(
            "put the files in the store", lines[-1][:300] if lines else f"exit {result.code}"
        )
    return result.stdout


async def put_files(
    executor: Executor,
    python: str,
    runs: Runs,
    record_id: str,
    remote: str,
    manifest: Sequence[FileDigest],
    held: Mapping[str, KeptFile] | None = None,
    prefix: str = "",
) -> dict[str, list[str]]:
    """Has the target put the files of `manifest` (relative to its run
    directory `remote`) into the store of `runs`, under the record
    `record_id` (each at `prefix` and its path), then checks that the store
    holds every one of them, whole.
    A file the store already holds with the same SHA-256 (a retrieval tried
    again) is not put again, nor one of several parts that `held` says was
    put before (by path, e.g. a checkpoint kept while the job trained) as
    the very file the manifest lists (its size and whole SHA-256), its parts'
    SHA-256s the store's. A put in parts that does not complete is aborted
    (none of its parts stays billing). Returns the SHA-256 of each file's
    parts as the store holds it, by path.

    A job across nodes (`executors.nodes`) has each node put its own files
    (those its manifest lists under `nodes/<rank>/`, rank 0's as they are).

    Raises ExecError when the target cannot put them, the store does not
    answer, or a file the store holds is not the manifest's.
    """
    if isinstance(executor, NodesExecutor):
        return await _put_every_node(executor, python, runs, record_id, remote, manifest, held)
    store = runs.store
    held = held or {}
    todo: list[FileDigest] = []
    parts: dict[str, list[str]] = {entry.path: [entry.sha256] for entry in manifest}
    for entry in manifest:
        info = await _store(store.head, runs.key(record_id, prefix + entry.path))
        kept = held.get(entry.path)
        if entry.size > store.part_size and kept is not None and kept.digest() == entry:
            # put before as this very file (its size and whole SHA-256, hashed in the same
            # read as its parts): the store holds it when it holds those parts
            parts[entry.path] = list(kept.parts)
        if not (
            info and info.size == entry.size and info.sha256 == expected_checksum(parts[entry.path])
        ):
            todo.append(entry)
            parts[entry.path] = [entry.sha256]
    total = sum(entry.size for entry in todo)
    timeout = max(MIN_PUT_S, total / SLOWEST_BPS)
    # the parts' digests, for a store that signs them: a file of one part is its own digest,
    # a bigger one is read once more on the target to hash its parts apart
    signed_digests: dict[str, list[str]] = {}

    signing: bool = await _store(store.signs_digests)
    if todo and signing:
        signed_digests = {e.path: [e.sha256] for e in todo if e.size <= store.part_size}
        big = {
            entry.path: part_length(entry.size, store.part_size)
            for entry in todo
            if entry.size > store.part_size
        }
        if big:
            argv = script_argv(python, "parts", remote)
            signed_digests |= json.loads(
                await _run(executor, argv, json.dumps(big).encode(), timeout)
            )
    signed: list[SignedPut] = []
    completed: list[SignedPut] = []
    try:
        for entry in todo:
            key = runs.key(record_id, prefix + entry.path)
            digests = signed_digests.get(entry.path)
            signed.append(await _store(store.sign_put, key, entry.size, digests))
        if signed:
            await _put_signed(
                executor, python, store, remote, todo, signed, parts, completed, signed_digests
            )
    finally:  # a put in parts begun and not completed: its parts would bill for ever
        for put in signed:
            if put not in completed:
                await asyncio.to_thread(store.abort, put)
    for entry in manifest:
        info = await _store(store.head, runs.key(record_id, prefix + entry.path))
        want = expected_checksum(parts[entry.path])
        if info is None or info.size != entry.size or info.sha256 != want:
            found = "nothing" if info is None else f"{info.size} bytes, SHA-256 {info.sha256}"
            raise ExecError(
                "verify",
                f"{runs.where_of(record_id, prefix + entry.path)} holds {found}, not the job's "
                f"{entry.size} bytes ({entry.sha256[:12]}...)",
            )
    return parts


async def _put_every_node(
    executor: NodesExecutor,
    python: str,
    runs: Runs,
    record_id: str,
    remote: str,
    manifest: Sequence[FileDigest],
    held: Mapping[str, KeptFile] | None,
) -> dict[str, list[str]]:
    """`put_files` on each node of `executor`, one after the other, each with
    the files of `manifest` (and `held`) under its `nodes/<rank>/`; returns
    every file's parts by its path in `manifest`."""
    parts: dict[str, list[str]] = {}
    for rank, node in enumerate(executor.nodes):
        own = node_dir(rank)
        files = [
            dataclasses.replace(f, path=f.path[len(own) :])
            for f in manifest
            if node_rank(f.path) == rank
        ]
        kept = {p[len(own) :]: k for p, k in (held or {}).items() if node_rank(p) == rank}
        if files:
            where = executor.on(rank, remote)
            got = await put_files(node, python, runs, record_id, where, files, kept, own)
            parts |= {own + path: each for path, each in got.items()}
    return parts


async def _put_signed(
    executor: Executor,
    python: str,
    store: Store,
    remote: str,
    todo: Sequence[FileDigest],
    signed: list[SignedPut],
    parts: dict[str, list[str]],
    completed: list[SignedPut],
    digests: Mapping[str, Sequence[str]],
) -> None:
    """Has the target put the files `todo` by their `signed` requests, then
    completes each whose bytes sent are the listed ones, in order: its parts'
    SHA-256 into `parts`, itself into `completed`. Where the credentials
    that sign the URLs expire before every part is in (`signed_for_s`), the
    target puts what it can while they are good, and the parts it did not
    begin are signed again (`signed` updated) and put by another run, each
    from the bytes first hashed; at most one run per part. `digests`: the
    parts' SHA-256 the store signs (see `sign_put`). Raises ExecError when
    the target cannot put them or a file changed, or what the store raises."""
    timeout = max(MIN_PUT_S, sum(entry.size for entry in todo) / SLOWEST_BPS)
    pending = {
        entry.path: list(range(len(put.parts))) for entry, put in zip(todo, signed, strict=True)
    }
    etags: dict[str, list[str | None]] = {
        e.path: [None] * len(p.parts) for e, p in zip(todo, signed, strict=True)
    }
    hashed: dict[str, list[str]] = {}  # each part's SHA-256, as the first run read it
    for _ in range(1 + sum(len(put.parts) for put in signed)):  # each run puts a part at least
        valid_s = await _store(store.signed_for_s)
        plan = {
            "deadline_s": timeout,
            "valid_s": valid_s,
            "files": [
                {
                    "path": entry.path,
                    "parts": [
                        {
                            "url": put.parts[i].url,
                            "headers": dict(put.parts[i].headers),
                            "offset": put.parts[i].offset,
                            "length": put.parts[i].length,
                        }
                        for i in pending[entry.path]
                    ],
                }
                for entry, put in zip(todo, signed, strict=True)
                if pending[entry.path]
            ],
        }
        output = await _run(
            executor, script_argv(python, "put", remote), json.dumps(plan).encode(), timeout
        )
        sent = json.loads(output)
        progress = False
        for index, entry in enumerate(todo):
            if not pending[entry.path]:
                continue
            got = sent[entry.path]
            if entry.path not in hashed:  # the first run read every part of the file, in order
                if got["sha256"] != entry.sha256:  # what was sent is not what was listed
                    raise ExecError(
                        "verify",
                        f"{entry.path} changed on the target after it was listed "
                        f"({entry.sha256[:12]}... then {got['sha256'][:12]}...)",
                    )
                hashed[entry.path] = list(got["parts"])
            for i, etag, digest in zip(
                pending[entry.path], got["etags"], got["parts"], strict=True
            ):
                if digest != hashed[entry.path][i]:
                    raise ExecError(
                        "verify",
                        f"{entry.path} changed on the target while it was put (part {i + 1})",
                    )
                if etag is not None:
                    etags[entry.path][i] = etag
                    progress = True
            pending[entry.path] = [i for i, tag in enumerate(etags[entry.path]) if tag is None]
            if pending[entry.path]:
                signed[index] = await _store(
                    store.sign_again, signed[index], digests.get(entry.path), pending[entry.path]
                )
        for entry, put in zip(todo, signed, strict=True):
            if not pending[entry.path] and put not in completed:
                parts[entry.path] = hashed[entry.path]
                tags = [tag for tag in etags[entry.path] if tag is not None]
                await _store(store.complete, put, tags, parts[entry.path])
                completed.append(put)
        if not any(pending.values()):
            return
        if not progress:
            break
    raise ExecError(
        "put the files in the store",
        f"the credentials that sign {store.url}'s URLs expire before the target can put a part "
        "with them, and were not renewed: renew them (the worker's role or credentials block), "
        "then retrieve the run again with attach",
    )


async def check_reach(executor: Executor, python: str, runs: Runs, record_id: str) -> None:
    """Checks that the target reaches the store of `runs` itself and that the
    store takes its signed URLs: the target gets one byte of the record
    `record_id`'s record by a signed URL, tried for at most `reach_s()` seconds.
    Raises ExecError with one line (naming the store, never the URL) when it
    cannot."""
    url = await _store(runs.store.sign_get, runs.key(record_id, runs.record_file))
    bound = reach_s()
    plan = json.dumps({"url": url, "deadline_s": bound}).encode()
    argv = script_argv(python, "reach", ".")
    try:
        await _run(executor, argv, plan, bound + 30)
    except TargetUnreachable:
        raise
    except ExecError as error:
        said = error.message.removeprefix(f"{SCRIPT}: ").removeprefix(f"{REACH_WHAT}: ")
        raise ExecError(
            "start the job",
            f"the target cannot reach {runs.store.url} ({said}); its job could not put its "
            "files there: open the target's network to the store, or give a runs directory "
            "it reaches, then start the run again",
        ) from None


def fetch_command(python: str, remote: str) -> list[str]:
    """The job's first command when it reads files from the store: the staged
    copy of the file-moving script fetches them (its plan in FETCH_ENV)."""
    return [python, f"{SCRIPTS_DIR}/{STORE_MODULE}.py", "get", remote, "--plan-env", FETCH_ENV]


def fetch_plan(runs: Runs, inputs: Sequence[StoredInput]) -> str:
    """The fetch plan of a job's inputs (its presigned URLs: a secret of the
    job; or, for a file on the machine's network volume, its path there).
    Raises StoreError when the store cannot sign them."""
    files = [
        {
            "path": item.path,
            **(
                {"source": item.source}
                if item.source is not None
                else {"url": runs.store.sign_get(str(item.key))}
            ),
            "size": item.size,
            "sha256": item.sha256,
        }
        for item in inputs
    ]
    total = sum(item.size for item in inputs)
    return json.dumps({"files": files, "deadline_s": max(MIN_PUT_S, total / SLOWEST_BPS)})


def push_staged(runs: Runs, record_id: str, local: Path, skip: Sequence[str]) -> None:
    """Copies what this process staged for the job `record_id` in `local`
    (its configs, its datasets, its held-out rows: never a model, which the
    job fetches itself) into the object store of `runs`, so that any worker
    finds them there (an export reads the run's config, an evaluation its
    held-out rows, a resume its datasets). The top-level entries in `skip`
    (the target's own records of the job: a pod's keys) stay here.

    Raises StoreError when the store cannot take them.
    """
    for path in sorted(local.rglob("*")):
        rel = path.relative_to(local)
        if rel.parts[0] in skip or not path.is_file() or path.is_symlink():
            continue
        runs.store.put_file(path, runs.key(record_id, rel.as_posix()))
