"""`pyxfer bench`'s document: the schema's name and version, the modes each version knows, validation
of a document (its own or an older one read by --compare) and the comparison of two runs. The
document's fields are listed in pyxfer.tools.bench's docstring."""
import json
import math

__all__ = ["SCHEMA", "SCHEMA_VERSION", "MODES", "validate", "compare", "read_compare"]

SCHEMA, SCHEMA_VERSION = "pyxfer.bench", 3
MODES = ("ce", "ce_bidir", "sm_pull", "sm_push", "staged", "verified", "verified_deferred")
# what --compare reads (version 2 had these modes; its ce_bidir serialized the two directions)
_OLD_MODES = {1: ("ce", "ce_bidir", "sm", "staged", "verified", "verified_deferred"), 2: MODES}


def _is_rate(v):
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf)


def _is_result(r, modes):
    """Whether ``r`` is a result whose fields compare() can trust (a typed field that compares nothing
    would hide a slowdown)."""
    return (isinstance(r, dict) and {"src", "dst", "mode", "bytes", "gbps", "check"} <= set(r)
            and isinstance(r["src"], str) and isinstance(r["dst"], str) and r["mode"] in modes
            and isinstance(r["bytes"], int) and not isinstance(r["bytes"], bool) and r["bytes"] >= 1
            and _is_rate(r["gbps"]) and r["check"] in ("ok", "corrupt", "error"))


def validate(doc, *, older=False):
    """Raise ValueError unless ``doc`` is a pyxfer.bench document of this schema version (``older``:
    or of an earlier one --compare can read), its results typed as the schema says (src, dst and mode
    strings, bytes an integer >= 1, gbps a positive number or null)."""
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise ValueError(f"not a {SCHEMA} document (schema {doc.get('schema') if isinstance(doc, dict) else None!r})")
    version = doc.get("schema_version")
    known = [SCHEMA_VERSION] + (sorted(_OLD_MODES) if older else [])
    if version not in known:
        raise ValueError(f"{SCHEMA} schema_version {version!r}, expected {' or '.join(map(str, known))}")
    modes = MODES if version == SCHEMA_VERSION else _OLD_MODES[version]
    for key in ("created", "machine", "method", "config", "results", "ratios", "latency", "checksum",
                "method_check", "corrupt") + (("warnings",) if version == SCHEMA_VERSION else ()):
        if key not in doc:
            raise ValueError(f"{SCHEMA} document without {key!r}")
    if not isinstance(doc["results"], list):
        raise ValueError(f"{SCHEMA}: 'results' must be a list, got {type(doc['results']).__name__}")
    for r in doc["results"]:
        if not _is_result(r, modes):
            raise ValueError(f"{SCHEMA}: malformed result {r!r:.300} (expected src, dst strings, mode one of "
                             f"{','.join(modes)}, bytes an integer >= 1, gbps a positive number or null, check "
                             f"ok, corrupt or error)")


def compare(doc, old, threshold):
    """Points of ``doc`` slower than the same point of ``old`` by more than ``threshold`` (a fraction)."""
    before = {(r["src"], r["dst"], r["mode"], r["bytes"]): r["gbps"] for r in old["results"]}
    slower = []
    for r in doc["results"]:
        was = before.get((r["src"], r["dst"], r["mode"], r["bytes"]))
        if was and r["gbps"] is not None and r["gbps"] < was * (1 - threshold):
            slower.append({"src": r["src"], "dst": r["dst"], "mode": r["mode"], "bytes": r["bytes"],
                           "old_gbps": was, "new_gbps": r["gbps"], "ratio": round(r["gbps"] / was, 4)})
    return slower


def read_compare(path):
    """The document of --compare ``path``, validated (validate(older=True)). Raises ValueError naming
    the file and what is wrong with it."""
    try:
        with open(path, "rb") as f:
            old = json.loads(f.read())
    except OSError as e:
        raise ValueError(f"--compare {path}: cannot read it ({e.strerror or e})") from None
    except (ValueError, RecursionError) as e:  # truncated, binary (UnicodeDecodeError is a ValueError), ...
        raise ValueError(f"--compare {path}: not a JSON document ({e})") from None
    try:
        validate(old, older=True)
    except ValueError as e:
        raise ValueError(f"--compare {path}: {e}") from None
    return old
