"""pyxfer.integrations.accelerate.attach on a dispatched Llama-style decoder, against the same model
unattached, same run.

Model: a Llama-style decoder built offline from a config (random weights; --hidden 1024, --layers 8,
GQA 16/4 heads, vocab 32000, bf16), dispatched by accelerate on cuda:0 with force_hooks=True and one
device_map entry per layer (so every layer is a block with its own AlignDevicesHook, and, attached,
its own pyxfer hooks and device guard). Inputs are given on the CPU: the root hook moves the input
ids to cuda:0 and the logits back to the CPU (io_same_device), across the host link.

Variants, each its own dispatched copy of the same weights (attached once, for the whole run):
- unattached: accelerate's hooks alone (the baseline);
- guard only: attach(include_cpu=False): pyxfer's hooks and guards, host <-> device moves left to .to
  (on the cuda:0/cuda:1 split the moves between the GPUs are still verified copies, sync: include_cpu
  concerns host moves only);
- deferred / sync: attach(verify=..., include_cpu=True): the host <-> device moves are verified copies.

Method: --rounds rounds (fewer when --budget-s runs out first, at least --min-rounds). In each round
every variant runs --reps forward calls, interleaved call by call, then one generate() call each; the
order of the variants rotates from call to call, so that drift, clock changes and order effects land
on all of them alike. Each call is timed by the wall clock from a synchronized device to all its
results back on the CPU, with Python's garbage collector off inside the timed call (as timeit does;
collected between rounds). A round's figure of a variant is the median of its calls in that round,
and its ratio is taken against the unattached model's figure of the same round; the table gives the
median of those per-round ratios with their spread (the quartiles, over the rounds), and the median
time. Figures: forward latency (model(ids) with all the logits back on the CPU; --batch x --seq
tokens, use_cache=False); the same with the last position's logits only (logits_to_keep=1, as
generate()'s prefill); generate() throughput (new tokens/s, greedy, --new-tokens with a KV cache,
prefill included). Targets, on the median per-round ratio of forward and of generate() time:
deferred <= 1.03x and sync <= 1.10x. The logits of every variant are checked bit-identical to the
unattached ones and the generated tokens identical, outside the timed region; deferred mismatches are
checked (pyxfer.check_transfers) after every round, outside the timing.

With include_cpu the logits coming back are hashed on the host after they land (a CPU destination
can only be checked there), in both modes: the run prints what pyxfer.checksum of the full logits
costs on this host's CPU, next to the unattached forward time.

Then the same on a cpu/cuda:0 split (--cpu-layers decoder layers, the embeddings and the rotary
embedding on the CPU, dispatch_model(main_device="cpu"): activations cross the link in the hooks),
reported without a target (--reps/2 calls per round, --split-budget-s, at least 3 rounds). Where two
GPUs are visible, last the cuda:0/cuda:1 split (the second half of the layers, the norm and lm_head on
cuda:1, inputs on cuda:0; activations and logits cross the peer link in the hooks), with the same
targets (--no-gpu-split skips it). Needs one GPU; runs offline (no hub access); about 2 minutes
(3 with two GPUs).

    python benchmarks/integrations.py [--hidden 1024 --layers 8 --batch 1 --seq 128] [--json out.json]

--host: no GPU needed. pyxfer's own host time per hooked block call, on the CPU: a tiny Llama
(hidden 64, --layers layers, float32) dispatched on the CPU by accelerate (force_hooks, per-layer
blocks), attach(verify="deferred", include_cpu=True). For each block, one real call's arguments,
keyword arguments and output are recorded, then the hooks are timed on them as Module.__call__ calls
them (through their torch.compiler.disable wrappers): "as attached", the hooks attach registered
here (a CPU block gets the pre-hook alone, the root both); "paired", pre-hook + forward hook as on a
CUDA execution device. Covered: the wrappers, the thread-local call stack, the structure walk of
args/kwargs (every tensor already on the execution device, so no copy is made), the root's
find_device and its move of the ModelOutput back (accelerate's own, which it skips while attached,
is printed beside it). Not covered: the device switch of the guard (two C calls on a GPU), the
copies, torch's hook dispatch (in the end-to-end figure that follows: the attached model's forward
against an unattached copy, interleaved; noisy on a busy machine, see its quartiles). Last,
pyxfer.checksum of a (--batch * --seq x --vocab) bf16 logits tensor on the CPU.

    python benchmarks/integrations.py --host [--json out.json]
"""
import argparse
import copy
import gc
import logging
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pyxfer  # noqa: E402
from pyxfer.integrations import accelerate as pxa  # noqa: E402
from pyxfer.tools.machine import machine_info  # noqa: E402
from pyxfer.tools.timing import cpu_samples  # noqa: E402

