"""FlashAttention-2 backward on tensor cores with cp.async + ldmatrix + mma.sync (sm_80+).

Three kernels over one float32 workspace (``abi.BACKWARD_ABI`` describes it):

1. ``prep`` (``backward_common.make_backward_prep_kernel``, shared with the Hopper backward): D =
   rowsum(dO ∘ O) per query row, the forward's LSE in log2 units (+inf where a row saw no key,
   so that its P is 0), a zeroed dQ accumulator and zeroed turn counters.
2. The main kernel (``make_backward_kernel``, this module): one CTA per block of ``block_n``
   keys of one (batch, kv head). K and V of the block sit in shared memory; dK and dV stay in
   registers while the CTA walks every query block of every query head of its group that sees
   the block (GQA sums there). For each query block, with Q, dO, LSE and D landed by cp.async
   (the next block's copies in flight when ``q_stages`` is 2):

   - ``transposed_scores`` (``make_gemms``): Sᵀ = K Qᵀ and dPᵀ = V dOᵀ (keys x queries, so that
     the rows a warp owns are keys, as in dK and dV);
   - ``scores_to_gradient`` (``make_score_gradient``): Pᵀ = exp2(Sᵀ·scale·log2e − LSE₂) and dSᵀ =
     Pᵀ ∘ (dPᵀ − D), masked past the last key and after the causal diagonal (``make_masker``),
     stored as 16-bit tiles in shared memory;
   - ``accumulate`` (``make_accumulation``): dV += Pᵀ dO from those tiles (``product_tn``); dQ_i
     += dS K, read transposed from the dSᵀ tile, added into the float32 accumulator with
     ``red.global.add.f32`` (``.v4.f32`` on sm_90: ``dq_vector``), in the dQ product's fragment
     order (``BackwardConfig.dq_offset``); in deterministic mode CTAs take turns per query block
     in key-block order (a counter per block, acquire/release), so the sums are bit-identical
     from run to run; then dK += dSᵀ Q (after dQ, so that its adds drain under the dK product).

   At the end (``make_kv_epilogue``) dK is scaled by the softmax scale and dK, dV are written
   through shared memory with 16-byte stores.
3. ``dq`` (``backward_common.make_backward_dq_kernel``, shared as ``prep``): dQ = scale ·
   accumulator, in the input dtype.

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
parameter list (``params.VARLEN_BACKWARD*``: the plain parameters, then cu_seqlens_q,
cu_seqlens_k and total_q). Each CTA takes its sequence from the grid (z, or the (batch, KV head)
pair of the main kernel), reads its bounds from the offsets, returns at once past its sequence's
end, and uses the sequence's own lengths (masks, causal diagonal, window: the variants combine);
its workspace rows start at ``abi.varlen_row_offset`` (whole 128-row blocks per sequence). All
that differs from a dense call is one piece, the row source (``make_row_source``), picked at
build time.

Each kernel function is thin: it packs its parameters into records (``View``, ``Operands``,
``Workspace``, ``Call``, ``Scaling``, and ``PackedRows`` for varlen) and calls one body device
function. The main kernel's body is built from rooms, each a ``make_*`` factory returning its
steps as a named tuple (as ``forward_ws`` is): the row source (``backward_common``), the
placement (launch order, the CTA's ``KeyBlock``, its walk of query blocks), the loads, the
GEMMs, the score gradient (with its masker), the accumulation and the dK/dV epilogue.

Every product is an m16n8k16 mma.sync; the warps split each product their own way
(``shapes.BackwardConfig``). Tiles use the swizzled layouts of ``smem``; the Pᵀ and dSᵀ tiles
are ``block_n`` rows of ``block_m`` 16-bit columns in 128-byte column blocks.
"""

from __future__ import annotations

from collections import namedtuple

from numba import cuda, float32, int32, int64, types, uint32

from .. import ptx
from . import params
from .backward_common import (
    PackedRows,
    RowSource,
    View,
    make_row_source,
)
from .blocks import (
    Band,
    band_kv_tiles,
    band_needs_mask,
    band_query_blocks,
    key_block_of,
    key_block_of_narrow,
    mask_band_transposed,
    mask_transposed,
)
from .common import keep_in_register, unroll
from .epilogue import store_rows_global
from .fragments import store_fragment_rows, zero_fragments
from .shapes import BackwardConfig
from .smem import copy_tile_async, drain_copies, ldmatrix_offsets, swizzled_offset
from .softmax import pack_16bit

# ---------------------------------------------------------------------------------- records

# The main kernel's tensors (Views): inputs Q, K, V, dO and outputs dK, dV.
Operands = namedtuple("Operands", ["q", "k", "v", "do", "dk", "dv"])
# The main kernel's float32 workspace (arrays) and its rows per head.
Workspace = namedtuple("Workspace", ["lse2", "delta", "dq_acc", "counters", "rows"])
# The main kernel's scalar arguments: the lengths (the maxima for varlen), heads, launch order,
# deterministic mode and the sliding window's sides (read by window kernels only).
Call = namedtuple("Call", ["seqlen_q", "seqlen_k", "heads_q", "group", "heads_kv", "tail_pairs",
                           "deterministic", "window_left", "window_right"])
# The exponent factor (scale, or softcap, times log2(e)), the softmax scale (dK's factor) and
# softmax scale / softcap (softcap kernels only).
Scaling = namedtuple("Scaling", ["scale_log2", "scale", "cap_scale"])
# Where a CTA sits: its key block (``n_block``, first key ``n0``) of one (batch, KV head), and
# that sequence's first query and key rows in the tensors (0 when dense), its lengths, its causal
# diagonal (query i sees keys j <= i + diag) and its first workspace row. Its sliding window (a
# Band) is the Cta's: ``Placement.window`` builds it after the K and V copies are issued.
KeyBlock = namedtuple("KeyBlock", ["n_block", "n0", "batch", "kv_head", "start_q", "start_k", "seqlen_q",
                                   "seqlen_k", "diag", "ws_start"])
