"""`pyxfer bench`: bandwidth and latency of every ordered device pair and copy mode.

Rows (SRC -> DST): host -> every GPU and back, from pinned and from pageable host memory; every GPU
to itself (GPU-local); every ordered GPU pair. Without a GPU: cpu -> cpu (host memcpy, CPU verified
and staged copies). Plus PXH64 checksum throughput on every device.

Modes:
  ce                 torch's copy_ of contiguous bytes: the driver's copy engine (cudaMemcpyAsync)
  ce_bidir           ce in both directions at once (two streams; GB/s counts both directions' bytes)
  sm_pull            pyxfer's copy kernel (torch.ops.pyxfer.sm_copy: 16-byte loads and stores, one
                     wave of blocks) on the destination GPU, reading the source's memory; GPU pairs
                     with peer access (the way pyxfer's verified peer copies move data)
  sm_push            the same kernel on the source GPU, writing into the destination's memory; GPU
                     pairs with peer access and GPU-local rows (where pull and push are one thing)
  staged             pyxfer.staged_copy (through the pinned host pool)
  verified           pyxfer.verified_copy(verify="sync"): hashes on both ends, compared on the host
  verified_deferred  pyxfer.verified_copy(verify="deferred"): compared on the device, no host wait

Method (pyxfer.tools.timing, shared with benchmarks/; nvbandwidth's): CUDA events on the stream torch
issues the copy on (the source GPU's; the GPU's for host rows), --warmup untimed repetitions, then
--reps samples, each timing a loop of calls (16 for small sizes, fewer for large ones) while a spin
kernel holds the stream, so the events time the GPU's work, not the host's issue rate; the median
is reported with min and max. Modes whose host waits for the GPU (pageable host memory, verified
sync, staged) cannot be held: they are timed from an idle stream ("held": false in the JSON). CPU
rows: wall clock. GB/s is 1e9 bytes per second of the bytes copied per call (ce_bidir: both
directions' bytes). After every point the destination is checked with PXH64 on its own device,
outside the timed region: a pair that writes wrong bytes is reported "corrupt" and the bench carries
on. Latency: one 8-byte copy between events on an idle stream (issue + copy), median.

The method check times torch's copy_ in the simplest correct way (20 back-to-back copies between
two events from an idle stream) at the largest size on host <-> GPU and GPU-local rows, and reports
bench's ce figure over it (1.00 = the harness adds nothing and loses nothing).

--json PATH writes one document, schema "pyxfer.bench", version 2 (version 1 had one "sm" mode, torch's
copy kernel pushing; --compare reads version 1 documents too, their "sm" points match nothing):
  schema, schema_version, created (UTC ISO 8601), argv, gpu (bool), machine (host, platform, python,
  torch, torch_cuda, nccl, driver, nvidia_driver (NVML's; null without pyxfer[nvml]), gpus [{index, name,
  uuid, capability, memory_gib, sms}], peer_access [[bool|null]], pyxfer, build, threads, env),
  method {description, warmup, reps, units}, config {sizes [int], matrix_size, modes [str], rows [[src, dst]]},
  results [{src, dst, mode, bytes, gbps|null, median_ms, min_ms, max_ms, reps, loop, held,
            check: "ok"|"corrupt"|"error", detail}],
  ratios [{src, dst, bytes, ratio: "verified/ce"|"staged/ce", value}],
  latency [{src, dst, bytes, median_us|null, min_us, max_us, detail}] (null and detail: the row failed),
  checksum [{device, bytes, gbps, median_ms, min_ms, max_ms}],
  method_check [{src, dst, bytes, bench_gbps, torch_gbps, ratio}],
  corrupt [{src, dst, mode, bytes, detail}],
  compare: null | {old, threshold, slower [{src, dst, mode, bytes, old_gbps, new_gbps, ratio}]}
Exit code 1 when a destination was wrong or --compare flagged a slowdown; 2 for a bad option (every
option, the --compare document and the outputs' paths are checked before anything is measured) or
for an output that could not be written after the run (the run is then saved in a new file of the
temporary directory, and the message says where).
"""
import contextlib
import datetime
import json
import math
import os
import sys
import tempfile
import time

import torch

from .._devices import as_device
from .timing import Samples, cpu_samples, cuda_samples, fmt_gbps, fmt_size

__all__ = ["MODES", "PRESETS", "SCHEMA", "SCHEMA_VERSION", "run", "validate", "compare", "parse_rows", "parse_modes",
           "plan_points"]

