"""The data movement of an mma.sync FP8 forward (issue 60), checked on the CPU before any kernel:
P goes from the QK^T accumulators into the PV step's A operand with no shuffle, because V is
stored K-major with its keys permuted within each block of 16 (``KEY_ORDER``).

    python lab/fp8_mma_layout.py

The fragments are those of PTX's ``mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32`` (the
8-bit shape, sm_89+) and of the fp32 accumulators every m16n8 shape shares, per lane
(g = lane >> 2, t = lane & 3):

- C (16 x 8, fp32): c0, c1 at row g, columns 2t, 2t + 1; c2, c3 at row g + 8.
- A (16 x 32, e4m3, row): a0 row g, columns 4t .. 4t + 3 (one 32-bit register, lowest byte
  first); a1 row g + 8, the same columns; a2 and a3 the same for columns 16 + 4t ...
- B (32 x 8, e4m3, col): b0 rows (k) 4t .. 4t + 3 of column g; b1 rows 16 + 4t ...

QK^T. Q (rows x d) and K (keys x d) keep their row-major layouts: in 16-bit units a row of 32
e4m3 values is 16 units, so ``ldmatrix`` (non-transposed, as for bf16) gives exactly the A and B
fragments above; the loop is the bf16 loop with k32 steps instead of k16.

PV. S's accumulators give a lane, for row g and the four 8-key tiles j = 0..3 of a 32-key step,
the keys 8j + 2t and 8j + 2t + 1. The A operand wants 4t .. 4t + 3. Instead of moving P between
lanes, the A operand's column c stands for key ``KEY_ORDER[c]``: a0 packs P at keys 2t, 2t + 1,
8 + 2t, 9 + 2t (two ``cvt.rn.satfinite.e4m3x2.f32``: the first operand lands in the upper byte),
and V's B operand must hold those keys in that order. So V is stored transposed, (d, keys), with
each 16-key block in ``KEY_ORDER``: FP8 V has to be K-major for the tensor cores anyway (no 8-bit
``ldmatrix.trans`` before sm_100), and the quantisation pass that writes e4m3 V can write it in
this order at no extra cost.

The script builds every lane's registers from the documented layouts, runs the two mma shapes as
the PTX semantics define them (D = A B + C on the matrices the fragments spell), and checks that
P V (any P, any V) and Q K^T come out equal to numpy's up to float64 rounding (the sums' order
differs). With ``KEY_ORDER`` the identity (V merely transposed) the PV check fails by O(1).
"""

from __future__ import annotations

import numpy as np

