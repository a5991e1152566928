"""MLA decode on Hopper (issue 58): wgmma on DeepSeek's latent cache, sm_90a.

The problem is ``mla_decode``'s (one latent row a token, 576 values; K the whole row, V its first
512; every query head reads the same rows), and so are the rows, the ring and the launch: a CTA
takes 64 packed query rows (query heads times seqlen_q) of one sequence and one split of its keys,
the K tiles stream through ``mla_decode.make_latent_ring`` (cp.async by every thread, a paged cache
through ``decode_mma.make_page_table``) into 128B-swizzle tiles, the layout wgmma's descriptors read,
and several splits merge in ``decode_mma.make_decode_combine_kernel``.

The products are warpgroup MMAs (``wgmma_gemms.make_attention_gemms``), in two warpgroups that
split O by columns: O is 64 x 512 float32, 256 registers a thread for one warpgroup, 128 for each of
two. Both need P for every key of a tile, so each scores half of the tile's keys (S = Q Kᵀ,
m64n{block_n / 2}k16 over the 576 columns, Q and K from shared memory), and the halves meet in
shared memory twice a tile: the row maxima (each warpgroup's, so that both adopt the same running
max and rescale alike) and P (16-bit A fragments, in fragment order). Then each computes its 256
columns of O += P V over every key (m64n256k16, P from shared memory into registers, V the K tile's
columns of its half read MN-major). The row sums stay each warpgroup's (its keys') until they meet
at the end.

A tile is: the ring's barrier, S, its masks and row maxima, a barrier, the maxima of both, a barrier
(the maxima and P share their shared memory), the softmax, P, a barrier, PV; the next tile's copies
run meanwhile. Causal masking is bottom-right (query i of seqlen_q sees keys j <= L - seqlen_q + i).
At the end each thread writes its rows' columns of O (one split: in the input dtype, with the LSE
from the first warpgroup) or the split's float32 partials and LSE.
"""

from __future__ import annotations

from collections import namedtuple

from numba import cuda, float32, int32, int64, types, uint16, uint32, uint64

from .. import ptx
from ..ptx import hopper as hp
from .common import FULL_MASK, NEG_INF, THRESHOLD, unroll, warp_uniform
from .decode_mma import KeyRows, decode_entry, decode_split, make_decode_rows, make_sequence_source
from .epilogue import log_sum_exp
from .mla_decode import make_latent_ring
from .shapes import WsMlaConfig
from .softmax import (
    exponentiate,
    max_grew,
    pack_16bit,
    pack_p_fragments,
    quad_sum,
    rescale_rows,
    scaled_row_maxes,
)
from .wgmma_gemms import make_attention_gemms

WARPGROUP = 128

# What the rows' writer (``write_row``) reads: the parameters, this warpgroup's O, the running maxima
# and the row sums (both warpgroups' keys), the batch, the block's first row, the rows that exist,
# the split, the warpgroup, its warp (0-3) and the lane.
WsRows = namedtuple("WsRows", ["p", "acc_o", "m_run", "l_run", "b", "r0", "rows_total", "split", "wg", "wq",
                               "lane"])


