"""pyxfer on accelerate-dispatched models (CPU): send_to_device's semantics in the verified move,
attach/detach on real dispatched transformers models (force_hooks, disk offload, from_pretrained
with a device_map), bit-identical logits and generate() tokens, exceptions, re-entrancy, threads,
training through adapters. The cross-device cases run in test_accelerate_gpu.py."""
import collections
import collections.abc
import copy
import threading
import warnings

import pytest
import torch

import pyxfer
from pyxfer.integrations import accelerate as pxa
from pyxfer.nested import verified_send
from pyxfer.testing import inject_fault

accelerate = pytest.importorskip("accelerate", reason="the integration tests need accelerate (pip install '.[test]')")
transformers = pytest.importorskip("transformers",
                                   reason="the integration tests need transformers (pip install '.[test]')")
from accelerate import dispatch_model  # noqa: E402
from accelerate.utils import send_to_device  # noqa: E402

from support.integrations_models import (  # noqa: E402
    Boom,
    Net,
    adapter_grads,
    block_names,
    clone_model,
    clone_model_with_adapters,
    device_map,
    dispatch,
    hook_state,
    input_ids,
    tiny_llama,
    with_adapters,
)

Pair = collections.namedtuple("Pair", "first second")


class Frozen(collections.abc.Mapping):
    """A Mapping that is not a dict (rebuilt as type(m)({...}), like send_to_device does)."""

    def __init__(self, data):
        self._data = dict(data)

    def __getitem__(self, k):
        return self._data[k]

    def __iter__(self):
        return iter(self._data)

    def __len__(self):
        return len(self._data)


class Tagged(torch.Tensor):
    """A tensor subclass: moved through its own .to (keeps the subclass)."""


class OnlyTo:
    """An object with a .to that rejects non_blocking (send_to_device retries without it)."""

    def __init__(self, device="cpu"):
        self.device = device

    def to(self, device):
        return OnlyTo(str(device))


class MyList(list):
    pass


def structure(gen):
    x = torch.randn(5, 7, generator=gen)
    y = torch.randn(3, 4, generator=gen).t()  # non-contiguous
    return x, y, {
        "tuple": (x, None, 3, "s"),
        "list": [y, [x, (y,)]],
        "mylist": MyList([x, y]),
        "pair": Pair(x, (y, None)),
        "ordered": collections.OrderedDict(a=x, b=y),
        "frozen": Frozen({"a": x, "skip": y}),
        "skip": x,  # skip_keys apply at every level
        "nested": {"skip": y, "keep": [x]},
        "encoding": transformers.BatchEncoding({"input_ids": x}),
        "subclass": x.as_subclass(Tagged),
        "param": torch.nn.Parameter(y.clone()),
        "only_to": OnlyTo(),
        "none": None,
        "number": 1.5,
    }


def assert_same_structure(got, want, device):
    """got (pyxfer) and want (accelerate) have the same types, containers and leaves."""
    assert type(got) is type(want), (type(got), type(want))
    if isinstance(want, torch.Tensor):
        assert got.device == want.device and got.dtype == want.dtype and got.shape == want.shape
        assert got.stride() == want.stride() and got.requires_grad == want.requires_grad
        if want.device.type != "meta":
            assert torch.equal(got, want)
    elif isinstance(want, transformers.BatchEncoding):
        assert_same_structure(dict(got), dict(want), device)
    elif isinstance(want, OnlyTo):
        assert got.device == want.device
    elif isinstance(want, (tuple, list)):
        assert len(got) == len(want)
        if hasattr(want, "_fields"):
            assert got._fields == want._fields
        for g, w in zip(got, want):
            assert_same_structure(g, w, device)
    elif isinstance(want, collections.abc.Mapping):
        assert list(got.keys()) == list(want.keys())
        for k in want:
            assert_same_structure(got[k], want[k], device)
    else:
        assert got is want


