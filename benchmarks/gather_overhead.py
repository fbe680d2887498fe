"""Where the host time of one steady-state pyxfer.all_gather call goes, beside torch's own all-gather.

A steady-state call is one of a group whose agreed signatures repeat (pyxfer.gather.engine: fused, one
native call, no record exchange). Modes: ``--mode gloo`` (``--world-size`` CPU processes, a gloo group),
``--mode gpu1`` (one GPU, a 1-rank NCCL group running all of all_gather's steps through
pyxfer.gather.gather; all_gather itself shortcuts one rank) and ``--mode nccl2`` (2 ranks, NCCL, one GPU
each). Per case, ``--calls`` calls back to back after a warm-up (the host runs ahead of the device as
far as each call lets it), each timed on the host (perf_counter):
- host us per call: the median call's wall time;
- collective us: the time spent inside the process group's collective call (the NCCL / gloo launch,
  counted by the native side: torch.ops.pyxfer.gather_stats), mean per call;
- verdict wait us: the time the native call waited for the previous call's verdict because the host
  was ahead of the device (a wait for the device, not host work), mean per call, and how many calls
  waited (per call);
- pyxfer's own host us: host time per call minus the collective and the verdict wait (means);
- host syncs per call: synchronizing CUDA calls made by the call, counted with
  torch.cuda.set_sync_debug_mode("warn") (every synchronizing CUDA operation torch makes warns) plus
  Python-level ones (Event / Stream / device synchronize, .tolist() / .item() / .cpu() of a CUDA tensor);
  the verdict reads are loads of host memory, which are not CUDA calls (their waits are the line above).
torch's all-gather (all_gather_single / all_gather_into_tensor, as the users call it) of the same bf16
shard, and of a uint8 shard of the same shape (the bytes of an FP8-sized payload), are the baselines in the
same run; "x torch bf16" / "x torch uint8" = a case's host us per call / the baseline's (1.00x: the call
costs the host what torch's does). nccl2 also times each call on the device (CUDA events around one call
after a barrier and a device sync, median): device ms and host ms side by side.
Goals (issue 32): pyxfer's own host us <= 30 per steady-state call (gpu1 and nccl2), host syncs per
call = 0, host time per call (without the verdict wait) <= torch's + 15 us.

    python benchmarks/gather_overhead.py --mode gloo [--rows 128 --cols 128] [--calls 2000]
    python benchmarks/gather_overhead.py --mode gpu1 [--rows 8192 --cols 8192] [--calls 2000]
    python benchmarks/gather_overhead.py [--mode nccl2] [--rows 8192 --cols 8192] [--calls 500]
    (every mode: [--json out.json])
"""
import argparse
import functools
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_json  # noqa: E402

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (shared hosts)
OWN_TARGET_US, OVER_TORCH_US = 30.0, 15.0
TORCH_BF16, TORCH_U8 = "torch all-gather bf16 (baseline)", "torch all-gather uint8, FP8-sized (baseline)"


class SyncCounter:
    """Counts synchronizing CUDA calls while active: torch's sync debug mode (a warning per synchronizing
    CUDA operation torch makes) and Python-level synchronize / host reads of CUDA tensors."""

    PATCHED = ((torch.cuda.Event, "synchronize"), (torch.cuda.Stream, "synchronize"), (torch.cuda, "synchronize"),
               (torch.Tensor, "tolist"), (torch.Tensor, "item"), (torch.Tensor, "cpu"))

    def __init__(self):
        self.count, self._undo, self._caught = 0, [], None

    def __enter__(self):
        for owner, name in self.PATCHED:
            fn = getattr(owner, name)

            @functools.wraps(fn)
            def wrapper(*args, _fn=fn, _tensor=owner is torch.Tensor, **kwargs):
                if not _tensor or (args and getattr(args[0], "is_cuda", False)):
                    self.count += 1
                return _fn(*args, **kwargs)
            setattr(owner, name, wrapper)
            self._undo.append((owner, name, fn))
        if torch.cuda.is_available():
            self._warnings = warnings.catch_warnings(record=True)
            self._caught = self._warnings.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        for owner, name, fn in reversed(self._undo):
            setattr(owner, name, fn)
        if self._caught is not None:
            torch.cuda.set_sync_debug_mode("default")
            self.count += sum("synchroniz" in str(w.message) for w in self._caught)
            self._warnings.__exit__(*exc)


