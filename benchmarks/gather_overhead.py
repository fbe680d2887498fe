"""Where the time of one pyxfer.all_gather call goes (2 ranks, NCCL, one GPU each): for torch's
all-gather and pyxfer's (plain bf16, MXFP8 rowwise, MXFP8 + verify) of an 8192x8192 shard, the
device time of one call (CUDA events around it, after a barrier and a device sync, median of 30)
and its host time, split into pyxfer's steps (input preparation, metadata records (in fused mode,
after the warm-up, the one collective with the data: the data launch is counted in both), data
launch, wait + post-processing; microseconds per call, wall clock); then the same pyxfer calls with
the group's agreed state forgotten before each one (every call waits for its records: the path of a
group's first calls with a signature). A diagnostic, not a target: benchmarks/gather.py measures those.

    python benchmarks/gather_overhead.py [--rows 8192 --cols 8192] [--reps 30]
"""
import argparse
import functools
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (shared hosts)
STEPS = {"_Local": "prep", "_Records": "records", "_launch": "launch", "wait": "wait+finish"}


def timed(fn, reps):
    device_ms, host_ms = [], []
    for _ in range(reps):
        dist.barrier()
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        fn()
        host_ms.append((time.perf_counter() - t0) * 1e3)
        stop.record()
        stop.synchronize()
        device_ms.append(start.elapsed_time(stop))
    return statistics.median(device_ms), statistics.median(host_ms)


def worker(rank, world, tmp, rows, cols, reps):
    import pyxfer.gather as G
    from pyxfer import formats
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{tmp}/init", rank=rank, world_size=world, device_id=device)
    spent = {}

    def count(owner, name):  # wall time spent in owner.name, per step
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
        setattr(owner, name, wrapper)
    for name in ("_Local", "_Records", "_launch"):
        count(G, name)
    count(G.GatherHandle, "wait")
    x = torch.randn(rows, cols, dtype=torch.bfloat16, device=device)
    u8 = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, device=device)
    q = formats.quantize(x, "mxfp8")
    out = torch.empty(world * rows, cols, dtype=x.dtype, device=device)
    out8 = torch.empty(world * rows, cols, dtype=u8.dtype, device=device)
    cases = {"torch bf16": lambda: dist.all_gather_into_tensor(out, x),
             "torch uint8": lambda: dist.all_gather_into_tensor(out8, u8),
             "pyxfer bf16": lambda: G.all_gather(x), "pyxfer mxfp8 rowwise": lambda: G.all_gather(q),
             "pyxfer mxfp8 rowwise + verify": lambda: G.all_gather(q, verify=True)}
    lines = []
    for name, fn in cases.items():
        for _ in range(5):
            fn()
        spent.clear()
        dev, host = timed(fn, reps)
        steps = " / ".join(f"{spent.get(k, 0.0) / reps * 1e6:.0f}" for k in STEPS) if name.startswith("pyxfer") else "-"
        lines.append(f"| {name} | {dev:.3f} | {host:.3f} | {steps} |")
    agreed = G._agreed
    G._agreed = lambda group: G._Agreed()  # every call waits for its records
    for name in ("pyxfer bf16", "pyxfer mxfp8 rowwise"):
        dev, host = timed(cases[name], reps)
        lines.append(f"| {name}, waiting for the records | {dev:.3f} | {host:.3f} | - |")
    G._agreed = agreed
    if rank == 0:
        print(f"| call ({world} ranks, {rows}x{cols} per rank) | device ms | host ms | host us per call: "
              f"{' / '.join(STEPS.values())} |\n|---|---|---|---|")
        print("\n".join(lines))
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--cols", type=int, default=8192)
    p.add_argument("--reps", type=int, default=30)
    a = p.parse_args()
    if torch.cuda.device_count() < 2:
        raise SystemExit("needs 2 GPUs")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(2, tmp, a.rows, a.cols, a.reps), nprocs=2)


if __name__ == "__main__":
    main()
