"""The engine: a group's plans and schedule, the native calls, and the protocol that keeps every rank
posting the same collectives without a host sync in the steady state.

Plans. A plan is the gather of one agreed signature on one group (pyxfer.gather.record: the record's
agreed slots): its parts (what each rank sends, from which input buffer, how the gathered bytes become
the result), registered once with the native side (``torch.ops.pyxfer.gather_plan_new``), with this
rank's record kept on the device as the template of the record that travels with the data.

Schedule. Every rank keeps the same history of the group's agreed signatures (appended by calls whose
outcome every rank knows: a waiting call that agreed, a fused call as predicted). When its tail repeats
with a period p (1 <= p <= MAX_PERIOD: the same signature over and over, attention / MLP alternating,
a cycle of FSDP parameter shapes), the group is fused: the next signature is predicted (history[-p]),
and a call whose signature is the predicted one posts its data and its record in one native call
(gather_run: one coalesced collective, the verdict on the device, no host read).

Verdicts. Each fused call's records are compared on the device after the data arrived; the verdict
goes to the group's latch (host memory the device writes) and, on a disagreement, the result is
marked invalid (NaN scales, NaN data where the dtype has a NaN; NVFP4 amax NaN). The host reads the
verdict of call N before it posts anything of call N+1 (inside the native call, right before the
launch, so the device waits at most the launch's own host time). This "depth 1" is the choice that
keeps the issue's wording (a peer raises at its next call) and the simplest interleavings; depth 2
(check N before posting N+2) would hide the launch from the device too, at the price of a second
invalid result, a later error and one more scratch collective on the rank that disagreed. The host
thus stays at most one gather ahead of the device on each group: in back-to-back use the device
waits for one launch per call. What a deeper pipeline would buy is measured by benchmarks/gather.py
(piped mode).

When each rank raises, for a call N of a fused group where rank R's signature differs from the
predicted one (another shape, dtype, format, options, verify; an invalid input; a failure before
posting, e.g. out of memory):
- rank R knows at once: it posts scratch buffers of the predicted layout with its own record (so no
  collective overruns or hangs), reads the gathered records (a host sync on this path only) and
  raises in call N, naming the ranks and what differs (record.check_agreement);
- every other rank's call N returns a result marked invalid; it raises the same error at its next
  pyxfer gather call on that group (before posting anything), or in ``wait()`` of call N's handle if
  the verdict is already there when wait() runs, or in ``check_gathers(group)`` (which waits for it),
  whichever comes first;
- ``strict=True`` waits for the call's own verdict (one host wait) and raises in the same call on
  every rank, as a waiting call does;
- if every rank's signature differs from the prediction, every rank read the same records: no error,
  they agree on the new signature right there (the scratch exchange served as the agreement) and the
  call goes on as a waiting call.
Every detection resets the group (history and prediction forgotten) before the rank posts again, so
every rank's next collective is a waiting call's record exchange: a rank that raised at call N and a
rank that raised at call N+1 meet in their next calls. (A rank's calls are then counted one apart:
the call that raised the deferred error gathered nothing of its own.)

Async, graphs. ``async_op=True`` posts beside the caller's stream (NCCL's own stream; the verdict on a
side stream right after the collective) and queues the rest (fix-ups, the invalid marking, NVFP4
renormalisation, the result's wrapping) in ``wait()``. A fused synchronous gather can be captured in a
CUDA graph (verify off): its verdicts then go to the latch's graph slot and its sticky words, which
``check_gathers(group)`` reads after synchronizing the device. A capture of any other call (a waiting
call, a mismatch: they read the device on the host) raises.

NOTE (lifetimes): no Work object is kept (the native side drops each one once waited for, or at once
for a collective on the caller's stream); nothing here holds a stream, a thread or a process group
(the native calls find the group by its name in torch's group registry).
"""
import math
import time
import weakref

import torch
from torch.distributed import distributed_c10d as c10d

from .. import formats
from . import layouts
from . import record as rec
from .errors import OP

MAX_PERIOD = 16
HISTORY = 2 * MAX_PERIOD

