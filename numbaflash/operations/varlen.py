"""The packed variable-length forward (``api.flash_attention_varlen``): checks of the offsets,
then one launch of the GPU's own family's varlen kernel (the Hopper kernel on sm_90 at head dims
64, 96, 128 and 256: a persistent walk over the real blocks; else the mma.sync kernel), on device
arrays or on numpy arrays staged through page-locked memory.

The sequences are packed along the first dimension: sequence b owns query rows
``cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1`` of q (total_q, heads_q, head_dim) and key rows
``cu_seqlens_k[b] .. cu_seqlens_k[b + 1] - 1`` of k and v (total_k, heads_kv, head_dim). The grid
covers ceil(max_seqlen_q / block_m) query blocks x heads_q x batch; each CTA reads its sequence's
bounds from the offsets on the device (two int32 loads each), so a call never reads device
values on the host (CUDA-graph safe). The LSE is (heads_q, total_q).
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Any

import numpy as np

from ..operands import (
    Operand,
    describe_index,
    device_pointer,
    empty_like,
    empty_lse,
    kind_of,
    stream_handle,
)
from ..runtime import device as gpu_state
from .forward import forward_kernel, variant_of
from .launch_forward import ForwardCall, VarlenCall

# driver calls of the numpy path, failures named for this operation
_call = functools.partial(gpu_state.driver_call, operation="varlen forward")


def check_max_seqlen(name: str, value: Any) -> int:
    """A positive Python or numpy int (the grid's query blocks, the config's sequence span)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def check_offsets_shape(name: str, shape: tuple[int, ...], dtype: Any) -> int:
    """cu_seqlens must be int32 and 1-D of at least 2 entries; returns batch (entries - 1)."""
    if np.dtype(dtype) != np.int32:
        raise TypeError(f"{name} must be int32, got {np.dtype(dtype)}")
    if len(shape) != 1 or shape[0] < 2:
        raise ValueError(f"{name} must be 1-D of shape (batch + 1,) with batch >= 1, got shape {shape}")
    return shape[0] - 1


def check_host_offsets(name: str, cu: np.ndarray, total: int, max_seqlen: int, max_name: str) -> None:
    """What numpy offsets allow checking cheaply: they start at 0, never decrease, end at the
    packed length ``total``, and no sequence is longer than ``max_seqlen``."""
    if int(cu[0]) != 0:
        raise ValueError(f"{name}[0] must be 0, got {int(cu[0])}")
    lengths = np.diff(cu.astype(np.int64))
    if (lengths < 0).any():
        b = int(np.argmax(lengths < 0))
        raise ValueError(f"{name} must be non-decreasing, got {name}[{b}] = {int(cu[b])} > "
                         f"{name}[{b + 1}] = {int(cu[b + 1])}")
    if int(cu[-1]) != total:
        raise ValueError(f"{name}[-1] must equal the packed length {total}, got {int(cu[-1])}")
    longest = int(lengths.max())
    if longest > max_seqlen:
        raise ValueError(f"{max_name} = {max_seqlen} is smaller than the longest sequence of {name} "
                         f"({longest} rows)")


def packed(op: Operand) -> Operand:
    """The (1, total, heads, head_dim) view of a packed 3-D operand that the kernel takes (its
    batch stride is never read: the whole extent, so that ``span`` stays right)."""
    total, heads, head_dim = op.shape
    strides = op.strides
    if strides:
        strides = (max(total, 1) * strides[0], *strides)
    return Operand(op.name, (1, total, heads, head_dim), op.dtype_name, op.on_device, op.obj, strides,
                   op.pointer, op.stream, op.device)


def check_packed_shapes(q: Operand, k: Operand, v: Operand) -> None:
    """q (total_q, heads_q, head_dim) against k and v (total_k, heads_kv, head_dim)."""
    for op in (q, k, v):
        if len(op.shape) != 3:
            raise ValueError(f"{op.name} must have 3 dimensions (total, heads, head_dim), got shape "
                             f"{op.shape}")
        if 0 in op.shape:
            raise ValueError(f"{op.name} is empty (shape {op.shape}); every dimension must be >= 1")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k and v must have the same shape, got {k.shape} and {v.shape}")


