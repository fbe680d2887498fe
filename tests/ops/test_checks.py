"""Bad input and surprising semantics, on the CPU: every error names the argument, what was expected
and what came; one exception type for one mistake; nothing half-done is returned. One shared check
(pyxfer/_checks.py) runs at every entry point and, for tensor kinds pyxfer has no kernels for, as the
kernel of every torch.ops.pyxfer op. Then the argument checks at their exact boundaries: checksum
seeds, CUDA device indices, the alignment of packed spans whose views have different element sizes,
the wrappers of existing (TE) buffers (QuantizedTensor and its format classes) and the native
quantize / dequantize ops."""
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
from pyxfer.checksums import as_uint64
from pyxfer.testing import inject_fault

from support.processes import run_fresh, run_python
from support.pxh64_reference import finalize, partial_np, pxh64_py
from support.tensors import logical_bytes, random_tensor

pytestmark = [pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor.*deprecated:UserWarning"),
              pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning"),
              pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")]

E4M3 = torch.float8_e4m3fn
ROOT = Path(__file__).resolve().parents[2]


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
    one, i64 = torch.ones(1), torch.zeros(64, dtype=torch.int64)
    return [
        ("checksum", "t", lambda: torch.ops.pyxfer.checksum(bad, 0)),
        ("checksum_partial", "t", lambda: torch.ops.pyxfer.checksum_partial(bad, 0, 0)),
        ("checksum_combine", "partials", lambda: torch.ops.pyxfer.checksum_combine(bad, 8, 0)),
        ("verified_copy", "src", lambda: torch.ops.pyxfer.verified_copy(bad, torch.device("cpu"), "auto", "sync")),
        ("staged_copy", "src", lambda: torch.ops.pyxfer.staged_copy(bad, torch.device("cpu"))),
        ("swap_first_dims", "src", lambda: torch.ops.pyxfer.swap_first_dims(bad)),
        ("sm_copy", "dst", lambda: torch.ops.pyxfer.sm_copy(u8, bad, True)),  # a mutated argument
        ("pointer_chase", "ring", lambda: torch.ops.pyxfer.pointer_chase(bad, 1)),
        ("peer_exchange", "a", lambda: torch.ops.pyxfer.peer_exchange(bad, i64, 1, 0, 1.0)),
        ("quantize_fp8_block", "x", lambda: torch.ops.pyxfer.quantize_fp8_block(bad, 1, True, False, E4M3, True, 0.0)),
        ("quantize_mxfp8", "x", lambda: torch.ops.pyxfer.quantize_mxfp8(bad, True, False, E4M3)),
        ("quantize_nvfp4", "global_amax", lambda: torch.ops.pyxfer.quantize_nvfp4(x, bad, True, False)),
        ("dequantize_fp8_block", "scale_inv",
         lambda: torch.ops.pyxfer.dequantize_fp8_block(u8, bad, 1, False, E4M3, torch.float32)),
        ("dequantize_mxfp8", "data", lambda: torch.ops.pyxfer.dequantize_mxfp8(bad, u8, False, E4M3, torch.float32)),
        ("dequantize_nvfp4", "amax", lambda: torch.ops.pyxfer.dequantize_nvfp4(u8, u8, bad, False, torch.float32)),
        ("dequantize_nvfp4", "data", lambda: torch.ops.pyxfer.dequantize_nvfp4(bad, u8, one, False, torch.float32)),
        # the gather engine's native calls (refused before any plan, latch or group is looked up)
        ("gather_post", "meta", lambda: torch.ops.pyxfer.gather_post("0", 0, [f32], bad, [], 0, 1, 0, 0)),
        ("gather_run", "meta", lambda: torch.ops.pyxfer.gather_run("0", 0, [f32], bad, [], 0, 1, 0, 0)),
        ("gather_finish", "meta_recv", lambda: torch.ops.pyxfer.gather_finish(0, [f32], [], bad, 1, 0)),
        ("gather_join", "meta_recv", lambda: torch.ops.pyxfer.gather_join(bad, 1)),
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


# ---- argument checks at their exact boundaries ---------------------------------------------------

E5M2 = torch.float8_e5m2
U64_MAX = (1 << 64) - 1


# --- checksum seeds: [0, 2**64) in Python, their int64 bits in the op schema ---------------------

def test_seed_boundaries(gen):
    t = random_tensor((37,), torch.uint8, gen)
    data = logical_bytes(t)
    assert pyxfer.checksum(t, U64_MAX) == pxh64_py(data, U64_MAX)  # the largest valid seed
    assert pyxfer.checksum(t, 0) == pxh64_py(data, 0)  # the smallest
    with pytest.raises(ValueError, match=re.escape(f"pyxfer.checksum: seed must be in [0, 2**64), got {1 << 64}")):
        pyxfer.checksum(t, 1 << 64)  # the first invalid one above
    with pytest.raises(ValueError, match=re.escape("pyxfer.checksum: seed must be in [0, 2**64), got -1")):
        pyxfer.checksum(t, -1)
    # the wrapper passes seeds >= 2**63 as their int64 bits: 2**63 - 1 and 2**63 sit either side
    for seed in ((1 << 63) - 1, 1 << 63):
        assert pyxfer.checksum(t, seed) == pxh64_py(data, seed)
        bits = seed - (1 << 64) if seed >> 63 else seed
        assert as_uint64(torch.ops.pyxfer.checksum(t, bits)) == pxh64_py(data, seed)


def test_word_offset_and_num_bytes_boundaries(gen):
    t = random_tensor((13,), torch.uint8, gen)
    assert as_uint64(torch.ops.pyxfer.checksum_partial(t, 0, 0)) == partial_np(logical_bytes(t))
    with pytest.raises(RuntimeError, match=r"pyxfer.checksum_partial: word_offset must be >= 0, got -1"):
        torch.ops.pyxfer.checksum_partial(t, -1, 0)
    partial = torch.ops.pyxfer.checksum_partial(t, 0, 0).reshape(1)
    assert as_uint64(torch.ops.pyxfer.checksum_combine(partial, 0, 0)) == \
        finalize(partial_np(logical_bytes(t)), 0)  # num_bytes 0: valid
    with pytest.raises(RuntimeError, match=r"pyxfer.checksum_combine: num_bytes must be >= 0, got -1"):
        torch.ops.pyxfer.checksum_combine(partial, -1, 0)


# --- CUDA device indices: cuda:{n-1} is the last valid one, cuda:{n} the first invalid ------------

@pytest.mark.gpu
def test_last_valid_and_first_invalid_cuda_index(gen):
    n = torch.cuda.device_count()
    src = random_tensor((1001,), torch.uint8, gen, device="cuda:0")
    out = pyxfer.verified_copy(src, f"cuda:{n - 1}")
    assert out.device == torch.device("cuda", n - 1) and torch.equal(out.cpu(), src.cpu())
    assert torch.equal(pyxfer.staged_copy(src, n - 1).cpu(), src.cpu())
    msg = f"device is cuda:{n}, which does not exist ({n} CUDA devices visible)"
    wrapper = "^" + re.escape(f"pyxfer.verified_copy: {msg}; expected 'cpu' or a CUDA device of this process") + "$"
    with pytest.raises(ValueError, match=wrapper):
        pyxfer.verified_copy(src, f"cuda:{n}")
    with pytest.raises(ValueError, match=wrapper):
        pyxfer.verified_copy(src, n)  # a bare index
    with pytest.raises(RuntimeError, match=re.escape("pyxfer.verified_copy: " + msg)):
        torch.ops.pyxfer.verified_copy(src, torch.device("cuda", n), "auto", "sync")
    with pytest.raises(RuntimeError, match=re.escape("pyxfer.staged_copy: " + msg)):
        torch.ops.pyxfer.staged_copy(src, torch.device("cuda", n))


# --- packed spans: one storage, views of several element sizes ----------------------------------

def test_packed_span_of_mixed_element_sizes_is_aligned_to_the_largest(gen):
    """Views of one storage pack as one span; the span starts at a multiple of the largest itemsize
    among them (its low end rounded down to it too), whatever the alignment asked for."""
    other = random_tensor((3,), torch.uint8, gen)
    base = random_tensor((8,), torch.float64, gen)
    u8 = base.view(torch.uint8)[3:5]      # storage bytes [3, 5): the span's lowest byte, odd
    f64 = base[2:4]                       # bytes [16, 32)
    i16 = base.view(torch.int16)[13:15]   # bytes [26, 30)
    for alignment in (1, 2, 4):
        packed = pack([other, u8, f64, i16], alignment=alignment)
        # `other` at 0; the shared span (lo rounded 3 -> 0) at align_up(3, 8) = 8
        assert [s.byte_offset for s in packed.specs] == [0, 8 + 3, 8 + 16, 8 + 26], alignment
        assert packed.nbytes == 8 + 32  # the span ends with the float64 view
        got = packed.unpack()
        for g, t in zip(got, [other, u8, f64, i16]):
            assert (g.dtype, g.shape, g.stride()) == (t.dtype, t.shape, t.stride())
            assert logical_bytes(g) == logical_bytes(t)
        got[2][0] = 1.0  # still one span: the uint8 and int16 views see the float64 write
        assert logical_bytes(got[1]) == logical_bytes(base.clone().index_fill_(0, torch.tensor([2]), 1.0)
                                                      .view(torch.uint8)[3:5])
    # the largest itemsize wins whatever order the views come in
    packed = pack([other, i16, u8, f64], alignment=1)
    assert [s.byte_offset for s in packed.specs] == [0, 8 + 26, 8 + 3, 8 + 16]
    # asked for more than the itemsize: the alignment wins
    packed = pack([other, u8, f64], alignment=64)
    assert [s.byte_offset for s in packed.specs] == [0, 64 + 3, 64 + 16]
    assert not packed.data[3:64].any()  # zeroed padding


@pytest.mark.parametrize("alignment,ok", [(1, True), (2, True), (1 << 30, True), (0, False), (3, False),
                                          (6, False), ((1 << 30) + 1, False)])
def test_pack_alignment_boundaries(alignment, ok):
    if ok:
        assert pack([torch.zeros(3)], alignment=alignment).specs[0].byte_offset == 0
    else:
        with pytest.raises(ValueError, match=re.escape(f"pyxfer.buffers.pack: alignment must be a positive power of "
                                                       f"two (bytes), got {alignment}")):
            pack([torch.zeros(3)], alignment=alignment)


# --- wrapping existing buffers: QuantizedTensor and its format classes ---------------------------

def _wrap_kwargs(fmt, shape=(64, 128), dtype=torch.bfloat16):
    """Constructor kwargs of a valid wrapper of both usages (buffers from pyxfer's own quantize)."""
    q = F.quantize(torch.randn(shape).to(dtype), fmt, rowwise=True, columnwise=True)
    kw = dict(shape=q.shape, dtype=q.dtype, **q.buffers())
    if fmt.startswith("fp8_block"):
        kw.update(block_dim=q.block_dim, fp8_dtype=q.fp8_dtype)
    return type(q), kw


def _rejects(cls, kw, match, exc=ValueError):
    with pytest.raises(exc, match=match):
        cls(**kw)


@pytest.mark.parametrize("fmt", F.FORMATS)
def test_wrapper_checks_every_buffer(fmt):
    cls, kw = _wrap_kwargs(fmt)
    op = re.escape(f"pyxfer.formats.{cls.__name__}: ")
    assert cls(**kw).dequantize().shape == (64, 128)  # the valid wrap the cases below break
    buffers = [n for n in kw if n.endswith(("_data", "_scale_inv")) or n.startswith("amax_")]
    for name in buffers:
        good = kw[name]
        want_shape, want_dtype = F.buffer_layout(fmt, kw["shape"], rowwise=True, columnwise=True)[name]
        wrong_dtype = torch.float32 if want_dtype == torch.uint8 else torch.uint8
        wrong_shape = tuple(want_shape[:-1]) + (want_shape[-1] + 1,)
        for bad, got in ((torch.zeros(want_shape, dtype=wrong_dtype), f"{want_shape} {wrong_dtype}"),
                         (torch.zeros(wrong_shape, dtype=want_dtype), f"{wrong_shape} {want_dtype}")):
            _rejects(cls, {**kw, name: bad}, op + re.escape(f"{name} must have shape {want_shape} and dtype "
                                                            f"{want_dtype} for logical shape (64, 128), got {got}"))
        _rejects(cls, {**kw, name: good.numpy()},
                 "^" + op + re.escape(f"{name} must be a torch.Tensor, got ndarray") + "$", TypeError)
        # a buffer without data (meta) is rejected by the shared tensor check, naming it; a buffer on
        # another real device is test_wrapper_buffers_on_two_devices_are_rejected (GPU)
        _rejects(cls, {**kw, name: good.to("meta")},
                 "^" + op + re.escape(f"{name} is on the meta device and has no data to read") + "$")
        if not name.endswith("_data"):  # a scale or amax without its usage's data
            usage = "columnwise" if "columnwise" in name else "rowwise"
            part = {k: v for k, v in kw.items() if not (k in buffers and usage in k) or k == name}
            _rejects(cls, part, op + re.escape(f"{name} given without its data buffer"))
            _rejects(cls, {**kw, name: None}, op + re.escape(f"missing {name} for the usages given"))
    _rejects(cls, {**kw, "rowwise_data": None, "columnwise_data": None},
             op + re.escape("needs rowwise_data and/or columnwise_data"))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", F.FORMATS)
def test_wrapper_buffers_on_two_devices_are_rejected(fmt):
    cls, kw = _wrap_kwargs(fmt)
    op = re.escape(f"pyxfer.formats.{cls.__name__}: ")
    _rejects(cls, {**kw, "rowwise_data": kw["rowwise_data"].cuda()},  # the first buffer elsewhere: the next is named
             op + re.escape("rowwise_scale_inv is on cpu, expected the device of rowwise_data (cuda:0)"))
    _rejects(cls, {**kw, "columnwise_data": kw["columnwise_data"].cuda()},
             op + re.escape("columnwise_data is on cuda:0, expected the device of rowwise_data (cpu)"))
    with pytest.raises(ValueError, match=re.escape("pyxfer.formats.quantize: global_amax must be on x's device "
                                                   "(cpu), got cuda:0")):
        F.quantize(torch.randn(64, 128), "nvfp4", global_amax=torch.ones(1, device="cuda"))


@pytest.mark.parametrize("fmt", F.FORMATS)
def test_wrapper_checks_shape_and_nominal_dtype(fmt):
    cls, kw = _wrap_kwargs(fmt)
    op = re.escape(f"pyxfer.formats.{cls.__name__}: ")
    for dtype in (torch.float64, torch.uint8, E4M3):
        _rejects(cls, {**kw, "dtype": dtype}, op + re.escape("dtype (the nominal dtype) must be one of"))
    _rejects(cls, {**kw, "shape": ()}, op + re.escape("shape must have at least 1 dimension, got ()"))
    # a logical shape the buffers do not fit: the first buffer is named
    _rejects(cls, {**kw, "shape": (64, 256)}, op + re.escape("rowwise_data must have shape"))
    if fmt in ("mxfp8", "nvfp4"):  # a shape the format cannot store, whatever buffers come with it
        block = F.BLOCK_LEN[fmt]
        for shape in ((64 + block // 2, 128), (64, 128 + block // 2), (128,)):
            m, k = (shape[0], shape[1]) if len(shape) == 2 else (1, shape[0])
            msg = (f"{fmt} needs the flattened leading dims (M={m}) and the last dim (K={k}) of shape to be "
                   f"multiples of {block}, got shape {shape}")
            _rejects(cls, {**kw, "shape": shape}, "^" + op + re.escape(msg) + "$")
            # buffer_layout has the same rule and message: no layout exists to build buffers from
            with pytest.raises(ValueError, match="^" + re.escape("pyxfer.formats.buffer_layout: " + msg) + "$"):
                F.buffer_layout(fmt, shape, rowwise=True)


def test_format_class_options_are_checked():
    f8, kw8 = _wrap_kwargs("fp8_block_1x128")
    mx, kwmx = _wrap_kwargs("mxfp8")
    nv, kwnv = _wrap_kwargs("nvfp4")
    cases = [
        (f8, {**kw8, "block_dim": 3}, ValueError,
         "Float8BlockTensor: block_dim must be 1 (1x128) or 2 (128x128), got 3"),
        (f8, {**kw8, "block_dim": 0}, ValueError, "Float8BlockTensor: block_dim must be 1 (1x128) or 2"),
        (f8, {**kw8, "fp8_dtype": torch.float16}, ValueError, "Float8BlockTensor: fp8_dtype must be"),
        (f8, {**kw8, "pow2_scales": 1}, TypeError, "Float8BlockTensor: pow2_scales must be a bool, got int 1"),
        (f8, {**kw8, "amax_epsilon": -1e-30}, ValueError,
         "Float8BlockTensor: amax_epsilon must be a finite float >= 0, got -1e-30"),
        (f8, {**kw8, "amax_epsilon": float("nan")}, ValueError,
         "Float8BlockTensor: amax_epsilon must be a finite float >= 0, got nan"),
        (f8, {**kw8, "amax_epsilon": float("inf")}, ValueError,  # inf would make every scale 1 (issue 22)
         "Float8BlockTensor: amax_epsilon must be a finite float >= 0, got inf"),
        (mx, {**kwmx, "fp8_dtype": torch.uint8}, ValueError, "MXFP8Tensor: fp8_dtype must be"),
        (mx, {**kwmx, "gemm_swizzled_scales": "yes"}, TypeError, "MXFP8Tensor: gemm_swizzled_scales must be a bool"),
        (nv, {**kwnv, "fp8_dtype": E5M2}, ValueError, "NVFP4Tensor: nvfp4 stores E2M1 data with E4M3 scales; "
                                                      "fp8_dtype must be torch.float8_e4m3fn"),
        (nv, {**kwnv, "gemm_swizzled_scales": None}, TypeError, "NVFP4Tensor: gemm_swizzled_scales must be a bool"),
    ]
    for cls, kw, exc, msg in cases:
        _rejects(cls, kw, "^" + re.escape("pyxfer.formats." + msg), exc)
    # the boundaries that are valid
    assert f8(**{**kw8, "amax_epsilon": 0.0}).amax_epsilon == 0.0
    assert f8(**{**kw8, "amax_epsilon": 0}).amax_epsilon == 0.0
    q2 = F.quantize(torch.randn(64, 128), "fp8_block_128x128", columnwise=True)
    assert F.Float8BlockTensor(shape=q2.shape, dtype=q2.dtype, block_dim=2, **q2.buffers()).fmt == "fp8_block_128x128"


def test_quantize_global_amax_device_and_bounds():
    x = torch.randn(16, 32)
    op = "pyxfer.formats.quantize: "
    with pytest.raises(ValueError, match="^" + re.escape(op + "global_amax is on the meta device and has no data "
                                                             "to read") + "$"):
        F.quantize(x, "nvfp4", global_amax=torch.ones(1, device="meta"))
    assert float(F.quantize(x, "nvfp4", global_amax=0.0).amax_rowwise[0]) == 0.0  # the smallest valid float
    fp32_max = torch.finfo(torch.float32).max
    assert float(F.quantize(x, "nvfp4", global_amax=fp32_max).amax_rowwise[0]) == fp32_max  # the largest
    rule = op + "global_amax must be None or a finite float32 value >= 0 or a 1-element floating-point tensor " \
                "holding one, got "
    for bad in (-1e-30, fp32_max * 2, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="^" + re.escape(rule + repr(bad)) + "$"):
            F.quantize(x, "nvfp4", global_amax=bad)
    for bad in (True, "1.0"):
        with pytest.raises(TypeError, match="^" + re.escape(f"{op}global_amax must be a real number, got "
                                                            f"{type(bad).__name__} {bad!r}") + "$"):
            F.quantize(x, "nvfp4", global_amax=bad)
    for bad in (torch.ones(1, dtype=torch.int32), torch.ones(2)):
        with pytest.raises(ValueError, match="^" + re.escape(f"{op}global_amax must be a 1-element floating-point "
                                                            f"tensor, got shape {tuple(bad.shape)} and dtype "
                                                            f"{bad.dtype}") + "$"):
            F.quantize(x, "nvfp4", global_amax=bad)
    with pytest.raises(TypeError, match=re.escape("pyxfer.formats.QuantizeSpec: global_amax must be None or a float "
                                                  "here (a QuantizeSpec holds no tensors), got a tensor")):
        F.QuantizeSpec("nvfp4", global_amax=torch.ones(1))
    for name in ("rowwise", "columnwise"):
        with pytest.raises(TypeError, match=re.escape(f"{op}{name} must be a bool, got int 1")):
            F.quantize(x, "nvfp4", **{name: 1})
        with pytest.raises(TypeError,
                           match=re.escape(f"pyxfer.formats.QuantizeSpec: {name} must be a bool, got int 1")):
            F.QuantizeSpec("nvfp4", **{name: 1})
    with pytest.raises(TypeError, match=re.escape(op + "x must be a torch.Tensor, got list")):
        F.quantize([1.0], "nvfp4")
    with pytest.raises(ValueError, match="^" + re.escape(op + "x must have at least 1 dimension, got ()") + "$"):
        F.quantize(torch.tensor(1.0), "fp8_block_1x128")


# --- the native quantize / dequantize ops ---------------------------------------------------------

def _u8(*shape):
    return torch.zeros(shape, dtype=torch.uint8)


def _native_cases():
    o, x, one = torch.ops.pyxfer, torch.randn(64, 64), torch.ones(1)
    q8, d8, qmx, dmx, qnv, dnv = (o.quantize_fp8_block, o.dequantize_fp8_block, o.quantize_mxfp8,
                                  o.dequantize_mxfp8, o.quantize_nvfp4, o.dequantize_nvfp4)
    f32 = torch.float32
    return [
        # quantize_fp8_block(x, block_dim, rowwise, columnwise, fp8_dtype, pow2_scales, amax_epsilon)
        (lambda: q8(x.int(), 1, True, False, E4M3, True, 0.0), "x must be float32, bfloat16 or float16, got Int"),
        (lambda: q8(torch.tensor(1.0), 1, True, False, E4M3, True, 0.0), "x must have at least 1 dimension"),
        (lambda: q8(x, 1, False, False, E4M3, True, 0.0), "at least one of rowwise and columnwise must be true"),
        (lambda: q8(x, 0, True, False, E4M3, True, 0.0), "block_dim must be 1 (1x128) or 2 (128x128), got 0"),
        (lambda: q8(x, 3, True, False, E4M3, True, 0.0), "block_dim must be 1 (1x128) or 2 (128x128), got 3"),
        (lambda: q8(x, 1, True, False, E4M3, True, -1e-30), "amax_epsilon must be >= 0, got -1e-30"),
        (lambda: q8(x, 1, True, False, torch.float16, True, 0.0),
         "fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got Half"),
        # quantize_mxfp8(x, rowwise, columnwise, fp8_dtype)
        (lambda: qmx(torch.randn(64, 48), True, False, E4M3),
         "MXFP8 needs the flattened leading dims (M=64) and the last dim (K=48) of x to be multiples of 32"),
        (lambda: qmx(torch.randn(2, 8, 32), True, False, E4M3), "(M=16) and the last dim (K=32) of x"),
        (lambda: qmx(torch.randn(48, 64), False, True, E4M3), "(M=48) and the last dim (K=64) of x"),
        (lambda: qmx(x, True, False, torch.uint8), "fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2"),
        (lambda: qmx(x.double(), True, False, E4M3), "x must be float32, bfloat16 or float16, got Double"),
        # quantize_nvfp4(x, global_amax, rowwise, columnwise)
        (lambda: qnv(x, torch.ones(2), True, False),
         "global_amax must be a float32 tensor with one element, got Float with shape [2]"),
        (lambda: qnv(x, torch.ones(1, dtype=torch.float64), True, False),
         "global_amax must be a float32 tensor with one element, got Double with shape [1]"),
        (lambda: qnv(torch.randn(16, 40), one, True, False),
         "(M=16) and the last dim (K=40) of x to be multiples of 16"),
        (lambda: qnv(torch.randn(24, 32), one, True, False),
         "(M=24) and the last dim (K=32) of x to be multiples of 16"),
        (lambda: qnv(x, one, False, False), "at least one of rowwise and columnwise must be true"),
        # dequantize_fp8_block(data, scale_inv, block_dim, columnwise, fp8_dtype, out_dtype)
        (lambda: d8(torch.zeros(4, 128), torch.ones(1, 4), 1, False, E4M3, f32),
         "data must be a uint8 tensor of raw bytes, got Float"),
        (lambda: d8(torch.tensor(1, dtype=torch.uint8), torch.ones(1, 4), 1, False, E4M3, f32),
         "data must have at least 1 dimension, got a 0-dim tensor"),
        (lambda: d8(_u8(4, 128), torch.ones(1, 8), 1, False, E4M3, f32),
         "scale_inv must be Float of shape [1, 4] for this data, got Float of shape [1, 8]"),
        (lambda: d8(_u8(4, 128), torch.ones(1, 4, dtype=torch.float64), 1, False, E4M3, f32),
         "scale_inv must be Float of shape [1, 4] for this data, got Double of shape [1, 4]"),
        (lambda: d8(_u8(4, 128), torch.ones(4), 1, False, E4M3, f32),
         "scale_inv must be Float of shape [1, 4] for this data, got Float of shape [4]"),
        (lambda: d8(_u8(4, 128), torch.ones(1, 4), 3, False, E4M3, f32), "block_dim must be 1 (1x128) or 2"),
        (lambda: d8(_u8(4, 128), torch.ones(1, 4), 1, False, E4M3, torch.float64),
         "out_dtype must be float32, bfloat16 or float16, got Double"),
        (lambda: d8(_u8(4, 128), torch.ones(1, 4), 1, False, torch.int8, f32),
         "fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got Char"),
        (lambda: d8(_u8(128, 4), torch.ones(1, 4), 1, True, E4M3, f32),  # columnwise: [cdiv(M,128), rup(K,4)]
         "scale_inv must be Float of shape [1, 128] for this data, got Float of shape [1, 4]"),
        # dequantize_mxfp8(data, scale_inv, columnwise, fp8_dtype, out_dtype)
        (lambda: dmx(_u8(32, 48), _u8(128, 4), False, E4M3, f32),
         "MXFP8 needs the flattened leading dims (M=32) and the last dim (K=48) of the matrix data stores"),
        (lambda: dmx(_u8(32, 32), _u8(4, 4), False, E4M3, f32),
         "scale_inv must be Byte of shape [128, 4] for this data, got Byte of shape [4, 4]"),
        (lambda: dmx(_u8(32, 32), _u8(128, 4), True, E4M3, f32),
         "scale_inv must be Byte of shape [4, 128] for this data, got Byte of shape [128, 4]"),
        (lambda: dmx(_u8(32, 32), torch.zeros(128, 4), False, E4M3, f32), "scale_inv must be Byte of shape [128, 4]"),
        (lambda: dmx(torch.zeros(32, 32, dtype=torch.int8), _u8(128, 4), False, E4M3, f32),
         "data must be a uint8 tensor of raw bytes, got Char"),
        (lambda: dmx(_u8(32, 32), _u8(128, 4), False, E4M3, torch.int32), "out_dtype must be float32"),
        (lambda: dmx(_u8(32, 32), _u8(128, 4), False, torch.float32, f32), "fp8_dtype must be torch.float8_e4m3fn"),
        # dequantize_nvfp4(data, scale_inv, amax, columnwise, out_dtype)
        (lambda: dnv(_u8(16, 8), _u8(128, 4), torch.ones(2), False, f32),
         "amax must be a float32 tensor with one element, got Float with shape [2]"),
        (lambda: dnv(_u8(16, 8), _u8(128, 4), torch.ones(1, dtype=torch.float16), False, f32),
         "amax must be a float32 tensor with one element, got Half with shape [1]"),
        (lambda: dnv(_u8(2, 16, 8), _u8(128, 4), one, True, f32),
         "columnwise NVFP4 data must be 2-D [K, M/2], got shape [2, 16, 8]"),
        (lambda: dnv(_u8(16, 4), _u8(128, 4), one, False, f32),
         "NVFP4 needs the flattened leading dims (M=16) and the last dim (K=8) of the matrix data stores"),
        (lambda: dnv(_u8(16, 4), _u8(128, 4), one, True, f32),  # columnwise [K, M/2]: M = 8, K = 16
         "(M=8) and the last dim (K=16) of the matrix data stores to be multiples of 16"),
        (lambda: dnv(_u8(16, 8), _u8(128, 8), one, False, f32),
         "scale_inv must be Byte of shape [128, 4] for this data, got Byte of shape [128, 8]"),
        (lambda: dnv(_u8(16, 8), _u8(128, 4), one, False, torch.float64), "out_dtype must be float32"),
        (lambda: dnv(_u8(16, 8).float(), _u8(128, 4), one, False, f32), "data must be a uint8 tensor of raw bytes"),
        # swap_first_dims(src)
        (lambda: o.swap_first_dims(_u8(5)), "src must have at least 2 dimensions, got shape [5]"),
    ]


_OP_NAMES = ("quantize_fp8_block", "dequantize_fp8_block", "quantize_mxfp8", "dequantize_mxfp8", "quantize_nvfp4",
             "dequantize_nvfp4", "swap_first_dims")


def test_native_format_op_checks_name_the_argument():
    for call, message in _native_cases():
        with pytest.raises(RuntimeError) as info:
            call()
        text = str(info.value).splitlines()[0]
        assert re.match(r"^pyxfer\.(" + "|".join(_OP_NAMES) + r"): ", text), text
        assert message in text, (message, text)


def test_native_format_ops_accept_the_boundary_cases(gen):
    """The valid side of the checks above: block_dim 1 and 2, amax_epsilon 0, the smallest divisible
    shapes, an empty matrix."""
    o = torch.ops.pyxfer
    x = torch.randn(32, 32, generator=gen)
    for block_dim in (1, 2):
        rd, rs, cd, cs = o.quantize_fp8_block(x, block_dim, True, True, E5M2, False, 0.0)
        assert o.dequantize_fp8_block(cd, cs, block_dim, True, E5M2, torch.float16).shape == (32, 32)
    rd, rs, cd, cs = o.quantize_mxfp8(x, True, True, E4M3)
    assert o.dequantize_mxfp8(cd, cs, True, E4M3, torch.bfloat16).shape == (32, 32)
    x16 = torch.randn(16, 16, generator=gen)
    amax = x16.abs().amax().reshape(1)
    rd, rs, cd, cs = o.quantize_nvfp4(x16, amax, True, True)
    assert rd.shape == (16, 8) and cd.shape == (16, 8)
    assert o.dequantize_nvfp4(cd, cs, amax, True, torch.float32).shape == (16, 16)
    rd, rs, cd, cs = o.quantize_mxfp8(torch.empty(0, 32), True, False, E4M3)
    assert rd.shape == (0, 32) and rs.shape == (0, 4)


# --- device arguments, fault specs and gather inputs ---------------------------------------------

def test_device_arguments_name_the_argument():
    t = torch.arange(5)
    op = "pyxfer.verified_copy: "
    assert pyxfer.verified_copy(t, torch.device("cpu")).device.type == "cpu"  # the unparsed fast path
    assert pyxfer.verified_copy(t, "cpu:0").device.type == "cpu"
    with pytest.raises(ValueError, match=re.escape(op + "device is not a device: 'gpu:0' (")):
        pyxfer.verified_copy(t, "gpu:0")
    with pytest.raises(ValueError, match="^" + re.escape(op + "device must be a CUDA index >= 0, got -1") + "$"):
        pyxfer.verified_copy(t, -1)
    with pytest.raises(TypeError, match=re.escape(op + "device must be a torch.device, a string or a CUDA index, "
                                                       "got bool")):
        pyxfer.verified_copy(t, True)
    with pytest.raises(ValueError, match=re.escape("pyxfer.staged_copy: device must be a CPU or CUDA device, "
                                                   "got meta")):
        pyxfer.staged_copy(t, "meta")
    with pytest.raises(ValueError, match=re.escape("pyxfer.health.status: dst is not a device: 'tpu'")):
        pyxfer.health.status("cpu", "tpu")
    with pytest.raises(ValueError, match=re.escape("pyxfer.testing.inject_fault: src must be a CPU or CUDA device")):
        with pyxfer.testing.inject_fault("zeros", src="meta"):
            pass


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA devices")
def test_the_current_cuda_device_without_cuda_is_a_clear_error():
    why = "0 CUDA devices visible" if torch.backends.cuda.is_built() else "torch was built without CUDA"
    msg = f"is cuda, which does not exist ({why}); expected 'cpu' or a CUDA device of this process"
    with pytest.raises(ValueError, match="^" + re.escape("pyxfer.verified_copy: device " + msg) + "$"):
        pyxfer.verified_copy(torch.ones(2), "cuda")
    with pytest.raises(ValueError, match="^" + re.escape("pyxfer.health.mark: src " + msg) + "$"):
        pyxfer.health.mark("cuda", "cpu", "healthy")


def test_fault_spec_from_the_environment_is_checked():
    # a malformed value never breaks `import pyxfer`: it warns, naming the variable and the form, and arms nothing
    r = run_python("import pyxfer", env={"PYXFER_INJECT_FAULT": "zeros,when=now"})
    assert r.returncode == 0, r.stderr
    assert (f"RuntimeWarning: PYXFER_INJECT_FAULT: 'when=now' is not one of path=, src=, dst=, times=; expected "
            f"kind[,path=P][,src=D][,dst=D][,times=N] with kind one of {pyxfer.testing.FAULT_KINDS} (e.g. "
            f"'bitflip,dst=cuda:1,times=3'), got 'zeros,when=now'; no fault installed") in r.stderr
    r = run_python("import pyxfer; print(pyxfer.testing.inject_fault)",
                   env={"PYXFER_INJECT_FAULT": "bitflip,path=staged,src=cpu,dst=cpu,times=2"})
    assert r.returncode == 0, r.stderr


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_gather_input_checks_in_a_world_of_one(world_of_one):
    with pytest.raises(ValueError, match=re.escape("pyxfer.all_gather: x has 9 dims; at most 8 are supported")):
        pyxfer.all_gather(torch.zeros([1] * 9))
    pyxfer.all_gather(torch.zeros([1] * 8))  # the largest valid rank
    with pytest.raises(ValueError, match=re.escape("pyxfer.all_gather: x must have at least one dim")):
        pyxfer.all_gather(torch.tensor(1.0))
    with pytest.raises(TypeError, match=re.escape("pyxfer.all_gather: x has dtype torch.complex32, which cannot be "
                                                  "gathered")):
        pyxfer.all_gather(torch.zeros(2, dtype=torch.complex32))
    with pytest.raises(TypeError, match=re.escape("pyxfer.all_gather: quantize_as needs a float32, bfloat16 or "
                                                  "float16 tensor, got torch.int32")):
        pyxfer.all_gather(torch.zeros(128, 128, dtype=torch.int32), quantize_as=F.QuantizeSpec("mxfp8"))
    x = torch.arange(5)
    handle = pyxfer.all_gather(x, async_op=True)
    assert handle.is_completed() and handle.wait() is x and handle.wait() is x  # world of one: x itself


def test_packed_buffer_checks_its_specs():
    buf = torch.zeros(64, dtype=torch.uint8)
    spec = pyxfer.SubviewSpec(8, (2,), (1,), torch.float64)
    packed = pyxfer.PackedBuffer(buf, [spec])
    assert repr(packed) == "PackedBuffer(64 bytes on cpu, 1 views)"
    with pytest.raises(TypeError, match=re.escape("pyxfer.buffers.PackedBuffer: specs[1] must be a SubviewSpec, "
                                                  "got dict")):
        pyxfer.PackedBuffer(buf, [spec, spec.to_dict()])
    with pytest.raises(ValueError, match=re.escape("pyxfer.buffers.PackedBuffer: specs[0] spans bytes [56, 72) of "
                                                   "buffer, expected them inside the buffer's 64 bytes")):
        pyxfer.PackedBuffer(buf, [pyxfer.SubviewSpec(56, (2,), (1,), torch.float64)])
    assert pyxfer.PackedBuffer(buf, [pyxfer.SubviewSpec(48, (2,), (1,), torch.float64)]).unpack()[0].shape == (2,)
