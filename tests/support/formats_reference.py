"""Independent bit-exact reference of the quantized formats, written from
docs/specs/quantized-formats.md (§1 encodings, §2.3/§3.3/§4.3 scale rules, §2.2/§3.2/§4.2 layouts,
§5 swizzle) and the buffer contract of pyxfer.formats (scale padding is zeroed). No pyxfer code, no
ml_dtypes: numpy (+ python ints) only.

Arithmetic model: every fp32 operation of the kernels is an IEEE single operation with
round-to-nearest-even and subnormals (numpy float32 ops are exactly that; there is no FMA here).
Conversions to the narrow types are done on the fp32 bit pattern with integer arithmetic.
16-bit inputs are converted to fp32 exactly by the caller (``torch_to_f32``); only the FP8-block
overflow rule looks at the input dtype (``in_dtype``: "float32" | "bfloat16" | "float16").

Conventions: all functions take/return numpy arrays. Quantized data and E8M0/E4M3 scales are uint8
arrays; FP8-block scale_inv are float32 arrays. Shapes are exactly the contract's buffer shapes.
"""
from __future__ import annotations

from fractions import Fraction

import numpy as np

f32 = np.float32
FLT_MAX = float(np.finfo(np.float32).max)
BF16_MAX = float.fromhex("0x1.FEp127")
FP16_MAX = 65504.0
INPUT_DTYPE_MAX = {"float32": FLT_MAX, "bfloat16": BF16_MAX, "float16": FP16_MAX}

# (exponent bits, mantissa bits, bias, largest finite magnitude code, max finite value)
FP8_E4M3 = "e4m3"
FP8_E5M2 = "e5m2"
_NARROW = {
    "e4m3": dict(ebits=4, mbits=3, bias=7, max_code=0x7E, max_value=448.0),
    "e5m2": dict(ebits=5, mbits=2, bias=15, max_code=0x7B, max_value=57344.0),
    "e2m1": dict(ebits=2, mbits=1, bias=1, max_code=0x7, max_value=6.0),
}
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}


def cdiv(a, b):
    return -(-a // b)


def rup(a, b):
    return b * cdiv(a, b)


def as_f32(x):
    a = np.asarray(x, dtype=np.float32)
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)  # (keeps 0-d arrays 0-d)


def bits(x):
    """fp32 -> uint32 bit pattern."""
    return as_f32(x).view(np.uint32)


def from_bits(u):
    return np.asarray(u, dtype=np.uint32).view(np.float32)


# ------------------------------------------------------------------------------------------------
# §1 element encodings
# ------------------------------------------------------------------------------------------------

def _encode_narrow(x, fmt):
    """fp32 -> narrow float code, round-to-nearest-even, saturating to the max finite (satfinite).

    Returns the code as int64 with the sign at bit (ebits + mbits). NaN -> all-ones magnitude
    (E4M3 0x7F, E5M2 0x7F, E2M1 undefined: spec says TE maps NaN to +6; we return 0x7 | sign).
    """
    p = _NARROW[fmt]
    mb, bias = p["mbits"], p["bias"]
    sign_bit = 1 << (p["ebits"] + mb)
    u = bits(x).astype(np.int64)
    sign = (u >> 31) & 1
    ef = (u >> 23) & 0xFF
    mant = u & 0x7FFFFF
    is_nan = (ef == 0xFF) & (mant != 0)
    is_inf = (ef == 0xFF) & (mant == 0)
    # |x| = sig * 2^(E - 23) with sig a 24-bit integer (normals) or the raw mantissa (subnormals)
    normal = ef != 0
    sig = np.where(normal, mant | 0x800000, mant)
    E = np.where(normal, ef - 127, -126)
    # quantum of the target type at this magnitude: 2^(max(E, 1 - bias) - mbits)
    e_t = np.maximum(E, 1 - bias)
    shift = e_t - mb - (E - 23)  # >= 23 - mbits > 0
    shift = np.minimum(shift, 40)  # beyond 25 everything rounds to 0 anyway
    q = sig >> shift
    rem = sig & ((np.int64(1) << shift) - 1)
    half = np.int64(1) << (shift - 1)
    q = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).astype(np.int64)
    # code = ((e_t + bias - 1) << mbits) + q covers subnormals, normals and the carry into the
    # next binade (q == 2^(mbits+1)) in one formula
    code = ((e_t + bias - 1) << mb) + q
    code = np.minimum(code, p["max_code"])
    code = np.where(is_inf, p["max_code"], code)
    code = np.where(is_nan, (sign_bit - 1), code)
    return code | (sign * sign_bit)


