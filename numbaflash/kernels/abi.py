"""The kernels' parameter types (the ABI) by Numba name, and the backward's workspace layout, in
plain Python. Each parameter list is declared once, with its names, in ``kernels.params``; the
tuples here are derived from it (``params.types_of``) for the launcher and the tests. The
launcher packs arguments from these without importing Numba."""

from __future__ import annotations

from . import params as _p

FORWARD_ABI = _p.types_of(_p.FORWARD)
VARLEN_FORWARD_ABI = _p.types_of(_p.VARLEN_FORWARD)
WS_ABI = _p.types_of(_p.WS_FORWARD)
VARLEN_WS_ABI = _p.types_of(_p.VARLEN_WS_FORWARD)

# The backward (``backward_mma``): three kernels over one float32 workspace per call, laid out
# (batch, heads_q, rows) with rows = seqlen_q rounded up to BACKWARD_ROW_ALIGN: the LSE in log2
# units (+inf on rows that see no key and on padding), D = rowsum(dO ∘ O), and the dQ
# accumulator (batch, heads_q, rows, head_dim), each block of block_m rows in the main kernel's
# fragment order (``BackwardConfig.dq_position``); plus one int32 turn counter per (batch, head,
# query block) for deterministic dQ.
BACKWARD_ROW_ALIGN = 128

# 1. Prepare: grid (rows // 64, heads_q, batch), 128 threads.
BACKWARD_PREP_ABI = _p.types_of(_p.BACKWARD_PREP)
# 2. The main kernel: grid ceil(seqlen_k / block_n) * heads_kv * batch (one dimension; CTA -> key
#    block and (batch, KV head) by ``blocks.key_block_of``), config.threads, config.shared_bytes.
BACKWARD_ABI = _p.types_of(_p.BACKWARD)
# 2'. The Hopper backward's main kernel (family sm90bwd): the same work and grid
#    (``config.threads``: 384, ``config.shared_bytes``), tensor maps instead of q, k, v, dout's
#    pointers and strides (4-D maps over (batch, seqlen, heads, head_dim), boxes
#    (1, block_m | block_n, 1, 64) with 128B swizzle, as the Hopper forward's). Its prepare and dQ
#    kernels are the mma.sync ones of ``WsBackwardConfig.dq_config()``.
BACKWARD_WS_ABI = _p.types_of(_p.WS_BACKWARD)
# 2''. Its GQA-split build (``KernelSpec.group_split``): grid ceil(seqlen_k / block_n) * heads_kv *
#    splits * batch, the same parameters then the dK / dV sums, the tickets and ``splits``.
BACKWARD_WS_SPLIT_ABI = _p.types_of(_p.WS_BACKWARD + _p.GROUP_SPLIT)
# 3. dQ: grid (ceil(seqlen_q / block_m), heads_q, batch), config.threads (the main kernel's, whose fragment
#    order it reads).
BACKWARD_DQ_ABI = _p.types_of(_p.BACKWARD_DQ)

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
VARLEN_BACKWARD_PREP_ABI = _p.types_of(_p.VARLEN_BACKWARD_PREP)
VARLEN_BACKWARD_ABI = _p.types_of(_p.VARLEN_BACKWARD)
VARLEN_BACKWARD_DQ_ABI = _p.types_of(_p.VARLEN_BACKWARD_DQ)


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


# Decode against a KV cache (``decode_mma``): the attention kernel (its window and softcap
# variants: the same, then the window's sides and the softcap's factor), then, with more than
# one split, the combine kernel.
DECODE_ABI = _p.types_of(_p.DECODE)
DECODE_VARIANT_ABI = _p.types_of(_p.DECODE_VARIANT)
DECODE_COMBINE_ABI = _p.types_of(_p.DECODE_COMBINE)
