"""The format rules that CPU and CUDA share through csrc/include/pyxfer/formats.h, checked on the CPU
against rules written here from the spec (docs/specs/quantized-formats.md) on top of the
independent reference's primitives (tests/support/formats_reference.py): a wrong shared rule fails here even
though CPU == CUDA still holds.

Rules beyond the reference's default model (the spec leaves NaN out of TE's bit-exact contract, §9;
pyxfer fixes one behaviour and keeps CPU == CUDA on it):
- amax of every block is a NaN-dropping max from +0 (CUDA fmaxf, §2.3 step 1, for every format): a
  block of NaNs only has amax +0;
- a NaN element, of either sign, encodes as the positive NaN 0x7F (E4M3 and E5M2) or +6 (E2M1);
- NVFP4 S_enc = fminf(RN(2688 / A), FLT_MAX) (§4.3 step 1 "capped at FLT_MAX", with fminf's NaN
  rule: a NaN global amax gives FLT_MAX; a negative tiny one gives -Inf), 1 when A == 0 or S_enc == 0;
  the block scale S_dec_b is capped the same way (fminf: 0 x Inf = NaN becomes FLT_MAX).
"""
import re

import numpy as np
import pytest
import torch

import pyxfer.formats as F

from support import formats_reference as R

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_NAME = {E4M3: "e4m3", E5M2: "e5m2"}
IN_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_NAME = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
f32 = np.float32


# --- the rules, on the reference's primitives ----------------------------------------------------

def amax_rule(blocks, axis):
    """NaN-dropping max of |x| from +0 (fmaxf): NaN-only blocks give +0."""
    return np.fmax.reduce(np.abs(blocks), axis=axis, initial=f32(0.0)).astype(np.float32)


def fp8_rule(values, nan, fp8):
    codes = R.encode_fp8(values, fp8)
    codes[nan] = 0x7F  # the positive NaN of either FP8 encoding
    return codes


def fp8_block_rows(x2, fp8, pow2, eps, in_dtype):
    """1x128 blocks along the rows of x2 [R, C] -> (codes [R, C], scale_inv [R, cdiv(C, 128)])."""
    rows, cols = x2.shape
    nb = R.cdiv(cols, 128)
    xp = np.zeros((rows, nb * 128), np.float32)
    xp[:, :cols] = x2
    blocks = xp.reshape(rows, nb, 128)
    scale = R.fp8_block_scale(amax_rule(blocks, 2), fp8, pow2, eps, in_dtype)
    codes = fp8_rule(R.mul32(blocks, scale[:, :, None]), np.isnan(blocks), fp8)
    return codes.reshape(rows, nb * 128)[:, :cols], R.scale_inv_1d(scale)


def fp8_block_tiles(x2, fp8, pow2, in_dtype):
    """128x128 tiles of x2 [M, K] -> (codes [M, K], scale_inv [cdiv(M,128), cdiv(K,128)])."""
    m, k = x2.shape
    mb, kb = R.cdiv(m, 128), R.cdiv(k, 128)
    xp = np.zeros((mb * 128, kb * 128), np.float32)
    xp[:m, :k] = x2
    tiles = xp.reshape(mb, 128, kb, 128)
    scale = R.fp8_block_scale(amax_rule(tiles, (1, 3)), fp8, pow2, 0.0, in_dtype)
    codes = fp8_rule(R.mul32(tiles, scale[:, None, :, None]), np.isnan(tiles), fp8)
    return codes.reshape(mb * 128, kb * 128)[:m, :k], R.scale_inv_2d(scale)


