"""FlashAttention-2 backward on tensor cores with cp.async + ldmatrix + mma.sync (sm_80+).

Three kernels over one float32 workspace (``abi.BACKWARD_ABI`` describes it):

1. ``prep``: D = rowsum(dO ∘ O) per query row, the forward's LSE in log2 units (+inf where a
   row saw no key, so that its P is 0), a zeroed dQ accumulator and zeroed turn counters.
2. The main kernel: one CTA per block of ``block_n`` keys of one (batch, kv head). K and V of
   the block sit in shared memory; dK and dV stay in registers while the CTA walks every
   query block of every query head of its group that sees the block (GQA sums there). For
   each query block, with Q, dO, LSE and D landed by cp.async (the next block's copies in
   flight when ``q_stages`` is 2):

   - ``transposed_scores``: Sᵀ = K Qᵀ and dPᵀ = V dOᵀ (keys x queries, so that the rows a warp
     owns are keys, as in dK and dV);
   - ``gradient_of_scores``: Pᵀ = exp2(Sᵀ·scale·log2e − LSE₂) and dSᵀ = Pᵀ ∘ (dPᵀ − D), masked
     past the last key and after the causal diagonal, stored as 16-bit tiles in shared memory;
   - ``product_tn``: dV += Pᵀ dO from those tiles;
   - ``add_dq``: dQ_i += dS K, read transposed from the dSᵀ tile, added into the float32
     accumulator with ``red.global.add.f32`` (``.v4.f32`` on sm_90: ``dq_vector``), in the dQ
     product's fragment order (``BackwardConfig.dq_offset``); in deterministic mode CTAs take
     turns per query block in key-block order (a counter per block, acquire/release), so the
     sums are bit-identical from run to run;
   - ``product_tn``: dK += dSᵀ Q (after dQ, so that its adds drain under the dK product).

   At the end dK is scaled by the softmax scale and dK, dV are written through shared memory
   with 16-byte stores.
3. ``dq``: dQ = scale · accumulator, in the input dtype.

Two compile-time variants of the main kernel (issue 35), built only when a call asks for them, as
the forward's: ``window`` (FlashAttention's sliding window: a key block's CTA walks only the query
blocks whose rows see one of its keys, ``blocks.band_query_blocks``, and masks the scores of tiles
on an edge of the window, ``mask_band_transposed``; the window's sides are kernel arguments) and
``softcap`` (Sᵀ becomes t = tanh(Sᵀ · scale / softcap), the scores softcap · t, so the exponent
factor is softcap·log2(e), and dSᵀ gets the tanh's derivative: dSᵀ = Pᵀ ∘ (dPᵀ − D) ∘ (1 − t²),
scaled by the softmax scale afterwards as before). The prepare and dQ kernels serve every variant.
A main kernel built without them compiles to the same code as before they existed: their
arguments are never read.

A ``varlen`` build of each of the three kernels (``flash_attention_varlen_backward``) has its own
parameter list (``VARLEN_BACKWARD_*_ARGTYPES``: the plain parameters, then cu_seqlens_q,
cu_seqlens_k and total_q): a thin kernel calls the same body as a device function with a
``Sequences`` record in a batch-stride slot that the varlen body never reads as a stride (o_sb,
q_sb, dq_sb). Each CTA takes its sequence from the grid (z, or the (batch, KV head) pair of the
main kernel), reads its bounds from the offsets, returns at once past its sequence's end, and
uses the sequence's own lengths (masks, causal diagonal, window: the variants combine); its
workspace rows start at ``abi.varlen_row_offset`` (whole 128-row blocks per sequence). The plain
builds compile to the same code as before.

Every product is an m16n8k16 mma.sync; the warps split each product their own way
(``shapes.BackwardConfig``). Tiles use the swizzled layouts of ``smem``; the Pᵀ and dSᵀ tiles
are ``block_n`` rows of ``block_m`` 16-bit columns in 128-byte column blocks.
"""

from __future__ import annotations

import math
from collections import namedtuple

from numba import cuda, float32, int32, int64, types, uint16, uint32

from .. import ptx
from . import abi
from .blocks import (
    Band,
    band_kv_tiles,
    band_needs_mask,
    band_query_blocks,
    key_block_of,
    mask_band_transposed,
    mask_transposed,
)
from .common import FULL_MASK, NEG_INF, keep_in_register, unroll
from .epilogue import store_rows_global
from .forward_mma import Sequences
from .fragments import store_fragment_rows, zero_fragments
from .shapes import PREP_ROWS, PREP_THREADS, BackwardConfig, prep_split
from .smem import (
    copy_tile_async,
    drain_copies,
    global_rows,
    ldmatrix_offsets,
    swizzled_offset,
)
from .softmax import pack_16bit

LOG2_E = 1.4426950408889634
INF = float32(math.inf)
# The packed variable-length workspace (``abi.varlen_row_offset``): a sequence's first row and its
# padded rows, on the device.
varlen_row_offset = cuda.jit(device=True, forceinline=True)(abi.varlen_row_offset)
varlen_padded_rows = cuda.jit(device=True, forceinline=True)(abi.varlen_padded_rows)

BACKWARD_PREP_ARGTYPES = (
    types.uint16[::1], types.uint16[::1], types.float32[::1],  # out, dout, lse
    types.float32[::1], types.float32[::1],  # delta, lse2
    types.float32[::1], types.int32[::1],  # dq_acc, counters
    types.int64, types.int64, types.int64,  # out strides
    types.int64, types.int64, types.int64,  # dout strides
    types.int64, types.int64, types.int64,  # seqlen_q, rows, heads_q
    types.int64,  # counters per (batch, head)
)
BACKWARD_ARGTYPES = (
    types.uint16[::1], types.uint16[::1], types.uint16[::1], types.uint16[::1],  # q, k, v, dout
    types.uint16[::1], types.uint16[::1],  # dk, dv
    types.float32[::1], types.float32[::1],  # lse2, delta
    types.float32[::1], types.int32[::1],  # dq_acc, counters
    *(types.int64,) * 18,  # strides of q, k, v, dout, dk, dv
    types.int64, types.int64, types.int64,  # seqlen_q, seqlen_k, rows
    types.int64, types.int64, types.int64,  # heads_q, group, heads_kv
    types.int64,  # tail pairs (blocks.key_block_of)
    types.float32, types.float32,  # scale * log2(e) (softcap * log2(e) when capped), scale
    types.boolean,  # deterministic
    types.int64, types.int64,  # sliding window: left, right, each >= 0 (read by window kernels only)
    types.float32,  # softmax scale / softcap (read by softcap kernels only)
)
BACKWARD_DQ_ARGTYPES = (
    types.float32[::1], types.uint16[::1],  # dq_acc, dq
    types.int64, types.int64, types.int64,  # dq strides
    types.int64, types.int64, types.int64,  # seqlen_q, rows, heads_q
    types.float32,  # scale
)
# The packed variable-length builds (``varlen=True``): the same parameters, then the sequences
# (``abi.VARLEN_BACKWARD_*_ABI``): the int32 offsets of their queries and keys and total_q.
_SEQUENCES = (types.int32[::1], types.int32[::1], types.int64)
VARLEN_BACKWARD_PREP_ARGTYPES = (*BACKWARD_PREP_ARGTYPES, *_SEQUENCES)
VARLEN_BACKWARD_ARGTYPES = (*BACKWARD_ARGTYPES, *_SEQUENCES)
VARLEN_BACKWARD_DQ_ARGTYPES = (*BACKWARD_DQ_ARGTYPES, *_SEQUENCES)

