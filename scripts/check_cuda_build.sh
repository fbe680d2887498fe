#!/usr/bin/env bash
# CI on a machine without a GPU: compile and link the full CUDA build against a CUDA build of torch
# (in its own venv, from a copy of the tree so the CPU build is untouched), import it, and run the
# CPU tests against it. CUDA code that does not compile or link can never land.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${PYXFER_CUDA_VENV:-.venv-cuda}
if [ -z "${CUDA_HOME:-}" ] && [ -d /usr/local/cuda ]; then export CUDA_HOME=/usr/local/cuda; fi
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip setuptools wheel ninja
"$VENV/bin/python" -m pip install -q ${PYXFER_CUDA_TORCH:-torch==2.14.1} numpy pytest
"$VENV/bin/python" -c "import torch; assert torch.version.cuda, 'expected a CUDA build of torch'; print('torch', torch.__version__)"
VENV=$(cd "$VENV" && pwd)
src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT
git ls-files -z | xargs -0 cp --parents -t "$src"
cd "$src"
start=$(date +%s)
PYXFER_WITH_CUDA=1 "$VENV/bin/python" -m pip install -q --no-build-isolation --no-deps .
echo "CUDA build compiled and linked in $(( $(date +%s) - start )) s"
rm -rf pyxfer  # import the installed build, not this copy of the sources
"$VENV/bin/python" -m pyxfer doctor
"$VENV/bin/pytest" -q -p no:cacheprovider tests
