"""Quantized all-gather (pyxfer.all_gather) against torch.distributed's plain all-gather, same run.

Spawns --world-size processes (default 2), one per GPU, NCCL (--backend gloo --device cpu: a CPU
smoke run). Every rank holds an MxK shard (default 8192x8192, random bf16); everything is gathered
along dim 0. Each case is timed the same way: warm-up calls, then for every rep all ranks meet at a
barrier (and synchronize their GPU) and each rank times one call between two CUDA events on its
current stream (wall clock on the CPU), wait() included: the call has returned and its result is
ready on that stream. time = median over reps of the slowest rank's call.
Bytes: bytes_out = W x what one rank sends in the data collective: plain, the shard; quantized, its
data and scale buffers (scale padding included); fallback, the shard in its nominal dtype (bf16), except
NVFP4 shards with different amax (gathered quantized, then decoded per shard and requantized).
algbw = bytes_out / time; busbw = bytes_out x (W-1)/W / time (nccl-tests' all-gather convention).
Cases (speed-up = time of the bf16 baseline of the same shard shape / time of the case):
- torch bf16: dist.all_gather_into_tensor (all_gather_single from torch 2.13 on, as pyxfer calls it)
  of the bf16 shard into a preallocated output (the baseline);
  torch uint8: the same for an MxK uint8 shard, the FP8-sized payload without scales (context);
  torch 384 B all-gather + host read: a host-built 48 x int64 record moved to the device, gathered and
  read back, as pyxfer.all_gather's metadata exchange does before the data gather of a waiting call
  (context: that exchange's floor; the timed calls repeat their signature, so after the warm-up they
  run in fused mode: data and record in one collective);
- pyxfer bf16: pyxfer.all_gather(x), the wrapper's overhead (its metadata exchange included);
- quantized FMT USAGE: pyxfer.all_gather(q) of a QuantizedTensor made beforehand (NVFP4 quantized with
  the group's all-reduced amax, so the shards can share one global scale), usages rowwise and
  rowwise+columnwise; "+ verify": the same with verify=True (PXH64 of every shard checked);
- quantize_as FMT: pyxfer.all_gather(x, quantize_as=QuantizeSpec(FMT)), bf16 in, quantized out
  (quantizing the shard is part of the time);
- fallback: shards that cannot be gathered quantized (dequantize, gather bf16, requantize), each
  against a torch bf16 gather of its own shape: FP8-block QuantizedTensors of (M+64)xK (M+64 is not a
  multiple of 128; W(M+64) is, for even W, so the result is requantized), quantize_as mxfp8 on
  (M+16)xK, quantize_as nvfp4 on (M+8)xK, and NVFP4 QuantizedTensors of MxK each quantized with its own
  amax (one element per rank set to 16 x (rank + 1), so the amaxes differ). (An MXFP8 / NVFP4
  QuantizedTensor always has whole blocks, so its shard is always quantizable.)
Checked outside the timed regions, on every rank: the path (a fallback warns, a quantized path does not)
and the result of every pyxfer case bit-identical (every buffer, scale padding included) to a
reference made in that process on its GPU from the full tensor gathered with torch: quantize(full)
for quantized and quantize_as cases, quantize(dequantized shards gathered) for fallbacks (the bf16
tensor itself where the gathered shape is not quantizable).
Targets (issue 5): quantized rowwise MXFP8 and FP8-block 1x128 >= 1.6x the bf16 gather, NVFP4 >= 2.5x;
fallback <= 1.25x the bf16 gather of the same shape; verify=True adds <= 15% to the quantized path.

    python benchmarks/gather.py [--world-size 2] [--rows 8192 --cols 8192] [--reps 50] [--json out.json]
    python benchmarks/gather.py --backend gloo --device cpu --rows 256 --cols 256 --reps 5   # CPU smoke run
"""
import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pyxfer  # noqa: E402
import pyxfer.gather  # noqa: E402
from pyxfer import formats  # noqa: E402
from pyxfer.gather import QuantizedGatherFallbackWarning  # noqa: E402
from pyxfer.tools.machine import machine_info  # noqa: E402
from pyxfer.tools.timing import fmt_gbps  # noqa: E402

from common import print_table, print_targets, write_json  # noqa: E402

