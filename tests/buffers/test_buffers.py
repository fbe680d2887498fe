"""pyxfer.buffers on the CPU: typed subviews of byte buffers survive pack, capture, move, offload, reload."""
import json

import pytest
import torch

from pyxfer.buffers import PackedBuffer, SubviewSpec, capture_subviews, pack, restore_subviews

from support.buffers import MIXED_DTYPES, bits, carve, sentinel_buffer, te_bulk_quantized
from support.tensors import ALL_DTYPES, layouts, random_tensor

QUANTIZED_DTYPES = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}  # rejected
EVERY_DTYPE = sorted({d for d in vars(torch).values() if isinstance(d, torch.dtype)} - QUANTIZED_DTYPES,
                     key=str)  # aliases once


def assert_same_view(got, want):
    assert (got.dtype, got.shape, got.stride()) == (want.dtype, want.shape, want.stride())
    assert torch.equal(bits(got), bits(want))


def shares_storage(a, b):
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


# --- SubviewSpec -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", EVERY_DTYPE, ids=str)
def test_spec_dict_round_trip_every_dtype(dtype):
    spec = SubviewSpec(48, (3, 5), (1, 3), dtype)
    d = json.loads(json.dumps(spec.to_dict()))  # the dict is plain JSON
    assert d["dtype"] == str(dtype).removeprefix("torch.")
    assert SubviewSpec.from_dict(d) == spec


def test_spec_normalises_lists_and_accepts_torch_prefix():
    spec = SubviewSpec.from_dict({"byte_offset": 16, "shape": [2, 2], "stride": [2, 1], "dtype": "torch.float32"})
    assert spec == SubviewSpec(16, (2, 2), (2, 1), torch.float32) and spec.shape == (2, 2)
    assert SubviewSpec(0, (), (), torch.float64).nbytes == 8
    assert SubviewSpec(0, (4, 0), (1, 4), torch.float64).nbytes == 0
    assert SubviewSpec(0, (9, 13), (0, 1), torch.int16).nbytes == 26  # expanded: one row's bytes


@pytest.mark.parametrize("d,error,match", [
    ({"byte_offset": 0, "shape": [1], "stride": [1]}, ValueError, "expected a dict with keys"),
    ({"byte_offset": 0, "shape": [1], "stride": [1], "dtype": "float32", "x": 1}, ValueError, "expected a dict"),
    ({"byte_offset": 0, "shape": [1], "stride": [1], "dtype": "float33"}, ValueError,
     "must name a torch dtype.*float33"),
    ({"byte_offset": 0, "shape": [1], "stride": [1], "dtype": "ones"}, ValueError, "must name a torch dtype.*ones"),
    ({"byte_offset": 0, "shape": [1], "stride": [1], "dtype": 7}, ValueError, "must name a torch dtype"),
    ({"byte_offset": 1.0, "shape": [1], "stride": [1], "dtype": "uint8"}, TypeError, "byte_offset must be an int"),
    ({"byte_offset": True, "shape": [1], "stride": [1], "dtype": "uint8"}, TypeError, "byte_offset must be an int"),
    ({"byte_offset": 0, "shape": [1.5], "stride": [1], "dtype": "uint8"}, TypeError,
     "shape must be a sequence of ints"),
    ({"byte_offset": 0, "shape": 3, "stride": [1], "dtype": "uint8"}, TypeError, "shape must be a sequence of ints"),
    ({"byte_offset": 0, "shape": [2, 2], "stride": [1], "dtype": "uint8"}, ValueError, "same length"),
], ids=["missing-key", "extra-key", "unknown-dtype", "not-a-dtype", "dtype-not-str", "float-offset",
        "bool-offset", "float-shape", "int-shape", "length-mismatch"])
def test_spec_from_dict_rejects(d, error, match):
    with pytest.raises(error, match=match):
        SubviewSpec.from_dict(d)


def test_spec_rejects_non_dtype():
    with pytest.raises(TypeError, match="SubviewSpec: dtype must be a torch.dtype"):
        SubviewSpec(0, (1,), (1,), "float32")


# --- restore_subviews / capture_subviews ------------------------------------------------------------

