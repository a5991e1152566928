"""FlashAttention-2 forward on tensor cores with cp.async + ldmatrix + mma.sync (sm_80+).

One CTA computes ``block_m`` query rows of one (batch, head); each of its warps owns 16 rows
per m-tile and keeps their Q fragments in registers for the whole KV loop (head_dim <= 128;
at 256, whose O accumulator alone is 128 registers per m-tile, it reloads them from the Q
tile one 16-column k-tile at a time inside S = Q Kᵀ). K and V tiles of
``block_n`` keys stream through swizzled shared memory with cp.async; the copy of V_j
overlaps S = Q K_jᵀ and the copy of K_{j+1} overlaps O += P V_j. The softmax runs online
in the exp2 domain with the scale folded into one FFMA; P becomes the A operand of the PV
product in registers; O is rescaled only when a row max grows (``common.THRESHOLD``) and is
normalised once at the end, then written through shared memory with 16-byte stores.

With ``config.interleave_pv`` (the shipped d64 kernels) V_j is waited for right after S_j, and
the exponentials of each 16-key slice are followed by that slice's PV mma.sync with no barrier
in between, so that ptxas interleaves a warp's MUFU work with its tensor-core work.

Tiles are stored as 64-column blocks of 128-byte rows when head_dim is a multiple of 64, else
(32, 96) as 32-column blocks of 64-byte rows (``smem``); head dims 32, 64, 96, 128, 256. V's head
dim may be smaller than Q's and K's (``ForwardConfig.head_dim_v``, e.g. (192, 128)): the V tile, O
and its epilogue are then that wide (``value_dim``), Q and K and S = Q Kᵀ are not.

Two compile-time variants (issue 35), built only when a call asks for them: ``window`` (a sliding
window, FlashAttention's ``window_size``: the KV loop runs over the tiles between the block's
window edges only, ``blocks.band_kv_tiles``, and edge tiles are masked by ``blocks.mask_band``;
the window's sizes are kernel arguments) and ``softcap`` (scores become tanh(QKᵀ · scale /
softcap) before the softmax, whose exponent factor is then softcap·log2(e): ``softmax.cap_scores``;
the factor is a kernel argument). A kernel built without them compiles to the same code as
before they existed: their arguments are never read.

A third, ``varlen`` (packed variable-length batches, ``flash_attention_varlen``), is a kernel of its
own parameter list (``params.VARLEN_FORWARD``): the plain parameters, then the int32 cumulative offsets
of the sequences' queries and keys (batch + 1,) and the LSE's head stride (total_q). It calls the
same body as a device function, with a ``Sequences`` record in the ``batch_size`` slot: grid z is
the sequence, whose rows start at ``cu_seqlens_q[b]`` (two int32 loads each for q and k), and
whose own lengths replace seqlen_q and seqlen_k (so masks, causal diagonal and window are per
sequence, and no tile reads or writes a row of another sequence); a query block past its
sequence's end returns at once. The LSE is (heads_q, total_q). The other builds never see it.

A fourth, ``sink`` (a learnable sink, FlashAttention-4's ``learnable_sink``), takes the float32
(heads_q,) logits last (``params.SINK``) and starts each row's online softmax at its head's logit
(``softmax.start_at_sink``): the loop and the epilogue are the plain ones. Every build's kernel is
the body's entry, generated from its declaration (``params.entry``).

A fifth, the e4m3 build (``config.fp8``, sm_89 on: FP8 on Ada and Blackwell; ``operations.fp8_forward``),
runs both products as mma.sync m16n8k32 e4m3: the Q and K tiles (head_dim bytes a row) are described
to ``mma_pieces`` as 16-bit tiles of half the columns, whose fragments are the 8-bit ones; V arrives
transposed with its keys in ``fp8_layout.KEY_ORDER`` (the Hopper build's prep), so O += P V is the
same product again with P's e4m3 fragments resident and the V tile's head-dim rows as the B tile; the
descales of q and k scale the exponent (or softcap) factor, v's O. Dense calls only.

The kernel is built from rooms, each returning its named steps: ``make_row_source`` (dense or
varlen rows), ``make_kv_step`` (one KV tile: copies, and the QK / PV steps, online softmax and
masker of ``mma_pieces``, which the decode kernel shares) and ``make_forward_epilogue``.
"""

from __future__ import annotations

from collections import namedtuple

