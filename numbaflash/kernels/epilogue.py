"""The epilogue: normalise O by the row sums, stage it in a swizzled shared tile, store it to
global memory with 16-byte stores, and write the log-sum-exp.
"""

from __future__ import annotations

from numba import cuda, float32, uint32, uint64

from .. import ptx
from .common import LN2, NEG_INF
from .smem import GlobalRows, swizzle_phase, swizzled_offset
from .softmax import pack_16bit, row_sum_inverse


@cuda.jit(device=True, forceinline=True)
def stage_output_rows(smem_tile, acc_o, d_tiles, tile_rows, row0, l_run, lane, bf16, row_bytes=128):
    """Normalise this warp's 16 O rows by their row sums and store them, 16-bit, into rows
    ``row0`` .. +15 of a swizzled shared tile (``row_bytes``-byte block rows, see ``smem``).
    Returns nothing; the row sums (summed over the quad) are left in ``l_run``. Rows with a
    zero sum give 0."""
    g = lane // 4
    t = lane % 4
    per_row = row_bytes // 16  # 16-byte chunks per block row
    row = row0 + g
    # Rows g and g + 8 share the swizzle phase (period 8), and so do n-tiles j and j + per_row:
    # one XOR per n-tile of a column block, the rest are immediates.
    phase = swizzle_phase(row, row_bytes) * 16
    row_at = smem_tile + row * row_bytes + 4 * t
    for r in range(2):
        inv = row_sum_inverse(l_run, r)
        for j in range(d_tiles):
            packed = pack_16bit(acc_o[j, 2 * r] * inv, acc_o[j, 2 * r + 1] * inv, bf16)
            block = (j // per_row) * (tile_rows * row_bytes) + 8 * r * row_bytes  # immediates
            ptx.st_shared_b32(row_at + block + (((j % per_row) * 16) ^ phase), packed)


@cuda.jit(device=True, forceinline=True)
def store_rows_global(dst, first_row, smem_tile, tile_rows, tile_row0, rows, chunks_per_row, lane, scratch,
                      row_bytes=128):
    """A warp copies ``rows`` rows of a swizzled shared tile (from ``tile_row0``; ``row_bytes``-byte
    block rows) to rows ``first_row`` ... of ``dst`` (GlobalRows) with 16-byte stores, skipping
    rows at or past ``dst.num_rows``. ``scratch`` is a uint32[4] register array;
    ``rows * chunks_per_row`` is a multiple of 32.

    Whole rows at a time when a row's chunks divide the warp; otherwise (head_dim 96: 12
    chunks) one column block of ``row_bytes // 16`` chunks after the other, so that a lane
    keeps one chunk of a block and one global address, stepped by whole rows."""
    if 32 % chunks_per_row == 0:
        store_block_rows(dst, first_row, smem_tile, tile_rows, tile_row0, rows, chunks_per_row, lane,
                         scratch, row_bytes)
    else:
        per_block = row_bytes // 16
        for b in range(chunks_per_row // per_block):
            block = GlobalRows(dst.address + b * row_bytes, dst.stride, dst.num_rows)
            store_block_rows(block, first_row, smem_tile + b * (tile_rows * row_bytes), tile_rows, tile_row0,
                             rows, per_block, lane, scratch, row_bytes)


@cuda.jit(device=True, forceinline=True)
def store_block_rows(dst, first_row, smem_tile, tile_rows, tile_row0, rows, chunks_per_row, lane, scratch,
                     row_bytes):
    """``store_rows_global`` when ``chunks_per_row`` divides 32: lane l stores chunk
    ``l % chunks_per_row`` of every ``32 // chunks_per_row``-th row."""
    rows_left = uint32(max(min(dst.num_rows - first_row, rows), 0))  # 32-bit compares below
    rows_per_pass = 32 // chunks_per_row
    row = lane // chunks_per_row
    chunk = lane % chunks_per_row
    at = dst.address + (first_row + row) * dst.stride + chunk * 16
    step = rows_per_pass * dst.stride
    for i in range(rows * chunks_per_row // 32):
        r = row + i * rows_per_pass
        ptx.ld_shared_v4(scratch, smem_tile + swizzled_offset(tile_row0 + r, chunk, tile_rows, row_bytes))
        if uint32(r) < rows_left:
            ptx.st_global_v4_at(at, scratch)
        at += step


@cuda.jit(device=True, forceinline=True)
def store_lse(lse, lse_base, row0, num_rows, m_run, l_run, lane):
    """Write the log-sum-exp (natural log) of rows g and g+8 from ``row0``; -inf where the
    row sum (``l_run``, already quad-reduced) is 0. ``m_run`` is in scaled log2 units.
    ``lse_base + row0`` is non-negative: the unsigned index skips Numba's wraparound check."""
    if lane % 4 == 0:
        g = lane // 4
        rows_left = uint32(max(min(num_rows - row0, 16), 0))  # 32-bit compares below
        for r in range(2):
            if uint32(g + 8 * r) < rows_left:
                lse[uint64(lse_base + row0 + g + 8 * r)] = log_sum_exp(m_run[r], l_run[r])


@cuda.jit(device=True, forceinline=True)
def log_sum_exp(m, l_sum):
    """The log-sum-exp (natural log) of a row whose max is ``m`` (scaled, log2 units) and whose
    sum of exp2(s - m) is ``l_sum``; -inf for a row that saw no key (``l_sum`` 0)."""
    return (m + ptx.log2(l_sum)) * float32(LN2) if l_sum > 0 else NEG_INF
