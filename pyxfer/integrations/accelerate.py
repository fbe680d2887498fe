"""pyxfer on models dispatched by Hugging Face accelerate (``dispatch_model``,
``from_pretrained(device_map=...)``): verified moves and a device guard per block.

``attach(model)`` registers PyTorch module hooks (not accelerate ``ModelHook``s) on the root and on
every block of ``model.hf_device_map`` that has an ``AlignDevicesHook``. They run outside accelerate's
wrapped forward: the forward pre-hook moves the block's inputs to its execution device with verified
copies, so that accelerate's own ``send_to_device`` finds them there and moves nothing; the block's
forward then runs inside ``pyxfer.device_guard(execution device)``; the forward hook (also called
when forward raises) leaves the guard and, for the root (``io_same_device``), moves the outputs
back to the inputs' device with verified copies (accelerate's own ``io_same_device`` flag on the
root's hook is off while attached, so that it does not move them first). A block with a guard or
outputs to move back also gets its ``forward`` attribute wrapped, only to undo its call's state when
forward raises a KeyboardInterrupt or SystemExit (torch runs the always-called hook for an
``Exception`` only), and every block a ``__deepcopy__`` that makes ``copy.deepcopy`` of it (or of a
model holding it) a copy without pyxfer's additions. The weights and accelerate's hook objects stay
as they are; ``detach(model)`` removes exactly what attach added and turns that flag back on.

``patch_send_to_device()`` is the opt-in, process-wide alternative: it replaces
``accelerate.hooks.send_to_device`` (the name accelerate's hooks call, also for offload and
``CpuOffload``) and nothing else; it affects every model in the process and gives no device guard.
``accelerate.utils.operations.send_to_device`` (the dataloader's, and the recursion's) is never patched.

Not covered: tensors that the model body moves itself (``labels.to(logits.device)``, masks built on
another device, ``generate``'s bookkeeping) do not pass through the hooks; ``pyxfer.audit()`` counts
them. Weights that accelerate loads for offloaded blocks are moved by accelerate, unverified.
"""
import collections.abc
import copy
import functools
import threading
import weakref

import torch

from .._checks import check_bool
from .._devices import parse_device
from ..guard import enter_index, exit_index
from ..nested import sender
from ..transfer import ROUTES, check_transfers
from ._patch import Integration

__all__ = ["attach", "detach", "is_attached", "Attachment", "patch_send_to_device", "unpatch_send_to_device",
           "send_to_device_patched", "is_send_to_device_patched"]

_VERIFY = ("sync", "deferred")
_PATCHED = "accelerate.hooks.send_to_device (patched by pyxfer)"  # what its callers' bad arguments are reported against


class _SendToDevice(Integration):
    def __init__(self):
        super().__init__("accelerate", module="accelerate.hooks", distribution="accelerate", tested=("1.10", "1.16"))

    def bindings(self, hooks, *, verify="sync", include_cpu=False, route=None):
        options = _patch_options("pyxfer.integrations.accelerate.patch_send_to_device", verify, include_cpu, route)

        def send_to_device(tensor, device, non_blocking=False, skip_keys=None):
            """pyxfer's replacement of accelerate.hooks.send_to_device (same signature and semantics;
            verified copies between devices: see pyxfer.nested.verified_send)."""
            return sender(device, non_blocking=non_blocking, skip_keys=skip_keys, op=_PATCHED, **options)(tensor)

        yield hooks, "send_to_device", send_to_device


_integration = _SendToDevice()


def patch_send_to_device(*, verify: str = "sync", include_cpu: bool = False, route=None):
    """Replace ``accelerate.hooks.send_to_device`` (what AlignDevicesHook and CpuOffload call) by a
    function with its signature and semantics whose copies between CUDA devices (and CPU <-> CUDA
    with ``include_cpu``) are ``pyxfer.verified_copy(..., verify=verify, route=route)``. Affects every
    model in the process, offloaded blocks and ``cpu_offload`` included; gives no device guard (use
    ``attach`` for that). Returns the PatchReport; idempotent (the pyxfer patch contract).
    Raises IntegrationError (accelerate missing or untested), ValueError for a bad ``verify`` /
    ``route`` (or when already patched with other options), TypeError for an ``include_cpu`` that is
    not a bool."""
    return _integration.patch(**_patch_options("pyxfer.integrations.accelerate.patch_send_to_device", verify,
                                               include_cpu, route))