from numba import cuda, float32, int64, types, uint32

from .. import ptx
from . import params
from .blocks import Band, ScoreMask, band_kv_tiles, query_block, visible_kv_tiles
from .common import NEG_INF, keep_in_register
from .epilogue import stage_output_rows, store_lse, store_rows_global
from .fp8_layout import Descales
from .mma_pieces import MmaShape, make_masker, make_online_softmax, make_pv_steps, make_qk_steps
from .shapes import ForwardConfig
from .smem import GlobalRows, copy_tile_async, drain_copies, global_rows, ldmatrix_offsets, load_a_fragments
from .softmax import P_SCALE_E4M3, scale_o_rows, sink_logit

# What a varlen kernel passes in the body's ``batch_size`` slot: the number of sequences, the
# int32 cumulative offsets of their queries and keys (count + 1,), and the LSE's head stride.
Sequences = namedtuple("Sequences", ["count", "cu_seqlens_q", "cu_seqlens_k", "lse_head_stride"])
# Where a CTA's rows are (``make_row_source``): whether it has any, the first query and key rows
# of its sequence (0 for a dense batch), and the sequence's lengths.
Span = namedtuple("Span", ["present", "start_q", "start_k", "seqlen_q", "seqlen_k"])
# The row source's steps: the CTA's Span, a tensor's GlobalRows, the LSE's first element.
RowSource = namedtuple("RowSource", ["locate", "rows_of", "lse_base"])
# What one KV tile's step (``make_kv_step``) reads: the loop's extent (n_tiles from tile kv_first),
# the thread, the shared K and V tiles and the warp's Q rows, K's and V's GlobalRows and ldmatrix
# offsets, the fragments (S, O, Q, P, K/V), the softmax state (running maxes and sums, scratch),
# the two exponent factors, the warp's ScoreMask and the window's Band.
KvLoop = namedtuple("KvLoop", ["n_tiles", "kv_first", "tid", "sk", "sv", "q_warp", "k_rows", "v_rows",
                               "k_offsets", "v_offsets", "acc_s", "acc_o", "q_frag", "p_frag", "b_frag",
                               "m_run", "l_run", "mx", "scale_log2", "cap_scale", "at", "band"])
# One KV tile's room (``make_kv_step``): the softmax state's start (``SoftmaxSteps.start_rows``) and
# the tile's step.
KvStep = namedtuple("KvStep", ["start_rows", "attend_tile"])
# Where the epilogue writes (``make_forward_epilogue``): O and its strides, the LSE and whether
# to write it, heads_q, and the body's ``batch_size`` slot (a Sequences for varlen kernels).
OutRows = namedtuple("OutRows", ["o", "o_sb", "o_ss", "o_sh", "lse", "write_lse", "heads_q", "seqs"])
# The warp's block in the epilogue: the CTA's Span, batch and head, the shared Q tile (staging),
# the warp's first row in it and in the sequence, and the lane.
WarpRows = namedtuple("WarpRows", ["span", "batch", "head", "sq", "warp_row", "row_first", "lane"])


def forward_shape(config: ForwardConfig) -> MmaShape:
    """The pieces' shape of a forward config: a warp takes every key of a tile. An e4m3 config's
    Q and K tiles are described as 16-bit tiles of half the columns (``make_qk_steps``' ``fp8``),
    O keeps its ``head_dim`` 16-bit columns (``value_dim``)."""
    if config.fp8:
        return MmaShape(config.head_dim // 2, config.block_m, config.block_n, config.block_n,
                        config.warp_m_tiles, config.row_bytes, config.head_dim)
    return MmaShape(config.head_dim, config.block_m, config.block_n, config.block_n, config.warp_m_tiles,
                    128 if config.head_dim % 64 == 0 else 64, config.head_dim_v)


def vt_shape(config: ForwardConfig) -> MmaShape:
    """An e4m3 config's O += P V as ``make_qk_steps`` sees it: P's fragments resident (the "Q" of
    ``block_n`` bytes a row, 32 keys a k-step), the transposed V tile (``head_dim`` rows of
    ``block_n`` keys, ``fp8_layout``) the B tile whose ``head_dim`` rows are O's columns."""
    return MmaShape(config.block_n // 2, config.block_m, config.head_dim, config.head_dim,
                    config.warp_m_tiles, config.vt_row_bytes)