def cases(device, rows, cols, world):
    """{name: fn} of the calls measured, all ranks alike (pyxfer's through pyxfer.gather.gather)."""
    import pyxfer.gather as G
    from pyxfer import formats
    group = dist.group.WORLD
    rank = dist.get_rank()
    gen = torch.Generator(device).manual_seed(7)
    x = torch.randn(rows, cols, dtype=torch.bfloat16, device=device, generator=gen)
    half = torch.randn(max(rows // 2 // 128 * 128, 128), cols, dtype=torch.bfloat16, device=device, generator=gen)
    out = torch.empty(world * rows, cols, dtype=x.dtype, device=device)
    u8 = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, device=device, generator=gen)
    out_u8 = torch.empty(world * rows, cols, dtype=torch.uint8, device=device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    mx, mx_half = formats.quantize(x, "mxfp8"), formats.quantize(half, "mxfp8")
    fp8 = formats.quantize(x, "fp8_block_1x128")
    amax = x.float().abs().max().reshape(1)
    if world > 1:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX)
    nv = formats.quantize(x, "nvfp4", global_amax=float(amax))

    def px(t, **kw):
        return lambda: G.gather(t, group, rank, world, **kw)
    return {TORCH_BF16: lambda: gather(out, x), TORCH_U8: lambda: gather(out_u8, u8),
            "pyxfer bf16": px(x), "pyxfer mxfp8 rowwise": px(mx), "pyxfer fp8_block_1x128 rowwise": px(fp8),
            "pyxfer nvfp4 rowwise": px(nv),
            "pyxfer mxfp8 rowwise, alternating two shapes": lambda: (G.gather(mx, group, rank, world),
                                                                       G.gather(mx_half, group, rank, world))[1],
            "pyxfer mxfp8 rowwise + verify": px(mx, verify=True)}


def measure(fn, calls, device, per_unit=1):
    """Host figures of ``calls`` back-to-back calls of fn (after a warm-up), per call."""
    for _ in range(20):  # fused after two agreed calls (alternating: four)
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    torch.ops.pyxfer.gather_stats(True)
    walls = []
    with SyncCounter() as syncs:
        for _ in range(calls):
            t0 = time.perf_counter()
            fn()
            walls.append(time.perf_counter() - t0)
    n_calls, collective_ns, waits, wait_ns = torch.ops.pyxfer.gather_stats(True)
    n = calls * per_unit
    wall_us = statistics.median(walls) * 1e6 / per_unit
    mean_us = sum(walls) * 1e6 / n
    out = {"host_us": wall_us, "native_calls": n_calls / n, "collective_us": collective_ns / 1e3 / n,
           "wait_us": wait_ns / 1e3 / n, "waits_per_call": waits / n, "syncs_per_call": syncs.count / n}
    out["own_us"] = mean_us - out["collective_us"] - out["wait_us"] if n_calls else None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    import pyxfer
    pyxfer.check_gathers()
    return out


def device_ms(fn, device, reps=30):
    """Median device time of one call after a barrier and a device sync (CUDA events)."""
    times = []
    for _ in range(reps):
        dist.barrier()
        torch.cuda.synchronize(device)
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def worker(rank, world, tmp, mode, rows, cols, calls, out):
    torch.set_num_threads(1)
    if mode == "gloo":
        device = torch.device("cpu")
        dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=world)
    else:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=f"file://{tmp}/init", rank=rank, world_size=world,
                                device_id=device)
    lines = []
    for name, fn in cases(device, rows, cols, world).items():
        per_unit = 2 if "alternating" in name else 1
        row = measure(fn, calls, device, per_unit)
        row["name"] = name
        if mode == "nccl2":
            row["device_ms"] = device_ms(fn, device) / per_unit
        lines.append(row)
    per_rank = [None] * world
    dist.all_gather_object(per_rank, lines)
    if rank == 0:
        out.put(per_rank)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("nccl2", "gloo", "gpu1"), default="nccl2")
    p.add_argument("--rows", type=int, default=None, help="shard rows (default: 8192 on GPUs, 128 on gloo)")
    p.add_argument("--cols", type=int, default=None, help="shard cols (default: 8192 on GPUs, 128 on gloo)")
    p.add_argument("--calls", type=int, default=None, help="timed calls per case (default 2000; nccl2 500)")
    p.add_argument("--world-size", type=int, default=2, help="gloo: processes")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args()
    small = a.mode == "gloo"
    rows, cols = a.rows or (128 if small else 8192), a.cols or (128 if small else 8192)
    calls = a.calls or (500 if a.mode == "nccl2" else 2000)
    world = {"gloo": a.world_size, "gpu1": 1, "nccl2": 2}[a.mode]
    if a.mode != "gloo" and torch.cuda.device_count() < world:
        raise SystemExit(f"--mode {a.mode} needs {world} GPU(s)")
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(worker, args=(world, tmp, a.mode, rows, cols, calls, out), nprocs=world,
                           start_method="spawn")
        per_rank = out.get()
    gpu = torch.cuda.get_device_name(0) if a.mode != "gloo" else ""
    where = {"gloo": f"gloo, {world} CPU processes", "gpu1": f"1-rank NCCL group, {gpu}",
             "nccl2": f"2 ranks NCCL, {gpu}"}[a.mode]
    rows_out = summarize(per_rank)
    show(rows_out, where, rows, cols, calls, a.mode)
    write_json(a.json, {"config": {"mode": a.mode, "world_size": world, "rows": rows, "cols": cols, "calls": calls,
                                   "device": gpu or "cpu"},
                        "method": __doc__.split("\n\n    python")[0], "rows": rows_out})


