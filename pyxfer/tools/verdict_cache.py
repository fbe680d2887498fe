"""The on-disk cache of `pyxfer doctor`'s per-pair verdicts: written by the doctor, read back as
verdicts for pyxfer.health, which applies them (this module never touches health).

The cache is one JSON document (schema "pyxfer.doctor.verdicts", version 1):
``{"schema", "schema_version", "key": {"gpus": [UUID, ...], "driver", "torch", "pyxfer"},
"created": unix seconds, "pairs": [{"src", "dst", "verdict"}]}`` where src / dst are "cpu" or a
GPU's UUID (not its index: CUDA_VISIBLE_DEVICES may renumber the GPUs of a later process).

Reading (cached_verdicts) gives the verdicts of the pairs this process sees, as "cpu" / "cuda:N" of
this process. A cache made under another key (other GPUs, driver, torch or pyxfer) is ignored with
a RuntimeWarning naming what differs; so is a file that is not a verdict cache (another schema, a
``key`` or ``pairs`` of the wrong shape): nothing of it is returned.
"""
import contextlib
import json
import os
import time
import warnings

import torch

from .._devices import as_device

__all__ = ["CACHE_ENV", "cache_path", "cache_key", "save_verdicts", "read_cache", "cached_verdicts"]

SCHEMA, SCHEMA_VERSION = "pyxfer.doctor.verdicts", 1
CACHE_ENV = "PYXFER_DOCTOR_CACHE"  # where the cache lives (default: $XDG_CACHE_HOME/pyxfer/doctor-verdicts.json)


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
    from .machine import gpus
    return [g["uuid"] for g in gpus()]


def cache_key() -> dict:
    """What the verdicts depend on: the visible GPUs' UUIDs, the driver, torch and pyxfer versions."""
    from .. import __version__
    from .machine import driver_version
    return {"gpus": _uuids(), "driver": driver_version(), "torch": torch.__version__, "pyxfer": __version__}


def _endpoint(device: str, uuids) -> str:
    d = as_device("pyxfer.tools.verdict_cache.save_verdicts", "a pair's device", device)
    return "cpu" if d.type == "cpu" else uuids[d.index]


def save_verdicts(pairs, path=None) -> str:
    """Write ``pairs`` ([{"src", "dst", "verdict"}], devices as "cpu" / "cuda:N") to the cache under
    the current key, atomically (a temporary file renamed; removed again when writing fails).
    Returns the path written. Raises OSError when the file cannot be written."""
    key = cache_key()
    doc = {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "key": key, "created": int(time.time()),
           "pairs": [{"src": _endpoint(p["src"], key["gpus"]), "dst": _endpoint(p["dst"], key["gpus"]),
                      "verdict": p["verdict"]} for p in pairs]}
    path = cache_path(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)  # never leave the temporary file behind (a directory at ``path``, a full disk)
        raise
    return path


def _is_endpoint(value):
    return value is None or isinstance(value, str)  # "cpu", a GPU's UUID, or None (a GPU without one)


def read_cache(path):
    """The verdict cache document at ``path``. Raises OSError when it cannot be read, ValueError
    naming the part that is wrong when it is not a verdict cache (schema, version, ``key`` or ``pairs``
    of the wrong type), so that nothing of a malformed cache is applied."""
    with open(path) as f:
        doc = json.load(f)  # JSONDecodeError, UnicodeDecodeError: ValueErrors
    if not isinstance(doc, dict):
        raise ValueError(f"expected a JSON object, got {type(doc).__name__}")
    if doc.get("schema") != SCHEMA or doc.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(f"schema {doc.get('schema')!r} version {doc.get('schema_version')!r}, "
                         f"expected {SCHEMA!r} version {SCHEMA_VERSION}")
    key, pairs = doc.get("key"), doc.get("pairs")
    if not isinstance(key, dict) or not isinstance(key.get("gpus"), list) \
            or not all(_is_endpoint(u) for u in key["gpus"]):
        raise ValueError(f"'key' must be an object with 'gpus' a list of GPU UUIDs, got {key!r:.200}")
    if not isinstance(pairs, list) or not all(
            isinstance(p, dict) and _is_endpoint(p.get("src")) and _is_endpoint(p.get("dst"))
            and isinstance(p.get("verdict"), str) for p in pairs):
        raise ValueError(f"'pairs' must be a list of {{src, dst, verdict}} objects of strings, got {pairs!r:.200}")
    return doc


def cached_verdicts(path=None, stacklevel: int = 2) -> dict:
    """The verdicts cached by `pyxfer doctor` that apply to this process (see the module docstring).

    ``path``: the cache file (default: cache_path()). Returns {(src, dst): verdict} of the pairs
    whose devices this process sees, as "cpu" / "cuda:N" of this process; {} when there is no cache,
    when it was made under another key (a RuntimeWarning says which part differs) or when it is not
    a verdict cache, malformed ``key`` or ``pairs`` included (a RuntimeWarning says why).
    ``stacklevel``: the warnings' (the caller's caller by default). Mutates nothing; raises nothing
    for a bad cache."""
    path = cache_path(path)
    if not os.path.exists(path):
        return {}
    try:
        doc = read_cache(path)
    except (OSError, ValueError) as e:
        warnings.warn(f"pyxfer: doctor verdict cache {path} ignored: not a verdict cache ({e})", RuntimeWarning,
                      stacklevel=stacklevel + 1)
        return {}
    cached, key = doc["key"], cache_key()
    # Every visible GPU must have been examined (a subset of the doctor's GPUs is fine).
    differs = [f"{k}: cache {cached.get(k)!r}, this process {key[k]!r}" for k in ("driver", "torch", "pyxfer")
               if cached.get(k) != key[k]]
    missing = [u for u in key["gpus"] if u not in cached["gpus"]]
    if missing:
        differs.append(f"GPUs {missing} are not in the cache")
    if differs:
        warnings.warn(f"pyxfer: doctor verdict cache {path} ignored: made under another key ({'; '.join(differs)}); "
                      f"run `pyxfer doctor` again", RuntimeWarning, stacklevel=stacklevel + 1)
        return {}
    local = {"cpu": "cpu", **{u: f"cuda:{i}" for i, u in enumerate(key["gpus"])}}
    verdicts = {}
    for p in doc["pairs"]:
        src, dst = local.get(p["src"]), local.get(p["dst"])
        if src is not None and dst is not None:  # else a GPU this process does not see
            verdicts[(src, dst)] = p["verdict"]
    return verdicts
