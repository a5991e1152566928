"""The forward kernels' parameter list, in plain Python: Numba's names of the argument types
(``str(numba_type)``). The launcher packs arguments from these without importing Numba;
``common.FORWARD_ARGTYPES`` holds the same types as Numba objects for compiling, and a CPU
test checks that the two agree."""

from __future__ import annotations

_U16_ARRAY = "array(uint16, 1d, C)"  # flat 16-bit bits of q, k, v, o
_F32_ARRAY = "array(float32, 1d, C)"

FORWARD_ABI = (
    _U16_ARRAY, _U16_ARRAY, _U16_ARRAY,  # q, k, v
    _U16_ARRAY, _F32_ARRAY,  # o, lse (lse may be a 1-element dummy)
    *("int64",) * 12,  # batch, seq and head strides of q, k, v, o (elements)
    "int64", "int64",  # seqlen_q, seqlen_k
    "int64", "int64", "int64",  # batch, heads_q, heads_q // heads_kv
    "float32", "bool",  # softmax scale * log2(e) (softcap * log2(e) when capped), write lse
    "int64", "int64",  # sliding window: left, right, each >= 0 (read by window kernels only)
    "float32",  # softmax scale / softcap (read by softcap kernels only)
)

# The mma.sync forward's packed variable-length kernels (``common.VARLEN_ARGTYPES``): the same,
# then the sequences' cumulative offsets and the LSE's head stride. Grid (query blocks of
# max_seqlen_q, heads_q, batch); q, k, v, o are (1, total, heads, head_dim) views whose batch
# strides the kernel never reads, seqlen_q and seqlen_k the maxima; the LSE is (heads_q, total_q).
VARLEN_FORWARD_ABI = (
    *FORWARD_ABI,
    "array(int32, 1d, C)", "array(int32, 1d, C)",  # cu_seqlens_q, cu_seqlens_k (batch + 1,)
    "int64",  # total_q (the LSE's head stride)
)

_U64_ARRAY = "array(uint64, 1d, C)"  # a 128-byte tensor map (16 words) in global memory

# The warp-specialised Hopper kernel (``forward_ws.WS_ARGTYPES``): tensor maps instead of
# pointers and strides, a persistent grid.
WS_ABI = (
    _U64_ARRAY, _U64_ARRAY, _U64_ARRAY, _U64_ARRAY,  # maps of q, k, v, o
    _F32_ARRAY,  # lse (may be a 1-element dummy)
    "int32", "int32",  # seqlen_q, seqlen_k
    "int32",  # rows the first query block starts before row 0
    "int32", "int32", "int32",  # heads_q, heads_q // heads_kv, batch
    "float32", "bool",  # softmax scale * log2(e) (softcap * log2(e) when capped), write lse
    "int64", "int64",  # sliding window: left, right, each >= 0 (read by window kernels only)
    "float32",  # softmax scale / softcap (read by softcap kernels only)
)

_I32_ARRAY = "array(int32, 1d, C)"

# The Hopper kernel's packed variable-length builds (``forward_ws.VARLEN_WS_ARGTYPES``): the same,
# then the offsets, the LSE's head stride (total_q), and out as a flat 16-bit array with its row
# and head strides (elements), where the threads store O.
VARLEN_WS_ABI = (
    *WS_ABI,
    _I32_ARRAY, _I32_ARRAY,  # cu_seqlens_q, cu_seqlens_k (batch + 1,)
    "int64",  # total_q
    _U16_ARRAY, "int64", "int64",  # out, its row and head strides
)

# The backward (``backward_mma``): three kernels over one float32 workspace per call, laid out
# (batch, heads_q, rows) with rows = seqlen_q rounded up to BACKWARD_ROW_ALIGN: the LSE in log2
# units (+inf on rows that see no key and on padding), D = rowsum(dO ∘ O), and the dQ
# accumulator (batch, heads_q, rows, head_dim), each block of block_m rows in the main kernel's
# fragment order (``BackwardConfig.dq_position``); plus one int32 turn counter per (batch, head,
# query block) for deterministic dQ.
BACKWARD_ROW_ALIGN = 128

# 1. Prepare: D and the LSE in log2 units per row; zero the dQ accumulator and the counters.
#    Grid (rows // 64, heads_q, batch), 128 threads.
BACKWARD_PREP_ABI = (
    _U16_ARRAY, _U16_ARRAY, _F32_ARRAY,  # out, dout, lse (batch, heads_q, seqlen_q) of the forward
    _F32_ARRAY, _F32_ARRAY, _F32_ARRAY, _I32_ARRAY,  # delta, lse_log2, dq_accum, counters (outputs)
    "int64", "int64", "int64",  # out strides: batch, seq, head (elements)
    "int64", "int64", "int64",  # dout strides
    "int64", "int64", "int64",  # seqlen_q, rows, heads_q
    "int64",  # counters per (batch, head): query blocks of the main kernel
)

