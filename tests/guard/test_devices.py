"""pyxfer._devices, the one device parser: what counts as a device (device_like, for device guards),
devices of any type (parse_device), and CUDA devices that do not exist as pyxfer's ValueError naming
the function and the argument, for device_guard and verified_send alike. Real devices only: CUDA
devices are this process's own (none with a CPU-only torch); support.tensors.cuda_tensor (no data)
stands for CUDA data."""
import pytest
import torch

from pyxfer._devices import device_like, parse_device
from pyxfer.nested import verified_send

from support.tensors import cuda_tensor


def num_gpus():
    return torch.cuda.device_count() if torch.cuda.is_available() else 0



class Moves:
    """An object with its own .to (like BatchEncoding)."""

    def to(self, device, non_blocking=False):
        raise AssertionError(f".to({device!r}) must not be reached")


def test_parse_device_takes_any_device_type_and_checks_cuda():
    assert parse_device("op", "d", "meta") == torch.device("meta")
    assert parse_device("op", "d", torch.device("cpu")) == torch.device("cpu")
    assert parse_device("op", "d", "mps") == torch.device("mps")  # parsed; whether it runs is .to's business
    n = num_gpus()
    if n:
        assert parse_device("op", "d", n - 1) == torch.device("cuda", n - 1)
    with pytest.raises(ValueError, match=f"op: d is cuda:{n}, which does not exist"):
        parse_device("op", "d", f"cuda:{n}")
    with pytest.raises(ValueError, match=f"op: d is cuda:{n}, which does not exist"):
        parse_device("op", "d", n)
    with pytest.raises(ValueError, match="op: d is not a device: 'gpu7'"):
        parse_device("op", "d", "gpu7")
    with pytest.raises(ValueError, match="op: d must be a CUDA index >= 0, got -2"):
        parse_device("op", "d", -2)
    for bad in (True, 1.0, None, [0]):
        with pytest.raises(TypeError, match="op: d must be a torch.device, a string or a CUDA index, got"):
            parse_device("op", "d", bad)


def test_device_like_says_what_is_a_device(gen):
    x = torch.randn(3, generator=gen)
    c1 = cuda_tensor(2, index=1)
    assert device_like("op", "a", x) == ((torch.device("cpu"), "a"),)
    assert device_like("op", "a", c1, inside=True) == ((torch.device("cuda", 1), "a"),)  # a tensor is never checked
    assert device_like("op", "a", "meta", inside=True) == ((torch.device("meta"), "a"),)
    assert device_like("op", "a", torch.device("cpu")) == ((torch.device("cpu"), "a"),)
    module = torch.nn.Linear(2, 3, device="meta")
    module.register_buffer("scale", c1)
    meta = torch.device("meta")
    assert list(device_like("op", "m", module)) == [(meta, "m.weight"), (meta, "m.bias"), (c1.device, "m.scale")]
    # Not device-like: other types anywhere; ints, bools and strings that are not devices inside structures.
    for obj in (None, 1.5, object(), (x,), [x], {"x": x}, True):
        assert device_like("op", "a", obj) is None and device_like("op", "a", obj, inside=True) is None, obj
    for obj in (0, 1024, -1, "fast", "gpu7", ""):
        assert device_like("op", "a", obj, inside=True) is None, obj
    # A device that is named must exist, inside a structure or not; ints and strings given as devices must parse.
    n = num_gpus()
    for obj, inside in ((f"cuda:{n}", True), (torch.device("cuda", n), True), (n, False), (f"cuda:{n}", False)):
        with pytest.raises(ValueError, match=f"op: a is cuda:{n}, which does not exist"):
            device_like("op", "a", obj, inside=inside)
    with pytest.raises(ValueError, match="op: a is not a device: 'fast'"):
        device_like("op", "a", "fast")
    with pytest.raises(ValueError, match="op: a must be a CUDA index >= 0, got -1"):
        device_like("op", "a", -1)


def test_verified_send_to_a_cuda_device_that_does_not_exist_is_a_value_error(gen):
    # Without include_cpu a CPU tensor goes through .to: before, torch's own error came from there
    # (AssertionError "Torch not compiled with CUDA enabled" with a CPU-only torch).
    n = num_gpus()
    x = torch.randn(5, 3, generator=gen)[:, 1]  # a view: what .to would copy
    targets = [f"cuda:{n}", torch.device("cuda", n), n] + (["cuda"] if n == 0 else [])
    for device in targets:
        name = "cuda" if device == "cuda" else f"cuda:{n}"
        for data in ({"a": [x]}, (Moves(),), x):
            with pytest.raises(ValueError, match=f"pyxfer.nested.verified_send: device is {name}, which does not "
                                                 f"exist"):
                verified_send(data, device)
        assert verified_send({"a": [1, None, "s"]}, device) == {"a": [1, None, "s"]}  # no tensor: nothing to check
