"""Bad input and surprising semantics (issue 22 items 2, 3, 5, 6, 7, 9, 10; issue 21 item 8), on the
CPU: every error names the argument, what was expected and what came; one exception type for one
mistake; nothing half-done is returned. One shared check (pyxfer/_checks.py) runs at every entry
point and, for tensor kinds pyxfer has no kernels for, as the kernel of every torch.ops.pyxfer op."""
import copy
import pickle
import re
from pathlib import Path

import numpy as np
import pytest
import tomllib
import torch

import pyxfer
import pyxfer.formats as F
from pyxfer.buffers import PackedBuffer, SubviewSpec, capture_subviews, pack, restore_subviews
from pyxfer.testing import inject_fault

from conftest import run_python
from tensors import random_tensor

pytestmark = [pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor.*deprecated:UserWarning"),
              pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning"),
              pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")]

E4M3 = torch.float8_e4m3fn
ROOT = Path(__file__).resolve().parents[1]


QUANTIZED_MESSAGE = r"{op}: {name} must be a non-quantized tensor, got a quantized torch.qint8 tensor"


# ------------------------------------------------------------------------------------------------
# 21.8: files named for what they hold; __version__
# ------------------------------------------------------------------------------------------------

def test_checksum_wrappers_live_in_checksums_and_version_matches_the_package(gen):
    t = random_tensor((1001,), torch.uint8, gen)[1:]
    assert pyxfer.checksum is pyxfer.checksums.checksum
    assert pyxfer.checksums.as_uint64(pyxfer.checksums.checksum_tensor(t, 7)) == pyxfer.checksum(t, 7)
    assert set(pyxfer.build_info()) >= {"torch", "torch_runtime", "cuda", "cuda_archs"}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert pyxfer.__version__ == project["version"]


# ------------------------------------------------------------------------------------------------
# 22.2: torch's quantized tensors are rejected by the one shared check, everywhere
# ------------------------------------------------------------------------------------------------

def test_quantized_tensors_are_rejected_by_every_entry_point(gen, world_of_one):
    q = torch.quantize_per_tensor(torch.randn(4, 8, generator=gen), 0.05, 3, torch.qint8)
    cases = [
        ("pyxfer.checksum", "t", lambda: pyxfer.checksum(q)),
        ("pyxfer.checksum", "t", lambda: pyxfer.checksums.checksum_tensor(q)),
        ("pyxfer.verified_copy", "src", lambda: pyxfer.verified_copy(q, "cpu")),
        ("pyxfer.staged_copy", "src", lambda: pyxfer.staged_copy(q, "cpu")),
        ("pyxfer.buffers.pack", r"tensors\[1\]", lambda: pack([torch.ones(3), q])),
        ("pyxfer.buffers.restore_subviews", "buffer", lambda: restore_subviews(q, [])),
        ("pyxfer.buffers.capture_subviews", "buffer", lambda: capture_subviews(q, [])),
        ("pyxfer.buffers.PackedBuffer", "buffer", lambda: PackedBuffer(q, [])),
        ("pyxfer.formats.quantize", "x", lambda: pyxfer.quantize(q, "fp8_block_1x128")),
        ("pyxfer.formats.global_amax", "x", lambda: F.global_amax(q)),
        ("pyxfer.formats.swizzle_scales", "scale", lambda: F.swizzle_scales(q)),
        ("pyxfer.all_gather", "x", lambda: pyxfer.all_gather(q)),
    ]
    for op, name, call in cases:
        with pytest.raises(ValueError, match=QUANTIZED_MESSAGE.format(op=re.escape(op), name=name)):
            call()
    u8 = torch.quantize_per_tensor(torch.rand(32, 32, generator=gen), 0.01, 0, torch.quint8)
    with pytest.raises(ValueError, match=r"MXFP8Tensor: rowwise_data must be a non-quantized tensor, got a "
                                         r"quantized torch.quint8 tensor"):
        F.MXFP8Tensor(shape=(32, 32), dtype=torch.float32, rowwise_data=u8,
                      rowwise_scale_inv=torch.zeros(128, 4, dtype=torch.uint8))
    # what to do instead is in the message
    with pytest.raises(ValueError, match=r"pass src.int_repr\(\) and keep q_scale\(\)/q_zero_point\(\) alongside"):
        pyxfer.verified_copy(q, "cpu")


def test_sparse_and_nested_inputs_to_quantize_name_x():
    with pytest.raises(ValueError, match=r"pyxfer.formats.quantize: x must be a dense strided tensor, got layout "
                                         r"torch.sparse_coo"):
        pyxfer.quantize(torch.randn(32, 32).to_sparse(), "mxfp8")
    nested = torch.nested.nested_tensor([torch.randn(32, 32), torch.randn(32, 32)])
    with pytest.raises(ValueError, match=r"pyxfer.formats.quantize: x must be a dense tensor, got a nested tensor"):
        pyxfer.quantize(nested, "mxfp8")


def _native_op_calls(bad, x, u8, f32):
    """(op name, bad argument's name, call) per op with tensor arguments, ``bad`` in one position."""
    one = torch.ones(1)
    return [
        ("checksum", "t", lambda: torch.ops.pyxfer.checksum(bad, 0)),
        ("checksum_partial", "t", lambda: torch.ops.pyxfer.checksum_partial(bad, 0, 0)),
        ("checksum_combine", "partials", lambda: torch.ops.pyxfer.checksum_combine(bad, 8, 0)),
        ("verified_copy", "src", lambda: torch.ops.pyxfer.verified_copy(bad, torch.device("cpu"), "auto", "sync")),
        ("staged_copy", "src", lambda: torch.ops.pyxfer.staged_copy(bad, torch.device("cpu"))),
        ("swap_first_dims", "src", lambda: torch.ops.pyxfer.swap_first_dims(bad)),
        ("sm_copy", "dst", lambda: torch.ops.pyxfer.sm_copy(u8, bad, True)),  # a mutated argument
        ("quantize_fp8_block", "x", lambda: torch.ops.pyxfer.quantize_fp8_block(bad, 1, True, False, E4M3, True, 0.0)),
        ("quantize_mxfp8", "x", lambda: torch.ops.pyxfer.quantize_mxfp8(bad, True, False, E4M3)),
        ("quantize_nvfp4", "global_amax", lambda: torch.ops.pyxfer.quantize_nvfp4(x, bad, True, False)),
        ("dequantize_fp8_block", "scale_inv",
         lambda: torch.ops.pyxfer.dequantize_fp8_block(u8, bad, 1, False, E4M3, torch.float32)),
        ("dequantize_mxfp8", "data", lambda: torch.ops.pyxfer.dequantize_mxfp8(bad, u8, False, E4M3, torch.float32)),
        ("dequantize_nvfp4", "amax", lambda: torch.ops.pyxfer.dequantize_nvfp4(u8, u8, bad, False, torch.float32)),
        ("dequantize_nvfp4", "data", lambda: torch.ops.pyxfer.dequantize_nvfp4(bad, u8, one, False, torch.float32)),
    ]


def test_native_ops_reject_quantized_and_sparse_tensors_before_the_dispatcher(gen):
    """Called through torch.ops, not the wrappers: the same message, not a table of backends."""
    x = torch.randn(32, 32, generator=gen)
    u8 = torch.zeros(32, 32, dtype=torch.uint8)
    covered = set()
    q = torch.quantize_per_tensor(torch.randn(4, 8, generator=gen), 0.05, 3, torch.qint8)
    for op, name, call in _native_op_calls(q, x, u8, x):
        covered.add(op)
        with pytest.raises(ValueError, match=QUANTIZED_MESSAGE.format(op=f"torch.ops.pyxfer.{op}", name=name)):
            call()
    for op, name, call in _native_op_calls(torch.randn(4, 8, generator=gen).to_sparse(), x, u8, x):
        with pytest.raises(ValueError, match=rf"torch.ops.pyxfer.{op}: {name} must be a dense strided tensor, got "
                                             r"layout torch.sparse_coo"):
            call()
    # every op that takes a tensor has the rejecting kernel, including ops added after this test
    with_tensors = set()
    for qualified in torch._C._dispatch_get_all_op_names():
        if qualified.startswith("pyxfer::"):
            name = qualified.split("::")[1]
            schema = getattr(torch.ops.pyxfer, name).default._schema
            if any(isinstance(a.type, torch.TensorType) for a in schema.arguments):
                with_tensors.add(name)
                for key in ("QuantizedCPU", "QuantizedCUDA", "SparseCPU", "SparseCUDA", "NestedTensorCPU",
                            "AutogradNestedTensor"):
                    assert torch._C._dispatch_has_kernel_for_dispatch_key(qualified, key), (qualified, key)
    assert covered == with_tensors, "a sample call above is missing for " + ", ".join(sorted(with_tensors - covered))


def test_subview_specs_refuse_quantized_dtypes():
    for dtype in (torch.qint8, torch.quint8, torch.qint32, torch.quint4x2):
        with pytest.raises(ValueError, match=rf"SubviewSpec: dtype must be a non-quantized dtype, got {dtype}"):
            SubviewSpec(0, (4,), (1,), dtype)
    with pytest.raises(ValueError, match=r"non-quantized dtype, got torch.qint8"):
        SubviewSpec.from_dict({"byte_offset": 0, "shape": [2], "stride": [1], "dtype": "qint8"})


# ------------------------------------------------------------------------------------------------
# 22.3: one rule for NVFP4's global amax (and amax_epsilon) in every form
# ------------------------------------------------------------------------------------------------

def _amax_forms(value):
    """``value`` as a Python float, numpy scalars of every float width, and tensors (0-dim, [1])."""
    forms = [("float", float(value)), ("np.float16", np.float16(value)), ("np.float32", np.float32(value)),
             ("np.float64", np.float64(value)), ("np.longdouble", np.longdouble(value))]
    forms += [(f"tensor {dt} {shape}", torch.tensor(value, dtype=dt).reshape(shape))
              for dt in (torch.float32, torch.float64, torch.bfloat16) for shape in ((), (1,))]
    return forms


@pytest.mark.parametrize("bad", [float("inf"), -float("inf"), float("nan"), -1.0, -1e-30, 1e39])
def test_nvfp4_global_amax_one_rule_rejects_every_form(bad, gen):
    x = torch.randn(32, 64, generator=gen)
    for form, amax in _amax_forms(bad):
        if isinstance(amax, np.float16) and bad == -1e-30:
            amax = np.float16(-1.0)  # -1e-30 is -0.0 in float16: a valid amax
        with pytest.raises(ValueError, match=r"pyxfer.formats.quantize: global_amax must be None or a finite "
                                             r"float32 value >= 0") as info:
            F.quantize(x, "nvfp4", columnwise=True, global_amax=amax)
        assert "got" in str(info.value), form
        if not isinstance(amax, torch.Tensor):
            with pytest.raises(ValueError, match=r"QuantizeSpec: global_amax must be None or a finite float32"):
                F.QuantizeSpec("nvfp4", global_amax=amax)


def test_nvfp4_global_amax_every_form_of_a_good_value_gives_the_same_bytes(gen):
    x = torch.randn(3, 32, 64, generator=gen, dtype=torch.bfloat16)[:, :, :48]
    x = x.contiguous()[:, 16:, :]  # an odd view: M = 48, K = 48
    want = F.quantize(x, "nvfp4", columnwise=True, global_amax=3.25)
    assert float(want.amax_rowwise[0]) == 3.25
    for form, amax in _amax_forms(3.25) + [("int", 3), ("np.int32", np.int32(3)), ("zero", 0.0)]:
        got = F.quantize(x, "nvfp4", columnwise=True, global_amax=amax)
        expected = want if form not in ("int", "np.int32", "zero") else \
            F.quantize(x, "nvfp4", columnwise=True, global_amax=float(amax))
        for name, t in expected.buffers().items():
            assert torch.equal(getattr(got, name), t), (form, name)
    spec = F.QuantizeSpec("nvfp4", global_amax=np.float32(3.25))
    assert spec == F.QuantizeSpec("nvfp4", global_amax=3.25) and type(spec.options["global_amax"]) is float


def test_global_amax_of_the_wrong_kind():
    x = torch.randn(32, 32)
    for amax, exc, match in ((True, TypeError, r"global_amax must be a real number, got bool"),
                             ("2.0", TypeError, r"global_amax must be a real number, got str"),
                             (torch.tensor([1.0, 2.0]), ValueError, r"global_amax must be a 1-element floating-point "
                                                                    r"tensor, got shape \(2,\)"),
                             (torch.tensor([2]), ValueError, r"1-element floating-point tensor, got shape \(1,\) "
                                                             r"and dtype torch.int64")):
        with pytest.raises(exc, match=match):
            F.quantize(x, "nvfp4", global_amax=amax)
    with pytest.raises(TypeError, match=r"QuantizeSpec: global_amax must be None or a float here"):
        F.QuantizeSpec("nvfp4", global_amax=torch.tensor([1.0]))


@pytest.mark.parametrize("eps, exc", [(float("inf"), ValueError), (float("nan"), ValueError), (-1e-6, ValueError),
                                      ("0.1", TypeError), (None, TypeError)])
def test_amax_epsilon_must_be_finite(eps, exc):
    with pytest.raises(exc, match=r"pyxfer.formats.quantize: amax_epsilon must be a"):
        F.quantize(torch.randn(8, 128), "fp8_block_1x128", amax_epsilon=eps)
    with pytest.raises(exc, match=r"QuantizeSpec: amax_epsilon must be a"):
        F.QuantizeSpec("fp8_block_128x128", amax_epsilon=eps)


def test_amax_epsilon_numpy_scalar_is_the_float(gen):
    x = torch.randn(5, 300, generator=gen) * 1e-4
    a = F.quantize(x, "fp8_block_1x128", amax_epsilon=np.float32(1e-3), pow2_scales=False)
    b = F.quantize(x, "fp8_block_1x128", amax_epsilon=float(np.float32(1e-3)), pow2_scales=False)
    assert torch.equal(a.rowwise_scale_inv, b.rowwise_scale_inv) and torch.equal(a.rowwise_data, b.rowwise_data)


# ------------------------------------------------------------------------------------------------
# 22.5: QuantizeSpec (and the other value types) through pickle, copy, deepcopy
# ------------------------------------------------------------------------------------------------

SPECS = [F.QuantizeSpec("fp8_block_1x128", columnwise=True, fp8_dtype=torch.float8_e5m2, pow2_scales=False,
                        amax_epsilon=1e-3),
         F.QuantizeSpec("fp8_block_128x128"),
         F.QuantizeSpec("mxfp8", rowwise=False, columnwise=True, gemm_swizzled_scales=True),
         F.QuantizeSpec("nvfp4", columnwise=True, global_amax=6.5),
         F.QuantizeSpec("nvfp4")]


@pytest.mark.parametrize("spec", SPECS, ids=repr)
def test_quantize_spec_round_trips_and_stays_immutable(spec):
    for again in (pickle.loads(pickle.dumps(spec)), pickle.loads(pickle.dumps(spec, protocol=0)),
                  copy.copy(spec), copy.deepcopy(spec), copy.deepcopy({"spec": spec})["spec"]):
        assert again == spec and hash(again) == hash(spec) and repr(again) == repr(spec)
        assert again.options == spec.options and again.fp8_dtype is spec.fp8_dtype
    with pytest.raises(AttributeError, match=r"QuantizeSpec is immutable: cannot set 'fmt'"):
        spec.fmt = "mxfp8"
    with pytest.raises(AttributeError, match=r"immutable"):
        object.__getattribute__(spec, "__setattr__")("rowwise", False)


def test_a_fresh_process_rebuilds_a_pickled_spec():
    """What a spawned worker does: unpickle in an interpreter that never built the spec."""
    blob = pickle.dumps(SPECS).hex()
    r = run_python(f"import pickle; specs = pickle.loads(bytes.fromhex({blob!r})); print(repr(specs))")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == repr(SPECS)


def test_quantized_tensors_subview_specs_and_packed_buffers_round_trip(gen):
    x = torch.randn(64, 96, generator=gen)
    for qt in (F.quantize(x, "mxfp8", columnwise=True, gemm_swizzled_scales=True),
               F.quantize(x, "nvfp4", columnwise=True), F.quantize(x[:, 1:], "fp8_block_128x128")):
        for again in (pickle.loads(pickle.dumps(qt)), copy.copy(qt), copy.deepcopy(qt)):
            assert type(again) is type(qt) and again.spec == qt.spec and again.shape == qt.shape
            for name, t in qt.buffers().items():
                assert torch.equal(getattr(again, name), t), name
    t = random_tensor((7, 5), torch.bfloat16, gen)
    packed = pack([t.t(), random_tensor((3,), torch.complex64, gen)])
    for again in (pickle.loads(pickle.dumps(packed)), copy.copy(packed), copy.deepcopy(packed)):
        assert again.specs == packed.specs and torch.equal(again.data, packed.data)
        assert torch.equal(again.unpack()[0].view(torch.int16), t.t().view(torch.int16))
    spec = packed.specs[0]
    assert pickle.loads(pickle.dumps(spec)) == spec == copy.deepcopy(spec)


# ------------------------------------------------------------------------------------------------
# 22.6: the device check under torch.compile(fullgraph=True), in a fresh process
# ------------------------------------------------------------------------------------------------

_FRESH_PROCESS_HELPERS = """
def raises(call, exc_type, text):
    try:
        call()
    except exc_type as e:
        assert text in str(e), str(e)
    else:
        raise AssertionError("no error, expected " + text)
"""


def run_fresh(code: str) -> None:
    """Run ``code`` in a new interpreter, with ``raises(call, exc_type, text)`` defined; it must finish."""
    r = run_python(_FRESH_PROCESS_HELPERS + code + "\nprint('ok')\n")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["ok"]


def test_verified_copy_compiles_with_fullgraph_in_a_fresh_process():
    """The first device check of the process runs while Dynamo traces: the CUDA device count must
    fold to a constant. On a CPU-only torch, a CUDA destination reaches pyxfer's device check: a
    ValueError eagerly and without fullgraph; with fullgraph Dynamo reports that ValueError (it
    lets no exception out of a full graph) -- not a failure inside the compiler."""
    code = """
import torch, pyxfer
x = torch.randn(301, dtype=torch.float64)[1::3]
f = torch.compile(lambda t, dev: pyxfer.verified_copy(t * 2, dev) + 1, fullgraph=True, backend="aot_eager")
for dev in ("cpu", torch.device("cpu")):
    assert torch.equal(f(x, dev), x * 2 + 1)
if not torch.cuda.is_available():
    for dev in ("cuda", "cuda:0"):
        text = f"pyxfer.verified_copy: device is {dev}, which does not exist"
        raises(lambda: f(x, dev), Exception, text)
        raises(lambda: torch.compile(lambda t: pyxfer.verified_copy(t, dev))(x), ValueError, text)
"""
    run_fresh(code)


# ------------------------------------------------------------------------------------------------
# 22.7: devices that do not exist: one clear ValueError from every entry point
# ------------------------------------------------------------------------------------------------

def _device_calls(dev):
    t = torch.arange(12.0)
    host = pack([t])
    return [
        ("pyxfer.verified_copy", "device", lambda: pyxfer.verified_copy(t, dev)),
        ("pyxfer.staged_copy", "device", lambda: pyxfer.staged_copy(t, dev)),
        ("pyxfer.health.status", "src", lambda: pyxfer.health.status(dev, "cpu")),
        ("pyxfer.health.status", "dst", lambda: pyxfer.health.status("cpu", dev)),
        ("pyxfer.health.mark", "dst", lambda: pyxfer.health.mark("cpu", dev, "corrupt")),
        ("pyxfer.testing.inject_fault", "dst", lambda: inject_fault("zeros", dst=dev).__enter__()),
        ("pyxfer.testing.inject_fault", "src", lambda: inject_fault("zeros", src=dev).__enter__()),
        ("pyxfer.buffers.PackedBuffer.reload", "device", lambda: host.reload(dev)),
        ("pyxfer.buffers.pack", "device", lambda: pack([t], device=dev)),
        ("pyxfer.verified_copy", "device", lambda: host.to(dev)),
        ("pyxfer.verified_copy", "device", lambda: F.quantize(t.reshape(1, 12), "fp8_block_1x128").to(dev)),
    ]


def test_a_cuda_device_that_does_not_exist_is_one_value_error_everywhere():
    n = torch.cuda.device_count()
    for dev in (f"cuda:{n + 3}", torch.device("cuda", n), n + 1):
        shown = str(torch.device("cuda", dev)) if isinstance(dev, int) else str(dev)
        for op, name, call in _device_calls(dev):
            with pytest.raises(ValueError, match=rf"{re.escape(op)}: {name} is {shown}, which does not exist "
                                                 rf"\(.*\); expected 'cpu' or a CUDA device of this process"):
                call()
    assert pyxfer.health.status("cpu", "cpu") in pyxfer.health.STATES  # nothing was marked
    with pytest.raises(ValueError, match=r"pyxfer.staged_copy: device must be a CUDA index >= 0, got -1"):
        pyxfer.staged_copy(torch.ones(2), -1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks 'cuda' without an index where torch has no CUDA device")
def test_cuda_without_an_index_and_no_cuda_device_is_the_same_error():
    why = r"torch was built without CUDA" if not torch.backends.cuda.is_built() else r"0 CUDA devices visible"
    for dev in ("cuda", torch.device("cuda")):
        for op, name, call in _device_calls(dev):
            with pytest.raises(ValueError, match=rf"{re.escape(op)}: {name} is cuda, which does not exist \({why}\)"):
                call()


def test_unknown_devices_leave_no_fault_armed(gen):
    """inject_fault with a bad dst raises before arming anything: the next copy is not hit."""
    with pytest.raises(ValueError):
        with inject_fault("zeros", dst=f"cuda:{torch.cuda.device_count() + 5}"):
            pass
    src = random_tensor((4099,), torch.uint8, gen)
    out = pyxfer.verified_copy(src, "cpu", route="direct", verify="none")
    assert torch.equal(out, src)


# ------------------------------------------------------------------------------------------------
# 22.9: argument hygiene
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, exc, match", [
    (("8M",), TypeError, r"pyxfer.configure_staging: chunk_bytes must be an int, got str '8M'"),
    ((4096.7, 2), TypeError, r"chunk_bytes must be an int, got float 4096.7"),
    ((8192.0, 4), TypeError, r"chunk_bytes must be an int, got float 8192.0"),
    ((8192, 2.9), TypeError, r"num_slots must be an int, got float 2.9"),
    ((8192, True), TypeError, r"num_slots must be an int, got bool True"),
])
def test_configure_staging_takes_ints_only(args, exc, match):
    with pytest.raises(exc, match=match):
        pyxfer.configure_staging(*args)


