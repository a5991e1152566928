"""FlashAttention-2 forward on tensor cores with cp.async + ldmatrix + mma.sync (sm_80+).

One CTA computes ``block_m`` query rows of one (batch, head); each of its warps owns 16 rows
and keeps their Q fragments in registers for the whole KV loop. K and V tiles of
``block_n`` keys stream through swizzled shared memory with cp.async; the copy of V_j
overlaps S = Q K_jᵀ and the copy of K_{j+1} overlaps O += P V_j. The softmax runs online
in the exp2 domain with the scale folded into one FFMA; P becomes the A operand of the PV
product in registers; O is rescaled only when a row max grows by more than 2^8 and is
normalised once at the end, then written through shared memory with 16-byte stores.
"""

from __future__ import annotations

import dataclasses
import math

from numba import cuda, float32, types, uint32

from .. import ptx
from ..tiles import (
    NEG_INF,
    block_offset,
    copy_tile_async,
    ldmatrix_offsets,
    load_a_fragments,
    quad_sum,
    row_max,
    swizzled_offset,
)

LOG2E = math.log2(math.e)
# Keep a stale row max until the true one exceeds it by this much (log2 units): P stays
# below 2^8, safe in fp16/bf16 and fp32 sums, and most tiles skip the O rescale.
RESCALE_THRESHOLD = 8.0
THRESHOLD = float32(RESCALE_THRESHOLD)


@dataclasses.dataclass(frozen=True)
class ForwardConfig:
    """Compile-time shape of the forward kernel."""

    head_dim: int
    block_m: int = 128  # query rows per CTA
    block_n: int = 64  # keys per KV tile
    warp_m_tiles: int = 1  # 16-row m-tiles per warp: 2 halves the shared-memory reads per MMA

    @property
    def num_warps(self) -> int:
        return self.block_m // (16 * self.warp_m_tiles)

    @property
    def threads(self) -> int:
        return 32 * self.num_warps

    @property
    def shared_bytes(self) -> int:
        """Q tile + one K tile + one V tile, 16-bit elements."""
        return (self.block_m + 2 * self.block_n) * self.head_dim * 2

    def check(self) -> None:
        if self.head_dim % 64 or not 64 <= self.head_dim <= 256:
            raise ValueError(f"head_dim must be 64, 128, 192 or 256, got {self.head_dim}")
        if self.block_m % (16 * self.warp_m_tiles) or self.block_n % 16:
            raise ValueError(f"block_m and block_n must be multiples of 16, got {self}")
        for rows in (self.block_m, self.block_n):
            if rows * self.head_dim // 8 % self.threads:
                raise ValueError(f"tile of {rows} rows does not split evenly over {self.threads} threads")


FORWARD_ARGTYPES = (
    types.uint16[::1], types.uint16[::1], types.uint16[::1],  # q, k, v (flat 16-bit bits)
    types.uint16[::1], types.float32[::1],  # o, lse (flat; lse may be a 1-element dummy)
    types.int64, types.int64, types.int64,  # q strides: batch, seq, head (elements)
    types.int64, types.int64, types.int64,  # k strides
    types.int64, types.int64, types.int64,  # v strides
    types.int64, types.int64, types.int64,  # o strides
    types.int64, types.int64,  # seqlen_q, seqlen_k
    types.int64, types.int64,  # heads_q, heads_q // heads_kv
    types.float32, types.boolean,  # softmax scale * log2(e), write lse
)


