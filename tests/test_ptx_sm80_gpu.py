"""GPU tests of the sm_80 PTX helpers and the demo tile GEMM.

Each helper runs in a tiny kernel (``_sm80_kernels.py``) on random data and is compared with
a numpy model of the instruction written from the PTX ISA fragment-layout tables. Outputs are
poisoned before every launch so that an element the kernel fails to write cannot pass.
"""

from __future__ import annotations

import functools
import zlib

import _sm80_kernels as K
import numpy as np
import pytest

gpu = pytest.mark.gpu

U16_POISON = np.uint16(0xBEEF)
U32_POISON = np.uint32(0xBAADF00D)


def _rng(name: str) -> np.random.Generator:
    """A generator seeded by the test's name: reproducible across processes."""
    return np.random.default_rng(zlib.crc32(name.encode()))


@functools.cache
def _jit(name: str):
    from numba import cuda

    return cuda.jit(K.KERNELS[name][0])


def _run(name: str, grid, block, *host_args):
    """Launch kernel ``name``; numpy arrays go to the device and come back after the launch."""
    from numba import cuda

    dev = [cuda.to_device(a) if isinstance(a, np.ndarray) else a for a in host_args]
    _jit(name)[grid, block](*dev)
    cuda.synchronize()
    pairs = zip(host_args, dev, strict=True)
    return [d.copy_to_host() if isinstance(a, np.ndarray) else None for a, d in pairs]


