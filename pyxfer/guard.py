"""Device guards: run code on the device of its data.

ATen ops guard themselves with the device of their tensors, but custom kernels (C++ extensions,
Triton) launch on ``torch.cuda.current_device()`` and its current stream, and lazily created state
(``device="cuda"``) lands there too. With data on cuda:1 and the current device left at 0 (what
accelerate's ``device_map`` does) that is "CUDA error: an illegal memory access", or a silently
racy result. ``device_guard`` makes the data's device current for a block; ``on_device_of`` does
it around every call of a launch function.
"""
import collections.abc
import functools
import inspect
import threading

import torch

from ._devices import device_like

__all__ = ["device_guard", "on_device_of"]


def _cuda_devices(op: str, name: str, obj, found: dict, inside: bool = False) -> None:
    """Record in ``found`` (index -> where it came from) the CUDA devices of ``obj``: what
    pyxfer._devices.device_like counts (tensors, modules, devices, device strings, and a CUDA index
    unless ``inside`` a structure), None, and tuples/lists/mappings of those, where only the
    device-like elements count (a shape or a block size is no device index)."""
    devices = device_like(op, name, obj, inside=inside)
    if devices is not None:
        for d, where in devices:
            if d.type == "cuda":
                found.setdefault(d.index, where)
    elif obj is None:
        pass
    elif isinstance(obj, collections.abc.Mapping):
        for k, v in obj.items():
            _cuda_devices(op, f"{name}[{k!r}]", v, found, True)
    elif isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            _cuda_devices(op, f"{name}[{i}]", v, found, True)
    elif not inside:
        raise TypeError(f"{op}: {name} must be a tensor, module, device, CUDA index, None or a tuple/list/"
                        f"mapping of those, got {type(obj).__name__}")


def _the_device(op: str, found: dict):
    """The one CUDA index in ``found``, None if there is none; ValueError if there are several."""
    if not found:
        return None
    if len(found) > 1:
        where = ", ".join(f"{src} on cuda:{i}" for i, src in sorted(found.items()))
        raise ValueError(f"{op}: the CUDA arguments span {len(found)} devices ({where}); "
                         f"a launch runs on one device: move them to one first")
    return next(iter(found))


class device_guard:
    """``with pyxfer.device_guard(*objs):`` makes the CUDA device of ``objs`` the current device for
    the block, so that custom kernels (C++ extensions, Triton) launch there, on that device's
    current stream, and ``device="cuda"`` allocations land there. Restores on exit, also when the
    block raises, the device that was current when the block was entered: one guard object may be
    nested in itself, re-entered and shared by threads (the current device is per thread, and so is
    what the guard restores).

    ``objs``: tensors, modules (their parameters and buffers), torch.device / device strings ('cuda':
    the current CUDA device at construction) / CUDA indices (ints), None, and tuples, lists or
    mappings of those. Inside tuples, lists and mappings only tensors, modules, torch.device and
    device strings count: ints (shapes, sizes) and anything else are ignored there. CPU (and meta)
    data are ignored: with no CUDA argument at all the guard does nothing (and never initializes
    CUDA). ``as`` gives the CUDA device made current, or None. Mutates only the current CUDA device
    of the calling thread, for the block.

    Raises, at construction: ValueError when the CUDA arguments span several devices (naming them),
    for a CUDA device this process does not have (any, with a CPU-only torch), a negative index or a
    string argument that is not a device; TypeError for an argument of another kind.
    """

    __slots__ = ("index", "_saved")

    def __init__(self, *objs):
        found = {}
        for i, obj in enumerate(objs):
            _cuda_devices("pyxfer.device_guard", f"argument {i}", obj, found)
        self.index = _the_device("pyxfer.device_guard", found)
        self._saved = {}  # thread id -> the devices its open blocks replaced, innermost last

    @classmethod
    def of_index(cls, index):
        """The guard of CUDA device ``index`` (an int; None: a guard that does nothing), without
        inspecting arguments: for callers that know the device already."""
        self = cls.__new__(cls)
        self.index, self._saved = index, {}
        return self

    def __enter__(self):
        if self.index is None:
            return None
        prev = enter_index(self.index)
        # NOTE: a stack per thread, not one slot: `with g: with g:` and two threads inside the same g
        # each restore what their own enter replaced.
        self._saved.setdefault(threading.get_ident(), []).append(prev)
        return torch.device("cuda", self.index)

    def __exit__(self, *exc):
        if self.index is not None:
            thread = threading.get_ident()
            stack = self._saved[thread]
            prev = stack.pop()
            if not stack:
                del self._saved[thread]
            exit_index(prev)
        return False


