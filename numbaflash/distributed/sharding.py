"""Cutting a sequence into the layout's shards and putting it back together."""

from __future__ import annotations

from itertools import pairwise

import torch
from torch import Tensor

from .comm import all_gather, resolve_group
from .layout import positions


def shard(x: Tensor, layout: str, world: int, rank: int, dim: int = 1) -> Tensor:
    """Rank ``rank``'s shard of ``x`` along ``dim`` (the sequence: 1 for (batch, seqlen, heads,
    d)), a new contiguous tensor."""
    index = torch.tensor(positions(layout, x.shape[dim], world, rank), dtype=torch.int64, device=x.device)
    return x.index_select(dim, index)


def unshard_parts(parts: list[Tensor], layout: str, dim: int = 1) -> Tensor:
    """The gathered sequence from every rank's shard (in rank order)."""
    world = len(parts)
    seqlen = sum(p.shape[dim] for p in parts)
    order = [p for r in range(world) for p in positions(layout, seqlen, world, r)]
    inverse = torch.empty(seqlen, dtype=torch.int64)
    inverse[torch.tensor(order)] = torch.arange(seqlen)
    return torch.cat(parts, dim).index_select(dim, inverse.to(parts[0].device))


def unshard(x: Tensor, layout: str, group=None, dim: int = 1) -> Tensor:
    """The gathered sequence on every rank of ``group`` (an all-gather; no autograd)."""
    return unshard_parts(all_gather(x, resolve_group(group)), layout, dim)


def varlen_rows(cu_seqlens: list[int], layout: str, world: int, rank: int) -> list[int]:
    """The rows of the gathered pack that rank ``rank`` holds, in its local order."""
    index = []
    for a, b in pairwise(cu_seqlens):
        if b > a:
            index += [a + p for p in positions(layout, b - a, world, rank)]
    return index


def shard_varlen(x: Tensor, cu_seqlens: list[int] | Tensor, layout: str, world: int, rank: int) -> Tensor:
    """Rank ``rank``'s rows of a pack (total, ...): each sequence sharded by ``layout`` on its own,
    packed in sequence order (what ``ring_attention_varlen`` takes)."""
    cu = [int(c) for c in (cu_seqlens.tolist() if isinstance(cu_seqlens, Tensor) else cu_seqlens)]
    index = torch.tensor(varlen_rows(cu, layout, world, rank), dtype=torch.int64, device=x.device)
    return x.index_select(0, index)


def unshard_varlen_parts(parts: list[Tensor], cu_seqlens: list[int] | Tensor, layout: str) -> Tensor:
    """The gathered pack from every rank's rows (in rank order)."""
    cu = [int(c) for c in (cu_seqlens.tolist() if isinstance(cu_seqlens, Tensor) else cu_seqlens)]
    world = len(parts)
    order = [i for r in range(world) for i in varlen_rows(cu, layout, world, r)]
    inverse = torch.empty(len(order), dtype=torch.int64)
    inverse[torch.tensor(order)] = torch.arange(len(order))
    return torch.cat(parts, 0).index_select(0, inverse.to(parts[0].device))
