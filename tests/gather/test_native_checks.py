"""The native gather ops (csrc/gather/gather.cpp) refuse malformed arguments before any work: plan
descriptors (version, header, dtype codes, dims, parts, the NVFP4 part), unknown plans and latches,
records of the wrong size, amax for a plan without NVFP4, inputs that do not match the plan, and
gather_run asked to post scratch or async. Each error names the op and what was expected; the
latch is left as it was (nothing posted, no verdict written)."""
import pytest
import torch
import torch.distributed as dist

from pyxfer.gather import engine
from pyxfer.gather import record as rec
from pyxfer.gather.plan import Local

ops = torch.ops.pyxfer


def _plan(x):
    local = Local(x, None, False, 1, exchange=True)
    meta = local.record()
    return engine.Plan(local, rec.signature(meta), meta, 1, 0), local


@pytest.fixture
def plain(world_of_one, gen):
    """(state, plan, inputs, meta, latch address, latch words) of a 1-rank gather of a (7, 5) float32 tensor."""
    x = torch.randn(7, 5, generator=gen)
    plan, local = _plan(x)
    state = engine.state_of(dist.group.WORLD, 0, 1)
    latch = ops.gather_latch_new(torch.device("cpu"))  # a latch of its own (the group's keeps its verdicts)
    address, words = latch.data_ptr(), latch.numpy()
    inputs, _ = plan.inputs_of(local)
    return state, plan, inputs, plan.meta(torch.device("cpu")), address, words


def _descriptor(plan):
    return list(plan._descriptor())


@pytest.mark.parametrize("what,edit,text", [
    ("version", lambda d: d.__setitem__(0, 99), "another version"),
    ("short", lambda d: d.__delitem__(slice(5, None)), "another version"),
    ("rank >= world", lambda d: d.__setitem__(2, 1), "malformed plan descriptor"),
    ("compare_len 0", lambda d: d.__setitem__(4, 0), "malformed plan descriptor"),
    ("parts vs length", lambda d: d.__setitem__(6, 2), "malformed plan descriptor"),
    ("send dtype", lambda d: d.__setitem__(engine.HEADER_WORDS + 1, 999), "bad send dtype code 999"),
    ("result dtype", lambda d: d.__setitem__(engine.HEADER_WORDS + 15, -1), "bad result dtype code -1"),
    ("ndim", lambda d: d.__setitem__(engine.HEADER_WORDS + 5, 9), "bad ndim 9"),
    ("fixup", lambda d: d.__setitem__(engine.HEADER_WORDS + 14, 3), "malformed plan part 0"),
    ("poison width", lambda d: d.__setitem__(engine.HEADER_WORDS + 27, 3), "malformed plan part 0"),
    ("nvfp4 part", lambda d: d.__setitem__(slice(7, 19), [1, 7, 5, 0, 1, 0, rec.F_AMAX_ROW, rec.F_AMAX_COL,
                                                          0, 5, -1, -1]), "malformed NVFP4 plan"),
])
def test_malformed_plan_descriptors_are_refused(what, edit, text, gen):
    plan, _ = _plan(torch.randn(7, 5, generator=gen))
    good = _descriptor(plan)
    ops.gather_plan_free(ops.gather_plan_new(good))  # the unedited descriptor is accepted
    bad = list(good)
    edit(bad)
    with pytest.raises(RuntimeError, match=text):
        ops.gather_plan_new(bad)


def test_post_and_run_refuse_bad_arguments_before_posting(plain):
    state, plan, inputs, meta, address, words = plain
    before = words.copy()
    name = state.group_name
    cases = [
        (lambda: engine.post(name, 123456789, inputs, meta, [], address, 1, 0, 0), "unknown plan id 123456789"),
        (lambda: engine.post(name, plan.id, inputs, meta[:-1], [], address, 1, 0, 0),
         f"meta must be a contiguous 1-D int64 tensor of {rec.RECORD_LEN} elements"),
        (lambda: engine.post(name, plan.id, inputs, meta.int(), [], address, 1, 0, 0), "int64"),
        (lambda: engine.post(name, plan.id, inputs, meta, [], address + 8, 1, 0, 0), "is not a latch of pyxfer.gather"),
        (lambda: engine.post(name, plan.id, inputs, meta, [torch.ones(1), torch.ones(1)], address, 1, 0, 0),
         "amax must be empty"),
        (lambda: engine.post(name, plan.id, [], meta, [], address, 1, 0, 0), "reads input 0 of 0"),
        (lambda: engine.post(name, plan.id, [inputs[0][:6]], meta, [], address, 1, 0, 0),
         "gives 30 elements, its plan sends 35"),
        (lambda: engine.run(name, plan.id, inputs, meta, [], address, 1, 0, engine.MODE_SCRATCH),
         "gather_run is the synchronous call of real data"),
        (lambda: engine.run(name, plan.id, inputs, meta, [], address, 1, 0, engine.MODE_ASYNC),
         "gather_run is the synchronous call of real data"),
        (lambda: engine.run(name, 123456789, inputs, meta, [], address, 1, 0, 0), "unknown plan id"),
        (lambda: engine.run(name, plan.id, inputs, meta[:3], [], address, 1, 0, 0), "meta must be"),
        (lambda: engine.run(name, plan.id, inputs, meta, [], 8, 1, 0, 0), "is not a latch"),
    ]
    for call, text in cases:
        with pytest.raises(RuntimeError, match=text):
            call()
        assert (words == before).all(), text  # no verdict written: nothing was posted
    outs = engine.run(name, plan.id, inputs, meta, [], address, 1, 0, engine.MODE_VERDICT)  # the same, well formed
    assert torch.equal(outs[0], inputs[0])


def test_finish_refuses_records_and_buffers_that_do_not_match_the_plan(plain):
    state, plan, inputs, meta, address, _ = plain
    outs = engine.post(state.group_name, plan.id, inputs, meta, [], address, 1, 0, engine.MODE_VERDICT)
    results, meta_recv = outs[:plan.num_results], outs[-1]
    with pytest.raises(RuntimeError, match="meta_recv must be"):
        engine.finish(plan.id, results, [], meta_recv[:-1], 1, engine.MODE_VERDICT)
    with pytest.raises(RuntimeError, match="finish takes 1 results and 0 temporaries, got 2 and 0"):
        engine.finish(plan.id, results * 2, [], meta_recv, 1, engine.MODE_VERDICT)
    with pytest.raises(RuntimeError, match="unknown plan id"):
        engine.finish(123456789, results, [], meta_recv, 1, engine.MODE_VERDICT)
    engine.finish(plan.id, results, [], meta_recv, 1, engine.MODE_VERDICT)
    assert torch.equal(results[0], inputs[0])


def test_latch_devices_are_checked():
    with pytest.raises(RuntimeError, match="a latch serves the CPU or a CUDA device, got meta"):
        ops.gather_latch_new(torch.device("meta"))