# gather_post / gather_run modes (csrc/gather/gather.h)
MODE_ASYNC, MODE_SCRATCH, MODE_VERDICT, MODE_HASHES = 1, 2, 4, 8
# latch layout (csrc/include/pyxfer/gather.h)
LATCH_STICKY_BAD, LATCH_STICKY_BAD_SEQ, LATCH_STICKY_RENORM = 0, 1, 2
LATCH_GRAPH_SLOT, LATCH_RING, LATCH_RING_SLOTS = 6, 8, 56
VERDICT_BAD, VERDICT_RENORM, SLOT_SHIFT = 1, 2, 4
# plan descriptor (csrc/gather/gather.h)
PLAN_VERSION, HEADER_WORDS, PART_WORDS, MAX_DIMS = 1, 20, 30, 8
FIXUP = {"direct": 0, "prefix": 1, "swap": 2}

_ops = torch.ops.pyxfer
# The native calls (module attributes, so that tests can make one fail; the overloads themselves, which
# skip the packet's overload resolution).
post = _ops.gather_post.default
run = _ops.gather_run.default
finish = _ops.gather_finish.default
join = _ops.gather_join.default


def find_period(history):
    """The smallest p <= MAX_PERIOD such that the last 2p signatures repeat with period p, else None."""
    n = len(history)
    for p in range(1, MAX_PERIOD + 1):
        if n < 2 * p:
            return None
        if all(history[n - i] == history[n - i - p] for i in range(1, p + 1)):
            return p
    return None


# ---- poison patterns: a NaN of each dtype (width in bytes, pattern) ---------------------------------
_NAN = {torch.float32: (4, 0x7FC00000), torch.complex64: (4, 0x7FC00000), torch.float64: (8, 0x7FF8000000000000),
        torch.complex128: (8, 0x7FF8000000000000), torch.bfloat16: (2, 0x7FC0), torch.float16: (2, 0x7E00),
        torch.float8_e4m3fn: (1, 0x7F), torch.float8_e5m2: (1, 0x7F)}
for _name, _pat in (("float8_e4m3fnuz", (1, 0x80)), ("float8_e5m2fnuz", (1, 0x80)), ("float8_e8m0fnu", (1, 0xFF))):
    if hasattr(torch, _name):
        _NAN[getattr(torch, _name)] = _pat
_SCALE_NAN = {"mxfp8": (1, 0xFF), "nvfp4": (1, 0x7F), "fp8_block_1x128": (4, 0x7FC00000),
              "fp8_block_128x128": (4, 0x7FC00000)}
_NOMINAL = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _dtype_code(dtype) -> int:
    # c10::ScalarType of a torch dtype (the descriptor names dtypes by it)
    return _SCALAR_TYPE[dtype]


_SCALAR_TYPE = {}
for _i, _d in enumerate([torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32,
                         torch.float64, None, torch.complex64, torch.complex128, torch.bool, None, None, None,
                         torch.bfloat16]):
    if _d is not None:
        _SCALAR_TYPE[_d] = _i


_plans = weakref.WeakValueDictionary()  # native id -> Plan (the ops' fakes read the layouts here)


def plan_by_id(plan_id):
    return _plans[plan_id]


