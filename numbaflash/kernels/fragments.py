"""mma.sync m16n8k16 accumulator fragments (float32, ``acc[..., j, e]``: n-tile j, element e of the
lane's four: rows g and g + 8, columns 2t and 2t + 1, with g = lane // 4 and t = lane % 4), as
the backward kernels keep them: zeroed, and stored as 16-bit rows into a swizzled shared tile
(``smem`` layout). Shared by the mma.sync backward (``backward_mma``) and the Hopper one
(``backward_ws``: the wgmma accumulator has the same per-warp layout)."""

from __future__ import annotations

from numba import cuda

from .. import ptx
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
