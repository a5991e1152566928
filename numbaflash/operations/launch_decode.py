"""The decode kernels' launches: from a ``DecodeCall`` to the parameter lists of
``kernels.abi.DECODE_ABI`` and ``DECODE_COMBINE_ABI``, and the choice of the split count from the
shapes alone (``decode_splits``).

1. decode (``flash_decode``): grid (num_splits, row_blocks * heads_kv, batch), ``config.threads``,
   ``config.shared_bytes`` or more (``occupancy_shared``: no more CTAs a SM than stream best).
   Row block rb of KV head h takes packed query rows rb * rows ..: the query heads of h times
   seqlen_q. Its window and softcap variants (``DECODE_VARIANT_ABI``):
   the same launch, the window's sides and the softcap's factor after the plain parameters. A
   learnable sink's build takes the sink's logits after those (``params.SINK``), then the builds of
   ``cache_batch_idx`` and ``cache_leftpad`` their arrays, and a rotary build its tables and sizes
   (``params.decode_params``; the fire's last pointers, in that order).
2. with num_splits > 1, combine (``decode_combine``): grid ceil(batch * heads_q * seqlen_q *
   head_dim / 128), 128 threads, one warp per 32 columns of a row.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from ..kernels import params
from ..kernels.params import ordered

if TYPE_CHECKING:
    from ..operands import Operand

MAX_SPLITS = 32  # a fixed ceiling, so that a captured graph's scratch never grows (vLLM's cap)
# Rows of head_dim float32 the split scratch holds past the partials and their LSEs: a combine
# warp loads all SPLITS_PER_WARP (32) splits of its row at constant offsets, past its last split
# too, and drops those values (``kernels.decode_mma.make_decode_combine_kernel``).
SCRATCH_TAIL_ROWS = 32
MIN_TILES_PER_SPLIT = 4  # keys a split reads at the least, in tiles: below, the merge costs more
# K and V bytes on the way that keep one SM's share of the HBM busy (``streaming_ctas``), measured
# on an H100 SXM, whose SMs each get REFERENCE_SM_BANDWIDTH bytes a second of its HBM's peak.
STREAM_BYTES_PER_SM = 64 * 1024
REFERENCE_SM_BANDWIDTH = 3.35e12 / 132


def resident_ctas(threads: int, registers: int, shared_bytes: int, shared_limit: int,
                  sm_registers: int = 65536, sm_threads: int = 2048, max_ctas: int = 32) -> int:
    """CTAs of a kernel one SM holds at once: the least of what its threads, its registers
    (``registers`` a thread, allocated 256 a warp) and its shared memory allow (``shared_limit``:
    the most one CTA may take, the SM's total less the 1 KB the GPU keeps for each CTA)."""
    by_threads = sm_threads // threads
    per_warp = -(-registers * 32 // 256) * 256
    by_registers = (sm_registers // per_warp) // max(1, threads // 32)
    by_shared = (shared_limit + 1024) // (shared_bytes + 1024)
    return max(1, min(by_threads, by_registers, by_shared, max_ctas))


def split_scratch_elements(parts: int, head_dim: int) -> int:
    """Float32 elements of a split call's scratch for ``parts`` partial rows (rows x splits, 0
    with one split): the partials, their LSEs, then ``SCRATCH_TAIL_ROWS`` rows the combine kernel
    may read past the last row's last split."""
    return parts * (head_dim + 1) + SCRATCH_TAIL_ROWS * head_dim if parts else 0


def occupancy_shared(shared_bytes: int, ctas: int, shared_limit: int) -> int:
    """The dynamic shared memory a launch asks for so that an SM holds at most ``ctas`` of its
    CTAs (``shared_limit``: the most one CTA may take, the SM's total less the 1 KB kept a CTA):
    the SM's share a CTA, never less than the kernel's own ``shared_bytes``. For a kernel an SM
    would hold more of than ``streaming_ctas``, which contend for the HBM (H100: at d64, 128 x
    2048 keys, 3 a SM 0.974-0.977 of cuDNN, 2 a SM 1.007-1.023; docs/PERFORMANCE.md)."""
    return max(shared_bytes, min(shared_limit, (shared_limit + 1024) // ctas - 1024))


def streaming_ctas(bytes_in_flight: int, resident: int, sm_bandwidth: float = 0.0) -> int:
    """Decode CTAs an SM should run at once: as many as keep ``STREAM_BYTES_PER_SM`` of K and V
    on the way (``DecodeConfig.bytes_in_flight`` a CTA), at most the ``resident`` it holds; on a
    GPU whose HBM serves each SM faster than the H100's (``sm_bandwidth``: bytes a second an SM,
    the device's peak over its SMs), at least the nearest count to that many bytes scaled by the
    ratio (Little's law at the same latency).

    Measured on an H100 (docs/PERFORMANCE.md; CUDA graphs, forced split counts): at d128 (64-key
    tiles, a ring of 3: 64 KB in flight a CTA) one CTA a SM streams 2-3% faster than two (8 x
    8192 keys: 2 splits 2799-2862 GB/s, 4 splits 2734-2798; 1 x 131072: 16 splits against 32,
    +2%), at d64 (32 KB a CTA) two a SM are 2-4% faster than one or three. On an H200 (1.47x the
    H100's bandwidth a SM: 94 KB) d64 takes three (128 x 2048 keys +2%, paged +2.5%) and d128's
    ring of 3 still one (two: 2-4% slower at 8 x 8192 and 1 x 131072; docs/PERFORMANCE.md [SB])."""
    ctas = -(-STREAM_BYTES_PER_SM // bytes_in_flight)
    scale = sm_bandwidth / REFERENCE_SM_BANDWIDTH
    if scale > 1.0:
        ctas = max(ctas, int(STREAM_BYTES_PER_SM * scale / bytes_in_flight + 0.5))
    return max(1, min(resident, ctas))


def decode_splits(batch: int, heads_kv: int, row_blocks: int, max_keys: int, block_n: int, sm_count: int,
                  ctas_per_sm: int = 1) -> int:
    """How many CTAs share the keys of one (batch, KV head, row block), from the shapes only
    (never from ``cache_seqlens``' values: a captured graph stays right when they change).

    Every CTA streams about as many keys, so a launch of n CTAs over s = ``sm_count *
    ctas_per_sm`` slots (``streaming_ctas`` a SM) takes ceil(n / s) waves and keeps the HBM busy
    for the fraction (n / s) / ceil(n / s) of them. The split counts allowed: at most
    ``MAX_SPLITS``, each split at least ``MIN_TILES_PER_SPLIT`` tiles of ``block_n`` of the
    longest sequence (``max_keys``), each count changing the tiles a split reads. One split where
    the (batch, KV head, row block) CTAs fill 80% of the slots or give every SM one (H100: d128
    grids of 136-192 CTAs on 132 SMs, two a SM, 0.98-1.04 of cuDNN unsplit, 0.91-0.99 split to
    fill the slots); the most allowed where even those leave slots empty; else the fewest whose
    waves are within 95% of the best (FlashAttention-2 takes 85%; at 1 x 8192 keys, d128, that
    would be 14 splits on 112 of 132 SMs, where 95% takes the 16 measured best of 8, 16
    and 32; docs/PERFORMANCE.md)."""
    ctas = batch * heads_kv * row_blocks
    slots = sm_count * ctas_per_sm
    if ctas >= min(0.8 * slots, sm_count):
        return 1
    tiles = -(-max_keys // block_n)
    most = max(1, min(MAX_SPLITS, tiles // MIN_TILES_PER_SPLIT))
    if ctas * most <= slots:
        return most
    candidates = [s for s in range(1, most + 1) if s == 1 or -(-tiles // s) < -(-tiles // (s - 1))]
    waves = {s: ctas * s / slots for s in candidates}
    efficiency = {s: w / math.ceil(w) for s, w in waves.items()}
    best = max(efficiency.values())
    return min(s for s in candidates if efficiency[s] >= 0.95 * best)


@functools.lru_cache(maxsize=64)
def page_divider(page_size: int) -> tuple[int, int]:
    """(magic, shift) with j // page_size == (j * magic) >> shift for every 0 <= j < 2**32:
    the kernel's division of a key index by the page size, a multiply and a shift (as a
    compiler does for a constant divisor). magic = ceil(2**(32 + l) / page_size), l =
    ceil(log2(page_size)); exact because magic * page_size - 2**(32 + l) < page_size <= 2**l
    (Granlund and Montgomery). The kernel's 64-bit product needs j < 2**31 (magic <= 2**33)."""
    if page_size < 1:
        raise ValueError(f"page_size must be positive, got {page_size}")
    shift = 32 + (page_size - 1).bit_length()
    return -(-(1 << shift) // page_size), shift


class DecodeCall(NamedTuple):
    """One layout of decode call, what its launches are bound with: operands (shapes and
    strides in elements; their pointers are given at each fire), the element counts of the LSE
    and split scratch, and scalars."""

    q: Operand
    k_cache: Operand
    v_cache: Operand
    k_new: Operand | None
    v_new: Operand | None
    paged: bool  # K and V through a block table
    block_table_stride: int
    pages: int  # pages a sequence (paged), else 0
    capacity: int  # rows a sequence (paged: page size)
    out: Operand
    lse_elements: int  # float32 LSE elements (1: the scratch scalar, when none is returned)
    o_part_elements: int  # float32 split scratch (1 with one split)
    lse_part_elements: int
    num_splits: int
    row_blocks: int
    scale_log2: np.float32  # softmax_scale·log2(e), or with a softcap softcap·log2(e)
    write_lse: bool
    shared_bytes: int  # the decode launch's dynamic shared memory (``occupancy_shared``)
    # the variants' (read by ``launch_decode_variant`` only): the window's sides as the kernel takes
    # them (each >= 0, ``forward.WINDOW_UNBOUNDED`` for -1; 0 without a window) and
    # softmax_scale / softcap (0 without)
    window_left: int = 0
    window_right: int = 0
    cap_scale: np.float32 = np.float32(0.0)
    # a learnable sink's (pointer, heads_q) for its build (``KernelSpec.sink``), else None
    sink: tuple[int, int] | None = None
    batch_idx: bool = False  # the ``cache_batch_idx`` build (``KernelSpec.batch_idx``)
    leftpad: bool = False  # the ``cache_leftpad`` build (``KernelSpec.leftpad``)
    rotary: tuple[int, int, int] | None = None  # a rotary build's (rotary_dim, table rows, q_step)


def _with_options(variant: bool, call: DecodeCall, values: dict[str, Any]) -> tuple:
    """A call's declared parameters (``params.decode_params``: the plain or variant kernel's, then
    each option's) and the options' values among ``values`` (arrays: their pointers come at each
    fire)."""
    batch = call.q.shape[0]
    if call.sink is not None:
        values["sink"] = call.sink
    if call.batch_idx:
        values["cache_batch_idx"] = (0, batch)
    if call.leftpad:
        values["cache_leftpad"] = (0, batch)
    if call.rotary is not None:
        dim, rows, q_step = call.rotary
        values.update(rotary_cos=(0, rows * dim // 2), rotary_sin=(0, rows * dim // 2), rotary_dim=dim,
                      rotary_rows=rows, rotary_q_step=q_step)
    return params.decode_params(variant, call.sink is not None, call.batch_idx, call.leftpad,
                                call.rotary is not None)


# (launcher, call, gpu) -> fire(stream, *array pointers) of the call's layout, or None (a combine
# with one split): the parameters are packed once (``KernelLauncher.bind``); a fire writes the
# array pointers in parameter order and launches.
Bind = Callable[[Any, DecodeCall, Any], "Callable[..., None] | None"]


def _strides(op: Operand | None) -> tuple[int, int, int]:
    return tuple(op.strides[:3]) if op is not None else (0, 0, 0)


def decode_values(call: DecodeCall) -> tuple[tuple[int, int, int], dict[str, Any]]:
    """(grid, arguments by parameter name) of the plain decode kernel (``kernels.params.DECODE``;
    arrays as (0, elements): their pointers come at each fire)."""
    q = call.q
    batch, seqlen_q, heads_q, _ = q.shape
    heads_kv = call.k_cache.shape[2]
    grid = (call.num_splits, call.row_blocks * heads_kv, batch)
    values = {"q": (0, 1), "k_cache": (0, 1), "v_cache": (0, 1), "k_new": (0, 1), "v_new": (0, 1),
              "cache_seqlens": (0, batch), "block_table": (0, 1), "out": (0, 1),
              "lse": (0, call.lse_elements), "o_part": (0, call.o_part_elements),
              "lse_part": (0, call.lse_part_elements)}
    for name, op in (("q", q), ("kc", call.k_cache), ("vc", call.v_cache), ("kn", call.k_new),
                     ("vn", call.v_new), ("o", call.out)):
        values.update(zip((f"{name}_sb", f"{name}_ss", f"{name}_sh"), _strides(op), strict=True))
    magic, shift = page_divider(call.capacity) if call.paged else (0, 0)
    values.update(seqlen_q=seqlen_q, seqlen_new=call.k_new.shape[1] if call.k_new is not None else 0,
                  capacity=call.capacity, bt_stride=call.block_table_stride, pages=call.pages,
                  page_magic=magic, page_shift=shift, heads_kv=heads_kv, group=heads_q // heads_kv,
                  row_blocks=call.row_blocks, num_splits=call.num_splits, scale_log2=call.scale_log2,
                  write_lse=call.write_lse and call.num_splits == 1)
    return grid, values


def launch_decode_variant(config) -> Bind:
    """The window and softcap variants' bind (``kernels.params.DECODE_VARIANT``): ``launch_decode``'s,
    then the call's window sides and softcap factor."""
    threads = config.threads

    def bind(launcher, call: DecodeCall, gpu: Any):
        grid, values = decode_values(call)
        declared = _with_options(True, call, values)
        args = ordered(declared, **values, window_left=call.window_left, window_right=call.window_right,
                       cap_scale=call.cap_scale)
        return launcher.bind(grid, threads, call.shared_bytes, *args)

    return bind


def launch_decode(config) -> Bind:
    """decode's bind: fire(stream, q, k_cache, v_cache, k_new, v_new, cache_seqlens, block_table,
    out, lse, o_part, lse_part), then a sink build's sink, cache_batch_idx, cache_leftpad and
    rotary_cos, rotary_sin where built; a missing array gets the scratch scalar's pointer."""
    threads = config.threads

    def bind(launcher, call: DecodeCall, gpu: Any):
        grid, values = decode_values(call)
        declared = _with_options(False, call, values)
        return launcher.bind(grid, threads, call.shared_bytes, *ordered(declared, **values))

    return bind


def launch_decode_combine(config) -> Bind:
    """combine's bind: fire(stream, o_part, lse_part, out, lse); None with one split."""

    def bind(launcher, call: DecodeCall, gpu: Any):
        if call.num_splits == 1:
            return None
        batch, seqlen_q, heads_q, _ = call.q.shape
        head_dim = call.out.shape[3]  # O's (V's head dim)
        warps = batch * heads_q * seqlen_q * (head_dim // 32)
        scratch = split_scratch_elements(call.lse_part_elements, head_dim)  # one LSE a partial row
        o_sb, o_ss, o_sh = call.out.strides[:3]
        args = ordered(params.DECODE_COMBINE, o_part=(0, scratch), lse_part=(0, call.lse_part_elements),
                       out=(0, 1), lse=(0, call.lse_elements), o_sb=o_sb, o_ss=o_ss, o_sh=o_sh, batch=batch,
                       seqlen_q=seqlen_q, heads_q=heads_q, num_splits=call.num_splits,
                       write_lse=call.write_lse)
        return launcher.bind((-(-warps // 4), 1, 1), 128, 0, *args)

    return bind
