"""Each kernel's parameters, declared once: an ordered tuple of ``Param(name, type)``, the type as
Numba names it (``str(numba_type)``). Plain Python (no Numba at import).

From a declaration come the parameter types the launcher packs (``types_of``: the ABI), the
Numba argument types the kernel is compiled with (``numba_types``, which imports Numba), and the
launcher's binding order (``ordered``: named values in declared order). The names are the kernel
functions' own parameter names; ``tests/test_params_cpu.py`` checks, for every registered
kernel, that the three agree. A variant that adds parameters adds a tuple (``VARLEN_FORWARD`` is
``FORWARD`` then the packed sequences); ``kernels.families.kernel_params`` picks a spec's.
"""

from __future__ import annotations

import functools
import operator
import re
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

U16_ARRAY = "array(uint16, 1d, C)"  # flat 16-bit bits of q, k, v, o, gradients
F32_ARRAY = "array(float32, 1d, C)"
I32_ARRAY = "array(int32, 1d, C)"
U64_ARRAY = "array(uint64, 1d, C)"  # a 128-byte tensor map (16 words) in global memory
U32_ARRAY = "array(uint32, 1d, C)"  # e4m3 bytes, four a word
I64, I32, F32, BOOL = "int64", "int32", "float32", "bool"


class Param(NamedTuple):
    """One kernel parameter: its name in the kernel function, and its type as Numba names it."""

    name: str
    type: str


def params(*groups: tuple[str, str]) -> tuple[Param, ...]:
    """Parameters from (type, "name name ...") groups, in order."""
    return tuple(Param(name, type_) for type_, names in groups for name in names.split())


def strides(*arrays: str) -> str:
    """The batch, sequence and head strides' names of ``arrays`` (``q`` -> ``q_sb q_ss q_sh``)."""
    return " ".join(f"{a}_{s}" for a in arrays for s in ("sb", "ss", "sh"))


# The window's sides (each >= 0, read by window kernels only) and softmax scale / softcap (read by
# softcap kernels only): the last parameters of every masked kernel but the plain decode kernel.
WINDOW_SOFTCAP = params((I64, "window_left window_right"), (F32, "cap_scale"))
# A packed variable-length call's sequences: their int32 cumulative offsets (batch + 1,) and the
# total query rows (the LSE's (heads_q, total_q) head stride).
SEQUENCES = params((I32_ARRAY, "cu_seqlens_q cu_seqlens_k"), (I64, "total_q"))

# A learnable sink's logits (FlashAttention-4's ``learnable_sink``): float32 (heads_q,), natural-log
# units, one per query head; the last parameter of a sink build (``KernelSpec.sink``).
SINK = params((F32_ARRAY, "sink"))
# An e4m3 forward's descales (``WsConfig.fp8``): float32 (batch * heads_kv,) each, x = x8 * descale;
# after the kernel's other parameters, before the sink's.
DESCALES = params((F32_ARRAY, "q_descale k_descale v_descale"))
# The e4m3 forward's V, transposed for its PV product (``fp8_prep``): V and Vt as 4-byte words, V's
# batch, sequence and head strides in words, its keys, Vt's padded keys, the KV heads.
FP8_V = params((U32_ARRAY, "v vt"), (I64, "v_sb v_ss v_sh seqlen_k keys heads_kv"))
# Its packed build: V (total_k, heads_kv, head_dim) and Vt as words, the key offsets, V's sequence and
# head strides in words, Vt's columns (``fp8_layout.packed_vt_keys``), the KV heads.
FP8_V_VARLEN = params((U32_ARRAY, "v vt"), (I32_ARRAY, "cu_seqlens_k"), (I64, "v_ss v_sh keys heads_kv"))
# The backward's prepare kernel with a learnable sink: the logits, then the float32 (heads_q,)
# gradient it adds each CTA's part of d_sink into (zeroed before the launch).
SINK_GRADIENT = params((F32_ARRAY, "sink d_sink"))

# The mma.sync forward (``forward_mma``): grid (query blocks, heads_q, batch); lse may be a
# 1-element dummy; scale_log2 is softmax scale * log2(e) (softcap * log2(e) when capped).
FORWARD = params(
    (U16_ARRAY, "q k v o"), (F32_ARRAY, "lse"), (I64, strides("q", "k", "v", "o")),
    (I64, "seqlen_q seqlen_k batch_size heads_q group"), (F32, "scale_log2"), (BOOL, "write_lse"),
) + WINDOW_SOFTCAP
# Its packed variable-length kernels: q, k, v, o are (1, total, heads, head_dim) views whose batch
# strides the kernel never reads, seqlen_q and seqlen_k the maxima; the LSE is (heads_q, total_q).
VARLEN_FORWARD = FORWARD + params((I32_ARRAY, "cu_seqlens_q cu_seqlens_k"), (I64, "lse_head_stride"))

