"""Verified transfers against plain-torch copies of the same tensors, measured in the same run.

Pairs: cuda:0 -> cuda:1 and cuda:1 -> cuda:0 (one GPU: cuda:0 -> cpu and cpu -> cuda:0; no GPU: cpu -> cpu
at sizes up to 16 MiB). Sizes 4 KiB, x4, ... 1 GiB of random int64 data. GB/s = bytes of the tensor / time
(each byte counted once, whatever the method reads, writes or compares). Columns and how each is timed:
- wall clock (perf_counter around a pass of calls plus a synchronize of the pair's GPUs, per call):
  raw ``dst.copy_(src)`` and ``verified_copy(verify="sync")`` (it waits on the host inside every call,
  so it is timed as the caller sees it; raw the same way, so that their ratio is fair);
- CUDA events on the destination's current stream (the source's when the destination is the CPU; for
  the pinned column, on the GPU that runs the copy):
  raw again (the baseline of the deferred mode), ``verified_copy(verify="deferred")``, ``staged_copy``,
  one ``copy_`` between the GPU and pinned host memory (device -> pinned host from the source GPU, the
  ceiling of the staged path; host -> device when the source is the CPU), naive ``src.cpu().to(dst)`` and
  naive round-trip verification ``torch.equal(a.to(dst).to(src), a)``.
Medians of many passes after warm-up; inputs are views of one buffer rotated over >= 256 MiB (at most
256 calls a pass) so that sources are not served from L2. One result per method is checked bit-exact
after timing. Also: 4 KiB latency (wall microseconds per call including the synchronize, median of 200),
a verified copy with one bit flipped on the direct path (detect + staged repair, end to end), peak extra
device memory of a verified copy beyond its destination, and the issue's targets with PASS/MISS.

    python benchmarks/transfer.py [--sizes 4K,16M,1G] [--max-size-mib 1024] [--json out.json]
"""
import argparse
import math
import os
import re
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pyxfer  # noqa: E402
from pyxfer.testing import inject_fault  # noqa: E402
from pyxfer.tools.timing import L2_DEFEAT_BYTES, cuda_time_ms, fmt_size  # noqa: E402

from common import print_table, write_json  # noqa: E402

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
MAX_CALLS = 256          # calls per pass: full rotation over L2_DEFEAT_BYTES would take 65536 at 4 KiB
SLOW_BYTES = 64 * MiB    # naive .cpu().to() from here on gets 3 reps (about 0.7 s a call at 1 GiB)
CPU_MAX_BYTES = 16 * MiB
LATENCY_BYTES = 4 * KiB
LEGEND = """columns: raw = dst.copy_(src); sync / deferred = verified_copy(route="auto", verify=...);
staged = staged_copy; pinned = one copy_ between the GPU and pinned host memory (device -> host from the
source GPU; host -> device when the source is the CPU); .cpu().to = naive host-staged copy; round trip =
torch.equal(a.to(dst).to(src), a); raw(ev) = raw timed like the columns after it.
"""


class Pair:
    """An ordered (src, dst) device pair, the GPUs to synchronize and the device whose stream is timed."""

    def __init__(self, src, dst):
        self.src, self.dst = torch.device(src), torch.device(dst)
        self.gpus = [d for d in dict.fromkeys((self.src, self.dst)) if d.type == "cuda"]
        self.event_device = self.dst if self.dst.type == "cuda" else self.gpus[0] if self.gpus else None
        self.name = f"{self.src}->{self.dst}"

    def sync(self):
        for d in self.gpus:
            torch.cuda.synchronize(d)


# ---- timing ---------------------------------------------------------------------------------------
def wall_ms(fn, inputs, pair, *, warmup=2, reps=10, min_calls=4):
    """Median wall milliseconds per call: perf_counter around a pass of fn over inputs (repeated to at
    least min_calls, so that the closing synchronize is amortized) and a synchronize of the pair."""
    calls = inputs * math.ceil(min_calls / len(inputs))
    times = []
    for i in range(warmup + reps):
        pair.sync()
        t0 = time.perf_counter()
        for x in calls:
            fn(x)
        pair.sync()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3 / len(calls))
    return statistics.median(times)


