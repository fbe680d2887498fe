"""Where a verified peer copy loses time against a raw one (a diagnostic for benchmarks/transfer.py).

Times, on cuda:0 -> cuda:1 with CUDA events (median of 10; 1 GiB and 256 MiB):
  raw copy_                                  dst.copy_(src)
  verified_copy verify="none" / "deferred"   the copy alone / pipelined with the destination hash
  copy_ + PXH64 of src beside it             contention on the source's memory
  copy_ + PXH64 of another buffer on cuda:1  contention on the destination's memory
  PXH64 alone                                the hash's own time on that size

    python benchmarks/peer_overlap.py [--json out.json]
"""
import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pyxfer  # noqa: E402,F401
from common import fmt_size, print_table, write_json  # noqa: E402


def timed(fn, reps=10):
    """Median ms of fn() between events on cuda:0's current stream (fn may use other streams)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        torch.cuda.current_stream(1).synchronize()  # work queued for cuda:1 is part of the time
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json")
    args = p.parse_args()
    if torch.cuda.device_count() < 2:
        print("peer_overlap: needs 2 GPUs; skipped")
        return
    torch.cuda.set_device(0)
    rows, result = [], []
    for size in (256 << 20, 1 << 30):
        src = torch.randint(-2**31, 2**31 - 1, (size // 4,), dtype=torch.int32, device="cuda:0")
        dst = torch.empty(size // 4, dtype=torch.int32, device="cuda:1")
        other = torch.randint(-2**31, 2**31 - 1, (size // 4,), dtype=torch.int32, device="cuda:1")
        side0, side1 = torch.cuda.Stream(0), torch.cuda.Stream(1)

        def copy_with_hash_beside(hashed, side):
            side.wait_stream(torch.cuda.current_stream(side.device))
            with torch.cuda.stream(side):
                torch.ops.pyxfer.checksum(hashed, 0)
            torch.cuda.set_device(0)
            dst.copy_(src)
            torch.cuda.current_stream(side.device).wait_stream(side)

        cases = {
            "raw copy_": lambda: dst.copy_(src),
            "verified none": lambda: pyxfer.verified_copy(src, "cuda:1", route="direct", verify="none"),
            "verified deferred": lambda: pyxfer.verified_copy(src, "cuda:1", route="direct", verify="deferred"),
            "verified sync": lambda: pyxfer.verified_copy(src, "cuda:1", route="direct", verify="sync"),
            "copy_ + hash src beside": lambda: copy_with_hash_beside(src, side0),
            "copy_ + hash on cuda:1 beside": lambda: copy_with_hash_beside(other, side1),
            "hash src alone": lambda: torch.ops.pyxfer.checksum(src, 0),
        }
        times = {name: timed(fn) for name, fn in cases.items()}
        pyxfer.check_transfers()
        raw = times["raw copy_"]
        for name, ms in times.items():
            rows.append([fmt_size(size), name, f"{ms:.3f}", f"{size / ms / 1e6:.0f}", f"{ms / raw:.3f}"])
            result.append({"bytes": size, "case": name, "ms": ms})
    print_table("peer copy cuda:0 -> cuda:1 and what slows it (CUDA events, median of 10)",
                ["size", "case", "ms", "GB/s", "x raw"], rows)
    write_json(args.json, {"rows": result})


if __name__ == "__main__":
    main()
