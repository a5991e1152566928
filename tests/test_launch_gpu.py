"""KernelLauncher: the argument layout on CPU, and on a GPU that a kernel launched through it
sees exactly the values (array size, shape, data, scalars) Numba's own launch gives it."""

from __future__ import annotations

import ctypes
import struct

import numpy as np
import pytest
from numba import cuda, int32, types

from numbaflash import ptx
from numbaflash.runtime.launch import KernelLauncher, _packer, param_layout


def test_param_layout_follows_numbas_abi():
    """A 1-D array is seven parameters (meminfo, parent, nitems, itemsize, data, shape, stride in
    bytes); scalars take their width; each sits at an offset aligned to its size."""
    layout = param_layout([types.uint16[::1], types.int32, types.float32[::1], types.boolean, types.int64,
                           types.uint32, types.float32])
    assert [p.code for p in layout] == ["q", "q", "q", "q", "Q", "q", "q", "i",
                                        "q", "q", "q", "q", "Q", "q", "q", "?", "q", "I", "f"]
    assert [p.offset for p in layout] == [0, 8, 16, 24, 32, 40, 48, 56,
                                          64, 72, 80, 88, 96, 104, 112, 120, 128, 136, 140]
    assert [p.value for p in layout[:7]] == ["0", "0", "a0[1]", "2", "a0[0]", "a0[1]", "2"]
    assert layout[7].value == "a1"


def test_packed_buffer_holds_each_value_at_its_offset():
    pack, size = _packer(param_layout(ECHO_ARGTYPES), len(ECHO_ARGTYPES))
    buffer = ctypes.create_string_buffer(size)
    pack(buffer, (0xABC0, 7), (0x100, 3), -5, 2**32 - 2, -7, np.float32(1.5), True)
    raw = buffer.raw
    assert struct.unpack_from("<7q", raw, 0) == (0, 0, 7, 2, 0xABC0, 7, 2)
    assert struct.unpack_from("<7q", raw, 56) == (0, 0, 3, 8, 0x100, 3, 8)
    assert struct.unpack_from("<qIif?", raw, 112) == (-5, 2**32 - 2, -7, 1.5, True)
    assert size == 133


@pytest.mark.parametrize("ty", [types.uint16[:, ::1], types.uint16[:], types.float64, types.complex64])
def test_layout_rejects_what_it_cannot_pass(ty):
    with pytest.raises(TypeError, match="KernelLauncher"):
        param_layout([ty])


ECHO_ARGTYPES = (types.uint16[::1], types.float64[::1], types.int64, types.uint32, types.int32,
                 types.float32, types.boolean)


def _echo(x, out, a, b, c, f, flag):
    if cuda.grid(1) == 0:
        out[0] = x.size
        out[1] = x.shape[0]
        out[2] = x[x.size - 1]
        out[3] = a
        out[4] = b
        out[5] = c
        out[6] = f
        out[7] = 1 if flag else 0
        out[8] = cuda.gridDim.x * 1000 + cuda.blockDim.x


@pytest.mark.gpu
def test_launcher_passes_what_numba_passes():
    kernel = cuda.jit(ECHO_ARGTYPES)(_echo)
    x = cuda.to_device(np.arange(11, dtype=np.uint16) * 3)
    scalars = (np.int64(-(2**40) - 3), np.uint32(2**32 - 2), np.int32(-7), np.float32(0.375), True)
    expected = cuda.to_device(np.full(9, np.nan))
    kernel[3, 64](x, expected, *scalars)
    got = cuda.to_device(np.full(9, np.nan))
    launcher = KernelLauncher.from_numba(kernel, ECHO_ARGTYPES)
    pointer = x.__cuda_array_interface__["data"][0]
    launcher((3, 1, 1), 64, 0, 0, (pointer, 11), (got.__cuda_array_interface__["data"][0], 9), *scalars)
    cuda.synchronize()
    want = [11, 11, 30, -(2**40) - 3, 2**32 - 2, -7, 0.375, 1, 3064]
    np.testing.assert_array_equal(expected.copy_to_host(), want)
    np.testing.assert_array_equal(got.copy_to_host(), want)


PDL_ARGTYPES = (types.int32[::1], types.int32[::1], types.int64)


def _pdl_first(data, copy, spins):
    """Signal the next kernel at once, spin ``spins`` dependent steps, then write ``data``."""
    ptx.grid_launch_dependents()
    i = cuda.grid(1)
    acc = int32(i)
    for k in range(spins):
        acc = acc * int32(3) + int32(k)
    if i < data.size:
        data[i] = 3 * i + 1 if acc != int32(123456789) else 0


