"""All-gather along dim 0 over torch.distributed, for plain tensors and pyxfer.formats
QuantizedTensors, with a correct dequantize-then-gather fallback and optional PXH64 verification.

Protocol (every rank runs the same steps, so every rank posts the same collectives):

1. Agreement (a "waiting call"): a fixed-size int64 record per rank (kind, format, dtypes, options,
   usages, shape, NVFP4 amax bits; ``record``) is all-gathered and read by the host before any data is
   sent (on CUDA on a side stream that waits for the caller's stream only when the record holds values
   computed there). Disagreements raise the same ValueError on every rank. The agreed signature picks
   the group's plan (``engine.Plan``, made once per signature: parts, fix-ups, result template, this
   rank's record on the device) and the data collective follows.
2. Fused calls: once the group's agreed signatures repeat with a period of 1 to engine.MAX_PERIOD
   calls (one shape over and over, attention / MLP alternating, a cycle of parameter shapes), every
   rank predicts the next signature; a call whose signature is the predicted one is one native call
   (``torch.ops.pyxfer.gather_run``): one coalesced collective of the data and the record, the records
   compared on the device (verdict to the group's latch; a disagreeing result is marked invalid with
   NaN scales / data), the fix-ups, the NVFP4 renormalisation, with no host read of device data; the
   host reads the previous call's verdict right before launching. A call with another signature posts
   scratch of the predicted layout and its record instead, reads the records and raises (or, when every
   rank changed, agrees right there); its peers raise at their next call. engine.py says exactly when
   each rank raises; ``strict=True`` makes every rank raise in the call itself (one host wait).
3. Path: fixed by the signature: quantized when every shard is quantizable (TE's ``is_quantizable``),
   else fallback (dequantize to the nominal dtype, ``.contiguous()``, gather, requantize only if the
   gathered shape is quantizable). NVFP4 shards quantized with different global amax are gathered
   quantized all the same and renormalised on the device (each shard decoded with its own amax, the
   whole requantized with the largest): the same result as the dequantize-then-gather fallback from
   a quarter of the bytes, and a fallback warning says so.
4. Data: every part gathered (raw bytes for dtypes the backends lack) in one coalesced NCCL group
   (gloo: all parts packed into one byte buffer, one all-gather), straight into the result where the
   rank-major concatenation already is the right layout, into temporaries where a fix-up is needed
   (FP8-block rowwise 1x128 scales, FP8-block columnwise data, 128x128 columnwise scales, NVFP4
   columnwise data and scales). Padded shard scales are trimmed before and zero-padded after, so the
   result is bit-identical (padding included) to quantizing the full tensor in one process.
5. Post-processing (fault injection for tests, verification, fix-ups, requantization, swizzling)
   runs after the data arrived: at once, or in ``handle.wait()`` with ``async_op=True``.
6. A rank that fails after the records of a waiting call agreed (the NVFP4 quantize with the group's
   amax, building or posting its buffers) still posts the agreed data collective, with scratch
   buffers and the failed step's code in its record's status slot, then raises its own error; every
   other rank raises a RuntimeError naming that rank and step once the data arrived. Nobody waits for
   a collective that is never posted.

Modules, in the order a call uses them: ``plan`` (this rank's input, normalised with the
``pyxfer.formats`` vocabulary), ``record`` (the agreement record and status word: pure logic),
``layouts`` (per-format gathered layouts), ``exchange`` (the waiting call's record exchange,
verification, the handle), ``engine`` (plans, the schedule, verdicts, the native calls); this module
runs the steps.

The differences from Transformer Engine's gather (docs/specs/quantized-formats.md §6.6) are deliberate:
contiguous fallbacks, async kept in every path, nothing post-processed before the data arrived,
128x128 gathered quantized, metadata compared across ranks, NVFP4 amax checked, swizzled scales
unswizzled before gathering, requantization only for quantizable gathered shapes.
"""

import traceback

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from .. import formats, testing
from . import engine
from . import plan as _plan
from . import record as rec
from .engine import MODE_ASYNC, MODE_HASHES, MODE_SCRATCH, MODE_VERDICT, GatheredRecords, Pending, Plan
from .errors import OP, GatherVerificationError, QuantizedGatherFallbackWarning, warn_once
from .exchange import GatherHandle, Records, on_device, queue_checks
from .plan import Local, fallback_warning, world_one

