"""The training spec, the axolotl trainer, its probe and its metrics plugin.

The tests check what the spec accepts and refuses, what the trainer writes
into a run directory, and the probe of the job venv. Real axolotl jobs of the
tiny model (the metrics plugin's events, a stop's checkpoint and the resume from
it) run through the train flow, in tests/test_train_flow.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

import overbrainer_prefect.jobs as overbrainer_jobs
from overbrainer_prefect.executors.base import CommandResult
from overbrainer_prefect.trainers import Trainer
from overbrainer_prefect.trainers.axolotl import CPU_FLAGS, AxolotlTrainer
from overbrainer_prefect.trainers.base import (
    METRICS_FILE,
    STOP_FILE,
    JobContext,
    TargetFacts,
    TrainError,
)
from overbrainer_prefect.trainers.keys import AXOLOTL_VERSION
from overbrainer_prefect.trainers.probe import parse_probe, probe_command
from overbrainer_prefect.trainers.spec import DatasetSpec, TrainingSpec, spec_problem

GPU = TargetFacts(python="/venv/bin/python", gpus=1, modules={"torch": "2", "axolotl": "0.19"})
CPU = TargetFacts(python="/venv/bin/python", gpus=0, modules={"torch": "2", "axolotl": "0.19"})


def make_spec(dataset: str | Path = "org/chats", **changes: Any) -> TrainingSpec:
    values: dict[str, Any] = {"base_model": "org/model", "datasets": [str(dataset)]}
    values.update(changes)
    return TrainingSpec.model_validate(values)


def context(run_dir: Path, facts: TargetFacts = CPU) -> JobContext:
    return JobContext(
        run_id="r1", run_dir=str(run_dir), cache_dir=str(run_dir.parent / "hf"), facts=facts
    )


def prepared_config(trainer: AxolotlTrainer, run_dir: Path, facts: TargetFacts) -> dict[str, Any]:
    trainer.prepare(run_dir, context(run_dir, facts))
    config: dict[str, Any] = yaml.safe_load((run_dir / "axolotl.yaml").read_text())
    return config


def one_line_error(error: ValidationError) -> str:
    return "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())


# The spec


def test_a_bare_string_is_shorthand_for_a_dataset_path() -> None:
    spec = make_spec("org/chats")
    assert spec.datasets == [DatasetSpec(path="org/chats", type="chat_template")]


def test_a_missing_local_dataset_file_is_one_line_that_says_what_to_give(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    spec = make_spec("data/x.jsonl")
    assert spec.datasets[0].is_local
    with pytest.raises(TrainError) as raised:
        spec.check_local_files()
    assert str(raised.value) == (
        "dataset file data/x.jsonl does not exist: give a path to a local .jsonl file "
        "or a Hub dataset id like org/name"
    )
    assert spec_problem(spec) == str(raised.value)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x.jsonl").write_text("{}\n")
    assert spec_problem(spec) is None


def test_a_hub_dataset_id_needs_no_local_file_even_with_a_dot_in_its_name() -> None:
    spec = make_spec("teknium/OpenHermes-2.5")
    assert not spec.datasets[0].is_local
    assert spec_problem(spec) is None


def test_a_bare_word_that_is_no_file_is_neither_local_nor_a_hub_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert spec_problem(make_spec("chats")) == (
        "dataset chats is neither a local file nor a Hub dataset id: give a path to a local "
        ".jsonl file or a Hub dataset id like org/name"
    )
    (tmp_path / "chats").mkdir()
    assert spec_problem(make_spec("chats")) is None


def test_a_nested_path_without_an_extension_is_refused_when_it_is_not_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValidationError) as raised:
        make_spec("data/sets/chats")
    assert "dataset data/sets/chats is neither a local file nor a Hub dataset id" in str(
        raised.value
    )


@pytest.mark.parametrize(
    ("changes", "field", "says"),
    [
        ({"max_steps": -3}, "max_steps", "greater than 0"),
        ({"max_steps": 0}, "max_steps", "greater than 0"),
        ({"num_epochs": 0}, "num_epochs", "greater than 0"),
        ({"learning_rate": -1e-4}, "learning_rate", "greater than 0"),
        ({"warmup_steps": -1}, "warmup_steps", "greater than or equal to 0"),
        ({"adapter": "dora"}, "adapter", "'lora', 'qlora' or 'full'"),
        ({"lora_dropout": 1.5}, "lora_dropout", "less than 1"),
        ({"datasets": []}, "datasets", "at least 1 item"),
        ({"val_set_size": 2.5}, "val_set_size", "neither a share below 1 nor a whole number"),
        ({"learning_rte": 1e-4}, "learning_rte", "Extra inputs are not permitted"),
    ],
)
def test_bad_values_are_refused_naming_the_field_and_what_it_takes(
    changes: dict[str, Any], field: str, says: str
) -> None:
    with pytest.raises(ValidationError) as raised:
        make_spec(**changes)
    message = one_line_error(raised.value)
    assert message.startswith(field), message
    assert says in message


@pytest.mark.parametrize("key", ["output_dir", "plugins", "datasets", "resume_from_checkpoint"])
def test_extra_cannot_set_a_key_the_trainer_sets_itself(key: str) -> None:
    with pytest.raises(ValidationError) as raised:
        make_spec(extra={key: "x"})
    assert f"extra sets {key}, which the trainer sets itself: remove it from extra" in str(
        raised.value
    )


def test_extra_cannot_set_a_key_that_is_a_field_of_the_spec() -> None:
    with pytest.raises(ValidationError) as raised:
        make_spec(extra={"learning_rate": 1e-3})
    assert "extra sets learning_rate, a field of its own: set the learning_rate field instead" in (
        str(raised.value)
    )


def test_every_field_of_the_spec_has_a_description_for_the_form() -> None:
    schema = TrainingSpec.model_json_schema()
    for name, field in schema["properties"].items():
        assert field.get("description"), name
    assert schema["required"] == ["datasets"]
    dataset = schema["$defs"]["DatasetSpec"]["properties"]
    assert all(field.get("description") for field in dataset.values())


def test_a_spec_survives_a_round_trip_through_its_json() -> None:
    spec = make_spec(max_steps=5, extra={"gradient_checkpointing": True})
    assert TrainingSpec.model_validate(json.loads(spec.model_dump_json())) == spec


# The trainer's files


def test_a_cpu_target_gets_the_cpu_flags_and_the_run_layout(tmp_path: Path) -> None:
    data = tmp_path / "chat.jsonl"
    data.write_text('{"messages": []}\n')
    run_dir = tmp_path / "run"
    trainer = AxolotlTrainer(make_spec(data, max_steps=6, extra={"bf16": True}))
    config = prepared_config(trainer, run_dir, CPU)

    for key, value in CPU_FLAGS.items():
        assert config[key] == value, key
    assert config["datasets"] == [{"path": "data/chat.jsonl", "type": "chat_template"}]
    assert (run_dir / "data" / "chat.jsonl").read_bytes() == data.read_bytes()
    plugin = (run_dir / "plugins" / "overbrainer_metrics.py").read_text()
    assert "class MetricsPlugin(BasePlugin)" in plugin
    assert config["plugins"] == ["overbrainer_metrics.MetricsPlugin"]
    runner = (run_dir / "plugins" / "overbrainer_run.py").read_bytes()
    assert runner == (Path(overbrainer_jobs.__file__).parent / "overbrainer_run.py").read_bytes()
    assert config["output_dir"] == "output"
    assert config["dataset_prepared_path"] == "prepared"
    assert config["logging_steps"] == 1
    assert config["overbrainer_metrics_file"] == METRICS_FILE
    assert config["overbrainer_stop_file"] == STOP_FILE
    assert config["max_steps"] == 6
    assert config["adapter"] == "lora"
    assert config["lora_target_linear"] is True
    assert "resume_from_checkpoint" not in config
    assert config["save_strategy"] == "no"


def test_extra_keys_about_saving_or_warmup_take_the_place_of_the_defaults() -> None:
    config = AxolotlTrainer(make_spec(extra={"saves_per_epoch": 2, "warmup_ratio": 0.1})).config(
        GPU
    )
    assert "save_strategy" not in config and "warmup_steps" not in config
    assert config["saves_per_epoch"] == 2 and config["warmup_ratio"] == 0.1


def test_a_gpu_target_keeps_axolotls_defaults_and_the_users_extra(tmp_path: Path) -> None:
    trainer = AxolotlTrainer(
        make_spec(extra={"bf16": True, "gradient_checkpointing": True}, save_steps=50)
    )
    config = prepared_config(trainer, tmp_path / "run", GPU)
    for key in CPU_FLAGS:
        assert key not in config or key == "bf16", key
    assert config["bf16"] is True
    assert config["gradient_checkpointing"] is True
    assert config["save_steps"] == 50
    assert "save_strategy" not in config
    assert config["datasets"] == [{"path": "org/chats", "type": "chat_template"}]
    assert "max_steps" not in config
    assert not (tmp_path / "run" / "data").exists()


def test_a_full_fine_tune_has_no_adapter_and_named_modules_replace_all_linear(
    tmp_path: Path,
) -> None:
    full = AxolotlTrainer(make_spec(adapter="full")).config(GPU)
    assert not any(key.startswith(("adapter", "lora_")) for key in full)
    lora = AxolotlTrainer(make_spec(lora_target_modules=["q_proj", "v_proj"])).config(GPU)
    assert lora["lora_target_modules"] == ["q_proj", "v_proj"]
    assert "lora_target_linear" not in lora
    qlora = AxolotlTrainer(make_spec(adapter="qlora")).config(GPU)
    assert qlora["adapter"] == "qlora" and qlora["load_in_4bit"] is True


def test_dataset_options_and_same_named_files_reach_the_config(tmp_path: Path) -> None:
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "chat.jsonl").write_text(f'{{"from": "{folder}"}}\n')
    spec = TrainingSpec.model_validate(
        {
            "base_model": "org/model",
            "datasets": [
                str(tmp_path / "a" / "chat.jsonl"),
                {"path": "org/hub", "split": "train_sft", "field_messages": "chat", "name": "en"},
                {"path": str(tmp_path / "b" / "chat.jsonl"), "type": "alpaca"},
            ],
        }
    )
    run_dir = tmp_path / "run"
    config = prepared_config(AxolotlTrainer(spec), run_dir, CPU)
    assert config["datasets"] == [
        {"path": "data/chat.jsonl", "type": "chat_template"},
        {
            "path": "org/hub",
            "type": "chat_template",
            "split": "train_sft",
            "field_messages": "chat",
            "name": "en",
        },
        {"path": "data/2-chat.jsonl", "type": "alpaca"},
    ]
    assert (run_dir / "data" / "chat.jsonl").read_text() == '{"from": "a"}\n'
    assert (run_dir / "data" / "2-chat.jsonl").read_text() == '{"from": "b"}\n'


def test_a_resumed_run_names_its_checkpoint_inside_the_run_directory(tmp_path: Path) -> None:
    config = prepared_config(
        AxolotlTrainer(make_spec(), resume_from="resume/checkpoint-3"), tmp_path / "run", CPU
    )
    assert config["resume_from_checkpoint"] == "resume/checkpoint-3"
    for outside in ("/tmp/checkpoint-3", "../r0/output/checkpoint-3", ""):
        with pytest.raises(TrainError, match="must be a directory inside the run directory"):
            AxolotlTrainer(make_spec(), resume_from=outside)


def test_qlora_on_a_target_without_a_gpu_is_refused(tmp_path: Path) -> None:
    trainer = AxolotlTrainer(make_spec(adapter="qlora"))
    with pytest.raises(TrainError, match="qlora needs a CUDA GPU"):
        trainer.check(CPU)
    with pytest.raises(TrainError, match="qlora needs a CUDA GPU"):
        trainer.prepare(tmp_path, context(tmp_path))
    trainer.check(GPU)


def test_a_job_venv_without_axolotl_is_refused_with_the_command_to_install_it() -> None:
    facts = TargetFacts(python="/x/bin/python", gpus=0, modules={"torch": "2", "axolotl": None})
    with pytest.raises(TrainError) as raised:
        AxolotlTrainer(make_spec()).check(facts)
    assert str(raised.value) == (
        "axolotl is not installed in the job venv /x/bin/python: install it with "
        "`uv pip install --python /x/bin/python axolotl` there"
    )


def test_the_job_runs_axolotl_without_telemetry_and_with_the_plugin_on_its_path(
    tmp_path: Path,
) -> None:
    trainer = AxolotlTrainer(make_spec(base_model="/models/tiny"), cpu_threads=1)
    assert isinstance(trainer, Trainer)
    ctx = context(Path("/work/r1"))
    assert trainer.commands(ctx) == [
        ["/venv/bin/python", "-m", "overbrainer_run", "axolotl.cli.train", "axolotl.yaml"]
    ]
    env = trainer.env(ctx)
    assert env["AXOLOTL_DO_NOT_TRACK"] == env["DO_NOT_TRACK"] == "1"
    assert env["WANDB_MODE"] == "disabled"
    assert env["PYTHONPATH"] == "/work/r1/plugins"
    assert env["HF_HOME"] == "/work/hf"
    assert env["OMP_NUM_THREADS"] == "1"
    assert "HF_HUB_OFFLINE" not in env  # its dataset comes from the Hub
    assert "OMP_NUM_THREADS" not in trainer.env(context(Path("/work/r1"), GPU))
    artifacts = trainer.artifacts()
    assert set(artifacts.entries) == {"output", METRICS_FILE, "axolotl.yaml"}
    assert artifacts.required == "output"
    assert not any("checkpoint" in pattern for pattern in artifacts.exclude)


SAVE_ONCE = """
import resource, sys
sys.path.insert(0, sys.argv[1])
from datasets import Dataset, load_from_disk
from overbrainer_metrics import MetricsPlugin
MetricsPlugin().register({})
MetricsPlugin().register({})  # a second registration wraps nothing more
rows = {"input_ids": [[1, 2, 3]] * 300}
dataset = Dataset.from_dict(rows)
# imports may run a child (the CUDA build of torch runs `ldconfig -p`): only the save counts
before = resource.getrusage(resource.RUSAGE_CHILDREN)
dataset.save_to_disk(sys.argv[2], num_proc=1)  # as axolotl saves its own
after = resource.getrusage(resource.RUSAGE_CHILDREN)
assert load_from_disk(sys.argv[2]).to_dict() == rows
spent = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
print(spent, Dataset.save_to_disk.__wrapped__.__name__)
"""


def test_the_plugin_saves_the_prepared_dataset_in_the_jobs_own_process(
    job_python: str, tmp_path: Path
) -> None:
    jobs = Path(overbrainer_jobs.__file__).parent
    argv = [job_python, "-c", SAVE_ONCE, str(jobs), str(tmp_path / "prepared")]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    children_cpu, wrapped = done.stdout.split()
    # datasets would spawn a pool of one and its manager: two Pythons, seconds of a core
    assert float(children_cpu) == 0.0 and wrapped == "save_to_disk"


AT_TEARDOWN = """
import os
class Marker:  # its __del__ runs when the interpreter's teardown clears this module
    def __del__(self, _open=os.open, _close=os.close, _flags=os.O_CREAT | os.O_WRONLY):
        _close(_open("teardown.done", _flags))