def test_configure_staging_accepts_numpy_ints(gen):
    pyxfer.configure_staging(np.int64(8192), np.int32(3))
    try:
        src = random_tensor((3 * 8192 + 5,), torch.uint8, gen)
        assert torch.equal(pyxfer.staged_copy(src, "cpu"), src)
    finally:
        pyxfer.configure_staging()


@pytest.mark.parametrize("seed, exc", [("abc", TypeError), (1.5, TypeError), (True, TypeError), (-1, ValueError),
                                       (1 << 64, ValueError)])
def test_inject_fault_seed(seed, exc):
    with pytest.raises(exc, match=r"pyxfer.testing.inject_fault: seed must be"):
        with inject_fault("bitflip", seed=seed):
            pass


def test_inject_fault_seed_is_reproducible_over_the_whole_range(gen):
    src = random_tensor((4099,), torch.uint8, gen)
    for seed in (0, 12345, (1 << 64) - 1):
        outs = []
        for _ in range(2):
            with inject_fault("bitflip", path="direct", seed=seed) as fault:
                outs.append(pyxfer.verified_copy(src, "cpu", route="direct", verify="none"))
            assert fault.used == 1
        assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], src), seed


def test_pack_restore_capture_want_iterables(gen):
    t = random_tensor((4, 6), torch.float32, gen)
    buf = pack([t]).data
    for call, match in ((lambda: pack(None), r"pyxfer.buffers.pack: tensors must be a list or other iterable of "
                                             r"tensors, got NoneType"),
                        (lambda: pack(t), r"pyxfer.buffers.pack: tensors must be a list .* got Tensor"),
                        (lambda: restore_subviews(buf, None), r"restore_subviews: specs must be a list or other "
                                                              r"iterable of SubviewSpec, got NoneType"),
                        (lambda: restore_subviews(buf, SubviewSpec(0, (4,), (1,), torch.float32)),
                         r"restore_subviews: specs must be a list .* got SubviewSpec"),
                        (lambda: capture_subviews(buf, buf), r"capture_subviews: views must be a list .* got Tensor"),
                        (lambda: PackedBuffer(buf, None), r"PackedBuffer: specs must be a list .* got NoneType")):
        with pytest.raises(TypeError, match=match):
            call()
    # tuples and generators are iterables of tensors / specs
    packed = pack(x for x in (t, t[1:]))
    assert [v.shape for v in restore_subviews(packed.data, tuple(packed.specs))] == [(4, 6), (3, 6)]


