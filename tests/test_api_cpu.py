"""Input validation happens on the host, before anything touches a GPU."""

from __future__ import annotations

import re

import numpy as np
import pytest

import numbaflash
from numbaflash import operands
from numbaflash.operations import forward, launch_forward
from numbaflash.runtime import device


def qkv(shape_q=(1, 8, 4, 64), shape_k=(1, 8, 2, 64), dtype=np.float16):
    return np.zeros(shape_q, dtype), np.zeros(shape_k, dtype), np.zeros(shape_k, dtype)


@pytest.mark.parametrize(
    "args, error, message",
    [
        (lambda: (np.zeros((8, 4, 64), np.float16),) + qkv()[1:], ValueError, "4 dimensions"),
        (lambda: qkv(shape_k=(1, 8, 3, 64)), ValueError, "multiple of heads"),
        (lambda: qkv(shape_q=(1, 8, 4, 80), shape_k=(1, 8, 2, 80)), ValueError, "head_dim must be one of"),
        (lambda: qkv(shape_k=(2, 8, 2, 64)), ValueError, "same batch"),
        (lambda: qkv(shape_q=(1, 0, 4, 64)), ValueError, "empty"),
        (lambda: qkv(dtype=np.float32), TypeError, "float16 or bfloat16"),
        (lambda: (qkv()[0], qkv()[1], qkv()[2][:, :4]), ValueError, "same shape"),
        (lambda: (qkv()[0], qkv()[1].astype(np.float32), qkv()[2]), TypeError, "float16 or bfloat16"),
        (lambda: (qkv()[0].tolist(), qkv()[1], qkv()[2]), TypeError, "numpy array or a CUDA array"),
    ],
)
def test_bad_input_raises_before_launch(args, error, message):
    with pytest.raises(error, match=message):
        numbaflash.flash_attention(*args())


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 256])
def test_supported_head_dims_reach_the_kernel(head_dim, no_compile):
    with pytest.raises(AssertionError, match="would compile"):
        numbaflash.flash_attention(*qkv((1, 8, 4, head_dim), (1, 8, 2, head_dim)))


@pytest.mark.parametrize("head_dim", [8, 16, 48, 80, 112, 160, 192, 224, 512])
def test_other_head_dims_rejected_with_the_supported_list(head_dim, no_compile):
    with pytest.raises(ValueError) as info:
        numbaflash.flash_attention(*qkv((1, 8, 4, head_dim), (1, 8, 2, head_dim)))
    assert str(info.value) == f"head_dim must be one of (32, 64, 96, 128, 256), got {head_dim}"


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf"), 1e300, 1e-300, -0.0, 1e39])
def test_bad_softmax_scale_value(scale, no_compile):
    with pytest.raises(ValueError, match=f"softmax_scale.*got {re.escape(repr(scale))}"):
        numbaflash.flash_attention(*qkv(), softmax_scale=scale)


@pytest.mark.parametrize("scale", ["0.1", True, np.bool_(True), 1j, [0.1], np.array([0.1])])
def test_bad_softmax_scale_type(scale, no_compile):
    with pytest.raises(TypeError, match="softmax_scale must be a real number or None, got"):
        numbaflash.flash_attention(*qkv(), softmax_scale=scale)


@pytest.mark.parametrize("scale", [1, 0.125, np.float32(0.3), np.float16(2.0), np.int64(3), 1e-30, 1e30])
def test_good_softmax_scale_reaches_the_kernel(scale, no_compile):
    with pytest.raises(AssertionError, match="would compile"):
        numbaflash.flash_attention(*qkv(), softmax_scale=scale)


@pytest.mark.parametrize("flag", ["causal", "return_lse"])
@pytest.mark.parametrize("value", ["no", "False", [False], 2, 0, 1, None, np.array(True), 1.0])
def test_flags_must_be_bools(flag, value, no_compile):
    with pytest.raises(TypeError, match=f"{flag} must be a bool \\(True or False\\), got"):
        numbaflash.flash_attention(*qkv(), **{flag: value})


@pytest.mark.parametrize("value", [True, False, np.True_, np.False_])
def test_bool_flags_accepted(value, no_compile):
    with pytest.raises(AssertionError, match="would compile"):
        numbaflash.flash_attention(*qkv(), causal=value, return_lse=value)


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.int16, np.uint16, np.complex64])
@pytest.mark.parametrize("have_ml_dtypes", [True, False])
def test_other_dtypes_rejected_with_or_without_ml_dtypes(dtype, have_ml_dtypes, monkeypatch, no_compile):
    if not have_ml_dtypes:
        monkeypatch.setattr(operands, "bfloat16_dtype", lambda: None)
    with pytest.raises(TypeError, match=f"q must be float16 or bfloat16, got {np.dtype(dtype)}"):
        numbaflash.flash_attention(*qkv(dtype=dtype))


