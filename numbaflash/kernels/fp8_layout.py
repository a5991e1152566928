"""The e4m3 Hopper forward's V layout (plain Python, no Numba; the host prepares V with it).

8-bit wgmma operands are K-major only, so the PV product's B operand (keys x head dim) must
be stored with the keys contiguous: V transposed, (batch, heads_kv, head_dim, keys). And P
reaches the PV product from the S accumulator with no shuffle (``softmax.pack_p_e4m3``): lane t
of a quad holds, in S's layout, keys 2t, 2t+1, 8+2t, 9+2t of each 16, which the m64nNk32 A
fragment reads as its columns 4t .. 4t+3. So A's column c of each 32-key step holds key
``KEY_ORDER[c]``, and V's keys are stored in the same order: column c of each group of 32 of
the transposed V holds key ``32 * group + KEY_ORDER[c]``. The product is then P·V exactly.
"""

from __future__ import annotations

from collections import namedtuple

# An e4m3 kernel's float32 (batch * heads_kv,) descales of q, k and v (x = x8 * descale, one per
# (batch, KV head), a packed call's per sequence; q's heads share their KV head's): what the Hopper
# forward (``forward_ws``) and the mma.sync forward (``forward_mma``) read them as.
Descales = namedtuple("Descales", ["q", "k", "v"])

KEY_GROUP = 32  # keys of one k-step of the e4m3 PV product


def _key_order() -> tuple[int, ...]:
    order = []
    for half in range(2):  # A columns 0-15 and 16-31: S n-tiles 0, 1 and 2, 3 of the step
        for t in range(4):  # the lane in its quad
            for i in range(4):  # the byte of the register
                order.append(16 * half + 8 * (i // 2) + 2 * t + i % 2)
    return tuple(order)


KEY_ORDER = _key_order()
"""The key (0..31) that column c of a 32-key step of the transposed V holds."""


def padded_keys(seqlen_k: int) -> int:
    """Keys of the transposed V: seqlen_k rounded up to a whole group (its rows stay 16-byte
    aligned for TMA); the padding keys are zero (P is 0 there, and 0 x NaN would not be)."""
    return -(-seqlen_k // KEY_GROUP) * KEY_GROUP


def key_index(seqlen_k: int) -> list[int]:
    """For each column of the transposed V's padded key axis, the key it holds (``seqlen_k``
    or more: a padding key, zero)."""
    return [KEY_GROUP * g + k for g in range(padded_keys(seqlen_k) // KEY_GROUP) for k in KEY_ORDER]


def sequence_vt_start(start_k: int, sequence: int) -> int:
    """Packed (varlen) calls: the first column of sequence ``sequence``'s keys in the transposed
    V, whose keys start at row ``start_k`` (``cu_seqlens_k[sequence]``) of the packed V: start_k
    rounded up to a whole group, plus one group per sequence before it. Each sequence's keys
    start a group (the key order is per group of its own keys) and never reach the next
    sequence's first column: from roundup(cu[b]) + 32 b to roundup(cu[b + 1]) + 32 (b + 1) there
    are at least roundup(cu[b + 1] - cu[b]) columns. Closed form, so the prep and the forward
    find a sequence's columns from its offset alone (no prefix sum, nothing read on the host).
    ``fp8_prep.vt_start`` computes the same on the device."""
    return -(-start_k // KEY_GROUP) * KEY_GROUP + KEY_GROUP * sequence


def packed_vt_keys(total_k: int, batch: int) -> int:
    """Columns of a packed call's transposed V, (1, heads_kv, head_dim, columns): the start of a
    sequence after the last (``sequence_vt_start(total_k, batch)``). The prep writes every one of
    them: a sequence's keys, then zeros up to the next sequence's first column."""
    return sequence_vt_start(total_k, batch)
