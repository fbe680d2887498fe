"""PXH64 throughput against a plain-torch read of the same bytes, measured in the same run.

GPU: pyxfer.checksum (no host sync) vs x.view(torch.int64).sum(), CUDA events, median of many,
inputs rotated over >= 256 MiB so small sizes are not served from L2. GB/s = bytes read / time.
CPU: the multithreaded reference vs the same int64 sum on the CPU.

    python benchmarks/checksum.py [--device cuda:0] [--max-size-gib 4] [--json out.json]
"""
import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pyxfer  # noqa: E402
from pyxfer.tools.timing import L2_DEFEAT_BYTES, cpu_time_ms, cuda_time_ms, fmt_size  # noqa: E402

from common import print_table, write_json  # noqa: E402


def gpu_rows(device, max_bytes):
    rows, sizes = [], []
    size = 1 << 20
    while size <= max_bytes:
        sizes.append(size)
        size *= 4
    for size in sizes:
        count = max(1, math.ceil(L2_DEFEAT_BYTES / size)) if size < L2_DEFEAT_BYTES else 1
        inputs = [torch.randint(-2**63, 2**63 - 1, (size // 8,), dtype=torch.int64, device=device)
                  for _ in range(count)]
        reps = 20 if size <= (1 << 30) else 10
        base_ms = cuda_time_ms(lambda x: x.sum(), inputs, reps=reps, device=device)
        ours_ms = cuda_time_ms(lambda x: torch.ops.pyxfer.checksum(x, 0), inputs, reps=reps, device=device)
        # the kernel's value is checked outside the timed region, against the CPU reference
        assert pyxfer.checksum(inputs[0]) == pyxfer.checksum(inputs[0].cpu())
        rows.append({"bytes": size, "baseline_gbps": size / base_ms / 1e6, "pyxfer_gbps": size / ours_ms / 1e6,
                     "baseline_ms": base_ms, "pyxfer_ms": ours_ms})
        del inputs
        torch.cuda.empty_cache()
    return rows


def cpu_rows(sizes):
    rows = []
    for size in sizes:
        x = torch.randint(-2**63, 2**63 - 1, (size // 8,), dtype=torch.int64)
        base_ms = cpu_time_ms(lambda t: t.sum(), x)
        ours_ms = cpu_time_ms(lambda t: torch.ops.pyxfer.checksum(t, 0), x)
        rows.append({"bytes": size, "baseline_gbps": size / base_ms / 1e6, "pyxfer_gbps": size / ours_ms / 1e6,
                     "baseline_ms": base_ms, "pyxfer_ms": ours_ms})
    return rows


def show(title, rows):
    print_table(title, ["size", "int64.sum GB/s", "pyxfer GB/s", "ratio"],
                [[fmt_size(r["bytes"]), f"{r['baseline_gbps']:.0f}", f"{r['pyxfer_gbps']:.0f}",
                  f"{r['pyxfer_gbps'] / r['baseline_gbps']:.3f}"] for r in rows])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--max-size-gib", type=float, default=4.0)
    p.add_argument("--cpu-sizes-mib", default="16,256", help="comma-separated CPU sizes in MiB")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()

    result = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        device = torch.device(args.device)
        result["gpu"] = torch.cuda.get_device_name(device)
        result["gpu_rows"] = gpu_rows(device, int(args.max_size_gib * (1 << 30)))
        show(f"PXH64 on {result['gpu']} ({device}) vs x.view(int64).sum(), same run, median GB/s read",
             result["gpu_rows"])
    else:
        print("no CUDA GPU: GPU rows skipped\n")
    result["cpu_rows"] = cpu_rows([int(s) << 20 for s in args.cpu_sizes_mib.split(",")])
    show(f"PXH64 CPU reference ({result['threads']} threads) vs int64.sum()", result["cpu_rows"])
    write_json(args.json, result)


if __name__ == "__main__":
    main()
