"""The packed variable-length backward (``api.flash_attention_varlen_backward``): the varlen
forward's checks, then the three varlen builds of the mma.sync backward's kernels (prepare, main,
dQ) on device arrays, or on numpy arrays staged through page-locked memory.

Layouts are the varlen forward's: dout, q, out (total_q, heads_q, head_dim), k, v (total_k,
heads_kv, head_dim), the LSE (heads_q, total_q) float32; sequence b owns query rows
``cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1`` and key rows ``cu_seqlens_k[b] ..``. The grids
span the maxima (``launch_backward.launch_varlen_backward_*``) and every CTA reads its
sequence's bounds from the offsets on the device, so a call never reads device values on the
host (CUDA-graph safe).

The float32 workspace (``launch_backward.varlen_workspace_layout``) is laid out per head over
``abi.varlen_workspace_rows(total_q, batch)`` rows: sequence b's rows start at
``abi.varlen_row_offset(cu_seqlens_q[b], b)`` (a multiple of 128) and span its length rounded
up to 128, so no query block of the LSE, D, dQ accumulator or turn counters holds rows of two
sequences.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from ..operands import Operand, device_pointer, empty_like, empty_lse, stream_handle
from ..runtime import device as gpu_state
from .backward import backward_kernels, zeroed_sink_gradient
from .forward import variant_of
from .launch_backward import BackwardCall, VarlenBackwardCall, varlen_workspace_layout
from .varlen import packed

# driver calls of the numpy path, failures named for this operation
_call = functools.partial(gpu_state.driver_call, operation="varlen backward")


def varlen_backward_variant(causal: bool, window_size: tuple[int, int], softcap: float, scale: float,
                            max_q: int, max_k: int):
    """The forward's ``Variant`` of a validated varlen call: the window the varlen forward masks
    with (``variant_of`` of the maxima); its ``window`` and ``softcap`` pick the main kernel."""
    return variant_of(causal, window_size, softcap, scale, max_q, max_k)


def _dense3(shape: tuple[int, int, int]) -> tuple[int, int, int]:
    _, h, d = shape
    return h * d, d, 1


def _gradient(given: Operand | None, ref: Operand, name: str) -> tuple[Any, Operand]:
    """(array, operand) of a packed gradient: the given one, or a new C-contiguous device array
    like ``ref`` (its library, shape and dtype)."""
    if given is not None:
        return given.obj, given
    array = empty_like(ref.obj, ref.shape, ref.dtype_name)
    return array, Operand(name, ref.shape, ref.dtype_name, True, array, _dense3(ref.shape),
                          device_pointer(array), device=ref.device)


def launch_varlen(kernels, vcall: VarlenBackwardCall) -> None:
    """The three varlen kernels of one call, in order, on the call's stream."""
    gpu = gpu_state.GPU
    for launcher, launch in (kernels.prep, kernels.main, kernels.dq):
        launch(launcher, vcall, gpu)


def run_device(dod: Operand, qd: Operand, kd: Operand, vd: Operand, od: Operand, lsed: Operand, cuq: Operand,
               cuk: Operand, batch: int, max_q: int, max_k: int,
               grads: tuple[Operand | None, Operand | None, Operand | None], causal: bool, scale: float,
               deterministic: bool, capability, device: int, window_size: tuple[int, int],
               softcap: float, sink: Operand | None = None) -> tuple[Any, ...]:
    """The varlen backward on validated device arrays: new gradients and the workspace from the
    inputs' library (``torch.empty`` for torch), three launches on q's stream. ``sink``: a
    learnable sink's operand (the prepare kernel's sink build adds d_sink over every sequence,
    ``backward.zeroed_sink_gradient``). Returns (dq, dk, dv), and d_sink after them with a sink."""
    total_q, heads_q, head_dim = qd.shape
    var = varlen_backward_variant(causal, window_size, softcap, scale, max_q, max_k)
    bf16 = qd.dtype_name == "bfloat16"
    kernels = backward_kernels(capability, device, head_dim, var.causal, bf16, window=var.window,
                               softcap=var.softcap, varlen=True, sink=sink is not None,
                               head_dim_v=0 if vd.shape[2] == head_dim else vd.shape[2])
    dq, dqd = _gradient(grads[0], qd, "dq")
    dk, dkd = _gradient(grads[1], kd, "dk")
    dv, dvd = _gradient(grads[2], vd, "dv")
    layout = varlen_workspace_layout(total_q, batch, heads_q, head_dim, kernels.config.block_m)
    workspace = empty_lse(qd.obj, (layout.total,))  # float32; the prepare kernel initialises it
    stream = stream_handle(qd)
    d_sink, sink_args = None, (None, None)
    if sink is not None:
        d_sink, zeroed = zeroed_sink_gradient(qd.obj, heads_q, stream)
        sink_args = ((sink.pointer, heads_q), zeroed)
    call = BackwardCall(packed(dod), packed(qd), packed(kd), packed(vd), packed(od), packed(dqd),
                        packed(dkd), packed(dvd), (lsed.pointer, heads_q * total_q),
                        layout.at(device_pointer(workspace)), layout.rows, var.scale_log2, np.float32(scale),
                        deterministic, stream, device, var.window_left, var.window_right,
                        var.cap_scale, *sink_args)
    launch_varlen(kernels, VarlenBackwardCall(call, (cuq.pointer, batch + 1), (cuk.pointer, batch + 1), batch,
                                              max_q, max_k))
    return (dq, dk, dv) if sink is None else (dq, dk, dv, d_sink)