@pytest.mark.parametrize("typestr", ["<f8", "<f4", "<i2", "<u2"])
def test_device_arrays_of_other_dtypes_rejected(typestr, no_compile):
    arrays = [FakeDeviceArray(s, typestr) for s in ((1, 8, 4, 64), (1, 8, 2, 64), (1, 8, 2, 64))]
    with pytest.raises(TypeError, match="q must be float16 or bfloat16"):
        numbaflash.flash_attention(*arrays)


def test_device_array_dtype_attribute_must_match_typestr(no_compile):
    q = FakeDeviceArray((1, 8, 4, 64), "<f8")
    q.dtype = np.dtype(np.float16)
    with pytest.raises(TypeError, match="disagree on the element size"):
        numbaflash.flash_attention(q, FakeDeviceArray((1, 8, 2, 64)), FakeDeviceArray((1, 8, 2, 64)))


def test_mixed_bf16_and_f16_rejected():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    q, k, v = qkv()
    with pytest.raises(TypeError, match="one dtype"):
        numbaflash.flash_attention(q, k.astype(ml_dtypes.bfloat16), v)


def test_out_must_match():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="out must have"):
        numbaflash.flash_attention(q, k, v, out=np.zeros((1, 8, 4, 32), np.float16))


class FakeDeviceArray:
    """Just enough of __cuda_array_interface__ to be classified as a device array; each one
    gets its own (fake) 1 GB-aligned address unless ``pointer`` is given."""

    next_pointer = 1 << 30

    def __init__(self, shape, typestr="<f2", strides=None, pointer=None):
        if pointer is None:
            pointer = FakeDeviceArray.next_pointer
            FakeDeviceArray.next_pointer += 1 << 30
        self.__cuda_array_interface__ = {
            "shape": shape, "typestr": typestr, "data": (pointer, False), "strides": strides, "version": 3,
        }


@pytest.fixture
def no_compile(monkeypatch):
    """Pretend a Hopper GPU is current, and fail if validation lets a call reach compilation:
    each bad input must be rejected before anything is compiled or launched."""
    def compile_(*args, **kwargs):
        raise AssertionError("would compile a kernel")

    monkeypatch.setattr(device.GPU, "current", lambda: ((9, 0), 0))
    monkeypatch.setattr(forward, "forward_kernel", compile_)


def fake_qkv(shape_q=(1, 8, 4, 64), shape_k=(1, 8, 2, 64)):
    return FakeDeviceArray(shape_q), FakeDeviceArray(shape_k), FakeDeviceArray(shape_k)


def test_read_only_numpy_out_rejected(no_compile):
    out = np.zeros((1, 8, 4, 64), np.float16)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        numbaflash.flash_attention(*qkv(), out=out)


def test_stride_0_numpy_out_rejected(no_compile):
    base = np.zeros((1, 8, 1, 64), np.float16)
    out = np.lib.stride_tricks.as_strided(base, (1, 8, 4, 64), (0, 128, 0, 2), writeable=True)
    with pytest.raises(ValueError, match="share memory"):
        numbaflash.flash_attention(*qkv(), out=out)


@pytest.mark.parametrize("strides", [(4096, 0, 128, 2), (4096, 512, 0, 2), (4096, 64, 16, 2)])
def test_overlapping_device_out_rejected(strides, no_compile):
    out = FakeDeviceArray((1, 8, 4, 64), strides=strides)
    with pytest.raises(ValueError, match="share memory"):
        numbaflash.flash_attention(*fake_qkv(), out=out)


def test_device_out_sharing_memory_with_k_rejected(no_compile):
    q, k, v = fake_qkv()
    k_pointer = k.__cuda_array_interface__["data"][0]
    with pytest.raises(ValueError, match="out shares memory with k"):
        numbaflash.flash_attention(q, k, v, out=FakeDeviceArray((1, 8, 4, 64), pointer=k_pointer + 256))


def test_device_out_may_be_q(no_compile):
    q, k, v = fake_qkv()
    with pytest.raises(AssertionError, match="would compile"):
        numbaflash.flash_attention(q, k, v, out=q)
    partly_q = FakeDeviceArray((1, 8, 4, 64), pointer=q.__cuda_array_interface__["data"][0] + 512)
    with pytest.raises(ValueError, match="out shares memory with q"):
        numbaflash.flash_attention(q, k, v, out=partly_q)


