"""Fault injection for tests and demos: make a copy path really write wrong bytes.

The fault is applied in the native layer, on the destination memory, by the copy itself (CPU and
GPU): "zeros" (a dropped write: the destination reads back as zeros), "bitflip" (one random bit),
"stale" (nothing arrives; the destination keeps what it held), "truncate" (the last eighth is
missing), "shift" (the data lands a few bytes off).

One more kind tests the verification itself rather than the link: "skip_kernel" (KERNEL_FAULT_KINDS;
path "direct" only) makes the next direct GPU copy leave out the kernel that hashes its destination
(for a GPU-local copy, the one kernel that copies and hashes both ends; for a copy between GPUs, the
destination's kernels): a kernel that did not run must be caught (sync: repaired staged or raised;
deferred: reported by check_transfers()), never read as a match. Other copies are not hit by it.

On the "gather" path (pyxfer.all_gather) ``src`` and ``dst`` are group ranks: the fault writes into
the bytes received from rank ``src`` on rank ``dst``, after the collective and before verification
(in Python, with tensor ops on the receive buffer's device). "stale" there leaves the pattern 0xA5
(receive buffers are fresh allocations, so "what it held" is arbitrary bytes).

A fault always writes wrong bytes: where the bytes of its kind happen to equal the source's (an
all-zero source under "zeros"; a recycled destination that already held the source's bytes under
"stale", "truncate" or "shift"; periodic data under "shift"), one bit of the destination is flipped
as well, so a test that counts on the fault cannot pass vacuously.

Threads: a fault hits only the copies (and gathers) made by the thread that armed it, while its
``with`` block is open; ``process_wide=True`` makes it hit every thread's copies (demos, or copies a
library makes on its own threads, e.g. autograd's device threads during backward). Health is per
process: a pair is a physical link, so a corrupt verdict found by one thread routes every thread's
copies of that pair (pyxfer.health). Deferred mismatches are reported by check_transfers() in the
thread that made the copy (for a copy captured in a CUDA graph: the thread that captured it).

The environment variable PYXFER_INJECT_FAULT installs one process-wide fault when pyxfer is
imported, e.g. ``PYXFER_INJECT_FAULT="bitflip,dst=cuda:1,times=3"`` (keys: path, src, dst, times,
each at most once; path defaults to direct, src/dst to any device, times to 1; ``path=gather,src=1``
names ranks). A malformed value warns and installs nothing.
"""
import contextlib
import os
import random
import threading
import warnings

import torch

from ._checks import check_seed
from ._devices import device_code

__all__ = ["FAULT_KINDS", "KERNEL_FAULT_KINDS", "inject_fault", "InjectedFault"]

FAULT_KINDS = ("zeros", "bitflip", "stale", "truncate", "shift")
KERNEL_FAULT_KINDS = ("skip_kernel",)  # faults of the verification's own kernels (GPU direct copies)
PATHS = ("direct", "staged", "gather")


class InjectedFault:
    """Handle of an active fault; ``unused`` (set when the context exits) counts copies it did not hit."""

    def __init__(self, fault_id: int, kind: str, times: int, pop=None):
        self.id, self.kind, self.times = fault_id, kind, times
        self.unused = None
        self._pop = pop or torch.ops.pyxfer.fault_pop

    @property
    def used(self):
        return None if self.unused is None else self.times - self.unused

    def remove(self) -> int:
        if self.unused is None:
            self.unused = self._pop(self.id)
        return self.unused