# A thread's seat: its index, warp and lane, and the shared memory's base address.
Seat = namedtuple("Seat", ["tid", "warp", "lane", "sbase"])
# Global byte addresses of the workspace: LSE₂, D, the dQ accumulator, the counters; its rows and
# turn counters per head.
WorkspaceAt = namedtuple("WorkspaceAt", ["lse2", "delta", "dq", "counters", "rows", "counters_per_head"])
# What every step of a CTA's walk reads: its Seat, its KeyBlock and the block's sliding window (a
# Band; window kernels), the Operands, the WorkspaceAt, the Call, and where the sequence's rows of
# Q and dO start (``RowSource.base``).
Cta = namedtuple("Cta", ["seat", "kb", "band", "ops", "ws", "call", "q_base", "do_base"])
# Which query block of the walk: its query head and block index.
BlockIndex = namedtuple("BlockIndex", ["head", "m_block"])
# One query block of the walk: its query head, block index, first row and first workspace row
# (``Placement.query_block``).
QueryBlock = namedtuple("QueryBlock", ["head", "m_block", "m0", "row"])
# Where one warp's part of a product sits: its first row and column in the CTA's tiles.
WarpPart = namedtuple("WarpPart", ["row0", "col0"])
# The warp's parts: keys x queries (Sᵀ, dPᵀ), keys x head-dim columns (dK, and dV: ``kvv``, its
# own where V's head dim differs), queries x head-dim columns (dQ).
Parts = namedtuple("Parts", ["s", "kv", "q", "kvv"])
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
# the warp's first key m-tile, n-tile j's column pair); ``tn_bv[j2]`` dO's columns of dV where V's
# head dim differs (else ``tn_b`` itself).
Offsets = namedtuple("Offsets", ["nt_a", "nt_b", "tn_a", "tn_b", "dq_a", "dq_b", "sts", "tn_bv"])
# A warp's GEMM state: its Parts, its Frags and its Offsets.
WarpGemm = namedtuple("WarpGemm", ["parts", "frags", "offsets"])
# The warp's accumulators (float32 fragments): dK, dV (kept over the walk), Sᵀ/Pᵀ, dPᵀ/dSᵀ, dQ.
Accumulators = namedtuple("Accumulators", ["dk", "dv", "s", "dp", "q"])
# The operands of one dV or dK product (``product_tn``) and of one dQ product (``dq_product``).
TnProduct = namedtuple("TnProduct", ["acc", "a_tile", "b_tile", "frags", "offsets"])
DqProduct = namedtuple("DqProduct", ["acc", "ds_tile", "sk", "frags", "offsets", "j0"])
# The operands of one Sᵀ or dPᵀ product (``product_nt``) and of one pass of dQ's (``add_dq``).
NtProduct = namedtuple("NtProduct", ["acc", "a_tile", "b_tile", "frags", "offsets"])
DqPass = namedtuple("DqPass", ["ds_tile", "sk", "dq_at", "frags", "offsets", "acc_q"])

# The rooms' steps (each factory below returns one of these).
Gemms = namedtuple("Gemms", ["parts", "lane_offsets", "transposed_scores", "product_dv", "product_dk",
                             "dq_product"])
ScoreGradient = namedtuple("ScoreGradient", ["scores_to_gradient"])
Masker = namedtuple("Masker", ["mask"])
Loads = namedtuple("Loads", ["load_kv", "load_block"])
Accumulation = namedtuple("Accumulation", ["accumulate"])
KvEpilogue = namedtuple("KvEpilogue", ["store_dk_dv"])
Placement = namedtuple("Placement", ["launch_order", "place", "window", "query_blocks", "query_block"])


# ---------------------------------------------------------------------------------- main kernel

# The main kernel's compile-time shape (``backward_shape``), worked out once from its config.
Shape = namedtuple("Shape", [
    "d", "bm", "bn", "threads", "kr", "qr", "kmt", "sq", "s_n", "dc", "kv_n", "qmt", "dq_cols", "dq_n",
    "a_tiles", "cpr", "rb", "kb", "stages", "store_rows", "dq_vector", "layout", "dv", "dcv", "kv_nv",
    "cprv", "dq_pass_n", "offset_pairs"])
PB = 128  # bytes per row of a column block of the Pᵀ and dSᵀ tiles (block_m is 64 or 128)


