"""Ring attention: each rank keeps its queries, the keys and values pass around the ring.

Forward: at step s a rank holds the keys and values of rank ``rank - s`` and runs the calls that
``layout.plan_step`` gives for its queries against them, while the next block is in transfer;
the partial outputs fold into a float32 accumulator through their LSEs (``blocks.merge_``).

Backward (FlashAttention-2's ring): the keys and values travel the same way; each block's
gradients come from the single-GPU backward with the *final* out and LSE (so P = exp(S - LSE) is
the global softmax), dQ adds up locally, and the float32 dK and dV of a block travel with it and
reach their owner one step after the last.
"""

from __future__ import annotations

import math
from itertools import pairwise

import numpy as np
import torch
from torch import Tensor

from .blocks import LocalAttention, dense_blocks, fold_sink_rows, packed_blocks, sink_grad
from .comm import Ring


def _accumulator(x: Tensor) -> torch.dtype:
    """float32, or the inputs' dtype where that is wider (float64 in the CPU tests)."""
    return torch.promote_types(x.dtype, torch.float32)


def _ring_forward(ring: Ring, attn, plans, q, k, v, scale, softcap, lse_shape, sink=None):
    wide = _accumulator(q)
    acc = acc_lse = None
    # the sink, once a row: into the first call over rows none of which has it yet (its kernel
    # folds it in before its one rounding: the whole result of a row that no other call sees),
    # into the float32 sum at the end for the rest
    unfolded = None if sink is None else np.ones(q.shape[-3], dtype=bool)
    kv = [k, v]
    for step in range(ring.world):
        pending = ring.send_recv(kv) if step < ring.world - 1 else None
        for block in plans[(ring.rank - step) % ring.world]:
            takes = unfolded is not None and all(unfolded[lo:hi].all() for lo, hi in block.q_pieces)
            if takes:
                for lo, hi in block.q_pieces:
                    unfolded[lo:hi] = False
            out, lse = block.forward(attn, q, kv[0], kv[1], scale, softcap, sink if takes else None)
            if acc is None and block.covers(q.shape[-3], k.shape[-3])[0]:
                acc, acc_lse = out, lse  # a first partial over every row is the running result
                continue
            if acc is None:
                acc = torch.zeros((*q.shape[:-1], v.shape[-1]), dtype=wide, device=q.device)
                acc_lse = torch.full(lse_shape, float("-inf"), dtype=wide, device=q.device)
            elif acc.dtype != wide:
                acc, acc_lse = acc.to(wide), acc_lse.to(wide)
            block.merge(acc, acc_lse, out, lse)
        if pending is not None:
            kv = pending.wait()
    if acc is None:  # no local rows
        empty_lse = torch.full(lse_shape, float("-inf"), device=q.device)
        return q.new_zeros((*q.shape[:-1], v.shape[-1])), empty_lse
    if unfolded is not None and unfolded.any():  # into the float32 sum, before the one rounding
        rows = None if unfolded.all() else torch.from_numpy(np.flatnonzero(unfolded)).to(q.device)
        acc, acc_lse = fold_sink_rows(acc.to(wide), acc_lse.to(wide), sink, rows)
    return acc.to(q.dtype), acc_lse


def _add(acc, g, covers: bool, add, like: Tensor):
    """``acc`` plus a block's gradient ``g`` (float32 or wider); the first block over every row
    starts the sum without a zero fill."""
    if acc is None:
        if covers:
            return g.to(_accumulator(like))
        acc = torch.zeros(like.shape, dtype=_accumulator(like), device=like.device)
    add(acc, g)
    return acc


