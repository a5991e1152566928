"""mma.sync m16n8k16 accumulator fragments (float32, ``acc[..., j, e]``: n-tile j, element e of the
lane's four: rows g and g + 8, columns 2t and 2t + 1, with g = lane // 4 and t = lane % 4), as
the backward kernels keep them: zeroed, and stored as 16-bit rows into a swizzled shared tile
(``smem`` layout). Shared by the mma.sync backward (``backward_mma``) and the Hopper one
(``backward_ws``: the wgmma accumulator has the same per-warp layout)."""

from __future__ import annotations

from numba import cuda

from .. import ptx
from .common import FULL_MASK
from .smem import swizzled_offset
from .softmax import pack_16bit


@cuda.jit(device=True, forceinline=True)
def zero_fragments(acc, m_tiles, n_tiles):
    """acc[mt, j, e] = 0 for the first ``m_tiles`` x ``n_tiles`` fragments (float32 (m, n, 4))."""
    for mt in range(m_tiles):
        for j in range(n_tiles):
            for e in range(4):
                acc[mt, j, e] = 0.0


@cuda.jit(device=True, forceinline=True)
def store_fragment_rows(tile, acc, n_tiles, tile_rows, row0, col0, lane, bf16, row_bytes, scale):
    """Store 16 rows (from ``row0``) x ``8 * n_tiles`` columns (from ``col0``, a multiple of 8)
    of mma accumulator fragments ``acc[j, e]``, times ``scale``, as 16-bit pairs into a
    swizzled shared tile (``smem`` layout)."""
    g = lane // 4
    t = lane % 4
    for r in range(2):
        row = row0 + g + 8 * r
        for j in range(n_tiles):
            packed = pack_16bit(acc[j, 2 * r] * scale, acc[j, 2 * r + 1] * scale, bf16)
            at = tile + swizzled_offset(row, col0 // 8 + j, tile_rows, row_bytes) + 4 * t
            ptx.st_shared_b32(at, packed)


@cuda.jit(device=True, forceinline=True)
def store_transposed_fragment(tile, acc, n_tiles, tile_rows, row0, col0, lane, bf16, row_bytes, scale):
    """Store a fragment whose rows are the tile's columns (a dQᵀ accumulator): ``acc[j, e]``, times
    ``scale``, is row ``row0`` + 8 j + 2 t + e % 2, column ``col0`` + g + 8 (e // 2) of the swizzled
    shared tile (16 columns from ``col0``, a multiple of 8; ``8 * n_tiles`` rows). Lanes g and g ^ 1 hold
    neighbouring columns, so each pair swaps one value (a shuffle) and stores two adjacent columns
    of one row as a 16-bit pair: the even lane's row 8 j + 2 t, the odd lane's the next."""
    g = lane // 4
    t = lane % 4
    odd = g % 2
    for j in range(n_tiles):
        for h in range(2):
            first = acc[j, 2 * h] * scale  # row 8 j + 2 t
            second = acc[j, 2 * h + 1] * scale  # row 8 j + 2 t + 1
            other = cuda.shfl_xor_sync(FULL_MASK, first if odd else second, 4)
            row = row0 + 8 * j + 2 * t + odd
            col = col0 + 8 * h + g - odd
            packed = pack_16bit(other, second, bf16) if odd else pack_16bit(first, other, bf16)
            at = tile + swizzled_offset(row, col // 8, tile_rows, row_bytes) + 2 * (col % 8)
            ptx.st_shared_b32(at, packed)
