"""Diagnostic probe (run S): is an eager pyxfer.gather result on NCCL exact, and if not, is it late (exact
after a device synchronize: a stream-order race) or wrong (NaN-marked / other bytes)? Per call: the path
(waiting / fused), sync and async, plain bf16 2-D and fp32 1-D, with and without device_id.
    torchrun --nproc-per-node 2 benchmarks/probes/gather_result_probe.py [--device-id]
"""
import os
import sys

import torch
import torch.distributed as dist

import pyxfer.gather as G


def main():
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    kw = {"device_id": dev} if "--device-id" in sys.argv else {}
    dist.init_process_group("nccl", **kw)
    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(1234)
    cases = (("bf16 256x256", (256, 256), torch.bfloat16), ("fp32 1M+3", ((1 << 20) + 3,), torch.float32),
             ("bf16 256x256 again", (256, 256), torch.bfloat16))
    for name, shape, dtype in cases:
        for call in range(5):
            for async_op in (False, True) if call >= 3 else (False,):
                full = torch.randn(world * shape[0], *shape[1:], generator=gen).to(dtype)
                x = full[rank * shape[0]:(rank + 1) * shape[0]].to(dev)
                state = G.engine.state_of(group, rank, world)
                fused = state.predicted() is not None
                out = G.gather(x, group, rank, world, async_op=async_op)
                if async_op:
                    out = out.wait()
                ordered = torch.equal(out.cpu(), full)
                torch.cuda.synchronize()
                got = out.cpu()
                late = torch.equal(got, full)
                bad = (got.view(-1) != full.view(-1)).nonzero()
                first = int(bad[0]) if len(bad) else -1
                print(f"rank {rank} {name} call {call} {'fused' if fused else 'waiting'} async={async_op}: "
                      f"exact on the stream {ordered}, after sync {late}; wrong {len(bad)}, first {first}, "
                      f"NaN {int(got.float().isnan().sum())}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
