#!/usr/bin/env bash
# On a GPU machine: build pyxfer from source, run every test (GPU ones included), the doctor and the
# benchmarks, and print a short summary table last. Results (logs, JSON) go to $OUT (default ./gpu-check-out).
#   bash benchmarks/gpu_check.sh            # everything
#   PYXFER_CUDA_ARCHS=90 bash benchmarks/gpu_check.sh   # build for the named architectures only
# Environment: PYXFER_STEPS (default "build doctor tests bench benchmarks summary"), PYXFER_TESTS (pytest
# arguments, default "tests"), PYXFER_TEST_MARK (a pytest -m expression, e.g. "gpu or multigpu"), PYXFER_TEST_TIMEOUT (s), PYXFER_BENCHMARKS (scripts in benchmarks/),
# PYXFER_TEST_SHARDS (sets of pytest arguments separated by '|', run at once; tests/ has one folder per subject,
# e.g. 'tests/transfer tests/guard|tests/gather|tests/formats tests/checksum|tests/integrations tests/tools'),
# PYXFER_BENCH_PRESET, PYXFER_BENCH_ARGS (more `pyxfer bench` arguments), PYXFER_CXX (compiler).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
# keep NVLink multicast off wherever these run (shared hosts)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -z "${CUDA_HOME:-}" ] && [ -d /usr/local/cuda ]; then export CUDA_HOME=/usr/local/cuda; fi
# The GPU image sets CXX=/opt/gcc/bin/g++, which links the extension with a private copy of
# libstdc++ (no libstdc++.so dependency, its own iostream/locale instances): it crashes on its first
# error message. Build with the system compiler unless PYXFER_CXX names another.
if [ -n "${PYXFER_CXX:-}" ]; then export CXX=$PYXFER_CXX; elif [ -x /usr/bin/g++ ]; then export CXX=/usr/bin/g++ CC=/usr/bin/gcc; fi

step() { echo; echo "=== $1"; }
wants() { [[ " ${PYXFER_STEPS:-build doctor tests bench benchmarks summary} " == *" $1 "* ]]; }
status=0

if wants build; then
  step "build (PYXFER_CUDA_ARCHS=${PYXFER_CUDA_ARCHS:-default})"
  start=$(date +%s)
  log=$(mktemp)  # kept in $OUT only when the build fails
  if ! PYXFER_WITH_CUDA=1 MAX_JOBS=${MAX_JOBS:-$(nproc)} $PY -m pip install --no-build-isolation --no-deps -e . > "$log" 2>&1; then
    cp "$log" "$OUT/build.log"; grep -n -B2 -A8 "error" "$log" | head -80; tail -20 "$log"; echo "BUILD FAILED"; exit 1
  fi
  echo "built in $(( $(date +%s) - start )) s"
fi
# smoke test in a child process: an error message and a str result cross into torch (a broken
# toolchain crashes exactly there)
if ! $PY -c "import torch, pyxfer
pyxfer.build_info()
try:
    torch.ops.pyxfer.checksum_partial(torch.ones(1), -1, 0)
except RuntimeError:
    pass"; then
  echo "SMOKE TEST FAILED: pyxfer crashes on its first error message (CXX=${CXX:-c++}; try PYXFER_CXX)"; exit 1
fi
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader || true

if wants doctor; then
  step "doctor"
  $PY -m pyxfer --version
  start=$(date +%s)
  $PY -m pyxfer doctor --no-cache || status=1
  echo "doctor took $(( $(date +%s) - start )) s"
  $PY -m pyxfer doctor --json --no-cache > "$OUT/doctor.json" 2>/dev/null || true
fi

if wants tests; then
  step "tests"
  if [ -n "${PYXFER_TEST_SHARDS:-}" ]; then
    # shards run at once (each a set of pytest arguments, separated by '|'); every one shares the GPUs
    IFS='|' read -ra shards <<< "$PYXFER_TEST_SHARDS"
    pids=()
    for i in "${!shards[@]}"; do
      # shellcheck disable=SC2086
      timeout "${PYXFER_TEST_TIMEOUT:-900}" $PY -m pytest -q -rs -p no:cacheprovider --durations=8 \
        ${PYXFER_TEST_MARK:+-m "$PYXFER_TEST_MARK"} ${shards[$i]} --junitxml="$OUT/tests_$i.xml" > "$OUT/tests_$i.log" 2>&1 &
      pids+=($!)
    done
    for i in "${!pids[@]}"; do
      wait "${pids[$i]}" || status=1
      echo "--- shard $i: ${shards[$i]}"; tail -40 "$OUT/tests_$i.log"
    done
  else
    timeout "${PYXFER_TEST_TIMEOUT:-900}" $PY -m pytest -q -rs -p no:cacheprovider --durations=12 ${PYXFER_TEST_MARK:+-m "$PYXFER_TEST_MARK"} ${PYXFER_TESTS:-tests} \
      --junitxml="$OUT/tests.xml" 2>&1 | tee "$OUT/tests.log" | tail -60
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  fi
fi

if wants bench; then
  step "pyxfer bench (${PYXFER_BENCH_PRESET:-quick} preset)"
  plot=()
  if $PY -c "import matplotlib" 2>/dev/null; then plot=(--plot "$OUT/pyxfer_bench.png"); fi
  # shellcheck disable=SC2086  (PYXFER_BENCH_ARGS: more arguments, e.g. --pairs / --sizes, split on spaces)
  $PY -m pyxfer bench --preset "${PYXFER_BENCH_PRESET:-quick}" ${PYXFER_BENCH_ARGS:-} --no-progress \
    --json "$OUT/pyxfer_bench.json" ${plot[@]+"${plot[@]}"} \
    2>&1 | tee "$OUT/pyxfer_bench.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if wants benchmarks; then
  step "benchmarks"
  for b in ${PYXFER_BENCHMARKS-checksum transfer buffers formats gather}; do
    $PY "benchmarks/$b.py" --json "$OUT/bench_$b.json" 2>&1 | tee -a "$OUT/bench.log" || status=1
  done
fi

if wants summary; then
  step "summary"
  $PY benchmarks/summary.py "$OUT" || status=1
fi
exit $status