def mxfp8_rows(x2, fp8):
    """1x32 blocks along the rows -> (codes [R, C], E8M0 bytes [R, C/32])."""
    rows, cols = x2.shape
    blocks = x2.reshape(rows, cols // 32, 32)
    e = R.mxfp8_e8m0_from_amax(amax_rule(blocks, 2), fp8)
    codes = fp8_rule(R.mul32(blocks, R.exp2f_rcp(e)[:, :, None]), np.isnan(blocks), fp8)
    return codes.reshape(rows, cols), e


def nvfp4_s_enc_rule(a):
    a = f32(a)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        s = f32(448.0 * 6.0) / a if a != 0 else f32(np.inf)
    s = f32(R.FLT_MAX) if np.isnan(s) else min(s, f32(R.FLT_MAX))
    return f32(1.0) if a == 0 or s == 0 else f32(s)


def nvfp4_rows(x2, a):
    """1x16 blocks along the rows -> (E2M1 codes [R, C], E4M3 scale bytes [R, C/16])."""
    rows, cols = x2.shape
    s_enc = nvfp4_s_enc_rule(a)
    s_dec = f32(1.0 / float(s_enc))
    blocks = x2.reshape(rows, cols // 16, 16)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        # fmin: a block of zeros under S_enc = +-Inf gives 0 * Inf = NaN, capped to FLT_MAX like fminf does
        s_dec_b = np.fmin(R.mul32(amax_rule(blocks, 2), R.mul32(s_enc, f32(1.0 / 6.0))), f32(R.FLT_MAX))
        s8 = R.encode_fp8(s_dec_b, "e4m3")
        denom = R.mul32(R.decode_fp8(s8, "e4m3"), s_dec)
        enc = np.where(denom == 0, f32(R.FLT_MAX), np.minimum(f32(1.0) / denom, f32(R.FLT_MAX))).astype(np.float32)
    codes = R.encode_e2m1(R.mul32(blocks, enc[:, :, None]))
    codes[np.isnan(blocks)] = 0x7  # +6
    return codes.reshape(rows, cols), s8


# --- inputs ---------------------------------------------------------------------------------------

def values(shape, dtype, gen, nan_every=None):
    """Random values over six orders of magnitude (exact in ``dtype``), with NaNs of either sign
    (quiet and signaling payloads) scattered ``1 in nan_every``; returned as (tensor, fp32 numpy)."""
    rng = np.random.default_rng(int(torch.randint(0, 2**62, (1,), generator=gen)))
    x = rng.standard_normal(shape).astype(np.float32) * (10.0 ** rng.uniform(-3, 3, shape[:-1] + (1,)))
    t = torch.from_numpy(x.astype(np.float32)).to(dtype)
    if nan_every:
        where = torch.from_numpy(rng.random(shape) < 1 / nan_every)
        t[where] = float("nan")
        signs = torch.from_numpy(rng.random(shape) < 0.5) & where
        bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[dtype]
        raw = t.view(bits)
        raw[signs] = raw[signs] | torch.tensor(-1 << (8 * t.element_size() - 1), dtype=bits)  # the sign bit
        raw[signs & torch.from_numpy(rng.random(shape) < 0.5)] += 1  # a payload
    return t, t.float().numpy()


def u8(t):
    return t.contiguous().numpy()


def f32bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


def assert_equal(what, got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    bad = np.argwhere(got != want)
    assert bad.size == 0, f"{what}: {len(bad)} differ, first at {bad[:4].tolist()}: got " \
                          f"{[got[tuple(i)] for i in bad[:4]]} want {[want[tuple(i)] for i in bad[:4]]}"


# --- FP8 block -----------------------------------------------------------------------------------

@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", IN_DTYPES, ids=str)
def test_fp8_block_nan_rules_match_the_reference(dtype, fp8, gen):
    """NaN-dropping amax (NaNs of either sign scattered; whole NaN blocks and tiles: amax +0, scale
    1), NaN -> 0x7F, Inf -> scale 1 and saturation; every usage, 1x128 and 128x128, partial blocks."""
    t, x = values((200, 300), dtype, gen, nan_every=37)
    t[5, 128:256] = float("nan")       # a whole 1x128 row block
    t[128:200, 256:300] = float("nan")  # a whole partial 128x128 tile, and 1x128 column blocks in it
    t[7, 3] = float("inf")
    t[9, 200] = -float("inf")
    x = t.float().numpy()
    name, in_dtype = FP8_NAME[fp8], DTYPE_NAME[dtype]
    for pow2 in (True, False):
        q = F.quantize(t, "fp8_block_1x128", columnwise=True, fp8_dtype=fp8, pow2_scales=pow2)
        codes, si = fp8_block_rows(x, name, pow2, 0.0, in_dtype)
        assert_equal("1x128 rowwise_data", u8(q.rowwise_data), codes)
        assert_equal("1x128 rowwise_scale_inv", f32bits(q.rowwise_scale_inv[:, :200].t()), f32bits(si))
        codes, si = fp8_block_rows(np.ascontiguousarray(x.T), name, pow2, 0.0, in_dtype)
        assert_equal("1x128 columnwise_data", u8(q.columnwise_data), codes)
        assert_equal("1x128 columnwise_scale_inv", f32bits(q.columnwise_scale_inv[:, :300].t()), f32bits(si))
        q = F.quantize(t, "fp8_block_128x128", columnwise=True, fp8_dtype=fp8, pow2_scales=pow2)
        codes, si = fp8_block_tiles(x, name, pow2, in_dtype)
        assert_equal("128x128 rowwise_data", u8(q.rowwise_data), codes)
        assert_equal("128x128 columnwise_data", u8(q.columnwise_data), codes.T)
        assert_equal("128x128 rowwise_scale_inv", f32bits(q.rowwise_scale_inv[:, :3]), f32bits(si))
        assert float(q.rowwise_scale_inv[1, 2]) == 1.0  # the NaN-only tile: amax +0 -> scale 1
    assert float(F.quantize(t, "fp8_block_1x128").rowwise_scale_inv[1, 5]) == 1.0  # the NaN-only row block ([kb, m])


def test_fp8_block_amax_epsilon_rule_matches_the_reference(gen):
    """amax < eps -> eps (§2.3 step 2): at eps exactly, just above and just below a block's amax."""
    t, x = values((64, 256), torch.float32, gen)
    amaxes = np.abs(x.reshape(64, 2, 128)).max(axis=2)
    a = float(amaxes[3, 0])
    for eps in (0.0, a, float(np.nextafter(f32(a), f32(np.inf))), float(np.nextafter(f32(a), f32(0))), 1e30):
        q = F.quantize(t, "fp8_block_1x128", amax_epsilon=eps, pow2_scales=False)
        codes, si = fp8_block_rows(x, "e4m3", False, eps, "float32")
        assert_equal(f"eps={eps} data", u8(q.rowwise_data), codes)
        assert_equal(f"eps={eps} scale_inv", f32bits(q.rowwise_scale_inv[:, :64].t()), f32bits(si))


# --- MXFP8 ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", IN_DTYPES, ids=str)
def test_mxfp8_nan_and_inf_rules_match_the_reference(dtype, fp8, gen):
    t, x = values((96, 160), dtype, gen, nan_every=29)
    t[4, 32:64] = float("nan")      # a NaN-only row block: amax +0 -> scale byte 0x00
    t[32:64, 7] = float("nan")      # a NaN-only column block
    t[10, 100] = float("inf")       # amax Inf -> 0xFE, the other elements of the block scale to ~0
    t[70, 150] = -float("inf")
    t[12, 0:32] = -0.0              # a block of -0: amax +0, data 0x80
    x = t.float().numpy()
    name = FP8_NAME[fp8]
    q = F.quantize(t, "mxfp8", columnwise=True, fp8_dtype=fp8)
    codes, e = mxfp8_rows(x, name)
    assert_equal("rowwise_data", u8(q.rowwise_data), codes)
    assert_equal("rowwise_scale_inv", u8(q.rowwise_scale_inv)[:96, :5], e)
    codes, e = mxfp8_rows(np.ascontiguousarray(x.T), name)
    assert_equal("columnwise_data", u8(q.columnwise_data), codes.T)
    assert_equal("columnwise_scale_inv", u8(q.columnwise_scale_inv)[:3, :160], e.T)
    assert int(q.rowwise_scale_inv[4, 1]) == 0 and int(q.columnwise_scale_inv[1, 7]) == 0
    assert int(q.rowwise_scale_inv[10, 3]) == 0xFE and set(u8(q.rowwise_data[12, :32]).tolist()) == {0x80}


# --- NVFP4 ---------------------------------------------------------------------------------------

def _check_nvfp4(t, a, what):
    x = t.float().numpy()
    amax = torch.tensor([a], dtype=torch.float32)
    q = F.quantize(t, "nvfp4", columnwise=True, global_amax=amax)
    m, k = x.shape
    codes, s8 = nvfp4_rows(x, a)
    assert_equal(f"{what} rowwise_data", u8(q.rowwise_data), R.pack_fp4(codes))
    assert_equal(f"{what} rowwise_scale_inv", u8(q.rowwise_scale_inv)[:m, :k // 16], s8)
    codes_t, s8_t = nvfp4_rows(np.ascontiguousarray(x.T), a)
    assert_equal(f"{what} columnwise_data", u8(q.columnwise_data), R.pack_fp4(codes_t))
    assert_equal(f"{what} columnwise_scale_inv", u8(q.columnwise_scale_inv)[:k, :m // 16], s8_t)
    # dequantize: e2m1(q) * RN(RN(s8 * A) * fl32(1 / 2688)), A as stored (negative and NaN included)
    with np.errstate(invalid="ignore", over="ignore"):
        want = R.dequantize_nvfp4(u8(q.rowwise_data), u8(q.rowwise_scale_inv), [a])
    assert_equal(f"{what} dequantize", f32bits(q.dequantize(torch.float32)), f32bits(want))
    return q


_AMAX_RULE = ("pyxfer.formats.quantize: global_amax must be None or a finite float32 value >= 0 or a 1-element "
              "floating-point tensor holding one, got ")


def _rejects_global_amax(t, a):
    """A global amax outside [0, FLT_MAX] (negative, NaN, inf) is rejected in every form (issue 22):
    the reference's rules for it (S_enc -Inf, FLT_MAX, 1) describe values no quantize returns."""
    with pytest.raises(ValueError, match="^" + re.escape(_AMAX_RULE + repr(a)) + "$"):
        F.quantize(t, "nvfp4", global_amax=a)
    for form in (np.float32(a), np.float64(a)):
        with pytest.raises(ValueError, match="^" + re.escape(_AMAX_RULE + repr(form)) + "$"):
            F.quantize(t, "nvfp4", global_amax=form)
    held = float(torch.tensor([a], dtype=torch.float32)[0])
    with pytest.raises(ValueError, match="^" + re.escape(f"{_AMAX_RULE}a tensor holding {held!r}") + "$"):
        F.quantize(t, "nvfp4", global_amax=torch.tensor([a], dtype=torch.float32))


@pytest.mark.parametrize("dtype", IN_DTYPES, ids=str)
def test_nvfp4_global_amax_rules_match_the_reference(dtype, gen):
    """Global amaxes the data does not give: 0 and -0 (S_enc 1), fp32 subnormals (S_enc capped at
    FLT_MAX), below the data's amax (block scales saturate at 448) and far above it (block scales
    underflow to 0) match the reference; negative, negative tiny, NaN and +Inf are rejected."""
    t, x = values((48, 64), dtype, gen)
    t[3, 16:32] = -0.0
    data_amax = float(np.abs(t.float().numpy()).max())
    for a in (0.0, -0.0, 1e-45, 1e-40, data_amax / 1e3, data_amax, data_amax * 1e30):
        _check_nvfp4(t, a, f"{dtype} A={a}")
    for a in (-data_amax, -1e-45, float("nan"), float("inf"), -float("inf")):
        _rejects_global_amax(t, a)


@pytest.mark.parametrize("dtype", IN_DTYPES, ids=str)
def test_nvfp4_nan_elements_match_the_reference(dtype, gen):
    t, _ = values((64, 96), dtype, gen, nan_every=23)
    t[0, 0:16] = float("nan")   # a NaN-only row block: amax +0, scale 0, data +6 (0x7)
    t[16:32, 5] = float("nan")  # a NaN-only column block
    finite = float(np.nanmax(np.abs(t.float().numpy())))
    q = _check_nvfp4(t, finite, f"{dtype} NaN elements")
    assert int(q.rowwise_scale_inv[0, 0]) == 0 and set(u8(q.rowwise_data[0, :8]).tolist()) == {0x77}
    # the default global amax of a tensor holding NaN is NaN (the max does not drop it there)
    d = F.quantize(t, "nvfp4")
    assert np.isnan(float(d.amax_rowwise[0]))
    # ...but a NaN given as the global amax is rejected (issue 22), in every form
    _rejects_global_amax(t, float("nan"))


def test_nvfp4_s_enc_rule_itself():
    """The rule used above, on its own edges (so a wrong rule here cannot agree with a wrong kernel)."""
    flt_max = f32(R.FLT_MAX)
    assert nvfp4_s_enc_rule(0.0) == 1.0 and nvfp4_s_enc_rule(np.inf) == 1.0 and nvfp4_s_enc_rule(-np.inf) == 1.0
    assert nvfp4_s_enc_rule(np.nan) == flt_max and nvfp4_s_enc_rule(1e-45) == flt_max
    assert nvfp4_s_enc_rule(-1e-45) == -np.inf and nvfp4_s_enc_rule(-1.0) == f32(-2688.0)
    assert nvfp4_s_enc_rule(10.0) == f32(2688.0) / f32(10.0) == R.nvfp4_s_enc(10.0)
    assert amax_rule(np.array([[np.nan, np.nan], [np.nan, -3.0]], np.float32), 1).tolist() == [0.0, 3.0]