def offsets_operand(name: str, cu: Any, on_device: bool) -> tuple[int, Any]:
    """(batch, checked offsets): an Operand for device inputs (dtype and shape only: the values
    are never read on the host), the int32 numpy array for numpy inputs."""
    if on_device:
        if kind_of(cu) == "numpy":
            raise TypeError(f"{name} must be an int32 device array for device inputs, got a numpy array")
        shape = tuple(int(n) for n in getattr(cu, "shape", ()))
        dtype = cu.__cuda_array_interface__["typestr"] if kind_of(cu) == "cai" else None
        if dtype is not None:
            check_offsets_shape(name, shape, dtype)
        op = describe_index(name, cu, shape)  # int32, contiguous, on a 4-byte boundary
        return check_offsets_shape(name, shape, np.int32), op
    if not isinstance(cu, np.ndarray):
        raise TypeError(f"{name} must be an int32 numpy array for numpy inputs, got {type(cu).__name__}")
    return check_offsets_shape(name, cu.shape, cu.dtype), np.ascontiguousarray(cu)


def check_sequences(cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: Any, max_seqlen_k: Any,
                    total_q: int, total_k: int, on_device: bool) -> tuple[int, Any, Any, int, int]:
    """The varlen calls' (forward and backward) checks of the sequence description: ``(batch,
    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)``, the offsets as ``offsets_operand``
    gives them. Both offset arrays of one length; host offsets (numpy inputs) also checked
    against the totals and the maxima (``check_host_offsets``); device ones are never read."""
    batch_q, cuq = offsets_operand("cu_seqlens_q", cu_seqlens_q, on_device)
    batch_k, cuk = offsets_operand("cu_seqlens_k", cu_seqlens_k, on_device)
    if batch_q != batch_k:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), got "
                         f"{batch_q + 1} and {batch_k + 1}")
    max_q = check_max_seqlen("max_seqlen_q", max_seqlen_q)
    max_k = check_max_seqlen("max_seqlen_k", max_seqlen_k)
    if not on_device:
        check_host_offsets("cu_seqlens_q", cuq, total_q, max_q, "max_seqlen_q")
        check_host_offsets("cu_seqlens_k", cuk, total_k, max_k, "max_seqlen_k")
    return batch_q, cuq, cuk, max_q, max_k


def varlen_kernel(capability, device: int, head_dim: int, bf16: bool, causal: bool, window_size,
                  softcap: float, scale: float, max_q: int, max_k: int, sink: bool = False,
                  head_dim_v: int = 0):
    """(variant, (launcher, config, launch)) of a varlen call: the GPU's own family's varlen kernel
    where it has the head dim, else the sm80 family's (``forward_config`` with the varlen
    variant), the config picked by the longer maximum; ``sink``: its learnable sink's build;
    ``head_dim_v``: V's head dim where it differs (the pair's config, every GPU)."""
    var = variant_of(causal, window_size, softcap, scale, max_q, max_k)
    return var, forward_kernel(capability, device, head_dim, var.causal, bf16, max(max_q, max_k),
                               window=var.window, softcap=var.softcap, varlen=True, sink=sink,
                               head_dim_v=head_dim_v)


