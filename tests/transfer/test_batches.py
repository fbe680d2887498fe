"""pyxfer.verified_copy_many on the CPU (issue 34 item 5): verified_copy's result for each tensor of a
mixed batch, in input order; a fault in one tensor repaired (sync) or latched (deferred) for that tensor
alone, its failure naming the tensor's index; bad input refused, naming the function and the argument,
before anything is copied. Zero-byte tensors take no fault (pyxfer.testing), so leading empty tensors
steer a fault to a chosen index."""
import pytest
import torch

import pyxfer
from pyxfer.testing import FAULT_KINDS, inject_fault

from support.tensors import layouts, logical_bytes, random_tensor

# health reset around each test; no latched deferred mismatch left behind (conftest.py)
pytestmark = pytest.mark.usefixtures("clean_transfers")

MANY = "pyxfer.verified_copy_many"


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and logical_bytes(a) == logical_bytes(b)


def mixed_batch(gen):
    """Every layout of tests/support/tensors.py (empty, scalar, odd sizes, views, offsets) in several dtypes."""
    return [t for dtype in (torch.uint8, torch.float16, torch.int64, torch.complex64, torch.bool)
            for _, t in layouts(dtype, gen)]


def with_target(gen, index, numel=4099):
    """`index` empty tensors, then a fresh non-empty one (the fault's target), then two more."""
    return ([random_tensor((0,), torch.float32, gen) for _ in range(index)] +
            [random_tensor((numel,), torch.uint8, gen), random_tensor((3, 77), torch.int16, gen).t(),
             random_tensor((1001,), torch.uint8, gen)[3:]])


@pytest.mark.parametrize("route", ["auto", "direct", "staged"])
@pytest.mark.parametrize("verify", ["sync", "deferred", "none"])
def test_mixed_batch_gives_each_tensor_its_verified_copy(route, verify, gen):
    batch = mixed_batch(gen)
    out = pyxfer.verified_copy_many(batch, "cpu", route=route, verify=verify)
    assert type(out) is list and len(out) == len(batch)
    for i, (o, t) in enumerate(zip(out, batch)):
        assert o.is_contiguous() and o.device.type == "cpu" and same_bits(o, t), i
        assert o.data_ptr() != t.data_ptr() or t.numel() == 0, i  # a copy, never the source itself
    pyxfer.check_transfers()  # nothing latched


def test_tuples_empty_batches_and_the_default_arguments(gen):
    a, b = random_tensor((7,), torch.int32, gen), random_tensor((5, 3), torch.float64, gen)[1:]
    out = pyxfer.verified_copy_many((a, b), torch.device("cpu"))
    assert [same_bits(o, t) for o, t in zip(out, (a, b))] == [True, True]
    assert pyxfer.verified_copy_many([], "cpu") == []
    assert pyxfer.verified_copy_many((), "cpu") == []
    assert torch.ops.pyxfer.verified_copy_many([], torch.device("cpu")) == []


def test_gradients_flow_back_per_tensor_like_verified_copy(gen):
    a = torch.randn(5, 7, generator=gen, dtype=torch.float64).requires_grad_()
    b = torch.randn(3, generator=gen)  # no grad
    c = torch.randn(11, generator=gen, dtype=torch.float64)[2:].requires_grad_()  # a view with an offset (a leaf)
    out = pyxfer.verified_copy_many([a, b, c], "cpu")
    assert [o.requires_grad for o in out] == [True, False, True]
    (out[0] * 3).sum().backward()
    (out[2] * 5).sum().backward()
    assert torch.equal(a.grad, torch.full_like(a, 3)) and torch.equal(c.grad, torch.full_like(c, 5))
    with torch.no_grad():
        assert not any(o.requires_grad for o in pyxfer.verified_copy_many([a, c], "cpu"))


@pytest.mark.parametrize("kind", FAULT_KINDS)
@pytest.mark.parametrize("index", [0, 3])
def test_a_fault_in_one_tensor_is_repaired_for_that_tensor(kind, index, gen):
    # route="direct": the pair's corrupt mark does not reroute the others, each keeps its own first try
    for _ in range(4):  # stale / truncate may leave the source's bytes by chance on tiny data: not here (4099 B)
        batch = with_target(gen, index)
        with inject_fault(kind, path="direct") as fault:
            out = pyxfer.verified_copy_many(batch, "cpu", route="direct")
        assert fault.used == 1
        assert all(same_bits(o, t) for o, t in zip(out, batch))
        if pyxfer.health.status("cpu", "cpu") == "corrupt":
            break
    assert pyxfer.health.status("cpu", "cpu") == "corrupt"  # detected, and repaired through the staged path


