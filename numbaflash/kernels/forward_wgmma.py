"""FlashAttention forward for Hopper (sm_90a) on wgmma.

A CTA is ``warpgroups`` warpgroups of 4 warps; each warpgroup owns 64 query rows (each warp
16 of them, with the same register fragment layout as the mma.sync kernel, so the online
softmax steps are shared). Q, K and V tiles live in shared memory in the 128-byte swizzle
layout that wgmma descriptors address directly:

    S  = Q Kᵀ   wgmma m64n{block_n}k16, A (Q) and B (K) from shared memory, both K-major
    O += P V    wgmma m64n{head_dim}k16, A (P, 16-bit) from registers, B (V) from shared
                memory, MN-major (transposed B)

K and V tiles are double buffered: while tile j is multiplied, cp.async brings the next
tiles into the other stage. cp.async writes through the generic proxy and wgmma reads
through the async proxy, so every thread fences (fence.proxy.async) before the CTA barrier
that hands a tile to the tensor cores.

``pipelined`` (FlashAttention-3's intra-warpgroup overlap): S_{j+1} = Q K_{j+1}ᵀ is issued
before the softmax of tile j, into a second S accumulator, so the tensor cores work while
the warpgroup computes exponentials; K is then loaded one tile ahead of V. The loop is
unrolled by two so that the two S accumulators swap roles with compile-time indices.
"""

from __future__ import annotations

from collections import namedtuple

from numba import cuda, float32, types, uint32

from .. import ptx
from ..ptx import hopper as hp
from .blocks import ScoreMask, mask_if_needed, query_block, visible_kv_tiles
from .common import FULL_MASK, NEG_INF, THRESHOLD
from .epilogue import stage_output_rows, store_lse, store_rows_global
from .shapes import WgmmaConfig
from .smem import GlobalRows, copy_tile_async, drain_copies
from .softmax import exponentiate, max_grew, pack_p_fragments, rescale_rows, scaled_row_maxes
from .wgmma_gemms import make_attention_gemms

# Per-warp online-softmax state (register arrays): running row maxes (scaled, log2 units),
# this lane's part of the row sums, and scratch for a tile's row maxes.
RowStats = namedtuple("RowStats", ["m_run", "l_run", "mx"])
# Shared-memory K and V stages (32-bit shared addresses, stage s at + s * KV_BYTES) and the
# wgmma descriptors of Q (this warpgroup's rows), K stage 0 and V stage 0.
KvStages = namedtuple("KvStages", ["sk", "sv", "desc_q", "desc_k", "desc_v"])


