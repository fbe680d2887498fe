"""Fake (meta) implementations of the native ops, so they trace under torch.compile and FakeTensor.
Shapes, dtypes and devices only; the schemas live in csrc/torch_bindings.cpp."""
import torch


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
def _verified_copy_fake(src, device, route="auto", verify="sync"):
    return torch.empty(src.shape, dtype=src.dtype, device=device)


@torch.library.register_fake("pyxfer::staged_copy")
def _staged_copy_fake(src, device):
    return torch.empty(src.shape, dtype=src.dtype, device=device)
