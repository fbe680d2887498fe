"""The pyxfer.formats test matrix and its bit-exact checks, shared by the CPU tests
(formats/test_formats.py, against the independent reference support.formats_reference) and the CUDA
tests (formats/test_formats_gpu.py): formats, usages, input and FP8 dtypes, options; inputs with
every kind of value; comparisons that name the first differing element."""
import math

import numpy as np
import torch

import pyxfer.formats as F

from support import formats_reference as R

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_NAME = {E4M3: "e4m3", E5M2: "e5m2"}
DTYPE_NAME = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
IN_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FP8_BLOCK = ["fp8_block_1x128", "fp8_block_128x128"]
USAGES = {"rowwise": (True, False), "columnwise": (False, True), "both": (True, True)}
BUFFERS = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")
FP8_BLOCK_OPTIONS = [dict(pow2_scales=True), dict(pow2_scales=False),
                     dict(pow2_scales=True, amax_epsilon=1e-3), dict(pow2_scales=False, amax_epsilon=2.5e-2)]


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------

def np32(t):
    """Exact fp32 values of a float tensor (any layout) as a contiguous numpy array."""
    return t.detach().to(torch.float32).contiguous().numpy()


def tbits(t):
    """A tensor's raw bits as numpy (uint8 / uint16 / uint32 by itemsize)."""
    t = t.detach().contiguous()
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]
    npview = {1: np.uint8, 2: np.uint16, 4: np.uint32}[t.element_size()]
    return t.view(view).numpy().view(npview)


def ebits(a):
    """Bits of a reference numpy array (uint8 stays; fp32 -> uint32)."""
    a = np.asarray(a)
    return a.view(np.uint32) if a.dtype == np.float32 else a


def assert_same(what, got, expected, x=None):
    """Bitwise equality of a pyxfer tensor with a reference numpy array, with a precise message."""
    assert got is not None, f"{what}: missing"
    assert tuple(got.shape) == tuple(expected.shape), f"{what}: shape {tuple(got.shape)} != {expected.shape}"
    g, e = tbits(got), ebits(expected)
    assert g.dtype == e.dtype, f"{what}: dtype {got.dtype} vs reference {expected.dtype}"
    if not np.array_equal(g, e):
        bad = np.argwhere(g != e)
        lines = []
        for idx in bad[:6]:
            idx = tuple(int(i) for i in idx)
            lines.append(f"  at {idx}: got 0x{int(g[idx]):x} expected 0x{int(e[idx]):x}")
        more = "" if x is None else f"\n  input shape {tuple(x.shape)} dtype {x.dtype} strides {x.stride()}"
        raise AssertionError(f"{what}: {len(bad)} of {g.size} differ\n" + "\n".join(lines) + more)


def make_input(shape, dtype, gen, *, span=None, zero_rows=True, tiny=True):
    """Random values over many orders of magnitude: a per-row and a per-column magnitude (so both
    row blocks and column blocks vary), a few all-zero rows / column chunks, a few elements far
    below their block's amax (subnormal FP8/FP4 results). No NaN/Inf, no exact -0.0.
    (numpy does the arithmetic, seeded from the test's torch generator: faster on small CPUs.)"""
    shape = tuple(shape)
    rng = np.random.default_rng(int(torch.randint(0, 2**62, (1,), generator=gen)))
    K = shape[-1] if shape else 1
    M = math.prod(shape[:-1]) if len(shape) > 1 else 1
    if span is None:
        span = {torch.float32: (-7.0, 7.0), torch.bfloat16: (-7.0, 7.0), torch.float16: (-4.0, 4.0)}[dtype]
    lo, hi = span
    x = rng.standard_normal((M, K), dtype=np.float32)
    r = 10.0 ** rng.uniform(lo / 2, hi / 2, (M, 1))
    c = 10.0 ** rng.uniform(lo / 2, hi / 2, (1, K))
    x = (x * (r * c)).astype(np.float32)
    if tiny and x.size:
        mask = rng.random((M, K)) < 0.05
        x[mask] *= np.exp2(-rng.integers(8, 20, int(mask.sum()))).astype(np.float32)
    if zero_rows and M > 2:
        x[rng.random(M) < 0.1] = 0
    if zero_rows and K > 32:
        for _ in range(2):
            k0 = int(rng.integers(0, K))
            x[:, k0:k0 + 32] = 0
    if dtype == torch.float16:
        x = np.clip(x, -60000, 60000)
    t = torch.from_numpy(x).to(dtype)
    t = t + 0.0  # -0.0 (from underflowing casts) -> +0.0
    return t.reshape(shape)


