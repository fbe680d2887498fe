#!/usr/bin/env bash
# Run S (detached: `setsid nohup bash benchmarks/runs/S/goS.sh $PWD &`; collect.sh gathers /tmp/S): build;
# the GPU suite in shards at once (correctness only: no shard times anything); then, with the GPUs to
# themselves, the timed tests, the doctor on 2 and 4 GPUs with and without faults, the all-gather
# benchmarks on 2 and 4 ranks and nvbandwidth beside pyxfer bench at 512 MiB.
cd "$1" || exit 1
W=/tmp/S; mkdir -p $W/doc
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CUDA_HOME=/usr/local/cuda CXX=/usr/bin/g++ CC=/usr/bin/gcc
t(){ echo "$(date +%s) $*" >> $W/t.log; }
t start
if ! PYXFER_WITH_CUDA=1 PYXFER_CUDA_ARCHS=90 MAX_JOBS=64 python3 -m pip install --no-build-isolation --no-deps -e . > $W/build.log 2>&1; then
  t build-failed; touch $W/done; exit 1
fi
t built
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv > $W/gpus.txt 2>&1
nvidia-smi topo -m > $W/topo.txt 2>&1
shard(){ local name=$1 gpus=$2 limit=$3; shift 3
  ( if [ "$gpus" = all ]; then unset CUDA_VISIBLE_DEVICES; else export CUDA_VISIBLE_DEVICES=$gpus; fi
    timeout "$limit" python3 -m pytest -q -rfEs -p no:cacheprovider --tb=short --durations=6 -m "gpu or multigpu" \
      "$@" > $W/$name.log 2>&1; t "$name rc=$?" ) ; }
G=tests/gather/test_gather_gpu.py
if [ -z "${ONLY_MEASURE:-}" ]; then
  shard g2own 0,1 540 $G -k "own-gpu or captured or fused_buffers or world_of_one" &
  shard g2swap 2,3 540 $G -k swapped-gpus &
  shard g4 all 540 $G -k four_gpus &
  shard xfer_a 2,3 540 tests/transfer/test_transfer_gpu.py tests/transfer/test_sm_copy_gpu.py tests/transfer/test_batches_gpu.py &
  shard xfer_b 0,1 540 tests/transfer/test_transfer_device_gpu.py tests/transfer/test_transfer_host_gpu.py &
  shard rest all 540 tests/checksum tests/ops tests/formats tests/buffers tests/guard tests/docs tests/integrations tests/tools/test_peer_exchange.py &
  wait
fi
t tests-done
# the GPUs to ourselves from here
shard tools 0,1,2,3 300 tests/tools/test_doctor_gpu.py tests/tools/test_bench_gpu.py
D="python3 -m pyxfer doctor --json --no-cache"
doc(){ local name=$1; shift; local s; s=$(date +%s)
  env "$@" timeout 300 $D > $W/doc/$name.json 2> $W/doc/$name.err; echo "$name rc=$? $(( $(date +%s)-s ))s" >> $W/doc/times.txt; }
doc four_plain
doc two_plain CUDA_VISIBLE_DEVICES=0,1
doc two_concurrent_corrupt CUDA_VISIBLE_DEVICES=0,1 PYXFER_DOCTOR_TEST_FAULT='concurrent-corrupt:cuda:0->cuda:1'
doc two_concurrent_hang CUDA_VISIBLE_DEVICES=0,1 PYXFER_DOCTOR_TEST_FAULT='concurrent-hang:cuda:0->cuda:1'
doc two_collective_corrupt CUDA_VISIBLE_DEVICES=0,1 PYXFER_DOCTOR_TEST_FAULT='collective-corrupt:cuda:0->cuda:1'
doc two_bitflip CUDA_VISIBLE_DEVICES=0,1 PYXFER_INJECT_FAULT='bitflip,src=cuda:0,dst=cuda:1,times=1000'
doc four_bitflip PYXFER_INJECT_FAULT='bitflip,src=cuda:2,dst=cuda:3,times=1000'
t doctor-done
python3 -m pyxfer doctor --no-cache > $W/doc/four_plain_text.txt 2>&1
for ws in 2 4; do
  timeout 420 python3 benchmarks/gather.py --world-size $ws --reps 20 --json $W/gather_w$ws.json > $W/gather_w$ws.log 2>&1; t "gather w$ws rc=$?"
done
CUDA_VISIBLE_DEVICES=0,1 timeout 200 python3 benchmarks/gather_overhead.py --mode nccl2 --json $W/overhead_nccl2.json > $W/overhead_nccl2.log 2>&1; t "overhead nccl2 rc=$?"
CUDA_VISIBLE_DEVICES=0 timeout 200 python3 benchmarks/gather_overhead.py --mode gpu1 --json $W/overhead_gpu1.json > $W/overhead_gpu1.log 2>&1; t "overhead gpu1 rc=$?"
timeout 300 python3 benchmarks/nvbandwidth_compare.py --nvbandwidth .tools/nvbandwidth --gpus 0,1 --mib 512 --json $W/nvb2.json > $W/nvb2.log 2>&1; t "nvb2 rc=$?"
timeout 400 python3 benchmarks/nvbandwidth_compare.py --nvbandwidth .tools/nvbandwidth --gpus 0,1,2,3 --mib 512 --json $W/nvb4.json > $W/nvb4.log 2>&1; t "nvb4 rc=$?"
t all-done; touch $W/done
