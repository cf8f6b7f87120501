"""The tiny model and chat dataset the tests fine-tune for real, built once and cached.

`tiny_model(cache_root)` and `tiny_dataset(cache_root)` return the model
directory and the dataset file, building both on first use with the job venv's
Python (`tests/tiny_model_build.py`, about 10 s). They are cached under
`cache_root/tiny-model-<hash>`, the hash being that of the build script, so
every test session reuses them until the script changes. A build goes to a
temporary directory renamed into place, so concurrent sessions never see a
half-built model, under a file lock, so the workers of one session build it once.

    model = tiny_model(REPO / ".cache")
    data = tiny_dataset(REPO / ".cache")
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

from filelock import FileLock

REPO = Path(__file__).resolve().parents[1]
BUILD_SCRIPT = REPO / "tests" / "tiny_model_build.py"
JOB_PYTHON = Path(os.environ.get("OVERBRAINER_JOB_PYTHON", REPO / ".venv-job" / "bin" / "python"))
"""The job venv's Python: it has torch, transformers and sentencepiece."""
CACHE_ROOT = REPO / ".cache"
BUILD_TIMEOUT_S = 300.0  # a build takes about 10 s alone, more on a loaded machine


class TinyModelError(RuntimeError):
    """The tiny model could not be built; the message quotes the build's last output."""


def build_dir(cache_root: Path = CACHE_ROOT) -> Path:
    """The cached build for the current build script, built first if needed."""
    digest = hashlib.sha256(BUILD_SCRIPT.read_bytes()).hexdigest()[:12]
    target = cache_root / f"tiny-model-{digest}"
    if (target / "model" / "model.safetensors").is_file():
        return target
    cache_root.mkdir(parents=True, exist_ok=True)
    # one build at a time: the xdist workers of a session wait for the first one's
    with FileLock(cache_root / ".tiny-model.lock", timeout=BUILD_TIMEOUT_S * 2):
        if (target / "model" / "model.safetensors").is_file():
            return target
        return _build_into(target, cache_root)


def _build_into(target: Path, cache_root: Path) -> Path:
    scratch = Path(tempfile.mkdtemp(prefix=".tiny-model-", dir=cache_root))
    try:
        build_tiny_model(scratch)
        try:
            scratch.rename(target)
        except OSError:
            if not (target / "model" / "model.safetensors").is_file():
                raise  # not a concurrent build that won the race
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def tiny_model(cache_root: Path = CACHE_ROOT) -> Path:
    """The tiny Llama's directory (weights, SentencePiece tokenizer, ChatML template)."""
    return build_dir(cache_root) / "model"


def tiny_dataset(cache_root: Path = CACHE_ROOT) -> Path:
    """The 64-conversation chat dataset (JSON lines of `messages`) the tokenizer was
    trained on."""
    return build_dir(cache_root) / "chat.jsonl"


def build_tiny_model(out: Path) -> None:
    """Builds `out/model/` and `out/chat.jsonl` with the job venv's Python.

    Raises TinyModelError when the build fails or runs past BUILD_TIMEOUT_S
    (its process group is then killed)."""
    if not JOB_PYTHON.is_file():
        raise TinyModelError(f"no job venv at {JOB_PYTHON}: create it with scripts/job-env.sh")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "DO_NOT_TRACK": "1"}
    proc = subprocess.Popen(
        [str(JOB_PYTHON), str(BUILD_SCRIPT), str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise TinyModelError(f"the tiny model build ran past {BUILD_TIMEOUT_S:.0f} s") from None
    if proc.returncode != 0:
        tail = output.decode(errors="replace").strip().splitlines()[-5:]
        raise TinyModelError(f"the tiny model build failed ({proc.returncode}): {' | '.join(tail)}")


def write_dataset(path: Path) -> Path:
    """Writes the tiny chat dataset at `path` (no job venv needed) and returns it."""
    spec = importlib.util.spec_from_file_location("tiny_model_build", BUILD_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    written: Path = module.write_dataset(path)
    return written
