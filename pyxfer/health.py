"""Per ordered device pair health, shared with the native transfer path (thread-safe there).

A pair is "unknown" until a verified direct copy between its devices succeeds ("healthy") or one is
caught writing wrong bytes ("corrupt"). route="auto" sends copies of a corrupt pair staged.

Health is per process, shared by every thread: a pair is a physical link, so a corrupt verdict found
by one thread's copy routes every thread's copies of that pair (unlike injected faults, which hit the
arming thread's copies, and deferred mismatches, which are reported to the copying thread).

load_doctor_verdicts() (or $PYXFER_HEALTH_FROM_DOCTOR=1 at import) marks the pairs `pyxfer doctor`
found bad as corrupt, so they route staged from a process's first copy. The cache is read by
pyxfer.tools.verdict_cache, imported only then.
"""
import os
import warnings

import torch

from ._devices import device_code

__all__ = ["STATES", "status", "mark", "reset", "load_doctor_verdicts"]

STATES = ("unknown", "healthy", "corrupt")
HEALTH_ENV = "PYXFER_HEALTH_FROM_DOCTOR"  # "1" (or a cache's path): load the doctor's verdicts when pyxfer is imported
BAD_VERDICTS = ("corrupt", "dropped", "hung")  # copies of these pairs route staged once loaded


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


def load_doctor_verdicts(path=None) -> dict:
    """Apply the verdicts cached by `pyxfer doctor` (pyxfer.tools.verdict_cache) to this process's
    health: a pair found ``corrupt``, ``dropped`` or ``hung`` is marked "corrupt" (route="auto"
    sends its copies staged from the first copy), an ``ok`` pair "healthy"; ``slow``,
    ``unsupported`` and ``error`` are left alone (the data was right or the path is not direct).

    ``path``: the cache file (default: $PYXFER_DOCTOR_CACHE, else ~/.cache/pyxfer/doctor-verdicts.json).
    Returns {(src, dst): verdict} of the pairs applied, devices as "cpu" / "cuda:N" of this process;
    {} when there is no cache, when it was made under another key or when it is not a verdict cache
    (a RuntimeWarning says why; nothing of it is applied). Mutates pyxfer.health; raises nothing for
    a bad cache."""
    from .tools.verdict_cache import cached_verdicts
    applied = {}
    for (src, dst), verdict in cached_verdicts(path, stacklevel=3).items():
        if verdict in BAD_VERDICTS:
            mark(src, dst, "corrupt")
        elif verdict == "ok":
            mark(src, dst, "healthy")
        else:
            continue
        applied[(src, dst)] = verdict
    return applied


def env_problem(value):
    """Why ``value`` of $PYXFER_HEALTH_FROM_DOCTOR loads no verdicts although it is set, or None: a
    value that is neither "0", "1" nor the path of a file, or "1" without a cache at the cache's path."""
    if value in ("", "0"):
        return None
    from .tools.verdict_cache import cache_path
    if value == "1":
        if os.path.isfile(cache_path()):
            return None
        return f"{HEALTH_ENV}=1: there is no verdict cache at {cache_path()} (run `pyxfer doctor`)"
    if os.path.isfile(value):
        return None
    return (f"{HEALTH_ENV}={value!r}: expected 1 (the cache at {cache_path()}), 0, or the path of a verdict cache "
            f"file, and there is no file {value!r}")


def load_from_env() -> dict:
    """load_doctor_verdicts() when $PYXFER_HEALTH_FROM_DOCTOR is set ("1", or the cache's path); what
    ``import pyxfer`` runs. A value that loads nothing (env_problem) warns (RuntimeWarning) and loads
    nothing; raises nothing."""
    value = os.environ.get(HEALTH_ENV, "")
    if value in ("", "0"):
        return {}  # NOTE: the common case imports nothing of the tools
    problem = env_problem(value)
    if problem:
        warnings.warn(f"pyxfer: {problem}: no doctor verdicts loaded", RuntimeWarning, stacklevel=2)
        return {}
    return load_doctor_verdicts(None if value == "1" else value)