# 2. The main kernel: dK, dV of one key block, dQ added into the accumulator.
#    Grid ceil(seqlen_k / block_n) * heads_kv * batch (one dimension; CTA -> key block and
#    (batch, KV head) by ``blocks.key_block_of``), config.threads, config.shared_bytes.
BACKWARD_ABI = (
    _U16_ARRAY, _U16_ARRAY, _U16_ARRAY, _U16_ARRAY,  # q, k, v, dout
    _U16_ARRAY, _U16_ARRAY,  # dk, dv (outputs)
    _F32_ARRAY, _F32_ARRAY, _F32_ARRAY, _I32_ARRAY,  # lse_log2, delta, dq_accum, counters
    *("int64",) * 18,  # batch, seq and head strides of q, k, v, dout, dk, dv (elements)
    "int64", "int64", "int64",  # seqlen_q, seqlen_k, rows
    "int64", "int64", "int64",  # heads_q, heads_q // heads_kv, heads_kv
    "int64",  # tail pairs: (batch, KV head) pairs launched interleaved at the end (causal only)
    "float32", "float32",  # softmax scale * log2(e) (softcap * log2(e) when capped), softmax scale
    "bool",  # deterministic: add each query block's dQ in key-block order
    "int64", "int64",  # sliding window: left, right, each >= 0 (read by window kernels only)
    "float32",  # softmax scale / softcap (read by softcap kernels only)
)

# 2'. The Hopper backward's main kernel (``backward_ws.BACKWARD_WS_ARGTYPES``, family sm90bwd): the
#    same work and grid (``config.threads``: 384, ``config.shared_bytes``), tensor maps instead of
#    q, k, v, dout's pointers and strides (4-D maps over (batch, seqlen, heads, head_dim), boxes
#    (1, block_m | block_n, 1, 64) with 128B swizzle, as the Hopper forward's). Its prepare and dQ
#    kernels are the mma.sync ones (``BACKWARD_PREP_ABI``, ``BACKWARD_DQ_ABI``) of
#    ``WsBackwardConfig.dq_config()``.
BACKWARD_WS_ABI = (
    _U64_ARRAY, _U64_ARRAY, _U64_ARRAY, _U64_ARRAY,  # maps of q, k, v, dout
    _U16_ARRAY, _U16_ARRAY,  # dk, dv (outputs)
    _F32_ARRAY, _F32_ARRAY, _F32_ARRAY, _I32_ARRAY,  # lse_log2, delta, dq_accum, counters
    *("int64",) * 6,  # batch, seq and head strides of dk, dv (elements)
    "int64", "int64", "int64",  # seqlen_q, seqlen_k, rows
    "int64", "int64", "int64",  # heads_q, heads_q // heads_kv, heads_kv
    "int64",  # tail pairs (causal and window kernels)
    "float32", "float32",  # softmax scale * log2(e) (softcap * log2(e) when capped), softmax scale
    "bool",  # deterministic
    "int64", "int64",  # sliding window: left, right, each >= 0 (read by window kernels only)
    "float32",  # softmax scale / softcap (read by softcap kernels only)
)

# 3. dQ = the accumulator, scaled, in the input dtype. Grid (rows // block_m, heads_q, batch),
#    config.threads (the main kernel's, whose fragment order it reads).
BACKWARD_DQ_ABI = (
    _F32_ARRAY, _U16_ARRAY,  # dq_accum, dq (output)
    "int64", "int64", "int64",  # dq strides: batch, seq, head (elements)
    "int64", "int64", "int64",  # seqlen_q, rows, heads_q
    "float32",  # softmax scale
)