def _push(kind, src, dst, path, times, seed, buffer=None, process_wide=False) -> InjectedFault:
    op = "pyxfer.testing.inject_fault"
    if not isinstance(process_wide, bool):
        raise ValueError(f"{op}: process_wide must be True or False, got {process_wide!r}")
    if kind not in FAULT_KINDS + KERNEL_FAULT_KINDS:
        raise ValueError(f"{op}: kind must be one of {FAULT_KINDS + KERNEL_FAULT_KINDS}, got {kind!r}")
    if path not in PATHS:
        raise ValueError(f"{op}: path must be one of {PATHS}, got {path!r}")
    if kind in KERNEL_FAULT_KINDS and path != "direct":
        raise ValueError(f"{op}: kind {kind!r} needs path='direct' (it skips a kernel of direct GPU copies), "
                         f"got path={path!r}")
    if isinstance(times, bool) or not isinstance(times, int) or times < 1:
        raise ValueError(f"{op}: times must be an int >= 1, got {times!r}")
    if buffer is not None and path != "gather":
        raise ValueError(f"{op}: buffer is only for path='gather', got path={path!r}")
    seed = random.getrandbits(62) if seed is None else check_seed(op, seed)
    if path == "gather":
        return _push_gather(op, kind, src, dst, times, seed, buffer, process_wide)
    fault_id = torch.ops.pyxfer.fault_push(kind, device_code(op, "src", src), device_code(op, "dst", dst),
                                           path, times, seed, process_wide)
    return InjectedFault(fault_id, kind, times)


@contextlib.contextmanager
def inject_fault(kind: str, *, src=None, dst=None, path: str = "direct", times: int = 1, seed=None, buffer=None,
                 process_wide: bool = False):
    """Within the block, the next ``times`` copies from ``src`` to ``dst`` (None: any device) along
    ``path`` ("direct" or "staged") made by this thread write wrong bytes of ``kind`` (see
    FAULT_KINDS) into the destination; with ``process_wide=True``, copies made by any thread.
    ``kind="skip_kernel"`` (path "direct"): the next ``times`` direct GPU copies leave out the kernel
    that hashes their destination (see the module docstring); no other copy is hit or counted.
    Zero-byte copies are not hit. A copy captured in a CUDA graph while the fault is armed carries
    it into every replay. Yields an InjectedFault; removed on exit.

    ``path="gather"``: the next ``times`` pyxfer.all_gather calls on rank ``dst`` (None: any rank)
    get wrong bytes of ``kind`` in the shard received from rank ``src`` (an int group rank; None:
    the lowest other rank), written into the receive buffer after the collective and before
    verification. ``buffer`` names the gathered buffer to hit ("data" for tensors, "rowwise_data",
    "columnwise_scale_inv", ...; None: the first non-empty one). A rank's own shard is a local
    copy, never hit; calls with no matching non-empty buffer are not counted.

    Raises ValueError for an unknown kind, path or device, a kernel fault on a path other than
    "direct", a negative rank, times < 1, or a process_wide that is not a bool; TypeError /
    ValueError for a seed that is not an int in [0, 2**64)."""
    fault = _push(kind, src, dst, path, times, seed, buffer, process_wide)
    try:
        yield fault
    finally:
        fault.remove()


ENV_FORM = "kind[,path=P][,src=D][,dst=D][,times=N]"  # the form PYXFER_INJECT_FAULT takes


def parse_env_fault(spec: str) -> dict:
    """The fault a PYXFER_INJECT_FAULT value names, as inject_fault's arguments {kind, path, src, dst,
    times}. Raises ValueError naming the variable, the expected form and the value (an unknown kind
    or key, a key given twice, a times that is not an integer >= 1)."""
    def bad(why):
        return ValueError(f"PYXFER_INJECT_FAULT: {why}; expected {ENV_FORM} with kind one of {FAULT_KINDS} "
                          f"(e.g. 'bitflip,dst=cuda:1,times=3'), got {spec!r}")

    kind, *items = [p.strip() for p in spec.split(",")]
    items = [i for i in items if i]  # a trailing comma is harmless
    if kind not in FAULT_KINDS:
        raise bad(f"unknown fault kind {kind!r}")
    fault = {"kind": kind, "path": "direct", "src": None, "dst": None, "times": 1}
    given = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in ("path", "src", "dst", "times"):
            raise bad(f"{item!r} is not one of path=, src=, dst=, times=")
        if key in given:  # which one was meant is a guess: refuse rather than let the last one win
            raise bad(f"{key}= is given twice ({given[key]!r}, {item!r})")
        given[key] = item
        if key == "times" or (key in ("src", "dst") and value.isdigit()):
            if not value.isdigit() or (key == "times" and int(value) < 1):
                raise bad(f"times must be an integer >= 1, got {value!r}")
            value = int(value)
        fault[key] = value
    return fault


