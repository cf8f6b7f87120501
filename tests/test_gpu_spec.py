"""The GPU side of the training spec: what each field makes of `axolotl.yaml`,
checked by axolotl's own `validate_config` in the job venv for a GPU target
(capabilities given) and for the CPU; the N-GPU launch against axolotl's
torchrun launcher; the shipped DeepSpeed configs and key list against the
pinned axolotl; the VRAM estimate on N GPUs; and, with real jobs, a failing
job's cause and the cancel of a job of two processes."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from overbrainer_prefect.executors.base import CommandResult
from overbrainer_prefect.executors.local import LocalExecutor
from overbrainer_prefect.runpod.vram import ModelShape, training_vram
from overbrainer_prefect.runs.failure import failure_cause
from overbrainer_prefect.runs.metrics import MetricsSummary
from overbrainer_prefect.runs.store import Runs, RunState
from overbrainer_prefect.steps import end as end_step
from overbrainer_prefect.steps import follow
from overbrainer_prefect.steps import start as start_step
from overbrainer_prefect.steps.context import Outcome, RunContext
from overbrainer_prefect.trainers.axolotl import AxolotlTrainer, launch_summary
from overbrainer_prefect.trainers.base import JobContext, TargetFacts, TrainError
from overbrainer_prefect.trainers.probe import PROBE_MARK, parse_probe
from overbrainer_prefect.trainers.spec import TrainingSpec
from tests.conftest import REPO

JOB_S = 300  # one job-venv check: mostly importing axolotl (10-30 s on a loaded machine)
MODULES = {"torch": "2", "axolotl": "0.19", "deepspeed": "0.17", "flash_attn": "2", "wandb": "0"}


def gpu(count: int = 1, capability: tuple[int, int] | None = (9, 0)) -> TargetFacts:
    return TargetFacts(
        python="/venv/bin/python", gpus=count, modules=MODULES, compute_capability=capability
    )


CPU = TargetFacts(python="/venv/bin/python", gpus=0, modules=MODULES)


def spec(**changes: Any) -> TrainingSpec:
    values: dict[str, Any] = {"base_model": "org/model", "datasets": ["org/chats"]}
    values.update(changes)
    return TrainingSpec.model_validate(values)


def context(run_dir: Path, facts: TargetFacts) -> JobContext:
    return JobContext(run_id="r1", run_dir=str(run_dir), cache_dir="/hf", facts=facts)


def prepared(trainer: AxolotlTrainer, run_dir: Path, facts: TargetFacts) -> dict[str, Any]:
    trainer.prepare(run_dir, context(run_dir, facts))
    loaded: dict[str, Any] = yaml.safe_load((run_dir / "axolotl.yaml").read_text())
    return loaded


def job_python(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    python = REPO / ".venv-job" / "bin" / "python"
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [str(python), *args],
        capture_output=True,
        text=True,
        timeout=JOB_S,
        check=False,
        env=clean | {"HF_HUB_OFFLINE": "1", "DO_NOT_TRACK": "1"} | (env or {}),
    )


# What the fields make of the config


def test_a_gpu_spec_asks_axolotl_for_bf16_flash_attention_packing_and_an_eval_split() -> None:
    config = AxolotlTrainer(
        spec(
            flash_attention=True,
            sample_packing=True,
            gradient_checkpointing=True,
            val_set_size=0.1,
            eval_steps=5,
            datasets=[{"path": "org/chats", "roles_to_train": ["assistant"]}],
        )
    ).config(gpu(1, (9, 0)))
    assert config["bf16"] is True and config["fp16"] is False
    assert config["attn_implementation"] == "flash_attention_2"
    assert config["sample_packing"] is True and config["pad_to_sequence_len"] is True
    assert config["eval_sample_packing"] is False
    assert config["gradient_checkpointing"] is True
    assert config["val_set_size"] == 0.1 and config["eval_steps"] == 5
    assert config["datasets"][0]["roles_to_train"] == ["assistant"]
    assert "deepspeed" not in config and "fsdp_config" not in config


@pytest.mark.parametrize(
    ("precision", "capability", "flags"),
    [
        ("auto", (8, 0), {"bf16": True, "fp16": False}),
        ("auto", (7, 5), {"bf16": False, "fp16": True}),
        ("auto", None, {"bf16": "auto"}),
        ("fp16", (9, 0), {"bf16": False, "fp16": True}),
        ("fp32", (9, 0), {"bf16": False, "fp16": False, "tf32": False}),
    ],
)
def test_precision_auto_is_bf16_from_ampere_on_and_fp16_before(
    precision: str, capability: tuple[int, int] | None, flags: dict[str, Any]
) -> None:
    config = AxolotlTrainer(spec(precision=precision)).config(gpu(1, capability))
    assert {k: config[k] for k in flags} == flags
    cpu = AxolotlTrainer(spec()).config(CPU)
    assert cpu["bf16"] is False and cpu["fp16"] is False


def test_zero3_ships_its_deepspeed_config_with_the_run(tmp_path: Path) -> None:
    trainer = AxolotlTrainer(spec(adapter="full", sharding="zero3"))
    config = prepared(trainer, tmp_path / "run", gpu(4))
    assert config["deepspeed"] == "deepspeed/zero3.json"
    shipped = json.loads((tmp_path / "run" / "deepspeed" / "zero3.json").read_text())
    assert shipped["zero_optimization"]["stage"] == 3
    assert "deepspeed" in trainer.probe_modules


def test_fsdp_is_set_by_yaml_keys_and_takes_checkpointing_into_its_own_config() -> None:
    config = AxolotlTrainer(
        spec(
            adapter="qlora",
            sharding="fsdp",
            gradient_checkpointing=True,
            extra={"fsdp_config": {"offload_params": True}},
        )
    ).config(gpu(2))
    assert config["fsdp_version"] == 2
    assert config["fsdp_config"]["activation_checkpointing"] is True
    assert config["fsdp_config"]["offload_params"] is True
    assert config["fsdp_config"]["cpu_ram_efficient_loading"] is False
    assert "gradient_checkpointing" not in config


def test_an_fsdp_config_that_is_no_mapping_is_refused_before_any_run() -> None:
    with pytest.raises(ValidationError, match="extra's fsdp_config is not a mapping"):
        spec(sharding="fsdp", extra={"fsdp_config": "offload"})


def test_trackers_are_on_only_when_asked_and_their_keys_never_in_the_job_files() -> None:
    trainer = AxolotlTrainer(
        spec(trackers=["wandb", "mlflow"], tracker_project="p", tracker_uri="http://mlflow:5000")
    )
    config = trainer.config(gpu())
    assert config["wandb_project"] == "p"
    assert config["use_mlflow"] is True and config["mlflow_experiment_name"] == "p"
    env = trainer.env(context(Path("/w/r1"), gpu()))
    assert "WANDB_MODE" not in env and env["WANDB_NAME"] == "r1"
    assert not {"WANDB_API_KEY", "MLFLOW_TRACKING_TOKEN"} & env.keys()
    assert {"wandb", "mlflow"} <= set(trainer.probe_modules)
    assert AxolotlTrainer(spec()).env(context(Path("/w/r1"), gpu()))["WANDB_MODE"] == "disabled"


def test_every_gpu_is_one_process_launched_by_torchrun() -> None:
    trainer = AxolotlTrainer(spec(sharding="zero2"))
    one = AxolotlTrainer(spec()).commands(context(Path("/w/r1"), gpu(1)))
    assert one == [
        ["/venv/bin/python", "-m", "overbrainer_run", "axolotl.cli.train", "axolotl.yaml"]
    ]
    four = trainer.commands(context(Path("/w/r1"), gpu(4)))
    assert four == [
        [
            "/venv/bin/python",
            *("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4"),
            *("-m", "overbrainer_run", "axolotl.cli.train", "axolotl.yaml"),
        ]
    ]
    assert trainer.launch(gpu(4)) == (
        "4 processes (torchrun, one a GPU) on 4 GPUs, DeepSpeed ZeRO-2: optimizer state and "
        "gradients sharded"
    )
    assert launch_summary(spec(), 0) == "1 process on the CPU"
    with pytest.raises(TrainError, match="every GPU runs one process"):
        AxolotlTrainer(spec(), processes=2).check(gpu(4))


def test_a_training_across_nodes_is_launched_by_torchrun_with_the_nodes_rendezvous() -> None:
    trainer = AxolotlTrainer(spec(nodes=2, sharding="zero2"))
    assert trainer.commands(context(Path("/w/r1"), gpu(4))) == [
        [
            "/venv/bin/python",
            *("-m", "torch.distributed.run", "--nproc_per_node=4"),  # PET_* from each node
            *("-m", "overbrainer_run", "axolotl.cli.train", "axolotl.yaml"),
        ]
    ]
    one = AxolotlTrainer(spec(nodes=2)).commands(context(Path("/w/r1"), gpu(1)))
    assert one[0][1:4] == ["-m", "torch.distributed.run", "--nproc_per_node=1"]
    with pytest.raises(ValidationError, match="extra sets device_map, which spreads the model"):
        spec(nodes=2, extra={"device_map": "auto"})  # layers on one machine's GPUs only
    spec(nodes=1, extra={"device_map": "auto"})


def test_the_probe_reports_the_lowest_compute_capability() -> None:
    line = PROBE_MARK + json.dumps(
        {"python": "3.11", "gpus": 2, "capabilities": [[9, 0], [8, 6]], "modules": {}}
    )
    facts = parse_probe("/v/bin/python", CommandResult(0, line + "\n", ""))
    assert facts.gpus == 2 and facts.compute_capability == (8, 6)


def test_the_begin_event_says_how_many_processes_trained_on_how_many_gpus() -> None:
    summary = MetricsSummary.of_text(
        '{"event": "begin", "step": 0, "processes": 4, "gpus": 4}\n'
        '{"event": "log", "step": 1, "loss": 2.0}\n{"event": "log", "step": 1, "eval_loss": 2.5}\n'
    )
    assert (summary.processes, summary.gpus, summary.launch) == (4, 4, "4 processes on 4 GPUs")
    assert summary.final_loss == 2.0 and summary.final_eval_loss == 2.5


def test_the_vram_estimate_per_gpu_falls_as_sharding_spreads_the_state() -> None:
    shape = ModelShape.from_config(
        {
            "hidden_size": 4096,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "intermediate_size": 14336,
            "vocab_size": 128256,
        }
    )
    full = spec(adapter="full", sequence_len=2048, micro_batch_size=1)
    ddp = training_vram(shape, full, gpus=4)
    assert ddp == training_vram(shape, full, gpus=1)
    zero1, zero2, zero3 = (
        training_vram(shape, full.model_copy(update={"sharding": s}), gpus=4)
        for s in ("zero1", "zero2", "zero3")
    )
    assert ddp.total > zero1.total > zero2.total > zero3.total
    assert zero3.weights < ddp.weights / 3
    # across nodes the states are sharded over every node's GPUs: 2 nodes of 4 are 8 GPUs
    for sharding in ("zero1", "zero2", "zero3", "fsdp"):
        one = full.model_copy(update={"sharding": sharding})
        two = one.model_copy(update={"nodes": 2})
        assert training_vram(shape, two, gpus=4) == training_vram(shape, one, gpus=8)
        assert training_vram(shape, two, gpus=4).total < training_vram(shape, one, gpus=4).total
        assert training_vram(shape, two, gpus=1) == training_vram(shape, one, gpus=2)
    # DDP holds everything on every GPU, however many nodes
    assert training_vram(shape, full.model_copy(update={"nodes": 3}), gpus=4) == ddp


# Against the pinned axolotl, in the job venv

VALIDATE = """
import json, sys, yaml
from axolotl.cli.config import prepare_plugins
from axolotl.utils.config import validate_config
from axolotl.utils.dict import DictDefault
out = {}
for case in json.loads(sys.argv[1]):
    cfg = DictDefault(yaml.safe_load(open(case["config"])))
    prepare_plugins(cfg)
    caps = case["capabilities"]
    env = {"torch_version": "2.7.0"} if caps else None
    valid = validate_config(cfg, capabilities=caps, env_capabilities=env)
    out[case["name"]] = {k: valid.get(k) for k in case["keys"]}
