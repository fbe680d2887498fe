"""nvbandwidth and `pyxfer bench` on the same rows, in one run, side by side.

Runs NVIDIA's nvbandwidth (--nvbandwidth, default .tools/nvbandwidth/nvbandwidth or .tools/nvbandwidth: see
../shared/tools/README.md for the sm_90 build and how it is carried to a GPU machine) on the testcases below,
then `pyxfer bench` on the rows they share, and prints one line per (row, figure): nvbandwidth's, pyxfer's,
their ratio and whether they agree within 5%. Writes everything (both tools' raw output too) to --json.

Rows (nvbandwidth testcase -> pyxfer bench figure; GPU(row) -> GPU(column) unless said):
  CE one way      device_to_device_memcpy_write_ce[i][j]   ce i->j (torch's copy_, issued by the source)
                  device_to_device_memcpy_read_ce[j][i]    ce i->j (the same bytes, read by j: shown too)
  CE both ways    device_to_device_bidirectional_memcpy_write_ce_total[i][j]   ce_bidir i->j (total)
  SM one way      device_to_device_memcpy_read_sm[j][i]    sm_pull i->j;  ..._write_sm[i][j]   sm_push i->j
  host -> GPU     host_to_device_memcpy_ce[0][g]           ce pinned->cuda:g
  GPU -> host     device_to_host_memcpy_ce[0][g]           ce cuda:g->pinned
  host <-> GPU    host_to_device_bidirectional_memcpy_ce[0][g] + device_to_host_bidirectional_memcpy_ce[0][g]
                  (each is one direction measured while the other runs)   ce_bidir pinned->cuda:g (total)
  GPU-local       device_local_copy[0][g]                  ce cuda:g->cuda:g
  latency         device_to_device_latency_sm[i][j] (ns)   chase i->j (us x 1000)

    python benchmarks/nvbandwidth_compare.py [--nvbandwidth PATH] [--mib 512] [--gpus 0,1] [--json out.json]
    python benchmarks/nvbandwidth_compare.py --parse nvbandwidth.log      # only parse and print a saved log
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

TESTCASES = ("device_to_device_memcpy_write_ce", "device_to_device_memcpy_read_ce",
             "device_to_device_bidirectional_memcpy_write_ce", "device_to_device_memcpy_read_sm",
             "device_to_device_memcpy_write_sm", "host_to_device_memcpy_ce", "device_to_host_memcpy_ce",
             "host_to_device_bidirectional_memcpy_ce", "device_to_host_bidirectional_memcpy_ce",
             "device_local_copy", "device_to_device_latency_sm")
AGREE = 0.05
# where ../shared/tools/README.md's recipe puts it (`cp ../shared/tools/nvbandwidth .tools/`), or a build tree
DEFAULT_BINARIES = (".tools/nvbandwidth/nvbandwidth", ".tools/nvbandwidth")

_NUM = re.compile(r"^-?\d+(\.\d+)?([eE][-+]?\d+)?$")


def _number(tok):
    """A cell of nvbandwidth's matrix: a float, or None for "N/A"."""
    if tok == "N/A":
        return None
    if not _NUM.match(tok):
        raise ValueError(tok)
    return float(tok)


def parse(text):
    """nvbandwidth's plain-text output -> {matrix key: {"testcase", "description", "columns", "rows":
    {row label: [float | None]}, "sum"}} and {testcase: status line} for testcases that did not run
    ("WAIVED", "ERROR: ..."). The format (output.cpp, inline_common.h of NVIDIA/nvbandwidth v0.8):

        Running <testcase>.
        <description>
                   0         1            (column labels, setw(10))
         0       N/A    395.12            (row label, then one setw(10) cell per column, 2 decimals or N/A)

        SUM <key> <sum>                    (or "&&&& PERF <key> <sum>[unit]" with the perf formatter)

    A testcase may print several matrices (the bidirectional ones: <testcase>_write1, _write2, _total);
    each is named by the key of the SUM line after it. Lines that are none of these (the header, the
    devices, notes, VERBOSE MIN/MAX/AVG lines) are skipped."""
    matrices, status = {}, {}
    lines = text.splitlines()
    testcase, i = None, 0
    while i < len(lines):
        line = lines[i].strip()
        m = re.match(r"^Running (\S+?)\.?$", line)
        if m:
            testcase = m.group(1)
            i += 1
            continue
        m = re.match(r"^(Waived|Error|Not Found)\b:?\s*(.*)$", line, re.IGNORECASE)
        if m and testcase:
            status[testcase] = line
            i += 1
            continue
        # a matrix: a description, then a header of column labels, then rows of cells, then a blank line
        if i + 2 < len(lines) and testcase and line and _is_table(lines[i + 1], lines[i + 2]):
            columns = lines[i + 1].split()
            rows, j = {}, i + 2
            while j < len(lines) and lines[j].strip():
                toks = lines[j].split()
                if len(toks) != len(columns) + 1:
                    break
                try:
                    rows[toks[0]] = [_number(t) for t in toks[1:]]
                except ValueError:
                    break
                j += 1
            key, total = testcase, None
            for k in range(j, min(j + 4, len(lines))):
                s = re.match(r"^(?:SUM|&&&& PERF)\s+(\S+)\s+(-?[\d.]+)", lines[k].strip())
                if s:
                    key, total = s.group(1), float(s.group(2))
                    j = k
                    break
            matrices[key] = {"testcase": testcase, "description": line, "columns": columns, "rows": rows,
                             "sum": total}
            i = j + 1
            continue
        i += 1
    return matrices, status


