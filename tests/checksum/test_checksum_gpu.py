"""PXH64 on CUDA: bit-identical to the CPU reference, on the data's device and current stream."""
import pytest
import torch

import pyxfer
from pyxfer.tools.selftest import TEST_VECTORS, as_tensor

from support.tensors import ALL_DTYPES, layouts, random_tensor

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name,data,seed,expected", TEST_VECTORS, ids=[v[0] for v in TEST_VECTORS])
def test_spec_vectors_on_cuda(name, data, seed, expected):
    assert pyxfer.checksum(as_tensor(data).cuda(), seed) == expected


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_cpu_equals_cuda_matrix(dtype, gen):
    for name, t in layouts(dtype, gen):
        # the same view (strides, storage offset) of the same base, rebuilt on the GPU
        base = t._base if t._base is not None else t
        gview = base.cuda().as_strided(t.shape, t.stride(), t.storage_offset() - base.storage_offset())
        for seed in (0, 0xDEADBEEFCAFEF00D):
            assert pyxfer.checksum(gview, seed) == pyxfer.checksum(t, seed), f"{dtype} {name} seed {seed}"


def test_every_alignment_and_length_on_cuda(gen):
    base = random_tensor((4096 + 64,), torch.uint8, gen)
    gbase = base.cuda()
    for offset in range(17):
        for n in list(range(0, 70)) + [1023, 1024, 1025, 4096 - 17]:
            got, want = pyxfer.checksum(gbase[offset:offset + n], 11), pyxfer.checksum(base[offset:offset + n], 11)
            assert got == want, (offset, n)


@pytest.mark.parametrize("offset", [0, 3, 8])
def test_large_sizes_on_cuda(gen, offset):
    n = (64 << 20) + 13  # many blocks, every code path of the kernel
    base = random_tensor((n + offset,), torch.uint8, gen)
    assert pyxfer.checksum(base.cuda()[offset:]) == pyxfer.checksum(base[offset:])


def test_more_than_2_pow_31_elements(gen):
    n = (1 << 31) + 37  # uint8: element indices and byte offsets past int32
    t = torch.empty(n, dtype=torch.uint8)
    t[:1 << 20] = random_tensor((1 << 20,), torch.uint8, gen)
    t[-(1 << 20):] = random_tensor((1 << 20,), torch.uint8, gen)
    t[1 << 20:-(1 << 20)] = 0x5A
    g = t.cuda()
    assert pyxfer.checksum(g) == pyxfer.checksum(t)
    g[-1] ^= 1  # a flip in the last byte, past 2^31, must be seen
    t[-1] ^= 1
    assert pyxfer.checksum(g) == pyxfer.checksum(t)
    del g
    torch.cuda.empty_cache()


def test_partial_sums_compose_on_cuda(gen):
    t = random_tensor((1_000_037,), torch.uint8, gen)
    g = t.cuda()
    cuts = [0, 8, 4096, 65_536 * 8, 999_992, t.numel()]
    partials = torch.stack([torch.ops.pyxfer.checksum_partial(g[a:b], a // 8, 5) for a, b in zip(cuts, cuts[1:])])
    assert partials.device == g.device
    whole = torch.ops.pyxfer.checksum_combine(partials, t.numel(), 5)
    assert whole.device == g.device
    assert pyxfer.checksums.as_uint64(whole) == pyxfer.checksum(t, 5)
    cpu_partials = torch.stack([torch.ops.pyxfer.checksum_partial(t[a:b], a // 8, 5) for a, b in zip(cuts, cuts[1:])])
    assert torch.equal(partials.cpu(), cpu_partials)


def test_runs_on_the_current_non_default_stream(gen):
    t = random_tensor((32 << 20,), torch.uint8, gen)
    expected = pyxfer.checksum(t)
    src = t.cuda()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        dst = torch.empty_like(src)
        torch.cuda._sleep(20_000_000)  # keep the stream busy: a hash on another stream would race
        dst.copy_(src)
        out = torch.ops.pyxfer.checksum(dst, 0)
    side.synchronize()
    assert pyxfer.checksums.as_uint64(out) == expected


def test_opcheck_and_compile_on_cuda(gen):
    for _name, t in layouts(torch.float16, gen, device="cuda"):
        torch.library.opcheck(torch.ops.pyxfer.checksum.default, (t, 3))
        torch.library.opcheck(torch.ops.pyxfer.checksum_partial.default, (t, 2, 3))
    torch.library.opcheck(torch.ops.pyxfer.checksum_combine.default,
                          (torch.randint(-2**62, 2**62, (4,), device="cuda"), 77, 1))
    f = torch.compile(lambda x: torch.ops.pyxfer.checksum(x + 1, 0), fullgraph=True)
    x = torch.randn(1000, device="cuda")
    assert pyxfer.checksums.as_uint64(f(x)) == pyxfer.checksum((x + 1).cpu())


@pytest.mark.multigpu
def test_data_on_cuda1_while_current_device_is_0(gen):
    t = random_tensor(((8 << 20) + 5,), torch.uint8, gen)
    torch.cuda.set_device(0)
    g1 = t.to("cuda:1")
    for offset in (0, 1, 8):
        out = torch.ops.pyxfer.checksum(g1[offset:], 0)
        assert out.device == torch.device("cuda:1")
        assert pyxfer.checksums.as_uint64(out) == pyxfer.checksum(t[offset:])
    assert torch.cuda.current_device() == 0
    # a busy non-default stream on cuda:1 made current there, while the current device stays 0:
    # the op must order itself after the copy queued on that stream
    side = torch.cuda.Stream(device=1)
    dst = torch.empty_like(g1)
    with torch.cuda.stream(side):
        torch.cuda._sleep(20_000_000)
        dst.copy_(g1)
    try:
        torch.cuda.set_stream(side)
        torch.cuda.set_device(0)
        assert torch.cuda.current_stream(1) == side and torch.cuda.current_device() == 0
        out = torch.ops.pyxfer.checksum(dst, 0)
    finally:
        torch.cuda.set_stream(torch.cuda.default_stream(1))
        torch.cuda.set_device(0)
    side.synchronize()
    assert pyxfer.checksums.as_uint64(out) == pyxfer.checksum(t)
