"""Design probe for the all-gather engine (issue 32): host microseconds per call of the ways a
steady-state gather can reach NCCL, pipelined (no host waits), 2+ ranks, one GPU each.
    torchrun --nproc-per-node 2 benchmarks/probes/gather_probe.py
"""
import os
import time

import torch
import torch.distributed as dist


def host_us(fn, n=200):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / n * 1e6
    return host, wall


def main():
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    pg = dist.group.WORLD
    world = dist.get_world_size()
    rows = []
    for name, shape, dtype in [("bf16 8192x8192", (8192, 8192), torch.bfloat16),
                               ("u8 8192x8192", (8192, 8192), torch.uint8),
                               ("u8 64x64", (64, 64), torch.uint8)]:
        x = torch.randint(0, 100, shape, device="cuda").to(dtype)
        out = torch.empty((world * shape[0], *shape[1:]), dtype=dtype, device="cuda")
        def plain(out=out, x=x):
            dist.all_gather_into_tensor(out, x)
        rows.append((name, "dist.all_gather_into_tensor", *host_us(plain)))
        sc = torch.empty(shape[0], shape[1] // 32, dtype=torch.uint8, device="cuda")
        sco = torch.empty(world * shape[0], shape[1] // 32, dtype=torch.uint8, device="cuda")

        def coalesced(out=out, x=x, sco=sco, sc=sc):
            with dist._coalescing_manager(async_ops=False):
                dist.all_gather_into_tensor(out, x)
                dist.all_gather_into_tensor(sco, sc)
        rows.append((name, "_coalescing_manager (data+scales)", *host_us(coalesced)))

        def op_call(out=out, x=x, sco=sco, sc=sc):  # the C++ op a native engine would call (no Python wrappers)
            torch.ops.c10d.allgather_into_tensor_coalesced_([out, sco], [x, sc], pg)
        try:
            rows.append((name, "torch.ops.c10d.allgather_into_tensor_coalesced_", *host_us(op_call)))
        except Exception as e:  # noqa: BLE001
            rows.append((name, f"c10d op failed: {e}"[:60], 0, 0))

        def alloc_and_gather(x=x, shape=shape, dtype=dtype):
            o = torch.empty((world * shape[0], *shape[1:]), dtype=dtype, device="cuda")
            dist.all_gather_into_tensor(o, x)
        rows.append((name, "alloc + all_gather_into_tensor", *host_us(alloc_and_gather)))
    if rank == 0:
        for r in rows:
            print(f"[gather probe, {world} ranks] {r[0]:16s} {r[1]:50s} host {r[2]:7.1f} us/call  "
                  f"wall {r[3]:8.1f} us/call")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
