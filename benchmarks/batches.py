"""pyxfer.verified_copy_many against a loop of pyxfer.verified_copy and a loop of plain Tensor.to over the same
tensors, measured in the same run (issue 34 item 5): a batch like one accelerate hook call's (--count tensors
of mixed sizes, --min-kib .. --max-kib, odd byte counts, a few non-contiguous), for each pair of devices
present: cuda:0 -> cuda:1 (2+ GPUs), cuda:0 -> cuda:0, pinned host -> cuda:0, cuda:0 -> host.

Method: pyxfer.tools.timing.cuda_samples with hold=False (CUDA events on cuda:0's current stream around one
call that ends with torch.cuda.synchronize() of every GPU; the loop of .to ends the same way), --warmup calls
first, the median of --reps; verify="sync" and "deferred" (deferred: check_transfers() once after the timed
calls). Results are checked once, outside the timed region. The ratio is time(loop) / time(batch): above 1,
the batch is faster.

    python benchmarks/batches.py [--count 18] [--min-kib 4] [--max-kib 8192] [--reps 50] [--json out.json]
"""
import argparse
import sys
from pathlib import Path

import torch

import pyxfer
from pyxfer.tools.timing import cuda_samples

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_json  # noqa: E402


def batch_of(count, min_kib, max_kib, device, gen):
    sizes = torch.logspace(torch.log10(torch.tensor(min_kib * 1024.0)), torch.log10(torch.tensor(max_kib * 1024.0)),
                           count).long().tolist()
    out = []
    for i, n in enumerate(sizes):
        t = torch.randint(0, 256, (n + 3,), dtype=torch.uint8, generator=gen)
        if i % 4 == 3:  # a non-contiguous view now and then (rotary tables, transposed caches)
            t = t[: (n + 3) // 8 * 8].view(torch.float16).reshape(-1, 4).t()
        out.append(t.to(device))
    return out


def median_ms(fn, reps, warmup):
    def once(_):
        fn()
        for d in range(torch.cuda.device_count()):
            torch.cuda.synchronize(d)

    return cuda_samples(once, [None], warmup=warmup, reps=reps, device=0, hold=False).median_ms


def measure(src_dev, dst, batch, a):
    """The rows of one pair: verified_copy_many, a loop of verified_copy, a loop of .to (sync and deferred)."""
    nb = src_dev == "cpu" or dst == "cpu"
    to_ms = median_ms(lambda: [t.to(dst, non_blocking=nb) for t in batch], a.reps, a.warmup)
    rows = []
    for verify in ("sync", "deferred"):
        many_ms = median_ms(lambda v=verify: pyxfer.verified_copy_many(batch, dst, verify=v), a.reps, a.warmup)
        loop_ms = median_ms(lambda v=verify: [pyxfer.verified_copy(t, dst, verify=v) for t in batch], a.reps,
                            a.warmup)
        pyxfer.check_transfers()
        rows.append({"pair": f"{src_dev} -> {dst}", "verify": verify, "bytes": sum(t.nbytes for t in batch),
                     "many_ms": round(many_ms, 4), "loop_verified_copy_ms": round(loop_ms, 4),
                     "loop_to_ms": round(to_ms, 4), "loop_verified_copy / many": round(loop_ms / many_ms, 3),
                     "loop_to / many": round(to_ms / many_ms, 3)})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=18)
    ap.add_argument("--min-kib", type=int, default=4)
    ap.add_argument("--max-kib", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    pairs = [("cuda:0", "cuda:0"), ("cpu", "cuda:0"), ("cuda:0", "cpu")]
    if torch.cuda.device_count() > 1:
        pairs.insert(0, ("cuda:0", "cuda:1"))
    print(f"{a.count} tensors of {a.min_kib} KiB .. {a.max_kib} KiB on {torch.cuda.get_device_name(0)} "
          f"x{torch.cuda.device_count()}")
    rows, results = [], []
    for src_dev, dst in pairs:
        batch = batch_of(a.count, a.min_kib, a.max_kib, src_dev, gen)
        if src_dev == "cpu":
            batch = [t.pin_memory() for t in batch]
        nbytes = sum(t.nbytes for t in batch)
        # checked once, outside the timed calls (as bytes: random bits include NaNs)
        assert all(g.device == torch.device(dst) and torch.equal(g.cpu().view(torch.uint8),
                                                                 t.cpu().contiguous().view(torch.uint8))
                   for g, t in zip(pyxfer.verified_copy_many(batch, dst), batch))
        for row in measure(src_dev, dst, batch, a):
            results.append(row)
            rows.append([row["pair"], row["verify"], f"{nbytes / 2**20:.1f}", f"{row['many_ms']:.3f}",
                         f"{row['loop_verified_copy_ms']:.3f}", f"{row['loop_to_ms']:.3f}",
                         f"{row['loop_verified_copy / many']:.3f}", f"{row['loop_to / many']:.3f}"])
    print_table("verified_copy_many vs loops (median ms per batch; ratio > 1: the batch is faster)",
                ["pair", "verify", "MiB", "many", "loop verified_copy", "loop .to", "loop vc / many",
                 "loop .to / many"], rows)
    write_json(a.json, {"device": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(),
                        "count": a.count, "results": results})


if __name__ == "__main__":
    main()