def run_numpy(dout: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, out: np.ndarray,
              lse: np.ndarray, cu_q: np.ndarray, cu_k: np.ndarray, max_q: int, max_k: int,
              grads: tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None], causal: bool,
              scale: float, deterministic: bool, capability, device: int, window_size: tuple[int, int],
              softcap: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The varlen backward on numpy arrays, staged synchronously as the dense numpy backward:
    the inputs (and the offsets) gathered into page-locked memory, one copy in, the three
    kernels on a stream of their own, dq, dk, dv back in one copy into pooled pinned memory
    (returned there, or written into the given ``grads``)."""
    from cuda.bindings import driver

    from ..runtime.pipeline import pinned_empty

    total_q, heads_q, head_dim = q.shape
    batch = cu_q.shape[0] - 1
    dtype_name = "bfloat16" if q.dtype != np.float16 else "float16"
    var = varlen_backward_variant(causal, window_size, softcap, scale, max_q, max_k)
    kernels = backward_kernels(capability, device, head_dim, var.causal, dtype_name == "bfloat16",
                               window=var.window, softcap=var.softcap, varlen=True,
                               head_dim_v=0 if v.shape[2] == head_dim else v.shape[2])
    ws = varlen_workspace_layout(total_q, batch, heads_q, head_dim, kernels.config.block_m)
    inputs = {"dout": dout, "q": q, "k": k, "v": v, "out": out,
              "lse": np.ascontiguousarray(lse, dtype=np.float32), "cu_q": cu_q, "cu_k": cu_k}
    outputs = {"dq": q.shape, "dk": k.shape, "dv": v.shape}
    offsets, at = {}, 0
    for name, x in inputs.items():
        offsets[name] = at
        at += -(-x.nbytes // 256) * 256
    in_bytes = at
    for name, shape in outputs.items():
        offsets[name] = at
        at += -(-2 * math.prod(shape) // 256) * 256
    grad_bytes = at - in_bytes
    total = at + 4 * ws.total
    staged = pinned_empty((in_bytes,), np.uint8)
    for name, x in inputs.items():
        view = staged[offsets[name]:offsets[name] + x.nbytes].view(x.dtype).reshape(x.shape)
        np.copyto(view, x)
    results = pinned_empty((grad_bytes,), np.uint8)
    stream = _call(driver.cuStreamCreate(driver.CUstream_flags.CU_STREAM_NON_BLOCKING),
                          "creating a stream")
    base = 0
    try:
        base = int(_call(driver.cuMemAlloc(total), f"allocating {total} device bytes"))
        _call(driver.cuMemcpyHtoDAsync(base, staged.ctypes.data, in_bytes, stream),
                     "copying the inputs to the device")

        def dense(name: str, shape: tuple[int, int, int]) -> Operand:
            return packed(Operand(name, shape, dtype_name, True, None, _dense3(shape), base + offsets[name]))

        call = BackwardCall(dense("dout", dout.shape), dense("q", q.shape), dense("k", k.shape),
                            dense("v", v.shape), dense("out", out.shape), dense("dq", q.shape),
                            dense("dk", k.shape), dense("dv", v.shape),
                            (base + offsets["lse"], heads_q * total_q),
                            ws.at(base + at), ws.rows, var.scale_log2, np.float32(scale), deterministic,
                            int(stream), device, var.window_left, var.window_right, var.cap_scale)
        launch_varlen(kernels, VarlenBackwardCall(call, (base + offsets["cu_q"], batch + 1),
                                                  (base + offsets["cu_k"], batch + 1), batch, max_q, max_k))
        _call(driver.cuMemcpyDtoHAsync(results.ctypes.data, base + in_bytes, grad_bytes, stream),
                     "copying the gradients to the host")
        _call(driver.cuStreamSynchronize(stream), "running the varlen backward")
    finally:
        driver.cuStreamSynchronize(stream)  # after a failure too: nothing may still use the memory
        if base:
            driver.cuMemFree(base)
        driver.cuStreamDestroy(stream)
    given = dict(zip(("dq", "dk", "dv"), grads, strict=True))
    found = []
    for name, shape in outputs.items():
        start = offsets[name] - in_bytes
        result = results[start:start + 2 * math.prod(shape)].view(q.dtype).reshape(shape)
        if given[name] is not None:
            given[name][...] = result
            result = given[name]
        found.append(result)
    return found[0], found[1], found[2]


def direct_flash_attention_varlen_backward(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any,
                                           cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: Any,
                                           max_seqlen_k: Any, causal: Any, softmax_scale: Any,
                                           window_size: Any, softcap: Any, deterministic: Any, dq: Any = None,
                                           dk: Any = None, dv: Any = None,
                                           learnable_sink: Any = None) -> tuple[Any, ...]:
    """``api.flash_attention_varlen_backward`` without the torch routing: every check (the varlen
    forward's, the dense backward's for dout, out, lse and given gradients, the forward's for a
    learnable sink) before anything is compiled or launched, then the launches."""
    from ..operands import (
        check_device_layout,
        check_flag,
        check_like,
        check_outputs_disjoint,
        check_same_device,
        check_shapes,
        check_softcap,
        check_softmax_scale,
        check_window_size,
        describe,
        describe_gradient,
        describe_lse,
        describe_sink,
    )
    from .launch_backward import check_backward_grid
    from .varlen import check_packed_shapes, check_sequences

    window_size = check_window_size(window_size)
    qd, kd, vd = describe("q", q), describe("k", k), describe("v", v)
    check_packed_shapes(qd, kd, vd)
    # dtypes, head dims (v's may differ where a kernel has the pair), GQA, where the inputs live
    check_shapes(packed(qd), packed(kd), packed(vd), value_dim=True)
    total_q, heads_q, head_dim = qd.shape
    total_k, heads_kv, _ = kd.shape
    dod, od = describe("dout", dout), describe("out", out)
    like_out = qd  # dout and out: q's shape, but for v's head dim where it differs
    if vd.shape[2] != head_dim:
        like_out = Operand("the forward's out (total_q, heads_q, v's head_dim)", (*qd.shape[:2], vd.shape[2]),
                           qd.dtype_name, qd.on_device, None)
    check_like(dod, like_out)
    check_like(od, like_out)
    lsed = describe_lse(lse, (heads_q, total_q), qd.on_device, "(heads_q, total_q)")
    batch, cuq, cuk, max_q, max_k = check_sequences(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                    total_q, total_k, qd.on_device)
    causal = check_flag("causal", causal)
    deterministic = check_flag("deterministic", deterministic)
    softmax_scale = check_softmax_scale(softmax_scale, head_dim)
    softcap = check_softcap(softcap, softmax_scale)
    sd = (None if learnable_sink is None
          else describe_sink(learnable_sink, heads_q, qd.on_device, "flash_attention_varlen_backward"))
    grads = (None if dq is None else describe_gradient("dq", dq, qd),
             None if dk is None else describe_gradient("dk", dk, kd),
             None if dv is None else describe_gradient("dv", dv, vd))
    given = [g for g in grads if g is not None]
    check_backward_grid(max_q, max_k, heads_q, heads_kv, batch)  # so every config's grids fit
    inputs = [dod, qd, kd, vd, od, lsed]
    if qd.on_device:  # layout checks before anything is compiled
        for op in (dod, qd, kd, vd, od, *given):
            check_device_layout(packed(op))
    check_outputs_disjoint(given, inputs)
    capability, device = gpu_state.GPU.current()
    if qd.on_device:
        check_same_device([*inputs, *given, cuq, cuk] + ([] if sd is None else [sd]), device)
        return run_device(dod, qd, kd, vd, od, lsed, cuq, cuk, batch, max_q, max_k, grads, causal,
                          softmax_scale, deterministic, capability, device, window_size, softcap, sd)
    return run_numpy(dout, q, k, v, out, lse, cuq, cuk, max_q, max_k, (dq, dk, dv), causal, softmax_scale,
                     deterministic, capability, device, window_size, softcap)
