"""The agreement record of pyxfer.all_gather as pure logic (pyxfer.gather.record), with no process
group: what each input encodes, that every agreed field can be the only one that differs, the exact
error every rank raises for each disagreement, and the status word of a failure after agreement."""
import math

import pytest
import torch

from pyxfer.formats import QuantizeSpec
from pyxfer.gather import record as rec

OP = "pyxfer.all_gather"
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def plain(dtype=torch.float32, shape=(4, 3), verify=False):
    return dict(kind=rec.KIND_PLAIN, dtype=dtype, shape=shape, verify=verify)


def quantized(spec, kind=rec.KIND_QUANTIZED, dtype=torch.bfloat16, shape=(32, 64), swizzled=False):
    return dict(kind=kind, dtype=dtype, shape=shape, spec=spec, out_swizzled=swizzled)


MXFP8 = QuantizeSpec("mxfp8", rowwise=True, columnwise=True)
# field name in errors: (rank 0's call, the other ranks' call, how rank 0's value reads, the others')
DISAGREEMENTS = {
    "input kind": (quantized(MXFP8), quantized(MXFP8, kind=rec.KIND_TO_QUANTIZE), "QuantizedTensor",
                   "tensor with quantize_as"),
    "format": (quantized(QuantizeSpec("fp8_block_1x128"), shape=(128, 128)),
               quantized(QuantizeSpec("fp8_block_128x128"), shape=(128, 128)), "'fp8_block_1x128'",
               "'fp8_block_128x128'"),
    "dtype": (plain(torch.float32), plain(torch.float16), "float32", "float16"),
    "fp8_dtype": (quantized(QuantizeSpec("mxfp8", fp8_dtype=E4M3)), quantized(QuantizeSpec("mxfp8", fp8_dtype=E5M2)),
                  "float8_e4m3fn", "float8_e5m2"),
    "rowwise usage": (quantized(MXFP8), quantized(QuantizeSpec("mxfp8", rowwise=False, columnwise=True)),
                      "True", "False"),
    "columnwise usage": (quantized(MXFP8), quantized(QuantizeSpec("mxfp8")), "True", "False"),
    "gemm_swizzled_scales": (quantized(MXFP8, swizzled=True), quantized(MXFP8), "True", "False"),
    "pow2_scales": (quantized(QuantizeSpec("fp8_block_1x128"), shape=(128, 128)),
                    quantized(QuantizeSpec("fp8_block_1x128", pow2_scales=False), shape=(128, 128)), "True", "False"),
    "amax_epsilon": (quantized(QuantizeSpec("fp8_block_128x128"), shape=(128, 128)),
                     quantized(QuantizeSpec("fp8_block_128x128", amax_epsilon=1e-3), shape=(128, 128)), "0.0",
                     "0.001"),
    "NVFP4 global_amax (given or not)": (quantized(QuantizeSpec("nvfp4"), kind=rec.KIND_TO_QUANTIZE),
                                         quantized(QuantizeSpec("nvfp4", global_amax=2.0), kind=rec.KIND_TO_QUANTIZE),
                                         "True", "False"),
    "verify": (plain(verify=True), plain(verify=False), "True", "False"),
    "ndim": (plain(shape=(4, 3)), plain(shape=(4, 3, 0)), "2", "3"),  # the same shape slots: only ndim differs
    "shape[1:]": (plain(shape=(4, 3)), plain(shape=(4, 2)), "[3]", "[2]"),
    "dim 0 (shards must be of equal size)": (plain(shape=(4, 3)), plain(shape=(5, 3)), "4", "5"),
    "the NVFP4 global_amax of quantize_as": (
        quantized(QuantizeSpec("nvfp4", global_amax=1.0), kind=rec.KIND_TO_QUANTIZE),
        quantized(QuantizeSpec("nvfp4", global_amax=2.5), kind=rec.KIND_TO_QUANTIZE), "1.0", "2.5"),
}
SLOT_OF = {name: slot for slot, name in rec.AGREE}
SLOT_OF.update({"shape[1:]": rec.F_SHAPE + 1, "dim 0 (shards must be of equal size)": rec.F_SHAPE,
                "the NVFP4 global_amax of quantize_as": rec.F_AMAX_ROW})


def test_every_agreed_field_has_a_disagreement_case():
    assert {name for _, name in rec.AGREE} <= set(DISAGREEMENTS)