def _ring_backward(ring: Ring, attn, plans, dout, q, k, v, out, lse, scale, softcap):
    rows_q, rows_k = q.shape[-3], k.shape[-3]
    dq = None
    kv = [k, v]
    dkv = None
    pending_dkv = None
    for step in range(ring.world):
        pending_kv = ring.send_recv(kv) if step < ring.world - 1 else None
        dk_step = dv_step = None
        for block in plans[(ring.rank - step) % ring.world]:
            gq, gk, gv = block.backward(attn, dout, q, kv[0], kv[1], out, lse, scale, softcap)
            all_q, all_k = block.covers(rows_q, rows_k)
            dq = _add(dq, gq, all_q, block.add_q, q)
            dk_step = _add(dk_step, gk, all_k, block.add_k, k)
            dv_step = _add(dv_step, gv, all_k, block.add_k, v)
        if dk_step is None:  # no query here sees this block
            dk_step = torch.zeros(k.shape, dtype=_accumulator(k), device=k.device)
            dv_step = torch.zeros(v.shape, dtype=_accumulator(v), device=v.device)
        if pending_dkv is None:
            dkv = [dk_step, dv_step]
        else:
            dkv = pending_dkv.wait()
            dkv[0] += dk_step
            dkv[1] += dv_step
        if ring.world > 1:
            # this block's gradients go on to the rank that holds it next; after the last step
            # that is its owner
            pending_dkv = ring.send_recv(dkv)
        if pending_kv is not None:
            kv = pending_kv.wait()
    if pending_dkv is not None:
        dkv = pending_dkv.wait()
    if dq is None:
        dq = torch.zeros_like(q)
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sink, ring, attn, plans, scale, softcap, lse_shape):
        out, lse = _ring_forward(ring, attn, plans, q, k, v, scale, softcap, lse_shape, sink)
        ctx.save_for_backward(q, k, v, out, lse, *(() if sink is None else (sink,)))
        ctx.ring, ctx.attn, ctx.plans, ctx.scale, ctx.softcap = ring, attn, plans, scale, softcap
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        saved = ctx.saved_tensors
        q, k, v, out, lse = saved[:5]
        dout = dout.contiguous()
        dq, dk, dv = _ring_backward(ctx.ring, ctx.attn, ctx.plans, dout, q, k, v, out, lse, ctx.scale,
                                    ctx.softcap)
        # the sink's gradient over this rank's rows (summed over the ranks as the weights' are)
        d_sink = sink_grad(dout, out, lse, saved[5]) if len(saved) > 5 and ctx.needs_input_grad[3] else None
        return dq, dk, dv, d_sink, None, None, None, None, None, None


def _scale(q: Tensor, softmax_scale: float | None) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(q.shape[-1])
    softmax_scale = float(softmax_scale)
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale!r}")
    return softmax_scale


def _check_common(q, k, v, dims: int, window_size, softcap, attn):
    from ..operands import check_window_size

    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != dims:
            raise ValueError(f"{name} must have {dims} dimensions, got shape {tuple(x.shape)}")
        if x.device != q.device:
            raise ValueError(f"q, k and v must be on one device, got {q.device} and {x.device} ({name})")
    window = check_window_size(window_size)
    if (
        isinstance(softcap, bool)
        or not isinstance(softcap, (int, float))
        or not (softcap >= 0 and math.isfinite(softcap))
    ):
        raise ValueError(f"softcap must be 0 (off) or a positive finite number, got {softcap!r}")
    attn.check(q, k, v)
    return window


@torch.compiler.disable  # under torch.compile: a graph break, the ring runs eagerly
def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group=None,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    layout: str = "zigzag",
    return_lse: bool = False,
    learnable_sink: Tensor | None = None,
    _attention=None,
):
    """Attention over a sequence sharded across the ranks of ``group``, with autograd.

    Each rank passes its shard (``shard(x, layout, group)`` cuts one): the tokens of the gathered
    sequence that ``layout`` gives it (``layout.segments``), in that order. The result is this
    rank's rows of ``flash_attention`` on the gathered q, k and v, and the backward gives this
    rank's rows of its gradients.

    Args:
        q: (batch, seqlen_local, heads_q, head_dim), float16 or bfloat16, a CUDA tensor.
        k, v: (batch, seqlen_local, heads_kv, head_dim), q's dtype; heads_q a multiple of
            heads_kv (GQA). The same shard of the sequence as q (self-attention).
        group: the torch.distributed process group (None: the default one). NCCL moves CUDA
            tensors directly; other backends stage them through host memory.
        causal, softmax_scale, window_size, softcap: as ``flash_attention``'s, on the gathered
            sequence (seqlen_q = seqlen_k, so bottom-right and top-left alignment agree).
        layout: "zigzag" (rank r holds chunks r and 2N-1-r of 2N: the causal load balance),
            "contiguous" (chunk r of N) or "stripe" (tokens r, r+N, ...).
        return_lse: also return this rank's float32 LSE rows, (batch, heads_q, seqlen_local).
        learnable_sink: float32 (heads_q,), one logit a head in every row's softmax with no value
            (gpt-oss; ``flash_attention``'s). Its gradient is this rank's rows' share: sum it over
            the ranks as the weights' gradients are.

    Returns:
        out (batch, seqlen_local, heads_q, head_dim) in q's dtype; with ``return_lse``, (out,
        lse). The LSE carries no gradient.

    Raises:
        RuntimeError: torch.distributed not initialised.
        TypeError, ValueError: bad input (a sequence length the layout cannot split, k or v not
            sharded like q, the single-GPU call's own checks), before any transfer.
    """
    attn = LocalAttention() if _attention is None else _attention
    window = _check_common(q, k, v, 4, window_size, softcap, attn)
    _check_sink(learnable_sink, q)
    if k.shape[1] != q.shape[1] or v.shape[1] != q.shape[1]:
        raise ValueError(
            "ring_attention shards q, k and v alike: their seqlen_local must agree, got "
            f"{q.shape[1]}, {k.shape[1]} and {v.shape[1]}"
        )
    scale = _scale(q, softmax_scale)
    ring = Ring(group)
    plans = dense_blocks(layout, q.shape[1] * ring.world, ring.world, ring.rank, bool(causal), window)
    lse_shape = (q.shape[0], q.shape[2], q.shape[1])
    out, lse = _RingAttention.apply(q, k, v, learnable_sink, ring, attn, plans, scale, float(softcap),
                                    lse_shape)
    return (out, lse) if return_lse else out


