"""pyxfer.formats on the CPU: the spec's worked values (docs/specs/quantized-formats.md §8), then
bit-exact agreement with the independent numpy reference (tests/support/formats_reference.py) on fresh
random data for every format x usage x input dtype x FP8 dtype x options, odd shapes, partial edge
blocks, non-contiguous inputs; error bounds; the QuantizedTensor API; bad inputs; opcheck."""
import math

import numpy as np
import pytest
import torch

import pyxfer.formats as F

from support import formats_reference as R
from support.formats_checks import (
    BUFFERS,
    DTYPE_NAME,
    E4M3,
    E5M2,
    FP8_BLOCK,
    FP8_BLOCK_OPTIONS,
    FP8_NAME,
    IN_DTYPES,
    USAGES,
    assert_same,
    check_dequantize,
    check_quantized,
    make_input,
    np32,
    quantize,
    reference,
    reference_dequantize,
    tbits,
    views,
)

# ------------------------------------------------------------------------------------------------
# the reference itself (cheap self-checks, so a broken reference cannot pass silently)
# ------------------------------------------------------------------------------------------------

def test_reference_encoders_match_exact_rational_rounding(gen):
    vals = [0.0, 448.0, 449.0, 464.0, 480.0, 500.0, 1e9, 2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -11,
            2.0 ** -6 * 1.0625, 2.0 ** -6 * 1.1875, 57344.0, 61440.0, 2.0 ** -16, 2.0 ** -17, 3 * 2.0 ** -18,
            0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 1e-45, 1e-40]
    rnd = (torch.randn(300, generator=gen) * 10.0 ** (torch.rand(300, generator=gen) * 12 - 6)).tolist()
    xs = np.array([v for v in vals + rnd] + [-v for v in vals if v], dtype=np.float32)
    for fmt in ("e4m3", "e5m2", "e2m1"):
        fast = R._encode_narrow(xs, fmt)
        for v, c in zip(xs.tolist(), fast.tolist()):
            if v == 0.0:
                continue
            assert c == R.encode_exact(v, fmt), (fmt, v, hex(c))


def test_reference_e8m0_rules():
    assert list(R.float_to_e8m0(np.array([0.0, np.inf, np.nan], np.float32))) == [0x00, 0xFE, 0xFF]
    assert R.exp2f(0).view(np.uint32) == 0x00400000 and R.exp2f_rcp(254).view(np.uint32) == 0x00400000
    assert R.exp2f(254) == 2.0 ** 127 and R.exp2f_rcp(0) == 2.0 ** 127 and np.isnan(R.exp2f(255))
    sub = np.array([0x00400000, 0x00400001, 0x00000001, 0x007FFFFF], np.uint32).view(np.float32)
    assert list(R.float_to_e8m0(sub)) == [0, 1, 0, 1]
    assert R.float_to_e8m0(np.float32(3.4e38)) == 0xFE  # 2^128 would be needed: saturates


# ------------------------------------------------------------------------------------------------
# §8.1 MXFP8 one block
# ------------------------------------------------------------------------------------------------

X81 = [1000.0, -1.0, 0.3, 250.0, -0.001, 7.0, -448.0, 3.0e-5]


def _block81(dtype=torch.float32, column=False):
    x = torch.zeros(32, 32, dtype=torch.float32)
    v = torch.tensor(X81 + [0.0] * 24)
    if column:
        x[:, 0] = v
    else:
        x[0] = v
    return x.to(dtype)


@pytest.mark.parametrize("column", [False, True], ids=["rowwise", "columnwise"])
def test_spec_8_1_mxfp8_e4m3(column):
    qt = F.quantize(_block81(column=column), "mxfp8", rowwise=not column, columnwise=column)
    if column:
        data, scale = qt.columnwise_data[:, 0], qt.columnwise_scale_inv[0, 0]
    else:
        data, scale = qt.rowwise_data[0], qt.rowwise_scale_inv[0, 0]
    assert int(scale) == 0x81  # TE round-up rule; OCP floor would give 0x80
    assert bytes(data.tolist()) == bytes.fromhex("78a81a68803eee00") + bytes(24)
    deq = qt.dequantize(dtype=torch.float32)
    deq = deq[:, 0] if column else deq[0]
    assert deq[:8].tolist() == [1024.0, -1.0, 0.3125, 256.0, -0.0, 7.0, -448.0, 0.0]
    assert math.copysign(1.0, float(deq[4])) == -1.0  # -0 keeps its sign
    assert torch.count_nonzero(deq[8:]) == 0


def test_spec_8_1_mxfp8_e5m2():
    qt = F.quantize(_block81(), "mxfp8", fp8_dtype=E5M2)
    assert int(qt.rowwise_scale_inv[0, 0]) == 0x7A
    assert bytes(qt.rowwise_data[0, :8].tolist()) == bytes.fromhex("78d04970a85bf314")
    assert qt.dequantize(dtype=torch.float32)[0, :8].tolist() == [
        1024.0, -1.0, 0.3125, 256.0, -0.0009765625, 7.0, -448.0, 3.0517578125e-05]


def test_spec_8_1_bf16_input():
    qt = F.quantize(_block81(torch.bfloat16), "mxfp8")
    assert int(qt.rowwise_scale_inv[0, 0]) == 0x81
    got = qt.rowwise_data[0, :8].tolist()
    want = list(bytes.fromhex("78a81a68803eee00"))
    assert [got[i] for i in (0, 1, 3, 5, 6)] == [want[i] for i in (0, 1, 3, 5, 6)]


# ------------------------------------------------------------------------------------------------
# §8.2 E8M0 table
# ------------------------------------------------------------------------------------------------

E8M0_TABLE = [  # amax, E4M3, E5M2
    (0.0, 0x00, 0x00), (1.0, 0x77, 0x70), (1.75, 0x77, 0x70),
    (float(np.nextafter(np.float32(1.75), np.float32(2))), 0x78, 0x71), (2.0, 0x78, 0x71),
    (float(np.nextafter(np.float32(448), np.float32(0))), 0x7F, 0x78), (448.0, 0x7F, 0x78),
    (float(np.nextafter(np.float32(448), np.float32(1000))), 0x80, 0x79), (896.0, 0x80, 0x79),
    (1e-30, 0x13, 0x0C), (3e38, 0xF7, 0xF0),
]


def test_spec_8_2_e8m0_table_reference():
    for amax, e4, e5 in E8M0_TABLE + [(float("inf"), 0xFE, 0xFE), (float("nan"), 0xFF, 0xFF)]:
        assert int(R.mxfp8_e8m0_from_amax(np.float32(amax), "e4m3")) == e4, amax
        assert int(R.mxfp8_e8m0_from_amax(np.float32(amax), "e5m2")) == e5, amax


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=str)
def test_spec_8_2_e8m0_table(fp8_dtype):
    col = 1 if fp8_dtype == E4M3 else 2
    x = torch.zeros(32, 32)
    for i, row in enumerate(E8M0_TABLE):
        x[i, 3] = row[0]  # the amax of row i's first block; columnwise: of column 3's block
        x[i, 7] = -row[0] / 2
    qt = F.quantize(x, "mxfp8", rowwise=True, columnwise=False, fp8_dtype=fp8_dtype)
    for i, row in enumerate(E8M0_TABLE):
        assert int(qt.rowwise_scale_inv[i, 0]) == row[col], (row, hex(int(qt.rowwise_scale_inv[i, 0])))
    for row in E8M0_TABLE:  # columnwise: one 32x1 block per column
        xc = torch.zeros(32, 32)
        xc[5, 2] = row[0]
        qc = F.quantize(xc, "mxfp8", rowwise=False, columnwise=True, fp8_dtype=fp8_dtype)
        assert int(qc.columnwise_scale_inv[0, 2]) == row[col], row