def interleaves(config: ForwardConfig, softcap: bool) -> bool:
    """Whether the kernel interleaves the softmax with PV. With a softcap the interleaved
    order spills (d64 128 x 128: 34 LDL/STL at sm_80, the tanh pass on top of a 255-register
    kernel): softcap kernels run the plain order instead."""
    return config.interleave_pv and not softcap


def make_row_source(varlen: bool) -> RowSource:
    """Where a CTA's rows are: a dense batch (``batch_size`` an int), or with ``varlen`` packed
    sequences (``batch_size`` a Sequences: the CTA's sequence is grid z, its rows start at its
    cumulative offsets and its own lengths replace seqlen_q and seqlen_k)."""
    VARLEN = varlen

    @cuda.jit(device=True, forceinline=True)
    def locate(batch_size, batch, m0, seqlen_q, seqlen_k):
        """The Span of the CTA's query block from row ``m0`` of batch (or sequence) ``batch``:
        not present past the last (batch, head) pair of a folded grid, nor (varlen) past its
        sequence's queries (or for an empty sequence). Two int32 loads each for q and k."""
        if VARLEN:
            seqs = batch_size
            if batch >= seqs.count:
                return Span(False, int64(0), int64(0), seqlen_q, seqlen_k)
            start_q = int64(seqs.cu_seqlens_q[batch])
            seqlen_q = int64(seqs.cu_seqlens_q[batch + 1]) - start_q
            if m0 >= seqlen_q:
                return Span(False, start_q, int64(0), seqlen_q, seqlen_k)
            start_k = int64(seqs.cu_seqlens_k[batch])
            seqlen_k = int64(seqs.cu_seqlens_k[batch + 1]) - start_k
            return Span(True, start_q, start_k, seqlen_q, seqlen_k)
        return Span(batch < batch_size, int64(0), int64(0), seqlen_q, seqlen_k)

    @cuda.jit(device=True, forceinline=True)
    def rows_of(t, start, batch, sb, ss, sh, head, num_rows):
        """The GlobalRows of ``head`` of tensor ``t`` (strides ``sb``, ``ss``, ``sh``): of batch
        ``batch``, or (varlen: a sequence's rows hold no batch stride) from row ``start``."""
        if VARLEN:
            return global_rows(t, start * ss + head * sh, ss, num_rows)
        return global_rows(t, batch * sb + head * sh, ss, num_rows)

    @cuda.jit(device=True, forceinline=True)
    def lse_base(seqs, span, batch, head, heads_q):
        """The LSE element of the CTA's head's row 0: (batch, heads_q, seqlen_q), or for varlen
        (heads_q, total_q), rows at the sequence's global index."""
        if VARLEN:
            return head * seqs.lse_head_stride + span.start_q
        return (batch * heads_q + head) * span.seqlen_q

    return RowSource(locate, rows_of, lse_base)


