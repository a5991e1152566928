"""The two GEMM steps of the Hopper attention kernel (``forward_ws``), each
issued asynchronously by one warpgroup for its 64 query rows:

    S  = Q Kᵀ   wgmma m64n{block_n}k16, Q and K from shared memory, both K-major
    O += P V    wgmma m64n{head_dim}k16 (V's head dim), P (16-bit) from registers, V MN-major in
                shared memory

Tiles are column blocks of ``row_bytes``-byte rows in the matching TMA swizzle layout: 64-column
blocks of 128-byte rows (128B swizzle; head dims 64, 128, 256) or 32-column blocks of 64-byte
rows (64B swizzle; head dim 96, whose 192-byte rows do not split into 128-byte blocks). A block
of a ``rows``-row tile is ``rows * row_bytes`` bytes; a k-step (16 columns) is 32 bytes of a
row, so the k-step ``kk`` of a K-major operand sits in block ``kk // (row_bytes // 32)``.

With e4m3 inputs (``fp8``) both products are m64nNk32 (a k-step is 32 columns, still 32 bytes of
a K-major row) and both operands of each are K-major: S as above, and

    O += P V    wgmma m64n{head_dim}k32, P (e4m3, ``softmax.pack_p_e4m3``) from registers, V
                transposed (head-dim rows of block_n keys, in ``vt_row_bytes``-byte blocks), K-major
"""

from __future__ import annotations

from collections import namedtuple

from numba import cuda

from ..ptx import hopper as hp
from .common import unroll

# issue_s(acc_s, desc_q, desc_k) and issue_pv(acc_o, p_frag, desc_v, accumulate) start a GEMM (commit
# group); fence_s(acc_s) / fence_o(acc_o) keep the accumulators' registers out of reordering
# across a wait.
AttentionGemms = namedtuple("AttentionGemms", ["issue_s", "issue_pv", "fence_s", "fence_o"])