def test_spec_8_2_e8m0_decode_extremes():
    """exp2f: e = 0 decodes as 2^-127 (fp32 0x00400000), e = 254 as 2^127."""
    data = torch.full((32, 32), 0x38, dtype=torch.uint8)  # E4M3 1.0
    scale = torch.zeros(128, 4, dtype=torch.uint8)
    scale[1, 0] = 254
    scale[2, 0] = 127
    out = torch.ops.pyxfer.dequantize_mxfp8(data, scale, False, E4M3, torch.float32)
    b = tbits(out)
    assert b[0, 0] == 0x00400000 and b[1, 0] == 0x7F000000 and b[2, 0] == 0x3F800000
    cscale = torch.zeros(4, 128, dtype=torch.uint8)
    cscale[0, 5] = 254
    outc = torch.ops.pyxfer.dequantize_mxfp8(data, cscale, True, E4M3, torch.float32)
    assert tbits(outc)[31, 5] == 0x7F000000 and tbits(outc)[31, 4] == 0x00400000


# ------------------------------------------------------------------------------------------------
# §8.3 FP8 block 1x128
# ------------------------------------------------------------------------------------------------

J83 = [0, 1, 33, 63, 64, 65, 100, 127]


@pytest.mark.parametrize("pow2,scale_inv_bits,expected", [
    (True, 0x3C800000, "f8 f8 f0 c8 00 48 71 78"),
    (False, 0x3C124925, "fe fe f6 ce 00 4e 78 7e"),
])
def test_spec_8_3_fp8_block_1x128_ramp(pow2, scale_inv_bits, expected):
    x = ((torch.arange(128) - 64) / 16.0).reshape(1, 128)
    qt = F.quantize(x, "fp8_block_1x128", pow2_scales=pow2)
    assert tbits(qt.rowwise_scale_inv)[0, 0] == scale_inv_bits
    assert [int(qt.rowwise_data[0, j]) for j in J83] == [int(b, 16) for b in expected.split()]
    if not pow2:
        assert abs(float(qt.dequantize(dtype=torch.float32)[0, 100]) - 2.2857143) < 1e-6
    # the same values as one column: columnwise 128x1 block
    qc = F.quantize(x.reshape(128, 1), "fp8_block_1x128", rowwise=False, columnwise=True, pow2_scales=pow2)
    assert tbits(qc.columnwise_scale_inv)[0, 0] == scale_inv_bits
    assert [int(qc.columnwise_data[0, j]) for j in J83] == [int(b, 16) for b in expected.split()]
    # 128x128 with the ramp in one row of an otherwise zero tile: same scale (fp32 division there)
    x2 = torch.zeros(128, 128)
    x2[7] = x[0]
    q2 = F.quantize(x2, "fp8_block_128x128", pow2_scales=pow2)
    assert tbits(q2.rowwise_scale_inv)[0, 0] == scale_inv_bits
    assert [int(q2.rowwise_data[7, j]) for j in J83] == [int(b, 16) for b in expected.split()]


def test_spec_8_3_other_cases():
    x = torch.zeros(4, 128)
    x[0, :3] = torch.tensor([3.0, -1.0, 0.1])
    x[2] = 1e-6
    q = F.quantize(x, "fp8_block_1x128")
    assert float(q.rowwise_scale_inv[0, 0]) == 0.0078125
    assert bytes(q.rowwise_data[0, :3].tolist()) == bytes.fromhex("7cf055")
    assert float(q.rowwise_scale_inv[0, 1]) == 1.0 and int(q.rowwise_data[1].count_nonzero()) == 0
    q = F.quantize(x, "fp8_block_1x128", pow2_scales=False)
    assert bytes(q.rowwise_data[0, :3].tolist()) == bytes.fromhex("7ef157")
    assert abs(float(q.rowwise_scale_inv[0, 0]) - 0.0066964286) < 1e-9
    assert tbits(q.rowwise_scale_inv)[0, 0] == R.scale_inv_1d(np.float32(448.0) / np.float32(3.0)).view(np.uint32)
    q = F.quantize(x, "fp8_block_1x128", amax_epsilon=1e-3)
    assert float(q.rowwise_scale_inv[0, 2]) == 3.814697265625e-06
    assert set(q.rowwise_data[2].tolist()) == {0x28}


@pytest.mark.parametrize("dtype,pow2", [(torch.bfloat16, True), (torch.float32, True),
                                        (torch.bfloat16, False), (torch.float32, False)])
def test_spec_8_3_scale_overflow_uses_input_dtype_max(dtype, pow2):
    x = torch.zeros(2, 128, dtype=dtype)
    x[0, 5] = 1e-39
    x[1, :] = 1e-39
    for fmt in FP8_BLOCK:
        q = F.quantize(x, fmt, columnwise=True, pow2_scales=pow2)
        ref = reference(x, fmt, pow2_scales=pow2)
        check_quantized(q, ref, "both", x, f"{fmt} {dtype} tiny")
        if pow2:
            assert tbits(q.rowwise_scale_inv)[0, 0] == 0x00400000  # 2^-127
    # and the overflow value itself: bf16 max 0x1.FEp127 vs FLT_MAX, visible without pow2
    if not pow2:
        s = R.fp8_block_scale(np.float32(1e-39), in_dtype=DTYPE_NAME[dtype], pow2=False)
        assert float(s) == (R.BF16_MAX if dtype == torch.bfloat16 else R.FLT_MAX)


def test_spec_8_3_layout_shapes():
    x = torch.randn(256, 384)
    q = F.quantize(x, "fp8_block_1x128", columnwise=True)
    assert q.rowwise_scale_inv.shape == (3, 256) and q.columnwise_data.shape == (384, 256)
    assert q.columnwise_scale_inv.shape == (2, 384) and q.rowwise_data.shape == (256, 384)
    q = F.quantize(x, "fp8_block_128x128", columnwise=True)
    assert q.rowwise_scale_inv.shape == (2, 4) and q.columnwise_scale_inv.shape == (3, 4)
    q = F.quantize(torch.randn(202, 384), "fp8_block_1x128", columnwise=True)
    assert q.rowwise_scale_inv.shape == (3, 204) and q.columnwise_scale_inv.shape == (2, 384)
    assert torch.count_nonzero(q.rowwise_scale_inv[:, 202:]) == 0  # padding is zeroed
    q = F.quantize(torch.randn(3, 5, 200), "fp8_block_1x128", columnwise=True)
    assert q.columnwise_data.shape == (200, 3, 5) and q.columnwise_scale_inv.shape == (1, 200)
    assert q.rowwise_scale_inv.shape == (2, 16)
    for t in (q.rowwise_scale_inv, q.columnwise_scale_inv):
        assert t.dtype == torch.float32
    for t in (q.rowwise_data, q.columnwise_data):
        assert t.dtype == torch.uint8


# ------------------------------------------------------------------------------------------------
# §8.4 NVFP4
# ------------------------------------------------------------------------------------------------

