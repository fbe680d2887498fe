"""pyxfer.gather.layouts without a process group: the layout a rank predicts from the agreed
signature alone (what a rank that cannot build its buffers posts as scratch) is the layout of the
parts the others build, for every format, usage, quantizable or not, and dtype; and the parts'
fix-ups of a 1-rank gather give the shard's own buffers back."""
import itertools

import pytest
import torch

from pyxfer import formats
from pyxfer.gather import layouts

USAGES = ((True, False), (False, True), (True, True))
SHAPES = {"fp8_block_1x128": [(128, 256), (2, 64, 128), (64, 256)], "fp8_block_128x128": [(128, 384), (32, 128)],
          "mxfp8": [(32, 64), (2, 16, 96), (16, 64)], "nvfp4": [(16, 64), (2, 8, 32), (8, 32)]}


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("fmt,usage", list(itertools.product(formats.FORMATS, USAGES)))
def test_predicted_layout_is_the_built_one(fmt, usage, world, gen):
    spec = formats.QuantizeSpec(fmt, rowwise=usage[0], columnwise=usage[1])
    for shape in SHAPES[fmt]:
        x = torch.randn(shape, generator=gen).to(torch.bfloat16)
        if spec.is_quantizable(shape):
            q = spec.quantize(x)
            parts = layouts.quantized_parts(q, spec, world)
            assert [p.name for p in parts] == [n for n in formats.BUFFER_NAMES if n in q.buffers()]
            if world == 1:  # the fix-ups of a 1-rank gather give the shard back, padding included
                for p in parts:
                    p.recv.view(-1).copy_(p.send.view(-1))
                    want = q.buffers()[p.name]
                    assert torch.equal(p.finish().view(torch.uint8), want.view(torch.uint8)), (shape, p.name)
        else:
            parts = [layouts.plain_part(x, world)]
        assert layouts.send_layout(spec, x.dtype, shape, world) == layouts.layout_of(parts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool, torch.complex64, torch.float8_e5m2, torch.int16])
def test_plain_layout_travels_natively_or_as_bytes(dtype):
    t = torch.zeros((5, 3), dtype=dtype)[:, ::2]  # non-contiguous
    part = layouts.plain_part(t, 4)
    assert layouts.send_layout(None, dtype, (5, 2), 4) == layouts.layout_of([part])
    assert part.nbytes == 10 * t.element_size() and part.recv.numel() * part.recv.element_size() == 4 * part.nbytes
