"""Argument checks shared by every entry point, so one mistake gets one error type and one message.

Each message names the operation, the argument, what was expected and what came. ``check_tensor``
is the rule for tensor arguments of the Python API; the same rule is registered as the kernel of
every ``torch.ops.pyxfer`` op for the tensor kinds pyxfer has no kernels for (quantized, sparse,
nested), so a direct op call gets that message too instead of the dispatcher's table of backends.
"""
import numbers

import torch

from . import _C  # noqa: F401  (registers torch.ops.pyxfer.*)

__all__ = ["check_tensor", "check_int", "check_seed", "check_bool", "check_real", "check_sequence"]


def check_tensor(op: str, name: str, t) -> None:
    """Raise unless ``t`` is a dense, strided, non-quantized tensor with data (not on meta).

    TypeError for a non-tensor; ValueError for a nested, sparse, quantized or meta tensor.
    Quantized tensors (``torch.quantize_per_tensor`` & co.) are rejected rather than moved or hashed
    as their integer bytes: their scale and zero point live in a quantizer that pyxfer's byte-level
    ops would drop, returning a tensor that is not what was given.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.is_nested:
        raise ValueError(f"{op}: {name} must be a dense tensor, got a nested tensor")
    if t.layout != torch.strided:
        raise ValueError(f"{op}: {name} must be a dense strided tensor, got layout {t.layout}")
    if t.is_quantized:
        raise ValueError(f"{op}: {name} must be a non-quantized tensor, got a quantized {t.dtype} tensor "
                         f"({t.qscheme()}); pyxfer does not carry torch's quantizer (scale, zero point): "
                         f"pass {name}.int_repr() and keep q_scale()/q_zero_point() alongside")
    if t.device.type == "meta":
        raise ValueError(f"{op}: {name} is on the meta device and has no data to read")


def check_int(op: str, name: str, value, *, minimum=None) -> int:
    """``value`` if it is an int (not a bool; numpy integers too) >= ``minimum``, as a Python int.
    TypeError for another type (floats are not truncated), ValueError below ``minimum``. A SymInt
    (a size while tracing, e.g. in a fake kernel) passes as it is: its value is the trace's."""
    if isinstance(value, torch.SymInt):
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{op}: {name} must be an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{op}: {name} must be an int >= {minimum}, got {value}")
    return value


def check_seed(op: str, seed) -> int:
    """A uint64 seed (an int in [0, 2**64)) as the int64 with its bits, which op schemas carry.
    TypeError for a non-int, ValueError out of range."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"{op}: seed must be an int in [0, 2**64), got {type(seed).__name__} {seed!r}")
    seed = int(seed)
    if not 0 <= seed < 1 << 64:
        raise ValueError(f"{op}: seed must be in [0, 2**64), got {seed}")
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def check_bool(op: str, name: str, value) -> bool:
    """``value`` if it is a bool; TypeError otherwise (no truthiness: "yes" and 1 are mistakes)."""
    if not isinstance(value, bool):
        raise TypeError(f"{op}: {name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def check_real(op: str, name: str, value) -> float:
    """``value`` as a Python float if it is a real number (int, float, numpy scalar of any width;
    not a bool). TypeError otherwise. Range checks are the caller's."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{op}: {name} must be a real number, got {type(value).__name__} {value!r}")
    return float(value)


def check_sequence(op: str, name: str, value, what: str) -> list:
    """``value`` as a list if it is an iterable of ``what`` (a tensor, string or mapping is not:
    iterating those gives rows, characters or keys, never what the caller meant)."""
    if isinstance(value, (torch.Tensor, str, bytes, dict)) or not hasattr(value, "__iter__"):
        raise TypeError(f"{op}: {name} must be a list or other iterable of {what}, got {type(value).__name__}")
    return list(value)


# ---- the same rule as kernels of torch.ops.pyxfer.* for tensor kinds pyxfer does not implement
# (AutogradNestedTensor too: an op that mutates an argument has no autograd fallthrough for nested tensors,
# which would meet a NotImplementedError there before reaching NestedTensorCPU)
_UNSUPPORTED_KEYS = ("QuantizedCPU", "QuantizedCUDA", "SparseCPU", "SparseCUDA", "SparseCsrCPU", "SparseCsrCUDA",
                     "NestedTensorCPU", "NestedTensorCUDA", "AutogradNestedTensor")


def _rejecting_kernel(op_name: str, tensor_args: tuple):
    """A kernel that raises check_tensor's error for the first bad one of ``tensor_args``
    ((position, name) pairs of the schema's tensor arguments)."""
    def kernel(*args, **kwargs):
        for i, name in tensor_args:
            value = args[i] if i < len(args) else kwargs.get(name)
            if value is not None:
                check_tensor(f"torch.ops.pyxfer.{op_name}", name, value)
        raise AssertionError(f"torch.ops.pyxfer.{op_name}: dispatched to a rejecting kernel with no bad argument")
    return kernel


def _register_rejecting_kernels() -> torch.library.Library:
    lib = torch.library.Library("pyxfer", "IMPL")
    for qualified in sorted(torch._C._dispatch_get_all_op_names()):
        if not qualified.startswith("pyxfer::"):
            continue
        name = qualified.split("::", 1)[1]
        schema = getattr(torch.ops.pyxfer, name).default._schema
        tensor_args = tuple((i, a.name) for i, a in enumerate(schema.arguments) if isinstance(a.type, torch.TensorType))
        if tensor_args:
            for key in _UNSUPPORTED_KEYS:
                lib.impl(name, _rejecting_kernel(name, tensor_args), key)
    return lib


_rejecting_library = _register_rejecting_kernels()  # kept alive: dropping a Library deregisters its kernels
