"""pyxfer.nested without accelerate: how the target device is read (CUDA indices, strings that are not
devices, dtypes and None passed on to ``.to``), and ``sender(rebuild=False)`` returning settled
structures themselves while rebuilding only what moved. send_to_device's semantics case for case are
compared with accelerate's in test_accelerate.py."""
import collections

import pytest
import torch

from pyxfer.nested import sender, verified_send

Pair = collections.namedtuple("Pair", "first second")


class Moves:
    """An object with a .to (like BatchEncoding): never settled, moved through its own .to."""

    def __init__(self, device):
        self.device = device

    def to(self, device, non_blocking=False):
        return Moves(str(device))


class Config:
    """An object without .to (a KV cache under a key not skipped, a config): returned as it is."""


def test_a_cuda_index_is_a_device_checked_before_any_copy(gen):
    x = torch.randn(5, generator=gen)
    missing = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ValueError, match=f"verified_send: device is cuda:{missing}, which does not exist"):
        verified_send({"a": [x]}, missing, include_cpu=True)


def test_targets_that_are_not_cpu_or_cuda_go_through_to(gen):
    x = torch.randn(3, 4, generator=gen)
    with pytest.raises(RuntimeError, match="Invalid device string: 'gpu7'"):  # Tensor.to's own error
        verified_send([x], "gpu7", include_cpu=True)
    doubled = verified_send({"x": x}, torch.float64, include_cpu=True)["x"]  # .to(dtype), as send_to_device
    assert doubled.dtype == torch.float64 and torch.equal(doubled, x.double())
    assert verified_send((x,), None, include_cpu=True)[0] is x  # .to(None) is the tensor itself
    with pytest.raises(NotImplementedError, match="Cannot copy out of meta tensor"):  # as .to("cpu") raises
        verified_send([x.to("meta")], "cpu", include_cpu=True)
    meta = verified_send(Pair(x, 2), "meta", include_cpu=True)
    assert type(meta) is Pair and meta.first.device.type == "meta" and meta.first.shape == (3, 4) and meta.second == 2


def test_settled_structures_come_back_themselves_without_rebuild(gen):
    x, y = torch.randn(7, generator=gen), torch.randn(2, 3, generator=gen)
    send = sender("cpu", rebuild=False, include_cpu=True)
    cfg = Config()
    settled = (x, [y, (x, None)], 3, "s", cfg, torch.float16)
    assert send(settled) is settled
    kwargs = {"a": x, "b": [y], "c": cfg}
    assert send(kwargs) is kwargs
    moved = sender("meta", rebuild=False)(settled)  # the same structure, to another device: rebuilt
    assert moved is not settled and moved[0].device.type == "meta" and moved[1][1][0].device.type == "meta"
    # one element that must move (it has a .to) two levels down: only the containers on its way are new
    inner = [y, Moves("meta")]
    data = (x, inner, cfg)
    got = send(data)
    assert got is not data and got[1] is not inner
    assert got[0] is x and got[2] is cfg and got[1][0] is y and got[1][1].device == "cpu"
    assert inner[1].device == "meta"  # the input is not mutated
    # rebuild=True (verified_send's default): new containers at every level even when nothing moved, as
    # send_to_device returns (the inner list of a settled tuple was once the input's own list)
    for data in (settled, list(settled)):
        again = verified_send(data, "cpu")
        assert type(again) is type(data) and again is not data and again == data
        assert again[1] is not data[1] and again[1][1] is not data[1][1] and again[0] is x and again[4] is cfg
        again[1].append("mutating the result")
        assert len(data[1]) == 2  # leaves the input alone


@pytest.mark.parametrize("unsettled", [Pair(1, 2), collections.OrderedDict(a=1), torch.nn.Parameter(torch.ones(2))],
                         ids=["namedtuple", "mapping", "tensor subclass"])
def test_containers_and_subclasses_are_never_taken_as_settled(unsettled):
    # _settled's fast path checks exact types: these are rebuilt or moved through their own .to
    data = [unsettled]
    got = sender("cpu", rebuild=False)(data)
    assert got is not data and type(got[0]) is type(unsettled)


def test_options_are_checked_and_named_before_anything_moves(gen):
    x = torch.randn(3, 5, generator=gen)
    for name, value in (("include_cpu", "no"), ("include_cpu", None), ("non_blocking", "yes"), ("non_blocking", 1)):
        with pytest.raises(TypeError, match=f"pyxfer.nested.verified_send: {name} must be a bool, "
                                            f"got {type(value).__name__} {value!r}"):
            verified_send({"a": x}, "meta", **{name: value})
    with pytest.raises(TypeError, match=r"pyxfer.nested.verified_send: skip_keys must be a key, a list of keys or "
                                        r"None; its element \['a'\] \(list\) cannot be a mapping key"):
        verified_send({"a": x}, "meta", skip_keys=["b", ["a"]])
    # sender: the same checks, reported against the caller's entry point
    with pytest.raises(TypeError, match="my.entry: rebuild must be a bool, got str 'no'"):
        sender("cpu", rebuild="no", op="my.entry")
    with pytest.raises(ValueError, match="my.entry: route must be one of"):
        sender("cpu", route="scenic", op="my.entry")
    assert verified_send({"a": x}, "cpu", skip_keys=("a", ("t", 1)))["a"] is x  # any hashable keys