print("RESULT " + json.dumps(out, default=str))
"""


@pytest.mark.slow
def test_the_generated_configs_pass_axolotls_own_validate_config(
    tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    model, data = tiny

    def caps(n: int, cc: str) -> dict[str, Any]:
        return {"bf16": cc >= "sm_80", "fp8": cc >= "sm_90", "tf32": True, "n_gpu": n,
                "compute_capability": cc}  # fmt: skip

    def tiny_spec(**changes: Any) -> TrainingSpec:
        base: dict[str, Any] = {"base_model": str(model), "datasets": [str(data)]}
        return TrainingSpec.model_validate(base | changes)

    cases = [
        (
            "gpu-1x-h100",
            tiny_spec(
                flash_attention=True,
                sample_packing=True,
                gradient_checkpointing=True,
                val_set_size=0.1,
                eval_steps=5,
                trackers=["wandb", "mlflow"],
                tracker_uri="http://127.0.0.1:5000",
                datasets=[{"path": str(data), "roles_to_train": ["assistant"], "ds_type": "json"}],
            ),
            gpu(1, (9, 0)),
            caps(1, "sm_90"),
        ),
        (
            "gpu-4x-zero3-full",
            tiny_spec(adapter="full", sharding="zero3"),
            gpu(4, (8, 0)),
            caps(4, "sm_80"),
        ),
        (
            "gpu-2x-fsdp-qlora",
            tiny_spec(adapter="qlora", sharding="fsdp", gradient_checkpointing=True),
            gpu(2, (8, 6)),
            caps(2, "sm_86"),
        ),
        ("gpu-1x-t4", tiny_spec(), gpu(1, (7, 5)), caps(1, "sm_75")),
        ("cpu", tiny_spec(gradient_checkpointing=True, val_set_size=0.1), CPU, None),
    ]
    keys = [
        *("bf16", "fp16", "attn_implementation", "sample_packing", "deepspeed", "fsdp_version"),
        *("gradient_checkpointing", "wandb_project", "use_mlflow", "val_set_size", "eval_steps"),
    ]
    payload = []
    for name, training, facts, capabilities in cases:
        run_dir = tmp_path / name
        AxolotlTrainer(training).prepare(run_dir, context(run_dir, facts))
        payload.append(
            {
                "name": name,
                "config": str(run_dir / "axolotl.yaml"),
                "capabilities": capabilities,
                "keys": keys,
            }
        )
    done = job_python(
        "-c", VALIDATE, json.dumps(payload), env={"PYTHONPATH": str(tmp_path / "cpu" / "plugins")}
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.split("RESULT ", 1)[1])
    assert result["gpu-1x-h100"]["bf16"] is True
    assert result["gpu-1x-h100"]["attn_implementation"] == "flash_attention_2"
    assert result["gpu-1x-h100"]["sample_packing"] is True
    assert result["gpu-1x-h100"]["wandb_project"] == "overbrainer"
    assert result["gpu-1x-h100"]["use_mlflow"] is True
    assert result["gpu-4x-zero3-full"]["deepspeed"] == "deepspeed/zero3.json"
    assert result["gpu-2x-fsdp-qlora"]["fsdp_version"] == 2
    assert result["gpu-1x-t4"]["fp16"] is True
    assert result["cpu"]["bf16"] is False and result["cpu"]["gradient_checkpointing"] is True


DEEPSPEED = """
import inspect, json, re, sys
from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig
source = inspect.getsource(HfTrainerDeepSpeedConfig)
filled = set(re.findall(r'"([a-z0-9_]+(?:\\.[a-z0-9_]+)*)"', source))
def autos(node, prefix=""):
    for key, value in node.items():
        name = prefix + key
        if isinstance(value, dict):
            yield from autos(value, name + ".")
        elif value == "auto":
            yield name
