"""The checked entries of the dense operations: validate a call's operands (``operands``), then
run its operation (``forward``, ``backward``, ``decode``). ``api`` calls these after its torch
routing, and ``torch_ops``' custom ops call them on real tensors; the packed variable-length
entries live beside their operations (``varlen``, ``varlen_backward``).

Every check runs before anything is compiled or launched; the device path then costs a few
dictionary lookups and one launch (``forward.run_device``). Torch tensors of a layout validated
before skip to the per-call checks and the launch (``forward.run_torch``, ``backward.run_torch``).
"""

from __future__ import annotations

from typing import Any

from ..configs import DECODE_HEAD_DIM_PAIRS, MLA_HEAD_DIMS
from ..operands import (
    Operand,
    check_device_layout,
    check_flag,
    check_like,
    check_mla_shapes,
    check_no_self_overlap,
    check_out_aliasing,
    check_outputs_disjoint,
    check_same_device,
    check_shapes,
    check_softcap,
    check_softmax_scale,
    check_window_size,
    describe,
    describe_gradient,
    describe_index,
    describe_lse,
    describe_out,
    describe_rotary,
    describe_sink,
    kind_of,
)
from ..runtime import device as gpu_state
from . import backward, decode, forward
from .launch_backward import check_backward_grid
from .launch_decode import MAX_SPLITS
from .launch_forward import forward_grid