@pytest.mark.parametrize("kind", FAULT_KINDS)
def test_faults_on_both_paths_raise_naming_the_index_and_return_nothing(kind, gen):
    batch = with_target(gen, 3, numel=6006)
    with inject_fault(kind, path="direct"), inject_fault("zeros", path="staged"):
        with pytest.raises(pyxfer.TransferError) as info:
            pyxfer.verified_copy_many(batch, "cpu")
    e = info.value
    zeros = pyxfer.checksum(torch.zeros(6006, dtype=torch.uint8))
    assert (e.index, e.src, e.dst, e.num_bytes, e.route, e.attempt) == (3, "cpu", "cpu", 6006, "direct", 2)
    assert (e.src_hash, e.retry_dst_hash) == (pyxfer.checksum(batch[3]), zeros)
    assert str(e).startswith("tensors[3]: copy cpu -> cpu of 6006 bytes failed verification on the direct path")
    assert torch.ops.pyxfer.take_sync_transfer_error() == []  # the wrapper took this thread's record


def test_a_single_copy_names_no_index(gen):
    src = random_tensor((4099,), torch.uint8, gen)
    with inject_fault("zeros", path="direct"), inject_fault("zeros", path="staged"):
        with pytest.raises(pyxfer.TransferError) as info:
            pyxfer.verified_copy(src, "cpu")
    assert info.value.index is None and str(info.value).startswith("copy cpu -> cpu")


def test_the_raw_op_records_the_index(gen):
    batch = with_target(gen, 2)
    with inject_fault("bitflip", path="direct"), inject_fault("zeros", path="staged"):
        with pytest.raises(RuntimeError, match=r"^pyxfer.TransferError: tensors\[2\]: copy cpu -> cpu of 4099 bytes"):
            torch.ops.pyxfer.verified_copy_many(batch, torch.device("cpu"), "direct", "sync")
    record = torch.ops.pyxfer.take_sync_transfer_error()
    assert len(record) == 10 and record[:4] == [1, -1, -1, 4099] and record[9] == 2


@pytest.mark.parametrize("kind", FAULT_KINDS)
@pytest.mark.parametrize("index", [0, 4])
def test_deferred_latches_the_one_faulty_tensor_with_its_index(kind, index, gen):
    batch = with_target(gen, index)
    with inject_fault(kind, path="direct") as fault:
        out = pyxfer.verified_copy_many(batch, "cpu", route="direct", verify="deferred")
    assert fault.used == 1
    assert [same_bits(o, t) for o, t in zip(out, batch)] == [i != index for i in range(len(batch))]
    with pytest.raises(pyxfer.TransferError) as info:
        pyxfer.check_transfers()
    e = info.value
    assert (e.index, e.num_bytes, e.src_hash, e.attempt) == (index, 4099, pyxfer.checksum(batch[index]), 1)
    assert str(e).startswith(f"1 deferred verified copy failed verification; the first: tensors[{index}] of a "
                             f"verified_copy_many call: copy cpu -> cpu of 4099 bytes")
    assert pyxfer.health.status("cpu", "cpu") == "corrupt"


def test_deferred_single_copies_record_no_index(gen):
    with inject_fault("zeros", path="direct"):
        pyxfer.verified_copy(random_tensor((4099,), torch.uint8, gen), "cpu", verify="deferred")
    with pytest.raises(pyxfer.TransferError) as info:
        pyxfer.check_transfers()
    assert info.value.index is None and "verified_copy_many" not in str(info.value)


def test_a_failure_in_a_batch_does_not_leave_its_index_on_later_copies(gen):
    batch = with_target(gen, 1)
    with inject_fault("zeros", path="direct"), inject_fault("zeros", path="staged"):
        with pytest.raises(pyxfer.TransferError):
            pyxfer.verified_copy_many(batch, "cpu")
    with inject_fault("zeros", path="direct"):  # now a plain copy, deferred
        pyxfer.verified_copy(batch[1], "cpu", route="direct", verify="deferred")
    with pytest.raises(pyxfer.TransferError) as info:
        pyxfer.check_transfers()
    assert info.value.index is None


NOT_A_TENSOR = object()