def make_attention_gemms(head_dim: int, block_m: int, block_n: int, bf16: bool,
                         row_bytes: int = 128, value_dim: int = 0, fp8: bool = False,
                         vt_row_bytes: int = 128, k_rows: int = 0) -> AttentionGemms:
    """The GEMM steps for a Q tile of ``block_m`` rows and K / V tiles of ``block_n`` rows, in
    blocks of ``row_bytes``-byte rows (128 or 64; the descriptors' swizzle must match). S's depth
    is ``head_dim`` (Q's and K's), O's width ``value_dim`` (V's; 0: ``head_dim``). ``fp8``: e4m3
    inputs (``bf16`` is then unused), V transposed in blocks of ``vt_row_bytes`` keys. ``k_rows``:
    the rows of the K tile's column blocks where S takes only ``block_n`` of them (0: ``block_n``;
    MLA's warpgroups each score half a tile's keys, ``mla_ws``)."""
    if row_bytes not in (64, 128) or vt_row_bytes not in (64, 128):
        raise ValueError(f"row_bytes and vt_row_bytes must be 64 or 128, got {row_bytes}, {vt_row_bytes}")
    value_dim = value_dim or head_dim
    dtype = "e4m3" if fp8 else "bf16" if bf16 else "f16"
    mma_s = hp.wgmma_ss(block_n, dtype)
    mma_o = hp.wgmma_rs(value_dim, dtype, trans_b=not fp8)
    fence_s = hp.wgmma_fence_operand(block_n)
    fence_o = hp.wgmma_fence_operand(value_dim)
    ELEMENT = 1 if fp8 else 2  # bytes of an input element
    D_K_STEPS = head_dim * ELEMENT // 32  # k-steps (32 bytes of a K-major row each) of the S wgmma
    P_K_STEPS = block_n * ELEMENT // 32  # k-steps of the PV wgmma (16 keys, or 32 in e4m3)
    BM, RB = block_m, row_bytes
    KR = k_rows or block_n  # rows of a K column block
    STEPS_PER_BLOCK = row_bytes // 32  # k-steps (32 bytes) in one block row
    FP8 = fp8
    VT_STEPS = vt_row_bytes // 32  # e4m3: k-steps of 32 keys in one block row of transposed V
    VT_BLOCK = value_dim * vt_row_bytes  # e4m3: bytes of one block of the transposed V tile

    @cuda.jit(device=True, forceinline=True)
    def s_step(kk, state):
        """k-step ``kk`` of S = Q Kᵀ (``state``: the accumulator and Q's and K's descriptors)."""
        acc_s, desc_q, desc_k = state
        block = (kk // STEPS_PER_BLOCK) * RB  # the block's offset, in bytes per tile row
        step = (kk % STEPS_PER_BLOCK) * 32
        mma_s(acc_s, hp.descriptor_add(desc_q, block * BM + step),
              hp.descriptor_add(desc_k, block * KR + step), 0 if kk == 0 else 1)

    # Above 16 k-steps (MLA's 576 columns: 36) NVVM leaves the loop rolled, each wgmma's descriptors
    # computed at run time and the group closed by an empty wgmma: the steps are unrolled in Python.
    UNROLLED = D_K_STEPS > 16
    s_steps = unroll(s_step, D_K_STEPS)

    @cuda.jit(device=True, forceinline=True)
    def issue_s(acc_s, desc_q, desc_k):
        """Start S = Q Kᵀ (async; the first k-step overwrites the accumulator)."""
        fence_s(acc_s)
        hp.wgmma_fence()
        if UNROLLED:
            s_steps((acc_s, desc_q, desc_k))
        else:  # s_step's body written out: called from the loop, it grew the d256 forward's SASS by 9%
            for kk in range(D_K_STEPS):
                block = (kk // STEPS_PER_BLOCK) * RB  # the block's offset, in bytes per tile row
                step = (kk % STEPS_PER_BLOCK) * 32
                mma_s(acc_s, hp.descriptor_add(desc_q, block * BM + step),
                      hp.descriptor_add(desc_k, block * KR + step), 0 if kk == 0 else 1)
        hp.wgmma_commit_group()

    @cuda.jit(device=True, forceinline=True)
    def issue_pv(acc_o, p_frag, desc_v, accumulate):
        """Start O += P V (async), P from registers, V MN-major (16 keys = 16 rows), or in e4m3
        transposed and K-major (32 keys = 32 bytes of each head-dim row); with ``accumulate`` 0
        the first k-step overwrites O (O = P V: a tile's first PV, so O needs no zeroing before it)."""
        fence_o(acc_o)
        hp.wgmma_fence()
        for kk in range(P_K_STEPS):
            if FP8:
                at = (kk // VT_STEPS) * VT_BLOCK + (kk % VT_STEPS) * 32
            else:
                at = kk * 16 * RB
            mma_o(acc_o, p_frag[kk], hp.descriptor_add(desc_v, at), accumulate if kk == 0 else 1)
        hp.wgmma_commit_group()

    return AttentionGemms(issue_s, issue_pv, fence_s, fence_o)


# The five GEMM steps of the Hopper backward (``backward_ws``), each issued asynchronously by one
# warpgroup for its 64 keys (one commit group each):
#   issue_scores(acc, desc_kv, desc_qdo)  Sᵀ = K Qᵀ or dPᵀ = V dOᵀ: wgmma SS m64n{block_m}k16, K or V
#                                         rows and Q or dO rows from shared memory, both K-major
#   issue_dkv(acc, frag, desc_mn)         dV += Pᵀ dO or dK += dSᵀ Q: wgmma RS m64n{head_dim}k16, Pᵀ or
#                                         dSᵀ (16-bit) from registers, dO or Q MN-major
#   issue_dq(acc, desc_ds, desc_k)        dQ = dS K: wgmma SS m64n{dq_n}k16 over the block's keys, the
#                                         dSᵀ tile and K both MN-major (the first k-step overwrites dQ);
#                                         with dq_transposed dQᵀ = Kᵀ dSᵀ, m64n{block_m}k16
# fence_scores / fence_dkv / fence_dq keep each accumulator's registers on their side of a wait.
BackwardGemms = namedtuple("BackwardGemms", ["issue_scores", "issue_dkv", "issue_dq", "fence_scores",
                                             "fence_dkv", "fence_dq"])


def make_k_major_steps(mma, fence, rows_a: int, rows_b: int, row_bytes_b: int = 128):
    """``issue(acc, desc_a, desc_b, depth)``: start ``acc = A Bᵀ`` over ``depth`` columns (async, one
    commit group; overwrites ``acc``), A and B both K-major tiles of ``rows_a`` and ``rows_b`` rows, A in
    64-column blocks of 128-byte rows: k-step kk sits in block kk // 4, 32 bytes a step; B likewise,
    or in 32-column blocks of 64-byte rows (``row_bytes_b`` 64: block kk // 2). The backward's scores
    (Sᵀ and dPᵀ of the swapped tile, S and dP of the unswapped one)."""
    B_STEPS = row_bytes_b // 32  # k-steps in a row of one of B's blocks

    @cuda.jit(device=True, forceinline=True)
    def issue(acc, desc_a, desc_b, depth):
        fence(acc)
        hp.wgmma_fence()
        for kk in range(depth // 16):
            a_at = (kk // 4) * 128 * rows_a + (kk % 4) * 32
            b_at = (kk // B_STEPS) * row_bytes_b * rows_b + (kk % B_STEPS) * 32
            mma(acc, hp.descriptor_add(desc_a, a_at), hp.descriptor_add(desc_b, b_at), 0 if kk == 0 else 1)
        hp.wgmma_commit_group()

    return issue


def make_backward_gemms(head_dim: int, block_m: int, block_n: int, dq_n: int, bf16: bool,
                        dq_transposed: bool = False) -> BackwardGemms:
    """The GEMM steps for key tiles of ``block_n`` rows, query tiles of ``block_m`` rows, and a dQ
    product ``dq_n`` head-dim columns wide, all in 64-column blocks of 128-byte rows (128B
    swizzle). A k-step of a K-major operand is 32 bytes of a row; of an MN-major one, 16 rows
    (2048 bytes)."""
    dtype = "bf16" if bf16 else "f16"
    mma_scores = hp.wgmma_ss(block_m, dtype)
    mma_dkv = hp.wgmma_rs(head_dim, dtype, trans_b=True)
    # dQ, or with ``dq_transposed`` dQᵀ = Kᵀ dSᵀ (64 head-dim columns x the block's queries)
    mma_dq = hp.wgmma_ss(block_m if dq_transposed else dq_n, dtype, trans_b=True, trans_a=True)
    DQ_T = dq_transposed
    fence_scores = hp.wgmma_fence_operand(block_m)
    fence_dkv = hp.wgmma_fence_operand(head_dim)
    fence_dq = hp.wgmma_fence_operand(block_m if dq_transposed else dq_n)
    D = head_dim
    M_K_STEPS = block_m // 16  # k-steps of dV and dK
    N_K_STEPS = block_n // 16  # k-steps of dQ
    scores = make_k_major_steps(mma_scores, fence_scores, block_n, block_m)

    @cuda.jit(device=True, forceinline=True)
    def issue_scores(acc, desc_kv, desc_qdo):
        """Start Sᵀ = K Qᵀ (or dPᵀ = V dOᵀ) over the head dim (async; overwrites ``acc``)."""
        scores(acc, desc_kv, desc_qdo, D)

    @cuda.jit(device=True, forceinline=True)
    def issue_dkv(acc, frag, desc_mn):
        """Start dV += Pᵀ dO (or dK += dSᵀ Q) over the query block (async), the A fragments
        ``frag[kk]`` from registers, B MN-major (16 query rows a k-step)."""
        fence_dkv(acc)
        hp.wgmma_fence()
        for kk in range(M_K_STEPS):
            mma_dkv(acc, frag[kk], hp.descriptor_add(desc_mn, kk * 2048), 1)
        hp.wgmma_commit_group()

    @cuda.jit(device=True, forceinline=True)
    def issue_dq(acc, desc_ds, desc_k):
        """Start dQ = dS K over the key block (async; overwrites ``acc``): A the dSᵀ tile (keys x
        queries, MN-major for dS), B the K tile (keys x head dim, MN-major), 16 keys a k-step."""
        fence_dq(acc)
        hp.wgmma_fence()
        for kk in range(N_K_STEPS):
            if DQ_T:  # A the K tile (its 64 columns as M), B the dSᵀ tile (queries as N)
                mma_dq(acc, hp.descriptor_add(desc_k, kk * 2048), hp.descriptor_add(desc_ds, kk * 2048),
                       0 if kk == 0 else 1)
            else:
                mma_dq(acc, hp.descriptor_add(desc_ds, kk * 2048), hp.descriptor_add(desc_k, kk * 2048),
                       0 if kk == 0 else 1)
        hp.wgmma_commit_group()

    return BackwardGemms(issue_scores, issue_dkv, issue_dq, fence_scores, fence_dkv, fence_dq)


# The GEMM steps of the Hopper backward's unswapped tile (``backward_ws_rows``, FlashAttention-4's (192,
# 128) tile): two warpgroups, each owning ``keys`` (48) of the block's keys; the P and dS tiles hold
# a warpgroup's keys in its own 128-byte column block (``keys`` of its 64 columns), so that each
# warpgroup's B of dKᵀ and dVᵀ is one MN-major atom wide; K's tile is in 32-column blocks of 64-byte
# rows (``WsBackwardConfig.k_row_bytes``), so that a warpgroup's 96 columns of it are one B of dQ:
#   issue_s(acc, desc_q, desc_k, depth)          S = Q Kᵀ: wgmma SS m64n{keys}k16 over ``depth``
#                                                head-dim columns, the query rows and this
#                                                warpgroup's key rows, both K-major (K's blocks of
#                                                64-byte rows)
#   issue_dp(acc, desc_do, desc_v, depth)        dP = dO Vᵀ: the same, V in 128-byte rows
#   issue_dkv(acc, desc_mn, desc_pds, m_tiles)   dKᵀ += Qᵀ dS or dVᵀ += dOᵀ P for the warpgroup's own
#                                                keys: ``m_tiles`` wgmma SS m64n{keys}k16 a k-step,
#                                                m-tile t (``acc[t]``) Q's or dO's 64 head-dim
#                                                columns 64 t .., both operands MN-major
#   issue_dq(acc, desc_ds, desc_k)               dQ = dS K over the block's keys for the warpgroup's
#                                                96 head-dim columns: wgmma SS m64n96k16, the dS
#                                                tile K-major (both column blocks), K MN-major (three
#                                                of its 32-column blocks)
# fence_scores / fence_dkv(acc, m_tiles) / fence_dq keep each accumulator's registers on their side
# of a wait.
RowsBackwardGemms = namedtuple("RowsBackwardGemms", ["issue_s", "issue_dp", "issue_dkv", "issue_dq",
                                                     "fence_scores", "fence_dkv", "fence_dq"])


def make_backward_rows_gemms(block_m: int, block_n: int, keys: int, bf16: bool) -> RowsBackwardGemms:
    """The GEMM steps of the two-warpgroup unswapped tile (above): query tiles of ``block_m`` rows,
    key tiles of ``block_n`` rows, ``keys`` a warpgroup."""
    dtype = "bf16" if bf16 else "f16"
    mma_scores = hp.wgmma_ss(keys, dtype)
    mma_dkv = hp.wgmma_ss(keys, dtype, trans_b=True, trans_a=True)
    mma_dq = hp.wgmma_ss(96, dtype, trans_b=True)
    fence_scores = hp.wgmma_fence_operand(keys)
    fence_dq = hp.wgmma_fence_operand(96)
    M_K_STEPS = block_m // 16  # k-steps of dKᵀ and dVᵀ
    WG_K_STEPS = keys // 16  # k-steps of dQ in one warpgroup's column block of dS
    N_K_STEPS = block_n // 16
    BM = block_m
    issue_s = make_k_major_steps(mma_scores, fence_scores, block_m, block_n, row_bytes_b=64)
    issue_dp = make_k_major_steps(mma_scores, fence_scores, block_m, block_n)

    @cuda.jit(device=True, forceinline=True)
    def fence_dkv(acc, m_tiles):
        """The operand fence of dKᵀ's (or dVᵀ's) ``m_tiles`` m-tiles."""
        for t in range(m_tiles):
            fence_scores(acc[t])

    @cuda.jit(device=True, forceinline=True)
    def issue_dkv(acc, desc_mn, desc_pds, m_tiles):
        """Start dKᵀ (or dVᵀ) += over the query block (async), 16 query rows a k-step of both
        operands; m-tile t's A is ``desc_mn``'s column block t."""
        fence_dkv(acc, m_tiles)
        hp.wgmma_fence()
        for kk in range(M_K_STEPS):
            for t in range(m_tiles):
                mma_dkv(acc[t], hp.descriptor_add(desc_mn, t * (BM * 128) + kk * 2048),
                        hp.descriptor_add(desc_pds, kk * 2048), 1)
        hp.wgmma_commit_group()

    @cuda.jit(device=True, forceinline=True)
    def issue_dq(acc, desc_ds, desc_k):
        """Start dQ = dS K over the key block (async; overwrites ``acc``): k-step kk is 16 keys of
        warpgroup kk // 3's column block of dS, 32 bytes a step, and K's key rows 16 kk .. (16
        rows of 64 bytes a step in each of its 32-column blocks)."""
        fence_dq(acc)
        hp.wgmma_fence()
        for kk in range(N_K_STEPS):
            at = (kk // WG_K_STEPS) * (BM * 128) + (kk % WG_K_STEPS) * 32
            mma_dq(acc, hp.descriptor_add(desc_ds, at), hp.descriptor_add(desc_k, kk * 1024),
                   0 if kk == 0 else 1)
        hp.wgmma_commit_group()

    return RowsBackwardGemms(issue_s, issue_dp, issue_dkv, issue_dq, fence_scores, fence_dkv, fence_dq)