def unpatch_send_to_device(*, force: bool = False) -> None:
    """Put back accelerate's own ``send_to_device`` (the identical object); see Integration.unpatch."""
    _integration.unpatch(force=force)


def send_to_device_patched(*, verify: str = "sync", include_cpu: bool = False, route=None):
    """Context manager: ``patch_send_to_device(...)`` for the block, unpatched after it (a patch
    applied before the block stays). Raises like patch_send_to_device."""
    return _integration.patched(**_patch_options("pyxfer.integrations.accelerate.send_to_device_patched", verify,
                                                 include_cpu, route))


def is_send_to_device_patched() -> bool:
    return _integration.is_patched()


def _check_verify(op, verify):
    if verify not in _VERIFY:
        raise ValueError(f"{op}: verify must be one of {_VERIFY}, got {verify!r}")


def _patch_options(op, verify, include_cpu, route) -> dict:
    """patch_send_to_device's options, checked before the patch contract compares them."""
    _check_verify(op, verify)
    options = dict(verify=verify, route=route, include_cpu=include_cpu)
    sender(0, op=op, **options)  # route and include_cpu: now, not at the first move
    return options


# ---- attach / detach -------------------------------------------------------------------------------

_attachments = weakref.WeakKeyDictionary()  # model -> the _Record of its active attach
_attach_lock = threading.Lock()
# A module's dicts keyed by forward hook id (torch.nn.Module's): what a copy of it must lose of ours.
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
               "_forward_hooks_always_called")


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


class _Block:
    """The hooks of one attached block. A thread-local stack pairs each call's pre-hook with its
    forward hook, so nested and concurrent calls each restore their own device. A block with nothing
    to do after its forward (no guard to leave, no outputs to move back: guard=False or a CPU
    execution device, not the root) gets the pre-hook alone. Holds its module weakly (attach's
    registry of models is weak)."""

    def __init__(self, name, module, hook, *, verify, route, guard, include_cpu, find_device, op):
        self.name, self.hook = name, hook
        self.module = weakref.ref(module)
        where = f"the AlignDevicesHook of block {name or '(root)'!r}"
        # NOTE: 'cuda' without an index is the current device now, for the guard and the moves alike
        # (an int is a CUDA index, as in accelerate's hooks; a CUDA device that does not exist is an error here)
        self.device = parse_device(op, f"the execution_device of {where}", hook.execution_device)
        # rebuild=False: accelerate's send_to_device rebuilds the containers right after us anyway.
        self.options = dict(verify=verify, route=route, include_cpu=include_cpu, rebuild=False)
        self.send_args = sender(self.device, op=op, **self.options)  # skip_keys never apply to args
        self.send_kwargs = sender(self.device, skip_keys=hook.skip_keys, op=f"{op} ({where})", **self.options)
        self.guard_index = self.device.index if guard and self.device.type == "cuda" else None
        self.io_same_device = bool(hook.io_same_device)
        self.find_device = find_device
        self.senders_back = {}  # input device -> send(output) with the hook's skip_keys
        self.local = threading.local()
        # Nothing below raises: attach removes only blocks that were built.
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
        # NOTE: the wrapper and the forward it wraps (accelerate's, bound to the module) are held
        # weakly, through the module: a block holding its module would keep the model alive in
        # attach's weak registry.
        self.had_forward = "forward" in module.__dict__  # accelerate's; else the class's
        self.wrapper = weakref.ref(self.wrap_forward(module)) if paired else None
        if getattr(module, "__deepcopy__", None) is None:  # a class's (or anyone's) own copy is left to it
            self.copier = self.deepcopy  # one bound method, to recognise it in strip()
            module.__dict__["__deepcopy__"] = self.copier
        else:
            self.copier = None

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

    def wrap_forward(self, module):
        """Set ``module.forward`` to a wrapper of it that pops this call's entry and leaves the guard
        when forward raises what is not an Exception (KeyboardInterrupt, SystemExit): torch runs
        always-called forward hooks for an Exception only, and a Ctrl-C in generate() would leave the
        block's device current. Returns the wrapper."""
        inner = module.forward

        def forward(*args, **kwargs):
            try:
                return inner(*args, **kwargs)
            except Exception:
                raise  # torch runs post_forward (always_call)
            except BaseException:
                self.post_forward(None, None, None, None)
                raise

        # __wrapped__ leads inspect.signature to the real forward (generate() reads its parameters)
        functools.update_wrapper(forward, inner)
        module.__dict__["forward"] = forward
        return forward

    def deepcopy(self, memo):
        """``copy.deepcopy`` of the block's module without what attach added (the module's
        ``__deepcopy__`` while attached): the copy's hooks would call this block (the original's),
        its forward the original's, and its root hook's io_same_device would stay off, with nothing
        to remove them. The copy is not attached; otherwise it is the default deep copy."""
        module = self.module()
        func, args, state = module.__reduce_ex__(4)[:3]
        state = dict(state)
        ids = {h.id for h in self.handles}
        for key in _HOOK_DICTS:
            hooks = state.get(key)
            if hooks is not None and not ids.isdisjoint(hooks):
                state[key] = type(hooks)((k, v) for k, v in hooks.items() if k not in ids)
        self.strip(state)
        copied = func(*copy.deepcopy(args, memo))
        memo[id(module)] = copied  # before the state: it refers back to the module (accelerate's forward)
        copied.__setstate__(copy.deepcopy(state, memo))
        if self.io_same_device:
            copy.deepcopy(self.hook, memo).io_same_device = True  # the copy's hook (copied with the state)
        return copied

    def remove(self):
        for h in self.handles:
            h.remove()
        if self.io_same_device:
            self.hook.io_same_device = True
        module = self.module()
        if module is not None:
            self.strip(module.__dict__)

    def strip(self, attributes: dict) -> None:
        """Take the forward wrapper and ``__deepcopy__`` out of a module's attribute dict (its
        ``__dict__``, or the state a copy is made of), where they are still ours: one re-bound
        since is left alone."""
        wrapper = self.wrapper() if self.wrapper is not None else None
        if wrapper is not None and attributes.get("forward") is wrapper:
            if self.had_forward:
                attributes["forward"] = wrapper.__wrapped__
            else:
                del attributes["forward"]
        if self.copier is not None and attributes.get("__deepcopy__") is self.copier:
            del attributes["__deepcopy__"]


