"""The measurement method shared by ``pyxfer bench`` and benchmarks/: CUDA events, warm-up, the
stream held by a spin kernel while a pass is queued, median with spread; wall clock on the CPU.

The method follows nvbandwidth's: a kernel holds the stream while the host queues the timed copies
between two events, so the events time the GPU's work alone, not the host's issue rate. nvbandwidth
spins on a host-mapped latch released after the queueing; torch offers no latch kernel, so the hold
here is a timed spin (torch.cuda._sleep) long enough to outlast the queueing, and each sample checks
that the spin was still running when the last call had been issued (else the sample is measured
again with a spin twice as long: the GPU may have waited on the host).
"""
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from .._devices import as_device

__all__ = ["L2_DEFEAT_BYTES", "Samples", "cuda_samples", "cuda_times", "cuda_time_ms", "cpu_samples",
           "cpu_time_ms", "fmt_size", "fmt_gbps"]

L2_DEFEAT_BYTES = 256 << 20  # rotate inputs over at least this much memory so no run hits in L2


def fmt_size(n):
    """A byte count as "4 KiB", "1.5 MiB", "7 B"."""
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:g} {unit}"
    return f"{n} B"


def fmt_gbps(v):
    """A rate in GB/s for a table: whole numbers from 10 up, 2 decimals below, "-" for None."""
    return "-" if v is None else f"{v:.0f}" if v >= 10 else f"{v:.2f}"


@dataclass(frozen=True)
class Samples:
    """Milliseconds per call over the repetitions: median, min and max; host_ms is the median host
    time to issue one call; held says whether the GPU stream was held while the calls were queued."""
    median_ms: float
    min_ms: float
    max_ms: float
    reps: int
    host_ms: float
    held: bool

    @classmethod
    def of(cls, times, host, held):
        return cls(statistics.median(times), min(times), max(times), len(times),
                   statistics.median(host) if host else 0.0, held)

    def gbps(self, num_bytes):
        """GB/s (1e9 bytes per second) of ``num_bytes`` moved per call, at the median."""
        return num_bytes / (self.median_ms * 1e-3) / 1e9 if self.median_ms > 0 else float("inf")

    def as_dict(self):
        return asdict(self)


_SPIN_CYCLES_PER_MS = {}


def _spin_cycles_per_ms(index):
    """GPU clock cycles of torch.cuda._sleep per millisecond on cuda:`index` (current), measured once."""
    if index not in _SPIN_CYCLES_PER_MS:
        cycles = 2_000_000
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles)  # warm-up
        start.record()
        torch.cuda._sleep(cycles)
        stop.record()
        stop.synchronize()
        _SPIN_CYCLES_PER_MS[index] = cycles / start.elapsed_time(stop)
    return _SPIN_CYCLES_PER_MS[index]


def cuda_samples(fn, inputs, *, warmup=3, reps=20, device=None, hold=True) -> Samples:
    """Time fn(x) per call, cycling through `inputs`: each rep times one pass over all inputs between
    two CUDA events on the current stream of `device` (work fn queues on other streams must be
    joined back to that stream by fn itself).

    hold=True: a spin kernel holds the stream while the host issues the pass (nvbench's "blocking
    kernel", nvbandwidth's latch), so the events time the GPU's work alone: the throughput of calls
    issued ahead of the GPU, as in a model's stream. A rep whose spin ended before the host had
    issued the pass is measured again with a spin twice as long; RuntimeError when a pass outlasts a
    2 s spin (fn waits for the GPU: time it with hold=False). hold=False: the pass starts on an idle
    GPU, and the host's time to issue the first call is in the figure."""
    # the one device parser: a torch.device, "cuda:N", "cuda" (the current device) or an index
    index = (torch.cuda.current_device() if device is None
             else as_device("pyxfer.tools.timing.cuda_samples", "device", device).index)
    with torch.cuda.device(index):
        host = []
        for _ in range(warmup):
            t0 = time.perf_counter()
            for x in inputs:
                fn(x)
            host.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        spin_ms = 2 * max(host, default=0.0) * 1e3 + 0.05 if hold else 0.0
        times, host = [], []
        while len(times) < reps:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if hold:
                torch.cuda._sleep(int(spin_ms * _spin_cycles_per_ms(index)))
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
                    raise RuntimeError("cuda_samples(hold=True): each pass outlasts a 2 s spin; fn seems to wait "
                                       "for the GPU (hold=False times it from an idle GPU instead)")
                continue
            times.append(start.elapsed_time(stop) / len(inputs))
            host.append(issue_s * 1e3 / len(inputs))
        return Samples.of(times, host, hold)


def cuda_times(fn, inputs, *, warmup=3, reps=20, device=None, hold=True):
    """(median GPU milliseconds per call, median host milliseconds to issue one call): cuda_samples."""
    s = cuda_samples(fn, inputs, warmup=warmup, reps=reps, device=device, hold=hold)
    return s.median_ms, s.host_ms


def cuda_time_ms(fn, inputs, *, warmup=3, reps=20, device=None):
    """Median milliseconds of fn(x) per call, each pass starting on an idle GPU (cuda_samples with
    hold=False: the host's time to issue the first call is part of the figure)."""
    return cuda_samples(fn, inputs, warmup=warmup, reps=reps, device=device, hold=False).median_ms


def cpu_samples(fn, x, *, warmup=1, reps=5, inner=1) -> Samples:
    """Wall-clock milliseconds per call of fn(x) (``inner`` calls per rep, for calls too short to
    time one by one): median, min and max over ``reps``."""
    for _ in range(warmup):
        fn(x)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn(x)
        times.append((time.perf_counter() - t0) * 1e3 / inner)
    return Samples.of(times, [], False)


def cpu_time_ms(fn, x, *, warmup=1, reps=5):
    """Median wall-clock milliseconds of fn(x) (cpu_samples)."""
    return cpu_samples(fn, x, warmup=warmup, reps=reps).median_ms
