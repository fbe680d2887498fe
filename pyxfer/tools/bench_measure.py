"""`pyxfer bench`'s measurement: rows, modes, the points and how each is timed, the latency kinds, the
pointer chase, the spread and plausibility checks (the method: pyxfer.tools.bench's docstring)."""
import contextlib
import sys
import time

import torch

from .._devices import as_device
from .bench_schema import MODES
from .destinations import SENTINEL, compare, describe
from .pairs import parse_pairs
from .timing import Samples, cpu_samples, cuda_samples, fmt_gbps, fmt_size, stream_samples

__all__ = ["PRESETS", "LATENCY_KINDS", "default_rows", "parse_rows", "parse_modes", "modes_of", "plan_points",
           "measure_all", "chase_ring", "chase", "plausibility", "spread_warnings", "ratios"]

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
PRESETS = {
    "quick": {"sizes": [4 * KiB, MiB, 64 * MiB], "reps": 5, "warmup": 2},
    "full": {"sizes": [4 * KiB << (2 * i) for i in range(10)], "reps": 20, "warmup": 3},  # 4 KiB ... 1 GiB
}
LATENCY_BYTES = 8
# Latency figures per row: "ce" and "sm" the GPU's view (LATENCY_LOOP 8-byte copies queued behind a held
# stream, timed by events, per copy: torch's copy_ / the copy kernel, pulling between GPUs); "chase" one
# dependent load by the source GPU from the destination's memory (pointer_chase over a CHASE_BYTES ring,
# nvbandwidth's SM latency; GPU pairs with peer access, GPU-local, and host memory on a CPU-only run);
# "host_call" the host's view (one 8-byte copy from an idle stream: issue + copy, what a lone call waits).
LATENCY_KINDS = ("ce", "sm", "chase", "host_call")
LATENCY_LOOP = 100
CHASE_BYTES, CHASE_HOPS = 2 * MiB, 20_000
HOST_ENDPOINTS = ("pinned", "pageable", "cpu")
CV_WARN = 0.05  # points whose times spread more than this (coefficient of variation) are flagged
CPU_CE_FLOOR_GBPS = 1.0  # a host memcpy of 1 MiB and up below this is contention, not the machine
# Without a GPU: preset sizes above CPU_MAX_BYTES are dropped, so a default run peaks below 2 GB of memory
# (about 5 x the largest size: random data, source, destination, the verified copy's and the staging's
# buffers; plus torch); the measurement runs on CPU_THREADS torch threads unless --threads says otherwise.
CPU_MAX_BYTES = 64 * MiB
CPU_THREADS = 1


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
    return parse_pairs(spec, lambda text: text if text in names else None, each="row",
                       accept=lambda a, b: not (num_gpus and _is_host(a) and _is_host(b)),
                       expected=f"SRC->DST[,...] with endpoints from {names} (not host -> host where GPUs are "
                                f"visible)")


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
            self.out = _buffer(dst, n, fill=SENTINEL)
            if mode == "ce_bidir":
                self.back_src = _buffer(dst, n, data=data_gpu)
                self.back_out = _buffer(src, n, fill=SENTINEL)
                self.fwd_streams, self.back_streams = _direction_streams(src, dst), _direction_streams(dst, src)
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
        """One copy each way, each direction on its own streams (nvbandwidth's way: each from its own GPU,
        nothing between the two directions). torch's copy between GPUs runs on the source GPU's current
        stream and puts a two-way barrier between it and the destination GPU's current stream; with one
        current stream per GPU shared by both directions, the back copy waited for the forward one (run Q:
        394 GB/s two-way where nvbandwidth reads 781). So each direction makes its own streams current on
        both of its GPUs, and the anchor stream (held, timed by the events) is joined only by events."""
        anchor = torch.cuda.current_stream()
        fwd, back = self.fwd_streams[0], self.back_streams[0]  # the streams the copies run on
        fwd.wait_stream(anchor)
        back.wait_stream(anchor)
        with _current(self.fwd_streams):
            self.out.copy_(self.data, non_blocking=True)
        with _current(self.back_streams):
            self.back_out.copy_(self.back_src, non_blocking=True)
        anchor.wait_stream(fwd)
        anchor.wait_stream(back)

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
        return stream_samples(self.fn, [None] * loop, warmup=warmup, reps=reps, device=self.anchor,
                              hold=self.can_hold)

    def check(self):
        """("ok" | "corrupt", detail): each destination's PXH64 on its own device against its source's."""
        from ..transfer import TransferError, check_transfers

        if self.mode == "verified_deferred":
            try:
                check_transfers()
            except TransferError as e:
                return "corrupt", str(e)
        bad = []
        for get in self.checks:
            out, src = get()
            diff = compare(out, src)
            if diff is not None:
                bad.append(describe(out.device, diff))
        return ("corrupt", "; ".join(bad)) if bad else ("ok", "")