def encode_fp8(x, fp8="e4m3"):
    """fp32 array -> FP8 bytes (uint8), RNE, satfinite (|x| > max and ±Inf -> ±max)."""
    assert fp8 in FP8_MAX
    return _encode_narrow(x, fp8).astype(np.uint8)


def encode_e2m1(x):
    """fp32 array -> E2M1 4-bit codes (uint8 0..15), RNE, saturating to ±6."""
    return _encode_narrow(x, "e2m1").astype(np.uint8)


def _decode_table(fmt):
    p = _NARROW[fmt]
    eb, mb, bias = p["ebits"], p["mbits"], p["bias"]
    n = 1 << (1 + eb + mb)
    out = np.empty(n, dtype=np.float32)
    for c in range(n):
        s = -1.0 if c >> (eb + mb) else 1.0
        e = (c >> mb) & ((1 << eb) - 1)
        m = c & ((1 << mb) - 1)
        if fmt == "e4m3" and e == 15 and m == 7:
            v = float("nan")
        elif fmt == "e5m2" and e == 31:
            v = s * float("inf") if m == 0 else float("nan")
        elif e == 0:
            v = s * m * 2.0 ** (1 - bias - mb)
        else:
            v = s * (1 + m / (1 << mb)) * 2.0 ** (e - bias)
        out[c] = v
    return out


DECODE = {f: _decode_table(f) for f in ("e4m3", "e5m2", "e2m1")}


def decode_fp8(b, fp8="e4m3"):
    return DECODE[fp8][np.asarray(b, dtype=np.uint8)]


def decode_e2m1(codes):
    return DECODE["e2m1"][np.asarray(codes, dtype=np.uint8) & 0xF]


def encode_exact(value: Fraction | float, fmt: str) -> int:
    """Slow scalar oracle: nearest representable value by exact rational arithmetic, ties to even
    code, saturating. Used to check the vectorized encoder. Finite inputs only."""
    p = _NARROW[fmt]
    v = Fraction(value)
    sign = 1 if v < 0 else 0
    a = abs(v)
    best = None
    for code in range(p["max_code"] + 1):
        cv = Fraction(float(DECODE[fmt][code]))
        d = abs(cv - a)
        if best is None or d < best[0] or (d == best[0] and code % 2 == 0):
            best = (d, code)
    code = best[1]
    if a > Fraction(p["max_value"]):
        code = p["max_code"]
    return code | (sign << (p["ebits"] + p["mbits"]))


# ------------------------------------------------------------------------------------------------
# E8M0 (§3.3) and its power-of-two helpers
# ------------------------------------------------------------------------------------------------

def float_to_e8m0(v):
    """TE's round-UP rule: e = clamp(ceil(log2 v), -127, 127) + 127 for finite v > 0 (exactly, on
    the bits, subnormal v included); 0 -> 0x00, +Inf -> 0xFE (satfinite), NaN -> 0xFF."""
    u = bits(v).astype(np.int64) & 0x7FFFFFFF
    ef = u >> 23
    mant = u & 0x7FFFFF
    e_norm = np.minimum(ef + (mant != 0), 254)
    e_sub = (mant > 0x400000).astype(np.int64)  # v in (0, 2^-127] -> 2^-127 (0), else 2^-126 (1)
    e = np.where(ef == 0, e_sub, e_norm)
    e = np.where((ef == 0xFF) & (mant == 0), 0xFE, e)
    e = np.where((ef == 0xFF) & (mant != 0), 0xFF, e)
    return e.astype(np.uint8)


