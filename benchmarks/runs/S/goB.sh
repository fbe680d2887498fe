#!/usr/bin/env bash
# Run S, call B (detached like goS.sh; collect.sh gathers /tmp/S): build; the result probe (2 ranks, with and
# without device_id); the all-gather engine's GPU tests (2 ranks own / swapped GPUs, 4 ranks, graphs,
# the gather ops' opcheck) at once; then alone: benchmarks/gather.py on 2 ranks, nvbandwidth beside
# pyxfer bench at 512 MiB on 2 GPUs, benchmarks/gather.py on 4 ranks.
cd "$1" || exit 1
W=/tmp/S; mkdir -p $W
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CUDA_HOME=/usr/local/cuda CXX=/usr/bin/g++ CC=/usr/bin/gcc
t(){ echo "$(date +%s) $*" >> $W/t.log; }
t start
if ! PYXFER_WITH_CUDA=1 PYXFER_CUDA_ARCHS=90 MAX_JOBS=64 python3 -m pip install --no-build-isolation --no-deps -e . > $W/build.log 2>&1; then
  t build-failed; touch $W/done; exit 1
fi
t built
nvidia-smi --query-gpu=index,name --format=csv > $W/gpus.txt 2>&1
PR=benchmarks/probes/gather_result_probe.py
CUDA_VISIBLE_DEVICES=0,1 timeout 60 torchrun --nproc-per-node 2 --master-port 29511 $PR > $W/probe.log 2>&1 &
CUDA_VISIBLE_DEVICES=2,3 timeout 60 torchrun --nproc-per-node 2 --master-port 29512 $PR --device-id > $W/probe_devid.log 2>&1 &
wait; t probes
shard(){ local name=$1 gpus=$2 limit=$3; shift 3
  ( if [ "$gpus" = all ]; then unset CUDA_VISIBLE_DEVICES; else export CUDA_VISIBLE_DEVICES=$gpus; fi
    timeout "$limit" python3 -m pytest -q -rfEs -p no:cacheprovider --tb=short --durations=6 -m "gpu or multigpu" \
      "$@" > $W/$name.log 2>&1; t "$name rc=$?" ) ; }
G=tests/gather/test_gather_gpu.py
shard g2own 0,1 300 $G -k "own-gpu or captured or fused_buffers or world_of_one" &
shard g2swap 2,3 300 $G -k swapped-gpus &
shard g4 all 300 $G -k four_gpus &
shard ops 1,0 300 tests/ops tests/gather --deselect $G &
wait; t tests-done
CUDA_VISIBLE_DEVICES=0,1 timeout 240 python3 benchmarks/gather.py --world-size 2 --reps 15 --json $W/gather_w2.json > $W/gather_w2.log 2>&1; t "gather w2 rc=$?"
timeout 150 python3 benchmarks/nvbandwidth_compare.py --nvbandwidth .tools/nvbandwidth --gpus 0,1 --mib 512 --json $W/nvb2.json > $W/nvb2.log 2>&1; t "nvb2 rc=$?"
timeout 240 python3 benchmarks/gather.py --world-size 4 --reps 15 --json $W/gather_w4.json > $W/gather_w4.log 2>&1; t "gather w4 rc=$?"
CUDA_VISIBLE_DEVICES=0,1 timeout 120 python3 benchmarks/gather_overhead.py --mode nccl2 --json $W/overhead_nccl2.json > $W/overhead_nccl2.log 2>&1; t "overhead nccl2 rc=$?"
t all-done; touch $W/done
