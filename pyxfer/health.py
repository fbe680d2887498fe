"""Per ordered device pair health, shared with the native transfer path (thread-safe there).

A pair is "unknown" until a verified direct copy between its devices succeeds ("healthy") or one is
caught writing wrong bytes ("corrupt"). route="auto" sends copies of a corrupt pair staged.

Health is per process, shared by every thread: a pair is a physical link, so a corrupt verdict found
by one thread's copy routes every thread's copies of that pair (unlike injected faults, which hit the
arming thread's copies, and deferred mismatches, which are reported to the copying thread).

load_doctor_verdicts() (or $PYXFER_HEALTH_FROM_DOCTOR=1 at import) marks the pairs `pyxfer doctor`
found bad as corrupt, so they route staged from a process's first copy (see pyxfer._verdict_cache).
"""
import torch

from ._devices import device_code
from ._verdict_cache import load_doctor_verdicts

__all__ = ["STATES", "status", "mark", "reset", "load_doctor_verdicts"]

STATES = ("unknown", "healthy", "corrupt")


def status(src, dst) -> str:
    """State of copies from ``src`` to ``dst`` (devices, strings or CUDA indices): one of STATES."""
    return STATES[torch.ops.pyxfer.health_status(device_code("pyxfer.health.status", "src", src),
                                                 device_code("pyxfer.health.status", "dst", dst))]


def mark(src, dst, state: str) -> None:
    """Set the state of the ordered pair (src, dst). Raises ValueError for an unknown state."""
    if state not in STATES:
        raise ValueError(f"pyxfer.health.mark: state must be one of {STATES}, got {state!r}")
    torch.ops.pyxfer.health_mark(device_code("pyxfer.health.mark", "src", src),
                                 device_code("pyxfer.health.mark", "dst", dst), STATES.index(state))


def reset() -> None:
    """Forget every pair's state (all become "unknown")."""
    torch.ops.pyxfer.health_reset()
