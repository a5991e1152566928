"""Online softmax on one 16-row m-tile of scores held as mma fragments.

``s[j, e]`` is this lane's element e of n-tile j (e = 0, 1: row g; e = 2, 3: row g + 8);
row "half" r = e // 2. The same layout is the accumulator of mma.sync m16n8k16 and, per
warp, of wgmma m64nNk16. Row maxes are kept scaled, in log2 units, so that P = exp2(S·c - m)
is one FFMA and one ex2 per score.
"""

from __future__ import annotations

from numba import cuda, float32, uint64

from .. import ptx
from .common import FULL_MASK, LOG2_E, NEG_INF


@cuda.jit(device=True, forceinline=True)
def cap_scores(s, n_tiles, cap_scale):
    """Softcapping, in place: ``s = tanh(s · cap_scale)`` for one m-tile's raw scores (QKᵀ), with
    cap_scale = softmax_scale / softcap. The kernel's exponent factor is then softcap·log2(e)
    instead of softmax_scale·log2(e), so that exp2(s · that - m) is exp(softcap · tanh(QKᵀ ·
    softmax_scale / softcap) - m): FlashAttention's softcap, applied to the scaled scores, at one
    FMUL and one MUFU.TANH a score. Masking comes after (tanh(-inf) would be -1)."""
    for j in range(n_tiles):
        for e in range(4):
            s[j, e] = ptx.tanh(s[j, e] * cap_scale)


@cuda.jit(device=True, forceinline=True)
def sink_logit(sink, head):
    """The learnable sink's logit of query head ``head`` (``sink``: float32 (heads_q,), natural-log
    units) in the kernels' scaled log2 units: times log2(e) only (neither the softmax scale nor the
    softcap applies to it)."""
    return sink[uint64(head)] * float32(LOG2_E)


@cuda.jit(device=True, forceinline=True)
def start_at_sink(m_run, l_run, logit):
    """Start a fragment row pair's online softmax with the learnable sink's term (FlashAttention-4's
    ``learnable_sink``: a logit with no value row): the running max at ``logit`` (``sink_logit``) and
    this lane's part of the running sum at 1/4, so that the quad's sum is exp2(logit - logit) = 1.
    The usual rescales then carry the term along, O's normalisation divides by it and the LSE
    includes it; a row that sees no key gives O = 0 and LSE = the sink. A sink of -inf is no sink
    (max -inf, sum 0: the plain start)."""
    for r in range(2):
        m_run[r] = logit
        l_run[r] = float32(0.25) if logit != NEG_INF else float32(0.0)


@cuda.jit(device=True, forceinline=True)
def quad_max(x):
    """Max over the 4 lanes that share a fragment row."""
    x = max(x, cuda.shfl_xor_sync(FULL_MASK, x, 1))
    return max(x, cuda.shfl_xor_sync(FULL_MASK, x, 2))


@cuda.jit(device=True, forceinline=True)
def quad_sum(x):
    """Sum over the 4 lanes that share a fragment row."""
    x += cuda.shfl_xor_sync(FULL_MASK, x, 1)
    return x + cuda.shfl_xor_sync(FULL_MASK, x, 2)


@cuda.jit(device=True, forceinline=True)
def row_max(s, n_tiles, half):
    """Max of this lane's scores in fragment row ``half`` (0: row g, 1: row g+8), reduced
    over the quad."""
    m = NEG_INF
    for j in range(n_tiles):
        m = max(m, max(s[j, 2 * half], s[j, 2 * half + 1]))
    return quad_max(m)


@cuda.jit(device=True, forceinline=True)
def scaled_row_maxes(s, n_tiles, mx, scale_log2):
    """``mx[r]`` = max over the quad's scores of row half r, times scale·log2(e)."""
    for r in range(2):
        mx[r] = row_max(s, n_tiles, r) * scale_log2


@cuda.jit(device=True, forceinline=True)
def max_grew(mx, m_run, threshold):
    """True if a row max exceeds the running one by more than ``threshold`` (log2 units)."""
    return mx[0] > m_run[0] + threshold or mx[1] > m_run[1] + threshold


@cuda.jit(device=True, forceinline=True)
def adopt_row_max(m_run, l_run, mx, r):
    """Row half ``r`` adopts its new max: m_run[r] := max(m_run[r], mx[r]) and the row sum is
    scaled by alpha = exp2(old - new) (1 while the row has seen no key). Returns alpha, by
    which O's rows must be scaled too (``scale_o_rows``)."""
    m_new = max(m_run[r], mx[r])
    alpha = ptx.exp2(m_run[r] - m_new) if m_new != NEG_INF else float32(1.0)
    m_run[r] = m_new
    l_run[r] *= alpha
    return alpha


@cuda.jit(device=True, forceinline=True)
def scale_o_rows(acc_o, d_tiles, r, factor):
    """Multiply this lane's O values of row half ``r`` by ``factor``."""
    for j in range(d_tiles):
        acc_o[j, 2 * r] *= factor
        acc_o[j, 2 * r + 1] *= factor


@cuda.jit(device=True, forceinline=True)
def rescale_rows(acc_o, d_tiles, m_run, l_run, mx):
    """Adopt the new row maxes: scale O and the row sums by exp2(old - new)."""
    for r in range(2):
        scale_o_rows(acc_o, d_tiles, r, adopt_row_max(m_run, l_run, mx, r))


@cuda.jit(device=True, forceinline=True)
def row_sum_inverse(l_run, r):
    """Sum row half ``r``'s partial row sums over the quad, in place (``l_run[r]``), and return
    1 / sum, or 0 for a row that saw no key (its sum is 0): what O's row is normalised by."""
    total = quad_sum(l_run[r])
    l_run[r] = total
    return ptx.reciprocal(total) if total > 0 else float32(0.0)