ROW84 = [0, 0.1, -0.2, 0.3, 0.5, -0.75, 1.0, 1.25, -1.5, 0.05, 0.9, -1.1, 0.6, 0, 0.4, 1.4,
         10, -5, 2.5, 0, 7.5, -10, 3.3, 1.0, -0.4, 6.0, 8.75, -2.0, 0.2, 4.4, -9.0, 5.5]
PACKED84 = "10 3a d4 76 0f e6 05 73 d7 03 f6 14 68 a7 50 5f"


@pytest.mark.parametrize("global_amax", [None, 10.0, "tensor"])
def test_spec_8_4_nvfp4_row(global_amax):
    x = torch.zeros(16, 32)
    x[0] = torch.tensor(ROW84)
    opts = {} if global_amax is None else {
        "global_amax": torch.tensor([10.0]) if global_amax == "tensor" else global_amax}
    q = F.quantize(x, "nvfp4", **opts)
    assert float(q.amax_rowwise.reshape(-1)[0]) == 10.0 and q.amax_rowwise.dtype == torch.float32
    assert bytes(q.rowwise_data[0].tolist()) == bytes.fromhex(PACKED84.replace(" ", ""))
    assert int(q.rowwise_scale_inv[0, 0]) == 0x68 and int(q.rowwise_scale_inv[0, 1]) == 0x7E
    assert torch.count_nonzero(q.rowwise_scale_inv[1:]) == 0 and torch.count_nonzero(q.rowwise_data[1:]) == 0
    deq = q.dequantize(dtype=torch.float32)[0]
    assert abs(float(deq[7]) - 1.4285714) < 1e-6  # 1.25 * 4.2 = 5.25 -> 6, decodes as 6 * 64 * 10 / 2688
    assert float(deq[8]) == float(np.float32(-6) * np.float32(np.float32(64 * 10) * np.float32(1 / 2688)))


def test_spec_8_4_nvfp4_columnwise_of_the_same_values():
    x = torch.zeros(32, 16)
    x[:, 0] = torch.tensor(ROW84)
    q = F.quantize(x, "nvfp4", rowwise=False, columnwise=True)
    assert q.columnwise_data.shape == (16, 16)
    assert bytes(q.columnwise_data[0].tolist()) == bytes.fromhex(PACKED84.replace(" ", ""))
    assert int(q.columnwise_scale_inv[0, 0]) == 0x68 and int(q.columnwise_scale_inv[0, 1]) == 0x7E


def test_spec_8_4_nvfp4_shapes_and_amax_edges():
    x = torch.randn(48, 64)
    q = F.quantize(x, "nvfp4", columnwise=True)
    assert q.rowwise_data.shape == (48, 32) and q.rowwise_scale_inv.shape == (128, 4)
    assert q.columnwise_data.shape == (64, 24) and q.columnwise_scale_inv.shape == (128, 4)
    assert q.amax_rowwise.shape == (1,) and q.amax_columnwise.shape == (1,)
    q = F.quantize(torch.randn(2, 3, 16, 32), "nvfp4", columnwise=True)
    assert q.rowwise_data.shape == (2, 3, 16, 16) and q.columnwise_data.shape == (32, 48)
    # A = 0 -> S_enc = 1: zeros everywhere, decodes to zeros
    z = F.quantize(torch.zeros(16, 32), "nvfp4", columnwise=True)
    assert float(z.amax_rowwise[0]) == 0.0
    assert all(torch.count_nonzero(b) == 0 for b in (z.rowwise_data, z.rowwise_scale_inv, z.columnwise_data))
    assert torch.count_nonzero(z.dequantize(dtype=torch.float32)) == 0
    assert R.nvfp4_s_enc(0.0) == 1.0 and R.nvfp4_s_enc(1e-45) == np.float32(R.FLT_MAX)
    # A so small that 2688 / A overflows -> S_enc = FLT_MAX
    x = torch.zeros(16, 32)
    x[0, :3] = torch.tensor([1e-45, -1e-45, 0.0])
    q = F.quantize(x, "nvfp4", columnwise=True, global_amax=1e-45)
    check_quantized(q, reference(x, "nvfp4", global_amax=1e-45), "both", x, "nvfp4 tiny A")


# ------------------------------------------------------------------------------------------------
# §8.5 swizzle
# ------------------------------------------------------------------------------------------------

def _where(swizzled_rows, swizzled_cols, i, j):
    """Flat position at which compact entry (i, j) landed (rows/cols hold their own index)."""
    r, c = swizzled_rows.reshape(-1), swizzled_cols.reshape(-1)
    pos = torch.nonzero((r == i) & (c == j)).reshape(-1)
    assert pos.numel() == 1, (i, j, pos)
    return int(pos[0])


