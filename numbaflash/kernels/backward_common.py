"""What the backward kernels share: the row source (where a dense call's or a packed sequence's
rows are: ``make_row_source``), the prepare kernel and the dQ kernel. The mma.sync backward
(``backward_mma``) and the Hopper one (``backward_ws``) run the same prepare and dQ kernels
around their main kernels (``abi.BACKWARD_ABI`` describes the float32 workspace they share):

- ``prep``: D = rowsum(dO ∘ O) per query row, the forward's LSE in log2 units (+inf where a
  row saw no key, so that its P is 0), a zeroed dQ accumulator and zeroed turn counters; its
  learnable-sink build also adds d_sink = -Σ p_sink · D (``make_sink_gradient``): with the
  forward's sink-inclusive LSE the main and dQ kernels give dq, dk, dv unchanged;
- ``dq``: dQ = scale · accumulator, in the input dtype.

Both serve every variant of the main kernel (window, softcap) and have a ``varlen`` build, whose
only difference is the row source: each kernel function packs its parameters into records
(``View``, ``PrepWorkspace``, ``PackedRows``) and calls one body device function.
"""

from __future__ import annotations

import math
from collections import namedtuple

from numba import cuda, float32, int64, uint16, uint32

from .. import ptx
from . import abi, params
from .common import FULL_MASK, NEG_INF
from .epilogue import store_rows_global
from .fragments import store_fragment_rows, store_transposed_fragment
from .shapes import PREP_ROWS, PREP_THREADS, BackwardConfig, prep_split
from .smem import GlobalRows, global_rows

LOG2_E = 1.4426950408889634
INF = float32(math.inf)
# The packed variable-length workspace (``abi.varlen_row_offset``): a sequence's first row and its
# padded rows, on the device.
varlen_row_offset = cuda.jit(device=True, forceinline=True)(abi.varlen_row_offset)
varlen_padded_rows = cuda.jit(device=True, forceinline=True)(abi.varlen_padded_rows)

# One 16-bit tensor of a call as the kernels address it: the flat array and its batch, row and
# head strides (elements; a packed variable-length tensor's batch stride is never read).
View = namedtuple("View", ["data", "batch_stride", "row_stride", "head_stride"])
# The packed variable-length sequences of a varlen build (``abi.VARLEN_BACKWARD_*_ABI``): the int32
# offsets of their queries and keys ((batch + 1,) each) and total_q, the forward LSE's head stride.
PackedRows = namedtuple("PackedRows", ["cu_seqlens_q", "cu_seqlens_k", "total_q"])
# Where a kernel finds a sequence's rows (``make_row_source``; dense or packed, picked at build
# time):
# - ``queries(seqs, batch, seqlen_q)``, ``keys(seqs, batch, seqlen_k)``: (the sequence's first row
#   in the tensors, its length);
# - ``past(first, end)``: a block from ``first`` lies past the sequence's ``end`` (never when
#   dense: the grid is exact);
# - ``base(view, batch, start)``: the element offset of the sequence's row 0 in a View, head 0;
#   ``row0(view, batch, start, head)``: that of a head's row 0, and ``rows(view, batch, start,
#   head, seqlen)`` the GlobalRows from there (``smem.global_rows``); ``head_rows(view, base, head,
#   seqlen)``: the same from a ``base``;
# - ``workspace_start(batch, start_q)``: the sequence's row 0 within a head's workspace rows (0
#   when dense), and ``workspace_row0(batch, ws_start, head, heads_q, rows)`` the head's row 0;
# - ``counter(batch, heads_q, head, ws_row, block, per_head)``: the turn counter of the query
#   block from workspace row ``ws_row`` (block ``block`` of its head);
# - ``lse_row0(seqs, batch, start_q, head, heads_q, seqlen_q)``: the head's row 0 in the LSE.
RowSource = namedtuple("RowSource", ["queries", "keys", "past", "base", "row0", "rows", "head_rows",
                                     "workspace_start", "workspace_row0", "counter", "lse_row0"])
