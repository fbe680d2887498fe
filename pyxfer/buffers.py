"""Packed byte buffers with exact typed subviews: pack, move (verified), offload, reload, restore.

A :class:`SubviewSpec` says how to rebuild one typed view of a 1-D uint8 buffer::

    buffer[byte_offset : byte_offset + nbytes].view(dtype).as_strided(shape, stride)

where ``nbytes`` (:attr:`SubviewSpec.nbytes`) is the number of bytes the view spans. Shape and stride are in
elements of the view's own dtype and ``byte_offset`` is relative to the buffer's first byte -- never an absolute
storage offset. That is what Transformer Engine's offload got wrong (docs/specs/quantized-formats.md
§7.3/§7.4): rebuilding with ``buffer.as_strided(shape, stride, offset)`` drops the dtype (fp32
scales come back as uint8) and shifts views whose base had a storage offset.
"""
import dataclasses

import torch

from ._checks import check_bool, check_sequence, check_tensor
from ._devices import as_device

__all__ = ["SubviewSpec", "PackedBuffer", "CopyHandle", "pack", "capture_subviews", "restore_subviews"]


_QUANTIZED_DTYPES = tuple(getattr(torch, n) for n in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4")
                          if hasattr(torch, n))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _as_int_tuple(name: str, values) -> tuple:
    try:
        out = tuple(values)
    except TypeError:
        raise TypeError(f"SubviewSpec: {name} must be a sequence of ints, got {values!r}") from None
    if not all(_is_int(v) for v in out):
        raise TypeError(f"SubviewSpec: {name} must be a sequence of ints, got {values!r}")
    return out


@dataclasses.dataclass(frozen=True)
class SubviewSpec:
    """Everything needed to rebuild one typed view of a 1-D uint8 buffer.

    ``byte_offset``: where the view's first element lies, in bytes from the buffer's start.
    ``shape`` / ``stride``: in elements of ``dtype``, as ``Tensor.shape`` / ``Tensor.stride()``.
    ``dtype``: the view's dtype (any torch dtype, fp8 / bool / complex included).

    Construction checks types only (ints, equal lengths, a torch.dtype) and raises TypeError or
    ValueError; the values are checked against a buffer by :func:`restore_subviews`.
    """

    byte_offset: int
    shape: tuple
    stride: tuple
    dtype: torch.dtype

    def __post_init__(self):
        if not _is_int(self.byte_offset):
            raise TypeError(f"SubviewSpec: byte_offset must be an int, got {self.byte_offset!r}")
        shape, stride = _as_int_tuple("shape", self.shape), _as_int_tuple("stride", self.stride)
        if len(shape) != len(stride):
            raise ValueError(f"SubviewSpec: shape {shape} and stride {stride} must have the same length")
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"SubviewSpec: dtype must be a torch.dtype, got {self.dtype!r}")
        if self.dtype in _QUANTIZED_DTYPES:  # view(qint8) makes a tensor without a quantizer: unusable
            raise ValueError(f"SubviewSpec: dtype must be a non-quantized dtype, got {self.dtype}; describe the "
                             f"integer bytes (e.g. torch.int8) and keep the scale and zero point alongside")
        object.__setattr__(self, "shape", shape)  # frozen: normalise lists to tuples once, here
        object.__setattr__(self, "stride", stride)

    @property
    def nbytes(self) -> int:
        """Bytes spanned from the first to the last element (0 for an empty view)."""
        if 0 in self.shape:
            return 0
        return (1 + sum((n - 1) * s for n, s in zip(self.shape, self.stride))) * self.dtype.itemsize

    def to_dict(self) -> dict:
        """A JSON-ready dict: ``{"byte_offset", "shape", "stride", "dtype"}`` with the dtype's name
        (``"float32"``, ``"float8_e4m3fn"``, ...). Mutates nothing; raises nothing."""
        return {"byte_offset": self.byte_offset, "shape": list(self.shape), "stride": list(self.stride),
                "dtype": _dtype_name(self.dtype)}

    @classmethod
    def from_dict(cls, d: dict) -> "SubviewSpec":
        """The spec :meth:`to_dict` wrote. ``dtype`` may be ``"float32"`` or ``"torch.float32"``.

        Raises ValueError for missing or unknown keys or an unknown dtype name, TypeError for
        values of the wrong type.
        """
        keys = {"byte_offset", "shape", "stride", "dtype"}
        if not isinstance(d, dict) or set(d) != keys:
            got = sorted(d) if isinstance(d, dict) else type(d).__name__
            raise ValueError(f"SubviewSpec.from_dict: expected a dict with keys {sorted(keys)}, got {got}")
        name = d["dtype"]
        dtype = getattr(torch, name.removeprefix("torch."), None) if isinstance(name, str) else None
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"SubviewSpec.from_dict: dtype must name a torch dtype (e.g. 'float32'), got {name!r}")
        return cls(d["byte_offset"], d["shape"], d["stride"], dtype)