@pytest.mark.parametrize("device", ["cpu", "meta", torch.device("meta")], ids=str)
@pytest.mark.parametrize("skip_keys", [None, "skip", ["skip", "b"]], ids=str)
def test_verified_send_has_send_to_device_semantics(device, skip_keys, gen):
    x, y, data = structure(gen)
    got = verified_send(data, device, skip_keys=skip_keys, include_cpu=True)
    want = send_to_device(data, device, skip_keys=skip_keys)
    assert_same_structure(got, want, device)
    skipped = [skip_keys] if isinstance(skip_keys, str) else (skip_keys or [])
    if "skip" in skipped:
        assert got["skip"] is x and got["nested"]["skip"] is y and got["frozen"]["skip"] is y
    if device == "cpu":  # a same-device move returns the very same tensor
        assert got["tuple"][0] is x and got["list"][0] is y and got["pair"].first is x
    assert isinstance(got["subclass"], Tagged) and got["pair"].second[1] is None
    assert got["tuple"][2:] == (3, "s") and got["number"] == 1.5 and got["none"] is None
    # Positional args: skip_keys never apply to a tuple's elements, only to mapping keys.
    assert verified_send((x,), "meta", skip_keys="skip")[0].device.type == "meta"


def test_verified_send_leaves_non_tensors_alone(gen):
    obj = object()
    assert verified_send(obj, "meta") is obj and verified_send(None, "cuda") is None  # no CUDA touched
    assert verified_send("text", 0) == "text" and verified_send((), "cpu") == ()


def test_verified_send_rejects_bad_options(gen):
    x = torch.randn(2, generator=gen)
    with pytest.raises(ValueError, match="pyxfer.nested.verified_send: verify must be one of"):
        verified_send(x, "cpu", verify="eventually")
    with pytest.raises(ValueError, match="route must be one of"):
        verified_send(x, "cpu", route="scenic")
    with pytest.raises(TypeError, match="skip_keys must be a key, a list of keys or None, got int"):
        verified_send({"a": x}, "cpu", skip_keys=3)


# ---- attach / detach ------------------------------------------------------------------------------

def dispatched_llama(gen, devices="cpu", **kwargs):
    ref = tiny_llama(gen)
    model = dispatch(clone_model(ref), devices, force_hooks=True, **kwargs)
    return ref, model


def test_attach_detach_round_trip_restores_the_model(gen):
    _, model = dispatched_llama(gen)
    before = hook_state(model)
    align_hooks = {n: m._hf_hook for n, m in model.named_modules() if hasattr(m, "_hf_hook")}
    attachment = pxa.attach(model)
    attached_state = hook_state(model)
    assert pxa.is_attached(model) and attachment.attached
    assert list(attachment.blocks) == [""] + block_names()
    assert all(d == torch.device("cpu") for d in attachment.blocks.values())
    assert hook_state(model) != before
    assert model._hf_hook.io_same_device is False  # the root's outputs go back through pyxfer
    again = pxa.attach(model)  # same options: a handle on the same attachment, nothing added
    assert again.attached and again.blocks == attachment.blocks and again.options == attachment.options
    assert hook_state(model) == attached_state
    with pytest.raises(ValueError, match="already attached with"):
        pxa.attach(model, verify="deferred")
    pxa.detach(model)
    assert hook_state(model) == before and not pxa.is_attached(model) and not attachment.attached
    assert model._hf_hook.io_same_device is True
    assert {n: m._hf_hook for n, m in model.named_modules() if hasattr(m, "_hf_hook")} == align_hooks
    pxa.detach(model)  # not attached: nothing to do
    with pxa.attach(model, verify="deferred", include_cpu=True) as again:
        assert again is not attachment and again.options["verify"] == "deferred"
    assert hook_state(model) == before


def test_logits_and_generate_are_bit_identical_with_attach(gen):
    ref, model = dispatched_llama(gen)
    ids = input_ids(gen)
    with torch.no_grad():
        want = ref(ids).logits
        plain = model(ids).logits
        with pxa.attach(model, include_cpu=True):
            got = model(ids).logits
            tokens = model.generate(ids[:1], max_new_tokens=6, do_sample=False)
    assert torch.equal(plain, want) and torch.equal(got, want)
    assert torch.equal(tokens, ref.generate(ids[:1], max_new_tokens=6, do_sample=False))