def _is_table(header, first):
    """Whether ``header`` is a line of column labels and ``first`` a row of as many cells and a label."""
    cols, toks = header.split(), first.split()
    if not cols or len(toks) != len(cols) + 1:
        return False
    try:
        [_number(t) for t in toks[1:]]
    except ValueError:
        return False
    return True


def cell(matrices, key, row, col):
    """matrices[key] at (row, column) (labels as printed: device indices), or None."""
    m = matrices.get(key)
    if m is None or str(row) not in m["rows"] or str(col) not in m["columns"]:
        return None
    return m["rows"][str(row)][m["columns"].index(str(col))]


def pairs(matrices, bench_doc, gpus):
    """[(row, figure, nvbandwidth value, pyxfer value, unit)] of every row both tools measured."""
    res = {(r["src"], r["dst"], r["mode"]): r["gbps"] for r in bench_doc["results"]
           if r["bytes"] == bench_doc["config"]["matrix_size"]}
    lat = {(r["src"], r["dst"]): r["median_us"] for r in bench_doc["latency"] if r.get("kind") == "chase"}
    out = []

    def add(row, figure, nvb, mine, unit="GB/s"):
        if nvb is not None or mine is not None:
            out.append((row, figure, nvb, mine, unit))
    for i in gpus:
        gi = f"cuda:{i}"
        add(f"pinned -> {gi}", "CE host -> GPU", cell(matrices, "host_to_device_memcpy_ce", 0, i),
            res.get(("pinned", gi, "ce")))
        add(f"{gi} -> pinned", "CE GPU -> host", cell(matrices, "device_to_host_memcpy_ce", 0, i),
            res.get((gi, "pinned", "ce")))
        h2d = cell(matrices, "host_to_device_bidirectional_memcpy_ce", 0, i)
        d2h = cell(matrices, "device_to_host_bidirectional_memcpy_ce", 0, i)
        add(f"pinned <-> {gi}", "CE both ways (total)", None if h2d is None or d2h is None else h2d + d2h,
            res.get(("pinned", gi, "ce_bidir")))
        add(f"{gi} -> {gi}", "GPU-local copy", cell(matrices, "device_local_copy", 0, i), res.get((gi, gi, "ce")))
        for j in gpus:
            if i == j:
                continue
            gj = f"cuda:{j}"
            row = f"{gi} -> {gj}"
            ce = res.get((gi, gj, "ce"))
            add(row, "CE one way (write)", cell(matrices, "device_to_device_memcpy_write_ce", i, j), ce)
            add(row, "CE one way (read)", cell(matrices, "device_to_device_memcpy_read_ce", j, i), ce)
            add(f"{gi} <-> {gj}", "CE both ways (total)",
                cell(matrices, "device_to_device_bidirectional_memcpy_write_ce_total", i, j),
                res.get((gi, gj, "ce_bidir")))
            add(row, "SM read (sm_pull)", cell(matrices, "device_to_device_memcpy_read_sm", j, i),
                res.get((gi, gj, "sm_pull")))
            add(row, "SM write (sm_push)", cell(matrices, "device_to_device_memcpy_write_sm", i, j),
                res.get((gi, gj, "sm_push")))
            us = lat.get((gi, gj))
            add(row, "SM latency (pointer chase)", cell(matrices, "device_to_device_latency_sm", i, j),
                None if us is None else us * 1e3, "ns")
    return out


def _fmt(v):
    return "-" if v is None else f"{v:.2f}"


