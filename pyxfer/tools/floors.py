"""Absolute bandwidth floors for `pyxfer doctor`: a uniformly slow machine passes a check relative to its own
median, so each pair's copy-engine GB/s is also held against what a healthy machine of its kind reaches.

A floor is {"gpu": regex over the GPU's name (optional: any GPU), "path": "nvlink" | "pcie" | "peer" | "host",
"pcie_gen": N (optional: host paths whose GPU's PCIe link is generation N), "gbps": number, "source": why}.
For a GPU pair both GPUs' names must match; for a host path, its GPU's. A host floor with "pcie_gen" is
scaled by the link's width (x8: half). The first floor that matches wins: a file's floors (--floors FILE,
{"floors": [...]}) before the built-in ones. Floors hold for copies of at least MIN_BYTES (a smaller copy
does not reach the link's rate).

The built-in figures are the ones Azure's GPU node health checks use for H100 / H200 SXM (peer >= 335 GB/s,
host <-> GPU >= 48 GB/s on PCIe gen 5 x16), under what a healthy node measures (one-way peer copy 384-395
GB/s, pinned host <-> GPU 55 GB/s: benchmarks/RESULTS.md); other PCIe generations scale by their rate.
"""
import json
import re

__all__ = ["BUILTIN", "MIN_BYTES", "PATHS", "load_floors", "floor_for"]

MIN_BYTES = 256 << 20
PATHS = ("nvlink", "pcie", "peer", "host")
_SXM = r"H100 80GB HBM3|H100 SXM|^NVIDIA H200$|H200 SXM|H200 141GB"
_AZURE = "Azure GPU node health checks (H100 / H200 SXM)"
BUILTIN = (
    {"gpu": _SXM, "path": "nvlink", "gbps": 335.0, "source": _AZURE},
    {"gpu": _SXM, "path": "host", "gbps": 48.0, "source": _AZURE + ", PCIe gen 5 x16"},
    {"path": "host", "pcie_gen": 5, "gbps": 48.0, "source": "PCIe gen 5 x16 (Azure's host <-> GPU floor)"},
    {"path": "host", "pcie_gen": 4, "gbps": 24.0, "source": "PCIe gen 4 x16 (half of gen 5's floor)"},
    {"path": "host", "pcie_gen": 3, "gbps": 12.0, "source": "PCIe gen 3 x16 (a quarter of gen 5's floor)"},
)


def _checked(entry, where):
    """``entry`` as a floor, or ValueError naming ``where`` and what was expected."""
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: expected an object {{gpu?, path, pcie_gen?, gbps, source?}}, got {entry!r:.80}")
    unknown = sorted(set(entry) - {"gpu", "path", "pcie_gen", "gbps", "source"})
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; expected gpu, path, pcie_gen, gbps, source")
    if entry.get("path") not in PATHS:
        raise ValueError(f"{where}: 'path' must be one of {list(PATHS)}, got {entry.get('path')!r}")
    gbps = entry.get("gbps")
    if isinstance(gbps, bool) or not isinstance(gbps, (int, float)) or not gbps > 0:
        raise ValueError(f"{where}: 'gbps' must be a number > 0, got {gbps!r}")
    gen = entry.get("pcie_gen")
    if gen is not None and (isinstance(gen, bool) or not isinstance(gen, int) or gen < 1):
        raise ValueError(f"{where}: 'pcie_gen' must be an integer >= 1, got {gen!r}")
    if "gpu" in entry:
        if not isinstance(entry["gpu"], str):
            raise ValueError(f"{where}: 'gpu' must be a regular expression (a string), got {entry['gpu']!r}")
        try:
            re.compile(entry["gpu"])
        except re.error as e:
            raise ValueError(f"{where}: 'gpu' is not a regular expression ({e}): {entry['gpu']!r}") from None
    return {**entry, "gbps": float(gbps), "source": str(entry.get("source", where))}


def load_floors(path=None):
    """The floors in force: those of the JSON file at ``path`` ({"floors": [...]}) first, then BUILTIN.
    Raises OSError when the file cannot be read, ValueError naming the file and the entry that is wrong."""
    if path is None:
        return list(BUILTIN)
    with open(path) as f:
        try:
            doc = json.load(f)
        except ValueError as e:
            raise ValueError(f"--floors {path}: not JSON ({e})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("floors"), list):
        raise ValueError(f"--floors {path}: expected an object {{\"floors\": [...]}}, got {str(doc)[:80]!r}")
    return [_checked(e, f"--floors {path}: floors[{i}]") for i, e in enumerate(doc["floors"])] + list(BUILTIN)


def floor_for(path, names, pcie, floors):
    """(GB/s, source) of the first floor of ``floors`` for a pair on ``path`` ("nvlink" / "pcie" / "peer" /
    "host"; no floor for others) between GPUs named ``names`` (one for a host path) whose PCIe links are
    ``pcie`` ({"gen", "width"} or None each), or (None, None)."""
    for f in floors:
        if f["path"] != path or ("gpu" in f and not all(re.search(f["gpu"], n) for n in names)):
            continue
        if "pcie_gen" not in f:
            return f["gbps"], f["source"]
        link = pcie[0] if pcie else None
        if link and link.get("gen") == f["pcie_gen"]:
            width = link.get("width") or 16
            return round(f["gbps"] * min(width, 16) / 16, 3), f"{f['source']}{'' if width >= 16 else f', x{width}'}"
    return None, None
