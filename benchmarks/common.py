"""Table and JSON output shared by the benchmarks. The measurement method (CUDA events, the held
stream, medians) and the machine facts live in the package, shared with `pyxfer bench`:
pyxfer.tools.timing and pyxfer.tools.machine."""
import json


def print_table(title, columns, rows):
    widths = [max(len(str(c)), *(len(str(r[i])) for r in rows)) if rows else len(str(c)) for i, c in enumerate(columns)]
    print(title)
    print("  ".join(str(c).rjust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(str(v).rjust(w) for v, w in zip(r, widths)))
    print()


def print_targets(targets):
    """Print target dicts ({"target", "measured", "result"}) as PASS/MISS lines, then a blank line."""
    width = max((len(str(t["measured"])) for t in targets), default=0)
    for t in targets:
        print(f"  {t['result']:>12}  {str(t['measured']):>{width}}  {t['target']}")
    print()


def write_json(path, payload):
    if path:
        with open(path, "w") as f:
            json.dump(payload, f, indent=2)
