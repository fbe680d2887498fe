"""The exchange: posting collectives, the side streams the records travel on, the group's fused-mode
state, buffer lifetimes, and the handle that waits for the data.

NOTE (buffer lifetimes): every tensor posted to a collective stays owned until the collective
completed on the stream that uses it. On NCCL the caller's stream waits for the data gather in
``GatherHandle.wait``; in fused mode the records are read on a side stream, whose ``work.wait()``
lets ProcessGroupNCCL drop its references to every posted buffer, so each one is recorded on that
side stream after the wait (the caching allocator then reuses it only once the collective is done,
even when the caller drops the handle or a local step raised), and the caller's stream waits for that
point of the side stream before it reads the data (_StreamPoint). Work objects are dropped as soon as
they were waited for (a gloo Work that outlives its process group aborts the process at exit).

NOTE (tensor lifetimes on gloo): gloo drops its references to a collective's tensors on its worker
thread, often after ``wait()`` returned; a tensor with a Python object then releases that object there,
taking the GIL, and a process finalizing at that moment aborts ("terminate called without an active
exception", SIGABRT). So nothing posted to gloo here has a Python object: CPU collectives go through
``torch.ops.pyxfer.gloo_all_gather_bytes``, which hands gloo views of these buffers made in C++ and waits
(csrc/cpu/gloo_all_gather.cpp): on gloo every collective completes inside the call that posts it."""
import contextlib

import torch
import torch.distributed as dist

from ..checksums import as_uint64
from . import record as rec
from .errors import OP, GatherVerificationError
from .layouts import Part, as_bytes

_OPTS = None


def _allgather(outs, ins, group):
    """Start an all-gather of ``ins`` (contiguous, one device) into ``outs`` (W times as many
    elements each, rank-major); returns the backend's Work (gloo: completed already, through
    gloo_all_gather_bytes: see the NOTE on tensor lifetimes on gloo). The process group's own methods are
    called directly: torch.distributed's Python wrappers add tens of microseconds per call, and
    ``all_gather_into_tensor`` warns (FutureWarning) on torch >= 2.13. CUDA (NCCL): one coalesced
    collective (one ncclGroup). CPU (gloo): exactly one tensor, gloo's plain all-gather: gloo's
    coalesced all-gather mis-gathers lists of mixed dtypes, and with
    several gloo all-gathers in flight at once on torch 2.14 a rank was seen to hang in gloo's
    buffer teardown (another run died of heap corruption), so the CPU path never has more than one
    of its own in flight (see launch)."""
    global _OPTS
    if _OPTS is None:
        _OPTS = dist.AllgatherOptions() if hasattr(dist, "AllgatherOptions") else \
            __import__("torch.distributed.distributed_c10d", fromlist=["x"]).AllgatherOptions()
        if hasattr(_OPTS, "asyncOp"):
            _OPTS.asyncOp = True
    if ins[0].is_cuda:
        return group.allgather_into_tensor_coalesced(outs, ins, _OPTS)
    (out,), (inp,) = outs, ins
    assert out.is_contiguous() and inp.is_contiguous() and out.device.type == inp.device.type == "cpu"
    torch.ops.pyxfer.gloo_all_gather_bytes(group.group_name, out.data_ptr(), inp.data_ptr(),
                                          inp.numel() * inp.element_size())
    return _COMPLETED


class _Completed:
    """The Work of a collective that completed inside the call (gloo)."""

    def is_completed(self) -> bool:
        return True

    def wait(self):
        return True


_COMPLETED = _Completed()


class _PackedWork:
    """gloo: the parts' bytes gathered as one buffer (what gloo's coalesced all-gather does inside,
    without its defects; see _allgather); ``wait()`` copies each rank's bytes into the parts."""

    def __init__(self, ops, group, world):
        self._ops, self._world = ops, world
        self._send = torch.cat([as_bytes(p.send) for p in ops])
        self._recv = torch.empty(world * self._send.numel(), dtype=torch.uint8)
        self._work = _allgather([self._recv], [self._send], group)

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()

    def wait(self):
        if self._work is None:
            return True
        self._work.wait()
        self._work = None
        columns = self._recv.view(self._world, -1).split([p.nbytes for p in self._ops], dim=1)
        for p, column in zip(self._ops, columns):
            as_bytes(p.recv).view(self._world, p.nbytes).copy_(column)
        self._ops = self._send = self._recv = None
        return True


