"""Tiny test kernels of the e4m3 PTX helpers (sm_89+: ``ptx.mma_m16n8k32_e4m3``,
``ptx.pack_e4m3x4``), shared by the GPU tests (``test_ptx_fp8_gpu.py``) and the offline SASS
tests (``test_ptx_fp8_offline.py``). Plain Python functions (jit them with ``cuda.jit``), with
example argument types for offline compilation in ``KERNELS``; launch shapes in the docstrings.
"""

from __future__ import annotations

from numba import cuda, float32, types, uint32

from numbaflash import ptx

LANES = 32


def mma_e4m3_kernel(a, b, acc_in, out):
    """Launch [1, 32]. ``a`` (32, 4) and ``b`` (32, 2) uint32: each lane's A and B registers
    (four e4m3 each); ``acc_in`` (32, 4) float32: its accumulators; ``out`` (32, 4) float32:
    the accumulators after one m16n8k32 mma."""
    lane = cuda.threadIdx.x
    ra = cuda.local.array(4, uint32)
    rb = cuda.local.array(2, uint32)
    acc = cuda.local.array(4, float32)
    for i in range(4):
        ra[i] = a[lane, i]
        acc[i] = acc_in[lane, i]
    for i in range(2):
        rb[i] = b[lane, i]
    ptx.mma_m16n8k32_e4m3(acc, ra, rb)
    for i in range(4):
        out[lane, i] = acc[i]


def pack_e4m3_kernel(x, out):
    """Launch [ceil(n / 128), 128]. ``x`` (n, 4) float32 -> ``out`` (n,) uint32: row i's four
    values as e4m3, x[i, 0] in the lowest byte."""
    i = cuda.grid(1)
    if i < x.shape[0]:
        out[i] = ptx.pack_e4m3x4(x[i, 0], x[i, 1], x[i, 2], x[i, 3])


_U32_2D = types.Array(types.uint32, 2, "C")
_F32_2D = types.Array(types.float32, 2, "C")
KERNELS = {
    "mma_e4m3": (mma_e4m3_kernel, (_U32_2D, _U32_2D, _F32_2D, _F32_2D)),
    "pack_e4m3": (pack_e4m3_kernel, (_F32_2D, types.Array(types.uint32, 1, "C"))),
}
