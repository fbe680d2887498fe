"""`pyxfer bench`'s report: the matrices, latency rows, size sweep and warnings printed from a document,
and the PNG (pyxfer.tools.bench runs the measurement, pyxfer.tools.bench_measure measures)."""
import sys

from .bench_measure import CHASE_BYTES, LATENCY_BYTES
from .timing import fmt_gbps, fmt_size

__all__ = ["matrix", "print_results", "plot"]

MAX_WARNINGS_PRINTED = 12


def _endpoints(rows):
    order = ["cpu", "pinned", "pageable"]
    names = {e for r in rows for e in r}
    return [e for e in order if e in names] + sorted((e for e in names if e not in order), key=lambda e: int(e[5:]))


def matrix(values, rows):
    """(row names, column names, cells) of a {(src, dst): value} over the sources and destinations in rows."""
    srcs, dsts = _endpoints([(s, s) for s, _ in rows]), _endpoints([(d, d) for _, d in rows])
    return srcs, dsts, [[values.get((s, d)) for d in dsts] for s in srcs]


def _print_matrix(title, values, rows, fmt, out):
    srcs, dsts, cells = matrix(values, rows)
    if all(v is None for row in cells for v in row):
        return
    text = [["-" if v is None else fmt(v) for v in row] for row in cells]
    width = max(8, *(len(d) + 1 for d in dsts), *(len(t) + 2 for row in text for t in row))
    print(title, file=out)
    print(" " * 10 + "".join(f"{d:>{width}}" for d in dsts), file=out)
    for s, row in zip(srcs, text):
        print(f"{s:>10}" + "".join(f"{t:>{width}}" for t in row), file=out)
    print(file=out)


LATENCY_TITLES = {
    "ce": f"latency as the GPU sees it, us per copy: {LATENCY_BYTES}-byte copy_ (copy engine) queued back to back "
          f"behind a held stream, timed by events (median and CV)",
    "sm": f"latency as the GPU sees it, us per copy: {LATENCY_BYTES}-byte copy kernel (sm_pull between GPUs), queued "
          f"behind a held stream, timed by events",
    "chase": "latency of one load, us: the row's GPU (the CPU without GPUs) chasing pointers through a "
             f"{CHASE_BYTES >> 20} MiB ring in the column's memory (nvbandwidth's SM latency)",
    "host_call": f"host round trip of one call, us: one {LATENCY_BYTES}-byte copy issued from an idle stream and "
                 f"waited for (what a lone call costs the host; not the link's latency)",
}


def _fmt_cv(fmt):
    """A cell formatter of (median, cv): "395 0.3%" (the CV beside the median)."""
    return lambda v: fmt(v[0]) + ("" if v[1] is None else f" {v[1]:.1%}")


