"""pyxfer.device_guard / on_device_of without a GPU: CPU data is a no-op, argument handling and
errors (devices given as indices or torch.device never touch CUDA before the guard is entered)."""
import pytest
import torch

import pyxfer


def test_cpu_and_meta_data_is_a_no_op(gen):
    x = torch.randn(3, generator=gen)
    module = torch.nn.Linear(2, 2)
    with pyxfer.device_guard(x, module, {"a": [x, None]}, torch.empty(2, device="meta"), "cpu") as d:
        assert d is None
    with pyxfer.device_guard() as d:
        assert d is None


def test_several_cuda_devices_are_an_error_naming_them():
    with pytest.raises(ValueError, match=r"span 2 devices \(argument 0 on cuda:0, argument 1\[1\] on cuda:1\)"):
        pyxfer.device_guard(torch.device("cuda:0"), [0, 1])
    with pytest.raises(ValueError, match=r"argument 0\['b'\] on cuda:3"):
        pyxfer.device_guard({"a": 2, "b": "cuda:3"})


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match=r"argument 1\[0\] must be a tensor, module, device, CUDA index, None "
                                        r"or a tuple/list/mapping of those, got float"):
        pyxfer.device_guard(None, [1.5])
    with pytest.raises(ValueError, match="argument 0 is not a device: 'gpu7'"):
        pyxfer.device_guard("gpu7")
    with pytest.raises(ValueError, match="argument 0 must be a CUDA index >= 0, got -1"):
        pyxfer.device_guard(-1)


def test_on_device_of_passes_results_and_errors_through(gen):
    calls = []

    @pyxfer.on_device_of("x")
    def launch(x, y, *, scale=2):
        """doc"""
        calls.append((x, y, scale))
        return x * scale + y

    x, y = torch.randn(4, generator=gen), torch.randn(4, generator=gen)
    assert torch.equal(launch(x, y), x * 2 + y) and torch.equal(launch(y=y, x=x, scale=3), x * 3 + y)
    assert launch.__name__ == "launch" and launch.__doc__ == "doc" and len(calls) == 2

    @pyxfer.on_device_of
    def first(a, b=None):
        if b is None:
            raise KeyError("from the launcher")
        return a + b

    assert torch.equal(first(x, b=y), x + y)
    with pytest.raises(KeyError, match="from the launcher"):
        first(x)
    assert pyxfer.on_device_of()(first.__wrapped__)(x, y).shape == (4,)


def test_on_device_of_checks_names_and_devices():
    with pytest.raises(TypeError, match=r"has no parameter named 'z' \(parameters: x, y\)"):
        pyxfer.on_device_of("z")(lambda x, y: None)
    with pytest.raises(TypeError, match="argument names must be strings, got int"):
        pyxfer.on_device_of("x", 3)

    @pyxfer.on_device_of("x", "out")
    def launch(x, out=None):
        return x

    with pytest.raises(ValueError, match=r"on_device_of\(.*launch\): the CUDA arguments span 2 devices "
                                         r"\(x on cuda:0, out on cuda:1\)"):
        launch(torch.device("cuda:0"), out=1)


def fake_cuda(*shape, index):
    """A FakeTensor on cuda:index: it has a CUDA device and no data, and needs no GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        return torch.empty(*shape, device=f"cuda:{index}")


def test_the_device_of_cuda_tensors_and_modules_without_entering():
    # .index is found at construction; CUDA is touched only when the block is entered
    x = fake_cuda(3, index=1)
    assert pyxfer.device_guard(x).index == 1 and pyxfer.device_guard(2).index == 2
    assert pyxfer.device_guard([torch.ones(2), None], {"k": "cuda:3"}, "cpu").index == 3
    assert pyxfer.device_guard(x, "cuda:1", [1, x]).index == 1  # one device, named several times
    module = torch.nn.Linear(2, 2, device="meta")
    module.register_buffer("scale", fake_cuda(2, index=2))
    assert pyxfer.device_guard(module).index == 2
    with pytest.raises(ValueError, match=r"span 2 devices \(argument 1 on cuda:1, argument 0\.scale on cuda:2\)"):
        pyxfer.device_guard(module, x)


def test_bare_on_device_of_picks_the_first_cuda_tensor():
    from pyxfer.guard import _first_cuda_tensor
    cpu, c0, c1, c2 = torch.ones(1), fake_cuda(1, index=0), fake_cuda(1, index=1), fake_cuda(1, index=2)
    assert _first_cuda_tensor((cpu, [cpu, c1], c0), {}) == 1  # one level into lists, in argument order
    assert _first_cuda_tensor((cpu, (c2,)), {"out": c0}) == 2
    assert _first_cuda_tensor((cpu, 3, "cuda:1"), {"out": c0, "b": c1}) == 0  # only tensors count; then kwargs
    assert _first_cuda_tensor(([[c1]], {"a": c1}), {}) is None  # not two levels deep, not in mappings
    assert _first_cuda_tensor((), {}) is None