marker = Marker()
"""

RUN_MODULE = """
import atexit, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
import at_teardown
print("argv", sys.argv[1:], __name__, flush=True)
sys.pool = ThreadPoolExecutor(1)  # left running, its idle worker not a daemon
sys.pool.submit(int).result()
def later():
    time.sleep(0.3)
    open("thread.done", "w").write("1")
threading.Thread(target=later).start()
atexit.register(lambda: open("atexit.done", "w").write(str(threading.active_count())))
sys.stdout.write("unflushed")
how = sys.argv[1]
if how == "raise":
    raise ValueError("the module failed")
if how == "exit":
    sys.exit(3)
if how == "exit0":
    sys.exit(0)
"""


@pytest.mark.parametrize(("how", "code"), [("ok", 0), ("exit0", 0), ("raise", 1), ("exit", 3)])
def test_the_runner_runs_a_module_as_dash_m_does_and_keeps_its_exit_code_and_end(
    tmp_path: Path, how: str, code: int
) -> None:
    """What `python -m overbrainer_run M ARGS` does with a module that ends
    well, by returning or by `sys.exit(0)` (its threads waited for, an
    executor it left running told to end as Python's exit tells it, its
    atexit functions run, its output flushed, exit 0, and no teardown of the
    interpreter's modules), that raises (the traceback, 1, and the teardown)
    and that exits 3 (the teardown too)."""
    (tmp_path / "the_module.py").write_text(RUN_MODULE)
    (tmp_path / "at_teardown.py").write_text(AT_TEARDOWN)
    jobs = Path(overbrainer_jobs.__file__).parent
    env = {"PYTHONPATH": f"{jobs}:{tmp_path}", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-m", "overbrainer_run", "the_module", how],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == code, done.stderr
    assert done.stdout == f"argv ['{how}'] __main__\nunflushed"
    assert (tmp_path / "thread.done").read_text() == "1"
    assert (tmp_path / "atexit.done").read_text() == "1"  # after the thread ended
    assert ("ValueError: the module failed" in done.stderr) == (how == "raise")
    assert (tmp_path / "teardown.done").exists() == (code != 0)
    bare = subprocess.run(
        [sys.executable, "-m", "overbrainer_run"], env=env, capture_output=True, text=True
    )
    assert bare.returncode == 1 and "usage: python -m overbrainer_run MODULE" in bare.stderr


# The axolotl of the target


def on(axolotl: str | None) -> TargetFacts:
    return TargetFacts(python="/x/bin/python", gpus=0, modules={"torch": "2", "axolotl": axolotl})


def test_a_key_only_a_newer_axolotl_knows_is_refused_on_a_target_with_the_older() -> None:
    for spec, key, what in [
        (make_spec(extra={"eval_on_start": True}), "eval_on_start", "axolotl key in extra"),
        (make_spec(datasets=[{"path": "org/chats", "weight": 0.5}]), "weight", "dataset key"),
    ]:
        trainer = AxolotlTrainer(spec)
        trainer.check(on("0.21.0"))
        trainer.check(on("0.21.3"))  # a patch release reads its line's keys
        with pytest.raises(TrainError) as raised:
            trainer.check(on("0.19.0"))
        assert str(raised.value) == (
            f"{what} `{key}` is known to axolotl 0.21.0, not to the job venv's 0.19.0: install "
            f"axolotl 0.21.0 there (`uv pip install --python /x/bin/python axolotl==0.21.0`), "
            f"or remove `{key}`"
        )


def test_an_axolotl_older_than_the_oldest_line_is_refused_and_a_newer_one_checks_itself() -> None:
    trainer = AxolotlTrainer(make_spec(extra={"eval_on_start": True}))
    with pytest.raises(TrainError) as raised:
        trainer.check(on("0.18.2"))
    assert str(raised.value) == (
        "the job venv has axolotl 0.18.2 and the trainer writes configs for 0.19 or newer: "
        "upgrade it with `uv pip install --python /x/bin/python axolotl==0.21.0`"
    )
    trainer.check(on("0.22.0"))  # no key list shipped for it: axolotl validates its config
    trainer.check(on("unknown"))


# The probe


def test_the_probe_reads_the_job_venv_without_importing_axolotl(job_python: str) -> None:
    argv = probe_command(job_python, ["torch", "axolotl", "no_such_module_here"])
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    facts = parse_probe(job_python, CommandResult(done.returncode, done.stdout, done.stderr))
    assert facts.python == job_python
    assert facts.gpus == 0
    assert facts.modules["torch"] is not None and facts.modules["torch"].startswith("2.")
    assert facts.modules["axolotl"] == AXOLOTL_VERSION  # what scripts/job-env.sh installs
    assert facts.modules["no_such_module_here"] is None
    AxolotlTrainer(make_spec()).check(facts)


def test_a_job_venv_without_python_is_one_line_naming_the_venv(tmp_path: Path) -> None:
    python = str(tmp_path / "venv" / "bin" / "python")
    argv = ["sh", "-c", 'exec "$@"', "sh", *probe_command(python, ["torch"])]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 127
    with pytest.raises(TrainError) as raised:
        parse_probe(python, CommandResult(done.returncode, done.stdout, done.stderr))
    assert str(raised.value).startswith(f"the job venv {tmp_path / 'venv'} has no bin/python: ")
    assert str(raised.value).endswith("or set the target's job_venv")


def test_a_probe_that_prints_no_answer_is_refused() -> None:
    with pytest.raises(TrainError, match="printed no answer"):
        parse_probe("/v/bin/python", CommandResult(0, "hello\n", ""))
    with pytest.raises(TrainError, match=r"failed \(exit 1\): ImportError: boom"):
        parse_probe("/v/bin/python", CommandResult(1, "", "Traceback\nImportError: boom\n"))


# Real axolotl jobs on the tiny model