def test_spec_8_5_swizzle_indices():
    for R_, C_, cases in ((128, 4, [((0, 0), 0), ((0, 1), 1), ((1, 0), 16), ((32, 0), 4), ((33, 2), 22),
                                    ((127, 3), 511)]),
                          (256, 8, [((130, 5), 1569)])):
        rows = torch.arange(R_, dtype=torch.uint8).reshape(R_, 1).expand(R_, C_).contiguous()
        cols = torch.arange(C_, dtype=torch.uint8).reshape(1, C_).expand(R_, C_).contiguous()
        sr, sc = F.swizzle_scales(rows), F.swizzle_scales(cols)
        assert sr.shape == (R_, C_) and sr.dtype == torch.uint8
        for (i, j), idx in cases:
            assert _where(sr, sc, i, j) == idx
            assert int(R.swizzle_index(i, j, C_ // 4)) == idx


def test_swizzle_matches_reference_and_round_trips(gen):
    for shape, transpose in (((128, 4), False), ((256, 12), False), ((384, 8), False),
                             ((4, 128), True), ((8, 256), True), ((12, 384), True)):
        s = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
        sw = F.swizzle_scales(s, transpose=transpose)
        assert_same(f"swizzle {shape} transpose={transpose}", sw, R.swizzle(s.numpy(), transpose))
        assert torch.equal(F.unswizzle_scales(sw, transpose=transpose), s)
        np.testing.assert_array_equal(R.unswizzle(R.swizzle(s.numpy(), transpose), transpose), s.numpy())
        # a permutation: a tensor of all distinct 16-bit positions says so without uint8 aliasing
        lo = torch.arange(s.numel()).reshape(shape)
        a = F.swizzle_scales((lo & 0xFF).to(torch.uint8), transpose=transpose).long()
        b = F.swizzle_scales((lo >> 8).to(torch.uint8), transpose=transpose).long()
        assert torch.equal(torch.sort((a | (b << 8)).reshape(-1)).values, torch.arange(s.numel()))


# ------------------------------------------------------------------------------------------------
# random data: pyxfer == reference, bit-exact
# ------------------------------------------------------------------------------------------------

SHAPES = {
    "fp8_block_1x128": [(1, 300), (3, 200, 131), (129, 257), (2, 3, 5, 131), (128, 128), (1, 1), (5, 1), (260, 7)],
    "mxfp8": [(32, 32), (64, 96), (2, 48, 160), (1, 3, 32, 64), (96, 224), (160, 32)],
    "nvfp4": [(16, 16), (48, 64), (3, 16, 48), (2, 5, 16, 80), (144, 208), (16, 272)],
}
SHAPES["fp8_block_128x128"] = SHAPES["fp8_block_1x128"]
VIEW_SHAPES = {"fp8_block_1x128": (3, 130, 131), "fp8_block_128x128": (131, 260),
               "mxfp8": (2, 64, 96), "nvfp4": (48, 80)}


def _span(fmt, dtype):
    # NVFP4 shares one global amax per tensor: with 14 decades most blocks would get a zero E4M3
    # scale (that edge is covered too, by the wide-span views); keep the main shapes to 4 decades
    return (-2.0, 2.0) if fmt == "nvfp4" else None


def _run_matrix(fmt, dtype, fp8_dtype, opts, gen, with_views=True):
    inputs = [(f"{s}", make_input(s, dtype, gen, span=_span(fmt, dtype))) for s in SHAPES[fmt]]
    if with_views:
        inputs += [(f"{VIEW_SHAPES[fmt]} {name}", x) for name, x in views(VIEW_SHAPES[fmt], dtype, gen)]
    for name, x in inputs:
        ref = reference(x, fmt, fp8_dtype, **opts)
        for usage in USAGES:
            what = f"{fmt} {dtype} {FP8_NAME.get(fp8_dtype)} {opts} {usage} x{name}"
            qt = quantize(x, fmt, usage, fp8_dtype, **opts)
            check_quantized(qt, ref, usage, x, what)
            if usage != "both":
                check_dequantize(qt, ref, fmt, usage, x, what, fp8_dtype)


@pytest.mark.parametrize("opts", FP8_BLOCK_OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", IN_DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FP8_BLOCK)
def test_fp8_block_matches_reference(fmt, dtype, fp8_dtype, opts, gen):
    # the options only change scales: the non-contiguous views run with the default options
    _run_matrix(fmt, dtype, fp8_dtype, opts, gen, with_views=opts == FP8_BLOCK_OPTIONS[0])


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", IN_DTYPES, ids=str)
def test_mxfp8_matches_reference(dtype, fp8_dtype, gen):
    _run_matrix("mxfp8", dtype, fp8_dtype, {}, gen)


@pytest.mark.parametrize("amax", ["default", "larger", "smaller", "tensor"])
@pytest.mark.parametrize("dtype", IN_DTYPES, ids=str)
def test_nvfp4_matches_reference(dtype, amax, gen):
    if amax == "default":
        _run_matrix("nvfp4", dtype, None, {}, gen)
        return
    for shape in SHAPES["nvfp4"][1:4]:
        x = make_input(shape, dtype, gen)
        a = float(x.float().abs().max())
        ga = {"larger": a * 37.5, "smaller": a / 23.0, "tensor": torch.tensor([a * 1.5])}[amax]
        ref = reference(x, "nvfp4", global_amax=ga)
        for usage in USAGES:
            qt = quantize(x, "nvfp4", usage, global_amax=ga)
            check_quantized(qt, ref, usage, x, f"nvfp4 {dtype} {amax} {usage} {shape}")
            if usage != "both":
                check_dequantize(qt, ref, "nvfp4", usage, x, f"nvfp4 {dtype} {amax} {usage}")


@pytest.mark.parametrize("dtype", IN_DTYPES, ids=str)
def test_global_amax_matches_reference(dtype, gen):
    """formats.global_amax (NVFP4's default global amax): max |x| in fp32 for every view, with -0,
    subnormals, infinities and NaN (which wins), and 0 for an empty tensor."""
    def expected(x):
        return np.array([R.nvfp4_global_amax(np32(x))], np.float32)

    for name, x in views((37, 53), dtype, gen):
        assert_same(f"global_amax {dtype} {name}", F.global_amax(x), expected(x))
    x = make_input((5, 64), dtype, gen)
    x[1, 3] = -float("inf")
    assert float(F.global_amax(x)) == math.inf
    x[2, 9] = float("nan")
    assert math.isnan(float(F.global_amax(x)))
    tiny = torch.full((3, 7), -torch.finfo(dtype).smallest_normal / 4, dtype=dtype)
    tiny[0, 0] = -0.0
    assert_same(f"global_amax {dtype} subnormal", F.global_amax(tiny), expected(tiny))
    empty = F.global_amax(torch.empty(0, 16, dtype=dtype))
    assert empty.dtype == torch.float32 and empty.shape == (1,) and float(empty) == 0.0


@pytest.mark.parametrize("fmt", F.FORMATS if hasattr(F, "FORMATS") else FP8_BLOCK + ["mxfp8", "nvfp4"])
def test_dequantize_to_every_dtype(fmt, gen):
    shape = {"mxfp8": (64, 96), "nvfp4": (32, 48)}.get(fmt, (130, 131))
    for dtype in IN_DTYPES:
        x = make_input(shape, dtype, gen)
        ref = reference(x, fmt)
        for usage in ("rowwise", "columnwise"):
            qt = quantize(x, fmt, usage)
            check_dequantize(qt, ref, fmt, usage, x, f"{fmt} {dtype} {usage}",
                             out_dtypes=(None, torch.float32, torch.bfloat16, torch.float16))


def test_dequantize_native_ops_match_reference(gen):
    x = make_input((3, 64, 96), torch.float32, gen)
    for fp8 in (E4M3, E5M2):
        for bd, fmt in ((1, "fp8_block_1x128"), (2, "fp8_block_128x128")):
            ref = reference(x, fmt, fp8)
            for cw in (False, True):
                d = ref["columnwise_data" if cw else "rowwise_data"]
                s = ref["columnwise_scale_inv" if cw else "rowwise_scale_inv"]
                for od in IN_DTYPES:
                    got = torch.ops.pyxfer.dequantize_fp8_block(torch.from_numpy(d), torch.from_numpy(s),
                                                                bd, cw, fp8, od)
                    exp = reference_dequantize(ref, fmt, tuple(x.shape), cw, fp8)
                    assert_same(f"dequantize_fp8_block {bd} cw={cw} {od}", got, R.cast_bits(exp, DTYPE_NAME[od]))
        ref = reference(x, "mxfp8", fp8)
        for cw in (False, True):
            d = ref["columnwise_data" if cw else "rowwise_data"]
            s = ref["columnwise_scale_inv" if cw else "rowwise_scale_inv"]
            got = torch.ops.pyxfer.dequantize_mxfp8(torch.from_numpy(d), torch.from_numpy(s), cw, fp8, torch.float32)
            assert_same(f"dequantize_mxfp8 cw={cw}", got, reference_dequantize(ref, "mxfp8", tuple(x.shape), cw, fp8))
    ref = reference(x, "nvfp4")
    t = {k: torch.from_numpy(v) for k, v in ref.items()}
    got = torch.ops.pyxfer.dequantize_nvfp4(t["rowwise_data"], t["rowwise_scale_inv"], t["amax_rowwise"], False,
                                            torch.float32)
    assert_same("dequantize_nvfp4 rowwise", got, reference_dequantize(ref, "nvfp4", tuple(x.shape), False))
    got = torch.ops.pyxfer.dequantize_nvfp4(t["columnwise_data"], t["columnwise_scale_inv"], t["amax_columnwise"], True,
                                            torch.float32)
    assert_same("dequantize_nvfp4 columnwise", got, reference_dequantize(ref, "nvfp4", (192, 96), True))


def test_every_fp8_and_fp4_code_decodes(gen):
    """Dequantize every byte value (E4M3 NaN codes excluded) with unit-ish scales."""
    for fp8 in (E4M3, E5M2):
        codes = torch.arange(256, dtype=torch.uint8)
        name = FP8_NAME[fp8]
        keep = ~torch.isnan(torch.from_numpy(R.decode_fp8(codes.numpy(), name))) & \
            ~torch.isinf(torch.from_numpy(R.decode_fp8(codes.numpy(), name)))
        c = codes[keep]
        data = c[torch.randint(0, c.numel(), (32 * 128,), generator=gen)].reshape(32, 128)
        scale = torch.full((128, 4), 127, dtype=torch.uint8)
        got = torch.ops.pyxfer.dequantize_mxfp8(data, scale, False, fp8, torch.float32)
        assert_same(f"decode {name}", got, R.decode_fp8(data.numpy(), name))
        s1 = torch.ones(1, 32)
        got = torch.ops.pyxfer.dequantize_fp8_block(data, s1, 1, False, fp8, torch.float32)
        assert_same(f"decode {name} fp8_block", got, R.decode_fp8(data.numpy(), name))
    # every E2M1 code pair, with s8 = 1.0 (0x38) and A = 2688: factor = 1
    data = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
    scale = torch.full((128, 4), 0x38, dtype=torch.uint8)
    got = torch.ops.pyxfer.dequantize_nvfp4(data, scale, torch.tensor([2688.0]), False, torch.float32)
    assert_same("decode e2m1", got, R.dequantize_nvfp4(data.numpy(), scale.numpy(), [2688.0]))
    # row r holds bytes 16r + j: low nibble (even element) j, high nibble (odd element) r
    assert got[0, 0::2].tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    assert got[3, 1::2].tolist() == [1.5] * 16 and got[15, 1::2].tolist() == [-6.0] * 16


def test_negative_zero_fp8(gen):
    """FP8 formats: -0.0 and tiny negatives encode as 0x80 (sign kept)."""
    x = torch.zeros(32, 128)
    x[0, 0] = 100.0
    x[0, 1] = -0.0
    x[0, 2] = -1e-30
    for fmt in FP8_BLOCK + ["mxfp8"]:
        q = F.quantize(x, fmt, columnwise=True)
        assert int(q.rowwise_data[0, 1]) == 0x80 and int(q.rowwise_data[0, 2]) == 0x80, fmt
        check_quantized(q, reference(x, fmt), "both", x, f"{fmt} -0")


def test_saturating_values(gen):
    """Values whose scaled magnitude exceeds the element max: FP8 with non-pow2 scales, NVFP4 with a
    global amax below the tensor's, fp16/bf16 extremes."""
    for dtype in IN_DTYPES:
        big = {torch.float32: 3e38, torch.bfloat16: 3e38, torch.float16: 65504.0}[dtype]
        x = make_input((64, 256), dtype, gen)
        x[0, :64] = big
        x[1, 128:] = -big
        x[2, :32] = torch.tensor(np.finfo(np.float32).tiny if dtype != torch.float16 else 6e-8, dtype=dtype)
        below = float(x.float().abs().max()) / 1000
        for fmt, opts in (("fp8_block_1x128", dict(pow2_scales=False)), ("fp8_block_128x128", dict(pow2_scales=False)),
                          ("fp8_block_1x128", {}), ("mxfp8", {}), ("nvfp4", dict(global_amax=below))):
            for fp8 in ((E4M3, E5M2) if fmt != "nvfp4" else (E4M3,)):
                q = quantize(x, fmt, "both", fp8, **opts)
                ref = reference(x, fmt, fp8, **opts)
                check_quantized(q, ref, "both", x, f"{fmt} {dtype} {opts} saturating")
                check_dequantize(q, ref, fmt, "rowwise", x, f"{fmt} {dtype} saturating", fp8,
                                 out_dtypes=(torch.float32,))


def test_larger_tensors_match_reference(gen):
    x = make_input((2, 256, 1000), torch.bfloat16, gen)
    for fmt in FP8_BLOCK + ["mxfp8", "nvfp4"]:
        if fmt == "mxfp8":
            x = x[..., :992]
        check_quantized(quantize(x, fmt), reference(x, fmt), "both", x, f"{fmt} large")


def test_one_dimensional_input_fp8_block(gen):
    """A 1-D tensor is M = 1 (empty product of leading dims); columnwise data has shape (K,)."""
    x = make_input((300,), torch.float32, gen)
    for fmt in FP8_BLOCK:
        q = F.quantize(x, fmt, columnwise=True)
        check_quantized(q, reference(x, fmt), "both", x, f"{fmt} 1-D")
        exp = reference_dequantize(reference(x, fmt), fmt, (300,), False)
        assert_same(f"{fmt} 1-D dequantize", q.dequantize(), exp)


# ------------------------------------------------------------------------------------------------
# error bounds (quantize -> dequantize) on random data
# ------------------------------------------------------------------------------------------------

def _block_amax(xn, fmt, columnwise):
    """Per-element amax of the element's block (fp64 numpy, logical [M, K])."""
    M, K = xn.shape
    if columnwise and fmt != "fp8_block_128x128":
        return _block_amax(xn.T, fmt, False).T
    bs = {"fp8_block_1x128": 128, "mxfp8": 32, "nvfp4": 16}.get(fmt)
    if fmt == "fp8_block_128x128":
        Mp, Kp = R.rup(M, 128), R.rup(K, 128)
        p = np.zeros((Mp, Kp))
        p[:M, :K] = np.abs(xn)
        a = p.reshape(Mp // 128, 128, Kp // 128, 128).max(axis=(1, 3))
        return np.repeat(np.repeat(a, 128, 0), 128, 1)[:M, :K]
    Kp = R.rup(K, bs)
    p = np.zeros((M, Kp))
    p[:, :K] = np.abs(xn)
    return np.repeat(p.reshape(M, Kp // bs, bs).max(axis=2), bs, 1)[:, :K]


@pytest.mark.parametrize("fmt", FP8_BLOCK + ["mxfp8", "nvfp4"])
def test_quantize_dequantize_error_bounds(fmt, gen):
    shape = {"mxfp8": (96, 224), "nvfp4": (96, 224)}.get(fmt, (200, 300))
    for dtype in IN_DTYPES:
        for fp8 in ((E4M3, E5M2) if fmt != "nvfp4" else (E4M3,)):
            x = make_input(shape, dtype, gen, span=(-4, 4) if dtype != torch.float16 else None)
            xn = np32(x).astype(np.float64)
            for usage in ("rowwise", "columnwise"):
                q = quantize(x, fmt, usage, fp8)
                err = np.abs(np32(q.dequantize(dtype=torch.float32)).astype(np.float64) - xn)
                amax = _block_amax(xn, fmt, usage == "columnwise")
                if fmt == "nvfp4":
                    A = float(np.abs(xn).max())
                    normal_scale = amax * 448.0 / A >= 2.0 ** -6  # E4M3 block scale is a normal number
                    bound = np.where(normal_scale, amax * 0.18, amax * 1.0001)
                else:
                    step = 2.0 ** -4 if fp8 == E4M3 else 2.0 ** -3
                    bound = amax * step * (1 + 1e-6) + amax * 2.0 ** -20
                bad = err > bound
                assert not bad.any(), (f"{fmt} {dtype} {fp8} {usage}: {int(bad.sum())} elements over the bound, e.g. "
                                       f"x={xn[bad][:3]} err={err[bad][:3]} bound={bound[bad][:3]}")
                if fmt != "nvfp4":  # a real bound, not a vacuous one: most blocks are far tighter
                    assert np.median(err[amax > 0] / amax[amax > 0]) < step / 4


# ------------------------------------------------------------------------------------------------
# QuantizedTensor API
# ------------------------------------------------------------------------------------------------

def _all_formats():
    return list(getattr(F, "FORMATS", FP8_BLOCK + ["mxfp8", "nvfp4"]))


def test_formats_tuple():
    assert tuple(F.FORMATS) == ("fp8_block_1x128", "fp8_block_128x128", "mxfp8", "nvfp4")


@pytest.mark.parametrize("fmt", _all_formats())
def test_quantized_tensor_attributes(fmt, gen):
    x = make_input((2, 64, 96), torch.bfloat16, gen)
    q = quantize(x, fmt, "both")
    assert q.fmt == fmt and q.shape == torch.Size((2, 64, 96)) and q.dtype == torch.bfloat16
    assert q.device == torch.device("cpu")
    assert q.rowwise_usage and q.columnwise_usage
    cls = {"mxfp8": F.MXFP8Tensor, "nvfp4": F.NVFP4Tensor}.get(fmt, F.Float8BlockTensor)
    assert isinstance(q, cls) and isinstance(q, F.QuantizedTensor)
    bufs = q.buffers()
    expected_names = set(BUFFERS) | ({"amax_rowwise", "amax_columnwise"} if fmt == "nvfp4" else set())
    assert set(bufs) == expected_names
    for name, t in bufs.items():
        assert t is getattr(q, name)
    opts = q.options
    if fmt in FP8_BLOCK:
        assert q.block_dim == (1 if fmt == "fp8_block_1x128" else 2)
        assert q.fp8_dtype == E4M3 and q.pow2_scales is True and q.amax_epsilon == 0.0
        assert opts["fp8_dtype"] == E4M3 and opts["pow2_scales"] is True and opts["amax_epsilon"] == 0.0
    elif fmt == "mxfp8":
        assert q.fp8_dtype == E4M3 and q.gemm_swizzled_scales is False and opts["fp8_dtype"] == E4M3
    else:
        assert q.gemm_swizzled_scales is False
    qr = quantize(x, fmt, "rowwise")
    assert qr.rowwise_usage and not qr.columnwise_usage
    assert set(qr.buffers()) == {n for n in expected_names if n.startswith("rowwise") or n == "amax_rowwise"}
    qc = quantize(x, fmt, "columnwise")
    assert qc.columnwise_usage and not qc.rowwise_usage and qc.rowwise_data is None
    # dequantize: nominal dtype by default, rowwise preferred when both are present
    assert q.dequantize().dtype == torch.bfloat16
    assert torch.equal(q.dequantize(dtype=torch.float32), qr.dequantize(dtype=torch.float32))
    assert torch.equal(qc.dequantize(dtype=torch.float16).float(), qc.dequantize(dtype=torch.float32).half().float())


@pytest.mark.parametrize("fmt", _all_formats())
def test_quantized_tensor_options_recorded(fmt, gen):
    x = make_input((64, 128), torch.float32, gen)
    if fmt in FP8_BLOCK:
        q = quantize(x, fmt, "rowwise", E5M2, pow2_scales=False, amax_epsilon=0.5)
        assert q.fp8_dtype == E5M2 and q.pow2_scales is False and q.amax_epsilon == 0.5
        assert q.options["pow2_scales"] is False and q.options["fp8_dtype"] == E5M2
    elif fmt == "mxfp8":
        q = quantize(x, fmt, "rowwise", E5M2, gemm_swizzled_scales=True)
        assert q.fp8_dtype == E5M2 and q.gemm_swizzled_scales is True and q.options["gemm_swizzled_scales"] is True
    else:
        q = quantize(x, fmt, "rowwise", global_amax=123.0)
        assert float(q.amax_rowwise[0]) == 123.0


@pytest.mark.parametrize("fmt", _all_formats())
def test_wrap_existing_buffers_without_copy(fmt, gen):
    x = make_input((64, 160), torch.float16, gen)
    q = quantize(x, fmt, "both")
    cls = type(q)
    kwargs = dict(shape=q.shape, dtype=q.dtype, **q.buffers())
    if fmt in FP8_BLOCK:
        kwargs.update(fp8_dtype=q.fp8_dtype, block_dim=q.block_dim, pow2_scales=q.pow2_scales,
                      amax_epsilon=q.amax_epsilon)
    elif fmt == "mxfp8":
        kwargs.update(fp8_dtype=q.fp8_dtype, gemm_swizzled_scales=q.gemm_swizzled_scales)
    else:
        kwargs.update(gemm_swizzled_scales=q.gemm_swizzled_scales)
    w = cls(**kwargs)
    for name, t in q.buffers().items():
        assert getattr(w, name).data_ptr() == t.data_ptr(), name
    assert torch.equal(w.dequantize(), q.dequantize())
    # rowwise-only wrap
    kw = {k: v for k, v in kwargs.items() if not k.startswith("columnwise") and k != "amax_columnwise"}
    w = cls(**kw)
    assert w.columnwise_data is None and w.rowwise_data.data_ptr() == q.rowwise_data.data_ptr()
    assert torch.equal(w.dequantize(dtype=torch.float32), q.dequantize(dtype=torch.float32))


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_swizzled_scales_round_trip(fmt, gen):
    shape = (3, 64, 96) if fmt == "mxfp8" else (3, 48, 80)
    x = make_input(shape, torch.bfloat16, gen)
    q = quantize(x, fmt, "both")
    s = q.with_swizzled_scales()
    assert s.gemm_swizzled_scales and not q.gemm_swizzled_scales
    assert torch.equal(s.rowwise_data, q.rowwise_data) and torch.equal(s.columnwise_data, q.columnwise_data)
    assert_same(f"{fmt} rowwise swizzled", s.rowwise_scale_inv, R.swizzle(q.rowwise_scale_inv.numpy()))
    assert_same(f"{fmt} columnwise swizzled", s.columnwise_scale_inv,
                R.swizzle(q.columnwise_scale_inv.numpy(), transpose=(fmt == "mxfp8")))
    c = s.with_compact_scales()
    assert not c.gemm_swizzled_scales
    for name in BUFFERS:
        assert torch.equal(getattr(c, name), getattr(q, name)), name
    assert torch.equal(s.dequantize(), q.dequantize())  # dequantize understands swizzled scales
    direct = quantize(x, fmt, "both", gemm_swizzled_scales=True)
    for name in BUFFERS:
        assert torch.equal(getattr(direct, name), getattr(s, name)), name


def test_is_quantizable_rules():
    cases = [
        ((128, 128), dict(fp8_block_1x128=True, fp8_block_128x128=True, mxfp8=True, nvfp4=True)),
        ((2, 64, 256), dict(fp8_block_1x128=True, fp8_block_128x128=True, mxfp8=True, nvfp4=True)),
        ((64, 128), dict(fp8_block_1x128=False, fp8_block_128x128=False, mxfp8=True, nvfp4=True)),
        ((128, 96), dict(fp8_block_1x128=False, fp8_block_128x128=False, mxfp8=True, nvfp4=True)),
        ((48, 48), dict(fp8_block_1x128=False, fp8_block_128x128=False, mxfp8=False, nvfp4=True)),
        ((3, 16, 32), dict(fp8_block_1x128=False, fp8_block_128x128=False, mxfp8=False, nvfp4=True)),
        ((24, 32), dict(fp8_block_1x128=False, fp8_block_128x128=False, mxfp8=False, nvfp4=False)),
        ((16, 8), dict(fp8_block_1x128=False, fp8_block_128x128=False, mxfp8=False, nvfp4=False)),
        ((256,), dict(fp8_block_1x128=False, fp8_block_128x128=False, mxfp8=False, nvfp4=False)),
        ((1, 128), dict(fp8_block_1x128=False, fp8_block_128x128=False, mxfp8=False, nvfp4=False)),
    ]
    for shape, expected in cases:
        for fmt, want in expected.items():
            assert F.is_quantizable(shape, fmt) is want, (shape, fmt)
            assert F.is_quantizable(torch.Size(shape), fmt) is want, (shape, fmt)
            assert F.QuantizeSpec(fmt).is_quantizable(shape) is want, (shape, fmt)


def test_quantize_spec(gen):
    spec = F.QuantizeSpec("fp8_block_1x128", rowwise=True, columnwise=True, fp8_dtype=E5M2, pow2_scales=False)
    same = F.QuantizeSpec("fp8_block_1x128", rowwise=True, columnwise=True, fp8_dtype=E5M2, pow2_scales=False)
    other = F.QuantizeSpec("fp8_block_1x128", rowwise=True, columnwise=True, fp8_dtype=E5M2)
    assert spec == same and hash(spec) == hash(same) and spec != other
    assert len({spec, same, other}) == 2
    with pytest.raises(AttributeError, match="^QuantizeSpec is immutable: cannot set 'fmt'$"):
        spec.fmt = "mxfp8"  # frozen
    x = make_input((3, 130, 131), torch.bfloat16, gen)
    q = spec.quantize(x)
    d = F.quantize(x, "fp8_block_1x128", rowwise=True, columnwise=True, fp8_dtype=E5M2, pow2_scales=False)
    for name in BUFFERS:
        assert torch.equal(getattr(q, name), getattr(d, name)), name
    assert q.pow2_scales is False and q.fp8_dtype == E5M2
    n = F.QuantizeSpec("nvfp4", global_amax=4.0)
    assert float(n.quantize(make_input((16, 32), torch.float32, gen)).amax_rowwise[0]) == 4.0


# ------------------------------------------------------------------------------------------------
# bad inputs, zero sizes
# ------------------------------------------------------------------------------------------------

def _raises_naming(fn, *words):
    with pytest.raises((ValueError, TypeError)) as info:
        fn()
    msg = str(info.value)
    assert any(w in msg for w in words), f"error message {msg!r} names none of {words}"


def test_bad_inputs_name_the_argument():
    x = torch.randn(64, 64)
    _raises_naming(lambda: F.quantize(x, "fp8"), "fmt")
    _raises_naming(lambda: F.quantize(x, 7), "fmt")
    _raises_naming(lambda: F.quantize(torch.randn(64, 48), "mxfp8"), "32")
    _raises_naming(lambda: F.quantize(torch.randn(48, 64), "mxfp8", columnwise=True), "32")
    _raises_naming(lambda: F.quantize(torch.randn(24, 64), "nvfp4"), "16")
    _raises_naming(lambda: F.quantize(torch.randn(16, 40), "nvfp4"), "16")
    _raises_naming(lambda: F.quantize(torch.arange(64 * 64).reshape(64, 64), "fp8_block_1x128"), "dtype", "x")
    _raises_naming(lambda: F.quantize(torch.randn(64, 64, dtype=torch.float64), "mxfp8"), "dtype", "x")
    _raises_naming(lambda: F.quantize(x, "nvfp4", fp8_dtype=E5M2), "fp8_dtype")
    _raises_naming(lambda: F.quantize(x, "mxfp8", fp8_dtype=torch.float16), "fp8_dtype")
    _raises_naming(lambda: F.quantize(x, "fp8_block_1x128", fp8_dtype=torch.uint8), "fp8_dtype")
    _raises_naming(lambda: F.quantize(x, "mxfp8", pow2_scales=False), "pow2_scales")
    _raises_naming(lambda: F.quantize(x, "fp8_block_128x128", gemm_swizzled_scales=True), "gemm_swizzled_scales")
    _raises_naming(lambda: F.quantize(x, "nvfp4", stochastic_rounding=True), "stochastic_rounding")
    _raises_naming(lambda: F.quantize(x, "nvfp4", bogus_option=1), "bogus_option")
    _raises_naming(lambda: F.quantize(x, "mxfp8", rowwise=False, columnwise=False), "rowwise", "columnwise")
    _raises_naming(lambda: F.quantize(x, "nvfp4", global_amax=torch.tensor([1.0, 2.0])), "global_amax")
    _raises_naming(lambda: F.quantize(torch.randn(64), "mxfp8"), "32", "x", "ndim", "dim")
    _raises_naming(lambda: F.quantize(x, "fp8_block_1x128", amax_epsilon=-1.0), "amax_epsilon")
    _raises_naming(lambda: F.is_quantizable((128, 128), "int8"), "fmt")
    _raises_naming(lambda: F.swizzle_scales(torch.zeros(100, 4, dtype=torch.uint8)), "128", "scale")


def test_native_op_argument_checks():
    x = torch.randn(64, 64)
    errors = (RuntimeError, ValueError, TypeError)
    with pytest.raises(errors, match="block_dim"):
        torch.ops.pyxfer.quantize_fp8_block(x, 3, True, False, E4M3, True, 0.0)
    with pytest.raises(errors):
        torch.ops.pyxfer.quantize_mxfp8(torch.randn(64, 48), True, False, E4M3)
    with pytest.raises(errors):
        torch.ops.pyxfer.quantize_nvfp4(torch.randn(16, 32), torch.tensor([1.0, 2.0]), True, False)
    with pytest.raises(errors):
        torch.ops.pyxfer.quantize_mxfp8(torch.randn(64, 64).to(torch.int32), True, False, E4M3)
    with pytest.raises(errors):
        torch.ops.pyxfer.dequantize_mxfp8(torch.zeros(32, 32, dtype=torch.uint8), torch.zeros(4, 4, dtype=torch.uint8),
                                          False, E4M3, torch.float32)  # scale too small for the data


def test_native_op_unused_usage_slots_are_empty(gen):
    x = make_input((3, 64, 96), torch.float32, gen)
    out = torch.ops.pyxfer.quantize_fp8_block(x, 1, True, False, E4M3, True, 0.0)
    assert len(out) == 4 and out[2].numel() == 0 and out[3].numel() == 0
    ref = reference(x, "fp8_block_1x128")
    assert_same("native rowwise_data", out[0], ref["rowwise_data"])
    assert_same("native rowwise_scale_inv", out[1], ref["rowwise_scale_inv"])
    out = torch.ops.pyxfer.quantize_mxfp8(x, False, True, E5M2)
    assert out[0].numel() == 0 and out[1].numel() == 0
    ref = reference(x, "mxfp8", E5M2)
    assert_same("native mxfp8 columnwise_data", out[2], ref["columnwise_data"])
    out = torch.ops.pyxfer.quantize_nvfp4(x, torch.tensor([float(x.abs().max())]), True, True)
    ref = reference(x, "nvfp4")
    for i, name in enumerate(BUFFERS):
        assert_same(f"native nvfp4 {name}", out[i], ref[name])


@pytest.mark.parametrize("fmt", _all_formats())
def test_zero_size_tensors(fmt):
    K = 128 if fmt in FP8_BLOCK else 64
    x = torch.empty(0, K)
    q = quantize(x, fmt, "both")
    ref = reference(x, fmt)
    check_quantized(q, ref, "both", x, f"{fmt} empty")
    assert q.dequantize().shape == (0, K)
    x3 = torch.empty(2, 0, K, dtype=torch.bfloat16)
    q = quantize(x3, fmt, "rowwise")
    assert q.dequantize().shape == (2, 0, K)


# ------------------------------------------------------------------------------------------------
# swap_first_dims, opcheck, compile
# ------------------------------------------------------------------------------------------------

def test_swap_first_dims(gen):
    for shape, dtype in (((3, 5), torch.uint8), ((2, 7, 3), torch.float32), ((4, 1, 6, 5), torch.int32),
                         ((1, 9), torch.bfloat16), ((5, 3, 0), torch.uint8), ((2, 128, 64), torch.uint8)):
        src = torch.randint(0, 200, shape, generator=gen).to(dtype)
        out = torch.ops.pyxfer.swap_first_dims(src)
        assert out.dtype == dtype and torch.equal(out, src.transpose(0, 1).contiguous()), shape


def test_opcheck_every_native_op(gen):
    x = make_input((2, 32, 64), torch.bfloat16, gen)
    xf = make_input((32, 160), torch.float32, gen)
    ops = torch.ops.pyxfer
    torch.library.opcheck(ops.quantize_fp8_block.default, (x, 1, True, True, E4M3, True, 0.0))
    torch.library.opcheck(ops.quantize_fp8_block.default, (xf, 2, False, True, E5M2, False, 1e-3))
    rd, rs, cd, cs = ops.quantize_fp8_block(xf, 1, True, True, E4M3, True, 0.0)
    torch.library.opcheck(ops.dequantize_fp8_block.default, (cd, cs, 1, True, E4M3, torch.bfloat16))
    rd, rs, cd, cs = ops.quantize_fp8_block(xf, 2, True, True, E4M3, True, 0.0)
    torch.library.opcheck(ops.dequantize_fp8_block.default, (rd, rs, 2, False, E4M3, torch.float32))
    torch.library.opcheck(ops.quantize_mxfp8.default, (x, True, True, E4M3))
    rd, rs, cd, cs = ops.quantize_mxfp8(xf, True, True, E5M2)
    torch.library.opcheck(ops.dequantize_mxfp8.default, (cd, cs, True, E5M2, torch.float16))
    amax = xf.abs().max().reshape(1)
    torch.library.opcheck(ops.quantize_nvfp4.default, (xf, amax, True, True))
    rd, rs, cd, cs = ops.quantize_nvfp4(xf, amax, True, True)
    torch.library.opcheck(ops.dequantize_nvfp4.default, (cd, cs, amax, True, torch.bfloat16))
    torch.library.opcheck(ops.swap_first_dims.default, (torch.randint(0, 9, (3, 4, 5), dtype=torch.uint8),))


def test_torch_compile_quantize(gen):
    x = make_input((64, 96), torch.float32, gen)

    def f(t):
        rd, rs, cd, cs = torch.ops.pyxfer.quantize_mxfp8(t * 2, True, True, E4M3)
        return torch.ops.pyxfer.dequantize_mxfp8(rd, rs, False, E4M3, torch.float32)

    got = torch.compile(f, backend="aot_eager", fullgraph=True)(x)
    ref = reference(x * 2, "mxfp8")
    assert_same("compiled mxfp8 round trip", got, reference_dequantize(ref, "mxfp8", (64, 96), False))
    g = torch.compile(lambda t: F.quantize(t, "fp8_block_1x128", columnwise=True).columnwise_data, backend="aot_eager")
    assert_same("compiled quantize", g(x), reference(x, "fp8_block_1x128")["columnwise_data"])


# ------------------------------------------------------------------------------------------------
# more API: buffer_layout, usage selection, spec, NaN/Inf in FP8 block (spec §2.3: fmaxf amax)
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", _all_formats())
def test_buffer_layout_matches_quantize(fmt, gen):
    for shape in ((64, 96), (2, 3, 32, 160), (5, 16, 48)):
        if not (fmt in FP8_BLOCK or F.is_quantizable(shape, fmt)):
            continue
        x = make_input(shape, torch.float16, gen)
        ref = reference(x, fmt)
        for usage, (rw, cw) in USAGES.items():
            layout = F.buffer_layout(fmt, shape, rowwise=rw, columnwise=cw)
            q = quantize(x, fmt, usage)
            assert set(layout) == set(q.buffers()), (fmt, shape, usage)
            for name, (shp, dt) in layout.items():
                assert tuple(shp) == tuple(ref[name].shape) == tuple(getattr(q, name).shape), (fmt, name)
                assert dt == getattr(q, name).dtype, (fmt, name)


@pytest.mark.parametrize("fmt", _all_formats())
def test_dequantize_usage_and_spec(fmt, gen):
    x = make_input((3, 32, 64), torch.bfloat16, gen, span=(-2, 2))
    ref = reference(x, fmt)
    q = quantize(x, fmt, "both")
    for usage in ("rowwise", "columnwise"):
        exp = reference_dequantize(ref, fmt, tuple(x.shape), usage == "columnwise")
        assert_same(f"{fmt} dequantize(usage={usage})", q.dequantize(torch.float32, usage=usage), exp)
    with pytest.raises(ValueError, match="usage"):
        quantize(x, fmt, "rowwise").dequantize(usage="columnwise")
    with pytest.raises(ValueError, match="dtype"):
        q.dequantize(dtype=torch.float64)
    again = q.spec.quantize(x)
    for name, t in q.buffers().items():
        assert torch.equal(getattr(again, name), t), name


def test_fp8_block_nan_and_inf_follow_the_kernel_rules():
    """amax by fmaxf ignores NaN; an Inf amax gives scale 1 and Inf saturates; NaN encodes as NaN."""
    x = torch.zeros(3, 128)
    x[0, 0], x[0, 1] = float("nan"), 3.0
    x[1, 0], x[1, 1], x[1, 2] = float("inf"), 2.0, -float("inf")
    for fmt in FP8_BLOCK:
        for fp8, nan_code, max_code in ((E4M3, 0x7F, 0x7E), (E5M2, None, 0x7B)):
            q = F.quantize(x if fmt == "fp8_block_1x128" else x[:1], fmt, fp8_dtype=fp8)
            row0 = q.rowwise_data[0]
            assert float(q.rowwise_scale_inv[0, 0]) == (0.0078125 if fp8 == E4M3 else 2.0 ** -14)
            assert int(row0[1]) == int(R.encode_fp8(np.float32(3.0 * (128 if fp8 == E4M3 else 16384)), FP8_NAME[fp8]))
            if nan_code is not None:
                assert int(row0[0]) & 0x7F == nan_code
            else:
                assert int(row0[0]) & 0x7F in (0x7D, 0x7E, 0x7F)  # an E5M2 NaN
            if fmt == "fp8_block_1x128":
                assert float(q.rowwise_scale_inv[0, 1]) == 1.0
                assert q.rowwise_data[1, :3].tolist() == [max_code, int(R.encode_fp8(np.float32(2.0), FP8_NAME[fp8])),
                                                          0x80 | max_code]
