"""Test-side shims that let real Transformer Engine 2.20 run on a machine without a GPU
(shared/te-on-cpu.md). Import torch before TE (TE's core library needs torch's NCCL loaded).

- ``install_cpu_device()``: ``torch.cuda.current_device()`` -> "cpu". NVFP4Quantizer.__init__ asks
  for it (and every NVFP4 storage copies its quantizer), so even the patched path needs this here.
- ``unpatched_te_on_cpu()``: what TE's *own* gather code needs on CPU, for the tests that show its
  defects: gloo has no startCoalescing (TE's ``_coalescing_manager(device=...)`` -> device=None),
  ``tex.swap_first_dims`` and the triton padding kernel are CUDA-only (torch equivalents), and
  ``quantizer(x)`` of a high-precision tensor is a CUDA kernel: replaced by TE's own allocator
  (``make_empty``, which runs on CPU and keeps TE's shape assertions) with zero-filled buffers;
  those tests check where TE fails, what it returns and how, never values TE computed this way.
"""
import contextlib

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d


def install_cpu_device():
    torch.cuda.current_device = lambda: "cpu"


def te_available():
    """(True, "") if transformer_engine.pytorch imports, else (False, why)."""
    try:
        import transformer_engine
        import transformer_engine.pytorch  # noqa: F401
        return True, transformer_engine.__version__
    except Exception as e:  # ImportError, OSError (a missing shared library), ...
        return False, f"{type(e).__name__}: {e}"


class _TexOnCPU:
    def __init__(self, tex):
        self._tex = tex

    def __getattr__(self, name):
        if name == "swap_first_dims":
            return lambda x, out=None: (x.transpose(0, 1).contiguous() if out is None
                                        else out.copy_(x.transpose(0, 1)))
        return getattr(self._tex, name)


def _zero_quantize_impl(self, t):
    out = self.make_empty(t.shape, dtype=t.dtype, device=t.device)
    for name in ("_rowwise_data", "_rowwise_scale_inv", "_columnwise_data", "_columnwise_scale_inv"):
        buf = getattr(out, name, None)
        if buf is not None:
            buf.zero_()
    return out


@contextlib.contextmanager
def collective_inputs():
    """Within the block, whether each input TE hands to ``torch.distributed.all_gather_into_tensor``
    is contiguous (a list of bools); the real collective runs. NCCL rejects a non-contiguous input
    ("Tensors must be contiguous"); gloo (torch 2.14) copies it, so on CPU this is how it shows."""
    seen = []
    original = dist.all_gather_into_tensor

    def record(output_tensor, input_tensor, *args, **kwargs):
        seen.append(input_tensor.is_contiguous())
        return original(output_tensor, input_tensor, *args, **kwargs)

    dist.all_gather_into_tensor = record
    try:
        yield seen
    finally:
        dist.all_gather_into_tensor = original


@contextlib.contextmanager
def unpatched_te_on_cpu():
    """Within the block TE's own gather code runs on CPU / gloo (see the module docstring)."""
    import transformer_engine.pytorch.distributed as ted
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer
    from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer
    from transformer_engine.pytorch.tensor.nvfp4_tensor import NVFP4Quantizer
    saved = [(dist, "_coalescing_manager", dist._coalescing_manager),
             (ted, "tex", ted.tex), (ted, "pad_columnwise_scale_inv", ted.pad_columnwise_scale_inv)]
    saved += [(q, "quantize_impl", q.__dict__["quantize_impl"])
              for q in (Float8BlockQuantizer, MXFP8Quantizer, NVFP4Quantizer)]
    original_cm = c10d._coalescing_manager
    dist._coalescing_manager = lambda group=None, device=None, async_ops=False: original_cm(
        group=group, device=None, async_ops=async_ops)
    ted.tex = _TexOnCPU(ted.tex)
    ted.pad_columnwise_scale_inv = lambda s: s
    for q in (Float8BlockQuantizer, MXFP8Quantizer, NVFP4Quantizer):
        q.quantize_impl = _zero_quantize_impl
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
        # A failed coalescing manager leaves its group registered: later collectives would be queued.
        c10d._world.pg_coalesce_state.clear()
