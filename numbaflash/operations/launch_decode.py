"""The decode kernels' launches (WORK IN PROGRESS, branch wip/decode): from a ``DecodeCall`` to
the parameter lists of ``kernels.abi.DECODE_ABI`` and ``DECODE_COMBINE_ABI``, and the choice of
the split count from the shapes alone (``decode_splits``).

1. decode (``flash_decode``): grid (num_splits, row_blocks * heads_kv, batch), ``config.threads``,
   ``config.shared_bytes``. Row block rb of KV head h takes packed query rows rb * rows ..: the
   query heads of h times seqlen_q.
2. with num_splits > 1, combine (``decode_combine``): grid ceil(batch * heads_q * seqlen_q / 4),
   128 threads, one warp a row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

if TYPE_CHECKING:
    from ..operands import Operand

MAX_SPLITS = 32  # a fixed ceiling, so that a captured graph's scratch never grows (vLLM's cap)
MIN_TILES_PER_SPLIT = 4  # keys a split reads at the least, in tiles: below, the merge costs more


def decode_splits(batch: int, heads_kv: int, row_blocks: int, max_keys: int, block_n: int, sm_count: int,
                  ctas_per_sm: int = 1) -> int:
    """How many CTAs share the keys of one (batch, KV head, row block), from the shapes only
    (never from ``cache_seqlens``' values: a captured graph stays right when they change).

    Enough splits for the launch to fill every CTA slot of the GPU once (``sm_count *
    ctas_per_sm``), at most ``MAX_SPLITS``, and no more than leaves each split
    ``MIN_TILES_PER_SPLIT`` tiles of ``block_n`` of the longest possible sequence (``max_keys``:
    the cache's capacity plus the new rows)."""
    ctas = batch * heads_kv * row_blocks
    slots = sm_count * ctas_per_sm
    if ctas >= slots:
        return 1
    tiles = -(-max_keys // block_n)
    by_keys = max(1, tiles // MIN_TILES_PER_SPLIT)
    return max(1, min(MAX_SPLITS, -(-slots // ctas), by_keys))


class DecodeCall(NamedTuple):
    """One decode call's operands (pointers and strides in elements) and scalars."""

    q: Operand
    k_cache: Operand
    v_cache: Operand
    k_new: Operand | None
    v_new: Operand | None
    cache_seqlens: tuple[int, int]  # (pointer, elements) int32
    block_table: tuple[int, int] | None  # (pointer, elements) int32, or None (not paged)
    block_table_stride: int
    pages: int  # pages a sequence (paged), else 0
    capacity: int  # rows a sequence (paged: page size)
    out: Operand
    lse: tuple[int, int]  # (pointer, elements) float32, or the scratch scalar
    o_part: tuple[int, int]
    lse_part: tuple[int, int]
    num_splits: int
    row_blocks: int
    scale_log2: np.float32
    write_lse: bool
    stream: int
    scratch: int  # a device scalar: what a dummy array argument points at


Launch = Callable[[Any, DecodeCall, Any], None]


def _array(op: Operand | None, scratch: int) -> tuple[int, int]:
    return (op.pointer, 1) if op is not None else (scratch, 1)


def _strides(op: Operand | None) -> tuple[int, int, int]:
    return tuple(op.strides[:3]) if op is not None else (0, 0, 0)


def launch_decode(config) -> Launch:
    threads, shared_bytes = config.threads, config.shared_bytes

    def launch(launcher, call: DecodeCall, gpu: Any) -> None:
        q = call.q
        batch, seqlen_q, heads_q, _ = q.shape
        heads_kv = call.k_cache.shape[2]
        seqlen_new = call.k_new.shape[1] if call.k_new is not None else 0
        grid = (call.num_splits, call.row_blocks * heads_kv, batch)
        launcher(grid, threads, call.stream, shared_bytes,
                 (q.pointer, 1), (call.k_cache.pointer, 1), (call.v_cache.pointer, 1),
                 _array(call.k_new, call.scratch), _array(call.v_new, call.scratch),
                 call.cache_seqlens, call.block_table or (call.scratch, 1),
                 (call.out.pointer, 1), call.lse, call.o_part, call.lse_part,
                 *q.strides[:3], *call.k_cache.strides[:3], *call.v_cache.strides[:3],
                 *_strides(call.k_new), *_strides(call.v_new), *call.out.strides[:3],
                 seqlen_q, seqlen_new, call.capacity, call.block_table_stride, call.pages,
                 heads_kv, heads_q // heads_kv, call.row_blocks, call.num_splits, call.scale_log2,
                 call.write_lse and call.num_splits == 1)

    return launch


def launch_decode_combine(config) -> Launch:
    def launch(launcher, call: DecodeCall, gpu: Any) -> None:
        if call.num_splits == 1:
            return
        batch, seqlen_q, heads_q, _ = call.q.shape
        rows = batch * heads_q * seqlen_q
        launcher((-(-rows // 4), 1, 1), 128, call.stream, 0,
                 call.o_part, call.lse_part, (call.out.pointer, 1), call.lse, *call.out.strides[:3],
                 batch, seqlen_q, heads_q, call.num_splits, call.write_lse)

    return launch
