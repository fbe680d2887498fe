"""Where a verified peer copy loses time against a raw one (a diagnostic for benchmarks/transfer.py),
and which chunk schedule of pipelined peer copies is fastest on this machine.

Times, on cuda:0 -> cuda:1 with CUDA events (median of 10; 16 MiB, 256 MiB and 1 GiB):
  raw copy_                                  dst.copy_(src)
  verified_copy verify="none" / "deferred"   the copy alone / pipelined with the destination hash
  verified_copy verify="sync"                the same plus the host wait for both hashes
  copy_ + PXH64 of src beside it             contention on the source's memory
  copy_ + PXH64 of another buffer on cuda:1  contention on the destination's memory
  PXH64 alone                                the hash's own time on that size
and the wall-clock latency of a 4 KiB copy (raw and verified sync, median of 200).

--timeline prints, for one raw copy_ and one verified sync copy at 4 KiB, 16 MiB and 256 MiB, what ran on each
GPU and stream and when (torch.profiler), relative to the call's start on the host, and when the call
returned: where the time between the copy and the host's return goes.

--schedules "auto auto@1 9,4@1 2,8:0" runs the verified cases once per schedule, each in a subprocess
with the native library's knobs set (read once): "auto" is the schedule pyxfer derives from the pair's
rates (measured at its first large copy; PYXFER_PEER_CHUNKS unset), "<shrink>,<min chunk MiB>" is
PYXFER_PEER_CHUNKS (each chunk of the copy-engine pipeline is 1/shrink of the one before, none below
the minimum; "2,8" is halving with 8 MiB chunks, "1,1" no pipelining); an optional ":<MiB>" sets
PYXFER_PEER_FUSED_MIB (hashed peer copies up to that size run as the source hash plus one pull-and-hash
kernel; 0: never) and an optional "@<share>" PYXFER_PEER_HASH_GRID (the hashes beside the copy get
that share of a wave of blocks; "@1": full grids, as before issue 34). Prints them side by side against
raw copy_ measured in each run.

    python benchmarks/peer_overlap.py [--schedules "auto auto@1 9,4@1"] [--timeline] [--json out.json]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pyxfer  # noqa: E402,F401
from pyxfer.tools.timing import fmt_size  # noqa: E402

from common import print_table, write_json  # noqa: E402

SIZES = (16 << 20, 256 << 20, 1 << 30)


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


def latency_us(fn, reps=200):
    """Median wall microseconds of fn() plus a synchronize of both GPUs."""
    times = []
    for i in range(20 + reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        if i >= 20:
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def verified_cases(src, dst):
    return {
        "raw copy_": lambda: dst.copy_(src),
        "verified none": lambda: pyxfer.verified_copy(src, "cuda:1", route="direct", verify="none"),
        "verified deferred": lambda: pyxfer.verified_copy(src, "cuda:1", route="direct", verify="deferred"),
        "verified sync": lambda: pyxfer.verified_copy(src, "cuda:1", route="direct", verify="sync"),
    }


def measure(with_diagnostics):
    """[{bytes, case, ms}] for every size and case, plus the 4 KiB latencies."""
    result = []
    for size in SIZES:
        src = torch.randint(-2**31, 2**31 - 1, (size // 4,), dtype=torch.int32, device="cuda:0")
        dst = torch.empty(size // 4, dtype=torch.int32, device="cuda:1")
        cases = verified_cases(src, dst)
        if with_diagnostics:
            other = torch.randint(-2**31, 2**31 - 1, (size // 4,), dtype=torch.int32, device="cuda:1")
            side0, side1 = torch.cuda.Stream(0), torch.cuda.Stream(1)

            def copy_with_hash_beside(hashed, side, src=src, dst=dst):  # this size's buffers
                side.wait_stream(torch.cuda.current_stream(side.device))
                with torch.cuda.stream(side):
                    torch.ops.pyxfer.checksum(hashed, 0)
                torch.cuda.set_device(0)
                dst.copy_(src)
                torch.cuda.current_stream(side.device).wait_stream(side)

            cases["copy_ + hash src beside"] = lambda src=src, side0=side0: copy_with_hash_beside(src, side0)
            cases["copy_ + hash on cuda:1 beside"] = \
                lambda other=other, side1=side1: copy_with_hash_beside(other, side1)
            cases["hash src alone"] = lambda src=src: torch.ops.pyxfer.checksum(src, 0)
        for name, fn in cases.items():
            result.append({"bytes": size, "case": name, "ms": timed(fn)})
    pyxfer.check_transfers()
    small = torch.randint(-2**31, 2**31 - 1, (1024,), dtype=torch.int32, device="cuda:0")
    small_dst = torch.empty_like(small, device="cuda:1")
    for name, fn in (("raw copy_", lambda: small_dst.copy_(small)),
                     ("verified sync", lambda: pyxfer.verified_copy(small, "cuda:1", route="direct"))):
        result.append({"bytes": 4096, "case": name, "us": latency_us(fn)})
    return result


GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def timeline(sizes=(4 << 10, 16 << 20, 256 << 20), calls=3):
    """[{bytes, case, returned_us, ops: [{device, stream, name, start_us, end_us}]}] for the last of
    `calls` profiled calls of each case (each call after a synchronize of both GPUs); times are
    microseconds from the call's start on the host."""
    from torch.profiler import ProfilerActivity, profile, record_function
    result = []
    for size in sizes:
        src = torch.randint(-2**31, 2**31 - 1, (size // 4,), dtype=torch.int32, device="cuda:0")
        dst = torch.empty(size // 4, dtype=torch.int32, device="cuda:1")
        cases = verified_cases(src, dst)
        for name in ("raw copy_", "verified sync"):
            fn = cases[name]
            for _ in range(3):
                fn()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for i in range(calls):
                    torch.cuda.synchronize(0)
                    torch.cuda.synchronize(1)
                    with record_function(f"pyxfer-timeline-call-{i}"):
                        fn()
                torch.cuda.synchronize(0)
                torch.cuda.synchronize(1)
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                prof.export_chrome_trace(f.name)
                events = json.load(open(f.name))["traceEvents"]
            mark = next(e for e in events if e.get("name") == f"pyxfer-timeline-call-{calls - 1}"
                        and e.get("cat") == "user_annotation")
            t0, t1 = float(mark["ts"]), float(mark["ts"]) + float(mark["dur"])
            ops = []
            for e in events:
                if e.get("cat") in GPU_CATEGORIES and e.get("ph") == "X" and float(e["ts"]) >= t0:
                    args = e.get("args", {})
                    ops.append({"device": args.get("device"), "stream": args.get("stream"), "name": e["name"][:40],
                                "start_us": float(e["ts"]) - t0, "end_us": float(e["ts"]) + float(e["dur"]) - t0})
            ops.sort(key=lambda o: o["start_us"])
            result.append({"bytes": size, "case": name, "returned_us": t1 - t0, "ops": ops})
    return result


def print_timeline(result):
    for r in result:
        rows = [[o["device"], o["stream"], o["name"], f"{o['start_us']:.1f}", f"{o['end_us']:.1f}",
                 f"{o['end_us'] - o['start_us']:.1f}"] for o in r["ops"]]
        print_table(f"{fmt_size(r['bytes'])} {r['case']} (the call returned to the host at {r['returned_us']:.1f} us)",
                    ["gpu", "stream", "op", "start us", "end us", "us"], rows)


KNOBS = ("PYXFER_PEER_CHUNKS", "PYXFER_PEER_FUSED_MIB", "PYXFER_PEER_HASH_GRID")


def schedule_env(schedule):
    """The knobs of one --schedules entry: "auto" or "<shrink>,<min MiB>", then ":<fused MiB>" and
    "@<hash grid share>", each optional; the knobs it does not name are unset."""
    spec, _, grid = schedule.partition("@")
    chunks, _, fused = spec.partition(":")
    env = {k: v for k, v in os.environ.items() if k not in KNOBS}
    for name, value in zip(KNOBS, ("" if chunks == "auto" else chunks, fused, grid)):
        if value:
            env[name] = value
    return env


def run_schedules(schedules):
    """One subprocess per schedule (the native library reads its knobs once)."""
    runs = {}
    for schedule in schedules:
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            subprocess.run([sys.executable, __file__, "--child", "--json", out.name], env=schedule_env(schedule),
                           check=True)
            runs[schedule] = json.load(open(out.name))["rows"]
    return runs


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schedules", help='schedules to compare, e.g. "auto auto@1 9,4@1 2,8:0" (see the docstring)')
    p.add_argument("--timeline", action="store_true", help="profile one raw and one verified copy (see the docstring)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json")
    args = p.parse_args()
    if torch.cuda.device_count() < 2:
        print("peer_overlap: needs 2 GPUs; skipped")
        return
    torch.cuda.set_device(0)
    if args.child:
        write_json(args.json, {"rows": measure(with_diagnostics=False)})
        return
    if args.timeline:
        result = timeline()
        print_timeline(result)
        write_json(args.json, {"timeline": result})
        return
    if args.schedules:
        runs = run_schedules(args.schedules.split())
        rows = []
        for schedule, result in runs.items():
            raw = {(r["bytes"]): r for r in result if r["case"] == "raw copy_"}
            for r in result:
                if r["case"] == "raw copy_":
                    continue
                base = raw[r["bytes"]]
                if "us" in r:
                    rows.append([schedule, fmt_size(r["bytes"]), r["case"] + " (latency)", f"{r['us']:.1f} us",
                                 f"raw {base['us']:.1f} us", f"+{r['us'] - base['us']:.1f} us"])
                else:
                    rows.append([schedule, fmt_size(r["bytes"]), r["case"], f"{r['ms']:.3f} ms",
                                 f"raw {base['ms']:.3f} ms", f"{100 * base['ms'] / r['ms']:.1f}% of raw"])
        print_table("verified peer copies cuda:0 -> cuda:1 per schedule (auto|PYXFER_PEER_CHUNKS"
                    "[:PYXFER_PEER_FUSED_MIB][@PYXFER_PEER_HASH_GRID]; "
                    "CUDA events, median of 10; 4 KiB: wall latency, median of 200)",
                    ["schedule", "size", "case", "time", "baseline", "vs raw"], rows)
        write_json(args.json, {"schedules": runs})
        return
    result = measure(with_diagnostics=True)
    rows = []
    for size in SIZES:
        raw = next(r["ms"] for r in result if r["bytes"] == size and r["case"] == "raw copy_")
        for r in result:
            if r["bytes"] == size and "ms" in r:
                rows.append([fmt_size(size), r["case"], f"{r['ms']:.3f}", f"{size / r['ms'] / 1e6:.0f}",
                             f"{r['ms'] / raw:.3f}"])
    print_table(f"peer copy cuda:0 -> cuda:1 and what slows it (CUDA events, median of 10; PYXFER_PEER_CHUNKS="
                f"{os.environ.get('PYXFER_PEER_CHUNKS', 'default')})", ["size", "case", "ms", "GB/s", "x raw"], rows)
    lat = {r["case"]: r["us"] for r in result if "us" in r}
    print(f"4 KiB latency (wall, median of 200): raw copy_ {lat['raw copy_']:.1f} us, "
          f"verified sync {lat['verified sync']:.1f} us (+{lat['verified sync'] - lat['raw copy_']:.1f} us)")
    write_json(args.json, {"rows": result})


if __name__ == "__main__":
    main()