def summarize(per_rank):
    """One row per case (the worst rank's figures) with its ratios to the torch baselines and its verdict."""
    out = []
    for i in range(len(per_rank[0])):
        rows_i = [r[i] for r in per_rank]
        worst = max(rows_i, key=lambda r: r["host_us"])
        own = max((r["own_us"] for r in rows_i if r["own_us"] is not None), default=None)
        row = {"case": worst["name"], "host_us": worst["host_us"], "collective_us": worst["collective_us"],
               "wait_us": worst["wait_us"], "waits_per_call": worst["waits_per_call"], "own_us": own,
               "syncs_per_call": max(r["syncs_per_call"] for r in rows_i)}
        if "device_ms" in worst:
            row["device_ms"] = max(r["device_ms"] for r in rows_i)
        out.append(row)
    by_name = {r["case"]: r for r in out}
    torch_host = by_name[TORCH_BF16]["host_us"]
    for row in out:
        row["x_torch_bf16"] = row["host_us"] / by_name[TORCH_BF16]["host_us"]
        row["x_torch_uint8"] = row["host_us"] / by_name[TORCH_U8]["host_us"]
        if row["own_us"] is not None and "verify" not in row["case"]:
            host = row["host_us"] - row["wait_us"]
            row["target"] = "PASS" if (row["own_us"] <= OWN_TARGET_US and row["syncs_per_call"] == 0 and
                                       host <= torch_host + OVER_TORCH_US) else "MISS"
    return out


def show(rows_out, where, rows, cols, calls, mode):
    print(f"host time per steady-state call ({where}; {rows}x{cols} bf16 shard; {calls} calls back to back per case; "
          "us; worst rank; x torch = host us / torch's host us, same run)")
    dev = " device ms |" if mode == "nccl2" else ""
    print(f"| call |{dev} host us per call | x torch bf16 | x torch uint8 | collective us | "
          "verdict wait us (waits per call) | pyxfer's own host us | host syncs per call |\n|---|" +
          ("---|" if dev else "") + "---|---|---|---|---|---|---|")
    for r in rows_out:
        d = f" {r['device_ms']:.3f} |" if dev else ""
        own = "-" if r["own_us"] is None else f"{r['own_us']:.1f}"
        print(f"| {r['case']} |{d} {r['host_us']:.1f} | {r['x_torch_bf16']:.2f}x | {r['x_torch_uint8']:.2f}x | "
              f"{r['collective_us']:.1f} | {r['wait_us']:.1f} ({r['waits_per_call']:.2f}) | {own} | "
              f"{r['syncs_per_call']:.2f} |")
    print()
    torch_host = next(r["host_us"] for r in rows_out if r["case"] == TORCH_BF16)
    for r in rows_out:
        if "target" in r:
            host = r["host_us"] - r["wait_us"]
            print(f"  {r['target']:>4}  {r['case']}: own {r['own_us']:.1f} us (<= {OWN_TARGET_US:.0f}), "
                  f"{r['syncs_per_call']:.2f} syncs per call (0), host {host:.1f} us vs torch {torch_host:.1f} us + "
                  f"{OVER_TORCH_US:.0f}")


if __name__ == "__main__":
    main()