def event_ms(fn, inputs, pair, *, device=None, warmup=3, reps=20):
    """CUDA events on the current stream of `device` (default: the pair's event device; it must be one
    whose stream the work is ordered on) via pyxfer.tools.timing.cuda_time_ms; wall clock without a GPU."""
    device = device or pair.event_device
    if device is None:
        return wall_ms(fn, inputs, pair, warmup=warmup, reps=reps)
    return cuda_time_ms(fn, inputs, warmup=warmup, reps=reps, device=device)


def latency_us(fn, x, pair, *, warmup=20, reps=200):
    """Median host-observed microseconds of one call followed by a synchronize of the pair."""
    times = []
    for i in range(warmup + reps):
        t0 = time.perf_counter()
        fn(x)
        pair.sync()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


# ---- data and checks ------------------------------------------------------------------------------
def random_int64(num_bytes, device):  # integers: no NaN, so torch.equal compares bits
    return torch.randint(-2**63, 2**63 - 1, (num_bytes // 8,), dtype=torch.int64, device=device)


def views(buf, size, count):
    n = size // 8
    return [buf[i * n:(i + 1) * n] for i in range(count)]


def check(out, ref, what):
    if not torch.equal(out, ref.to(out.device)):
        raise AssertionError(f"{what}: the result differs from the source")


def verified(pair, verify):
    return lambda x: pyxfer.verified_copy(x, pair.dst, route="auto", verify=verify)


def repaired_copy(x, pair):
    """verified_copy(route="auto", verify="sync") with one bit flipped on the direct path: it must detect
    the flip, mark the pair corrupt and repair through the staged path."""
    pyxfer.health.reset()
    with inject_fault("bitflip", src=pair.src, dst=pair.dst, path="direct", times=1) as fault:
        out = pyxfer.verified_copy(x, pair.dst, route="auto", verify="sync")
    hit = fault.used == 1 and pyxfer.health.status(pair.src, pair.dst) == "corrupt"
    pyxfer.health.reset()  # later copies of the pair route direct again
    if not hit:
        raise AssertionError(f"{pair.name}: the injected fault did not hit a direct copy (no peer access?)")
    return out


# ---- measurements ---------------------------------------------------------------------------------
def measure_row(size, pair, pinned):
    count = min(MAX_CALLS, max(1, math.ceil(L2_DEFEAT_BYTES / size)))
    src_buf = random_int64(size * count, pair.src)
    dst_buf = torch.empty_like(src_buf, device=pair.dst)
    inputs, dsts = views(src_buf, size, count), views(dst_buf, size, count)
    pairs = list(zip(inputs, dsts))
    raw = lambda p: p[1].copy_(p[0])  # noqa: E731
    ms = {"raw": wall_ms(raw, pairs, pair),
          "sync": wall_ms(verified(pair, "sync"), inputs, pair),
          "raw_events": event_ms(raw, pairs, pair),
          "deferred": event_ms(verified(pair, "deferred"), inputs, pair),
          "staged": event_ms(lambda x: pyxfer.staged_copy(x, pair.dst), inputs, pair)}
    pyxfer.check_transfers()  # raises if any timed deferred copy mismatched
    if pair.gpus:
        # timed on the GPU that runs the copy: a non-blocking copy_ orders nothing on the other device
        host = pinned[:size // 8]
        if pair.src.type == "cuda":
            ms["pinned"] = event_ms(lambda x: host.copy_(x, non_blocking=True), inputs, pair, device=pair.src)
        else:
            ms["pinned"] = event_ms(lambda d: d.copy_(host, non_blocking=True), dsts, pair, device=pair.dst)
        slow = dict(warmup=1, reps=3 if size >= SLOW_BYTES else 5)
        ms["naive"] = event_ms(lambda x: x.cpu().to(pair.dst), inputs, pair, **slow)
        ms["round_trip"] = event_ms(lambda x: torch.equal(x.to(pair.dst).to(pair.src), x), inputs, pair, **slow)

    # outside the timed regions: one result of each method is bit-exact
    ref = inputs[0]
    check(dsts[0], ref, f"{pair.name} raw copy_")
    check(verified(pair, "sync")(ref), ref, f"{pair.name} verified (sync)")
    out = verified(pair, "deferred")(ref)
    pyxfer.check_transfers()
    check(out, ref, f"{pair.name} verified (deferred)")
    check(pyxfer.staged_copy(ref, pair.dst), ref, f"{pair.name} staged")
    if pair.gpus:
        check(ref.cpu().to(pair.dst), ref, f"{pair.name} naive .cpu().to()")
        if not torch.equal(ref.to(pair.dst).to(pair.src), ref):
            raise AssertionError(f"{pair.name} naive round trip: the result differs from the source")

    row = {"pair": pair.name, "bytes": size, "calls_per_pass": count}
    for key, v in ms.items():
        row[f"{key}_ms"], row[f"{key}_gbps"] = v, size / v / 1e6
    del src_buf, dst_buf, inputs, dsts, pairs, out
    if pair.gpus:
        torch.cuda.empty_cache()
    return row


def measure_latency(pair):
    x = random_int64(LATENCY_BYTES, pair.src)
    d = torch.empty_like(x, device=pair.dst)
    row = {"pair": pair.name, "bytes": LATENCY_BYTES, "raw_us": latency_us(lambda t: d.copy_(t), x, pair),
           "sync_us": latency_us(verified(pair, "sync"), x, pair),
           "deferred_us": latency_us(verified(pair, "deferred"), x, pair)}
    pyxfer.check_transfers()
    return row


def measure_repair(size, pair, reps=5):
    x = random_int64(size, pair.src)
    times = []
    for i in range(1 + reps):  # the first is a warm-up
        pair.sync()
        t0 = time.perf_counter()
        out = repaired_copy(x, pair)
        pair.sync()
        if i:
            times.append((time.perf_counter() - t0) * 1e3)
        check(out, x, f"{pair.name} repaired copy")  # outside the timed region
    ms = statistics.median(times)
    return {"pair": pair.name, "bytes": size, "ms": ms, "gbps": size / ms / 1e6}


def measure_memory(size, pair):
    """Peak device memory of one copy beyond what was allocated before it and beyond its result, per GPU."""
    x = random_int64(size, pair.src)
    rows = []
    for method, fn in (("verified (sync)", verified(pair, "sync")), ("verified (deferred)", verified(pair, "deferred")),
                       ("repaired", lambda t: repaired_copy(t, pair))):
        pair.sync()
        base = {}
        for d in pair.gpus:
            torch.cuda.reset_peak_memory_stats(d)
            base[d] = torch.cuda.memory_allocated(d)
        out = fn(x)
        pair.sync()
        extra = {str(d): torch.cuda.max_memory_allocated(d) - base[d] for d in pair.gpus}
        if out.is_cuda:
            extra[str(out.device)] -= out.untyped_storage().nbytes()
        rows.append({"pair": pair.name, "bytes": size, "method": method, "extra_bytes": extra})
        del out
    pyxfer.check_transfers()
    return rows


# ---- output ---------------------------------------------------------------------------------------
def gb(v):
    return "-" if v is None else f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 1 else f"{v:.3f}"


def ratio(a, b):
    return "-" if a is None or b is None else f"{a / b:.3f}" if a / b < 10 else f"{a / b:.1f}"


def show_rows(pair, rows):
    cols = ["size", "raw", "sync", "raw(ev)", "deferred", "staged", "pinned", ".cpu().to", "round trip",
            "sync/raw", "defer/raw(ev)", "staged/pinned", "staged/naive"]
    out = []
    for r in rows:
        g = lambda k, r=r: r.get(f"{k}_gbps")  # noqa: E731
        out.append([fmt_size(r["bytes"]), *(gb(g(k)) for k in ("raw", "sync", "raw_events", "deferred", "staged",
                                                                  "pinned", "naive", "round_trip")),
                    *(ratio(g(a), g(b)) for a, b in (("sync", "raw"), ("deferred", "raw_events"),
                                                         ("staged", "pinned"), ("staged", "naive")))])
    rest = "CUDA events" if pair.event_device else "wall clock too (no GPU)"
    print_table(f"{pair.name}: GB/s = tensor bytes / time, median; raw, sync: wall clock; the rest: {rest}", cols, out)


def targets(result):
    """(target, measured, PASS/MISS/not measured) for each target of the issue, per direction."""
    out = []

    def add(name, value, ok, fmt):
        out.append([name, "-" if value is None else fmt(value), "not measured" if value is None else
                    "PASS" if ok(value) else "MISS"])

    pct = lambda v: f"{v:.1%}"  # noqa: E731
    for pair in dict.fromkeys(r["pair"] for r in result["rows"]):
        rows = {r["bytes"]: r for r in result["rows"] if r["pair"] == pair}
        big = [r for b, r in rows.items() if b >= 256 * MiB]
        worst = lambda a, b, big=big: min((r[f"{a}_gbps"] / r[f"{b}_gbps"] for r in big), default=None)  # noqa: E731
        mid = rows.get(16 * MiB)
        add(f"{pair} verified(sync)/raw >= 95% at >= 256 MiB (worst)", worst("sync", "raw"), lambda v: v >= 0.95, pct)
        add(f"{pair} verified(sync)/raw >= 80% at 16 MiB", mid and mid["sync_gbps"] / mid["raw_gbps"],
            lambda v: v >= 0.80, pct)
        lat = next((r for r in result["latency"] if r["pair"] == pair), None)
        add(f"{pair} 4 KiB verified(sync) - raw latency <= 25 us", lat and lat["sync_us"] - lat["raw_us"],
            lambda v: v <= 25, lambda v: f"{v:.1f} us")
        add(f"{pair} staged/D2H pinned >= 80% at >= 256 MiB (worst)", worst("staged", "pinned"),
            lambda v: v >= 0.80, pct)
        add(f"{pair} staged/naive .cpu().to() >= 20x at >= 256 MiB (worst)", worst("staged", "naive"),
            lambda v: v >= 20, lambda v: f"{v:.1f}x")
        rep = next((r for r in result["repair"] if r["pair"] == pair and r["bytes"] == GiB), None)
        add(f"{pair} repaired (fault + staged repair)/D2H pinned >= 70% at 1 GiB",
            rep and rep["gbps"] / rows[GiB]["pinned_gbps"], lambda v: v >= 0.70, pct)
    for m in result["memory"]:
        if m["method"] == "verified (sync)":
            extra = max(m["extra_bytes"].values())
            add(f"{m['pair']} extra device memory of a verified copy of {fmt_size(m['bytes'])} <= 1 MiB (O(1))",
                extra, lambda v: v <= MiB, lambda v: f"{v} B")
    return out


def parse_size(text):
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4K, 16MiB, 1G, 4096)")
    return int(float(m[1]) * {"": 1, "K": KiB, "M": MiB, "G": GiB}[m[2].upper()])


def environment():
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "pyxfer": pyxfer.__version__,
           "build": pyxfer.build_info(), "threads": torch.get_num_threads(),
           "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}
    if len(env["gpus"]) >= 2:
        env["peer_access"] = {"0->1": torch.cuda.can_device_access_peer(0, 1),
                              "1->0": torch.cuda.can_device_access_peer(1, 0)}
    return env


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=lambda text: [parse_size(t) for t in text.split(",")],
                   help="comma-separated sizes, e.g. 4K,16M,1G (default 4 KiB, x4, ... 1 GiB)")
    p.add_argument("--max-size-mib", type=float, default=1024.0, help="skip sizes above this")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()

    sizes = args.sizes or [LATENCY_BYTES << 2 * k for k in range(10)]
    if any(s <= 0 or s % 8 for s in sizes):
        p.error("sizes must be positive multiples of 8 bytes")
    num_gpus = torch.cuda.device_count()
    max_bytes = int(args.max_size_mib * MiB) if num_gpus else min(int(args.max_size_mib * MiB), CPU_MAX_BYTES)
    sizes = sorted({s for s in sizes if s <= max_bytes})
    if not sizes:
        p.error("no size left under --max-size-mib")

    result = {"env": environment(), "method": __doc__.split("\n\n    python")[0], "rows": [], "latency": [],
              "repair": [], "memory": []}
    if num_gpus >= 2:
        pairs = [Pair("cuda:0", "cuda:1"), Pair("cuda:1", "cuda:0")]
        print(f"{result['env']['gpus'][0]} x{num_gpus}, peer access {result['env']['peer_access']}, "
              f"torch {torch.__version__}\n")
    elif num_gpus == 1:
        pairs = [Pair("cuda:0", "cpu"), Pair("cpu", "cuda:0")]
        print(f"one GPU ({result['env']['gpus'][0]}): GPU pair rows skipped; cuda:0 <-> cpu instead\n")
    else:
        pairs = [Pair("cpu", "cpu")]
        print(f"no CUDA GPU: GPU pair rows skipped; cpu -> cpu only, sizes up to {fmt_size(CPU_MAX_BYTES)} "
              f"({result['env']['threads']} threads); no pinned/naive columns, no device memory\n")
    print(LEGEND)
    pinned = torch.empty(max(sizes) // 8, dtype=torch.int64, pin_memory=True) if num_gpus else None
    repair_sizes = [s for s in sizes if s >= 16 * MiB] or [max(sizes)]

    pyxfer.health.reset()
    for pair in pairs:
        rows = [measure_row(size, pair, pinned) for size in sizes]
        result["rows"] += rows
        show_rows(pair, rows)
        result["latency"].append(measure_latency(pair))
        result["repair"] += [measure_repair(size, pair) for size in repair_sizes]
        if pair.gpus:
            result["memory"] += measure_memory(max(sizes), pair)

    print_table(f"latency at {fmt_size(LATENCY_BYTES)}: wall us per call including the synchronize, median of 200",
                ["pair", "raw copy_", "verified (sync)", "verified (deferred)", "sync - raw"],
                [[r["pair"], f"{r['raw_us']:.1f}", f"{r['sync_us']:.1f}", f"{r['deferred_us']:.1f}",
                  f"{r['sync_us'] - r['raw_us']:.1f}"] for r in result["latency"]])
    pinned_gbps = {(r["pair"], r["bytes"]): r.get("pinned_gbps") for r in result["rows"]}
    print_table("repair: verified copy (sync, auto) with one bit flipped on the direct path, detect + staged "
                "repair, wall ms end to end, median of 5",
                ["pair", "size", "ms", "GB/s", "/pinned"],
                [[r["pair"], fmt_size(r["bytes"]), f"{r['ms']:.2f}", gb(r["gbps"]),
                  ratio(r["gbps"], pinned_gbps[r["pair"], r["bytes"]])] for r in result["repair"]])
    for m in result["memory"]:
        print(f"peak extra device memory, {m['method']} {m['pair']} of {fmt_size(m['bytes'])} (beyond the result): "
              + ", ".join(f"{d} {v} B" for d, v in m["extra_bytes"].items()))
    if result["memory"]:
        print()

    if num_gpus >= 2:
        result["targets"] = [dict(zip(("target", "measured", "result"), t)) for t in targets(result)]
        print("targets (measured in this run)")
        for t in result["targets"]:
            print(f"  {t['result']:>12}  {t['measured']:>9}  {t['target']}")
    else:
        print("targets: defined for a pair of GPUs; not evaluated here\n")
    # the peer-copy knobs in effect (read by the native library; see peer_overlap.py)
    result["peer_knobs"] = {k: os.environ.get(k, "default") for k in ("PYXFER_PEER_FUSED_MIB", "PYXFER_PEER_CHUNKS",
                                                                      "PYXFER_PEER_HASH_GRID", "PYXFER_PEER_RATES")}
    print(" ".join(f"{k}={v}" for k, v in result["peer_knobs"].items()))
    write_json(args.json, result)


if __name__ == "__main__":
    main()
