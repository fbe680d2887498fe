"""Audit mode: which moves between devices did pyxfer not verify, and which ops ran off the current device.

``with pyxfer.audit(model) as report:`` runs the block under a TorchDispatchMode and counts, per
module (the innermost module whose forward was running):

(a) copies between devices that pyxfer did not make: ``aten._to_copy`` / ``aten.copy_`` (and the
    functional ``aten.copy``) whose source and destination are different devices. pyxfer's own
    copies are recognised by their op: the mode sees ``pyxfer.verified_copy`` / ``pyxfer.staged_copy``
    as one call, and the aten copies inside them are not dispatched to the mode again.
(b) ops whose CUDA tensors sit on a device other than the current one: the precondition of the
    "illegal memory access" class (a custom kernel launched there would run on the wrong device).
    Copies are not counted here: moving across devices is what they are for.

Limits: launches that bypass the dispatcher (Triton kernels, pybind/C++ extension calls that are not
torch ops) are not seen; (b) is the proxy for the context they run in. Code run under
``torch.compile`` is seen as the compiled graph's ops, or not at all. Only the calling thread's ops
are seen (dispatch modes are thread-local), and a module's forward called as ``module.forward(...)``
(not ``module(...)``) is attributed to its caller.
"""
import contextlib
import dataclasses
import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["audit", "AuditReport", "Tally"]

_aten = torch.ops.aten
_COPY_OPS = {_aten._to_copy.default, _aten.copy_.default, _aten.copy.default}
_PYXFER_COPY_OPS = {torch.ops.pyxfer.verified_copy.default, torch.ops.pyxfer.staged_copy.default}
_PYXFER_MANY = torch.ops.pyxfer.verified_copy_many.default  # seen itself where autograd is off (inference mode)
NO_MODULE = "(no module)"


@dataclasses.dataclass
class Tally:
    """A number of copies and the bytes they moved."""

    count: int = 0
    num_bytes: int = 0


class AuditReport:
    """What ``pyxfer.audit`` saw; filled while the block runs.

    - ``unverified_copies``: {(module, src device, dst device): Tally} of copies pyxfer did not make.
    - ``pyxfer_copies``: the same for every call of pyxfer's copies (verified_copy / staged_copy).
    - ``off_device_ops``: {(module, op name, tensor's CUDA device, current device): count}.
    Devices are strings ("cpu", "cuda:1"); module is the qualified name inside the audited model
    (its class name for the root or a module outside it), or "(no module)".
    ``str(report)`` is a readable summary; ``as_dict()`` the same as plain data.
    """

    def __init__(self):
        self.unverified_copies = {}
        self.pyxfer_copies = {}
        self.off_device_ops = {}

    @property
    def num_unverified_copies(self) -> int:
        return sum(t.count for t in self.unverified_copies.values())

    @property
    def num_pyxfer_copies(self) -> int:
        return sum(t.count for t in self.pyxfer_copies.values())

    @property
    def num_off_device_ops(self) -> int:
        return sum(self.off_device_ops.values())

    def as_dict(self) -> dict:
        def copies(d):
            return [dict(module=m, src=s, dst=t, count=v.count, num_bytes=v.num_bytes) for (m, s, t), v in d.items()]
        return dict(unverified_copies=copies(self.unverified_copies), pyxfer_copies=copies(self.pyxfer_copies),
                    off_device_ops=[dict(module=m, op=o, device=d, current=c, count=n)
                                    for (m, o, d, c), n in self.off_device_ops.items()])

    def __str__(self) -> str:
        lines = [f"pyxfer audit: {self.num_unverified_copies} copies between devices not made by pyxfer, "
                 f"{self.num_pyxfer_copies} by pyxfer; {self.num_off_device_ops} ops with CUDA tensors off the "
                 f"current device"]
        for title, table in (("copies not made by pyxfer", self.unverified_copies),
                             ("copies made by pyxfer", self.pyxfer_copies)):
            if table:
                lines.append(f"{title} (module: from -> to: count, bytes):")
                lines += [f"  {m}: {s} -> {t}: {v.count}, {v.num_bytes}" for (m, s, t), v in sorted(table.items())]
        if self.off_device_ops:
            lines.append("ops off the current device (module: op: tensor device / current device: count):")
            lines += [f"  {m}: {o}: {d} / {c}: {n}" for (m, o, d, c), n in sorted(self.off_device_ops.items())]
        return "\n".join(lines)

    __repr__ = __str__


class _ModuleStack(threading.local):
    def __init__(self):
        self.names = []


class _AuditMode(TorchDispatchMode):
    def __init__(self, report: AuditReport, stack: _ModuleStack):
        super().__init__()
        self.report, self.stack = report, stack

    def _module(self) -> str:
        names = self.stack.names
        return names[-1] if names else NO_MODULE

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _PYXFER_COPY_OPS:
            self._copy(self.report.pyxfer_copies, args[0], out, every=True)
        elif func is _PYXFER_MANY:
            for src, dst in zip(args[0], out):
                self._copy(self.report.pyxfer_copies, src, dst, every=True)
        elif func in _COPY_OPS:
            if func is _aten.copy_.default:  # copy_(self=dst, src)
                self._copy(self.report.unverified_copies, args[1], args[0])
            else:
                self._copy(self.report.unverified_copies, args[0], out)
        else:
            self._off_device(func, args, kwargs)
        return out

    def _copy(self, table, src, dst, every=False):
        if not (isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor)):
            return
        if src.device == dst.device and not every:
            return
        key = (self._module(), str(src.device), str(dst.device))
        tally = table.get(key)
        if tally is None:
            tally = table[key] = Tally()
        tally.count += 1
        tally.num_bytes += src.numel() * src.element_size()

    def _off_device(self, func, args, kwargs):
        current = None
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                if current is None:
                    current = torch.cuda.current_device()
                if t.device.index != current:
                    key = (self._module(), str(func.overloadpacket.__name__), str(t.device), f"cuda:{current}")
                    self.report.off_device_ops[key] = self.report.off_device_ops.get(key, 0) + 1
                    return


@contextlib.contextmanager
def audit(*models):
    """``with pyxfer.audit(model) as report:`` count, while the block runs in this thread, (a) copies
    between devices that pyxfer did not make and (b) ops whose CUDA tensors are on a device other
    than the current one, per module; see the module docstring for what is and is not seen.

    ``models``: modules whose submodules are named by their qualified names in the report (others
    by their class name). Yields an AuditReport (filled live; final when the block ends). Ops run
    as usual; the mode and the global forward hooks it registers are removed on exit, also when the
    block raises. Slows every op (a Python call each): a diagnostic, not for production runs.
    """
    names = {}
    for model in models:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"pyxfer.audit: models must be torch.nn.Module, got {type(model).__name__}")
        for name, module in model.named_modules():
            names.setdefault(id(module), name or type(module).__name__)
    stack = _ModuleStack()

    def enter(module, args):
        stack.names.append(names.get(id(module)) or type(module).__name__)

    def leave(module, args, output):
        if stack.names:
            stack.names.pop()

    report = AuditReport()
    pre = torch.nn.modules.module.register_module_forward_pre_hook(enter)
    try:
        post = torch.nn.modules.module.register_module_forward_hook(leave, always_call=True)
        try:
            with _AuditMode(report, stack):
                yield report
        finally:
            post.remove()
    finally:
        pre.remove()
