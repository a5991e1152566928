"""All-to-all (DeepSpeed Ulysses) context parallelism: trade the sequence shard for a head shard,
run the single-GPU attention on the whole sequence for heads/N heads, trade back.

Two all-to-alls of q, k, v and one of out forward; one of dout and three of the gradients back.
Needs heads_q divisible by the group's size, and heads_kv divisible by it or dividing it.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.distributed as dist
from torch import Tensor

from .blocks import LocalAttention, sink_grad
from .comm import all_to_all, resolve_group
from .layout import segments
from .ring import _check_common, _check_sink, _scale
from .sharding import permutation, shard_rows


@lru_cache(maxsize=64)
def _order(layout: str, seqlen: int, world: int, device) -> tuple[Tensor | None, Tensor | None]:
    """(order, inverse) on ``device`` (``sharding.permutation``, once a layout and length); None
    for the contiguous layout (already in order)."""
    if layout == "contiguous":
        segments(layout, seqlen, world, 0)  # the layout's own checks
        return None, None
    order, inverse = permutation(lambda r: shard_rows(layout, seqlen, world, r), world)
    return torch.from_numpy(order).to(device), torch.from_numpy(inverse).to(device)


def _to_heads(x: Tensor, group, world: int, inverse: Tensor | None) -> Tensor:
    """(batch, s_local, heads, d) sequence shard -> (batch, seqlen, heads / N, d) head shard in
    global order."""
    b, s, h, d = x.shape
    pieces = x.reshape(b, s, world, h // world, d).permute(2, 0, 1, 3, 4)
    got = all_to_all(pieces, group)  # piece i: rank i's rows of my heads
    full = got.permute(1, 0, 2, 3, 4).reshape(b, world * s, h // world, d)
    return full if inverse is None else full.index_select(1, inverse)


def _to_sequence(x: Tensor, group, world: int, order: Tensor | None) -> Tensor:
    """The inverse of ``_to_heads``."""
    b, S, hp, d = x.shape
    if order is not None:
        x = x.index_select(1, order)
    pieces = x.reshape(b, world, S // world, hp, d).permute(1, 0, 2, 3, 4)
    got = all_to_all(pieces, group)  # piece i: my rows of rank i's heads
    return got.permute(1, 2, 0, 3, 4).reshape(b, S // world, world * hp, d)


def _lse_to_sequence(lse: Tensor, group, world: int, order: Tensor | None) -> Tensor:
    b, hp, S = lse.shape
    if order is not None:
        lse = lse.index_select(2, order)
    pieces = lse.reshape(b, hp, world, S // world).permute(2, 0, 1, 3)
    got = all_to_all(pieces, group)
    return got.permute(1, 0, 2, 3).reshape(b, world * hp, S // world)


def _spread_kv_heads(q: Tensor, k: Tensor, v: Tensor, world: int, name: str,
                     dim: int) -> tuple[Tensor, Tensor]:
    """k and v with heads a multiple of ``world``: as they are, or each KV head repeated where the
    ranks outnumber them (autograd sums the copies' gradients back), so that every rank's query
    heads find theirs. heads_q must be a multiple of ``world``."""
    heads_q, heads_kv = q.shape[dim], k.shape[dim]
    if heads_q % world == 0 and heads_kv % world == 0:
        return k, v
    if heads_q % world == 0 and world % heads_kv == 0:
        copies = world // heads_kv
        return k.repeat_interleave(copies, dim=dim), v.repeat_interleave(copies, dim=dim)
    raise ValueError(f"{name} needs heads_q divisible by the group's size {world}, and heads_kv divisible "
                     f"by it or dividing it; got {heads_q} and {heads_kv} (the ring has no such limit)")


class _Ulysses(torch.autograd.Function):
    """Dense inputs (batch, s_local, heads, d), or a pack as a batch of one (``packed``: the varlen
    call's (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) of the gathered pack)."""

    @staticmethod
    def forward(ctx, q, k, v, sink, group, world, attn, causal, scale, window, softcap, order, inverse,
                packed):
        qg, kg, vg = (_to_heads(x, group, world, inverse) for x in (q, k, v))
        heads, mine = slice(None), None
        if sink is not None:  # this rank's heads of it, folded in by the kernel
            per = sink.shape[0] // world
            heads = slice(dist.get_rank(group) * per, (dist.get_rank(group) + 1) * per)
            mine = sink[heads].contiguous()
        if packed is None:
            out_g, lse_g = attn.forward(qg, kg, vg, causal, scale, window, softcap, mine)
        else:
            out_g, lse_g = attn.varlen_forward(qg[0], kg[0], vg[0], *packed, causal, scale, window, softcap,
                                               mine)
            out_g, lse_g = out_g[None], lse_g[None]
        ctx.save_for_backward(qg, kg, vg, out_g, lse_g, *(() if sink is None else (sink,)))
        ctx.args = (group, world, attn, causal, scale, window, softcap, order, inverse, heads, packed)
        lse = _lse_to_sequence(lse_g, group, world, order)
        ctx.mark_non_differentiable(lse)
        return _to_sequence(out_g, group, world, order), lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        saved = ctx.saved_tensors
        qg, kg, vg, out_g, lse_g = saved[:5]
        group, world, attn, causal, scale, window, softcap, order, inverse, heads, packed = ctx.args
        dout_g = _to_heads(dout.contiguous(), group, world, inverse).contiguous()
        if packed is None:
            dq, dk, dv = attn.backward(dout_g, qg, kg, vg, out_g, lse_g, causal, scale, window, softcap)
        else:
            grads = attn.varlen_backward(dout_g[0], qg[0], kg[0], vg[0], out_g[0], lse_g[0], *packed, causal,
                                         scale, window, softcap)
            dq, dk, dv = (g[None] for g in grads)
        grads = [_to_sequence(g, group, world, order) for g in (dq, dk, dv)]
        d_sink = None
        if len(saved) > 5 and ctx.needs_input_grad[3]:
            # this rank's heads over every row, zero elsewhere: the sum over the ranks is the whole
            d_sink = torch.zeros_like(saved[5])
            d_sink[heads] = sink_grad(dout_g, out_g, lse_g, saved[5][heads])
        return (*grads, d_sink, None, None, None, None, None, None, None, None, None, None)


@torch.compiler.disable  # under torch.compile: a graph break, the ring runs eagerly
def ulysses_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group=None,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    layout: str = "contiguous",
    return_lse: bool = False,
    learnable_sink: Tensor | None = None,
    _attention=None,
):
    """``ring_attention``'s contract (same shards, same result) by all-to-all over heads.

    heads_q must be a multiple of the group's size N, and heads_kv a multiple or a divisor of it (each
    KV head is then repeated to N, its gradients summed back). Each rank then attends over the
    whole gathered sequence for heads/N query heads: the single-GPU kernel at full length (one
    call, no merge), at the price of moving q, k, v and out (and their gradients) once each.
    The contiguous layout needs no reordering; zigzag and stripe are put in order around the call.
    A ``learnable_sink``'s gradient on each rank holds its heads' share (zero at the others): sum
    it over the ranks as the weights' gradients are.
    """
    attn = LocalAttention() if _attention is None else _attention
    window = _check_common(q, k, v, 4, window_size, softcap, attn)
    _check_sink(learnable_sink, q)
    group = resolve_group(group)
    world = torch.distributed.get_world_size(group)
    if k.shape[1] != q.shape[1] or v.shape[1] != q.shape[1]:
        raise ValueError(
            "ulysses_attention shards q, k and v alike: their seqlen_local must agree, got "
            f"{q.shape[1]}, {k.shape[1]} and {v.shape[1]}"
        )
    k, v = _spread_kv_heads(q, k, v, world, "ulysses_attention", 2)
    order, inverse = _order(layout, q.shape[1] * world, world, q.device)
    out, lse = _Ulysses.apply(
        q,
        k,
        v,
        learnable_sink,
        group,
        world,
        attn,
        bool(causal),
        _scale(q, softmax_scale),
        window,
        float(softcap),
        order,
        inverse,
        None,
    )
    return (out, lse) if return_lse else out


@torch.compiler.disable  # under torch.compile: a graph break, the all-to-alls run eagerly
def ulysses_attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor | list[int], *, group=None,
                             causal: bool = False, softmax_scale: float | None = None,
                             window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                             layout: str = "zigzag", return_lse: bool = False,
                             learnable_sink: Tensor | None = None, _attention=None):
    """``ring_attention_varlen``'s contract (each sequence of the pack sharded by ``layout`` on its
    own; q (total_local, heads_q, d), k and v (total_local, heads_kv, d); ``cu_seqlens`` the
    gathered pack's) by all-to-all over heads: one varlen call over the whole pack for heads/N
    heads. Head counts as ``ulysses_attention``'s; the LSE is (heads_q, total_local)."""
    from .ring import _seqlens
    from .sharding import varlen_rows

    attn = LocalAttention() if _attention is None else _attention
    window = _check_common(q, k, v, 3, window_size, softcap, attn)
    _check_sink(learnable_sink, q)
    group = resolve_group(group)
    world = torch.distributed.get_world_size(group)
    seqlens = _seqlens(cu_seqlens)
    cu = [0]
    for n in seqlens:
        cu.append(cu[-1] + n)
    total = cu[-1] // world
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.shape[0] != total:
            raise ValueError(f"{name} must hold this rank's {total} rows of the pack, got {x.shape[0]}")
    k, v = _spread_kv_heads(q, k, v, world, "ulysses_attention_varlen", 1)
    order, inverse = (torch.from_numpy(x).to(q.device)
                      for x in permutation(lambda r: varlen_rows(cu, layout, world, r), world))
    cu_t = torch.tensor(cu, dtype=torch.int32, device=q.device)
    packed = (cu_t, cu_t, max(seqlens), max(seqlens))
    out, lse = _Ulysses.apply(q[None], k[None], v[None], learnable_sink, group, world, attn, bool(causal),
                              _scale(q, softmax_scale), window, float(softcap), order, inverse,
                              packed)
    return (out[0], lse[0]) if return_lse else out[0]