@pytest.mark.parametrize("which", ["q", "k", "out"])
def test_device_layout_checked_before_compiling(which, no_compile):
    arrays = dict(zip("qkv", fake_qkv(), strict=True))
    misaligned = FakeDeviceArray((1, 8, 4 if which in "q out" else 2, 64), pointer=(3 << 30) + 8)
    arrays[which] = misaligned
    with pytest.raises(ValueError, match="16-byte"):
        numbaflash.flash_attention(arrays["q"], arrays["k"], arrays["v"], out=arrays.get("out"))


def test_grid_limit(no_compile):
    """Up to 65535 x 65535 (batch, head) pairs are folded into the grid; more are refused."""
    with pytest.raises(AssertionError, match="would compile"):
        numbaflash.flash_attention(*fake_qkv((70000, 8, 4, 64), (70000, 8, 1, 64)))
    with pytest.raises(ValueError, match="exceeds the CUDA grid"):
        numbaflash.flash_attention(*fake_qkv((70000, 8, 65536, 64), (70000, 8, 1, 64)))
    assert launch_forward.forward_grid(3, 4, 70000) == (3, 65535, 5)
    assert launch_forward.forward_grid(3, 70000, 2) == (3, 65535, 3)
    assert launch_forward.forward_grid(3, 16, 2) == (3, 16, 2)  # y = heads, z = batch: no divisions


def test_folded_grid_forced(monkeypatch):
    """Tests can force the folded (batch, head) numbering on small problems."""
    monkeypatch.setattr(launch_forward, "FOLD_GRID", True)
    assert launch_forward.forward_grid(3, 16, 2) == (3, 32, 1)
    assert launch_forward.forward_grid(3, 7, 5) == (3, 35, 1)


def test_mixed_host_and_device_rejected():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="not a mix"):
        numbaflash.flash_attention(FakeDeviceArray(q.shape), k, v)


def test_device_layout_checks():
    op = operands.describe("q", FakeDeviceArray((1, 8, 2, 64), strides=(2048, 256, 128, 4)))
    with pytest.raises(ValueError, match="contiguous"):
        operands.check_device_layout(op)
    op = operands.describe("q", FakeDeviceArray((1, 8, 2, 64), strides=(2 * 1044, 2 * 130, 2 * 65, 2)))
    with pytest.raises(ValueError, match="16-byte"):
        operands.check_device_layout(op)


@pytest.mark.parametrize("failure", ["no device", "no driver"])
def test_no_gpu_is_a_clear_runtime_error(monkeypatch, failure):
    """Whatever the machine has, a driver that finds no GPU (or no driver at all) gives a clear
    RuntimeError, before anything is compiled."""
    from cuda.bindings import driver

    class NoDevice:
        CUresult = driver.CUresult

        @staticmethod
        def cuInit(flags):
            if failure == "no driver":
                raise RuntimeError("Failed to dlopen libcuda.so.1")
            return (driver.CUresult.CUDA_ERROR_NO_DEVICE,)

    monkeypatch.setattr(device, "GPU", device.GpuState(load_driver=lambda: NoDevice))  # a fresh process
    with pytest.raises(RuntimeError, match="needs an NVIDIA GPU"):
        numbaflash.flash_attention(*qkv())


def test_reference_handles_rows_without_keys():
    from numbaflash.tools.reference import attention_reference

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s) for s in ((1, 5, 1, 64), (1, 3, 1, 64), (1, 3, 1, 64)))
    out, lse = attention_reference(q, k, v, causal=True)
    assert np.all(out[:, :2] == 0) and np.all(np.isneginf(lse[..., :2]))
    assert np.isfinite(out).all() and np.isfinite(lse[..., 2:]).all()


def test_tensors_must_be_on_the_current_device():
    ops = [operands.Operand(n, (1, 1, 1, 64), "float16", True, None, device=d)
           for n, d in (("q", 0), ("k", 1))]
    with pytest.raises(ValueError, match=r"current CUDA device \(cuda:0\), got q on cuda:0, k on cuda:1"):
        operands.check_same_device(ops, 0)
    operands.check_same_device(ops[:1], 0)
    unknown = operands.Operand("q", (1, 1, 1, 64), "float16", True, None)
    operands.check_same_device([unknown], 3)  # a device not known: allowed


def test_device_buffer_rejects_other_than_16_bit_floats():
    from numbaflash.runtime.buffers import DeviceBuffer

    with pytest.raises(TypeError, match="16-bit floats, got dtype float32"):
        DeviceBuffer(np.zeros(3, np.float32))
    with pytest.raises(TypeError, match="16-bit floats, got dtype int8"):
        DeviceBuffer.empty((2, 2), np.int8)
    with pytest.raises(TypeError, match="needs a numpy array"):
        DeviceBuffer()