def test_bulk_buffer_example_from_spec_8_7():
    buf = torch.zeros(64, dtype=torch.uint8)
    buf[16:32].view(torch.float32).copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    view = buf[16:32].view(torch.float32).view(2, 2)
    # TE's rebuild loses the dtype (the defect this module exists for)
    assert torch.equal(buf.as_strided((2, 2), (2, 1), 16), torch.tensor([[0, 0], [128, 63]], dtype=torch.uint8))
    specs = capture_subviews(buf, [view])
    assert specs == [SubviewSpec(16, (2, 2), (2, 1), torch.float32)]
    (got,) = restore_subviews(buf, specs)
    assert got.dtype == torch.float32 and torch.equal(got, torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    assert shares_storage(got, buf)


@pytest.mark.parametrize("buffer_offset", [0, 16, 256])
def test_capture_restore_mixed_dtypes_at_odd_offsets(gen, buffer_offset):
    storage = sentinel_buffer(buffer_offset + 8192)
    buf = storage[buffer_offset:]
    views, offset = [], 8
    for k, dtype in enumerate(MIXED_DTYPES):
        size = dtype.itemsize
        offset = (offset // size + 2 * k + 1) * size  # odd multiples of the itemsize
        base = carve(buf, offset, (7, 9), dtype, gen)
        views += [base, base.t(), base[1:, 2::3], base[3], base[2, 5]]  # transposed, strided, row, scalar
        offset += base.numel() * size
    views.append(buf[5000:5000 + 64].view(torch.complex64)[:0])  # empty
    specs = capture_subviews(buf, views)
    for spec, v in zip(specs, views):
        assert spec.byte_offset == v.storage_offset() * v.element_size() - buffer_offset  # relative, not absolute
    # restore into a copy (another storage, storage offset 0): same dtypes, strides and values
    copy = buf.clone()
    for got, want in zip(restore_subviews(copy, specs), views):
        assert_same_view(got, want)
        assert shares_storage(got, copy)


def test_restore_into_a_buffer_with_its_own_storage_offset(gen):
    # the TE shift bug (§7.3): offsets recorded relative to the buffer must not shift
    payload = random_tensor((96,), torch.uint8, gen)
    specs = [SubviewSpec(8, (3, 4), (4, 1), torch.float32), SubviewSpec(64, (2,), (1,), torch.int64)]
    expected = restore_subviews(payload, specs)
    storage = sentinel_buffer(32 + 96)
    storage[32:] = payload
    for got, want in zip(restore_subviews(storage[32:], specs), expected):
        assert_same_view(got, want)


def test_view_as_real_keeps_both_dtypes(gen):
    buf = sentinel_buffer(512)
    c = carve(buf, 256, (5,), torch.complex64, gen)
    r = torch.view_as_real(c)
    # the case of §7.1: a float view of a complex tensor must come back float, the complex one complex
    got_c, got_r = restore_subviews(buf.clone(), capture_subviews(buf, [c, r]))
    assert_same_view(got_c, c)
    assert_same_view(got_r, r)
    got_r[2, 1] = 42.0
    assert got_c[2].imag == 42.0


def test_restored_views_alias_the_buffer_and_each_other(gen):
    buf = sentinel_buffer(1024)
    base = carve(buf, 128, (6, 10), torch.float32, gen)
    a, b = restore_subviews(buf, capture_subviews(buf, [base[1:, 2:], base.t()]))
    a[0, 0] = -7.5
    assert b[2, 1] == -7.5 and base[1, 2] == -7.5


BAD_SPECS = [
    (SubviewSpec(-4, (1,), (1,), torch.float32), r"specs\[1\] starts at byte -4 of buffer, expected >= 0"),
    (SubviewSpec(6, (1,), (1,), torch.float32), r"specs\[1\] starts at byte 6 .*multiple of 4 \(the size of float32\)"),
    (SubviewSpec(8, (2, 2), (2, -1), torch.float32), r"specs\[1\] has stride \(2, -1\), expected no negative"),
    (SubviewSpec(8, (-1,), (1,), torch.float32), r"specs\[1\] has shape \(-1,\), expected no negative"),
    (SubviewSpec(56, (3,), (1,), torch.float32), r"specs\[1\] spans bytes \[56, 68\) .*inside the buffer's 64 bytes"),
    (SubviewSpec(64, (1,), (1,), torch.uint8), r"specs\[1\] spans bytes \[64, 65\)"),
    (SubviewSpec(0, (2, 3), (40, 1), torch.float64), r"specs\[1\] spans bytes \[0, 344\)"),
]


@pytest.mark.parametrize("spec,match", BAD_SPECS, ids=["negative-offset", "misaligned", "negative-stride",
                                                        "negative-shape", "past-end", "one-past-end",
                                                        "strided-past-end"])
def test_restore_rejects_bad_specs(spec, match):
    good = SubviewSpec(0, (4,), (1,), torch.float32)
    with pytest.raises(ValueError, match="pyxfer.buffers.restore_subviews: " + match):
        restore_subviews(torch.zeros(64, dtype=torch.uint8), [good, spec])
    with pytest.raises(ValueError, match="pyxfer.buffers.PackedBuffer: " + match):
        PackedBuffer(torch.zeros(64, dtype=torch.uint8), [good, spec])


def test_restore_rejects_storage_misalignment_and_non_specs():
    odd = torch.zeros(65, dtype=torch.uint8)[1:]  # the buffer itself starts at storage byte 1
    with pytest.raises(ValueError, match=r"restore_subviews: specs\[0\] lands at byte 9 of the buffer's storage "
                                         r"\(buffer starts at byte 1\), expected a multiple of 8 "
                                         r"\(the size of int64\)"):
        restore_subviews(odd, [SubviewSpec(8, (1,), (1,), torch.int64)])
    with pytest.raises(TypeError, match=r"restore_subviews: specs\[0\] must be a SubviewSpec .*got dict"):
        restore_subviews(odd, [SubviewSpec(0, (1,), (1,), torch.uint8).to_dict()])


BAD_BUFFERS = [
    (torch.zeros(16), "got torch.float32 of shape \\(16,\\)"),
    (torch.zeros(4, 4, dtype=torch.uint8), "got torch.uint8 of shape \\(4, 4\\)"),
    (torch.zeros(16, dtype=torch.uint8)[::2], "got torch.uint8 of shape \\(8,\\) with stride \\(2,\\)"),
    (torch.zeros(16, dtype=torch.int8), "got torch.int8"),
]


@pytest.mark.parametrize("buffer,match", BAD_BUFFERS, ids=["float", "2d", "strided", "int8"])
@pytest.mark.parametrize("fn", [restore_subviews, capture_subviews], ids=lambda f: f.__name__)
def test_bad_buffers_rejected(fn, buffer, match):
    with pytest.raises(ValueError, match=f"{fn.__name__}: buffer must be a 1-D contiguous uint8 tensor, {match}"):
        fn(buffer, [])


def test_non_tensor_buffer_rejected():
    with pytest.raises(TypeError, match="restore_subviews: buffer must be a torch.Tensor, got list"):
        restore_subviews([0] * 8, [])


def test_capture_rejects_views_outside_the_buffer():
    storage = torch.zeros(128, dtype=torch.uint8)
    buf = storage[16:80]
    fn = "pyxfer.buffers.capture_subviews: "
    with pytest.raises(ValueError, match=fn + r"views\[1\] starts at byte -8 of buffer, expected >= 0"):
        capture_subviews(buf, [buf[:4], storage[8:24].view(torch.float32)])
    with pytest.raises(ValueError, match=fn + r"views\[0\] spans bytes \[56, 72\) of buffer, expected them inside "
                                              r"the buffer's 64 bytes"):
        capture_subviews(buf, [storage[72:88].view(torch.float64)])
    with pytest.raises(ValueError, match=fn + r"views\[0\] does not share buffer's storage"):
        capture_subviews(buf, [torch.zeros(4)])
    with pytest.raises(ValueError, match=fn + r"views\[0\] starts at byte 3 of buffer, expected a multiple of 4"):
        capture_subviews(storage[1:], [storage[4:8].view(torch.float32)])
    with pytest.raises(ValueError, match=fn + r"views\[0\] is a lazily conjugated/negated view"):
        capture_subviews(buf, [buf[:16].view(torch.complex64).conj()])
    with pytest.raises(TypeError, match=fn + r"views\[0\] must be a torch.Tensor, got int"):
        capture_subviews(buf, [3])


# --- pack / unpack ---------------------------------------------------------------------------------

def check_unpack(packed, tensors):
    got = packed.unpack()
    assert len(got) == len(tensors)
    for g, t in zip(got, tensors):
        assert_same_view(g, t)
        assert shares_storage(g, packed.data)
    return got


@pytest.mark.parametrize("numel", [0, 1, 7, (1 << 17) + 3])
def test_pack_mixed_dtypes_at_odd_offsets(gen, numel):
    # each tensor starts at an odd element offset of its own storage
    tensors = [random_tensor((numel + 3,), dtype, gen)[3:] for dtype in MIXED_DTYPES]
    packed = pack(tensors)
    assert packed.data.dtype == torch.uint8 and packed.data.device.type == "cpu"
    check_unpack(packed, tensors)
    for spec in packed.specs:
        assert spec.byte_offset % 256 == 0 or numel == 0  # separate storages: each span 256-aligned
    tensors[0][0:1] = 0  # packing copied: the buffer does not alias its inputs
    assert not shares_storage(packed.unpack()[0], tensors[0])


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_pack_every_layout_of_every_dtype(gen, dtype):
    named = list(layouts(dtype, gen))
    check_unpack(pack([t for _, t in named]), [t for _, t in named])


def test_pack_view_of_a_base_with_storage_offset():
    # §7.3 / §8.7: x is not a view but has storage offset 2; z is a view of x at storage offset 3
    x = torch.arange(10.0)[2:].detach()
    z = x[1:3]
    assert z._base is x and z.storage_offset() == 3
    got_x, got_z = check_unpack(pack([x, z]), [x, z])
    assert torch.equal(got_z, torch.tensor([3.0, 4.0]))
    got_x[1] = -1.0
    assert got_z[0] == -1.0


def test_pack_preserves_aliasing(gen):
    base = random_tensor((7, 9), torch.float32, gen)
    other = random_tensor((5,), torch.bfloat16, gen)
    tensors = [base[1:, 2:], other, base.t(), base.view(-1)[5:], base.view(torch.int32)[3], base[6, 8]]
    packed = pack(tensors)
    a, o, b, c, d, e = check_unpack(packed, tensors)
    a[0, 0] = 123.0  # base[1, 2]
    assert b[2, 1] == 123.0 and c[9 - 5 + 2] == 123.0
    e.fill_(-2.0)  # base[6, 8]
    assert a[5, 6] == -2.0 and b[8, 6] == -2.0
    assert d[2] == torch.tensor(base[3, 2].item()).view(torch.int32)  # untouched element, reinterpreted
    assert packed.specs[0].byte_offset - packed.specs[2].byte_offset == (1 * 9 + 2) * 4
    assert packed.specs[1].byte_offset % 256 == 0 and packed.specs[2].byte_offset % 256 == 0


def test_pack_view_as_real_aliases(gen):
    c = random_tensor((1001,), torch.complex64, gen)[1:]
    r = torch.view_as_real(c)
    got_r, got_c = check_unpack(pack([r, c]), [r, c])
    got_r[7, 0] = 5.0
    assert got_c[7].real == 5.0


def test_pack_resolves_conjugate_views(gen):
    c = random_tensor((9,), torch.complex64, gen)
    (got,) = pack([c.conj()]).unpack()
    assert not got.is_conj()
    assert torch.equal(bits(got), bits(c.conj().resolve_conj()))


def test_pack_alignment_and_zeroed_padding(gen):
    tensors = [random_tensor((n,), torch.uint8, gen) for n in (1, 7, 300)]
    for alignment, offsets in ((1, [0, 1, 8]), (16, [0, 16, 32]), (4096, [0, 4096, 8192])):
        packed = pack(tensors, alignment=alignment)
        assert [s.byte_offset for s in packed.specs] == offsets
        used = torch.zeros(packed.nbytes, dtype=torch.bool)
        for s in packed.specs:
            used[s.byte_offset:s.byte_offset + s.nbytes] = True
        assert not packed.data[~used].any()
        check_unpack(packed, tensors)
    # a complex128 span is aligned to its itemsize even when asked for less
    packed = pack([tensors[0], random_tensor((3,), torch.complex128, gen)], alignment=1)
    assert packed.specs[1].byte_offset == 16


def test_pack_edge_cases(gen):
    empty = pack([])
    assert empty.nbytes == 0 and empty.unpack() == [] and empty.specs == ()
    assert empty.offload().result().reload("cpu").result().nbytes == 0
    grad = random_tensor((5,), torch.float32, gen).requires_grad_()
    (got,) = check_unpack(pack([grad]), [grad.detach()])
    assert not got.requires_grad
    # empty views of a storage that also holds data do not move the others' offsets
    base = random_tensor((12,), torch.int16, gen)
    check_unpack(pack([base[12:], base[4:9], base[:0]]), [base[12:], base[4:9], base[:0]])
    assert pack([], device="cpu").device == torch.device("cpu")


@pytest.mark.parametrize("alignment", [0, 3, -256, 256.0, True])
def test_pack_rejects_bad_alignment(alignment):
    with pytest.raises(ValueError, match="pyxfer.buffers.pack: alignment must be a positive power of two"):
        pack([torch.zeros(1)], alignment=alignment)


def test_pack_rejects_non_tensors_and_meta():
    with pytest.raises(TypeError, match=r"pack: tensors\[1\] must be a torch.Tensor, got str"):
        pack([torch.zeros(1), "x"])
    with pytest.raises(ValueError, match=r"pack: tensors\[0\] is on the meta device"):
        pack([torch.zeros(1, device="meta")])


def test_spec_dict_round_trip_rebuilds_the_buffer(gen):
    tensors = [random_tensor((7, 3), d, gen).t() for d in MIXED_DTYPES]
    packed = pack(tensors)
    saved = json.dumps([s.to_dict() for s in packed.specs])
    rebuilt = PackedBuffer(packed.data.clone(), [SubviewSpec.from_dict(d) for d in json.loads(saved)])
    check_unpack(rebuilt, tensors)


# --- moving: .to, offload, reload ---------------------------------------------------------------

@pytest.mark.parametrize("verify", [True, False])
def test_to_cpu_through_verified_copy(gen, verify):
    dtypes = (torch.float8_e5m2, torch.int64, torch.bfloat16)
    tensors = [random_tensor((n,), d, gen)[1:] for n, d in zip((2, 8, 1 << 16), dtypes)]
    packed = pack(tensors)
    moved = packed.to("cpu", verify=verify)
    assert moved.specs == packed.specs and not shares_storage(moved.data, packed.data)
    assert torch.equal(moved.data, packed.data)
    check_unpack(moved, tensors)


def test_quantized_bulk_buffer_offload_reload(gen):
    buf, views = te_bulk_quantized(gen)
    packed = PackedBuffer(buf, capture_subviews(buf, views))
    assert [s.dtype for s in packed.specs] == [torch.uint8, torch.float32, torch.float32, torch.float32]
    handle = packed.offload()
    assert handle.event is None  # no CUDA: synchronous, waiting is a no-op
    handle.wait()
    host = handle.result()
    assert host.device.type == "cpu" and not shares_storage(host.data, buf)
    back = host.reload("cpu").result()
    assert not shares_storage(back.data, host.data)
    for got, want in zip(back.unpack(), views):
        assert_same_view(got, want)
    # the same views packed: one storage, one span, offsets kept
    repacked = pack(views)
    assert [s.byte_offset for s in repacked.specs] == [s.byte_offset for s in packed.specs]
    check_unpack(repacked, views)


def test_offload_reuses_its_host_buffer(gen):
    src = random_tensor((1001,), torch.bfloat16, gen)
    packed = pack([src[1:]])
    first = packed.offload().result()
    packed.data.fill_(0x3C)  # new contents in the same PackedBuffer, offloaded again
    second = packed.offload().result()
    assert second.data.data_ptr() == first.data.data_ptr()
    assert torch.equal(second.data, packed.data)
    assert (second.unpack()[0].view(torch.uint8) == 0x3C).all()
