"""One rank of a pyxfer.all_gather test group (tests/support/gather_harness.py spawns one per rank): runs
the cases listed in ``--cases`` (a JSON list of names; every case of ``cases(world)`` without it) in
registry order and appends one JSON line per case to its output file (gather_harness.run_cases).

    python gather_worker.py --rank R --world W --init file:///... --out DIR --seed S
        [--backend gloo|nccl] [--swap-devices] [--cases FILE]
"""
import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for support.*
from support.gather_harness import Ctx, cases, fresh, run_cases  # noqa: E402

# ---- main -------------------------------------------------------------------------------------

def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--init", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--backend", default="gloo")
    p.add_argument("--swap-devices", action="store_true")
    p.add_argument("--cases", default=None, help="a JSON file listing the names of the cases to run")
    a = p.parse_args()
    torch.set_num_threads(1)
    if a.backend == "nccl":
        gpu = (a.world - 1 - a.rank) if a.swap_devices else a.rank
        torch.cuda.set_device(a.rank)  # the current device is the rank's; data may live on another GPU
        device = torch.device("cuda", gpu)
    else:
        device = torch.device("cpu")
    dist.init_process_group(a.backend, init_method=a.init, rank=a.rank, world_size=a.world,
                            timeout=datetime.timedelta(seconds=60))
    ctx = Ctx(a.rank, a.world, device, a.seed)
    ctx.fresh = fresh
    ctx.singletons = [dist.new_group([r]) for r in range(a.world)]
    ctx.pair = dist.new_group([0, 1]) if a.world > 2 else None
    run_cases(ctx, cases(a.world), a.out, a.cases, limit=6)
    if a.backend == "nccl":
        torch.cuda.synchronize(device)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

