"""Where the time of one pyxfer.all_gather call goes.

``--mode gloo`` (2 CPU processes, a gloo group; ``--world-size 1``: one process) and ``--mode gpu1``
(one GPU, a 1-rank NCCL group), each call running all of all_gather's steps (pyxfer.gather.gather;
all_gather itself shortcuts a 1-rank group):
pyxfer's own host time per steady-state call (the same signature as the calls before it: fused
mode), i.e. the wall time of the call minus the time inside torch.distributed (the backend's
all-gather call and Work.wait, which on gloo moves the data) and, on CUDA, minus host waits for the
device (Event.synchronize), split by step: group (looking the group up), prep (the input
normalised: pyxfer.gather.plan.Local), plan (decide: parts built), post (the record and the
collective posted, pyxfer.gather.exchange.Records), finish (waiting + post-processing + reading the
records) and other (the rest of the call: the record encoded, the signature compared, the handle).
Wall: median per call of a plain loop; own time and steps: medians per call of a second,
instrumented loop (each call's own time is its wall time minus its own torch.distributed time and
device waits (Event.synchronize, a CUDA tensor's tolist), so a peer's lateness does not count; the
wrappers add ~0.3 us per step), and its CPU time (this thread's CPU time per call minus that inside
torch.distributed calls and device waits: what the own time would be on an idle machine, as a
preempted process's wall time is not). torch's own all-gather of the same shard (plain, host time
per call) is the baseline in the same run. Goal (issue 20): <= 30 us for an
already-quantized MXFP8 or FP8-block input, <= 50 us with verify=True.

    python benchmarks/gather_overhead.py --mode gloo [--rows 128 --cols 128] [--calls 2000]
    python benchmarks/gather_overhead.py --mode gpu1 [--rows 8192 --cols 8192] [--calls 2000]

``--mode nccl2`` (the default; 2 ranks, NCCL, one GPU each): for torch's
all-gather and pyxfer's (plain bf16, MXFP8 rowwise, MXFP8 + verify) of an 8192x8192 shard, the
device time of one call (CUDA events around it, after a barrier and a device sync, median of 30)
and its host time, split into pyxfer's steps (input preparation, metadata records (in fused mode,
after the warm-up, the one collective with the data: the data launch is counted in both), data
launch, wait + post-processing; microseconds per call, wall clock); then the same pyxfer calls with
the group's agreed state forgotten before each one (every call waits for its records: the path of a
group's first calls with a signature). A diagnostic, not a target: benchmarks/gather.py measures those.

    python benchmarks/gather_overhead.py [--mode nccl2] [--rows 8192 --cols 8192] [--reps 30]
"""
import argparse
import functools
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (shared hosts)
STEPS = {"Local": "prep", "Records": "records", "launch": "launch", "complete": "wait+finish"}


def timed(fn, reps):
    device_ms, host_ms = [], []
    for _ in range(reps):
        dist.barrier()
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        fn()
        host_ms.append((time.perf_counter() - t0) * 1e3)
        stop.record()
        stop.synchronize()
        device_ms.append(start.elapsed_time(stop))
    return statistics.median(device_ms), statistics.median(host_ms)


def worker(rank, world, tmp, rows, cols, reps):
    import pyxfer.gather as G
    from pyxfer import formats
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{tmp}/init", rank=rank, world_size=world, device_id=device)
    spent = {}

    def count(owner, name):  # wall time spent in owner.name, per step
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
        setattr(owner, name, wrapper)
    for name in ("Local", "Records", "complete"):
        count(G, name)
    count(G, "launch")  # a waiting call's data collective
    count(G.exchange, "launch")  # records (fused: with the data)
    x = torch.randn(rows, cols, dtype=torch.bfloat16, device=device)
    u8 = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, device=device)
    q = formats.quantize(x, "mxfp8")
    out = torch.empty(world * rows, cols, dtype=x.dtype, device=device)
    out8 = torch.empty(world * rows, cols, dtype=u8.dtype, device=device)
    cases = {"torch bf16": lambda: dist.all_gather_into_tensor(out, x),
             "torch uint8": lambda: dist.all_gather_into_tensor(out8, u8),
             "pyxfer bf16": lambda: G.all_gather(x), "pyxfer mxfp8 rowwise": lambda: G.all_gather(q),
             "pyxfer mxfp8 rowwise + verify": lambda: G.all_gather(q, verify=True)}
    lines = []
    for name, fn in cases.items():
        for _ in range(5):
            fn()
        spent.clear()
        dev, host = timed(fn, reps)
        steps = " / ".join(f"{spent.get(k, 0.0) / reps * 1e6:.0f}" for k in STEPS) if name.startswith("pyxfer") else "-"
        lines.append(f"| {name} | {dev:.3f} | {host:.3f} | {steps} |")
    agreed = G._agreed
    G._agreed = lambda group: G.Agreed()  # every call waits for its records
    for name in ("pyxfer bf16", "pyxfer mxfp8 rowwise"):
        dev, host = timed(cases[name], reps)
        lines.append(f"| {name}, waiting for the records | {dev:.3f} | {host:.3f} | - |")
    G._agreed = agreed
    if rank == 0:
        print(f"| call ({world} ranks, {rows}x{cols} per rank) | device ms | host ms | host us per call: "
              f"{' / '.join(STEPS.values())} |\n|---|---|---|---|")
        print("\n".join(lines))
    dist.destroy_process_group()


