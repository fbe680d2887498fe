"""Quantized all-gather (pyxfer.all_gather) against torch.distributed's plain all-gathers, same run.

Spawns --world-size processes (default 2), one per GPU, NCCL (--backend gloo --device cpu: a CPU
smoke run). Every rank holds an MxK shard (default 8192x8192, random bf16); everything is gathered
along dim 0. Each case is timed in each mode (--modes), all on the same warm machine:
- cold: for every rep all ranks meet at a barrier (and synchronize their GPU), then each rank times one
  call between two CUDA events on its current stream (wall clock on the CPU), wait() included: the
  call has returned and its result is ready on that stream;
- piped: after the barrier each rank times --calls calls back to back (no host wait between them:
  the host runs ahead as far as the call lets it; pyxfer's reads the previous call's verdict before it
  launches) between two events; per call;
- graph: one call captured in a CUDA graph after the warm-up (pyxfer's calls are then fused: one
  native call), each rep times --calls replays back to back; per replay. pyxfer's verdicts are read
  after the timed region (pyxfer.check_gathers). Cases that need a host read (verify, the mismatch)
  are not captured.
time = median over --reps reps of the slowest rank's time.
host us = the host's wall time per call while issuing the calls of a rep (before its wait for the device),
median over reps of the slowest rank.
Bytes: bytes_out = W x what one rank sends in the data collective: plain, the shard; quantized, its
data and scale buffers as sent (padding rows trimmed; the plan's layout); fallback, the shard in its
nominal dtype (bf16), except NVFP4 shards with different amax (gathered quantized, renormalised on the
device). The 384-byte agreement record that travels with pyxfer's data is not counted.
algbw = bytes_out / time; busbw = bytes_out x (W-1)/W / time (nccl-tests' all-gather convention).
Every case is measured beside two torch baselines in the same mode: torch bf16 (all_gather_single of
the bf16 shard of the same shape; "x bf16" = its time / the case's) and the case's floor: torch uint8
of exactly the case's bytes per rank ("% floor" = the floor's time / the case's: 100% moves the case's
bytes as fast as a plain torch gather of that many bytes).
Cases:
- torch bf16 / torch uint8 (FP8-sized): baselines;
- pyxfer bf16: pyxfer.all_gather(x), the wrapper's overhead;
- quantized FMT USAGE: pyxfer.all_gather(q) of a QuantizedTensor made beforehand (NVFP4 quantized with
  the group's all-reduced amax, so the shards share one global scale), usages rowwise and
  rowwise+columnwise; "+ verify": the same with verify=True (PXH64 of every shard checked; a host read
  per call, so cold mode only);
- quantize_as FMT: pyxfer.all_gather(x, quantize_as=QuantizeSpec(FMT)), bf16 in, quantized out
  (quantizing the shard is part of the time; NVFP4 with the group's amax waits for the records);
- fallback: shards that cannot be gathered quantized (dequantize, gather bf16, requantize), each against
  torch gathers of its own shape: FP8-block QuantizedTensors of (M+64)xK, quantize_as mxfp8 on (M+16)xK,
  quantize_as nvfp4 on (M+8)xK, and NVFP4 QuantizedTensors of MxK each quantized with its own amax
  (renormalised on the device after a quantized gather);
- alternating MXFP8 rowwise: QuantizedTensors of MxK and (M/2)xK, one call of each per timed unit (a
  period-2 schedule: fused), per call; its baselines alternate the same two shapes;
- mismatch (cold only): a fused group whose last rank calls with another shape (it raises at once, the
  others get a result marked invalid and raise in check_gathers), then one call of the agreed shape
  (a new agreement): what detecting a disagreement and agreeing again costs.
Checked outside the timed regions, on every rank: the path (a fallback warns, a quantized path does not)
and the result of every pyxfer case bit-identical (every buffer, scale padding included) to a
reference made in that process on its GPU from the full tensor gathered with torch; the graph mode's
replayed result too; the mismatch's error on every rank.
Targets (issue 32, cold mode, as the issue's table): pyxfer bf16 >= 0.97x torch bf16; quantized rowwise
MXFP8 and FP8-block 1x128 >= 1.6x the bf16 gather at 2 ranks, >= 1.7x at 4; NVFP4 >= 2.3x at 2 ranks
(2.5x the stretch), >= 2.7x at 4; (issue 5) fallback <= 1.25x the bf16 gather of the same shape, verify
adds <= 15%.

    python benchmarks/gather.py [--world-size 2] [--rows 8192 --cols 8192] [--reps 30] [--json out.json]
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
# issue 32's goals (cold mode): world size -> {format: x bf16}
SPEEDUP_TARGETS = {2: {"mxfp8": 1.6, "fp8_block_1x128": 1.6, "nvfp4": 2.3},
                   4: {"mxfp8": 1.7, "fp8_block_1x128": 1.7, "nvfp4": 2.7}}
NVFP4_STRETCH_2 = 2.5
PLAIN_TARGET = 0.97
FALLBACK_TARGET = 1.25
VERIFY_TARGET = 0.15
MODES = ("cold", "piped", "graph")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (shared hosts)
# torch's tensor all-gather, as pyxfer calls it (all_gather_single from torch 2.13 on)
TORCH_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclasses.dataclass
class Case:
    name: str
    kind: str                   # baseline, plain, quantized, verify, quantize_as, fallback, alternating, mismatch
    fn: Callable
    shapes: tuple               # the shard shapes of one timed unit (two for the alternating case)
    fallback: bool = False      # the path it must take
    reference: Callable | None = None  # -> the expected result of one call of fn (None: no check)
    of_case: str | None = None  # verify: the case it adds verification to
    sent: list | None = None    # bytes per rank of each call of one unit (None: from the plan after the warm-up)
    graph: bool = True          # can be captured in a CUDA graph
    modes: tuple = MODES


# ---- one rank ---------------------------------------------------------------------------------------
class Rank:
    def __init__(self, rank, world, device, seed, calls):
        self.rank, self.world, self.device, self.calls = rank, world, device, calls
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

    def span_ms(self, fn, count):
        """``count`` calls of fn back to back, timed between CUDA events (wall clock on the CPU), per call; and
        the host's microseconds per call (wall clock around the calls, before any wait for the device)."""
        if self.device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            for _ in range(count):
                fn()
            host = time.perf_counter() - t0
            stop.record()
            stop.synchronize()
            return start.elapsed_time(stop) / count, host * 1e6 / count
        t0 = time.perf_counter()
        for _ in range(count):
            fn()
        host = time.perf_counter() - t0
        return host * 1e3 / count, host * 1e6 / count

    def times_ms(self, fn, mode, warmup, reps):
        """This rank's (milliseconds per call, host us per call) of each rep (all ranks start each rep
        together); for the graph mode also the captured call's result (what its replays produce)."""
        for _ in range(warmup):
            fn()
        out = None
        if mode == "graph":
            self.barrier()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = fn()
            fn = graph.replay
        times, hosts = [], []
        for _ in range(reps):
            self.barrier()
            ms, host_us = self.span_ms(fn, 1 if mode == "cold" else self.calls)
            times.append(ms)
            hosts.append(host_us)
        if mode == "graph":
            torch.cuda.synchronize(self.device)
        return times, hosts, out


