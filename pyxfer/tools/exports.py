"""`pyxfer doctor --env`: the doctor's verdicts as shell exports that keep other software off broken paths,
for ``eval "$(pyxfer doctor --env)"`` in a job script.

Veto-only: a pair vetoes its path when its verdict is one pyxfer.health routes around (corrupt, dropped,
hung); ok, slow and unsupported veto nothing (a slow pair still moves the right bytes; a pair without peer
access is already off peer-to-peer). From the verdicts, in this order:
  - a GPU whose copies to or from the host are vetoed is left out of CUDA_VISIBLE_DEVICES (named by UUID, so
    the list holds whatever numbering the caller's CUDA_VISIBLE_DEVICES made);
  - when a pair of the remaining GPUs is vetoed, NCCL_P2P_DISABLE=1 (NCCL then moves data through host
    memory), and as a commented alternative the largest set of GPUs whose pairs are all ok, kept on
    peer-to-peer; software that maps peers itself (vLLM's custom all-reduce, torch symmetric memory) does
    not read NCCL_P2P_DISABLE: the lines say what to pass it;
  - PYXFER_HEALTH_FROM_DOCTOR (and PYXFER_DOCTOR_CACHE when the cache is not at its default place), so
    pyxfer's own copies route vetoed pairs staged.
"""
import itertools
import shlex

from ..health import BAD_VERDICTS as VETO

__all__ = ["VETO", "exports"]


def _largest_clean_set(gpus, bad):
    """The largest subset of ``gpus`` (in their order) with no pair in ``bad`` (unordered pairs); the first
    such in order when there are several. Exhaustive up to 16 GPUs, greedy beyond."""
    if len(gpus) <= 16:
        for size in range(len(gpus), 0, -1):
            for subset in itertools.combinations(gpus, size):
                if not any(frozenset(p) in bad for p in itertools.combinations(subset, 2)):
                    return list(subset)
        return []
    keep = list(gpus)
    while True:
        count = {g: sum(frozenset((g, h)) in bad for h in keep if h != g) for g in keep}
        worst = max(keep, key=lambda g: count[g])
        if count[worst] == 0:
            return keep
        keep.remove(worst)


def exports(doc, cache_path, default_path):
    """(shell text, number of vetoed pairs) for the verdict cache document ``doc``
    (pyxfer.tools.verdict_cache.read_cache / cache_document: devices as "cpu" or GPU UUIDs). ``cache_path``:
    where the cache is (None: none was written), exported as PYXFER_DOCTOR_CACHE when it is not
    ``default_path``."""
    gpus = [u if u else f"{i}" for i, u in enumerate(doc["key"]["gpus"])]  # a GPU without a UUID: its index
    name = {"cpu": "cpu", **{u: g for u, g in zip(doc["key"]["gpus"], gpus) if u}}
    vetoed = [(name.get(p["src"], p["src"]), name.get(p["dst"], p["dst"]), p["verdict"])
              for p in doc["pairs"] if p["verdict"] in VETO]
    off_host = sorted({d for s, t, _ in vetoed for d in (s, t) if "cpu" in (s, t) and d != "cpu"}, key=gpus.index)
    keep = [g for g in gpus if g not in off_host]
    bad_peer = {frozenset((s, t)) for s, t, _ in vetoed if s in keep and t in keep and s != t}
    lines = [f"# pyxfer doctor --env: {len(doc['pairs'])} pairs, {len(vetoed)} vetoed"
             + "".join(f"; {s} -> {t} {v}" for s, t, v in vetoed)]
    if any(s == t == "cpu" for s, t, _ in vetoed):
        lines.append("# host memory -> host memory failed: no variable fixes that; see the doctor's advice")
    if off_host:
        lines.append(f"# GPUs whose copies to or from host memory are vetoed, left out: {', '.join(off_host)}")
        lines.append(f"export CUDA_VISIBLE_DEVICES={shlex.quote(','.join(keep))}")
    if bad_peer:
        pairs = ", ".join(sorted(" <-> ".join(sorted(p, key=gpus.index)) for p in bad_peer))
        lines.append(f"# peer-to-peer vetoed between {pairs}: NCCL goes through host memory")
        lines.append("export NCCL_P2P_DISABLE=1")
        clean = _largest_clean_set(keep, bad_peer)
        lines.append(f"# or, instead of NCCL_P2P_DISABLE, keep peer-to-peer on the {len(clean)} GPUs whose pairs are "
                     f"all ok: export CUDA_VISIBLE_DEVICES={shlex.quote(','.join(clean))}")
        lines.append("# vLLM's custom all-reduce maps peers itself and does not read NCCL_P2P_DISABLE: start vLLM "
                     "with --disable-custom-all-reduce; torch symmetric memory (SymmetricMemory) likewise needs "
                     "working peer access")
    if not vetoed:
        lines.append("# every pair's verdict lets its path be used: nothing to keep off")
    if cache_path is None:
        lines.append("# no verdict cache was written: pyxfer's own copies do not know these verdicts")
        return "\n".join(lines) + "\n", len(vetoed)
    lines.append("export PYXFER_HEALTH_FROM_DOCTOR=1")
    if cache_path != default_path:
        lines.append(f"export PYXFER_DOCTOR_CACHE={shlex.quote(str(cache_path))}")
    return "\n".join(lines) + "\n", len(vetoed)