USAGES = {"rowwise": (True, False), "rowwise+columnwise": (True, True)}
QUANTIZED_FORMATS = ("mxfp8", "fp8_block_1x128", "nvfp4", "fp8_block_128x128")
# Rows added to M for a fallback shard: not a multiple of the format's block, W x rows is for even W.
FALLBACK_EXTRA_ROWS = {"fp8_block": 64, "mxfp8": 16, "nvfp4": 8}
SPEEDUP_TARGETS = {"mxfp8": 1.6, "fp8_block_1x128": 1.6, "nvfp4": 2.5}
META_INTS = 48  # int64 slots of pyxfer.all_gather's metadata record
FALLBACK_TARGET = 1.25
VERIFY_TARGET = 0.15
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (shared hosts)
# torch's tensor all-gather, as pyxfer.all_gather calls it (all_gather_single from torch 2.13 on)
TORCH_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclasses.dataclass
class Case:
    name: str
    kind: str                   # baseline / plain / quantized / verify / quantize_as / fallback
    fn: Callable
    bytes_out: int
    shape: tuple                # shard shape
    baseline: str               # name of the bf16 baseline of the same shard shape
    fallback: bool = False      # the path it must take
    reference: Callable | None = None  # -> the expected result (None: no check)
    of_case: str | None = None  # verify: the case it adds verification to


# ---- one rank ---------------------------------------------------------------------------------------
class Rank:
    def __init__(self, rank, world, device, seed):
        self.rank, self.world, self.device = rank, world, device
        self.gen = torch.Generator(device).manual_seed(seed * 1000 + rank)
        self.fulls = {}

    def randn(self, shape):
        return torch.randn(shape, dtype=torch.bfloat16, device=self.device, generator=self.gen)

    def torch_gather(self, shard):
        out = torch.empty((self.world * shard.shape[0],) + tuple(shard.shape[1:]), dtype=shard.dtype,
                          device=self.device)
        TORCH_GATHER(out, shard.contiguous())
        return out

    def full(self, shard):
        """The full tensor (every rank's shard, rank-major), gathered with torch, cached per shard."""
        if id(shard) not in self.fulls:
            self.fulls[id(shard)] = (shard, self.torch_gather(shard))
        return self.fulls[id(shard)][1]

    def group_amax(self, x):
        amax = x.abs().amax().float().reshape(1)
        dist.all_reduce(amax, op=dist.ReduceOp.MAX)
        return amax

    def barrier(self):
        dist.barrier()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def call_ms(self, fn):
        """One call, timed between CUDA events on the current stream (wall clock on the CPU)."""
        if self.device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            return start.elapsed_time(stop)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    def time_ms(self, fn, warmup, reps):
        """This rank's milliseconds of each rep (all ranks start each rep together)."""
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            self.barrier()
            times.append(self.call_ms(fn))
        return times


def payload_bytes(q):
    return sum(b.numel() * b.element_size() for n, b in q.buffers().items() if n in formats.BUFFER_NAMES)


