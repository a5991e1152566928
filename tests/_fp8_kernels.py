"""Tiny test kernels of the e4m3 PTX helpers (sm_89+: ``ptx.mma_m16n8k32_e4m3``,
``ptx.pack_e4m3x4``), shared by the GPU tests (``test_ptx_fp8_gpu.py``) and the offline SASS
tests (``test_ptx_fp8_offline.py``). Plain Python functions (jit them with ``cuda.jit``), with
example argument types for offline compilation in ``KERNELS``; launch shapes in the docstrings.
"""

from __future__ import annotations

from _sm80_kernels import MMA_ARGTYPES, make_mma_kernel
from numba import cuda, types

from numbaflash import ptx

LANES = 32


# One m16n8k32 e4m3 mma: the sm80 probes' one-mma kernel (``_sm80_kernels.make_mma_kernel``). Launch
# [1, 32]: ``a`` (32, 4) and ``b`` (32, 2) uint32, each lane's A and B registers (four e4m3 each);
# ``c`` (32, 4) float32 its accumulators; ``d`` (32, 4) the accumulators after the mma.
mma_e4m3_kernel = make_mma_kernel(ptx.mma_m16n8k32_e4m3)


def pack_e4m3_kernel(x, out):
    """Launch [ceil(n / 128), 128]. ``x`` (n, 4) float32 -> ``out`` (n,) uint32: row i's four
    values as e4m3, x[i, 0] in the lowest byte."""
    i = cuda.grid(1)
    if i < x.shape[0]:
        out[i] = ptx.pack_e4m3x4(x[i, 0], x[i, 1], x[i, 2], x[i, 3])


def byte_perm_kernel(a, b, selector, out):
    """Launch [ceil(n / 128), 128]: ``out[i] = ptx.byte_perm(a[i], b[i], selector[i])`` (uint32 each;
    the FP8 V prep's 4 x 4 byte transpose; any GPU)."""
    i = cuda.grid(1)
    if i < a.shape[0]:
        out[i] = ptx.byte_perm(a[i], b[i], selector[i])


_F32_2D = types.Array(types.float32, 2, "C")
KERNELS = {
    "mma_e4m3": (mma_e4m3_kernel, MMA_ARGTYPES),
    "pack_e4m3": (pack_e4m3_kernel, (_F32_2D, types.Array(types.uint32, 1, "C"))),
}