def launch(parts, group, world) -> list:
    """Start the gathers of every non-empty part: one collective on either backend. CUDA (NCCL):
    one coalesced group straight into the parts' buffers. CPU (gloo): one part goes straight into
    its buffer; several are packed into one byte buffer (_PackedWork)."""
    ops = [p for p in parts if p.nbytes]
    if not ops:
        return []
    if ops[0].send.is_cuda:
        return [_allgather([p.recv for p in ops], [p.send for p in ops], group)]
    if len(ops) == 1:
        return [_allgather([as_bytes(ops[0].recv)], [as_bytes(ops[0].send)], group)]
    return [_PackedWork(ops, group, world)]


def status_part(code, hashes, num_hashes, world, device) -> Part:
    """The status word of a waiting call's data collective (0, or the record.STEP_* code of a local
    failure after agreement), followed by ``num_hashes`` slots: the PXH64 of the sent buffers when
    they travel with the data (``hashes``; None: left unset, a failed rank's)."""
    n = 1 + num_hashes
    send = torch.empty(n, dtype=torch.int64, device=device)
    send[:1].fill_(code)
    if hashes is not None:
        send[1:].copy_(hashes)
    return Part("status", send, torch.empty(world * n, dtype=torch.int64, device=device))


def on_device(device):
    return torch.cuda.device(device) if device is not None and device.type == "cuda" else contextlib.nullcontext()


_side_streams = {}  # device -> the stream waiting calls' records travel on (created once per device)


def _side_stream(device):
    stream = _side_streams.get(device)
    if stream is None:
        stream = _side_streams[device] = torch.cuda.Stream(device)
    return stream


class _RecordBuffers:
    """The buffers of one record exchange on a CUDA device, reused across calls (allocating pinned
    memory, device memory and an event per call cost more host time than the exchange itself): this
    rank's record (pinned host and device copies), the gathered records (device, and the pinned copy
    the host reads), the event after that copy, and ``read_done``, recorded when the set is given back
    on the stream where ``max_amax`` read the records on the device (if it did)."""

    def __init__(self, device, world):
        self.host_send = torch.empty(rec.RECORD_LEN, dtype=torch.int64, pin_memory=True)
        self.send_np = self.host_send.numpy()
        self.host = torch.empty(world * rec.RECORD_LEN, dtype=torch.int64, pin_memory=True)
        self.dev_send = torch.empty(rec.RECORD_LEN, dtype=torch.int64, device=device)
        self.dev = torch.empty(world * rec.RECORD_LEN, dtype=torch.int64, device=device)
        self.event, self.read_done = torch.cuda.Event(), torch.cuda.Event()
        self.read_pending = False
        self.key = (device, world)


_free_record_buffers = {}  # (device, world) -> sets no call holds (list pop / append are atomic)


class _StreamPoint:
    """A point on a stream that stands for a collective already waited for there: ``wait()`` makes
    the current stream wait for it (what NCCL's ``Work.wait()`` does)."""

    def __init__(self, stream):
        self._event, self._device = torch.cuda.Event(), stream.device
        self._event.record(stream)

    def is_completed(self) -> bool:
        return self._event.query()

    def wait(self):
        torch.cuda.current_stream(self._device).wait_event(self._event)
        return True


