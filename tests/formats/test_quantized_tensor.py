"""The QuantizedTensor / QuantizeSpec API around the kernels, on the CPU: repr, spec round trips,
verified moves of every buffer, scale-layout conversions of one-usage tensors, usage and dtype
selection in dequantize, immutability and hashing of specs, the scale-swizzle argument checks."""
import re

import pytest
import torch

import pyxfer
import pyxfer.formats as F

from support import formats_reference as R

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _bits(t):
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("fmt", F.FORMATS)
def test_repr_names_format_shape_dtype_device_usages_and_options(fmt):
    x = torch.randn(2, 32, 64, dtype=torch.bfloat16)
    q = F.quantize(x, fmt, rowwise=False, columnwise=True)
    opts = ", ".join(f"{k}={v}" for k, v in q.options.items())
    assert repr(q) == f"{type(q).__name__}(fmt={fmt}, shape=(2, 32, 64), dtype=torch.bfloat16, device=cpu, " \
                      f"columnwise, {opts})"
    assert "rowwise+columnwise" in repr(F.quantize(x, fmt, columnwise=True))


@pytest.mark.parametrize("fmt", F.FORMATS)
def test_spec_of_a_tensor_quantizes_the_same_bits(fmt, gen):
    x = torch.randn(64, 96, generator=gen)
    opts = {"fp8_block_1x128": dict(fp8_dtype=E5M2, pow2_scales=False, amax_epsilon=0.25),
            "fp8_block_128x128": dict(fp8_dtype=E5M2), "mxfp8": dict(fp8_dtype=E5M2, gemm_swizzled_scales=True),
            "nvfp4": dict(gemm_swizzled_scales=True)}[fmt]
    if fmt == "mxfp8":
        x = x[:, :64]
    q = F.quantize(x, fmt, rowwise=False, columnwise=True, **opts)
    spec = q.spec
    assert (spec.fmt, spec.rowwise, spec.columnwise) == (fmt, False, True)
    assert spec.fp8_dtype == opts.get("fp8_dtype", E4M3)
    again = spec.quantize(x)
    assert type(again) is type(q) and again.options == q.options
    for name, t in q.buffers().items():
        assert torch.equal(_bits(getattr(again, name)), _bits(t)), name


@pytest.mark.parametrize("fmt", F.FORMATS)
def test_to_moves_every_buffer_through_a_verified_copy(fmt, gen):
    x = torch.randn(32, 128, generator=gen)
    q = F.quantize(x, fmt, columnwise=True)
    pyxfer.health.reset()
    moved = q.to("cpu", verify="deferred")
    pyxfer.check_transfers()
    assert type(moved) is type(q) and moved.options == q.options and moved.shape == q.shape
    for name, t in q.buffers().items():
        got = getattr(moved, name)
        assert got.data_ptr() != t.data_ptr() and torch.equal(_bits(got), _bits(t)), name
    with pyxfer.testing.inject_fault("zeros", path="direct", times=len(q.buffers())):
        repaired = q.to(torch.device("cpu"))  # each buffer's copy is caught and repaired through staging
    assert pyxfer.health.status("cpu", "cpu") == "corrupt"
    for name, t in q.buffers().items():
        assert torch.equal(_bits(getattr(repaired, name)), _bits(t)), name
    pyxfer.health.reset()


@pytest.mark.parametrize("fmt,usage", [(f, u) for f in ("mxfp8", "nvfp4") for u in ("rowwise", "columnwise")])
def test_scale_layout_conversions_of_one_usage(fmt, usage, gen):
    x = torch.randn(64, 160 if fmt == "mxfp8" else 48, generator=gen)
    q = F.quantize(x, fmt, rowwise=usage == "rowwise", columnwise=usage == "columnwise")
    assert q.with_compact_scales() is q  # already compact: the same object
    s = q.with_swizzled_scales()
    assert s.with_swizzled_scales() is s
    scale = getattr(q, f"{usage}_scale_inv").numpy()
    transpose = fmt == "mxfp8" and usage == "columnwise"
    assert torch.equal(getattr(s, f"{usage}_scale_inv"), torch.from_numpy(R.swizzle(scale, transpose=transpose)))
    assert getattr(s, f"{'columnwise' if usage == 'rowwise' else 'rowwise'}_scale_inv") is None
    assert torch.equal(s.dequantize(torch.float32), q.dequantize(torch.float32))
    assert torch.equal(s.with_compact_scales().dequantize(torch.float32), q.dequantize(torch.float32))


