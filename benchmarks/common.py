"""Timing helpers shared by the benchmarks: CUDA events, warm-up, median of many, JSON output."""
import json
import os
import platform
import statistics
import time

import torch

L2_DEFEAT_BYTES = 256 << 20  # rotate inputs over at least this much memory so no run hits in L2


def fmt_size(n):
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:g} {unit}"
    return f"{n} B"


def fmt_gbps(v):
    """A rate in GB/s for a table: whole numbers from 10 up, 2 decimals below, "-" for None."""
    return "-" if v is None else f"{v:.0f}" if v >= 10 else f"{v:.2f}"


def cuda_time_ms(fn, inputs, *, warmup=3, reps=20, device=None):
    """Median milliseconds of fn(x) per call, cycling through `inputs`; each rep times one pass
    over all inputs between two CUDA events on the current stream of `device`, the pass starting on
    an idle GPU: the host's time to issue the first call is part of the figure (see cuda_times)."""
    return cuda_times(fn, inputs, warmup=warmup, reps=reps, device=device, hold=False)[0]


_SPIN_CYCLES_PER_MS = {}


def _spin_cycles_per_ms(device):
    """GPU clock cycles of torch.cuda._sleep per millisecond on `device`, measured once."""
    key = torch.cuda.current_device() if device is None else torch.device(device).index
    if key not in _SPIN_CYCLES_PER_MS:
        cycles = 2_000_000
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles)  # warm-up
        start.record()
        torch.cuda._sleep(cycles)
        stop.record()
        stop.synchronize()
        _SPIN_CYCLES_PER_MS[key] = cycles / start.elapsed_time(stop)
    return _SPIN_CYCLES_PER_MS[key]


def cuda_times(fn, inputs, *, warmup=3, reps=20, device=None, hold=True):
    """(median GPU milliseconds per call, median host milliseconds to issue one call), cycling through
    `inputs`; each rep times one pass over all inputs between two CUDA events on the current stream.
    hold=True: a spin kernel holds the stream while the host issues the pass (nvbench's "blocking
    kernel"), so the events time the GPU's work alone: the throughput of calls issued ahead of the
    GPU, as in a model's stream. A rep whose spin ended before the host had issued the pass (the
    GPU may have waited on the host) is measured again with a spin twice as long. hold=False: the
    pass starts on an idle GPU, and the host's time to issue the first call is in the figure."""
    with torch.cuda.device(device):
        host = []
        for _ in range(warmup):
            t0 = time.perf_counter()
            for x in inputs:
                fn(x)
            host.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        spin_ms = 2 * max(host) * 1e3 + 0.05 if hold else 0.0
        times, host = [], []
        while len(times) < reps:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if hold:
                torch.cuda._sleep(int(spin_ms * _spin_cycles_per_ms(device)))
            start.record()
            t0 = time.perf_counter()
            for x in inputs:
                fn(x)
            issue_s = time.perf_counter() - t0
            held = not hold or not start.query()  # the spin still ran when the pass was issued
            stop.record()
            stop.synchronize()
            if not held:
                spin_ms *= 2
                if spin_ms > 2000:
                    raise RuntimeError("cuda_times(hold=True): each pass outlasts a 2 s spin; fn seems to wait "
                                       "for the GPU (hold=False times it from an idle GPU instead)")
                continue
            times.append(start.elapsed_time(stop) / len(inputs))
            host.append(issue_s * 1e3 / len(inputs))
        return statistics.median(times), statistics.median(host)


def cpu_time_ms(fn, x, *, warmup=1, reps=5):
    for _ in range(warmup):
        fn(x)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(x)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def print_table(title, columns, rows):
    widths = [max(len(str(c)), *(len(str(r[i])) for r in rows)) if rows else len(str(c)) for i, c in enumerate(columns)]
    print(title)
    print("  ".join(str(c).rjust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(str(v).rjust(w) for v, w in zip(r, widths)))
    print()


def print_targets(targets):
    """Print target dicts ({"target", "measured", "result"}) as PASS/MISS lines, then a blank line."""
    width = max((len(str(t["measured"])) for t in targets), default=0)
    for t in targets:
        print(f"  {t['result']:>12}  {str(t['measured']):>{width}}  {t['target']}")
    print()


def write_json(path, payload):
    if path:
        with open(path, "w") as f:
            json.dump(payload, f, indent=2)


def machine_info():
    """Machine and versions for a benchmark's JSON: host, Python, torch, CUDA, NCCL, driver, GPUs, pyxfer
    build, CPU threads and the NCCL / multicast environment variables in effect."""
    import pyxfer
    from pyxfer.cli import driver_version, gpus
    nccl = None
    if torch.cuda.is_available():
        v = torch.cuda.nccl.version()
        nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    return {"host": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "torch_cuda": torch.version.cuda, "nccl": nccl, "driver": driver_version(),
            "gpus": gpus(), "pyxfer": pyxfer.__version__, "build": pyxfer.build_info(),
            "threads": torch.get_num_threads(),
            "env": {k: v for k, v in sorted(os.environ.items())
                    if k.startswith(("NCCL_", "TORCH_SYMM_MEM", "NVSHMEM_", "CUDA_VISIBLE", "PYXFER_"))}}
