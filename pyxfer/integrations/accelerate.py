"""pyxfer on models dispatched by Hugging Face accelerate (``dispatch_model``,
``from_pretrained(device_map=...)``): verified moves and a device guard per block.

``attach(model)`` registers PyTorch module hooks (not accelerate ``ModelHook``s) on the root and on
every block of ``model.hf_device_map`` that has an ``AlignDevicesHook``. They run outside accelerate's
wrapped forward: the forward pre-hook moves the block's inputs to its execution device with verified
copies, so that accelerate's own ``send_to_device`` finds them there and moves nothing; the block's
forward then runs inside ``pyxfer.device_guard(execution device)``; the forward hook (also called
when forward raises) leaves the guard and, for the root (``io_same_device``), moves the outputs
back to the inputs' device with verified copies (accelerate's own ``io_same_device`` flag on the
root's hook is off while attached, so that it does not move them first). The forward functions, the
weights and accelerate's hook objects stay as they are; ``detach(model)`` removes exactly what attach
added and turns that flag back on.

``patch_send_to_device()`` is the opt-in, process-wide alternative: it replaces
``accelerate.hooks.send_to_device`` (the name accelerate's hooks call, also for offload and
``CpuOffload``) and nothing else; it affects every model in the process and gives no device guard.
``accelerate.utils.operations.send_to_device`` (the dataloader's, and the recursion's) is never patched.

Not covered: tensors that the model body moves itself (``labels.to(logits.device)``, masks built on
another device, ``generate``'s bookkeeping) do not pass through the hooks; ``pyxfer.audit()`` counts
them. Weights that accelerate loads for offloaded blocks are moved by accelerate, unverified.
"""
import threading
import weakref

import torch

from ..guard import enter_index, exit_index
from ..nested import sender
from ..transfer import check_transfers
from ._patch import Integration

__all__ = ["attach", "detach", "is_attached", "Attachment", "patch_send_to_device", "unpatch_send_to_device",
           "send_to_device_patched", "is_send_to_device_patched"]

_VERIFY = ("sync", "deferred")


class _SendToDevice(Integration):
    def __init__(self):
        super().__init__("accelerate", module="accelerate.hooks", distribution="accelerate", tested=("1.10", "1.16"))

    def bindings(self, hooks, *, verify="sync", include_cpu=False, route=None):
        _check_verify("pyxfer.integrations.accelerate.patch_send_to_device", verify)
        options = dict(verify=verify, route=route, include_cpu=include_cpu)
        sender(0, **options)  # checks route now, not at the first move

        def send_to_device(tensor, device, non_blocking=False, skip_keys=None):
            """pyxfer's replacement of accelerate.hooks.send_to_device (same signature and semantics;
            verified copies between devices: see pyxfer.nested.verified_send)."""
            return sender(device, non_blocking=non_blocking, skip_keys=skip_keys, **options)(tensor)

        yield hooks, "send_to_device", send_to_device


_integration = _SendToDevice()


def patch_send_to_device(*, verify: str = "sync", include_cpu: bool = False, route=None):
    """Replace ``accelerate.hooks.send_to_device`` (what AlignDevicesHook and CpuOffload call) by a
    function with its signature and semantics whose copies between CUDA devices (and CPU <-> CUDA
    with ``include_cpu``) are ``pyxfer.verified_copy(..., verify=verify, route=route)``. Affects every
    model in the process, offloaded blocks and ``cpu_offload`` included; gives no device guard (use
    ``attach`` for that). Returns the PatchReport; idempotent (the pyxfer patch contract).
    Raises IntegrationError (accelerate missing or untested), ValueError for a bad option."""
    return _integration.patch(verify=verify, include_cpu=include_cpu, route=route)


def unpatch_send_to_device(*, force: bool = False) -> None:
    """Put back accelerate's own ``send_to_device`` (the identical object); see Integration.unpatch."""
    _integration.unpatch(force=force)


def send_to_device_patched(*, verify: str = "sync", include_cpu: bool = False, route=None):
    """Context manager: ``patch_send_to_device(...)`` for the block, unpatched after it."""
    return _integration.patched(verify=verify, include_cpu=include_cpu, route=route)


def is_send_to_device_patched() -> bool:
    return _integration.is_patched()


def _check_verify(op, verify):
    if verify not in _VERIFY:
        raise ValueError(f"{op}: verify must be one of {_VERIFY}, got {verify!r}")


# ---- attach / detach -------------------------------------------------------------------------------

_attachments = weakref.WeakKeyDictionary()  # model -> Attachment
_attach_lock = threading.Lock()


