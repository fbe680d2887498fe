#!/usr/bin/env bash
# Set up pyxfer in ./.venv on a fresh machine: torch first, then pyxfer built against it (never let
# build isolation pull another torch). On a CPU-only machine this installs the CPU build of torch.
#   bash scripts/setup.sh            # CPU torch (torch==2.13.0 unless PYXFER_TORCH says otherwise)
#   PYXFER_TORCH="torch" bash scripts/setup.sh   # whatever torch pip picks (CUDA on GPU machines)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${PYXFER_VENV:-.venv}
PY=${PYTHON:-python3}
if [ -z "${CUDA_HOME:-}" ] && [ -d /usr/local/cuda ]; then export CUDA_HOME=/usr/local/cuda; fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip setuptools wheel ninja
"$VENV/bin/python" -m pip install -q ${PYXFER_TORCH:-torch==2.13.0} numpy pytest
"$VENV/bin/python" -m pip install -q --no-build-isolation -e '.[test]'
"$VENV/bin/python" -c "import pyxfer, json; print('pyxfer built:', json.dumps(pyxfer.build_info()))"
