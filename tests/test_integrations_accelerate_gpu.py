"""pyxfer.integrations.accelerate.attach on GPUs: what a CPU cannot show of the root's output hook
(the logits come back to the inputs' device with guard=False and with a CPU root, while accelerate's
own io_same_device is off) and of an interrupt inside a block (the guard's previous device restored)."""
import pytest
import torch

from pyxfer.integrations import accelerate as pxa

pytest.importorskip("accelerate", reason="the integration tests need accelerate (pip install '.[test]')")
pytest.importorskip("transformers", reason="the integration tests need transformers (pip install '.[test]')")
from accelerate import dispatch_model  # noqa: E402

from integrations_models import clone_model, dispatch, input_ids, tiny_llama  # noqa: E402

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
