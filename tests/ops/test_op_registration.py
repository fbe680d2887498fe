"""Every torch.ops.pyxfer op is registered completely, so that an op landing without one of its parts
fails here. The ops are enumerated from the dispatcher's pyxfer namespace (a new op is covered without
editing this file), and each must have:

- tensor ops on a backend (formats, checksums): a CPU kernel, a CUDA kernel exactly when this build
  has CUDA (pyxfer.build_info()["cuda"]), no composite kernel beside them;
- device-generic tensor ops (the verified-copy protocol): one CompositeExplicitAutograd kernel, which
  serves every device (each transfer path registers itself behind it), and no CPU / CUDA kernel;
- every tensor op: a fake (pyxfer/_fake.py; a Meta kernel) and an opcheck sample in SAMPLES below,
  which torch.library.opcheck runs on the CPU and, marked gpu, on CUDA;
- ops without tensor arguments: a kernel that needs none, CompositeExplicitAutograd or a catch-all
  registration (the dispatcher files a catch-all, and ``m.def(schema, fn)``, under
  CompositeImplicitAutograd), and no CPU / CUDA / Meta kernel: the dispatcher picks those from tensor
  arguments, so they would never run. They take no opcheck sample (there is nothing to fake).
"""
import pytest
import torch

import pyxfer

from support.tensors import layouts

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
CUDA_BUILD = bool(pyxfer.build_info()["cuda"])
COMPOSITES = ("CompositeImplicitAutograd", "CompositeExplicitAutograd", "CompositeExplicitAutogradNonFunctional")


def _pyxfer_ops():
    """{"name" or "name.overload": OpOverload} of every op the dispatcher holds in the pyxfer namespace."""
    ops = {}
    for qualified in torch._C._dispatch_get_all_op_names():
        ns, _, full = qualified.partition("::")
        if ns != "pyxfer":
            continue
        name, _, overload = full.partition(".")
        ops[full] = getattr(getattr(torch.ops.pyxfer, name), overload or "default")
    return ops


OPS = _pyxfer_ops()
TENSOR_OPS = sorted(n for n, op in OPS.items() if any("Tensor" in str(a.type) for a in op._schema.arguments))
NO_TENSOR_OPS = sorted(set(OPS) - set(TENSOR_OPS))


def _kernels(name):
    """The dispatch keys (and alias keys) that hold a kernel registered directly for pyxfer::name."""
    keys = ("CPU", "CUDA", "Meta") + COMPOSITES
    return {k for k in keys if torch._C._dispatch_has_kernel_for_dispatch_key(OPS[name].name(), k)}


# ------------------------------------------------------------------------------------------------
# opcheck samples: op name -> f(device, gen) -> list of argument tuples. Fresh random data, odd sizes,
# views and offsets; values without NaN (opcheck compares outputs, and NaN != NaN).
# ------------------------------------------------------------------------------------------------

def _values(shape, dtype, gen, device):
    return (torch.randn(shape, generator=gen) * 4).to(dtype).to(device)


def _some_layouts(dtype, gen, device):
    """A few of tests/support/tensors.py's layouts (each opcheck sample runs the op several times)."""
    keep = ("empty", "scalar", "seven", "transposed", "offset3-2d", "permuted")
    return [t for name, t in layouts(dtype, gen, device) if name in keep]


def _checksum(device, gen):
    return [(t, 3) for t in _some_layouts(torch.float32, gen, device)]


def _checksum_partial(device, gen):
    return [(t, 5, 3) for t in _some_layouts(torch.float32, gen, device)]


def _checksum_combine(device, gen):
    partials = torch.randint(-2**63, 2**63 - 1, (5,), dtype=torch.int64, generator=gen).to(device)
    return [(partials, 1000, 3), (partials[1:4], 17, 0)]


def _copies(device, gen):
    """(source, destination device) pairs of int32 data (every bit pattern compares equal to itself): on
    the CPU, cpu -> cpu; on CUDA, cuda:0 -> cpu and cpu -> cuda:0 (the pairs one GPU has)."""
    if device == "cpu":
        return [(t, torch.device("cpu")) for t in _some_layouts(torch.int32, gen, "cpu")]
    return ([(t, torch.device("cpu")) for t in _some_layouts(torch.int32, gen, "cuda:0")] +
            [(t, torch.device("cuda:0")) for t in _some_layouts(torch.int32, gen, "cpu")])


def _verified_copy(device, gen):
    return [(t, dst, "auto", "sync") for t, dst in _copies(device, gen)]