def table(rows):
    """Lines of the side-by-side table and the JSON entries."""
    lines = [f"{'row':>22} {'figure':>27} {'nvbandwidth':>12} {'pyxfer':>10} {'ratio':>7}  within 5%"]
    entries = []
    for row, figure, nvb, mine, unit in rows:
        ratio = mine / nvb if nvb and mine is not None else None
        ok = None if ratio is None else abs(ratio - 1) <= AGREE
        lines.append(f"{row:>22} {figure:>27} {_fmt(nvb):>12} {_fmt(mine):>10} "
                     f"{'-' if ratio is None else f'{ratio:.3f}':>7}  {'-' if ok is None else 'yes' if ok else 'NO'}"
                     f"  {unit}")
        entries.append({"row": row, "figure": figure, "unit": unit, "nvbandwidth": nvb, "pyxfer": mine,
                        "ratio": None if ratio is None else round(ratio, 4), "within_5pct": ok})
    return lines, entries


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nvbandwidth", default=None,
                   help=f"the nvbandwidth binary (default: the first executable of {', '.join(DEFAULT_BINARIES)})")
    p.add_argument("--mib", type=int, default=512, help="buffer size of both tools' bandwidth rows, MiB")
    p.add_argument("--gpus", default=None, help="GPU indices to compare, e.g. 0,1 (default: all visible)")
    p.add_argument("--json", help="write the side-by-side table, both tools' output and the bench document")
    p.add_argument("--parse", metavar="LOG", help="only parse a saved nvbandwidth log and print its matrices")
    args = p.parse_args(argv)
    if args.parse:
        with open(args.parse) as f:
            matrices, status = parse(f.read())
        print(json.dumps({"matrices": matrices, "status": status}, indent=1))
        return 0
    import torch
    count = torch.cuda.device_count()
    gpus = [int(g) for g in args.gpus.split(",")] if args.gpus else list(range(count))
    if count == 0:
        print("nvbandwidth_compare: no CUDA GPU visible (nvbandwidth measures GPUs)", file=sys.stderr)
        return 2
    if len(gpus) < 1 or any(g >= count or g < 0 for g in gpus):
        print(f"nvbandwidth_compare: --gpus: expected indices below {count}, got {args.gpus!r}", file=sys.stderr)
        return 2
    if args.nvbandwidth is None:
        args.nvbandwidth = next((b for b in DEFAULT_BINARIES if os.path.isfile(b) and os.access(b, os.X_OK)),
                                DEFAULT_BINARIES[0])
    if not (os.path.isfile(args.nvbandwidth) and os.access(args.nvbandwidth, os.X_OK)):
        print(f"nvbandwidth_compare: --nvbandwidth: {args.nvbandwidth} is not an executable (see "
              f"../shared/tools/README.md)", file=sys.stderr)
        return 2
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(str(g) for g in gpus))
    nvb = subprocess.run([args.nvbandwidth, "-b", str(args.mib), "-t", *TESTCASES], capture_output=True, text=True,
                         env=env)
    print(nvb.stdout)
    matrices, status = parse(nvb.stdout)
    local = list(range(len(gpus)))  # both tools see the chosen GPUs as 0 ... n-1
    rows = [f"pinned->cuda:{g},cuda:{g}->pinned,cuda:{g}->cuda:{g}" for g in local]
    rows += [f"cuda:{i}->cuda:{j}" for i in local for j in local if i != j]
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "bench.json")
        bench = subprocess.run([sys.executable, "-m", "pyxfer", "bench", "--sizes", f"{args.mib}M", "--no-progress",
                                "--modes", "ce,ce_bidir,sm_pull,sm_push" if len(local) > 1 else "ce,ce_bidir,sm_push",
                                "--pairs", ",".join(rows), "--json", path],
                               capture_output=True, text=True, env=env)
        print(bench.stdout)
        if not os.path.exists(path):
            print(f"nvbandwidth_compare: pyxfer bench wrote no JSON (exit {bench.returncode}): {bench.stderr[-2000:]}",
                  file=sys.stderr)
            return 1
        with open(path) as f:
            doc = json.load(f)
    lines, entries = table(pairs(matrices, doc, local))
    gpu = doc["machine"]["gpus"][0]["name"] if doc["machine"]["gpus"] else "?"
    print(f"nvbandwidth vs pyxfer bench at {args.mib} MiB on {len(gpus)} x {gpu} (GPUs {','.join(map(str, gpus))})")
    print("\n".join(lines))
    for t, s in status.items():
        print(f"nvbandwidth {t}: {s}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mib": args.mib, "gpus": gpus, "card": gpu, "rows": entries, "nvbandwidth_status": status,
                       "nvbandwidth_stdout": nvb.stdout, "nvbandwidth_rc": nvb.returncode,
                       "bench_stdout": bench.stdout, "bench_rc": bench.returncode, "bench": doc}, f, indent=1)
        print(f"wrote {args.json}")
    return 0 if nvb.returncode == 0 and bench.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