SCHEMA, SCHEMA_VERSION = "pyxfer.bench", 2
_OLD_MODES = {1: ("ce", "ce_bidir", "sm", "staged", "verified", "verified_deferred")}  # what --compare reads
MODES = ("ce", "ce_bidir", "sm_pull", "sm_push", "staged", "verified", "verified_deferred")
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
PRESETS = {
    "quick": {"sizes": [4 * KiB, MiB, 64 * MiB], "reps": 5, "warmup": 2},
    "full": {"sizes": [4 * KiB << (2 * i) for i in range(10)], "reps": 20, "warmup": 3},  # 4 KiB ... 1 GiB
}
LATENCY_BYTES = 8
HOST_ENDPOINTS = ("pinned", "pageable", "cpu")


# ---- rows and buffers

def _is_host(ep):
    return ep in HOST_ENDPOINTS


def _device(ep):
    return torch.device("cpu") if _is_host(ep) else as_device("pyxfer bench", "an endpoint of --pairs", ep)


def default_rows(num_gpus):
    """Every row this machine has (see the module docstring)."""
    if num_gpus == 0:
        return [("cpu", "cpu")]
    rows = []
    for i in range(num_gpus):
        g = f"cuda:{i}"
        rows += [("pinned", g), (g, "pinned"), ("pageable", g), (g, "pageable"), (g, g)]
    rows += [(f"cuda:{i}", f"cuda:{j}") for i in range(num_gpus) for j in range(num_gpus) if i != j]
    return rows


def parse_rows(spec, num_gpus):
    """Rows from "SRC->DST,..." (endpoints: pinned, pageable, cuda:N; cpu without GPUs).
    Raises ValueError naming the bad or repeated row."""
    names = ["cpu"] if num_gpus == 0 else ["pinned", "pageable"] + [f"cuda:{i}" for i in range(num_gpus)]
    rows = []
    for item in spec.split(","):
        a, sep, b = (s.strip() for s in item.partition("->"))
        if not sep or a not in names or b not in names or (num_gpus and _is_host(a) and _is_host(b)):
            raise ValueError(f"--pairs: expected SRC->DST[,...] with endpoints from {names} (not host -> host "
                             f"where GPUs are visible), got {item!r}")
        if (a, b) in rows:
            raise ValueError(f"--pairs: expected each row once, got {a}->{b} twice in {spec!r}")
        rows.append((a, b))
    return rows


def parse_modes(spec):
    """Modes from "M,M,..." (names from MODES, each once). Raises ValueError naming the bad one."""
    names = [m.strip() for m in spec.split(",")]
    if "" in names:
        raise ValueError(f"--modes: expected names from {','.join(MODES)} separated by commas, got an empty name "
                         f"in {spec!r}")
    if bad := [m for m in names if m not in MODES]:
        raise ValueError(f"--modes: expected names from {','.join(MODES)}, got {','.join(bad)}")
    if twice := sorted({m for m in names if names.count(m) > 1}):
        raise ValueError(f"--modes: expected each mode once, got {','.join(twice)} twice in {spec!r}")
    return names


def modes_of(src, dst, peer):
    """The modes a row supports. ``peer``: whether src can access dst's memory (GPU pairs)."""
    if src == "cpu":
        return ["ce", "staged", "verified", "verified_deferred"]
    gpu_pair = not _is_host(src) and not _is_host(dst)
    modes = ["ce"]
    if (gpu_pair and src != dst) or "pinned" in (src, dst):
        modes.append("ce_bidir")
    if gpu_pair and src != dst and peer:
        modes.append("sm_pull")
    if gpu_pair and (src == dst or peer):
        modes.append("sm_push")
    return modes + ["staged", "verified", "verified_deferred"]


def _peer(src, dst):
    """Whether the GPU of ``src`` can access the memory of ``dst`` (GPU rows; False for host rows)."""
    if _is_host(src) or _is_host(dst):
        return False
    return src == dst or torch.cuda.can_device_access_peer(_device(src).index, _device(dst).index)


def plan_points(rows, modes):
    """(src, dst, mode) of every point a run of ``rows`` and ``modes`` measures at each size: the
    modes each row supports (modes_of), in row order."""
    return [(s, d, m) for s, d in rows for m in modes_of(s, d, _peer(s, d)) if m in modes]


def _buffer(ep, n, fill=None, data=None):
    """n bytes on endpoint ``ep`` (pinned / pageable host memory or a GPU), ``data`` copied in or
    filled with ``fill``."""
    if data is not None:
        out = torch.empty(n, dtype=torch.uint8, pin_memory=ep == "pinned") if _is_host(ep) else \
            torch.empty(n, dtype=torch.uint8, device=_device(ep))
        return out.copy_(data)
    out = torch.empty(n, dtype=torch.uint8, pin_memory=ep == "pinned", device=_device(ep))
    return out.fill_(fill) if fill is not None else out


# ---- one measurement