out = {}
for path in sys.argv[1:]:
    config = json.load(open(path))
    # what axolotl's prepare_optim_env reads to set ACCELERATE_DEEPSPEED_ZERO_STAGE
    stage = config.get("zero_optimization", {}).get("stage", None)
    out[path.rsplit("/", 1)[1]] = {"stage": stage, "unfilled": sorted(set(autos(config)) - filled)}
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow
def test_the_shipped_deepspeed_configs_are_what_axolotl_and_transformers_read() -> None:
    shipped = REPO / "overbrainer_prefect" / "trainers" / "deepspeed"
    files = sorted(str(p) for p in shipped.glob("*.json"))
    done = job_python("-c", DEEPSPEED, *files)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.split("RESULT ", 1)[1])
    assert result == {f"zero{n}.json": {"stage": n, "unfilled": []} for n in (1, 2, 3)}


@pytest.mark.slow
def test_the_shipped_key_list_matches_the_pinned_axolotl() -> None:
    done = job_python(str(REPO / "scripts" / "axolotl_keys.py"), "--check")
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]


LAUNCHER = """
import json, os
from importlib.metadata import entry_points
import axolotl.cli.utils.train as launch
seen = {}
def execvpe(file, args, env):
    seen["argv"] = args
    raise SystemExit(0)
os.execvpe = execvpe
try:
    args = ["--standalone", "--nproc_per_node=4"]
    launch._launch_torchrun_training("axolotl.yaml", {}, args, True)
except SystemExit:
    pass
script = [e.value for e in entry_points(group="console_scripts") if e.name == "torchrun"]
print("RESULT " + json.dumps({"argv": seen["argv"], "torchrun": script}))
"""


