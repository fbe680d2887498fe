"""Quantize / dequantize throughput of every pyxfer.formats format and usage against a device-to-device
copy of the same input, measured in the same run.

GPU (--device, default cuda:0): CUDA events on its current stream, warm-up, median of 20, the stream
held by a spin kernel while the host issues the timed call (pyxfer.tools.timing.cuda_times, as nvbench's blocking
kernel): the times are the GPU's work for a call issued ahead of it, as in a model's stream, and the
host's time to issue one call is its own column ("host us"). Inputs are random (randn) of --dtype
(default bfloat16; the sizes below are bf16's) and shapes 1024x8192 (16 MiB), 8192x16384 (256 MiB)
and 16384x32768 (1 GiB), rotated over >= 256 MiB so that small sizes are not served from L2. Per
format (fp8_block_1x128, fp8_block_128x128, mxfp8, nvfp4) and usage:
- quantize: pyxfer.formats.quantize(x, fmt, rowwise=..., columnwise=...), usages rowwise, columnwise
  and both. NVFP4 gets its global amax as a tensor computed once beforehand (finding it is one more
  read of x, TE fuses it elsewhere). GB/s = (bytes of x read + bytes of the data and scale buffers
  written) / time. One more NVFP4 row, direction "quantize+amax": rowwise with the global amax found
  in the call (formats.quantize's default, formats.global_amax: one more read of x), same byte
  accounting (so it shows what finding the amax costs; not a target row).
- dequantize: qt.dequantize(usage=...) to the input dtype, from the rowwise and from the columnwise
  buffers (one usage is decoded per call, so "both" has no dequantize row). GB/s = (bytes of that
  usage's data and scales read + bytes of the result written) / time.
- copy (the baseline): dst.copy_(x) of the input, GB/s = (bytes read + bytes written) / time =
  2 x input bytes / time. "% copy" = GB/s / copy GB/s of the same input size. Target: >= 75% at
  >= 256 MiB for every format, usage and direction.
- "op GB/s": the native op alone (torch.ops.pyxfer.quantize_* / dequantize_*, no Python wrapper), same
  byte accounting; "host us" / "op host us": the host's time to issue one public / native call.
After timing, outside the timed region: per format and usage, a 256x1024 slice of the input is
quantized on the GPU and on the CPU and every buffer, and the dequantized values, compared bitwise
(a sanity check; the tests do the full comparison).
--cpu: also CPU numbers (torch.get_num_threads() threads) for --cpu-shapes, against a CPU copy_.

    python benchmarks/formats.py [--device cuda:0] [--shapes 1024x8192,8192x16384,16384x32768]
                                 [--dtype bfloat16|float16|float32]
                                 [--cpu [--cpu-shapes 1024x8192]] [--json out.json]
"""
import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pyxfer import formats  # noqa: E402
from pyxfer.tools.timing import L2_DEFEAT_BYTES, cpu_time_ms, cuda_times, fmt_gbps, fmt_size  # noqa: E402

from common import print_table, print_targets, write_json  # noqa: E402

