"""The exchange of a waiting call's records (the agreement every rank reads before its data gather),
PXH64 verification of received shards, and the handle of an async call.

NOTE (lifetimes): Work objects are dropped as soon as they were waited for (a gloo Work that outlives
its process group aborts the process at exit); the data collectives are the native engine's
(pyxfer.gather.engine), which keeps no Work either.

NOTE (tensor lifetimes on gloo): gloo drops its references to a collective's tensors on its worker
thread, often after ``wait()`` returned; a tensor with a Python object then releases that object there,
taking the GIL, and a process finalizing at that moment aborts ("terminate called without an active
exception"). So nothing posted to gloo here has a Python object: the records travel through
``torch.ops.pyxfer.gloo_all_gather_bytes``, which hands gloo views of these buffers made in C++ and waits
(csrc/gather/gloo_bytes.cpp); the native engine's gloo collectives post buffers of their own likewise.
"""
import contextlib

import torch
import torch.distributed as dist

from ..checksums import as_uint64
from . import record as rec
from .errors import OP, GatherVerificationError
from .layouts import as_bytes

_OPTS = None


def _allgather(outs, ins, group):
    """Start an all-gather of ``ins`` (contiguous, one device) into ``outs`` (W times as many
    elements each, rank-major); returns the backend's Work (gloo: the
    collective already completed, see the NOTE on tensor lifetimes on gloo). The process group's own methods are
    called directly: torch.distributed's Python wrappers add tens of microseconds per call, and
    ``all_gather_into_tensor`` warns (FutureWarning) on torch >= 2.13. CUDA (NCCL): one coalesced
    collective (one ncclGroup). CPU (gloo): exactly one tensor, through ``_allgather_base`` (gloo's
    plain all-gather): gloo's coalesced all-gather mis-gathers lists of mixed dtypes, and with
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


def launch(send, recv, group):
    """Start the all-gather of a record exchange (``send`` into ``recv``): one collective; its Work."""
    if send.is_cuda:
        return _allgather([recv], [send], group)
    return _allgather([as_bytes(recv)], [as_bytes(send)], group)


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


class Records:
    """A waiting call's records: every rank's, gathered; the host reads them once (``read``). A call holds
    a buffer set of its own until ``release()``, so that calls in flight never share one.

    ``meta``: this rank's record (host part); ``device_values``: None, or a function writing the
    values computed on the device (the NVFP4 amax) into a 1-D int64 record tensor on ``device``.
    CUDA: on a side stream that waits for the caller's stream only when the record holds values
    computed there, so the host's wait does not include unrelated queued work. CPU (gloo): waited for
    at once, so that gloo never has two of pyxfer's collectives in flight."""

    def __init__(self, meta, device_values, group, world, device):
        self.world, self._metas, self._bufs, self._device_reader = world, None, None, None
        if device.type != "cuda":
            send = torch.tensor(meta, dtype=torch.int64)
            if device_values is not None:
                device_values(send)
            self.dev = self.host = torch.empty(world * rec.RECORD_LEN, dtype=torch.int64)
            self.event = None
            launch(send, self.dev, group).wait()  # (the Work is dropped at once)
            return
        free = _free_record_buffers.setdefault((device, world), [])
        self._bufs = bufs = free.pop() if free else _RecordBuffers(device, world)
        self.host, self.dev, self.event = bufs.host, bufs.dev, bufs.event
        side = _side_stream(device)
        if bufs.read_pending:  # the previous holder's device reads (max_amax)
            side.wait_event(bufs.read_done)
            bufs.read_pending = False
        if device_values is not None:  # the amax is computed on the caller's stream
            side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            bufs.send_np[:] = meta  # the previous holder's copy out of it finished before its read()
            send = bufs.dev_send.copy_(bufs.host_send, non_blocking=True)
            if device_values is not None:
                device_values(send)
            launch(send, self.dev, group).wait()  # the side stream (current here) waits for the collective
            self.host.copy_(self.dev, non_blocking=True)
            self.event.record(side)

    def read(self) -> list:
        """The W records as lists of ints (waits for them the first time)."""
        if self._metas is None:
            if self.event is not None:
                self.event.synchronize()
            flat = self.host.tolist()
            self._metas = [flat[r * rec.RECORD_LEN:(r + 1) * rec.RECORD_LEN] for r in range(self.world)]
        return self._metas

    def release(self):
        """Give the buffer set back (after ``read``, once the call's device work with the records is queued)."""
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


class GatherHandle:
    """Returned by ``all_gather(..., async_op=True)``. ``wait()`` makes the current stream wait for the
    data (on NCCL; gloo moved them already), post-processes (fix-ups, invalid marking, verification,
    requantization) and returns the result; later calls return the same object (or raise the same
    error). It raises the error of a disagreement among the ranks when this rank can know it without
    waiting for the device (see pyxfer.gather.engine). ``is_completed()`` says whether the collective
    finished (post-processing may still be due)."""

    def __init__(self, finish, probe=None):
        self._finish, self._probe = finish, probe
        self._result, self._error, self._done = None, None, False

    def is_completed(self) -> bool:
        if self._done or self._probe is None:
            return True
        return self._probe()

    def wait(self):
        if not self._done:
            finish, self._finish, self._probe, self._done = self._finish, None, None, True
            try:
                self._result = finish()
            except Exception as e:
                # NOTE: the error is kept to raise it again, so its finished frames are cleared: they
                # hold the call's buffers, which must not live as long as the handle (nor, through the
                # cycle handle -> error -> this frame, until a garbage collection).
                import traceback
                traceback.clear_frames(e.__traceback__)
                self._error = e
            del finish
        if self._error is not None:
            raise self._error
        return self._result