def build_cases(r: Rank, rows, cols):
    """Every case, in the order they run; all ranks build the same list."""
    world, m, k = r.world, rows, cols
    all_gather = pyxfer.all_gather
    cases = []
    x = r.randn((m, k))
    u8 = torch.randint(0, 256, (m, k), dtype=torch.uint8, device=r.device, generator=r.gen)
    out_u8 = torch.empty((world * m, k), dtype=torch.uint8, device=r.device)

    def bf16_baseline(shard):
        out = torch.empty((world * shard.shape[0], k), dtype=torch.bfloat16, device=r.device)
        name = "torch bf16" + ("" if shard.shape[0] == m else f" {shard.shape[0]}x{k}")
        cases.append(Case(name, "baseline", lambda: TORCH_GATHER(out, shard),
                          world * shard.numel() * 2, tuple(shard.shape), name))
        return name

    base = bf16_baseline(x)
    cases.append(Case("torch uint8 (FP8-sized)", "baseline", lambda: TORCH_GATHER(out_u8, u8),
                      world * m * k, (m, k), base))
    record, out_record = [r.rank] * META_INTS, torch.empty(world * META_INTS, dtype=torch.int64, device=r.device)

    def metadata_round_trip():  # what pyxfer.all_gather's metadata exchange costs at least
        TORCH_GATHER(out_record, torch.tensor(record, dtype=torch.int64).to(r.device))
        return out_record.tolist()

    cases.append(Case(f"torch {META_INTS * 8} B all-gather + host read", "context", metadata_round_trip,
                      world * META_INTS * 8, (META_INTS,), base))
    cases.append(Case("pyxfer bf16", "plain", lambda: all_gather(x), world * m * k * 2, (m, k), base,
                      reference=lambda: r.full(x)))

    for fmt in QUANTIZED_FORMATS:
        for usage, (row, col) in USAGES.items():
            opts = {"global_amax": r.group_amax(x)} if fmt == "nvfp4" else {}
            q = formats.quantize(x, fmt, rowwise=row, columnwise=col, **opts)

            def ref(fmt=fmt, row=row, col=col):
                return formats.quantize(r.full(x), fmt, rowwise=row, columnwise=col)

            name = f"quantized {fmt} {usage}"
            cases.append(Case(name, "quantized", lambda q=q: all_gather(q), world * payload_bytes(q), (m, k), base,
                              reference=ref))
            if usage == "rowwise":
                cases.append(Case(f"{name} + verify", "verify", lambda q=q: all_gather(q, verify=True),
                                  world * payload_bytes(q), (m, k), base, reference=ref, of_case=name))
    for fmt in QUANTIZED_FORMATS:
        spec = formats.QuantizeSpec(fmt)
        cases.append(Case(f"quantize_as {fmt} rowwise", "quantize_as",
                          lambda spec=spec: all_gather(x, quantize_as=spec), world * payload_bytes(spec.quantize(x)),
                          (m, k), base,
                          reference=lambda spec=spec: spec.quantize(r.full(x))))

    def requantized(hp, fmt, **opts):
        return formats.quantize(hp, fmt, **opts) if formats.is_quantizable(hp.shape, fmt) else hp

    xf = r.randn((m + FALLBACK_EXTRA_ROWS["fp8_block"], k))
    fbase = bf16_baseline(xf)
    for fmt in ("fp8_block_1x128", "fp8_block_128x128"):
        q = formats.quantize(xf, fmt)
        hp = q.dequantize()
        cases.append(Case(f"fallback {fmt} QuantizedTensor {xf.shape[0]}x{k}", "fallback", lambda q=q: all_gather(q),
                          world * xf.numel() * 2, tuple(xf.shape), fbase, fallback=True,
                          reference=lambda fmt=fmt, hp=hp: requantized(r.full(hp), fmt)))
    for fmt in ("mxfp8", "nvfp4"):
        xs = r.randn((m + FALLBACK_EXTRA_ROWS[fmt], k))
        sbase = bf16_baseline(xs)
        spec = formats.QuantizeSpec(fmt)
        cases.append(Case(f"fallback quantize_as {fmt} {xs.shape[0]}x{k}", "fallback",
                          lambda xs=xs, spec=spec: all_gather(xs, quantize_as=spec), world * xs.numel() * 2,
                          tuple(xs.shape), sbase, fallback=True,
                          reference=lambda xs=xs, fmt=fmt: requantized(r.full(xs), fmt)))
    # Each rank quantizes with its own amax, so the shards cannot share a global scale. One element per rank
    # makes the amaxes differ for sure (random bf16 shards of this size often have equal maxima).
    xa = x.clone()
    xa[0, 0] = 16.0 * (r.rank + 1)
    q_own = formats.quantize(xa, "nvfp4")
    hp_own = q_own.dequantize()
    cases.append(Case("fallback nvfp4 QuantizedTensor, amax per rank", "fallback", lambda: all_gather(q_own),
                      world * payload_bytes(q_own), (m, k), base, fallback=True,
                      reference=lambda: requantized(r.full(hp_own), "nvfp4", global_amax=r.group_amax(xa))))
    return cases