def _verified_copy_many(device, gen):
    """Each destination's sources as one list (mixed layouts; on CUDA cuda:0 and CPU sources together), and
    a list of one, deferred."""
    by_dst = {}
    for t, dst in _copies(device, gen):
        by_dst.setdefault(dst, []).append(t)
    if device != "cpu":
        by_dst[torch.device("cuda:0")] += _some_layouts(torch.int32, gen, "cuda:0")
    return [(ts, dst, "auto", "sync") for dst, ts in by_dst.items()] + [(ts[:1], dst, "direct", "deferred")
                                                                         for dst, ts in by_dst.items()]


def _staged_copy(device, gen):
    return _copies(device, gen)


def _quantize_fp8_block(device, gen):
    x = _values((2, 33, 65), torch.bfloat16, gen, device)
    xt = _values((130, 37), torch.float32, gen, device).t()  # non-contiguous, partial edge blocks
    return [(x, 1, True, True, E4M3, True, 0.0), (xt, 2, False, True, E5M2, False, 1e-3),
            (x[1], 2, True, False, E4M3, False, 0.0)]


def _dequantize_fp8_block(device, gen):
    x = _values((33, 160), torch.float16, gen, device)
    samples = []
    for block_dim, out_dtype in ((1, torch.bfloat16), (2, torch.float32)):
        rd, rs, cd, cs = torch.ops.pyxfer.quantize_fp8_block(x, block_dim, True, True, E4M3, True, 0.0)
        samples += [(rd, rs, block_dim, False, E4M3, out_dtype), (cd, cs, block_dim, True, E4M3, out_dtype)]
    return samples


def _quantize_mxfp8(device, gen):
    return [(_values((2, 32, 64), torch.bfloat16, gen, device), True, True, E4M3),
            (_values((96, 64), torch.float32, gen, device)[32:], False, True, E5M2)]  # storage offset


def _dequantize_mxfp8(device, gen):
    rd, rs, cd, cs = torch.ops.pyxfer.quantize_mxfp8(_values((64, 96), torch.float32, gen, device), True, True, E5M2)
    return [(rd, rs, False, E5M2, torch.float16), (cd, cs, True, E5M2, torch.float32)]


def _amax(x):
    return x.abs().amax().float().reshape(1)


def _quantize_nvfp4(device, gen):
    x = _values((32, 160), torch.float32, gen, device)
    xb = _values((3, 16, 48), torch.bfloat16, gen, device)
    return [(x, _amax(x), True, True), (xb, _amax(xb), True, False)]


def _dequantize_nvfp4(device, gen):
    x = _values((48, 160), torch.float32, gen, device)
    rd, rs, cd, cs = torch.ops.pyxfer.quantize_nvfp4(x, _amax(x), True, True)
    return [(rd, rs, _amax(x), False, torch.bfloat16), (cd, cs, _amax(x), True, torch.float32)]


def _swap_first_dims(device, gen):
    return [(torch.randint(0, 200, (3, 4, 5), dtype=torch.uint8, generator=gen).to(device),),
            (_values((5, 7, 3), torch.float32, gen, device).permute(1, 0, 2),),
            (_values((2, 9), torch.bfloat16, gen, device),)]


def _sm_copy(device, gen):
    """Odd sizes, a storage offset, a byte count shared by two dtypes; pull and push (one device)."""
    src = torch.randint(0, 256, (4099,), dtype=torch.uint8, generator=gen).to(device)
    wide = torch.randint(-2**31, 2**31 - 1, (7, 5), dtype=torch.int32, generator=gen).to(device)
    return [(src[3:], torch.full((4096,), 0xC3, dtype=torch.uint8, device=device), True),
            (wide, torch.zeros(35, dtype=torch.float32, device=device).view(torch.int32), False),
            (src[:0], torch.empty(0, dtype=torch.uint8, device=device), True)]


def _pointer_chase(device, gen):
    """A ring that is one random cycle (odd length), walked 0, a few and more hops than it has nodes."""
    order = torch.cat([torch.zeros(1, dtype=torch.int64), torch.randperm(1000, generator=gen) + 1])
    ring = torch.empty(1001, dtype=torch.int64)
    ring[order] = order.roll(-1)
    ring = ring.to(device)
    return [(ring, 0), (ring, 7), (ring, 2503)]


