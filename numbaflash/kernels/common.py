"""What both forward kernels share: their argument types (one ABI, one launch path), the
online-softmax rescale threshold, and the device constants."""

from __future__ import annotations

import math

from numba import cuda, float32, int32, uint32

FULL_MASK = 0xFFFFFFFF  # every lane of a warp, for shuffles
NEG_INF = float32(-math.inf)
LN2 = math.log(2.0)  # LSE is stored in natural-log units; the kernels work in log2
LOG2_E = math.log2(math.e)  # exp(x) = exp2(x · LOG2_E); wrap both in float32() in device code


# The O rescale is skipped (warp-uniformly) unless some row max grew by more than this
# (log2 units). A stale max keeps P below 2^threshold, but P's largest entries then round
# in 16 bits instead of being exactly 1: measured on an H200 (fp16, d64, 1k keys) 8.0 gave
# a 1.3x larger max error than 0.0, which matches FlashAttention-2 to the digit
# (benchmarks/accuracy_compare.py). So only rows whose max did grow trigger a rescale.
RESCALE_THRESHOLD = 0.0
THRESHOLD = float32(RESCALE_THRESHOLD)


@cuda.jit(device=True, forceinline=True)
def keep_in_register(value, lane):
    """``value`` (this lane's own, by a shuffle): an identity ptxas cannot recompute. A value
    computed once from the thread index (an ldmatrix offset) then stays in a register instead
    of being rematerialised from the thread index in every KV iteration."""
    return uint32(cuda.shfl_sync(FULL_MASK, int32(value), lane))


@cuda.jit(device=True, forceinline=True)
def warp_uniform(value):
    """``value`` (int32) as lane 0 of the warp holds it, by a ``shfl.sync`` broadcast: for a value every
    lane computes alike but ptxas cannot prove so (a quotient of the thread index, a length loaded
    from memory). What derives from it (wgmma descriptors, ring stages, a branch) can then live in
    uniform registers instead of being moved into them (R2UR) before each use."""
    return cuda.shfl_sync(FULL_MASK, int32(value), 0)


def unroll(step, count: int):
    """A device function ``run(state)`` that calls ``step(0, state)``, ..., ``step(count - 1,
    state)``: a loop unrolled in Python. For loop bodies too large for NVVM to unroll fully: a
    loop left rolled indexes the fragment arrays at run time, which puts them in local memory.
    ``state`` is a tuple of whatever the steps share.

    ``run`` is generated with one call per step, flat, and NVVM inlines every step into it.
    (When Numba inlined at its IR level, a chain of functions each calling the next copied the
    IR once per level, which took a minute for 8 steps.)"""
    calls = "".join(f"    step({k}, state)\n" for k in range(count)) or "    pass\n"
    namespace = {"step": step}
    exec(f"def run(state):\n{calls}", namespace)  # noqa: S102 - generated from the constant count
    return cuda.jit(device=True, forceinline=True)(namespace["run"])
