"""The patch contract on a script's own module (issue 39 item 9): a script run as ``__main__`` that
imports a patched function by name is also registered as ``__mp_main__`` as soon as multiprocessing
is imported (``import torch`` does: torch/__init__ imports torch.multiprocessing, and
multiprocessing/__init__.py runs ``sys.modules['__mp_main__'] = sys.modules['__main__']``). The
binding is found once and patched, not refused as "listed twice"."""
import json
import os
import subprocess
import sys
import textwrap

TARGET = '''
def scale(x):
    return 2 * x
'''

SCRIPT = '''
import functools
import json
import sys

before = "__mp_main__" in sys.modules
import torch  # noqa: E402,F401  (registers this module again as __mp_main__, through multiprocessing)

from pyxfer_main_target import scale  # noqa: E402  the patched function, imported by name
from pyxfer_main_target import scale as twice  # noqa: E402  and under a second name
from pyxfer.integrations._patch import Integration, holders  # noqa: E402


class Everywhere(Integration):
    """A real integration (real import and version check of a real distribution) that patches a
    function in its module and in every module that imported it by name, as the TE one does."""

    def __init__(self):
        super().__init__("main-module-test", module="pyxfer_main_target", distribution="torch", tested=("1.0", "99"))

    def bindings(self, target):
        original = target.scale
        replacement = functools.wraps(original)(lambda x: -original(x))
        yield target, "scale", replacement
        for owner, attribute in holders(original, exclude=target):
            yield owner, attribute, replacement


kept = [scale]  # in a list: a global named ``original`` would be one more binding to patch
p = Everywhere()
report = p.patch()
patched = (scale(3), twice(5), sys.modules["pyxfer_main_target"].scale(7))
p.unpatch()
print(json.dumps({
    "aliased_by_torch": not before and sys.modules["__mp_main__"] is sys.modules["__main__"],
    "where": [b.where for b in report.bindings],
    "patched": patched,
    "restored": scale is twice is kept[0] is sys.modules["pyxfer_main_target"].scale,
    "after": (scale(3), twice(5)),
}))
'''


def test_a_script_importing_the_target_by_name_is_patched_once(tmp_path):
    (tmp_path / "pyxfer_main_target.py").write_text(textwrap.dedent(TARGET))
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(SCRIPT))
    # run from tmp_path: the script's folder is first on sys.path; pyxfer comes from the environment
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, check=False,
                       cwd=str(tmp_path), env={**os.environ})
    assert r.returncode == 0, r.stdout + r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["aliased_by_torch"], "import torch no longer registers __main__ as __mp_main__: the test is vacuous"
    assert got["where"] == ["pyxfer_main_target.scale", "__main__.scale", "__main__.twice"]
    assert got["patched"] == [-6, -10, -14]
    assert got["restored"] and got["after"] == [6, 10]