def _pdl_second(data, copy, waits):
    """Wait for the kernel before (unless ``waits`` is 0), then copy what it wrote."""
    if waits:
        ptx.grid_dependency_wait()
    i = cuda.grid(1)
    if i < data.size:
        copy[i] = data[i]


@pytest.mark.hopper
def test_programmatic_launch_overlaps_and_waits_for_the_kernel_before():
    """A kernel launched programmatically (``KernelLauncher(..., programmatic=True)``) after one
    that signals its dependents at once and writes after about 0.7 ms of work: without
    ``ptx.grid_dependency_wait`` it starts early and reads stale values (so the launch attribute
    takes effect); with it, it reads every value the first kernel wrote, eagerly and in replays
    of a CUDA graph captured from the same launches."""
    torch = pytest.importorskip("torch")
    first = cuda.jit(PDL_ARGTYPES)(_pdl_first)
    second = cuda.jit(PDL_ARGTYPES)(_pdl_second)
    launch_first = KernelLauncher.from_numba(first, PDL_ARGTYPES)
    launch_second = KernelLauncher.from_numba(second, PDL_ARGTYPES, programmatic=True)
    n, spins = 64 * 1024, 20_000  # about 0.7 ms of work
    data = torch.full((n,), -1, dtype=torch.int32, device="cuda")
    copy = torch.full((n,), -2, dtype=torch.int32, device="cuda")
    want = 3 * torch.arange(n, dtype=torch.int32, device="cuda") + 1

    def both(waits: int):  # on the current stream (the capture stream inside ``torch.cuda.graph``)
        stream = torch.cuda.current_stream().cuda_stream
        arrays = ((data.data_ptr(), n), (copy.data_ptr(), n))
        launch_first((n // 256, 1, 1), 256, stream, 0, *arrays, spins)
        launch_second((n // 256, 1, 1), 256, stream, 0, *arrays, waits)

    both(1)  # the first launch of each kernel loads its module (lazy loading), in order
    torch.cuda.synchronize()
    assert torch.equal(copy, want)
    data.fill_(-1)
    both(0)
    torch.cuda.synchronize()
    assert torch.equal(data, want)
    assert int((copy == -1).sum()) > 0  # started before the first kernel wrote
    data.fill_(-1)
    both(1)
    torch.cuda.synchronize()
    assert torch.equal(copy, want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        both(1)
    for _ in range(3):
        data.fill_(-1)
        copy.fill_(-2)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(copy, want)


@pytest.mark.gpu
def test_launcher_checks_argument_count():
    kernel = cuda.jit(ECHO_ARGTYPES)(_echo)
    launcher = KernelLauncher.from_numba(kernel, ECHO_ARGTYPES)
    with pytest.raises(TypeError, match="expected 7 arguments, got 2"):
        launcher((1, 1, 1), 32, 0, 0, (0, 1), (0, 1))


@pytest.mark.gpu
def test_flash_attention_from_a_fresh_thread(rng):
    """A thread with no current CUDA context: the API makes one current before launching."""
    import threading

    import numbaflash
    from numbaflash.tools.reference import attention_reference

    q, k, v = (rng.standard_normal((1, 70, 2, 64)).astype(np.float16) for _ in range(3))
    result = {}

    def work():
        try:
            result["out"] = numbaflash.flash_attention(q, k, v, causal=True)
        except Exception as exc:  # reported below
            result["error"] = exc

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert "error" not in result, result.get("error")
    ref, _ = attention_reference(q, k, v, causal=True)
    assert np.abs(result["out"].astype(np.float64) - ref).max() < 4e-3


@pytest.mark.gpu
def test_two_devices():
    """Each device gets its own loaded kernel and shared-memory limit (head dim 128 needs more
    than 48 KB); tensors on a device other than the current one are refused with a message."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    import numbaflash

    sdpa = torch.nn.functional.scaled_dot_product_attention
    try:
        for device in (1, 0):
            torch.cuda.set_device(device)
            q, k, v = (torch.randn(2, 300, 4, 128, device=f"cuda:{device}", dtype=torch.float16)
                       for _ in range(3))
            out = numbaflash.flash_attention(q, k, v, causal=True)
            ref = sdpa(*(t.transpose(1, 2).float() for t in (q, k, v)), is_causal=True).transpose(1, 2)
            assert out.device.index == device
            assert (out.float() - ref).abs().max().item() < 8e-3
        other = torch.randn(1, 64, 1, 64, device="cuda:1", dtype=torch.float16)
        with pytest.raises(ValueError, match=r"current CUDA device \(cuda:0\)"):
            numbaflash.flash_attention(other, other, other)
    finally:
        torch.cuda.set_device(0)
