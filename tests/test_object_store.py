"""Runs in an object store (a real S3 server, moto's, on 127.0.0.1): the runs
directory given as `s3://bucket/prefix`, every record there, the job's files
put there by the target itself and checked by the store, inputs fetched from
it by the job, and workers that share nothing but the store and the Prefect
server taking each other's runs over.

- a real fine-tune and its export on a local target, nothing of a model kept
  by the worker, no store key on the target;
- two workers with their own working directory, HOME and staging directory:
  the one training on a simulated pod is SIGKILLed mid-training; the other's
  `collect`, once the dead one's lease expired, finishes the run from the
  store and deletes the pod;
- two `collect`s racing over 20 runs: each run followed exactly once;
- a store that cannot be used: refused at the start, in one line, nothing made.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from overbrainer_prefect.blocks import LocalTarget
from overbrainer_prefect.flows import collect, export, train
from overbrainer_prefect.kinds.export import ExportResult
from overbrainer_prefect.kinds.training import RunResult
from overbrainer_prefect.runpod.pod import PodRecord
from overbrainer_prefect.runs.lock import LOCK_FILE, holder_of
from overbrainer_prefect.runs.manifest import load_manifest
from overbrainer_prefect.runs.store import Runs, RunState
from overbrainer_prefect.runs_dir import CREDENTIALS_ENV
from overbrainer_prefect.steps import context
from overbrainer_prefect.steps import start as start_step
from overbrainer_prefect.store import S3Store, StoreRefused, StoreUnreachable
from overbrainer_prefect.store.lease import TTL_ENV
from overbrainer_prefect.store.s3 import OUTAGE_ENV
from tests import runpod_fixtures as on_pods
from tests.conftest import job_venv
from tests.flowrun import run
from tests.ports import free_port
from tests.runpod_sim import RunpodSim
from tests.runpod_sim.pods import SimPods
from tests.s3server import SECRET, S3Server
from tests.shelljobs import ShellTrainer
from tests.test_train_flow import kill, spec, wait_until

fast, sim, pods_of = on_pods.fast, on_pods.sim, on_pods.pods_of  # the simulator's fixtures

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
LEASE_TTL_S = 5.0  # the follow lease in these tests: a dead worker's run is free within it


@pytest.fixture
def local_target(prefect_server: None, tmp_path: Path) -> str:
    name = f"local-{uuid.uuid4().hex[:8]}"
    LocalTarget(
        job_venv=str(job_venv()), work_dir=str(tmp_path / "work"), poll_seconds=0.5, cpu_threads=1
    ).save(name)
    return name


def worker_env(home: Path, **more: str) -> dict[str, str]:
    """The environment of a worker of its own: its HOME, its staging directory,
    this session's Prefect server, the tests' lease TTL."""
    from prefect.settings import PREFECT_API_URL

    home.mkdir(parents=True, exist_ok=True)
    return dict(
        os.environ,
        HOME=str(home),
        OVERBRAINER_WORK_DIR=str(home / "staging"),
        PREFECT_API_URL=str(PREFECT_API_URL.value()),
        PYTHONPATH=str(REPO),
        **{TTL_ENV: str(LEASE_TTL_S)},
        **more,
    )


def worker(code: str, args: list[str], home: Path, log: Path) -> subprocess.Popen[bytes]:
    """`code` in a worker process of its own (its own working directory and HOME)."""
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        cwd=home,
        env=worker_env(home),
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def staged_files(home: Path) -> list[Path]:
    return [p for p in (home / "staging").rglob("*") if p.is_file()]


def assert_stored_as_manifest(runs: Runs, record_id: str) -> list[Any]:
    """Every file of the record's verified manifest is in the store, with the
    size and SHA-256 the store checked or computed."""
    manifest = load_manifest(runs, record_id)
    assert manifest
    for entry in manifest:
        info = runs.store.head(runs.key(record_id, entry.path))
        assert info is not None, entry.path
        assert (info.size, info.sha256) == (entry.size, entry.sha256), entry.path
    return manifest


def test_a_fine_tune_and_its_export_keep_their_runs_in_an_object_store(
    s3: S3Server,
    local_target: str,
    tiny: tuple[Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OVERBRAINER_WORK_DIR", str(tmp_path / "staging"))
    url = s3.bucket_url()
    result = run(train(target=local_target, training=spec(*tiny), runs_dir=url))
    assert isinstance(result, RunResult) and result.state == RunState.SUCCEEDED, result.message
    runs = Runs(url)
    assert isinstance(runs.store, S3Store) and result.run_dir == runs.where_of(result.run_id)
    record = runs.load(result.run_id)
    assert record.state == RunState.SUCCEEDED and record.not_retrieved is None
    stored = {e.path for e in assert_stored_as_manifest(runs, result.run_id)}
    assert {"job.log", "metrics.jsonl", "output/adapter_model.safetensors"} <= stored
    assert {"axolotl.yaml", "data/chat.jsonl"} <= {i.key for i in runs.files(result.run_id)}
    # the worker staged the job's inputs, and kept none of its outputs
    staged = staged_files(tmp_path)
    assert staged and not any("output" in p.parts for p in staged), staged

    exported = run(export(run_id=result.run_id, quant="q8_0", runs_dir=url))
    assert isinstance(exported, ExportResult) and exported.state == RunState.SUCCEEDED
    exports = runs.children(result.run_id, "export")
    files = assert_stored_as_manifest(exports, exported.export_id)
    assert any(f.path.endswith("-q8_0.gguf") for f in files)
    # the adapter went from the store to the export's job by signed URLs: never staged here
    export_stage = exports.run_dir(exported.export_id)
    assert not (export_stage / "model" / "adapter_model.safetensors").exists()
    fetched = json.loads((export_stage / ".inputs.json").read_text())
    assert {Path(i["path"]).name for i in fetched} >= {"adapter_model.safetensors"}
    job_dir = tmp_path / "work" / "exports" / exported.export_id
    assert (job_dir / "model" / "adapter_model.safetensors").stat().st_size == next(
        f.size for f in load_manifest(runs, result.run_id) if f.path.endswith(".safetensors")
    )
    # no store key anywhere a job runs, nor in the store
    for path in (tmp_path / "work").rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path
    for info in runs.store.objects(""):
        assert SECRET.encode() not in runs.store.read(info.key).data  # type: ignore[union-attr]


COLLECT = """
import asyncio, json, sys
from overbrainer_prefect.flows import collect
rows = asyncio.run(collect(runs_dir=sys.argv[1]))
print("ROWS " + json.dumps([[r.run_id, r.action, str(r.state)] for r in rows]), flush=True)
"""

TRAIN = """
import asyncio, json, sys
from overbrainer_prefect.flows import train
from overbrainer_prefect.trainers.spec import TrainingSpec
spec = TrainingSpec.model_validate(json.loads(sys.argv[2]))
asyncio.run(train(target=sys.argv[1], training=spec, runs_dir=sys.argv[3]))
"""


def rows_of(log: Path) -> list[list[str]]:
    line = next(x for x in log.read_text().splitlines() if x.startswith("ROWS "))
    rows: list[list[str]] = json.loads(line[5:])
    return rows


def test_a_worker_killed_mid_training_is_taken_over_by_another_from_the_store(
    prefect_server: None,
    s3: S3Server,
    sim: RunpodSim,
    pods_of: SimPods,
    tiny: tuple[Path, Path],
    tmp_path: Path,
) -> None:
    """Worker A trains on a simulated pod, its runs in the bucket; it is
    SIGKILLed (no hook) once its job logged a step. Worker B, which shares
    nothing with A but the bucket and the Prefect server, collects: once A's
    follow lease expired (LEASE_TTL_S) it follows the job to its end, the pod
    puts the files in the bucket, B checks them there and deletes the pod.
    What bills: the pod, from its create to B's delete; nothing else."""
    url = s3.bucket_url()
    name = on_pods.target(sim)
    training = spec(*tiny, max_steps=40).model_dump_json()
    a_home, b_home = tmp_path / "worker-a", tmp_path / "worker-b"
    a = worker(TRAIN, [name, training, url], a_home, tmp_path / "a.log")
    runs = Runs(url)

    def training_now() -> bool:
        records = runs.list()
        if not records or records[0].job is None:
            return False
        metrics = Path(records[0].remote_dir) / "metrics.jsonl"
        return metrics.exists() and '"log"' in metrics.read_text()

    try:
        wait_until(training_now, 300, "worker A's job to train")
    finally:
        kill(a)  # SIGKILL: A's lease is renewed no more
    (record,) = runs.list()
    assert record.state == RunState.RUNNING
    killed = time.monotonic()
    lock = runs.key(record.id, LOCK_FILE)  # A's follow lease, renewed no more, lapses
    wait_until(lambda: runs.store.holder(lock) is None, LEASE_TTL_S + 30, "A's lease to lapse")
    b = worker(COLLECT, [url], b_home, tmp_path / "b.log")
    assert b.wait(timeout=400) == 0, (tmp_path / "b.log").read_text()[-3000:]
    assert [r[0] for r in rows_of(tmp_path / "b.log")] == [record.id]
    saved = runs.load(record.id)
    assert saved.state == RunState.SUCCEEDED, saved.message
    assert_stored_as_manifest(runs, record.id)
    pod = PodRecord.load(runs, record.id)
    assert pod is not None and pod.gone and pod.deleted_by == "collector"
    assert [p for p in sim.pods() if p.name.startswith(f"ob-{record.id}-")] == []
    billed = sim.pod(pod.pod_id or "").deleted_at
    assert billed is not None and billed - time.time() < 0  # deleted, not billing
    assert time.monotonic() - killed < 400
    # B kept no model bytes: what it has of the run is its pod key, nothing from output/
    assert not any("output" in p.parts for p in staged_files(b_home))
    assert not any(p.suffix == ".safetensors" for p in staged_files(b_home))