def make_mla_ws_kernel(config: WsMlaConfig, causal: bool, bf16: bool):
    """The Hopper MLA decode kernel (``params.DECODE``, the MLA kernel's parameters: ``v_cache``,
    ``k_new`` and ``v_new`` are not read, ``heads_kv`` is 1 and ``seqlen_new`` 0): grid
    (num_splits, row_blocks, batch), 256 threads, ``config.shared_bytes`` of dynamic shared memory."""
    config.check()
    BN, BM = config.block_n, config.rows
    RB = config.row_bytes
    DV = config.value_dim
    DVH = config.value_columns  # O's columns a warpgroup
    O_N_TILES = DVH // 8
    KH = BN // 2  # keys a warpgroup scores: its half of the tile
    S_N_TILES = KH // 8
    P_OWN = KH // 16  # P's 16-key slices a warpgroup scores
    P_K_STEPS = BN // 16  # of the tile: PV's k-steps
    V_AT = (DVH // 64) * (BN * RB)  # from a K tile to the second warpgroup's V columns
    P_AT = config.p_at
    ALIGN = config.ALIGN
    CAUSAL = causal
    BF16 = bf16
    rows = make_decode_rows(config, bf16, 0, v_in_k=True)
    PAGE_ROWS = rows.pages.rows
    prepare_q = rows.prepare_q
    ring = make_latent_ring(config, rows, proxy_fence=True)
    sequence_of = make_sequence_source(False, False)
    # S over this warpgroup's half of a tile's keys; PV over every key of it
    issue_s, _, fence_s, _ = make_attention_gemms(config.head_dim, BM, KH, bf16, RB, DVH, k_rows=BN)
    _, issue_pv, _, fence_o = make_attention_gemms(config.head_dim, BM, BN, bf16, RB, DVH)

    @cuda.jit(device=True, forceinline=True)
    def mask_keys(acc_s, key0, lane, total, upper):
        """-inf on the keys from ``key0`` at or past ``total`` and (causal) past each fragment row's
        last key ``upper[r]``."""
        for j in range(S_N_TILES):
            for e in range(4):
                key = key0 + 8 * j + 2 * (lane % 4) + e % 2
                if key >= total or (CAUSAL and key > upper[e // 2]):
                    acc_s[j, e] = NEG_INF

    @cuda.jit(device=True, forceinline=True)
    def write_row(r, at):
        """Fragment row half ``r`` of this thread's O columns (``at``: a WsRows), over the row's sum:
        one split, O in the input dtype (and the LSE, by the first warpgroup); else the split's
        float32 partials and LSE. Unrolled in Python (``write_rows``): O stays in registers."""
        p = at.p
        row = 16 * at.wq + at.lane // 4 + 8 * r
        rr = at.r0 + row
        l_all = at.l_run[r]
        if rr < at.rows_total:
            inv = float32(1.0) / l_all if l_all > 0 else float32(0.0)
            lse = log_sum_exp(at.m_run[r], l_all)
            pos = rr // p.group
            head = rr - pos * p.group
            col0 = at.wg * DVH + 2 * (at.lane % 4)
            row_id = (at.b * p.group + head) * p.seqlen_q + pos  # one KV head: heads_q = group
            if p.num_splits == 1:
                o_at = at.b * p.o_sb + pos * p.o_ss + head * p.o_sh + col0
                for j in range(O_N_TILES):
                    packed = pack_16bit(at.acc_o[j, 2 * r] * inv, at.acc_o[j, 2 * r + 1] * inv, BF16)
                    p.out[uint64(o_at + 8 * j)] = uint16(packed & uint32(0xFFFF))
                    p.out[uint64(o_at + 8 * j + 1)] = uint16(packed >> uint32(16))
                if p.write_lse and at.wg == 0 and at.lane % 4 == 0:
                    p.lse[uint64(row_id)] = lse
            else:
                part = (row_id * p.num_splits + at.split) * DV + col0
                for j in range(O_N_TILES):
                    p.o_part[uint64(part + 8 * j)] = at.acc_o[j, 2 * r] * inv
                    p.o_part[uint64(part + 8 * j + 1)] = at.acc_o[j, 2 * r + 1] * inv
                if at.wg == 0 and at.lane % 4 == 0:
                    p.lse_part[uint64(row_id * p.num_splits + at.split)] = lse

    write_rows = unroll(write_row, 2)

    @cuda.jit(device=True, forceinline=True)
    def meet_rows(smem_f, at, values, wg, wq, lane, combine_max):
        """Both warpgroups' values of this thread's two fragment rows (quad-uniform: the row maxima,
        the row sums) through shared memory at float index ``at``: each writes its own, a barrier,
        ``values[r]`` becomes the max (``combine_max``) or the sum of the two, and a barrier (P,
        written next, shares the place)."""
        for r in range(2):
            if lane % 4 == 0:
                smem_f[at + wg * BM + 16 * wq + lane // 4 + 8 * r] = values[r]
        cuda.syncthreads()
        for r in range(2):
            row = 16 * wq + lane // 4 + 8 * r
            first, second = smem_f[at + row], smem_f[at + BM + row]
            values[r] = max(first, second) if combine_max else first + second
        cuda.syncthreads()

    @cuda.jit(device=True, forceinline=True)
    def share_p(base, p_own, p_all, wg, wq, lane):
        """This warpgroup's P slices into shared memory (slot: 16-key slice of the tile, warp of the
        warpgroup, lane: 16 bytes), a barrier, then every slice of the tile into ``p_all``."""
        for k in range(P_OWN):
            ptx.st_shared_v4(base + P_AT + (((wg * P_OWN + k) * 4 + wq) * 32 + lane) * 16, p_own[k])
        cuda.syncthreads()
        for kk in range(P_K_STEPS):
            ptx.ld_shared_v4(p_all[kk], base + P_AT + ((kk * 4 + wq) * 32 + lane) * 16)

    @cuda.jit(device=True, forceinline=True)
    def run_mla(p, window_left, window_right, cap_scale, sink, cache_batch_idx, cache_leftpad, rotary):
        """The kernel's body (``decode_mma.decode_entry``'s signature; only ``p`` is read)."""
        tid = cuda.threadIdx.x & 1023
        wg = int64(warp_uniform(tid // WARPGROUP))  # (and the tile range below: the wgmma descriptors)
        wq = (tid // 32) % 4  # the warp in its warpgroup: rows 16 * wq ..
        lane = tid % 32
        split = int64(cuda.blockIdx.x)
        row_block = int64(cuda.blockIdx.y)
        b = int64(cuda.blockIdx.z)
        rows_total = p.group * p.seqlen_q
        r0 = row_block * BM
        ptx.grid_dependency_wait()  # sm_90 launches this kernel programmatically: inputs after this
        seq = sequence_of(p, b, None, None, None)
        total = seq.total
        diag = total - p.seqlen_q  # query i sees keys j <= i + diag
        first, last = decode_split((total + BN - 1) // BN, p.num_splits, split)
        first, last = int64(warp_uniform(first)), int64(warp_uniform(last))  # from a loaded length

        raw = ptx.shared_address_u16(cuda.shared.array(0, types.uint16))
        base = (raw + uint32(ALIGN - 1)) & uint32(~(ALIGN - 1) & 0xFFFFFFFF)  # wgmma's swizzle atoms
        ks = KeyRows(ptx.global_address(p.k_cache), p.kc_sb * 2, p.kc_ss * 2, int64(0), int64(0), int64(0))
        prepare_q(base, (ptx.global_address(p.q) + b * p.q_sb * 2, p.q_ss * 2, p.q_sh * 2), int64(0), p.group,
                  rows_total, r0, tid)
        pending = cuda.local.array((PAGE_ROWS, 2), int32)  # paged: the next tile's block-table entries
        ring.fill(base, first, last, seq, ks, tid, pending)

        acc_o = cuda.local.array((O_N_TILES, 4), float32)
        for j in range(O_N_TILES):
            for e in range(4):
                acc_o[j, e] = 0.0
        acc_s = cuda.local.array((S_N_TILES, 4), float32)
        p_own = cuda.local.array((P_OWN, 4), uint32)
        p_all = cuda.local.array((P_K_STEPS, 4), uint32)
        m_run = cuda.local.array(2, float32)
        l_run = cuda.local.array(2, float32)
        mx = cuda.local.array(2, float32)
        upper = cuda.local.array(2, int64)  # causal: the last key each fragment row sees
        for r in range(2):
            m_run[r] = NEG_INF
            l_run[r] = 0.0
            upper[r] = diag + (r0 + 16 * wq + lane // 4 + 8 * r) // p.group
        smem_f = cuda.shared.array(0, float32)
        meet_at = (base - raw + P_AT) // 4  # float index of P's tile, where rows meet
        desc_q = hp.smem_descriptor_k_sw128(base)
        for t in range(first, last):
            sk = ring.advance(base, t, first, last, seq, ks, tid, pending)
            issue_s(acc_s, desc_q, hp.smem_descriptor_k_sw128(sk + wg * KH * RB))  # this half's keys
            hp.wgmma_wait_group_0()
            fence_s(acc_s)
            key0 = t * BN + wg * KH
            if key0 + KH > total or (CAUSAL and key0 + KH - 1 > diag + (r0 + 16 * wq) // p.group):
                mask_keys(acc_s, key0, lane, total, upper)
            scaled_row_maxes(acc_s, S_N_TILES, mx, p.scale_log2)
            meet_rows(smem_f, meet_at, mx, wg, wq, lane, True)  # the tile's row maxima, both halves
            if cuda.any_sync(FULL_MASK, max_grew(mx, m_run, THRESHOLD)):  # alike in both warpgroups
                rescale_rows(acc_o, O_N_TILES, m_run, l_run, mx)
            exponentiate(acc_s, S_N_TILES, m_run, l_run, p.scale_log2)
            pack_p_fragments(p_own, acc_s, P_OWN, BF16)
            share_p(base, p_own, p_all, wg, wq, lane)
            issue_pv(acc_o, p_all, hp.smem_descriptor_mn_sw128(sk + wg * V_AT, BN * RB), 1)
            hp.wgmma_wait_group_0()
            fence_o(acc_o)

        ptx.grid_launch_dependents()  # the combine kernel (sm_90: launched programmatically) may start
        ptx.cp_async_wait_group_0()  # a split with no tile still has Q's copies in flight
        for r in range(2):
            l_run[r] = quad_sum(l_run[r])
        cuda.syncthreads()  # every warp is done with the last P
        meet_rows(smem_f, meet_at, l_run, wg, wq, lane, False)  # the row sums over both halves' keys
        write_rows(WsRows(p, acc_o, m_run, l_run, b, r0, rows_total, split, wg, wq, lane))

    kernel = decode_entry(run_mla, False)
    kernel.__name__ = (f"flash_mla_decode_d{config.head_dim}v{DV}{config.tag}_"
                       f"{'causal' if causal else 'full'}_{'bf16' if BF16 else 'f16'}")
    kernel.launch_bounds = (config.threads, 1)
    return kernel