# Where one warp's part of a product sits: its first row and column in the CTA's tiles.
WarpPart = namedtuple("WarpPart", ["row0", "col0"])
# The tiles of one step of the walk (shared byte addresses): Q, dO, and the stage's LSE and D
# rows (float32).
StepTiles = namedtuple("StepTiles", ["q", "do", "lse", "delta"])
# Fragment buffers a warp reuses: A fragments of every m-tile and one B pair.
Frags = namedtuple("Frags", ["a", "b"])
# The lane's ldmatrix byte offsets into each tile, for the warp's part of each product, worked
# out once (``lane_offsets``): with the k-tile a compile-time constant, every load address is
# then a tile base + one of these + an immediate. Sᵀ/dPᵀ: ``nt_a[kb]`` (K, V rows, 16-column
# block kb of a column block) and ``nt_b[kb]`` (Q, dO rows); dV/dK: ``tn_a[kb]`` (Pᵀ, dSᵀ rows)
# and ``tn_b[j2]`` (dO, Q columns, transposed); dQ: ``dq_a[mt]`` (dSᵀ transposed) and
# ``dq_b[j2]`` (K columns, transposed); the Pᵀ and dSᵀ stores: ``sts[j]`` (the lane's row of
# the warp's first key m-tile, n-tile j's column pair).
Offsets = namedtuple("Offsets", ["nt_a", "nt_b", "tn_a", "tn_b", "dq_a", "dq_b", "sts"])
# The operands of one dV or dK product (``product_tn``) and of one dQ product (``dq_product``).
TnProduct = namedtuple("TnProduct", ["acc", "a_tile", "b_tile", "frags", "offsets"])
DqProduct = namedtuple("DqProduct", ["acc", "ds_tile", "sk", "frags", "offsets"])


@cuda.jit(device=True, forceinline=True)
def f32_of_bits(bits, bf16):
    """The 16-bit value in ``bits`` (uint32, low half) as float32."""
    return ptx.f32_from_bf16_bits(bits) if bf16 else ptx.f32_from_f16_bits(bits)