def test_two_collects_racing_over_twenty_runs_follow_each_exactly_once(
    prefect_server: None, s3: S3Server, local_target: str, tmp_path: Path
) -> None:
    """20 runs whose jobs run with nobody following them; two collect
    processes with nothing in common but the store start at once. Each run
    is followed by exactly one of them (its follow lease), ends succeeded,
    and its files are in the store once."""
    url = s3.bucket_url()
    runs = Runs(url)
    go = tmp_path / "go"

    async def start_all() -> list[str]:
        loaded = await LocalTarget.aload(local_target)
        assert isinstance(loaded, LocalTarget)
        executor = loaded.executor(local_target)
        ctx = context.RunContext(runs=runs, executor=executor, python=loaded.python)
        trainer = ShellTrainer(
            f"while [ ! -e {go} ]; do sleep 0.2; done; "
            'printf \'{"event":"begin","max_steps":1}\\n{"event":"log","step":1,"loss":1.0}\\n'
            '{"event":"end","step":1}\\n\' >> metrics.jsonl; '
            "mkdir -p output && echo weights > output/adapter_model.safetensors"
        )
        ids = []
        for _ in range(20):
            record = start_step.create(
                runs,
                target=local_target,
                target_kind="local",
                workdir=executor.workdir,
                spec={"base_model": "/none", "datasets": ["/none.jsonl"], "max_steps": 1},
            )
            await start_step.start(ctx, trainer, record)
            ids.append(record.id)
        return ids

    ids = run(start_all())  # each recorded with its job: a collect takes it at once
    logs = [tmp_path / "c1.log", tmp_path / "c2.log"]
    collectors = [
        worker(COLLECT, [url], tmp_path / f"worker-{n}", log) for n, log in enumerate(logs)
    ]
    pids = [f"pid {collector.pid} " for collector in collectors]

    def racing() -> bool:  # both collects follow, or one took every run's follow lease
        holders = [holder_of(runs, run_id) for run_id in ids]
        both = all(any(h.startswith(pid) for h in holders) for pid in pids)
        return both or all(any(h.startswith(pid) for pid in pids) for h in holders)

    wait_until(racing, 180, "the two collects to follow the runs (hold their follow leases)")
    go.touch()
    for collector, log in zip(collectors, logs, strict=True):
        assert collector.wait(timeout=300) == 0, log.read_text()[-3000:]
    followed = [{run_id for run_id, _action, _state in rows_of(log)} for log in logs]
    assert followed[0] & followed[1] == set(), followed  # never both
    assert followed[0] | followed[1] == set(ids)  # each by one of them
    for run_id in ids:
        assert runs.load(run_id).state == RunState.SUCCEEDED
        assert_stored_as_manifest(runs, run_id)


