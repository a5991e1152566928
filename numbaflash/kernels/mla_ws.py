"""MLA decode on Hopper (issue 58): wgmma on DeepSeek's latent cache, sm_90a.

The problem is ``mla_decode``'s (one latent row a token, 576 values; K the whole row, V its first
512; every query head reads the same rows), and so are the rows and the launch: a CTA takes 64
packed query rows (query heads times seqlen_q) of one sequence and one split of its keys, and
several splits merge in ``decode_mma.make_decode_combine_kernel``.

Two warpgroups split O by columns (64 x 512 float32: 128 registers a thread for each half) and take
the split's 64-key tiles in pairs: warpgroup 0 owns tiles first, first + 2, .. in stage 0 of the
ring, warpgroup 1 tiles first + 1, first + 3, .. in stage 1. Each copies its own tile (cp.async by
its 128 threads, ``decode_mma.make_decode_rows`` seen with 128 threads; a paged cache through
``decode_mma.make_page_table``) into the 128B-swizzle layout wgmma's descriptors read, and scores
it whole (S = Q Kᵀ, m64n64k16 over the 576 columns, Q and K from shared memory). A pair is:

    each: wait for its own tile (its copies, a warpgroup barrier), S, masks, row maxima
    CTA barrier: the pair's row maxima meet; both adopt the common max (so neither rescales the
        other's P), rescale O's half and the row sums alike
    each: P of its own tile, into that tile's rotary columns (S has retired: nothing else reads
        them), and (paged) the page rows of its next tile
    CTA barrier: each takes the other's P
    each: O_half += P_A V_A + P_B V_B (m64n256k16, P from registers, V the tiles' columns of its
        half read MN-major); warpgroup 0 refills stage 0 once both have retired P_A V_A, warpgroup
        1 stage 1 once both have retired P_B V_B (a named barrier each way)

An odd last tile leaves warpgroup 1 without one: its maxima are -inf and its P products skipped.
Against the first build (each warpgroup half of every tile's keys, m64n32, four CTA barriers a tile)
the pair takes two barriers for two tiles: 128 heads 198 -> 181 µs, the 2-token causal row 406 -> 342
(docs/PERFORMANCE.md [MLAP]). Causal masking is bottom-right (query i of seqlen_q sees keys j <= L -
seqlen_q + i). At the end each thread writes its rows' columns of O (one split: in the input dtype,
with the LSE from the first warpgroup) or the split's float32 partials and LSE.
"""

from __future__ import annotations

from collections import namedtuple
from typing import ClassVar

from numba import cuda, float32, int32, int64, types, uint16, uint32, uint64

from .. import ptx
from ..ptx import hopper as hp
from .common import FULL_MASK, NEG_INF, THRESHOLD, unroll, warp_uniform
from .decode_mma import KeyRows, decode_entry, decode_split, make_decode_rows, make_sequence_source
from .epilogue import log_sum_exp
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
# Named barriers (0 is the CTA's): LANDED + w, warpgroup w's copies of its tile have landed (128
# threads); A_FREE and B_FREE, both warpgroups have retired their P V product of stage 0 or 1 (the
# other warpgroup arrives, the refilling one waits)
LANDED, A_FREE, B_FREE = 1, 3, 4

# What the rows' writer (``write_row``) reads: the parameters, this warpgroup's O, the running maxima
# and the row sums (both warpgroups' keys), the batch, the block's first row, the rows that exist,
# the split, the warpgroup, its warp (0-3) and the lane.
WsRows = namedtuple("WsRows", ["p", "acc_o", "m_run", "l_run", "b", "r0", "rows_total", "split", "wg", "wq",
                               "lane"])


class _WarpgroupCopies(WsMlaConfig):
    """The config as a tile's copies see it: one warpgroup's 128 threads walk a tile."""

    num_warps: ClassVar[int] = 4


