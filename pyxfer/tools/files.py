"""Files the tools write (the verdict cache, `pyxfer bench --json`)."""
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