class Plan:
    """The gather of one agreed signature on one group, as this rank runs it.

    ``path``: "plain" (a plain tensor), "fallback" (the shard in its nominal dtype, requantized after if
    the gathered shape is quantizable) or "quantized" (the format's buffers; ``gathered``: their
    layouts.Gathered). ``inputs(local_or_x)``: the tensors the parts are cut from. ``build(outs, ...)``:
    the result from the native call's outputs. ``fusable``: whether the call can run fused (its data
    do not depend on the records: not quantize_as NVFP4 with the group's amax)."""

    def __init__(self, local, signature, meta, world, rank, warning=None):
        self.signature, self.record, self.world, self.rank = signature, list(meta), world, rank
        self.kind, self.spec, self.dtype, self.shape = local.kind, local.spec, local.dtype, tuple(local.shape)
        self.out_swizzled = local.out_swizzled
        self.out_shape = (world * self.shape[0],) + self.shape[1:]
        self.warning = warning
        self.compare_len = rec.AGREE_LEN + (1 if rec.gives_nvfp4_amax(meta) else 0)
        if self.kind == rec.KIND_PLAIN:
            self.path = "plain"
        elif layouts.quantizable(self.spec, self.shape):
            self.path = "quantized"
        else:
            self.path = "fallback"
        # quantize_as NVFP4 with the group's amax quantizes with the records' amax: such calls wait for them
        self.fusable = not (self.path == "quantized" and rec.amax_from_records(meta))
        self.nvfp4 = self.path == "quantized" and self.kind == rec.KIND_QUANTIZED and self.spec.fmt == "nvfp4"
        self.out_quantizable = self.path != "plain" and layouts.quantizable(self.spec, self.out_shape)
        self.gathered = layouts.quantized_layout(self.spec, self.shape, world) if self.path == "quantized" else ()
        self.names = tuple(g.name for g in self.gathered)
        self.layout = self._layout()
        self.num_results = (len(self.gathered) or 1) + (2 if self.nvfp4 else 0)  # gather_post's outputs: results,
        self.num_temps = sum(g.fixup == "swap" for g in self.gathered)          # temporaries, the records
        self.id = _ops.gather_plan_new(self._descriptor())
        self._finalizer = weakref.finalize(self, _ops.gather_plan_free, self.id)
        _plans[self.id] = self
        self._meta = {}       # device -> this rank's record (host part) on it
        self._template = {}   # device -> a result wrapper without buffers (quantized)

    def _layout(self):
        if self.path != "quantized":
            numel = math.prod(self.shape)
            if self.dtype in layouts.NATIVE:
                return ((self.dtype, numel),)
            return ((torch.uint8, numel * self.dtype.itemsize),)
        return tuple((g.dtype, math.prod(g.send_shape)) for g in self.gathered)

    def _descriptor(self) -> list:
        header = [0] * HEADER_WORDS
        parts = []
        header[:7] = [PLAN_VERSION, self.world, self.rank, rec.RECORD_LEN, self.compare_len, rec.F_HASH, 0]
        if self.path != "quantized":
            # dtypes the backends lack travel as bytes, into a byte result viewed as the dtype after
            as_bytes = self.dtype not in layouts.NATIVE
            nan = _NAN.get(self.dtype, (0, 0))
            if as_bytes:  # (shapes in bytes)
                nbytes = math.prod(self.shape) * self.dtype.itemsize
                send_dtype, send_shape, out_shape = torch.uint8, (nbytes,), (self.world * nbytes,)
            else:
                send_dtype, send_shape, out_shape = self.dtype, self.shape, self.out_shape
            parts.append(self._part(0, send_dtype, as_bytes, None, send_shape, "direct", send_dtype, out_shape, None,
                                    nan))
        else:
            for i, g in enumerate(self.gathered):
                nan = _SCALE_NAN[self.spec.fmt] if g.name.endswith("scale_inv") else (0, 0)
                out_shape = g.out_shape if g.out_shape is not None else ()
                parts.append(self._part(i, g.dtype, False, g.trim, g.send_shape, g.fixup, g.dtype, out_shape,
                                        g.pad_shape, nan))
        header[6] = len(parts)
        if self.nvfp4:
            index = {n: i for i, n in enumerate(self.names)}
            m = math.prod(self.shape[:-1])
            header[7:19] = [1, m, self.shape[-1], _NOMINAL[self.dtype], int(self.spec.rowwise),
                            int(self.spec.columnwise), rec.F_AMAX_ROW, rec.F_AMAX_COL,
                            index.get("rowwise_data", -1), index.get("rowwise_scale_inv", -1),
                            index.get("columnwise_data", -1), index.get("columnwise_scale_inv", -1)]
        return header + [w for p in parts for w in p]

    @staticmethod
    def _part(src, send_dtype, as_bytes, trim, send_shape, fixup, out_dtype, out_shape, pad_shape, nan):
        words = [0] * PART_WORDS
        rows, cols = trim if trim is not None else (-1, -1)
        pad_rows, pad_cols = pad_shape if pad_shape is not None else (-1, -1)
        words[0:6] = [src, _dtype_code(send_dtype), int(as_bytes), rows, cols, len(send_shape)]
        words[6:6 + len(send_shape)] = send_shape
        words[14:17] = [FIXUP[fixup], _dtype_code(out_dtype), len(out_shape)]
        words[17:17 + len(out_shape)] = out_shape
        words[25:29] = [pad_rows, pad_cols, nan[0], nan[1]]
        return words

    def meta(self, device) -> torch.Tensor:
        """This rank's record (host part) on ``device``, made once (only read after that)."""
        t = self._meta.get(device)
        if t is None:
            t = self._meta[device] = torch.tensor(self.record, dtype=torch.int64).to(device)
        return t

    # ---- what a call sends and what it returns ----------------------------------------------
    def inputs_of(self, local):
        """(inputs, amax) of the native call for a prepared Local."""
        if self.path != "quantized":
            return [local.x], []
        q = local.q
        return [getattr(q, n) for n in self.names], self._amax(q)

    def _amax(self, q):
        if not self.nvfp4:
            return []
        row = q.amax_rowwise if self.spec.rowwise else None
        col = q.amax_columnwise if self.spec.columnwise else None
        return [row if row is not None else col, col if col is not None else row]

    def build(self, outs, q=None):
        """The result from the completed results (``q``: the shard a quantize_as call quantized)."""
        if self.path == "plain":
            return self.plain_result(outs[0])
        if self.path == "fallback":
            hp = outs[0]
            if not self.out_quantizable:
                return hp
            out = self.spec.quantize(hp)
            return out.with_swizzled_scales() if self.out_swizzled else out
        bufs = dict(zip(self.names, outs))
        if self.spec.fmt == "nvfp4":
            if self.nvfp4:  # the group's amax, from the records (NaN when the ranks disagreed)
                row, col = outs[len(self.names)], outs[len(self.names) + 1]
            else:  # quantize_as: every rank quantized with the same amax
                row, col = q.amax_rowwise, q.amax_columnwise
                row, col = (row.clone() if row is not None else None), (col.clone() if col is not None else None)
            bufs.update(amax_rowwise=row if self.spec.rowwise else None,
                        amax_columnwise=col if self.spec.columnwise else None)
        device = outs[0].device
        like = self._template.get(device)
        out = formats.tensor_from_buffers(self.spec, self.out_shape, self.dtype, bufs, like=like)
        if like is None:
            self._template[device] = formats.tensor_from_buffers(self.spec, self.out_shape, self.dtype, {}, like=out)
        return out.with_swizzled_scales() if self.out_swizzled else out

    def fake_outputs(self, like, temps):
        """Empty tensors like gather_post's (``temps``) / gather_run's outputs but the records (the fakes)."""
        results, swaps = [], []
        if self.path != "quantized":
            (dtype, numel), = self.layout
            results.append(like.new_empty((self.world * numel,) if dtype != self.dtype else self.out_shape,
                                          dtype=dtype))
        for g in self.gathered:
            results.append(like.new_empty(g.out_shape if g.pad_shape is None else g.pad_shape, dtype=g.dtype))
            if g.fixup == "swap":
                swaps.append(like.new_empty((self.world * math.prod(g.send_shape),), dtype=g.dtype))
        if self.nvfp4:
            results += [like.new_empty((1,), dtype=torch.float32), like.new_empty((1,), dtype=torch.float32)]
        return results + (swaps if temps else [])

    def plain_result(self, out):
        return out if out.dtype == self.dtype else out.view(self.dtype).view(self.out_shape)

    def renormalised(self, metas) -> bool:
        """NVFP4 QuantizedTensor shards: whether their amax differ (the result was renormalised)."""
        if not self.nvfp4:
            return False
        row, col = rec.amaxes(metas, rec.F_AMAX_ROW), rec.amaxes(metas, rec.F_AMAX_COL)
        return len(set(row)) > 1 or len(set(col)) > 1