def make_forward_wgmma_kernel(config: WgmmaConfig, causal: bool, bf16: bool):
    """Return the Python kernel function for ``config``; same arguments and grid as
    ``forward_mma.make_forward_kernel`` (jit it with ``common.FORWARD_ARGTYPES``)."""
    config.check()
    D = config.head_dim
    BN = config.block_n
    BM = config.block_m
    THREADS = config.threads
    CPR = D // 8  # 16-byte chunks per row
    D_N_TILES = D // 8  # 8-column tiles of the O accumulator
    S_N_TILES = BN // 8  # 8-column tiles of the S accumulator
    P_K_STEPS = BN // 16  # k-steps of the PV wgmma
    Q_BYTES = BM * D * 2
    KV_BYTES = BN * D * 2  # one K (or V) stage
    CAUSAL = causal
    BF16 = bf16
    dtype = "bf16" if bf16 else "f16"
    issue_s, issue_pv, fence_s, fence_o = make_attention_gemms(D, BM, BN, bf16)

    PIPELINED = config.pipelined

    @cuda.jit(device=True, inline="always")
    def softmax_to_p(acc_s, acc_o, p_frag, stats, n0, at, scale_log2):
        """Online softmax of one S tile into 16-bit P fragments, rescaling O if a max grew."""
        mask_if_needed(acc_s, S_N_TILES, n0, BN, at, CAUSAL)
        scaled_row_maxes(acc_s, S_N_TILES, stats.mx, scale_log2)
        if cuda.any_sync(FULL_MASK, max_grew(stats.mx, stats.m_run, THRESHOLD)):
            rescale_rows(acc_o, D_N_TILES, stats.m_run, stats.l_run, stats.mx)
        exponentiate(acc_s, S_N_TILES, stats.m_run, stats.l_run, scale_log2)
        pack_p_fragments(p_frag, acc_s, P_K_STEPS, BF16)

    @cuda.jit(device=True, inline="always")
    def handover():
        """Every copy issued so far has landed and is visible to wgmma, for all threads; and
        every warpgroup has finished the work of the previous step."""
        ptx.cp_async_wait_group_0()
        hp.fence_proxy_async_shared_cta()
        cuda.syncthreads()

    @cuda.jit(device=True, inline="always")
    def pipelined_step(n_block, n_tiles, s_cur, s_next, acc_o, p_frag, stats, stages, kv, at):
        """Tile j = n_block: S_j is in ``s_cur``; K_{j+1} and V_j are (being) loaded.
        ``kv``: (k rows, v rows, tid, scale_log2); ``at``: where this warp's scores sit."""
        k_rows, v_rows, tid, scale_log2 = kv
        n0 = n_block * BN
        handover()  # K_{j+1}, V_j landed; S_j and PV_{j-1} are done everywhere
        if n_block + 1 < n_tiles:  # V_{j+1} over V_{j-1}
            v_stage = stages.sv + ((n_block + 1) % 2) * KV_BYTES
            copy_tile_async(v_stage, BN, v_rows, n0 + BN, CPR, tid, THREADS)
        if n_block + 2 < n_tiles:  # K_{j+2} over K_j
            copy_tile_async(stages.sk + (n_block % 2) * KV_BYTES, BN, k_rows, n0 + 2 * BN, CPR, tid, THREADS)
        ptx.cp_async_commit_group()
        if n_block + 1 < n_tiles:
            issue_s(s_next, stages.desc_q, hp.descriptor_add(stages.desc_k, ((n_block + 1) % 2) * KV_BYTES))
        softmax_to_p(s_cur, acc_o, p_frag, stats, n0, at, scale_log2)
        issue_pv(acc_o, p_frag, hp.descriptor_add(stages.desc_v, (n_block % 2) * KV_BYTES))
        hp.wgmma_wait_group_0()
        fence_s(s_next)
        fence_o(acc_o)

    def flash_forward_wgmma(q, k, v, o, lse, q_sb, q_ss, q_sh, k_sb, k_ss, k_sh, v_sb, v_ss, v_sh,
                            o_sb, o_ss, o_sh, seqlen_q, seqlen_k, batch_size, heads_q, group, scale_log2,
                            write_lse):
        smem = cuda.shared.array(0, types.uint16)
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        m_block, head, batch, kv_head = query_block(heads_q, group, CAUSAL)
        if batch >= batch_size:  # past the last (batch, head) pair of a folded grid
            return
        m0 = m_block * BM
        diag = seqlen_k - seqlen_q  # query i sees keys j <= i + diag

        sq = (ptx.shared_address_u16(smem) + 1023) & ~uint32(1023)  # swizzle atoms: 1024-aligned
        sk = sq + Q_BYTES  # stage s of K at sk + s * KV_BYTES
        sv = sk + 2 * KV_BYTES  # stage s of V at sv + s * KV_BYTES
        q_rows = GlobalRows(q, batch * q_sb + head * q_sh, q_ss, seqlen_q)
        k_rows = GlobalRows(k, batch * k_sb + kv_head * k_sh, k_ss, seqlen_k)
        v_rows = GlobalRows(v, batch * v_sb + kv_head * v_sh, v_ss, seqlen_k)

        n_tiles = visible_kv_tiles(m0, BM, BN, seqlen_k, diag, CAUSAL)

        acc_o = cuda.local.array((D_N_TILES, 4), float32)
        for j in range(D_N_TILES):
            for e in range(4):
                acc_o[j, e] = 0.0
        acc_s = cuda.local.array((S_N_TILES, 4), float32)
        acc_s2 = cuda.local.array((S_N_TILES, 4), float32)  # the second S buffer (pipelined)
        p_frag = cuda.local.array((P_K_STEPS, 4), uint32)
        stats = RowStats(cuda.local.array(2, float32), cuda.local.array(2, float32),
                         cuda.local.array(2, float32))  # rows g, g+8 of the warp's fragments
        for r in range(2):
            stats.m_run[r] = NEG_INF
            stats.l_run[r] = 0.0

        warpgroup = warp // 4
        row_first = m0 + warp * 16  # this warp's first query row
        at = ScoreMask(row_first, lane, seqlen_k, diag)
        # Descriptors: Q rows of this warpgroup (K-major); K stage 0 (K-major); V stage 0
        # (MN-major: 64-wide head-dim blocks BN*128 bytes apart).
        stages = KvStages(sk, sv, hp.smem_descriptor_k_sw128(sq + warpgroup * 64 * 128),
                          hp.smem_descriptor_k_sw128(sk), hp.smem_descriptor_mn_sw128(sv, BN * 128))

        if PIPELINED:
            # Prologue: {Q, K_0}, then {V_0, K_1}; S_0 before the loop.
            copy_tile_async(sq, BM, q_rows, m0, CPR, tid, THREADS)
            if n_tiles > 0:
                copy_tile_async(sk, BN, k_rows, 0, CPR, tid, THREADS)
            ptx.cp_async_commit_group()
            if n_tiles > 0:
                copy_tile_async(sv, BN, v_rows, 0, CPR, tid, THREADS)
            if n_tiles > 1:
                copy_tile_async(sk + KV_BYTES, BN, k_rows, BN, CPR, tid, THREADS)
            ptx.cp_async_commit_group()
            ptx.cp_async_wait_group_1()
            hp.fence_proxy_async_shared_cta()
            cuda.syncthreads()
            if n_tiles > 0:
                issue_s(acc_s, stages.desc_q, stages.desc_k)
                hp.wgmma_wait_group_0()
                fence_s(acc_s)
            kv = (k_rows, v_rows, tid, scale_log2)
            for n_block in range(0, n_tiles, 2):
                pipelined_step(n_block, n_tiles, acc_s, acc_s2, acc_o, p_frag, stats, stages, kv, at)
                if n_block + 1 < n_tiles:
                    pipelined_step(n_block + 1, n_tiles, acc_s2, acc_s, acc_o, p_frag, stats, stages, kv, at)
        else:
            # Prologue: Q and the first K, V tiles in one copy group.
            copy_tile_async(sq, BM, q_rows, m0, CPR, tid, THREADS)
            if n_tiles > 0:
                copy_tile_async(sk, BN, k_rows, 0, CPR, tid, THREADS)
                copy_tile_async(sv, BN, v_rows, 0, CPR, tid, THREADS)
            ptx.cp_async_commit_group()
            for n_block in range(n_tiles):
                n0 = n_block * BN
                stage = (n_block % 2) * KV_BYTES
                handover()  # tile j landed; everyone is done with tile j-1
                if n_block + 1 < n_tiles:  # prefetch tile j+1 into the other stage
                    other = KV_BYTES - stage
                    copy_tile_async(sk + other, BN, k_rows, n0 + BN, CPR, tid, THREADS)
                    copy_tile_async(sv + other, BN, v_rows, n0 + BN, CPR, tid, THREADS)
                    ptx.cp_async_commit_group()
                issue_s(acc_s, stages.desc_q, hp.descriptor_add(stages.desc_k, stage))
                hp.wgmma_wait_group_0()
                fence_s(acc_s)
                softmax_to_p(acc_s, acc_o, p_frag, stats, n0, at, scale_log2)
                issue_pv(acc_o, p_frag, hp.descriptor_add(stages.desc_v, stage))
                hp.wgmma_wait_group_0()
                fence_o(acc_o)

        # Epilogue (as in the mma.sync kernel): stage rows in the Q tile, 16-byte stores.
        drain_copies()  # the Q copy has landed (a CTA with no KV tile never waited for it),
        # and every warpgroup's wgmma is done reading Q
        stage_output_rows(sq, acc_o, D_N_TILES, BM, warp * 16, stats.l_run, lane, BF16)
        if write_lse:
            store_lse(lse, (batch * heads_q + head) * seqlen_q, row_first, seqlen_q, stats.m_run,
                      stats.l_run, lane)
        cuda.syncwarp()
        scratch = cuda.local.array(4, uint32)
        o_rows = GlobalRows(o, batch * o_sb + head * o_sh, o_ss, seqlen_q)
        store_rows_global(o_rows, row_first, sq, BM, warp * 16, 16, CPR, lane, scratch)

    flash_forward_wgmma.__name__ = (
        f"flash_forward_wgmma_d{D}_m{BM}_n{BN}{'_pipe' if config.pipelined else ''}_"
        f"{'causal' if causal else 'full'}_{dtype}"
    )
    # One CTA per SM is the design point: ptxas may use 65536 / threads registers.
    flash_forward_wgmma.launch_bounds = (THREADS, 1)
    return flash_forward_wgmma