@pytest.mark.parametrize("args, kwargs, exc, match", [
    ((None, "cpu"), {}, TypeError, f"{MANY}: tensors must be a list or tuple of torch.Tensor, got NoneType"),
    (("T", "cpu"), {}, TypeError, f"{MANY}: tensors must be a list or tuple of torch.Tensor, got Tensor"),
    (("GEN", "cpu"), {}, TypeError, f"{MANY}: tensors must be a list or tuple of torch.Tensor, got generator"),
    (("BAD_ELEMENT", "cpu"), {}, TypeError, f"{MANY}: tensors\\[2\\] must be a torch.Tensor, got object"),
    (("SPARSE", "cpu"), {}, ValueError, f"{MANY}: tensors\\[1\\] must be a dense strided tensor"),
    (("META", "cpu"), {}, ValueError, f"{MANY}: tensors\\[2\\] is on the meta device"),
    (("OK", "nowhere"), {}, ValueError, f"{MANY}: device is not a device"),
    (("OK", "cuda:99"), {}, ValueError, f"{MANY}: device is cuda:99, which does not exist"),
    (("OK", 1.5), {}, TypeError, f"{MANY}: device must be a torch.device"),
    (("OK", "meta"), {}, ValueError, f"{MANY}: device must be a CPU or CUDA device"),
    (("OK", "cpu"), {"verify": "later"}, ValueError, f"{MANY}: verify must be one of"),
    (("OK", "cpu"), {"route": "nvlink"}, ValueError, f"{MANY}: route must be one of"),
    (("OK", "cpu"), {"pin_memory": 1}, TypeError, f"{MANY}: pin_memory must be a bool"),
])
def test_bad_input_is_refused_before_anything_is_copied(args, kwargs, exc, match, gen):
    ok = [random_tensor((4099,), torch.uint8, gen), random_tensor((5,), torch.float32, gen)]
    tensors = {"T": ok[0], "GEN": (t for t in ok), "BAD_ELEMENT": ok + [NOT_A_TENSOR],
               "SPARSE": [ok[0], torch.eye(3).to_sparse()], "META": ok + [torch.empty(3, device="meta")],
               "OK": ok}.get(args[0], args[0])
    with inject_fault("zeros", path="direct", times=5) as direct, inject_fault("zeros", path="staged") as staged:
        with pytest.raises(exc, match=match):
            pyxfer.verified_copy_many(tensors, args[1], **kwargs)
    assert direct.used == 0 and staged.used == 0  # the first tensor was not copied


@pytest.mark.parametrize("args, match", [
    (("later", "sync"), "pyxfer.verified_copy_many: route must be 'auto', 'direct' or 'staged', got 'later'"),
    (("auto", "later"), "pyxfer.verified_copy_many: verify must be 'sync', 'deferred' or 'none', got 'later'"),
])
def test_the_raw_op_checks_every_argument_before_the_first_copy(args, match, gen):
    ok = [random_tensor((4099,), torch.uint8, gen), random_tensor((5,), torch.float32, gen)]
    with inject_fault("zeros", path="direct", times=5) as direct:
        with pytest.raises(RuntimeError, match=match):
            torch.ops.pyxfer.verified_copy_many(ok, torch.device("cpu"), *args)
    assert direct.used == 0


@pytest.mark.parametrize("inference", [False, True])
def test_audit_counts_each_tensor_of_a_batch_as_a_pyxfer_copy(inference, gen):
    # with autograd on, the audit sees verified_copy per tensor; in inference mode the batch op itself
    batch = [random_tensor((33,), torch.uint8, gen), random_tensor((0,), torch.float32, gen),
             random_tensor((5, 7), torch.float64, gen).t()]
    with torch.inference_mode(inference), pyxfer.audit() as report:
        out = pyxfer.verified_copy_many(batch, "cpu")
    assert all(same_bits(o, t) for o, t in zip(out, batch))
    assert report.num_pyxfer_copies == 3 and report.num_unverified_copies == 0
    assert sum(t.num_bytes for t in report.pyxfer_copies.values()) == 33 + 0 + 5 * 7 * 8


@pytest.mark.parametrize("bad, match", [
    (lambda: torch.quantize_per_tensor(torch.randn(4, 8), 0.05, 3, torch.qint8),
     "srcs\\[1\\] must be a non-quantized tensor, got a quantized QInt8 tensor"),
    (lambda: torch.randn(4, 8).to_sparse(), "srcs\\[1\\] must be a dense strided tensor"),
    (lambda: torch.empty(3, device="meta"), "srcs\\[1\\].device must be a CPU or CUDA device, got meta"),
])
def test_the_raw_op_refuses_bad_elements_before_the_first_copy(bad, match, gen):
    ok = random_tensor((4099,), torch.uint8, gen)
    with inject_fault("zeros", path="direct", times=5) as direct:
        with pytest.raises(RuntimeError, match="pyxfer.verified_copy_many: " + match):
            torch.ops.pyxfer.verified_copy_many([ok, bad()], torch.device("cpu"))
    assert direct.used == 0