def test_dequantize_usage_and_dtype_errors_name_the_argument():
    q = F.quantize(torch.randn(32, 32), "mxfp8", rowwise=False, columnwise=True)
    assert q.dequantize().dtype == torch.float32  # columnwise is used when it is the only usage
    with pytest.raises(ValueError, match=re.escape("MXFP8Tensor.dequantize: usage must be a usage this tensor holds "
                                                   "(rowwise=False, columnwise=True), got 'rowwise'")):
        q.dequantize(usage="rowwise")
    with pytest.raises(ValueError, match=re.escape("MXFP8Tensor.dequantize: usage must be a usage this tensor holds "
                                                   "(rowwise=False, columnwise=True), got 'both'")):
        q.dequantize(usage="both")
    with pytest.raises(ValueError, match=re.escape("MXFP8Tensor.dequantize: dtype must be one of")):
        q.dequantize(torch.int8)


def test_quantize_spec_is_immutable_hashable_and_printable():
    spec = F.QuantizeSpec("nvfp4", columnwise=True, global_amax=3.5)
    assert repr(spec) == ("QuantizeSpec('nvfp4', rowwise=True, columnwise=True, fp8_dtype=torch.float8_e4m3fn, "
                          "gemm_swizzled_scales=False, global_amax=3.5)")
    with pytest.raises(AttributeError, match="QuantizeSpec is immutable"):
        spec.rowwise = False
    with pytest.raises(AttributeError, match="QuantizeSpec is immutable"):
        spec.anything = 1
    same = F.QuantizeSpec("nvfp4", rowwise=True, columnwise=True, global_amax=3.5)
    assert spec == same and hash(spec) == hash(same) and len({spec, same}) == 1
    assert spec != F.QuantizeSpec("nvfp4", columnwise=True, global_amax=3.25)
    assert spec != "nvfp4" and spec.options == {"gemm_swizzled_scales": False, "global_amax": 3.5}
    q = spec.quantize(torch.randn(16, 32), global_amax=7.0)  # an override replaces the spec's option
    assert float(q.amax_rowwise[0]) == float(q.amax_columnwise[0]) == 7.0
    assert q.amax_rowwise.data_ptr() != q.amax_columnwise.data_ptr()  # two buffers, as TE keeps them


def test_swizzle_argument_checks():
    op = "pyxfer.formats.swizzle_scales: "
    with pytest.raises(ValueError, match="^" + re.escape(op + "scale must be a 2-D tensor, got shape (128,)") + "$"):
        F.swizzle_scales(torch.zeros(128, dtype=torch.uint8))
    with pytest.raises(TypeError, match="^" + re.escape(op + "scale must be a torch.Tensor, got list") + "$"):
        F.swizzle_scales([[0] * 4] * 128)
    with pytest.raises(ValueError, match=re.escape(op + "the scale matrix (transposed) must be padded to multiples "
                                                        "of 128 rows and 4 columns, got (4, 128)")):
        F.swizzle_scales(torch.zeros(128, 4, dtype=torch.uint8), transpose=True)
    with pytest.raises(ValueError, match=re.escape("pyxfer.formats.unswizzle_scales: the scale matrix must be padded "
                                                   "to multiples of 128 rows and 4 columns, got (128, 6)")):
        F.unswizzle_scales(torch.zeros(128, 6, dtype=torch.uint8))
    for shape, transpose in (((128, 4), False), ((256, 8), False), ((4, 128), True), ((8, 256), True)):
        s = torch.randint(0, 256, shape, dtype=torch.uint8)  # the smallest valid shapes and the next ones
        assert torch.equal(F.unswizzle_scales(F.swizzle_scales(s, transpose=transpose), transpose=transpose), s)
        assert torch.equal(F.swizzle_scales(s, transpose=transpose),
                           torch.from_numpy(R.swizzle(s.numpy(), transpose=transpose)))
