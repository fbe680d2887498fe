"""Verified moves of nested structures, with the semantics of accelerate's ``send_to_device``.

``send_to_device`` (accelerate.utils.operations) is what accelerate's hooks use to move a module's
inputs and outputs; ``verified_send`` keeps its behaviour case for case and only replaces the copy
of plain dense tensors between different CPU/CUDA devices by ``pyxfer.verified_copy``.
"""
import collections.abc

import torch

from ._checks import check_bool
from ._devices import parse_device
from .transfer import ROUTES, VERIFY_MODES, verified_copy

__all__ = ["verified_send", "sender"]


class _Move:
    """One verified_send call's settings, passed down the recursion."""

    __slots__ = ("device", "_target", "non_blocking", "skip_keys", "verify", "route", "include_cpu", "rebuild")

    def __init__(self, device, non_blocking, skip_keys, verify, route, include_cpu, rebuild):
        self.device, self._target, self.non_blocking = device, _UNRESOLVED, non_blocking
        self.skip_keys, self.verify, self.route, self.include_cpu = skip_keys, verify, route, include_cpu
        self.rebuild = rebuild

    @property
    def target(self):
        # Resolved at the first tensor: "cuda" means the current device then, and data without
        # tensors never touches CUDA.
        if self._target is _UNRESOLVED:
            self._target = _target(self.device)
        return self._target


_UNRESOLVED = object()
# Leaves send_to_device returns as they are (none has a .to): checked by exact type, first.
_ATOMS = frozenset({type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device})
_CPU_CUDA = ("cpu", "cuda")


def _target(device):
    """The torch.device that ``Tensor.to(device)`` moves to, when it is a CPU or CUDA device (else
    None: such moves are left to ``.to``). An int is a CUDA index, as in accelerate's hooks; 'cuda'
    is the current device (what Tensor.to("cuda") means); a CUDA device that does not exist is
    pyxfer's ValueError (pyxfer._devices.parse_device)."""
    if isinstance(device, str):
        try:
            torch.device(device)
        except RuntimeError:
            return None  # not a device string: .to decides what it means
    elif isinstance(device, bool) or not isinstance(device, (torch.device, int)):
        return None  # a dtype, None: passed on to .to
    d = parse_device("pyxfer.nested.verified_send", "device", device)
    return d if d.type in _CPU_CUDA else None


def _dense_order(t: torch.Tensor):
    """The dimension order in which ``t`` is contiguous, for a non-contiguous tensor that is dense
    and non-overlapping (``Tensor.to`` keeps such strides); None otherwise."""
    if t.is_contiguous():
        return None
    perm = sorted(range(t.dim()), key=lambda d: (-t.stride(d), -t.size(d)))
    return perm if t.permute(perm).is_contiguous() else None


def _verified(t: torch.Tensor, m: _Move) -> torch.Tensor:
    perm = _dense_order(t)
    if perm is None:
        return verified_copy(t, m.target, route=m.route, verify=m.verify)
    # Copy the dense bytes as they lie and give the result the source's strides, like Tensor.to.
    out = verified_copy(t.permute(perm), m.target, route=m.route, verify=m.verify)
    inverse = [0] * len(perm)
    for i, d in enumerate(perm):
        inverse[d] = i
    return out.permute(inverse)


def _to(obj, m: _Move):
    m.target  # noqa: B018 (resolved first: a CUDA device that does not exist is pyxfer's ValueError, not .to's error)
    try:
        return obj.to(m.device, non_blocking=m.non_blocking)
    except TypeError:  # a .to() without non_blocking (as accelerate retries)
        return obj.to(m.device)


def _tensor(obj: torch.Tensor, m: _Move):
    target = m.target
    if target is not None:
        d = obj.device
        if d == target:
            return obj  # what .to() returns for a plain tensor already there, without the call
        if obj.layout == torch.strided and not obj.is_nested and (
                (d.type == "cuda" and target.type == "cuda") or (m.include_cpu and d.type in _CPU_CUDA)):
            return _verified(obj, m)
    return _to(obj, m)


def _settled(values, target) -> bool:
    """Whether send_to_device would leave every value as it is: atoms, plain tensors already on
    ``target``, tuples/lists of those, and objects it returns as they are (no ``.to``, not a
    tensor, sequence or mapping: a KV cache under a key not skipped, a config). The common case of
    a hooked call, checked without rebuilding anything."""
    for v in values:
        t = type(v)
        if t in _ATOMS:
            continue
        if t is torch.Tensor:
            if target is not None and v.device == target:
                continue
            return False
        if t is tuple or t is list:
            if _settled(v, target):
                continue
            return False
        if isinstance(v, (torch.Tensor, tuple, list, collections.abc.Mapping)) or hasattr(v, "to"):
            return False
    return True