class Received:
    """A gathered buffer as verification and fault injection see it: the rank-major bytes."""
    __slots__ = ("name", "buffer", "nbytes")

    def __init__(self, name, buffer, nbytes):
        self.name, self.buffer, self.nbytes = name, buffer, nbytes

    def region(self, r) -> torch.Tensor:
        return layouts.as_bytes(self.buffer)[r * self.nbytes:(r + 1) * self.nbytes]


def received(plan, results, temps):
    """The rank-major buffers of a posted call (gather_post's results and temporaries), per part."""
    if plan.path != "quantized":
        (dtype, numel), = plan.layout
        return [Received("data", results[0], dtype.itemsize * numel)]
    temps, out = list(temps), []
    for g, result, (dtype, numel) in zip(plan.gathered, results, plan.layout):
        out.append(Received(g.name, temps.pop(0) if g.fixup == "swap" else result, dtype.itemsize * numel))
    return out


class GatheredRecords:
    """The records gathered with a collective (``meta_recv``): what a waiting call's exchange gives
    (read(), max_amax(), release()), from the collective that carried them."""

    def __init__(self, meta_recv, world):
        self.dev, self.world, self._metas = meta_recv, world, None

    def read(self) -> list:
        if self._metas is None:
            flat = self.dev.tolist()
            self._metas = [flat[r * rec.RECORD_LEN:(r + 1) * rec.RECORD_LEN] for r in range(self.world)]
        return self._metas

    def max_amax(self) -> torch.Tensor:
        bits = self.dev.view(self.world, rec.RECORD_LEN)[:, rec.F_AMAX_ROW].max()
        return bits.to(torch.int32).view(torch.float32).reshape(1)

    def release(self):
        pass