def make_kv_step(config: ForwardConfig, causal: bool, bf16: bool, window: bool = False,
                 softcap: bool = False, sink: bool = False) -> KvStep:
    """One KV tile of the loop, ``attend_tile(n_block, loop)`` (``loop``: a KvLoop): V_j's copy,
    S = Q K_jᵀ, K_{j+1}'s copy, softcap and masks, the online softmax and O += P V_j; and
    ``start_rows(m_run, l_run, logit)``, the softmax state before the first tile (with ``sink``:
    the learnable sink's term, ``logit`` its ``softmax.sink_logit``).

    The copy of V_j overlaps S = Q K_jᵀ and the copy of K_{j+1} overlaps O += P V_j (with
    ``early_k`` or ``interleave_pv``: the softmax too)."""
    shape = forward_shape(config)
    BN = config.block_n
    D = config.head_dim
    THREADS = config.threads
    CPR = config.head_dim * config.element_bytes // 16  # 16-byte chunks per row of K
    CPR_V = config.value_dim // 8  # of V
    RB = shape.row_bytes
    INTERLEAVE = interleaves(config, softcap)
    EARLY_K = config.early_k
    SOFTCAP = softcap
    FP8 = config.fp8
    qk = make_qk_steps(shape, config.q_in_regs, config.double_buffer, bf16, fp8=FP8)
    if FP8:  # O += P V on P's resident fragments and the transposed V tile (``vt_shape``)
        vt = vt_shape(config)
        RB_V, CPR_VT = vt.row_bytes, BN // 16
        pv = None
        pv_accumulate = make_qk_steps(vt, True, False, bf16, fp8=True, accumulate=True).qk_scores
    else:
        pv = make_pv_steps(shape, config.double_buffer, bf16)
        pv_accumulate = pv.pv_accumulate
    softmax = make_online_softmax(shape, bf16, pv, config.double_buffer, sink, fp8=FP8)
    masker = make_masker(shape, causal, window)
    qk_scores = qk.qk_scores
    online_softmax, softmax_into_pv, cap = softmax.online_softmax, softmax.softmax_into_pv, softmax.cap
    mask_tile = masker.mask_tile

    @cuda.jit(device=True, forceinline=True)
    def attend_tile(n_block, loop):
        n0 = (loop.kv_first + n_block) * BN
        # 0, but not provably so: the copies' per-pass shared addresses then stay base +
        # immediate instead of being hoisted out of the loop into registers (which spill).
        zero = uint32(n0 >> 62)
        tid, sk, sv = loop.tid, loop.sk, loop.sv
        acc_s, acc_o = loop.acc_s, loop.acc_o
        ptx.cp_async_wait_group_0()  # K_j has landed ...
        cuda.syncthreads()  # ... for everyone, and every warp is done with V_{j-1}
        if FP8:  # the transposed V's head-dim rows, keys n0 .. n0 + BN (bytes)
            vt_rows = GlobalRows(loop.v_rows.address + n0, loop.v_rows.stride, loop.v_rows.num_rows)
            copy_tile_async(sv + zero, D, vt_rows, 0, CPR_VT, tid, THREADS, RB_V)
        else:
            copy_tile_async(sv + zero, BN, loop.v_rows, n0, CPR_V, tid, THREADS, RB)
        ptx.cp_async_commit_group()

        qk_scores(acc_s, loop.q_frag, loop.q_warp + zero, loop.v_offsets, sk, loop.k_offsets, loop.b_frag, 0)
        if INTERLEAVE:
            ptx.cp_async_wait_group_0()  # V_j has landed (the barrier below: for everyone)
        if INTERLEAVE or EARLY_K:
            cuda.syncthreads()  # every warp is done with K_j: K_{j+1} overlaps the softmax
            if n_block + 1 < loop.n_tiles:
                copy_tile_async(sk + zero, BN, loop.k_rows, n0 + BN, CPR, tid, THREADS, RB)
            ptx.cp_async_commit_group()  # (empty on the last tile: the waits stay right)
        if SOFTCAP:  # before the masks: tanh(-inf) is not -inf
            cap(acc_s, loop.cap_scale)
        mask_tile(acc_s, n0, loop.at, loop.band)
        if INTERLEAVE:
            softmax_into_pv(acc_s, acc_o, loop.p_frag, loop.m_run, loop.l_run, loop.mx, loop.scale_log2, sv,
                            loop.v_offsets, loop.b_frag)
        else:
            online_softmax(acc_s, acc_o, loop.p_frag, loop.m_run, loop.l_run, loop.mx, loop.scale_log2)
            if EARLY_K:
                ptx.cp_async_wait_group_1()  # V_j has landed (K_{j+1} may still be in flight) ...
                cuda.syncthreads()  # ... for everyone
            else:
                ptx.cp_async_wait_group_0()  # V_j has landed ...
                cuda.syncthreads()  # ... for everyone, and every warp is done with K_j
                if n_block + 1 < loop.n_tiles:
                    copy_tile_async(sk + zero, BN, loop.k_rows, n0 + BN, CPR, tid, THREADS, RB)
                    ptx.cp_async_commit_group()
            if FP8:  # (P's fragments are resident: the "Q" tile and offsets are not read)
                pv_accumulate(acc_o, loop.p_frag, sv, loop.v_offsets, sv, loop.v_offsets, loop.b_frag, 0)
            else:
                pv_accumulate(acc_o, loop.p_frag, sv, loop.v_offsets, loop.b_frag, 0)

    return KvStep(softmax.start_rows, attend_tile)


