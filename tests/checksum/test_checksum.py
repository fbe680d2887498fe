"""PXH64 on the CPU (and on every device the test process sees, through the same entry points)."""
import os

import pytest
import torch

import pyxfer
from pyxfer.tools.selftest import TEST_VECTORS, as_tensor

from support.pxh64_reference import finalize, partial_np, pxh64_np, pxh64_py
from support.tensors import ALL_DTYPES, layouts, logical_bytes, random_tensor


@pytest.mark.parametrize("name,data,seed,expected", TEST_VECTORS, ids=[v[0] for v in TEST_VECTORS])
def test_spec_vectors(name, data, seed, expected):
    assert pxh64_py(data, seed) == expected  # the independent reference agrees with the spec
    assert pyxfer.checksum(as_tensor(data), seed) == expected


def test_result_is_a_0dim_int64_on_the_data_device():
    out = torch.ops.pyxfer.checksum(torch.arange(10), 0)
    assert out.shape == () and out.dtype == torch.int64 and out.device.type == "cpu"
    assert pyxfer.checksums.as_uint64(out) == pyxfer.checksum(torch.arange(10))


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_dtype_shape_view_offset_matrix(dtype, gen):
    for name, t in layouts(dtype, gen):
        expected = pxh64_np(logical_bytes(t))
        assert pyxfer.checksum(t) == expected, f"{dtype} {name}"
        assert pyxfer.checksum(t) == pyxfer.checksum(t.contiguous()), f"{dtype} {name}"


def test_every_alignment_and_length(gen):
    base = random_tensor((200,), torch.uint8, gen)
    for offset in range(17):
        for n in range(0, 41):
            t = base[offset:offset + n]
            assert pyxfer.checksum(t, 7) == pxh64_py(logical_bytes(t), 7), (offset, n)


def test_large_odd_size_against_numpy_reference(gen):
    t = random_tensor(((1 << 20) + 3,), torch.uint8, gen)
    seed = int.from_bytes(os.urandom(8), "little")
    assert pyxfer.checksum(t, seed) == pxh64_np(logical_bytes(t), seed)
    assert pyxfer.checksum(t[5:], seed) == pxh64_np(logical_bytes(t[5:]), seed)


# --- detection properties on random data -------------------------------------------------------

def _hash_bytes(b: bytearray) -> int:
    return pyxfer.checksum(as_tensor(bytes(b)))


def test_every_single_bit_flip_changes_the_hash(gen):
    data = bytearray(logical_bytes(random_tensor((1029,), torch.uint8, gen)))
    h = _hash_bytes(data)
    for byte in range(len(data)):  # every byte, a random bit each, plus every bit of a few bytes
        bit = int(torch.randint(0, 8, (1,), generator=gen))
        data[byte] ^= 1 << bit
        assert _hash_bytes(data) != h, (byte, bit)
        data[byte] ^= 1 << bit
    for byte in (0, 511, len(data) - 1):
        for bit in range(8):
            data[byte] ^= 1 << bit
            assert _hash_bytes(data) != h
            data[byte] ^= 1 << bit
    assert _hash_bytes(data) == h


def test_swapped_blocks_zeroed_and_truncated_data_change_the_hash(gen):
    data = bytearray(logical_bytes(random_tensor((64 * 37 + 5,), torch.uint8, gen)))
    h = _hash_bytes(data)
    for _ in range(20):
        i, j = sorted(torch.randperm(37, generator=gen)[:2].tolist())
        swapped = bytearray(data)
        swapped[64 * i:64 * i + 64], swapped[64 * j:64 * j + 64] = data[64 * j:64 * j + 64], data[64 * i:64 * i + 64]
        assert _hash_bytes(swapped) != h, (i, j)
    assert _hash_bytes(bytearray(len(data))) != h
    assert _hash_bytes(data[:-1]) != h
    assert _hash_bytes(data[1:]) != h
    assert _hash_bytes(data + b"\0") != h  # n enters the finalizer


# --- chunk composition -------------------------------------------------------------------------