def _align_hook(hook, align_cls, sequential_cls):
    """The AlignDevicesHook in ``hook`` (itself, or inside a SequentialHook), or None."""
    if isinstance(hook, align_cls):
        return hook
    if isinstance(hook, sequential_cls):
        for h in hook.hooks:
            found = _align_hook(h, align_cls, sequential_cls)
            if found is not None:
                return found
    return None


def _as_device(device) -> torch.device:
    """AlignDevicesHook.execution_device (an int, a string or a torch.device) as a torch.device."""
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cuda", device)
    return torch.device(device)


class _Block:
    """The hooks of one attached block. A thread-local stack pairs each call's pre-hook with its
    forward hook, so nested and concurrent calls each restore their own device. A block with nothing
    to do after its forward (no guard to leave, no outputs to move back: guard=False or a CPU
    execution device, not the root) gets the pre-hook alone."""

    def __init__(self, name, module, hook, *, verify, route, guard, include_cpu, find_device):
        self.name, self.hook = name, hook
        self.device = _as_device(hook.execution_device)
        # rebuild=False: accelerate's send_to_device rebuilds the containers right after us anyway.
        self.options = dict(verify=verify, route=route, include_cpu=include_cpu, rebuild=False)
        self.send_args = sender(hook.execution_device, **self.options)  # skip_keys never apply to args
        self.send_kwargs = sender(hook.execution_device, skip_keys=hook.skip_keys, **self.options)
        self.guard_index = self.device.index if guard and self.device.type == "cuda" else None
        self.io_same_device = bool(hook.io_same_device)
        self.find_device = find_device
        self.senders_back = {}  # input device -> send(output) with the hook's skip_keys
        self.local = threading.local()
        paired = self.guard_index is not None or self.io_same_device
        pre = torch.compiler.disable(self.pre_forward if paired else self.move_inputs)
        self.handles = (module.register_forward_pre_hook(pre, with_kwargs=True, prepend=True),)
        if paired:
            post = torch.compiler.disable(self.post_forward)
            self.handles += (module.register_forward_hook(post, with_kwargs=True, always_call=True),)
        # NOTE: the root's move of the outputs back to the inputs' device is ours while attached:
        # accelerate records the inputs' device after our pre-hook moved them (so it would move
        # nothing), but when they already sat on the execution device and the last block left the
        # outputs elsewhere, its post_forward would move them itself, unverified, before our hook
        # runs. Its flag is off while attached; remove() puts it back.
        if self.io_same_device:
            hook.io_same_device = False

    def stack(self):
        """This thread's entries of the calls in progress: (previous device, inputs' device)."""
        try:
            return self.local.stack
        except AttributeError:
            self.local.stack = []
            return self.local.stack

    def move_inputs(self, module, args, kwargs):
        """The pre-hook: (args, kwargs) on the execution device, or None when nothing moved (the
        common case of a block inside a model: torch then keeps its own)."""
        moved_args, moved_kwargs = self.send_args(args), self.send_kwargs(kwargs)
        if moved_args is args and moved_kwargs is kwargs:  # rebuild=False: settled ones come back as they were
            return None
        return moved_args, moved_kwargs

    def pre_forward(self, module, args, kwargs):
        """The pre-hook of a paired block: move_inputs, then enter the guard."""
        stack = self.stack()
        # NOTE: pushed before anything can raise: the forward hook runs (always_call) and pops it
        # even when this pre-hook or the forward fails.
        stack.append(None)
        src = self.find_device([args, kwargs]) if self.io_same_device else None
        moved = self.move_inputs(module, args, kwargs)
        index = self.guard_index
        stack[-1] = (enter_index(index) if index is not None else None, src)
        return moved

    def post_forward(self, module, args, kwargs, output):
        stack = self.stack()
        if not stack:  # a global pre-hook failed before ours ran
            return None
        entry = stack.pop()
        if entry is None:  # our pre-hook failed: nothing entered
            return None
        prev, src = entry
        if self.guard_index is not None:
            exit_index(prev)
        if src is None or output is None:
            return None
        send = self.senders_back.get(src)
        if send is None:
            send = self.senders_back[src] = sender(src, skip_keys=self.hook.skip_keys, **self.options)
        return send(output)

    def remove(self):
        for h in self.handles:
            h.remove()
        if self.io_same_device:
            self.hook.io_same_device = True


class Attachment:
    """What ``attach`` added to a model. ``blocks``: {block name ("" for the root): execution
    device}; ``options``: attach's keyword arguments. ``detach()`` (or leaving a ``with`` block)
    removes it."""

    def __init__(self, model, blocks, options):
        self._model = weakref.ref(model)
        self._blocks = blocks
        self.options = options
        self.blocks = {b.name: b.device for b in blocks}

    @property
    def attached(self) -> bool:
        model = self._model()
        return model is not None and _attachments.get(model) is self

    def detach(self) -> None:
        model = self._model()
        if model is not None:
            detach(model)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.detach()
        return False

    def __repr__(self):
        blocks = ", ".join(f"{n or '(root)'}: {d}" for n, d in self.blocks.items())
        return f"Attachment({blocks}; {', '.join(f'{k}={v!r}' for k, v in self.options.items())})"


