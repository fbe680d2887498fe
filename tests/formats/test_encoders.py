"""Every encoder at each of its round-to-nearest-even tie points and saturation edges, built
deterministically (random data only happens to hit them), through pyxfer's public quantize on the CPU:

- E4M3 / E5M2 elements: an FP8-block 1x128 block holding +Inf has scale 1 (§2.3 step 3), so its other
  elements are encoded as given: every midpoint between neighbouring codes, one fp32 ulp either side,
  the subnormal ties, and the saturation edges (max, the would-be next value's midpoint, FLT_MAX);
- E2M1 elements: an NVFP4 block of amax 6 under global amax 2688 has multiplier exactly 1 (S_enc = 1,
  block scale byte 1.0), so its elements are encoded as given: 0.25 ... 5 and above 6;
- E8M0 scales: MXFP8 block amaxes at 448 * 2^k (E5M2: 57344 * 2^k) and one ulp either side, against an
  exact rational ceil(log2) of the fp32 product amax * fl32(1/448);
- FP8-block scales: amaxes at fp8_max / 2^k and one ulp either side (pow2 rounding down), and the amax
  where fp8_max / amax first overflows fp32 (scale = the input dtype's max).
Expected codes come from the rule (ties to the even code) and are cross-checked with the reference's
exact rational encoder (tests/support/formats_reference.py)."""
import math
from fractions import Fraction

import numpy as np
import pytest
import torch

import pyxfer.formats as F

from support import formats_reference as R

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
f32 = np.float32
FLT_MAX = f32(np.finfo(np.float32).max)


def up(v):
    return f32(np.nextafter(f32(v), f32(np.inf)))


def down(v):
    return f32(np.nextafter(f32(v), f32(-np.inf)))


def fp8_cases(name):
    """(value, expected code) for positive values: ties, one ulp around them, saturation edges."""
    table, max_code, max_value = R.DECODE[name], R._NARROW[name]["max_code"], R._NARROW[name]["max_value"]
    cases = [(f32(0.0), 0), (f32(1e-45), 0)]
    for c in range(max_code):
        lo, hi = float(table[c]), float(table[c + 1])
        mid = f32((lo + hi) / 2)
        assert float(mid) == (lo + hi) / 2  # exact: one more mantissa bit than the format
        cases += [(mid, c if c % 2 == 0 else c + 1), (down(mid), c), (up(mid), c + 1), (f32(hi), c + 1)]
    step = float(table[max_code]) - float(table[max_code - 1])
    beyond = f32(max_value + step / 2)  # the midpoint to the value the format does not have
    cases += [(f32(max_value), max_code), (up(max_value), max_code), (down(beyond), max_code), (beyond, max_code),
              (up(beyond), max_code), (f32(2 * max_value), max_code), (FLT_MAX, max_code)]
    return cases