# ---- pyxfer's own host time per steady-state call (gloo, one GPU) -----------------------------------
HOST_STEPS = ("group", "prep", "plan", "post", "finish", "other")


class StepClock:
    """Exclusive host time per step of pyxfer.gather calls, torch.distributed time (the backend's
    all-gather call and Work.wait / is_completed) and device waits (CUDA Event.synchronize) apart."""

    OUTSIDE = ("torch.distributed", "device wait")

    def __init__(self, G):
        self.G, self.spent, self.stack, self.undo = G, {}, [], []
        self.outside_cpu = 0.0  # this thread's CPU time inside OUTSIDE steps

    def _timed(self, owner, name, step):
        fn = getattr(owner, name)
        clock = self

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            return clock.run(step, fn, *args, **kwargs)
        setattr(owner, name, wrapper)
        self.undo.append((owner, name, fn))

    def run(self, step, fn, *args, **kwargs):
        self.stack.append(0.0)
        outside = step in self.OUTSIDE
        c0 = time.thread_time() if outside else 0.0
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            elapsed = time.perf_counter() - t0
            if outside:
                self.outside_cpu += time.thread_time() - c0
            children = self.stack.pop()
            self.spent[step] = self.spent.get(step, 0.0) + elapsed - children
            if self.stack:
                self.stack[-1] += elapsed

    def install(self):
        G, clock = self.G, self
        self._timed(G, "_group_info", "group")
        self._timed(G, "Local", "prep")
        self._timed(G, "decide", "plan")
        self._timed(G, "Records", "post")
        self._timed(G, "complete", "finish")
        real_allgather = G.exchange._allgather

        class TimedWork:  # the backend's Work, its waits counted as torch.distributed time
            def __init__(self, work):
                self.work = work

            def wait(self):
                return clock.run("torch.distributed", self.work.wait)

            def is_completed(self):
                return clock.run("torch.distributed", self.work.is_completed)

        def allgather(*args):
            return TimedWork(clock.run("torch.distributed", real_allgather, *args))
        G.exchange._allgather = allgather
        self.undo.append((G.exchange, "_allgather", real_allgather))
        if torch.cuda.is_available():
            self._timed(torch.cuda.Event, "synchronize", "device wait")
            real_tolist = torch.Tensor.tolist

            def tolist(t):  # a CUDA tensor's values: the host waits for the device (verify's hashes)
                return clock.run("device wait", real_tolist, t) if t.is_cuda else real_tolist(t)
            torch.Tensor.tolist = tolist
            self.undo.append((torch.Tensor, "tolist", real_tolist))

    def uninstall(self):
        for owner, name, fn in reversed(self.undo):
            setattr(owner, name, fn)
        self.undo.clear()


def host_cases(G, formats, device, rows, cols):
    x = torch.randn(rows, cols, dtype=torch.bfloat16, device=device)
    mx, fp8 = formats.quantize(x, "mxfp8"), formats.quantize(x, "fp8_block_1x128")
    return {"pyxfer bf16": (x, {}), "pyxfer mxfp8 rowwise": (mx, {}),
            "pyxfer mxfp8 rowwise + verify": (mx, {"verify": True}), "pyxfer fp8_block_1x128 rowwise": (fp8, {}),
            "pyxfer fp8_block_1x128 rowwise + verify": (fp8, {"verify": True})}