def test_packed_buffer_methods_check_their_arguments(gen):
    packed = pack([random_tensor((33,), torch.int16, gen)])
    for call, exc, match in (
            (lambda: packed.to("cpu", verify="yes"), TypeError, r"PackedBuffer.to: verify must be a bool, got str"),
            (lambda: packed.to("cpu", verify=1), TypeError, r"PackedBuffer.to: verify must be a bool, got int"),
            (lambda: packed.to("cpu", non_blocking="no"), TypeError, r"non_blocking must be a bool"),
            (lambda: packed.reload(None), TypeError, r"PackedBuffer.reload: device must be a torch.device, a string "
                                                     r"or a CUDA index, got NoneType"),
            (lambda: packed.reload("cpu", stream="x"), TypeError, r"reload: stream must be None or a "
                                                                  r"torch.cuda.Stream, got str"),
            (lambda: packed.offload(stream="x"), TypeError, r"PackedBuffer.offload: stream must be None or a "
                                                            r"torch.cuda.Stream, got str"),
            (lambda: pack([torch.ones(2)], device="gpu"), ValueError, r"pack: device is not a device: 'gpu'")):
        with pytest.raises(exc, match=match):
            call()
    assert packed._host is None  # the rejected offload allocated nothing


def test_format_shapes_and_block_dim_are_checked():
    for call, exc, match in (
            (lambda: F.buffer_layout("mxfp8", ()), ValueError, r"buffer_layout: shape must have at least 1 dimension, "
                                                               r"got \(\)"),
            (lambda: F.buffer_layout("mxfp8", (32.5, 64)), TypeError, r"buffer_layout: shape\[0\] must be an int, "
                                                                      r"got float 32.5"),
            (lambda: F.buffer_layout("nvfp4", (32, -16)), ValueError, r"shape\[1\] must be an int >= 0, got -16"),
            (lambda: F.buffer_layout("mxfp8", (33, 64)), ValueError, r"buffer_layout: mxfp8 needs .* \(M=33\) .* "
                                                                     r"multiples of 32"),
            (lambda: F.buffer_layout("mxfp8", 64), TypeError, r"shape must be a list or other iterable of ints, "
                                                              r"got int"),
            (lambda: F.buffer_layout("mxfp8", (32, 64), rowwise=1), TypeError, r"rowwise must be a bool, got int"),
            (lambda: F.is_quantizable(None, "mxfp8"), TypeError, r"is_quantizable: shape must be a list or other "
                                                                 r"iterable of ints, got NoneType"),
            (lambda: F.is_quantizable("128x128", "mxfp8"), TypeError, r"is_quantizable: shape must be .* got str"),
            (lambda: F.MXFP8Tensor(shape=None, dtype=torch.float32), TypeError, r"MXFP8Tensor: shape must be a list "
                                                                                r"or other iterable of ints"),
            (lambda: F.NVFP4Tensor(shape=(24, 32), dtype=torch.float32), ValueError, r"NVFP4Tensor: nvfp4 needs .* "
                                                                                     r"multiples of 16"),
            (lambda: F.Float8BlockTensor(shape=(4, 4), dtype=torch.float32, block_dim=True), TypeError,
             r"Float8BlockTensor: block_dim must be an int, got bool True"),
            (lambda: F.Float8BlockTensor(shape=(4, 4), dtype=torch.float32, block_dim=1.0), TypeError,
             r"block_dim must be an int, got float"),
            (lambda: F.Float8BlockTensor(shape=(4, 4), dtype=torch.float32, block_dim=3), ValueError,
             r"block_dim must be 1 \(1x128\) or 2 \(128x128\), got 3"),
            (lambda: F.swizzle_scales(torch.zeros(128, 4, dtype=torch.uint8), transpose="no"), TypeError,
             r"swizzle_scales: transpose must be a bool")):
        with pytest.raises(exc, match=match):
            call()
    # sizes as numpy ints and torch.Size are shapes
    assert F.buffer_layout("nvfp4", (np.int64(32), 64)) == F.buffer_layout("nvfp4", torch.Size([32, 64]))
    assert F.is_quantizable([np.int32(128), 256], "fp8_block_128x128") is True
    assert F.is_quantizable((), "mxfp8") is False


# ------------------------------------------------------------------------------------------------
# 22.10: torch.func through verified_copy (not supported: its autograd is C++) -- README says so
# ------------------------------------------------------------------------------------------------

def test_torch_func_grad_is_refused_and_torch_autograd_works(gen):
    x = torch.randn(7, dtype=torch.float64, generator=gen, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"cannot use C\+\+ torch::autograd::Function with functorch transforms"):
        torch.func.grad(lambda t: (pyxfer.verified_copy(t, "cpu") * 3).sum())(x.detach())
    (g,) = torch.autograd.grad((pyxfer.verified_copy(x, "cpu") * 3).sum(), x)
    assert torch.equal(g, torch.full_like(x, 3.0))