LANES = 32
# A operand column c (0..15 of each 16-key half) -> key of that half whose P value it carries
KEY_ORDER = np.array([2 * (c // 4) + (c % 2) + 8 * ((c % 4) // 2) for c in range(16)])


def lane(i: int) -> tuple[int, int]:
    return i >> 2, i & 3


def c_fragment(tile: np.ndarray) -> list[list[float]]:
    """A 16 x 8 fp32 accumulator tile as each lane holds it: [c0, c1, c2, c3]."""
    out = []
    for i in range(LANES):
        g, t = lane(i)
        out.append([tile[g, 2 * t], tile[g, 2 * t + 1], tile[g + 8, 2 * t], tile[g + 8, 2 * t + 1]])
    return out


def a_matrix(frags: list[list[list[float]]]) -> np.ndarray:
    """The 16 x 32 matrix that lanes' 8-bit A registers [a0, a1, a2, a3] (4 values each, lowest
    byte first) spell, per the PTX layout."""
    a = np.full((16, 32), np.nan)
    for i, regs in enumerate(frags):
        g, t = lane(i)
        for r, (row, col0) in enumerate(((g, 4 * t), (g + 8, 4 * t), (g, 16 + 4 * t), (g + 8, 16 + 4 * t))):
            a[row, col0:col0 + 4] = regs[r]
    return a


def b_matrix(frags: list[list[list[float]]]) -> np.ndarray:
    """The 32 x 8 matrix that lanes' 8-bit B registers [b0, b1] spell."""
    b = np.full((32, 8), np.nan)
    for i, regs in enumerate(frags):
        g, t = lane(i)
        b[4 * t:4 * t + 4, g] = regs[0]
        b[16 + 4 * t:16 + 4 * t + 4, g] = regs[1]
    return b


def p_as_a_operand(s_tiles: list[list[list[float]]]) -> list[list[list[float]]]:
    """Each lane's A registers of the PV step from its own accumulators of four 8-key S tiles
    (``c_fragment`` of keys 0-7, 8-15, 16-23, 24-31): no value crosses lanes."""
    frags = []
    for i in range(LANES):
        c = [s_tiles[j][i] for j in range(4)]
        a0 = [c[0][0], c[0][1], c[1][0], c[1][1]]  # row g: keys 2t, 2t+1, 8+2t, 9+2t
        a1 = [c[0][2], c[0][3], c[1][2], c[1][3]]  # row g + 8
        a2 = [c[2][0], c[2][1], c[3][0], c[3][1]]  # row g: keys 16+2t, 17+2t, 24+2t, 25+2t
        a3 = [c[2][2], c[2][3], c[3][2], c[3][3]]
        frags.append([a0, a1, a2, a3])
    return frags


def v_kmajor(v: np.ndarray) -> np.ndarray:
    """V (keys, d), keys a multiple of 16, as the kernel reads it: (d, keys), each 16-key block in
    ``KEY_ORDER``."""
    keys = v.shape[0]
    order = (np.arange(keys) // 16) * 16 + KEY_ORDER[np.arange(keys) % 16]
    return np.ascontiguousarray(v[order].T)


def v_as_b_operand(vt: np.ndarray, n0: int) -> list[list[list[float]]]:
    """Lanes' B registers of the PV step for output columns n0 .. n0 + 7 and the step's 32 keys
    (columns 0..31 of ``vt``): lane (g, t) reads row n0 + g, 4 consecutive bytes at 4t and
    16 + 4t, which is what ``ldmatrix`` (non-transposed, 16-bit units) gives it."""
    frags = []
    for i in range(LANES):
        g, t = lane(i)
        row = vt[n0 + g]
        frags.append([list(row[4 * t:4 * t + 4]), list(row[16 + 4 * t:16 + 4 * t + 4])])
    return frags


def check(seed: int = 0, d: int = 64) -> float:
    """P (16 x 32) from random S accumulator tiles, V (32 x d): the fragment path's P V against
    numpy's; returns the largest difference."""
    rng = np.random.default_rng(seed)
    p = rng.standard_normal((16, 32))
    v = rng.standard_normal((32, d))
    s_tiles = [c_fragment(p[:, 8 * j:8 * j + 8]) for j in range(4)]
    a = a_matrix(p_as_a_operand(s_tiles))
    vt = v_kmajor(v)
    out = np.concatenate([a @ b_matrix(v_as_b_operand(vt, n0)) for n0 in range(0, d, 8)], axis=1)
    assert not np.isnan(out).any()
    return float(np.abs(out - p @ v).max())


def check_qk(seed: int = 0, d: int = 64) -> float:
    """S = Q K^T from row-major Q (16 x d) and K (8 x d) read as A and B fragments (k32 steps)."""
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((16, d)), rng.standard_normal((8, d))
    s = np.zeros((16, 8))
    for k0 in range(0, d, 32):
        frags_a, frags_b = [], []
        for i in range(LANES):
            g, t = lane(i)
            frags_a.append([list(q[g, k0 + 4 * t:k0 + 4 * t + 4]), list(q[g + 8, k0 + 4 * t:k0 + 4 * t + 4]),
                            list(q[g, k0 + 16 + 4 * t:k0 + 20 + 4 * t]),
                            list(q[g + 8, k0 + 16 + 4 * t:k0 + 20 + 4 * t])])
            frags_b.append([list(k[g, k0 + 4 * t:k0 + 4 * t + 4]),
                            list(k[g, k0 + 16 + 4 * t:k0 + 20 + 4 * t])])
        s += a_matrix(frags_a) @ b_matrix(frags_b)
    return float(np.abs(s - q @ k.T).max())


def main() -> None:
    assert sorted(KEY_ORDER) == list(range(16)), "KEY_ORDER must be a permutation"
    worst_pv = max(check(seed, d) for seed in range(20) for d in (64, 128, 256))
    worst_qk = max(check_qk(seed, d) for seed in range(20) for d in (64, 128, 256))
    print(f"KEY_ORDER = {KEY_ORDER.tolist()}")
    print(f"PV through the fragments, 60 cases: largest difference from numpy {worst_pv:.1e}")
    print(f"QK^T through the fragments, 60 cases: largest difference from numpy {worst_qk:.1e}")
    assert worst_pv < 1e-12 and worst_qk < 1e-12


if __name__ == "__main__":
    main()
