"""`pyxfer bench`'s options are checked before anything is measured (exit 2, one line naming the
option and what was expected, no traceback), and a finished run is never lost: an output that
cannot be written after the measurement (a full disk) is reported and the run saved elsewhere."""
import json
import os
import tempfile

import pytest
import torch

from pyxfer import bench
from pyxfer.cli import main

N = 4099  # odd, one size: fast on a shared CPU
QUICK = ["--sizes", str(N), "--reps", "1", "--warmup", "0", "--no-progress"]
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only rows run where no GPU is visible")


def bench_exit(capsys, *args):
    """(exit code, stdout, stderr) of `pyxfer bench QUICK ARGS` run in-process; argparse's own exit too."""
    try:
        code = main(["bench", *QUICK, *args])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("args,option,expected", [
    (["--json", "{d}/no/b.json"], "--json", "expected a file in an existing directory, got '{d}/no/b.json' "
                                            "({d}/no is not a directory)"),
    (["--json", "{d}"], "--json", "expected a file to write, got the directory '{d}'"),
    (["--plot", "out.txt"], "--plot", "expected a path ending in .png, got 'out.txt'"),
    (["--plot", "heatmap"], "--plot", "expected a path ending in .png, got 'heatmap'"),
    (["--plot", "{d}/no/b.png"], "--plot", "expected a file in an existing directory, got '{d}/no/b.png' "
                                           "({d}/no is not a directory)"),
    (["--sizes", "9223372036854775808"], "--sizes", "expected a size of at most 2^63 - 1 bytes (int64), "
                                                    "got '9223372036854775808'"),
    (["--sizes", "4K,99999999999G"], "--sizes", "expected a size of at most 2^63 - 1 bytes (int64), "
                                                "got '99999999999G'"),
    (["--threshold", "1"], "--threshold", "expected a fraction in (0, 1), got '1'"),
])
def test_outputs_and_sizes_are_checked_when_parsed(capsys, tmp_path, monkeypatch, args, option, expected):
    monkeypatch.chdir(tmp_path)
    args = [a.format(d=tmp_path) for a in args]
    code, out, err = bench_exit(capsys, *args)
    assert code == 2 and out == ""
    assert err.splitlines()[-1] == f"pyxfer bench: error: argument {option}: {expected.format(d=tmp_path)}"
    assert "Traceback" not in err and "no CUDA GPU visible" not in err  # nothing measured
    assert list(tmp_path.iterdir()) == []


@cpu_only
@pytest.mark.parametrize("args,expected", [
    (["--modes", ""], "--modes: expected names from ce,ce_bidir,sm_pull,sm_push,staged,verified,verified_deferred "
                      "separated by commas, got an empty name in ''"),
    (["--modes", "ce,"], "--modes: expected names from ce,ce_bidir,sm_pull,sm_push,staged,verified,"
                         "verified_deferred separated by commas, got an empty name in 'ce,'"),
    (["--modes", "ce,staged,ce"], "--modes: expected each mode once, got ce twice in 'ce,staged,ce'"),
    (["--modes", "ce,sm_pull"], "--modes: expected modes the rows support (cpu->cpu: ce,staged,verified,"
                                "verified_deferred), got sm_pull, which no row supports"),
    (["--pairs", ""], "--pairs: expected SRC->DST[,...] with endpoints from ['cpu'] (not host -> host where GPUs "
                      "are visible), got ''"),
    (["--pairs", "cpu->cpu, cpu -> cpu"], "--pairs: expected each row once, got cpu->cpu twice in "
                                          "'cpu->cpu, cpu -> cpu'"),
    (["--json", "b.png", "--plot", "b.png"], "--json and --plot: expected two files, got 'b.png' twice"),
    (["--sizes", "1000000G"], "--sizes: expected sizes whose buffers fit: 1e+06 GiB needs about 3 x 1e+06 GiB on "
                              "cpu, which has "),
])
def test_lists_and_sizes_that_would_measure_something_else_exit_2(capsys, tmp_path, monkeypatch, args, expected):
    monkeypatch.chdir(tmp_path)
    code, out, err = bench_exit(capsys, *args)
    assert code == 2 and out == "" and list(tmp_path.iterdir()) == []  # nothing measured, nothing written
    assert err.startswith(f"pyxfer bench: {expected}") and err.count("\n") == 1, err


@pytest.fixture(scope="module")
def small_doc(tmp_path_factory):
    """A real run's document (ce at N) for --compare."""
    path = tmp_path_factory.mktemp("old") / "old.json"
    assert main(["bench", *QUICK, "--modes", "ce", "--json", str(path)]) == 0
    return json.loads(path.read_text())


