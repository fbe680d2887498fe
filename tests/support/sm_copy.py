"""torch.ops.pyxfer.sm_copy for its CPU and GPU tests: the call, sentinel-filled destinations, exact
comparisons, sign-bit flips and the math-bit destination script run in a fresh interpreter."""
import textwrap

import torch

import pyxfer  # noqa: F401  (registers the ops)

SENTINEL = 0xC3


def run_sm_copy(src, dst_device, pull, pad=5):
    """sm_copy of ``src`` into the middle of a sentinel-filled buffer: (the destination view, the whole buffer)."""
    n = src.numel() * src.element_size()
    whole = torch.full((n + 2 * pad,), SENTINEL, dtype=torch.uint8, device=dst_device)
    dst = whole[pad:pad + n]
    torch.ops.pyxfer.sm_copy(src, dst, pull)
    return dst, whole


def check_exact(src, dst, whole, pad=5):
    want = src.reshape(-1).view(torch.uint8).cpu()
    assert torch.equal(dst.cpu(), want)
    assert bool((whole[:pad] == SENTINEL).all()) and bool((whole[pad + want.numel():] == SENTINEL).all())


def sentinel_like(t):
    """A tensor of t's shape, dtype and device whose bytes are all SENTINEL."""
    whole = torch.full((t.numel() * t.element_size(),), SENTINEL, dtype=torch.uint8, device=t.device)
    return whole.view(t.dtype).reshape(t.shape)


def assert_sentinel(t):
    assert bool((t.detach().reshape(-1).view(torch.uint8) == SENTINEL).all()), "the destination was written"


def flip_sign_bits(t, step=1, start=0):
    """t's bytes with the sign bit of every step-th float from start flipped: conj (imaginary parts) and
    neg, computed without torch's conj / neg kernels."""
    width = t.element_size() // (2 if t.is_complex() else 1)
    words = t.detach().reshape(-1).view({4: torch.int32, 8: torch.int64}[width]).clone()
    words[start::step] ^= torch.iinfo(words.dtype).min  # the sign bit alone
    return words.view(torch.uint8)


MATH_BIT_DST_SCRIPT = textwrap.dedent(r"""
    import torch, pyxfer
    op = torch.ops.pyxfer.sm_copy
    device = {device!r}
    z = torch.full((13,), 0xC3, dtype=torch.uint8, device=device).repeat(8).view(torch.complex64)
    src = torch.randn(13, dtype=torch.complex64, device=device)
    cases = [("dst.is_conj()", "conjugate", src, z.conj()),
             ("dst.is_neg()", "negative", src.real.contiguous(), z.conj().imag),       # strided, too
             ("dst.is_neg()", "negative", src.real.contiguous(), torch._neg_view(z.real.contiguous())),
             ("dst.is_conj()", "conjugate", src.conj(), z.conj())]                     # both conjugate
    for flag, what, s, d in cases:
        try:
            op(s, d, True)
        except ValueError as e:
            want = (f"pyxfer.sm_copy: dst must be a tensor without the {{what}} bit, got a {{what}} view "
                    f"({{flag}} is True)")
            assert want in str(e), str(e)
        else:
            raise AssertionError(f"no error for a {{what}} dst")
    assert bool((z.view(torch.uint8) == 0xC3).all()), "a refused call wrote into dst"
    out = torch.empty_like(src)
    op(src, out, True)  # the op and the interpreter still work
    assert torch.equal(out.view(torch.uint8), src.view(torch.uint8))
    print("alive")
""")