class Records:
    """One call's records: every rank's, gathered; the host reads them once (``read``). A call holds
    a buffer set of its own until ``release()``, so that calls in flight never share one.

    ``meta``: this rank's record (host part); ``device_values``: None, or a function writing the
    values computed on the device (amax bits, hashes) into a 1-D int64 record tensor on ``device``.
    Alone (``data_parts`` None, the waiting protocol): CUDA, on a side stream that waits for the
    caller's stream only when the record holds values computed there, so the host's wait does not
    include unrelated queued work; CPU (gloo), waited for at once, so that gloo never has two of
    pyxfer's collectives in flight. Fused: the record is the last part of the collective that carries
    ``data_parts`` (``works``), posted from the caller's stream; on CUDA a side stream waits for it and
    copies the records to the host, so ``read`` waits for nothing else. ``cached``: the call repeats
    the group's agreed record, whose device copy the group keeps (no host-to-device copy)."""

    def __init__(self, meta, device_values, group, world, device, agreed, data_parts=None, cached=False):
        self.world, self._metas, self._bufs, self._device_reader, self._work = world, None, None, None, None
        self.works = []
        fused = data_parts is not None
        if device.type != "cuda":
            send = agreed.device_record(meta, device) if cached else torch.tensor(meta, dtype=torch.int64)
            if device_values is not None:
                send = send.clone() if cached else send
                device_values(send)
            self.dev = self.host = torch.empty(world * rec.RECORD_LEN, dtype=torch.int64)
            self.event = None
            works = launch(list(data_parts or ()) + [Part("record", send, self.dev)], group, world)
            if fused:
                self.works, self._work = works, works[0]
            else:
                works[0].wait()
            return
        free = _free_record_buffers.setdefault((device, world), [])
        self._bufs = bufs = free.pop() if free else _RecordBuffers(device, world)
        self.host, self.dev, self.event = bufs.host, bufs.dev, bufs.event
        # Fused: the group's own read stream, so that no other group's records wait for this data gather.
        side = agreed.read_stream(device) if fused else _side_stream(device)
        if bufs.read_pending:  # the previous holder's device reads (max_amax)
            (torch.cuda.current_stream(device) if fused else side).wait_event(bufs.read_done)
            bufs.read_pending = False
        if fused:  # from the caller's stream, with no stream switch before the launch (host time delays the data)
            send = agreed.device_record(meta, device) if cached else self._send_from_host(bufs, meta)
            if device_values is not None:
                send = send.clone() if cached else send
                device_values(send)
            posted = data_parts + [Part("record", send, self.dev)]
            self.works = launch(posted, group, world)
        if not fused and device_values is not None:  # the amax / the sent bytes are computed on the caller's stream
            side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            if not fused:
                send = self._send_from_host(bufs, meta)
                if device_values is not None:
                    device_values(send)
                works = launch([Part("record", send, self.dev)], group, world)
            for work in self.works if fused else works:
                work.wait()  # makes the side stream (current here) wait for the collective
            if fused:
                # NOTE: the wait above let the backend drop its references to the posted buffers, which
                # were allocated on the caller's stream; recorded here, none is reused before the
                # collective completed, whatever the caller does with the handle.
                for p in posted:
                    p.send.record_stream(side)
                    p.recv.record_stream(side)
                # The Work objects are done with; the caller's stream waits for this point of the side
                # stream instead (complete() / GatherHandle.wait()) before it reads the data.
                self.works = [_StreamPoint(side)]
            self.host.copy_(self.dev, non_blocking=True)
            self.event.record(side)

    @staticmethod
    def _send_from_host(bufs, meta) -> torch.Tensor:
        bufs.send_np[:] = meta  # the previous holder's copy out of it finished before its read()
        return bufs.dev_send.copy_(bufs.host_send, non_blocking=True)

    def read(self) -> list:
        """The W records as lists of ints (waits for them the first time)."""
        if self._metas is None:
            if self._work is not None:
                self._work.wait()
                self._work = None
            elif self.event is not None:
                self.event.synchronize()
            self.works = []  # waited for (or, NCCL, recorded on the read stream): no Work object outlives its use
            flat = self.host.tolist()
            self._metas = [flat[r * rec.RECORD_LEN:(r + 1) * rec.RECORD_LEN] for r in range(self.world)]
        return self._metas

    def release(self):
        """Give the buffer set back (after ``read``, once the call's device work with the records is
        queued and, fused, once the caller's stream waited for the collective)."""
        bufs, self._bufs = self._bufs, None
        if bufs is None:
            return
        if self._device_reader is not None:
            bufs.read_done.record(self._device_reader)
            bufs.read_pending = True
        _free_record_buffers[bufs.key].append(bufs)

    def max_amax(self) -> torch.Tensor:
        """The largest shard amax of the group as a 1-element fp32 tensor on the current stream,
        computed on the device from the gathered records (no host read). Non-negative fp32 values
        order as their bit patterns do."""
        records = self.dev
        if self.event is not None:
            current = torch.cuda.current_stream(records.device)
            current.wait_event(self.event)
            self._device_reader = current
        bits = records.view(self.world, rec.RECORD_LEN)[:, rec.F_AMAX_ROW].max()
        return bits.to(torch.int32).view(torch.float32).reshape(1)


# ---------------------------------------------------------------------------------------------
# Fused mode. Every rank keeps the same Agreed state for a group, changed only by calls that read
# their records before posting data (so at the same point of the call sequence on every rank). After
# FUSE_AFTER agreed calls in a row with one signature, every call of the group posts one collective:
# its data parts and its record. A rank whose call has that signature posts its data; any other
# rank posts scratch buffers of the agreed layout, so the collective matches on every rank, then reads
# the records at once: if every rank did the same (a new signature on all ranks) the call goes on as
# a waiting call (its data gathered next); if not, the ranks disagree, and each raises the same error
# (the ones that posted data, from wait()). Errors change no state. Signatures whose data depend on
# the records (quantize_as NVFP4 with the group's amax) never fuse.

