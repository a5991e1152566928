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
    "float32", "bool",  # softmax scale * log2(e), write lse
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
    "float32", "bool",  # softmax scale * log2(e), write lse
)