def _check_buffer(fn: str, buffer) -> None:
    check_tensor(fn, "buffer", buffer)
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
        raise ValueError(f"{fn}: buffer must be a 1-D contiguous uint8 tensor, got {buffer.dtype} of shape "
                         f"{tuple(buffer.shape)} with stride {tuple(buffer.stride())}")


def _check_spec(fn: str, where: str, spec: SubviewSpec, buffer: torch.Tensor) -> None:
    """Raise ValueError unless ``spec`` describes a view that lies inside ``buffer`` and that
    ``Tensor.view(dtype)`` can make (its first byte aligned to the dtype's size)."""
    off, itemsize, name = spec.byte_offset, spec.dtype.itemsize, _dtype_name(spec.dtype)
    if off < 0:
        raise ValueError(f"{fn}: {where} starts at byte {off} of buffer, expected >= 0")
    for label, values in (("shape", spec.shape), ("stride", spec.stride)):
        if any(v < 0 for v in values):
            raise ValueError(f"{fn}: {where} has {label} {values}, expected no negative entries")
    if off % itemsize:
        raise ValueError(f"{fn}: {where} starts at byte {off} of buffer, expected a multiple of "
                         f"{itemsize} (the size of {name})")
    if off + spec.nbytes > buffer.numel():
        raise ValueError(f"{fn}: {where} spans bytes [{off}, {off + spec.nbytes}) of buffer, expected them "
                         f"inside the buffer's {buffer.numel()} bytes")
    # NOTE: view(dtype) needs the storage offset, not just the relative one, to be aligned.
    if (buffer.storage_offset() + off) % itemsize:
        raise ValueError(f"{fn}: {where} lands at byte {buffer.storage_offset() + off} of the buffer's storage "
                         f"(buffer starts at byte {buffer.storage_offset()}), expected a multiple of {itemsize} "
                         f"(the size of {name})")


def restore_subviews(buffer: torch.Tensor, specs) -> list:
    """Rebuild typed views of ``buffer``: ``buffer[off : off + nbytes].view(dtype).as_strided(shape, stride)``.

    ``buffer``: 1-D contiguous uint8 tensor on any device (it may itself have a storage offset;
    spec offsets are relative to its first byte). ``specs``: iterable of :class:`SubviewSpec`.
    Returns one tensor per spec, each a view sharing ``buffer``'s storage, with the spec's dtype,
    shape and strides, on ``buffer``'s device. Copies and mutates nothing.
    Raises TypeError for a non-SubviewSpec entry and ValueError for a bad buffer (not a 1-D
    contiguous uint8 tensor) or a spec that is out of bounds, has negative shape or strides, or
    starts at a byte that is not a multiple of its dtype's size.
    """
    fn = "pyxfer.buffers.restore_subviews"
    _check_buffer(fn, buffer)
    specs = check_sequence(fn, "specs", specs, "SubviewSpec")
    views = []
    for i, spec in enumerate(specs):
        if not isinstance(spec, SubviewSpec):
            raise TypeError(f"{fn}: specs[{i}] must be a SubviewSpec (see SubviewSpec.from_dict), "
                            f"got {type(spec).__name__}")
        _check_spec(fn, f"specs[{i}]", spec, buffer)
        raw = buffer[spec.byte_offset:spec.byte_offset + spec.nbytes]
        # as_strided keeps the slice's own storage offset: offsets stay relative to the buffer
        views.append(raw.view(spec.dtype).as_strided(spec.shape, spec.stride))
    return views


