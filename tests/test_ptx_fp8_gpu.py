"""GPU tests of the e4m3 PTX helpers (sm_89+; on an H200 the mma runs as ptxas's f16 emulation,
``test_ptx_fp8_offline.py``). Each helper runs in a tiny kernel (``_fp8_kernels.py``) on random
data and is compared with a numpy model written from the PTX ISA fragment-layout tables of
``mma.sync.m16n8k32`` (8-bit operands) and from ml_dtypes' e4m3 rounding. Outputs are poisoned
before every launch, so an element the kernel fails to write cannot pass.
"""

from __future__ import annotations

import zlib

import _fp8_kernels as K
import numpy as np
import pytest

gpu = pytest.mark.gpu
E4M3_MAX = 448.0


def _rng(name: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(name.encode()))


def _needs_fp8() -> None:
    from numba import cuda

    cap = cuda.get_current_device().compute_capability
    if cap < (8, 9):
        pytest.skip(f"the e4m3 helpers need sm_89+; this GPU is sm_{cap[0]}{cap[1]}")


def _e4m3():
    return pytest.importorskip("ml_dtypes").float8_e4m3fn


def _run(pyfunc, grid, block, *host):
    from numba import cuda

    dev = [cuda.to_device(a) for a in host]
    cuda.jit(pyfunc)[grid, block](*dev)
    cuda.synchronize()
    return [d.copy_to_host() for d in dev]


def _words(four_bytes: np.ndarray) -> np.ndarray:
    """(..., 4) uint8 -> (...) uint32, element 0 in the lowest byte."""
    b = four_bytes.astype(np.uint32)
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def mma_fragments(a: np.ndarray, b: np.ndarray, c: np.ndarray):
    """Each lane's registers for A (16 x 32 e4m3 bytes, row), B (32 x 8 bytes, col) and C (16 x 8
    float32), per PTX's m16n8k32 layout (g = lane // 4, t = lane % 4): A register r holds row g
    (r even) or g + 8 (r odd), columns 4t .. 4t + 3 (r < 2) or 16 + 4t ...; B register r holds
    rows 16r + 4t .. 16r + 4t + 3 of column g; C holds (g, 2t), (g, 2t + 1), (g + 8, 2t),
    (g + 8, 2t + 1)."""
    ra = np.zeros((32, 4), np.uint32)
    rb = np.zeros((32, 2), np.uint32)
    rc = np.zeros((32, 4), np.float32)
    for lane in range(32):
        g, t = divmod(lane, 4)
        for r in range(4):
            row, col = g + 8 * (r % 2), 4 * t + 16 * (r // 2)
            ra[lane, r] = _words(a[row, col:col + 4])
        for r in range(2):
            rb[lane, r] = _words(b[16 * r + 4 * t:16 * r + 4 * t + 4, g])
        rc[lane] = c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t], c[g + 8, 2 * t + 1]
    return ra, rb, rc


@gpu
def test_mma_m16n8k32_e4m3_is_a_times_b_plus_c():
    _needs_fp8()
    e4m3 = _e4m3()
    rng = _rng("mma_e4m3")
    a = (rng.standard_normal((16, 32)) * 8).clip(-E4M3_MAX, E4M3_MAX).astype(e4m3)
    b = (rng.standard_normal((32, 8)) * 8).clip(-E4M3_MAX, E4M3_MAX).astype(e4m3)
    c = rng.standard_normal((16, 8)).astype(np.float32) * 100
    ra, rb, rc = mma_fragments(a.view(np.uint8), b.view(np.uint8), c)
    poison = np.full((32, 4), np.nan, np.float32)
    (_, _, _, out) = _run(K.mma_e4m3_kernel, 1, 32, ra, rb, rc, poison)
    _, _, want = mma_fragments(a.view(np.uint8), b.view(np.uint8),
                               (c.astype(np.float64) + a.astype(np.float64) @ b.astype(np.float64)))
    size = np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64)) + np.abs(c)
    _, _, bound = mma_fragments(a.view(np.uint8), b.view(np.uint8), size * 2.0**-19)
    assert np.isfinite(out).all(), "an accumulator was not written"
    assert (np.abs(out - want) <= bound).all(), np.abs(out - want).max()


@gpu
def test_pack_e4m3x4_rounds_as_ml_dtypes_and_saturates():
    """Round to nearest even as ml_dtypes' cast; past +-448 it saturates (satfinite) where the cast
    would give NaN; NaN stays NaN; tiny values become subnormals or signed zeros."""
    _needs_fp8()
    e4m3 = _e4m3()
    rng = _rng("pack_e4m3")
    x = np.concatenate([rng.standard_normal(4096) * scale for scale in (1e-3, 0.1, 1.0, 30.0, 600.0)])
    x = np.concatenate([x, [np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 448.0, 464.0, -465.0, 2.0**-10,
                            -(2.0**-10), 2.0**-9 * 1.5]]).astype(np.float32)
    x = np.concatenate([x, np.zeros(-len(x) % 4, np.float32)]).reshape(-1, 4)
    out = np.full(len(x), 0xDEADBEEF, np.uint32)
    (_, got) = _run(K.pack_e4m3_kernel, (len(x) + 127) // 128, 128, x, out)
    got_bytes = got.view(np.uint8).reshape(-1, 4)
    clipped = np.where(np.isnan(x), x, np.clip(x, -E4M3_MAX, E4M3_MAX))
    want = clipped.astype(e4m3).view(np.uint8)
    nan = np.isnan(x)
    assert ((got_bytes[nan] & 0x7F) == 0x7F).all(), "NaN did not stay NaN"
    assert (got_bytes[~nan] == want[~nan]).all(), np.argwhere(got_bytes != want)[:5]


@gpu
def test_byte_perm_matches_prmt_semantics():
    """``ptx.byte_perm`` (prmt.b32, default mode) against the PTX ISA's rule on random words and
    selectors (the prep's four among them): byte i of the result is byte (selector >> 4i) & 7 of
    {b, a}; the selectors' sign bits (0x8 of a nibble) are left out: the prep never sets them."""
    rng = _rng("byte_perm")
    n = 4096
    a = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    b = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    selector = np.zeros(n, np.uint32)
    for i in range(4):
        selector |= (rng.integers(0, 8, n).astype(np.uint32) << np.uint32(4 * i))
    selector[:4] = (0x5140, 0x7362, 0x5410, 0x7632)
    out = np.full(n, 0xDEADBEEF, np.uint32)
    (*_, got) = _run(K.byte_perm_kernel, (n + 127) // 128, 128, a, b, selector, out)
    pool = a.astype(np.uint64) | (b.astype(np.uint64) << np.uint64(32))
    want = np.zeros(n, np.uint64)
    for i in range(4):
        pick = (selector.astype(np.uint64) >> np.uint64(4 * i)) & np.uint64(7)
        want |= ((pool >> (np.uint64(8) * pick)) & np.uint64(0xFF)) << np.uint64(8 * i)
    np.testing.assert_array_equal(got, want.astype(np.uint32))