__all__ = ["all_gather", "check_gathers", "GatherHandle", "QuantizedGatherFallbackWarning", "GatherVerificationError"]



def _group_info(group):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{OP}: torch.distributed is not initialized (call torch.distributed.init_process_group)")
    if group is None:
        group = dist.group.WORLD
    if isinstance(group, c10d.ProcessGroup):  # a member's group: its own methods (the dist helpers look it up)
        rank, world = group.rank(), group.size()
    else:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise ValueError(f"{OP}: this process is not a member of the given group")
    if engine.in_coalescing(group):
        raise RuntimeError(f"{OP}: cannot run inside torch.distributed._coalescing_manager (it exchanges "
                           "metadata before gathering); call it outside, with async_op=True for overlap")
    return group, rank, world


def _default_device(group):
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and "gloo" not in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather(x, group=None, *, quantize_as=None, async_op: bool = False, verify: bool = False,
               strict: bool = False):
    """Gather ``x`` along dim 0 from every rank of ``group`` (default: the world group).

    ``x``: a tensor of any dtype, at least 1 dim (at most 8), any strides, or a
    pyxfer.formats.QuantizedTensor; on the device the group's backend serves (CUDA for NCCL, CPU for
    gloo). Every rank must pass the same kind, dtype, shape (dim 0 included), format, usages and
    options. Result: the same kind as ``x`` with dim 0 multiplied by the world size W, on x's device;
    a tensor is contiguous. A QuantizedTensor result is bit-identical, scale padding included (zero),
    to quantizing the gathered high-precision tensor in one process; swizzled inputs give a swizzled
    result (they are gathered compact).

    ``quantize_as``: a pyxfer.formats.QuantizeSpec asking for a quantized result from a float32 /
    bfloat16 / float16 tensor (TE's ``quantizer=``): the shard is quantized and gathered quantized
    when it is quantizable (NVFP4 without a given global amax uses the max of the shard amaxes, i.e.
    the full tensor's, so the result equals quantizing the full tensor); otherwise the tensor is
    gathered in its dtype and the result quantized if its shape is quantizable, else returned as is.
    A QuantizedTensor whose format, options or usages do not provide the spec is dequantized and
    requantized locally first (one with more usages only drops them).

    Fallback: when a shard is not quantizable for its format (TE's rule: M and K multiples of the
    block), x is dequantized to its nominal dtype, gathered contiguous, and requantized with the same
    format and options when the gathered shape is quantizable, else returned in high precision.
    NVFP4 shards that carry different global amax give the same result (each shard decoded with its
    own amax, requantized with the max of the shard amaxes), renormalised on the device after a
    quantized gather. A QuantizedGatherFallbackWarning (once per call site and reason) says why
    (for the NVFP4 amax, in a fused call: when the host next reads a verdict).

    ``async_op``: return a GatherHandle at once; its ``wait()`` returns the result. Every step after
    the data collective (verification, fix-ups, requantization) runs in ``wait()``.
    ``verify``: every rank checks the PXH64 of every shard it received from another rank against the
    hash its sender computed before sending (the hashes travel with the data); the host reads them, so
    a verified call also raises a disagreement in the call itself.
    ``strict``: wait (on the host) for this call's agreement verdict and raise a disagreement in this
    call on every rank; without it, a call of a fused group (see below) whose ranks disagree returns a
    result marked invalid on the ranks that called as the group predicted, and they raise at their next
    gather call on the group (or in ``wait()``, or in ``check_gathers(group)``).

    World size 1: no communication; returns x itself (quantized per ``quantize_as`` if asked).
    Mutates nothing it was given. Collectives: until the group's calls repeat a pattern of signatures
    (the same one twice in a row, or a cycle of up to 16, seen twice), a record all-gather waited for,
    then one (coalesced) data gather; after that, one collective per call carries both and the records
    are compared on the device (pyxfer.gather.engine). Raises ValueError on every rank when the ranks
    disagree (the field, its values and the ranks are named) or when a rank's input is invalid or its
    call failed before sending, e.g. out of memory (that rank raises its own error) -- in a fused call
    without ``strict``/``verify``, on the ranks that called as predicted, at their next call (the
    error's note says so); when a rank fails after the ranks agreed, that rank raises its own error
    (with a note naming the step) and every other rank a RuntimeError naming it and the step (from
    ``wait()`` when async); GatherVerificationError (a RuntimeError, on the receiving rank, from
    ``wait()`` when async) for a corrupted shard; RuntimeError when torch.distributed is not
    initialized, the call is inside a ``_coalescing_manager``, or a CUDA graph capture would need a
    host read (anything but a fused synchronous call without verify); TypeError for a non-bool
    ``strict``.
    """
    if not isinstance(strict, bool):
        raise TypeError(f"{OP}: strict must be a bool, got {type(strict).__name__}")
    group, rank, world = _group_info(group)
    if world == 1:
        result = world_one(Local(x, quantize_as, verify, world), x, quantize_as)
        return GatherHandle(lambda: result) if async_op else result
    return gather(x, group, rank, world, quantize_as=quantize_as, async_op=async_op, verify=verify, strict=strict)