def attach(model: torch.nn.Module, *, verify: str = "sync", guard: bool = True, include_cpu: bool = False,
           route=None) -> Attachment:
    """Put verified moves and a device guard on every block of a model dispatched by accelerate.

    ``model``: dispatched by ``accelerate.dispatch_model`` (or ``from_pretrained(device_map=...)``)
    with hooks; its blocks are the root and the entries of ``model.hf_device_map`` whose
    ``_hf_hook`` is (or contains, in a SequentialHook) an ``AlignDevicesHook``. For each block:
    inputs (args; kwargs with the hook's ``skip_keys`` left alone) are moved to the hook's
    execution device with ``pyxfer.nested.verified_send`` before accelerate's hook runs; the forward
    runs inside ``pyxfer.device_guard(execution device)`` when ``guard`` (restored on exit, also when
    it raises); for the root (``io_same_device``) the outputs go back to the inputs' device.

    ``verify``: "sync" (every copy checked before it is used; a mismatch is repaired through the
    staged path) or "deferred" (checked on the device; a mismatch is raised by
    ``pyxfer.check_transfers()``, which ``detach`` also calls: call it where you synchronize anyway,
    e.g. after ``generate()``). ``include_cpu``: also verify CPU <-> CUDA moves (else only CUDA <->
    CUDA ones; the rest go through ``.to`` as accelerate does). ``route``: see verified_copy.

    Works under autograd (the copies are differentiable), re-entrantly, from several threads, and
    is skipped by torch.compile (graph break, like accelerate's hooks). Mutates the model's hook
    dicts and, while attached, the root hook's ``io_same_device`` flag (pyxfer moves the outputs
    back). Returns an Attachment (a context manager that detaches). Attaching an attached model
    again with the same options returns its Attachment; with other options it raises ValueError
    (detach first). Raises IntegrationError when accelerate is missing or untested, TypeError /
    ValueError for bad arguments or a model without accelerate hooks.
    """
    op = "pyxfer.integrations.accelerate.attach"
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{op}: model must be a torch.nn.Module, got {type(model).__name__}")
    _check_verify(op, verify)
    options = dict(verify=verify, guard=bool(guard), include_cpu=bool(include_cpu), route=route)
    _integration.target()  # accelerate present and in the tested range
    from accelerate.hooks import AlignDevicesHook, SequentialHook
    from accelerate.utils import find_device

    with _attach_lock:
        current = _attachments.get(model)
        if current is not None:
            if current.options != options:
                raise ValueError(f"{op}: model is already attached with {current.options}, not {options}: "
                                 f"detach(model) first")
            return current
        names = [""] + [n for n in getattr(model, "hf_device_map", {}) if n]
        found = []
        for name in names:
            try:
                module = model.get_submodule(name) if name else model
            except AttributeError:
                continue  # a device_map entry that is a parameter, not a module
            hook = _align_hook(getattr(module, "_hf_hook", None), AlignDevicesHook, SequentialHook)
            if hook is not None and hook.execution_device is not None:
                found.append((name, module, hook))
        if not found:
            raise ValueError(f"{op}: {type(model).__name__} has no accelerate AlignDevicesHook on its root or its "
                             f"hf_device_map blocks: dispatch it with accelerate.dispatch_model (force_hooks=True "
                             f"for a single device), or use pyxfer.device_guard directly")
        blocks = []
        try:
            for name, module, hook in found:
                blocks.append(_Block(name, module, hook, verify=verify, route=route, guard=guard,
                                     include_cpu=include_cpu, find_device=find_device))
        except BaseException:
            for b in blocks:
                b.remove()
            raise
        attachment = Attachment(model, tuple(blocks), options)
        _attachments[model] = attachment
        return attachment


def detach(model: torch.nn.Module) -> None:
    """Remove what ``attach`` added to ``model`` (its module hooks; nothing else was changed).
    Does nothing for a model that is not attached. With verify="deferred", then calls
    ``pyxfer.check_transfers()`` (a host sync), raising TransferError for a mismatch it reports."""
    with _attach_lock:
        attachment = _attachments.pop(model, None)
    if attachment is None:
        return
    for b in attachment._blocks:
        b.remove()
    if attachment.options["verify"] == "deferred":
        check_transfers()


def is_attached(model: torch.nn.Module) -> bool:
    """Whether ``attach`` is active on ``model``."""
    return model in _attachments