# The warp-specialised Hopper forward (``forward_ws``): tensor maps instead of pointers and strides,
# a persistent grid; row_lead: rows the first query block starts before row 0.
WS_FORWARD = params(
    (U64_ARRAY, "map_q map_k map_v map_o"), (F32_ARRAY, "lse"),
    (I32, "seqlen_q seqlen_k row_lead heads_q group batch_size"), (F32, "scale_log2"), (BOOL, "write_lse"),
) + WINDOW_SOFTCAP
# Its packed builds: the sequences, then out as a flat array with its row and head strides
# (elements), where the threads store O.
VARLEN_WS_FORWARD = WS_FORWARD + SEQUENCES + params((U16_ARRAY, "o"), (I64, "o_row_stride o_head_stride"))

# The backward (``backward_mma``, ``kernels.abi`` describes its workspace). 1. Prepare: D and the
# LSE in log2 units per row; zero the dQ accumulator and the counters.
BACKWARD_PREP = params(
    (U16_ARRAY, "o do"), (F32_ARRAY, "lse delta lse2 dq_acc"), (I32_ARRAY, "counters"),
    (I64, strides("o", "do")), (I64, "seqlen_q rows heads_q counters_per_head"),
)
# 2. The main kernel: dK, dV of one key block, dQ added into the accumulator. tail_pairs:
# (batch, KV head) pairs launched interleaved at the end; scale: the softmax scale.
_BACKWARD_SCALARS = params(
    (I64, "seqlen_q seqlen_k rows heads_q group heads_kv tail_pairs"), (F32, "scale_log2 scale"),
    (BOOL, "deterministic"),
) + WINDOW_SOFTCAP
BACKWARD = params(
    (U16_ARRAY, "q k v do dk dv"), (F32_ARRAY, "lse2 delta dq_acc"), (I32_ARRAY, "counters"),
    (I64, strides("q", "k", "v", "do", "dk", "dv")),
) + _BACKWARD_SCALARS
# 2'. The Hopper backward's main kernel (``backward_ws``): tensor maps of q, k, v, dout instead of
# their pointers and strides. Its prepare and dQ kernels are the mma.sync ones. Its GQA-split build
# (``KernelSpec.group_split``) takes ``GROUP_SPLIT`` last: the float32 dK / dV sums and int32
# tickets of its key blocks (zeroed before the launch) and the CTAs each group's query heads are
# split over.
WS_BACKWARD = params(
    (U64_ARRAY, "map_q map_k map_v map_do"), (U16_ARRAY, "dk dv"), (F32_ARRAY, "lse2 delta dq_acc"),
    (I32_ARRAY, "counters"), (I64, strides("dk", "dv")),
) + _BACKWARD_SCALARS
GROUP_SPLIT = params((F32_ARRAY, "dkv_acc"), (I32_ARRAY, "tickets"), (I64, "splits"))
# 3. dQ = the accumulator, scaled, in the input dtype.
BACKWARD_DQ = params((F32_ARRAY, "dq_acc"), (U16_ARRAY, "dq"), (I64, strides("dq")),
                     (I64, "seqlen_q rows heads_q"), (F32, "scale"))
# The packed variable-length backward: each kernel's parameters, then the sequences.
VARLEN_BACKWARD_PREP = BACKWARD_PREP + SEQUENCES
VARLEN_BACKWARD = BACKWARD + SEQUENCES
VARLEN_BACKWARD_DQ = BACKWARD_DQ + SEQUENCES

