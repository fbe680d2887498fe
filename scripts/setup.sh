#!/usr/bin/env bash
# Set up pyxfer in ./.venv on a fresh machine: torch first, then pyxfer built against it (never let
# build isolation pull another torch). On a CPU-only machine this installs the CPU build of torch.
#   bash scripts/setup.sh            # CPU torch (torch==2.13.0 unless PYXFER_TORCH says otherwise)
#   PYXFER_TORCH="torch" bash scripts/setup.sh   # whatever torch pip picks (CUDA on GPU machines)
# The build (`pip install -e`) is skipped when nothing it compiles changed since the last one: a hash
# of csrc/, setup.py, pyproject.toml, the venv's torch, the build's environment (PYXFER_CUDA_ARCHS,
# PYXFER_WITH_CUDA, PYXFER_KERNEL_CHECK, CXX, CC, CUDA_HOME, nvcc) and the checkout's path (an editable
# install points at it) is kept in $VENV/.pyxfer-build; pyxfer is rebuilt when that differs, when
# `import pyxfer._C` fails outside the checkout, or with PYXFER_REBUILD=1.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${PYXFER_VENV:-.venv}
PY=${PYTHON:-python3}
if [ -z "${CUDA_HOME:-}" ] && [ -d /usr/local/cuda ]; then export CUDA_HOME=/usr/local/cuda; fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
VENV_PY=$(cd "$VENV" && pwd)/bin/python
"$VENV_PY" -m pip install -q --upgrade pip setuptools wheel ninja
"$VENV_PY" -m pip install -q ${PYXFER_TORCH:-torch==2.13.0} numpy pytest

build_hash() {
  {
    find csrc -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum
    sha256sum setup.py pyproject.toml
    "$VENV_PY" -c "import torch; print('torch', torch.__version__, torch.version.cuda)"
    env | grep -E '^(PYXFER_CUDA_ARCHS|PYXFER_WITH_CUDA|PYXFER_KERNEL_CHECK|CXX|CC|CUDA_HOME)=' | LC_ALL=C sort || true
    echo "nvcc $(command -v nvcc || true)"
    echo "checkout $PWD"
  } | sha256sum | cut -d' ' -f1
}
stamp="$VENV/.pyxfer-build"
hash=$(build_hash)
# from / : the check imports the installed pyxfer, not this directory's
if [ "${PYXFER_REBUILD:-0}" != 1 ] && [ "$(cat "$stamp" 2>/dev/null)" = "$hash" ] && \
    (cd / && "$VENV_PY" -c "import pyxfer._C") 2>/dev/null; then
  echo "pyxfer: nothing the build compiles changed since the last build ($stamp): not rebuilt"
else
  rm -f "$stamp"
  "$VENV_PY" -m pip install -q --no-build-isolation -e '.[test]'
  echo "$hash" > "$stamp"
fi
"$VENV_PY" -c "import pyxfer, json; print('pyxfer built:', json.dumps(pyxfer.build_info()))"