def test_dispatch_with_a_disk_offloaded_block(gen, tmp_path):
    ref = tiny_llama(gen)
    devices = ["cpu"] * len(block_names())
    devices[block_names().index("model.layers.1")] = "disk"
    model = dispatch(clone_model(ref), devices, offload_dir=str(tmp_path))
    ids = input_ids(gen)
    with torch.no_grad(), pxa.attach(model, include_cpu=True) as attachment:
        got = model(ids).logits
        tokens = model.generate(ids[:1], max_new_tokens=5, do_sample=False)
    assert "model.layers.1" in attachment.blocks
    offloaded = [n for n, m in model.get_submodule("model.layers.1").named_modules()
                 if getattr(getattr(m, "_hf_hook", None), "offload", False)]
    assert offloaded and model.get_submodule("model.layers.1.mlp.up_proj").weight.device.type == "meta"
    with torch.no_grad():
        assert torch.equal(got, ref(ids).logits)
        assert torch.equal(tokens, ref.generate(ids[:1], max_new_tokens=5, do_sample=False))


def test_from_pretrained_with_a_device_map_saved_locally(gen, tmp_path):
    """transformers' own dispatch (a disk entry makes it call dispatch_model, with Llama's skip_keys)."""
    ref = tiny_llama(gen)
    ref.save_pretrained(tmp_path / "model")
    devices = ["cpu"] * len(block_names())
    devices[block_names().index("model.layers.2")] = "disk"
    model = transformers.LlamaForCausalLM.from_pretrained(
        tmp_path / "model", device_map=device_map(devices), offload_folder=str(tmp_path / "offload"),
        dtype=torch.float32).eval()
    assert model._hf_hook.skip_keys == model._skip_keys_device_placement
    ids = input_ids(gen)
    with torch.no_grad():
        want = ref(ids).logits
        with pxa.attach(model, include_cpu=True) as attachment:
            got = model(ids).logits
            tokens = model.generate(ids[:1], max_new_tokens=5, do_sample=False)
    assert set(attachment.blocks) == {""} | set(model.hf_device_map)
    assert torch.equal(got, want)
    assert torch.equal(tokens, ref.generate(ids[:1], max_new_tokens=5, do_sample=False))


def dispatched_net(gen):
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    return dispatch_model(Net(), {"first": "cpu", "boom": "cpu", "last": "cpu"}, force_hooks=True)


def test_forward_raising_inside_a_block_leaves_nothing_behind(gen):
    net = dispatched_net(gen)
    x = torch.randn(4, 5, generator=gen)
    want = net(x)
    attachment = pxa.attach(net)
    net.boom.fail = True
    with pytest.raises(RuntimeError, match="boom inside the block"):
        net(x)
    assert all(b.stack() == [] for b in attachment._blocks)
    net.boom.fail = False
    assert torch.equal(net(x), want)
    pxa.detach(net)