def exp2f(e):
    """E8M0 byte -> 2^(e-127) as fp32 (e = 0 -> 2^-127, a subnormal; 255 -> NaN)."""
    e = np.asarray(e).astype(np.int64)
    u = np.where(e == 0, 0x00400000, e << 23)
    u = np.where(e == 255, 0x7FC00000, u)
    return from_bits(u.astype(np.uint32))


def exp2f_rcp(e):
    """E8M0 byte -> 2^(127-e) as fp32 (e = 254 -> 2^-127 subnormal, 255 -> NaN)."""
    e = np.asarray(e).astype(np.int64)
    u = np.where(e == 254, 0x00400000, (254 - e) << 23)
    u = np.where(e == 255, 0x7FC00000, u)
    return from_bits(u.astype(np.uint32))


def mxfp8_e8m0_from_amax(amax, fp8="e4m3"):
    rcp = f32(1.0 / FP8_MAX[fp8])
    with np.errstate(over="ignore"):
        v = as_f32(amax) * rcp
    return float_to_e8m0(v)


# ------------------------------------------------------------------------------------------------
# FP8 block scale (§2.3)
# ------------------------------------------------------------------------------------------------

def fp8_block_scale(amax, fp8="e4m3", pow2=True, eps=0.0, in_dtype="float32"):
    """amax (fp32 array) -> scale (fp32 array)."""
    amax = as_f32(amax).copy()
    eps32 = f32(eps)
    amax = np.where(amax < eps32, eps32, amax).astype(np.float32)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        scale = f32(FP8_MAX[fp8]) / amax
    scale = np.where(np.isinf(scale), f32(INPUT_DTYPE_MAX[in_dtype]), scale).astype(np.float32)
    bad = (amax == 0) | np.isinf(amax) | np.isnan(amax)
    scale = np.where(bad, f32(1.0), scale).astype(np.float32)
    if pow2:
        scale = from_bits(bits(scale) & np.uint32(0xFF800000))
    return as_f32(scale)


def scale_inv_1d(scale):
    """1-D kernel: 1.0 / scale in double, narrowed to fp32."""
    with np.errstate(divide="ignore"):
        return (1.0 / np.asarray(scale, dtype=np.float64)).astype(np.float32)


def scale_inv_2d(scale):
    """2-D kernel: 1.0f / scale in fp32."""
    with np.errstate(divide="ignore"):
        return f32(1.0) / as_f32(scale)


def mul32(a, b):
    with np.errstate(over="ignore", invalid="ignore"):
        return as_f32(a) * as_f32(b)


def _abs_max(x, axis):
    return np.max(np.abs(x), axis=axis) if x.size else np.zeros(
        [s for i, s in enumerate(x.shape) if i != axis], np.float32)


# ------------------------------------------------------------------------------------------------
# full-tensor quantize / dequantize, contract layouts
# ------------------------------------------------------------------------------------------------

def _flat2d(x):
    x = as_f32(x)
    assert x.ndim >= 1
    K = x.shape[-1]
    M = int(np.prod(x.shape[:-1], dtype=np.int64))
    return x.reshape(M, K), M, K


def _col_shape(shape):
    """(K, d0, ..., d_{n-2}) of a logical shape."""
    return (shape[-1],) + tuple(shape[:-1])


def _fp8_1d_rows(x2, fp8, pow2, eps, in_dtype):
    """1x128 blocks along the rows of x2 [R, C]: returns data [R, C] and scale_inv [R, cdiv(C,128)]."""
    R, C = x2.shape
    Cb = cdiv(C, 128)
    xp = np.zeros((R, Cb * 128), np.float32)
    xp[:, :C] = x2
    blocks = xp.reshape(R, Cb, 128)
    amax = np.abs(blocks).max(axis=2) if R and Cb else np.zeros((R, Cb), np.float32)
    scale = fp8_block_scale(amax, fp8, pow2, eps, in_dtype)
    q = encode_fp8(mul32(blocks, scale[:, :, None]), fp8).reshape(R, Cb * 128)[:, :C]
    return q, scale_inv_1d(scale)


