"""pyxfer.formats on CUDA: bit-identical to the CPU ops (which tests/formats/test_formats.py checks against
the independent numpy reference), on the data's device and current stream, for every format x
usage x input dtype x FP8 dtype x options, odd and large sizes, non-contiguous inputs; dequantize
on Hopper for every format; swizzle and swap_first_dims."""
import math

import numpy as np
import pytest
import torch

import pyxfer.formats as F

from support import formats_reference as R
from support.formats_checks import (
    BUFFERS,
    E4M3,
    E5M2,
    FP8_BLOCK,
    FP8_BLOCK_OPTIONS,
    IN_DTYPES,
    USAGES,
    assert_same,
    make_input,
    quantize,
    reference,
    reference_dequantize,
    tbits,
)

pytestmark = pytest.mark.gpu

FORMATS = ["fp8_block_1x128", "fp8_block_128x128", "mxfp8", "nvfp4"]
GPU_SHAPES = {
    "fp8_block_1x128": [(1, 300), (3, 200, 131), (2, 3, 5, 131), (1000, 1037), (5, 1), (260, 7), (4096, 4100),
                        (1, 5, 48), (1001, 1040)],  # odd numbers of 16-element row chunks (lane pairs)
    "mxfp8": [(32, 32), (2, 48, 160), (1, 3, 32, 64), (1024, 1056), (4, 512, 2080)],
    "nvfp4": [(16, 16), (3, 16, 48), (2, 5, 16, 80), (1024, 2064), (4, 512, 2080)],
}
GPU_SHAPES["fp8_block_128x128"] = GPU_SHAPES["fp8_block_1x128"]


def fp8_choices(fmt):
    return (None,) if fmt == "nvfp4" else (E4M3, E5M2)


def option_choices(fmt):
    if fmt in FP8_BLOCK:
        return FP8_BLOCK_OPTIONS
    if fmt == "nvfp4":
        return [{}, {"global_amax": "tensor"}]
    return [{}]


def resolve(opts, x):
    """'tensor' -> a 1-element global amax on x's device (a value below x's amax: saturation)."""
    if opts.get("global_amax") == "tensor":
        a = float(x.float().abs().max()) / 3.0
        return {**opts, "global_amax": torch.tensor([a], device=x.device)}
    return opts


def same_view_on(t, device):
    """The same view (shape, strides, storage offset) of the same base, rebuilt on `device`."""
    base = t._base if t._base is not None else t
    return base.to(device).as_strided(t.shape, t.stride(), t.storage_offset() - base.storage_offset())


def gpu_views(shape, dtype, gen):
    shape = tuple(shape)
    yield "contiguous", make_input(shape, dtype, gen)
    n = math.prod(shape)
    yield "offset", make_input((n + 5,), dtype, gen)[5:].view(shape)
    yield "strided-rows", make_input((shape[0] * 2,) + shape[1:], dtype, gen)[::2]
    yield "sliced-cols", make_input(shape[:-1] + (shape[-1] + 3,), dtype, gen)[..., 1:1 + shape[-1]]
    if len(shape) >= 2:
        yield "transposed", make_input(shape[:-2] + (shape[-1], shape[-2]), dtype, gen).transpose(-1, -2)


def assert_tensors_bitwise_equal(what, cpu, gpu, device=None):
    assert cpu is not None and gpu is not None, what
    assert gpu.is_cuda and (device is None or gpu.device == torch.device(device)), f"{what}: on {gpu.device}"
    assert cpu.dtype == gpu.dtype and cpu.shape == gpu.shape, \
        f"{what}: {gpu.dtype} {tuple(gpu.shape)} vs {cpu.dtype} {tuple(cpu.shape)}"
    c, g = tbits(cpu), tbits(gpu.cpu())
    if not np.array_equal(c, g):
        bad = np.argwhere(c != g)
        raise AssertionError(f"{what}: {len(bad)} of {c.size} differ, first at {bad[:4].tolist()}: "
                             f"cpu {[hex(int(c[tuple(i)])) for i in bad[:4]]} "
                             f"cuda {[hex(int(g[tuple(i)])) for i in bad[:4]]}")


