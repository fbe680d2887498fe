"""Packed buffers: pack/unpack and offload/reload against copying the tensors one by one, same run.

Each size is the payload of a mixed set of tensors as an FP8 layer offload sees them: 4 groups of
FP8-like uint8 data (rows x 1024), its fp32 scales (one per 128 bytes), an fp32 amax and a bf16
activation. GB/s = payload bytes (the tensors' bytes, not the alignment padding) / time.

GPU, on the current stream of --device, CUDA events, warm-up, median of many; inputs rotated over
>= 256 MiB so that small sizes are not served from L2:
- pack: pyxfer.buffers.pack vs cloning each tensor (device to device); unpack: microseconds a call
  (it makes views, nothing is copied).
- offload: packed.offload() then waiting on its event (and pack + offload, end to end), vs
  ``t.to("cpu", non_blocking=True)`` for each tensor, vs one big ``copy_`` of the same bytes into
  pinned host memory (the ceiling; target: offload >= 80% of it at >= 256 MiB).
- reload: host.reload(device) then waiting, vs ``t.to(device, non_blocking=True)`` of each pinned host
  tensor, vs one big ``copy_`` from pinned host memory.
The round trip is checked bit-exact outside the timed region.
Without a GPU: says so, and times pack/unpack on the CPU for small sizes.

    python benchmarks/buffers.py [--device cuda:0] [--max-size-mib 1024] [--json out.json]
"""
import argparse
import math
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pyxfer.buffers import pack  # noqa: E402
from pyxfer.tools.timing import L2_DEFEAT_BYTES, cpu_time_ms, cuda_time_ms, fmt_size  # noqa: E402

from common import print_table, write_json  # noqa: E402

GROUPS = 4
ROW_BYTES = 1024