class _Record:
    """One attach of a model: its blocks and options (what ``_attachments`` holds while it is active)."""

    __slots__ = ("blocks", "options")

    def __init__(self, blocks, options):
        self.blocks, self.options = blocks, options


class Attachment:
    """A handle on what ``attach`` added to a model. ``blocks``: {block name ("" for the root):
    execution device}; ``options``: attach's keyword arguments; ``attached``: whether that
    attachment is still the model's active one.

    ``detach()`` removes that attachment if it is still active; a stale handle (its attachment was
    detached, and maybe another made since) does nothing. Leaving a ``with`` block detaches only if
    this handle's ``attach`` call attached the model: ``with attach(m):`` nested in another one (or
    in a plain ``attach(m)``) leaves the model attached, as ``patched()`` leaves a patch that was
    applied before it."""

    def __init__(self, model, record, made):
        self._model = weakref.ref(model)
        self._record = record
        self._made = made
        self.options = dict(record.options)
        self.blocks = {b.name: b.device for b in record.blocks}

    @property
    def _blocks(self):
        return self._record.blocks

    @property
    def attached(self) -> bool:
        model = self._model()
        return model is not None and _attachments.get(model) is self._record

    def detach(self) -> None:
        """Detach the model if this handle's attachment is still active (see ``detach(model)``)."""
        model = self._model()
        if model is not None:
            _detach(model, self._record)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self._made:
            self.detach()
        return False

    def __repr__(self):
        blocks = ", ".join(f"{n or '(root)'}: {d}" for n, d in self.blocks.items())
        return f"Attachment({blocks}; {', '.join(f'{k}={v!r}' for k, v in self.options.items())})"


