#!/usr/bin/env bash
# A venv with real Transformer Engine (PyTorch) on a machine without a GPU, for the TE integration
# tests (shared/te-on-cpu.md has the measurements behind each step):
#   - CUDA torch 2.14.1 (TE's extension links against libtorch_cuda; CPU torch cannot load it),
#   - TE's core wheels installed with --no-deps (their metadata would pull cuDNN frontend and the
#     cutlass DSL, which the import does not need),
#   - the transformer_engine_torch extension, sdist-only on PyPI: built once (~11 min on 2 cores,
#     niced) and cached under $PYXFER_CACHE (default ~/.cache/pyxfer) keyed by TE version, torch
#     version and Python tag; a cached wheel is installed as it is,
#   - pyxfer itself, built against that torch (CPU extension: the TE tests run on gloo; the CUDA
#     build check in .ci/run compiles the kernels).
#   bash scripts/te_env.sh            # venv in ./.venv-te (PYXFER_TE_VENV overrides)
#   bash scripts/te_env.sh --no-pyxfer   # TE only (a developer puts pyxfer on PYTHONPATH)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${PYXFER_TE_VENV:-.venv-te}
TE_VERSION=${PYXFER_TE_VERSION:-2.20.2}
TORCH_SPEC=${PYXFER_TE_TORCH:-torch==2.14.1}
CACHE=${PYXFER_CACHE:-$HOME/.cache/pyxfer}
PY=${PYTHON:-python3}
if [ -z "${CUDA_HOME:-}" ] && [ -d /usr/local/cuda ]; then export CUDA_HOME=/usr/local/cuda; fi
t0=$(date +%s)
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
VENV=$(cd "$VENV" && pwd)
pip() { "$VENV/bin/python" -m pip "$@"; }
pip install -q --upgrade pip setuptools wheel ninja
# TE's import needs numpy pydantic packaging onnxscript einops; pybind11 builds its extension.
pip install -q "$TORCH_SPEC" numpy pytest packaging pydantic onnxscript einops pybind11
read -r TORCH_VERSION PYTAG < <("$VENV/bin/python" -c \
  "import sys, torch; assert torch.version.cuda, 'TE needs a CUDA build of torch, got ' + torch.__version__; \
print(torch.__version__, 'cp%d%d' % sys.version_info[:2])")
CUDA_MAJOR=$("$VENV/bin/python" -c "import torch; print(torch.version.cuda.split('.')[0])")

# TE's core wheels (the 276 MB one carries libtransformer_engine.so), kept beside the built wheel.
core="$CACHE/te-$TE_VERSION/core"
if ! ls "$core"/transformer_engine_cu"$CUDA_MAJOR"-*.whl >/dev/null 2>&1; then
  mkdir -p "$core"
  pip download -q --no-deps --only-binary=:all: -d "$core" \
    "transformer-engine==$TE_VERSION" "transformer-engine-cu$CUDA_MAJOR==$TE_VERSION"
fi
pip install -q --no-deps "$core"/transformer_engine-"$TE_VERSION"-*.whl \
  "$core"/transformer_engine_cu"$CUDA_MAJOR"-"$TE_VERSION"-*.whl

# transformer_engine_torch: the cached wheel, or build it from the sdist and cache it.
key="te-$TE_VERSION/torch-$TORCH_VERSION-$PYTAG"
built="$CACHE/$key"
if ! ls "$built"/transformer_engine_torch-*.whl >/dev/null 2>&1; then
  echo "building transformer_engine_torch $TE_VERSION against torch $TORCH_VERSION ($PYTAG); ~11 min on 2 cores"
  tb=$(date +%s)
  work=$(mktemp -d)
  site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  # /usr/local/cuda here has no cuBLAS/cuSPARSE/cuDNN/NCCL headers: the torch wheel's nvidia
  # packages have them. The toolkit's own include dir must stay first (crt/ lives only there).
  inc="$site/nvidia/cu$CUDA_MAJOR/include:$site/nvidia/cudnn/include:$site/nvidia/nccl/include"
  # FORCE_BUILD: skip setup.py's download of a prebuilt wheel (no network besides the registries).
  CPLUS_INCLUDE_PATH="$inc${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}" NVTE_FRAMEWORK=pytorch \
    NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_CUDA_ARCHS=${NVTE_CUDA_ARCHS:-90} MAX_JOBS=${MAX_JOBS:-2} \
    nice -n 19 "$VENV/bin/python" -m pip wheel -q --no-deps --no-build-isolation \
      --no-binary transformer-engine-torch -w "$work" "transformer-engine-torch==$TE_VERSION"
  mkdir -p "$built"
  mv "$work"/transformer_engine_torch-*.whl "$built"/  # only a finished wheel enters the cache
  rm -rf "$work"
  echo "transformer_engine_torch built in $(( $(date +%s) - tb )) s, cached in $built"
fi
pip install -q --no-deps --force-reinstall "$built"/transformer_engine_torch-*.whl
"$VENV/bin/python" -c "import torch, transformer_engine, transformer_engine.pytorch; \
print('transformer_engine', transformer_engine.__version__, 'torch', torch.__version__)"

if [ "${1:-}" != "--no-pyxfer" ]; then
  # pyxfer's CPU extension against this venv's torch, from a copy of the tracked tree so the
  # work tree's own build (against .venv's torch) is untouched.
  src=$(mktemp -d)
  trap 'rm -rf "$src"' EXIT
  git ls-files -z | xargs -0 cp --parents -t "$src"
  (cd "$src" && PYXFER_WITH_CUDA=0 PYXFER_KERNEL_CHECK=0 nice -n 10 "$VENV/bin/python" -m pip install -q \
     --no-build-isolation --no-deps --force-reinstall .)
  (cd / && "$VENV/bin/python" -c "import pyxfer, json; print('pyxfer built:', json.dumps(pyxfer.build_info()))")
fi
echo "TE venv ready in $(( $(date +%s) - t0 )) s: $VENV"