def payload_bytes(q):
    return sum(b.numel() * b.element_size() for n, b in q.buffers().items() if n in formats.BUFFER_NAMES)


def sent_bytes(world):
    """Bytes one rank sends in the data collective of the group's predicted (fused) call."""
    plan = pyxfer.gather.engine.state_of(dist.group.WORLD, dist.get_rank(), world).predicted()
    return sum(d.itemsize * n for d, n in plan.layout)


def build_cases(r: Rank, rows, cols):
    """Every case, in the order they run; all ranks build the same list."""
    world, m, k = r.world, rows, cols
    all_gather = pyxfer.all_gather
    cases = []
    x = r.randn((m, k))
    u8 = torch.randint(0, 256, (m, k), dtype=torch.uint8, device=r.device, generator=r.gen)
    out_u8 = torch.empty((world * m, k), dtype=torch.uint8, device=r.device)
    out_x = torch.empty((world * m, k), dtype=torch.bfloat16, device=r.device)
    cases.append(Case("torch bf16", "baseline", lambda: TORCH_GATHER(out_x, x), ((m, k),), sent=[m * k * 2]))
    cases.append(Case("torch uint8 (FP8-sized)", "baseline", lambda: TORCH_GATHER(out_u8, u8), ((m, k),),
                      sent=[m * k]))
    cases.append(Case("pyxfer bf16", "plain", lambda: all_gather(x), ((m, k),), reference=lambda: r.full(x)))

    for fmt in QUANTIZED_FORMATS:
        for usage, (row, col) in USAGES.items():
            opts = {"global_amax": r.group_amax(x)} if fmt == "nvfp4" else {}
            q = formats.quantize(x, fmt, rowwise=row, columnwise=col, **opts)

            def ref(fmt=fmt, row=row, col=col):
                return formats.quantize(r.full(x), fmt, rowwise=row, columnwise=col)

            name = f"quantized {fmt} {usage}"
            cases.append(Case(name, "quantized", lambda q=q: all_gather(q), ((m, k),), reference=ref))
            if usage == "rowwise":
                cases.append(Case(f"{name} + verify", "verify", lambda q=q: all_gather(q, verify=True), ((m, k),),
                                  reference=ref, of_case=name, graph=False, modes=("cold",)))
    for fmt in QUANTIZED_FORMATS:
        spec = formats.QuantizeSpec(fmt)
        cases.append(Case(f"quantize_as {fmt} rowwise", "quantize_as",
                          lambda spec=spec: all_gather(x, quantize_as=spec), ((m, k),),
                          reference=lambda spec=spec: spec.quantize(r.full(x)),
                          sent=[payload_bytes(spec.quantize(x))] if fmt == "nvfp4" else None,
                          graph=fmt != "nvfp4"))  # (NVFP4 with the group's amax reads the records: never fused)

    def requantized(hp, fmt, **opts):
        return formats.quantize(hp, fmt, **opts) if formats.is_quantizable(hp.shape, fmt) else hp

    xf = r.randn((m + FALLBACK_EXTRA_ROWS["fp8_block"], k))
    for fmt in ("fp8_block_1x128", "fp8_block_128x128"):
        q = formats.quantize(xf, fmt)
        hp = q.dequantize()
        cases.append(Case(f"fallback {fmt} QuantizedTensor {xf.shape[0]}x{k}", "fallback", lambda q=q: all_gather(q),
                          (tuple(xf.shape),), fallback=True,
                          reference=lambda fmt=fmt, hp=hp: requantized(r.full(hp), fmt)))
    for fmt in ("mxfp8", "nvfp4"):
        xs = r.randn((m + FALLBACK_EXTRA_ROWS[fmt], k))
        spec = formats.QuantizeSpec(fmt)
        cases.append(Case(f"fallback quantize_as {fmt} {xs.shape[0]}x{k}", "fallback",
                          lambda xs=xs, spec=spec: all_gather(xs, quantize_as=spec), (tuple(xs.shape),),
                          fallback=True, reference=lambda xs=xs, fmt=fmt: requantized(r.full(xs), fmt)))
    # Each rank quantizes with its own amax, so the shards cannot share a global scale. One element per rank
    # makes the amaxes differ for sure (random bf16 shards of this size often have equal maxima).
    xa = x.clone()
    xa[0, 0] = 16.0 * (r.rank + 1)
    q_own = formats.quantize(xa, "nvfp4")
    hp_own = q_own.dequantize()
    cases.append(Case("fallback nvfp4 QuantizedTensor, amax per rank", "fallback", lambda: all_gather(q_own),
                      ((m, k),), fallback=True,
                      reference=lambda: requantized(r.full(hp_own), "nvfp4", global_amax=r.group_amax(xa))))

    # two shapes, alternating call by call: a period-2 schedule
    half = max(m // 2 // 128 * 128, 128)
    xb = r.randn((half, k))
    qa, qb = formats.quantize(x, "mxfp8"), formats.quantize(xb, "mxfp8")
    cases.append(Case("alternating mxfp8 rowwise", "alternating", lambda: (all_gather(qa), all_gather(qb))[1],
                      ((m, k), (half, k)), reference=lambda: formats.quantize(r.full(xb), "mxfp8")))

    xm = torch.zeros((32, 64), device=r.device)
    odd = torch.zeros((16, 64), device=r.device)

    def mismatch():
        """Two agreeing calls (the group fuses), then the last rank leaves the schedule: every rank raises (at
        once / in check_gathers); then one call of the agreed shape agrees anew. Returns the errors seen."""
        errors = 0
        all_gather(xm)
        all_gather(xm)
        try:
            all_gather(odd if r.rank == world - 1 else xm)
            pyxfer.check_gathers()
        except ValueError:
            errors += 1
        all_gather(xm)
        return errors

    cases.append(Case("mismatch unit: 2 agreeing calls, 1 fused call left by a rank + check_gathers, 1 call "
                      "agreeing anew (32x64 fp32, per unit)", "mismatch", mismatch, ((32, 64),), sent=[32 * 64 * 4],
                      graph=False, modes=("cold",)))
    return cases


def same_bits(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def compare(got, want):
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


def check(r: Rank, case: Case):
    """(ok, detail): the path taken and the result bitwise against the reference (outside the timing)."""
    pyxfer.gather.errors._warned.clear()  # the fallback warning is shown once per call site: show it again
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", QuantizedGatherFallbackWarning)
        got = case.fn()
        pyxfer.check_gathers()  # (a fused NVFP4 call warns about different amax when its verdict is read)
    if case.kind == "mismatch":
        return (got == 1, "ok" if got == 1 else "no error raised")
    fell_back = any(issubclass(w.category, QuantizedGatherFallbackWarning) for w in caught)
    if fell_back != case.fallback:
        return False, f"took the {'fallback' if fell_back else 'quantized'} path"
    return compare(got, case.reference())


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
        r = Rank(rank, cfg["world_size"], device, cfg["seed"], cfg["calls"])
        cases = build_cases(r, cfg["rows"], cfg["cols"])
        modes = [m for m in cfg["modes"] if m != "graph" or device.type == "cuda"]
        times, hosts = {m: {} for m in modes}, {m: {} for m in modes}
        checks, sent = {}, {}
        floors, bf16s = {m: {} for m in modes}, {m: {} for m in modes}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", QuantizedGatherFallbackWarning)
            for case in cases:
                for mode in modes:
                    if mode not in case.modes or (mode == "graph" and not case.graph):
                        continue
                    times[mode][case.name], hosts[mode][case.name], out = r.times_ms(case.fn, mode, cfg["warmup"],
                                                                                     cfg["reps"])
                    if mode == "graph" and out is not None and case.reference is not None:
                        checks[f"{case.name} (graph replay)"] = compare(out, case.reference())
                    pyxfer.check_gathers()
                    if case.name not in sent:
                        sent[case.name] = case.sent or [sent_bytes(r.world)] * len(case.shapes)
                        if case.kind == "alternating":  # the plan after the warm-up is the first shape's
                            sent[case.name] = alternating_bytes(r, case)
                    for key, store, make in ((tuple(sent[case.name]), floors[mode], floor_fn),
                                             (case.shapes, bf16s[mode], bf16_fn)):
                        if key not in store:
                            store[key] = r.times_ms(make(r, key), mode, cfg["warmup"], cfg["reps"])[0]
                if case.reference is not None or case.kind == "mismatch":
                    checks[case.name] = check(r, case)
                pyxfer.check_gathers()
                r.fulls.clear()
        per_rank = [None] * r.world
        dist.all_gather_object(per_rank, {"times": times, "hosts": hosts, "checks": checks, "sent": sent,
                                          "floors": {m: list(v.items()) for m, v in floors.items()},
                                          "bf16s": {m: list(v.items()) for m, v in bf16s.items()}})
        if rank == 0:
            result = {"env": machine_info(), "config": cfg,
                      "modes": {m: summarize(cases, per_rank, r.world, m) for m in modes}}
            result["rows"] = result["modes"]["cold"]
            result["targets"] = targets(result["modes"], r.world, timed=device.type == "cuda")
            with open(os.path.join(out_dir, "result.json"), "w") as f:
                json.dump(result, f)
    finally:
        dist.destroy_process_group()


def alternating_bytes(r, case):
    out = []
    for shape in case.shapes:  # the bytes of one MXFP8 rowwise call of each shape
        q = formats.quantize(torch.zeros(shape, dtype=torch.bfloat16, device=r.device), "mxfp8")
        out.append(q.rowwise_data.numel() + shape[0] * q.rowwise_scale_inv.shape[1])
    return out


def floor_fn(r, sent):
    """torch uint8 gathers of exactly these bytes per rank, one after the other (one timed unit)."""
    pairs = [(torch.randint(0, 256, (n,), dtype=torch.uint8, device=r.device, generator=r.gen),
              torch.empty(r.world * n, dtype=torch.uint8, device=r.device)) for n in sent]

    def fn():
        for send, recv in pairs:
            TORCH_GATHER(recv, send)
    return fn


def bf16_fn(r, shapes):
    pairs = [(r.randn(s), torch.empty((r.world * s[0],) + tuple(s[1:]), dtype=torch.bfloat16, device=r.device))
             for s in shapes]

    def fn():
        for send, recv in pairs:
            TORCH_GATHER(recv, send)
    return fn


# ---- results ----------------------------------------------------------------------------------------
def slowest_median(per_rank_times):
    return statistics.median(max(rep) for rep in zip(*per_rank_times))


def summarize(cases, per_rank, world, mode):
    rows = []
    floors = [dict((tuple(k), v) for k, v in p["floors"][mode]) for p in per_rank]
    bf16s = [dict((tuple(tuple(s) for s in k), v) for k, v in p["bf16s"][mode]) for p in per_rank]
    for c in cases:
        if c.name not in per_rank[0]["times"][mode]:
            continue
        units = len(c.shapes)
        ms = slowest_median([p["times"][mode][c.name] for p in per_rank]) / units
        sent = per_rank[0]["sent"][c.name]
        floor_ms = slowest_median([f[tuple(sent)] for f in floors]) / units
        bf16_ms = slowest_median([b[tuple(tuple(s) for s in c.shapes)] for b in bf16s]) / units
        bytes_out = world * sum(sent) / units
        row = {"case": c.name, "kind": c.kind, "mode": mode, "shard_shapes": [list(s) for s in c.shapes],
               "bytes_out": bytes_out, "ms": ms, "bf16_ms": bf16_ms, "floor_ms": floor_ms,
               "rank_median_ms": [statistics.median(p["times"][mode][c.name]) / units for p in per_rank],
               # the host's time per call (issuing it, before any wait for the device), slowest rank
               "host_us": slowest_median([p["hosts"][mode][c.name] for p in per_rank]) / units,
               "algbw_gbps": bytes_out / ms / 1e6, "busbw_gbps": bytes_out * (world - 1) / world / ms / 1e6,
               "speedup": bf16_ms / ms, "of_floor": floor_ms / ms,
               "path": "-" if c.kind in ("baseline", "mismatch") else "fallback" if c.fallback else
               "plain" if c.kind == "plain" else "quantized"}
        if c.of_case:
            row["of_case"] = c.of_case
        for name in (c.name, f"{c.name} (graph replay)") if mode == "graph" else (c.name,):
            if name in per_rank[0]["checks"]:
                results = [p["checks"][name] for p in per_rank]
                ok = all(good for good, _ in results)
                row["identical"] = row.get("identical", True) and ok
                row["check"] = "ok" if row["identical"] else "; ".join(
                    f"rank {i}: {d}" for i, (good, d) in enumerate(results) if not good)
        rows.append(row)
    by_name = {r["case"]: r for r in rows}
    for row in rows:
        if "of_case" in row and row["of_case"] in by_name:
            row["verify_overhead"] = row["ms"] / by_name[row["of_case"]]["ms"] - 1
    return rows


def targets(modes, world, timed=True):
    """The issues' targets (timed=False: only the correctness one; the timings are defined for NCCL on GPUs)."""
    out = []

    def add(name, value, ok, text):
        out.append({"target": name, "measured": text, "value": value, "result": "PASS" if ok else "MISS"})

    cold = {r["case"]: r for r in modes["cold"]}
    if timed:
        row = cold["pyxfer bf16"]
        add(f"pyxfer bf16 >= {PLAIN_TARGET}x torch bf16 (cold)", row["speedup"], row["speedup"] >= PLAIN_TARGET,
            f"{row['speedup']:.2f}x")
        for fmt, want in SPEEDUP_TARGETS.get(world, SPEEDUP_TARGETS[4]).items():
            row = cold[f"quantized {fmt} rowwise"]
            add(f"quantized {fmt} rowwise >= {want}x the bf16 gather (cold, {world} ranks)", row["speedup"],
                row["speedup"] >= want, f"{row['speedup']:.2f}x")
        if world == 2:
            row = cold["quantized nvfp4 rowwise"]
            add(f"stretch: quantized nvfp4 rowwise >= {NVFP4_STRETCH_2}x (cold, 2 ranks)", row["speedup"],
                row["speedup"] >= NVFP4_STRETCH_2, f"{row['speedup']:.2f}x")
        for row in modes["cold"]:
            if row["kind"] == "fallback":
                slow = 1 / row["speedup"]
                add(f"{row['case']} <= {FALLBACK_TARGET}x its bf16 gather (cold)", slow, slow <= FALLBACK_TARGET,
                    f"{slow:.2f}x")
            if row["kind"] == "verify":
                v = row["verify_overhead"]
                add(f"{row['case']}: verify adds <= {VERIFY_TARGET:.0%} (cold)", v, v <= VERIFY_TARGET, f"{v:+.1%}")
    bad = [f"{r['mode']}: {r['case']}" for rows in modes.values() for r in rows if r.get("identical") is False]
    add("every pyxfer result bit-identical to the one-process reference (and on the expected path; graph replays "
        "too; the mismatch raised on every rank)", len(bad), not bad, "all" if not bad else f"{len(bad)} differ")
    return out


def show(result):
    cfg = result["config"]
    w = cfg["world_size"]
    for mode, rows in result["modes"].items():
        what = {"cold": "one call after a barrier", "piped": f"{cfg['calls']} calls back to back, per call",
                "graph": f"{cfg['calls']} CUDA graph replays back to back, per replay"}[mode]
        print_table(f"all-gather along dim 0, {w} ranks ({cfg['backend']}), shard {cfg['rows']}x{cfg['cols']}, mode "
                    f"{mode} ({what}): time = median over {cfg['reps']} reps of the slowest rank "
                    f"({'CUDA events' if cfg['device'] == 'cuda' else 'wall clock'}); x bf16 = torch bf16 gather of "
                    "the same shape / case; % floor = torch uint8 gather of the case's bytes / case; host us = "
                    "the host's time per call (issuing it, before waiting for the device)",
                    ["case", "path", "MiB out", "ms", "busbw GB/s", "x bf16", "% floor", "host us", "check"],
                    [[r["case"], r["path"], f"{r['bytes_out'] / 2**20:.1f}", f"{r['ms']:.3f}",
                      fmt_gbps(r["busbw_gbps"]), f"{r['speedup']:.2f}x", f"{100 * r['of_floor']:.0f}%",
                      f"{r['host_us']:.1f}",
                      r.get("check", "-") if "verify_overhead" not in r else
                      f"{r['check']}, verify {r['verify_overhead']:+.1%}"] for r in rows])
    print(f"targets ({w} ranks, measured in this run)" + ("" if cfg["device"] == "cuda" else
          "; the timing targets are defined for NCCL on GPUs: not evaluated here"))
    print_targets(result["targets"])


def run(world_size=2, backend="nccl", device="cuda", rows=8192, cols=8192, reps=30, warmup=5, seed=None, calls=10,
        modes=MODES):
    """Spawn world_size ranks, measure every case; returns the result dict (what --json writes)."""
    if world_size < 2:
        raise SystemExit("gather: --world-size must be at least 2")
    if device == "cuda" and torch.cuda.device_count() < world_size:
        raise SystemExit(f"gather: --world-size {world_size} needs {world_size} GPUs, "
                         f"{torch.cuda.device_count()} visible")
    if rows % 256 or cols % 128:
        raise SystemExit(f"gather: --rows must be a multiple of 256 and --cols of 128 (quantizable shards, and the "
                         f"alternating case's half), got {rows}x{cols}")
    bad = [m for m in modes if m not in MODES]
    if bad or "cold" not in modes:
        raise SystemExit(f"gather: --modes takes cold (always) and piped / graph, got {','.join(modes)}")
    seed = int.from_bytes(os.urandom(3), "little") if seed is None else seed
    cfg = {"world_size": world_size, "backend": backend, "device": device, "rows": rows, "cols": cols, "reps": reps,
           "warmup": warmup, "seed": seed, "calls": calls, "modes": list(modes)}
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(cfg, tmp), nprocs=world_size, join=True)
        with open(os.path.join(tmp, "result.json")) as f:
            return json.load(f)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--backend", default="nccl", choices=("nccl", "gloo"))
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--rows", type=int, default=8192, help="M of each rank's shard (a multiple of 256)")
    p.add_argument("--cols", type=int, default=8192, help="K (a multiple of 128)")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--calls", type=int, default=10, help="piped / graph: calls (replays) per timed rep")
    p.add_argument("--modes", default=",".join(MODES), help="cold,piped,graph (graph: CUDA only)")
    p.add_argument("--seed", type=int, help="data seed (default: random, recorded in the JSON)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    if args.backend == "nccl" and args.device != "cuda":
        p.error("NCCL needs --device cuda")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gather: no CUDA GPU (for a CPU smoke run: --backend gloo --device cpu --rows 256 --cols 256)")
        return
    result = run(args.world_size, args.backend, args.device, args.rows, args.cols, args.reps, args.warmup, args.seed,
                 args.calls, tuple(m for m in args.modes.split(",") if m))
    result["method"] = __doc__.split("\n\n    python")[0]
    show(result)
    write_json(args.json, result)
    if any(t["result"] == "MISS" and t["target"].startswith("every") for t in result["targets"]):
        sys.exit(1)  # wrong results, not just slow ones


if __name__ == "__main__":
    main()
