"""pyxfer.integrations.accelerate.attach on a dispatched Llama-style decoder, against the same model
unattached, same run.

Model: a Llama-style decoder built offline from a config (random weights; --hidden 1024, --layers 8,
GQA 16/4 heads, vocab 32000, bf16), dispatched by accelerate on cuda:0 with force_hooks=True and one
device_map entry per layer (so every layer is a block with its own AlignDevicesHook, and, attached,
its own pyxfer hooks and device guard). Inputs are given on the CPU: the root hook moves the input
ids to cuda:0 and the logits back to the CPU (io_same_device), across the host link.

Variants (same model object, attached and detached in turn; rounds interleave them so that drift
hits all alike):
- unattached: accelerate's hooks alone (the baseline);
- guard only: attach(include_cpu=False): pyxfer's hooks and guards, host <-> device moves left to .to;
- deferred / sync: attach(verify=..., include_cpu=True): the host <-> device moves are verified copies.

Figures: forward latency (ms, wall clock of model(ids) with all the logits back on the CPU; --batch x
--seq tokens, use_cache=False), the same with the last position's logits only (logits_to_keep=1,
as generate()'s prefill), and generate() throughput (new tokens/s, greedy, --new-tokens with a KV
cache; prefill included), medians of --reps. Targets (on the first and the last): deferred <= 1.03x
and sync <= 1.10x the unattached time (ratios of medians). With include_cpu the logits coming back
are hashed on the host after they land (a CPU destination can only be checked there), in both modes. The logits of every variant are checked bit-identical to the
unattached ones outside the timed region, and the generated tokens identical.

Then the same on a cpu/cuda:0 split (--cpu-layers decoder layers, the embeddings and the rotary
embedding on the CPU, dispatch_model(main_device="cpu"): activations cross the link in the hooks),
reported without a target. Needs one GPU; runs offline (no hub access).

    python benchmarks/integrations.py [--hidden 1024 --layers 8 --batch 1 --seq 128] [--json out.json]
"""
import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_info, print_table, print_targets, write_json  # noqa: E402

import pyxfer  # noqa: E402
from pyxfer.integrations import accelerate as pxa  # noqa: E402

VARIANTS = {  # name -> attach options (None: unattached)
    "unattached": None,
    "guard only": dict(include_cpu=False),
    "deferred": dict(verify="deferred", include_cpu=True),
    "sync": dict(verify="sync", include_cpu=True),
}
TARGETS = {"deferred": 1.03, "sync": 1.10}


def build_model(args, device):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, max_position_embeddings=4096)
    torch.manual_seed(0)
    with torch.device(device):  # initialized on the GPU: seconds, not minutes
        model = LlamaForCausalLM(cfg)
    return model.to(torch.bfloat16).eval()


def per_layer_map(layers, cpu_layers, gpu):
    names = ["model.embed_tokens", "model.rotary_emb"] + [f"model.layers.{i}" for i in range(layers)]
    names += ["model.norm", "lm_head"]
    on_cpu = set()
    if cpu_layers:
        on_cpu = {"model.embed_tokens", "model.rotary_emb"} | {f"model.layers.{i}" for i in range(cpu_layers)}
    return {n: ("cpu" if n in on_cpu else gpu) for n in names}


def dispatched(args, cpu_layers):
    from accelerate import dispatch_model
    model = build_model(args, "cuda:0")
    device_map = per_layer_map(args.layers, cpu_layers, 0)
    return dispatch_model(model, device_map, main_device="cpu" if cpu_layers else 0, force_hooks=True,
                          skip_keys=model._skip_keys_device_placement)


