"""Host API: validation, dtype/layout handling, dispatch by GPU, launch, staging."""

from __future__ import annotations

import dataclasses
import math
import threading
from typing import Any

import numpy as np

from .configs import SUPPORTED_HEAD_DIMS, forward_config

_FLOAT16 = np.dtype(np.float16)


def _bfloat16_dtype() -> np.dtype | None:
    try:
        import ml_dtypes
    except ImportError:
        return None
    return np.dtype(ml_dtypes.bfloat16)


@dataclasses.dataclass
class _Operand:
    """One attention operand reduced to what the kernel needs."""

    name: str
    shape: tuple[int, ...]
    dtype_name: str  # "float16" | "bfloat16"
    on_device: bool
    obj: Any
    strides: tuple[int, ...] = ()  # in elements (device operands)
    pointer: int = 0
    stream: int | None = None


def _dtype_name_of_numpy(dtype: np.dtype, name: str) -> str:
    if dtype == _FLOAT16:
        return "float16"
    if dtype == _bfloat16_dtype() or str(dtype) == "bfloat16":
        return "bfloat16"
    raise TypeError(f"{name} must be float16 or bfloat16, got {dtype}")


def _is_torch(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def _describe(name: str, x: Any) -> _Operand:
    """Classify one input: host numpy array or device array (``__cuda_array_interface__``)."""
    if isinstance(x, np.ndarray):
        return _Operand(name, tuple(x.shape), _dtype_name_of_numpy(x.dtype, name), False, x)
    if _is_torch(x):
        import torch

        if x.device.type != "cuda":
            raise TypeError(f"{name}: torch tensors must be on a CUDA device, got device {x.device}")
        names = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
        if x.dtype not in names:
            raise TypeError(f"{name} must be float16 or bfloat16, got {x.dtype}")
        strides = tuple(int(s) for s in x.stride())
        stream = torch.cuda.current_stream(x.device).cuda_stream
        return _Operand(name, tuple(x.shape), names[x.dtype], True, x, strides, x.data_ptr(), stream)
    cai = getattr(x, "__cuda_array_interface__", None)
    if cai is None:
        raise TypeError(
            f"{name} must be a numpy array or a CUDA array (__cuda_array_interface__), "
            f"got {type(x).__name__}"
        )
    dtype = getattr(x, "dtype", None)
    dtype = np.dtype(dtype) if isinstance(dtype, np.dtype) else np.dtype(cai["typestr"])
    shape = tuple(int(s) for s in cai["shape"])
    itemsize = dtype.itemsize
    if cai.get("strides") is None:
        strides = tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
    else:
        if any(s % itemsize for s in cai["strides"]):
            raise ValueError(f"{name}: strides {cai['strides']} are not multiples of the element size")
        strides = tuple(int(s) // itemsize for s in cai["strides"])
    stream = cai.get("stream")
    return _Operand(name, shape, _dtype_name_of_numpy(dtype, name), True, x, strides,
                    int(cai["data"][0]), stream)


def _check_shapes(q: _Operand, k: _Operand, v: _Operand) -> None:
    for op in (q, k, v):
        if len(op.shape) != 4:
            raise ValueError(
                f"{op.name} must have 4 dimensions (batch, seqlen, heads, head_dim), got shape {op.shape}"
            )
        if 0 in op.shape:
            raise ValueError(f"{op.name} is empty (shape {op.shape}); every dimension must be >= 1")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {k.shape} and {v.shape}")
    b, _, hq, d = q.shape
    bk, _, hkv, dk = k.shape
    if bk != b:
        raise ValueError(f"q and k must have the same batch size, got {b} and {bk}")
    if dk != d:
        raise ValueError(f"q and k must have the same head_dim, got {d} and {dk}")
    if hq % hkv:
        raise ValueError(f"heads of q ({hq}) must be a multiple of heads of k/v ({hkv})")
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {d}")
    dtypes = {op.dtype_name for op in (q, k, v)}
    if len(dtypes) != 1:
        raise TypeError(f"q, k, v must have one dtype, got {q.dtype_name}, {k.dtype_name}, {v.dtype_name}")
    places = {op.on_device for op in (q, k, v)}
    if len(places) != 1:
        raise TypeError("q, k, v must be all numpy (host) arrays or all device arrays, not a mix")


def _check_device_layout(op: _Operand) -> None:
    """The kernel moves 16-byte chunks: head_dim contiguous, rows 16-byte aligned."""
    if op.strides[3] != 1:
        raise ValueError(
            f"{op.name}: the last (head_dim) dimension must be contiguous (stride 1), got strides "
            f"{op.strides} (in elements); pass a contiguous copy"
        )
    if op.pointer % 16 or any(s % 8 for s in op.strides[:3] if s):
        raise ValueError(
            f"{op.name}: rows must start on 16-byte boundaries (pointer {op.pointer:#x}, strides "
            f"{op.strides} in elements must be multiples of 8); pass a contiguous copy"
        )
    if any(s < 0 for s in op.strides):
        raise ValueError(f"{op.name}: negative strides {op.strides} are not supported")


_GPU_LOCK = threading.Lock()
_KERNELS: dict = {}


def _gpu_capability() -> tuple[int, int]:
    from numba import cuda

    if not cuda.is_available():
        raise RuntimeError(
            "numbaflash needs an NVIDIA GPU with compute capability >= 8.0 (sm_80), and none "
            "is available (numba.cuda.is_available() is False)"
        )
    cap = tuple(cuda.get_current_device().compute_capability)
    if cap < (8, 0):
        raise RuntimeError(
            f"numbaflash needs compute capability >= 8.0 (sm_80, Ampere or newer); this GPU is "
            f"sm_{cap[0]}{cap[1]}"
        )
    return cap


def _forward_kernel(capability, head_dim: int, causal: bool, bf16: bool):
    """Compile (once per process) and return (kernel, config) for this problem."""
    from numba import cuda

    from .configs import make_kernel
    from .kernels.forward_mma import FORWARD_ARGTYPES

    config = forward_config(capability, head_dim, causal)
    key = (config, causal, bf16, capability)
    with _GPU_LOCK:
        if key not in _KERNELS:
            pyfunc = make_kernel(config, causal, bf16)
            kernel = cuda.jit(FORWARD_ARGTYPES, launch_bounds=pyfunc.launch_bounds)(pyfunc)
            _raise_shared_limit(kernel, FORWARD_ARGTYPES, config.shared_bytes)
            _KERNELS[key] = kernel
    return _KERNELS[key], config


def _raise_shared_limit(kernel, argtypes, nbytes: int) -> None:
    """Allow more than 48 KB of dynamic shared memory for this kernel."""
    if nbytes <= 48 * 1024:
        return
    from cuda.bindings import driver as cu_driver
    from numba.cuda.cudadrv.driver import driver

    cufunc = kernel.overloads[tuple(argtypes)]._codelibrary.get_cufunc()
    attr = cu_driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    driver.cuKernelSetAttribute(attr, nbytes, cufunc.handle, cufunc.device.id)


def _flat_view(op: _Operand):
    """A 1-D uint16 Numba device array spanning ``op``'s memory (zero copy)."""
    from numba import cuda

    span = 1 + sum((n - 1) * s for n, s in zip(op.shape, op.strides, strict=True))
    interface = {"shape": (span,), "strides": None, "typestr": "<u2", "data": (op.pointer, False),
                 "version": 3}
    return cuda.from_cuda_array_interface(interface, owner=op.obj, sync=False)


def _flat_f32_view(obj):
    from numba import cuda

    cai = obj.__cuda_array_interface__
    n = int(np.prod(cai["shape"]))
    interface = {"shape": (n,), "strides": None, "typestr": "<f4", "data": (cai["data"][0], False),
                 "version": 3}
    return cuda.from_cuda_array_interface(interface, owner=obj, sync=False)


def flash_attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    out: Any = None,
) -> Any:
    """Exact attention ``O = softmax(Q Kᵀ · scale) V`` on tensor cores.

    Args:
        q: (batch, seqlen_q, heads_q, head_dim), float16 or bfloat16.
        k, v: (batch, seqlen_k, heads_kv, head_dim), same dtype; heads_q a multiple of
            heads_kv (GQA / MQA). head_dim 64 or 128; any seqlen >= 1.
            All three numpy arrays (copied to the GPU and back; the result is numpy), or all
            device arrays: torch CUDA tensors, CuPy arrays, Numba device arrays or any
            ``__cuda_array_interface__`` object (zero copy; the result stays on the device,
            of the same library for torch and CuPy, a Numba device array otherwise). Strided
            device inputs work when head_dim is contiguous and rows are 16-byte aligned.
        causal: mask keys after the diagonal, bottom-right aligned (query i sees key j iff
            j <= i + seqlen_k - seqlen_q). Rows that see no key give 0.
        softmax_scale: positive scale of QKᵀ; default 1/sqrt(head_dim).
        return_lse: also return the float32 log-sum-exp, (batch, heads_q, seqlen_q); -inf
            for rows that see no key.
        out: optional output array (same shape and dtype as q, same kind as the inputs).

    Returns:
        ``out`` (batch, seqlen_q, heads_q, head_dim) in q's dtype, or ``(out, lse)``.
    """
    ops = [_describe(n, x) for n, x in (("q", q), ("k", k), ("v", v))]
    qd, kd, vd = ops
    _check_shapes(qd, kd, vd)
    batch, seqlen_q, heads_q, head_dim = qd.shape
    seqlen_k, heads_kv = kd.shape[1], kd.shape[2]
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    if not isinstance(softmax_scale, (int, float, np.floating)) or not (
        math.isfinite(softmax_scale) and softmax_scale > 0
    ):
        raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale!r}")
    if out is not None:
        od = _describe("out", out)
        if od.shape != qd.shape or od.dtype_name != qd.dtype_name:
            raise ValueError(
                f"out must have q's shape {qd.shape} and dtype {qd.dtype_name}, "
                f"got {od.shape} {od.dtype_name}"
            )
        if od.on_device != qd.on_device:
            raise TypeError("out must live where the inputs live (numpy for numpy inputs, device otherwise)")
    capability = _gpu_capability()
    bf16 = qd.dtype_name == "bfloat16"
    kernel, config = _forward_kernel(capability, head_dim, bool(causal), bf16)

    from numba import cuda

    if qd.on_device:
        for op in ops:
            _check_device_layout(op)
        stream = cuda.external_stream(qd.stream) if qd.stream not in (None, 0) else cuda.default_stream()
        o_obj = out if out is not None else _empty_like(q, (batch, seqlen_q, heads_q, head_dim), qd)
        od = _describe("out", o_obj)
        _check_device_layout(od)
        flat = [_flat_view(op) for op in (qd, kd, vd, od)]
        lse_obj = _empty_lse(q, (batch, heads_q, seqlen_q)) if return_lse else None
    else:
        stream = cuda.stream()
        host = [np.ascontiguousarray(op.obj).view(np.uint16) for op in ops]
        flat = [cuda.to_device(h.reshape(-1), stream=stream) for h in host]
        flat.append(cuda.device_array(batch * seqlen_q * heads_q * head_dim, np.uint16, stream=stream))
        for op, h in zip(ops, host, strict=True):
            op.strides = tuple(s // 2 for s in h.strides)
        contiguous = (seqlen_q * heads_q * head_dim, heads_q * head_dim, head_dim, 1)
        od = _Operand("out", qd.shape, qd.dtype_name, False, None, contiguous)
        lse_obj = None
        if return_lse:
            lse_obj = cuda.device_array((batch, heads_q, seqlen_q), np.float32, stream=stream)
    lse_flat = _flat_f32_view(lse_obj) if return_lse else cuda.device_array(1, np.float32, stream=stream)

    grid = ((seqlen_q + config.block_m - 1) // config.block_m, heads_q, batch)
    scale_log2 = np.float32(softmax_scale * math.log2(math.e))
    args = [*flat, lse_flat]
    for op in (qd, kd, vd, od):
        args += list(op.strides[:3])
    args += [seqlen_q, seqlen_k, heads_q, heads_q // heads_kv, scale_log2, bool(return_lse)]
    kernel[grid, config.threads, stream, config.shared_bytes](*args)

    if qd.on_device:
        return (o_obj, lse_obj) if return_lse else o_obj
    result = flat[3].copy_to_host(stream=stream).view(q.dtype).reshape(batch, seqlen_q, heads_q, head_dim)
    lse_host = lse_obj.copy_to_host(stream=stream) if return_lse else None
    stream.synchronize()
    if out is not None:
        out[...] = result
        result = out
    return (result, lse_host) if return_lse else result


def _empty_like(ref: Any, shape: tuple[int, ...], op: _Operand):
    """A new device array for the output, of the inputs' library where we know it."""
    if _is_torch(ref):
        import torch

        return torch.empty(shape, dtype=ref.dtype, device=ref.device)
    module = type(ref).__module__.split(".")[0]
    if module == "cupy":
        import cupy

        return cupy.empty(shape, dtype=ref.dtype)
    from numba import cuda

    dtype = _FLOAT16 if op.dtype_name == "float16" else _bfloat16_dtype()
    return cuda.device_array(shape, dtype=dtype)


def _empty_lse(ref: Any, shape: tuple[int, ...]):
    if _is_torch(ref):
        import torch

        return torch.empty(shape, dtype=torch.float32, device=ref.device)
    if type(ref).__module__.split(".")[0] == "cupy":
        import cupy

        return cupy.empty(shape, dtype=cupy.float32)
    from numba import cuda

    return cuda.device_array(shape, dtype=np.float32)