def make_forward_epilogue(config: ForwardConfig, bf16: bool, rows: RowSource):
    """``finish(acc_o, m_run, l_run, out, at)`` (``out``: OutRows, ``at``: WarpRows): normalise,
    stage this warp's rows in its own part of the Q tile, then 16-byte coalesced stores, and the
    LSE. Rows with no visible key give 0 and LSE -inf (with a learnable sink: the sink)."""
    BM = config.block_m
    MT = config.warp_m_tiles
    D_N_TILES = config.value_dim // 8  # of O
    CPR = config.value_dim // 8
    RB = config.o_row_bytes  # O's 16-bit rows (an e4m3 Q tile's rows are half as wide)
    BF16 = bf16
    rows_of, lse_base = rows.rows_of, rows.lse_base

    @cuda.jit(device=True, forceinline=True)
    def finish(acc_o, m_run, l_run, out, at):
        drain_copies()  # no copy may land on the staged rows (none is in flight today)
        span = at.span
        for mt in range(MT):
            stage_output_rows(at.sq, acc_o[mt], D_N_TILES, BM, at.warp_row + 16 * mt, l_run[mt], at.lane,
                              BF16, RB)
            if out.write_lse:
                store_lse(out.lse, lse_base(out.seqs, span, at.batch, at.head, out.heads_q),
                          at.row_first + 16 * mt, span.seqlen_q, m_run[mt], l_run[mt], at.lane)
        cuda.syncwarp()
        scratch = cuda.local.array(4, uint32)
        o_rows = rows_of(out.o, span.start_q, at.batch, out.o_sb, out.o_ss, out.o_sh, at.head, span.seqlen_q)
        store_rows_global(o_rows, at.row_first, at.sq, BM, at.warp_row, 16 * MT, CPR, at.lane, scratch, RB)

    return finish


