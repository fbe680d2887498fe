"""One small collective per GPU pair, with its result checked: `pyxfer doctor`'s probe of the transport NCCL
itself uses. A copy followed by a synchronize can pass where NCCL deadlocks or delivers wrong data: NCCL's
kernels run on both GPUs at once and poll each other's writes through the peer mapping. So one process per
GPU joins a process group, and for every unordered pair {a, b} of GPUs the two run an all-gather over a
2-rank group of random bytes both can regenerate (a per-pair seed): each checks the shard the other sent,
which gives a result for both directions of the pair. A rank that does not answer within the watchdog's time
makes the pairs it has not reported ``hung``; a process that dies, ``error``.

The same code runs on gloo with CPU ranks (tests/tools/test_pair_collectives.py): only the backend and the
ranks' devices differ.
"""
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time

from .files import last_line

__all__ = ["BYTES", "collectives_unavailable", "run_pair_collectives"]

BYTES = (1 << 20) + 4093  # small, and odd: the tail of every vectorized loop
STARTUP_S = 120.0  # importing torch and pyxfer and joining the group, before a rank's first result


def collectives_unavailable(backend="nccl"):
    """Why ``backend``'s collectives cannot run here (a sentence), or None when they can."""
    import torch
    import torch.distributed as dist

    if not dist.is_available():
        return "torch.distributed is not available in this torch build"
    if backend == "nccl":
        if not dist.is_nccl_available():
            return "NCCL is not available in this torch build"
        if torch.cuda.device_count() < 2:
            return "fewer than 2 GPUs visible"
    return None


def _pattern(seed, src, a, b, device):
    """BYTES random bytes that rank ``src`` sends to its partner in the pair {a, b}: the same on every
    rank that makes them (a generator on the device's kind, seeded from the run, the pair and the sender)."""
    import torch

    gen = torch.Generator(device=device).manual_seed((seed * 1_000_003 + a * 1009 + b * 101 + src) % (1 << 62))
    return torch.randint(0, 256, (BYTES,), dtype=torch.uint8, device=device, generator=gen)


