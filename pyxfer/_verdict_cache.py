"""The on-disk cache of `pyxfer doctor`'s per-pair verdicts, and loading it into pyxfer.health.

The cache is one JSON document (schema "pyxfer.doctor.verdicts", version 1):
``{"schema", "schema_version", "key": {"gpus": [UUID, ...], "driver", "torch", "pyxfer"},
"created": unix seconds, "pairs": [{"src", "dst", "verdict"}]}`` where src / dst are "cpu" or a
GPU's UUID (not its index: CUDA_VISIBLE_DEVICES may renumber the GPUs of a later process).

Loading applies the verdicts to pyxfer.health (per process): a pair found ``corrupt``, ``dropped``
or ``hung`` is marked "corrupt", so route="auto" sends its copies staged from the first copy of the
process; an ``ok`` pair is marked "healthy". A cache made under another key (other GPUs, driver,
torch or pyxfer) is ignored with a RuntimeWarning naming what differs; so is a file that is not a
verdict cache (another schema, a ``key`` or ``pairs`` of the wrong shape): nothing of it is applied.
$PYXFER_HEALTH_FROM_DOCTOR set to a value that loads nothing (not 0, 1 or a file's path; 1 without
a cache) warns at import too.
"""
import contextlib
import json
import os
import time
import warnings

import torch

__all__ = ["CACHE_ENV", "HEALTH_ENV", "cache_path", "cache_key", "save_verdicts", "read_cache", "load_doctor_verdicts",
           "env_problem", "load_from_env"]

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


def load_doctor_verdicts(path=None) -> dict:
    """Apply the verdicts cached by `pyxfer doctor` to pyxfer.health (see the module docstring).

    ``path``: the cache file (default: cache_path()). Returns {(src, dst): verdict} of the pairs
    applied, devices as "cpu" / "cuda:N" of this process; {} when there is no cache, when it was
    made under another key (a RuntimeWarning says which part differs) or when it is not a verdict
    cache, malformed ``key`` or ``pairs`` included (a RuntimeWarning says why; nothing of it is
    applied). Mutates pyxfer.health; raises nothing for a bad cache."""
    from . import health
    path = cache_path(path)
    if not os.path.exists(path):
        return {}
    try:
        doc = read_cache(path)
    except (OSError, ValueError) as e:
        warnings.warn(f"pyxfer: doctor verdict cache {path} ignored: not a verdict cache ({e})", RuntimeWarning,
                      stacklevel=2)
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
                      f"run `pyxfer doctor` again", RuntimeWarning, stacklevel=2)
        return {}
    local = {"cpu": "cpu", **{u: f"cuda:{i}" for i, u in enumerate(key["gpus"])}}
    applied = {}
    for p in doc["pairs"]:
        src, dst = local.get(p["src"]), local.get(p["dst"])
        if src is None or dst is None:
            continue  # a GPU this process does not see
        if p["verdict"] in BAD_VERDICTS:
            health.mark(src, dst, "corrupt")
        elif p["verdict"] == "ok":
            health.mark(src, dst, "healthy")
        else:
            continue  # slow / unsupported / error: the data was right or the path is not direct
        applied[(src, dst)] = p["verdict"]
    return applied


def env_problem(value):
    """Why ``value`` of $PYXFER_HEALTH_FROM_DOCTOR loads no verdicts although it is set, or None: a
    value that is neither "0", "1" nor the path of a file, or "1" without a cache at cache_path()."""
    if value in ("", "0"):
        return None
    if value == "1":
        if os.path.isfile(cache_path()):
            return None
        return f"{HEALTH_ENV}=1: there is no verdict cache at {cache_path()} (run `pyxfer doctor`)"
    if os.path.isfile(value):
        return None
    return (f"{HEALTH_ENV}={value!r}: expected 1 (the cache at {cache_path()}), 0, or the path of a verdict cache "
            f"file, and there is no file {value!r}")


def load_from_env() -> dict:
    """load_doctor_verdicts() when $PYXFER_HEALTH_FROM_DOCTOR is set ("1", or the cache's path). A value
    that loads nothing (env_problem) warns (RuntimeWarning) and loads nothing; raises nothing."""
    value = os.environ.get(HEALTH_ENV, "")
    if value in ("", "0"):
        return {}
    problem = env_problem(value)
    if problem:
        warnings.warn(f"pyxfer: {problem}: no doctor verdicts loaded", RuntimeWarning, stacklevel=2)
        return {}
    return load_doctor_verdicts(None if value == "1" else value)
