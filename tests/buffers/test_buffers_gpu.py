"""pyxfer.buffers on CUDA: offload/reload follow their events, moves are verified, pack is capturable."""
import pytest
import torch

from pyxfer.buffers import PackedBuffer, capture_subviews, pack, restore_subviews

from support.buffers import MIXED_DTYPES, SENTINEL, bits, te_bulk_quantized
from support.tensors import random_tensor

SLOW = 50_000_000  # cycles of torch.cuda._sleep: tens of milliseconds, far longer than any copy here


def mixed_tensors(gen, device):
    """Mixed dtypes, odd sizes and offsets, a transposed view and views sharing one base, on ``device``."""
    out = []
    for numel, dtype in zip((0, 1, 7, (1 << 18) + 5, 1001, 33, 5, 65), MIXED_DTYPES):
        out.append(random_tensor((numel + 3,), dtype, gen).to(device)[3:])
    base = random_tensor((37, 129), torch.float32, gen).to(device)
    return out + [base[1:, 3:], base.t(), base.view(torch.int32)[5]]


def snapshot(tensors):
    """(dtype, shape, strides, host copy of the bytes) of each tensor, to compare with later."""
    return [(t.dtype, t.shape, t.stride(), bits(t).cpu()) for t in tensors]


def assert_matches(tensors, snap, strides=True):
    """Same dtypes, shapes, bits and (unless ``strides=False``, for clones) strides; reads each
    tensor on the current stream."""
    assert len(tensors) == len(snap)
    for t, (dtype, shape, stride, data) in zip(tensors, snap):
        assert (t.dtype, t.shape) == (dtype, shape)
        assert not strides or t.stride() == stride
        assert torch.equal(bits(t).cpu(), data)


def sleep_on(stream, cycles=SLOW):
    with torch.cuda.stream(stream):
        torch.cuda._sleep(cycles)


@pytest.fixture
def dev():
    return torch.device("cuda", torch.cuda.current_device())


@pytest.mark.gpu
def test_offload_reload_follow_their_events(gen, dev):
    tensors = mixed_tensors(gen, dev)
    snap = snapshot(tensors)
    packed = pack(tensors)
    real = packed.data.clone()
    packed.data.fill_(SENTINEL)
    packed.offload().result()  # the reused host buffer now holds sentinel bytes
    copy_stream = torch.cuda.Stream(dev)

    # producer: the real bytes land on the current stream only after a long sleep; the copy stream
    # is busy too, for half as long: a copy that does not wait for the producer reads the sentinel,
    # a result() that does not wait for the copy sees the sentinel left by the first offload
    torch.cuda._sleep(2 * SLOW)
    packed.data.copy_(real)
    sleep_on(copy_stream)
    handle = packed.offload(stream=copy_stream)
    host = handle.result()
    assert handle.event.query()
    assert host.device.type == "cpu" and host.data.is_pinned()
    assert torch.equal(host.data, real.cpu())

    # consumer: the destination reuses a freed block full of sentinel bytes; the copy is queued
    # behind a sleep, so reading without waiting on the handle's event would see the sentinel
    del packed, real
    torch.full((host.nbytes,), SENTINEL, dtype=torch.uint8, device=dev)  # allocated and freed at once
    sleep_on(copy_stream)
    back = host.reload(dev, stream=copy_stream).result()
    assert back.device == dev
    assert_matches(back.unpack(), snap)  # read on the current stream, which waited on the event


@pytest.mark.gpu
def test_wait_makes_another_stream_wait(gen, dev):
    tensors = mixed_tensors(gen, dev)
    snap = snapshot(tensors)
    host = pack(tensors).offload().result()  # the default copy stream
    copy_stream, consumer = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    sleep_on(copy_stream)
    handle = host.reload(dev, stream=copy_stream)
    handle.wait(consumer)
    views = handle.result().unpack()
    with torch.cuda.stream(consumer):
        assert_matches(views, snap)  # read on the consumer stream: ordered by its wait alone


@pytest.mark.gpu
def test_offload_keeps_the_source_alive(gen, dev):
    packed = pack([random_tensor(((64 << 20) + 7,), torch.uint8, gen).to(dev)])
    expected = packed.data.cpu()
    copy_stream = torch.cuda.Stream(dev)
    sleep_on(copy_stream)
    handle = packed.offload(stream=copy_stream)
    del packed  # the copy has not started: its source must not be recycled
    junk = [torch.full((expected.numel(),), SENTINEL, dtype=torch.uint8, device=dev) for _ in range(4)]
    assert torch.equal(handle.result().data, expected)
    del junk


