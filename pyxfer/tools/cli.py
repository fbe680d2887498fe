"""Command line: `pyxfer doctor`, `pyxfer bench`, `pyxfer --version` (also `python -m pyxfer ...`).

This module parses arguments only; the commands live in pyxfer.tools.doctor and pyxfer.tools.bench.
"""
import argparse
import math
import os
import sys

MAX_BYTES = (1 << 63) - 1  # sizes travel as int64 through torch
MAX_TIMEOUT_S = 7 * 24 * 3600.0  # a week: longer waits overflow the watchdog's select() on some platforms


def _size(text):
    """A byte count: 4096, 4K / 4KiB, 64M / 64MiB, 1G / 1GiB (binary units), 1 to 2^63 - 1."""
    units = {"": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30}
    t = text.strip().lower().replace(" ", "")
    num = t.rstrip("kmgib")
    unit = t[len(num):]
    if not num.isdigit() or unit not in units or int(num) * units[unit] < 1:
        raise argparse.ArgumentTypeError(f"expected a size like 4096, 4K, 64MiB or 1G, got {text!r}")
    if int(num) * units[unit] > MAX_BYTES:
        raise argparse.ArgumentTypeError(f"expected a size of at most 2^63 - 1 bytes (int64), got {text!r}")
    return int(num) * units[unit]


def _sizes(text):
    return [_size(s) for s in text.split(",")]


def _number(text):
    try:
        return float(text)
    except ValueError:
        return math.nan


def _seconds(text):
    """A watchdog's timeout: positive, finite, at most MAX_TIMEOUT_S."""
    if not 0 < _number(text) <= MAX_TIMEOUT_S:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds up to {MAX_TIMEOUT_S:.0f} "
                                         f"(a week), got {text!r}")
    return _number(text)


def _fraction(upper_included):
    """A fraction in (0, 1] (``upper_included``) or (0, 1): 1 and above would flag what is not slower."""
    def parse(text):
        v = _number(text)
        if not (0 < v <= 1 if upper_included else 0 < v < 1):
            raise argparse.ArgumentTypeError(f"expected a fraction in (0, {'1]' if upper_included else '1)'}, "
                                             f"got {text!r}")
        return v
    return parse


def _output_path(suffix=None):
    """An output file that can be written: not a directory, in an existing writable directory (and
    ending in ``suffix``), checked when the arguments are parsed, before anything is measured."""
    def parse(text):
        if suffix and not text.lower().endswith(suffix):
            raise argparse.ArgumentTypeError(f"expected a path ending in {suffix}, got {text!r}")
        if os.path.isdir(text):
            raise argparse.ArgumentTypeError(f"expected a file to write, got the directory {text!r}")
        parent = os.path.dirname(os.path.abspath(text))
        if not os.path.isdir(parent):
            raise argparse.ArgumentTypeError(f"expected a file in an existing directory, got {text!r} "
                                             f"({parent} is not a directory)")
        if not os.access(parent if not os.path.exists(text) else text, os.W_OK):
            raise argparse.ArgumentTypeError(f"expected a file this process can write, got {text!r} "
                                             f"(permission denied)")
        return text
    return parse


def _version_text():
    import torch

    from .. import __version__
    from .._build import build_info

    info = build_info()
    cuda = f"CUDA {info['cuda_version']} {','.join(info['cuda_archs'])}" if info["cuda"] else "CPU only"
    return f"pyxfer {__version__} (built against torch {info['torch']}, {cuda}; running torch {torch.__version__})"


class _Version(argparse.Action):
    """--version, computed only when asked (it needs the native module)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, help="print pyxfer's version and build, then exit")

    def __call__(self, parser, namespace, values, option_string=None):
        print(_version_text())
        parser.exit()


def build_parser():
    from .bench import MODES, PRESETS

    parser = argparse.ArgumentParser(prog="pyxfer", description="Trustworthy, fast tensor transfers between GPUs.")
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(dest="command", required=True)

    d = sub.add_parser("doctor", help="check the build, the GPUs and every device pair (a verdict per pair)",
                       description="Self-checks, then a verdict per ordered device pair: ok, corrupt, dropped, "
                                   "slow, unsupported, hung or error. Exit code 1 unless everything is ok.")
    d.add_argument("--json", action="store_true", help="print one JSON document (schema pyxfer.doctor, version 2)")
    d.add_argument("--pairs", metavar="SRC->DST,...",
                   help="probe only these ordered pairs, e.g. 'cpu->cuda:0,cuda:0->cuda:1' (default: host <-> every "
                        "GPU and every GPU pair)")
    d.add_argument("--timeout", type=_seconds, default=30.0, metavar="S",
                   help="seconds a pair's probes may take before the pair is 'hung' (default 30)")
    d.add_argument("--large", type=_size, default=64 << 20, metavar="SIZE",
                   help="the large probe size (default 64MiB; cpu -> cpu uses at most 16MiB)")
    d.add_argument("--slow-fraction", type=_fraction(True), default=0.5, metavar="F",
                   help="'slow' under F x the median GB/s of comparable pairs (default 0.5)")
    d.add_argument("--cache", type=_output_path(), metavar="PATH",
                   help="verdict cache file (default $PYXFER_DOCTOR_CACHE or ~/.cache/pyxfer/doctor-verdicts.json)")
    d.add_argument("--no-cache", action="store_true", help="do not write the verdict cache")

    b = sub.add_parser("bench", help="bandwidth and latency matrices: copy engine, SM kernel, staged, verified",
                       description="Bandwidth (GB/s, 1e9 bytes/s) of every ordered pair and mode; "
                                   "see pyxfer.tools.bench.")
    b.add_argument("--preset", choices=sorted(PRESETS), default="full",
                   help="quick: 3 sizes up to 64 MiB, 5 reps (about a minute on one GPU); full: 4 KiB ... 1 GiB")
    b.add_argument("--sizes", type=_sizes, metavar="S,S,...", help="sizes of the sweep, e.g. 4K,1M,256M")
    b.add_argument("--modes", metavar="M,M,...", help=f"modes to run, of {','.join(MODES)} (default: all)")
    b.add_argument("--pairs", metavar="SRC->DST,...",
                   help="rows to run, e.g. 'pinned->cuda:0,cuda:0->cuda:0' (endpoints: pinned, pageable, cuda:N; "
                        "cpu where no GPU is visible)")
    b.add_argument("--reps", type=int, metavar="N", help="timed repetitions per point (median reported)")
    b.add_argument("--warmup", type=int, metavar="N", help="untimed repetitions first")
    b.add_argument("--json", type=_output_path(), metavar="PATH",
                   help="write the results (schema pyxfer.bench, version 2)")
    b.add_argument("--plot", type=_output_path(".png"), metavar="PATH.png",
                   help="write PNG heatmaps (needs matplotlib: pip install 'pyxfer[plot]')")
    b.add_argument("--compare", metavar="OLD.json", help="flag points slower than in an earlier --json")
    b.add_argument("--threshold", type=_fraction(False), default=0.10, metavar="F",
                   help="--compare flags a point slower by more than this fraction (default 0.10)")
    b.add_argument("--no-progress", action="store_true", help="no progress on stderr")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.command == "doctor":
        from .doctor import run
    else:
        from .bench import run
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