def capture_subviews(buffer: torch.Tensor, views) -> list:
    """Describe tensors that live inside ``buffer`` (e.g. sub-buffers of a bulk allocation).

    ``buffer``: 1-D contiguous uint8 tensor; ``views``: tensors of any dtype, shape and strides that
    share ``buffer``'s storage, lie within its bytes and are on its device. Returns one
    :class:`SubviewSpec` per view, offsets relative to ``buffer``'s first byte, such that
    ``restore_subviews(buffer, specs)`` gives back the same dtype, shape, strides and values.
    Mutates nothing. Raises TypeError for a non-tensor and ValueError for a bad buffer, a view on
    another device, one that does not share ``buffer``'s storage or does not lie inside it, a
    conjugate/negative view, or a first byte that is not a multiple of the view's dtype size.
    """
    fn = "pyxfer.buffers.capture_subviews"
    _check_buffer(fn, buffer)
    views = check_sequence(fn, "views", views, "tensors")
    specs = []
    for i, v in enumerate(views):
        where = f"views[{i}]"
        check_tensor(fn, where, v)
        if v.device != buffer.device:
            raise ValueError(f"{fn}: {where} is on {v.device}, expected buffer's device {buffer.device}")
        if v.is_conj() or v.is_neg():
            raise ValueError(f"{fn}: {where} is a lazily conjugated/negated view, which a SubviewSpec cannot "
                             f"describe; expected a plain view (call resolve_conj()/resolve_neg() first)")
        if v.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr():
            raise ValueError(f"{fn}: {where} does not share buffer's storage, expected a view into buffer")
        byte_offset = v.storage_offset() * v.element_size() - buffer.storage_offset()
        spec = SubviewSpec(byte_offset, tuple(v.shape), v.stride(), v.dtype)
        _check_spec(fn, where, spec, buffer)
        specs.append(spec)
    return specs


def _check_alignment(fn: str, alignment) -> None:
    if not _is_int(alignment) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"{fn}: alignment must be a positive power of two (bytes), got {alignment!r}")


def _common_device(fn: str, tensors) -> torch.device:
    """The one device all ``tensors`` are on (CPU for an empty list)."""
    for i, t in enumerate(tensors):
        if t.device != tensors[0].device:
            raise ValueError(f"{fn}: tensors[{i}] is on {t.device}, expected the device of tensors[0] "
                             f"({tensors[0].device}); move them first or pack per device")
    return tensors[0].device if tensors else torch.device("cpu")