@pytest.mark.gpu
def test_offload_reuses_a_pinned_host_buffer(gen, dev):
    packed = pack(mixed_tensors(gen, dev))
    first = packed.offload().result()
    packed.data.copy_(random_tensor((packed.nbytes,), torch.uint8, gen).to(dev))
    second = packed.offload().result()
    assert first.data.data_ptr() == second.data.data_ptr() and second.data.is_pinned()
    assert torch.equal(second.data, packed.data.cpu())


@pytest.mark.gpu
def test_quantized_bulk_buffer_on_gpu(gen, dev):
    cpu_buf, cpu_views = te_bulk_quantized(gen, m=257, k=1000)
    buf = cpu_buf.to(dev)
    views = restore_subviews(buf, capture_subviews(cpu_buf, cpu_views))  # the same sub-buffers, on the GPU
    packed = PackedBuffer(buf, capture_subviews(buf, views))
    back = packed.offload().result().reload(dev).result()
    assert [s.dtype for s in back.specs] == [torch.uint8, torch.float32, torch.float32, torch.float32]
    assert_matches(back.unpack(), snapshot(cpu_views))


@pytest.mark.gpu
def test_pack_to_another_device_is_verified(gen, dev):
    cpu_tensors = mixed_tensors(gen, "cpu")
    snap = snapshot(cpu_tensors)
    on_gpu = pack(cpu_tensors, device=dev)
    assert on_gpu.device == dev
    assert_matches(on_gpu.unpack(), snap)
    on_cpu = pack(on_gpu.unpack(), device="cpu")
    assert on_cpu.device.type == "cpu"
    assert_matches(on_cpu.unpack(), snap)


@pytest.mark.gpu
def test_device_mismatches_rejected(dev):
    with pytest.raises(ValueError, match=rf"capture_subviews: views\[0\] is on {dev}, expected buffer's device cpu"):
        capture_subviews(torch.zeros(16, dtype=torch.uint8), [torch.zeros(4, device=dev)])
    with pytest.raises(ValueError,
                       match=rf"pack: tensors\[1\] is on {dev}, expected the device of tensors\[0\] \(cpu\)"):
        pack([torch.zeros(4), torch.zeros(4, device=dev)])
    with pytest.raises(ValueError, match=rf"reload: expected a host PackedBuffer \(data on cpu\), got data on {dev}"):
        pack([torch.zeros(4, device=dev)]).reload(dev)


@pytest.mark.gpu
def test_pack_and_unpack_in_a_cuda_graph(gen, dev):
    roots = [random_tensor((n,), d, gen).to(dev) for n, d in zip((7, 4099, 1001, 33), MIXED_DTYPES[1:5])]
    grid = random_tensor((19, 23), torch.bfloat16, gen).to(dev)
    inputs = roots + [grid, grid[3:, 5:], grid.t()]  # views of one base stay views of one another
    pack(inputs)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        packed = pack(inputs)
        outputs = [t.clone() for t in packed.unpack()]
    for _ in range(2):
        for root in roots + [grid]:  # new data in the captured input memory
            root.copy_(random_tensor(root.shape, root.dtype, gen).to(dev))
        graph.replay()
        snap = snapshot(inputs)
        assert_matches(packed.unpack(), snap)
        assert_matches(outputs, snap, strides=False)


@pytest.mark.multigpu
def test_reload_on_cuda1_while_the_current_device_is_0(gen):
    with torch.cuda.device(0):
        tensors = mixed_tensors(gen, "cuda:0")
        snap = snapshot(tensors)
        host = pack(tensors).offload().result()
        stream1 = torch.cuda.Stream("cuda:1")
        sleep_on(stream1)
        back = host.reload("cuda:1", stream=stream1).result()  # cuda:1's current stream waits
        assert back.device == torch.device("cuda", 1) and torch.cuda.current_device() == 0
        assert_matches(back.unpack(), snap)
        again = host.reload("cuda:1").result()  # cuda:1's default copy stream
        assert_matches(again.unpack(), snap)
        with pytest.raises(ValueError, match="reload: stream is on cuda:0, expected the copy's CUDA device cuda:1"):
            host.reload("cuda:1", stream=torch.cuda.Stream("cuda:0"))
        with pytest.raises(ValueError, match="offload: stream is on cuda:1, expected the copy's CUDA device cuda:0"):
            pack(tensors).offload(stream=stream1)


@pytest.mark.multigpu
@pytest.mark.parametrize("verify", [True, False])
def test_verified_moves_between_gpus(gen, verify):
    tensors = mixed_tensors(gen, "cuda:0")
    snap = snapshot(tensors)
    packed = pack(tensors)
    on1 = packed.to("cuda:1", verify=verify)
    assert on1.device == torch.device("cuda", 1) and on1.specs == packed.specs
    assert_matches(on1.unpack(), snap)
    back = on1.to("cuda:0", verify=verify)
    assert back.device == torch.device("cuda", 0)
    assert torch.equal(back.data.cpu(), packed.data.cpu())
    assert_matches(back.unpack(), snap)