@pytest.mark.slow
def test_the_n_gpu_command_is_what_axolotls_torchrun_launcher_runs() -> None:
    done = job_python("-c", LAUNCHER)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.split("RESULT ", 1)[1])
    assert result["torchrun"] == ["torch.distributed.run:main"]
    ours = AxolotlTrainer(spec()).commands(context(Path("/w/r1"), gpu(4)))[0]
    assert result["argv"][0] == "torchrun"
    assert ours[1:3] == ["-m", "torch.distributed.run"]  # `torchrun` is this module's main
    runner = ours.index("overbrainer_run")  # runs axolotl's module as `-m` would
    assert ours[runner - 1 : runner + 2] == ["-m", "overbrainer_run", "axolotl.cli.train"]
    assert ours[3:runner] + ours[runner + 1 :] == result["argv"][1:]


# Real jobs


def local_context(tmp_path: Path, job: str) -> RunContext:
    return RunContext(
        runs=Runs(tmp_path / "runs"),
        executor=LocalExecutor(tmp_path / "work", name="box"),
        python=job,
        poll_s=0.2,
    )


@pytest.mark.slow
def test_a_failing_axolotl_job_says_why_with_the_absolute_path_of_its_log(
    tiny: tuple[Path, Path], job_python: str, tmp_path: Path
) -> None:
    model, _ = tiny
    data = tmp_path / "chat.jsonl"
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    data.write_text(json.dumps({"conversations": turns}) + "\n")
    training = TrainingSpec.model_validate(
        {"base_model": str(model), "datasets": [str(data)], "sequence_len": 64, "max_steps": 2}
    )
    with pytest.raises(TrainError, match="has no list of messages under `messages`"):
        training.check_local_files()  # what the flow refuses; the job is tried here all the same

    async def go() -> Outcome:
        ctx = local_context(tmp_path, job_python)
        trainer = AxolotlTrainer(training, cpu_threads=1)
        record = start_step.create(
            ctx.runs, target="box", target_kind="local", workdir=ctx.executor.workdir
        )
        return await follow.watch(ctx, trainer, await start_step.start(ctx, trainer, record))

    outcome = asyncio.run(go())
    local = Runs(tmp_path / "runs").run_dir(outcome.record.id)
    assert outcome.record.state == RunState.FAILED
    assert outcome.record.message == (
        "the job exited with code 1: ValueError: Messages is null. Please check "
        f"`field_messages`. (see {local}/job.log)"
    )
    assert failure_cause((local / "job.log").read_text()) in outcome.record.message