def quantize_fp8_block(x, block_dim=1, rowwise=True, columnwise=False, fp8="e4m3", pow2=True,
                       eps=0.0, in_dtype="float32"):
    """Returns (rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv); unused
    usages are None. x: fp32 numpy array (exact conversion of the input), ndim >= 1."""
    x = as_f32(x)
    shape = x.shape
    x2, M, K = _flat2d(x)
    rd = rs = cd = cs = None
    if block_dim == 1:
        if rowwise:
            q, si = _fp8_1d_rows(x2, fp8, pow2, eps, in_dtype)  # si [M, Kb]
            rd = q.reshape(shape)
            rs = np.zeros((cdiv(K, 128), rup(M, 4)), np.float32)
            rs[:, :M] = si.T
        if columnwise:
            q, si = _fp8_1d_rows(np.ascontiguousarray(x2.T), fp8, pow2, eps, in_dtype)  # [K, M], [K, Mb]
            cd = q.reshape(_col_shape(shape))
            cs = np.zeros((cdiv(M, 128), rup(K, 4)), np.float32)
            cs[:, :K] = si.T
    elif block_dim == 2:
        Mb, Kb = cdiv(M, 128), cdiv(K, 128)
        xp = np.zeros((Mb * 128, Kb * 128), np.float32)
        xp[:M, :K] = x2
        tiles = xp.reshape(Mb, 128, Kb, 128)
        amax = np.abs(tiles).max(axis=(1, 3)) if Mb and Kb else np.zeros((Mb, Kb), np.float32)
        scale = fp8_block_scale(amax, fp8, pow2, eps, in_dtype)
        si = scale_inv_2d(scale)
        q = encode_fp8(mul32(tiles, scale[:, None, :, None]), fp8).reshape(Mb * 128, Kb * 128)[:M, :K]
        if rowwise:
            rd = q.reshape(shape)
            rs = np.zeros((Mb, rup(Kb, 4)), np.float32)
            rs[:, :Kb] = si
        if columnwise:
            cd = np.ascontiguousarray(q.T).reshape(_col_shape(shape))
            cs = np.zeros((Kb, rup(Mb, 4)), np.float32)
            cs[:, :Mb] = si.T
    else:
        raise ValueError(block_dim)
    return rd, rs, cd, cs


