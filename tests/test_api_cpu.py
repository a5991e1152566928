"""Input validation happens on the host, before anything touches a GPU."""

from __future__ import annotations

import numpy as np
import pytest

import numbaflash
from numbaflash import api


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


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf"), "0.1"])
def test_bad_softmax_scale(scale):
    with pytest.raises(ValueError, match="softmax_scale"):
        numbaflash.flash_attention(*qkv(), softmax_scale=scale)


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
    """Just enough of __cuda_array_interface__ to be classified as a device array."""

    def __init__(self, shape, typestr="<f2", strides=None):
        self.__cuda_array_interface__ = {
            "shape": shape, "typestr": typestr, "data": (0x10000, False), "strides": strides, "version": 3,
        }


def test_mixed_host_and_device_rejected():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="not a mix"):
        numbaflash.flash_attention(FakeDeviceArray(q.shape), k, v)


def test_device_layout_checks():
    op = api._describe("q", FakeDeviceArray((1, 8, 2, 64), strides=(2048, 256, 128, 4)))
    with pytest.raises(ValueError, match="contiguous"):
        api._check_device_layout(op)
    op = api._describe("q", FakeDeviceArray((1, 8, 2, 64), strides=(2 * 1044, 2 * 130, 2 * 65, 2)))
    with pytest.raises(ValueError, match="16-byte"):
        api._check_device_layout(op)


def test_no_gpu_is_a_clear_runtime_error(monkeypatch):
    from numba import cuda

    monkeypatch.setattr(cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="needs an NVIDIA GPU"):
        numbaflash.flash_attention(*qkv())


def test_reference_handles_rows_without_keys():
    from numbaflash.reference import attention_reference

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s) for s in ((1, 5, 1, 64), (1, 3, 1, 64), (1, 3, 1, 64)))
    out, lse = attention_reference(q, k, v, causal=True)
    assert np.all(out[:, :2] == 0) and np.all(np.isneginf(lse[..., :2]))
    assert np.isfinite(out).all() and np.isfinite(lse[..., 2:]).all()


def test_tensors_must_be_on_the_current_device():
    ops = [api._Operand(n, (1, 1, 1, 64), "float16", True, None, device=d) for n, d in (("q", 0), ("k", 1))]
    with pytest.raises(ValueError, match=r"current CUDA device \(cuda:0\), got q on cuda:0, k on cuda:1"):
        api._check_same_device(ops, 0)
    api._check_same_device(ops[:1], 0)
    api._check_same_device([api._Operand("q", (1, 1, 1, 64), "float16", True, None)], 3)  # unknown: allowed


def test_device_buffer_rejects_other_than_16_bit_floats():
    from numbaflash.buffers import DeviceBuffer

    with pytest.raises(TypeError, match="16-bit floats, got dtype float32"):
        DeviceBuffer(np.zeros(3, np.float32))
    with pytest.raises(TypeError, match="16-bit floats, got dtype int8"):
        DeviceBuffer.empty((2, 2), np.int8)
    with pytest.raises(TypeError, match="needs a numpy array"):
        DeviceBuffer()
