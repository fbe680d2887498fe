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

import torch

__all__ = ["device_guard", "on_device_of"]


def _cuda_index(op: str, name: str, obj, found: dict) -> None:
    """Record in ``found`` (index -> where it came from) the CUDA devices of ``obj``: a tensor, a
    module (its parameters and buffers), a torch.device, a device string or CUDA index, None, or
    tuples/lists/mappings of those."""
    if isinstance(obj, torch.Tensor):
        d = obj.device
        if d.type == "cuda":
            found.setdefault(d.index, name)
    elif isinstance(obj, torch.nn.Module):
        for pname, t in _module_tensors(obj):
            if t.device.type == "cuda":
                found.setdefault(t.device.index, f"{name}.{pname}")
    elif isinstance(obj, (torch.device, str)):
        try:
            d = torch.device(obj)
        except RuntimeError:
            raise ValueError(f"{op}: {name} is not a device: {obj!r}") from None
        if d.type == "cuda":
            found.setdefault(torch.cuda.current_device() if d.index is None else d.index, name)
    elif isinstance(obj, int) and not isinstance(obj, bool):
        if obj < 0:
            raise ValueError(f"{op}: {name} must be a CUDA index >= 0, got {obj}")
        found.setdefault(obj, name)
    elif obj is None:
        pass
    elif isinstance(obj, collections.abc.Mapping):
        for k, v in obj.items():
            _cuda_index(op, f"{name}[{k!r}]", v, found)
    elif isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            _cuda_index(op, f"{name}[{i}]", v, found)
    else:
        raise TypeError(f"{op}: {name} must be a tensor, module, device, CUDA index, None or a tuple/list/"
                        f"mapping of those, got {type(obj).__name__}")


def _module_tensors(module):
    yield from module.named_parameters()
    yield from module.named_buffers()


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
    current stream, and ``device="cuda"`` allocations land there. Restores the previous current
    device on exit, also when the block raises; nests and re-enters.

    ``objs``: tensors, modules (their parameters and buffers), torch.device / strings / CUDA
    indices, None, and tuples, lists or mappings of those. CPU (and meta) data are ignored: with no
    CUDA argument at all the guard does nothing (and never initializes CUDA). ``as`` gives the CUDA
    device made current, or None. Mutates only the current CUDA device, for the block.

    Raises ValueError when the CUDA arguments span several devices (naming them), TypeError for an
    argument of another kind.
    """

    __slots__ = ("index", "_prev")

    def __init__(self, *objs):
        found = {}
        for i, obj in enumerate(objs):
            _cuda_index("pyxfer.device_guard", f"argument {i}", obj, found)
        self.index = _the_device("pyxfer.device_guard", found)
        self._prev = None

    @classmethod
    def of_index(cls, index):
        """The guard of CUDA device ``index`` (an int; None: a guard that does nothing), without
        inspecting arguments: for callers that know the device already."""
        self = cls.__new__(cls)
        self.index, self._prev = index, None
        return self

    def __enter__(self):
        if self.index is None:
            return None
        self._prev = enter_index(self.index)
        return torch.device("cuda", self.index)

    def __exit__(self, *exc):
        if self.index is not None:
            exit_index(self._prev)
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

    ``@pyxfer.on_device_of("x")`` (or several names) guards with the named arguments (tensors,
    modules, devices or structures of them, see device_guard); ``@pyxfer.on_device_of`` or
    ``@pyxfer.on_device_of()`` uses the first CUDA tensor among the positional then keyword
    arguments (also looking one level into tuples/lists). The wrapped function's result and
    exceptions pass through unchanged.

    Raises TypeError at decoration time for a name that is not a parameter of the function, and at
    call time like device_guard (several devices, an argument of the wrong kind).
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
                with device_guard.of_index(_first_cuda_tensor(args, kwargs)):
                    return fn(*args, **kwargs)
            return first_cuda

        sig = inspect.signature(fn)
        params = list(sig.parameters.values())
        lookups = []  # (name, positional index or None, default)
        for n in names:
            p = sig.parameters.get(n)
            if p is None or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise TypeError(f"pyxfer.on_device_of: {fn.__qualname__} has no parameter named {n!r} "
                                f"(parameters: {', '.join(sig.parameters)})")
            pos = params.index(p) if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) else None
            lookups.append((n, pos, None if p.default is p.empty else p.default))
        op = f"pyxfer.on_device_of({fn.__qualname__})"

        @functools.wraps(fn)
        def named(*args, **kwargs):
            found = {}
            for n, pos, default in lookups:
                value = args[pos] if pos is not None and pos < len(args) else kwargs.get(n, default)
                _cuda_index(op, n, value, found)
            with device_guard.of_index(_the_device(op, found)):
                return fn(*args, **kwargs)
        return named

    return decorate