# The packed variable-length backward (``flash_attention_varlen_backward``): each of the three
# kernels' parameters, then the sequences: cu_seqlens_q, cu_seqlens_k (int32, batch + 1) and
# total_q (the forward's LSE is (heads_q, total_q)). Operands are (1, total, heads, head_dim)
# views whose batch strides are never read; seqlen_q and seqlen_k are the maxima, rows is
# ``varlen_workspace_rows``. Grids: prepare (backward_rows(max_seqlen_q) // 64, heads_q, batch),
# main ceil(max_seqlen_k / block_n) * heads_kv * batch, dQ (backward_rows(max_seqlen_q) //
# block_m, heads_q, batch); CTAs past their own sequence's rows return at once.
#
# The workspace is (heads_q, rows) per part (dQ accumulator: (heads_q, rows, head_dim); counters:
# (heads_q, rows // block_m)); sequence b's rows start at ``varlen_row_offset(cu_seqlens_q[b],
# b)``, a multiple of BACKWARD_ROW_ALIGN, and span ``varlen_padded_rows`` of its length, so no
# query block holds rows of two sequences (FlashAttention's padding: total_q + 128 * batch rows).
_SEQUENCES_ABI = (_I32_ARRAY, _I32_ARRAY, "int64")
VARLEN_BACKWARD_PREP_ABI = (*BACKWARD_PREP_ABI, *_SEQUENCES_ABI)
VARLEN_BACKWARD_ABI = (*BACKWARD_ABI, *_SEQUENCES_ABI)
VARLEN_BACKWARD_DQ_ABI = (*BACKWARD_DQ_ABI, *_SEQUENCES_ABI)


def varlen_row_offset(start_q, b):
    """The workspace row (within a head) of sequence ``b``'s first query, whose packed row is
    ``start_q`` (= cu_seqlens_q[b]): (start_q + ALIGN * b) rounded down to a multiple of ALIGN
    (``BACKWARD_ROW_ALIGN``). Pure arithmetic on non-negative ints, shared by the host (tests)
    and the kernels (jitted as a device function). Sequence b + 1 starts at least
    ``varlen_padded_rows`` of b's length later: the regions never overlap."""
    return (start_q + BACKWARD_ROW_ALIGN * b) // BACKWARD_ROW_ALIGN * BACKWARD_ROW_ALIGN


def varlen_padded_rows(seqlen_q):
    """The workspace rows a sequence of ``seqlen_q`` queries owns: its length rounded up to
    ``BACKWARD_ROW_ALIGN`` (0 for an empty sequence)."""
    return (seqlen_q + BACKWARD_ROW_ALIGN - 1) // BACKWARD_ROW_ALIGN * BACKWARD_ROW_ALIGN


def varlen_workspace_rows(total_q: int, batch: int) -> int:
    """The workspace rows per head of a packed call: total_q + ALIGN * batch, rounded up to
    ALIGN; every sequence's region (``varlen_row_offset`` .. + ``varlen_padded_rows``) ends
    within it."""
    return varlen_padded_rows(total_q + BACKWARD_ROW_ALIGN * batch)

# Decode against a KV cache (``decode_mma``): the attention kernel, then, with
# more than one split, the combine kernel.
DECODE_ABI = (
    _U16_ARRAY, _U16_ARRAY, _U16_ARRAY,  # q, k_cache, v_cache
    _U16_ARRAY, _U16_ARRAY,  # k_new, v_new (1-element dummies when not given)
    _I32_ARRAY, _I32_ARRAY,  # cache_seqlens, block_table (dummy when not paged)
    _U16_ARRAY, _F32_ARRAY,  # out, lse (dummy when not asked for)
    _F32_ARRAY, _F32_ARRAY,  # o_part, lse_part (dummies with one split)
    *("int64",) * 18,  # strides (batch or page, seq, head) of q, k_cache, v_cache, k_new, v_new, out
    "int64", "int64",  # seqlen_q, seqlen_new
    "int64", "int64", "int64",  # capacity (paged: page_size), block-table row stride, pages a sequence
    "int64", "int64",  # paged: the page size's divider (magic, shift), else 0
    "int64", "int64", "int64",  # heads_kv, group, row blocks
    "int64",  # num_splits
    "float32", "bool",  # softmax scale * log2(e), write lse
)
# The decode kernel's window and softcap variants (``decode_mma.DECODE_VARIANT_ARGTYPES``): the
# same, then the window's sides and the softcap's factor. The plain kernel keeps DECODE_ABI.
DECODE_VARIANT_ABI = (
    *DECODE_ABI,
    "int64", "int64",  # sliding window: left, right, each >= 0 (read by window kernels only)
    "float32",  # softmax scale / softcap (read by softcap kernels only; scale_log2 is softcap * log2(e))
)
DECODE_COMBINE_ABI = (
    _F32_ARRAY, _F32_ARRAY,  # o_part, lse_part
    _U16_ARRAY, _F32_ARRAY,  # out, lse
    "int64", "int64", "int64",  # out strides
    "int64", "int64", "int64",  # batch, seqlen_q, heads_q
    "int64", "bool",  # num_splits, write lse
)
