"""Fake (meta) implementations of the native ops, so they trace under torch.compile and FakeTensor.
Shapes, dtypes and devices only; the schemas live in csrc/torch_bindings.cpp."""
import torch

from ._checks import check_tensor
from .formats import buffer_layout


@torch.library.register_fake("pyxfer::checksum")
def _checksum_fake(t, seed=0):
    return t.new_empty((), dtype=torch.int64)


@torch.library.register_fake("pyxfer::checksum_partial")
def _checksum_partial_fake(t, word_offset=0, seed=0):
    return t.new_empty((), dtype=torch.int64)


@torch.library.register_fake("pyxfer::checksum_combine")
def _checksum_combine_fake(partials, num_bytes, seed=0):
    return partials.new_empty((), dtype=torch.int64)


@torch.library.register_fake("pyxfer::verified_copy")
def _verified_copy_fake(src, device, route="auto", verify="sync", pin_memory=True):
    return torch.empty(src.shape, dtype=src.dtype, device=device)


@torch.library.register_fake("pyxfer::verified_copy_many")
def _verified_copy_many_fake(srcs, device, route="auto", verify="sync", pin_memory=True):
    return [torch.empty(s.shape, dtype=s.dtype, device=device) for s in srcs]


@torch.library.register_fake("pyxfer::staged_copy")
def _staged_copy_fake(src, device):
    return torch.empty(src.shape, dtype=src.dtype, device=device)


@torch.library.register_fake("pyxfer::sm_copy")
def _sm_copy_fake(src, dst, pull=True):
    # Also sm_copy's Meta kernel, which real meta tensors reach: refuse them, as every entry point does
    # (FakeTensors report the device they stand for, never meta).
    check_tensor("torch.ops.pyxfer.sm_copy", "src", src)
    check_tensor("torch.ops.pyxfer.sm_copy", "dst", dst)
    return None


@torch.library.register_fake("pyxfer::pointer_chase")
def _pointer_chase_fake(ring, num_hops, device=None):
    check_tensor("torch.ops.pyxfer.pointer_chase", "ring", ring)
    return ring.new_empty((), dtype=torch.int64, device=ring.device if device is None else device)


@torch.library.register_fake("pyxfer::peer_exchange")
def _peer_exchange_fake(a, b, rounds, seed, timeout_s, corrupt_round=-1, stall_side=-1):
    check_tensor("torch.ops.pyxfer.peer_exchange", "a", a)
    check_tensor("torch.ops.pyxfer.peer_exchange", "b", b)
    return torch.empty((2, 5), dtype=torch.int64)


def _quantized_fakes(x, fmt, rowwise, columnwise):
    layout = buffer_layout(fmt, x.shape, rowwise=rowwise, columnwise=columnwise)
    names = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")
    return tuple(x.new_empty(layout[n][0], dtype=layout[n][1]) if n in layout else x.new_empty((0,), dtype=torch.uint8)
                 for n in names)


@torch.library.register_fake("pyxfer::quantize_fp8_block")
def _quantize_fp8_block_fake(x, block_dim, rowwise, columnwise, fp8_dtype, pow2_scales, amax_epsilon):
    return _quantized_fakes(x, "fp8_block_1x128" if block_dim == 1 else "fp8_block_128x128", rowwise, columnwise)


@torch.library.register_fake("pyxfer::quantize_mxfp8")
def _quantize_mxfp8_fake(x, rowwise, columnwise, fp8_dtype):
    return _quantized_fakes(x, "mxfp8", rowwise, columnwise)


@torch.library.register_fake("pyxfer::quantize_nvfp4")
def _quantize_nvfp4_fake(x, global_amax, rowwise, columnwise):
    return _quantized_fakes(x, "nvfp4", rowwise, columnwise)


@torch.library.register_fake("pyxfer::dequantize_fp8_block")
def _dequantize_fp8_block_fake(data, scale_inv, block_dim, columnwise, fp8_dtype, out_dtype):
    shape = (*data.shape[1:], data.shape[0]) if columnwise else data.shape
    return data.new_empty(shape, dtype=out_dtype)


@torch.library.register_fake("pyxfer::dequantize_mxfp8")
def _dequantize_mxfp8_fake(data, scale_inv, columnwise, fp8_dtype, out_dtype):
    return data.new_empty(data.shape, dtype=out_dtype)


@torch.library.register_fake("pyxfer::dequantize_nvfp4")
def _dequantize_nvfp4_fake(data, scale_inv, amax, columnwise, out_dtype):
    shape = (data.shape[1] * 2, data.shape[0]) if columnwise else (*data.shape[:-1], data.shape[-1] * 2)
    return data.new_empty(shape, dtype=out_dtype)


@torch.library.register_fake("pyxfer::swap_first_dims")
def _swap_first_dims_fake(src):
    return src.new_empty((src.shape[1], src.shape[0], *src.shape[2:]))


def _gather_plan(plan):
    from .gather.engine import plan_by_id
    return plan_by_id(plan)


@torch.library.register_fake("pyxfer::gather_post")
def _gather_post_fake(group, plan, inputs, meta, amax, latch, seq, wait_seq, flags):
    p = _gather_plan(plan)
    return p.fake_outputs(meta, temps=True) + [meta.new_empty((p.world * meta.numel(),))]


@torch.library.register_fake("pyxfer::gather_finish")
def _gather_finish_fake(plan, results, temps, meta_recv, seq, flags):
    return None


@torch.library.register_fake("pyxfer::gather_join")
def _gather_join_fake(meta_recv, seq):
    return None


@torch.library.register_fake("pyxfer::gather_run")
def _gather_run_fake(group, plan, inputs, meta, amax, latch, seq, wait_seq, flags):
    p = _gather_plan(plan)
    return p.fake_outputs(meta, temps=False) + [meta.new_empty((p.world * meta.numel(),))]