def host_worker(rank, world, tmp, mode, rows, cols, calls, out):
    import pyxfer.gather as G
    from pyxfer import formats
    torch.set_num_threads(1)
    if mode == "gpu1":
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=f"file://{tmp}/init", rank=0, world_size=1, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=world)
    group = dist.group.WORLD

    def warm(fn):
        for _ in range(20):  # fused after two agreed calls
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()

    def per_call_us(fn):
        warm(fn)
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e6

    def per_step_us(fn):
        """Medians over calls of (pyxfer's own time, {step: exclusive time}), from the instrumented loop."""
        clock = StepClock(G)
        clock.install()
        try:
            warm(fn)
            own, own_cpu, steps = [], [], {k: [] for k in HOST_STEPS}
            for _ in range(calls):
                clock.spent.clear()
                clock.outside_cpu = 0.0
                c0 = time.thread_time()
                t0 = time.perf_counter()
                fn()
                wall = time.perf_counter() - t0
                own_cpu.append(time.thread_time() - c0 - clock.outside_cpu)
                spent = dict(clock.spent)
                mine = wall - spent.pop("torch.distributed", 0.0) - spent.pop("device wait", 0.0)
                own.append(mine)
                spent["other"] = mine - sum(spent.values())
                for k in HOST_STEPS:
                    steps[k].append(spent.get(k, 0.0))
        finally:
            clock.uninstall()
        return statistics.median(own) * 1e6, statistics.median(own_cpu) * 1e6, \
            {k: statistics.median(v) * 1e6 for k, v in steps.items()}

    x0 = torch.randn(rows, cols, dtype=torch.bfloat16, device=device)
    out_t = torch.empty(world * rows, cols, dtype=x0.dtype, device=device)
    lines = [("torch all_gather_into_tensor bf16 (baseline)", per_call_us(
        lambda: group._allgather_base(out_t, x0).wait()), None, None, {})]
    for name, (x, kw) in host_cases(G, formats, device, rows, cols).items():
        def fn(x=x, kw=kw):  # all_gather's steps, for any world size (all_gather itself shortcuts one rank)
            return G.gather(x, *G._group_info(group), **kw)
        for _ in range(3):
            assert fn() is not None
        assert G._agreed(group).fused(), f"{name}: not in fused mode after 3 calls"
        wall = per_call_us(fn)
        own, own_cpu, steps = per_step_us(fn)
        lines.append((name, wall, own, own_cpu, steps))
    if rank == 0:
        out.put(lines)
    dist.destroy_process_group()


def host_main(a):
    if a.mode == "gpu1" and not torch.cuda.is_available():
        raise SystemExit("--mode gpu1 needs a GPU")
    world = 1 if a.mode == "gpu1" else a.world_size
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(host_worker, args=(world, tmp, a.mode, a.rows, a.cols, a.calls, out), nprocs=world,
                           start_method="spawn")
        lines = out.get()
    where = f"gloo, {world} CPU processes" if a.mode == "gloo" else \
        f"1-rank NCCL group, {torch.cuda.get_device_name(0)}"
    print(f"pyxfer host time per steady-state call ({where}; {a.rows}x{a.cols} bf16 shard; median of {a.calls} "
          f"calls; us)")
    print(f"| call | wall per call | pyxfer's own host time | its CPU time | {' / '.join(HOST_STEPS)} |\n"
          "|---|---|---|---|---|")
    for name, wall, own, own_cpu, steps in lines:
        if own is None:
            print(f"| {name} | {wall:.1f} | - | - | - |")
            continue
        split = " / ".join(f"{steps[k]:.1f}" for k in HOST_STEPS)
        print(f"| {name} | {wall:.1f} | {own:.1f} | {own_cpu:.1f} | {split} |")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("nccl2", "gloo", "gpu1"), default="nccl2")
    p.add_argument("--rows", type=int, default=None, help="shard rows (default: 8192 on GPUs, 128 on gloo)")
    p.add_argument("--cols", type=int, default=None, help="shard cols (default: 8192 on GPUs, 128 on gloo)")
    p.add_argument("--reps", type=int, default=30, help="nccl2: reps per case")
    p.add_argument("--calls", type=int, default=2000, help="gloo / gpu1: calls per case")
    p.add_argument("--world-size", type=int, default=2, help="gloo: processes")
    a = p.parse_args()
    small = a.mode == "gloo"
    a.rows, a.cols = a.rows or (128 if small else 8192), a.cols or (128 if small else 8192)
    if a.mode != "nccl2":
        return host_main(a)
    if torch.cuda.device_count() < 2:
        raise SystemExit("needs 2 GPUs")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(2, tmp, a.rows, a.cols, a.reps), nprocs=2)


if __name__ == "__main__":
    main()
