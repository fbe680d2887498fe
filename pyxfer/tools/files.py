"""Files the tools write (the verdict cache, `pyxfer bench --json`) and read back (a child process's stderr)."""
import contextlib
import json
import os


def write_json_atomic(path, doc):
    """Write ``doc`` as JSON to ``path`` through a temporary file renamed over it: a failed write leaves the
    old file and no temporary (a directory at ``path``, a full disk). Raises OSError when it cannot."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def last_line(f, limit=300):
    """The last non-blank line (at most ``limit`` characters) of the binary file ``f`` (a child process's
    stderr, read from its start), or "no message"."""
    f.seek(0)
    lines = [ln for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    return lines[-1][:limit] if lines else "no message"