def _pack(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Two 16-bit bit patterns -> one uint32 register, ``lo`` in bits 0-15."""
    return lo.astype(np.uint32) | (hi.astype(np.uint32) << 16)


def _bf16():
    return pytest.importorskip("ml_dtypes").bfloat16


# --------------------------------------------------------------------------- ldmatrix


def ldmatrix_model(pool: np.ndarray, row_of_lane: np.ndarray, nregs: int, trans: bool) -> np.ndarray:
    """PTX ISA ldmatrix .m8n8 .b16: matrix i's row r is at the address given by lane 8i+r;
    lane l's register i holds elements (l//4, 2*(l%4)) and (l//4, 2*(l%4)+1) of matrix i
    (of its transpose with .trans), the first in the low half."""
    lanes = np.arange(32)
    r, c = lanes // 4, 2 * (lanes % 4)
    out = np.zeros((32, nregs), np.uint32)
    for i in range(nregs):
        m = pool[row_of_lane[8 * i : 8 * i + 8]]  # (8, 8) uint16
        if trans:
            m = m.T
        out[:, i] = _pack(m[r, c], m[r, c + 1])
    return out


@gpu
@pytest.mark.parametrize("trans", [False, True], ids=["plain", "trans"])
@pytest.mark.parametrize("nregs", [1, 2, 4])
def test_ldmatrix(nregs, trans):
    name = f"ldmatrix_x{nregs}" + ("_trans" if trans else "")
    rng = _rng(name)
    pool = rng.integers(0, 1 << 16, size=(K.POOL_ROWS, 8), dtype=np.uint16)
    # Every lane points at a different, scattered row of the pool.
    row_of_lane = rng.permutation(K.POOL_ROWS)[:32].astype(np.int32)
    out = np.full((32, 4), U32_POISON, np.uint32)
    _, _, out = _run(name, 1, 32, pool.ravel(), row_of_lane, out)
    np.testing.assert_array_equal(out[:, :nregs], ldmatrix_model(pool, row_of_lane, nregs, trans))
    assert (out[:, nregs:] == U32_POISON).all()


def test_ldmatrix_model_matches_ptx_table():
    """The model itself, on a pool whose elements encode their (row, column): lane 5 of
    x1 gets row 1, columns 2 and 3; with .trans it gets column 1, rows 2 and 3."""
    pool = (np.arange(8)[:, None] * 16 + np.arange(8)[None, :]).astype(np.uint16)
    rows = np.arange(32, dtype=np.int32) % 8
    plain = ldmatrix_model(pool, rows, 1, False)
    trans = ldmatrix_model(pool, rows, 1, True)
    assert plain[5, 0] == (0x12 | 0x13 << 16)
    assert trans[5, 0] == (0x21 | 0x31 << 16)


# --------------------------------------------------------------------------- mma


def mma_fragments(a_bits: np.ndarray, b_bits: np.ndarray, c: np.ndarray):
    """Per-lane fragments of PTX ISA mma.m16n8k16 (.f16/.bf16, .row.col, f32 accumulators).

    a_bits (16, 16) and b_bits (16, 8) = (K, N) are 16-bit patterns, c (16, 8) float32. With
    g = lane//4, t = lane%4: A regs {a0,a1}..{a6,a7} = A[g, 2t:2t+2], A[g+8, 2t:2t+2],
    A[g, 2t+8:2t+10], A[g+8, 2t+8:2t+10]; B regs = B[2t:2t+2, g], B[2t+8:2t+10, g];
    C/D = C[g, 2t], C[g, 2t+1], C[g+8, 2t], C[g+8, 2t+1]."""
    lanes = np.arange(32)
    g, t = lanes // 4, 2 * (lanes % 4)
    a = np.stack(
        [
            _pack(a_bits[g, t], a_bits[g, t + 1]),
            _pack(a_bits[g + 8, t], a_bits[g + 8, t + 1]),
            _pack(a_bits[g, t + 8], a_bits[g, t + 9]),
            _pack(a_bits[g + 8, t + 8], a_bits[g + 8, t + 9]),
        ],
        axis=1,
    )
    b = np.stack([_pack(b_bits[t, g], b_bits[t + 1, g]), _pack(b_bits[t + 8, g], b_bits[t + 9, g])], axis=1)
    return a, b, np.ascontiguousarray(c_to_fragment(c))


def c_to_fragment(c: np.ndarray) -> np.ndarray:
    lanes = np.arange(32)
    g, t = lanes // 4, 2 * (lanes % 4)
    return np.stack([c[g, t], c[g, t + 1], c[g + 8, t], c[g + 8, t + 1]], axis=1).astype(np.float32)


def fragment_to_c(d: np.ndarray) -> np.ndarray:
    lanes = np.arange(32)
    g, t = lanes // 4, 2 * (lanes % 4)
    out = np.full((16, 8), np.nan, np.float32)
    out[g, t], out[g, t + 1], out[g + 8, t], out[g + 8, t + 1] = d[:, 0], d[:, 1], d[:, 2], d[:, 3]
    return out


def _dtype(kind: str):
    return np.float16 if kind == "f16" else _bf16()


@gpu
@pytest.mark.parametrize("data", ["random", "integers"])
@pytest.mark.parametrize("kind", ["f16", "bf16"])
def test_mma_m16n8k16(kind, data):
    dt = _dtype(kind)
    rng = _rng(f"mma-{kind}-{data}")
    if data == "random":
        a = rng.standard_normal((16, 16)).astype(dt)
        b = rng.standard_normal((16, 8)).astype(dt)
        c = rng.standard_normal((16, 8)).astype(np.float32)
    else:  # small integers: every product and partial sum is exact, so D must be exact
        a = rng.integers(-8, 9, (16, 16)).astype(dt)
        b = rng.integers(-8, 9, (16, 8)).astype(dt)
        c = rng.integers(-64, 65, (16, 8)).astype(np.float32)
    fa, fb, fc = mma_fragments(a.view(np.uint16), b.view(np.uint16), c)
    d = np.full((32, 4), np.nan, np.float32)
    _, _, _, d = _run(f"mma_{kind}", 1, 32, fa, fb, fc, d)
    got = fragment_to_c(d)
    a64, b64, c64 = a.astype(np.float64), b.astype(np.float64), c.astype(np.float64)
    ref = a64 @ b64 + c64
    if data == "integers":
        np.testing.assert_array_equal(got, ref)
    else:
        # fp32 accumulation of 17 exact terms: each addition errs by at most 2^-23 of the
        # sum of magnitudes (truncating tensor-core adders included).
        bound = 17 * 2.0**-23 * (np.abs(a64) @ np.abs(b64) + np.abs(c64))
        err = np.abs(got - ref)
        assert (err <= bound).all(), f"max err {err.max():.3g}, worst ratio {(err / bound).max():.3g}"


def test_mma_fragment_model_roundtrip():
    """The C/D layout model covers each of the 16x8 elements exactly once."""
    c = np.arange(128, dtype=np.float32).reshape(16, 8)
    np.testing.assert_array_equal(fragment_to_c(c_to_fragment(c)), c)


# --------------------------------------------------------------------------- cp.async


@gpu
@pytest.mark.parametrize("name", ["cp_async", "cp_async_at"])
def test_cp_async_and_zero_fill(name):
    rng = _rng(name)
    nrows = 40
    src = rng.integers(0, 1 << 16, size=(nrows, 8), dtype=np.uint16)
    plain_rows = rng.choice(nrows, 32, replace=False).astype(np.int32)
    # Half the lanes ask for rows past the end of src: they must read nothing and write zeros.
    zfill_rows = rng.permutation(
        np.concatenate([rng.choice(nrows, 16, replace=False), nrows + rng.choice(64, 16, replace=False)])
    ).astype(np.int32)
    out_plain = np.full(32 * 8, U16_POISON, np.uint16)
    out_zfill = np.full(32 * 8, U16_POISON, np.uint16)
    res = _run(name, 1, 32, src.ravel(), plain_rows, zfill_rows, np.int32(nrows), out_plain, out_zfill)
    out_plain, out_zfill = res[4].reshape(32, 8), res[5].reshape(32, 8)
    np.testing.assert_array_equal(out_plain, src[plain_rows])
    in_range = zfill_rows < nrows
    expected = np.zeros((32, 8), np.uint16)
    expected[in_range] = src[zfill_rows[in_range]]
    np.testing.assert_array_equal(out_zfill, expected)
    assert in_range.any() and not in_range.all()


@gpu
@pytest.mark.parametrize("n", [0, 1, 2, 3])
def test_cp_async_wait_group(n):
    """GROUPS groups in flight; after wait_group n the GROUPS-n oldest must have landed."""
    rng = _rng(f"wait_group_{n}")
    src = rng.integers(0, 1 << 16, size=K.WAIT_ELEMS, dtype=np.uint16)
    out = np.full(K.WAIT_ELEMS, U16_POISON, np.uint16)
    _, out = _run(f"wait_group_{n}", 1, K.WAIT_THREADS, src, out)
    landed = (K.GROUPS - n) * K.GROUP_ELEMS
    np.testing.assert_array_equal(out[:landed], src[:landed])
    assert (out[landed:] == U16_POISON).all()


# --------------------------------------------------------------------------- 16-byte moves


@gpu
@pytest.mark.parametrize("name", ["vec4", "vec4_at"])
def test_ld_st_shared_v4_and_st_global_v4(name):
    rng = _rng(name)
    src = rng.integers(0, 1 << 32, size=(32, 4), dtype=np.uint32)
    store_row = rng.permutation(32).astype(np.int32)
    load_row = rng.permutation(32).astype(np.int32)
    out_shared = np.full(32 * 4, U32_POISON, np.uint32)
    out_global = np.full(32 * 8, U16_POISON, np.uint16)
    res = _run(name, 1, 32, src, store_row, load_row, out_shared, out_global)
    shared = np.zeros((32, 4), np.uint32)
    shared[store_row] = src  # register i of the v4 store lands at byte 4*i of the row
    np.testing.assert_array_equal(res[3].reshape(32, 4), shared)
    np.testing.assert_array_equal(res[4].view(np.uint32).reshape(32, 4), shared[load_row])


@gpu
def test_ld_global_nc_v4():
    """Lane l's 16-byte read-only load of chunk ``load_chunk[l]`` lands, bit for bit, at chunk l."""
    rng = _rng("ld_global_nc")
    src = rng.integers(0, 1 << 16, size=64 * 8, dtype=np.uint16)
    load_chunk = rng.permutation(64)[:32].astype(np.int32)
    out = np.full(32 * 8, U16_POISON, np.uint16)
    _, _, out = _run("ld_global_nc", 1, 32, src, load_chunk, out)
    np.testing.assert_array_equal(out.reshape(32, 8), src.reshape(64, 8)[load_chunk])


@gpu
def test_shared_address_st_shared_b32_and_ld_shared_f32():
    rng = _rng("shared_address")
    values = rng.integers(0, 1 << 32, size=(4, 32), dtype=np.uint32)
    values[2] = rng.standard_normal(32).astype(np.float32).view(np.uint32)
    out16 = np.full(64, U16_POISON, np.uint16)
    out32 = np.full(32, U32_POISON, np.uint32)
    outf = np.full(32, np.nan, np.float32)
    out64 = np.full(16, U32_POISON, np.uint64)
    addresses = np.full(5, U32_POISON, np.uint32)
    loaded = np.full(32, np.nan, np.float32)
    res = _run("shared_address", 1, 32, values, out16, out32, outf, out64, addresses, loaded)
    _, out16, out32, outf, out64, addresses, loaded = res
    np.testing.assert_array_equal(out16, values[0].view(np.uint16))  # low half at the lower address
    np.testing.assert_array_equal(out32, values[1])
    np.testing.assert_array_equal(outf.view(np.uint32), values[2])
    # ld_shared_f32: lane l reads float (7 l) % 32 of the f32 array, bit for bit
    np.testing.assert_array_equal(loaded.view(np.uint32), values[2][(7 * np.arange(32)) % 32])
    np.testing.assert_array_equal(out64, values[3].view(np.uint64))
    bases = addresses[:4].astype(np.int64)
    assert (bases % 16 == 0).all(), addresses
    assert (bases + 128 <= 228 * 1024).all(), addresses  # inside the shared window
    ordered = np.sort(bases)
    assert (np.diff(ordered) >= 128).all(), addresses  # four distinct, non-overlapping arrays
    assert addresses[4] == addresses[0] + 16  # a slice's address: 8 uint16 further


# --------------------------------------------------------------------------- conversions


def _special_f32() -> np.ndarray:
    f16_ulp1 = 2.0**-10
    bf16_ulp1 = 2.0**-7
    vals = [
        0.0, -0.0, np.inf, -np.inf, 1.0, -1.0,
        65504.0, 65519.99, 65520.0, -65520.0,  # f16 max, last value rounding down, overflow
        1 + f16_ulp1 / 2, 1 + 3 * f16_ulp1 / 2, -(1 + f16_ulp1 / 2),  # f16 ties -> even
        2.0**-24, 2.0**-25, 3 * 2.0**-25, 2.0**-14 - 2.0**-25,  # f16 subnormals and ties
        1 + bf16_ulp1 / 2, 1 + 3 * bf16_ulp1 / 2, -(1 + 3 * bf16_ulp1 / 2),  # bf16 ties -> even
        float(np.finfo(np.float32).max), -float(np.finfo(np.float32).max),  # bf16 overflow
        float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).smallest_subnormal),
        1e-40, -3e-39,  # f32 subnormals
    ]
    return np.array(vals, np.float32)