def typed(doc, **fields):
    doc = json.loads(json.dumps(doc))
    doc["results"][0].update(fields)
    return json.dumps(doc).encode()


@cpu_only
@pytest.mark.parametrize("case", ["missing", "truncated", "binary", "bytes as text", "negative gbps", "gbps as text",
                                  "bytes as bool", "results not a list"])
def test_compare_document_problems_name_the_file_before_measuring(capsys, tmp_path, small_doc, case):
    path = tmp_path / "old.json"
    text = json.dumps(small_doc).encode()
    content = {"truncated": text[:len(text) // 2], "binary": bytes(range(256)) * 4,
               "bytes as text": typed(small_doc, bytes=str(N)), "negative gbps": typed(small_doc, gbps=-5),
               "gbps as text": typed(small_doc, gbps="fast"), "bytes as bool": typed(small_doc, bytes=True),
               "results not a list": json.dumps({**small_doc, "results": 5}).encode()}.get(case)
    if content is not None:
        path.write_bytes(content)
    why = {"missing": "cannot read it (No such file or directory)", "truncated": "not a JSON document (",
           "binary": "not a JSON document (", "results not a list": "pyxfer.bench: 'results' must be a list, got int"
           }.get(case, "pyxfer.bench: malformed result {")
    code, out, err = bench_exit(capsys, "--modes", "ce", "--compare", str(path), "--json", str(tmp_path / "n.json"))
    assert code == 2 and out == "" and not (tmp_path / "n.json").exists()  # said before measuring
    assert err.startswith(f"pyxfer bench: --compare {path}: {why}") and err.count("\n") == 1, err


@cpu_only
def test_a_size_that_cannot_be_allocated_is_reported_and_the_run_carries_on():
    # passes the options' check when called directly: the allocation itself fails, after a size was measured
    huge = 1 << 50
    results, latency, sums, _ = bench.measure_all([("cpu", "cpu")], ["ce", "staged"], [N, huge], reps=1, warmup=0,
                                                  progress=False)
    by = {(r["mode"], r["bytes"]): r for r in results}
    assert sorted(by) == [("ce", N), ("ce", huge), ("staged", N), ("staged", huge)]
    assert by["ce", N]["check"] == "ok" and by["staged", N]["check"] == "ok"
    for mode in ("ce", "staged"):
        r = by[mode, huge]
        assert (r["check"], r["gbps"], r["reps"]) == ("error", None, 0)
        assert r["detail"].startswith("RuntimeError: ") and "can't allocate memory" in r["detail"]
    assert [s["bytes"] for s in sums] == [N] and latency[0]["median_us"] > 0


@cpu_only
def test_a_json_that_cannot_be_written_after_the_run_is_saved_elsewhere(capsys, tmp_path, monkeypatch):
    # a full disk, for real: a link to /dev/full passes the options' check and fails the write
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    link = tmp_path / "b.json"
    link.symlink_to("/dev/full")
    spare_dir = tmp_path / "tmp"
    spare_dir.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spare_dir))  # where the run goes instead
    code, out, err = bench_exit(capsys, "--modes", "ce", "--json", str(link))
    assert code == 2 and f"ce GB/s at {bench.fmt_size(N)}" in out and "wrote" not in out  # the report is printed
    (spare,) = spare_dir.iterdir()
    assert err.splitlines()[-1] == (f"pyxfer bench: --json: could not write {link} ([Errno 28] No space left on "
                                    f"device); the run is saved in {spare}")
    doc = json.loads(spare.read_text())
    bench.validate(doc)
    assert [(r["mode"], r["bytes"], r["check"]) for r in doc["results"]] == [("ce", N, "ok")]
    assert os.readlink(link) == "/dev/full" and sorted(p.name for p in tmp_path.iterdir()) == ["b.json", "tmp"]


@cpu_only
def test_a_plot_that_cannot_be_written_after_the_run_is_reported(capsys, tmp_path):
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (the test and bench extras bring it)")
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    png = tmp_path / "b.png"
    png.symlink_to("/dev/full")
    code, out, err = bench_exit(capsys, "--modes", "ce", "--json", str(tmp_path / "b.json"), "--plot", str(png))
    assert code == 2 and f"wrote {tmp_path / 'b.json'}" in out.splitlines() and f"wrote {png}" not in out
    assert err.splitlines()[-1] == (f"pyxfer bench: --plot: could not write {png} (OSError: [Errno 28] No space "
                                    f"left on device)")
    bench.validate(json.loads((tmp_path / "b.json").read_text()))  # the run itself is saved
