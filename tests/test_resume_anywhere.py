"""Resume from anywhere: a stopped run resumes from another working directory,
training on the copy of its data the stopped run uploaded, and continues at the
checkpoint's step + 1 (a real axolotl job on the tiny model, on this machine)."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest

from overbrainer_prefect.executors.local import LocalExecutor
from overbrainer_prefect.kinds.training import resume_point, resumed_spec, stage_checkpoint
from overbrainer_prefect.runs.store import Runs, RunState
from overbrainer_prefect.steps import end as end_step
from overbrainer_prefect.steps import follow
from overbrainer_prefect.steps import start as start_step
from overbrainer_prefect.steps.context import RunContext
from overbrainer_prefect.trainers.axolotl import AxolotlTrainer
from overbrainer_prefect.trainers.spec import TrainingSpec
from tests.shelljobs import wait_for


def test_the_resumed_spec_reads_the_stopped_runs_own_copy_of_its_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "chat.jsonl").write_text(
        '{"messages": [{"role": "user", "content": "x"}]}\n'
    )
    runs = Runs(tmp_path / "runs")
    spec = TrainingSpec.model_validate({"datasets": ["data/chat.jsonl", "org/hub"]})
    record = start_step.create(
        runs, target="box", target_kind="local", workdir="/w", spec=spec.model_dump(mode="json")
    )
    copy = runs.run_dir(record.id) / "data" / "chat.jsonl"
    copy.parent.mkdir(parents=True)
    shutil.copyfile(tmp_path / "data" / "chat.jsonl", copy)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    resumed = resumed_spec(runs, runs.load(record.id))
    assert [d.path for d in resumed.datasets] == [str(copy), "org/hub"]
    resumed.check_files_exist()


@pytest.mark.slow
def test_a_stopped_run_resumes_from_another_directory_at_its_checkpoint_plus_one(
    tiny: tuple[Path, Path], job_python: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, data = tiny
    start_dir = tmp_path / "project"
    (start_dir / "data").mkdir(parents=True)
    shutil.copyfile(data, start_dir / "data" / "chat.jsonl")
    monkeypatch.chdir(start_dir)
    training = TrainingSpec.model_validate(
        {
            "base_model": str(model),
            "datasets": ["data/chat.jsonl"],  # relative to where the run starts
            "sequence_len": 64,
            "micro_batch_size": 4,
            "gradient_accumulation_steps": 1,
            "max_steps": 400,
            "learning_rate": 5e-3,
            "warmup_steps": 0,
            "lora_r": 8,
            "lora_alpha": 16,
        }
    )
    runs = Runs(tmp_path / "runs")
    ctx = RunContext(
        runs=runs, executor=LocalExecutor(tmp_path / "work"), python=job_python, poll_s=0.2
    )

    async def stop_first() -> str:
        training.check_local_files()
        trainer = AxolotlTrainer(training, cpu_threads=1)
        record = start_step.create(
            runs,
            target="box",
            target_kind="local",
            workdir=ctx.executor.workdir,
            spec=training.model_dump(mode="json"),
        )
        record = await start_step.start(ctx, trainer, record)
        metrics = Path(record.remote_dir) / "metrics.jsonl"
        await wait_for(
            lambda: metrics.is_file() and '"log"' in metrics.read_text(), 240, "a first step"
        )
        await end_step.request_stop(ctx, record)
        outcome = await follow.watch(ctx, trainer, record)
        assert outcome.record.state == RunState.STOPPED, outcome.record.message
        return record.id

    stopped_id = asyncio.run(stop_first())
    shutil.rmtree(start_dir)  # the data is only in the stopped run now
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)

    async def resume() -> tuple[int, list[int]]:
        stopped = runs.load(stopped_id)
        point = resume_point(runs, stopped)
        spec = resumed_spec(runs, stopped).model_copy(update={"max_steps": point.step + 3})
        spec.check_local_files()
        record = start_step.create(
            runs,
            target="box",
            target_kind="local",
            workdir=ctx.executor.workdir,
            spec=spec.model_dump(mode="json"),
        )
        resume_from = stage_checkpoint(runs, point, record)
        record.resumed_from = point
        runs.save(record)
        trainer = AxolotlTrainer(spec, resume_from=resume_from, cpu_threads=1)
        outcome = await follow.watch(ctx, trainer, await start_step.start(ctx, trainer, record))
        assert outcome.record.state == RunState.SUCCEEDED, outcome.record.message
        lines = (runs.run_dir(record.id) / "metrics.jsonl").read_text().splitlines()
        return point.step, [json.loads(x)["step"] for x in lines if '"log"' in x]

    step, steps = asyncio.run(resume())
    assert step >= 1
    assert steps == [step + 1, step + 2, step + 3]