def dequantize_fp8_block(data, scale_inv, block_dim=1, columnwise=False, fp8="e4m3"):
    """-> fp32 array of the logical shape (columnwise data (K, d0..) is permuted back)."""
    data = np.asarray(data, dtype=np.uint8)
    scale_inv = as_f32(scale_inv)
    if columnwise:
        K = data.shape[0]
        lead = data.shape[1:]
        M = int(np.prod(lead, dtype=np.int64))
        d2 = data.reshape(K, M).T  # [M, K]
        out_shape = tuple(lead) + (K,)
    else:
        K = data.shape[-1]
        M = int(np.prod(data.shape[:-1], dtype=np.int64))
        d2 = data.reshape(M, K)
        out_shape = data.shape
    m = np.arange(M)[:, None]
    k = np.arange(K)[None, :]
    if block_dim == 1:
        s = scale_inv[m // 128, k] if columnwise else scale_inv[k // 128, m]
    else:
        s = scale_inv[k // 128, m // 128] if columnwise else scale_inv[m // 128, k // 128]
    return mul32(decode_fp8(d2, fp8), s).reshape(out_shape)


def quantize_mxfp8(x, rowwise=True, columnwise=False, fp8="e4m3"):
    x = as_f32(x)
    shape = x.shape
    x2, M, K = _flat2d(x)
    assert M % 32 == 0 and K % 32 == 0
    rd = rs = cd = cs = None
    if rowwise:
        b = x2.reshape(M, K // 32, 32)
        e = mxfp8_e8m0_from_amax(_abs_max(b, 2), fp8)
        rd = encode_fp8(mul32(b, exp2f_rcp(e)[:, :, None]), fp8).reshape(shape)
        rs = np.zeros((rup(M, 128), rup(K // 32, 4)), np.uint8)
        rs[:M, :K // 32] = e
    if columnwise:
        b = x2.reshape(M // 32, 32, K)
        e = mxfp8_e8m0_from_amax(_abs_max(b, 1), fp8)
        cd = encode_fp8(mul32(b, exp2f_rcp(e)[:, None, :]), fp8).reshape(shape)
        cs = np.zeros((rup(M // 32, 4), rup(K, 128)), np.uint8)
        cs[:M // 32, :K] = e
    return rd, rs, cd, cs


def dequantize_mxfp8(data, scale_inv, columnwise=False, fp8="e4m3"):
    data = np.asarray(data, dtype=np.uint8)
    K = data.shape[-1]
    M = int(np.prod(data.shape[:-1], dtype=np.int64))
    d2 = data.reshape(M, K)
    m = np.arange(M)[:, None]
    k = np.arange(K)[None, :]
    e = scale_inv[m // 32, k] if columnwise else scale_inv[m, k // 32]
    return mul32(decode_fp8(d2, fp8), exp2f(e)).reshape(data.shape)


def nvfp4_s_enc(global_amax, e4m3_max=448.0):
    """S_enc = RN(E*6 / A), capped at FLT_MAX; A == 0 or result 0 -> 1."""
    A = f32(global_amax)
    with np.errstate(divide="ignore", over="ignore"):
        s = f32(e4m3_max * 6.0) / A
    if np.isinf(s):
        s = f32(FLT_MAX)
    if A == 0 or s == 0:
        s = f32(1.0)
    return f32(s)


def _nvfp4_rows(x2, A):
    """1x16 blocks along the rows of x2 [R, C] -> (codes [R, C] uint8, s8 [R, C/16] uint8)."""
    R, C = x2.shape
    S_enc = nvfp4_s_enc(A)
    S_dec = f32(1.0 / float(S_enc))
    b = x2.reshape(R, C // 16, 16)
    bamax = _abs_max(b, 2)
    with np.errstate(over="ignore"):
        s_dec_b = bamax * (S_enc * f32(f32(1.0) / f32(6.0)))
    s_dec_b = np.minimum(s_dec_b, f32(FLT_MAX)).astype(np.float32)
    s8 = encode_fp8(s_dec_b, "e4m3")
    denom = decode_fp8(s8, "e4m3") * S_dec
    with np.errstate(divide="ignore", over="ignore"):
        enc = f32(1.0) / denom
    enc = np.minimum(enc, f32(FLT_MAX)).astype(np.float32)
    codes = encode_e2m1(mul32(b, enc[:, :, None])).reshape(R, C)
    return codes, s8


def pack_fp4(codes):
    """[..., 2n] codes -> [..., n] bytes, even element in the low nibble."""
    codes = np.asarray(codes, dtype=np.uint8)
    return (codes[..., 0::2] & 0xF) | ((codes[..., 1::2] & 0xF) << 4)


def unpack_fp4(packed):
    packed = np.asarray(packed, dtype=np.uint8)
    out = np.empty(packed.shape[:-1] + (packed.shape[-1] * 2,), np.uint8)
    out[..., 0::2] = packed & 0xF
    out[..., 1::2] = packed >> 4
    return out


def nvfp4_global_amax(x):
    x = as_f32(x)
    return f32(np.max(np.abs(x))) if x.size else f32(0.0)


def quantize_nvfp4(x, global_amax=None, rowwise=True, columnwise=False):
    """Returns (rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv, amax)."""
    x = as_f32(x)
    shape = x.shape
    x2, M, K = _flat2d(x)
    assert M % 16 == 0 and K % 16 == 0
    A = nvfp4_global_amax(x) if global_amax is None else f32(global_amax)
    rd = rs = cd = cs = None
    if rowwise:
        codes, s8 = _nvfp4_rows(x2, A)
        rd = pack_fp4(codes).reshape(tuple(shape[:-1]) + (K // 2,))
        rs = np.zeros((rup(M, 128), rup(K // 16, 4)), np.uint8)
        rs[:M, :K // 16] = s8
    if columnwise:
        codes, s8 = _nvfp4_rows(np.ascontiguousarray(x2.T), A)  # [K, M], [K, M/16]
        cd = pack_fp4(codes)
        cs = np.zeros((rup(K, 128), rup(M // 16, 4)), np.uint8)
        cs[:K, :M // 16] = s8
    return rd, rs, cd, cs, np.array([A], np.float32)


def dequantize_nvfp4(data, scale_inv, amax, columnwise=False, e4m3_max=448.0):
    """rowwise: data (..., K/2) -> (..., K); columnwise: data [K, M/2] -> [M, K]."""
    data = np.asarray(data, dtype=np.uint8)
    A = f32(np.asarray(amax, np.float32).reshape(-1)[0])
    codes = unpack_fp4(data)
    if columnwise:
        K, M = codes.shape
        c2 = codes.T
        out_shape = (M, K)
    else:
        K = codes.shape[-1]
        M = int(np.prod(codes.shape[:-1], dtype=np.int64))
        c2 = codes.reshape(M, K)
        out_shape = codes.shape
    m = np.arange(M)[:, None]
    k = np.arange(K)[None, :]
    s8 = scale_inv[k, m // 16] if columnwise else scale_inv[m, k // 16]
    factor_inv = f32(1.0 / (6.0 * e4m3_max))
    final = mul32(mul32(decode_fp8(s8, "e4m3"), A), factor_inv)
    return mul32(decode_e2m1(c2), final).reshape(out_shape)


# ------------------------------------------------------------------------------------------------
# §5 GEMM-swizzled scale layout
# ------------------------------------------------------------------------------------------------

def swizzle_index(i, j, num_tiles_x):
    """Flat position of compact entry (i, j) in the swizzled buffer; num_tiles_x = T."""
    i = np.asarray(i)
    j = np.asarray(j)
    return ((i // 128) * num_tiles_x + (j // 4)) * 512 + (i % 32) * 16 + ((i % 128) // 32) * 4 + (j % 4)


def swizzle(compact, transpose=False):
    """compact [R, C] -> swizzled (same shape, bytes permuted). transpose=False: i = row, j = col,
    T = C/4 (requires R%128, C%4). transpose=True (MXFP8 columnwise [mb, k]): i = col, j = row,
    T = R/4 (requires C%128, R%4)."""
    compact = np.asarray(compact)
    R, C = compact.shape
    r = np.arange(R)[:, None]
    c = np.arange(C)[None, :]
    if transpose:
        assert C % 128 == 0 and R % 4 == 0
        idx = swizzle_index(c, r, R // 4)
    else:
        assert R % 128 == 0 and C % 4 == 0
        idx = swizzle_index(r, c, C // 4)
    out = np.empty(R * C, compact.dtype)
    out[idx.reshape(-1)] = compact.reshape(-1)
    return out.reshape(R, C)


def unswizzle(swizzled, transpose=False):
    swizzled = np.asarray(swizzled)
    R, C = swizzled.shape
    r = np.arange(R)[:, None]
    c = np.arange(C)[None, :]
    idx = swizzle_index(c, r, R // 4) if transpose else swizzle_index(r, c, C // 4)
    return swizzled.reshape(-1)[idx]


# ------------------------------------------------------------------------------------------------
# output casts (dequantize to bf16/fp16), on bits
# ------------------------------------------------------------------------------------------------

def f32_to_bf16_bits(x):
    """RNE fp32 -> bf16 bit pattern (uint16); NaN stays a quiet NaN."""
    u = bits(x).astype(np.uint64)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = np.isnan(as_f32(x))
    r = np.where(nan, (u >> 16) | 0x40, r)
    return (r & 0xFFFF).astype(np.uint16)


def f32_to_f16_bits(x):
    """RNE fp32 -> fp16 (numpy's conversion is correctly rounded, overflow -> Inf)."""
    with np.errstate(over="ignore"):
        return as_f32(x).astype(np.float16).view(np.uint16)


def cast_bits(x32, out_dtype):
    """fp32 array -> bit pattern of the output dtype ('float32' -> uint32, 16-bit -> uint16)."""
    if out_dtype == "float32":
        return bits(x32)
    if out_dtype == "bfloat16":
        return f32_to_bf16_bits(x32)
    if out_dtype == "float16":
        return f32_to_f16_bits(x32)
    raise ValueError(out_dtype)
