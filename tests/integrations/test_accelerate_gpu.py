"""pyxfer.integrations.accelerate on real GPUs with real dispatched transformers models.

One GPU: a tiny Llama split between cpu and cuda:0 (dispatch_model(main_device="cpu"), so cpu
blocks execute on the CPU and activations cross the host link through the hooks), attached with
include_cpu=True: every fault kind on the host <-> device direct path is detected and repaired with
logits bit-identical to the unattached split model; the current device inside each block; audit
counts; deferred verification; training through adapters. Two GPUs (multigpu, skipped on one with
the reason): the same model split over cuda:0 / cuda:1 with peer faults and the guard's devices.
What a CPU cannot show of the root's output hook (the logits come back to the inputs' device with
guard=False and with a CPU root, while accelerate's own io_same_device is off) and of an interrupt
inside a block (the guard's previous device restored)."""
import pytest
import torch

import pyxfer
from pyxfer.integrations import accelerate as pxa
from pyxfer.testing import FAULT_KINDS, inject_fault

pytest.importorskip("accelerate", reason="the integration tests need accelerate (pip install '.[test]')")
pytest.importorskip("transformers", reason="the integration tests need transformers (pip install '.[test]')")
from accelerate import dispatch_model  # noqa: E402

from support.integrations_models import (  # noqa: E402
    Net,
    adapter_grads,
    block_names,
    clone_model,
    clone_model_with_adapters,
    dispatch,
    input_ids,
    tiny_llama,
    with_adapters,
)

# health reset and cuda:0 current around each test; no latched mismatch left behind (conftest.py)
pytestmark = pytest.mark.usefixtures("clean_transfers")

# embed_tokens, rotary_emb, layers 0-2, norm, lm_head: the last block (the logits) on the GPU
CPU_ROOT_SPLIT = ["cpu", "cpu", 0, "cpu", 0, "cpu", 0]


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.gpu
@pytest.mark.parametrize("guard", [False, True])
def test_logits_come_back_to_the_inputs_device(guard, gen):
    """The root moves the outputs back through pyxfer's forward hook: with guard=False, and with a
    CPU root (no guard to enter either way), it must still have one."""
    ref = tiny_llama(gen)
    ids = input_ids(gen)
    split = dispatch(clone_model(ref), CPU_ROOT_SPLIT, main_device="cpu")  # root on the CPU, logits on cuda:0
    on_gpu = dispatch(clone_model(ref), 0, force_hooks=True)  # root on cuda:0, inputs on the CPU
    for model in (split, on_gpu):
        want = logits(model, ids)  # unattached: accelerate moves the logits back itself
        assert want.device.type == "cpu"
        with pxa.attach(model, guard=guard, include_cpu=True):
            assert model._hf_hook.io_same_device is False  # accelerate moves nothing back itself now
            got = logits(model, ids)
        assert got.device == ids.device and torch.equal(got, want), (model is split, guard)


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(6, 6)
        self.interrupt = False

    def forward(self, x):
        if self.interrupt:
            raise KeyboardInterrupt("Ctrl-C inside the block")
        return self.linear(x)


class TwoDevices(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(5, 6)
        self.block = Block()
        self.last = torch.nn.Linear(6, 3)

    def forward(self, x):
        return self.last(self.block(self.first(x)))


@pytest.mark.multigpu
def test_an_interrupt_in_a_block_restores_the_current_device(gen):
    """torch runs always-called forward hooks for an Exception only: a KeyboardInterrupt inside the
    cuda:1 block must still leave the guards (the current device back to cuda:0) and pop every entry."""
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    net = dispatch_model(TwoDevices(), {"first": 0, "block": 1, "last": 0}, main_device=0)
    x = torch.randn(4, 5, generator=gen).to("cuda:0")
    want = net(x)
    torch.cuda.set_device(0)
    with pxa.attach(net) as attachment:
        net.block.interrupt = True
        with pytest.raises(KeyboardInterrupt, match="Ctrl-C inside the block"):
            net(x)
        assert torch.cuda.current_device() == 0 and all(b.stack() == [] for b in attachment._blocks)
        net.block.interrupt = False
        assert torch.equal(net(x), want) and torch.cuda.current_device() == 0


# ---- a tiny Llama split between the host and GPUs ------------------------------------------------

# Blocks alternate between the host and the device so that activations cross the link both ways
# several times per forward: embed_tokens, rotary_emb, layers 0-2, norm, lm_head.
CPU_CUDA = ["cpu", "cpu", 0, "cpu", 0, "cpu", 0]
TWO_GPUS = [0, 0, 0, 1, 0, 1, 1]


def split_llama(gen, devices, **kwargs):
    model = tiny_llama(gen, **kwargs)
    main = "cpu" if devices[0] == "cpu" else devices[0]
    return dispatch(clone_model(model), devices, main_device=main)


def record_current_devices(model, names):
    """Forward pre-hooks (registered after attach: they run inside its guard) that record, per block,
    the current CUDA device and the devices of the tensor arguments."""
    seen, handles = [], []
    for name in names:
        def hook(module, args, kwargs, name=name):
            devices = {a.device for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)}
            seen.append((name, torch.cuda.current_device(), devices))
        handles.append(model.get_submodule(name).register_forward_pre_hook(hook, with_kwargs=True))
    return seen, handles