def run_device(q: Any, qd: Operand, kd: Operand, vd: Operand, cuq: Operand, cuk: Operand, batch: int,
               max_q: int, max_k: int, out: Any, od: Operand | None, causal: bool, scale: float,
               return_lse: bool, capability, device: int, window_size: tuple[int, int], softcap: float,
               sd: Operand | None = None):
    """One launch on validated device arrays, on q's stream (``sd``: a learnable sink, float32
    (heads_q,))."""
    total_q, heads_q, head_dim = qd.shape
    value_dim = vd.shape[2]
    bf16 = qd.dtype_name == "bfloat16"
    var, (launcher, _, launch) = varlen_kernel(capability, device, head_dim, bf16, causal, window_size,
                                               softcap, scale, max_q, max_k, sd is not None,
                                               0 if value_dim == head_dim else value_dim)
    if out is None:
        shape = (total_q, heads_q, value_dim)
        out = empty_like(q, shape, qd.dtype_name)
        od = Operand("out", shape, qd.dtype_name, True, out, (heads_q * value_dim, value_dim, 1),
                     device_pointer(out))
    lse_obj = None
    if return_lse:
        lse_obj = empty_lse(q, (heads_q, total_q))
        lse = (device_pointer(lse_obj), heads_q * total_q)
    else:
        lse = gpu_state.GPU.scratch_f32(device)
    call = ForwardCall(packed(qd), packed(kd), packed(vd), packed(od), lse, max_k, kd.shape[1],
                       var.scale_log2, return_lse, stream_handle(qd), device, var.window_left,
                       var.window_right, var.cap_scale, None if sd is None else (sd.pointer, heads_q))
    launch(launcher, VarlenCall(call, (cuq.pointer, batch + 1), (cuk.pointer, batch + 1), batch, max_q),
           gpu_state.GPU)
    return (out, lse_obj) if return_lse else out