def _install_from_env():
    """Install the fault named by $PYXFER_INJECT_FAULT. A malformed value never breaks ``import
    pyxfer``: it warns (RuntimeWarning, naming the variable and the expected form) and installs nothing."""
    spec = os.environ.get("PYXFER_INJECT_FAULT")
    if not spec:
        return None
    try:
        f = parse_env_fault(spec)
        return _push(f["kind"], f["src"], f["dst"], f["path"], f["times"], None,
                     process_wide=True)  # set before any thread of the program exists: every thread's copies
    except (ValueError, TypeError) as e:
        msg = str(e) if str(e).startswith("PYXFER_INJECT_FAULT") else f"PYXFER_INJECT_FAULT={spec!r}: {e}"
        warnings.warn(f"{msg}; no fault installed", RuntimeWarning, stacklevel=2)
        return None


# Gather-path faults live here, not in the native registry: pyxfer.all_gather corrupts its receive
# buffers in Python (_corrupt_gathered), after the collective and before verification.
_gather_faults = {}  # id -> dict(kind, src, dst, left, rng, buffer, thread: the arming thread's ident or None)
_next_gather_id = [1 << 40]
_gather_lock = threading.Lock()


def _rank_arg(op, name, value):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{op}: with path='gather', {name} must be a group rank (an int >= 0) or None, got {value!r}")
    return value


def _push_gather(op, kind, src, dst, times, seed, buffer, process_wide) -> InjectedFault:
    src, dst = _rank_arg(op, "src", src), _rank_arg(op, "dst", dst)
    thread = None if process_wide else threading.get_ident()
    with _gather_lock:
        fault_id = _next_gather_id[0]
        _next_gather_id[0] += 1
        _gather_faults[fault_id] = dict(kind=kind, src=src, dst=dst, left=times, rng=random.Random(seed),
                                        buffer=buffer, thread=thread)

    def pop(i):
        with _gather_lock:
            return _gather_faults.pop(i)["left"]

    return InjectedFault(fault_id, kind, times, pop=pop)


def _corrupt_gathered(rank, world, received):
    """Apply the active gather faults for receiving ``rank``. ``received``: (name, region, nbytes)
    per gathered buffer, ``region(r)`` the bytes received from rank r (a flat uint8 view)."""
    if not _gather_faults:
        return
    me = threading.get_ident()
    with _gather_lock:
        faults = list(_gather_faults.values())
    for fault in faults:
        if fault["dst"] not in (None, rank) or fault["thread"] not in (None, me):
            continue
        src = fault["src"] if fault["src"] is not None else (0 if rank != 0 else 1)
        if src == rank or src >= world:
            continue
        hit = [(n, t, b) for n, t, b in received if b and fault["buffer"] in (None, n)]
        if not hit:
            continue
        with _gather_lock:  # a process-wide fault is shared by threads: count each use once
            if fault["left"] <= 0:
                continue
            fault["left"] -= 1
        _corrupt(fault["kind"], hit[0][1](src), fault["rng"])


def _corrupt(kind, region, rng):
    """Write wrong bytes of ``kind`` into ``region`` (a flat uint8 tensor with at least one byte);
    always wrong: where the kind's bytes equal what the region held, one bit is flipped too."""
    before = region.clone()
    _corrupt_as(kind, region, rng)
    if torch.equal(region, before):
        region[:1].bitwise_xor_(1)


def _corrupt_as(kind, region, rng):
    n = region.numel()
    if kind == "zeros":
        region.zero_()
    elif kind == "bitflip":
        i = rng.randrange(n)
        region[i:i + 1].bitwise_xor_(1 << rng.randrange(8))
    elif kind == "stale":
        region.fill_(0xA5)
    elif kind == "truncate":
        region[n - max(1, n // 8):].zero_()
    else:  # shift: the bytes land k bytes late (the first k keep what they held)
        k = min(n - 1, rng.randrange(1, 8))
        if k:
            region[k:].copy_(region[:n - k].clone())
        else:
            region.bitwise_xor_(0xFF)
