"""Fault injection for tests and demos: make a copy path really write wrong bytes.

The fault is applied in the native layer, on the destination memory, by the copy itself (CPU and
GPU): "zeros" (a dropped write: the destination reads back as zeros), "bitflip" (one random bit),
"stale" (nothing arrives; the destination keeps what it held), "truncate" (the last eighth is
missing), "shift" (the data lands a few bytes off).

The environment variable PYXFER_INJECT_FAULT installs one fault when pyxfer is imported, e.g.
``PYXFER_INJECT_FAULT="bitflip,dst=cuda:1,times=3"`` (keys: path, src, dst, times; path defaults to
direct, src/dst to any device, times to 1).
"""
import contextlib
import os
import random

import torch

from ._devices import device_code

__all__ = ["FAULT_KINDS", "inject_fault", "InjectedFault"]

FAULT_KINDS = ("zeros", "bitflip", "stale", "truncate", "shift")


class InjectedFault:
    """Handle of an active fault; ``unused`` (set when the context exits) counts copies it did not hit."""

    def __init__(self, fault_id: int, kind: str, times: int):
        self.id, self.kind, self.times = fault_id, kind, times
        self.unused = None

    @property
    def used(self):
        return None if self.unused is None else self.times - self.unused

    def remove(self) -> int:
        if self.unused is None:
            self.unused = torch.ops.pyxfer.fault_pop(self.id)
        return self.unused


def _push(kind, src, dst, path, times, seed) -> InjectedFault:
    op = "pyxfer.testing.inject_fault"
    if kind not in FAULT_KINDS:
        raise ValueError(f"{op}: kind must be one of {FAULT_KINDS}, got {kind!r}")
    if path not in ("direct", "staged"):
        raise ValueError(f"{op}: path must be 'direct' or 'staged', got {path!r}")
    if isinstance(times, bool) or not isinstance(times, int) or times < 1:
        raise ValueError(f"{op}: times must be an int >= 1, got {times!r}")
    seed = random.getrandbits(62) if seed is None else int(seed)
    fault_id = torch.ops.pyxfer.fault_push(kind, device_code(op, "src", src), device_code(op, "dst", dst),
                                           path, times, seed)
    return InjectedFault(fault_id, kind, times)


@contextlib.contextmanager
def inject_fault(kind: str, *, src=None, dst=None, path: str = "direct", times: int = 1, seed=None):
    """Within the block, the next ``times`` copies from ``src`` to ``dst`` (None: any device) along
    ``path`` ("direct" or "staged") write wrong bytes of ``kind`` (see FAULT_KINDS) into the
    destination. Zero-byte copies are not hit. Yields an InjectedFault; removed on exit.
    Raises ValueError for an unknown kind, path or device, or times < 1."""
    fault = _push(kind, src, dst, path, times, seed)
    try:
        yield fault
    finally:
        fault.remove()


def _install_from_env():
    spec = os.environ.get("PYXFER_INJECT_FAULT")
    if not spec:
        return None
    kind, *items = [p.strip() for p in spec.split(",") if p.strip()]
    opts = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in ("path", "src", "dst", "times"):
            raise ValueError(f"PYXFER_INJECT_FAULT: expected kind[,path=..][,src=..][,dst=..][,times=N], got {spec!r}")
        opts[key] = int(value) if key == "times" else value
    return _push(kind, opts.get("src"), opts.get("dst"), opts.get("path", "direct"), opts.get("times", 1), None)