def test_partial_sums_compose_to_the_whole(gen):
    t = random_tensor((100_003,), torch.uint8, gen)
    seed = int(torch.randint(0, 2**62, (1,), generator=gen))
    cuts = sorted({0, t.numel(), *(8 * int(c) for c in torch.randint(0, t.numel() // 8, (6,), generator=gen))})
    partials = [torch.ops.pyxfer.checksum_partial(t[a:b], a // 8, seed) for a, b in zip(cuts, cuts[1:])]
    for (a, b), p in zip(zip(cuts, cuts[1:]), partials):
        assert pyxfer.checksums.as_uint64(p) == partial_np(logical_bytes(t[a:b]), seed, a // 8)
    whole = torch.ops.pyxfer.checksum_combine(torch.stack(partials), t.numel(), seed)
    assert pyxfer.checksums.as_uint64(whole) == pyxfer.checksum(t, seed)
    acc = sum(pyxfer.checksums.as_uint64(p) for p in partials) % (1 << 64)
    assert finalize(acc, t.numel(), seed) == pyxfer.checksum(t, seed)


def test_large_seed_uses_all_64_bits():
    t = torch.arange(100, dtype=torch.int32)
    seed = (1 << 64) - 12345
    assert pyxfer.checksum(t, seed) == pxh64_py(logical_bytes(t), seed)


# --- torch integration -------------------------------------------------------------------------

def test_opcheck(gen):
    for _name, t in layouts(torch.float32, gen):
        torch.library.opcheck(torch.ops.pyxfer.checksum.default, (t, 3))
        torch.library.opcheck(torch.ops.pyxfer.checksum_partial.default, (t, 5, 3))
    partials = torch.randint(-2**63, 2**63 - 1, (5,), dtype=torch.int64, generator=gen)
    torch.library.opcheck(torch.ops.pyxfer.checksum_combine.default, (partials, 1000, 3))


def test_torch_compile(gen):
    @torch.compile(fullgraph=True, backend="inductor")
    def both(x, y):
        return torch.ops.pyxfer.checksum(x * 2, 0), torch.ops.pyxfer.checksum(y, 9)

    x = random_tensor((77, 3), torch.float32, gen)
    x = torch.nan_to_num(x)
    y = random_tensor((41,), torch.uint8, gen)
    hx, hy = both(x, y)
    assert pyxfer.checksums.as_uint64(hx) == pxh64_np(logical_bytes(x * 2))
    assert pyxfer.checksums.as_uint64(hy) == pxh64_np(logical_bytes(y), 9)


def test_meta_tensors_trace_but_have_no_value():
    out = torch.ops.pyxfer.checksum(torch.empty(5, device="meta"), 0)
    assert out.device.type == "meta" and out.dtype == torch.int64 and out.shape == ()
    with pytest.raises(ValueError, match=r"pyxfer.checksum: t is on the meta device"):
        pyxfer.checksum(torch.empty(5, device="meta"))


# --- bad input ---------------------------------------------------------------------------------

def test_bad_input_is_rejected_with_a_clear_error():
    t = torch.arange(8)
    with pytest.raises(ValueError,
                       match=r"pyxfer.checksum: t must be a dense strided tensor, got layout torch.sparse_coo"):
        pyxfer.checksum(t.to_sparse())
    with pytest.raises(ValueError, match=r"nested"):
        pyxfer.checksum(torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]))
    with pytest.raises(TypeError, match=r"pyxfer.checksum: t must be a torch.Tensor, got list"):
        pyxfer.checksum([1, 2])
    for seed, exc in ((1.5, TypeError), (True, TypeError), ("1", TypeError), (-1, ValueError), (1 << 64, ValueError)):
        with pytest.raises(exc, match=r"pyxfer.checksum: seed must be"):
            pyxfer.checksum(t, seed)
    with pytest.raises(RuntimeError, match=r"pyxfer.checksum_partial: word_offset must be >= 0, got -1"):
        torch.ops.pyxfer.checksum_partial(t, -1, 0)
    with pytest.raises(RuntimeError, match=r"partials must be a 1-D int64 tensor"):
        torch.ops.pyxfer.checksum_combine(torch.ones(3), 24, 0)
    with pytest.raises(RuntimeError, match=r"num_bytes must be >= 0"):
        torch.ops.pyxfer.checksum_combine(torch.ones(3, dtype=torch.int64), -5, 0)


def test_build_info():
    info = pyxfer.build_info()
    assert info["torch"] == torch.__version__.split("+")[0]
    assert info["torch_runtime"] == torch.__version__
    assert isinstance(info["cuda"], bool) and isinstance(info["cuda_archs"], list)
    assert info["cuda"] == bool(info["cuda_archs"])
