"""pyxfer.tools.pairs: the one --pairs parser of doctor and bench (each endpoint vocabulary its own)."""
import pytest

from pyxfer.tools import bench, doctor
from pyxfer.tools.pairs import parse_pairs


def test_parse_pairs_order_names_and_errors():
    names = {"a": "A", "b": "B"}
    assert parse_pairs("a->b, b -> a,a->a", names.get, expected="X") == [("A", "B"), ("B", "A"), ("A", "A")]
    with pytest.raises(ValueError, match=r"^--pairs: expected X, got 'a-b'$"):
        parse_pairs("a->b,a-b", names.get, expected="X")
    with pytest.raises(ValueError, match=r"^--pairs: expected X, got 'a->c'$"):
        parse_pairs("a->c", names.get, expected="X")
    with pytest.raises(ValueError, match=r"^--pairs: expected each row once, got A->B twice in 'a->b,a ->b'$"):
        parse_pairs("a->b,a ->b", names.get, expected="X", each="row")
    with pytest.raises(ValueError, match=r"^--pairs: expected X, got 'b->b'$"):
        parse_pairs("a->b,b->b", names.get, expected="X", accept=lambda s, d: s != d)


def test_bench_rows_refuse_host_to_host_where_gpus_are_visible():
    # parse_rows takes the GPU count: the rows of a 2-GPU machine are checked here without GPUs
    assert bench.parse_rows("pinned->cuda:1,cuda:1->cuda:0", 2) == [("pinned", "cuda:1"), ("cuda:1", "cuda:0")]
    with pytest.raises(ValueError, match=r"^--pairs: expected SRC->DST\[,\.\.\.\] with endpoints from \['pinned', "
                                         r"'pageable', 'cuda:0', 'cuda:1'\] \(not host -> host where GPUs are "
                                         r"visible\), got 'pinned->pageable'$"):
        bench.parse_rows("pinned->pageable", 2)
    assert bench.parse_rows("cpu->cpu", 0) == [("cpu", "cpu")]


def test_doctor_pairs_use_the_same_parser():
    assert doctor.select_pairs([], "cpu->cpu") == [("cpu", "cpu")]
    with pytest.raises(ValueError, match=r"^--pairs: expected SRC->DST\[,SRC->DST\.\.\.\] with devices from "
                                         r"\['cpu'\], got 'cpu->cuda:0'$"):
        doctor.select_pairs([], "cpu->cuda:0")