def same_bits(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def check(r: Rank, case: Case):
    """(ok, detail): the path taken and the result bitwise against the reference (outside the timing)."""
    pyxfer.gather.errors._warned.clear()  # the fallback warning is shown once per call site: show it again
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", QuantizedGatherFallbackWarning)
        got = case.fn()
    fell_back = any(issubclass(w.category, QuantizedGatherFallbackWarning) for w in caught)
    want = case.reference()
    if fell_back != case.fallback:
        return False, f"took the {'fallback' if fell_back else 'quantized'} path"
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor) or not same_bits(got, want):
            return False, "result differs from the reference"
        return True, "ok"
    if type(got) is not type(want) or tuple(got.shape) != tuple(want.shape):
        return False, f"got {type(got).__name__} {tuple(getattr(got, 'shape', ()))}, want {type(want).__name__} " \
                      f"{tuple(want.shape)}"
    gb, wb = got.buffers(), want.buffers()
    if sorted(gb) != sorted(wb):
        return False, f"buffers {sorted(gb)} != {sorted(wb)}"
    bad = [n for n in wb if not same_bits(gb[n], wb[n])]
    return (False, f"{', '.join(bad)} differ") if bad else (True, "ok")


def worker(rank, cfg, out_dir):
    if cfg["device"] == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    dist.init_process_group(cfg["backend"], init_method=f"file://{out_dir}/init", rank=rank,
                            world_size=cfg["world_size"], timeout=timedelta(seconds=300),
                            device_id=device if device.type == "cuda" else None)
    try:
        r = Rank(rank, cfg["world_size"], device, cfg["seed"])
        cases = build_cases(r, cfg["rows"], cfg["cols"])
        times, checks = {}, {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", QuantizedGatherFallbackWarning)
            for case in cases:
                times[case.name] = r.time_ms(case.fn, cfg["warmup"], cfg["reps"])
                if case.reference is not None:
                    checks[case.name] = check(r, case)
                r.fulls.clear()
        per_rank = [None] * r.world
        dist.all_gather_object(per_rank, {"times": times, "checks": checks})
        if rank == 0:
            result = {"env": machine_info(), "config": cfg, "rows": summarize(cases, per_rank, r.world)}
            result["targets"] = targets(result["rows"], timed=device.type == "cuda")
            with open(os.path.join(out_dir, "result.json"), "w") as f:
                json.dump(result, f)
    finally:
        dist.destroy_process_group()


# ---- results ----------------------------------------------------------------------------------------
def summarize(cases, per_rank, world):
    rows = []
    for c in cases:
        reps = zip(*(p["times"][c.name] for p in per_rank))
        ms = statistics.median(max(rep) for rep in reps)
        row = {"case": c.name, "kind": c.kind, "shard_shape": list(c.shape), "bytes_out": c.bytes_out, "ms": ms,
               "rank_median_ms": [statistics.median(p["times"][c.name]) for p in per_rank],
               "algbw_gbps": c.bytes_out / ms / 1e6, "busbw_gbps": c.bytes_out * (world - 1) / world / ms / 1e6,
               "baseline": c.baseline, "path": "-" if c.kind == "context" else "fallback" if c.fallback else
               "quantized" if c.kind in ("quantized", "verify", "quantize_as") else "plain"}
        if c.of_case:
            row["of_case"] = c.of_case
        if c.name in per_rank[0]["checks"]:
            results = [p["checks"][c.name] for p in per_rank]
            row["identical"] = all(ok for ok, _ in results)
            row["check"] = "ok" if row["identical"] else "; ".join(
                f"rank {i}: {d}" for i, (ok, d) in enumerate(results) if not ok)
        rows.append(row)
    by_name = {r["case"]: r for r in rows}
    for row in rows:
        # > 1: faster than the bf16 gather (None for the metadata context row: not the same work)
        row["speedup"] = None if row["kind"] == "context" else by_name[row["baseline"]]["ms"] / row["ms"]
        if "of_case" in row:
            row["verify_overhead"] = row["ms"] / by_name[row["of_case"]]["ms"] - 1
    return rows


def targets(rows, timed=True):
    """The issue's targets (timed=False: only the correctness one; the timings are defined for NCCL on GPUs)."""
    out = []

    def add(name, value, ok, text):
        out.append({"target": name, "measured": text, "value": value, "result": "PASS" if ok else "MISS"})

    by_name = {r["case"]: r for r in rows}
    for fmt, want in SPEEDUP_TARGETS.items() if timed else ():
        row = by_name[f"quantized {fmt} rowwise"]
        add(f"quantized {fmt} rowwise >= {want}x the bf16 gather", row["speedup"], row["speedup"] >= want,
            f"{row['speedup']:.2f}x")
    for row in rows if timed else ():
        if row["kind"] == "fallback":
            slow = 1 / row["speedup"]
            add(f"{row['case']} <= {FALLBACK_TARGET}x its bf16 gather", slow, slow <= FALLBACK_TARGET, f"{slow:.2f}x")
    for row in rows if timed else ():
        if row["kind"] == "verify":
            v = row["verify_overhead"]
            add(f"{row['case']}: verify adds <= {VERIFY_TARGET:.0%}", v, v <= VERIFY_TARGET, f"{v:+.1%}")
    bad = [r["case"] for r in rows if r.get("identical") is False]
    add("every pyxfer result bit-identical to the one-process reference (and on the expected path)", len(bad),
        not bad, "all" if not bad else f"{len(bad)} differ")
    return out


def show(result):
    cfg, rows = result["config"], result["rows"]
    w = cfg["world_size"]
    print_table(f"all-gather along dim 0, {w} ranks ({cfg['backend']}), shard {cfg['rows']}x{cfg['cols']}: time = "
                f"median over {cfg['reps']} reps of the slowest rank "
                f"({'CUDA events' if cfg['device'] == 'cuda' else 'wall clock'}); algbw = bytes_out / time, "
                f"busbw = bytes_out x (W-1)/W / time; speed-up = bf16 gather of the same shape / case",
                ["case", "path", "MiB out", "ms", "algbw GB/s", "busbw GB/s", "speed-up", "vs", "check"],
                [[r["case"], r["path"], f"{r['bytes_out'] / 2**20:.1f}", f"{r['ms']:.3f}", fmt_gbps(r["algbw_gbps"]),
                  fmt_gbps(r["busbw_gbps"]), f"{r['speedup']:.2f}x" if r["speedup"] else "-",
                  "" if r["baseline"] == r["case"] or not r["speedup"] else r["baseline"],
                  r.get("check", "-") if "verify_overhead" not in r else
                  f"{r['check']}, verify {r['verify_overhead']:+.1%}"]
                 for r in rows])
    print(f"targets ({w} ranks, measured in this run)" + ("" if cfg["device"] == "cuda" else
          "; the timing targets are defined for NCCL on GPUs: not evaluated here"))
    print_targets(result["targets"])


def run(world_size=2, backend="nccl", device="cuda", rows=8192, cols=8192, reps=50, warmup=5, seed=None):
    """Spawn world_size ranks, measure every case; returns the result dict (what --json writes)."""
    if world_size < 2:
        raise SystemExit("gather: --world-size must be at least 2")
    if device == "cuda" and torch.cuda.device_count() < world_size:
        raise SystemExit(f"gather: --world-size {world_size} needs {world_size} GPUs, "
                         f"{torch.cuda.device_count()} visible")
    if rows % 128 or cols % 128:
        raise SystemExit(f"gather: --rows and --cols must be multiples of 128 (quantizable shards), got {rows}x{cols}")
    seed = int.from_bytes(os.urandom(3), "little") if seed is None else seed
    cfg = {"world_size": world_size, "backend": backend, "device": device, "rows": rows, "cols": cols, "reps": reps,
           "warmup": warmup, "seed": seed}
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(cfg, tmp), nprocs=world_size, join=True)
        with open(os.path.join(tmp, "result.json")) as f:
            return json.load(f)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--backend", default="nccl", choices=("nccl", "gloo"))
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--rows", type=int, default=8192, help="M of each rank's shard (a multiple of 128)")
    p.add_argument("--cols", type=int, default=8192, help="K (a multiple of 128)")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--seed", type=int, help="data seed (default: random, recorded in the JSON)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    if args.backend == "nccl" and args.device != "cuda":
        p.error("NCCL needs --device cuda")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gather: no CUDA GPU (for a CPU smoke run: --backend gloo --device cpu --rows 256 --cols 256)")
        return
    result = run(args.world_size, args.backend, args.device, args.rows, args.cols, args.reps, args.warmup, args.seed)
    result["method"] = __doc__.split("\n\n    python")[0]
    show(result)
    write_json(args.json, result)
    if any(t["result"] == "MISS" and t["target"].startswith("every") for t in result["targets"]):
        sys.exit(1)  # wrong results, not just slow ones


if __name__ == "__main__":
    main()