@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_fp8_element_encoder_ties_and_saturation(fp8):
    name = "e4m3" if fp8 == E4M3 else "e5m2"
    cases = fp8_cases(name)
    values = np.array([v for v, _ in cases] + [-v for v, _ in cases], np.float32)
    codes = np.array([c for _, c in cases] + [c | 0x80 for _, c in cases], np.uint8)
    for v, c in zip(values[1:len(cases)].tolist(), codes[1:len(cases)].tolist()):  # the rule vs the oracle
        assert R.encode_exact(Fraction(v), name) == c, (name, v, hex(c))
    rows = -(-values.size // 127)
    x = torch.zeros(rows, 128)
    x[:, 0] = float("inf")  # amax Inf -> scale 1: the other 127 elements of each row are encoded as given
    flat = torch.zeros(rows * 127)
    flat[:values.size] = torch.from_numpy(values)
    x[:, 1:] = flat.reshape(rows, 127)
    q = F.quantize(x, "fp8_block_1x128", fp8_dtype=fp8, columnwise=True)
    assert q.rowwise_scale_inv[0, :rows].tolist() == [1.0] * rows
    got = q.rowwise_data[:, 1:].reshape(-1)[:values.size].numpy()
    bad = np.flatnonzero(got != codes)
    assert bad.size == 0, [(float(values[i]), hex(got[i]), hex(codes[i])) for i in bad[:8]]
    assert q.rowwise_data[:, 0].tolist() == [R._NARROW[name]["max_code"]] * rows  # +Inf saturates to +max
    # the same values as 128x1 columns (columnwise 1x128 blocks): the same codes
    col = F.quantize(x.t().contiguous(), "fp8_block_1x128", fp8_dtype=fp8, rowwise=False, columnwise=True)
    assert torch.equal(col.columnwise_data, q.rowwise_data)


def test_e2m1_encoder_ties_and_saturation():
    ties = {0.25: 0, 0.75: 2, 1.25: 2, 1.75: 4, 2.5: 4, 3.5: 6, 5.0: 6}  # ties go to the even code
    below = {0.25: 0, 0.75: 1, 1.25: 2, 1.75: 3, 2.5: 4, 3.5: 5, 5.0: 6}  # one ulp below a tie: the lower code
    cases = [(f32(0.0), 0), (f32(1e-45), 0), (f32(0.5), 1), (f32(6.0), 7), (up(6.0), 7), (f32(6.25), 7)]
    for t, c in ties.items():
        cases += [(f32(t), c), (down(t), below[t]), (up(t), below[t] + 1)]
    for v, c in cases:  # the rule vs the oracle
        assert R.encode_exact(Fraction(float(v)), "e2m1") == c, (float(v), c)
    values = [v for v, _ in cases] + [-v for v, _ in cases]
    codes = [c for _, c in cases] + [c | 0x8 for _, c in cases]
    per_block = 15  # element 0 of each 16-element block is its amax, 6
    rows = 16
    blocks = -(-len(values) // per_block)
    x = torch.zeros(rows, 16 * blocks)
    x[:, 0::16] = 6.0
    flat = torch.zeros(blocks * per_block)
    flat[:len(values)] = torch.tensor(values)
    x[0].view(blocks, 16)[:, 1:] = flat.reshape(blocks, per_block)
    q = F.quantize(x, "nvfp4", global_amax=2688.0)  # S_enc = 1; block scale 6 * fl32(1/6) -> E4M3 1.0
    assert set(q.rowwise_scale_inv[:rows, :blocks].reshape(-1).tolist()) == {0x38}
    row = R.unpack_fp4(q.rowwise_data[0].numpy()).reshape(blocks, 16)
    assert row[:, 0].tolist() == [7] * blocks
    got = row[:, 1:].reshape(-1)[:len(values)].tolist()
    bad = [(float(v), g, c) for v, g, c in zip(values, got, codes) if g != c]
    assert not bad, bad[:8]


def _ceil_log2(v: float) -> int:
    """ceil(log2(v)) for a finite v > 0, exactly (frexp: v = m * 2^e with 0.5 <= m < 1)."""
    m, e = math.frexp(v)
    return e - 1 if m == 0.5 else e


@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_e8m0_scale_encoder_round_up_edges(fp8):
    fp8_max = 448.0 if fp8 == E4M3 else 57344.0
    rcp = f32(1.0 / fp8_max)
    amaxes = [f32(0.0), f32(1e-45), f32(2.0 ** -149 * 7), FLT_MAX]
    for k in range(-140, 128):
        if 0 < fp8_max * 2.0 ** k <= float(FLT_MAX):
            a = f32(fp8_max * 2.0 ** k)
            amaxes += [a, down(a), up(a)]
    amaxes = np.array([a for a in amaxes if np.isfinite(a)], np.float32)
    expected = []
    for a in amaxes.tolist():
        p = float(f32(a) * rcp)  # the fp32 product the rule rounds up
        expected.append(0 if p == 0 else min(max(_ceil_log2(p), -127), 127) + 127)
    rows = amaxes.size
    x = torch.zeros(R.rup(rows, 32), 32)
    x[:rows, 5] = torch.from_numpy(amaxes)
    x[:rows, 6] = -torch.from_numpy(amaxes) / 2
    q = F.quantize(x, "mxfp8", fp8_dtype=fp8)
    got = q.rowwise_scale_inv[:rows, 0].tolist()
    bad = [(float(a), hex(g), hex(e)) for a, g, e in zip(amaxes, got, expected) if g != e]
    assert not bad, bad[:8]
    assert got == R.mxfp8_e8m0_from_amax(amaxes, "e4m3" if fp8 == E4M3 else "e5m2").tolist()
    x[0, 5] = float("inf")  # the saturation edge: +Inf -> 0xFE
    assert int(F.quantize(x, "mxfp8", fp8_dtype=fp8).rowwise_scale_inv[0, 0]) == 0xFE


@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_fp8_block_scale_power_of_two_edges(fp8):
    """pow2 scales round fp8_max / amax down to a power of two: amax = fp8_max / 2^k gives exactly 2^k,
    one ulp above gives 2^(k-1), one ulp below still 2^k; scale_inv = 1 / scale."""
    fp8_max = 448.0 if fp8 == E4M3 else 57344.0
    amaxes, expected = [], []
    for k in range(-20, 60):
        a = f32(fp8_max / 2.0 ** k)
        amaxes += [a, up(a), down(a)]
        expected += [2.0 ** -k, 2.0 ** -(k - 1), 2.0 ** -k]  # scale_inv
    x = torch.zeros(len(amaxes), 128)
    x[:, 77] = torch.tensor(amaxes)
    q = F.quantize(x, "fp8_block_1x128", fp8_dtype=fp8)
    assert q.rowwise_scale_inv[0, :len(amaxes)].tolist() == expected
    q = F.quantize(x, "fp8_block_1x128", fp8_dtype=fp8, pow2_scales=False)  # exact quotients, no rounding down
    want = [float(R.scale_inv_1d(f32(fp8_max) / f32(a))) for a in amaxes]
    assert q.rowwise_scale_inv[0, :len(amaxes)].tolist() == want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fp8_block_scale_overflow_edge(dtype):
    """The smallest amax (of the input dtype) whose fp8_max / amax is finite in fp32, and the next
    smaller one, where the scale overflows and becomes the input dtype's max finite value (§2.3 step 4)."""
    fp8_max = f32(448.0)
    a = f32(fp8_max / FLT_MAX)  # near the edge; walk to the exact fp32 boundary
    with np.errstate(over="ignore"):
        while np.isfinite(fp8_max / down(a)):
            a = down(a)
        while not np.isfinite(fp8_max / a):
            a = up(a)
    t = torch.tensor([float(a)]).to(dtype)  # the input dtype's values either side of the boundary
    hi = t if float(t) >= float(a) else torch.nextafter(t, torch.tensor([1.0], dtype=dtype))
    lo = torch.nextafter(hi, torch.tensor([0.0], dtype=dtype))
    hi, lo = f32(float(hi)), f32(float(lo))
    with np.errstate(over="ignore"):
        assert np.isfinite(fp8_max / hi) and np.isinf(fp8_max / lo)
    in_max = f32(torch.finfo(dtype).max)
    for amax, scale in ((hi, fp8_max / hi), (lo, in_max)):
        x = torch.zeros(1, 128, dtype=dtype)
        x[0, 3] = float(amax)
        assert float(x[0, 3]) == float(amax)
        q = F.quantize(x, "fp8_block_1x128", pow2_scales=False)
        assert float(q.rowwise_scale_inv[0, 0]) == float(R.scale_inv_1d(scale)), (float(amax), dtype)
        assert int(q.rowwise_data[0, 3]) == int(R.encode_fp8(R.mul32(amax, f32(scale)), "e4m3"))
        q = F.quantize(x, "fp8_block_1x128")  # pow2: the scale's exponent only
        pow2 = R.from_bits(R.bits(f32(scale)) & np.uint32(0xFF800000))
        assert float(q.rowwise_scale_inv[0, 0]) == float(R.scale_inv_1d(pow2)) == 2.0 ** -127