# The prepare kernel's float32 workspace: D, LSE₂, the dQ accumulator, the turn counters, the
# rows per head and the counters per head.
PrepWorkspace = namedtuple("PrepWorkspace", ["delta", "lse2", "dq_acc", "counters", "rows",
                                             "counters_per_head"])
# A sink build's prepare arrays: the float32 (heads_q,) logits and the d_sink it adds into.
SinkArrays = namedtuple("SinkArrays", ["sink", "d_sink"])
# The prepare kernel's d_sink steps (``make_sink_gradient``): logit, add, commit.
SinkGradient = namedtuple("SinkGradient", ["logit", "add", "commit"])


@cuda.jit(device=True, forceinline=True)
def f32_of_bits(bits, bf16):
    """The 16-bit value in ``bits`` (uint32, low half) as float32."""
    return ptx.f32_from_bf16_bits(bits) if bf16 else ptx.f32_from_f16_bits(bits)


# ---------------------------------------------------------------------------------- row source

def make_row_source(block_m: int, varlen: bool) -> RowSource:
    """The rows of a dense call (batch strides, ``(batch, head)`` workspace rows) or, ``varlen``,
    of packed sequences (``PackedRows``: the sequence's offsets; its workspace rows from
    ``varlen_row_offset``, whole ``block_m``-row blocks). One piece for all three kernels: every
    place that differs between the two layouts is one of these steps."""
    BM = block_m

    @cuda.jit(device=True, forceinline=True)
    def dense_length(seqs, batch, seqlen):
        return int64(0), seqlen

    @cuda.jit(device=True, forceinline=True)
    def packed_queries(seqs, batch, seqlen_q):
        start_q = int64(seqs.cu_seqlens_q[batch])
        return start_q, int64(seqs.cu_seqlens_q[batch + 1]) - start_q

    @cuda.jit(device=True, forceinline=True)
    def packed_keys(seqs, batch, seqlen_k):
        start_k = int64(seqs.cu_seqlens_k[batch])
        return start_k, int64(seqs.cu_seqlens_k[batch + 1]) - start_k

    @cuda.jit(device=True, forceinline=True)
    def dense_past(first, end):
        return False

    @cuda.jit(device=True, forceinline=True)
    def packed_past(first, end):
        return first >= end

    @cuda.jit(device=True, forceinline=True)
    def dense_base(view, batch, start):
        return batch * view.batch_stride

    @cuda.jit(device=True, forceinline=True)
    def packed_base(view, batch, start):
        return start * view.row_stride

    @cuda.jit(device=True, forceinline=True)
    def dense_workspace_start(batch, start_q):
        return int64(0)

    @cuda.jit(device=True, forceinline=True)
    def packed_workspace_start(batch, start_q):
        return varlen_row_offset(start_q, batch)

    @cuda.jit(device=True, forceinline=True)
    def dense_workspace_row0(batch, ws_start, head, heads_q, rows):
        return (batch * heads_q + head) * rows

    @cuda.jit(device=True, forceinline=True)
    def packed_workspace_row0(batch, ws_start, head, heads_q, rows):
        return head * rows + ws_start

    @cuda.jit(device=True, forceinline=True)
    def dense_counter(batch, heads_q, head, ws_row, block, per_head):
        return (batch * heads_q + head) * per_head + block

    @cuda.jit(device=True, forceinline=True)
    def packed_counter(batch, heads_q, head, ws_row, block, per_head):
        return ws_row // BM  # rows and the sequence's row offset are multiples of block_m

    @cuda.jit(device=True, forceinline=True)
    def dense_lse_row0(seqs, batch, start_q, head, heads_q, seqlen_q):
        return (batch * heads_q + head) * seqlen_q

    @cuda.jit(device=True, forceinline=True)
    def packed_lse_row0(seqs, batch, start_q, head, heads_q, seqlen_q):
        return head * seqs.total_q + start_q  # the LSE is (heads_q, total_q)

    base = packed_base if varlen else dense_base

    @cuda.jit(device=True, forceinline=True)
    def row0(view, batch, start, head):
        return base(view, batch, start) + head * view.head_stride

    @cuda.jit(device=True, forceinline=True)
    def head_rows(view, first, head, seqlen):
        return global_rows(view.data, first + head * view.head_stride, view.row_stride, seqlen)

    @cuda.jit(device=True, forceinline=True)
    def rows(view, batch, start, head, seqlen):
        return global_rows(view.data, row0(view, batch, start, head), view.row_stride, seqlen)

    if varlen:
        return RowSource(packed_queries, packed_keys, packed_past, base, row0, rows, head_rows,
                         packed_workspace_start, packed_workspace_row0, packed_counter, packed_lse_row0)
    return RowSource(dense_length, dense_length, dense_past, base, row0, rows, head_rows,
                     dense_workspace_start, dense_workspace_row0, dense_counter, dense_lse_row0)


