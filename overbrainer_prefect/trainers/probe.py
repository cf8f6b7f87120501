"""The probe of a target's job environment: which Python, how many GPUs, which modules.

Before a run is started, the job venv's Python is run once on the target with
a small script that prints one JSON line: the GPUs and their lowest compute
capability (what decides bf16 and FlashAttention), and the modules' versions.
Modules are looked up without being imported (axolotl takes twenty seconds to
import, torch three): a CPU build of torch is told by its `version.py`, and the
GPUs of a CUDA build are counted by the CUDA driver, as torch would count them
(none where the driver library is not there: PyPI's torch for Linux is a CUDA
build, which the job env on Python 3.12 has on a CPU-only machine too); torch
is imported only for another build (ROCm).
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Sequence

from overbrainer_prefect.executors.base import CommandResult
from overbrainer_prefect.trainers.base import TargetFacts, TrainError

PROBE_MARK = "OVERBRAINER-PROBE "
"""Starts the probe's JSON line, so that whatever else the interpreter prints is ignored."""

MISSING_CODES = (126, 127)  # a shell's exit codes for a command it cannot find or run

DISTRIBUTIONS = {"llama_cpp": "llama-cpp-python"}
"""The distribution of a module whose name differs from its own: looked up by
name, where finding it otherwise scans every installed distribution (half a
second in an axolotl venv, for each export, compare and evaluation job)."""

PROBE_SCRIPT = """\
import ctypes, importlib.metadata as md, importlib.util, json, os, sys
mods = {}
dists = @DISTRIBUTIONS@
for name in sys.argv[1:]:
    version = None
    try:
        if importlib.util.find_spec(name) is not None:
            try:
                version = md.version(dists.get(name, name))
            except md.PackageNotFoundError:
                dists = md.packages_distributions().get(name) or []
                version = md.version(dists[0]) if dists else "unknown"
    except Exception:
        version = None
    mods[name] = version
def torch_build():
    # torch/version.py names the accelerator torch was built for; reading it costs
    # nothing, where importing torch costs seconds
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return None
    found = {}
    try:
        with open(os.path.join(os.path.dirname(spec.origin), "version.py")) as file:
            exec(file.read(), found)
    except Exception:
        return "unknown"
    return "cuda" if found.get("cuda") else "hip" if found.get("hip") else None

def cuda_devices():
    # the driver's count, as torch.cuda.device_count() gets it (CUDA_VISIBLE_DEVICES applies),
    # and each device's compute capability (attributes 75 and 76: major, minor)
    lib = ctypes.CDLL("libcuda.so.1")
    count = ctypes.c_int(0)
    if lib.cuInit(0) != 0 or lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0, []
    caps = []
    for ordinal in range(count.value):
        dev, major, minor = ctypes.c_int(0), ctypes.c_int(0), ctypes.c_int(0)
        if lib.cuDeviceGet(ctypes.byref(dev), ordinal) != 0:
            continue
        if lib.cuDeviceGetAttribute(ctypes.byref(major), 75, dev) == 0 and \
                lib.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev) == 0:
            caps.append([major.value, minor.value])
    return count.value, caps

gpus, caps = 0, []
build = torch_build()
if build is not None:
    try:
        gpus, caps = cuda_devices()
    except OSError:
        # no CUDA driver library: a CUDA build sees no GPU either (torch would say so
        # after seconds of importing); any other build (ROCm) is asked itself
        if build != "cuda":
            try:
                import torch
                gpus = torch.cuda.device_count()
                caps = [list(torch.cuda.get_device_capability(i)) for i in range(gpus)]
            except Exception:
                pass
print(@MARK@ + json.dumps({"python": sys.version.split()[0], "gpus": gpus, "capabilities": caps,
                          "modules": mods}))
""".replace("@MARK@", repr(PROBE_MARK)).replace("@DISTRIBUTIONS@", repr(DISTRIBUTIONS))


def probe_command(python: str, modules: Sequence[str]) -> list[str]:
    """The command that probes the job environment of `python` for `modules`."""
    return [python, "-c", PROBE_SCRIPT, *modules]


def parse_probe(python: str, result: CommandResult) -> TargetFacts:
    """What the probe of `python` found.

    Raises TrainError when the venv has no such Python, or the probe failed or
    printed no answer.
    """
    if result.code in MISSING_CODES or (result.code != 0 and "No such file" in result.stderr):
        venv = _venv_of(python)
        raise TrainError(
            f"the job venv {venv} has no bin/python: create it with "
            f"`python3 -m venv {venv}` and install axolotl in it "
            f"(`uv pip install --python {python} axolotl`), or set the target's job_venv"
        )
    if result.code != 0:
        raise TrainError(
            f"the probe of the job venv's {python} failed (exit {result.code}): "
            f"{_last_line(result.stderr)}; run `{python} -c 'import torch'` there to see why"
        )
    for line in reversed(result.stdout.splitlines()):
        if line.startswith(PROBE_MARK):
            try:
                found = json.loads(line[len(PROBE_MARK) :])
                modules = {
                    str(k): (None if v is None else str(v)) for k, v in found["modules"].items()
                }
                caps = [(int(c[0]), int(c[1])) for c in found.get("capabilities") or []]
                return TargetFacts(
                    python=python,
                    gpus=int(found["gpus"]),
                    modules=modules,
                    compute_capability=min(caps) if caps else None,
                )
            except (ValueError, KeyError, TypeError, AttributeError):
                break
    raise TrainError(
        f"the probe of the job venv's {python} printed no answer: check that it is a Python 3 "
        "interpreter"
    )


def _venv_of(python: str) -> str:
    bin_dir = posixpath.dirname(python)
    return posixpath.dirname(bin_dir) if posixpath.basename(bin_dir) == "bin" else bin_dir


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:200] if lines else "no error output"