class Pending:
    """The last fused call of a group whose verdict this rank has not read yet."""
    __slots__ = ("seq", "meta_recv", "plan")

    def __init__(self, seq, meta_recv, plan):
        self.seq, self.meta_recv, self.plan = seq, meta_recv, plan


class DeferredGatherError:
    """Marker base: errors raised for another call's disagreement carry a note saying so."""


class GroupState:
    """One group's engine state on this rank (identical on every rank at each collective)."""

    def __init__(self, group, rank, world):
        self.rank, self.world = rank, world
        self.group_name = group.group_name  # what the native calls take (torch's group registry)
        self.plans = {}        # signature -> Plan
        self.by_key = {}       # fast input key -> Plan
        self.history = []      # agreed signatures, oldest first (at most HISTORY)
        self.period = None     # fused when not None
        self.seq = 0           # fused calls posted (eager and captured)
        self.pending = None    # Pending: the last eager fused call, verdict unread
        self.latches = {}      # device -> (latch tensor, its numpy view)
        self.captured = False  # a fused call was captured in a CUDA graph since the last check
        self.device = None     # the device of the group's earlier calls
        self.failed = {}       # seq -> (type, args, notes) of the error of a call found disagreeing (its wait())
        self.mismatch_records = None  # the records of this rank's last mismatch (for its error)

    # ---- schedule ----------------------------------------------------------------------------
    def predicted(self):
        """The plan the schedule predicts for the next call (fused mode), else None."""
        if self.period is None:
            return None
        return self.plans.get(self.history[-self.period])

    def agree(self, signature):
        """A waiting call agreed on ``signature`` (every rank knows it)."""
        self.history.append(signature)
        del self.history[:-HISTORY]
        self.period = find_period(self.history)

    def advance(self):
        """A fused call went as predicted (on every rank: each posted the predicted layout)."""
        self.history.append(self.history[-self.period])
        del self.history[:-HISTORY]

    def reset(self):
        """A disagreement was detected: forget the schedule (every rank does so before posting again)."""
        self.history.clear()
        self.period = None
        self.pending = None

    # ---- latch -------------------------------------------------------------------------------
    def latch(self, device):
        """(the latch's address, which the native calls take; its words, for the host to read)."""
        entry = self.latches.get(device)
        if entry is None:
            t = _ops.gather_latch_new(device)
            entry = self.latches[device] = (t.data_ptr(), t.numpy())
        return entry

    def verdict(self, seq, device, block):
        """The flags of call ``seq`` (VERDICT_*), or None if not known yet and not ``block``."""
        _, words = self.latch(device)
        slot = LATCH_RING + seq % LATCH_RING_SLOTS
        spins = 0
        while True:
            word = int(words[slot])
            if word >> SLOT_SHIFT == seq:
                return word & ((1 << SLOT_SHIFT) - 1)
            if not block:
                return None
            spins += 1
            if spins % 64 == 0 and device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
                torch.cuda.current_stream(device).query()  # raises a failed device's error
            time.sleep(0)

    def clear_sticky(self, device):
        _, words = self.latch(device)
        words[LATCH_STICKY_BAD] = 0
        words[LATCH_STICKY_RENORM] = 0

    def settle(self, block=True):
        """Read the pending call's verdict (waiting for it): raise its disagreement, if any, after
        resetting the group. Returns without raising when it agreed (or, ``block`` False, is not known)."""
        pending = self.pending
        if pending is None:
            return
        device = pending.meta_recv.device
        flags = self.verdict(pending.seq, device, block)
        if flags is None:
            return
        self.pending = None
        if flags & VERDICT_RENORM:
            warn_renormalised(pending.plan)
        if flags & VERDICT_BAD:
            raise self.detected(pending)

    def detected(self, pending):
        """The error of a fused call whose records disagreed (read back now: a host sync on this path)."""
        self.reset()
        self.clear_sticky(pending.meta_recv.device)
        records = GatheredRecords(pending.meta_recv, self.world)
        try:
            rec.check_agreement(records.read())
        except (ValueError, RuntimeError) as e:
            error = e
            # NOTE: its traceback would hold this frame, which holds it (a reference cycle)
            error.__traceback__ = None
        else:
            error = RuntimeError(f"{OP}: internal error: the device found the records of call {pending.seq} "
                                 "disagreeing, the host does not")
        error.add_note(f"{OP}: raised on rank {self.rank} after the gather whose ranks disagreed had returned (by "
                       "the next gather call on this group, which sent nothing, by that gather's wait(), by "
                       "check_gathers() or with strict=True): that gather's result on this rank holds NaN scales "
                       "(or NaN data where its dtype has a NaN)")
        # NOTE: what rebuilds the error, not the error itself: its traceback's frames hold this state
        # (a reference cycle that would keep the group's buffers until a garbage collection).
        self.failed[pending.seq] = (type(error), error.args, list(getattr(error, "__notes__", ())))
        if len(self.failed) > 64:
            self.failed.pop(next(iter(self.failed)))
        return error

    def failure_of(self, seq):
        """A new error like the one found for fused call ``seq`` (None if none was)."""
        found = self.failed.get(seq)
        if found is None:
            return None
        cls, args, notes = found
        error = cls(*args)
        for note in notes:
            error.add_note(note)
        return error


def warn_renormalised(plan):
    from .errors import warn_once
    dtype = str(plan.dtype).removeprefix("torch.")
    warn_once(f"{OP} gathered NVFP4 shards that were quantized with different global amax, so they cannot share "
              f"one global scale (quantize with the group's all-reduced amax): each shard was decoded to {dtype} "
              "with its own amax and the result requantized as nvfp4 with the largest, as the "
              "dequantize-then-gather fallback would (seen after the call returned: a fused call reads no records)",
              ("nvfp4", "amax", True))


_states = weakref.WeakKeyDictionary()


def state_of(group, rank, world) -> GroupState:
    state = _states.get(group)
    if state is None:
        state = _states[group] = GroupState(group, rank, world)
    return state


def existing_state(group):
    return _states.get(group)


def is_capturing(device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def in_coalescing(group) -> bool:
    return group in c10d._world.pg_coalesce_state
