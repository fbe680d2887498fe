"""Device arguments: parsed and checked once here, for every entry point (one error for one mistake),
and coded as the native registries code them: -1 is the CPU, n is cuda:n, -2 is any."""
import torch

CPU_CODE = -1
ANY_CODE = -2


# NOTE: torch.compile folds this to a constant instead of tracing torch.cuda.device_count() (Dynamo
# cannot put an int-returning torch call in a graph: fullgraph=True would fail in the compiler).
# The count is fixed for the process once CUDA is initialised, and pyxfer reads it at the first
# device check only.
@torch.compiler.assume_constant_result
def cuda_device_count() -> int:
    """CUDA devices this process sees (0 with a CPU-only torch), read once."""
    global _num_cuda_devices
    if _num_cuda_devices is None:
        _num_cuda_devices = torch.cuda.device_count()
    return _num_cuda_devices


_num_cuda_devices = None
_TORCH_HAS_CUDA = torch.backends.cuda.is_built()  # a constant for messages, read outside any trace


def _missing(op: str, name: str, device) -> ValueError:
    n = cuda_device_count()
    why = f"{n} CUDA devices visible" if _TORCH_HAS_CUDA else "torch was built without CUDA"
    return ValueError(f"{op}: {name} is {device}, which does not exist ({why}); expected 'cpu' or a CUDA device "
                      f"of this process")


def parse_device(op: str, name: str, device) -> torch.device:
    """The torch.device of a device argument of any device type: a torch.device, a string or a CUDA
    index (an int). 'cuda' without an index means the current CUDA device. A CUDA device must exist in
    this process. TypeError for another type; ValueError for a negative index, a string that is not a
    device, a CUDA device this process does not see ('cuda' without any CUDA device included)."""
    if isinstance(device, bool) or not isinstance(device, (torch.device, str, int)):
        raise TypeError(f"{op}: {name} must be a torch.device, a string or a CUDA index, got {type(device).__name__}")
    if isinstance(device, int) and device < 0:
        raise ValueError(f"{op}: {name} must be a CUDA index >= 0, got {device}")
    try:
        d = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"{op}: {name} is not a device: {device!r} ({e})") from None
    if d.type == "cuda":
        if d.index is None:
            if cuda_device_count() == 0:
                raise _missing(op, name, d)
            d = torch.device("cuda", torch.cuda.current_device())
        elif d.index >= cuda_device_count():
            raise _missing(op, name, d)
    return d


def as_device(op: str, name: str, device) -> torch.device:
    """The torch.device of a device argument (see :func:`parse_device`) that must be the CPU or a
    CUDA device that exists: TypeError for another type, ValueError for anything else (unparsable,
    another device type, a CUDA device this process does not see, 'cuda' without any CUDA device)."""
    if type(device) is torch.device and (device.type == "cpu" or (
            device.type == "cuda" and device.index is not None and device.index < cuda_device_count())):
        return device  # the common cases, without parsing
    d = parse_device(op, name, device)
    if d.type not in ("cpu", "cuda"):
        raise ValueError(f"{op}: {name} must be a CPU or CUDA device, got {d}")
    return d


def device_like(op: str, name: str, obj, *, inside: bool = False):
    """The devices that ``obj`` stands for, as (torch.device, where) pairs, or None when ``obj`` is
    not device-like. ``where`` is ``name``, or ``name.<parameter>`` for a module's parameter or buffer.

    Device-like: a tensor (its device; never checked: it exists), a module (the devices of its
    parameters and buffers, lazily), a torch.device or a device string (parsed by
    :func:`parse_device`: 'cuda' is the current CUDA device, a CUDA device must exist), and a CUDA
    index (an int) unless ``inside``. ``inside``: ``obj`` is an element of a structure (shapes,
    block sizes, flags and names sit there beside the tensors): ints never count and a string that is
    not a device is not device-like; otherwise such a string is a ValueError. Bools never count.

    Raises ValueError for a device that does not exist (or a negative index, or a string that is
    not a device when not ``inside``); never TypeError (None says "not device-like")."""
    if isinstance(obj, torch.Tensor):
        return ((obj.device, name),)
    if isinstance(obj, torch.nn.Module):
        return _module_devices(name, obj)
    if isinstance(obj, str) and inside:
        try:
            torch.device(obj)
        except RuntimeError:
            return None  # a name, a mode: not a device
    elif isinstance(obj, bool) or not isinstance(obj, (torch.device, str, int)) or (inside and isinstance(obj, int)):
        return None
    return ((parse_device(op, name, obj), name),)


def _module_devices(name, module):
    for pname, t in module.named_parameters():
        yield t.device, f"{name}.{pname}"
    for bname, t in module.named_buffers():
        yield t.device, f"{name}.{bname}"


def device_code(op: str, name: str, device) -> int:
    """The registry code of a device argument (checked by :func:`as_device`); None means any device."""
    if device is None:
        return ANY_CODE
    d = as_device(op, name, device)
    return CPU_CODE if d.type == "cpu" else d.index


def device_name(code: int) -> str:
    return "cpu" if code == CPU_CODE else f"cuda:{code}"
