"""Real accelerate / transformers models for the integration tests, built offline from a config, and
small modules of their own (Boom, Net: blocks to dispatch; LoRA adapters to train through).

No hub access: the weights are random (seeded from the test's generator) and, where a test loads
with ``from_pretrained(device_map=...)``, saved to a local directory first.
"""
import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

NUM_LAYERS = 3
VOCAB = 101  # odd on purpose


def llama_config(**overrides):
    from transformers import LlamaConfig
    cfg = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=NUM_LAYERS,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cfg.update(overrides)
    return LlamaConfig(**cfg)


def tiny_llama(gen, dtype=torch.float32, **overrides):
    """A tiny random Llama (eval mode, CPU) whose weights come from ``gen``."""
    from transformers import LlamaForCausalLM
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    return LlamaForCausalLM(llama_config(**overrides)).to(dtype).eval()


def clone_model(model):
    """A second model of the same class and config with the same weights (for dispatching)."""
    other = type(model)(model.config).to(next(model.parameters()).dtype).eval()
    other.load_state_dict(model.state_dict())
    return other


def block_names(num_layers=NUM_LAYERS):
    """The blocks of a device_map with one entry per decoder layer, in execution order."""
    return (["model.embed_tokens", "model.rotary_emb"] + [f"model.layers.{i}" for i in range(num_layers)]
            + ["model.norm", "lm_head"])


def device_map(devices, num_layers=NUM_LAYERS):
    """{block: device} from a list with one device per block_names() entry (or one for all)."""
    names = block_names(num_layers)
    if not isinstance(devices, (list, tuple)):
        devices = [devices] * len(names)
    assert len(devices) == len(names)
    return dict(zip(names, devices))


def dispatch(model, devices, **kwargs):
    """accelerate.dispatch_model with a per-block device_map and the model's skip_keys (as
    transformers' from_pretrained does)."""
    from accelerate import dispatch_model
    kwargs.setdefault("skip_keys", model._skip_keys_device_placement)
    return dispatch_model(model, device_map(devices, model.config.num_hidden_layers), **kwargs)


def input_ids(gen, batch=2, length=11, vocab=VOCAB):
    return torch.randint(0, vocab, (batch, length), generator=gen)


def _align_fields(hook):
    if hook is None:
        return None
    hooks = getattr(hook, "hooks", (hook,))  # a SequentialHook's, or the hook itself
    return [(type(h).__name__, str(getattr(h, "execution_device", None)), getattr(h, "io_same_device", None),
             getattr(h, "skip_keys", None), getattr(h, "offload", None)) for h in hooks]


def hook_state(model):
    """Everything attach/detach may touch, per module, to compare before and after: the module hook
    dicts (by key and hook object), the forward attribute, accelerate's hook and the parameters."""
    state = {}
    for name, m in model.named_modules():
        state[name] = (
            [(k, id(v)) for k, v in m._forward_pre_hooks.items()],
            [(k, id(v)) for k, v in m._forward_hooks.items()],
            sorted(m._forward_pre_hooks_with_kwargs), sorted(m._forward_hooks_with_kwargs),
            sorted(m._forward_hooks_always_called),
            id(m.__dict__.get("forward")), id(getattr(m, "_hf_hook", None)), id(getattr(m, "_old_forward", None)),
            _align_fields(getattr(m, "_hf_hook", None)),
            [(n, id(p)) for n, p in m.named_parameters(recurse=False)],
        )
    return state


class Boom(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(6, 6)
        self.fail = False
        self.error = RuntimeError  # what it raises when it fails

    def forward(self, x, scale=None):
        if self.fail:
            raise self.error("boom inside the block")
        return self.linear(x) * (1 if scale is None else scale)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(5, 6)
        self.boom = Boom()
        self.last = torch.nn.Linear(6, 3)

    def forward(self, x):
        return self.last(self.boom(self.first(x), scale=torch.tensor(2.0)))


class LoRA(torch.nn.Module):
    """A PEFT-style low-rank adapter around a frozen Linear."""

    def __init__(self, base, rank, gen):
        super().__init__()
        self.base = base
        self.a = torch.nn.Parameter(torch.randn(rank, base.in_features, generator=gen) * 0.1)
        self.b = torch.nn.Parameter(torch.randn(base.out_features, rank, generator=gen) * 0.1)

    def forward(self, x):
        return self.base(x) + x @ self.a.t() @ self.b.t()


def with_adapters(model, gen):
    for layer in model.model.layers:
        layer.self_attn.q_proj = LoRA(layer.self_attn.q_proj, 3, gen)
        layer.self_attn.v_proj = LoRA(layer.self_attn.v_proj, 3, gen)
    for name, p in model.named_parameters():
        p.requires_grad_(name.endswith((".a", ".b")))
    return model


def adapter_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def clone_model_with_adapters(ref, gen):
    other = with_adapters(type(ref)(ref.config).eval(), gen)
    other.load_state_dict(ref.state_dict())
    return other