def enter_index(index: int) -> int:
    """Make CUDA device ``index`` current; returns what ``exit_index`` restores. What device_guard's
    ``with`` does, without an object: for hooks that run per module call and keep the previous
    device themselves (pyxfer.integrations.accelerate)."""
    # NOTE: what torch.cuda.device does, without its argument parsing
    return torch.cuda._exchange_device(index)


def exit_index(prev: int) -> None:
    """Make current again the device that ``enter_index`` returned."""
    torch.cuda._maybe_exchange_device(prev)


def _call_on(index, fn, args, kwargs):
    """``fn(*args, **kwargs)`` with CUDA device ``index`` current (None: as it is)."""
    if index is None:
        return fn(*args, **kwargs)
    prev = enter_index(index)
    try:
        return fn(*args, **kwargs)
    finally:
        exit_index(prev)


def _first_cuda_tensor(args, kwargs):
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor):
            if v.device.type == "cuda":
                return v.device.index
        elif isinstance(v, (tuple, list)):
            for t in v:
                if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                    return t.device.index
    return None


def on_device_of(*names):
    """Decorator for launch functions: run each call inside :class:`device_guard` of some of its
    arguments.

    ``@pyxfer.on_device_of("x")`` (or several names) guards with the named arguments as the call
    binds them, defaults included (tensors, modules, devices, CUDA indices or structures of them,
    see device_guard). A ``*args`` or ``**kwargs`` parameter may be named: it stands for the
    arguments it collects, as a tuple or a dict (only their tensors, modules and devices count).
    ``@pyxfer.on_device_of`` or ``@pyxfer.on_device_of()`` uses the first CUDA tensor among the
    positional then keyword arguments (also looking one level into tuples/lists). The wrapped
    function's result and exceptions pass through unchanged.

    Raises TypeError at decoration time for a name that is not a string or not a parameter of the
    function, and at call time like device_guard (several devices, a CUDA device that does not
    exist, an argument of the wrong kind), before the function runs.
    """
    if len(names) == 1 and callable(names[0]) and not isinstance(names[0], str):
        return on_device_of()(names[0])  # bare @on_device_of
    for n in names:
        if not isinstance(n, str):
            raise TypeError(f"pyxfer.on_device_of: argument names must be strings, got {type(n).__name__}")

    def decorate(fn):
        if not names:
            @functools.wraps(fn)
            def first_cuda(*args, **kwargs):
                return _call_on(_first_cuda_tensor(args, kwargs), fn, args, kwargs)
            return first_cuda

        sig = inspect.signature(fn)
        params = list(sig.parameters.values())
        lookups = [_lookup(fn, sig, params, n) for n in names]
        op = f"pyxfer.on_device_of({fn.__qualname__})"

        @functools.wraps(fn)
        def named(*args, **kwargs):
            found = {}
            for n, value in lookups:
                _cuda_devices(op, n, value(args, kwargs), found)
            return _call_on(_the_device(op, found), fn, args, kwargs)
        return named

    return decorate


def _lookup(fn, sig, params, name):
    """(name, value(args, kwargs)): what parameter ``name`` of ``fn`` is bound to in a call."""
    p = sig.parameters.get(name)
    if p is None:
        listed = ", ".join("*" * (q.kind == q.VAR_POSITIONAL) + "**" * (q.kind == q.VAR_KEYWORD) + q.name
                           for q in params)
        raise TypeError(f"pyxfer.on_device_of: {fn.__qualname__} has no parameter named {name!r} "
                        f"(parameters: {listed or 'none'})")
    pos = params.index(p)
    if p.kind == p.VAR_POSITIONAL:
        return name, lambda args, kwargs: args[pos:]
    if p.kind == p.VAR_KEYWORD:
        named = {q.name for q in params if q.kind in (q.POSITIONAL_OR_KEYWORD, q.KEYWORD_ONLY)}
        return name, lambda args, kwargs: {k: v for k, v in kwargs.items() if k not in named}
    default = None if p.default is p.empty else p.default
    if p.kind == p.KEYWORD_ONLY:
        return name, lambda args, kwargs: kwargs.get(name, default)
    if p.kind == p.POSITIONAL_ONLY:
        return name, lambda args, kwargs: args[pos] if pos < len(args) else default
    return name, lambda args, kwargs: args[pos] if pos < len(args) else kwargs.get(name, default)