class _Point:
    """Buffers and the timed call of one (row, mode, size)."""

    def __init__(self, src, dst, mode, n, data_gpu):
        from ..transfer import staged_copy, verified_copy

        self.src, self.dst, self.mode, self.n = src, dst, mode, n
        self.data = _buffer(src, n, data=data_gpu)
        self.out = None
        self.checks = []  # (destination tensor, the source it must equal)
        dev = _device(dst)
        if mode in ("ce", "sm_pull", "sm_push", "ce_bidir"):
            self.out = _buffer(dst, n, fill=0xC3)
            if mode == "ce_bidir":
                self.back_src = _buffer(dst, n, data=data_gpu)
                self.back_out = _buffer(src, n, fill=0xC3)
                # Issued by the GPU the back copy leaves (as nvbandwidth does: each direction from its
                # own GPU); for host rows that is the pair's one GPU.
                self.side = torch.cuda.Stream(device=self.anchor if _is_host(dst) or _is_host(src) else _device(dst))
                self.checks.append(lambda: (self.back_out, self.back_src))
            if mode == "ce_bidir":
                self.fn = self._bidir
            elif mode == "ce":
                self.fn = lambda _: self.out.copy_(self.data, non_blocking=True)
            else:
                pull = mode == "sm_pull"
                self.fn = lambda _: torch.ops.pyxfer.sm_copy(self.data, self.out, pull)
            self.checks.append(lambda: (self.out, self.data))
        else:
            verify = {"staged": None, "verified": "sync", "verified_deferred": "deferred"}[mode]
            if verify is None:
                self.fn = lambda _: self._keep(staged_copy(self.data, dev))
            else:
                self.fn = lambda _: self._keep(verified_copy(self.data, dev, verify=verify))
            self.checks.append(lambda: (self.out, self.data))

    def _keep(self, out):
        self.out = out

    def _bidir(self, _):
        anchor = torch.cuda.current_stream()
        # Held with the anchor stream (it waits before the forward copy is queued, so the directions
        # overlap: run P waited after it and serialized them, measuring one-way bandwidth)
        self.side.wait_stream(anchor)
        self.out.copy_(self.data, non_blocking=True)
        with torch.cuda.stream(self.side):
            self.back_out.copy_(self.back_src, non_blocking=True)
        anchor.wait_stream(self.side)

    @property
    def anchor(self):
        """The GPU whose current stream the copy is issued on: the source's (torch's copies, sm_push),
        the destination's (sm_pull), the GPU of a host row."""
        if self.src == "cpu":
            return None
        return _device(self.dst) if _is_host(self.src) or self.mode == "sm_pull" else _device(self.src)

    @property
    def can_hold(self):
        """Whether the calls can be queued behind a held stream: not when the host waits for the GPU
        (pageable memory, staged, verified sync; deferred verification into host memory compares on the host)."""
        return ("pageable" not in (self.src, self.dst) and self.mode not in ("staged", "verified")
                and not (self.mode == "verified_deferred" and _is_host(self.dst)))

    @property
    def moved(self):
        return 2 * self.n if self.mode == "ce_bidir" else self.n

    def measure(self, loop, warmup, reps) -> Samples:
        if self.anchor is None:
            return cpu_samples(self.fn, None, warmup=warmup, reps=reps, inner=loop)
        inputs = [None] * loop
        if self.can_hold:
            try:
                return cuda_samples(self.fn, inputs, warmup=warmup, reps=reps, device=self.anchor, hold=True)
            except RuntimeError as e:
                if "outlasts a 2 s spin" not in str(e):
                    raise
        return cuda_samples(self.fn, inputs, warmup=warmup, reps=reps, device=self.anchor, hold=False)

    def check(self):
        """("ok" | "corrupt", detail): each destination's PXH64 on its own device against its source's."""
        from ..checksums import checksum
        from ..transfer import TransferError, check_transfers

        if self.mode == "verified_deferred":
            try:
                check_transfers()
            except TransferError as e:
                return "corrupt", str(e)
        bad = []
        for get in self.checks:
            out, src = get()
            want, got = checksum(src), checksum(out)
            if want != got:
                wrong = (out.reshape(-1).cpu() != src.reshape(-1).cpu()).nonzero()
                bad.append(f"{out.device}: PXH64 {got:#018x}, source {want:#018x}; {len(wrong)} wrong bytes, "
                           f"the first at offset {int(wrong[0]) if len(wrong) else '?'}")
        return ("corrupt", "; ".join(bad)) if bad else ("ok", "")


