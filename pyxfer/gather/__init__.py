"""All-gather along dim 0 over torch.distributed, for plain tensors and pyxfer.formats
QuantizedTensors, with a correct dequantize-then-gather fallback and optional PXH64 verification.

Protocol of one call (every rank runs the same steps, so every rank takes the same path):

1. Metadata: a fixed-size int64 record per rank (kind, format, dtypes, options, usages, shape,
   NVFP4 amax bits, and with ``verify`` the PXH64 of every buffer the rank will send; ``record``), all-gathered
   on the data's device (NCCL needs device memory) and read back once by the host. Disagreements
   raise the same ValueError on every rank.
   - Waiting calls: the records are gathered alone and read before any data is sent (on CUDA on a
     side stream that waits for the caller's stream only when the record holds values computed
     there, so the host's wait does not include unrelated queued work).
   - Fused mode: once a group's last two waiting calls agreed on the same signature (the fields
     every rank must agree on), every call of the group posts one collective, its data buffers and
     its record, and checks the records after the data arrived: the host never waits before the data
     moves and async calls return at once. A rank whose call has another signature posts scratch
     buffers of the agreed layout instead and reads the records at once; if every rank did so the
     call goes on as a waiting call, else every rank raises the same error (the ranks that posted
     data from ``wait()``). The mode changes only in waiting calls, so it is the same on every rank.
2. Path: fixed by the signature: quantized when every shard is quantizable (TE's ``is_quantizable``),
   else fallback (dequantize to the nominal dtype, ``.contiguous()``, gather, requantize only if the
   gathered shape is quantizable). NVFP4 shards quantized with different global amax (known from the
   records, after the data arrived) are gathered quantized all the same and then decoded shard by
   shard with their own amax and requantized: the same result as the dequantize-then-gather fallback
   from a quarter of the bytes, and the fallback warning says so.
3. Data: every buffer gathered (raw bytes for dtypes the backends lack) in one coalesced NCCL group
   (gloo: all buffers packed into one byte buffer, one all-gather), straight into the result where
   the rank-major concatenation already is the right layout, into temporaries where a fix-up is
   needed (FP8-block rowwise 1x128 scales, FP8-block columnwise data, 128x128 columnwise scales,
   NVFP4 columnwise data and scales). Padded shard scales are trimmed before and zero-padded after,
   so the result is bit-identical (padding included) to quantizing the full tensor in one process.
4. Post-processing (fault injection for tests, verification, fix-ups, requantization, swizzling)
   runs after the data arrived: at once, or in ``handle.wait()`` with ``async_op=True``.
5. A rank that fails after the records agreed (building its buffers, the NVFP4 quantize with the
   group's amax, hashing, an allocation) still posts the agreed data collective, with scratch
   buffers and the failed step's code in the status word that travels with a waiting call's data,
   then raises its own error; every other rank raises a RuntimeError naming that rank and step
   once the data arrived. Nobody waits for a collective that is never posted.

Modules, in the order a call uses them: ``plan`` (this rank's input, normalised with the
``pyxfer.formats`` vocabulary, and the path), ``record`` (the agreement record and status word:
pure logic), ``layouts`` (per-format gathered layouts and fix-ups), ``exchange`` (collectives,
streams, buffer lifetimes, fused-mode state, the handle); this module runs the steps.

The differences from Transformer Engine's gather (docs/specs/quantized-formats.md §6.6) are deliberate:
contiguous fallbacks, async kept in every path, nothing post-processed before the data arrived,
128x128 gathered quantized, metadata compared across ranks, NVFP4 amax checked, swizzled scales
unswizzled before gathering, requantization only for quantizable gathered shapes.
"""

import traceback
import weakref

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from .. import testing
from . import record as rec
from .errors import OP, GatherVerificationError, QuantizedGatherFallbackWarning, warn_once
from .exchange import Agreed, GatherHandle, Records, complete, launch, on_device, queue_checks, status_part
from .layouts import hash_all, layout_of, scratch_parts
from .plan import Local, decide, world_one