def _send(obj, m: _Move):
    # NOTE: runs for every argument of every hooked block call: exact types first (plain tensors,
    # atoms, tuple/list/dict), then send_to_device's own order of checks for everything else
    # (tensor or .to, tuple/list, Mapping, anything else).
    t = type(obj)
    if t is torch.Tensor:
        return _tensor(obj, m)
    if t in _ATOMS:
        return obj
    if t is dict:
        skip = m.skip_keys
        if not m.rebuild and _settled(obj.values() if skip.isdisjoint(obj) else
                                      [v for k, v in obj.items() if k not in skip], m.target):
            return obj
        return {k: v if k in skip else _send(v, m) for k, v in obj.items()}
    if t is tuple or t is list:
        if not m.rebuild and _settled(obj, m.target):
            return obj
        # NOTE: rebuilt at every level (send_to_device's new containers): t(obj) would return a tuple
        # itself and share the inner lists with the input
        return t([_send(v, m) for v in obj])
    if isinstance(obj, torch.Tensor) or hasattr(obj, "to"):
        return _to(obj, m)  # tensor subclasses, BatchEncoding-like objects: their own .to
    if isinstance(obj, (tuple, list)):
        items = [_send(v, m) for v in obj]
        if isinstance(obj, tuple) and hasattr(obj, "_asdict") and hasattr(obj, "_fields"):  # namedtuple
            return t(*items)
        return t(items)
    if isinstance(obj, collections.abc.Mapping):
        skip = m.skip_keys
        return t({k: v if k in skip else _send(v, m) for k, v in obj.items()})
    return obj


def _check_options(op, verify, route, skip_keys) -> frozenset:
    if verify not in VERIFY_MODES:
        raise ValueError(f"{op}: verify must be one of {VERIFY_MODES}, got {verify!r}")
    if route is not None and route not in ROUTES:
        raise ValueError(f"{op}: route must be one of {ROUTES} or None, got {route!r}")
    if isinstance(skip_keys, str):
        return frozenset([skip_keys])
    if skip_keys is None:
        return frozenset()
    if not isinstance(skip_keys, (list, tuple, set, frozenset)):
        raise TypeError(f"{op}: skip_keys must be a key, a list of keys or None, got {type(skip_keys).__name__}")
    try:
        return frozenset(skip_keys)
    except TypeError:  # a key that no mapping can hold (a list): named, not "unhashable type"
        bad = next(k for k in skip_keys if not _hashable(k))
        raise TypeError(f"{op}: skip_keys must be a key, a list of keys or None; its element {bad!r} "
                        f"({type(bad).__name__}) cannot be a mapping key") from None


def _hashable(key) -> bool:
    try:
        hash(key)
    except TypeError:
        return False
    return True


def verified_send(data, device, *, non_blocking: bool = False, skip_keys=None, verify: str = "sync",
                  route=None, include_cpu: bool = False):
    """Move the tensors in ``data`` to ``device`` like accelerate's ``send_to_device``, with verified
    copies between devices.

    Structure, exactly as ``send_to_device``: tensors and anything with a ``.to`` (e.g.
    ``BatchEncoding``, tensor subclasses) are moved; tuples and lists are rebuilt with their type
    (namedtuples through their fields); mappings are rebuilt as ``type(m)({...})`` with the values
    of keys in ``skip_keys`` (a key or a list of keys, applied at every level) left untouched; None
    and any other object are returned as they are. A tensor already on ``device`` comes back as the
    same object.

    Copies: a plain ``torch.Tensor`` (not a subclass), dense and strided, moving between two
    different CUDA devices, or between the CPU and a CUDA device when ``include_cpu`` is true, goes
    through ``pyxfer.verified_copy(t, device, route=route, verify=verify)``: same dtype, shape,
    values and (for dense non-overlapping tensors) strides as ``t.to(device)``, differentiable.
    Everything else goes through ``.to(device, non_blocking=non_blocking)``.

    ``device``: a torch.device, a string or a CUDA index (as accelerate's hooks pass it).
    ``verify``: "sync", "deferred" (mismatches raised by pyxfer.check_transfers()) or "none".
    ``route``: see verified_copy. Mutates nothing; returns new containers.

    Raises pyxfer.TransferError when a copy arrived wrong on both paths; ValueError for a bad
    ``verify`` / ``route`` or a CUDA device that does not exist; TypeError for bad ``skip_keys`` or a
    ``non_blocking`` / ``include_cpu`` that is not a bool. Options are checked before anything moves.
    """
    return sender(device, non_blocking=non_blocking, skip_keys=skip_keys, verify=verify, route=route,
                  include_cpu=include_cpu)(data)


def sender(device, *, non_blocking: bool = False, skip_keys=None, verify: str = "sync", route=None,
           include_cpu: bool = False, rebuild: bool = True, op: str = "pyxfer.nested.verified_send"):
    """``verified_send`` with its options checked once: returns ``send(data)`` (for hooks that move
    the inputs of every call to the same device). ``rebuild=False``: a tuple, list or mapping whose
    elements all came back as they were is returned itself instead of a rebuilt copy (for callers
    that rebuild anyway, like accelerate's hooks after pyxfer's; saves the allocations). ``op``: the
    function that bad options are reported against (the caller's public entry point). Raises like
    verified_send."""
    keys = _check_options(op, verify, route, skip_keys)
    for name, value in (("non_blocking", non_blocking), ("include_cpu", include_cpu), ("rebuild", rebuild)):
        check_bool(op, name, value)
    m = _Move(device, non_blocking, keys, verify, route, include_cpu, rebuild)
    return lambda data: _send(data, m)