def _loop(n):
    """Calls per sample: enough bytes to amortize the events (nvbandwidth's loop count)."""
    return max(1, min(16, (256 * MiB) // n))


# ---- progress

class _Progress:
    """Progress on stderr: tqdm when installed (the ecosystem's convention), else a plain line per step."""

    def __init__(self, total, enabled):
        self.total, self.done, self.enabled, self.bar = total, 0, enabled, None
        if enabled:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, file=sys.stderr, desc="pyxfer bench", unit="pt", leave=False)
            except ImportError:
                pass

    def step(self, what):
        self.done += 1
        if self.bar is not None:
            self.bar.set_postfix_str(what, refresh=False)
            self.bar.update(1)
        elif self.enabled:
            print(f"[{self.done}/{self.total}] {what}", file=sys.stderr, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


# ---- the run

def _gpu_data(n, gen_device):
    """n random bytes on the first GPU (fast to make) or the CPU."""
    g = torch.Generator(device=gen_device).manual_seed(int(time.time_ns() % (1 << 31)))
    return torch.randint(0, 256, (n,), dtype=torch.uint8, device=gen_device, generator=g)


def _sync_all():
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            torch.cuda.synchronize(i)


def measure_all(rows, modes, sizes, *, reps, warmup, progress=True):
    """Run every point; returns the result lists of the JSON (results, latency, checksum, method_check)."""
    from ..checksums import checksum_tensor

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gen_device = "cuda:0" if gpus else "cpu"
    plan = plan_points(rows, modes)
    devices = ["cpu"] + [f"cuda:{i}" for i in range(gpus)]
    bar = _Progress(len(plan) * len(sizes) + len(rows) + len(devices) * len(sizes), progress)
    results, latency, sums, method = [], [], [], []
    for n in sizes:
        try:
            data, failed = _gpu_data(n, gen_device), ""
        except RuntimeError as e:  # out of memory: each point of this size is reported failed, the run goes on
            data, failed = None, f"{type(e).__name__}: {e}".splitlines()[0][:300]
            _reset_after_error()
        for src, dst, mode in plan:
            entry = {"src": src, "dst": dst, "mode": mode, "bytes": n, "gbps": None, "median_ms": None,
                     "min_ms": None, "max_ms": None, "reps": 0, "loop": _loop(n), "held": False,
                     "check": "error", "detail": failed}
            point = None  # set once its buffers exist: a setup that raises is reported like a failing call
            try:
                if not failed:
                    point = _Point(src, dst, mode, n, data)
                    s = point.measure(_loop(n), warmup, reps)
                    _sync_all()
                    entry.update(gbps=round(s.gbps(point.moved), 3), median_ms=s.median_ms, min_ms=s.min_ms,
                                 max_ms=s.max_ms, reps=s.reps, held=s.held)
                    entry["check"], entry["detail"] = point.check()
            except Exception as e:  # noqa: BLE001  (a failing pair is reported; the bench carries on)
                entry["detail"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                _reset_after_error()
            results.append(entry)
            bar.step(f"{src}->{dst} {mode} {fmt_size(n)}")
            point = None  # frees its buffers before the next point's
        for dev in devices:
            try:
                if not failed:  # (no data of this size: no checksum figure either)
                    x = data.to(dev)
                    if dev == "cpu":
                        s = cpu_samples(checksum_tensor, x, warmup=warmup, reps=reps, inner=_loop(n))
                    else:
                        s = cuda_samples(checksum_tensor, [x] * _loop(n), warmup=warmup, reps=reps, device=dev,
                                         hold=True)
                    sums.append({"device": dev, "bytes": n, "gbps": round(s.gbps(n), 3), "median_ms": s.median_ms,
                                 "min_ms": s.min_ms, "max_ms": s.max_ms})
            except torch.OutOfMemoryError:  # this GPU is full: no checksum figure at this size, the run goes on
                _reset_after_error()
            x = None
            bar.step(f"checksum {dev} {fmt_size(n)}")
        del data
    small = _gpu_data(LATENCY_BYTES, gen_device)
    for src, dst in rows:
        entry = {"src": src, "dst": dst, "bytes": LATENCY_BYTES, "median_us": None, "min_us": None, "max_us": None,
                 "detail": ""}
        try:
            s = _Point(src, dst, "ce", LATENCY_BYTES, small)
            if s.anchor is None:
                t = cpu_samples(s.fn, None, warmup=warmup, reps=reps, inner=1000)
            else:
                t = cuda_samples(s.fn, [None], warmup=warmup, reps=max(reps, 20), device=s.anchor, hold=False)
            entry.update(median_us=t.median_ms * 1e3, min_us=t.min_ms * 1e3, max_us=t.max_ms * 1e3)
        except Exception as e:  # noqa: BLE001  (as for the bandwidth points: reported, the bench carries on)
            entry["detail"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            _reset_after_error()
        latency.append(entry)
        bar.step(f"latency {src}->{dst}")
    if gpus:
        method = _method_check(rows, results, max(sizes), warmup, reps)
    bar.close()
    return results, latency, sums, method


def _reset_after_error():
    try:
        _sync_all()
    except Exception:  # noqa: BLE001  (a sticky error shows up in the next point's result too)
        pass


def _method_check(rows, results, n, warmup, reps):
    """bench's ce figure over torch's copy_ timed plainly (see the module docstring)."""
    out = []
    for src, dst in rows:
        host_gpu, gpu_local = _is_host(src) != _is_host(dst), not _is_host(src) and src == dst
        if "pageable" in (src, dst) or not (host_gpu or gpu_local):  # GPU pairs, cpu -> cpu: not checked
            continue
        mine = next((r for r in results if (r["src"], r["dst"], r["mode"], r["bytes"]) == (src, dst, "ce", n)), None)
        if mine is None or mine["gbps"] is None:
            continue
        a = torch.empty(n, dtype=torch.uint8, pin_memory=src == "pinned", device=_device(src))
        b = torch.empty(n, dtype=torch.uint8, pin_memory=dst == "pinned", device=_device(dst))
        gpu = _device(dst) if _is_host(src) else _device(src)
        s = cuda_samples(lambda _, a=a, b=b: b.copy_(a, non_blocking=True), [None] * 20, warmup=warmup, reps=reps,
                         device=gpu, hold=False)
        torch_gbps = s.gbps(n)
        out.append({"src": src, "dst": dst, "bytes": n, "bench_gbps": mine["gbps"], "torch_gbps": round(torch_gbps, 3),
                    "ratio": round(mine["gbps"] / torch_gbps, 4)})
    return out


def ratios(results, n):
    """verified/ce and staged/ce of every row at size n."""
    by = {(r["src"], r["dst"], r["mode"]): r["gbps"] for r in results if r["bytes"] == n}
    out = []
    for (src, dst, mode), ce in by.items():
        if mode != "ce" or not ce:
            continue
        for num in ("verified", "staged"):
            v = by.get((src, dst, num))
            if v:
                out.append({"src": src, "dst": dst, "bytes": n, "ratio": f"{num}/ce", "value": round(v / ce, 4)})
    return out


# ---- output

def _endpoints(rows):
    order = ["cpu", "pinned", "pageable"]
    names = {e for r in rows for e in r}
    return [e for e in order if e in names] + sorted((e for e in names if e not in order), key=lambda e: int(e[5:]))


def matrix(values, rows):
    """(row names, column names, cells) of a {(src, dst): value} over the sources and destinations in rows."""
    srcs, dsts = _endpoints([(s, s) for s, _ in rows]), _endpoints([(d, d) for _, d in rows])
    return srcs, dsts, [[values.get((s, d)) for d in dsts] for s in srcs]


def _print_matrix(title, values, rows, fmt, out):
    srcs, dsts, cells = matrix(values, rows)
    if all(v is None for row in cells for v in row):
        return
    width = max(8, *(len(d) + 1 for d in dsts))
    print(title, file=out)
    print(" " * 10 + "".join(f"{d:>{width}}" for d in dsts), file=out)
    for s, row in zip(srcs, cells):
        print(f"{s:>10}" + "".join(f"{'-' if v is None else fmt(v):>{width}}" for v in row), file=out)
    print(file=out)


def print_results(doc, out=None):
    out = sys.stdout if out is None else out
    results, n = doc["results"], doc["config"]["matrix_size"]
    rows = [tuple(r) for r in doc["config"]["rows"]]
    print(f"pyxfer bench  (GB/s = 1e9 bytes/s; rows = source, columns = destination; medians of "
          f"{doc['method']['reps']} samples; ce_bidir counts both directions)", file=out)
    if not doc["gpu"]:
        print("no CUDA GPU visible: measuring host memcpy, checksum and CPU verified / staged copies only", file=out)
    for mode in doc["config"]["modes"]:
        vals = {(r["src"], r["dst"]): r["gbps"] for r in results if r["mode"] == mode and r["bytes"] == n}
        _print_matrix(f"{mode} GB/s at {fmt_size(n)}", vals, rows, fmt_gbps, out)
    for name in ("verified/ce", "staged/ce"):
        vals = {(r["src"], r["dst"]): r["value"] for r in doc["ratios"] if r["ratio"] == name}
        _print_matrix(f"{name} at {fmt_size(n)} (1.00 = as fast as the raw copy)", vals, rows,
                      lambda v: f"{v:.2f}", out)
    vals = {(r["src"], r["dst"]): r["median_us"] for r in doc["latency"]}
    _print_matrix(f"latency, us: one {LATENCY_BYTES}-byte copy from an idle stream (median)", vals, rows,
                  lambda v: f"{v:.1f}", out)
    sizes = doc["config"]["sizes"]
    if len(sizes) > 1:
        print("size sweep, GB/s", file=out)
        head = f"{'row':>22} {'mode':>18}" + "".join(f"{fmt_size(s):>10}" for s in sizes)
        print(head, file=out)
        keys = list(dict.fromkeys((r["src"], r["dst"], r["mode"]) for r in results))
        by = {(r["src"], r["dst"], r["mode"], r["bytes"]): r["gbps"] for r in results}
        for s, d, m in keys:
            print(f"{s + ' -> ' + d:>22} {m:>18}" + "".join(f"{fmt_gbps(by.get((s, d, m, z))):>10}" for z in sizes),
                  file=out)
        print(file=out)
    print("checksum (PXH64) GB/s: " + "; ".join(
        f"{c['device']} {fmt_gbps(c['gbps'])}" for c in doc["checksum"] if c["bytes"] == n), file=out)
    for m in doc["method_check"]:
        print(f"method check {m['src']} -> {m['dst']} at {fmt_size(m['bytes'])}: bench ce {m['bench_gbps']:.1f} GB/s, "
              f"torch copy_ (20 copies between events) {m['torch_gbps']:.1f} GB/s, ratio {m['ratio']:.3f}", file=out)
    errors = [r for r in results if r["check"] == "error"]
    for r in doc["corrupt"]:
        print(f"CORRUPT {r['src']} -> {r['dst']} {r['mode']} {fmt_size(r['bytes'])}: {r['detail']}", file=out)
    for r in errors:
        print(f"error {r['src']} -> {r['dst']} {r['mode']} {fmt_size(r['bytes'])}: {r['detail']}", file=out)
    cmp = doc.get("compare")
    if cmp:
        print(f"compared with {cmp['old']}: {len(cmp['slower'])} points slower by more than "
              f"{cmp['threshold']:.0%}", file=out)
        for r in cmp["slower"]:
            print(f"  SLOWER {r['src']} -> {r['dst']} {r['mode']} {fmt_size(r['bytes'])}: {r['old_gbps']:.2f} -> "
                  f"{r['new_gbps']:.2f} GB/s ({r['ratio']:.2f}x)", file=out)


def plot(doc, path):
    """PNG heatmaps of every mode's GB/s and of the verified/ce and staged/ce ratios at the matrix size,
    on shared color scales (every GB/s panel 0 to the largest GB/s; the ratios 0 to 1 or above), so
    that equal colors mean equal figures across panels. Raises RuntimeError when matplotlib is not
    installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'pyxfer[plot]' (or matplotlib)") from None
    n, rows = doc["config"]["matrix_size"], [tuple(r) for r in doc["config"]["rows"]]
    panels = []
    for mode in doc["config"]["modes"]:
        vals = {(r["src"], r["dst"]): r["gbps"] for r in doc["results"] if r["mode"] == mode and r["bytes"] == n}
        if any(v is not None for v in vals.values()):
            panels.append((f"{mode} GB/s", vals, "{:.1f}", "gbps"))
    for name in ("verified/ce", "staged/ce"):
        vals = {(r["src"], r["dst"]): r["value"] for r in doc["ratios"] if r["ratio"] == name}
        if vals:
            panels.append((name, vals, "{:.2f}", "ratio"))
    top = {"gbps": 0.0, "ratio": 1.0}
    for _, vals, _, kind in panels:
        top[kind] = max([top[kind]] + [v for v in vals.values() if v is not None])
    cols = min(3, max(1, len(panels)))
    nrows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(4.5 * cols, 3.8 * nrows), squeeze=False)
    for ax, (title, vals, fmt, kind) in zip(axes.flat, panels):
        srcs, dsts, cells = matrix(vals, rows)
        grid = [[float("nan") if v is None else v for v in row] for row in cells]
        im = ax.imshow(grid, cmap="viridis", vmin=0.0, vmax=top[kind] or 1.0)
        ax.set_xticks(range(len(dsts)), dsts, rotation=45, ha="right")
        ax.set_yticks(range(len(srcs)), srcs)
        ax.set_xlabel("destination")
        ax.set_ylabel("source")
        ax.set_title(f"{title} ({fmt_size(n)})")
        for i, row in enumerate(cells):
            for j, v in enumerate(row):
                if v is not None:
                    ax.text(j, i, fmt.format(v), ha="center", va="center", color="w", fontsize=8)
        fig.colorbar(im, ax=ax, shrink=0.8)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    gpus = doc["machine"]["gpus"]
    fig.suptitle(f"pyxfer bench: {gpus[0]['name'] + ' x' + str(len(gpus)) if gpus else 'no GPU'}, {doc['created']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _is_rate(v):
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf)


def _is_result(r, modes):
    """Whether ``r`` is a result whose fields compare() can trust (a typed field that compares nothing
    would hide a slowdown)."""
    return (isinstance(r, dict) and {"src", "dst", "mode", "bytes", "gbps", "check"} <= set(r)
            and isinstance(r["src"], str) and isinstance(r["dst"], str) and r["mode"] in modes
            and isinstance(r["bytes"], int) and not isinstance(r["bytes"], bool) and r["bytes"] >= 1
            and _is_rate(r["gbps"]) and r["check"] in ("ok", "corrupt", "error"))


def validate(doc, *, older=False):
    """Raise ValueError unless ``doc`` is a pyxfer.bench document of this schema version (``older``:
    or of an earlier one --compare can read), its results typed as the schema says (src, dst and mode
    strings, bytes an integer >= 1, gbps a positive number or null)."""
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise ValueError(f"not a {SCHEMA} document (schema {doc.get('schema') if isinstance(doc, dict) else None!r})")
    version = doc.get("schema_version")
    known = [SCHEMA_VERSION] + (sorted(_OLD_MODES) if older else [])
    if version not in known:
        raise ValueError(f"{SCHEMA} schema_version {version!r}, expected {' or '.join(map(str, known))}")
    modes = MODES if version == SCHEMA_VERSION else _OLD_MODES[version]
    for key in ("created", "machine", "method", "config", "results", "ratios", "latency", "checksum",
                "method_check", "corrupt"):
        if key not in doc:
            raise ValueError(f"{SCHEMA} document without {key!r}")
    if not isinstance(doc["results"], list):
        raise ValueError(f"{SCHEMA}: 'results' must be a list, got {type(doc['results']).__name__}")
    for r in doc["results"]:
        if not _is_result(r, modes):
            raise ValueError(f"{SCHEMA}: malformed result {r!r:.300} (expected src, dst strings, mode one of "
                             f"{','.join(modes)}, bytes an integer >= 1, gbps a positive number or null, check "
                             f"ok, corrupt or error)")


def compare(doc, old, threshold):
    """Points of ``doc`` slower than the same point of ``old`` by more than ``threshold`` (a fraction)."""
    before = {(r["src"], r["dst"], r["mode"], r["bytes"]): r["gbps"] for r in old["results"]}
    slower = []
    for r in doc["results"]:
        was = before.get((r["src"], r["dst"], r["mode"], r["bytes"]))
        if was and r["gbps"] is not None and r["gbps"] < was * (1 - threshold):
            slower.append({"src": r["src"], "dst": r["dst"], "mode": r["mode"], "bytes": r["bytes"],
                           "old_gbps": was, "new_gbps": r["gbps"], "ratio": round(r["gbps"] / was, 4)})
    return slower


def read_compare(path):
    """The document of --compare ``path``, validated (validate(older=True)). Raises ValueError naming
    the file and what is wrong with it."""
    try:
        with open(path, "rb") as f:
            old = json.loads(f.read())
    except OSError as e:
        raise ValueError(f"--compare {path}: cannot read it ({e.strerror or e})") from None
    except (ValueError, RecursionError) as e:  # truncated, binary (UnicodeDecodeError is a ValueError), ...
        raise ValueError(f"--compare {path}: not a JSON document ({e})") from None
    try:
        validate(old, older=True)
    except ValueError as e:
        raise ValueError(f"--compare {path}: {e}") from None
    return old


def _configure(args, gpus):
    """(sizes, reps, warmup, rows, modes, old document) of a run, every option checked before anything is
    measured. Raises ValueError naming the option and what was expected."""
    from .machine import memory_bytes

    preset = PRESETS[args.preset]
    sizes = sorted(set(args.sizes or preset["sizes"]))
    reps = args.reps if args.reps is not None else preset["reps"]
    warmup = args.warmup if args.warmup is not None else preset["warmup"]
    if reps < 1 or warmup < 0:
        raise ValueError(f"--reps must be >= 1 and --warmup >= 0, got {reps} and {warmup}")
    rows = parse_rows(args.pairs, gpus) if args.pairs is not None else default_rows(gpus)
    modes = parse_modes(args.modes) if args.modes is not None else list(MODES)
    if args.modes is not None:  # every mode asked for must be measured somewhere
        planned = {m for _, _, m in plan_points(rows, modes)}
        if unsupported := [m for m in modes if m not in planned]:
            supports = "; ".join(f"{s}->{d}: {','.join(modes_of(s, d, _peer(s, d)))}" for s, d in rows)
            raise ValueError(f"--modes: expected modes the rows support ({supports}), got {','.join(unsupported)}, "
                             f"which no row supports")
    # each point holds about three buffers of its size on a device: the random data, the source, the destination
    n = max(sizes)
    for dev in sorted({"cpu" if _is_host(e) else e for row in rows for e in row} | {"cuda:0" if gpus else "cpu"}):
        if 3 * n > memory_bytes(dev):
            raise ValueError(f"--sizes: expected sizes whose buffers fit: {fmt_size(n)} needs about 3 x "
                             f"{fmt_size(n)} on {dev}, which has {fmt_size(memory_bytes(dev))}")
    old = read_compare(args.compare) if args.compare is not None else None
    if args.plot:
        if args.json and os.path.abspath(args.json) == os.path.abspath(args.plot):
            raise ValueError(f"--json and --plot: expected two files, got {args.plot!r} twice")
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError("--plot needs matplotlib: pip install 'pyxfer[plot]' (or matplotlib)") from None
    return sizes, reps, warmup, rows, modes, old


def _write_json(doc, path):
    """Write ``doc`` to ``path``: over a regular file through a temporary file renamed (a failed write
    leaves the old file and no temporary), into anything else (a pipe, /dev/stdout) directly."""
    if os.path.exists(path) and not os.path.isfile(path):
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)
        return
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def _save_elsewhere(doc):
    """Save a finished run whose --json could not be written: in a new file of the temporary
    directory (returns its path), else as JSON on stderr (returns None)."""
    try:
        fd, path = tempfile.mkstemp(prefix="pyxfer-bench-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1)
        return path
    except OSError:
        json.dump(doc, sys.stderr, indent=1)
        print(file=sys.stderr)
        return None


def run(args) -> int:
    """`pyxfer bench` with parsed ``args`` (see cli.py). Returns the exit code: 0, 1 (a destination
    was wrong, or --compare flagged a slowdown), 2 (a bad option, before anything is measured; or an
    output that could not be written after the run: the run is then saved elsewhere and said where)."""
    from .machine import machine_info

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    try:
        sizes, reps, warmup, rows, modes, old = _configure(args, gpus)
    except ValueError as e:
        print(f"pyxfer bench: {e}", file=sys.stderr)
        return 2
    if not gpus:
        print("pyxfer bench: no CUDA GPU visible: measuring host memcpy, checksum and CPU verified / staged "
              "copies only", file=sys.stderr)
    results, latency, sums, method = measure_all(rows, modes, sizes, reps=reps, warmup=warmup,
                                                 progress=not args.no_progress)
    n = max(sizes)
    doc = {"schema": SCHEMA, "schema_version": SCHEMA_VERSION,
           "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "argv": sys.argv[1:], "gpu": bool(gpus), "machine": machine_info(),
           "method": {"description": " ".join(__doc__[__doc__.index("Method"):__doc__.index("--json PATH")].split()),
                      "warmup": warmup, "reps": reps, "units": "GB/s = 1e9 bytes per second; ms per call; us"},
           "config": {"sizes": sizes, "matrix_size": n, "modes": [m for m in MODES if m in modes],
                      "rows": [list(r) for r in rows]},
           "results": results, "ratios": ratios(results, n), "latency": latency, "checksum": sums,
           "method_check": method,
           "corrupt": [{k: r[k] for k in ("src", "dst", "mode", "bytes", "detail")} for r in results
                       if r["check"] == "corrupt"],
           "compare": None}
    if old is not None:
        doc["compare"] = {"old": args.compare, "threshold": args.threshold,
                          "slower": compare(doc, old, args.threshold)}
    status = 1 if doc["corrupt"] or (doc["compare"] and doc["compare"]["slower"]) else 0
    # From here the run is finished: it is saved before anything else can fail, and an output that
    # cannot be written (a full disk) is reported with where the run went instead.
    errors, wrote = [], []
    if args.json:
        try:
            _write_json(doc, args.json)
            wrote.append(args.json)
        except (OSError, ValueError) as e:
            spare = _save_elsewhere(doc)
            errors.append(f"--json: could not write {args.json} ({e}); the run is saved in "
                          f"{spare if spare else 'the JSON above, on stderr'}")
    print_results(doc)
    if args.plot:
        try:
            plot(doc, args.plot)
            wrote.append(args.plot)
        except Exception as e:  # noqa: BLE001  (the run is printed and saved: report the plot and go on)
            errors.append(f"--plot: could not write {args.plot} ({type(e).__name__}: {e})")
    for path in wrote:
        print(f"wrote {path}")
    for message in errors:
        print(f"pyxfer bench: {message}", file=sys.stderr)
    return 2 if errors else status