def run_numpy(q: np.ndarray, k: np.ndarray, v: np.ndarray, cu_q: np.ndarray, cu_k: np.ndarray, max_q: int,
              max_k: int, out: np.ndarray | None, causal: bool, scale: float, return_lse: bool, capability,
              device: int, window_size: tuple[int, int], softcap: float):
    """The varlen forward on numpy arrays, staged synchronously (as the numpy backward): q, k, v
    and the offsets gathered into one block of page-locked memory, one copy to one device
    allocation, one launch on a stream of its own, out (and the LSE) back in one copy into pooled
    pinned memory, returned there or written into ``out``."""
    from cuda.bindings import driver

    from ..runtime.pipeline import pinned_empty

    total_q, heads_q, head_dim = q.shape
    out_shape = (total_q, heads_q, v.shape[2])
    out_nbytes = 2 * math.prod(out_shape)
    batch = cu_q.shape[0] - 1
    dtype_name = "bfloat16" if q.dtype != np.float16 else "float16"
    var, (launcher, _, launch) = varlen_kernel(capability, device, head_dim, dtype_name == "bfloat16", causal,
                                               window_size, softcap, scale, max_q, max_k,
                                               head_dim_v=0 if v.shape[2] == head_dim else v.shape[2])
    inputs = {"q": q, "k": k, "v": v, "cu_q": cu_q, "cu_k": cu_k}
    offsets, at = {}, 0
    for name, x in inputs.items():
        offsets[name] = at
        at += -(-x.nbytes // 256) * 256
    in_bytes = at
    out_bytes = -(-out_nbytes // 256) * 256
    lse_bytes = 4 * heads_q * total_q if return_lse else 0
    staged = pinned_empty((in_bytes,), np.uint8)
    for name, x in inputs.items():
        view = staged[offsets[name]:offsets[name] + x.nbytes].view(x.dtype).reshape(x.shape)
        np.copyto(view, x)
    results = pinned_empty((out_bytes + lse_bytes,), np.uint8)
    stream = _call(driver.cuStreamCreate(driver.CUstream_flags.CU_STREAM_NON_BLOCKING),
                          "creating a stream")
    base = 0
    try:
        total = in_bytes + out_bytes + lse_bytes
        base = int(_call(driver.cuMemAlloc(total), f"allocating {total} device bytes"))
        _call(driver.cuMemcpyHtoDAsync(base, staged.ctypes.data, in_bytes, stream),
                     "copying the inputs to the device")

        def dense(name: str, shape: tuple[int, int, int], at: int) -> Operand:
            _, h, d = shape
            return Operand(name, shape, dtype_name, True, None, (h * d, d, 1), base + at)

        lse = ((base + in_bytes + out_bytes, heads_q * total_q) if return_lse
               else gpu_state.GPU.scratch_f32(device))
        call = ForwardCall(packed(dense("q", q.shape, offsets["q"])),
                           packed(dense("k", k.shape, offsets["k"])),
                           packed(dense("v", v.shape, offsets["v"])),
                           packed(dense("out", out_shape, in_bytes)),
                           lse, max_k, k.shape[1], var.scale_log2, return_lse, int(stream), device,
                           var.window_left, var.window_right, var.cap_scale)
        cu_q_at, cu_k_at = (base + offsets["cu_q"], batch + 1), (base + offsets["cu_k"], batch + 1)
        launch(launcher, VarlenCall(call, cu_q_at, cu_k_at, batch, max_q), gpu_state.GPU)
        _call(driver.cuMemcpyDtoHAsync(results.ctypes.data, base + in_bytes, out_bytes + lse_bytes,
                                              stream), "copying the output to the host")
        _call(driver.cuStreamSynchronize(stream), "running the varlen forward")
    finally:
        driver.cuStreamSynchronize(stream)  # after a failure too: nothing may still use the memory
        if base:
            driver.cuMemFree(base)
        driver.cuStreamDestroy(stream)
    result = results[:out_nbytes].view(q.dtype).reshape(out_shape)
    if out is not None:
        out[...] = result
        result = out
    if return_lse:
        lse_host = results[out_bytes:out_bytes + lse_bytes].view(np.float32).reshape(heads_q, total_q)
        return result, lse_host
    return result



def direct_flash_attention_varlen(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any,
                                  max_seqlen_q: Any,
                                  max_seqlen_k: Any, causal: Any, softmax_scale: Any, window_size: Any,
                                  softcap: Any, return_lse: Any, out: Any, learnable_sink: Any = None) -> Any:
    """``api.flash_attention_varlen`` without the torch routing: every check, then one launch."""
    from ..operands import (
        check_device_layout,
        check_flag,
        check_no_self_overlap,
        check_out_aliasing,
        check_same_device,
        check_shapes,
        check_softcap,
        check_softmax_scale,
        check_window_size,
        describe,
        describe_out,
        describe_sink,
    )
    from .launch_forward import varlen_grid

    qd, kd, vd = describe("q", q), describe("k", k), describe("v", v)
    check_packed_shapes(qd, kd, vd)
    # dtypes, head dims (v's may differ where a kernel has the pair), GQA, where the inputs live
    check_shapes(packed(qd), packed(kd), packed(vd), value_dim=True)
    total_q, heads_q, head_dim = qd.shape
    total_k = kd.shape[0]
    batch, cuq, cuk, max_q, max_k = check_sequences(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                    total_q, total_k, qd.on_device)
    causal = check_flag("causal", causal)
    return_lse = check_flag("return_lse", return_lse)
    softmax_scale = check_softmax_scale(softmax_scale, head_dim)
    window_size = check_window_size(window_size)
    softcap = check_softcap(softcap, softmax_scale)
    sd = (None if learnable_sink is None
          else describe_sink(learnable_sink, heads_q, qd.on_device, "flash_attention_varlen"))
    od = None
    if out is not None:
        od = describe_out(out, qd, vd.shape[2])
    varlen_grid(16, max_q, heads_q, batch)  # the grid fits (every config's block_m >= 16)
    if qd.on_device:  # layout checks before anything is compiled
        for op in (qd, kd, vd, *([od] if od is not None else [])):
            check_device_layout(packed(op))
        if od is not None:
            check_no_self_overlap(packed(od))
            check_out_aliasing(od, [qd, kd, vd])
    capability, device = gpu_state.GPU.current()
    if qd.on_device:
        given = [qd, kd, vd, cuq, cuk] if od is None else [qd, kd, vd, od, cuq, cuk]
        check_same_device(given if sd is None else [*given, sd], device)
        return run_device(q, qd, kd, vd, cuq, cuk, batch, max_q, max_k, out, od, causal, softmax_scale,
                          return_lse, capability, device, window_size, softcap, sd)
    return run_numpy(q, k, v, cuq, cuk, max_q, max_k, out, causal, softmax_scale, return_lse, capability,
                     device,
                     window_size, softcap)
