"""The on-disk cache of `pyxfer doctor`'s per-pair verdicts, and loading it into pyxfer.health.

The cache is one JSON document (schema "pyxfer.doctor.verdicts", version 1):
``{"schema", "schema_version", "key": {"gpus": [UUID, ...], "driver", "torch", "pyxfer"},
"created": unix seconds, "pairs": [{"src", "dst", "verdict"}]}`` where src / dst are "cpu" or a
GPU's UUID (not its index: CUDA_VISIBLE_DEVICES may renumber the GPUs of a later process).

Loading applies the verdicts to pyxfer.health (per process): a pair found ``corrupt``, ``dropped``
or ``hung`` is marked "corrupt", so route="auto" sends its copies staged from the first copy of the
process; an ``ok`` pair is marked "healthy". A cache made under another key (other GPUs, driver,
torch or pyxfer) is ignored with a RuntimeWarning naming what differs.
"""
import json
import os
import time
import warnings

import torch

__all__ = ["CACHE_ENV", "HEALTH_ENV", "cache_path", "cache_key", "save_verdicts", "load_doctor_verdicts"]

SCHEMA, SCHEMA_VERSION = "pyxfer.doctor.verdicts", 1
CACHE_ENV = "PYXFER_DOCTOR_CACHE"  # where the cache lives (default: $XDG_CACHE_HOME/pyxfer/doctor-verdicts.json)
HEALTH_ENV = "PYXFER_HEALTH_FROM_DOCTOR"  # "1" (or a cache path): load the verdicts when pyxfer is imported
BAD_VERDICTS = ("corrupt", "dropped", "hung")  # copies of these pairs route staged once loaded


def cache_path(path=None) -> str:
    """The cache file: ``path``, else $PYXFER_DOCTOR_CACHE, else
    $XDG_CACHE_HOME (~/.cache)/pyxfer/doctor-verdicts.json."""
    if path:
        return os.fspath(path)
    if os.environ.get(CACHE_ENV):
        return os.environ[CACHE_ENV]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pyxfer", "doctor-verdicts.json")


def _uuids():
    if not torch.cuda.is_available():
        return []
    from ._machine import gpus
    return [g["uuid"] for g in gpus()]


def cache_key() -> dict:
    """What the verdicts depend on: the visible GPUs' UUIDs, the driver, torch and pyxfer versions."""
    from . import __version__
    from ._machine import driver_version
    return {"gpus": _uuids(), "driver": driver_version(), "torch": torch.__version__, "pyxfer": __version__}


def _endpoint(device: str, uuids) -> str:
    return "cpu" if device == "cpu" else uuids[torch.device(device).index]


def save_verdicts(pairs, path=None) -> str:
    """Write ``pairs`` ([{"src", "dst", "verdict"}], devices as "cpu" / "cuda:N") to the cache under
    the current key, atomically (a temporary file renamed). Returns the path written."""
    key = cache_key()
    doc = {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "key": key, "created": int(time.time()),
           "pairs": [{"src": _endpoint(p["src"], key["gpus"]), "dst": _endpoint(p["dst"], key["gpus"]),
                      "verdict": p["verdict"]} for p in pairs]}
    path = cache_path(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)
    return path


def load_doctor_verdicts(path=None) -> dict:
    """Apply the verdicts cached by `pyxfer doctor` to pyxfer.health (see the module docstring).

    ``path``: the cache file (default: cache_path()). Returns {(src, dst): verdict} of the pairs
    applied, devices as "cpu" / "cuda:N" of this process; {} when there is no cache, when it was
    made under another key (a RuntimeWarning says which part differs) or when it is not a verdict
    cache (a RuntimeWarning says why). Mutates pyxfer.health; raises nothing for a bad cache."""
    from . import health
    path = cache_path(path)
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            doc = json.load(f)
        if doc.get("schema") != SCHEMA or doc.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(f"schema {doc.get('schema')!r} version {doc.get('schema_version')!r}, "
                             f"expected {SCHEMA!r} version {SCHEMA_VERSION}")
        cached, key = doc["key"], cache_key()
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        warnings.warn(f"pyxfer: doctor verdict cache {path} ignored: not a verdict cache ({e})", RuntimeWarning,
                      stacklevel=2)
        return {}
    # Every visible GPU must have been examined (a subset of the doctor's GPUs is fine).
    differs = [f"{k}: cache {cached.get(k)!r}, this process {key[k]!r}" for k in ("driver", "torch", "pyxfer")
               if cached.get(k) != key[k]]
    missing = [u for u in key["gpus"] if u not in (cached.get("gpus") or [])]
    if missing:
        differs.append(f"GPUs {missing} are not in the cache")
    if differs:
        warnings.warn(f"pyxfer: doctor verdict cache {path} ignored: made under another key ({'; '.join(differs)}); "
                      f"run `pyxfer doctor` again", RuntimeWarning, stacklevel=2)
        return {}
    local = {"cpu": "cpu", **{u: f"cuda:{i}" for i, u in enumerate(key["gpus"])}}
    applied = {}
    for p in doc.get("pairs", []):
        src, dst = local.get(p.get("src")), local.get(p.get("dst"))
        if src is None or dst is None:
            continue  # a GPU this process does not see
        if p.get("verdict") in BAD_VERDICTS:
            health.mark(src, dst, "corrupt")
        elif p.get("verdict") == "ok":
            health.mark(src, dst, "healthy")
        else:
            continue  # slow / unsupported / error: the data was right or the path is not direct
        applied[(src, dst)] = p["verdict"]
    return applied


def load_from_env() -> dict:
    """load_doctor_verdicts() when $PYXFER_HEALTH_FROM_DOCTOR is set ("1", or the cache's path)."""
    value = os.environ.get(HEALTH_ENV, "")
    if value in ("", "0"):
        return {}
    return load_doctor_verdicts(None if value == "1" else value)
