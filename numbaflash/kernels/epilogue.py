"""The epilogue: normalise O by the row sums, stage it in a swizzled shared tile, store it to
global memory with 16-byte stores, and write the log-sum-exp.
"""

from __future__ import annotations

from numba import cuda, float32

from .. import ptx
from .common import LN2, NEG_INF
from .smem import swizzled_offset
from .softmax import quad_sum


@cuda.jit(device=True, inline="always")
def stage_output_rows(smem_tile, acc_o, d_tiles, tile_rows, row0, l_run, lane, bf16, row_bytes=128):
    """Normalise this warp's 16 O rows by their row sums and store them, 16-bit, into rows
    ``row0`` .. +15 of a swizzled shared tile (``row_bytes``-byte block rows, see ``smem``).
    Returns nothing; the row sums (summed over the quad) are left in ``l_run``. Rows with a
    zero sum give 0."""
    g = lane // 4
    t = lane % 4
    for r in range(2):
        l_total = quad_sum(l_run[r])
        l_run[r] = l_total
        inv = ptx.reciprocal(l_total) if l_total > 0 else float32(0.0)
        for j in range(d_tiles):
            lo = acc_o[j, 2 * r] * inv
            hi = acc_o[j, 2 * r + 1] * inv
            packed = ptx.pack_bf16x2(lo, hi) if bf16 else ptx.pack_f16x2(lo, hi)
            offset = swizzled_offset(row0 + g + 8 * r, j, tile_rows, row_bytes) + 4 * t
            ptx.st_shared_b32(smem_tile + offset, packed)


@cuda.jit(device=True, inline="always")
def store_rows_global(dst, first_row, smem_tile, tile_rows, tile_row0, rows, chunks_per_row, lane, scratch,
                      row_bytes=128):
    """A warp copies ``rows`` rows of a swizzled shared tile (from ``tile_row0``; ``row_bytes``-byte
    block rows) to rows ``first_row`` ... of ``dst`` (GlobalRows) with 16-byte stores, skipping
    rows at or past ``dst.num_rows``. ``scratch`` is a uint32[4] register array;
    ``rows * chunks_per_row`` is a multiple of 32."""
    for i in range(rows * chunks_per_row // 32):
        idx = lane + i * 32
        row = idx // chunks_per_row
        chunk = idx % chunks_per_row
        ptx.ld_shared_v4(scratch, smem_tile + swizzled_offset(tile_row0 + row, chunk, tile_rows, row_bytes))
        if first_row + row < dst.num_rows:
            ptx.st_global_v4(dst.array, dst.base + (first_row + row) * dst.row_stride + chunk * 8, scratch)


@cuda.jit(device=True, inline="always")
def store_lse(lse, lse_base, row0, num_rows, m_run, l_run, lane):
    """Write the log-sum-exp (natural log) of rows g and g+8 from ``row0``; -inf where the
    row sum (``l_run``, already quad-reduced) is 0. ``m_run`` is in scaled log2 units."""
    if lane % 4 == 0:
        for r in range(2):
            row = row0 + lane // 4 + 8 * r
            if row < num_rows:
                value = NEG_INF
                if l_run[r] > 0:
                    value = (m_run[r] + ptx.log2(l_run[r])) * float32(LN2)
                lse[lse_base + row] = value
