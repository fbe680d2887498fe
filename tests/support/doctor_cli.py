"""Running `pyxfer doctor` through its CLI entry point in-process, for the doctor's CPU tests: an autouse
fixture that isolates each test (no fault from the environment, the verdict cache in a temporary directory,
pyxfer.health restored) and the (exit code, output) of a run."""
import json

import pytest
import torch

import pyxfer
from pyxfer.tools import doctor
from pyxfer.tools.cli import main

from .tool_schemas import check_doctor_schema

__all__ = ["isolated", "run_doctor", "run_doctor_err", "run_json"]


@pytest.fixture(autouse=True)
def isolated(monkeypatch, tmp_path):
    """No fault from the environment, the cache in a temporary directory, health restored."""
    for name in ("PYXFER_INJECT_FAULT", doctor.TEST_FAULT_ENV, "PYXFER_ROUTE", "PYXFER_HEALTH_FROM_DOCTOR",
                 "PYXFER_PEER_FUSED_MIB", "PYXFER_PEER_CHUNKS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PYXFER_DOCTOR_CACHE", str(tmp_path / "verdicts.json"))
    pyxfer.health.reset()
    yield
    pyxfer.health.reset()


def run_doctor(capsys, *args):
    """(exit code, stdout) of `pyxfer doctor ARGS`: see run_doctor_err."""
    return run_doctor_err(capsys, *args)[:2]


def run_doctor_err(capsys, *args):
    """(exit code, stdout, stderr) of `pyxfer doctor ARGS` run through the CLI's entry point. Where GPUs are
    visible the probes stay on the pair a CPU-only machine has (cpu -> cpu) unless ARGS name pairs:
    these tests are about the doctor's logic; its GPU pairs are tests/tools/test_doctor_gpu.py's."""
    if torch.cuda.is_available() and "--pairs" not in args:
        args = (*args, "--pairs", "cpu->cpu")
    code = main(["doctor", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def run_json(capsys, *args):
    code, out = run_doctor(capsys, "--json", *args)
    doc = json.loads(out)
    check_doctor_schema(doc)
    assert doc["ok"] == (code == 0)
    return code, doc
