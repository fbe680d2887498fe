"""The documentation's examples are tests, so that none can go stale.

Every ```python block of README.md, CONTRIBUTING.md and docs/**/*.md runs, each in a fresh namespace;
the blocks of one page run in order in one fresh interpreter (``python -u``, a new empty working
directory per block, ``pyxfer.health`` reset before each), so that a page costs one import of torch.
An HTML comment on the line right before a block says where it runs:

    <!-- example: gpu -->              needs one CUDA GPU: marked ``gpu`` (skipped without one)
    <!-- example: multigpu -->         needs two: marked ``multigpu``
    <!-- example: requires MODULE -->  runs where MODULE can be imported, skipped elsewhere
    <!-- example: skip REASON -->      never runs (it cannot run in CI anywhere: say why)

A ```text block right after a python block (blank lines between are fine), preceded by
``<!-- output -->``, is what the block prints: its stdout at the file-descriptor level (processes
it forks included) must match, after this normalisation: trailing spaces and trailing blank lines
are ignored; ``...`` inside an expected line matches any text within one line; an expected line
that is exactly ``...`` matches any number of lines (none included). Use ``...`` only for what
varies from run to run or machine to machine (timings, GB/s, random offsets, versions).

Shell blocks are not run; every ``pyxfer <subcommand> --option`` they (or inline code) mention
must exist in the command line's --help. Also checked: the README is a front door (at most 250
lines, the two commands CI runs literally), every relative link resolves (headings included),
every ``docs/...`` pointer in the code names a file (and section) that exists, and
docs/environment.md lists exactly the PYXFER_* variables the code reads.
"""
import importlib.util
import json
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())  # the checkout
PAGES = sorted(p for p in [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").rglob("*.md")] if p.exists())
README_MAX_LINES = 250
README_COMMANDS = ("bash scripts/setup.sh && .venv/bin/pyxfer doctor",
                   "bash scripts/setup.sh && .venv/bin/python -m pytest -q tests")
MARKER = re.compile(r"^<!--\s*example:\s*(gpu|multigpu|requires\s+(\S+)|skip\s+(.+?))\s*-->$")
OUTPUT_MARKER = "<!-- output -->"
FENCE = re.compile(r"^(```|~~~)\s*([\w+-]*)")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


class Block:
    """One fenced code block of a page: language, first line of its body (1-based), source, the
    line before its opening fence, the marker there (kind, argument) and, for a python block, its
    expected output."""

    def __init__(self, page, lang, start, end, source, before):
        self.page, self.lang, self.start, self.end, self.source = page, lang, start, end, source
        self.before = before
        self.kind, self.arg, self.expected = None, None, None

    @property
    def line(self) -> int:
        return self.start + 2

    @property
    def name(self) -> str:
        return f"{_rel(self.page)}:{self.line}"


def parse_page(page: Path):
    """(blocks, problems): every fenced block with its marker and expected output; problems are
    malformed or misplaced markers and unclosed fences."""
    lines = page.read_text().splitlines()
    blocks, problems, i = [], [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start = m.group(1), m.group(2).lower(), i
        end = start + 1
        while end < len(lines) and not lines[end].startswith(fence):
            end += 1
        if end == len(lines):
            problems.append(f"{_rel(page)}:{start + 1}: unclosed code fence")
            break
        before = lines[start - 1].strip() if start > 0 else ""
        blocks.append(Block(page, lang, start, end, "\n".join(lines[start + 1:end]) + "\n", before))
        i = end + 1
    for k, b in enumerate(blocks):
        if b.before.startswith("<!-- example:"):
            m = MARKER.match(b.before)
            if not m:
                problems.append(f"{b.name}: unknown marker {b.before!r} (gpu, multigpu, requires MODULE, skip REASON)")
            elif b.lang != "python":
                problems.append(f"{b.name}: {b.before!r} annotates a {b.lang or 'plain'} block, not a python one")
            else:
                b.kind = m.group(1).split()[0]
                b.arg = m.group(2) or m.group(3)
        elif b.before == OUTPUT_MARKER:  # a text block right after a python block: its output
            prev = blocks[k - 1] if k else None
            if b.lang != "text" or prev is None or prev.lang != "python" \
                    or any(s.strip() for s in lines[prev.end + 1:b.start - 1]):
                problems.append(f"{b.name}: {OUTPUT_MARKER} must mark a ```text block right after a ```python block")
            else:
                prev.expected = b.source
    return blocks, problems


PARSED = {page: parse_page(page) for page in PAGES}
EXAMPLES = [b for page in PAGES for b in PARSED[page][0] if b.lang == "python"]


def _num_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _runnable(b: Block) -> bool:
    if b.kind == "skip":
        return False
    if b.kind == "gpu":
        return _num_gpus() >= 1
    if b.kind == "multigpu":
        return _num_gpus() >= 2
    if b.kind == "requires":
        return importlib.util.find_spec(b.arg) is not None
    return True


# Runs one page's blocks: argv[1] a JSON list of {name, source}, argv[2] where the results go.
RUNNER = r"""
import json, os, sys, tempfile, traceback
blocks = json.load(open(sys.argv[1]))
results = []
for block in blocks:
    error = None
    with tempfile.TemporaryDirectory() as work, tempfile.TemporaryFile() as out:
        os.chdir(work)
        sys.stdout.flush()
        saved = os.dup(1)
        os.dup2(out.fileno(), 1)
        try:
            if "pyxfer" in sys.modules:
                sys.modules["pyxfer"].health.reset()
            exec(compile(block["source"], block["name"], "exec"), {"__name__": "__main__"})
        except BaseException:
            error = traceback.format_exc()
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
        os.chdir("/")
        out.seek(0)
        results.append({"output": out.read().decode("utf-8", "replace"), "error": error})
json.dump(results, open(sys.argv[2], "w"))
"""
_results = {}


def _page_results(page: Path) -> dict:
    """{block line: {output, error}} for the page's runnable python blocks (run once per session)."""
    if page not in _results:
        blocks = [b for b in PARSED[page][0] if b.lang == "python" and _runnable(b)]
        with tempfile.TemporaryDirectory() as tmp:
            spec, out = Path(tmp, "blocks.json"), Path(tmp, "results.json")
            spec.write_text(json.dumps([{"name": b.name, "source": b.source} for b in blocks]))
            # NOTE: from an empty directory, so that the checkout is not put first on sys.path
            # (an interpreter of another venv, e.g. .venv-te, must import its own pyxfer).
            proc = subprocess.run([sys.executable, "-u", "-c", RUNNER, str(spec), str(out)], cwd=tmp,
                                  capture_output=True, text=True, timeout=1200)
            if proc.returncode != 0 or not out.exists():
                raise AssertionError(f"the runner of {_rel(page)} died (exit {proc.returncode}):\n"
                                     f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
            _results[page] = dict(zip([b.line for b in blocks], json.loads(out.read_text())))
    return _results[page]


def _line_regex(expected_line: str):
    return re.compile(".*?".join(re.escape(part) for part in expected_line.split("...")) + r"\Z")


def output_matches(expected: str, actual: str) -> bool:
    """Whether ``actual`` matches ``expected`` under the normalisation in the module docstring."""
    def lines(text):
        out = [s.rstrip() for s in text.splitlines()]
        while out and not out[-1]:
            out.pop()
        return out

    exp, act = lines(expected), lines(actual)
    memo = {}

    def match(i, j):
        if (i, j) not in memo:
            if i == len(exp):
                memo[i, j] = j == len(act)
            elif exp[i] == "...":
                memo[i, j] = any(match(i + 1, k) for k in range(j, len(act) + 1))
            else:
                memo[i, j] = j < len(act) and bool(_line_regex(exp[i]).match(act[j])) and match(i + 1, j + 1)
        return memo[i, j]

    return match(0, 0)


def _param(b: Block):
    marks = {"gpu": [pytest.mark.gpu], "multigpu": [pytest.mark.multigpu],
             "skip": [pytest.mark.skip(reason=f"docs example marked skip: {b.arg}")]}.get(b.kind, [])
    return pytest.param(b, id=b.name, marks=marks)


@pytest.mark.parametrize("block", [_param(b) for b in EXAMPLES])
def test_example(block):
    if block.kind == "requires" and importlib.util.find_spec(block.arg) is None:
        pytest.skip(f"needs {block.arg}, which this environment cannot import")
    result = _page_results(block.page)[block.line]
    assert result["error"] is None, f"{block.name} raised:\n{result['error']}\nprinted:\n{result['output']}"
    if block.expected is not None:
        assert output_matches(block.expected, result["output"]), (
            f"{block.name} printed:\n{result['output']}\nexpected (see the normalisation in this module):\n"
            f"{block.expected}")


def test_output_normalisation():
    assert output_matches("a 1.5 GB/s\n", "a 1.5 GB/s  \n\n")
    assert output_matches("a ... GB/s\n...\nend\n", "a 1.5 GB/s\nx\ny\nend\n")
    assert output_matches("...\nend", "end")
    assert not output_matches("a ... GB/s", "a 1.5 GB/s\nmore")
    assert not output_matches("exact", "exactly")
    assert not output_matches("two\nlines", "two")


def test_markers_and_outputs_are_well_formed():
    problems = [p for page in PAGES for p in PARSED[page][1]]
    assert not problems, "\n".join(problems)
    assert EXAMPLES, "no python examples found"
    skipped = [b.name for b in EXAMPLES if b.kind == "skip" and not (b.arg or "").strip()]
    assert not skipped, f"a skip marker must give its reason: {skipped}"


# ---- the command line: options mentioned in shell blocks and inline code exist
def _tool(name):
    """pyxfer's command-line module ``name`` (pyxfer/tools/, formerly pyxfer/)."""
    try:
        return importlib.import_module(f"pyxfer.tools.{name}")
    except ModuleNotFoundError:
        return importlib.import_module(f"pyxfer.{name}")


def _cli_help():
    parser = _tool("cli").build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    helps = {None: parser.format_help()}
    helps.update({name: p.format_help() for name, p in sub.choices.items()})
    return helps


_CLI = re.compile(r"(?<![\w.\-\[/])(?:[\w./-]*/)?pyxfer(?=[ \t])(.*)$")
_SHELL_STOP = ("|", "||", "&&", ";", "&")


def _words(rest: str) -> list:
    """The arguments after ``pyxfer`` on a command line, up to a shell operator or redirection."""
    try:
        words = shlex.split(rest, comments=True)
    except ValueError:  # an unbalanced quote: fall back to spaces
        words = rest.split()
    out = []
    for w in words:
        if w in _SHELL_STOP or w.startswith((">", "<", "2>")):
            break
        out.append(w)
    return out


def cli_mentions():
    """(where, arguments after `pyxfer`) for every command line in a shell block or inline code span."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for b in PARSED[page][0]:
            if b.lang in ("bash", "sh", "shell", "console"):
                for k, line in enumerate(b.source.splitlines()):
                    m = _CLI.search(line.split(" #")[0])  # not in a comment
                    if m:
                        found.append((f"{_rel(page)}:{b.line + k}", _words(m.group(1))))
        prose = re.sub(r"^(```|~~~).*?^\1", "", text, flags=re.S | re.M)
        for span in re.findall(r"`([^`\n]+)`", prose):
            m = _CLI.search(span)
            if m:
                found.append((f"{_rel(page)} `{span}`", _words(m.group(1))))
    return found


def test_cli_options_mentioned_exist():
    helps = _cli_help()
    bad = []
    for where, words in cli_mentions():
        command = words[0] if words and not words[0].startswith("-") else None
        if command is not None and command not in helps:
            bad.append(f"{where}: `pyxfer {command}` is not a subcommand ({', '.join(k for k in helps if k)})")
            continue
        for opt in (w.split("=")[0] for w in words if w.startswith("--")):
            if not re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])", helps[command]):
                bad.append(f"{where}: `pyxfer {command or ''} {opt}` is not in its --help")
    assert not bad, "\n".join(bad)
    assert len(cli_mentions()) >= 5  # the scan itself works


# ---- the README is a front door
def test_readme_is_short_and_has_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES
    for command in README_COMMANDS:
        assert command in readme.splitlines(), f"README.md must show `{command}` on a line of its own"


# ---- links
def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set:
    text = re.sub(r"^(```|~~~).*?^\1", "", page.read_text(), flags=re.S | re.M)
    return {_slug(h) for h in re.findall(r"^#+\s+(.+)$", text, flags=re.M)}


def test_relative_links_resolve():
    bad = []
    for page in PAGES:
        text = re.sub(r"^(```|~~~).*?^\1", "", page.read_text(), flags=re.S | re.M)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{_rel(page)}: link to {target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{_rel(page)}: link to {target}: no such heading")
    assert not bad, "\n".join(bad)


_CODE_DIRS = ("pyxfer", "csrc", "tests", "benchmarks", "scripts")
_CODE_SUFFIXES = (".py", ".cpp", ".h", ".cu", ".cuh", ".sh")


def _code_files():
    """The project's code (not benchmarks/runs/, the record of past runs, nor this file)."""
    for d in _CODE_DIRS:
        for p in sorted((ROOT / d).rglob("*")):
            if p.is_file() and p.suffix in _CODE_SUFFIXES and "runs" not in p.parts and p != Path(__file__).resolve():
                yield p
    yield ROOT / "setup.py"


def test_code_pointers_into_docs_exist():
    """Comments and docstrings point at docs/...md (and § sections of it): they must exist, and
    nothing points at files the repository does not have (shared/specs/..., DESIGN.md)."""
    bad = []
    for f in _code_files():
        text = f.read_text(errors="replace")
        for m in re.finditer(r"docs/([\w./-]+\.md)((?:\s*§\s*[\d.]*\d(?:\s*(?:/|,|and|-|–)\s*§?\s*[\d.]*\d)*)?)",
                             text):
            doc = ROOT / "docs" / m.group(1)
            if not doc.exists():
                bad.append(f"{_rel(f)}: docs/{m.group(1)} does not exist")
                continue
            numbers = set(re.findall(r"^#+\s+(\d+(?:\.\d+)*)\.?\s", doc.read_text(), flags=re.M))
            for section in re.findall(r"\d+(?:\.\d+)*", m.group(2)):
                if section not in numbers:
                    bad.append(f"{_rel(f)}: docs/{m.group(1)} has no section {section}")
        if re.search(r"shared/specs|DESIGN\.md", text):
            bad.append(f"{_rel(f)}: points at shared/specs or DESIGN.md, which the repository does not have")
    assert not bad, "\n".join(bad)


# ---- environment variables
_ENV_READ_IN_TESTS = re.compile(r"""(?:environ\.get\(|environ\[|getenv\()\s*["'](PYXFER_[A-Z0-9_]+)""")
NOT_ENVIRONMENT = {"PYXFER_HOST_DEVICE"}  # a C macro (csrc/include/pyxfer/host_device.h)


def code_env_vars() -> set:
    """PYXFER_* names in the code (pyxfer/, csrc/, scripts/, benchmarks/, setup.py, .ci/run), and
    those the tests read from the environment (tests also set made-up names on purpose)."""
    word = re.compile(r"(?<![\w])PYXFER_[A-Z0-9_]*[A-Z0-9]")
    names = set()
    for f in _code_files():
        text = f.read_text(errors="replace")
        names |= set((_ENV_READ_IN_TESTS if f.relative_to(ROOT).parts[0] == "tests" else word).findall(text))
    ci = ROOT / ".ci" / "run"
    if ci.exists():
        names |= set(word.findall(ci.read_text()))
    return names - NOT_ENVIRONMENT


def test_environment_page_lists_every_variable():
    page = (ROOT / "docs" / "environment.md").read_text()
    documented = set(re.findall(r"^\|\s*`(PYXFER_[A-Z0-9_]+)`", page, flags=re.M))
    in_code = code_env_vars()
    doctor = _tool("doctor")
    known_to_doctor = set(doctor.RUNTIME_ENV + doctor.OTHER_ENV)
    assert not in_code - documented, f"read by the code, missing from docs/environment.md: {in_code - documented}"
    assert not documented - in_code - known_to_doctor, \
        f"in docs/environment.md, read by nothing: {documented - in_code - known_to_doctor}"