def print_results(doc, out=None):
    out = sys.stdout if out is None else out
    results, n = doc["results"], doc["config"]["matrix_size"]
    rows = [tuple(r) for r in doc["config"]["rows"]]
    print(f"pyxfer bench  (GB/s = 1e9 bytes/s; rows = source, columns = destination; medians of "
          f"{doc['method']['reps']} samples; ce_bidir counts both directions)", file=out)
    if not doc["gpu"]:
        print("no CUDA GPU visible: measuring host memcpy, checksum and CPU verified / staged copies only", file=out)
    for mode in doc["config"]["modes"]:
        vals = {(r["src"], r["dst"]): (r["gbps"], r.get("cv")) for r in results if r["mode"] == mode and r["bytes"] == n
                and r["gbps"] is not None}
        _print_matrix(f"{mode} GB/s at {fmt_size(n)}, median and its CV", vals, rows, _fmt_cv(fmt_gbps), out)
    for name in ("verified/ce", "staged/ce"):
        vals = {(r["src"], r["dst"]): r["value"] for r in doc["ratios"] if r["ratio"] == name}
        _print_matrix(f"{name} at {fmt_size(n)} (1.00 = as fast as the raw copy)", vals, rows,
                      lambda v: f"{v:.2f}", out)
    for kind, title in LATENCY_TITLES.items():
        vals = {(r["src"], r["dst"]): (r["median_us"], r.get("cv")) for r in doc["latency"]
                if r.get("kind", "host_call") == kind and r["median_us"] is not None}
        _print_matrix(title, vals, rows, _fmt_cv(lambda v: f"{v:.2f}" if v < 10 else f"{v:.1f}"), out)
    sizes = doc["config"]["sizes"]
    if len(sizes) > 1:
        print("size sweep, GB/s", file=out)
        head = f"{'row':>22} {'mode':>18}" + "".join(f"{fmt_size(s):>10}" for s in sizes)
        print(head, file=out)
        keys = list(dict.fromkeys((r["src"], r["dst"], r["mode"]) for r in results))
        by = {(r["src"], r["dst"], r["mode"], r["bytes"]): r["gbps"] for r in results}
        for s, d, m in keys:
            print(f"{s + ' -> ' + d:>22} {m:>18}" + "".join(f"{fmt_gbps(by.get((s, d, m, z))):>10}" for z in sizes),
                  file=out)
        print(file=out)
    print("checksum (PXH64) GB/s: " + "; ".join(
        f"{c['device']} {fmt_gbps(c['gbps'])}" for c in doc["checksum"] if c["bytes"] == n), file=out)
    for m in doc["method_check"]:
        print(f"method check {m['src']} -> {m['dst']} at {fmt_size(m['bytes'])}: bench ce {m['bench_gbps']:.1f} GB/s, "
              f"torch copy_ (20 copies between events) {m['torch_gbps']:.1f} GB/s, ratio {m['ratio']:.3f}", file=out)
    errors = [r for r in results if r["check"] == "error"]
    for r in doc["corrupt"]:
        print(f"CORRUPT {r['src']} -> {r['dst']} {r['mode']} {fmt_size(r['bytes'])}: {r['detail']}", file=out)
    for r in errors:
        print(f"error {r['src']} -> {r['dst']} {r['mode']} {fmt_size(r['bytes'])}: {r['detail']}", file=out)
    warnings = doc.get("warnings", [])
    for w in warnings[:MAX_WARNINGS_PRINTED]:
        print(f"WARNING {w}", file=out)
    if len(warnings) > MAX_WARNINGS_PRINTED:
        print(f"... and {len(warnings) - MAX_WARNINGS_PRINTED} more warnings (the JSON's \"warnings\" lists all)",
              file=out)
    cmp = doc.get("compare")
    if cmp:
        print(f"compared with {cmp['old']}: {len(cmp['slower'])} points slower by more than "
              f"{cmp['threshold']:.0%}", file=out)
        for r in cmp["slower"]:
            print(f"  SLOWER {r['src']} -> {r['dst']} {r['mode']} {fmt_size(r['bytes'])}: {r['old_gbps']:.2f} -> "
                  f"{r['new_gbps']:.2f} GB/s ({r['ratio']:.2f}x)", file=out)


def _text_color(rgba):
    """Black or white, whichever reads better on ``rgba`` (its relative luminance, WCAG's weights)."""
    lin = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in rgba[:3]]
    return "black" if 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2] > 0.179 else "white"