def check_gathers(group=None):
    """Raise the error of a disagreement among the ranks in the group's last gathers that this rank has
    not raised yet (pyxfer.gather.engine: a fused call's peers raise it at their next gather call; call
    this after the last gather of a program, or after replaying captured gathers). Waits (on the host)
    for the verdict of the group's last gather, and, if gathers of the group were captured in a CUDA
    graph, synchronizes the device first. Returns None. Raises what that gather's disagreement raises
    (ValueError naming the field and the ranks; RuntimeError for a gather replayed from a CUDA graph
    whose ranks disagreed), RuntimeError when torch.distributed is not initialized."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("pyxfer.check_gathers: torch.distributed is not initialized (call "
                           "torch.distributed.init_process_group)")
    state = engine.existing_state(dist.group.WORLD if group is None else group)
    if state is None:
        return
    state.settle(block=True)
    if state.captured:
        for device in list(state.latches):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            _, words = state.latch(device)
            if words[engine.LATCH_STICKY_BAD]:
                seq = int(words[engine.LATCH_STICKY_BAD_SEQ])
                state.reset()
                state.clear_sticky(device)
                raise RuntimeError(f"{OP}: the ranks disagreed in a gather replayed from a CUDA graph (call {seq} of "
                                   f"this group as captured on rank {state.rank}): its result holds NaN scales / "
                                   "data; every rank must capture the same gathers")
        state.captured = False


# ---- one call ------------------------------------------------------------------------------------

def _fast_key(x, quantize_as, verify):
    """What identifies this input's plan without normalising it (pyxfer.gather.plan.Local), for the
    inputs whose plan depends on nothing else; None for the others (they take the slow path)."""
    t = type(x)
    if t is torch.Tensor or t is torch.nn.Parameter:
        if quantize_as is None:
            return (0, x.dtype, x.shape, x.device, verify)
        if quantize_as.fmt == "nvfp4" and quantize_as.options["global_amax"] is None:
            return None  # its data depend on the records: never fused
        return (2, x.dtype, x.shape, x.device, quantize_as, verify)
    if isinstance(x, formats.QuantizedTensor) and quantize_as is None and not getattr(x, "gemm_swizzled_scales", False):
        return (1, t, x.shape, x.dtype, x.device, x.rowwise_data is not None, x.columnwise_data is not None,
                tuple(x.options.items()), verify)
    return None


def gather(x, group, rank, world, *, quantize_as=None, async_op=False, verify=False, strict=False):
    """The protocol of ``all_gather`` on ``group`` (this process is ``rank`` of ``world``), for any world
    size: all_gather takes a shortcut for one rank, this runs every step (for tests and benchmarks on
    a 1-rank group)."""
    state = engine.state_of(group, rank, world)
    key = None if testing._gather_faults else _fast_key(x, quantize_as, verify)
    if key is not None and state.period is not None:
        plan = state.by_key.get(key)
        if plan is not None and plan is state.predicted() and plan.fusable:
            return _fused(state, plan, x, None, async_op, verify, strict)
    local = Local(x, quantize_as, verify, world, exchange=True)
    # no usable input (it raises after the exchange): the device of the group's earlier calls
    device = local.device or state.device or _default_device(group)
    with on_device(device):
        meta = local.record()
        signature = rec.signature(meta)
        predicted = state.predicted()
        if predicted is not None and predicted.fusable:
            if signature == predicted.signature:
                if key is not None:
                    state.by_key[key] = predicted
                return _fused(state, predicted, None, local, async_op, verify, strict)
            records = _mismatch(state, predicted, meta, local.device_values(), device)
            if records is None:  # not every rank left the schedule: the ranks disagree
                rec.check_agreement(records_of_mismatch(state), local.take_error())
                raise AssertionError(f"{OP}: internal error: the records of a disagreement agree")
        else:
            _refuse_capture(device, "a waiting call (the group's schedule predicts no fused call)")
            state.settle()
            records = Records(meta, local.device_values(), group, world, device)
        return _waiting(state, local, records, signature, rank, world, device, async_op, verify, key)


def _refuse_capture(device, what):
    if engine.is_capturing(device):
        raise RuntimeError(f"{OP}: {what} cannot be captured in a CUDA graph: it reads the device on the host; "
                           "capture a steady-state gather (the same signatures as the calls before the capture, "
                           "synchronous, verify off)")


def records_of_mismatch(state):
    records, state.mismatch_records = state.mismatch_records, None
    return records.read()


def _mismatch(state, predicted, meta, device_values, device):
    """This rank's call of a fused group has another signature than the predicted one (or none: an
    invalid input, a failure before posting): post scratch of the predicted layout with this rank's
    record, so that the collective matches the peers', and read the records. Returns them when every
    rank left the schedule (a new agreement, no error); else None, with the group reset and the records
    kept for the error (records_of_mismatch)."""
    _refuse_capture(device, "a gather whose signature differs from the group's schedule")
    state.settle()  # the previous call's verdict, before anything of this call is posted
    latch, _ = state.latch(device)
    meta_dev = torch.tensor(meta, dtype=torch.int64).to(device)
    if device_values is not None:
        device_values(meta_dev)
    bufs = engine.post(state.group_name, predicted.id, [], meta_dev, [], latch, 0, 0, MODE_SCRATCH)
    records = GatheredRecords(bufs[-1], state.world)
    metas = records.read()  # a host sync: after it, the scratch buffers can go
    del bufs
    if all(rec.signature(m) != predicted.signature for m in metas):
        state.period = None  # every rank left the schedule: they agree again from these records
        return records
    state.reset()
    state.mismatch_records = records
    return None


def _inputs_fast(plan, x):
    """(inputs, amax, q) of a fused call from the raw input (the _fast_key cases)."""
    if plan.kind == rec.KIND_QUANTIZED:
        if plan.path == "fallback":
            return [x.dequantize()], [], None
        return [getattr(x, n) for n in plan.names], plan._amax(x), None
    x = x.detach() if x.requires_grad else x
    if plan.kind == rec.KIND_TO_QUANTIZE and plan.path == "quantized":
        q = plan.spec.quantize(x)
        return [getattr(q, n) for n in plan.names], [], q
    return [x], [], None


def _fused(state, plan, x, local, async_op, verify, strict):
    """A call whose signature is the predicted one: data and record in one native call."""
    if local is not None:
        inputs, amax = plan.inputs_of(local)
        q = local.q
    else:
        inputs, amax, q = _inputs_fast(plan, x)
    device = inputs[0].device
    if plan.warning is not None:
        warn_once(*plan.warning)
    capturing = engine.is_capturing(device)
    faults = bool(testing._gather_faults)
    if capturing and (async_op or verify or faults):
        raise RuntimeError(f"{OP}: only a synchronous gather without verify can be captured in a CUDA graph")
    seq = state.seq + 1
    pending = state.pending
    wait_seq = pending.seq if pending is not None else 0
    latch, _ = state.latch(device)
    mode = MODE_VERDICT | (MODE_HASHES if verify else 0)
    split = async_op or verify or faults
    cuda_async = MODE_ASYNC if async_op and device.type == "cuda" else 0
    try:
        if split:
            outs = engine.post(state.group_name, plan.id, inputs, plan.meta(device), amax, latch, seq, wait_seq,
                               mode | cuda_async)
        else:
            outs = engine.run(state.group_name, plan.id, inputs, plan.meta(device), amax, latch, seq, wait_seq, mode)
    except Exception as e:  # every step that can fail precedes the launch: nothing was posted
        traceback.clear_frames(e.__traceback__)
        del inputs, amax, q
        return _failed_before_posting(state, plan, e, device)  # (raises)
    if not outs:  # the previous call's verdict: its ranks disagreed; nothing of this call was posted
        raise state.detected(pending)
    state.seq = seq
    state.advance()
    state.device = device
    if pending is not None and (state.verdict(pending.seq, device, False) or 0) & engine.VERDICT_RENORM:
        engine.warn_renormalised(pending.plan)
    meta_recv = outs[-1]
    if capturing:
        state.captured = True
        state.pending = None  # a captured call runs at replays: check_gathers reads its verdict
    else:
        state.pending = Pending(seq, meta_recv, plan)
    results = outs[:plan.num_results]
    if not split:
        result = plan.build(results, q)
        if strict:
            state.settle(block=True)
        return result
    temps = outs[plan.num_results:-1]
    del outs
    rank, world = state.rank, state.world

    def finish():
        if cuda_async:  # the reads of the received bytes below (faults, hashes) follow the data
            engine.join(meta_recv, seq)
        received = engine.received(plan, results, temps)
        if faults:
            testing._corrupt_gathered(rank, world, [(r.name, r.region, r.nbytes) for r in received])
        check_hashes = queue_checks(received, rank, world) if verify else None
        engine.finish(plan.id, results, temps, meta_recv, seq, mode | cuda_async)
        _settle_call(state, seq, block=strict or verify)
        if verify:
            metas = GatheredRecords(meta_recv, world).read()
            check_hashes(lambda r: metas[r][rec.F_HASH:rec.F_HASH + len(plan.layout)])
        return plan.build(results, q)

    if async_op:
        return GatherHandle(finish, lambda: state.verdict(seq, device, False) is not None)
    return finish()


def _settle_call(state, seq, block):
    """Raise the disagreement of fused call ``seq`` if this rank can know it: already found (by a later
    call or check_gathers), or its verdict is there (``block``: wait for it)."""
    error = state.failure_of(seq)
    if error is not None:
        raise error
    pending = state.pending
    if pending is not None and pending.seq == seq:
        state.settle(block=block)


def _failed_before_posting(state, plan, error, device):
    """A fused call failed on this rank before posting (e.g. out of memory): post scratch of the
    predicted layout with an error record, so that nobody waits, then raise this rank's error (its
    peers raise at their next call: their result names this rank)."""
    try:
        records = _mismatch(state, plan, rec.encode(error=True), None, device)
        if records is not None:  # every rank left the schedule: they all read the same records
            rec.check_agreement(records.read(), error)
        else:
            state.mismatch_records = None
        raise error
    finally:
        error = None  # this frame, on the error's traceback, must not hold it (a reference cycle)


def _waiting(state, local, records, signature, rank, world, device, async_op, verify, key):
    """A call that read the records before its data collective: returns the result (or handle). A failure
    after the records agreed posts the agreed collective all the same (scratch buffers, the step's code
    in the record's status slot) and raises this rank's error."""
    step, failure, agreed_on_call, plan, inputs, amax = rec.STEP_BUILD, None, False, None, None, None
    try:
        metas = records.read()
        rec.check_agreement(metas, local.take_error())
        agreed_on_call = True
        plan = state.plans.get(signature)
        if plan is None:
            plan = state.plans[signature] = Plan(local, signature, local.record(), world, rank,
                                                 warning=fallback_warning(local, world))
        if plan.path == "quantized" and local.q is None:  # quantize_as NVFP4 with the group's amax
            step = rec.STEP_NVFP4_QUANTIZE
            _plan.quantize_with_group_amax(local, records)
        step = rec.STEP_BUILD
        inputs, amax = plan.inputs_of(local)
    except Exception as e:
        if agreed_on_call:  # the records agreed: the peers post the data collective, so this rank does too
            failure = e
        else:
            raise
    finally:
        records.release()
    state.agree(signature)  # the records agreed on every rank: the same state everywhere
    state.device = device
    if plan is not None and plan.warning is not None:
        warn_once(*plan.warning)
    latch, _ = state.latch(device)
    seq = state.seq + 1
    mode = MODE_VERDICT | (MODE_HASHES if verify else 0)
    cuda_async = MODE_ASYNC if async_op and device.type == "cuda" else 0
    if failure is None:
        try:
            outs = engine.post(state.group_name, plan.id, inputs, plan.meta(device), amax, latch, seq, 0,
                                    mode | cuda_async)
        except Exception as e:  # nothing was posted (every step that can fail precedes the launch)
            failure, step = e, rec.STEP_BUILD
    if failure is not None:
        _post_failure(state, plan, local, failure, step, device)
    state.seq = seq
    if key is not None:
        state.by_key[key] = plan
    results, temps, meta_recv = outs[:plan.num_results], outs[plan.num_results:-1], outs[-1]
    del outs, inputs
    q = local.q

    def finish():
        # Everything the result needs is queued before the host reads the records (statuses, hashes).
        if cuda_async:  # the reads of the received bytes below (faults, hashes) follow the data
            engine.join(meta_recv, seq)
        received = engine.received(plan, results, temps)
        if testing._gather_faults:
            testing._corrupt_gathered(rank, world, [(r.name, r.region, r.nbytes) for r in received])
        check_hashes = queue_checks(received, rank, world) if verify else None
        engine.finish(plan.id, results, temps, meta_recv, seq, mode | cuda_async)
        metas = GatheredRecords(meta_recv, world).read()
        rec.check_statuses([m[rec.F_STATUS] for m in metas], rank)
        if verify:
            check_hashes(lambda r: metas[r][rec.F_HASH:rec.F_HASH + len(plan.layout)])
        if plan.renormalised(metas):
            row = plan.spec.rowwise
            amaxes = ", ".join(f"rank {r}: {a!r}" for r, a in enumerate(rec.amaxes(metas, rec.F_AMAX_ROW if row
                                                                                      else rec.F_AMAX_COL)))
            dtype = str(plan.dtype).removeprefix("torch.")
            warn_once(f"{OP} gathered NVFP4 shards that were quantized with different global amax ({amaxes}), so "
                      "they cannot share one global scale (quantize with the group's all-reduced amax): each shard "
                      f"was decoded to {dtype} with its own amax and the result requantized as nvfp4, as the "
                      "dequantize-then-gather fallback would.", ("nvfp4", "amax", True))
        return plan.build(results, q)

    if async_op:
        return GatherHandle(finish, lambda: state.verdict(seq, device, False) is not None)
    # NOTE: no handle in the synchronous path: an error kept by a handle would hold the call (its
    # buffers) in a reference cycle through the error's traceback.
    return finish()


def _post_failure(state, plan, local, failure, step, device):
    """After the records agreed this rank could not post its data: post scratch of the agreed layout
    with the step's code in the record's status slot (so that no rank waits), then raise its error."""
    # Release the failed attempt's buffers (its frames hold them), then post the scratch.
    traceback.clear_frames(failure.__traceback__)
    local.q = local.x = None
    if plan is None:  # (the plan is made from the agreed signature; only a bug fails before it)
        plan = Plan(local, rec.signature(local.record()), local.record(), state.world, state.rank)
    meta = torch.tensor(plan.record, dtype=torch.int64)
    meta[rec.F_STATUS] = step
    latch, _ = state.latch(device)
    bufs = engine.post(state.group_name, plan.id, [], meta.to(device), [], latch, 0, 0, MODE_SCRATCH)
    bufs[-1].tolist()  # the scratch stays ours until the data moved
    del bufs
    failure.add_note(f"{OP}: rank {state.rank} failed while {rec.step_name(step)}, after the ranks agreed on the "
                     "call; it posted scratch buffers so that no rank waits, and the others raise a "
                     "RuntimeError naming this rank")
    try:
        raise failure
    finally:  # this frame, on the error's traceback, must not hold it (a reference cycle)
        failure = None