@pytest.mark.parametrize("world", [2, 3, 5])
@pytest.mark.parametrize("field", list(DISAGREEMENTS))
def test_disagreement_names_the_field_values_and_ranks(field, world):
    first, other, shown0, shown1 = DISAGREEMENTS[field]
    r0, r1 = rec.encode(**first), rec.encode(**other)
    # the field is the only agreed slot that differs (so that it alone explains the disagreement)
    differs = [i for i in range(rec.AGREE_LEN) if r0[i] != r1[i]]
    assert differs == ([SLOT_OF[field]] if SLOT_OF[field] < rec.AGREE_LEN else []), differs
    assert rec.signature(r0) != rec.signature(r1)
    others = "rank 1" if world == 2 else f"ranks {', '.join(map(str, range(1, world)))}"
    want = f"{OP}: ranks disagree on {field}: {shown0} on rank 0; {shown1} on {others}"
    for metas in ([r0] + [r1] * (world - 1), [list(r0)] + [list(r1) for _ in range(world - 1)]):
        with pytest.raises(ValueError) as info:
            rec.check_agreement(metas)
        assert str(info.value) == want
    # the same records in another order name the ranks where they are
    with pytest.raises(ValueError) as info:
        rec.check_agreement([r1, r0] + [r1] * (world - 2))
    where = "rank 0" if world == 2 else f"ranks 0, {', '.join(map(str, range(2, world)))}"
    assert str(info.value) == f"{OP}: ranks disagree on {field}: {shown1} on {where}; {shown0} on rank 1"


@pytest.mark.parametrize("call", [plain(), plain(torch.bool, (0,), True), quantized(MXFP8, swizzled=True),
                                  quantized(QuantizeSpec("nvfp4", global_amax=3.0), kind=rec.KIND_TO_QUANTIZE),
                                  quantized(QuantizeSpec("fp8_block_1x128", fp8_dtype=E5M2, amax_epsilon=0.5),
                                            shape=(2, 64, 128))])
def test_equal_records_agree_and_shard_values_may_differ(call):
    metas = [rec.encode(**call) for _ in range(3)]
    metas[1][rec.F_HASH] = 12345  # hashes and shard amaxes are per rank
    if not rec.gives_nvfp4_amax(metas[0]):
        metas[2][rec.F_AMAX_ROW] = rec.f32_bits(7.0)
    rec.check_agreement(metas)


def test_encode_writes_every_field():
    spec = QuantizeSpec("fp8_block_128x128", rowwise=False, columnwise=True, fp8_dtype=E5M2, pow2_scales=False,
                        amax_epsilon=0.25)
    meta = rec.encode(kind=rec.KIND_QUANTIZED, dtype=torch.float16, shape=(3, 128, 256), verify=True, spec=spec)
    assert len(meta) == rec.RECORD_LEN and meta[rec.F_MAGIC] == rec.MAGIC and meta[rec.F_ERROR] == 0
    assert meta[rec.F_KIND] == rec.KIND_QUANTIZED and meta[rec.F_FMT] == rec.FORMAT_CODE["fp8_block_128x128"]
    assert rec.describe(rec.F_DTYPE, meta[rec.F_DTYPE]) == "float16"
    assert rec.describe(rec.F_FP8, meta[rec.F_FP8]) == "float8_e5m2"
    assert (meta[rec.F_ROW], meta[rec.F_COL], meta[rec.F_SWIZZLED], meta[rec.F_POW2]) == (0, 1, 0, 0)
    assert rec.bits_f64(meta[rec.F_EPS]) == 0.25 and meta[rec.F_VERIFY] == 1 and meta[rec.F_AMAX_AUTO] == 0
    assert meta[rec.F_NDIM] == 3 and meta[rec.F_SHAPE:rec.F_SHAPE + 4] == [3, 128, 256, 0]
    assert meta[rec.AGREE_LEN:] == [0] * (rec.RECORD_LEN - rec.AGREE_LEN)  # written on the device
    nvfp4 = rec.encode(**quantized(QuantizeSpec("nvfp4", global_amax=6.5), kind=rec.KIND_TO_QUANTIZE))
    assert meta[rec.F_FP8] != 0 and nvfp4[rec.F_FP8] == 0 and nvfp4[rec.F_AMAX_AUTO] == 0
    assert rec.amaxes([nvfp4], rec.F_AMAX_ROW) == rec.amaxes([nvfp4], rec.F_AMAX_COL) == [6.5]
    assert rec.gives_nvfp4_amax(nvfp4) and not rec.amax_from_records(nvfp4)
    auto = rec.encode(**quantized(QuantizeSpec("nvfp4"), kind=rec.KIND_TO_QUANTIZE))
    assert auto[rec.F_AMAX_AUTO] == 1 and rec.amax_from_records(auto) and not rec.gives_nvfp4_amax(auto)
    # an NVFP4 QuantizedTensor's amax comes from its data (the device), not from the spec
    assert rec.encode(**quantized(QuantizeSpec("nvfp4")))[rec.F_AMAX_AUTO] == 0
    assert rec.signature(rec.encode(error=True)) is None
    assert rec.encode(error=True)[1:] == [1] + [0] * (rec.RECORD_LEN - 2)