# Decode against a KV cache (``decode_mma``): k_new, v_new, block_table, lse, o_part, lse_part may
# be 1-element dummies; capacity is the page size when paged, page_magic and page_shift its divider.
DECODE = params(
    (U16_ARRAY, "q k_cache v_cache k_new v_new"), (I32_ARRAY, "cache_seqlens block_table"),
    (U16_ARRAY, "out"), (F32_ARRAY, "lse o_part lse_part"), (I64, strides("q", "kc", "vc", "kn", "vn", "o")),
    (I64, "seqlen_q seqlen_new capacity bt_stride pages page_magic page_shift heads_kv group row_blocks "
          "num_splits"),
    (F32, "scale_log2"), (BOOL, "write_lse"),
)
# The decode kernel's window and softcap variants: the same, then the window's sides and the
# softcap's factor. The plain kernel keeps DECODE.
DECODE_VARIANT = DECODE + WINDOW_SOFTCAP
# FlashAttention's ``cache_batch_idx``: int32 (batch,), the cache's batch row (paged: the block
# table's row) that sequence b reads and appends to (``KernelSpec.batch_idx``).
CACHE_BATCH_IDX = params((I32_ARRAY, "cache_batch_idx"))
# FlashAttention's ``cache_leftpad``: int32 (batch,), the cache row where sequence b's keys start
# (``KernelSpec.leftpad``).
CACHE_LEFTPAD = params((I32_ARRAY, "cache_leftpad"))
# FlashAttention's rotary embedding in the KV-cache call (``KernelSpec.rotary``): cos and sin in
# q's dtype (16-bit bits), (rotary_rows, rotary_dim / 2) contiguous; rotary_q_step 1 where query
# i sits at cache_seqlens[b] + i (causal or windowed calls), 0 where every query sits there.
ROTARY = params((U16_ARRAY, "rotary_cos rotary_sin"), (I64, "rotary_dim rotary_rows rotary_q_step"))


def decode_params(variant: bool, sink: bool = False, batch_idx: bool = False, leftpad: bool = False,
                  rotary: bool = False) -> tuple[Param, ...]:
    """A decode kernel's parameters: the plain kernel's (``DECODE``) or a window or softcap
    variant's (``DECODE_VARIANT``), then for each option the build takes, in this order, the
    sink's logits (``SINK``), ``CACHE_BATCH_IDX``, ``CACHE_LEFTPAD`` and ``ROTARY``."""
    return ((DECODE_VARIANT if variant else DECODE) + (SINK if sink else ())
            + (CACHE_BATCH_IDX if batch_idx else ()) + (CACHE_LEFTPAD if leftpad else ())
            + (ROTARY if rotary else ()))


DECODE_COMBINE = params(
    (F32_ARRAY, "o_part lse_part"), (U16_ARRAY, "out"), (F32_ARRAY, "lse"), (I64, strides("o")),
    (I64, "batch seqlen_q heads_q num_splits"), (BOOL, "write_lse"),
)


def names_of(declared: Iterable[Param]) -> tuple[str, ...]:
    return tuple(p.name for p in declared)


def entry(name: str, declared: tuple[Param, ...], body: str, namespace: dict[str, Any]) -> Callable:
    """A kernel's entry function ``name``, generated from its declaration: its parameters are
    ``declared``'s names in order, its one statement ``body`` (which names them, and what
    ``namespace`` holds). So a kernel's parameter list is written once, here, for its dense and
    packed builds alike."""
    exec(f"def {name}({', '.join(names_of(declared))}):\n    {body}\n", namespace)  # noqa: S102
    return namespace[name]


def types_of(declared: Iterable[Param]) -> tuple[str, ...]:
    """The parameter types by Numba name: what the launcher packs (``runtime.launch``)."""
    return tuple(p.type for p in declared)


def ordered(declared: tuple[Param, ...], **values: Any) -> tuple:
    """``values`` (one per parameter, by name) in the declared order: the launcher's arguments.
    Raises TypeError naming any parameter without a value and any value of no parameter."""
    get, names = _getter(declared)
    if len(values) != len(names) or not names.issuperset(values):
        missing = [p.name for p in declared if p.name not in values]
        raise TypeError(f"kernel arguments: missing {missing}, unknown {sorted(set(values) - names)}")
    return get(values)


@functools.cache
def _getter(declared: tuple[Param, ...]) -> tuple[Callable[[dict], tuple], frozenset[str]]:
    return operator.itemgetter(*names_of(declared)), frozenset(names_of(declared))


_ARRAY = re.compile(r"array\((\w+), 1d, C\)")


@functools.cache
def numba_types(declared: tuple[Param, ...]) -> tuple:
    """The Numba argument types of ``declared`` (imports Numba): each type name parsed back
    (``array(uint16, 1d, C)`` -> ``types.uint16[::1]``, ``bool`` -> ``types.boolean``)."""
    from numba import types

    found = []
    for p in declared:
        array = _ARRAY.fullmatch(p.type)
        if array:
            found.append(getattr(types, array.group(1))[::1])
        else:
            found.append(types.boolean if p.type == BOOL else getattr(types, p.type))
    return tuple(found)