def mixed_tensors(size, device):
    """About ``size`` bytes: per group uint8 data, fp32 scales, fp32 amax, bf16 activation."""
    tensors, per_group = [], size // GROUPS
    rows = max(1, per_group // (2 * ROW_BYTES))  # half of the group is FP8 data
    scales = rows * ROW_BYTES // 128
    act = max(1, (per_group - rows * ROW_BYTES - 4 * scales - 4) // 2)
    for _ in range(GROUPS):
        tensors += [torch.randint(0, 256, (rows, ROW_BYTES), dtype=torch.uint8, device=device),
                    torch.rand(rows, ROW_BYTES // 128, device=device),
                    torch.rand(1, device=device),
                    torch.randn(act, dtype=torch.bfloat16, device=device)]
    return tensors


def payload_bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def same_bits(got, want):
    return all(torch.equal(g.reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8)) for g, w in zip(got, want))


def unpack_us(packed):
    calls = 100
    return cpu_time_ms(lambda p: [p.unpack() for _ in range(calls)], packed) * 1e3 / calls


def gbps(nbytes, ms):
    return nbytes / ms / 1e6


def gpu_row(size, device):
    count = max(1, math.ceil(L2_DEFEAT_BYTES / size)) if size < L2_DEFEAT_BYTES else 1
    sets = [mixed_tensors(size, device) for _ in range(count)]
    nbytes = payload_bytes(sets[0])
    time = lambda fn, inputs: cuda_time_ms(fn, inputs, device=device)  # noqa: E731

    packs = [pack(ts) for ts in sets]
    hosts = [p.offload().result() for p in packs]
    host_sets = [[t.to("cpu", non_blocking=True) for t in ts] for ts in sets]  # pinned by torch
    torch.cuda.synchronize(device)
    big_dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    big_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    row = {"bytes": nbytes, "tensors": len(sets[0]),
           "pack_ms": time(pack, sets),
           "clone_each_ms": time(lambda ts: [t.clone() for t in ts], sets),
           "unpack_us": unpack_us(packs[0]),
           "offload_ms": time(lambda p: p.offload().wait(), packs),
           "to_cpu_each_ms": time(lambda ts: [t.to("cpu", non_blocking=True) for t in ts], sets),
           "d2h_copy_ms": time(partial(big_host.copy_, non_blocking=True), [big_dev]),  # bound: deleted below
           "reload_ms": time(lambda h: h.reload(device).wait(), hosts),
           "to_dev_each_ms": time(lambda hs: [h.to(device, non_blocking=True) for h in hs], host_sets),
           "h2d_copy_ms": time(partial(big_dev.copy_, non_blocking=True), [big_host])}
    row["pack_offload_ms"] = row["pack_ms"] + row["offload_ms"]  # end to end, as the per-tensor baseline
    for key in ("pack", "clone_each", "offload", "pack_offload", "to_cpu_each", "d2h_copy", "reload", "to_dev_each",
                "h2d_copy"):
        row[f"{key}_gbps"] = gbps(nbytes, row[f"{key}_ms"])

    # outside the timed region: the round trip is bit-exact
    back = packs[0].offload().result().reload(device).result()
    if not same_bits(back.unpack(), sets[0]):
        raise AssertionError(f"offload/reload of {fmt_size(size)} changed the data")
    del sets, packs, hosts, host_sets, back, big_dev, big_host
    torch.cuda.empty_cache()
    return row


def cpu_row(size):
    tensors = mixed_tensors(size, "cpu")
    nbytes = payload_bytes(tensors)
    packed = pack(tensors)
    if not same_bits(packed.unpack(), tensors):
        raise AssertionError(f"pack/unpack of {fmt_size(size)} changed the data")
    row = {"bytes": nbytes, "tensors": len(tensors), "pack_ms": cpu_time_ms(pack, tensors),
           "clone_each_ms": cpu_time_ms(lambda ts: [t.clone() for t in ts], tensors), "unpack_us": unpack_us(packed)}
    for key in ("pack", "clone_each"):
        row[f"{key}_gbps"] = gbps(nbytes, row[f"{key}_ms"])
    return row


def show_pack(title, rows):
    print_table(title, ["payload", "tensors", "pack GB/s", "clone each GB/s", "ratio", "unpack us"],
                [[fmt_size(r["bytes"]), r["tensors"], f"{r['pack_gbps']:.2f}", f"{r['clone_each_gbps']:.2f}",
                  f"{r['pack_gbps'] / r['clone_each_gbps']:.2f}", f"{r['unpack_us']:.1f}"] for r in rows])


def show_moves(title, rows):
    print_table(title, ["payload", "offload", "pack+offload", "to(cpu) each", "D2H copy_", "offload/D2H",
                        "reload", "to(dev) each", "H2D copy_", "reload/H2D"],
                [[fmt_size(r["bytes"]), f"{r['offload_gbps']:.2f}", f"{r['pack_offload_gbps']:.2f}",
                  f"{r['to_cpu_each_gbps']:.2f}",
                  f"{r['d2h_copy_gbps']:.2f}", f"{r['offload_gbps'] / r['d2h_copy_gbps']:.2f}",
                  f"{r['reload_gbps']:.2f}", f"{r['to_dev_each_gbps']:.2f}", f"{r['h2d_copy_gbps']:.2f}",
                  f"{r['reload_gbps'] / r['h2d_copy_gbps']:.2f}"] for r in rows])


def sizes_up_to(max_bytes, start=1 << 20):
    sizes = []
    while start <= max_bytes:
        sizes.append(start)
        start *= 4
    return sizes


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--max-size-mib", type=float, default=1024.0, help="largest payload (sizes 1 MiB, x4, ...)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    max_bytes = int(args.max_size_mib * (1 << 20))

    result = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        device = torch.device(args.device)
        result["gpu"] = torch.cuda.get_device_name(device)
        rows = result["gpu_rows"] = [gpu_row(size, device) for size in sizes_up_to(max_bytes)]
        where = f"{result['gpu']} ({device})"
        show_pack(f"pack on {where} vs cloning each tensor, same run, median GB/s of payload", rows)
        show_moves(f"offload/reload on {where}, GB/s of payload, same run (target: offload/D2H >= 0.80 at "
                   f">= 256 MiB)", rows)
    else:
        print("no CUDA GPU: offload/reload rows skipped, pack/unpack timed on the CPU at small sizes\n")
        rows = result["cpu_rows"] = [cpu_row(size) for size in sizes_up_to(min(max_bytes, 16 << 20))]
        show_pack(f"pack on the CPU ({result['threads']} threads) vs cloning each tensor, median GB/s of payload", rows)
    write_json(args.json, result)


if __name__ == "__main__":
    main()
