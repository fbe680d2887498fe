# Run R, call C: build; the all-gather engine's GPU tests (2 and 4 ranks), batches, held-stream host legs,
# sm_copy math bits (at once); the bench's two-way / pointer-chase tests; nvbandwidth beside pyxfer bench.
cd "$1"; W=/tmp/rc; mkdir -p $W; O=$2
pk(){ (cd /tmp && tar czf $O/rc.tgz rc); }
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 CUDA_HOME=/usr/local/cuda CXX=/usr/bin/g++ CC=/usr/bin/gcc
s=$(date +%s); PYXFER_WITH_CUDA=1 PYXFER_CUDA_ARCHS=90 MAX_JOBS=64 python3 -m pip install --no-build-isolation --no-deps -e . > $W/build.log 2>&1 || { grep -n " error" $W/build.log | head; pk; exit 1; }
echo "built $(( $(date +%s)-s ))s" | tee $W/t.log; pk
P="timeout ${TT:-70} python3 -m pytest -q -rfE -p no:cacheprovider --tb=short"
$P tests/gather/test_gather_gpu.py -k own-gpu > $W/s0.log 2>&1 &
$P tests/gather/test_gather_gpu.py -k four_gpus > $W/s1.log 2>&1 &
$P tests/gather/test_gather_gpu.py tests/transfer/test_batches_gpu.py -k "fused_buffers or captured or world_of_one or batches" > $W/s2.log 2>&1 &
$P tests/transfer/test_transfer_host_gpu.py tests/transfer/test_sm_copy_gpu.py -k "ready_on_the_current or held or math_bits or conjugate_and" > $W/s3.log 2>&1 &
wait; echo "tests $(( $(date +%s)-s ))s" >> $W/t.log; pk
timeout 28 python3 -m pytest -q -rfE -p no:cacheprovider --tb=short tests/tools/test_bench_gpu.py -k "two_way or pointer_chase" > $W/s4.log 2>&1; pk
timeout 40 python3 benchmarks/nvbandwidth_compare.py --nvbandwidth .tools/nvbandwidth --gpus 0,1 --mib 64 --json $W/nvb.json > $W/nvb.log 2>&1
echo "all $(( $(date +%s)-s ))s" >> $W/t.log; pk
