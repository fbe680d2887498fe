"""pyxfer.all_gather on real gloo process groups of 2, 3 and 4 processes (CPU).

Each world size is spawned once (tests/gather_worker.py, one process per rank) and runs the whole
case list; every case below reports what all ranks saw. Cases: plain tensors of every dtype
(non-contiguous, empty, sync/async, verify), the format matrix (format x usage x quantizable or not x
bf16/fp16/fp32 x non-contiguous, with QuantizedTensor / quantize_as / requantized inputs, sync/async,
verify on/off) compared bit-exactly with quantizing the full tensor in one process, swizzled scales,
NVFP4 amax handling, warnings, async post-processing, shards corrupted in transit (caught by verify,
let through without it), disagreements across ranks (an error on every rank, no hang), world size 1.
"""
import json
import os
import subprocess
import sys
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist

import pyxfer

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gather_worker  # noqa: E402

WORLD_SIZES = (2, 3, 4)
SPAWN_TIMEOUT_S = 240


def run_group(world, backend="gloo", extra=(), timeout=SPAWN_TIMEOUT_S, seed=None):
    """Spawn ``world`` worker processes; returns (seed, {case: [None or error text per rank]}). A
    rank that died or hung is reported on the first case it did not finish. PYXFER_GATHER_SEED
    replays a failing run's seed."""
    if seed is None:
        seed = int(os.environ.get("PYXFER_GATHER_SEED") or int.from_bytes(os.urandom(4), "little"))
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{tmp}/init"
        # no empty PYTHONPATH entry: that would put the working directory (maybe a source tree
        # without the built extension) ahead of the installed pyxfer
        path = [HERE] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path),
               "OMP_NUM_THREADS": "1"}
        procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "gather_worker.py"), "--rank", str(r),
                                   "--world", str(world), "--init", init, "--out", tmp, "--seed", str(seed),
                                   "--backend", backend, *extra],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
                 for r in range(world)]
        outputs = []
        for p in procs:
            try:
                outputs.append(p.communicate(timeout=timeout)[0])
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                outputs.append(p.communicate()[0] + f"\n(killed after {timeout} s)")
        results = {}
        for r in range(world):
            path = os.path.join(tmp, f"rank{r}.jsonl")
            records = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
            for rec in records:
                results.setdefault(rec["case"], [None] * world)[r] = None if rec["ok"] else rec["error"]
            done = {rec["case"] for rec in records}
            missing = [c for c in gather_worker.case_names(world) if c not in done]
            if missing:  # died or hung: blame the first case it did not finish
                tail = outputs[r][-3000:] if r < len(outputs) else ""
                results.setdefault(missing[0], [None] * world)[r] = f"rank {r} did not finish (seed {seed}):\n{tail}"
                for c in missing[1:]:
                    results.setdefault(c, [None] * world)[r] = f"rank {r} did not get to this case"
        return seed, results


_cache = {}


def group_results(world):
    if world not in _cache:
        _cache[world] = run_group(world)
    return _cache[world]


def assert_case_passed(seed, results, case):
    """Every rank ran ``case`` of a run_group result without an error (else each rank's error)."""
    errors = results.get(case)
    assert errors is not None, f"case {case} did not run (seed {seed})"
    failed = [(r, e) for r, e in enumerate(errors) if e]
    assert not failed, f"seed {seed}: " + "\n".join(f"--- rank {r}:\n{e}" for r, e in failed)


@pytest.mark.parametrize("world,case", [(w, c) for w in WORLD_SIZES for c in gather_worker.case_names(w)])
def test_gather_case(world, case):
    assert_case_passed(*group_results(world), case)


# ---- single-process checks (no group of several ranks needed) ---------------------------------

def test_not_initialized_is_a_clear_error():
    if dist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    with pytest.raises(RuntimeError, match="not initialized"):
        pyxfer.all_gather(torch.ones(2))



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
