"""Verified copies with a host end against the plain-torch copy that makes the same result (issue 34's
host rows), measured in the same run on one GPU:

  GPU -> pinned (new tensor)    verified_copy(t, "cpu")                vs t.to("cpu", non_blocking=True) + sync
  GPU -> pageable (new tensor)  verified_copy(t, "cpu", pin_memory=False)  vs t.to("cpu")
  GPU -> host, staged           verified_copy(t, "cpu", route="staged")    vs t.to("cpu", non_blocking=True) + sync
  pinned host -> GPU            verified_copy(h, dev)                  vs h.to(dev, non_blocking=True) + sync
  pageable host -> GPU          verified_copy(p, dev)                  vs p.to(dev) + sync

each verify="sync" and "deferred" (deferred into host memory is synchronous too), and the raw D2H into a
preallocated pinned buffer for reference. Method: pyxfer._timing.cuda_samples with hold=False (every
call here waits for the GPU): CUDA events on the GPU's current stream around --loop calls, --warmup
passes first, the median of --reps; GB/s = 1e9 bytes/s of the bytes copied per call. Results are
checked once, outside the timed region. The host hashing pool in use is printed (host_hash_info).

    python benchmarks/host_legs.py [--size-mib 512] [--reps 10] [--device cuda:0] [--json out.json]
"""
import argparse
import json

import torch

import pyxfer
from pyxfer._timing import cuda_samples


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--loop", type=int, default=2)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    dev = torch.device(a.device)
    n = a.size_mib << 20
    gpu = torch.randint(0, 256, (n,), dtype=torch.uint8, device=dev)
    pinned = gpu.cpu().pin_memory()
    pageable = gpu.cpu()
    pinned_out = torch.empty(n, dtype=torch.uint8).pin_memory()
    sync = torch.cuda.current_stream(dev).synchronize
    info = json.loads(torch.ops.pyxfer.host_hash_info())
    print(f"{a.size_mib} MiB on {torch.cuda.get_device_name(dev)}; host pool: {info}")

    def d2h_new_pinned():
        out = gpu.to("cpu", non_blocking=True)
        sync()
        return out

    def h2d(src, non_blocking):
        out = src.to(dev, non_blocking=non_blocking)
        sync()
        return out

    cases = [  # (row, name, fn, baseline name, what it must equal)
        ("GPU -> pinned", "raw into a preallocated pinned buffer",
         lambda: (pinned_out.copy_(gpu, non_blocking=True), sync())[0], None, pinned),
        ("GPU -> pinned", "t.to('cpu', non_blocking=True) + sync", d2h_new_pinned, None, pinned),
        ("GPU -> pageable", "t.to('cpu')", lambda: gpu.to("cpu"), None, pinned),
        ("pinned -> GPU", "h.to(dev, non_blocking=True) + sync", lambda: h2d(pinned, True), None, gpu),
        ("pageable -> GPU", "p.to(dev) + sync", lambda: h2d(pageable, False), None, gpu),
    ]
    for verify in ("sync", "deferred"):
        cases += [
            ("GPU -> pinned", f"verified_copy {verify}", lambda v=verify: pyxfer.verified_copy(gpu, "cpu", verify=v),
             "t.to('cpu', non_blocking=True) + sync", pinned),
            ("GPU -> pageable", f"verified_copy {verify} pin_memory=False",
             lambda v=verify: pyxfer.verified_copy(gpu, "cpu", verify=v, pin_memory=False), "t.to('cpu')", pinned),
            ("GPU -> pinned", f"verified_copy {verify} route=staged",
             lambda v=verify: pyxfer.verified_copy(gpu, "cpu", route="staged", verify=v),
             "t.to('cpu', non_blocking=True) + sync", pinned),
            ("pinned -> GPU", f"verified_copy {verify}",
             lambda v=verify: (pyxfer.verified_copy(pinned, dev, verify=v), sync())[0],
             "h.to(dev, non_blocking=True) + sync", gpu),
            ("pageable -> GPU", f"verified_copy {verify}",
             lambda v=verify: (pyxfer.verified_copy(pageable, dev, verify=v), sync())[0], "p.to(dev) + sync", gpu),
        ]
    results, gbps = [], {}
    for row, name, fn, base, want in cases:
        out = fn()
        ok = torch.equal(out.cpu() if out.is_cuda else out, want.cpu() if want.is_cuda else want)
        s = cuda_samples(lambda _, fn=fn: fn(), [None] * a.loop, warmup=a.warmup, reps=a.reps, device=dev, hold=False)
        gbps[(row, name)] = s.gbps(n)
        ratio = gbps[(row, name)] / gbps[(row, base)] if base else None
        results.append({"row": row, "mode": name, "bytes": n, "gbps": round(gbps[(row, name)], 3),
                        "median_ms": s.median_ms, "baseline": base, "ratio": None if ratio is None else round(ratio, 4),
                        "exact": ok})
        print(f"{row:16} {name:42} {gbps[(row, name)]:8.2f} GB/s" + (f"  {ratio:5.3f} of {base}" if base else "")
              + ("" if ok else "  WRONG BYTES"))
    pyxfer.check_transfers()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"host_hash_info": info, "device": torch.cuda.get_device_name(dev), "results": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