def assert_qt_equal(what, qc, qg, device=None):
    assert type(qc) is type(qg) and qc.shape == qg.shape and qc.dtype == qg.dtype, what
    assert set(qc.buffers()) == set(qg.buffers()), what
    for name, t in qc.buffers().items():
        assert_tensors_bitwise_equal(f"{what} {name}", t, qg.buffers()[name], device)


@pytest.mark.parametrize("dtype", IN_DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
def test_cpu_equals_cuda_matrix(fmt, dtype, gen):
    inputs = [(str(s), make_input(s, dtype, gen, span=(-2, 2) if fmt == "nvfp4" else None)) for s in GPU_SHAPES[fmt]]
    vshape = {"mxfp8": (2, 64, 96), "nvfp4": (48, 80)}.get(fmt, (3, 130, 131))
    inputs += [(f"{vshape} {n}", t) for n, t in gpu_views(vshape, dtype, gen)]
    for name, x in inputs:
        xg = same_view_on(x, "cuda")
        assert xg.stride() == x.stride()
        for fp8 in fp8_choices(fmt):
            for opts in option_choices(fmt):
                oc, og = resolve(opts, x), resolve(opts, xg)
                for usage in USAGES:
                    what = f"{fmt} {dtype} {fp8} {opts} {usage} x{name}"
                    qc = quantize(x, fmt, usage, fp8, **oc)
                    qg = quantize(xg, fmt, usage, fp8, **og)
                    assert_qt_equal(what, qc, qg)
                    if usage != "both":
                        for od in (None, torch.float32):
                            assert_tensors_bitwise_equal(f"{what} dequantize({od})", qc.dequantize(od),
                                                         qg.dequantize(od))


@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_matches_the_reference(fmt, gen):
    """Not only CPU == CUDA: CUDA == the numpy reference directly, on one mid-size input per dtype."""
    shape = {"mxfp8": (3, 96, 224), "nvfp4": (3, 96, 224)}.get(fmt, (3, 200, 131))
    for dtype in IN_DTYPES:
        x = make_input(shape, dtype, gen, span=(-2, 2) if fmt == "nvfp4" else None)
        q = quantize(x.cuda(), fmt, "both")
        ref = reference(x, fmt)
        for name in BUFFERS:
            assert_same(f"{fmt} {dtype} cuda {name}", getattr(q, name).cpu(), ref[name], x)
        for usage in ("rowwise", "columnwise"):
            exp = reference_dequantize(ref, fmt, shape, usage == "columnwise")
            got = q.dequantize(torch.float32, usage=usage)
            assert got.is_cuda
            assert_same(f"{fmt} {dtype} cuda dequantize {usage}", got.cpu(), exp, x)


@pytest.mark.parametrize("fmt", FORMATS)
def test_large_input_at_least_64_MiB(fmt, gen):
    shape = (8192, 4160)  # bf16: 65 MiB; M and K multiples of 128 / 32
    x = make_input(shape, torch.bfloat16, gen, span=(-3, 3))
    assert x.numel() * x.element_size() >= 64 << 20
    xg = x.cuda()
    qc, qg = quantize(x, fmt, "both"), quantize(xg, fmt, "both")
    assert_qt_equal(f"{fmt} large", qc, qg)
    for usage in ("rowwise", "columnwise"):
        assert_tensors_bitwise_equal(f"{fmt} large dequantize {usage}", qc.dequantize(usage=usage),
                                     qg.dequantize(usage=usage))
    del xg, qg
    torch.cuda.empty_cache()


@pytest.mark.parametrize("fmt", ["fp8_block_1x128", "nvfp4"])
def test_more_than_65535_tile_rows(fmt, gen):
    """The tiles wholly inside x launch as 2-D grids of at most 65535 tile rows (blockIdx.y), so 65536
    tile rows take two launches, the second from tile row 65535; a partial tile row follows (its own
    launch). bf16 [65536 * 128 + 48, 128], 2 GiB (5 GiB of GPU memory with the results): CPU == CUDA for
    both usages."""
    if torch.cuda.get_device_properties(0).total_memory < 12 << 30:
        pytest.skip("needs 12 GiB of GPU memory (a 2 GiB input and its quantized buffers)")
    cuda_gen = torch.Generator("cuda").manual_seed(int(torch.randint(0, 2**62, (1,), generator=gen)))
    xg = torch.randn((65536 * 128 + 48, 128), device="cuda", dtype=torch.bfloat16, generator=cuda_gen) * 4
    qg = quantize(xg, fmt, "both")
    assert_qt_equal(f"{fmt} {tuple(xg.shape)}", quantize(xg.cpu(), fmt, "both"), qg)
    del xg, qg
    torch.cuda.empty_cache()


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_on_this_gpu_every_format(fmt, gen):
    """TE cannot dequantize MXFP8 below SM 100; pyxfer must, on whatever GPU runs this (Hopper)."""
    print("device capability", torch.cuda.get_device_capability())
    shape = {"mxfp8": (256, 320), "nvfp4": (256, 320)}.get(fmt, (257, 333))
    for fp8 in fp8_choices(fmt):
        x = make_input(shape, torch.float32, gen, span=(-2, 2) if fmt == "nvfp4" else None)
        qc = quantize(x, fmt, "both", fp8)
        qg = qc.to("cuda")
        assert all(t.is_cuda for t in qg.buffers().values())
        for usage in ("rowwise", "columnwise"):
            for od in IN_DTYPES:
                assert_tensors_bitwise_equal(f"{fmt} {fp8} dequantize {usage} {od}",
                                             qc.dequantize(od, usage=usage), qg.dequantize(od, usage=usage))


def test_dequantize_native_ops_on_cuda_with_hand_made_buffers(gen):
    """Random bytes as data and scales (within sane E8M0/E4M3/pow2 ranges): every decode path."""
    M, K = 96, 256
    for fp8 in (E4M3, E5M2):
        nan_free = [c for c in range(256) if np.isfinite(R.decode_fp8(np.uint8(c), "e4m3" if fp8 == E4M3 else "e5m2"))]
        pick = torch.tensor(nan_free, dtype=torch.uint8)
        data = pick[torch.randint(0, len(nan_free), (M, K), generator=gen)]
        e8 = torch.randint(100, 160, (128, 8), generator=gen, dtype=torch.int32).to(torch.uint8)
        ce8 = torch.randint(100, 160, (4, 256), generator=gen, dtype=torch.int32).to(torch.uint8)
        for cw, s in ((False, e8), (True, ce8)):
            for od in IN_DTYPES:
                c = torch.ops.pyxfer.dequantize_mxfp8(data, s, cw, fp8, od)
                g = torch.ops.pyxfer.dequantize_mxfp8(data.cuda(), s.cuda(), cw, fp8, od)
                assert_tensors_bitwise_equal(f"dequantize_mxfp8 {fp8} cw={cw} {od}", c, g)
        s1 = torch.randn(2, 96, generator=gen).abs() + 0.01
        for od in IN_DTYPES:
            c = torch.ops.pyxfer.dequantize_fp8_block(data, s1, 1, False, fp8, od)
            g = torch.ops.pyxfer.dequantize_fp8_block(data.cuda(), s1.cuda(), 1, False, fp8, od)
            assert_tensors_bitwise_equal(f"dequantize_fp8_block {fp8} {od}", c, g)
    packed = torch.randint(0, 256, (M, K // 2), generator=gen, dtype=torch.int32).to(torch.uint8)
    s8 = torch.randint(0, 0x7F, (128, 16), generator=gen, dtype=torch.int32).to(torch.uint8)
    amax = torch.tensor([37.5])
    for od in IN_DTYPES:
        c = torch.ops.pyxfer.dequantize_nvfp4(packed, s8, amax, False, od)
        g = torch.ops.pyxfer.dequantize_nvfp4(packed.cuda(), s8.cuda(), amax.cuda(), False, od)
        assert_tensors_bitwise_equal(f"dequantize_nvfp4 {od}", c, g)


def assert_every_format_cpu_equals_cuda(what, x, nvfp4_global_amax):
    """x (on the CPU) quantized with both usages in every format and FP8 dtype, on the CPU and on cuda."""
    xg = x.cuda()
    for fmt in FORMATS:
        for fp8 in fp8_choices(fmt):
            opts = {"global_amax": nvfp4_global_amax} if fmt == "nvfp4" else {}
            assert_qt_equal(f"{fmt} {x.dtype} {fp8} {what}", quantize(x, fmt, "both", fp8, **opts),
                            quantize(xg, fmt, "both", fp8, **opts))


def negative_nans(n, dtype):
    """n NaNs of dtype with the sign bit set, quiet and signaling, with payloads (float("nan") is +NaN)."""
    int_dtype, quiet, signaling = {torch.float32: (torch.int32, -(1 << 22), -(1 << 23) + 1),
                                   torch.bfloat16: (torch.int16, -64, -127),
                                   torch.float16: (torch.int16, -512, -1023)}[dtype]
    bits = [(quiet if i % 2 == 0 else signaling) + i // 2 for i in range(n)]
    x = torch.tensor(bits, dtype=int_dtype).view(dtype)
    assert bool(x.isnan().all()) and bool((x.view(int_dtype) < 0).all())
    return x


def test_nan_and_inf_inputs_cpu_equals_cuda(gen):
    """Not specified bit-exactly by the spec (§9), but CPU and CUDA must still agree: every NaN, of
    either sign, encodes as the format's positive NaN (FP8) or +6 (NVFP4)."""
    for dtype in IN_DTYPES:
        x = make_input((64, 256), dtype, gen, span=(-2, 2))
        x[0, 3] = float("nan")
        x[1, 7] = float("inf")
        x[2, 130] = -float("inf")
        x[40, 9] = float("nan")
        x[5, 200] = -0.0
        x[7, 33:37] = negative_nans(4, dtype)
        x[10, 48:64] = negative_nans(16, dtype)  # a whole NVFP4 row block
        x[16:32, 250] = negative_nans(16, dtype)  # a whole NVFP4 column block
        assert_every_format_cpu_equals_cuda("nan/inf", x, 100.0)


def subnormals(shape, dtype, gen):
    """Random nonzero subnormals of dtype, either sign: k * (smallest subnormal), 0 < k < 2^mantissa bits."""
    bits = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}[dtype]
    k = torch.randint(1, 2**bits, shape, generator=gen, dtype=torch.float64)
    sign = torch.randint(0, 2, shape, generator=gen, dtype=torch.float64) * 2 - 1
    x = (sign * k * (torch.finfo(dtype).smallest_normal * 2.0**-bits)).to(dtype)  # exact
    assert bool(((x != 0) & (x.abs() < torch.finfo(dtype).smallest_normal)).all()), "not all subnormal"
    return x


def test_amax_edge_blocks_cpu_equals_cuda(gen):
    """16-bit inputs take their |x| maxima two values per instruction on the GPU: blocks and tiles that
    are all NaN (the amax of a NaN-only group is +0, as the fp32 chain from +0 gives), all
    subnormal, all -0 or mixed NaN / subnormal must still agree with the CPU."""
    for dtype in IN_DTYPES:
        x = make_input((256, 384), dtype, gen, span=(-2, 2))
        x[0:128, 0:128] = float("nan")                       # a whole 128x128 tile (every usage, every block)
        x[130, 128:256] = float("nan")                       # a whole 1x128 row block
        x[128:256, 300] = float("nan")                       # a whole 128-row column block
        x[140, 256:288] = -0.0                               # a 32-element (MXFP8) row block of -0
        x[160:192, 320:384] = subnormals((32, 64), dtype, gen)  # subnormal-only blocks of every format
        x[200, 256:384] = subnormals((128,), dtype, gen)
        x[200, 260] = float("nan")                           # NaN among subnormals
        assert_every_format_cpu_equals_cuda("edge blocks", x, 4.0)


def test_nvfp4_encodes_near_the_clamp_cpu_equals_cuda(gen):
    """The CUDA NVFP4 encodes skip their clamp to 6 where every block of a warp (rowwise) or a tile
    (columnwise) scales below 7 and holds no NaN: global amaxes that saturate the block scales (below
    the data's amax), leave them normal, or put them among E4M3's subnormals (scaled values up to 9),
    and a negative one (which quantize rejects; the native op, which does not check a tensor's value,
    is compared directly: its scale bytes are E4M3's negative half);
    data of one magnitude and of many; a NaN in one tile only, so one tile clamps and the others need
    not; whole tiles, partial edge tiles and a misaligned view; every usage."""
    for dtype in IN_DTYPES:
        for span in ((0.0, 0.0), (-4.0, 4.0)):
            inputs = [make_input((384, 512), dtype, gen, span=span), make_input((400, 528), dtype, gen, span=span),
                      make_input((400, 531), dtype, gen, span=span)[:, 1:529]]
            for x in inputs:
                x[300, 400] = float("nan")
                amax = float(x.float().nan_to_num(0.0).abs().max())
                xg = same_view_on(x, "cuda")
                for ga in (amax / 3, amax, amax * 64, amax * 4096, -amax):
                    for usage in USAGES:
                        what = f"nvfp4 {dtype} {tuple(x.shape)} {x.stride()} span {span} global amax {ga:g} {usage}"
                        if ga < 0:
                            rw, cw = USAGES[usage]
                            c = torch.ops.pyxfer.quantize_nvfp4(x, torch.tensor([ga]), rw, cw)
                            g = torch.ops.pyxfer.quantize_nvfp4(xg, torch.tensor([ga], device="cuda"), rw, cw)
                            for name, bc, bg in zip(BUFFERS, c, g):
                                assert_tensors_bitwise_equal(f"{what} {name}", bc, bg)
                            continue
                        assert_qt_equal(what, quantize(x, "nvfp4", usage, global_amax=torch.tensor([ga])),
                                        quantize(xg, "nvfp4", usage, global_amax=torch.tensor([ga], device="cuda")))


def test_zero_size_on_cuda():
    for fmt in FORMATS:
        x = torch.empty(0, 128, device="cuda")
        q = quantize(x, fmt, "both")
        assert all(t.is_cuda for t in q.buffers().values())
        assert q.dequantize().shape == (0, 128) and q.dequantize().is_cuda


def test_nvfp4_default_global_amax_on_the_device(gen):
    x = make_input((3, 64, 96), torch.bfloat16, gen, span=(-2, 2))
    qg = F.quantize(x.cuda(), "nvfp4", columnwise=True)
    assert qg.amax_rowwise.is_cuda and float(qg.amax_rowwise[0]) == float(x.float().abs().max())
    assert_qt_equal("nvfp4 default amax", F.quantize(x, "nvfp4", columnwise=True), qg)
    with pytest.raises(ValueError, match="global_amax"):
        F.quantize(x.cuda(), "nvfp4", global_amax=torch.tensor([1.0]))  # amax on another device


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_swizzle_on_cuda(fmt, gen):
    x = make_input((3, 64, 96), torch.float32, gen, span=(-2, 2))
    qc = quantize(x, fmt, "both")
    qg = quantize(x.cuda(), fmt, "both")
    sc, sg = qc.with_swizzled_scales(), qg.with_swizzled_scales()
    assert_qt_equal(f"{fmt} swizzled", sc, sg)
    assert_qt_equal(f"{fmt} compact again", qc, sg.with_compact_scales())
    assert_tensors_bitwise_equal(f"{fmt} swizzled dequantize", sc.dequantize(), sg.dequantize())
    for shape, tr in (((256, 8), False), ((8, 384), True)):
        s = torch.randint(0, 256, shape, generator=gen, dtype=torch.int32).to(torch.uint8)
        assert_tensors_bitwise_equal("swizzle_scales", F.swizzle_scales(s, transpose=tr),
                                     F.swizzle_scales(s.cuda(), transpose=tr))
        assert torch.equal(F.unswizzle_scales(F.swizzle_scales(s.cuda(), transpose=tr), transpose=tr).cpu(), s)


def test_swap_first_dims_cpu_equals_cuda(gen):
    for shape, dtype in (((3, 5), torch.uint8), ((2, 7, 3), torch.float32), ((4, 1, 6, 5), torch.int32),
                         ((2, 1000, 1031), torch.uint8), ((8, 4096, 512), torch.uint8), ((3, 129, 257), torch.float32),
                         ((1, 9), torch.bfloat16), ((5, 3, 0), torch.uint8)):
        src = torch.randint(0, 200, shape, generator=gen).to(dtype)
        c = torch.ops.pyxfer.swap_first_dims(src)
        g = torch.ops.pyxfer.swap_first_dims(src.cuda())
        assert g.is_cuda and torch.equal(c, g.cpu()), shape
        assert torch.equal(c, src.transpose(0, 1).contiguous()), shape


def test_runs_on_the_current_non_default_stream(gen):
    x = make_input((2048, 4096), torch.bfloat16, gen, span=(-2, 2))
    expected = {fmt: quantize(x, fmt, "both") for fmt in FORMATS}
    src = x.cuda()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        results = {}
        for fmt in FORMATS:
            dst = torch.empty_like(src)
            torch.cuda._sleep(20_000_000)  # keep the stream busy: work on another stream would race
            dst.copy_(src)
            results[fmt] = quantize(dst, fmt, "both")
            results[fmt + " dq"] = results[fmt].dequantize(torch.float32)
    side.synchronize()
    for fmt in FORMATS:
        assert_qt_equal(f"{fmt} side stream", expected[fmt], results[fmt])
        assert_tensors_bitwise_equal(f"{fmt} side stream dequantize", expected[fmt].dequantize(torch.float32),
                                     results[fmt + " dq"])


def test_opcheck_on_cuda(gen):
    ops = torch.ops.pyxfer
    x = make_input((2, 32, 64), torch.bfloat16, gen).cuda()
    xf = make_input((32, 160), torch.float32, gen).cuda()
    torch.library.opcheck(ops.quantize_fp8_block.default, (x, 1, True, True, E4M3, True, 0.0))
    torch.library.opcheck(ops.quantize_fp8_block.default, (xf.t(), 2, True, True, E5M2, False, 1e-3))
    rd, rs, cd, cs = ops.quantize_fp8_block(xf, 1, True, True, E4M3, True, 0.0)
    torch.library.opcheck(ops.dequantize_fp8_block.default, (rd, rs, 1, False, E4M3, torch.bfloat16))
    torch.library.opcheck(ops.dequantize_fp8_block.default, (cd, cs, 1, True, E4M3, torch.float32))
    torch.library.opcheck(ops.quantize_mxfp8.default, (x, True, True, E4M3))
    rd, rs, cd, cs = ops.quantize_mxfp8(xf, True, True, E5M2)
    torch.library.opcheck(ops.dequantize_mxfp8.default, (rd, rs, False, E5M2, torch.float16))
    torch.library.opcheck(ops.dequantize_mxfp8.default, (cd, cs, True, E5M2, torch.float32))
    amax = xf.abs().amax().reshape(1)
    torch.library.opcheck(ops.quantize_nvfp4.default, (xf, amax, True, True))
    rd, rs, cd, cs = ops.quantize_nvfp4(xf, amax, True, True)
    torch.library.opcheck(ops.dequantize_nvfp4.default, (rd, rs, amax, False, torch.bfloat16))
    torch.library.opcheck(ops.dequantize_nvfp4.default, (cd, cs, amax, True, torch.float32))
    torch.library.opcheck(ops.swap_first_dims.default, (torch.randint(0, 9, (3, 4, 5), device="cuda").to(torch.uint8),))


def test_torch_compile_on_cuda(gen):
    x = make_input((256, 512), torch.bfloat16, gen, span=(-2, 2))

    def f(t):
        rd, rs, cd, cs = torch.ops.pyxfer.quantize_mxfp8(t * 2, True, True, E4M3)
        return torch.ops.pyxfer.dequantize_mxfp8(cd, cs, True, E4M3, torch.float32)

    got = torch.compile(f, fullgraph=True)(x.cuda())
    ref = reference(x * 2, "mxfp8")
    assert_same("compiled cuda mxfp8 round trip", got.cpu(), reference_dequantize(ref, "mxfp8", (256, 512), True))


@pytest.mark.multigpu
def test_data_on_cuda1_while_current_device_is_0(gen):
    torch.cuda.set_device(0)
    x = make_input((3, 160, 256), torch.bfloat16, gen, span=(-2, 2))
    for fmt in FORMATS:
        for fp8 in fp8_choices(fmt):
            xg = x.to("cuda:1")
            for view_name, v, vg in (("contiguous", x, xg), ("transposed", x.transpose(0, 1), xg.transpose(0, 1))):
                qc = quantize(v, fmt, "both", fp8)
                qg = quantize(vg, fmt, "both", fp8)
                assert_qt_equal(f"{fmt} {fp8} {view_name} on cuda:1", qc, qg, device="cuda:1")
                for usage in ("rowwise", "columnwise"):
                    d = qg.dequantize(torch.float32, usage=usage)
                    assert d.device == torch.device("cuda:1")
                    assert_tensors_bitwise_equal(f"{fmt} cuda:1 dequantize {usage}",
                                                 qc.dequantize(torch.float32, usage=usage), d)
                if fmt in ("mxfp8", "nvfp4"):
                    assert_qt_equal(f"{fmt} cuda:1 swizzled", qc.with_swizzled_scales(), qg.with_swizzled_scales(),
                                    device="cuda:1")
            assert torch.cuda.current_device() == 0
    s = torch.randint(0, 256, (3, 1000, 17), generator=gen, dtype=torch.int32).to(torch.uint8)
    out = torch.ops.pyxfer.swap_first_dims(s.to("cuda:1"))
    assert out.device == torch.device("cuda:1") and torch.equal(out.cpu(), s.transpose(0, 1).contiguous())
    # a busy non-default stream current on cuda:1 while the current device stays 0
    src = x.to("cuda:1")
    expected = {fmt: quantize(x, fmt, "both") for fmt in FORMATS}
    side = torch.cuda.Stream(device=1)
    dst = torch.empty_like(src)
    with torch.cuda.stream(side):
        torch.cuda._sleep(20_000_000)
        dst.copy_(src)
    try:
        torch.cuda.set_stream(side)
        torch.cuda.set_device(0)
        assert torch.cuda.current_stream(1) == side and torch.cuda.current_device() == 0
        results = {fmt: quantize(dst, fmt, "both") for fmt in FORMATS}
        deq = {fmt: results[fmt].dequantize(torch.float32) for fmt in FORMATS}
    finally:
        torch.cuda.set_stream(torch.cuda.default_stream(1))
        torch.cuda.set_device(0)
    side.synchronize()
    for fmt in FORMATS:
        assert_qt_equal(f"{fmt} cuda:1 side stream", expected[fmt], results[fmt], device="cuda:1")
        assert_tensors_bitwise_equal(f"{fmt} cuda:1 side stream dequantize", expected[fmt].dequantize(torch.float32),
                                     deq[fmt])


@pytest.mark.multigpu
def test_quantized_tensor_to_another_gpu(gen):
    x = make_input((2, 64, 128), torch.float16, gen, span=(-2, 2))
    for fmt in FORMATS:
        q0 = quantize(x.to("cuda:0"), fmt, "both")
        q1 = q0.to("cuda:1")
        assert type(q1) is type(q0) and all(t.device == torch.device("cuda:1") for t in q1.buffers().values())
        assert_qt_equal(f"{fmt} moved", quantize(x, fmt, "both"), q1, device="cuda:1")
        assert torch.equal(q1.dequantize().cpu(), q0.dequantize().cpu())
