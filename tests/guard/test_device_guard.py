"""pyxfer.device_guard / on_device_of without a GPU: CPU data is a no-op, argument handling and
errors (devices given as indices or torch.device never touch CUDA before the guard is entered).

Where a test needs CUDA devices that this machine lacks, the ``gpus`` fixture (tests/conftest.py,
support/simulated_cuda.py) simulates them at the one place pyxfer reads them: the device count
pyxfer._devices reads, and torch.cuda's current device per thread (what the real runtime keeps per
thread). pyxfer's own code runs unchanged. The same behaviours on real GPUs: test_device_guard_gpu.py.
CUDA data is support.tensors.cuda_tensor (a device, no data)."""
import threading

import pytest
import torch

import pyxfer

from support.tensors import cuda_tensor


def num_gpus():
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def test_cpu_and_meta_data_is_a_no_op(gen):
    x = torch.randn(3, generator=gen)
    module = torch.nn.Linear(2, 2)
    with pyxfer.device_guard(x, module, {"a": [x, None]}, torch.empty(2, device="meta"), "cpu") as d:
        assert d is None
    with pyxfer.device_guard() as d:
        assert d is None


def test_ints_inside_structures_are_not_device_indices(gen):
    # A shape, a block size or a count beside the tensors is no device: no CUDA device is named here.
    x = torch.randn(7, 3, generator=gen)
    for args in [(x.shape,), ({"x": x, "block": 1024},), ([x, 1, (2, 3)], {"n": [5]}), ((0,),)]:
        g = pyxfer.device_guard(*args)
        assert g.index is None, args
        with g as d:
            assert d is None


def test_ints_inside_structures_do_not_count_beside_a_cuda_tensor(gpus):
    x = cuda_tensor(7, 3, index=2)
    assert pyxfer.device_guard(x, x.shape, {"x": x, "block": 1024, "flag": True}).index == 2
    with pyxfer.device_guard({"x": x, "block": 1024}) as d:
        assert d == torch.device("cuda", 2) and gpus.current() == 2
    assert gpus.current() == 0 and gpus.entered == [2]


def test_several_cuda_devices_are_an_error_naming_them(gpus):
    with pytest.raises(ValueError, match=r"span 2 devices \(argument 0 on cuda:0, argument 1\[1\] on cuda:1\)"):
        pyxfer.device_guard(torch.device("cuda:0"), [None, "cuda:1"])
    with pytest.raises(ValueError, match=r"argument 0\['b'\] on cuda:3"):
        pyxfer.device_guard({"a": torch.device("cuda", 2), "b": "cuda:3"})
    with pytest.raises(ValueError, match=r"span 2 devices \(argument 1 on cuda:0, argument 0 on cuda:1\)"):
        pyxfer.device_guard(1, 0)  # top-level ints are CUDA indices
    assert gpus.entered == []


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match=r"argument 1 must be a tensor, module, device, CUDA index, None "
                                        r"or a tuple/list/mapping of those, got float"):
        pyxfer.device_guard(None, 1.5)
    with pytest.raises(TypeError, match="argument 0 must be .* got bool"):
        pyxfer.device_guard(True)
    with pytest.raises(ValueError, match="argument 0 is not a device: 'gpu7'"):
        pyxfer.device_guard("gpu7")
    with pytest.raises(ValueError, match="argument 0 must be a CUDA index >= 0, got -1"):
        pyxfer.device_guard(-1)
    # Inside structures only device-like things count: names, numbers and objects are left alone.
    assert pyxfer.device_guard([1.5, object()], {"mode": "fast", "eps": 1e-5, "n": -1}).index is None


