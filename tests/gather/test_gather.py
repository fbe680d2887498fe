"""pyxfer.all_gather on real gloo process groups of 2, 3 and 4 processes (CPU).

Each world size is spawned once (tests/support/gather_worker.py, one process per rank) and runs the whole
case list; every case below reports what all ranks saw. Cases: plain tensors of every dtype
(non-contiguous, empty, sync/async, verify), the format matrix (format x usage x quantizable or not x
bf16/fp16/fp32 x non-contiguous, with QuantizedTensor / quantize_as / requantized inputs, sync/async,
verify on/off) compared bit-exactly with quantizing the full tensor in one process, swizzled scales,
NVFP4 amax handling, warnings, async post-processing, shards corrupted in transit (caught by verify,
let through without it), disagreements across ranks (an error on every rank, no hang), world size 1.
"""
import warnings

import pytest
import torch
import torch.distributed as dist

import pyxfer

from support.gather_harness import assert_case_passed, case_names, run_group, selected_cases

WORLD_SIZES = (2, 3, 4)


_cache = {}


@pytest.mark.parametrize("world,case", [(w, c) for w in WORLD_SIZES for c in case_names(w)])
def test_gather_case(request, world, case):
    """One case on a gloo group of ``world`` CPU processes: the group is spawned once per world size
    and runs every selected case of that size (``pytest -k <case>`` runs only the matching ones)."""
    if world not in _cache:
        _cache[world] = run_group(world, only=selected_cases(request, "test_gather_case", world=world))
    assert_case_passed(*_cache[world], case)


# ---- single-process checks (no group of several ranks needed) ---------------------------------

def test_not_initialized_is_a_clear_error():
    if dist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    with pytest.raises(RuntimeError, match="not initialized"):
        pyxfer.all_gather(torch.ones(2))
    with pytest.raises(RuntimeError, match="pyxfer.check_gathers: torch.distributed is not initialized"):
        pyxfer.check_gathers()


def test_world_size_one_is_a_no_op_that_keeps_the_type(world_of_one, gen):
    from pyxfer import formats
    x = torch.randn(64, 32, generator=gen).to(torch.bfloat16)
    assert pyxfer.all_gather(x) is x
    assert pyxfer.all_gather(x, async_op=True).wait() is x
    q = formats.quantize(x, "mxfp8", columnwise=True)
    assert pyxfer.all_gather(q, verify=True) is q
    spec = formats.QuantizeSpec("nvfp4", rowwise=True, columnwise=True)
    got = pyxfer.all_gather(x, quantize_as=spec)
    want = spec.quantize(x)
    for name, buf in want.buffers().items():
        assert torch.equal(got.buffers()[name].view(torch.uint8), buf.view(torch.uint8)), name
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # world size 1 never falls back
        assert pyxfer.all_gather(x[:, :8], quantize_as=spec) is not None


def test_argument_errors_are_raised_before_any_collective(world_of_one):
    from pyxfer import formats
    with pytest.raises(TypeError, match="quantize_as"):
        pyxfer.all_gather(torch.ones(2, 2), quantize_as="mxfp8")
    with pytest.raises(TypeError, match="verify"):
        pyxfer.all_gather(torch.ones(2, 2), verify=1)
    for bad in (1, None, "yes"):
        with pytest.raises(TypeError, match=f"pyxfer.all_gather: strict must be a bool, got {type(bad).__name__}"):
            pyxfer.all_gather(torch.ones(2, 2), strict=bad)
    with pytest.raises(ValueError, match="0-dim"):
        pyxfer.all_gather(torch.ones(()))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        pyxfer.all_gather([1, 2])
    with pytest.raises(TypeError, match="quantize_as needs"):
        pyxfer.all_gather(torch.ones(32, 32, dtype=torch.int32), quantize_as=formats.QuantizeSpec("mxfp8"))


def test_gather_fault_arguments_are_checked():
    from pyxfer.testing import inject_fault
    with pytest.raises(ValueError, match="group rank"):
        with inject_fault("zeros", src="cuda:0", path="gather"):
            pass
    with pytest.raises(ValueError, match="only for path='gather'"):
        with inject_fault("zeros", path="direct", buffer="data"):
            pass
    with pytest.raises(ValueError, match="path must be one of"):
        with inject_fault("zeros", path="elsewhere"):
            pass
    with inject_fault("bitflip", src=1, dst=0, path="gather", times=2) as fault:
        pass
    assert fault.unused == 2 and fault.used == 0