def _storage_bytes(t: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Bytes [start, stop) of ``t``'s storage as a 1-D uint8 tensor (a view, no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage(), start, (stop - start,), (1,))


def _align_up(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


@dataclasses.dataclass
class _Span:
    """Bytes [lo, hi) of ``tensor``'s storage (the union of what its packed tensors span), to be
    copied to buffer bytes [offset, offset + hi - lo); ``itemsize``: the largest of those tensors."""

    tensor: torch.Tensor
    lo: int
    hi: int
    itemsize: int
    offset: int = 0


def _plan_spans(tensors, nbytes, alignment):
    """One :class:`_Span` per storage, keyed by storage pointer, and the packed buffer's size.

    ``lo`` is rounded down, and ``offset`` up, to a multiple of the span's itemsize, so that every
    tensor's first byte in the buffer is a multiple of its own itemsize.
    """
    spans = {}
    for t, n in zip(tensors, nbytes):
        if n == 0:
            continue  # no bytes to keep: restored as an empty view at byte 0
        start = t.storage_offset() * t.element_size()
        span = spans.setdefault(t.untyped_storage().data_ptr(), _Span(t, start, start, 1))
        span.lo, span.hi = min(span.lo, start), max(span.hi, start + n)
        span.itemsize = max(span.itemsize, t.element_size())
    size = 0
    for span in spans.values():
        span.lo -= span.lo % span.itemsize
        span.offset = _align_up(size, max(alignment, span.itemsize))
        size = span.offset + span.hi - span.lo
    return spans, size


def pack(tensors, *, alignment: int = 256, device=None) -> "PackedBuffer":
    """Copy ``tensors`` into one new contiguous uint8 buffer, each at an aligned offset.

    ``tensors``: dense tensors of any dtype, shape and strides, all on one device (CPU or one GPU).
    Tensors that share a storage (views of one another, ``view(dtype)``/``view_as_real`` aliases)
    are packed once, as the span of storage they use together, and stay views of one another
    after :meth:`PackedBuffer.unpack`; each storage span starts at a multiple of
    ``max(alignment, largest itemsize)`` bytes, and the padding between spans is zeroed.
    Lazily conjugated/negated tensors are packed by value (they no longer alias).
    ``alignment``: positive power of two, in bytes. ``device``: where the buffer should end up;
    default the tensors' device. Packing happens on the tensors' device (copies on its current
    stream, capturable in a CUDA graph), then the buffer moves with a verified copy
    (:meth:`PackedBuffer.to`) if ``device`` differs.
    Returns a :class:`PackedBuffer`; no autograd history is recorded. Mutates nothing.
    Raises TypeError for ``tensors`` that is a single tensor or no iterable, or holds a
    non-tensor; ValueError for sparse/nested/quantized/meta tensors, tensors on different devices,
    a bad alignment or an unknown device (before any copy); ``pyxfer.TransferError`` if the move
    cannot be verified.
    """
    fn = "pyxfer.buffers.pack"
    _check_alignment(fn, alignment)
    tensors = check_sequence(fn, "tensors", tensors, "tensors")
    for i, t in enumerate(tensors):
        check_tensor(fn, f"tensors[{i}]", t)
    src_device = _common_device(fn, tensors)
    device = None if device is None else as_device(fn, "device", device)  # checked before any work
    tensors = [t.resolve_conj().resolve_neg() for t in tensors]  # no-ops unless lazily conjugated/negated

    specs = [SubviewSpec(0, tuple(t.shape), t.stride(), t.dtype) for t in tensors]  # offsets come later
    spans, size = _plan_spans(tensors, [spec.nbytes for spec in specs], alignment)
    with torch.no_grad():
        data = torch.empty(size, dtype=torch.uint8, device=src_device)
        end = 0
        for span in spans.values():
            data[end:span.offset].zero_()  # alignment padding: deterministic bytes, no stale memory
            end = span.offset + span.hi - span.lo
            data[span.offset:end].copy_(_storage_bytes(span.tensor, span.lo, span.hi))
    for i, (t, spec) in enumerate(zip(tensors, specs)):
        if spec.nbytes:
            span = spans[t.untyped_storage().data_ptr()]
            byte_offset = span.offset + t.storage_offset() * t.element_size() - span.lo
            specs[i] = dataclasses.replace(spec, byte_offset=byte_offset)
    packed = PackedBuffer(data, specs)
    if device is None or device == src_device:
        return packed
    return packed.to(device)


_copy_streams = {}  # CUDA device index -> the default side stream for offload/reload copies


def _default_copy_stream(device: torch.device):
    if device.index not in _copy_streams:
        _copy_streams[device.index] = torch.cuda.Stream(device)
    return _copy_streams[device.index]


def _check_stream(fn: str, stream) -> None:
    if stream is not None and not isinstance(stream, torch.cuda.Stream):
        raise TypeError(f"{fn}: stream must be None or a torch.cuda.Stream, got {type(stream).__name__}")


def _start_copy(fn: str, src: torch.Tensor, dst: torch.Tensor, stream, after=()):
    """``dst.copy_(src)``: on a copy stream with events when either side is on CUDA, else synchronously.
    The copy also waits for the events in ``after`` (earlier copies that read or write ``dst``).

    Returns the event recorded on the copy stream after the copy (None for a synchronous copy).
    """
    cuda_device = src.device if src.is_cuda else dst.device if dst.is_cuda else None
    if cuda_device is None:
        dst.copy_(src)
        return None
    copy_stream = _default_copy_stream(cuda_device) if stream is None else stream
    if copy_stream.device != cuda_device:
        raise ValueError(f"{fn}: stream is on {copy_stream.device}, expected the copy's CUDA device {cuda_device}")
    # NOTE: the copy must not start before work already queued on the current stream (the producer
    # of src, or the last user of dst's recycled memory) is done.
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(cuda_device))
    done = torch.cuda.Event()
    with torch.cuda.stream(copy_stream):
        copy_stream.wait_event(ready)
        for event in after:
            copy_stream.wait_event(event)
        dst.copy_(src, non_blocking=True)
        done.record(copy_stream)
    # NOTE: memory allocated on another stream is not recycled before the copy stream is past the copy.
    for t in (src, dst):
        if t.is_cuda:
            t.record_stream(copy_stream)
    return done


class CopyHandle:
    """An offload/reload in flight. ``event`` is recorded on the copy stream right after the copy
    (None when the copy ran synchronously, e.g. without CUDA: then waiting is a no-op). The handle
    holds a reference to the copy's source until it is dropped."""

    def __init__(self, result: "PackedBuffer", event, device, source: torch.Tensor):
        self._result, self.event, self.device, self._source = result, event, device, source

    def wait(self, stream=None) -> None:
        """Make ``stream`` (default: the current stream of the copy's CUDA device) wait for the copy,
        without blocking the host. Mutates nothing else; raises nothing."""
        if self.event is not None:
            (torch.cuda.current_stream(self.device) if stream is None else stream).wait_event(self.event)

    def result(self) -> "PackedBuffer":
        """The copied PackedBuffer, ready where it lives: for a host result the host waits for the
        copy; for a device result that device's current stream waits on the event (no host sync)."""
        if self.event is not None:
            if self._result.data.is_cuda:
                self.wait()
            else:
                self.event.synchronize()
        return self._result


class PackedBuffer:
    """A 1-D contiguous uint8 buffer (``data``) and the :class:`SubviewSpec` of every tensor in it
    (``specs``). Built by :func:`pack`, or from an existing bulk buffer with
    ``PackedBuffer(buffer, capture_subviews(buffer, views))``."""

    def __init__(self, data: torch.Tensor, specs):
        """``data``: 1-D contiguous uint8 tensor on any device (kept, not copied); ``specs``: iterable
        of SubviewSpec inside it. Raises TypeError/ValueError as :func:`restore_subviews` does."""
        fn = "pyxfer.buffers.PackedBuffer"
        _check_buffer(fn, data)
        self._specs = tuple(check_sequence(fn, "specs", specs, "SubviewSpec"))
        for i, spec in enumerate(self._specs):
            if not isinstance(spec, SubviewSpec):
                raise TypeError(f"{fn}: specs[{i}] must be a SubviewSpec, got {type(spec).__name__}")
            _check_spec(fn, f"specs[{i}]", spec, data)
        self._data = data
        self._host = None  # the host PackedBuffer (pinned; plain without CUDA) that offload() reuses
        # NOTE: events of the copies that use this buffer's data as the host buffer of an offload: the
        # offload that wrote it and every reload since. The next offload into it waits for all of
        # them (a reload on another stream or device may still be reading it). Shared with the host
        # PackedBuffer that offload() returns; a fresh list for every other buffer.
        self._host_users = []

    @property
    def data(self) -> torch.Tensor:
        return self._data

    @property
    def specs(self) -> tuple:
        return self._specs

    @property
    def device(self) -> torch.device:
        return self._data.device

    @property
    def nbytes(self) -> int:
        return self._data.numel()

    def __repr__(self):
        return f"PackedBuffer({self.nbytes} bytes on {self.device}, {len(self._specs)} views)"

    def unpack(self) -> list:
        """The packed tensors as typed views of ``data`` (same dtype, shape, strides and values;
        tensors that shared a storage when packed share ``data`` now). Copies and mutates nothing."""
        return restore_subviews(self._data, self._specs)

    def to(self, device, *, verify: bool = True, non_blocking: bool = False) -> "PackedBuffer":
        """A copy on ``device`` (same specs), through ``pyxfer.verified_copy``: bytes checksummed on
        both devices unless ``verify=False``. ``non_blocking=True`` verifies without a host wait
        (``verify="deferred"``: a mismatch is raised by ``pyxfer.check_transfers()``); otherwise the
        call waits for the two checksums and repairs or raises. The copy is ready on the
        destination's current stream either way. Mutates nothing. Raises ``pyxfer.TransferError`` on
        unrepairable corruption and what verified_copy raises for a bad device.
        """
        from .transfer import verified_copy  # lazily: transfer imports more than buffers needs

        fn = "pyxfer.buffers.PackedBuffer.to"
        check_bool(fn, "verify", verify)
        check_bool(fn, "non_blocking", non_blocking)
        mode = ("deferred" if non_blocking else "sync") if verify else "none"
        return PackedBuffer(verified_copy(self._data, device, verify=mode), self._specs)

    def offload(self, stream=None) -> CopyHandle:
        """Start copying ``data`` to this PackedBuffer's host buffer (pinned when ``data`` is on CUDA;
        allocated by the first offload, reused by the next ones).

        On CUDA the copy runs on ``stream`` (default: a per-device side stream) after the current
        stream's queued work; the handle's event follows it; ``handle.result()`` waits on the host
        and returns a host PackedBuffer that views the reused host buffer. Without CUDA the copy is
        synchronous. Mutates the host buffer: the host PackedBuffer of an earlier offload of this
        buffer is overwritten (reload it first). Raises TypeError if ``stream`` is not None or a
        torch.cuda.Stream, ValueError if it is on another device.
        """
        _check_stream("pyxfer.buffers.PackedBuffer.offload", stream)
        if self._host is None:
            self._host = PackedBuffer(
                torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=self._data.is_cuda), self._specs)
        users = self._host._host_users
        event = _start_copy("pyxfer.buffers.PackedBuffer.offload", self._data, self._host.data, stream, users)
        users[:] = [] if event is None else [event]  # later users are ordered after this write
        return CopyHandle(self._host, event, self._data.device, self._data)

    def reload(self, device, stream=None) -> CopyHandle:
        """Start copying this host PackedBuffer into a new buffer on ``device``.

        ``data`` must be on the CPU (e.g. from :meth:`offload`). The destination is allocated on
        ``device``'s current stream; on CUDA the copy runs on ``stream`` (default: a per-device side
        stream) after that stream's queued work, and ``handle.result()`` makes the current stream of
        ``device`` wait on the handle's event (``handle.wait(stream)`` for another stream). Works on
        any current device. Without CUDA (``device="cpu"``) the copy is synchronous. Mutates nothing.
        Raises ValueError if ``data`` is not on the CPU (use :meth:`to` between devices), for a
        device that does not exist, or if ``stream`` is on another device than ``device``;
        TypeError if ``device`` is not a device (None included) or ``stream`` not a torch.cuda.Stream.
        """
        fn = "pyxfer.buffers.PackedBuffer.reload"
        device = as_device(fn, "device", device)
        _check_stream(fn, stream)
        if self._data.device.type != "cpu":
            raise ValueError(f"{fn}: expected a host PackedBuffer (data on cpu), got data on {self._data.device}; "
                             f"use .to(device) to move between devices (verified)")
        dst = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        event = _start_copy(fn, self._data, dst, stream)
        if event is not None:  # the next offload into this host buffer waits for this read
            self._host_users[:] = [e for e in self._host_users if not e.query()] + [event]
        return CopyHandle(PackedBuffer(dst, self._specs), event, dst.device, self._data)