def test_devices_that_do_not_exist_are_value_errors_naming_the_argument(gen):
    # Real: this process's own CUDA devices (none with a CPU-only torch): cuda:<count> does not exist.
    n = num_gpus()
    missing = f"cuda:{n}"
    x = torch.randn(3, generator=gen)
    for args, name in [((missing,), "argument 0"), ((x, torch.device(missing)), "argument 1"), ((n,), "argument 0"),
                       ((x, {"out": [missing]}), r"argument 1\['out'\]\[0\]")]:
        with pytest.raises(ValueError, match=f"pyxfer.device_guard: {name} is {missing}, which does not exist"):
            pyxfer.device_guard(*args)
    if n == 0:
        with pytest.raises(ValueError, match="argument 0 is cuda, which does not exist"):
            pyxfer.device_guard("cuda")

    calls = []

    @pyxfer.on_device_of("x", "out")
    def launch(x, out=None):
        calls.append(x)

    with pytest.raises(ValueError, match=rf"on_device_of\(.*launch\): out is {missing}, which does not exist"):
        launch(x, out=missing)
    assert calls == []  # checked before the function runs


def test_one_guard_nested_in_itself_restores_each_level(gpus):
    x = cuda_tensor(5, index=2)
    for g in (pyxfer.device_guard(x), pyxfer.device_guard.of_index(2)):
        gpus.set(1)
        with g as d:
            assert d == torch.device("cuda", 2) and gpus.current() == 2
            with g:
                assert gpus.current() == 2
            assert gpus.current() == 2
            with pyxfer.device_guard("cuda:3"):
                with g:
                    assert gpus.current() == 2
                assert gpus.current() == 3
            assert gpus.current() == 2
        assert gpus.current() == 1
        with pytest.raises(KeyError):
            with g:
                with g:
                    raise KeyError("inside")
        assert gpus.current() == 1 and not g._saved  # nothing left behind for this thread


def test_one_guard_shared_by_threads_restores_each_threads_device(gpus):
    g = pyxfer.device_guard(cuda_tensor(5, index=2))
    steps = [threading.Event() for _ in range(3)]
    seen = {}

    def worker(name, start, wait_before_enter, set_after_enter, wait_before_exit, set_after_exit):
        try:
            gpus.set(start)
            if wait_before_enter is not None:
                assert steps[wait_before_enter].wait(60)
            with g:
                seen[name, "inside"] = gpus.current()
                steps[set_after_enter].set()
                if wait_before_exit is not None:
                    assert steps[wait_before_exit].wait(60)
            seen[name, "after"] = gpus.current()
            if set_after_exit is not None:
                steps[set_after_exit].set()
        except BaseException as e:  # reported by the main thread
            seen[name, "error"] = e
            for s in steps:
                s.set()

    # A enters (from cuda:1), then B enters (from cuda:3), then A leaves, then B leaves.
    a = threading.Thread(target=worker, args=("A", 1, None, 0, 1, 2))
    b = threading.Thread(target=worker, args=("B", 3, 0, 1, 2, None))
    a.start()
    b.start()
    a.join(120)
    b.join(120)
    assert seen == {("A", "inside"): 2, ("B", "inside"): 2, ("A", "after"): 1, ("B", "after"): 3}
    assert not g._saved


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


def test_on_device_of_checks_names_and_devices(gpus):
    with pytest.raises(TypeError, match=r"has no parameter named 'z' \(parameters: x, y\)"):
        pyxfer.on_device_of("z")(lambda x, y: None)
    with pytest.raises(TypeError, match=r"has no parameter named 'z' \(parameters: x, \*rest, k, \*\*extra\)"):
        pyxfer.on_device_of("z")(lambda x, *rest, k=1, **extra: None)
    with pytest.raises(TypeError, match="argument names must be strings, got int"):
        pyxfer.on_device_of("x", 3)

    @pyxfer.on_device_of("x", "out")
    def launch(x, out=None):
        return x

    with pytest.raises(ValueError, match=r"on_device_of\(.*launch\): the CUDA arguments span 2 devices "
                                         r"\(x on cuda:0, out on cuda:1\)"):
        launch(torch.device("cuda:0"), out=1)