def make_forward_kernel(config: ForwardConfig, causal: bool, bf16: bool, window: bool = False,
                        softcap: bool = False, varlen: bool = False, sink: bool = False):
    """Return the Python kernel function for ``config`` (its parameters: ``params.FORWARD``).

    Launch: grid ``launch_forward.forward_grid``, ``config.threads`` threads,
    ``config.shared_bytes`` bytes of dynamic shared memory.

    ``window``: a sliding-window kernel (``window_left`` / ``window_right`` arguments, each >= 0;
    ``causal`` must then be False: the window's right edge 0 is causal masking). ``softcap``:
    scores capped by tanh (``cap_scale`` argument = softmax_scale / softcap, and ``scale_log2`` =
    softcap·log2(e)). Kernels without them never read those arguments. ``varlen``: the packed
    variable-length kernel (``params.VARLEN_FORWARD``; grid
    ``launch_forward.forward_grid(query blocks of max_seqlen_q, heads_q, batch)``). ``sink``: a
    learnable sink (``params.SINK`` last: float32 (heads_q,) logits), which starts each row's
    softmax (``make_kv_step``'s ``start_rows``); kernels without it compile as before it existed.

    The body (``flash_forward``, a device function) takes every build's parameters and the sink
    (None where there is none); the kernel is its entry, generated from the declaration
    (``params.entry``).
    """
    if window and causal:
        raise ValueError("a window kernel's causal masking is its right edge 0: build it with causal=False")
    if config.fp8 and varlen:  # a sequence's last V tile would read the next sequence's columns
        raise NotImplementedError(f"{config} has no packed (varlen) build: packed e4m3 calls run the Hopper "
                                  "kernel")
    config.check()
    D = config.head_dim
    BM = config.block_m
    BN = config.block_n
    MT = config.warp_m_tiles
    THREADS = config.threads
    EB = config.element_bytes
    CPR = D * EB // 16  # 16-byte chunks per row of Q and K
    RB = config.row_bytes  # bytes per row of a swizzle column block of Q and K (smem)
    Q_RESIDENT = config.q_in_regs  # Q fragments in registers for the whole loop, else per k-slice
    D_K_TILES = forward_shape(config).head_dim // 16  # k-tiles of the QKᵀ product (e4m3: 32 bytes)
    D_N_TILES = config.value_dim // 8  # n-tiles of the O accumulator
    S_N_TILES = BN // 8  # n-tiles of the S accumulator
    P_K_TILES = BN // (32 if config.fp8 else 16)  # k-tiles of the PV product
    Q_BUFFERS = 2 if config.double_buffer else 1  # Q k-slice buffers when Q is not resident
    CAUSAL = causal
    WINDOW = window
    REVERSE = causal or window  # heaviest query blocks first (blocks.query_block)
    SINK = sink
    FP8 = config.fp8
    SOFTCAP = softcap
    RB_V = config.vt_row_bytes if FP8 else RB  # of the V tile (e4m3: the transposed V's key rows)
    rows = make_row_source(varlen)
    locate, rows_of = rows.locate, rows.rows_of
    start_rows, attend_tile = make_kv_step(config, causal, bf16, window, softcap, sink)
    finish = make_forward_epilogue(config, bf16, rows)

    def flash_forward(q, k, v, o, lse, q_sb, q_ss, q_sh, k_sb, k_ss, k_sh, v_sb, v_ss, v_sh,
                      o_sb, o_ss, o_sh, seqlen_q, seqlen_k, batch_size, heads_q, group, scale_log2,
                      write_lse, window_left, window_right, cap_scale, sink, descales):
        smem = cuda.shared.array(0, types.uint16)
        tid = cuda.threadIdx.x & 1023  # known to be in [0, 1024): its // and % are shifts and masks
        warp = tid // 32
        lane = tid % 32
        m_block, head, batch, kv_head = query_block(heads_q, group, REVERSE)
        span = locate(batch_size, batch, m_block * BM, seqlen_q, seqlen_k)
        if not span.present:
            return
        seqlen_q, seqlen_k = span.seqlen_q, span.seqlen_k
        m0 = m_block * BM
        diag = seqlen_k - seqlen_q  # query i sees keys j <= i + diag

        sq = ptx.shared_address_u16(smem)
        sk = sq + BM * D * EB
        sv = sk + BN * D * EB  # after K's D columns: V's are config.value_dim
        q_rows = rows_of(q, span.start_q, batch, q_sb, q_ss, q_sh, head, seqlen_q)
        k_rows = rows_of(k, span.start_k, batch, k_sb, k_ss, k_sh, kv_head, seqlen_k)
        if FP8:  # V transposed (``fp8_layout``): the KV head's D rows of keys; strides in 16-bit units
            v_rows = global_rows(v, batch * v_sb + kv_head * v_sh, v_ss, D)
            # q's and k's descales of the (batch, KV head) fold into the exponent (or softcap) factor
            pair = batch * (heads_q // group) + kv_head
            qk_descale = descales.q[pair] * descales.k[pair]
            if SOFTCAP:
                cap_scale *= qk_descale
            else:
                scale_log2 *= qk_descale
        else:
            v_rows = rows_of(v, span.start_k, batch, v_sb, v_ss, v_sh, kv_head, seqlen_k)

        n_tiles = visible_kv_tiles(m0, BM, BN, seqlen_k, diag, CAUSAL)
        kv_first = int64(0)  # the loop reads KV tiles kv_first .. kv_first + n_tiles - 1
        band = Band(seqlen_k, diag - window_left, diag + window_right)  # read by WINDOW kernels only
        if WINDOW:
            kv_first, kv_end = band_kv_tiles(m0, min(BM, seqlen_q - m0), BN, band)
            n_tiles = kv_end - kv_first

        # Prologue: Q and K_0 in flight together.
        copy_tile_async(sq, BM, q_rows, m0, CPR, tid, THREADS, RB)
        ptx.cp_async_commit_group()
        if n_tiles > 0:
            copy_tile_async(sk, BN, k_rows, kv_first * BN, CPR, tid, THREADS, RB)
        ptx.cp_async_commit_group()

        acc_o = cuda.local.array((MT, D_N_TILES, 4), float32)
        for mt in range(MT):
            for j in range(D_N_TILES):
                for e in range(4):
                    acc_o[mt, j, e] = 0.0
        acc_s = cuda.local.array((MT, S_N_TILES, 4), float32)
        q_frag = cuda.local.array((MT, D_K_TILES if Q_RESIDENT else Q_BUFFERS, 4), uint32)
        p_frag = cuda.local.array((MT, P_K_TILES, 4), uint32)
        b_frag = cuda.local.array((2, 4), uint32)  # K or V fragments (two buffers: double_buffer)
        # Per fragment row (m-tile mt, half r: rows g and g+8): running max (scaled, log2
        # units) and this lane's partial row sum.
        m_run = cuda.local.array((MT, 2), float32)
        l_run = cuda.local.array((MT, 2), float32)
        logit = NEG_INF
        if SINK:
            logit = sink_logit(sink, head)
        start_rows(m_run, l_run, logit)

        ptx.cp_async_wait_group_1()  # Q has landed (K_0 may still be in flight)
        cuda.syncthreads()
        warp_row = warp * 16 * MT  # this warp's first row in the CTA tile
        if Q_RESIDENT:
            for mt in range(MT):
                load_a_fragments(q_frag[mt], sq, warp_row + 16 * mt, D_K_TILES, BM, lane, RB)
        q_warp = sq + warp_row * RB  # the warp's rows of the Q tile (a multiple of 16 rows in)

        row_first = m0 + warp_row  # this warp's first query row
        # ldmatrix byte offsets of this lane: K as the B operand of QKᵀ (non-transposed,
        # two n-tiles of 8 keys per load), V as the B operand of PV (transposed), which is
        # also the pattern of Q as the A operand.
        k_offsets = cuda.local.array(4, uint32)
        ldmatrix_offsets(k_offsets, lane % 8 + (lane // 16) * 8, (lane // 8) % 2, RB)
        v_offsets = cuda.local.array(4, uint32)
        if FP8:  # the transposed V is a B tile as K is (its rows O's columns), with its own swizzle
            ldmatrix_offsets(v_offsets, lane % 8 + (lane // 16) * 8, (lane // 8) % 2, RB_V)
        else:
            ldmatrix_offsets(v_offsets, lane % 16, lane // 16, RB)
        for b in range(RB // 32):  # computed once: keep them in registers (see keep_in_register)
            k_offsets[b] = keep_in_register(k_offsets[b], lane)
            v_offsets[b] = keep_in_register(v_offsets[b], lane)
        mx = cuda.local.array((MT, 2), float32)
        loop = KvLoop(n_tiles, kv_first, tid, sk, sv, q_warp, k_rows, v_rows, k_offsets, v_offsets, acc_s,
                      acc_o, q_frag, p_frag, b_frag, m_run, l_run, mx, scale_log2, cap_scale,
                      ScoreMask(row_first, lane, seqlen_k, diag), band)
        for n_block in range(n_tiles):
            attend_tile(n_block, loop)

        if FP8:
            # O times v's descale, and O and the row sums over P's scale (both carry it); then a
            # barrier: O's 16-bit rows, staged from the Q tile on, are twice Q's e4m3 rows, so a
            # warp's staged rows are not the Q rows it read
            v_scale = descales.v[pair] * float32(1.0 / P_SCALE_E4M3)
            for mt in range(MT):
                for r in range(2):
                    scale_o_rows(acc_o[mt], D_N_TILES, r, v_scale)
                    l_run[mt, r] *= float32(1.0 / P_SCALE_E4M3)
            cuda.syncthreads()
        finish(acc_o, m_run, l_run, OutRows(o, o_sb, o_ss, o_sh, lse, write_lse, heads_q, batch_size),
               WarpRows(span, batch, head, sq, warp_row, row_first, lane))

    mask_kind = "window" if window else "causal" if causal else "full"
    kind = f"{mask_kind}{'_softcap' if softcap else ''}_{'e4m3_' if FP8 else ''}{'bf16' if bf16 else 'f16'}"
    if varlen:
        kind = f"varlen_{kind}"
    dropped_ip = config.interleave_pv and not interleaves(config, softcap)
    tag = config.tag.replace("_ip", "") if dropped_ip else config.tag
    dims = f"d{D}v{config.head_dim_v}" if config.head_dim_v else f"d{D}"
    name = f"flash_forward_{dims}_m{BM}x{MT}_n{BN}{tag}_{kind}{'_sink' if sink else ''}"
    body = cuda.jit(device=True, forceinline=True)(flash_forward)
    declared = (params.VARLEN_FORWARD if varlen else params.FORWARD) + (params.DESCALES if FP8 else ())
    seqs = "Sequences(batch_size, cu_seqlens_q, cu_seqlens_k, lse_head_stride)" if varlen else "batch_size"
    args = [seqs if p == "batch_size" else p for p in params.names_of(params.FORWARD)]
    descaled = "Descales(q_descale, k_descale, v_descale)" if FP8 else "None"
    kernel = params.entry("flash_forward_varlen" if varlen else "flash_forward",
                          declared + params.SINK if sink else declared,
                          f"body({', '.join(args)}, {'sink' if sink else 'None'}, {descaled})",
                          {"body": body, "Sequences": Sequences, "Descales": Descales})
    kernel.__name__ = name
    # ptxas may use 65536 / (threads * min_ctas) registers a thread (at most 255).
    kernel.launch_bounds = (THREADS, config.min_ctas)
    return kernel
