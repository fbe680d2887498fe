"""Fresh interpreters for anything that may leave a sticky CUDA error or needs a process of its own."""
import os
import subprocess
import sys


def run_python(code: str, env=None, timeout=600):
    """Run code in a fresh interpreter (for anything that may leave a sticky CUDA error)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout)


_FRESH_PROCESS_HELPERS = """
def raises(call, exc_type, text):
    try:
        call()
    except exc_type as e:
        assert text in str(e), str(e)
    else:
        raise AssertionError("no error, expected " + text)
"""


def run_fresh(code: str) -> None:
    """Run ``code`` in a new interpreter, with ``raises(call, exc_type, text)`` defined; it must finish."""
    r = run_python(_FRESH_PROCESS_HELPERS + code + "\nprint('ok')\n")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["ok"]


def pool_workers() -> int:
    """Threads of this process named as pyxfer's host hashing pool's workers (Linux: /proc)."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return names.count("pyxfer-host")