def _direction_streams(src, dst):
    """New streams for one direction of a two-way copy: the first, the copying GPU's (the source's; the
    GPU of a host row), where torch issues the copy; then one on the destination GPU of a GPU pair."""
    gpus = [_device(e) for e in (src, dst) if not _is_host(e)]
    return [torch.cuda.Stream(device=g) for g in dict.fromkeys(gpus)]


@contextlib.contextmanager
def _current(streams):
    """Make each of ``streams`` its GPU's current stream (torch.cuda.stream sets one GPU's only)."""
    with contextlib.ExitStack() as stack:
        for st in streams:
            stack.enter_context(torch.cuda.stream(st))
        yield


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
                     "min_ms": None, "max_ms": None, "cv": None, "reps": 0, "loop": _loop(n), "held": False,
                     "check": "error", "detail": failed}
            point = None  # set once its buffers exist: a setup that raises is reported like a failing call
            try:
                if not failed:
                    point = _Point(src, dst, mode, n, data)
                    s = point.measure(_loop(n), warmup, reps)
                    _sync_all()
                    entry.update(gbps=round(s.gbps(point.moved), 3), median_ms=s.median_ms, min_ms=s.min_ms,
                                 max_ms=s.max_ms, cv=round(s.cv, 4), reps=s.reps, held=s.held)
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
        for kind in LATENCY_KINDS:
            entry = {"src": src, "dst": dst, "kind": kind, "bytes": LATENCY_BYTES if kind != "chase" else CHASE_BYTES,
                     "median_us": None, "min_us": None, "max_us": None, "cv": None, "detail": ""}
            try:
                t, scale = _latency(src, dst, kind, small, warmup, reps)
                if t is None:
                    continue  # this row has no such latency (see LATENCY_KINDS)
                entry.update(median_us=t.median_ms * scale, min_us=t.min_ms * scale, max_us=t.max_ms * scale,
                             cv=round(t.cv, 4))
            except Exception as e:  # noqa: BLE001  (as for the bandwidth points: reported, the bench carries on)
                entry["detail"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                _reset_after_error()
            latency.append(entry)
        bar.step(f"latency {src}->{dst}")
    if gpus:
        method = _method_check(rows, results, max(sizes), warmup, reps)
    bar.close()
    return results, latency, sums, method


def chase_ring(num_nodes, generator=None):
    """(ring, order): a ring of ``num_nodes`` int64 node indices that is one random cycle through every
    node (ring[i] is the node after i; random, so no prefetcher guesses the next load), and the cycle's
    order from node 0 (order[k] is the node reached after k hops)."""
    order = torch.cat([torch.zeros(1, dtype=torch.int64),
                       torch.randperm(num_nodes - 1, generator=generator, dtype=torch.int64) + 1])
    ring = torch.empty(num_nodes, dtype=torch.int64)
    ring[order] = order.roll(-1)
    return ring, order


def chase(src, dst, ring, order, hops, warmup, reps):
    """Samples of ``src`` (a GPU; the CPU without GPUs) walking ``hops`` hops of ``ring`` (chase_ring) put in
    ``dst``'s memory, each walk from an idle stream. Raises RuntimeError when a walk ends on another node
    than ``order`` says (the ring's memory read back wrong)."""
    ring = ring.to(_device(dst))
    got = []

    def walk(_):
        got.append(torch.ops.pyxfer.pointer_chase(ring, hops, _device(src)))
    if src == "cpu":
        t = cpu_samples(walk, None, warmup=warmup, reps=reps)
    else:
        t = cuda_samples(walk, [None], warmup=warmup, reps=reps, device=_device(src), hold=False)
    want = int(order[hops % len(order)])
    if bad := [int(g) for g in got if int(g) != want]:
        raise RuntimeError(f"pointer chase {src} -> {dst}: {len(bad)} of {len(got)} walks ended on node {bad[0]}, "
                           f"expected {want}: the ring's memory read back wrong")
    return t


def _latency(src, dst, kind, small, warmup, reps):
    """(Samples, microseconds per sample millisecond) of one latency figure (LATENCY_KINDS), or (None, 0)
    where the row has none. Raises RuntimeError when a pointer chase ends on the wrong node."""
    if kind == "host_call":  # the host's view: one call from an idle stream, issue and copy
        p = _Point(src, dst, "ce", LATENCY_BYTES, small)
        if p.anchor is None:
            return cpu_samples(p.fn, None, warmup=warmup, reps=reps, inner=1000), 1e3
        return cuda_samples(p.fn, [None], warmup=warmup, reps=max(reps, 20), device=p.anchor, hold=False), 1e3
    gpu_pair = not _is_host(src) and not _is_host(dst)
    if kind == "chase":
        if src != "cpu" and not (gpu_pair and _peer(src, dst)):
            return None, 0
        # nvbandwidth's device_to_device_latency_sm: the row's GPU walks a 2 MiB ring in the column's memory
        ring, order = chase_ring(CHASE_BYTES // 8)
        hops = CHASE_HOPS if src != "cpu" else 100 * CHASE_HOPS
        return chase(src, dst, ring, order, hops, warmup, reps), 1e3 / hops
    # the GPU's view: LATENCY_LOOP copies queued back to back behind a held stream, timed by events, per copy
    if src == "cpu":
        return None, 0
    mode = "ce" if kind == "ce" else "sm_pull" if gpu_pair and src != dst else "sm_push"
    if mode != "ce" and not (gpu_pair and _peer(src, dst)):
        return None, 0
    p = _Point(src, dst, mode, LATENCY_BYTES, small)
    if not p.can_hold:  # pageable memory: the host waits for each copy; only its host_call figure means anything
        return None, 0
    return cuda_samples(p.fn, [None] * LATENCY_LOOP, warmup=warmup, reps=max(reps, 20), device=p.anchor,
                        hold=True), 1e3


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


def spread_warnings(results, latency, limit=CV_WARN):
    """A line per point whose coefficient of variation is above ``limit``: its median is not a steady figure."""
    out = []
    for r in results:
        if r.get("cv") is not None and r["cv"] > limit:
            out.append(f"spread: {r['src']} -> {r['dst']} {r['mode']} {fmt_size(r['bytes'])}: CV {r['cv']:.1%} "
                       f"(above {limit:.0%}): the median {fmt_gbps(r['gbps'])} GB/s is not a steady figure")
    for r in latency:
        if r.get("cv") is not None and r["cv"] > limit:
            out.append(f"spread: latency {r['kind']} {r['src']} -> {r['dst']}: CV {r['cv']:.1%} (above {limit:.0%})")
    return out


def plausibility(results, floor=CPU_CE_FLOOR_GBPS):
    """Warnings on host memcpy rows (cpu -> cpu) that cannot be the machine's real speed: ``ce`` (torch's
    copy_, one memcpy) below ``staged`` (which does more work) or below ``floor`` GB/s at 1 MiB and up.
    Both mean the copy's CPU threads were contended (other processes on the cores, or more torch threads
    than free cores): torch's parallel copy then waits on threads that do not run."""
    by = {(r["src"], r["dst"], r["mode"], r["bytes"]): r["gbps"] for r in results}
    why = ("CPU threads contended (other processes on these cores, or more threads than free cores); rerun on an "
           "idle machine or with --threads 1")
    out = []
    for (src, dst, mode, n), ce in by.items():
        if src != "cpu" or mode != "ce" or ce is None:
            continue
        staged = by.get((src, dst, "staged", n))
        if staged is not None and ce < staged:
            out.append(f"implausible: {src} -> {dst} ce {fmt_gbps(ce)} GB/s below staged {fmt_gbps(staged)} GB/s at "
                       f"{fmt_size(n)} (a plain copy slower than one that does more): {why}")
        elif n >= MiB and ce < floor:
            out.append(f"implausible: {src} -> {dst} ce {fmt_gbps(ce)} GB/s at {fmt_size(n)}, below {floor} GB/s (any "
                       f"machine's memcpy is faster): {why}")
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
