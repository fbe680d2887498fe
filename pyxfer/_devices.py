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


def as_device(op: str, name: str, device) -> torch.device:
    """The torch.device of a device argument: a torch.device, a string or a CUDA index; 'cuda'
    without an index means the current CUDA device. Only CPU and CUDA devices that exist pass:
    TypeError for another type, ValueError for anything else (unparsable, another device type, a
    CUDA device this process does not see, 'cuda' without any CUDA device)."""
    if type(device) is torch.device and (device.type == "cpu" or (
            device.type == "cuda" and device.index is not None and device.index < cuda_device_count())):
        return device  # the common cases, without parsing
    if isinstance(device, bool) or not isinstance(device, (torch.device, str, int)):
        raise TypeError(f"{op}: {name} must be a torch.device, a string or a CUDA index, got {type(device).__name__}")
    if isinstance(device, int) and device < 0:
        raise ValueError(f"{op}: {name} must be a CUDA index >= 0, got {device}")
    try:
        d = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"{op}: {name} is not a device: {device!r} ({e})") from None
    if d.type not in ("cpu", "cuda"):
        raise ValueError(f"{op}: {name} must be a CPU or CUDA device, got {d}")
    if d.type == "cuda":
        if d.index is None:
            if cuda_device_count() == 0:
                raise _missing(op, name, d)
            d = torch.device("cuda", torch.cuda.current_device())
        elif d.index >= cuda_device_count():
            raise _missing(op, name, d)
    return d


def device_code(op: str, name: str, device) -> int:
    """The registry code of a device argument (checked by :func:`as_device`); None means any device."""
    if device is None:
        return ANY_CODE
    d = as_device(op, name, device)
    return CPU_CODE if d.type == "cpu" else d.index


def device_name(code: int) -> str:
    return "cpu" if code == CPU_CODE else f"cuda:{code}"