MiB = 1 << 20
FP8 = torch.float8_e4m3fn
USAGES = {"rowwise": (True, False), "columnwise": (False, True), "both": (True, True)}
DEQUANT_USAGES = ("rowwise", "columnwise")
TARGET_BYTES = 256 * MiB
TARGET_FRACTION = 0.75
CHECK_SHAPE = (256, 1024)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_shapes(text):
    try:
        shapes = [tuple(int(d) for d in s.lower().split("x")) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of shapes: {text!r} (e.g. 1024x8192,8192x16384)") from None
    if any(len(s) != 2 or min(s) < 1 for s in shapes):
        raise argparse.ArgumentTypeError(f"shapes must be MxK with M, K >= 1, got {text!r}")
    return shapes


def nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def written_bytes(qt):
    """Bytes of the data and scale buffers a quantize writes (the NVFP4 amax, 4 bytes, not counted)."""
    return nbytes(getattr(qt, name) for name in formats.BUFFER_NAMES if getattr(qt, name) is not None)


def usage_bytes(qt, usage):
    return nbytes([getattr(qt, f"{usage}_data"), getattr(qt, f"{usage}_scale_inv")])


def quantize_call(fmt, usage, amax):
    """(public call, native op call) quantizing x into fmt with the usage; amax: NVFP4's global amax tensor."""
    row, col = USAGES[usage]
    options = {"global_amax": amax} if fmt == "nvfp4" else {}
    api = lambda x: formats.quantize(x, fmt, rowwise=row, columnwise=col, **options)  # noqa: E731
    if fmt == "mxfp8":
        op = lambda x: torch.ops.pyxfer.quantize_mxfp8(x, row, col, FP8)  # noqa: E731
    elif fmt == "nvfp4":
        op = lambda x: torch.ops.pyxfer.quantize_nvfp4(x, amax, row, col)  # noqa: E731
    else:
        block_dim = 1 if fmt == "fp8_block_1x128" else 2
        op = lambda x: torch.ops.pyxfer.quantize_fp8_block(x, block_dim, row, col, FP8, True, 0.0)  # noqa: E731
    return api, op


def dequantize_call(fmt, usage, dtype):
    """(public call, native op call) decoding a QuantizedTensor's usage to dtype."""
    col = usage == "columnwise"
    api = lambda q: q.dequantize(dtype, usage=usage)  # noqa: E731
    if fmt == "mxfp8":
        op = lambda q: torch.ops.pyxfer.dequantize_mxfp8(  # noqa: E731
            getattr(q, f"{usage}_data"), getattr(q, f"{usage}_scale_inv"), col, FP8, dtype)
    elif fmt == "nvfp4":
        op = lambda q: torch.ops.pyxfer.dequantize_nvfp4(  # noqa: E731
            getattr(q, f"{usage}_data"), getattr(q, f"{usage}_scale_inv"), getattr(q, f"amax_{usage}"), col, dtype)
    else:
        op = lambda q: torch.ops.pyxfer.dequantize_fp8_block(  # noqa: E731
            getattr(q, f"{usage}_data"), getattr(q, f"{usage}_scale_inv"), q.block_dim, col, FP8, dtype)
    return api, op


def same_bits(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def check_against_cpu(x, fmt, usage):
    """Quantize a small slice of x on its device and on the CPU: every buffer and the decoded values bitwise."""
    part = x[:CHECK_SHAPE[0], :CHECK_SHAPE[1]]
    row, col = USAGES[usage]
    amax = float(part.float().abs().amax())
    options = {"global_amax": amax} if fmt == "nvfp4" else {}
    q_dev = formats.quantize(part, fmt, rowwise=row, columnwise=col, **options)
    q_cpu = formats.quantize(part.cpu(), fmt, rowwise=row, columnwise=col, **options)
    for name, buf in q_cpu.buffers().items():
        if not same_bits(q_dev.buffers()[name].cpu(), buf):
            raise AssertionError(f"{fmt} {usage}: {name} on {x.device} differs from the CPU's")
    for u in DEQUANT_USAGES:
        held = USAGES[usage][u == "columnwise"]
        if held and not same_bits(q_dev.dequantize(usage=u).cpu(), q_cpu.dequantize(usage=u)):
            raise AssertionError(f"{fmt} {usage}: dequantize(usage={u!r}) on {x.device} differs from the CPU's")


def measure(shape, device, timer, dtype):
    """Rows for one input shape: the copy baseline, then quantize and dequantize for every format and usage."""
    size = shape[0] * shape[1] * dtype.itemsize
    count = max(1, math.ceil(L2_DEFEAT_BYTES / size)) if device.type == "cuda" and size < L2_DEFEAT_BYTES else 1
    inputs = [torch.randn(shape, dtype=dtype, device=device) for _ in range(count)]
    amaxes = [formats.global_amax(x) for x in inputs]
    dst = torch.empty_like(inputs[0])
    copy_ms, _ = timer(dst.copy_, inputs)
    copy_gbps = 2 * size / copy_ms / 1e6
    base = {"shape": list(shape), "bytes": size, "copy_ms": copy_ms, "copy_gbps": copy_gbps}
    rows = []

    def add(fmt, usage, direction, moved, api, op):  # api, op: (ms, host ms) of the public call, the native op
        gbps = moved / api[0] / 1e6
        rows.append({**base, "format": fmt, "usage": usage, "direction": direction, "bytes_moved": moved,
                     "ms": api[0], "host_ms": api[1], "gbps": gbps, "of_copy": gbps / copy_gbps, "op_ms": op[0],
                     "op_host_ms": op[1], "op_gbps": moved / op[0] / 1e6})

    for fmt in formats.FORMATS:
        for usage in USAGES:
            calls = [(x, *quantize_call(fmt, usage, a)) for x, a in zip(inputs, amaxes)]  # x, api, op
            api_t = timer(lambda c: c[1](c[0]), calls)
            op_t = timer(lambda c: c[2](c[0]), calls)
            add(fmt, usage, "quantize", size + written_bytes(calls[0][1](inputs[0])), api_t, op_t)
        if fmt == "nvfp4":
            api = lambda x, fmt=fmt: formats.quantize(x, fmt)  # noqa: E731
            op = lambda x: torch.ops.pyxfer.quantize_nvfp4(x, formats.global_amax(x), True, False)  # noqa: E731
            add(fmt, "rowwise", "quantize+amax", size + written_bytes(api(inputs[0])), timer(api, inputs),
                timer(op, inputs))
        for usage in DEQUANT_USAGES:
            row, col = USAGES[usage]
            qts = [formats.quantize(x, fmt, rowwise=row, columnwise=col,
                                    **({"global_amax": a} if fmt == "nvfp4" else {})) for x, a in zip(inputs, amaxes)]
            api, op = dequantize_call(fmt, usage, dtype)
            add(fmt, usage, "dequantize", usage_bytes(qts[0], usage) + size, timer(api, qts), timer(op, qts))
            del qts
    if device.type == "cuda":  # outside the timed regions
        for fmt in formats.FORMATS:
            for usage in USAGES:
                check_against_cpu(inputs[0], fmt, usage)
    del inputs, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return base, rows


def show(title, bases, rows):
    print_table(title, ["shape", "input", "format", "direction", "usage", "ms", "GB/s", "% copy", "op GB/s",
                        "host us", "op host us"],
                [[f"{r['shape'][0]}x{r['shape'][1]}", fmt_size(r["bytes"]), r["format"], r["direction"], r["usage"],
                  f"{r['ms']:.3f}", fmt_gbps(r["gbps"]), f"{r['of_copy']:.1%}", fmt_gbps(r["op_gbps"]),
                  host_us(r["host_ms"]), host_us(r["op_host_ms"])]
                 for r in rows])
    print("copy baseline (dst.copy_(x) of the input, GB/s = 2 x input bytes / time): " +
          ", ".join(f"{fmt_size(b['bytes'])} {fmt_gbps(b['copy_gbps'])} GB/s" for b in bases) + "\n")


def host_us(ms):
    return "-" if ms is None else f"{ms * 1e3:.0f}"


def targets(rows):
    """Per format and direction: the worst % copy over usages and sizes >= 256 MiB."""
    out = []
    for fmt in formats.FORMATS:
        for direction in ("quantize", "dequantize"):
            big = [r for r in rows if r["format"] == fmt and r["direction"] == direction and r["bytes"] >= TARGET_BYTES]
            name = f"{direction} {fmt} >= {TARGET_FRACTION:.0%} of copy at >= 256 MiB (worst usage/size)"
            if not big:
                out.append({"target": name, "measured": "-", "result": "not measured"})
                continue
            worst = min(big, key=lambda r: r["of_copy"])
            out.append({"target": name, "measured": f"{worst['of_copy']:.1%} ({worst['usage']}, "
                                                    f"{fmt_size(worst['bytes'])})",
                        "value": worst["of_copy"], "result": "PASS" if worst["of_copy"] >= TARGET_FRACTION else "MISS"})
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--shapes", type=parse_shapes, default=parse_shapes("1024x8192,8192x16384,16384x32768"),
                   help="comma-separated MxK input shapes")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="input dtype")
    p.add_argument("--reps", type=int, default=20, help="timed passes per measurement (median)")
    p.add_argument("--cpu", action="store_true", help="also time the CPU implementations")
    p.add_argument("--cpu-shapes", type=parse_shapes, default=parse_shapes("1024x8192"))
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()

    dtype = DTYPES[args.dtype]
    result = {"torch": torch.__version__, "threads": torch.get_num_threads(), "dtype": args.dtype,
              "method": __doc__.split("\n\n    python")[0]}
    if torch.cuda.is_available():
        device = torch.device(args.device)
        result["gpu"] = torch.cuda.get_device_name(device)
        timer = lambda fn, inputs: cuda_times(fn, inputs, reps=args.reps, device=device)  # noqa: E731
        bases, rows = [], []
        for shape in args.shapes:
            base, shape_rows = measure(shape, device, timer, dtype)
            bases.append(base)
            rows += shape_rows
        result["copy"], result["gpu_rows"] = bases, rows
        show(f"pyxfer.formats on {result['gpu']} ({device}), {args.dtype} inputs: GB/s = (bytes read + bytes "
             f"written) / GPU time, CUDA events with the stream held while the call is issued, median of {args.reps}",
             bases, rows)
        print(f"checked outside the timed region: CUDA == CPU bitwise on a {CHECK_SHAPE[0]}x{CHECK_SHAPE[1]} slice, "
              "every format and usage (quantize and dequantize)\n")
        result["targets"] = targets(rows)
        print("targets (measured in this run)")
        print_targets(result["targets"])
    else:
        print("no CUDA GPU: GPU rows skipped" + ("" if args.cpu else " (--cpu times the CPU implementations)") + "\n")
    if args.cpu:
        def timer(fn, inputs):
            return cpu_time_ms(lambda xs: [fn(x) for x in xs], inputs, reps=5) / len(inputs), None
        bases, rows = [], []
        for shape in args.cpu_shapes:
            base, shape_rows = measure(shape, torch.device("cpu"), timer, dtype)
            bases.append(base)
            rows += shape_rows
        result["cpu_copy"], result["cpu_rows"] = bases, rows
        show(f"pyxfer.formats CPU implementations ({result['threads']} threads), {args.dtype} inputs, wall clock, "
             "median of 5",
             bases, rows)
    write_json(args.json, result)


if __name__ == "__main__":
    main()