def workers_of(run_dir: str) -> list[int]:
    """The processes whose working directory is `run_dir` and that run axolotl."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cwd = os.readlink(proc / "cwd")
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if cwd == run_dir and b"axolotl.cli.train" in argv:
            found.append(int(proc.name))
    return found


@pytest.mark.slow
def test_cancel_ends_every_process_of_a_two_process_job(
    tiny: tuple[Path, Path], job_python: str, tmp_path: Path
) -> None:
    model, data = tiny
    training = TrainingSpec.model_validate(
        {"base_model": str(model), "datasets": [str(data)], "sequence_len": 64, "max_steps": 400}
    )

    async def go() -> tuple[RunState, list[int], list[int]]:
        ctx = local_context(tmp_path, job_python)
        trainer = AxolotlTrainer(training, cpu_threads=1, processes=2)
        record = start_step.create(
            ctx.runs, target="box", target_kind="local", workdir=ctx.executor.workdir
        )
        record = await start_step.start(ctx, trainer, record)
        deadline = time.monotonic() + 120
        while len(workers_of(record.remote_dir)) < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)  # torchrun and its two workers
        seen = workers_of(record.remote_dir)
        record, _, _ = await end_step.cancel(ctx, trainer, record)
        await asyncio.sleep(1.0)
        return record.state, seen, workers_of(record.remote_dir)

    state, seen, left = asyncio.run(go())
    assert len(seen) == 3, seen
    assert state == RunState.CANCELLED
    assert left == []


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