def test_on_device_of_reads_parameter_defaults(gpus):
    # Issue 40: a default the call leaves in place is an argument like any other.
    calls = []
    on_1, on_3 = cuda_tensor(3, index=1), torch.device("cuda", 3)

    @pyxfer.on_device_of("x", "out")
    def launch(x, out=on_1):
        calls.append(gpus.current())

    with pytest.raises(ValueError, match=r"span 2 devices \(x on cuda:0, out on cuda:1\)"):
        launch(cuda_tensor(3, index=0))
    launch(cuda_tensor(3, index=1))
    assert calls == [1] and gpus.current() == 0

    @pyxfer.on_device_of("x", "scale", "out")
    def by_kind(x, /, scale=on_3, *, out="cuda:3"):
        calls.append(gpus.current())

    with pytest.raises(ValueError, match=r"span 2 devices \(x on cuda:2, scale on cuda:3\)"):
        by_kind(cuda_tensor(3, index=2))
    with pytest.raises(ValueError, match=r"span 2 devices \(x on cuda:2, out on cuda:3\)"):
        by_kind(cuda_tensor(3, index=2), None)
    by_kind(cuda_tensor(3, index=3))
    by_kind(cuda_tensor(3, index=2), "cuda:2", out=None)
    assert calls == [1, 3, 2] and gpus.current() == 0


def test_on_device_of_star_args_and_kwargs_stand_for_what_they_collect(gpus):
    calls = []

    @pyxfer.on_device_of("args")
    def h(*args):
        calls.append(gpus.current())
        return len(args)

    c1 = cuda_tensor(2, index=1)
    assert h(torch.ones(2), c1, 1024, "mean") == 4 and h() == 0 and h(3, (5, 7)) == 2
    with pytest.raises(ValueError, match=r"span 2 devices \(args\[1\]\[0\] on cuda:0, args\[0\] on cuda:1\)"):
        h(c1, [cuda_tensor(1, index=0)])
    assert calls == [1, 0, 0]  # the tensor's device, then no CUDA argument: left as it was

    @pyxfer.on_device_of("x", "extra")
    def k(x, *rest, scale=2, **extra):
        calls.append(gpus.current())

    k(cuda_tensor(1, index=3), c1, scale=cuda_tensor(1, index=2), block=1024)  # *rest and scale are not named
    with pytest.raises(ValueError, match=r"span 2 devices \(extra\['out'\] on cuda:1, x on cuda:3\)"):
        k(cuda_tensor(1, index=3), out=c1)
    assert calls == [1, 0, 0, 3] and gpus.current() == 0


def test_the_device_of_cuda_tensors_and_modules_without_entering(gpus):
    # .index is found at construction; CUDA is touched only when the block is entered
    x = cuda_tensor(3, index=1)
    assert pyxfer.device_guard(x).index == 1 and pyxfer.device_guard(2).index == 2
    assert pyxfer.device_guard([torch.ones(2), None], {"k": "cuda:3"}, "cpu").index == 3
    assert pyxfer.device_guard(x, "cuda:1", [torch.device("cuda", 1), x]).index == 1  # one device, named thrice
    gpus.set(2)
    assert pyxfer.device_guard("cuda").index == 2 and pyxfer.device_guard(["cuda"]).index == 2  # the current one
    module = torch.nn.Linear(2, 2, device="meta")
    module.register_buffer("scale", cuda_tensor(2, index=2))
    assert pyxfer.device_guard(module).index == 2 and pyxfer.device_guard({"m": [module]}).index == 2
    with pytest.raises(ValueError, match=r"span 2 devices \(argument 1 on cuda:1, argument 0\.scale on cuda:2\)"):
        pyxfer.device_guard(module, x)
    assert gpus.entered == []


def test_bare_on_device_of_picks_the_first_cuda_tensor():
    from pyxfer.guard import _first_cuda_tensor
    cpu, c0, c1, c2 = torch.ones(1), cuda_tensor(1, index=0), cuda_tensor(1, index=1), cuda_tensor(1, index=2)
    assert _first_cuda_tensor((cpu, [cpu, c1], c0), {}) == 1  # one level into lists, in argument order
    assert _first_cuda_tensor((cpu, (c2,)), {"out": c0}) == 2
    assert _first_cuda_tensor((cpu, 3, "cuda:1"), {"out": c0, "b": c1}) == 0  # only tensors count; then kwargs
    assert _first_cuda_tensor(([[c1]], {"a": c1}), {}) is None  # not two levels deep, not in mappings
    assert _first_cuda_tensor((), {}) is None