def views(shape, dtype, gen, **kw):
    """(name, tensor of logical `shape`): contiguous, storage offset, strided rows, sliced columns,
    transposed base."""
    shape = tuple(shape)
    yield "contiguous", make_input(shape, dtype, gen, **kw)
    n = math.prod(shape)
    yield "offset", make_input((n + 3,), dtype, gen, **kw)[3:].view(shape)
    big = make_input((shape[0] * 2,) + shape[1:], dtype, gen, **kw)
    yield "strided-rows", big[::2]
    wide = make_input(shape[:-1] + (shape[-1] + 5,), dtype, gen, **kw)
    yield "sliced-cols", wide[..., 2:2 + shape[-1]]
    if len(shape) >= 2:
        tshape = shape[:-2] + (shape[-1], shape[-2])
        yield "transposed", make_input(tshape, dtype, gen, **kw).transpose(-1, -2)


def quantize(x, fmt, usage="both", fp8_dtype=E4M3, **opts):
    rowwise, columnwise = USAGES[usage]
    if fmt == "nvfp4":
        return F.quantize(x, fmt, rowwise=rowwise, columnwise=columnwise, **opts)
    return F.quantize(x, fmt, rowwise=rowwise, columnwise=columnwise, fp8_dtype=fp8_dtype, **opts)


def reference(x, fmt, fp8_dtype=E4M3, **opts):
    """Reference buffers (dict) for both usages of x (a torch tensor)."""
    xn = np32(x)
    fp8 = FP8_NAME.get(fp8_dtype, "e4m3")
    if fmt in FP8_BLOCK:
        bufs = R.quantize_fp8_block(xn, 1 if fmt == "fp8_block_1x128" else 2, True, True, fp8,
                                    opts.get("pow2_scales", True), opts.get("amax_epsilon", 0.0),
                                    DTYPE_NAME[x.dtype])
        return dict(zip(BUFFERS, bufs))
    if fmt == "mxfp8":
        return dict(zip(BUFFERS, R.quantize_mxfp8(xn, True, True, fp8)))
    if fmt == "nvfp4":
        ga = opts.get("global_amax")
        if isinstance(ga, torch.Tensor):
            ga = float(ga.reshape(-1)[0])
        *bufs, amax = R.quantize_nvfp4(xn, ga, True, True)
        d = dict(zip(BUFFERS, bufs))
        d["amax_rowwise"] = d["amax_columnwise"] = amax
        return d
    raise AssertionError(fmt)


def reference_dequantize(ref, fmt, shape, columnwise, fp8_dtype=E4M3):
    """fp32 numpy array of the logical shape."""
    fp8 = FP8_NAME.get(fp8_dtype, "e4m3")
    data = ref["columnwise_data" if columnwise else "rowwise_data"]
    scale = ref["columnwise_scale_inv" if columnwise else "rowwise_scale_inv"]
    if fmt in FP8_BLOCK:
        out = R.dequantize_fp8_block(data, scale, 1 if fmt == "fp8_block_1x128" else 2, columnwise, fp8)
    elif fmt == "mxfp8":
        out = R.dequantize_mxfp8(data, scale, columnwise, fp8)
    else:
        out = R.dequantize_nvfp4(data, scale, ref["amax_columnwise" if columnwise else "amax_rowwise"], columnwise)
    return out.reshape(shape)


def check_quantized(qt, ref, usage, x, what):
    rowwise, columnwise = USAGES[usage]
    for name in BUFFERS:
        buf = getattr(qt, name)
        used = rowwise if name.startswith("rowwise") else columnwise
        if used:
            assert_same(f"{what} {name}", buf, ref[name], x)
        else:
            assert buf is None, f"{what} {name}: expected None for an unused usage"
    if "amax_rowwise" in ref:
        for name, used in (("amax_rowwise", rowwise), ("amax_columnwise", columnwise)):
            buf = getattr(qt, name)
            if used:
                assert_same(f"{what} {name}", buf, ref[name], x)
            else:
                assert buf is None, f"{what} {name}: expected None for an unused usage"


def check_dequantize(qt, ref, fmt, usage, x, what, fp8_dtype=E4M3, out_dtypes=(None,)):
    columnwise = usage == "columnwise"
    exp32 = reference_dequantize(ref, fmt, tuple(x.shape), columnwise, fp8_dtype)
    for dt in out_dtypes:
        got = qt.dequantize() if dt is None else qt.dequantize(dtype=dt)
        want = x.dtype if dt is None else dt
        assert got.dtype == want and tuple(got.shape) == tuple(x.shape), f"{what} dequantize({dt})"
        assert_same(f"{what} dequantize({dt})", got, R.cast_bits(exp32, DTYPE_NAME[want]), x)