@gpu
def test_pack_f16x2_bf16x2_bit_exact():
    bf16 = _bf16()
    rng = _rng("pack")
    bits = rng.integers(0, 1 << 32, size=4096, dtype=np.uint64).astype(np.uint32)
    rand = bits.view(np.float32)
    rand = rand[~np.isnan(rand)]
    normal = (rng.standard_normal(1024) * 100).astype(np.float32)
    lo = np.concatenate([_special_f32(), rand, normal])
    hi = rng.permutation(lo)  # different values in the two halves: catches a lo/hi swap
    n = lo.size
    out_f16 = np.full(n, U32_POISON, np.uint32)
    out_bf16 = np.full(n, U32_POISON, np.uint32)
    _, _, out_f16, out_bf16 = _run("pack", (n + 127) // 128, 128, lo, hi, out_f16, out_bf16)
    with np.errstate(over="ignore"):
        want_f16 = _pack(lo.astype(np.float16).view(np.uint16), hi.astype(np.float16).view(np.uint16))
        want_bf16 = _pack(lo.astype(bf16).view(np.uint16), hi.astype(bf16).view(np.uint16))
    np.testing.assert_array_equal(out_f16, want_f16)
    np.testing.assert_array_equal(out_bf16, want_bf16)


@gpu
def test_pack_nan():
    lo = np.array([np.nan, 1.0], np.float32)
    hi = np.array([2.0, -np.nan], np.float32)
    out_f16 = np.full(2, U32_POISON, np.uint32)
    out_bf16 = np.full(2, U32_POISON, np.uint32)
    _, _, out_f16, out_bf16 = _run("pack", 1, 32, lo, hi, out_f16, out_bf16)
    f16 = out_f16.view(np.uint16).view(np.float16)  # [lo0, hi0, lo1, hi1]
    assert np.isnan(f16[0]) and f16[1] == 2.0 and f16[2] == 1.0 and np.isnan(f16[3])
    bf = out_bf16.view(np.uint16)
    is_nan = ((bf & 0x7F80) == 0x7F80) & ((bf & 0x7F) != 0)
    assert list(is_nan) == [True, False, False, True]
    assert bf[1] == 0x4000 and bf[2] == 0x3F80  # 2.0, 1.0


@gpu
def test_exp2_approx_ftz():
    rng = _rng("exp2")
    x = np.concatenate(
        [
            rng.uniform(-125.9, 127.9, 8192),
            rng.uniform(-1, 1, 2048),
            np.arange(-125, 128),  # 2^-126 itself sits on the flush-to-zero edge: avoided
            [0.0, -0.0, -np.inf, np.inf, np.nan, -130.0, -200.0, 128.0, 1e-40, -1e-40],
        ]
    ).astype(np.float32)
    out = np.full(x.size, np.nan, np.float32)
    _, out = _run("exp2", (x.size + 127) // 128, 128, x, out)
    finite = np.isfinite(x) & (x >= -125.9) & (x < 128)
    ref = np.exp2(x[finite].astype(np.float64))
    rel = np.abs(out[finite] - ref) / ref
    assert rel.max() <= 2.0**-22, f"max relative error {rel.max():.3g} = 2^{np.log2(rel.max()):.2f}"
    tail = x.size - 10
    got = out[tail:]
    assert got[0] == 1.0 and got[1] == 1.0  # 2^0, 2^-0
    assert got[2] == 0.0  # 2^-inf
    assert got[3] == np.inf
    assert np.isnan(got[4])
    assert got[5] == 0.0 and got[6] == 0.0  # subnormal results flushed to zero
    assert got[7] == np.inf  # overflow
    assert got[8] == 1.0 and got[9] == 1.0  # subnormal inputs flushed to zero


@gpu
def test_tanh_approx():
    """tanh.approx.f32 (softcapping's tanh): relative error at most 2^-10.9 (the PTX ISA gives
    about 2^-11) where |tanh| is not tiny, absolute 2^-20 near 0; +-1 at +-inf, +-0 at +-0, NaN
    at NaN."""
    rng = _rng("tanh")
    x = np.concatenate([rng.uniform(-10, 10, 8192), rng.uniform(-1e-3, 1e-3, 1024),
                        rng.uniform(-200, 200, 1024),
                        [0.0, -0.0, np.inf, -np.inf, np.nan, 100.0, -100.0, 1e-30]]).astype(np.float32)
    out = np.full(x.size, np.nan, np.float32)
    _, out = _run("tanh", (x.size + 127) // 128, 128, x, out)
    finite = np.isfinite(x)
    ref = np.tanh(x[finite].astype(np.float64))
    err = np.abs(out[finite] - ref)
    big = np.abs(ref) >= 2.0**-10
    rel = err[big] / np.abs(ref[big])
    assert rel.max() <= 2.0**-10.9, f"max relative error {rel.max():.3g} = 2^{np.log2(rel.max()):.2f}"
    assert err[~big].max() <= 2.0**-20
    got = out[x.size - 8:]
    assert got[0] == 0.0 and got[1] == 0.0 and np.signbit(got[1])
    assert got[2] == 1.0 and got[3] == -1.0 and np.isnan(got[4])
    assert abs(got[5] - 1.0) <= 2.0**-10.9 and abs(got[6] + 1.0) <= 2.0**-10.9


@gpu
def test_unroll_runs_every_step_once_in_order():
    x = np.array([-3.25], np.float32)
    out = np.full(K.UNROLL_STEPS, np.nan, np.float32)
    _, out = _run("unroll", 1, 1, x, out)
    ref = np.cumsum(np.exp2(x[0].astype(np.float64) + np.arange(K.UNROLL_STEPS)))
    np.testing.assert_allclose(out, ref, rtol=1e-6)


def exp2_poly_inputs() -> np.ndarray:
    rng = _rng("exp2_poly")
    return np.concatenate([
        -rng.exponential(8.0, 8192), rng.uniform(-1, 1, 2048), rng.uniform(-126, 127, 2048),
        np.arange(-126, 128), [0.0, -0.0, -np.inf, -126.5, -127.0, -200.0, 0.5, -0.5, 126.9],
    ]).astype(np.float32)


def check_exp2_poly(x: np.ndarray, got: np.ndarray) -> None:
    """Relative error < 8e-5 down to 2^-125; tiny (subnormal range) from -126 to -125; exactly
    0 below -126 (and at -inf)."""
    normal = x >= -125
    edge = (x >= -126) & ~normal
    assert np.all((got[edge] >= 0) & (got[edge] <= 2.0**-124))
    ref = np.exp2(x[normal].astype(np.float64))
    rel = np.abs(got[normal] - ref) / ref
    assert rel.max() < 8e-5, f"max relative error {rel.max():.3g} at x = {x[normal][rel.argmax()]}"
    assert np.all(got[x < -126] == 0.0) and got[np.isneginf(x)][0] == 0.0


def exp2_poly_model(x: np.ndarray) -> np.ndarray:
    """``ex2_poly3_f32`` of ptx/convert.cu step by step in float32, with its own constants."""
    import pathlib
    import re

    source = (pathlib.Path(__file__).parents[1] / "ptx" / "convert.cu").read_text()
    body = source[source.index("float ex2_poly3_f32"):]
    c3, c2, c1, c0 = (np.float32(v) for v in re.findall(r"(-?\d+\.\d+)f", body.split("int bits")[0])[1:5])
    shifter = np.float32(12582912.0)
    with np.errstate(invalid="ignore", over="ignore"):
        t = x + shifter
        f = x - (t - shifter)
        p = ((c3 * f + c2) * f + c1) * f + c0
        bits = p.view(np.int32) + (t.view(np.int32) << np.int32(23))
    return np.where(x < -126, np.float32(0), bits.view(np.float32))


def test_exp2_poly_model_meets_its_bound():
    """The algorithm and constants (CPU; the GPU test runs the compiled helper)."""
    x = exp2_poly_inputs()
    check_exp2_poly(x, exp2_poly_model(x))


@gpu
def test_exp2_poly_on_the_fma_pipe():
    x = exp2_poly_inputs()
    out = np.full(x.size, np.nan, np.float32)
    _, out = _run("exp2_poly", (x.size + 127) // 128, 128, x, out)
    check_exp2_poly(x, out)


# --------------------------------------------------------------------------- demo GEMM


@gpu
@pytest.mark.parametrize("shape", [(64, 64, 32), (128, 192, 96)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("kind", ["f16", "bf16"])
def test_tile_gemm(kind, shape):
    m, n, k = shape
    dt = _dtype(kind)
    rng = _rng(f"gemm-{kind}-{shape}")
    a = rng.standard_normal((m, k)).astype(dt)
    b = rng.standard_normal((n, k)).astype(dt)
    c = np.full((m, n), np.nan, np.float32)
    res = _run(f"tile_gemm_{kind}", (n // 64, m // 64), 128,
               a.view(np.uint16).ravel(), b.view(np.uint16).ravel(), c, m, n, k)
    got = res[2]
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    ref = a64 @ b64.T
    bound = (k + 1) * 2.0**-23 * (np.abs(a64) @ np.abs(b64).T)
    err = np.abs(got - ref)
    assert np.isfinite(got).all()
    assert (err <= bound).all(), f"max err {err.max():.3g}, worst ratio {(err / bound).max():.3g}"


# --------------------------------------------------------------------------- reductions, turns, 16-bit reads


@gpu
def test_red_global_add_f32_sums_every_value():
    """Many threads add into few addresses: each element ends as the sum of its values. Values
    are small integers, so every summation order gives the same float32 exactly."""
    rng = _rng("red_add")
    n, slots = 1 << 16, 37
    values = rng.integers(-8, 9, n).astype(np.float32)
    index = rng.integers(0, slots, n).astype(np.int64)
    start = rng.integers(-100, 100, slots).astype(np.float32)
    _, _, out = _run("red_add", (n + 255) // 256, 256, values, index, start.copy())
    want = start.astype(np.float64)
    np.add.at(want, index, values.astype(np.float64))
    np.testing.assert_array_equal(out, want.astype(np.float32))


@pytest.mark.hopper
def test_red_global_add_v4_f32_adds_four_adjacent_floats():
    """sm_90's vector red: thread i adds values[i, 0..3] into out[4 index[i] .. 4 index[i] + 3]
    (16-byte aligned); many threads share each group of four, and each float ends as the sum of
    its values (small integers: exact in any order). Not in ``_sm80_kernels`` (no sm_80 form)."""
    from numba import cuda

    from numbaflash import ptx

    @cuda.jit
    def red_add_v4_kernel(values, index, out):
        i = cuda.grid(1)
        if i < index.size:
            ptx.red_global_add_v4_f32(ptx.global_address_f32(out) + index[i] * 16, values[i, 0],
                                      values[i, 1], values[i, 2], values[i, 3])

    rng = _rng("red_add_v4")
    n, groups = 1 << 15, 29
    values = rng.integers(-8, 9, (n, 4)).astype(np.float32)
    index = rng.integers(0, groups, n).astype(np.int64)
    start = rng.integers(-100, 100, 4 * groups).astype(np.float32)
    dev = [cuda.to_device(a) for a in (values, index, start)]
    red_add_v4_kernel[(n + 255) // 256, 256](*dev)
    want = start.astype(np.float64).reshape(groups, 4)
    np.add.at(want, index, values.astype(np.float64))
    np.testing.assert_array_equal(dev[2].copy_to_host(), want.reshape(-1).astype(np.float32))


@gpu
def test_acquire_release_turns_pass_in_block_order():
    """Blocks wait for their turn on a counter (acquire load) and pass it on (release add): the
    order they recorded is 0, 1, 2, ... and the counter ends at the block count."""
    blocks = 96
    counter = np.zeros(1, np.int32)
    order = np.full(blocks, -1, np.int32)
    counter, order = _run("turns", blocks, 32, counter, order)
    assert counter[0] == blocks
    np.testing.assert_array_equal(order, np.arange(blocks, dtype=np.int32))


@gpu
def test_f32_from_16bit_bits_exact():
    bf16 = _bf16()
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    out_f16 = np.full(bits.size, np.float32(1234.5), np.float32)
    out_bf16 = np.full(bits.size, np.float32(1234.5), np.float32)
    _, out_f16, out_bf16 = _run("bits_to_f32", (bits.size + 255) // 256, 256, bits, out_f16, out_bf16)
    for got, want in ((out_f16, bits.view(np.float16).astype(np.float32)),
                      (out_bf16, bits.view(bf16).astype(np.float32))):
        nan = np.isnan(want)
        np.testing.assert_array_equal(np.isnan(got), nan)
        np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))