# ---------------------------------------------------------------------------------- prepare and dQ

def make_sink_gradient(sink: bool) -> SinkGradient:
    """The prepare kernel's part of d_sink (a learnable sink: ``sink``; the steps do nothing
    otherwise, and the plain builds' code is unchanged). A sink's rows have
    p_sink = exp(sink[head] - LSE) (natural-log units; the forward's LSE includes the sink) and
    d_sink[head] = -Σ p_sink · D over every batch and row of the query head (rows past the
    sequence give nothing; a row that saw no key has O = 0, so D = 0; a sink of -inf gives 0).

    - ``logit(sinks, head)``: the head's sink (``sinks``: a SinkArrays, None without a sink);
    - ``add(part, logit, lse, delta)``: ``part`` with one row's -p_sink · D added;
    - ``commit(sinks, head, part, tid)``: the CTA's 128 parts summed (warp shuffles, then shared
      memory) and thread 0's one float32 reduction into ``d_sink[head]``."""
    WARPS = PREP_THREADS // 32

    @cuda.jit(device=True, forceinline=True)
    def logit(sinks, head):
        if sink:
            return sinks.sink[head]
        return float32(0.0)

    @cuda.jit(device=True, forceinline=True)
    def add(part, logit, lse, delta):
        if sink:
            return part - math.exp(logit - lse) * delta
        return part

    @cuda.jit(device=True, forceinline=True)
    def commit(sinks, head, part, tid):
        if sink:
            for offset in (16, 8, 4, 2, 1):
                part += cuda.shfl_xor_sync(FULL_MASK, part, offset)
            parts = cuda.shared.array(WARPS, float32)
            if tid % 32 == 0:
                parts[tid // 32] = part
            cuda.syncthreads()
            if tid == 0:
                total = float32(0.0)
                for w in range(WARPS):
                    total += parts[w]
                ptx.red_global_add_f32(ptx.global_address_f32(sinks.d_sink) + 4 * head, total)

    return SinkGradient(logit, add, commit)


def make_backward_prep_kernel(config: BackwardConfig, causal: bool, bf16: bool, varlen: bool = False,
                              sink: bool = False):
    """The prep kernel (``abi.BACKWARD_PREP_ABI``): grid (rows // 64, heads_q, batch), 128 threads;
    the same code with causal masking or not (``causal`` is not used: one kernel serves both).
    The threads of a row (``prep_split``) each load 16-byte chunks of O and dO (the loads of up
    to 8 passes issued before any sum), dot them and sum over a shuffle tree; then 16-byte
    stores zero the block's dQ accumulator.

    ``varlen``: the packed variable-length build (``abi.VARLEN_BACKWARD_PREP_ABI``; grid
    (backward_rows(max_seqlen_q) // 64, heads_q, batch)): the sequence's rows come from the row
    source (``make_row_source``); a block past its sequence's padded rows (``varlen_padded_rows``)
    returns.

    ``sink``: the learnable sink's build (``params.SINK_GRADIENT`` last: the float32 (heads_q,)
    logits and d_sink, which must be zero before the launch): each CTA also adds its rows' part of
    d_sink (``make_sink_gradient``)."""
    config.check()
    D = config.head_dim  # the dQ accumulator's columns (Q's head dim)
    DV = config.value_dim  # O's and dO's, whose rows D = rowsum(dO ∘ O) sums
    BM = config.block_m
    TPR, PER, RPP = prep_split(DV)
    PASSES = PREP_ROWS // RPP
    GROUP = min(PASSES, 8)  # passes whose loads are in flight together (unrolled: registers)
    SHUFFLES = tuple(TPR >> i for i in range(1, TPR.bit_length()))  # TPR/2 .. 1
    ZERO_STORES = PREP_ROWS * D // 4 // PREP_THREADS  # 16-byte stores a thread
    BF16 = bf16
    WHOLE_BLOCKS = BM % PREP_ROWS == 0  # a query block starts only at the first of a CTA's rows
    source = make_row_source(BM, varlen)
    sink_gradient = make_sink_gradient(sink)

    @cuda.jit(device=True, forceinline=True)
    def run_prep(o, do, lse, ws, seqlen_q, heads_q, seqs, sinks):
        """D and LSE₂ of the block's 64 rows of one (sequence, head), its dQ accumulator zeroed
        and its turn counter reset (``o``, ``do``: Views; ``ws``: a PrepWorkspace; ``sinks``: a
        SinkArrays, None without a sink)."""
        tid = cuda.threadIdx.x & 1023
        x = int64(cuda.blockIdx.x)
        head = int64(cuda.blockIdx.y)
        batch = int64(cuda.blockIdx.z)
        row_base = x * PREP_ROWS
        part = tid % TPR
        start_q, seqlen_q = source.queries(seqs, batch, seqlen_q)
        if source.past(row_base, varlen_padded_rows(seqlen_q)):  # past the sequence's workspace rows
            return
        if not WHOLE_BLOCKS and row_base >= (seqlen_q + BM - 1) // BM * BM:  # rows no query block reads
            return
        ws_row0 = source.workspace_row0(batch, source.workspace_start(batch, start_q), head, heads_q, ws.rows)
        o_at = ptx.global_address(o.data) + 2 * source.row0(o, batch, start_q, head) + 16 * part
        do_at = ptx.global_address(do.data) + 2 * source.row0(do, batch, start_q, head) + 16 * part
        lse_row0 = source.lse_row0(seqs, batch, start_q, head, heads_q, seqlen_q)
        sink_logit = sink_gradient.logit(sinks, head)
        sink_part = float32(0.0)
        ov = cuda.local.array((GROUP, PER, 4), uint32)
        dov = cuda.local.array((GROUP, PER, 4), uint32)
        for g in range(PASSES // GROUP):
            for p in range(GROUP):
                row = row_base + (g * GROUP + p) * RPP + tid // TPR
                for c in range(PER):
                    if row < seqlen_q:
                        ptx.ld_global_nc_v4_at(ov[p, c], o_at + 2 * row * o.row_stride + 16 * TPR * c)
                        ptx.ld_global_nc_v4_at(dov[p, c], do_at + 2 * row * do.row_stride + 16 * TPR * c)
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
                    at = ws_row0 + row
                    ws.delta[at] = acc
                    value = INF
                    if row < seqlen_q:
                        forward = lse[lse_row0 + row]
                        if forward != NEG_INF:
                            value = forward * float32(LOG2_E)
                            sink_part = sink_gradient.add(sink_part, sink_logit, forward, acc)
                    ws.lse2[at] = value
        sink_gradient.commit(sinks, head, sink_part, tid)
        zeros = cuda.local.array(4, uint32)
        for w in range(4):
            zeros[w] = 0
        zero_at = ptx.global_address_f32(ws.dq_acc) + 4 * (ws_row0 + row_base) * D + 16 * tid
        for i in range(ZERO_STORES):
            ptx.st_global_v4_at(zero_at + 16 * PREP_THREADS * i, zeros)
        if WHOLE_BLOCKS:
            if tid == 0 and row_base % BM == 0:
                ws.counters[source.counter(batch, heads_q, head, ws_row0 + row_base, row_base // BM,
                                           ws.counters_per_head)] = 0
        elif tid == 0:  # the query block that starts in these rows, if one does (block_m 80)
            block = (row_base + BM - 1) // BM
            if block * BM < row_base + PREP_ROWS:
                ws.counters[source.counter(batch, heads_q, head, ws_row0 + block * BM, block,
                                           ws.counters_per_head)] = 0

    seqs = "PackedRows(cu_seqlens_q, cu_seqlens_k, total_q)" if varlen else "int64(0)"
    declared = params.VARLEN_BACKWARD_PREP if varlen else params.BACKWARD_PREP
    kernel = params.entry(
        "backward_prep_varlen" if varlen else "backward_prep",
        declared + params.SINK_GRADIENT if sink else declared,
        "run_prep(View(o, o_sb, o_ss, o_sh), View(do, do_sb, do_ss, do_sh), lse, PrepWorkspace(delta, lse2, "
        f"dq_acc, counters, rows, counters_per_head), seqlen_q, heads_q, {seqs}, "
        f"{'SinkArrays(sink, d_sink)' if sink else 'None'})",
        {"run_prep": run_prep, "View": View, "PrepWorkspace": PrepWorkspace, "PackedRows": PackedRows,
         "SinkArrays": SinkArrays, "int64": int64})
    dims = f"d{D}v{DV}" if DV != D else f"d{D}"
    kernel.__name__ = (f"flash_backward_prep_{dims}_m{BM}_{'varlen_' if varlen else ''}"
                       f"{'bf16' if bf16 else 'f16'}{'_sink' if sink else ''}")
    kernel.launch_bounds = (PREP_THREADS, 1)
    return kernel


def make_backward_dq_kernel(config: BackwardConfig, causal: bool, bf16: bool, varlen: bool = False):
    """The dQ kernel (``abi.BACKWARD_DQ_ABI``): grid (ceil(seqlen_q / block_m), heads_q, batch),
    ``config.threads`` threads. Thread ``tid`` reads back the accumulator elements that thread
    ``tid`` of the main kernel added (fragment order, ``BackwardConfig.dq_position``: coalesced
    loads), stores them scaled, as 16-bit pairs, into a swizzled shared tile of the block, and the
    warps then write the block's rows with 16-byte stores.

    ``varlen``: the packed variable-length build (``abi.VARLEN_BACKWARD_DQ_ABI``; grid
    (backward_rows(max_seqlen_q) // block_m, heads_q, batch)): the sequence's rows come from the
    row source (``make_row_source``); a block past its sequence's end returns."""
    config.check()
    D = config.head_dim
    BM = config.block_m
    THREADS = config.threads
    QR = config.dq_row_warps
    QMT = BM // (16 * QR)
    DQ_COLS = D // config.dq_col_warps
    DQ_N = DQ_COLS // 8
    RB = config.row_bytes
    CPR = D // 8
    STORE_ROWS = BM // config.num_warps  # rows each warp writes out
    VEC = config.dq_vector
    # The block goes out through a static shared tile (48 KB at most) in column passes: one up to
    # head dim 256 (64 x 256), two above (head dim 512: a warp's dQ columns lie in one pass's).
    PASSES = 1 if BM * D * 2 <= 48 * 1024 else 2
    WIDTH = D // PASSES  # columns of the tile
    TILE = BM * WIDTH  # 16-bit elements of the block's shared tile
    if TILE * 2 > 48 * 1024 or WIDTH % DQ_COLS:
        raise ValueError(f"the dQ kernel's static shared tile ({BM} x {WIDTH} 16-bit) exceeds 48 KB, or "
                         f"a warp's {DQ_COLS} columns straddle two passes: {config}")
    BF16 = bf16
    TRANSPOSED = config.dq_transposed  # (``dq_position``): 8-query n-tiles of 16 head-dim columns a warp
    T_N = BM // 8
    source = make_row_source(BM, varlen)

    @cuda.jit(device=True, forceinline=True)
    def run_dq(dq_acc, dq, seqlen_q, rows, heads_q, scale, seqs):
        """dQ rows of one query block of one (sequence, head) (``dq``: a View), from the float32
        accumulator (times ``scale``)."""
        smem = cuda.shared.array(TILE, uint16, alignment=128)
        tile = ptx.shared_address_u16(smem)
        tid = cuda.threadIdx.x & 1023
        warp = tid // 32
        lane = tid % 32
        head = int64(cuda.blockIdx.y)
        batch = int64(cuda.blockIdx.z)
        m0 = int64(cuda.blockIdx.x) * BM
        start_q, seqlen_q = source.queries(seqs, batch, seqlen_q)
        if source.past(m0, seqlen_q):
            return
        ws_row0 = source.workspace_row0(batch, source.workspace_start(batch, start_q), head, heads_q, rows)
        at = (ws_row0 + m0) * D + VEC * tid
        if TRANSPOSED or PASSES == 1:  # the block in one pass
            if TRANSPOSED:  # a dQᵀ fragment: its rows are this warp's 16 head-dim columns
                acc_t = cuda.local.array((T_N, 4), float32)
                for j in range(T_N):
                    for e in range(4):  # config.dq_offset(tid, 4 j + e)
                        acc_t[j, e] = dq_acc[at + j * 4 * THREADS + e]
                store_transposed_fragment(tile, acc_t, T_N, BM, 0, 16 * warp, lane, BF16, RB, scale)
            else:
                acc = cuda.local.array((QMT, DQ_N, 4), float32)
                for mt in range(QMT):
                    for j in range(DQ_N):
                        for e in range(4):  # config.dq_offset(tid, 4 (mt DQ_N + j) + e) in the block
                            acc[mt, j, e] = dq_acc[at + ((mt * DQ_N + j) * 4 + e // VEC * VEC) * THREADS
                                                   + e % VEC]
                row0 = (warp % QR) * 16 * QMT
                col0 = (warp // QR) * DQ_COLS
                for mt in range(QMT):
                    store_fragment_rows(tile, acc[mt], DQ_N, BM, row0 + 16 * mt, col0, lane, BF16, RB, scale)
            cuda.syncthreads()
            scratch = cuda.local.array(4, uint32)
            first = warp * STORE_ROWS
            dq_rows = source.rows(dq, batch, start_q, head, seqlen_q)
            store_rows_global(dq_rows, m0 + first, tile, BM, first, STORE_ROWS, CPR, lane, scratch, RB)
            return
        row0 = (warp % QR) * 16 * QMT
        col0 = (warp // QR) * DQ_COLS
        scratch = cuda.local.array(4, uint32)
        first = warp * STORE_ROWS
        dq_rows = source.rows(dq, batch, start_q, head, seqlen_q)
        part_acc = cuda.local.array((DQ_N, 4), float32)  # one m-tile at a time: 128 floats spill
        for h in range(PASSES):  # the warps whose columns are this pass's fill the tile; all store it
            if col0 // WIDTH == h:
                for mt in range(QMT):
                    for j in range(DQ_N):
                        for e in range(4):
                            part_acc[j, e] = dq_acc[at + ((mt * DQ_N + j) * 4 + e // VEC * VEC) * THREADS
                                                    + e % VEC]
                    store_fragment_rows(tile, part_acc, DQ_N, BM, row0 + 16 * mt, col0 - h * WIDTH, lane,
                                        BF16, RB, scale)
            cuda.syncthreads()
            part = GlobalRows(dq_rows.address + h * WIDTH * 2, dq_rows.stride, dq_rows.num_rows)
            store_rows_global(part, m0 + first, tile, BM, first, STORE_ROWS, WIDTH // 8, lane, scratch, RB)
            cuda.syncthreads()  # the tile is free for the next pass

    seqs = "PackedRows(cu_seqlens_q, cu_seqlens_k, total_q)" if varlen else "int64(0)"
    kernel = params.entry(
        "backward_dq_varlen" if varlen else "backward_dq",
        params.VARLEN_BACKWARD_DQ if varlen else params.BACKWARD_DQ,
        f"run_dq(dq_acc, View(dq, dq_sb, dq_ss, dq_sh), seqlen_q, rows, heads_q, scale, {seqs})",
        {"run_dq": run_dq, "View": View, "PackedRows": PackedRows, "int64": int64})
    kernel.__name__ = (f"flash_backward_dq_d{D}_m{BM}{config.tag}_{'varlen_' if varlen else ''}"
                       f"{'bf16' if bf16 else 'f16'}")
    kernel.launch_bounds = (THREADS, 1)
    return kernel