def _worker():
    """One rank: its task as JSON on stdin; one JSON line per result on stdout."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from .destinations import SENTINEL, compare
    from .doctor import TEST_FAULT_ENV  # test-only: "collective-corrupt:SRC->DST" flips a byte of what DST
    # received from SRC before it is checked; "collective-hang:SRC->DST" makes DST never finish that pair,
    # "collective-crash:SRC->DST" makes it die there

    task = json.load(sys.stdin)
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # stray prints go to stderr, not into the protocol
    rank, labels, seed = task["rank"], task["labels"], task["seed"]
    device = torch.device("cuda", task["devices"][rank]) if task["backend"] == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(task["backend"], init_method=task["init"], rank=rank, world_size=len(labels),
                            timeout=timedelta(seconds=2 * task["timeout"] + 30))  # the parent's watchdog first
    out.write(json.dumps({"ready": rank}) + "\n")  # joined: from here the watchdog allows `timeout` per result
    out.flush()
    fault = os.environ.get(TEST_FAULT_ENV, "")
    for a, b in task["pairs"]:
        group = dist.new_group([a, b])  # every rank makes every group, in the same order
        if rank not in (a, b):
            continue
        other = b if rank == a else a
        edge = f"{labels[other]}->{labels[rank]}"
        if fault == f"collective-hang:{edge}":
            while True:
                time.sleep(60)
        if fault == f"collective-crash:{edge}":
            os.abort()
        got = torch.full((2 * BYTES,), SENTINEL, dtype=torch.uint8, device=device)
        dist.all_gather_into_tensor(got, _pattern(seed, rank, a, b, device), group=group)
        shard = got[BYTES:] if other == b else got[:BYTES]  # the group's ranks in order: a, then b
        if fault == f"collective-corrupt:{edge}":
            shard[4097] ^= 0x10
        diff = compare(shard, _pattern(seed, other, a, b, device))
        result = {"src": other, "dst": rank, "result": "ok"}
        if diff is not None:
            result.update(result="dropped" if diff["all_zero"] or diff["all_sentinel"] else "corrupt",
                          first_offset=diff["first_offset"], wrong_bytes=diff["wrong_bytes"])
        out.write(json.dumps(result) + "\n")
        out.flush()
    dist.destroy_process_group()


def run_pair_collectives(labels, pairs, *, backend="nccl", devices=None, timeout=30.0, seed=0):
    """{(src label, dst label): {"path": "collective", "bytes", "result": "ok" | "corrupt" | "dropped" |
    "hung" | "error", first_offset?, wrong_bytes?, detail?}} for every ordered pair in ``pairs`` (pairs of
    indices into ``labels``, the ranks' names). One process per label (rank); ``devices``: the GPU of each
    rank (NCCL); ``timeout``: seconds the ranks may take between two results."""
    want = {(a, b) for a, b in pairs}
    unordered = sorted({tuple(sorted(p)) for p in want})
    results = {}
    env = dict(os.environ)
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    code = "import pyxfer.tools.pair_collectives as m; m._worker()"
    with tempfile.TemporaryDirectory() as tmp:
        procs, errs = [], []
        for rank in range(len(labels)):
            err = open(os.path.join(tmp, f"err{rank}"), "w+b")  # closed below, after the ranks
            task = {"rank": rank, "labels": labels, "devices": devices, "backend": backend, "seed": seed,
                    "init": f"file://{tmp}/init", "pairs": unordered, "timeout": timeout}
            p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=err, env=env, start_new_session=True)
            p.stdin.write(json.dumps(task).encode())
            p.stdin.close()
            procs.append(p)
            errs.append(err)
        try:
            _collect(procs, results, STARTUP_S + timeout, timeout)
        finally:
            killed = set()
            for r, p in enumerate(procs):
                if p.poll() is None:  # past the watchdog's time: this rank is hung
                    killed.add(r)
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
                p.stdout.close()
        died = {r: last_line(errs[r]) for r, p in enumerate(procs) if r not in killed and p.returncode != 0}
        for e in errs:
            e.close()
    out = {}
    for a, b in want:
        got = results.get((a, b))
        if got is None and died.keys() & {a, b}:  # the cause, before a partner left waiting for it
            r = b if b in died else a
            got = {"result": "error", "detail": f"the process of {labels[r]} ended without a result: {died[r]}"}
        elif got is None:
            names = ", ".join(labels[r] for r in sorted(killed & {a, b})) or "neither rank"
            got = {"result": "hung", "detail": f"no result within {timeout:g} s; killed: {names}"}
        out[(labels[a], labels[b])] = {"path": "collective", "bytes": BYTES, **got}
    return out


def _collect(procs, results, first_wait, timeout):
    """Read the ranks' result lines into ``results`` ({(src, dst): fields}) until every rank has ended or
    none has said anything for ``timeout`` seconds once every rank joined the group (``first_wait`` until
    then: importing torch on a loaded machine takes long, a hung collective must not)."""
    bufs = {p.stdout.fileno(): b"" for p in procs}
    open_fds = set(bufs)
    joined = set()
    deadline = time.monotonic() + first_wait
    while open_fds:
        ready, _, _ = select.select(list(open_fds), [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            return  # the watchdog: the rest are hung
        for fd in ready:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                open_fds.discard(fd)
                continue
            bufs[fd] += chunk
            while b"\n" in bufs[fd]:
                line, bufs[fd] = bufs[fd].split(b"\n", 1)
                msg = json.loads(line)
                if "ready" in msg:
                    joined.add(msg["ready"])
                else:
                    results[(msg.pop("src"), msg.pop("dst"))] = msg
                if len(joined) == len(procs):
                    deadline = time.monotonic() + timeout