def backward_shape(config: BackwardConfig) -> Shape:
    """The main kernel's tile counts of ``config``: key m-tiles of a warp (Sᵀ, dPᵀ, dK, dV: kmt),
    queries of a warp's Sᵀ and dPᵀ (sq; s_n n-tiles), head-dim columns of its dK and dV (dc;
    kv_n), query m-tiles and columns of its dQ (qmt, dq_cols; dq_n), A fragments held at once,
    16-byte chunks a row (cpr), 16-column blocks per column block (kb), rows of dK and dV each warp
    writes out (store_rows); ``layout``: the shared byte offsets (``config.shared_layout``); V's
    side (V, dO, dV: ``config.value_dim``): dv, its columns of a warp's dV (dcv; kv_nv n-tiles)
    and 16-byte chunks a row (cprv), the same as head_dim's unless the config says otherwise; the
    n-tiles of a warp's dQ that one pass computes (dq_pass_n: all of them up to head dim 256,
    half above, so that dQ's accumulator never holds more than 64 floats a thread); the transposed B
    offsets a warp keeps per product (offset_pairs: 4 above head dim 256, one 64-column block's,
    else 0 for one a pair: ``make_gemms``)."""
    D, DV, BM, BN = config.head_dim, config.value_dim, config.block_m, config.block_n
    KR, KC, QR, QC = config.key_warps, config.col_warps, config.dq_row_warps, config.dq_col_warps
    KMT, QMT = BN // (16 * KR), BM // (16 * QR)
    return Shape(D, BM, BN, config.threads, KR, QR, KMT, BM // KC, BM // KC // 8, D // KC, D // KC // 8, QMT,
                 D // QC, D // QC // 8, max(KMT, QMT), D // 8, config.row_bytes, config.row_bytes // 32,
                 config.q_stages, BN // config.num_warps, config.dq_vector, config.shared_layout, DV,
                 DV // KC, DV // KC // 8, DV // 8, D // QC // 8 // (2 if D > 256 else 1), 4 if D > 256 else 0)


def kept_offsets(s: Shape) -> tuple[int, int, int]:
    """How many transposed B offsets a warp keeps in registers for dK's (``tn_b``), dV's
    (``tn_bv``) and dQ's (``dq_b``) products: one a pair of n-tiles, or above head dim 256 one
    64-column block's (``s.offset_pairs``; the rest are whole blocks further: ``make_gemms``)."""
    kv, kvv, dq = s.kv_n // 2, s.kv_nv // 2, s.dq_n // 2
    if not s.offset_pairs:
        return kv, kvv, dq
    return s.offset_pairs, min(s.offset_pairs, kvv), s.offset_pairs


def make_gemms(s: Shape, bf16: bool) -> Gemms:
    """The warp's products, each m16n8k16 mma.sync over ldmatrix fragments: ``parts(warp)`` (its
    Parts), ``lane_offsets`` (its Offsets, once), ``transposed_scores`` (Sᵀ = K Qᵀ, dPᵀ = V dOᵀ),
    ``product_dv`` (dV += Pᵀ dO), ``product_dk`` (dK += dSᵀ Q) and ``dq_product`` (dQ = dS K).
    Where V's head dim differs (``s.dv``), dPᵀ = V dOᵀ runs over it and dV has its columns (its
    own Part and dO column offsets); else dV's product is dK's, on the same offsets."""
    D, DV, BM, BN, RB, KB = s.d, s.dv, s.bm, s.bn, s.rb, s.kb
    KMT, S_N, KV_N, KV_NV, QMT = s.kmt, s.s_n, s.kv_n, s.kv_nv, s.qmt
    KR, QR, SQ, DC, DCV, DQ_COLS = s.kr, s.qr, s.sq, s.dc, s.dcv, s.dq_cols
    DQ_PASS_N = s.dq_pass_n
    VALUE_DIM = DV != D
    # Above head dim 256 a warp's dK, dV and dQ columns start on 64-column blocks, so the transposed
    # B operands' offsets repeat every 4 pairs, a block (BM or BN rows) further: 4 registers each
    # (``s.offset_pairs``), the rest an immediate away. (Up to 256 every pair keeps its own.)
    WIDE = s.offset_pairs > 0
    TN_PAIRS, TN_PAIRS_V, DQ_OFFSET_PAIRS = kept_offsets(s)  # dK's (tn_b), dV's (tn_bv), dQ's (dq_b)
    if WIDE and (DC % 64 or DCV % 64 or DQ_COLS % 64 or RB != 128):
        raise ValueError(f"head dim {D}: a warp's columns must start on 64-column blocks")
    mma = ptx.mma_m16n8k16_bf16 if bf16 else ptx.mma_m16n8k16_f16

    @cuda.jit(device=True, forceinline=True)
    def parts(warp):
        """The warp's Parts: keys x queries, keys x head-dim columns (dK; dV's own where V's
        head dim differs), queries x head-dim columns."""
        kv = WarpPart((warp % KR) * 16 * KMT, (warp // KR) * DC)
        return Parts(WarpPart((warp % KR) * 16 * KMT, (warp // KR) * SQ), kv,
                     WarpPart((warp % QR) * 16 * QMT, (warp // QR) * DQ_COLS),
                     WarpPart(kv.row0, (warp // KR) * DCV) if VALUE_DIM else kv)

    @cuda.jit(device=True, forceinline=True)
    def mma_b_pair(acc, frags, m_tiles, j2):
        """acc[mt, 2 j2] and acc[mt, 2 j2 + 1] += A_mt B for every m-tile: the A fragments of
        ``frags.a`` times the two n-tiles of one B load (``frags.b``: registers 0-1, 2-3)."""
        for mt in range(m_tiles):
            mma(acc[mt, 2 * j2], frags.a[mt], frags.b[0:2])
            mma(acc[mt, 2 * j2 + 1], frags.a[mt], frags.b[2:4])

    def make_product_nt(depth: int):
        """``product_nt(acc, a_tile, b_tile, frags, offsets)``: acc[mt, j] += A Bᵀ over ``depth``
        head-dim columns: A = the warp's key rows (+ 16 mt) of ``a_tile`` (K or V, ldmatrix), B =
        its query rows (+ 8 j) of ``b_tile`` (Q or dO, non-transposed ldmatrix, two n-tiles a
        load)."""

        @cuda.jit(device=True, forceinline=True)
        def nt_step(kt, st):
            """k-tile ``kt`` (16 head-dim columns) of the product; ``st``: an NtProduct."""
            block = (kt // KB) * RB  # the column block, per row of the tile
            for mt in range(KMT):
                at = st.a_tile + st.offsets.nt_a[kt % KB] + block * BN + 16 * mt * RB
                ptx.ldmatrix_x4(st.frags.a[mt], at)
            for j2 in range(S_N // 2):
                ptx.ldmatrix_x4(st.frags.b, st.b_tile + st.offsets.nt_b[kt % KB] + block * BM + 16 * j2 * RB)
                mma_b_pair(st.acc, st.frags, KMT, j2)

        # Above 16 k-tiles (head dim 512) unrolled in Python: NVVM leaves a loop that long rolled,
        # and the offsets it then indexes at run time go to local memory.
        steps = unroll(nt_step, depth // 16) if depth > 256 else None

        @cuda.jit(device=True, forceinline=True)
        def product_nt(acc, a_tile, b_tile, frags, offsets):
            if depth > 256:
                steps(NtProduct(acc, a_tile, b_tile, frags, offsets))
                return
            for kt in range(depth // 16):
                nt_step(kt, NtProduct(acc, a_tile, b_tile, frags, offsets))

        return product_nt

    product_qk = make_product_nt(D)
    product_vdo = make_product_nt(DV) if VALUE_DIM else product_qk

    @cuda.jit(device=True, forceinline=True)
    def transposed_scores(acc_s, acc_dp, sk, sv, tiles, frags, offsets):
        """Sᵀ = K Qᵀ and dPᵀ = V dOᵀ for the warp's keys and queries."""
        zero_fragments(acc_s, KMT, S_N)
        zero_fragments(acc_dp, KMT, S_N)
        product_qk(acc_s, sk, tiles.q, frags, offsets)
        product_vdo(acc_dp, sv, tiles.do, frags, offsets)

    def make_product_tn(n_tiles: int, value: bool):
        """acc[mt, j] += A B over the ``block_m`` queries (a TnProduct): A = rows ``row0`` + 16 mt
        of a keys x queries tile (Pᵀ or dSᵀ, 128-byte column blocks), B = head-dim columns ``col0``
        .. of a queries x head-dim tile (dO or Q) by transposing ldmatrix, ``n_tiles`` of them at
        the offsets ``tn_b`` (``value``: ``tn_bv``). Unrolled in Python: NVVM left the k-tile loop
        rolled, so no k-tile's loads could overlap the previous one's mma.sync."""

        @cuda.jit(device=True, forceinline=True)
        def tn_step(kt, st):
            """k-tile ``kt`` (16 queries) of the product."""
            for mt in range(KMT):
                at = st.a_tile + st.offsets.tn_a[kt % 4] + (kt // 4) * (BN * PB) + 16 * mt * PB
                ptx.ldmatrix_x4(st.frags.a[mt], at)
            b_offsets = st.offsets.tn_bv if value else st.offsets.tn_b
            for j2 in range(n_tiles // 2):
                at = st.b_tile + b_offsets[j2] + 16 * kt * RB
                if WIDE:
                    at = st.b_tile + b_offsets[j2 % 4] + (j2 // 4) * (BM * RB) + 16 * kt * RB
                ptx.ldmatrix_x4_trans(st.frags.b, at)
                mma_b_pair(st.acc, st.frags, KMT, j2)

        return unroll(tn_step, BM // 16)

    product_dk = make_product_tn(KV_N, False)
    product_dv = make_product_tn(KV_NV, True) if VALUE_DIM else product_dk

    @cuda.jit(device=True, forceinline=True)
    def dq_step(kt, st):
        """k-tile ``kt`` (16 keys) of ``dq_product``: the pass's n-tiles (``dq_pass_n``) from
        n-tile pair ``st.j0`` of the warp's columns."""
        for mt in range(QMT):  # A(m = query, k = key) of the keys x queries tile, transposed
            ptx.ldmatrix_x4_trans(st.frags.a[mt], st.ds_tile + st.offsets.dq_a[mt] + 16 * kt * PB)
        for j2 in range(DQ_PASS_N // 2):
            at = st.sk + st.offsets.dq_b[st.j0 + j2] + 16 * kt * RB
            if WIDE:
                jj = st.j0 + j2
                at = st.sk + st.offsets.dq_b[jj % 4] + (jj // 4) * (BN * RB) + 16 * kt * RB
            ptx.ldmatrix_x4_trans(st.frags.b, at)
            mma_b_pair(st.acc, st.frags, QMT, j2)

    # dQ rows ``part.row0`` + 16 mt, columns ``part.col0`` .. of this step (a DqProduct): dS (from
    # the dSᵀ tile, by transposing ldmatrix) times K (transposing ldmatrix), over the block's keys.
    dq_product = unroll(dq_step, BN // 16)

    @cuda.jit(device=True, forceinline=True)
    def lane_offsets(offsets, parts, lane):
        """Fill ``offsets`` (an Offsets) for this lane and its warp's Parts; each value is kept
        in a register (``keep_in_register``), not recomputed from the lane index every step."""
        s_part, kv_part, q_part, kvv_part = parts
        ldmatrix_offsets(offsets.nt_a, lane % 16, lane // 16, RB)
        ldmatrix_offsets(offsets.nt_b, lane % 8 + (lane // 16) * 8, (lane // 8) % 2, RB)
        ldmatrix_offsets(offsets.tn_a, lane % 16, lane // 16, PB)
        for b in range(KB):
            offsets.nt_a[b] = keep_in_register(offsets.nt_a[b] + s_part.row0 * RB, lane)
            offsets.nt_b[b] = keep_in_register(offsets.nt_b[b] + s_part.col0 * RB, lane)
        for b in range(4):
            offsets.tn_a[b] = keep_in_register(offsets.tn_a[b] + kv_part.row0 * PB, lane)
        for j2 in range(TN_PAIRS):
            chunk = kv_part.col0 // 8 + 2 * j2 + lane // 16
            offsets.tn_b[j2] = keep_in_register(swizzled_offset(lane % 16, chunk, BM, RB), lane)
        if VALUE_DIM:  # dO's columns of the warp's dV (else tn_bv is tn_b)
            for j2 in range(TN_PAIRS_V):
                chunk = kvv_part.col0 // 8 + 2 * j2 + lane // 16
                offsets.tn_bv[j2] = keep_in_register(swizzled_offset(lane % 16, chunk, BM, RB), lane)
        for mt in range(QMT):
            key = lane % 8 + 8 * (lane // 16)
            query_chunk = (q_part.row0 + 16 * mt) // 8 + (lane // 8) % 2
            offsets.dq_a[mt] = keep_in_register(swizzled_offset(key, query_chunk, BN, PB), lane)
        for j2 in range(DQ_OFFSET_PAIRS):
            chunk = q_part.col0 // 8 + 2 * j2 + lane // 16
            offsets.dq_b[j2] = keep_in_register(swizzled_offset(lane % 16, chunk, BN, RB), lane)
        for j in range(S_N):
            at = swizzled_offset(s_part.row0 + lane // 4, s_part.col0 // 8 + j, BN, PB) + 4 * (lane % 4)
            offsets.sts[j] = keep_in_register(at, lane)

    return Gemms(parts, lane_offsets, transposed_scores, product_dv, product_dk, dq_product)


def make_masker(s: Shape, causal: bool, window: bool) -> Masker:
    """``mask(acc_s, key0, q0, lane, kb, band)``: the warp's Sᵀ (keys from ``key0``, queries from ``q0``)
    masked where its keys x queries tile crosses the end of the keys or (causal) the diagonal
    (``mask_transposed``), or with a sliding window an edge of the window (``mask_band_transposed``);
    a tile that crosses none is left as it is. ``kb``: the CTA's KeyBlock; ``band``: its Band."""
    KMT, S_N, SQ = s.kmt, s.s_n, s.sq
    CAUSAL, WINDOW = causal, window

    @cuda.jit(device=True, forceinline=True)
    def mask(acc_s, key0, q0, lane, kb, band):
        if WINDOW:
            if band_needs_mask(key0, 16 * KMT, q0, SQ, band):  # keys x queries: an edge or the keys' end
                for mt in range(KMT):
                    mask_band_transposed(acc_s[mt], S_N, key0 + 16 * mt, q0, lane, band)
        elif key0 + 16 * KMT > kb.seqlen_k or (CAUSAL and key0 + 16 * KMT - 1 > q0 + kb.diag):
            for mt in range(KMT):
                mask_transposed(acc_s[mt], S_N, key0 + 16 * mt, q0, lane, kb.seqlen_k, kb.diag, CAUSAL)

    return Masker(mask)


def make_score_gradient(s: Shape, causal: bool, bf16: bool, gemms: Gemms, window: bool = False,
                        softcap: bool = False) -> ScoreGradient:
    """``scores_to_gradient``: one query block's Sᵀ and dPᵀ, capped (softcap) and masked, turned
    into Pᵀ and dSᵀ and stored as 16-bit keys x queries tiles in shared memory for every warp."""
    KMT, S_N = s.kmt, s.s_n
    SK, SV, SP, SDS = (s.layout[name] for name in ("k", "v", "p", "ds"))
    SOFTCAP, BF16 = softcap, bf16
    masker = make_masker(s, causal, window)

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
    def scores_to_gradient(acc, tiles, wg, cta, m0, scaling):
        """Pᵀ (in ``acc.s``) and dSᵀ (in ``acc.dp``) of the query block from row ``m0`` (its
        StepTiles landed), stored for every warp (``wg``: the WarpGemm; ``cta``: the Cta)."""
        sbase, lane = cta.seat.sbase, cta.seat.lane
        gemms.transposed_scores(acc.s, acc.dp, sbase + SK, sbase + SV, tiles, wg.frags, wg.offsets)
        key0 = cta.kb.n0 + wg.parts.s.row0
        q0 = m0 + wg.parts.s.col0
        if SOFTCAP:  # before the masks: tanh(-inf) is not -inf
            for mt in range(KMT):
                for j in range(S_N):
                    for e in range(4):
                        acc.s[mt, j, e] = ptx.tanh(acc.s[mt, j, e] * scaling.cap_scale)
        masker.mask(acc.s, key0, q0, lane, cta.kb, cta.band)
        gradient_of_scores(acc.s, acc.dp, tiles, wg.parts.s, scaling.scale_log2, lane)
        store_scores(sbase + SP, acc.s, wg.offsets)
        store_scores(sbase + SDS, acc.dp, wg.offsets)
        cuda.syncthreads()  # Pᵀ and dSᵀ are in shared memory for everyone

    return ScoreGradient(scores_to_gradient)


def make_placement(s: Shape, causal: bool, source: RowSource, window: bool = False) -> Placement:
    """Where a CTA sits and what it walks: ``launch_order(call)`` -> (key block, batch, KV head)
    (``blocks.key_block_of``); ``place(...)`` -> its KeyBlock; ``window(kb, call)`` -> its sliding
    window (a Band); ``query_blocks(kb, band)`` -> (first, end): the query blocks whose rows see a
    key of the block; ``query_block(cta, at)``: the QueryBlock of a BlockIndex."""
    BM, BN = s.bm, s.bn
    CAUSAL, WINDOW = causal, window
    # (see key_block_of_narrow: measured per kernel, ptxas gave fewer registers with the narrow
    # order only to the causal kernels at d96)
    launch_index = key_block_of_narrow if causal and s.d == 96 else key_block_of

    @cuda.jit(device=True, forceinline=True)
    def launch_order(call):
        """Launch order (blocks.key_block_of): causal, the last waves longest first. 32-bit
        division: the grid has at most 2^31 - 1 CTAs."""
        key_blocks = uint32((call.seqlen_k + BN - 1) // BN)
        n_block, pair = launch_index(cuda.blockIdx.x, key_blocks, uint32(cuda.gridDim.x) // key_blocks,
                                     call.tail_pairs if CAUSAL or WINDOW else 0)
        kv_head = int64(uint32(pair) % uint32(call.heads_kv))
        batch = int64(uint32(pair) // uint32(call.heads_kv))
        return n_block, batch, kv_head

    @cuda.jit(device=True, forceinline=True)
    def place(n_block, batch, kv_head, start_k, seqlen_k, call, seqs):
        """The KeyBlock of key block ``n_block`` of (batch, kv_head), whose sequence's keys start
        at ``start_k`` and number ``seqlen_k``."""
        start_q, seqlen_q = source.queries(seqs, batch, call.seqlen_q)
        ws_start = source.workspace_start(batch, start_q)  # the sequence's row 0 in the workspace
        diag = seqlen_k - seqlen_q  # query i sees keys j <= i + diag
        return KeyBlock(n_block, n_block * BN, batch, kv_head, start_q, start_k, seqlen_q, seqlen_k, diag,
                        ws_start)

    @cuda.jit(device=True, forceinline=True)
    def window(kb, call):
        """The sliding window of KeyBlock ``kb`` (a Band; read by window kernels only). Built once
        the K and V copies are issued (not in ``place``): ptxas gave the sm_80 varlen window
        softcap kernel at d96, n64 204 registers instead of 178 with the Band worked out before
        the copies."""
        return Band(kb.seqlen_k, kb.diag - call.window_left, kb.diag + call.window_right)

    @cuda.jit(device=True, forceinline=True)
    def query_blocks(kb, band):
        """(m_first, m_blocks): every query block (full), those from the first that sees a key of
        the block (causal), or only those whose rows see one (window: ``band_query_blocks``)."""
        m_blocks = (kb.seqlen_q + BM - 1) // BM
        m_first = int64(0)
        if CAUSAL:
            m_first = max(kb.n0 - kb.diag, 0) // BM  # the first query block that sees a key of the block
        if WINDOW:  # only the query blocks whose rows see a key of the block: m_first .. m_blocks - 1
            keys = min(BN, kb.seqlen_k - kb.n0)
            m_first, m_blocks = band_query_blocks(kb.n0, keys, BM, kb.seqlen_q, band)
        return m_first, m_blocks

    @cuda.jit(device=True, forceinline=True)
    def query_block(cta, at):
        """The QueryBlock of BlockIndex ``at``: its first row and its first workspace row (LSE₂, D,
        the dQ accumulator)."""
        kb = cta.kb
        first = source.workspace_row0(kb.batch, kb.ws_start, at.head, cta.call.heads_q, cta.ws.rows)
        m0 = at.m_block * BM
        return QueryBlock(at.head, at.m_block, m0, first + m0)

    return Placement(launch_order, place, window, query_blocks, query_block)


def make_loads(s: Shape, source: RowSource, placement: Placement) -> Loads:
    """The cp.async copies: ``load_kv`` (the key block's K and V tiles) and ``load_block`` (a query
    block's Q and dO rows, its LSE₂ and D, into a stage; one commit group each)."""
    BM, BN, THREADS, CPR, CPRV, RB = s.bm, s.bn, s.threads, s.cpr, s.cprv, s.rb
    layout = s.layout
    SK, SV, SQ0, SDO0 = layout["k"], layout["v"], layout["q"], layout["do"]
    SLSE0, SDELTA0, STAGE = layout["lse"], layout["delta"], layout["stage"]

    @cuda.jit(device=True, forceinline=True)
    def load_kv(seat, kb, ops):
        """K and V rows of the CTA's key block (``kb``, a KeyBlock) into their tiles (one commit
        group)."""
        k_rows = source.rows(ops.k, kb.batch, kb.start_k, kb.kv_head, kb.seqlen_k)
        v_rows = source.rows(ops.v, kb.batch, kb.start_k, kb.kv_head, kb.seqlen_k)
        copy_tile_async(seat.sbase + SK, BN, k_rows, kb.n0, CPR, seat.tid, THREADS, RB)
        copy_tile_async(seat.sbase + SV, BN, v_rows, kb.n0, CPRV, seat.tid, THREADS, RB)
        ptx.cp_async_commit_group()

    @cuda.jit(device=True, forceinline=True)
    def load_block(cta, stage, blk):
        """cp.async of query block ``blk``'s Q and dO rows and its LSE₂ and D (``BM`` floats
        each) into ``stage``."""
        kb, ops, seat = cta.kb, cta.ops, cta.seat
        q_rows = source.head_rows(ops.q, cta.q_base, blk.head, kb.seqlen_q)
        do_rows = source.head_rows(ops.do, cta.do_base, blk.head, kb.seqlen_q)
        m0 = blk.m0
        lse2_at = cta.ws.lse2 + blk.row * 4
        delta_at = cta.ws.delta + blk.row * 4
        sbase, tid = seat.sbase, seat.tid
        off = stage * STAGE
        copy_tile_async(sbase + SQ0 + off, BM, q_rows, m0, CPR, tid, THREADS, RB)
        copy_tile_async(sbase + SDO0 + off, BM, do_rows, m0, CPRV, tid, THREADS, RB)
        chunks = BM * 4 // 16
        if tid < chunks:
            ptx.cp_async_16_at(sbase + SLSE0 + off + 16 * tid, lse2_at + 16 * tid)
        elif tid < 2 * chunks:
            ptx.cp_async_16_at(sbase + SDELTA0 + off + 16 * (tid - chunks), delta_at + 16 * (tid - chunks))
        ptx.cp_async_commit_group()

    return Loads(load_kv, load_block)


def make_accumulation(s: Shape, source: RowSource, gemms: Gemms, window: bool = False) -> Accumulation:
    """``accumulate``: one query block's dV += Pᵀ dO, its dQ = dS K added into the float32
    accumulator (in deterministic mode in the key blocks' turn), and dK += dSᵀ Q."""
    D, BM, BN, THREADS = s.d, s.bm, s.bn, s.threads
    QMT, DQ_N, DQ_VECTOR, DQ_PASS_N = s.qmt, s.dq_n, s.dq_vector, s.dq_pass_n
    DQ_PASSES = DQ_N // DQ_PASS_N
    SK, SP, SDS = s.layout["k"], s.layout["p"], s.layout["ds"]
    WINDOW = window

    @cuda.jit(device=True, forceinline=True)
    def add_dq(ds_tile, sk, dq_at, frags, offsets, acc_q):
        """dQ of this step for the warp's part, added into the query block's accumulator in
        fragment order (``BackwardConfig.dq_offset``; ``dq_at``: the block's byte address + 4
        dq_vector tid): with dq_vector 1 element ``i`` of the thread's fragment by
        ``red.global.add.f32`` at ``dq_at`` + 4 i threads, with 4 the four floats of an n-tile
        by one ``red.global.add.v4.f32`` at ``dq_at`` + 16 (i // 4) threads."""
        if DQ_PASSES == 1:
            dq_pass(0, DqPass(ds_tile, sk, dq_at, frags, offsets, acc_q))
        else:
            dq_passes(DqPass(ds_tile, sk, dq_at, frags, offsets, acc_q))

    @cuda.jit(device=True, forceinline=True)
    def dq_pass(h, st):
        """Pass ``h`` of ``add_dq``: the warp's n-tiles ``h * DQ_PASS_N`` .. of dQ, computed in
        ``st.acc_q`` and added (the accumulator's order is the whole product's); ``st``: a DqPass."""
        acc_q, dq_at = st.acc_q, st.dq_at
        zero_fragments(acc_q, QMT, DQ_PASS_N)
        gemms.dq_product(DqProduct(acc_q, st.ds_tile, st.sk, st.frags, st.offsets, h * DQ_PASS_N // 2))
        for mt in range(QMT):
            for jp in range(DQ_PASS_N):
                j = h * DQ_PASS_N + jp
                if DQ_VECTOR == 4:
                    ptx.red_global_add_v4_f32(dq_at + (mt * DQ_N + j) * (THREADS * 16), acc_q[mt, jp, 0],
                                              acc_q[mt, jp, 1], acc_q[mt, jp, 2], acc_q[mt, jp, 3])
                else:
                    for e in range(4):
                        ptx.red_global_add_f32(dq_at + ((mt * DQ_N + j) * 4 + e) * (THREADS * 4),
                                               acc_q[mt, jp, e])

    dq_passes = unroll(dq_pass, DQ_PASSES)

    @cuda.jit(device=True, forceinline=True)
    def accumulate(acc, tiles, wg, cta, blk):
        """dV, dQ and dK of query block ``blk`` from the Pᵀ and dSᵀ tiles; then a barrier."""
        seat, kb = cta.seat, cta.kb
        sbase = seat.sbase
        m0, row = blk.m0, blk.row
        gemms.product_dv(TnProduct(acc.dv, sbase + SP, tiles.do, wg.frags, wg.offsets))
        # dQ before dK (FlashAttention-2's order): its red.global adds drain while the dK
        # product runs, instead of queueing in front of the next step's cp.async copies.
        counter = source.counter(kb.batch, cta.call.heads_q, blk.head, row, blk.m_block,
                                 cta.ws.counters_per_head)
        counter_at = cta.ws.counters + counter * 4
        if cta.call.deterministic:  # wait for this query block's turn: key blocks add in order
            # The key blocks that visit a query block are the consecutive ones it sees: 0 ..
            # (causal or full), or a window's range from its first (band_kv_tiles, the inverse
            # of band_query_blocks): this block's turn is its place in that range.
            # (int32, as the counter: a 32-bit compare in the wait loop; a window kernel's stays
            # 64-bit: ptxas gave d96 v4 varlen window on sm_90a 254 registers with an int32, 252 without)
            turn = int32(kb.n_block)
            if WINDOW:
                turn = kb.n_block - band_kv_tiles(m0, min(BM, kb.seqlen_q - m0), BN, cta.band)[0]
            if seat.tid == 0:
                while ptx.ld_acquire_gpu_s32(counter_at) != turn:
                    pass
            cuda.syncthreads()
        dq_at = cta.ws.dq + (row * D + DQ_VECTOR * seat.tid) * 4
        add_dq(sbase + SDS, sbase + SK, dq_at, wg.frags, wg.offsets, acc.q)
        if cta.call.deterministic:
            cuda.threadfence()
            cuda.syncthreads()
            if seat.tid == 0:
                ptx.red_release_gpu_add_s32(counter_at, int32(1))
        gemms.product_dk(TnProduct(acc.dk, sbase + SDS, tiles.q, wg.frags, wg.offsets))
        cuda.syncthreads()  # every warp is done with this step's tiles

    return Accumulation(accumulate)


def make_kv_epilogue(s: Shape, bf16: bool, source: RowSource) -> KvEpilogue:
    """``store_dk_dv``: dK (times the softmax scale) and dV written through the K and V tiles,
    16-byte stores."""
    BN, KMT, KV_N, KV_NV, RB, STORE_ROWS = s.bn, s.kmt, s.kv_n, s.kv_nv, s.rb, s.store_rows
    CPR, CPRV = s.cpr, s.cprv
    SK, SV = s.layout["k"], s.layout["v"]
    BF16 = bf16

    @cuda.jit(device=True, forceinline=True)
    def store_dk_dv(acc, wg, cta, scale):
        seat, kb, ops = cta.seat, cta.kb, cta.ops
        sk, sv, lane = seat.sbase + SK, seat.sbase + SV, seat.lane
        kv_part, kvv_part = wg.parts.kv, wg.parts.kvv
        drain_copies()
        for mt in range(KMT):
            row0 = kv_part.row0 + 16 * mt
            store_fragment_rows(sk, acc.dk[mt], KV_N, BN, row0, kv_part.col0, lane, BF16, RB, scale)
            store_fragment_rows(sv, acc.dv[mt], KV_NV, BN, row0, kvv_part.col0, lane, BF16, RB, float32(1.0))
        cuda.syncthreads()
        scratch = cuda.local.array(4, uint32)
        first = seat.warp * STORE_ROWS
        dk_rows = source.rows(ops.dk, kb.batch, kb.start_k, kb.kv_head, kb.seqlen_k)
        dv_rows = source.rows(ops.dv, kb.batch, kb.start_k, kb.kv_head, kb.seqlen_k)
        store_rows_global(dk_rows, kb.n0 + first, sk, BN, first, STORE_ROWS, CPR, lane, scratch, RB)
        store_rows_global(dv_rows, kb.n0 + first, sv, BN, first, STORE_ROWS, CPRV, lane, scratch, RB)

    return KvEpilogue(store_dk_dv)


def make_backward_kernel(config: BackwardConfig, causal: bool, bf16: bool, window: bool = False,
                         softcap: bool = False, varlen: bool = False):
    """The main backward kernel (``params.BACKWARD``): grid ceil(seqlen_k / block_n) * heads_kv
    * batch in one dimension (``blocks.key_block_of`` maps a CTA to its key block and (batch,
    KV head)), ``config.threads`` threads, ``config.shared_bytes`` of dynamic shared memory.

    ``window``: a sliding-window kernel (``window_left`` / ``window_right`` arguments, each >= 0;
    ``causal`` must then be False: the window's right edge 0 is causal masking). ``softcap``:
    scores capped by tanh (``cap_scale`` argument = softmax_scale / softcap, ``scale_log2`` =
    softcap·log2(e), as the forward's). Kernels without them never read those arguments.

    ``varlen``: the packed variable-length build (``params.VARLEN_BACKWARD``: the same parameters,
    then cu_seqlens_q, cu_seqlens_k and total_q; seqlen_q and seqlen_k the maxima, rows the padded
    total ``varlen_workspace_rows``): the grid's third factor is the sequence; a key block past
    its sequence's keys returns at once; the sequence's own lengths replace seqlen_q and seqlen_k
    (masks, causal diagonal, window); its rows come from the row source (``make_row_source``).

    Built from the rooms above: the row source, the placement, the loads, the GEMMs, the score
    gradient (with its masker), the accumulation of dV, dQ and dK, and the dK/dV epilogue."""
    if window and causal:
        raise ValueError("a window kernel's causal masking is its right edge 0: build it with causal=False")
    config.check()
    s = backward_shape(config)
    BM, BN, A_TILES = s.bm, s.bn, s.a_tiles
    KV_PAIRS, KV_PAIRS_V, DQ_PAIRS = kept_offsets(s)
    VALUE_DIM, KV_NV = s.dv != s.d, s.kv_nv  # V's head dim apart: dV's own
    STAGES = s.stages
    STAGE, SQ0, SDO0, SLSE0, SDELTA0 = (s.layout[name] for name in ("stage", "q", "do", "lse", "delta"))
    KMT, S_N, KV_N, QMT, KB = s.kmt, s.s_n, s.kv_n, s.qmt, s.kb
    DQ_PASS_N = s.dq_pass_n
    source = make_row_source(BM, varlen)
    placement = make_placement(s, causal, source, window)
    loads = make_loads(s, source, placement)
    gemms = make_gemms(s, bf16)
    scores = make_score_gradient(s, causal, bf16, gemms, window, softcap)
    accumulation = make_accumulation(s, source, gemms, window)
    epilogue = make_kv_epilogue(s, bf16, source)

    @cuda.jit(device=True, forceinline=True)
    def run_cta(ops, ws, call, scaling, seqs):
        """One CTA: its key block's dK and dV over the walk of query blocks (``ops``: Operands;
        ``ws``: Workspace; ``call``: Call; ``scaling``: Scaling; ``seqs``: PackedRows or unused)."""
        smem = cuda.shared.array(0, types.uint16)
        tid = cuda.threadIdx.x & 1023
        warp = tid // 32
        lane = tid % 32
        n_block, batch, kv_head = placement.launch_order(call)
        start_k, seqlen_k = source.keys(seqs, batch, call.seqlen_k)
        if source.past(n_block * BN, seqlen_k):  # past this sequence's keys (or no keys at all)
            return
        kb = placement.place(n_block, batch, kv_head, start_k, seqlen_k, call, seqs)
        seat = Seat(tid, warp, lane, ptx.shared_address_u16(smem))
        q_base = source.base(ops.q, batch, kb.start_q)
        do_base = source.base(ops.do, batch, kb.start_q)
        loads.load_kv(seat, kb, ops)
        band = placement.window(kb, call)
        m_first, m_blocks = placement.query_blocks(kb, band)
        steps = call.group * max(m_blocks - m_first, 0)
        at = WorkspaceAt(ptx.global_address_f32(ws.lse2), ptx.global_address_f32(ws.delta),
                         ptx.global_address_f32(ws.dq_acc), ptx.global_address_i32(ws.counters), ws.rows,
                         ws.rows // BM)
        cta = Cta(seat, kb, band, ops, at, call, q_base, do_base)

        tn_b = cuda.local.array(KV_PAIRS, uint32)
        tn_bv = tn_b
        if VALUE_DIM:
            tn_bv = cuda.local.array(KV_PAIRS_V, uint32)
        wg = WarpGemm(gemms.parts(seat.warp),
                      Frags(cuda.local.array((A_TILES, 4), uint32), cuda.local.array(4, uint32)),
                      Offsets(cuda.local.array(KB, uint32), cuda.local.array(KB, uint32),
                              cuda.local.array(4, uint32), tn_b,
                              cuda.local.array(QMT, uint32), cuda.local.array(DQ_PAIRS, uint32),
                              cuda.local.array(S_N, uint32), tn_bv))
        gemms.lane_offsets(wg.offsets, wg.parts, seat.lane)
        acc = Accumulators(cuda.local.array((KMT, KV_N, 4), float32),
                           cuda.local.array((KMT, KV_NV, 4), float32),
                           cuda.local.array((KMT, S_N, 4), float32), cuda.local.array((KMT, S_N, 4), float32),
                           cuda.local.array((QMT, DQ_PASS_N, 4), float32))
        zero_fragments(acc.dk, KMT, KV_N)
        zero_fragments(acc.dv, KMT, KV_NV)

        # The walk: query blocks m_blocks - 1 down to m_first of each query head of the group in
        # turn (FlashAttention-2's order: the CTAs of a head start on the same query block, so in
        # deterministic mode no CTA waits for one that starts further up; H100, fp16, causal:
        # 0.4-0.6% faster than upward at d64 and d128, 1k and 4k); (head, m_block) is this
        # step's, (head1, m1) the next one's, each advanced by one comparison a step (no division).
        # Each step: the next block's copies issued (two stages) or this one's (one stage, but the
        # first's), this one's waited for; Pᵀ and dSᵀ; dV, dQ and dK. The step's lines stay here,
        # in this order, with the QueryBlock built where it is used: ptxas gave the one-stage
        # kernels 4 to 16 more registers with the copies and waits in a device function of their
        # own, or with the QueryBlock built once at the top of the step.
        head = kv_head * call.group
        m_block = m_blocks - 1
        if steps > 0:
            loads.load_block(cta, 0, placement.query_block(cta, BlockIndex(head, m_block)))
        for step in range(steps):
            stage = step % STAGES
            m0 = m_block * BM
            bh_rows = source.workspace_row0(batch, kb.ws_start, head, call.heads_q, ws.rows)
            head1 = head
            m1 = m_block - 1
            if m1 < m_first:
                head1 = head + 1
                m1 = m_blocks - 1
            if STAGES == 2:
                if step + 1 < steps:
                    loads.load_block(cta, 1 - stage, placement.query_block(cta, BlockIndex(head1, m1)))
                    ptx.cp_async_wait_group_1()
                else:
                    ptx.cp_async_wait_group_0()
            else:
                if step > 0:
                    loads.load_block(cta, 0, QueryBlock(head, m_block, m0, bh_rows + m0))
                ptx.cp_async_wait_group_0()
            cuda.syncthreads()  # this step's tiles have landed for everyone
            at_stage = seat.sbase + stage * STAGE
            tiles = StepTiles(at_stage + SQ0, at_stage + SDO0, at_stage + SLSE0, at_stage + SDELTA0)
            scores.scores_to_gradient(acc, tiles, wg, cta, m0, scaling)
            accumulation.accumulate(acc, tiles, wg, cta, QueryBlock(head, m_block, m0, bh_rows + m0))
            head = head1
            m_block = m1

        epilogue.store_dk_dv(acc, wg, cta, scaling.scale)

    seqs = "PackedRows(cu_seqlens_q, cu_seqlens_k, total_q)" if varlen else "int64(0)"
    entry = params.entry(
        "flash_backward_varlen" if varlen else "flash_backward",
        params.VARLEN_BACKWARD if varlen else params.BACKWARD,
        "run_cta(Operands(View(q, q_sb, q_ss, q_sh), View(k, k_sb, k_ss, k_sh), View(v, v_sb, v_ss, v_sh), "
        "View(do, do_sb, do_ss, do_sh), View(dk, dk_sb, dk_ss, dk_sh), View(dv, dv_sb, dv_ss, dv_sh)), "
        "Workspace(lse2, delta, dq_acc, counters, rows), Call(seqlen_q, seqlen_k, heads_q, group, heads_kv, "
        "tail_pairs, deterministic, window_left, window_right), Scaling(scale_log2, scale, cap_scale), "
        f"{seqs})",
        {"run_cta": run_cta, "Operands": Operands, "View": View, "Workspace": Workspace, "Call": Call,
         "Scaling": Scaling, "PackedRows": PackedRows, "int64": int64})

    mask_kind = "window" if window else "causal" if causal else "full"
    kind = f"{mask_kind}{'_softcap' if softcap else ''}_{'bf16' if bf16 else 'f16'}"
    if varlen:
        kind = f"varlen_{kind}"
    kernel = entry
    dims = f"d{s.d}v{s.dv}" if s.dv != s.d else f"d{s.d}"
    kernel.__name__ = f"flash_backward_{dims}_m{s.bm}_n{s.bn}{config.tag}_{kind}"
    kernel.launch_bounds = (s.threads, 1)
    return kernel