FUSE_AFTER = 2


class Agreed:
    __slots__ = ("signature", "layout", "streak", "device", "_records", "_read_streams", "__weakref__")

    def __init__(self):
        self.signature = self.layout = self.device = None
        self.streak = 0  # agreed calls in a row with ``signature``
        self._records = {}  # device -> (record, its device copy)
        self._read_streams = {}  # device -> the stream that copies fused calls' records to the host

    def read_stream(self, device):
        stream = self._read_streams.get(device)
        if stream is None:
            stream = self._read_streams[device] = torch.cuda.Stream(device)
        return stream

    def fused(self) -> bool:
        return self.streak >= FUSE_AFTER

    def agree(self, signature, layout, device):
        """A call that read its records before its data gather agreed on ``signature`` and sends
        ``layout`` (layouts.layout_of of its data parts) from ``device``: where a later call without
        a usable input posts its scratch (an NCCL rank's collectives stay on one device)."""
        fusable = signature is not None and not rec.amax_from_records(signature)
        self.streak = 0 if not fusable else self.streak + 1 if signature == self.signature else 1
        self.signature, self.layout, self.device = signature, layout, device

    def device_record(self, meta, device) -> torch.Tensor:
        """This rank's record as a tensor on ``device`` (CPU included) for a call of the agreed
        signature, made once and only read after that (on CUDA, recorded on the read stream by every
        call that posts it)."""
        record, dev = self._records.get(device, (None, None))
        if record != meta:
            dev = torch.tensor(meta, dtype=torch.int64).to(device)
            self._records[device] = (list(meta), dev)
        return dev


def queue_checks(data_parts, rank, world):
    """Queue the PXH64 of every shard received from another rank (the rank-major bytes, before any
    fix-up) and return ``check(expected)``, which compares them with the senders' hashes
    (``expected(r)`` lists rank r's hashes in part order) with one host read. Queued before the
    caller waits for its records, so that the host waits once for both."""
    checks = [(r, i, p) for r in range(world) if r != rank for i, p in enumerate(data_parts) if p.nbytes]
    got = torch.stack([torch.ops.pyxfer.checksum(p.region(r), 0) for r, _, p in checks]) if checks else None

    def check(expected):
        if got is None:
            return
        want = {r: expected(r) for r in range(world) if r != rank}
        bad = [(r, p, as_uint64(w), as_uint64(g)) for (r, i, p), g in zip(checks, got.tolist())
               for w in [want[r][i]] if as_uint64(w) != as_uint64(g)]
        if bad:
            r, p, w, g = bad[0]
            more = f" ({len(bad) - 1} more shard buffer(s) mismatched too)" if len(bad) > 1 else ""
            raise GatherVerificationError(
                f"{OP}: the {p.name} shard from rank {r} arrived corrupted on rank {rank}: sender PXH64 {w:#018x}, "
                f"received PXH64 {g:#018x} ({p.nbytes} bytes){more}",
                src_rank=r, rank=rank, buffer=p.name, num_bytes=p.nbytes, expected=w, actual=g)
    return check


def complete(works, finish, device):
    """Wait for ``works`` (on NCCL: the current stream waits), then ``finish()``: the result."""
    with on_device(device):
        for w in works:
            w.wait()
        works.clear()
        return finish()


class GatherHandle:
    """Returned by ``all_gather(..., async_op=True)``. ``wait()`` waits for the data (on NCCL: makes
    the current stream wait), then post-processes (verification, layout fix-ups, requantization)
    and returns the result; later calls return the same object (or raise the same error).
    ``is_completed()`` says whether the collectives finished (post-processing may still be due)."""

    def __init__(self, works, finish, device):
        self._works, self._finish, self._device = works, finish, device
        self._result, self._error, self._done = None, None, False

    def is_completed(self) -> bool:
        if self._done:
            return True
        return all(w.is_completed() for w in self._works)

    def wait(self):
        if not self._done:
            works, finish, self._works, self._finish, self._done = self._works, self._finish, None, None, True
            try:
                self._result = complete(works, finish, self._device)
            except Exception as e:
                # NOTE: the error is kept to raise it again, so its finished frames are cleared: they
                # hold the call's buffers and Work objects, which must not live as long as the handle
                # (nor, through the cycle handle -> error -> this frame, until a garbage collection).
                import traceback
                traceback.clear_frames(e.__traceback__)
                self._error = e
            del works, finish
        if self._error is not None:
            raise self._error
        return self._result