@cuda.jit(device=True, forceinline=True)
def pack_16bit(lo, hi, bf16):
    """Two fp32 values -> one 32-bit word of two bf16 (``bf16``) or fp16 values, lo first."""
    return ptx.pack_bf16x2(lo, hi) if bf16 else ptx.pack_f16x2(lo, hi)


@cuda.jit(device=True, forceinline=True)
def pack_p_slice(p_frag, p, kt, bf16):
    """P k-tile ``kt`` (16 keys: S n-tiles 2kt and 2kt+1, fp32) -> the 16-bit A fragment
    ``p_frag[kt]`` of the PV product; the two n-tiles are exactly the m16k16 A layout."""
    for half in range(2):
        for r in range(2):
            p_frag[kt, 2 * half + r] = pack_16bit(p[2 * kt + half, 2 * r], p[2 * kt + half, 2 * r + 1], bf16)


@cuda.jit(device=True, forceinline=True)
def pack_p_fragments(p_frag, p, k_tiles, bf16):
    """P (fp32 fragments) -> 16-bit A fragments of the PV product, in registers."""
    for kt in range(k_tiles):
        pack_p_slice(p_frag, p, kt, bf16)


# The e4m3 kernels compute P (in [0, 1]) times this power of two, so that small probabilities land
# on e4m3's normals (from 2^-6) rather than its subnormals or zero (FlashAttention-3's static P
# scale; ``fp8.P_SCALE``, which the reference rounds P with). It costs nothing: the exponent's
# offset is the row max less log2 of it (``exponentiate_e4m3``); the row sums, which then carry
# the factor too, and O are divided by it once a tile.
P_SCALE_E4M3 = 256.0
P_SCALE_LOG2 = 8.0


@cuda.jit(device=True, forceinline=True)
def exponentiate_e4m3(s, n_tiles, m_run, l_run, scale_log2):
    """``exponentiate`` for the e4m3 kernels: P·``P_SCALE_E4M3`` = exp2(S·scale·log2(e) - m + 8) in
    place, the row sums (``l_run``) of those."""
    exponentiate_shifted(s, n_tiles, m_run, l_run, scale_log2, float32(P_SCALE_LOG2))


@cuda.jit(device=True, forceinline=True)
def pack_p_e4m3(p_frag, p, k_steps):
    """P (fp32 fragments, already times ``P_SCALE_E4M3``) -> e4m3 A fragments of an m64nNk32 PV
    product, in registers, with no shuffle: ``p_frag[kk]`` takes S n-tiles 4kk .. 4kk+3 in the
    lane's own order, so A's column 4t + i of a 32-key step holds key ``fp8_layout.KEY_ORDER[4t +
    i]`` (t = lane % 4), not key 4t + i. V's keys are stored in that order (``fp8_layout``), so P·V
    is unchanged. Register 2h + r: row half r (rows g, g + 8), n-tiles 4kk + 2h and 4kk + 2h + 1,
    two keys each."""
    for kk in range(k_steps):
        for h in range(2):
            j = 4 * kk + 2 * h
            for r in range(2):
                p_frag[kk, 2 * h + r] = ptx.pack_e4m3x4(p[j, 2 * r], p[j, 2 * r + 1], p[j + 1, 2 * r],
                                                        p[j + 1, 2 * r + 1])


@cuda.jit(device=True, forceinline=True)
def exponent_offsets(m_use, m_run):
    """``m_use[r]``: the running max of row half r, or 0 for a row with no key yet (its
    scores are all -inf, so exp2(-inf - 0) gives 0 instead of NaN)."""
    for r in range(2):
        m_use[r] = m_run[r] if m_run[r] != NEG_INF else float32(0.0)


@cuda.jit(device=True, forceinline=True)
def exponentiate_slice(s, kt, m_use, row_sum, scale_log2):
    """P = exp2(S·scale·log2(e) - m) in place for the 16 keys of PV k-tile ``kt`` (S n-tiles
    2kt and 2kt+1), adding them to this lane's partial row sums ``row_sum[r]``."""
    for r in range(2):
        for half in range(2):
            j = 2 * kt + half
            for e in range(2):
                p = ptx.exp2(s[j, 2 * r + e] * scale_log2 - m_use[r])
                s[j, 2 * r + e] = p
                row_sum[r] += p


@cuda.jit(device=True, forceinline=True)
def exponentiate(s, n_tiles, m_run, l_run, scale_log2):
    """P = exp2(S·scale·log2(e) - m) in place (one FFMA + one ex2 per score), and add this
    lane's part of each row sum to ``l_run``. Rows with no key yet (m = -inf) give 0."""
    exponentiate_shifted(s, n_tiles, m_run, l_run, scale_log2, float32(0.0))  # (x - 0 folds away)


@cuda.jit(device=True, forceinline=True)
def exponentiate_shifted(s, n_tiles, m_run, l_run, scale_log2, shift):
    """P = exp2(S·scale·log2(e) - m + shift) in place, this lane's row sums added to ``l_run``:
    ``exponentiate`` (shift 0) and ``exponentiate_e4m3`` (P times 2^shift)."""
    for r in range(2):
        m_use = (m_run[r] if m_run[r] != NEG_INF else float32(0.0)) - shift
        row_sum = float32(0.0)
        for j in range(n_tiles):
            for e in range(2):
                p = ptx.exp2(s[j, 2 * r + e] * scale_log2 - m_use)
                s[j, 2 * r + e] = p
                row_sum += p
        l_run[r] += row_sum