def test_float_bits_round_trip():
    for value in (0.0, 1e-3, 448.0, math.inf, 3.4028234663852886e38):
        assert rec.bits_f64(rec.f64_bits(value)) == value
        assert rec.bits_f32(rec.f32_bits(value)) == torch.tensor(value, dtype=torch.float32).item()


def test_rejected_inputs_and_foreign_records():
    good, bad = rec.encode(**plain()), rec.encode(error=True)
    with pytest.raises(ValueError) as info:
        rec.check_agreement([good, bad, good])
    assert str(info.value) == (f"{OP}: rank 1 rejected its input or failed before sending (see the error raised "
                               "there); nothing was gathered")
    with pytest.raises(ValueError, match="ranks 0, 2 rejected their input"):
        rec.check_agreement([bad, good, bad])
    own = TypeError("x must be a torch.Tensor")
    with pytest.raises(TypeError) as info:
        rec.check_agreement([good, bad], own_error=own)
    assert info.value is own
    foreign = [0] * rec.RECORD_LEN
    with pytest.raises(RuntimeError) as info:
        rec.check_agreement([good, foreign, bad, foreign])
    assert str(info.value) == (f"{OP}: ranks 1, 3 sent no pyxfer gather metadata (different pyxfer versions, or "
                               "the ranks are not calling all_gather at the same point)")
    older = list(good)
    older[rec.F_MAGIC] = 0x70786761_74680003  # protocol version 3
    with pytest.raises(RuntimeError, match="rank 0 sent no pyxfer gather metadata"):
        rec.check_agreement([older, good])


def test_the_first_differing_field_is_named():
    r0 = rec.encode(**plain(torch.float32, (4, 3)))
    r1 = rec.encode(**plain(torch.float16, (5, 2)))
    with pytest.raises(ValueError, match="ranks disagree on dtype: float32 on rank 0; float16 on rank 1$"):
        rec.check_agreement([r0, r1])


def test_statuses_name_the_failing_ranks_and_steps():
    rec.check_statuses([0, 0, 0], rank=1)
    with pytest.raises(RuntimeError) as info:
        rec.check_statuses([0, 0, rec.STEP_NVFP4_QUANTIZE], rank=0)
    assert str(info.value) == (f"{OP}: the call failed after the ranks agreed on it (rank 2 while quantizing with "
                               "the group's NVFP4 global amax; see the error raised there), so rank 0 received "
                               "no usable data; nothing was gathered")
    with pytest.raises(RuntimeError, match=r"\(rank 0 while building the send and receive buffers; rank 3 while "
                                           r"quantizing with the group's NVFP4 global amax;"):
        rec.check_statuses([rec.STEP_BUILD, 0, 0, rec.STEP_NVFP4_QUANTIZE], rank=1)
    assert rec.step_name(rec.STEP_BUILD) == "building the send and receive buffers" and rec.step_name(99) == "step 99"


def test_describe_reads_every_kind_of_slot():
    assert rec.describe(rec.F_KIND, rec.KIND_PLAIN) == "plain tensor" and rec.describe(rec.F_KIND, 9) == "9"
    assert rec.describe(rec.F_FMT, 0) == "none" and rec.describe(rec.F_FMT, rec.NVFP4_CODE) == "'nvfp4'"
    assert rec.describe(rec.F_DTYPE, 0) == "none"
    assert rec.describe(rec.F_DTYPE, rec.DTYPE_CODE[torch.complex64]) == "complex64"
    assert rec.describe(rec.F_AMAX_COL, rec.f32_bits(0.5)) == "0.5"
    assert rec.describe(rec.F_VERIFY, 1) == "True" and rec.describe(rec.F_NDIM, 3) == "3"
