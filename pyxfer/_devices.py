"""Device arguments as the native registries code them: -1 is the CPU, n is cuda:n, -2 is any."""
import torch

CPU_CODE = -1
ANY_CODE = -2


def as_device(op: str, name: str, device) -> torch.device:
    """torch.device from a torch.device, a string or a CUDA index; 'cuda' gets the current index."""
    if type(device) is torch.device and (device.type == "cpu" or (device.type == "cuda" and device.index is not None)):
        return device  # the common case, without parsing
    if isinstance(device, bool) or not isinstance(device, (torch.device, str, int)):
        raise TypeError(f"{op}: {name} must be a torch.device, a string or a CUDA index, got {type(device).__name__}")
    try:
        d = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"{op}: {name} is not a device: {device!r} ({e})") from None
    if d.type not in ("cpu", "cuda"):
        raise ValueError(f"{op}: {name} must be a CPU or CUDA device, got {d}")
    if d.type == "cuda" and d.index is None:
        if not torch.cuda.is_available():  # current_device() would raise torch's own error, naming nothing
            raise ValueError(f"{op}: {name} is {device!r}, the current CUDA device, but no CUDA device is visible "
                             f"(torch.cuda.is_available() is False)")
        d = torch.device("cuda", torch.cuda.current_device())
    return d


def device_code(op: str, name: str, device) -> int:
    """The registry code of a device; None means any device."""
    if device is None:
        return ANY_CODE
    d = as_device(op, name, device)
    return CPU_CODE if d.type == "cpu" else d.index


def device_name(code: int) -> str:
    return "cpu" if code == CPU_CODE else f"cuda:{code}"