def plot(doc, path):
    """PNG heatmaps of every mode's GB/s and of the verified/ce and staged/ce ratios at the matrix size,
    on shared color scales (every GB/s panel 0 to the largest GB/s; the ratios 0 to 1 or above), so
    that equal colors mean equal figures across panels; cell values in black or white by the cell's
    luminance, panels and fonts sized by the matrix (1x1 ... 9x9 and more stay readable); and, where
    the run has more than one size, a size-sweep panel (each mode's median GB/s over its rows against
    the size, the band from the slowest to the fastest row). Raises RuntimeError when matplotlib is not
    installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'pyxfer[plot]' (or matplotlib)") from None
    n, rows = doc["config"]["matrix_size"], [tuple(r) for r in doc["config"]["rows"]]
    panels = []
    for mode in doc["config"]["modes"]:
        vals = {(r["src"], r["dst"]): r["gbps"] for r in doc["results"] if r["mode"] == mode and r["bytes"] == n}
        if any(v is not None for v in vals.values()):
            panels.append((f"{mode} GB/s", vals, fmt_gbps, "gbps"))
    for name in ("verified/ce", "staged/ce"):
        vals = {(r["src"], r["dst"]): r["value"] for r in doc["ratios"] if r["ratio"] == name}
        if vals:
            panels.append((name, vals, "{:.2f}".format, "ratio"))
    sizes = doc["config"]["sizes"]
    sweep = len(sizes) > 1 and any(r["gbps"] is not None for r in doc["results"])
    top = {"gbps": 0.0, "ratio": 1.0}
    for _, vals, _, kind in panels:
        top[kind] = max([top[kind]] + [v for v in vals.values() if v is not None])
    srcs, dsts, _ = matrix({}, rows)
    cells = max(len(srcs), len(dsts))
    side = max(3.6, 1.6 + 0.62 * cells)  # inches per panel: the cells grow with the matrix, the fonts fit them
    font = max(7.5, min(11.0, 60.0 / cells))
    count = len(panels) + sweep
    cols = min(3, max(1, count))
    nrows = (count + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(side * cols + 1.2, side * nrows + 0.8), squeeze=False)
    cmap = plt.get_cmap("viridis")
    for ax, (title, vals, fmt, kind) in zip(axes.flat, panels):
        srcs, dsts, cells_ = matrix(vals, rows)
        grid = [[float("nan") if v is None else v for v in row] for row in cells_]
        vmax = top[kind] or 1.0
        im = ax.imshow(grid, cmap=cmap, vmin=0.0, vmax=vmax)
        ax.set_xticks(range(len(dsts)), dsts, rotation=45, ha="right", rotation_mode="anchor", fontsize=font)
        ax.set_yticks(range(len(srcs)), srcs, fontsize=font)
        ax.set_xlabel("destination")
        ax.set_ylabel("source")
        ax.set_title(f"{title} ({fmt_size(n)})", fontsize=10)
        for i, row in enumerate(cells_):
            for j, v in enumerate(row):
                if v is not None:
                    ax.text(j, i, fmt(v), ha="center", va="center", fontsize=font,
                            color=_text_color(cmap(min(v, vmax) / vmax)))
        fig.colorbar(im, ax=ax, shrink=0.8)
    if sweep:
        ax = list(axes.flat)[len(panels)]
        for mode in doc["config"]["modes"]:
            xs, mids, lows, highs = [], [], [], []
            for z in sizes:
                v = sorted(r["gbps"] for r in doc["results"] if r["mode"] == mode and r["bytes"] == z and r["gbps"])
                if v:
                    xs.append(z)
                    mids.append(v[len(v) // 2])
                    lows.append(v[0])
                    highs.append(v[-1])
            if xs:
                line, = ax.plot(xs, mids, marker="o", markersize=3, label=mode)
                ax.fill_between(xs, lows, highs, color=line.get_color(), alpha=0.15)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sizes, [fmt_size(z).replace(" ", "") for z in sizes], rotation=45, ha="right",
                      rotation_mode="anchor", fontsize=7)
        ax.minorticks_off()
        ax.set_xlabel("bytes per copy")
        ax.set_ylabel("GB/s (median over rows; band: slowest to fastest row)")
        ax.set_title("size sweep", fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[count:]:
        ax.axis("off")
    gpus = doc["machine"]["gpus"]
    fig.suptitle(f"pyxfer bench: {gpus[0]['name'] + ' x' + str(len(gpus)) if gpus else 'no GPU'}, {doc['created']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