def _peer_exchange(device, gen):
    """Two buffers of an odd number of words (the header, then 4099), 1 and 5 rounds; on CUDA two GPUs."""
    if device == "cpu":
        ends = ("cpu", "cpu")
    elif torch.cuda.device_count() >= 2 and torch.cuda.can_device_access_peer(0, 1):
        ends = ("cuda:0", "cuda:1")
    else:
        pytest.skip("peer_exchange on CUDA needs 2 GPUs with peer access")
    seed = int(torch.randint(0, 2**62, (1,), generator=gen))
    return [(torch.full((16 + 4099,), -7, dtype=torch.int64, device=ends[0]),
             torch.full((16 + 4099,), -7, dtype=torch.int64, device=ends[1]), rounds, seed, 10.0)
            for rounds in (1, 5)]


_GATHER_GROUPS = {}


def _gather_group(device):
    """The name of a 1-rank process group of ``device``'s backend, registered in torch's group registry
    (the gather ops find groups there) without initializing torch.distributed in this process."""
    kind = "cuda" if str(device).startswith("cuda") else "cpu"
    if kind not in _GATHER_GROUPS:
        import tempfile

        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d
        store = dist.FileStore(tempfile.mkstemp()[1], 1)
        pg = c10d.ProcessGroup(store, 0, 1)
        if kind == "cuda":
            backend, kind_code = dist.ProcessGroupNCCL(store, 0, 1), c10d.ProcessGroup.BackendType.NCCL
            pg._register_backend(torch.device("cuda"), kind_code, backend)
        else:
            backend, kind_code = dist.ProcessGroupGloo(store, 0, 1), c10d.ProcessGroup.BackendType.GLOO
            pg._register_backend(torch.device("cpu"), kind_code, backend)
        pg._set_default_backend(kind_code)
        name = f"pyxfer-opcheck-{kind}"
        c10d._register_process_group(name, pg)
        _GATHER_GROUPS[kind] = (name, pg)
    return _GATHER_GROUPS[kind][0]


def _indexed(device):
    """``device`` with its index (the engine's latches and records name a device by index, as its calls do)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _gather_plans(device, gen):
    """(group name, plan, inputs, amax, latch address) of a 1-rank gather: plain (odd shape, non-contiguous,
    a dtype sent as bytes), MXFP8 with trimmed scales, NVFP4 with its amax and a swap fix-up."""
    from pyxfer import formats
    from pyxfer.gather import engine
    from pyxfer.gather import record as rec
    from pyxfer.gather.plan import Local
    group, out = _gather_group(device), []
    latch = torch.ops.pyxfer.gather_latch_new(_indexed(device)).data_ptr()
    xs = [_values((7, 3), torch.float32, gen, device).t(), _values((5,), torch.float32, gen, device).to(torch.bool),
          formats.quantize(_values((64, 96), torch.bfloat16, gen, device), "mxfp8", columnwise=True),
          formats.quantize(_values((32, 64), torch.float32, gen, device), "nvfp4", rowwise=True, columnwise=True)]
    for x in xs:
        local = Local(x, None, False, 1, exchange=True)
        meta = local.record()
        plan = engine.Plan(local, rec.signature(meta), meta, 1, 0)
        _gather_plans.keep.append(plan)  # the op's fakes find plans by id while they live
        inputs, amax = plan.inputs_of(local)
        out.append((group, plan, inputs, amax, latch))
    return out


_gather_plans.keep = []


def _gather_run(device, gen):
    from pyxfer.gather import engine
    return [(group, plan.id, inputs, plan.meta(_indexed(device)), amax, latch, seq, 0, engine.MODE_VERDICT)
            for seq, (group, plan, inputs, amax, latch) in enumerate(_gather_plans(device, gen), 1)]


def _gather_post(device, gen):
    """The plans whose posted outputs hold no uninitialized bytes (a fix-up's result and an NVFP4 amax are
    only written by gather_finish, which gather_run and the gather_finish samples cover): opcheck compares
    two runs' outputs."""
    from pyxfer.gather import engine
    return [args for args in _gather_run(device, gen)
            if not (engine.plan_by_id(args[1]).num_temps or engine.plan_by_id(args[1]).nvfp4)]


def _gather_join(device, gen):
    """The records of posted calls (CUDA: joins their ring slots' events; CPU: nothing to wait for)."""
    from pyxfer.gather import engine
    samples = []
    for args in _gather_run(device, gen)[:2]:
        posted = torch.ops.pyxfer.gather_post(*args[:-1], args[-1] | (engine.MODE_ASYNC if device != "cpu" else 0))
        samples.append((posted[-1], args[6]))
    return samples