__all__ = ["all_gather", "GatherHandle", "QuantizedGatherFallbackWarning", "GatherVerificationError"]


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
    if group in c10d._world.pg_coalesce_state:
        raise RuntimeError(f"{OP}: cannot run inside torch.distributed._coalescing_manager (it exchanges "
                           "metadata before gathering); call it outside, with async_op=True for overlap")
    return group, rank, world


def _default_device(group):
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and "gloo" not in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_agreed_by_group = weakref.WeakKeyDictionary()


def _agreed(group) -> Agreed:
    state = _agreed_by_group.get(group)
    if state is None:
        state = _agreed_by_group[group] = Agreed()
    return state


def all_gather(x, group=None, *, quantize_as=None, async_op: bool = False, verify: bool = False):
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
    own amax, requantized with the max of the shard amaxes), decoded after a quantized gather. A
    QuantizedGatherFallbackWarning (once per call site and reason) says why.

    ``async_op``: return a GatherHandle at once; its ``wait()`` returns the result. Every step after
    the data collective (verification, fix-ups, requantization) runs in ``wait()``.
    ``verify``: every rank checks the PXH64 of every shard it received from another rank against the
    hash its sender computed before sending (the hashes travel in the metadata exchange).

    World size 1: no communication; returns x itself (quantized per ``quantize_as`` if asked).
    Mutates nothing it was given. Collectives: a metadata all-gather, waited for, then one
    (coalesced) data gather; once the group's last two such calls agreed on the signature (kind,
    dtype, shape, format, usages, options, verify), one collective per call carries both and the
    metadata is checked after the data arrived (a call that then changes the signature costs one
    extra gather of the previous layout). Raises ValueError on every rank when the ranks disagree
    (the field, its values and the ranks are named) or when a rank's input is invalid or its call
    failed before sending, e.g. out of memory (that rank raises its own error); when a rank fails
    after the ranks agreed, that rank raises its own error (with a note naming the step) and every
    other rank a RuntimeError naming it and the step (from ``wait()`` when async);
    GatherVerificationError (a RuntimeError, on the receiving rank, from ``wait()`` when async) for a
    corrupted shard; RuntimeError when torch.distributed is not initialized or the call is inside a
    ``_coalescing_manager``.
    """
    group, rank, world = _group_info(group)
    if world == 1:
        result = world_one(Local(x, quantize_as, verify, world), x, quantize_as)
        return GatherHandle([], lambda: result, None) if async_op else result
    return gather(x, group, rank, world, quantize_as=quantize_as, async_op=async_op, verify=verify)


def gather(x, group, rank, world, *, quantize_as=None, async_op=False, verify=False):
    """The protocol of ``all_gather`` on ``group`` (this process is ``rank`` of ``world``), for any world
    size: all_gather takes a shortcut for one rank, this runs every step (for tests and benchmarks on
    a 1-rank group)."""
    local, agreed = Local(x, quantize_as, verify, world, exchange=True), _agreed(group)
    # no usable input (it raises after the exchange): the device of the group's earlier calls
    device = local.device or agreed.device or _default_device(group)
    with on_device(device):
        meta = local.record()
        signature = rec.signature(meta)
        fast = agreed.fused() and signature == agreed.signature
        if fast:  # data and record in one collective; the records are checked after the data arrived
            try:
                plan = decide(local, None, world)  # the signature fixes the plan, and it needs no record
                if layout_of(plan.parts) != agreed.layout:  # before posting: never a collective of other sizes
                    raise RuntimeError(f"{OP}: internal error: parts {layout_of(plan.parts)} differ from the "
                                       f"agreed layout {agreed.layout}")
            except Exception as e:  # e.g. out of memory for the result. The other ranks post the agreed
                # collective: post it too, with scratch buffers and an error record (below), so that they raise.
                # The failed attempt's buffers go first (its frames and ours hold them), then the scratch.
                traceback.clear_frames(e.__traceback__)
                plan = local.parts = local.q = None
                local.error, fast = e, False
                meta, signature = local.record(), None
        if fast:
            data_parts = plan.parts
            records = Records(meta, local.device_values(), group, world, device, agreed, data_parts, cached=True)
            works, status = records.works, None
        else:
            records = Records(meta, local.device_values(), group, world, device, agreed,
                              scratch_parts(agreed.layout, world, device) if agreed.fused() else None)
            plan, data_parts, status, works = _waiting_call(local, records, agreed, signature, group, rank, world,
                                                            device, verify)
    if plan.warning is not None:
        warn_once(*plan.warning)

    def read_records():
        metas = records.read()
        if fast:  # a rank that disagrees posted scratch buffers of the same layout, so the data has arrived
            records.release()
            rec.check_agreement(metas)
        return metas

    def read_statuses():  # a waiting call: [status, hashes...] of every rank (status 0: it sent its data)
        rows = status.recv.view(world, -1).tolist()
        rec.check_statuses([row[0] for row in rows], rank)
        return rows

    def finish():
        # Everything the result needs is queued before the host waits for the records (in fused mode
        # they arrive with the data): the host's wait is the call's last step.
        try:
            if testing._gather_faults:
                testing._corrupt_gathered(rank, world, [(p.name, p.region, p.nbytes) for p in data_parts])
            check_hashes = queue_checks(data_parts, rank, world) if verify else None
            finals = [p.finish() for p in data_parts]
            result = plan.build(finals)
        except Exception:
            # the ranks' disagreement or a peer's failure, if any, explains more (and the fused
            # record buffers are read before the set is reused)
            if fast:
                read_records()
            else:
                read_statuses()
            raise
        metas = read_records()
        rows = None if fast else read_statuses()
        if verify:
            if local.hashes_in_record:
                check_hashes(lambda r: metas[r][rec.F_HASH:rec.F_HASH + len(data_parts)])
            else:
                check_hashes(lambda r: rows[r][1:])
        if plan.rebuild is not None:
            result = plan.rebuild(finals, metas, result)
        return result

    if async_op:
        return GatherHandle(works, finish, device)
    # NOTE: no handle in the synchronous path: an error kept by a handle would hold the call (its
    # buffers, gloo's Work objects) in a reference cycle through the error's traceback.
    return complete(works, finish, device)


def _waiting_call(local, records, agreed, signature, group, rank, world, device, verify):
    """The data collective of a call that reads the records first: returns (plan, data parts, status
    part, works). A failure after the records agreed posts the agreed collective all the same (scratch
    buffers, the step's code in the status word) and raises this rank's error."""
    step, failure, agreed_on_call = rec.STEP_BUILD, None, False
    try:
        if local.error is None:
            try:
                local.build_parts(world)  # allocations overlap the exchange
            except Exception as e:  # reported after the records agreed (or not)
                failure = e
        rec.check_agreement(records.read(), local.take_error())
        agreed_on_call = True
        if failure is not None:
            raise failure

        def on_step(code):
            nonlocal step
            step = code
        plan = decide(local, records, world, on_step)
        hashes = None
        if verify and not local.hashes_in_record:  # sent bytes made after the exchange: hashes ride with the data
            step = rec.STEP_HASH
            hashes = hash_all(plan.parts)
        step = rec.STEP_ALLOCATE
        status = status_part(0, hashes, len(plan.parts) if hashes is not None else 0, world, device)
    except Exception as e:
        if agreed_on_call:  # the records agreed: the peers post the data collective, so this rank does too
            failure = e
        else:
            raise
    finally:
        records.release()
    if failure is None:
        agreed.agree(signature, layout_of(plan.parts), device)
        return plan, plan.parts, status, launch(plan.parts + [status], group, world)
    # Release the failed attempt's buffers (its frames hold them), then post scratch and the status.
    traceback.clear_frames(failure.__traceback__)
    local.parts = local.q = plan = None
    layout = local.send_layout(world)
    agreed.agree(signature, layout, device)  # the records agreed on every rank: the same state everywhere
    parts = scratch_parts(layout, world, device)
    parts.append(status_part(step, None, len(layout) if verify and not local.hashes_in_record else 0,
                             world, device))
    complete(launch(parts, group, world), lambda: None, device)  # the scratch stays ours until the data moved
    del parts
    failure.add_note(f"{OP}: rank {rank} failed while {rec.step_name(step)}, after the ranks agreed on the "
                     "call; it posted scratch buffers so that no rank waits, and the others raise a "
                     "RuntimeError naming this rank")
    try:
        raise failure
    finally:  # this frame, on the error's traceback, must not hold it (a reference cycle)
        failure = None