from common import print_table, print_targets, write_json  # noqa: E402

# accelerate warns "offloaded to the cpu" for every map with a CPU block; with main_device="cpu"
# (as dispatched here) they execute there and nothing is offloaded.
logging.getLogger("accelerate.big_modeling").setLevel(logging.ERROR)

BASELINE = "unattached"
VARIANTS = {  # name -> attach options (None: unattached)
    BASELINE: None,
    "guard only": dict(include_cpu=False),
    "deferred": dict(verify="deferred", include_cpu=True),
    "sync": dict(verify="sync", include_cpu=True),
}
TARGETS = {"deferred": 1.03, "sync": 1.10}
KINDS = ("forward", "forward_last", "generate")


def llama(args, device, dtype, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
               num_hidden_layers=args.layers, num_attention_heads=args.heads,
               num_key_value_heads=args.kv_heads, max_position_embeddings=4096)
    cfg.update(overrides)
    torch.manual_seed(0)
    with torch.device(device):  # initialized where it runs: seconds, not minutes, for the GPU model
        model = LlamaForCausalLM(LlamaConfig(**cfg))
    return model.to(dtype).eval()


def per_layer_map(layers, cpu_layers, gpu, second_gpu=None):
    """One entry per block; with second_gpu, the second half of the layers, the norm and lm_head there."""
    names = ["model.embed_tokens", "model.rotary_emb"] + [f"model.layers.{i}" for i in range(layers)]
    names += ["model.norm", "lm_head"]
    on_cpu = set(names) if gpu == "cpu" else set()
    if cpu_layers:
        on_cpu = {"model.embed_tokens", "model.rotary_emb"} | {f"model.layers.{i}" for i in range(cpu_layers)}
    on_second = set()
    if second_gpu is not None:
        on_second = {f"model.layers.{i}" for i in range(layers // 2, layers)} | {"model.norm", "lm_head"}
    return {n: ("cpu" if n in on_cpu else second_gpu if n in on_second else gpu) for n in names}


def dispatch(model, layers, cpu_layers, gpu, second_gpu=None):
    """The model dispatched by accelerate with per-layer blocks, executing where its map says (no
    offload: main_device is the CPU when any block is there)."""
    from accelerate import dispatch_model
    main_device = "cpu" if cpu_layers or gpu == "cpu" else gpu
    return dispatch_model(model, per_layer_map(layers, cpu_layers, gpu, second_gpu), main_device=main_device,
                          force_hooks=True, skip_keys=model._skip_keys_device_placement)


def dispatched_copies(args, cpu_layers, second_gpu=None):
    """{variant: a dispatched copy of one model (same weights), attached with its options}."""
    base = llama(args, "cuda:0", torch.bfloat16)
    models = {}
    for name, options in VARIANTS.items():
        models[name] = dispatch(copy.deepcopy(base), args.layers, cpu_layers, 0, second_gpu)
        if options is not None:
            pxa.attach(models[name], **options)
    del base
    return models


def detach_all(models):
    for model in models.values():
        pxa.detach(model)  # deferred: checks its transfers


def sync_all():
    for i in range(torch.cuda.device_count()):
        torch.cuda.synchronize(i)


def timed_s(fn, sync):
    """Wall seconds of fn() from a synchronized device to its end (``sync`` after it), with the
    garbage collector off inside (collected between rounds)."""
    sync()
    gc.disable()
    try:
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0
    finally:
        gc.enable()


def rotated(names, k):
    k %= len(names)
    return names[k:] + names[:k]


def run_rounds(models, ids, args, *, reps, budget_s, min_rounds, sync):
    """{kind: {variant: [seconds per round]}} and the number of rounds, after checking that every
    variant gives the baseline's logits and tokens bit for bit."""
    gen_kwargs = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)

    def calls(model):
        pad = dict(pad_token_id=model.config.eos_token_id)

        def forward():
            with torch.no_grad():
                return model(ids, use_cache=False).logits

        def forward_last():
            with torch.no_grad():
                return model(ids, use_cache=False, logits_to_keep=1).logits

        def generate():
            with torch.no_grad():
                return model.generate(ids, **gen_kwargs, **pad)
        return {"forward": forward, "forward_last": forward_last, "generate": generate}

    fns = {name: calls(model) for name, model in models.items()}
    names = list(models)
    # Correctness first, outside any timed region (and the warm-up of every path).
    reference = {kind: fn() for kind, fn in fns[BASELINE].items()}
    for name in names[1:]:
        for kind, fn in fns[name].items():
            if not torch.equal(fn(), reference[kind]):
                raise SystemExit(f"{name}: {kind} differs from the unattached model's")
    pyxfer.check_transfers()

    times = {kind: {n: [] for n in names} for kind in KINDS}
    start, rounds, k = time.perf_counter(), 0, 0
    while rounds < args.rounds:
        gc.collect()
        for kind in KINDS:
            per_call = {n: [] for n in names}
            for _ in range(reps if kind != "generate" else 1):
                for n in rotated(names, k):
                    per_call[n].append(timed_s(fns[n][kind], sync))
                k += 1
            for n in names:
                times[kind][n].append(statistics.median(per_call[n]))
        pyxfer.check_transfers()  # deferred mismatches of this round, outside the timing
        rounds += 1
        if rounds >= min_rounds and time.perf_counter() - start > budget_s:
            break
    return times, rounds


def spread(values):
    """(median, first quartile, third quartile) of ``values``."""
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return statistics.median(values), q1, q3


def table(title, times, rounds, args, with_targets):
    rows, targets, data = [], [], []
    for name in times["forward"]:
        cells, entry = [name], {"variant": name}
        for kind in KINDS:
            base = times[kind][BASELINE]
            ratios = [t / b for t, b in zip(times[kind][name], base)]
            med, q1, q3 = spread(ratios)
            seconds = statistics.median(times[kind][name])
            if kind == "generate":
                tok_s = args.new_tokens * args.batch / seconds
                cells.append(f"{tok_s:.1f}")
                entry["generate_tokens_per_s"] = tok_s
            else:
                cells.append(f"{seconds * 1e3:.3f}")
                entry[f"{kind}_ms"] = seconds * 1e3
            cells.append(f"{med:.3f} [{q1:.3f}, {q3:.3f}]")
            entry[f"{kind}_ratio"] = {"median": med, "q1": q1, "q3": q3, "per_round": ratios}
            if with_targets and name in TARGETS and kind != "forward_last":
                what = "forward" if kind == "forward" else "generate()"
                targets.append({"target": f"{name} {what} time <= {TARGETS[name]:.2f}x unattached "
                                          f"(median of {rounds} per-round ratios)",
                                "measured": f"{med:.3f}x [{q1:.3f}, {q3:.3f}]",
                                "result": "PASS" if med <= TARGETS[name] else "MISS"})
        rows.append(cells)
        data.append(entry)
    columns = ["variant", "forward ms", "x [q1, q3]", "forward (last logits) ms", "x [q1, q3]",
               "generate tok/s", "time x [q1, q3]"]
    print_table(f"{title}\nms and tok/s: medians over the rounds; x: median of the per-round ratios against the "
                f"unattached model of the same round [quartiles], {rounds} rounds", columns, rows)
    if targets:
        print_targets(targets)
    return {"rounds": rounds, "rows": data, "targets": targets}


def logits_checksum(args):
    """pyxfer.checksum of a (batch*seq x vocab) bf16 CPU tensor, what include_cpu hashes on the host
    for the logits coming back: Samples (ms) and the tensor's bytes."""
    logits = torch.randn(args.batch * args.seq, args.vocab).to(torch.bfloat16)
    return cpu_samples(pyxfer.checksum, logits, warmup=2, reps=15), logits.nbytes


def gpu_main(args):
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/integrations.py needs a CUDA GPU (none visible); --host runs on the CPU")
    if args.hidden < 1024 or args.layers < 8:
        print("note: the targets are stated for hidden >= 1024 and >= 8 layers\n")
    torch.cuda.set_device(0)
    started = time.perf_counter()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)  # on the CPU
    shape = (f"Llama-style decoder, hidden {args.hidden}, {args.layers} layers, bf16, batch {args.batch} x "
             f"{args.seq} tokens, {args.new_tokens} new tokens; {torch.cuda.get_device_name(0)}")
    result = {"machine": machine_info(), "args": vars(args)}

    models = dispatched_copies(args, 0)
    times, rounds = run_rounds(models, ids, args, reps=args.reps, budget_s=args.budget_s,
                               min_rounds=args.min_rounds, sync=torch.cuda.synchronize)
    detach_all(models)
    result["cuda0"] = table(f"attach on a model dispatched on cuda:0 (force_hooks, per-layer blocks, inputs on "
                            f"the CPU), same run\n{shape}", times, rounds, args, True)
    del models
    torch.cuda.empty_cache()

    hashed, nbytes = logits_checksum(args)
    forward_ms = statistics.median(times["forward"][BASELINE]) * 1e3
    print(f"include_cpu hashes the logits coming back on the host: pyxfer.checksum of {nbytes / 2**20:.1f} MiB "
          f"({args.batch * args.seq} x {args.vocab} bf16) on this CPU: {hashed.median_ms:.3f} ms (min "
          f"{hashed.min_ms:.3f}) = {hashed.median_ms / forward_ms:.3f}x of the unattached forward's "
          f"{forward_ms:.3f} ms (the deferred target leaves {0.03 * forward_ms:.3f} ms)\n")
    result["logits_checksum"] = {"bytes": nbytes, **hashed.as_dict(), "unattached_forward_ms": forward_ms}

    if args.cpu_layers:
        models = dispatched_copies(args, args.cpu_layers)
        times, rounds = run_rounds(models, ids, args, reps=max(2, args.reps // 2), budget_s=args.split_budget_s,
                                   min_rounds=min(3, args.min_rounds), sync=torch.cuda.synchronize)
        detach_all(models)
        result["split"] = table(f"the cpu/cuda:0 split (embeddings and {args.cpu_layers} layers on the CPU, "
                                f"main_device='cpu'), same run, no target\n{shape}", times, rounds, args, False)
        del models
    if torch.cuda.device_count() >= 2 and args.gpu_split:
        # The 2-GPU split: activations cross the peer link in the hooks, and the logits come back
        # from cuda:1 to the inputs' device, cuda:0 (io_same_device).
        models = dispatched_copies(args, 0, second_gpu=1)
        times, rounds = run_rounds(models, ids.to("cuda:0"), args, reps=args.reps, budget_s=args.budget_s,
                                   min_rounds=args.min_rounds, sync=sync_all)
        detach_all(models)
        result["gpu_split"] = table(f"the cuda:0/cuda:1 split (layers {args.layers // 2}.. , norm and lm_head on "
                                    f"cuda:1, inputs on cuda:0), same run\n{shape}", times, rounds, args, True)
        del models
    elif args.gpu_split:
        print("the cuda:0/cuda:1 split needs 2 GPUs: skipped\n")
    print(f"total {time.perf_counter() - started:.0f} s")
    write_json(args.json, result)


# ---- --host: pyxfer's host time per hooked call, on the CPU ------------------------------------------

def record_calls(model, names):
    """{block name: (module, args, kwargs, output)} of the first call of each block in one forward,
    as module hooks see them."""
    seen, handles = {}, []
    for name in names:
        module = model.get_submodule(name) if name else model

        def pre(mod, a, k, name=name):
            seen.setdefault(name, [mod, a, k, None])

        def post(mod, a, k, out, name=name):
            if seen[name][3] is None:
                seen[name][3] = out
        handles += [module.register_forward_pre_hook(pre, with_kwargs=True, prepend=True),
                    module.register_forward_hook(post, with_kwargs=True)]
    return seen, handles


def added_hooks(module, pre_before, post_before):
    """The (pre-hook, forward hook or None) that attach registered on ``module``."""
    pre = [h for k, h in module._forward_pre_hooks.items() if k not in pre_before]
    post = [h for k, h in module._forward_hooks.items() if k not in post_before]
    assert len(pre) == 1 and len(post) <= 1, (pre, post)
    return pre[0], (post[0] if post else None)


def hooked_call(module, a, k, out, pre, post):
    """One call of a block's hooks as Module.__call__ makes it (the forward itself left out)."""
    def call(_):
        moved = pre(module, a, k)
        if post is not None:
            if moved is not None:
                post(module, moved[0], moved[1], out)
            else:
                post(module, a, k, out)
    return call


def host_main(args):
    torch.set_num_threads(1)  # the host time of one Python thread; keeps the tiny model's forward steady
    micro = argparse.Namespace(**{**vars(args), "hidden": 64, "intermediate": 128, "heads": 4, "kv_heads": 2,
                                  "vocab": 1000})
    unattached = dispatch(llama(micro, "cpu", torch.float32), args.layers, 0, "cpu")
    attached = dispatch(llama(micro, "cpu", torch.float32), args.layers, 0, "cpu")
    ids = torch.randint(0, micro.vocab, (1, 16), generator=torch.Generator().manual_seed(1))
    names = [""] + list(attached.hf_device_map)
    modules = {n: attached.get_submodule(n) if n else attached for n in names}
    assert not any(getattr(m._hf_hook, "offload", False) for m in modules.values() if hasattr(m, "_hf_hook"))

    seen, handles = record_calls(attached, names)
    with torch.no_grad():
        attached(ids)
    for h in handles:
        h.remove()
    before = {n: (set(m._forward_pre_hooks), set(m._forward_hooks)) for n, m in modules.items()}
    options = dict(verify="deferred", include_cpu=True)
    attachment = pxa.attach(attached, **options)
    hooks = {n: added_hooks(modules[n], *before[n]) for n in names}
    # NOTE: on a CUDA execution device every block gets both hooks (its guard is left after the
    # forward); here only the root does. The blocks' own paired path is timed too, through the same
    # wrappers, without the device switch (two C calls on a GPU).
    blocks = {b.name: b for b in attachment._blocks}
    paired = {n: (torch.compiler.disable(blocks[n].pre_forward), torch.compiler.disable(blocks[n].post_forward))
              for n in names}

    groups = {"(root)": [""], "model.embed_tokens": ["model.embed_tokens"], "model.rotary_emb": ["model.rotary_emb"],
              "model.layers.* (decoder layer)": [f"model.layers.{i}" for i in range(args.layers)],
              "model.norm": ["model.norm"], "lm_head": ["lm_head"]}
    rows, data = [], []
    total = {"attached": [0.0, 0.0], "paired": [0.0, 0.0]}  # [min, median] us per forward
    for label, members in groups.items():
        name = members[0]
        row, entry = [label, len(members)], {"block": label, "calls_per_forward": len(members)}
        for what, (pre, post) in (("attached", hooks[name]), ("paired", paired[name])):
            s = cpu_samples(hooked_call(*seen[name], pre, post), None, warmup=200, reps=args.host_reps, inner=2000)
            total[what][0] += s.min_ms * 1e3 * len(members)
            total[what][1] += s.median_ms * 1e3 * len(members)
            row += [f"{s.min_ms * 1e3:.2f}", f"{s.median_ms * 1e3:.2f}"]
            entry[what] = {"us_min": s.min_ms * 1e3, "us_median": s.median_ms * 1e3,
                           "hooks": 1 if what == "attached" and post is None else 2}
        rows.append(row)
        data.append(entry)
    calls = sum(len(m) for m in groups.values())
    rows.append(["per forward", calls] + [f"{v:.1f}" for what in total for v in total[what]])
    attach_args = ", ".join(f"{k}={v!r}" for k, v in options.items())
    print_table(f"pyxfer's host time per hooked call (its hooks on one recorded real call, {args.host_reps} x 2000 "
                f"calls), CPU, torch {torch.__version__}, one thread\ntiny Llama, {args.layers} layers, dispatched "
                f"on the CPU (force_hooks, per-layer blocks), attach({attach_args})"
                f"\nas attached: the hooks attach registered here; paired: pre-hook + forward hook as on a CUDA "
                f"execution device, device switch excluded", ["block", "calls/forward", "as attached us (min)",
                                                              "(median)", "paired us (min)", "(median)"], rows)
    result = {"machine": machine_info(), "args": vars(args), "hooks": data,
              "per_forward_us": {what: {"min": v[0], "median": v[1]} for what, v in total.items()}, "calls": calls}

    # What accelerate's root hook no longer does while attached (its io_same_device is off: pyxfer
    # finds the inputs' device and moves the outputs back instead).
    from accelerate.utils import find_device, send_to_device
    _, a, k, out = seen[""]
    skip = modules[""]._hf_hook.skip_keys
    s = cpu_samples(lambda _: send_to_device(out, find_device([a, k]), skip_keys=skip), None, warmup=200,
                    reps=args.host_reps, inner=2000)
    print(f"of the root's figure, accelerate no longer does its own io_same_device work while attached (find_device + "
          f"send_to_device of the output): {s.min_ms * 1e3:.2f} us (min), {s.median_ms * 1e3:.2f} us (median)\n")
    result["root_accelerate_io_same_device_us"] = {"min": s.min_ms * 1e3, "median": s.median_ms * 1e3}

    # End to end: attached forward against the unattached copy, interleaved call by call.
    def forward(model):
        def call():
            with torch.no_grad():
                return model(ids).logits
        return call
    fns = {"unattached": forward(unattached), "attached": forward(attached)}
    if not torch.equal(fns["unattached"](), fns["attached"]()):
        raise SystemExit("the attached model's logits differ from the unattached copy's")
    deltas = []
    for _ in range(args.host_rounds):
        gc.collect()
        per = {n: [] for n in fns}
        for i in range(10):
            for n in rotated(list(fns), i):
                per[n].append(timed_s(fns[n], lambda: None))
        deltas.append((statistics.median(per["attached"]) - statistics.median(per["unattached"])) * 1e6)
    base_ms = statistics.median(per["unattached"]) * 1e3
    med, q1, q3 = spread(deltas)
    print(f"end to end: forward attached - unattached (interleaved, median of {args.host_rounds} rounds of 10 "
          f"calls each): {med:+.1f} us [{q1:+.1f}, {q3:+.1f}] per forward of ~{base_ms:.2f} ms = {med / calls:+.2f} us "
          f"per hooked call (includes torch's hook dispatch)\n")
    result["end_to_end_us"] = {"median": med, "q1": q1, "q3": q3, "per_call": med / calls, "forward_ms": base_ms}
    attachment.detach()

    hashed, nbytes = logits_checksum(args)
    print(f"pyxfer.checksum of {args.batch * args.seq} x {args.vocab} bf16 logits ({nbytes / 2**20:.1f} MiB) on the "
          f"CPU: {hashed.median_ms:.3f} ms median, {hashed.min_ms:.3f} ms min ({nbytes / hashed.min_ms / 1e6:.1f} GB/s)"
          f"; include_cpu does it on the host before the root's forward returns, in both verify modes")
    result["logits_checksum"] = {"bytes": nbytes, **hashed.as_dict()}
    write_json(args.json, result)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=128, help="prompt tokens")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--reps", type=int, default=5, help="forward calls per variant and round (generate: 1)")
    p.add_argument("--rounds", type=int, default=40, help="at most this many rounds")
    p.add_argument("--min-rounds", type=int, default=6, help="at least this many rounds, whatever the budget")
    p.add_argument("--budget-s", type=float, default=60, help="no new round after this many seconds (cuda:0)")
    p.add_argument("--split-budget-s", type=float, default=15,
                   help="the same for the cpu/cuda:0 split (at least 3 rounds there)")
    p.add_argument("--cpu-layers", type=int, default=2, help="decoder layers on the CPU in the split (0: skip it)")
    p.add_argument("--no-gpu-split", dest="gpu_split", action="store_false",
                   help="skip the cuda:0/cuda:1 split (run where 2 GPUs are visible)")
    p.add_argument("--host", action="store_true", help="pyxfer's host time per hooked call, on the CPU (no GPU)")
    p.add_argument("--host-reps", type=int, default=15, help="--host: timed batches of 2000 hooked calls per block")
    p.add_argument("--host-rounds", type=int, default=15, help="--host: rounds of the end-to-end forward")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    host_main(args) if args.host else gpu_main(args)


if __name__ == "__main__":
    main()