def make_backward_prep_kernel(config: BackwardConfig, causal: bool, bf16: bool, varlen: bool = False):
    """The prep kernel (``BACKWARD_PREP_ARGTYPES``): grid (rows // 64, heads_q, batch), 128 threads;
    the same code with causal masking or not (``causal`` is not used: one kernel serves both).
    The threads of a row (``prep_split``) each load 16-byte chunks of O and dO (the loads of up
    to 8 passes issued before any sum), dot them and sum over a shuffle tree; then 16-byte
    stores zero the block's dQ accumulator.

    ``varlen``: the packed variable-length build (``VARLEN_BACKWARD_PREP_ARGTYPES``; grid
    (backward_rows(max_seqlen_q) // 64, heads_q, batch)): a ``Sequences`` record in the ``o_sb``
    slot; a block past its sequence's padded rows (``varlen_padded_rows``) returns."""
    config.check()
    D = config.head_dim
    BM = config.block_m
    VARLEN = varlen
    TPR, PER, RPP = prep_split(D)
    PASSES = PREP_ROWS // RPP
    GROUP = min(PASSES, 8)  # passes whose loads are in flight together (unrolled: registers)
    SHUFFLES = tuple(TPR >> i for i in range(1, TPR.bit_length()))  # TPR/2 .. 1
    ZERO_STORES = PREP_ROWS * D // 4 // PREP_THREADS  # 16-byte stores a thread
    BF16 = bf16

    def backward_prep(o, do, lse, delta, lse2, dq_acc, counters, o_sb, o_ss, o_sh, do_sb, do_ss, do_sh,
                      seqlen_q, rows, heads_q, counters_per_head):
        tid = cuda.threadIdx.x & 1023
        x = int64(cuda.blockIdx.x)
        head = int64(cuda.blockIdx.y)
        batch = int64(cuda.blockIdx.z)
        bh = batch * heads_q + head
        row_base = x * PREP_ROWS
        part = tid % TPR
        if VARLEN:  # o_sb is a Sequences record: this sequence's rows and its workspace rows
            seqs = o_sb
            start_q = int64(seqs.cu_seqlens_q[batch])
            seqlen_q = int64(seqs.cu_seqlens_q[batch + 1]) - start_q
            if row_base >= varlen_padded_rows(seqlen_q):  # past the sequence's workspace rows
                return
            ws_row0 = head * rows + varlen_row_offset(start_q, batch)  # the sequence's row 0
            o_at = ptx.global_address(o) + 2 * (start_q * o_ss + head * o_sh) + 16 * part
            do_at = ptx.global_address(do) + 2 * (start_q * do_ss + head * do_sh) + 16 * part
        else:
            o_at = ptx.global_address(o) + 2 * (batch * o_sb + head * o_sh) + 16 * part
            do_at = ptx.global_address(do) + 2 * (batch * do_sb + head * do_sh) + 16 * part
        ov = cuda.local.array((GROUP, PER, 4), uint32)
        dov = cuda.local.array((GROUP, PER, 4), uint32)
        for g in range(PASSES // GROUP):
            for p in range(GROUP):
                row = row_base + (g * GROUP + p) * RPP + tid // TPR
                for c in range(PER):
                    if row < seqlen_q:
                        ptx.ld_global_nc_v4_at(ov[p, c], o_at + 2 * row * o_ss + 16 * TPR * c)
                        ptx.ld_global_nc_v4_at(dov[p, c], do_at + 2 * row * do_ss + 16 * TPR * c)
                    else:
                        for w in range(4):
                            ov[p, c, w] = 0
                            dov[p, c, w] = 0
            for p in range(GROUP):
                row = row_base + (g * GROUP + p) * RPP + tid // TPR
                acc = float32(0.0)
                for c in range(PER):
                    for w in range(4):
                        a = ov[p, c, w]
                        b = dov[p, c, w]
                        acc += f32_of_bits(uint32(a & 0xFFFF), BF16) * f32_of_bits(uint32(b & 0xFFFF), BF16)
                        acc += f32_of_bits(uint32(a >> 16), BF16) * f32_of_bits(uint32(b >> 16), BF16)
                for offset in SHUFFLES:
                    acc += cuda.shfl_xor_sync(FULL_MASK, acc, offset)
                if part == 0:
                    if VARLEN:
                        at = ws_row0 + row
                    else:
                        at = bh * rows + row
                    delta[at] = acc
                    value = INF
                    if row < seqlen_q:
                        if VARLEN:  # the LSE is (heads_q, total_q)
                            forward = lse[head * seqs.lse_head_stride + start_q + row]
                        else:
                            forward = lse[bh * seqlen_q + row]
                        if forward != NEG_INF:
                            value = forward * float32(LOG2_E)
                    lse2[at] = value
        zeros = cuda.local.array(4, uint32)
        for w in range(4):
            zeros[w] = 0
        if VARLEN:
            zero_at = ptx.global_address_f32(dq_acc) + 4 * (ws_row0 + row_base) * D + 16 * tid
        else:
            zero_at = ptx.global_address_f32(dq_acc) + 4 * (bh * rows + row_base) * D + 16 * tid
        for i in range(ZERO_STORES):
            ptx.st_global_v4_at(zero_at + 16 * PREP_THREADS * i, zeros)
        if tid == 0 and row_base % BM == 0:
            if VARLEN:  # rows and the sequence's row offset are multiples of block_m
                counters[(ws_row0 + row_base) // BM] = 0
            else:
                counters[bh * counters_per_head + row_base // BM] = 0

    backward_prep.__name__ = (f"flash_backward_prep_d{D}_m{BM}_{'varlen_' if varlen else ''}"
                              f"{'bf16' if bf16 else 'f16'}")
    backward_prep.launch_bounds = (PREP_THREADS, 1)
    if not VARLEN:
        return backward_prep
    body = cuda.jit(device=True, forceinline=True)(backward_prep)

    def backward_prep_varlen(o, do, lse, delta, lse2, dq_acc, counters, o_sb, o_ss, o_sh, do_sb, do_ss, do_sh,
                             seqlen_q, rows, heads_q, counters_per_head, cu_seqlens_q, cu_seqlens_k, total_q):
        seqs = Sequences(int64(cuda.gridDim.z), cu_seqlens_q, cu_seqlens_k, total_q)
        body(o, do, lse, delta, lse2, dq_acc, counters, seqs, o_ss, o_sh, do_sb, do_ss, do_sh, seqlen_q, rows,
             heads_q, counters_per_head)

    backward_prep_varlen.__name__ = backward_prep.__name__
    backward_prep_varlen.launch_bounds = backward_prep.launch_bounds
    return backward_prep_varlen


def make_backward_dq_kernel(config: BackwardConfig, causal: bool, bf16: bool, varlen: bool = False):
    """The dQ kernel (``BACKWARD_DQ_ARGTYPES``): grid (rows // block_m, heads_q, batch),
    ``config.threads`` threads. Thread ``tid`` reads back the accumulator elements that thread
    ``tid`` of the main kernel added (fragment order, ``BackwardConfig.dq_position``: coalesced
    loads), stores them scaled, as 16-bit pairs, into a swizzled shared tile of the block, and the
    warps then write the block's rows with 16-byte stores.

    ``varlen``: the packed variable-length build (``VARLEN_BACKWARD_DQ_ARGTYPES``; grid
    (backward_rows(max_seqlen_q) // block_m, heads_q, batch)): a ``Sequences`` record in the
    ``dq_sb`` slot; a block past its sequence's end returns."""
    config.check()
    D = config.head_dim
    BM = config.block_m
    VARLEN = varlen
    THREADS = config.threads
    QR = config.dq_row_warps
    QMT = BM // (16 * QR)
    DQ_COLS = D // config.dq_col_warps
    DQ_N = DQ_COLS // 8
    RB = config.row_bytes
    CPR = D // 8
    STORE_ROWS = BM // config.num_warps  # rows each warp writes out
    VEC = config.dq_vector
    TILE = BM * D  # 16-bit elements of the block's shared tile
    if TILE * 2 > 48 * 1024:
        raise ValueError(f"the dQ kernel's static shared tile ({BM} x {D} 16-bit) exceeds 48 KB: {config}")
    BF16 = bf16

    def backward_dq(dq_acc, dq, dq_sb, dq_ss, dq_sh, seqlen_q, rows, heads_q, scale):
        smem = cuda.shared.array(TILE, uint16, alignment=128)
        tile = ptx.shared_address_u16(smem)
        tid = cuda.threadIdx.x & 1023
        warp = tid // 32
        lane = tid % 32
        head = int64(cuda.blockIdx.y)
        batch = int64(cuda.blockIdx.z)
        m0 = int64(cuda.blockIdx.x) * BM
        if VARLEN:  # dq_sb is a Sequences record
            seqs = dq_sb
            start_q = int64(seqs.cu_seqlens_q[batch])
            seqlen_q = int64(seqs.cu_seqlens_q[batch + 1]) - start_q
            if m0 >= seqlen_q:
                return
            at = (head * rows + varlen_row_offset(start_q, batch) + m0) * D + VEC * tid
        else:
            at = ((batch * heads_q + head) * rows + m0) * D + VEC * tid
        acc = cuda.local.array((QMT, DQ_N, 4), float32)
        for mt in range(QMT):
            for j in range(DQ_N):
                for e in range(4):  # config.dq_offset(tid, 4 (mt DQ_N + j) + e) in the block
                    acc[mt, j, e] = dq_acc[at + ((mt * DQ_N + j) * 4 + e // VEC * VEC) * THREADS + e % VEC]
        row0 = (warp % QR) * 16 * QMT
        col0 = (warp // QR) * DQ_COLS
        for mt in range(QMT):
            store_fragment_rows(tile, acc[mt], DQ_N, BM, row0 + 16 * mt, col0, lane, BF16, RB, scale)
        cuda.syncthreads()
        scratch = cuda.local.array(4, uint32)
        first = warp * STORE_ROWS
        if VARLEN:
            dq_rows = global_rows(dq, start_q * dq_ss + head * dq_sh, dq_ss, seqlen_q)
        else:
            dq_rows = global_rows(dq, batch * dq_sb + head * dq_sh, dq_ss, seqlen_q)
        store_rows_global(dq_rows, m0 + first, tile, BM, first, STORE_ROWS, CPR, lane, scratch, RB)

    backward_dq.__name__ = (f"flash_backward_dq_d{D}_m{BM}{config.tag}_{'varlen_' if varlen else ''}"
                            f"{'bf16' if bf16 else 'f16'}")
    backward_dq.launch_bounds = (THREADS, 1)
    if not VARLEN:
        return backward_dq
    body = cuda.jit(device=True, forceinline=True)(backward_dq)

    def backward_dq_varlen(dq_acc, dq, dq_sb, dq_ss, dq_sh, seqlen_q, rows, heads_q, scale, cu_seqlens_q,
                           cu_seqlens_k, total_q):
        seqs = Sequences(int64(cuda.gridDim.z), cu_seqlens_q, cu_seqlens_k, total_q)
        body(dq_acc, dq, seqs, dq_ss, dq_sh, seqlen_q, rows, heads_q, scale)

    backward_dq_varlen.__name__ = backward_dq.__name__
    backward_dq_varlen.launch_bounds = backward_dq.launch_bounds
    return backward_dq_varlen


def make_backward_kernel(config: BackwardConfig, causal: bool, bf16: bool, window: bool = False,
                         softcap: bool = False, varlen: bool = False):
    """The main backward kernel (``BACKWARD_ARGTYPES``): grid ceil(seqlen_k / block_n) * heads_kv
    * batch in one dimension (``blocks.key_block_of`` maps a CTA to its key block and (batch,
    KV head)), ``config.threads`` threads, ``config.shared_bytes`` of dynamic shared memory.

    ``window``: a sliding-window kernel (``window_left`` / ``window_right`` arguments, each >= 0;
    ``causal`` must then be False: the window's right edge 0 is causal masking). ``softcap``:
    scores capped by tanh (``cap_scale`` argument = softmax_scale / softcap, ``scale_log2`` =
    softcap·log2(e), as the forward's). Kernels without them never read those arguments.

    ``varlen``: the packed variable-length build (``VARLEN_BACKWARD_ARGTYPES``: the same parameters,
    then cu_seqlens_q, cu_seqlens_k and total_q; seqlen_q and seqlen_k the maxima, rows the padded
    total ``varlen_workspace_rows``): a ``Sequences`` record in the ``q_sb`` slot; the grid's
    third factor is the sequence; a key block past its sequence's keys returns at once; the
    sequence's own lengths replace seqlen_q and seqlen_k (masks, causal diagonal, window); its
    workspace rows start at ``varlen_row_offset``."""
    if window and causal:
        raise ValueError("a window kernel's causal masking is its right edge 0: build it with causal=False")
    config.check()
    D = config.head_dim
    BM = config.block_m
    BN = config.block_n
    THREADS = config.threads
    WARPS = config.num_warps
    KR = config.key_warps
    KC = config.col_warps
    QR = config.dq_row_warps
    QC = config.dq_col_warps
    KMT = BN // (16 * KR)  # key m-tiles of a warp (Sᵀ, dPᵀ, dK, dV)
    SQ = BM // KC  # queries of a warp's Sᵀ and dPᵀ
    S_N = SQ // 8  # their n-tiles
    DC = D // KC  # head-dim columns of a warp's dK and dV
    KV_N = DC // 8
    QMT = BM // (16 * QR)  # query m-tiles of a warp's dQ
    DQ_COLS = D // QC
    DQ_N = DQ_COLS // 8
    A_TILES = max(KMT, QMT)  # A fragments held at once
    KV_PAIRS = KV_N // 2  # B loads (two n-tiles each) of a dV or dK k-tile
    DQ_PAIRS = DQ_N // 2
    CPR = D // 8  # 16-byte chunks per row
    RB = config.row_bytes
    KB = RB // 32  # 16-column blocks per column block of the Q, K, V and dO tiles
    PB = 128  # bytes per row of a column block of the Pᵀ and dSᵀ tiles (block_m is 64 or 128)
    STAGES = config.q_stages
    layout = config.shared_layout
    SK, SV, SP, SDS = layout["k"], layout["v"], layout["p"], layout["ds"]
    SQ0, SDO0 = layout["q"], layout["do"]
    SLSE0, SDELTA0, STAGE = layout["lse"], layout["delta"], layout["stage"]
    STORE_ROWS = BN // WARPS  # rows of dK and dV each warp writes out
    DQ_VECTOR = config.dq_vector
    CAUSAL = causal
    WINDOW = window
    SOFTCAP = softcap
    VARLEN = varlen
    BF16 = bf16
    mma = ptx.mma_m16n8k16_bf16 if bf16 else ptx.mma_m16n8k16_f16

    @cuda.jit(device=True, forceinline=True)
    def mma_b_pair(acc, frags, m_tiles, j2):
        """acc[mt, 2 j2] and acc[mt, 2 j2 + 1] += A_mt B for every m-tile: the A fragments of
        ``frags.a`` times the two n-tiles of one B load (``frags.b``: registers 0-1, 2-3)."""
        for mt in range(m_tiles):
            mma(acc[mt, 2 * j2], frags.a[mt], frags.b[0:2])
            mma(acc[mt, 2 * j2 + 1], frags.a[mt], frags.b[2:4])

    @cuda.jit(device=True, forceinline=True)
    def product_nt(acc, a_tile, b_tile, frags, offsets):
        """acc[mt, j] += A Bᵀ over the head dim: A = the warp's key rows (+ 16 mt) of ``a_tile``
        (K or V, ldmatrix), B = its query rows (+ 8 j) of ``b_tile`` (Q or dO, non-transposed
        ldmatrix, two n-tiles a load)."""
        for kt in range(D // 16):
            block = (kt // KB) * RB  # the column block, per row of the tile
            for mt in range(KMT):
                ptx.ldmatrix_x4(frags.a[mt], a_tile + offsets.nt_a[kt % KB] + block * BN + 16 * mt * RB)
            for j2 in range(S_N // 2):
                ptx.ldmatrix_x4(frags.b, b_tile + offsets.nt_b[kt % KB] + block * BM + 16 * j2 * RB)
                mma_b_pair(acc, frags, KMT, j2)

    @cuda.jit(device=True, forceinline=True)
    def transposed_scores(acc_s, acc_dp, sk, sv, tiles, frags, offsets):
        """Sᵀ = K Qᵀ and dPᵀ = V dOᵀ for the warp's keys and queries."""
        zero_fragments(acc_s, KMT, S_N)
        zero_fragments(acc_dp, KMT, S_N)
        product_nt(acc_s, sk, tiles.q, frags, offsets)
        product_nt(acc_dp, sv, tiles.do, frags, offsets)

    @cuda.jit(device=True, forceinline=True)
    def gradient_of_scores(acc_s, acc_dp, tiles, part, scale_log2, lane):
        """Sᵀ -> Pᵀ and dPᵀ -> dSᵀ = Pᵀ ∘ (dPᵀ − D) in place (each column: one query's LSE and D
        from the stage's shared rows, at the lane's first column + an immediate); masking is done
        on Sᵀ before."""
        first = uint32((part.col0 + 2 * (lane % 4)) * 4)
        lse_at = tiles.lse + first
        delta_at = tiles.delta + first
        for j in range(S_N):
            for e in range(2):
                lse = ptx.ld_shared_f32(lse_at + (8 * j + e) * 4)
                d = ptx.ld_shared_f32(delta_at + (8 * j + e) * 4)
                for mt in range(KMT):
                    for r in range(2):
                        s = acc_s[mt, j, 2 * r + e]
                        p = ptx.exp2(s * scale_log2 - lse)
                        acc_s[mt, j, 2 * r + e] = p
                        if SOFTCAP:  # s = t = tanh(.), the score softcap·t: d(score)/d(QKᵀ·scale) = 1 - t²
                            # (a masked t is -inf, its P 0: the max keeps 0 · -inf from making a NaN)
                            slope = max(float32(1.0) - s * s, float32(0.0))
                            acc_dp[mt, j, 2 * r + e] = p * (acc_dp[mt, j, 2 * r + e] - d) * slope
                        else:
                            acc_dp[mt, j, 2 * r + e] = p * (acc_dp[mt, j, 2 * r + e] - d)

    @cuda.jit(device=True, forceinline=True)
    def store_scores(tile, acc, offsets):
        """The warp's part of Pᵀ or dSᵀ (``acc[mt, j]``, keys x queries) as 16-bit pairs into a
        swizzled keys x queries tile: the lane's address for n-tile j is ``tile + sts[j]``, and
        the rows of m-tile mt and of the fragment's second half are immediates (the swizzle
        phase of a row is the same 16 rows further)."""
        for mt in range(KMT):
            for r in range(2):
                for j in range(S_N):
                    packed = pack_16bit(acc[mt, j, 2 * r], acc[mt, j, 2 * r + 1], BF16)
                    ptx.st_shared_b32(tile + offsets.sts[j] + (16 * mt + 8 * r) * PB, packed)

    @cuda.jit(device=True, forceinline=True)
    def tn_step(kt, st):
        """k-tile ``kt`` (16 queries) of ``product_tn``."""
        for mt in range(KMT):
            at = st.a_tile + st.offsets.tn_a[kt % 4] + (kt // 4) * (BN * PB) + 16 * mt * PB
            ptx.ldmatrix_x4(st.frags.a[mt], at)
        for j2 in range(KV_N // 2):
            ptx.ldmatrix_x4_trans(st.frags.b, st.b_tile + st.offsets.tn_b[j2] + 16 * kt * RB)
            mma_b_pair(st.acc, st.frags, KMT, j2)

    # acc[mt, j] += A B over the ``block_m`` queries (a TnProduct): A = rows ``row0`` + 16 mt of a
    # keys x queries tile (Pᵀ or dSᵀ, 128-byte column blocks), B = head-dim columns ``col0`` .. of
    # a queries x head-dim tile (dO or Q) by transposing ldmatrix. Unrolled in Python: NVVM left
    # the k-tile loop rolled, so no k-tile's loads could overlap the previous one's mma.sync.
    product_tn = unroll(tn_step, BM // 16)

    @cuda.jit(device=True, forceinline=True)
    def dq_step(kt, st):
        """k-tile ``kt`` (16 keys) of ``dq_product``."""
        for mt in range(QMT):  # A(m = query, k = key) of the keys x queries tile, transposed
            ptx.ldmatrix_x4_trans(st.frags.a[mt], st.ds_tile + st.offsets.dq_a[mt] + 16 * kt * PB)
        for j2 in range(DQ_N // 2):
            ptx.ldmatrix_x4_trans(st.frags.b, st.sk + st.offsets.dq_b[j2] + 16 * kt * RB)
            mma_b_pair(st.acc, st.frags, QMT, j2)

    # dQ rows ``part.row0`` + 16 mt, columns ``part.col0`` .. of this step (a DqProduct): dS (from
    # the dSᵀ tile, by transposing ldmatrix) times K (transposing ldmatrix), over the block's keys.
    dq_product = unroll(dq_step, BN // 16)

    @cuda.jit(device=True, forceinline=True)
    def add_dq(ds_tile, sk, dq_at, frags, offsets, acc_q):
        """dQ of this step for the warp's part, added into the query block's accumulator in
        fragment order (``BackwardConfig.dq_offset``; ``dq_at``: the block's byte address + 4
        dq_vector tid): with dq_vector 1 element ``i`` of the thread's fragment by
        ``red.global.add.f32`` at ``dq_at`` + 4 i threads, with 4 the four floats of an n-tile
        by one ``red.global.add.v4.f32`` at ``dq_at`` + 16 (i // 4) threads."""
        zero_fragments(acc_q, QMT, DQ_N)
        dq_product(DqProduct(acc_q, ds_tile, sk, frags, offsets))
        for mt in range(QMT):
            for j in range(DQ_N):
                if DQ_VECTOR == 4:
                    ptx.red_global_add_v4_f32(dq_at + (mt * DQ_N + j) * (THREADS * 16), acc_q[mt, j, 0],
                                              acc_q[mt, j, 1], acc_q[mt, j, 2], acc_q[mt, j, 3])
                else:
                    for e in range(4):
                        ptx.red_global_add_f32(dq_at + ((mt * DQ_N + j) * 4 + e) * (THREADS * 4),
                                               acc_q[mt, j, e])

    @cuda.jit(device=True, forceinline=True)
    def load_step(sbase, stage, q_rows, do_rows, m0, lse2_at, delta_at, tid):
        """cp.async of one query block's Q and dO rows and its LSE and D (``BM`` floats each,
        at byte addresses ``lse2_at`` / ``delta_at``) into ``stage``."""
        off = stage * STAGE
        copy_tile_async(sbase + SQ0 + off, BM, q_rows, m0, CPR, tid, THREADS, RB)
        copy_tile_async(sbase + SDO0 + off, BM, do_rows, m0, CPR, tid, THREADS, RB)
        chunks = BM * 4 // 16
        if tid < chunks:
            ptx.cp_async_16_at(sbase + SLSE0 + off + 16 * tid, lse2_at + 16 * tid)
        elif tid < 2 * chunks:
            ptx.cp_async_16_at(sbase + SDELTA0 + off + 16 * (tid - chunks), delta_at + 16 * (tid - chunks))
        ptx.cp_async_commit_group()

    @cuda.jit(device=True, forceinline=True)
    def lane_offsets(offsets, s_part, kv_part, q_part, lane):
        """Fill ``offsets`` (an Offsets) for this lane and its warp's parts; each value is kept
        in a register (``keep_in_register``), not recomputed from the lane index every step."""
        ldmatrix_offsets(offsets.nt_a, lane % 16, lane // 16, RB)
        ldmatrix_offsets(offsets.nt_b, lane % 8 + (lane // 16) * 8, (lane // 8) % 2, RB)
        ldmatrix_offsets(offsets.tn_a, lane % 16, lane // 16, PB)
        for b in range(KB):
            offsets.nt_a[b] = keep_in_register(offsets.nt_a[b] + s_part.row0 * RB, lane)
            offsets.nt_b[b] = keep_in_register(offsets.nt_b[b] + s_part.col0 * RB, lane)
        for b in range(4):
            offsets.tn_a[b] = keep_in_register(offsets.tn_a[b] + kv_part.row0 * PB, lane)
        for j2 in range(KV_N // 2):
            chunk = kv_part.col0 // 8 + 2 * j2 + lane // 16
            offsets.tn_b[j2] = keep_in_register(swizzled_offset(lane % 16, chunk, BM, RB), lane)
        for mt in range(QMT):
            key = lane % 8 + 8 * (lane // 16)
            query_chunk = (q_part.row0 + 16 * mt) // 8 + (lane // 8) % 2
            offsets.dq_a[mt] = keep_in_register(swizzled_offset(key, query_chunk, BN, PB), lane)
        for j2 in range(DQ_N // 2):
            chunk = q_part.col0 // 8 + 2 * j2 + lane // 16
            offsets.dq_b[j2] = keep_in_register(swizzled_offset(lane % 16, chunk, BN, RB), lane)
        for j in range(S_N):
            at = swizzled_offset(s_part.row0 + lane // 4, s_part.col0 // 8 + j, BN, PB) + 4 * (lane % 4)
            offsets.sts[j] = keep_in_register(at, lane)

    def flash_backward(q, k, v, do, dk, dv, lse2, delta, dq_acc, counters,
                       q_sb, q_ss, q_sh, k_sb, k_ss, k_sh, v_sb, v_ss, v_sh,
                       do_sb, do_ss, do_sh, dk_sb, dk_ss, dk_sh, dv_sb, dv_ss, dv_sh,
                       seqlen_q, seqlen_k, rows, heads_q, group, heads_kv, tail_pairs, scale_log2, scale,
                       deterministic, window_left, window_right, cap_scale):
        smem = cuda.shared.array(0, types.uint16)
        tid = cuda.threadIdx.x & 1023
        warp = tid // 32
        lane = tid % 32
        # Launch order (blocks.key_block_of): causal, the last waves longest first. 32-bit
        # division: the grid has at most 2^31 - 1 CTAs.
        key_blocks = uint32((seqlen_k + BN - 1) // BN)
        n_block, pair = key_block_of(cuda.blockIdx.x, key_blocks, uint32(cuda.gridDim.x) // key_blocks,
                                     tail_pairs if CAUSAL or WINDOW else 0)
        kv_head = int64(uint32(pair) % uint32(heads_kv))
        batch = int64(uint32(pair) // uint32(heads_kv))
        n0 = n_block * BN
        if VARLEN:  # q_sb is a Sequences record: this sequence's rows and lengths
            seqs = q_sb
            start_k = int64(seqs.cu_seqlens_k[batch])
            seqlen_k = int64(seqs.cu_seqlens_k[batch + 1]) - start_k
            if n0 >= seqlen_k:  # past this sequence's keys (or no keys at all)
                return
            start_q = int64(seqs.cu_seqlens_q[batch])
            seqlen_q = int64(seqs.cu_seqlens_q[batch + 1]) - start_q
            ws_row0 = varlen_row_offset(start_q, batch)  # the sequence's row 0 in the workspace
        diag = seqlen_k - seqlen_q  # query i sees keys j <= i + diag
        sbase = ptx.shared_address_u16(smem)
        sk = sbase + SK
        sv = sbase + SV

        if VARLEN:
            q_b0 = start_q * q_ss
            do_b0 = start_q * do_ss
            k_rows = global_rows(k, start_k * k_ss + kv_head * k_sh, k_ss, seqlen_k)
            v_rows = global_rows(v, start_k * v_ss + kv_head * v_sh, v_ss, seqlen_k)
        else:
            q_b0 = batch * q_sb
            do_b0 = batch * do_sb
            k_rows = global_rows(k, batch * k_sb + kv_head * k_sh, k_ss, seqlen_k)
            v_rows = global_rows(v, batch * v_sb + kv_head * v_sh, v_ss, seqlen_k)
        copy_tile_async(sk, BN, k_rows, n0, CPR, tid, THREADS, RB)
        copy_tile_async(sv, BN, v_rows, n0, CPR, tid, THREADS, RB)
        ptx.cp_async_commit_group()

        m_blocks = (seqlen_q + BM - 1) // BM
        m_first = int64(0)
        if CAUSAL:
            m_first = max(n0 - diag, 0) // BM  # the first query block that sees a key of the block
        band = Band(seqlen_k, diag - window_left, diag + window_right)  # read by WINDOW kernels only
        if WINDOW:  # only the query blocks whose rows see a key of the block: m_first .. m_blocks - 1
            m_first, m_blocks = band_query_blocks(n0, min(BN, seqlen_k - n0), BM, seqlen_q, band)
        per_head = max(m_blocks - m_first, 0)
        steps = group * per_head
        lse2_base = ptx.global_address_f32(lse2)
        delta_base = ptx.global_address_f32(delta)
        dq_base = ptx.global_address_f32(dq_acc)
        counter_base = ptx.global_address_i32(counters)
        counters_per_head = rows // BM

        # The warp's parts: keys x queries (Sᵀ, dPᵀ), keys x head-dim columns (dK, dV),
        # queries x head-dim columns (dQ).
        s_part = WarpPart((warp % KR) * 16 * KMT, (warp // KR) * SQ)
        kv_part = WarpPart((warp % KR) * 16 * KMT, (warp // KR) * DC)
        q_part = WarpPart((warp % QR) * 16 * QMT, (warp // QR) * DQ_COLS)

        offsets = Offsets(cuda.local.array(KB, uint32), cuda.local.array(KB, uint32),
                          cuda.local.array(4, uint32), cuda.local.array(KV_PAIRS, uint32),
                          cuda.local.array(QMT, uint32), cuda.local.array(DQ_PAIRS, uint32),
                          cuda.local.array(S_N, uint32))
        lane_offsets(offsets, s_part, kv_part, q_part, lane)
        frags = Frags(cuda.local.array((A_TILES, 4), uint32), cuda.local.array(4, uint32))

        acc_dk = cuda.local.array((KMT, KV_N, 4), float32)
        acc_dv = cuda.local.array((KMT, KV_N, 4), float32)
        zero_fragments(acc_dk, KMT, KV_N)
        zero_fragments(acc_dv, KMT, KV_N)
        acc_s = cuda.local.array((KMT, S_N, 4), float32)
        acc_dp = cuda.local.array((KMT, S_N, 4), float32)
        acc_q = cuda.local.array((QMT, DQ_N, 4), float32)

        # The walk: query blocks m_blocks - 1 down to m_first of each query head of the group in
        # turn (FlashAttention-2's order: the CTAs of a head start on the same query block, so in
        # deterministic mode no CTA waits for one that starts further up; H100, fp16, causal:
        # 0.4-0.6% faster than upward at d64 and d128, 1k and 4k); (head, m_block) is this
        # step's, (head1, m1) the next one's, each advanced by one comparison a step (no division).
        head = kv_head * group
        m_block = m_blocks - 1
        if steps > 0:
            bh = batch * heads_q + head
            if VARLEN:  # the workspace row of (head, the sequence's row 0), as bh * rows is
                bh_rows = head * rows + ws_row0
            else:
                bh_rows = bh * rows
            m0 = m_block * BM
            load_step(sbase, 0, global_rows(q, q_b0 + head * q_sh, q_ss, seqlen_q),
                      global_rows(do, do_b0 + head * do_sh, do_ss, seqlen_q), m0,
                      lse2_base + (bh_rows + m0) * 4, delta_base + (bh_rows + m0) * 4, tid)
        for step in range(steps):
            stage = step % STAGES
            m0 = m_block * BM
            bh = batch * heads_q + head
            if VARLEN:
                bh_rows = head * rows + ws_row0
            else:
                bh_rows = bh * rows
            head1 = head
            m1 = m_block - 1
            if m1 < m_first:
                head1 = head + 1
                m1 = m_blocks - 1
            if STAGES == 2:
                if step + 1 < steps:
                    if VARLEN:
                        row1 = head1 * rows + ws_row0 + m1 * BM
                    else:
                        row1 = (batch * heads_q + head1) * rows + m1 * BM
                    load_step(sbase, 1 - stage, global_rows(q, q_b0 + head1 * q_sh, q_ss, seqlen_q),
                              global_rows(do, do_b0 + head1 * do_sh, do_ss, seqlen_q), m1 * BM,
                              lse2_base + row1 * 4, delta_base + row1 * 4, tid)
                    ptx.cp_async_wait_group_1()
                else:
                    ptx.cp_async_wait_group_0()
            else:
                if step > 0:
                    load_step(sbase, 0, global_rows(q, q_b0 + head * q_sh, q_ss, seqlen_q),
                              global_rows(do, do_b0 + head * do_sh, do_ss, seqlen_q), m0,
                              lse2_base + (bh_rows + m0) * 4, delta_base + (bh_rows + m0) * 4, tid)
                ptx.cp_async_wait_group_0()
            cuda.syncthreads()  # this step's tiles have landed for everyone
            at = sbase + stage * STAGE
            tiles = StepTiles(at + SQ0, at + SDO0, at + SLSE0, at + SDELTA0)

            transposed_scores(acc_s, acc_dp, sk, sv, tiles, frags, offsets)
            key0 = n0 + s_part.row0
            q0 = m0 + s_part.col0
            if SOFTCAP:  # before the masks: tanh(-inf) is not -inf
                for mt in range(KMT):
                    for j in range(S_N):
                        for e in range(4):
                            acc_s[mt, j, e] = ptx.tanh(acc_s[mt, j, e] * cap_scale)
            if WINDOW:
                if band_needs_mask(key0, 16 * KMT, q0, SQ, band):  # keys x queries: an edge or the keys' end
                    for mt in range(KMT):
                        mask_band_transposed(acc_s[mt], S_N, key0 + 16 * mt, q0, lane, band)
            elif key0 + 16 * KMT > seqlen_k or (CAUSAL and key0 + 16 * KMT - 1 > q0 + diag):
                for mt in range(KMT):
                    mask_transposed(acc_s[mt], S_N, key0 + 16 * mt, q0, lane, seqlen_k, diag, CAUSAL)
            gradient_of_scores(acc_s, acc_dp, tiles, s_part, scale_log2, lane)
            store_scores(sbase + SP, acc_s, offsets)
            store_scores(sbase + SDS, acc_dp, offsets)
            cuda.syncthreads()  # Pᵀ and dSᵀ are in shared memory for everyone

            product_tn(TnProduct(acc_dv, sbase + SP, tiles.do, frags, offsets))
            # dQ before dK (FlashAttention-2's order): its red.global adds drain while the dK
            # product runs, instead of queueing in front of the next step's cp.async copies.
            if VARLEN:  # rows and ws_row0 are multiples of block_m
                counter_at = counter_base + ((bh_rows + m0) // BM) * 4
            else:
                counter_at = counter_base + (bh * counters_per_head + m_block) * 4
            if deterministic:  # wait for this query block's turn: key blocks add in order
                # The key blocks that visit a query block are the consecutive ones it sees: 0 ..
                # (causal or full), or a window's range from its first (band_kv_tiles, the inverse
                # of band_query_blocks): this block's turn is its place in that range.
                turn = n_block
                if WINDOW:
                    turn = n_block - band_kv_tiles(m0, min(BM, seqlen_q - m0), BN, band)[0]
                if tid == 0:
                    while ptx.ld_acquire_gpu_s32(counter_at) != turn:
                        pass
                cuda.syncthreads()
            add_dq(sbase + SDS, sk, dq_base + ((bh_rows + m0) * D + DQ_VECTOR * tid) * 4, frags, offsets,
                   acc_q)
            if deterministic:
                cuda.threadfence()
                cuda.syncthreads()
                if tid == 0:
                    ptx.red_release_gpu_add_s32(counter_at, int32(1))
            product_tn(TnProduct(acc_dk, sbase + SDS, tiles.q, frags, offsets))
            cuda.syncthreads()  # every warp is done with this step's tiles
            head = head1
            m_block = m1

        # Epilogue: dK (scaled) and dV through the K and V tiles, 16-byte stores.
        drain_copies()
        for mt in range(KMT):
            row0 = kv_part.row0 + 16 * mt
            store_fragment_rows(sk, acc_dk[mt], KV_N, BN, row0, kv_part.col0, lane, BF16, RB, scale)
            store_fragment_rows(sv, acc_dv[mt], KV_N, BN, row0, kv_part.col0, lane, BF16, RB, float32(1.0))
        cuda.syncthreads()
        scratch = cuda.local.array(4, uint32)
        first = warp * STORE_ROWS
        if VARLEN:
            dk_rows = global_rows(dk, start_k * dk_ss + kv_head * dk_sh, dk_ss, seqlen_k)
            dv_rows = global_rows(dv, start_k * dv_ss + kv_head * dv_sh, dv_ss, seqlen_k)
        else:
            dk_rows = global_rows(dk, batch * dk_sb + kv_head * dk_sh, dk_ss, seqlen_k)
            dv_rows = global_rows(dv, batch * dv_sb + kv_head * dv_sh, dv_ss, seqlen_k)
        store_rows_global(dk_rows, n0 + first, sk, BN, first, STORE_ROWS, CPR, lane, scratch, RB)
        store_rows_global(dv_rows, n0 + first, sv, BN, first, STORE_ROWS, CPR, lane, scratch, RB)

    mask_kind = "window" if window else "causal" if causal else "full"
    kind = f"{mask_kind}{'_softcap' if softcap else ''}_{'bf16' if bf16 else 'f16'}"
    if varlen:
        kind = f"varlen_{kind}"
    flash_backward.__name__ = f"flash_backward_d{D}_m{BM}_n{BN}{config.tag}_{kind}"
    flash_backward.launch_bounds = (THREADS, 1)
    if not VARLEN:
        return flash_backward
    body = cuda.jit(device=True, forceinline=True)(flash_backward)

    def flash_backward_varlen(q, k, v, do, dk, dv, lse2, delta, dq_acc, counters,
                              q_sb, q_ss, q_sh, k_sb, k_ss, k_sh, v_sb, v_ss, v_sh,
                              do_sb, do_ss, do_sh, dk_sb, dk_ss, dk_sh, dv_sb, dv_ss, dv_sh,
                              seqlen_q, seqlen_k, rows, heads_q, group, heads_kv, tail_pairs, scale_log2,
                              scale, deterministic, window_left, window_right, cap_scale, cu_seqlens_q,
                              cu_seqlens_k, total_q):
        seqs = Sequences(int64(0), cu_seqlens_q, cu_seqlens_k, total_q)  # count unused: the grid is exact
        body(q, k, v, do, dk, dv, lse2, delta, dq_acc, counters, seqs, q_ss, q_sh, k_sb, k_ss, k_sh,
             v_sb, v_ss, v_sh, do_sb, do_ss, do_sh, dk_sb, dk_ss, dk_sh, dv_sb, dv_ss, dv_sh,
             seqlen_q, seqlen_k, rows, heads_q, group, heads_kv, tail_pairs, scale_log2, scale,
             deterministic, window_left, window_right, cap_scale)

    flash_backward_varlen.__name__ = flash_backward.__name__
    flash_backward_varlen.launch_bounds = flash_backward.launch_bounds
    return flash_backward_varlen


# The variants' factories (``operations.families``: one kernel operation each, built on demand).
def make_backward_window_kernel(config: BackwardConfig, causal: bool, bf16: bool):
    """The sliding-window main kernel of ``config`` (``causal`` is ignored: a window's right edge 0
    is causal masking; ``KernelOp.masked`` is False for it)."""
    return make_backward_kernel(config, False, bf16, window=True)


def make_backward_softcap_kernel(config: BackwardConfig, causal: bool, bf16: bool):
    """The softcapped main kernel of ``config``, causal or not."""
    return make_backward_kernel(config, causal, bf16, softcap=True)


def make_backward_window_softcap_kernel(config: BackwardConfig, causal: bool, bf16: bool):
    """The sliding-window, softcapped main kernel of ``config`` (``causal`` ignored, as for the
    window)."""
    return make_backward_kernel(config, False, bf16, window=True, softcap=True)


# The packed variable-length builds (``flash_attention_varlen_backward``): their own prepare and dQ
# kernels, and the main kernel's plain, window and softcap variants.
def make_backward_varlen_prep_kernel(config: BackwardConfig, causal: bool, bf16: bool):
    """The packed variable-length prepare kernel (``VARLEN_BACKWARD_PREP_ARGTYPES``)."""
    return make_backward_prep_kernel(config, False, bf16, varlen=True)


def make_backward_varlen_dq_kernel(config: BackwardConfig, causal: bool, bf16: bool):
    """The packed variable-length dQ kernel (``VARLEN_BACKWARD_DQ_ARGTYPES``)."""
    return make_backward_dq_kernel(config, False, bf16, varlen=True)


def make_backward_varlen_kernel(config: BackwardConfig, causal: bool, bf16: bool):
    """The packed variable-length main kernel (``VARLEN_BACKWARD_ARGTYPES``), causal or not."""
    return make_backward_kernel(config, causal, bf16, varlen=True)


def make_backward_varlen_window_kernel(config: BackwardConfig, causal: bool, bf16: bool):
    """The packed variable-length sliding-window main kernel (``causal`` ignored)."""
    return make_backward_kernel(config, False, bf16, window=True, varlen=True)


def make_backward_varlen_softcap_kernel(config: BackwardConfig, causal: bool, bf16: bool):
    """The packed variable-length softcapped main kernel, causal or not."""
    return make_backward_kernel(config, causal, bf16, softcap=True, varlen=True)


def make_backward_varlen_window_softcap_kernel(config: BackwardConfig, causal: bool, bf16: bool):
    """The packed variable-length sliding-window, softcapped main kernel (``causal`` ignored)."""
    return make_backward_kernel(config, False, bf16, window=True, softcap=True, varlen=True)