class Recursive(torch.nn.Module):
    """Calls itself: the same attached block entered while it is already running."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.depths = []
        self.interrupt = None  # raised at depth 0 when set

    def forward(self, x, depth):
        self.depths.append(depth)
        if depth == 0 and self.interrupt is not None:
            raise self.interrupt("at depth 0")
        return x if depth == 0 else self.linear(self(x, depth - 1))


def test_attach_is_re_entrant_and_thread_safe(gen):
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    model = dispatch_model(Recursive(), {"": "cpu"}, force_hooks=True)
    x = torch.randn(3, 4, generator=gen)
    want = model(x, 4)
    attachment = pxa.attach(model)
    results, errors = [], []

    def run():
        try:
            for _ in range(20):
                results.append(torch.equal(model(x, 4), want))
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 80 and all(results)
    assert attachment._blocks[0].stack() == []
    pxa.detach(model)


def test_training_through_adapters_gives_identical_gradients(gen):
    ref = with_adapters(tiny_llama(gen), gen).train()
    model = dispatch(clone_model_with_adapters(ref, gen), "cpu", force_hooks=True).train()
    ids = input_ids(gen)
    want_loss, want = adapter_grads(ref, ids)
    with pxa.attach(model, include_cpu=True):
        loss, got = adapter_grads(model, ids)
    assert torch.equal(loss, want_loss) and got.keys() == want.keys() and len(got) == 4 * 3
    for n in want:
        assert torch.equal(got[n], want[n]), n


def test_attach_rejects_what_it_cannot_attach_to(gen):
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got str"):
        pxa.attach("model")
    model = tiny_llama(gen)
    with pytest.raises(ValueError, match="has no accelerate AlignDevicesHook"):
        pxa.attach(model)
    _, dispatched = dispatched_llama(gen)
    with pytest.raises(ValueError, match="verify must be one of"):
        pxa.attach(dispatched, verify="none")
    assert not pxa.is_attached(dispatched) and not pxa.is_attached(model)


def test_deferred_attachment_checks_transfers_on_detach(gen):
    ref, model = dispatched_llama(gen)
    ids = input_ids(gen)
    pyxfer.check_transfers()
    with torch.no_grad(), pxa.attach(model, verify="deferred", include_cpu=True):
        got = model(ids).logits
    with torch.no_grad():
        assert torch.equal(got, ref(ids).logits)


def test_attached_hooks_are_skipped_by_torch_compile(gen):
    """The hooks are torch.compiler.disable'd (graph breaks, like accelerate's): a compiled attached
    model gives the eager result."""
    net = dispatched_net(gen)
    x = torch.randn(4, 5, generator=gen)
    want = net(x)
    torch._dynamo.reset()
    with pxa.attach(net) as attachment:
        compiled = torch.compile(net, backend="eager")
        assert torch.equal(compiled(x), want) and torch.equal(compiled(x), want)
        assert all(b.stack() == [] for b in attachment._blocks)
    torch._dynamo.reset()


def test_verified_leaf_keeps_strides_and_gradients(gen):
    """The leaf copy verified_send uses between devices (reached here CPU -> CPU through the private
    helper: a CPU machine has no second device; the GPU tests cover it through verified_send)."""
    from pyxfer.nested import _Move, _verified
    m = _Move("cpu", False, frozenset(), "sync", None, True, True)
    base = torch.randn(4, 6, 10, generator=gen, dtype=torch.float64)
    views = (base, base.permute(2, 0, 1), base.transpose(0, 2), base[:, 1:4], base[..., ::2],
             base[1:2].expand(3, 6, 10))
    for t in views:
        out = _verified(t, m)
        want = t.to("meta")  # Tensor.to's strides: kept when dense and non-overlapping, else contiguous
        assert torch.equal(out, t) and out.stride() == want.stride() and out.data_ptr() != t.data_ptr()
    x = base.clone().transpose(1, 2).requires_grad_()
    w = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    (_verified(x, m) * w).sum().backward()
    assert torch.equal(x.grad, w)


# ---- attach: hooks accelerate composes, maps with parameter entries, failures half-way, errors in hooks

def test_align_hook_inside_a_sequential_hook(gen):
    from accelerate.hooks import AlignDevicesHook, ModelHook, SequentialHook, add_hook_to_module
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    net = Net()
    x = torch.randn(4, 5, generator=gen)
    want = net(x)
    add_hook_to_module(net, ModelHook())
    add_hook_to_module(net, AlignDevicesHook(execution_device="cpu", io_same_device=True), append=True)
    assert isinstance(net._hf_hook, SequentialHook)
    with pxa.attach(net) as attachment:
        assert attachment.blocks == {"": torch.device("cpu")}
        assert net._hf_hook.hooks[1].io_same_device is False  # found inside the SequentialHook
        assert torch.equal(net(x), want)
    assert net._hf_hook.hooks[1].io_same_device is True
    other = Net()
    add_hook_to_module(other, ModelHook())
    add_hook_to_module(other, ModelHook(), append=True)
    with pytest.raises(ValueError, match="Net has no accelerate AlignDevicesHook on its root"):
        pxa.attach(other)  # a SequentialHook without one


def test_an_integer_execution_device_is_a_cuda_index(gen, gpus):
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module
    net = Net()
    add_hook_to_module(net, AlignDevicesHook(execution_device=1, io_same_device=True))
    before = hook_state(net)
    with pxa.attach(net) as attachment:  # attaching touches no device (cuda:1 exists: simulated)
        assert attachment.blocks == {"": torch.device("cuda", 1)}
        assert repr(attachment) == ("Attachment((root): cuda:1; verify='sync', guard=True, include_cpu=False, "
                                    "route=None)")
    assert hook_state(net) == before


class Where(torch.nn.Module):
    """A block without tensors: its forward returns the current CUDA device."""

    def forward(self):
        return torch.cuda.current_device()


def test_cuda_without_an_index_is_the_device_current_at_attach(gpus):
    """An execution device given as 'cuda' (accelerate takes one) is the CUDA device current when
    attach runs, like device_guard('cuda'): its guard makes that device current around the block's
    forward. (Read as a torch.device without an index, the block had silently no guard.)"""
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module
    net = Where()
    add_hook_to_module(net, AlignDevicesHook(execution_device="cuda", io_same_device=True))
    gpus.set(2)
    with pxa.attach(net) as attachment:
        assert attachment.blocks == {"": torch.device("cuda", 2)}
        gpus.set(0)
        assert net() == 2  # the forward ran with the block's device current
        assert gpus.current() == 0 and gpus.entered == [2]  # and the caller's came back


def test_an_execution_device_that_does_not_exist_is_refused(gpus):
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module
    for device in (7, "cuda:4", torch.device("cuda", 9)):
        net = Where()
        add_hook_to_module(net, AlignDevicesHook(execution_device=device, io_same_device=True))
        before = hook_state(net)
        with pytest.raises(ValueError, match=r"^pyxfer.integrations.accelerate.attach: the execution_device of the "
                                             r"AlignDevicesHook of block '\(root\)' is cuda:\d, which does not exist"):
            pxa.attach(net)
        assert not pxa.is_attached(net) and hook_state(net) == before


def test_attach_failing_on_a_later_block_removes_the_earlier_ones(gen):
    net = dispatched_net(gen)
    net.last._hf_hook.skip_keys = 3  # not a key or a list of keys: the third block's senders reject it
    before = hook_state(net)
    with pytest.raises(TypeError, match=r"accelerate.attach \(the AlignDevicesHook of block 'last'\): "
                                        r"skip_keys must be a key, a list of keys or None, got int"):
        pxa.attach(net)
    assert not pxa.is_attached(net) and hook_state(net) == before
    assert net._hf_hook.io_same_device is True  # the root's flag, turned off by its block, is back


def test_detach_after_the_model_is_gone(gen):
    import gc
    net = dispatched_net(gen)
    attachment = pxa.attach(net)
    del net
    gc.collect()
    assert not attachment.attached
    attachment.detach()  # nothing left to detach: no error
    with attachment:
        pass


def test_errors_in_hooks_before_the_forward_leave_nothing_behind(gen):
    net = dispatched_net(gen)
    x = torch.randn(4, 5, generator=gen)
    want = net(x)
    attachment = pxa.attach(net)

    def refuse(module, args):
        if module is net:
            raise RuntimeError("a global pre-hook refused")

    # a global pre-hook runs before the root's own: the root's forward hook (always called) finds
    # nothing to pop
    handle = torch.nn.modules.module.register_module_forward_pre_hook(refuse)
    try:
        # torch silences an always-called hook's own exception into a warning: there must be none
        with warnings.catch_warnings(record=True) as caught, pytest.raises(RuntimeError, match="pre-hook refused"):
            warnings.simplefilter("always")
            net(x)
    finally:
        handle.remove()
    assert [str(w.message) for w in caught] == []
    assert all(b.stack() == [] for b in attachment._blocks)
    assert torch.equal(net(x), want)

    class Unmovable:
        def to(self, device, non_blocking=False):
            raise RuntimeError("cannot move this")

    # the root's own pre-hook fails while moving an input: its entry is popped without leaving a guard
    with warnings.catch_warnings(record=True) as caught, pytest.raises(RuntimeError, match="cannot move this"):
        warnings.simplefilter("always")
        net(Unmovable())
    assert [str(w.message) for w in caught] == []
    assert all(b.stack() == [] for b in attachment._blocks)
    assert torch.equal(net(x), want)
    pxa.detach(net)


class Gained(torch.nn.Module):
    """Passes a Parameter of its own to a block (a tensor subclass: moved through its own .to)."""

    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(5, 6)
        self.boom = Boom()
        self.gain = torch.nn.Parameter(torch.tensor(3.0))

    def forward(self, x):
        return self.boom(self.first(x), scale=self.gain)


@pytest.mark.filterwarnings("ignore:The following device_map keys do not match any submodules")
def test_a_parameter_passed_to_a_block_keeps_its_gradient(gen):
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    ref = Gained()
    net = Gained()
    net.load_state_dict(ref.state_dict())
    # "gain" is a parameter of the root: a device_map entry that is not a module (as accelerate's
    # infer_auto_device_map writes them), which attach skips
    net = dispatch_model(net, {"first": "cpu", "boom": "cpu", "gain": "cpu"}, force_hooks=True)
    x = torch.randn(4, 5, generator=gen)
    ref(x).square().sum().backward()
    with pxa.attach(net, guard=False, include_cpu=True) as attachment:
        assert list(attachment.blocks) == ["", "first", "boom"]
        out = net(x)
        out.square().sum().backward()
    assert torch.equal(out, ref(x)) and torch.equal(net.gain.grad, ref.gain.grad)
    assert torch.equal(net.first.weight.grad, ref.first.weight.grad)


# ---- attach: nesting and stale handles, copies, bool options, messages, interrupts, deferred checks at detach

def test_nested_with_attach_blocks_leave_the_model_attached(gen):
    net = dispatched_net(gen)
    x = torch.randn(4, 5, generator=gen)
    want = net(x)
    before = hook_state(net)
    with pxa.attach(net) as outer:
        attached = hook_state(net)
        with pxa.attach(net) as inner:
            assert inner.attached and outer.attached and hook_state(net) == attached
        # the inner block attached nothing, so its exit detaches nothing
        assert pxa.is_attached(net) and outer.attached and inner.attached and hook_state(net) == attached
        assert net._hf_hook.io_same_device is False and torch.equal(net(x), want)
    assert not pxa.is_attached(net) and hook_state(net) == before
    plain = pxa.attach(net)  # a plain attach, then a with block inside it: the same
    attached = hook_state(net)
    with pxa.attach(net) as nested:
        pass
    assert plain.attached and nested.attached and hook_state(net) == attached
    inner.detach()  # a handle on an earlier attachment: stale, does nothing
    assert plain.attached
    nested.detach()  # an explicit detach() through any handle on the active attachment detaches
    assert not plain.attached and hook_state(net) == before


@pytest.mark.parametrize("options", [{}, {"include_cpu": True}], ids=["same options", "other options"])
def test_a_stale_handle_leaves_a_newer_attachment_alone(options, gen):
    net = dispatched_net(gen)
    before = hook_state(net)
    old = pxa.attach(net)
    old.detach()
    new = pxa.attach(net, **options)
    attached = hook_state(net)
    assert not old.attached and new.attached
    old.detach()
    with old:
        pass
    assert new.attached and pxa.is_attached(net) and hook_state(net) == attached
    with pxa.attach(net, **options):  # a stale outer handle's exit, with a newer attachment active
        with old:
            pass
        assert new.attached
    assert new.attached  # the nested block attached nothing
    pxa.detach(net)  # the model's detach removes the active attachment, whichever handle made it
    assert not new.attached and hook_state(net) == before


def hook_layout(model):
    """Per module: hook ids per hook dict, whether forward is an instance attribute bound to the
    module itself (accelerate's partial), __deepcopy__ in the instance, accelerate's hook fields:
    hook_state without object identities, to compare a copy with its original."""
    layout = {}
    for name, m in model.named_modules():
        forward = m.__dict__.get("forward")
        hooks = getattr(m, "_hf_hook", None)
        layout[name] = (
            list(m._forward_pre_hooks), list(m._forward_hooks), sorted(m._forward_pre_hooks_with_kwargs),
            sorted(m._forward_hooks_with_kwargs), sorted(m._forward_hooks_always_called),
            None if forward is None else (type(forward).__name__, getattr(forward, "args", (None,))[0] is m),
            "__deepcopy__" in m.__dict__,
            [(type(h).__name__, str(getattr(h, "execution_device", None)), getattr(h, "io_same_device", None))
             for h in getattr(hooks, "hooks", (hooks,))],
        )
    return layout


def test_deepcopy_of_an_attached_model_is_a_clean_detached_copy(gen):
    ref, model = dispatched_llama(gen)
    ids = input_ids(gen)
    before, layout = hook_state(model), hook_layout(model)
    assert layout[""][5] == ("partial", True)  # accelerate's forward, bound to the module
    with torch.no_grad():
        want = ref(ids).logits
        with pxa.attach(model, include_cpu=True) as attachment:
            twin = copy.deepcopy(model)
            layer = copy.deepcopy(model.model.layers[1])  # a block alone
            assert model._hf_hook.io_same_device is False and attachment.attached
            assert hook_layout(model) != layout
            # the copies carry accelerate's hooks and forward (bound to themselves), none of pyxfer's
            assert not pxa.is_attached(twin) and hook_layout(twin) == layout
            assert hook_layout(layer) == {k[len("model.layers.1."):] if k != "model.layers.1" else "": v
                                          for k, v in layout.items() if k.startswith("model.layers.1")}
            assert torch.equal(twin(ids).logits, want) and torch.equal(model(ids).logits, want)
            with pxa.attach(twin) as twin_attachment:  # a clean copy attaches and detaches on its own
                assert twin_attachment.attached and attachment.attached and torch.equal(twin(ids).logits, want)
            assert hook_layout(twin) == layout and attachment.attached
    assert hook_state(model) == before


def test_bool_options_must_be_bools(gen):
    net = dispatched_net(gen)
    before = hook_state(net)
    for name, value in (("include_cpu", "no"), ("guard", None), ("guard", 1), ("include_cpu", "False")):
        with pytest.raises(TypeError, match=f"pyxfer.integrations.accelerate.attach: {name} must be a bool, "
                                            f"got {type(value).__name__} {value!r}"):
            pxa.attach(net, **{name: value})
        assert not pxa.is_attached(net) and hook_state(net) == before


def test_attach_errors_name_attach_and_the_argument(gen):
    net = dispatched_net(gen)
    before = hook_state(net)
    with pytest.raises(ValueError, match=r"pyxfer.integrations.accelerate.attach: route must be one of "
                                         r"\('auto', 'direct', 'staged'\) or None, got 'scenic'"):
        pxa.attach(net, route="scenic")
    net.hf_device_map = ["first", "boom"]
    with pytest.raises(TypeError, match=r"attach: model.hf_device_map must be a mapping \{block name: device\} or "
                                        r"None, got list"):
        pxa.attach(net)
    assert not pxa.is_attached(net) and hook_state(net) == before
    net.hf_device_map = None  # no map: the root alone
    with pxa.attach(net) as attachment:
        assert attachment.blocks == {"": torch.device("cpu")}
    for function in (pxa.detach, pxa.is_attached):
        with pytest.raises(TypeError, match=f"pyxfer.integrations.accelerate.{function.__name__}: model must be a "
                                            f"torch.nn.Module, got str"):
            function("x")


@pytest.mark.parametrize("error", [KeyboardInterrupt, SystemExit])
def test_an_interrupt_inside_an_attached_forward_leaves_nothing_behind(error, gen):
    """torch runs always-called forward hooks for an Exception only: a KeyboardInterrupt (Ctrl-C in
    generate()) must still pop each call's entry (and, on a GPU, leave its device guard)."""
    net = dispatched_net(gen)
    x = torch.randn(4, 5, generator=gen)
    want = net(x)
    attachment = pxa.attach(net)
    net.boom.fail, net.boom.error = True, error
    with pytest.raises(error, match="boom inside the block"):
        net(x)
    assert all(b.stack() == [] for b in attachment._blocks)
    net.boom.fail = False
    assert torch.equal(net(x), want) and all(b.stack() == [] for b in attachment._blocks)
    # interrupted several levels deep in a re-entrant block: every level pops its own entry
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    model = dispatch_model(Recursive(), {"": "cpu"}, force_hooks=True)
    y = torch.randn(3, 4, generator=gen)
    want = model(y, 4)
    with pxa.attach(model) as deep:
        model.interrupt = error
        with pytest.raises(error):
            model(y, 4)
        assert deep._blocks[0].stack() == [] and model.depths[-1] == 0
        model.interrupt = None
        assert torch.equal(model(y, 4), want) and deep._blocks[0].stack() == []
    pxa.detach(net)
    # detach put accelerate's forward back (the wrapper is gone)
    assert net.__dict__["forward"].args[0] is net and model.__dict__["forward"].args[0] is model


def test_the_root_moves_outputs_back_without_a_guard(gen):
    """The root's outputs go back to the inputs' device through pyxfer's forward hook while
    accelerate's own io_same_device is off: with guard=False (and a CPU root, which has no guard)
    the root must still carry that hook. (That the logits do come back across devices needs a GPU:
    test_accelerate_gpu.py.)"""
    net = dispatched_net(gen)
    x = torch.randn(4, 5, generator=gen)
    want = net(x)
    before = set(net._forward_hooks)
    for guard in (False, True):
        with pxa.attach(net, guard=guard):
            added = set(net._forward_hooks) - before
            assert len(added) == 1 and added <= set(net._forward_hooks_always_called), guard
            assert net._hf_hook.io_same_device is False and torch.equal(net(x), want)
        assert set(net._forward_hooks) == before and net._hf_hook.io_same_device is True


def test_deferred_attachment_raises_a_pending_failed_copy_at_detach(gen):
    """detach() and the with block's exit check the deferred copies (check_transfers). On the CPU the
    hooks copy nothing (every block and input is on the CPU, and a tensor already on its target is
    returned as it is), so the pending copy is a deferred verified_copy made while attached."""
    net = dispatched_net(gen)
    x = torch.randn(4, 5, generator=gen)
    before = hook_state(net)
    pyxfer.check_transfers()  # nothing pending
    try:
        for leave in ("detach", "with", "model"):
            attachment = pxa.attach(net, verify="deferred", include_cpu=True)
            with inject_fault("bitflip", src="cpu", dst="cpu") as fault:
                pyxfer.verified_copy(net(x), "cpu", route="direct", verify="deferred")
            assert fault.used == 1
            with pytest.raises(pyxfer.TransferError, match="1 deferred verified copy failed verification; "
                                                           "the first: copy cpu -> cpu"):
                if leave == "detach":
                    attachment.detach()
                elif leave == "model":
                    pxa.detach(net)
                else:
                    with attachment:
                        pass
            assert not pxa.is_attached(net) and hook_state(net) == before, leave  # detached first
            pyxfer.check_transfers()  # reported once
    finally:
        pyxfer.health.reset()