def test_a_store_that_cannot_be_used_is_refused_before_anything_exists(
    prefect_server: None,
    s3: S3Server,
    local_target: str,
    tiny: tuple[Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(OUTAGE_ENV, "1")
    nobody = f"http://127.0.0.1:{free_port()}"
    cases = [
        (f"s3://runs-{uuid.uuid4().hex[:6]}/r?endpoint_url={nobody}", StoreUnreachable, "answer"),
        (f"s3://no-such-bucket/r?endpoint_url={s3.endpoint}", StoreRefused, "no such bucket"),
        ("gs://bucket/r", StoreRefused, "s3://bucket/prefix"),
    ]
    for url, error, said in cases:
        with pytest.raises(error) as refused:
            run(train(target=local_target, training=spec(*tiny), runs_dir=url))
        assert said in str(refused.value) and "\n" not in str(refused.value)
    assert not (tmp_path / "work").exists()  # no job was placed
    monkeypatch.setenv(CREDENTIALS_ENV, "aws-credentials/none-such")
    with pytest.raises(StoreRefused, match="cannot load the store's credentials block"):
        run(collect(runs_dir=s3.bucket_url()))


def test_the_stores_credentials_come_from_a_prefect_aws_block(
    prefect_server: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a server that checks credentials (moto with its IAM), the
    environment's keys are refused in one line; an `AwsCredentials` block
    named by OVERBRAINER_STORE_CREDENTIALS, with the store's endpoint in its
    client parameters, opens it; the secret is in no message."""
    from prefect_aws import AwsClientParameters, AwsCredentials

    with S3Server.start(tmp_path / "auth.log", auth=True) as guarded:
        key_id, secret = guarded.keys
        guarded.client().create_bucket(Bucket="runs-guarded")
        with pytest.raises(StoreRefused, match="check the credentials") as refused:
            run(collect(runs_dir=f"s3://runs-guarded/a?endpoint_url={guarded.endpoint}"))
        assert SECRET not in str(refused.value)
        name = f"store-{uuid.uuid4().hex[:8]}"
        AwsCredentials(
            aws_access_key_id=key_id,
            aws_secret_access_key=secret,
            region_name="us-east-1",
            aws_client_parameters=AwsClientParameters(endpoint_url=guarded.endpoint),
        ).save(name)
        monkeypatch.setenv(CREDENTIALS_ENV, f"aws-credentials/{name}")
        assert run(collect(runs_dir="s3://runs-guarded/b")) == []
        runs = Runs("s3://runs-guarded/b")
        assert runs.store.names("") == []  # checked, and nothing left behind by the check