def attach(model: torch.nn.Module, *, verify: str = "sync", guard: bool = True, include_cpu: bool = False,
           route=None) -> Attachment:
    """Put verified moves and a device guard on every block of a model dispatched by accelerate.

    ``model``: dispatched by ``accelerate.dispatch_model`` (or ``from_pretrained(device_map=...)``)
    with hooks; its blocks are the root and the entries of ``model.hf_device_map`` (a mapping, or
    None or absent: the root alone) whose ``_hf_hook`` is (or contains, in a SequentialHook) an
    ``AlignDevicesHook``. For each block: inputs (args; kwargs with the hook's ``skip_keys`` left
    alone) are moved to the hook's execution device with ``pyxfer.nested.verified_send`` before
    accelerate's hook runs; the forward runs inside ``pyxfer.device_guard(execution device)`` when
    ``guard`` (restored on exit, also when it raises, KeyboardInterrupt included); for the root
    (``io_same_device``) the outputs go back to the inputs' device, with or without ``guard``.

    ``verify``: "sync" (every copy checked before it is used; a mismatch is repaired through the
    staged path) or "deferred" (checked on the device; a mismatch is raised by
    ``pyxfer.check_transfers()``, which ``detach`` also calls: call it where you synchronize anyway,
    e.g. after ``generate()``). ``guard`` and ``include_cpu``: bools. ``include_cpu``: also verify
    CPU <-> CUDA moves (else only CUDA <-> CUDA ones; the rest go through ``.to`` as accelerate
    does). ``route``: None or one of pyxfer.ROUTES (see verified_copy).

    Works under autograd (the copies are differentiable), re-entrantly, from several threads, and
    is skipped by torch.compile (graph break, like accelerate's hooks). Mutates, while attached, the
    model's hook dicts, the root hook's ``io_same_device`` flag (pyxfer moves the outputs back), the
    ``forward`` attribute of the blocks with a guard or outputs to move back and the ``__deepcopy__``
    attribute of every block: ``copy.deepcopy`` of the model (or of a block) gives a copy that is
    not attached.

    Returns an Attachment handle (a context manager). Attaching an attached model again with the
    same options attaches nothing and returns a handle on the same attachment, whose ``with`` block
    leaves the model attached at its exit; with other options it raises ValueError (detach first).
    Raises IntegrationError when accelerate is missing or untested; TypeError for a model that is
    not a Module, a ``guard`` / ``include_cpu`` that is not a bool or an ``hf_device_map`` that is
    not a mapping; ValueError for a bad ``verify`` / ``route``, a model without accelerate hooks or an
    execution device that does not exist in this process. An execution device given as 'cuda'
    without an index is the CUDA device current at ``attach``.
    """
    op = "pyxfer.integrations.accelerate.attach"
    _check_model(op, model)
    _check_verify(op, verify)
    check_bool(op, "guard", guard)
    check_bool(op, "include_cpu", include_cpu)
    if route is not None and route not in ROUTES:
        raise ValueError(f"{op}: route must be one of {ROUTES} or None, got {route!r}")
    device_map = getattr(model, "hf_device_map", None)
    if device_map is None:
        device_map = {}
    elif not isinstance(device_map, collections.abc.Mapping):
        raise TypeError(f"{op}: model.hf_device_map must be a mapping {{block name: device}} or None, "
                        f"got {type(device_map).__name__}")
    options = dict(verify=verify, guard=guard, include_cpu=include_cpu, route=route)
    _integration.target()  # accelerate present and in the tested range
    from accelerate.hooks import AlignDevicesHook, SequentialHook
    from accelerate.utils import find_device

    with _attach_lock:
        current = _attachments.get(model)
        if current is not None:
            if current.options != options:
                raise ValueError(f"{op}: model is already attached with {current.options}, not {options}: "
                                 f"detach(model) first")
            return Attachment(model, current, made=False)
        names = [""] + [n for n in device_map if n]
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
                                     include_cpu=include_cpu, find_device=find_device, op=op))
        except BaseException:
            for b in blocks:
                b.remove()
            raise
        record = _Record(tuple(blocks), options)
        _attachments[model] = record
        return Attachment(model, record, made=True)


def _check_model(op, model):
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{op}: model must be a torch.nn.Module, got {type(model).__name__}")


def _detach(model, record=None) -> None:
    """Remove the model's active attachment (only if it is ``record``, when given); then, for
    verify="deferred", check the pending deferred copies."""
    with _attach_lock:
        current = _attachments.get(model)
        if current is None or (record is not None and current is not record):
            return
        del _attachments[model]
    for b in current.blocks:
        b.remove()
    if current.options["verify"] == "deferred":
        check_transfers()


def detach(model: torch.nn.Module) -> None:
    """Remove what ``attach`` added to ``model`` (its module hooks, the attributes it wrapped, the
    root hook's flag), whichever handle made it. Does nothing for a model that is not attached. With
    verify="deferred", then calls ``pyxfer.check_transfers()`` (a host sync), raising TransferError
    for a mismatch it reports (the model is detached by then). Raises TypeError for a model that is
    not a Module."""
    _check_model("pyxfer.integrations.accelerate.detach", model)
    _detach(model)


def is_attached(model: torch.nn.Module) -> bool:
    """Whether ``attach`` is active on ``model``. Raises TypeError for a model that is not a Module."""
    _check_model("pyxfer.integrations.accelerate.is_attached", model)
    return model in _attachments