@pytest.mark.gpu
def test_cpu_cuda_split_every_fault_kind_is_repaired_bit_identically(gen):
    model = split_llama(gen, CPU_CUDA)
    directions = [("cpu", "cuda:0"), ("cuda:0", "cpu")]
    # Fresh inputs per case, and the faulted run before the reference run: the right bytes never
    # existed at the destination before, so a "stale" / "truncated" destination really is wrong.
    cases = [(kind, src, dst, input_ids(gen)) for kind in FAULT_KINDS for src, dst in directions]
    got = []
    with pxa.attach(model, include_cpu=True):
        for kind, src, dst, ids in cases:
            pyxfer.health.reset()
            with inject_fault(kind, src=src, dst=dst, path="direct") as fault:
                got.append(logits(model, ids))
            assert fault.used == 1, (kind, src, dst)                              # a real copy was hit ...
            assert pyxfer.health.status(src, dst) == "corrupt", (kind, src, dst)  # ... and detected
        # With the pair marked corrupt the next forward routes it staged.
        again = logits(model, cases[-1][3])
    for (kind, src, dst, ids), g in zip(cases, got):
        want = logits(model, ids)  # the unattached split model
        assert want.device.type == "cpu" and torch.equal(g, want), (kind, src, dst)  # repaired
    assert torch.equal(again, got[-1])


@pytest.mark.gpu
def test_cpu_cuda_split_generate_and_current_device_per_block(gen):
    model = split_llama(gen, CPU_CUDA)
    ids = input_ids(gen)
    want = logits(model, ids)
    tokens = model.generate(ids[:1], max_new_tokens=6, do_sample=False)
    names = block_names()
    with pxa.attach(model, include_cpu=True) as attachment:
        assert attachment.blocks == {"": torch.device("cpu"),
                                     **{n: torch.device("cpu" if d == "cpu" else f"cuda:{d}")
                                        for n, d in zip(names, CPU_CUDA)}}
        seen, handles = record_current_devices(model, names)
        got = logits(model, ids)
        for h in handles:
            h.remove()
        assert torch.equal(got, want)
        assert torch.equal(model.generate(ids[:1], max_new_tokens=6, do_sample=False), tokens)
    assert [s[0] for s in seen] == names
    for (name, current, devices), d in zip(seen, CPU_CUDA):
        block_device = torch.device("cpu" if d == "cpu" else f"cuda:{d}")
        assert devices == {block_device}, (name, devices)  # every input arrived before accelerate's hook
        if d != "cpu":
            assert current == d, name
    assert torch.cuda.current_device() == 0


@pytest.mark.gpu
def test_audit_counts_unverified_moves_and_none_once_attached(gen):
    model = split_llama(gen, CPU_CUDA)
    ids = input_ids(gen)
    with pyxfer.audit(model) as plain:
        want = logits(model, ids)
    cuda_blocks = [n for n, d in zip(block_names(), CPU_CUDA) if d != "cpu"]
    moved_in = {m for (m, s, d) in plain.unverified_copies if (s, d) == ("cpu", "cuda:0")}
    moved_out = {m for (m, s, d) in plain.unverified_copies if (s, d) == ("cuda:0", "cpu")}
    assert set(cuda_blocks) <= moved_in, plain   # accelerate's moves into each cuda block ...
    assert moved_out, plain                       # ... and back out, none of them verified
    assert plain.num_pyxfer_copies == 0
    with pxa.attach(model, include_cpu=True), pyxfer.audit(model) as attached:
        got = logits(model, ids)
    assert torch.equal(got, want)
    assert attached.num_unverified_copies == 0, attached
    assert attached.num_pyxfer_copies >= plain.num_unverified_copies
    assert {m for (m, s, d) in attached.pyxfer_copies if (s, d) == ("cpu", "cuda:0")} >= set(cuda_blocks)
    assert attached.num_off_device_ops == plain.num_off_device_ops == 0  # one GPU: always current


