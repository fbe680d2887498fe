"""Random test tensors of every dtype, odd sizes, views and storage offsets (CPU, then moved)."""
import torch

ALL_DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
    torch.float8_e4m3fn, torch.float8_e5m2,
] + [getattr(torch, n) for n in ("uint16", "uint32", "uint64", "float8_e4m3fnuz", "float8_e5m2fnuz")
     if hasattr(torch, n)]


def random_tensor(shape, dtype, gen, device="cpu"):
    """Random bits of the given dtype (every byte pattern, NaNs included), made on the CPU."""
    numel = 1
    for s in shape:
        numel *= s
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw = raw & 1
    return raw.view(dtype).reshape(shape).to(device)


def layouts(dtype, gen, device="cpu"):
    """(name, tensor) pairs: empty, scalar, odd sizes, non-contiguous views, odd storage offsets."""
    r = lambda *shape: random_tensor(shape, dtype, gen, device)  # noqa: E731
    yield "empty", r(0)
    yield "scalar", r()
    yield "one", r(1)
    yield "seven", r(7)
    yield "3x5x7", r(3, 5, 7)
    yield "odd-large", r((1 << 17) + 3)
    yield "transposed", r(33, 65).t()
    yield "strided", r(301)[::3]
    yield "offset1", r(1001)[1:]
    yield "offset3-2d", r(19, 23)[3:, 5:]
    yield "expanded", r(1, 13).expand(9, 13)
    yield "permuted", r(4, 6, 10).permute(2, 0, 1)


def logical_bytes(t: torch.Tensor) -> bytes:
    """The tensor's contiguous row-major bytes, as the spec defines what PXH64 hashes."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


class _NoData(torch.Tensor):
    """A tensor with a shape and a device but no data, like FakeTensor without FakeTensor's CUDA
    context set-up (which fails where the device does not exist, on a machine with fewer GPUs)."""

    @staticmethod
    def __new__(cls, shape, device):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.float32, device=device)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"{func}: a tensors.cuda_tensor has no data")

    def __repr__(self):
        return f"cuda_tensor({tuple(self.shape)}, {self.device})"


def cuda_tensor(*shape, index):
    """A float32 tensor on cuda:index with no data, on any machine (a CPU-only one included): for code
    that reads only devices."""
    return _NoData(shape, torch.device("cuda", index))


def conj_views(gen, device="cpu"):
    """Lazily conjugated / negated views and what they must read as (resolved copies)."""
    z = random_tensor((37, 29), torch.complex64, gen, device)
    zd = random_tensor((1001,), torch.complex128, gen, device)
    for name, view in (("conj", z.conj()), ("conj-imag", z.conj().imag), ("conj-slice", z[3:, 5::2].conj()),
                       ("conj-t", z.t().conj()), ("conj-1d-offset", zd[1:].conj()), ("neg-view", zd.conj().imag[7:])):
        assert view.is_conj() or view.is_neg(), name  # the views really are lazy
        yield name, view, view.resolve_conj().resolve_neg()
