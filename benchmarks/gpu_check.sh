#!/usr/bin/env bash
# On a GPU machine: build pyxfer from source, run every test (GPU ones included), the doctor, the
# benchmarks and nvbandwidth beside `pyxfer bench`, and print a short summary table last. Results (logs,
# JSON) go to $PYXFER_CHECK_OUT, else $OUT, else ./gpu-check-out.
#   bash benchmarks/gpu_check.sh            # everything
#   PYXFER_CUDA_ARCHS=90 bash benchmarks/gpu_check.sh   # build for the named architectures only
#   PYXFER_DETACH=1 PYXFER_CHECK_OUT=/tmp/gc bash benchmarks/gpu_check.sh   # in the background (outlives the shell)
#   PYXFER_CHECK_OUT=/tmp/gc bash benchmarks/gpu_check.sh --collect 540  # wait <= 540 s for it; pack into $OUT
# Environment: PYXFER_STEPS (default "build doctor tests bench benchmarks nvbandwidth summary"), PYXFER_TESTS
# (pytest arguments, default "tests"), PYXFER_TEST_MARK (a pytest -m expression, e.g. "gpu or multigpu"),
# PYXFER_TEST_TIMEOUT (s), PYXFER_BENCHMARKS (scripts in benchmarks/), PYXFER_TEST_SHARDS (sets of pytest
# arguments separated by '|', run at once; a set that starts with @GPUS sees only those GPUs, e.g.
# '@0,1 tests/gather -k own-gpu|@2,3 tests/gather -k swapped-gpus|tests/transfer'), PYXFER_BENCH_PRESET,
# PYXFER_BENCH_ARGS (more `pyxfer bench` arguments), PYXFER_NVBANDWIDTH (the nvbandwidth binary; default
# .tools/nvbandwidth), PYXFER_NVBANDWIDTH_GPUS / PYXFER_NVBANDWIDTH_MIB (default all visible / 512),
# PYXFER_CXX (compiler).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${PYXFER_CHECK_OUT:-${OUT:-$PWD/gpu-check-out}}
if [ "${1:-}" = "--collect" ]; then
  # wait for a detached check, show where it got, and pack its folder into $OUT (a device call's return folder)
  limit=${2:-540}; start=$(date +%s)
  while [ ! -e "$OUT_DIR/done" ] && [ $(( $(date +%s) - start )) -lt "$limit" ]; do sleep 5; done
  [ -e "$OUT_DIR/done" ] && echo "finished" || echo "still running after ${limit} s"
  tail -n 40 "$OUT_DIR/gpu_check.log" 2>/dev/null
  if [ -n "${OUT:-}" ] && [ "$OUT" != "$OUT_DIR" ]; then
    tar czf "$OUT/gpu_check.tgz" -C "$(dirname "$OUT_DIR")" "$(basename "$OUT_DIR")"
  fi
  exit 0
fi
mkdir -p "$OUT_DIR"
if [ -n "${PYXFER_DETACH:-}" ] && [ -z "${PYXFER_DETACHED:-}" ]; then
  rm -f "$OUT_DIR/done"
  PYXFER_DETACHED=1 setsid nohup bash "$0" > "$OUT_DIR/gpu_check.log" 2>&1 < /dev/null &
  echo "detached (pid $!): log $OUT_DIR/gpu_check.log; collect: PYXFER_CHECK_OUT=$OUT_DIR bash $0 --collect"
  exit 0
fi
OUT=$OUT_DIR
# a detached check says it ended, however it ends (a failed build exits early)
if [ -n "${PYXFER_DETACHED:-}" ]; then trap 'echo $? > "$OUT/done"' EXIT; fi
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
wants() { [[ " ${PYXFER_STEPS:-build doctor tests bench benchmarks nvbandwidth summary} " == *" $1 "* ]]; }
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
      args=${shards[$i]# }; gpus=""
      if [[ $args == @* ]]; then gpus=${args%% *}; gpus=${gpus#@}; args=${args#* }; fi  # '@0,1 ...': those GPUs
      # shellcheck disable=SC2086
      ( if [ -n "$gpus" ]; then export CUDA_VISIBLE_DEVICES=$gpus; fi
        exec timeout "${PYXFER_TEST_TIMEOUT:-900}" $PY -m pytest -q -rs -p no:cacheprovider --durations=8 \
          ${PYXFER_TEST_MARK:+-m "$PYXFER_TEST_MARK"} $args --junitxml="$OUT/tests_$i.xml" > "$OUT/tests_$i.log" 2>&1 ) &
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

if wants nvbandwidth; then
  step "nvbandwidth beside pyxfer bench"
  nvb=${PYXFER_NVBANDWIDTH:-.tools/nvbandwidth}
  if [ -x "$nvb" ] || [ -x "$nvb/nvbandwidth" ]; then
    # shellcheck disable=SC2086
    $PY benchmarks/nvbandwidth_compare.py --nvbandwidth "$nvb" --mib "${PYXFER_NVBANDWIDTH_MIB:-512}" \
      ${PYXFER_NVBANDWIDTH_GPUS:+--gpus "$PYXFER_NVBANDWIDTH_GPUS"} --json "$OUT/nvbandwidth_compare.json" \
      2>&1 | tee "$OUT/nvbandwidth_compare.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  else
    echo "skipped: no nvbandwidth binary at $nvb (PYXFER_NVBANDWIDTH names it; ../shared/tools has an sm_90 build)"
  fi
fi

if wants summary; then
  step "summary"
  $PY benchmarks/summary.py "$OUT" || status=1
fi
exit $status
