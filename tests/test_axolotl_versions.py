"""Both axolotl release lines the trainer writes configs for, for real: the job
venv's (`make setup`: the newest, on Python 3.12) and 0.19 (on Python 3.11), in
a venv of its own that `scripts/job-env.sh` builds once (torch and axolotl
only) and that is kept outside the clone, as the llama.cpp build is. Each
one's own `validate_config` accepts the generated configs, for the CPU and for
GPU targets; each one's key list is the one shipped for its line; the probe
names each version, and the trainer checks a spec against that line's keys."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from filelock import FileLock

from overbrainer_prefect.executors.base import CommandResult
from overbrainer_prefect.trainers.axolotl import AxolotlTrainer
from overbrainer_prefect.trainers.base import JobContext, TargetFacts, TrainError
from overbrainer_prefect.trainers.keys import AXOLOTL_VERSION, keys_for
from overbrainer_prefect.trainers.probe import parse_probe, probe_command
from overbrainer_prefect.trainers.spec import TrainingSpec
from tests.conftest import REPO

pytestmark = pytest.mark.slow

OLD_AXOLOTL = "0.19.0"
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "overbrainer"
BUILD_S = 900  # from uv's cache about 30 s; on a new machine it downloads about 1 GB
JOB_S = 300  # importing axolotl: 10-30 s on a loaded machine
ENV_FILES = (REPO / "scripts" / "job-env.sh", REPO / "scripts" / "job-constraints.txt")


def old_venv() -> Path:
    """The venv of axolotl 0.19, built by job-env.sh the first time and again when
    the script or its constraints change (their digest names it), under a file
    lock so that one session's workers build it once."""
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in ENV_FILES)).hexdigest()[:12]
    venv = CACHE / f"job-env-axolotl-{OLD_AXOLOTL}-{digest}"
    if (venv / ".ok").is_file():
        return venv
    CACHE.mkdir(parents=True, exist_ok=True)
    with FileLock(CACHE / f".job-env-axolotl-{OLD_AXOLOTL}.lock", timeout=BUILD_S * 2):
        if (venv / ".ok").is_file():
            return venv
        env = os.environ | {
            "AXOLOTL": OLD_AXOLOTL,
            "JOB_ENV_TRAIN_ONLY": "1",
            "PATH": f"{REPO / '.venv' / 'bin'}:{os.environ['PATH']}",  # uv
        }
        env.pop("PYTHON", None)
        proc = subprocess.Popen(
            [str(REPO / "scripts" / "job-env.sh"), str(venv)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        try:
            output, _ = proc.communicate(timeout=BUILD_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            pytest.fail(f"building the axolotl {OLD_AXOLOTL} venv ran past {BUILD_S} s")
        if proc.returncode != 0:
            tail = output.decode(errors="replace").strip().splitlines()[-5:]
            pytest.fail(f"building the axolotl {OLD_AXOLOTL} venv failed: {' | '.join(tail)}")
        (venv / ".ok").touch()
        for stale in CACHE.glob(f"job-env-axolotl-{OLD_AXOLOTL}-*"):
            if stale != venv:
                shutil.rmtree(stale, ignore_errors=True)
    return venv


@pytest.fixture(scope="module")
def pythons(job_python: str) -> dict[str, str]:
    """Each axolotl line's job venv Python: the job venv's and 0.19's."""
    return {AXOLOTL_VERSION: job_python, OLD_AXOLOTL: str(old_venv() / "bin" / "python")}


CHECK = """
import json, sys
sys.path.insert(0, sys.argv[2])
import yaml
from axolotl.cli.config import prepare_plugins
from axolotl.utils.config import validate_config
from axolotl.utils.dict import DictDefault
from axolotl_keys import key_list
out = {"keys": key_list(), "configs": {}}
for case in json.loads(sys.argv[1]):
    cfg = DictDefault(yaml.safe_load(open(case["config"])))
    prepare_plugins(cfg)
    caps = case["capabilities"]
    env = {"torch_version": "2.7.0"} if caps else None
    valid = validate_config(cfg, capabilities=caps, env_capabilities=env)
    out["configs"][case["name"]] = {k: valid.get(k) for k in case["keys"]}
print("RESULT " + json.dumps(out, default=str))
"""

KEYS = [
    *("bf16", "fp16", "attn_implementation", "sample_packing", "deepspeed", "fsdp_version"),
    *("gradient_checkpointing", "adapter", "load_in_4bit", "val_set_size", "optimizer"),
]


def facts(gpus: int, capability: tuple[int, int] | None, axolotl: str) -> TargetFacts:
    modules = {"torch": "2", "axolotl": axolotl, "deepspeed": "0.17", "flash_attn": "2"}
    return TargetFacts(
        python="/venv/bin/python", gpus=gpus, modules=modules, compute_capability=capability
    )


def caps(n: int, cc: str) -> dict[str, Any]:
    return {"bf16": cc >= "sm_80", "fp8": cc >= "sm_90", "tf32": True, "n_gpu": n,
            "compute_capability": cc}  # fmt: skip


def write_configs(model: Path, data: Path, root: Path, axolotl: str) -> list[dict[str, Any]]:
    """The configs the trainer writes for a target with axolotl `axolotl`: the
    CPU's and four GPU targets'."""

    def tiny(**changes: Any) -> TrainingSpec:
        base: dict[str, Any] = {"base_model": str(model), "datasets": [str(data)]}
        return TrainingSpec.model_validate(base | changes)

    cases = [
        ("cpu", tiny(gradient_checkpointing=True, val_set_size=0.1), facts(0, None, axolotl), None),
        (
            "gpu-1x-h100",
            tiny(flash_attention=True, sample_packing=True, val_set_size=0.1, eval_steps=5),
            facts(1, (9, 0), axolotl),
            caps(1, "sm_90"),
        ),
        (
            "gpu-4x-zero3-full",
            tiny(adapter="full", sharding="zero3"),
            facts(4, (8, 0), axolotl),
            caps(4, "sm_80"),
        ),
        (
            "gpu-2x-fsdp-qlora",
            tiny(adapter="qlora", sharding="fsdp", gradient_checkpointing=True),
            facts(2, (8, 6), axolotl),
            caps(2, "sm_86"),
        ),
        ("gpu-1x-t4", tiny(), facts(1, (7, 5), axolotl), caps(1, "sm_75")),
    ]
    payload = []
    for name, spec, target, capabilities in cases:
        run_dir = root / name
        trainer = AxolotlTrainer(spec)
        trainer.check(target)
        ctx = JobContext(run_id="r1", run_dir=str(run_dir), cache_dir="/hf", facts=target)
        trainer.prepare(run_dir, ctx)
        config = str(run_dir / "axolotl.yaml")
        payload.append({"name": name, "config": config, "capabilities": capabilities, "keys": KEYS})
    return payload


def run_check(python: str, payload: list[dict[str, Any]], plugins: Path) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env |= {"HF_HUB_OFFLINE": "1", "DO_NOT_TRACK": "1", "PYTHONPATH": str(plugins)}
    argv = [python, "-c", CHECK, json.dumps(payload), str(REPO / "scripts")]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=JOB_S, env=env, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.split("RESULT ", 1)[1])
    return result


def test_each_axolotl_validates_the_generated_configs_and_has_the_shipped_keys(
    pythons: dict[str, str], tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    payloads = {v: write_configs(*tiny, tmp_path / v, v) for v in pythons}
    with ThreadPoolExecutor(len(pythons)) as pool:
        futures = {
            v: pool.submit(run_check, python, payloads[v], tmp_path / v / "cpu" / "plugins")
            for v, python in pythons.items()
        }
        results = {v: f.result() for v, f in futures.items()}
    assert set(results) == {OLD_AXOLOTL, AXOLOTL_VERSION} and OLD_AXOLOTL != AXOLOTL_VERSION
    for version, result in results.items():
        shipped = keys_for(version)
        assert shipped is not None and shipped.version == version
        assert result["keys"]["axolotl"] == version
        assert set(result["keys"]["config"]) == shipped.config, version
        assert set(result["keys"]["dataset"]) == shipped.dataset, version
        configs = result["configs"]
        cpu = configs["cpu"]
        assert cpu["bf16"] is False and cpu["fp16"] is False, version
        assert cpu["gradient_checkpointing"] is True and cpu["optimizer"] == "adamw_torch"
        assert configs["gpu-1x-h100"]["bf16"] is True, version
        assert configs["gpu-1x-h100"]["attn_implementation"] == "flash_attention_2", version
        assert configs["gpu-1x-h100"]["sample_packing"] is True, version
        assert configs["gpu-4x-zero3-full"]["deepspeed"] == "deepspeed/zero3.json", version
        assert configs["gpu-4x-zero3-full"]["adapter"] is None, version
        assert configs["gpu-2x-fsdp-qlora"]["fsdp_version"] == 2, version
        assert configs["gpu-2x-fsdp-qlora"]["load_in_4bit"] is True, version
        assert configs["gpu-1x-t4"]["fp16"] is True, version


def test_the_probe_names_each_axolotl_and_the_trainer_reads_its_keys(
    pythons: dict[str, str],
) -> None:
    newer_only = TrainingSpec.model_validate(
        {"datasets": [{"path": "org/chats", "weight": 0.5}], "extra": {"eval_on_start": True}}
    )
    for version, python in pythons.items():
        argv = probe_command(python, ["torch", "axolotl"])
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
        found = parse_probe(python, CommandResult(done.returncode, done.stdout, done.stderr))
        assert found.modules["axolotl"] == version and found.gpus == 0
        assert found.modules["torch"] is not None
        trainer = AxolotlTrainer(newer_only)
        if version == OLD_AXOLOTL:
            with pytest.raises(TrainError, match="not to the job venv's 0.19.0: install axolotl"):
                trainer.check(found)
        else:
            trainer.check(found)


def test_the_old_venv_is_kept_outside_the_clone_and_built_once(pythons: dict[str, str]) -> None:
    old = Path(pythons[OLD_AXOLOTL]).parent.parent
    assert not old.resolve().is_relative_to(REPO.resolve())
    assert (old / ".ok").is_file() and old_venv() == old
    assert "version_info = 3.11." in (old / "pyvenv.cfg").read_text()  # 0.19's own Python