def direct_flash_attention(q: Any, k: Any, v: Any, causal: Any, softmax_scale: Any, return_lse: Any,
                           out: Any, window_size: Any = (-1, -1), softcap: Any = 0.0,
                           learnable_sink: Any = None) -> Any:
    """``api.flash_attention`` without the torch routing: validate, then launch (what the custom
    op runs on real tensors, and what every call that needs no autograd takes). Torch tensors of
    a layout validated before take ``forward.run_torch``: its per-call checks and the launch (a
    learnable sink too)."""
    if kind_of(q) == "torch":
        done = forward.run_torch(q, k, v, causal, softmax_scale, return_lse, out, window_size, softcap,
                                 learnable_sink)
        if done is not None:
            return done
    default_scale = softmax_scale is None  # the plans' key holds None for it (as run_torch's does)
    qd, kd, vd = describe("q", q), describe("k", k), describe("v", v)
    check_shapes(qd, kd, vd, value_dim=True)
    batch, seqlen_q, heads_q, head_dim = qd.shape
    causal = check_flag("causal", causal)
    return_lse = check_flag("return_lse", return_lse)
    softmax_scale = check_softmax_scale(softmax_scale, head_dim)
    window_size = check_window_size(window_size)
    softcap = check_softcap(softcap, softmax_scale)
    sd = None if learnable_sink is None else describe_sink(learnable_sink, heads_q, qd.on_device)
    od = None
    if out is not None:
        od = describe_out(out, qd, vd.shape[3])
        if not od.on_device:
            od.strides = tuple(st // out.itemsize for st in out.strides)
        check_no_self_overlap(od)
    forward_grid((seqlen_q + 15) // 16, heads_q, batch)  # the grid fits (checked again at launch)
    if qd.on_device:  # layout checks before anything is compiled
        check_device_layout(qd)
        check_device_layout(kd)
        check_device_layout(vd)
        if od is not None:
            check_device_layout(od)
            check_out_aliasing(od, [qd, kd, vd])
    capability, device = gpu_state.GPU.current()
    if qd.on_device:
        given = [qd, kd, vd] if od is None else [qd, kd, vd, od]
        check_same_device(given if sd is None else [*given, sd], device)
        return forward.run_device(q, qd, kd, vd, od, out, causal, softmax_scale,
                                  None if default_scale else softmax_scale, return_lse,
                                  capability, device, window_size, softcap, sd)
    return forward.run_numpy(q, k, v, out, qd.dtype_name, causal, softmax_scale, return_lse,
                             capability, device, window_size, softcap)


def direct_flash_attention_backward(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, causal: Any,
                                    softmax_scale: Any, deterministic: Any, dq: Any, dk: Any, dv: Any,
                                    window_size: Any = (-1, -1), softcap: Any = 0.0,
                                    learnable_sink: Any = None) -> tuple[Any, ...]:
    """``api.flash_attention_backward``: validate, then launch (what the custom op runs).
    With a ``learnable_sink`` (checked as the forward's, ``describe_sink``) returns d_sink too.
    Torch tensors of a layout validated before take ``backward.run_torch``: its per-call checks,
    the allocations and the three launches."""
    if kind_of(q) == "torch":
        done = backward.run_torch(dout, q, k, v, out, lse, causal, softmax_scale, deterministic, dq, dk, dv,
                                  window_size, softcap, learnable_sink)
        if done is not None:
            return done
    window_size = check_window_size(window_size)
    qd, kd, vd = describe("q", q), describe("k", k), describe("v", v)
    check_shapes(qd, kd, vd, value_dim=True)
    batch, seqlen_q, heads_q, head_dim = qd.shape
    _, seqlen_k, heads_kv, _ = kd.shape
    dod, od = describe("dout", dout), describe("out", out)
    like_out = qd  # dout and out: q's shape, but for v's head dim where it differs
    if vd.shape[3] != head_dim:
        like_out = Operand("the forward's out (batch, seqlen_q, heads_q, v's head_dim)",
                           (*qd.shape[:3], vd.shape[3]), qd.dtype_name, qd.on_device, None)
    check_like(dod, like_out)
    check_like(od, like_out)
    lsed = describe_lse(lse, (batch, heads_q, seqlen_q), qd.on_device)
    causal = check_flag("causal", causal)
    deterministic = check_flag("deterministic", deterministic)
    softmax_scale = check_softmax_scale(softmax_scale, head_dim)
    softcap = check_softcap(softcap, softmax_scale)
    sd = (None if learnable_sink is None
          else describe_sink(learnable_sink, heads_q, qd.on_device, "flash_attention_backward"))
    grads = (None if dq is None else describe_gradient("dq", dq, qd),
             None if dk is None else describe_gradient("dk", dk, kd),
             None if dv is None else describe_gradient("dv", dv, vd))
    given = [g for g in grads if g is not None]
    check_backward_grid(seqlen_q, seqlen_k, heads_q, heads_kv, batch)  # so every config's grids fit
    inputs = [dod, qd, kd, vd, od, lsed]
    if qd.on_device:  # layout checks before anything is compiled
        for op in (dod, qd, kd, vd, od, *given):
            check_device_layout(op)
    check_outputs_disjoint(given, inputs)
    capability, device = gpu_state.GPU.current()
    if qd.on_device:
        check_same_device([*inputs, *given] + ([] if sd is None else [sd]), device)
        return backward.run_device(dod, qd, kd, vd, od, lsed, grads, causal, softmax_scale, deterministic,
                                   capability, device, window_size, softcap, sd)
    return backward.run_numpy(dout, q, k, v, out, lse, (dq, dk, dv), causal, softmax_scale, deterministic,
                              capability, device, window_size, softcap)



def direct_flash_attention_with_kvcache(q: Any, k_cache: Any, v_cache: Any, cache_seqlens: Any, k_new: Any,
                                        v_new: Any, block_table: Any, causal: Any, softmax_scale: Any,
                                        num_splits: Any, return_lse: Any, out: Any,
                                        window_size: Any = (-1, -1), softcap: Any = 0.0,
                                        learnable_sink: Any = None, cache_batch_idx: Any = None,
                                        cache_leftpad: Any = None, rotary_cos: Any = None,
                                        rotary_sin: Any = None, rotary_interleaved: Any = False) -> Any:
    """``api.flash_attention_with_kvcache`` without the torch routing: validate, then launch (what
    the custom op runs on real tensors)."""
    qd, kcd, vcd = describe("q", q), describe("k_cache", k_cache), describe("v_cache", v_cache)
    # with cache_batch_idx the cache's batch (or the block table's rows) is its own; v_cache may have
    # another head dim where a kernel has the pair (out then has it)
    check_shapes(qd, kcd, vcd, paged=block_table is not None or cache_batch_idx is not None, value_dim=True,
                 pairs=DECODE_HEAD_DIM_PAIRS)
    if not qd.on_device:
        raise TypeError("flash_attention_with_kvcache takes device arrays (torch, CuPy, Numba), got numpy")
    batch, seqlen_q, heads_q, head_dim = qd.shape
    btd = None
    if block_table is not None:
        if not isinstance(getattr(block_table, "shape", None), tuple) and not hasattr(block_table, "shape"):
            raise TypeError(f"block_table must be an int32 device array, got {type(block_table).__name__}")
        shape = tuple(block_table.shape)
        if len(shape) != 2 or (shape[0] != batch and cache_batch_idx is None):
            raise ValueError(f"block_table must have shape (batch, max_pages) = ({batch}, max_pages), "
                             f"got {shape}")
        btd = describe_index("block_table", block_table, shape)
    seqd = describe_index("cache_seqlens", cache_seqlens, (batch,))
    bid = None if cache_batch_idx is None else describe_index("cache_batch_idx", cache_batch_idx, (batch,))
    lpd = None if cache_leftpad is None else describe_index("cache_leftpad", cache_leftpad, (batch,))
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new must be given together")
    knd = vnd = None
    if k_new is not None:
        knd, vnd = describe("k_new", k_new), describe("v_new", v_new)
        want = (batch, knd.shape[1] if len(knd.shape) == 4 else -1, kcd.shape[2], head_dim)
        for op, cache in ((knd, kcd), (vnd, vcd)):
            want = (*want[:3], cache.shape[3])  # v_new: v_cache's head dim
            if op.shape != want or op.dtype_name != qd.dtype_name or not op.on_device:
                raise ValueError(f"{op.name} must be a {qd.dtype_name} device array of shape (batch, "
                                 f"seqlen_new, heads_kv, head_dim) = {want}, got {op.shape} {op.dtype_name}")
        room = btd.shape[1] * kcd.shape[1] if btd is not None else kcd.shape[1]
        if knd.shape[1] > room:
            raise ValueError(f"k_new has {knd.shape[1]} rows, more than the cache holds a sequence ({room})")
    causal = check_flag("causal", causal)
    return_lse = check_flag("return_lse", return_lse)
    scale_key = softmax_scale  # as given: the plans' key (``decode.run_torch`` builds it the same way)
    softmax_scale = check_softmax_scale(softmax_scale, head_dim)
    window_size = check_window_size(window_size)
    softcap = check_softcap(softcap, softmax_scale)
    rot = None
    if rotary_cos is not None or rotary_sin is not None:
        room = btd.shape[1] * kcd.shape[1] if btd is not None else kcd.shape[1]
        cosd, sind, dim = describe_rotary(rotary_cos, rotary_sin, qd, room, knd is not None)
        rot = decode.RotaryCall(cosd, sind, dim, check_flag("rotary_interleaved", rotary_interleaved),
                                decode.rotary_q_step(causal, window_size, room))
    sd = (None if learnable_sink is None
          else describe_sink(learnable_sink, heads_q, True, "flash_attention_with_kvcache"))
    check_num_splits(num_splits)
    outd = None
    if out is not None:
        outd = describe_out(out, qd, None if vcd.shape[3] == head_dim else vcd.shape[3])
    given = [op for op in (qd, kcd, vcd, knd, vnd, outd) if op is not None]
    for op in given:
        check_device_layout(op)
    if outd is not None:
        check_no_self_overlap(outd)
        check_outputs_disjoint([outd], [op for op in given if op is not outd])
    capability, device = gpu_state.GPU.current()
    rotary_ops = () if rot is None else (rot.cos, rot.sin)
    check_same_device([*given, seqd, *(op for op in (btd, sd, bid, lpd) if op is not None), *rotary_ops],
                      device)
    result, lse = decode.run_device(qd, kcd, vcd, knd, vnd, seqd, btd, outd, causal, softmax_scale, scale_key,
                                    num_splits, return_lse, capability, device, window_size, softcap, sd,
                                    bid, lpd, rot)
    return (result, lse) if return_lse else result


def check_num_splits(num_splits: Any) -> None:
    """The KV-cache and MLA calls' ``num_splits``: an int from 0 (automatic) to ``MAX_SPLITS``."""
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or not 0 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be an int from 0 (automatic) to {MAX_SPLITS}, got {num_splits!r}")


def direct_flash_mla_with_kvcache(q: Any, kv_cache: Any, cache_seqlens: Any, block_table: Any,
                                  head_dim_v: Any, causal: Any, softmax_scale: Any, num_splits: Any,
                                  return_lse: Any, out: Any) -> Any:
    """``api.flash_mla_with_kvcache``: validate, then launch the MLA decode kernel
    (``kernels.mla_decode``) through decode's plan (``decode.run_device(.., latent=True)``), V
    described as the first ``head_dim_v`` columns of the cache. Torch tensors of a layout validated
    before take ``decode.run_torch(.., latent=True)``: its per-call checks and the launches."""
    if kind_of(q) == "torch" and type(head_dim_v) is int and head_dim_v == MLA_HEAD_DIMS[1]:
        done = decode.run_torch(q, kv_cache, kv_cache, cache_seqlens, None, None, block_table, causal,
                                softmax_scale, num_splits, return_lse, out, latent=True)
        if done is not None:
            return done
    qd, kcd = describe("q", q), describe("kv_cache", kv_cache)
    for op in (qd, kcd):
        if len(op.shape) != 4 or 0 in op.shape:
            raise ValueError(f"{op.name} must have 4 non-empty dimensions, got shape {op.shape}")
    check_mla_shapes(qd.shape, kcd.shape, qd.dtype_name, kcd.dtype_name, head_dim_v)
    d_v = MLA_HEAD_DIMS[1]
    batch, seqlen_q, heads_q, head_dim = qd.shape
    for op in (qd, kcd):
        if not op.on_device:
            raise TypeError(f"flash_mla_with_kvcache takes device arrays (torch, CuPy, Numba), got a numpy "
                            f"{op.name}")
    btd = None
    if block_table is not None:
        shape = tuple(getattr(block_table, "shape", ()))
        if len(shape) != 2 or shape[0] != batch:
            raise ValueError(f"block_table must have shape (batch, max_pages) = ({batch}, max_pages), "
                             f"got {shape}")
        btd = describe_index("block_table", block_table, shape)
    elif kcd.shape[0] != batch:
        raise ValueError(f"a contiguous kv_cache must have q's batch ({batch}) first, got {kcd.shape}; "
                         "a paged one needs block_table")
    seqd = describe_index("cache_seqlens", cache_seqlens, (batch,))
    causal = check_flag("causal", causal)
    return_lse = check_flag("return_lse", return_lse)
    scale_key = softmax_scale
    softmax_scale = check_softmax_scale(softmax_scale, head_dim)
    check_num_splits(num_splits)
    check_device_layout(qd)
    check_device_layout(kcd)
    vcd = Operand("kv_cache[..., :head_dim_v]", (*kcd.shape[:3], d_v), kcd.dtype_name, True, kv_cache,
                  kcd.strides, kcd.pointer, kcd.stream, kcd.device)
    outd = None
    if out is not None:
        outd = describe_out(out, qd, d_v)
        check_device_layout(outd)
        check_no_self_overlap(outd)
        check_outputs_disjoint([outd], [qd, kcd])
    capability, device = gpu_state.GPU.current()
    check_same_device([qd, kcd, seqd, *(op for op in (btd, outd) if op is not None)], device)
    result, lse = decode.run_device(qd, kcd, vcd, None, None, seqd, btd, outd, causal, softmax_scale,
                                    scale_key, num_splits, return_lse, capability, device, latent=True)
    return (result, lse) if return_lse else result
