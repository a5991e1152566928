"""Cutting a sequence into the layout's shards and putting it back together."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import torch
from torch import Tensor

from .comm import all_gather, resolve_group
from .layout import segments


def shard_rows(layout: str, seqlen: int, world: int, rank: int, offset: int = 0) -> np.ndarray:
    """``positions`` as an int64 array (plus ``offset``), built a segment at a time."""
    return np.concatenate([np.arange(g.start, g.start + g.stride * g.length, g.stride, dtype=np.int64)
                           for g in segments(layout, seqlen, world, rank)]) + offset


def varlen_rows(cu_seqlens: list[int], layout: str, world: int, rank: int) -> np.ndarray:
    """The rows of the gathered pack that rank ``rank`` holds, in its local order (int64)."""
    parts = [shard_rows(layout, b - a, world, rank, a) for a, b in pairwise(cu_seqlens) if b > a]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def permutation(rows_of_rank, world: int) -> tuple[np.ndarray, np.ndarray]:
    """(order, inverse) of the rank-ordered concatenation of shards: ``order[i]`` is the gathered
    row of its row i (``rows_of_rank(r)`` gives rank r's), ``inverse`` puts it back in order."""
    order = np.concatenate([rows_of_rank(r) for r in range(world)])
    inverse = np.empty_like(order)
    inverse[order] = np.arange(len(order))
    return order, inverse


def _cu(cu_seqlens) -> list[int]:
    return [int(c) for c in (cu_seqlens.tolist() if isinstance(cu_seqlens, Tensor) else cu_seqlens)]


def shard(x: Tensor, layout: str, world: int, rank: int, dim: int = 1) -> Tensor:
    """Rank ``rank``'s shard of ``x`` along ``dim`` (the sequence: 1 for (batch, seqlen, heads,
    d)), a new contiguous tensor."""
    return x.index_select(dim, torch.from_numpy(shard_rows(layout, x.shape[dim], world, rank)).to(x.device))


def unshard_parts(parts: list[Tensor], layout: str, dim: int = 1) -> Tensor:
    """The gathered sequence from every rank's shard (in rank order)."""
    world = len(parts)
    seqlen = sum(p.shape[dim] for p in parts)
    _, inverse = permutation(lambda r: shard_rows(layout, seqlen, world, r), world)
    return torch.cat(parts, dim).index_select(dim, torch.from_numpy(inverse).to(parts[0].device))


def unshard(x: Tensor, layout: str, group=None, dim: int = 1) -> Tensor:
    """The gathered sequence on every rank of ``group`` (an all-gather; no autograd)."""
    return unshard_parts(all_gather(x, resolve_group(group)), layout, dim)


def shard_varlen(x: Tensor, cu_seqlens: list[int] | Tensor, layout: str, world: int, rank: int) -> Tensor:
    """Rank ``rank``'s rows of a pack (total, ...): each sequence sharded by ``layout`` on its own,
    packed in sequence order (what ``ring_attention_varlen`` takes)."""
    index = torch.from_numpy(varlen_rows(_cu(cu_seqlens), layout, world, rank))
    return x.index_select(0, index.to(x.device))


def unshard_varlen_parts(parts: list[Tensor], cu_seqlens: list[int] | Tensor, layout: str) -> Tensor:
    """The gathered pack from every rank's rows (in rank order)."""
    cu, world = _cu(cu_seqlens), len(parts)
    _, inverse = permutation(lambda r: varlen_rows(cu, layout, world, r), world)
    return torch.cat(parts, 0).index_select(0, torch.from_numpy(inverse).to(parts[0].device))
