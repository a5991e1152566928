"""The two GEMM steps of the Hopper attention kernel (``forward_ws``), each
issued asynchronously by one warpgroup for its 64 query rows:

    S  = Q Kᵀ   wgmma m64n{block_n}k16, Q and K from shared memory, both K-major
    O += P V    wgmma m64n{head_dim}k16, P (16-bit) from registers, V MN-major in shared memory

Tiles are column blocks of ``row_bytes``-byte rows in the matching TMA swizzle layout: 64-column
blocks of 128-byte rows (128B swizzle; head dims 64, 128, 256) or 32-column blocks of 64-byte
rows (64B swizzle; head dim 96, whose 192-byte rows do not split into 128-byte blocks). A block
of a ``rows``-row tile is ``rows * row_bytes`` bytes; a k-step (16 columns) is 32 bytes of a
row, so the k-step ``kk`` of a K-major operand sits in block ``kk // (row_bytes // 32)``.
"""

from __future__ import annotations

from collections import namedtuple

from numba import cuda

from ..ptx import hopper as hp

# issue_s(acc_s, desc_q, desc_k) and issue_pv(acc_o, p_frag, desc_v, accumulate) start a GEMM (commit
# group); fence_s(acc_s) / fence_o(acc_o) keep the accumulators' registers out of reordering
# across a wait.
AttentionGemms = namedtuple("AttentionGemms", ["issue_s", "issue_pv", "fence_s", "fence_o"])


def make_attention_gemms(head_dim: int, block_m: int, block_n: int, bf16: bool,
                         row_bytes: int = 128) -> AttentionGemms:
    """The GEMM steps for a Q tile of ``block_m`` rows and K / V tiles of ``block_n`` rows, in
    blocks of ``row_bytes``-byte rows (128 or 64; the descriptors' swizzle must match)."""
    if row_bytes not in (64, 128):
        raise ValueError(f"row_bytes must be 64 or 128, got {row_bytes}")
    dtype = "bf16" if bf16 else "f16"
    mma_s = hp.wgmma_ss(block_n, dtype)
    mma_o = hp.wgmma_rs(head_dim, dtype, trans_b=True)
    fence_s = hp.wgmma_fence_operand(block_n)
    fence_o = hp.wgmma_fence_operand(head_dim)
    D_K_STEPS = head_dim // 16  # k-steps of the S wgmma
    P_K_STEPS = block_n // 16  # k-steps of the PV wgmma
    BM, BN, RB = block_m, block_n, row_bytes
    STEPS_PER_BLOCK = row_bytes // 32  # k-steps of 16 columns (32 bytes) in one block row

    @cuda.jit(device=True, forceinline=True)
    def issue_s(acc_s, desc_q, desc_k):
        """Start S = Q Kᵀ (async; the first k-step overwrites the accumulator)."""
        fence_s(acc_s)
        hp.wgmma_fence()
        for kk in range(D_K_STEPS):
            block = (kk // STEPS_PER_BLOCK) * RB  # the block's offset, in bytes per tile row
            step = (kk % STEPS_PER_BLOCK) * 32
            mma_s(acc_s, hp.descriptor_add(desc_q, block * BM + step),
                  hp.descriptor_add(desc_k, block * BN + step), 0 if kk == 0 else 1)
        hp.wgmma_commit_group()

    @cuda.jit(device=True, forceinline=True)
    def issue_pv(acc_o, p_frag, desc_v, accumulate):
        """Start O += P V (async), P from registers, V MN-major (16 keys = 16 rows); with
        ``accumulate`` 0 the first k-step overwrites O (O = P V: a tile's first PV, so O needs
        no zeroing before it)."""
        fence_o(acc_o)
        hp.wgmma_fence()
        for kk in range(P_K_STEPS):
            mma_o(acc_o, p_frag[kk], hp.descriptor_add(desc_v, kk * 16 * RB), accumulate if kk == 0 else 1)
        hp.wgmma_commit_group()

    return AttentionGemms(issue_s, issue_pv, fence_s, fence_o)