def make_rows_out(config: WsMlaConfig, bf16: bool):
    """``write_rows(WsRows)``, the rows' writer at the end, and ``meet_rows(smem_f, at, values, wg, wq,
    lane, combine_max)``, where the two warpgroups' values of a fragment row meet."""
    BM = config.rows
    DV = config.value_dim
    DVH = config.value_columns
    O_N_TILES = DVH // 8
    BF16 = bf16

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
        """Both warpgroups' values of this thread's two fragment rows (quad-uniform: a pair's row
        maxima, the row sums at the end) through shared memory at float index ``at``: each writes its
        own, a CTA barrier, and ``values[r]`` becomes the max (``combine_max``) or the sum of the two.
        The next write waits for a barrier of the caller's."""
        for r in range(2):
            if lane % 4 == 0:
                smem_f[at + wg * BM + 16 * wq + lane // 4 + 8 * r] = values[r]
        cuda.syncthreads()
        for r in range(2):
            row = 16 * wq + lane // 4 + 8 * r
            first, second = smem_f[at + row], smem_f[at + BM + row]
            values[r] = max(first, second) if combine_max else first + second

    return write_rows, meet_rows


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
    S_N_TILES = BN // 8  # S's n-tiles: a warpgroup scores a whole tile
    P_K_STEPS = BN // 16  # PV's k-steps
    V_AT = (DVH // 64) * (BN * RB)  # from a K tile to the second warpgroup's V columns
    P_AT = config.p_at
    RING = config.ring_at
    STAGE_BYTES = config.stage_bytes
    PAGE_ROWS_AT = config.page_rows_at
    PAGED = config.paged
    P_IN_STAGE = (config.head_dim // 64 - 1) * BN * RB  # the rotary columns' block of a K tile
    ALIGN = config.ALIGN
    CAUSAL = causal
    BF16 = bf16
    prepare_q = make_decode_rows(config, bf16, 0, v_in_k=True).prepare_q  # Q: every thread's copies
    half = make_decode_rows(_WarpgroupCopies(paged=PAGED), bf16, 0, v_in_k=True)  # a tile: a warpgroup's
    load_half, fetch_half, publish_half = half.load_tiles, half.pages.fetch_pages, half.pages.publish_pages
    sequence_of = make_sequence_source(False, False)
    issue_s, issue_pv, fence_s, fence_o = make_attention_gemms(config.head_dim, BM, BN, bf16, RB, DVH)
    write_rows, meet_rows = make_rows_out(config, bf16)

    @cuda.jit(device=True, forceinline=True)
    def copy_tile(stage, tile, last, seq, ks, wt, pending, page_rows):
        """This warpgroup's copies of K tile ``tile`` into its stage (a copy group; paged: from the
        rows published before a CTA barrier, then the block-table look-up of its next tile)."""
        load_half(stage, tile * BN, seq, ks, ks, wt, False, page_rows, pending)
        ptx.cp_async_commit_group()
        if PAGED and tile + 2 < last:
            fetch_half(pending, (tile + 2) * BN, seq, wt)

    @cuda.jit(device=True, forceinline=True)
    def p_slot(k, wq, lane):
        """Where this lane's P fragment of 16-key slice ``k`` sits in a tile's rotary block (bytes from
        the stage): [slice][warp of the warpgroup][lane] x 16 bytes, so the other warpgroup's lane of
        the same warp and rows reads what this one wrote."""
        return P_IN_STAGE + ((k * 4 + wq) * 32 + lane) * 16

    @cuda.jit(device=True, forceinline=True)
    def mask_keys(acc_s, key0, lane, total, upper):
        """-inf on the keys from ``key0`` (a tile) at or past ``total`` and (causal) past each fragment
        row's last key ``upper[r]``."""
        for j in range(S_N_TILES):
            for e in range(4):
                key = key0 + 8 * j + 2 * (lane % 4) + e % 2
                if key >= total or (CAUSAL and key > upper[e // 2]):
                    acc_s[j, e] = NEG_INF

    @cuda.jit(device=True, forceinline=True)
    def run_mla(p, window_left, window_right, cap_scale, sink, cache_batch_idx, cache_leftpad, rotary):
        """The kernel's body (``decode_mma.decode_entry``'s signature; only ``p`` is read): the pairs
        of the module's docstring."""
        tid = cuda.threadIdx.x & 1023
        wg = int64(warp_uniform(tid // WARPGROUP))  # (and the tile range below: the wgmma descriptors)
        wq = (tid // 32) % 4  # the warp in its warpgroup: rows 16 * wq ..
        lane = tid % 32
        wt = tid % WARPGROUP  # the thread in its warpgroup: its share of the warpgroup's copies
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
        stage = base + RING + uint32(wg * STAGE_BYTES)  # this warpgroup's: tiles first + wg, + 2, ..
        other = base + RING + uint32((1 - wg) * STAGE_BYTES)  # the other warpgroup's
        page_rows = base + PAGE_ROWS_AT + uint32(wg * BN * 16)
        pending = cuda.local.array((1, 2), int32)  # paged: the block-table entry of the next tile's row
        if PAGED:
            if first + wg < last:
                fetch_half(pending, (first + wg) * BN, seq, wt)
                publish_half(page_rows, pending, ks, ks, wt)
            cuda.syncthreads()
        if first + wg < last:
            copy_tile(stage, first + wg, last, seq, ks, wt, pending, page_rows)
        ptx.cp_async_wait_group_0()  # Q (every thread's) and the first pair
        hp.fence_proxy_async_shared_cta()
        cuda.syncthreads()

        acc_o = cuda.local.array((O_N_TILES, 4), float32)
        for j in range(O_N_TILES):
            for e in range(4):
                acc_o[j, e] = 0.0
        acc_s = cuda.local.array((S_N_TILES, 4), float32)
        p_own = cuda.local.array((P_K_STEPS, 4), uint32)
        p_other = cuda.local.array((P_K_STEPS, 4), uint32)
        p_a = cuda.local.array((P_K_STEPS, 4), uint32)
        p_b = cuda.local.array((P_K_STEPS, 4), uint32)
        m_run = cuda.local.array(2, float32)
        l_run = cuda.local.array(2, float32)
        mx = cuda.local.array(2, float32)
        upper = cuda.local.array(2, int64)  # causal: the last key each fragment row sees
        for r in range(2):
            m_run[r] = NEG_INF
            l_run[r] = 0.0
            upper[r] = diag + (r0 + 16 * wq + lane // 4 + 8 * r) // p.group
        smem_f = cuda.shared.array(0, float32)
        meet_at = (base - raw + P_AT) // 4  # float index of the tile where rows meet
        desc_q = hp.smem_descriptor_k_sw128(base)
        stage_a = base + RING
        stage_b = stage_a + STAGE_BYTES
        for t in range(first, last, 2):
            has_b = t + 1 < last
            own = wg == 0 or has_b
            more = t + 2 < last  # a next pair: both stages are handed over
            if t > first:  # this warpgroup's tile has landed (the first pair's: waited above)
                ptx.cp_async_wait_group_0()
                hp.fence_proxy_async_shared_cta()
                hp.named_barrier_sync(LANDED + wg, WARPGROUP)
            if own:
                issue_s(acc_s, desc_q, hp.smem_descriptor_k_sw128(stage))
                hp.wgmma_wait_group_0()
                fence_s(acc_s)
                key0 = (t + wg) * BN
                if key0 + BN > total or (CAUSAL and key0 + BN - 1 > diag + (r0 + 16 * wq) // p.group):
                    mask_keys(acc_s, key0, lane, total, upper)
                scaled_row_maxes(acc_s, S_N_TILES, mx, p.scale_log2)
            else:
                mx[0] = NEG_INF
                mx[1] = NEG_INF
            meet_rows(smem_f, meet_at, mx, wg, wq, lane, True)  # the pair's row maxima
            if cuda.any_sync(FULL_MASK, max_grew(mx, m_run, THRESHOLD)):  # alike in both warpgroups
                rescale_rows(acc_o, O_N_TILES, m_run, l_run, mx)
            if own:
                exponentiate(acc_s, S_N_TILES, m_run, l_run, p.scale_log2)
                pack_p_fragments(p_own, acc_s, P_K_STEPS, BF16)
                for k in range(P_K_STEPS):
                    ptx.st_shared_v4(stage + p_slot(k, wq, lane), p_own[k])
            if PAGED and t + 2 + wg < last:  # the rows of this warpgroup's next tile, for its copies
                publish_half(page_rows, pending, ks, ks, wt)
            cuda.syncthreads()
            if wg == 1 or has_b:  # the other warpgroup's P
                for k in range(P_K_STEPS):
                    ptx.ld_shared_v4(p_other[k], other + p_slot(k, wq, lane))
            for k in range(P_K_STEPS):
                for e in range(4):
                    p_a[k, e] = p_own[k, e] if wg == 0 else p_other[k, e]
                    p_b[k, e] = p_other[k, e] if wg == 0 else p_own[k, e]
            issue_pv(acc_o, p_a, hp.smem_descriptor_mn_sw128(stage_a + wg * V_AT, BN * RB), 1)
            if has_b:
                issue_pv(acc_o, p_b, hp.smem_descriptor_mn_sw128(stage_b + wg * V_AT, BN * RB), 1)
                hp.wgmma_wait_group_1()  # A's product has retired
            else:
                hp.wgmma_wait_group_0()
            if more:  # A's stage takes tile t + 2 once both warpgroups are past A
                if wg == 1:
                    hp.named_barrier_arrive(A_FREE, 2 * WARPGROUP)
                else:
                    hp.named_barrier_sync(A_FREE, 2 * WARPGROUP)
                    copy_tile(stage, t + 2, last, seq, ks, wt, pending, page_rows)
            hp.wgmma_wait_group_0()
            fence_o(acc_o)
            if more:  # B's stage takes tile t + 3 likewise (the hand-over even with no tile t + 3: each
                # warpgroup then waits once for the other a pair, which racecheck needs to see)
                if wg == 0:
                    hp.named_barrier_arrive(B_FREE, 2 * WARPGROUP)
                else:
                    hp.named_barrier_sync(B_FREE, 2 * WARPGROUP)
                    if t + 3 < last:
                        copy_tile(stage, t + 3, last, seq, ks, wt, pending, page_rows)

        ptx.grid_launch_dependents()  # the combine kernel (sm_90: launched programmatically) may start
        ptx.cp_async_wait_group_0()  # a split with no tile still has Q's copies in flight
        for r in range(2):
            l_run[r] = quad_sum(l_run[r])
        cuda.syncthreads()  # every warp is done with the last pair's maxima
        meet_rows(smem_f, meet_at, l_run, wg, wq, lane, False)  # the row sums over both warpgroups' keys
        write_rows(WsRows(p, acc_o, m_run, l_run, b, r0, rows_total, split, wg, wq, lane))

    kernel = decode_entry(run_mla, False)
    kernel.__name__ = (f"flash_mla_decode_d{config.head_dim}v{DV}{config.tag}_"
                       f"{'causal' if causal else 'full'}_{'bf16' if BF16 else 'f16'}")
    kernel.launch_bounds = (config.threads, 1)
    return kernel