@torch.compiler.disable  # under torch.compile: a graph break, the ring runs eagerly
def ring_attention_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor | list[int],
    *,
    group=None,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    layout: str = "zigzag",
    return_lse: bool = False,
    learnable_sink: Tensor | None = None,
    _attention=None,
):
    """``ring_attention`` on packed sequences: each sequence of the pack is sharded by ``layout``
    on its own (``shard_varlen``), and each rank passes its rows of every sequence, packed in
    sequence order.

    Args:
        q: (total_local, heads_q, head_dim); k, v: (total_local, heads_kv, head_dim).
        cu_seqlens: the *gathered* pack's cumulative sequence lengths, (num_seqs + 1,) ints
            starting at 0 (a host list or tensor; read on the host once a call). Each length a
            multiple of 2N (zigzag) or N.
        Others as ``ring_attention``'s; the LSE is (heads_q, total_local).
    """
    attn = LocalAttention() if _attention is None else _attention
    window = _check_common(q, k, v, 3, window_size, softcap, attn)
    _check_sink(learnable_sink, q)
    ring = Ring(group)
    seqlens = _seqlens(cu_seqlens)
    total = sum(s // ring.world for s in seqlens)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.shape[0] != total:
            raise ValueError(
                f"{name} must hold this rank's {total} rows of the pack (sum of seqlen / {ring.world}), "
                f"got {x.shape[0]}"
            )
    scale = _scale(q, softmax_scale)
    plans = packed_blocks(layout, seqlens, ring.world, ring.rank, bool(causal), window, q.device)
    lse_shape = (q.shape[1], q.shape[0])
    out, lse = _RingAttention.apply(q, k, v, learnable_sink, ring, attn, plans, scale, float(softcap),
                                    lse_shape)
    return (out, lse) if return_lse else out


def _check_sink(sink, q: Tensor) -> None:
    if sink is None:
        return
    heads = q.shape[-2]
    if not isinstance(sink, Tensor) or sink.dtype != torch.float32 or tuple(sink.shape) != (heads,):
        got = f"{tuple(sink.shape)} {sink.dtype}" if isinstance(sink, Tensor) else type(sink).__name__
        raise ValueError(f"learnable_sink must be a float32 tensor of shape ({heads},) (heads_q), got {got}")
    if sink.device != q.device:
        raise ValueError(f"learnable_sink must be on q's device {q.device}, got {sink.device}")


def _seqlens(cu_seqlens) -> list[int]:
    cu = [int(x) for x in (cu_seqlens.tolist() if isinstance(cu_seqlens, Tensor) else cu_seqlens)]
    if len(cu) < 2 or cu[0] != 0 or any(b < a for a, b in pairwise(cu)):
        raise ValueError(f"cu_seqlens must be non-decreasing from 0 with at least 2 entries, got {cu}")
    return [b - a for a, b in pairwise(cu)]