def wall_ms(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def run_variants(model, ids, args, reps, rounds):
    """{variant: {"forward": ms, "forward_last": ms, "generate": s}} (medians), after checking that
    every variant gives the unattached logits and tokens bit for bit."""
    gen_kwargs = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                      pad_token_id=model.config.eos_token_id)

    def forward(**kwargs):
        with torch.no_grad():
            return model(ids, use_cache=False, **kwargs).logits

    def generate():
        with torch.no_grad():
            return model.generate(ids, **gen_kwargs)

    # Correctness first, outside any timed region (and warm-up of every path).
    reference, ref_last, ref_tokens = forward(), forward(logits_to_keep=1), generate()
    for name, options in VARIANTS.items():
        if options is None:
            continue
        with pxa.attach(model, **options):
            same = (torch.equal(forward(), reference) and torch.equal(forward(logits_to_keep=1), ref_last)
                    and torch.equal(generate(), ref_tokens))
        if not same:
            raise SystemExit(f"{name}: logits or tokens differ from the unattached model")
    pyxfer.check_transfers()

    times = {n: {"forward": [], "forward_last": [], "generate": []} for n in VARIANTS}
    order = list(VARIANTS)
    for r in range(rounds):
        for name in order[r % len(order):] + order[:r % len(order)]:  # rotate who goes first
            options = VARIANTS[name]
            attachment = pxa.attach(model, **options) if options is not None else None
            try:
                forward()  # settle after attach
                times[name]["forward"] += [wall_ms(forward) for _ in range(reps)]
                times[name]["forward_last"] += [wall_ms(lambda: forward(logits_to_keep=1)) for _ in range(reps)]
                times[name]["generate"] += [wall_ms(generate) / 1e3 for _ in range(max(1, reps // 4))]
            finally:
                if attachment is not None:
                    attachment.detach()  # deferred: checks the transfers (outside the timing)
    return {n: {k: statistics.median(v) for k, v in t.items()} for n, t in times.items()}


def table(title, results, args, with_targets):
    base = results["unattached"]
    rows, targets = [], []
    for name, r in results.items():
        ratios = {k: r[k] / base[k] for k in r}
        tok_s = args.new_tokens * args.batch / r["generate"]
        rows.append([name, f"{r['forward']:.3f}", f"{ratios['forward']:.3f}", f"{r['forward_last']:.3f}",
                     f"{ratios['forward_last']:.3f}", f"{tok_s:.1f}", f"{ratios['generate']:.3f}"])
        if with_targets and name in TARGETS:
            for what, key in (("forward", "forward"), ("generate()", "generate")):
                targets.append({"target": f"{name} {what} time <= {TARGETS[name]:.2f}x unattached",
                                "measured": f"{ratios[key]:.3f}x",
                                "result": "PASS" if ratios[key] <= TARGETS[name] else "MISS"})
    columns = ["variant", "forward ms", "x", "forward (last logits) ms", "x", "generate tok/s", "time x"]
    print_table(title, columns, rows)
    if targets:
        print_targets(targets)
    keys = ["variant", "forward_ms", "forward_ratio", "forward_last_ms", "forward_last_ratio",
            "generate_tokens_per_s", "generate_time_ratio"]
    return {"rows": [dict(zip(keys, [r[0], *map(float, r[1:])])) for r in rows], "targets": targets}


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
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=20, help="forward calls per variant and round (generate: reps/4)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--cpu-layers", type=int, default=2, help="decoder layers on the CPU in the split (0: skip it)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    if args.hidden < 1024 or args.layers < 8:
        print("note: the targets are stated for hidden >= 1024 and >= 8 layers\n")
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/integrations.py needs a CUDA GPU (none visible)")
    torch.cuda.set_device(0)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)  # on the CPU
    shape = (f"Llama-style decoder, hidden {args.hidden}, {args.layers} layers, bf16, batch {args.batch} x "
             f"{args.seq} tokens, {args.new_tokens} new tokens; {torch.cuda.get_device_name(0)}")
    result = {"machine": machine_info(), "args": vars(args)}

    model = dispatched(args, 0)
    results = run_variants(model, ids, args, args.reps, args.rounds)
    result["cuda0"] = table(f"attach on a model dispatched on cuda:0 (force_hooks, per-layer blocks, inputs on "
                            f"the CPU), medians, same run\n{shape}", results, args, True)
    del model
    torch.cuda.empty_cache()

    if args.cpu_layers:
        model = dispatched(args, args.cpu_layers)
        results = run_variants(model, ids, args, max(2, args.reps // 4), args.rounds)
        result["split"] = table(f"the cpu/cuda:0 split (embeddings and {args.cpu_layers} layers on the CPU, "
                                f"main_device='cpu'), medians, same run, no target\n{shape}", results, args, False)
    write_json(args.json, result)


if __name__ == "__main__":
    main()