def make_forward_kernel(config: ForwardConfig, causal: bool, bf16: bool):
    """Return the Python kernel function for ``config`` (jit it with FORWARD_ARGTYPES).

    Launch: grid (cdiv(seqlen_q, block_m), heads_q, batch), ``config.threads`` threads,
    ``config.shared_bytes`` bytes of dynamic shared memory.
    """
    config.check()
    D = config.head_dim
    BM = config.block_m
    BN = config.block_n
    MT = config.warp_m_tiles
    THREADS = config.threads
    CPR = D // 8  # 16-byte chunks per row
    D_K_TILES = D // 16  # k-tiles of the QKᵀ product
    D_N_TILES = D // 8  # n-tiles of the O accumulator
    S_N_TILES = BN // 8  # n-tiles of the S accumulator
    P_K_TILES = BN // 16  # k-tiles of the PV product
    CAUSAL = causal
    mma = ptx.mma_m16n8k16_bf16 if bf16 else ptx.mma_m16n8k16_f16
    pack = ptx.pack_bf16x2 if bf16 else ptx.pack_f16x2

    def flash_forward(q, k, v, o, lse, q_sb, q_ss, q_sh, k_sb, k_ss, k_sh, v_sb, v_ss, v_sh,
                      o_sb, o_ss, o_sh, seqlen_q, seqlen_k, heads_q, group, scale_log2, write_lse):
        smem = cuda.shared.array(0, types.uint16)
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        g = lane // 4  # fragment row within the warp's 16 (and g + 8)
        t = lane % 4  # fragment column pair
        m_block = cuda.blockIdx.x
        if CAUSAL:  # heaviest query blocks first: better tail balance
            m_block = cuda.gridDim.x - 1 - m_block
        head = cuda.blockIdx.y
        batch = cuda.blockIdx.z
        kv_head = uint32(head) // uint32(group)  # 32-bit: no division subroutine
        m0 = m_block * BM
        diag = seqlen_k - seqlen_q  # query i sees keys j <= i + diag

        sq = ptx.shared_address_u16(smem)
        sk = sq + BM * D * 2
        sv = sk + BN * D * 2
        q_base = batch * q_sb + head * q_sh
        k_base = batch * k_sb + kv_head * k_sh
        v_base = batch * v_sb + kv_head * v_sh

        n_tiles = (seqlen_k + BN - 1) // BN
        if CAUSAL:
            n_tiles = min(n_tiles, (m0 + BM + diag + BN - 1) // BN)

        # Prologue: Q and K_0 in flight together.
        copy_tile_async(sq, q, q_base, q_ss, m0, seqlen_q, BM, CPR, tid, THREADS)
        ptx.cp_async_commit_group()
        if n_tiles > 0:
            copy_tile_async(sk, k, k_base, k_ss, 0, seqlen_k, BN, CPR, tid, THREADS)
        ptx.cp_async_commit_group()

        acc_o = cuda.local.array((MT, D_N_TILES, 4), float32)
        for mt in range(MT):
            for j in range(D_N_TILES):
                for e in range(4):
                    acc_o[mt, j, e] = 0.0
        acc_s = cuda.local.array((MT, S_N_TILES, 4), float32)
        q_frag = cuda.local.array((MT, D_K_TILES, 4), uint32)
        p_frag = cuda.local.array((MT, P_K_TILES, 4), uint32)
        b_frag = cuda.local.array(4, uint32)
        # Per fragment row (m-tile mt, half r: rows g and g+8): running max (scaled, log2
        # units) and this lane's partial row sum.
        m_run = cuda.local.array((MT, 2), float32)
        l_run = cuda.local.array((MT, 2), float32)
        for mt in range(MT):
            for r in range(2):
                m_run[mt, r] = NEG_INF
                l_run[mt, r] = 0.0

        ptx.cp_async_wait_group_1()  # Q has landed (K_0 may still be in flight)
        cuda.syncthreads()
        warp_row = warp * 16 * MT  # this warp's first row in the CTA tile
        for mt in range(MT):
            load_a_fragments(q_frag[mt], sq, warp_row + 16 * mt, D_K_TILES, CPR, lane)

        row_first = m0 + warp_row  # this warp's first query row
        # ldmatrix byte offsets of this lane: K as the B operand of QKᵀ (non-transposed,
        # two n-tiles of 8 keys per load), V as the B operand of PV (transposed).
        k_offsets = cuda.local.array(4, uint32)
        ldmatrix_offsets(k_offsets, lane % 8 + (lane // 16) * 8, (lane // 8) % 2, CPR)
        v_offsets = cuda.local.array(4, uint32)
        ldmatrix_offsets(v_offsets, lane % 16, lane // 16, CPR)
        mx = cuda.local.array((MT, 2), float32)
        for n_block in range(n_tiles):
            n0 = n_block * BN
            ptx.cp_async_wait_group_0()  # K_j has landed ...
            cuda.syncthreads()  # ... for everyone, and every warp is done with V_{j-1}
            copy_tile_async(sv, v, v_base, v_ss, n0, seqlen_k, BN, CPR, tid, THREADS)
            ptx.cp_async_commit_group()

            # S = Q K_jᵀ
            for mt in range(MT):
                for j in range(S_N_TILES):
                    for e in range(4):
                        acc_s[mt, j, e] = 0.0
            for kt in range(D_K_TILES):
                for j2 in range(S_N_TILES // 2):
                    ptx.ldmatrix_x4(b_frag, sk + block_offset(k_offsets, kt) + j2 * 16 * CPR * 16)
                    for mt in range(MT):
                        mma(acc_s[mt, 2 * j2], q_frag[mt, kt], b_frag[0:2])
                        mma(acc_s[mt, 2 * j2 + 1], q_frag[mt, kt], b_frag[2:4])

            # Mask keys past the end, and (causal) keys after the diagonal.
            if n0 + BN > seqlen_k or (CAUSAL and n0 + BN - 1 > row_first + diag):
                for mt in range(MT):
                    for j in range(S_N_TILES):
                        for e in range(4):
                            col = n0 + j * 8 + 2 * t + e % 2
                            row = row_first + 16 * mt + g + (e // 2) * 8
                            if col >= seqlen_k or (CAUSAL and col > row + diag):
                                acc_s[mt, j, e] = NEG_INF

            # Online softmax (exp2 domain), with a lazily refreshed row max.
            grow = False
            for mt in range(MT):
                for r in range(2):
                    mx[mt, r] = row_max(acc_s[mt], S_N_TILES, r) * scale_log2
                    grow = grow or mx[mt, r] > m_run[mt, r] + THRESHOLD
            if cuda.any_sync(0xFFFFFFFF, grow):
                for mt in range(MT):
                    for r in range(2):
                        m_new = max(m_run[mt, r], mx[mt, r])
                        alpha = ptx.exp2(m_run[mt, r] - m_new) if m_new != NEG_INF else float32(1.0)
                        m_run[mt, r] = m_new
                        l_run[mt, r] *= alpha
                        for j in range(D_N_TILES):
                            acc_o[mt, j, 2 * r] *= alpha
                            acc_o[mt, j, 2 * r + 1] *= alpha
            for mt in range(MT):
                for r in range(2):
                    m_use = m_run[mt, r] if m_run[mt, r] != NEG_INF else float32(0.0)
                    row_sum = float32(0.0)
                    for j in range(S_N_TILES):
                        for e in range(2):
                            p = ptx.exp2(acc_s[mt, j, 2 * r + e] * scale_log2 - m_use)
                            acc_s[mt, j, 2 * r + e] = p
                            row_sum += p
                    l_run[mt, r] += row_sum
                # P in 16-bit, laid out as the A operand of m16n8k16 (two S n-tiles per k-tile).
                for kt in range(P_K_TILES):
                    p_frag[mt, kt, 0] = pack(acc_s[mt, 2 * kt, 0], acc_s[mt, 2 * kt, 1])
                    p_frag[mt, kt, 1] = pack(acc_s[mt, 2 * kt, 2], acc_s[mt, 2 * kt, 3])
                    p_frag[mt, kt, 2] = pack(acc_s[mt, 2 * kt + 1, 0], acc_s[mt, 2 * kt + 1, 1])
                    p_frag[mt, kt, 3] = pack(acc_s[mt, 2 * kt + 1, 2], acc_s[mt, 2 * kt + 1, 3])

            ptx.cp_async_wait_group_0()  # V_j has landed ...
            cuda.syncthreads()  # ... for everyone, and every warp is done with K_j
            if n_block + 1 < n_tiles:
                copy_tile_async(sk, k, k_base, k_ss, n0 + BN, seqlen_k, BN, CPR, tid, THREADS)
                ptx.cp_async_commit_group()

            # O += P V_j
            for kt in range(P_K_TILES):
                for j2 in range(D_N_TILES // 2):
                    ptx.ldmatrix_x4_trans(b_frag, sv + block_offset(v_offsets, j2) + kt * 16 * CPR * 16)
                    for mt in range(MT):
                        mma(acc_o[mt, 2 * j2], p_frag[mt, kt], b_frag[0:2])
                        mma(acc_o[mt, 2 * j2 + 1], p_frag[mt, kt], b_frag[2:4])

        # Epilogue: normalise, stage this warp's 16 rows in its own part of the Q tile,
        # then 16-byte coalesced stores. Rows with no visible key give 0 and LSE -inf.
        o_base = batch * o_sb + head * o_sh
        for mt in range(MT):
            for r in range(2):
                l_total = quad_sum(l_run[mt, r])
                inv = ptx.reciprocal(l_total) if l_total > 0 else float32(0.0)
                local_row = warp_row + 16 * mt + g + 8 * r
                for j in range(D_N_TILES):
                    ptx.st_shared_b32(
                        sq + swizzled_offset(local_row, j, CPR) + 4 * t,
                        pack(acc_o[mt, j, 2 * r] * inv, acc_o[mt, j, 2 * r + 1] * inv),
                    )
                row = m0 + local_row
                if write_lse and t == 0 and row < seqlen_q:
                    value = NEG_INF
                    if l_total > 0:
                        value = (m_run[mt, r] + ptx.log2(l_total)) * float32(1.0 / LOG2E)
                    lse[(batch * heads_q + head) * seqlen_q + row] = value
        cuda.syncwarp()
        out = cuda.local.array(4, uint32)
        for i in range(16 * MT * CPR // 32):
            idx = lane + i * 32
            row = idx // CPR
            chunk = idx % CPR
            ptx.ld_shared_v4(out, sq + swizzled_offset(warp_row + row, chunk, CPR))
            if row_first + row < seqlen_q:
                ptx.st_global_v4(o, o_base + (row_first + row) * o_ss + chunk * 8, out)

    flash_forward.__name__ = f"flash_forward_d{D}_m{BM}x{MT}_n{BN}_{'causal' if causal else 'full'}_" + (
        "bf16" if bf16 else "f16"
    )
    return flash_forward