def _gather_finish(device, gen):
    from pyxfer.gather import engine
    samples = []
    for args in _gather_run(device, gen):
        posted = torch.ops.pyxfer.gather_post(*args)
        n = engine.plan_by_id(args[1]).num_results
        samples.append((args[1], posted[:n], posted[n:-1], posted[-1], args[6], engine.MODE_VERDICT))
    return samples


SAMPLES = {
    "gather_post": _gather_post,
    "gather_run": _gather_run,
    "gather_finish": _gather_finish,
    "gather_join": _gather_join,
    "checksum": _checksum,
    "checksum_partial": _checksum_partial,
    "checksum_combine": _checksum_combine,
    "verified_copy": _verified_copy,
    "verified_copy_many": _verified_copy_many,
    "staged_copy": _staged_copy,
    "sm_copy": _sm_copy,
    "pointer_chase": _pointer_chase,
    "peer_exchange": _peer_exchange,
    "quantize_fp8_block": _quantize_fp8_block,
    "dequantize_fp8_block": _dequantize_fp8_block,
    "quantize_mxfp8": _quantize_mxfp8,
    "dequantize_mxfp8": _dequantize_mxfp8,
    "quantize_nvfp4": _quantize_nvfp4,
    "dequantize_nvfp4": _dequantize_nvfp4,
    "swap_first_dims": _swap_first_dims,
}


# ------------------------------------------------------------------------------------------------
# Registration
# ------------------------------------------------------------------------------------------------

def test_the_namespace_is_enumerated():
    # The enumeration finds ops of each kind, so that the tests below do not pass on an empty list.
    assert {"checksum", "quantize_nvfp4", "verified_copy"} <= set(TENSOR_OPS), TENSOR_OPS
    assert {"build_info", "health_status"} <= set(NO_TENSOR_OPS), NO_TENSOR_OPS


def test_every_tensor_op_has_an_opcheck_sample():
    missing, stale = sorted(set(TENSOR_OPS) - set(SAMPLES)), sorted(set(SAMPLES) - set(TENSOR_OPS))
    assert not missing, f"ops without an opcheck sample in SAMPLES (tests/ops/test_op_registration.py): {missing}"
    assert not stale, f"SAMPLES entries for ops that are not pyxfer tensor ops: {stale}"


@pytest.mark.parametrize("name", TENSOR_OPS)
def test_tensor_op_kernels(name):
    kernels = _kernels(name)
    assert "Meta" in kernels, f"pyxfer::{name} has no fake: register one in pyxfer/_fake.py (got {sorted(kernels)})"
    if "CompositeExplicitAutograd" in kernels:  # device-generic: one kernel serves every device
        extra = kernels & {"CPU", "CUDA", "CompositeImplicitAutograd"}
        assert not extra, f"pyxfer::{name} is CompositeExplicitAutograd and also has {sorted(extra)} kernels"
        return
    assert "CPU" in kernels, f"pyxfer::{name} has no CPU kernel (got {sorted(kernels)})"
    assert ("CUDA" in kernels) == CUDA_BUILD, (
        f"pyxfer::{name}: CUDA kernel {'missing from' if CUDA_BUILD else 'registered in'} a build with "
        f"cuda={CUDA_BUILD} (got {sorted(kernels)})")
    composite = kernels & set(COMPOSITES)
    assert not composite, f"pyxfer::{name} has backend kernels and also {sorted(composite)}"


@pytest.mark.parametrize("name", NO_TENSOR_OPS)
def test_op_without_tensors_has_a_kernel_that_needs_none(name):
    kernels = _kernels(name)
    assert kernels & {"CompositeExplicitAutograd", "CompositeImplicitAutograd"}, (
        f"pyxfer::{name} takes no tensor: it needs a CompositeExplicitAutograd or catch-all kernel "
        f"(got {sorted(kernels)})")
    backend = kernels & {"CPU", "CUDA", "Meta"}
    assert not backend, f"pyxfer::{name} takes no tensor, so its {sorted(backend)} kernels can never be chosen"
    assert name not in SAMPLES


# ------------------------------------------------------------------------------------------------
# opcheck
# ------------------------------------------------------------------------------------------------

def _opcheck_all(name, device, gen):
    samples = SAMPLES[name](device, gen)
    assert samples
    for args in samples:
        torch.library.opcheck(OPS[name], args)


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_opcheck_on_cpu(name, gen):
    _opcheck_all(name, "cpu", gen)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_opcheck_on_cuda(name, gen):
    _opcheck_all(name, "cuda", gen)