@pytest.mark.gpu
def test_deferred_verification_reports_a_fault_at_check_transfers(gen):
    model = split_llama(gen, CPU_CUDA)
    ids = input_ids(gen)
    want = logits(model, ids)
    attachment = pxa.attach(model, verify="deferred", include_cpu=True)
    assert torch.equal(logits(model, ids), want)
    pyxfer.check_transfers()  # nothing wrong so far
    with inject_fault("bitflip", src="cpu", dst="cuda:0", path="direct") as fault:
        logits(model, ids)  # not repaired: deferred mode only detects
    assert fault.used == 1
    with pytest.raises(pyxfer.TransferError, match=r"1 deferred verified copy failed verification; the first: "
                                                  r"copy cpu -> cuda:0"):
        pyxfer.check_transfers()
    attachment.detach()  # its own check_transfers finds nothing more
    assert pyxfer.health.status("cpu", "cuda:0") == "corrupt"


@pytest.mark.gpu
def test_training_through_the_split_with_adapters(gen):
    ref = with_adapters(tiny_llama(gen), gen)
    model = dispatch(clone_model_with_adapters(ref, gen), CPU_CUDA, main_device="cpu").train()
    ids = input_ids(gen)
    want_loss, want = adapter_grads(model, ids)
    with pxa.attach(model, include_cpu=True), pyxfer.audit(model) as report:
        loss, got = adapter_grads(model, ids)
    assert torch.equal(loss, want_loss) and got.keys() == want.keys()
    for n in want:
        assert got[n].device == want[n].device and torch.equal(got[n], want[n]), n
    # Backward's moves are verified copies too; what is left is the model body's own move of the
    # labels to the logits' device in transformers' loss (the audit's point: hooks never see it).
    assert {m for (m, s, d) in report.unverified_copies} <= {type(model).__name__}, report
    assert report.num_pyxfer_copies > 0


@pytest.mark.gpu
def test_forward_raising_in_a_cuda_block_restores_the_current_device(gen):
    from accelerate import dispatch_model

    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    net = dispatch_model(Net(), {"first": "cpu", "boom": 0, "last": "cpu"}, main_device="cpu")
    x = torch.randn(4, 5, generator=gen)
    want = net(x)
    attachment = pxa.attach(net, include_cpu=True)
    net.boom.fail = True
    with pytest.raises(RuntimeError, match="boom inside the block"):
        net(x)
    assert torch.cuda.current_device() == 0 and all(b.stack() == [] for b in attachment._blocks)
    net.boom.fail = False
    assert torch.equal(net(x), want)
    attachment.detach()


# ---- two GPUs ---------------------------------------------------------------------------------------

@pytest.mark.multigpu
@pytest.mark.parametrize("current", [0, 1])
def test_two_gpu_split_current_device_per_block_and_restored(current, gen):
    model = split_llama(gen, TWO_GPUS)
    ids = input_ids(gen).to("cuda:0")
    want = logits(model, ids)
    names = block_names()
    torch.cuda.set_device(current)
    with pxa.attach(model):
        seen, handles = record_current_devices(model, names)
        got = logits(model, ids)
        for h in handles:
            h.remove()
    assert torch.equal(got, want) and torch.cuda.current_device() == current
    for (name, cur, devices), d in zip(seen, TWO_GPUS):
        assert cur == d and devices == {torch.device("cuda", d)}, (name, cur, devices)


@pytest.mark.multigpu
@pytest.mark.parametrize("kind", FAULT_KINDS)
@pytest.mark.parametrize("src,dst", [("cuda:0", "cuda:1"), ("cuda:1", "cuda:0")])
def test_two_gpu_split_peer_faults_are_repaired(kind, src, dst, gen):
    model = split_llama(gen, TWO_GPUS)
    ids = input_ids(gen).to("cuda:0")
    with pxa.attach(model), inject_fault(kind, src=src, dst=dst, path="direct") as fault:
        got = logits(model, ids)  # first: the right bytes were never at the destination before
    assert fault.used == 1 and pyxfer.health.status(src, dst) == "corrupt"
    assert torch.equal(got, logits(model, ids))


@pytest.mark.multigpu
def test_two_gpu_audit_off_device_ops_only_outside_blocks_once_attached(gen):
    model = split_llama(gen, TWO_GPUS)
    ids = input_ids(gen).to("cuda:0")
    with pyxfer.audit(model) as plain:
        want = logits(model, ids)
    assert plain.num_off_device_ops > 0 and plain.num_unverified_copies > 0  # unguarded cuda:1 blocks
    cuda1_blocks = [n for n, d in zip(block_names(), TWO_GPUS) if d == 1]
    with pxa.attach(model), pyxfer.audit(model) as attached:
        got = logits(model, ids)
    assert torch.equal(got, want) and attached.num_unverified_copies == 0
    # Inside every block the data's device is current; what is left runs in the root's body.
    inside = [k for k in attached.off_device_ops if any(k[0] == b or k[0].startswith(b + ".") for b in cuda1_blocks)]
    assert not inside, attached
    assert attached.num_off_device_ops < plain.num_off_device_ops
