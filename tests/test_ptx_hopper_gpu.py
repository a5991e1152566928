"""GPU tests of the Hopper (sm_90a) helpers: each helper runs in a small kernel on random data
and is compared element by element with a numpy model written from the PTX ISA tables
(wgmma accumulator / A-fragment layouts, canonical shared-memory layouts and swizzles, TMA box
placement, stmatrix fragments). Values are small integers, so every product and sum is exact.
"""

from __future__ import annotations

import functools

import _hopper_probes as probes
import numpy as np
import pytest

from numbaflash.demos import hopper_gemm as hd
from numbaflash.ptx import hopper as hp

pytestmark = pytest.mark.hopper

K = probes.PROBE_K
SWIZZLE_CODE = {0: hp.SWIZZLE_NONE, 32: hp.SWIZZLE_32B, 64: hp.SWIZZLE_64B, 128: hp.SWIZZLE_128B}

# ---------------------------------------------------------------------------------------------
# numpy models
# ---------------------------------------------------------------------------------------------


def to_bits(x: np.ndarray, dtype: str) -> np.ndarray:
    """float values (exactly representable) -> uint16 bits of f16 or bf16."""
    if dtype == "f16":
        return x.astype(np.float16).view(np.uint16)
    return (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def swizzle(offsets: np.ndarray, span: int) -> np.ndarray:
    """Byte offsets (from a 1024-aligned base) under the 32/64/128-byte swizzle: the 16-byte
    chunk index (bits 4..) is XORed with the 128-byte row index (bits 7..), span/16 chunks."""
    if span == 0:
        return offsets
    mask = (span // 16 - 1) << 4
    return offsets ^ ((offsets >> 3) & mask)


def canonical_layout(major: str, span: int, mn: int, k: int):
    """Byte offsets (mn x k, swizzle applied), LBO, SBO and the k16-step start offsets of a
    16-bit operand in the canonical wgmma layouts (PTX ISA "Shared Memory Matrix Layout"):

    K-major, swizzled: rows of span bytes (span/2 k-elements) at span-byte pitch, 8-row atoms
        SBO = 8*span apart; further k-columns of atoms follow all MN atoms; LBO unused (16).
    K-major, no swizzle: 8x8 core matrices (8 rows of 16 bytes, contiguous); SBO between
        8-row groups along MN, LBO between the two 8-element k halves.
    MN-major, swizzled: k rows of span bytes (span/2 MN-elements), 8-k-row atoms SBO =
        8*span apart; LBO between span/2-wide MN chunks.
    MN-major, no swizzle: core matrices of 8 k rows x 8 MN elements; LBO between 8-k
        groups, SBO between 8-MN groups.
    """
    m_idx, k_idx = np.meshgrid(np.arange(mn), np.arange(k), indexing="ij")
    steps = np.arange(k // 16)
    if major == "K" and span:
        e = span // 2
        sbo, lbo = 8 * span, 16
        column = (mn // 8) * sbo
        off = (k_idx // e) * column + (m_idx // 8) * sbo + (m_idx % 8) * span + (k_idx % e) * 2
        step_off = (16 * steps // e) * column + (16 * steps % e) * 2
    elif major == "K":
        sbo, lbo = 128, (mn // 8) * 128
        off = (m_idx // 8) * sbo + (k_idx // 8) * lbo + (m_idx % 8) * 16 + (k_idx % 8) * 2
        step_off = 2 * steps * lbo
    elif span:
        e = span // 2
        sbo = 8 * span
        lbo = (k // 8) * sbo
        off = (m_idx // e) * lbo + (k_idx // 8) * sbo + (k_idx % 8) * span + (m_idx % e) * 2
        step_off = 2 * steps * sbo
    else:
        lbo, sbo = 128, (k // 8) * 128
        off = (m_idx // 8) * sbo + (k_idx // 8) * lbo + (k_idx % 8) * 16 + (m_idx % 8) * 2
        step_off = 2 * steps * lbo
    return swizzle(off, span), lbo, sbo, [int(s) for s in step_off]


def shared_image(offsets: np.ndarray, bits: np.ndarray) -> np.ndarray:
    """uint32 words of a shared-memory image holding ``bits[i]`` at byte ``offsets[i]``."""
    n16 = int(offsets.max()) // 2 + 1
    img = np.zeros(n16 + (n16 % 2), np.uint16)
    img[offsets.ravel() // 2] = bits.ravel()
    return img.view(np.uint32)


def _thread_coords():
    t = np.arange(128)
    return t // 32, (t % 32) // 4, t % 4  # warp, group g, quad position q


def accumulator_positions(n: int):
    """(row, col) of accumulator i of thread t, each (128, n/2): wgmma D fragment, warp w owns
    rows 16w..16w+15; acc[4j + 2h + e] of lane 4g+q is D[16w + g + 8h, 8j + 2q + e]."""
    w, g, q = (x[:, None] for x in _thread_coords())
    i = np.arange(n // 2)[None, :]
    rows = 16 * w + g + 8 * ((i // 2) % 2)
    cols = 8 * (i // 4) + 2 * q + i % 2
    return rows, cols


def a_fragments(a_bits: np.ndarray) -> np.ndarray:
    """uint32 (128, k/16, 4): thread t's wgmma A register fragment for each k16 step (the
    m16n8k16 A layout for its warp's 16 rows): reg r holds (row g + 8*(r%2), cols 2q + 8*(r//2)
    and +1), low half first."""
    w, g, q = _thread_coords()
    frags = np.zeros((128, a_bits.shape[1] // 16, 4), np.uint32)
    for s in range(frags.shape[1]):
        for r in range(4):
            row = 16 * w + g + 8 * (r % 2)
            col = 16 * s + 2 * q + 8 * (r // 2)
            lo = a_bits[row, col].astype(np.uint32)
            hi = a_bits[row, col + 1].astype(np.uint32)
            frags[:, s, r] = lo | (hi << 16)
    return frags


# ---------------------------------------------------------------------------------------------
# wgmma
# ---------------------------------------------------------------------------------------------


@functools.cache
def _wgmma_kernel(n, dtype, rs, tb, commit_each=False):
    from numba import cuda

    return cuda.jit(probes.WGMMA_PROBE_ARGTYPES)(probes.make_wgmma_probe(n, dtype, rs, tb, commit_each))


def run_wgmma(rng, n, dtype, rs, tb, a_layout, b_layout, accumulate, commit_each=False, swap_b=False):
    """Run the probe; return (got, expected, device descriptors, host descriptor params)."""
    from numba import cuda

    a = rng.integers(-8, 9, (64, K)).astype(np.float32)
    b = rng.integers(-8, 9, (K, n)).astype(np.float32)  # logical B, K x N
    c0 = rng.integers(-64, 65, (64, n)).astype(np.float32)
    a_off, a_lbo, a_sbo, a_steps = canonical_layout("K", a_layout, 64, K)
    b_off, b_lbo, b_sbo, b_steps = canonical_layout(b_layout[0], b_layout[1], n, K)
    if swap_b:
        b_lbo, b_sbo = b_sbo, b_lbo
    a_bits = to_bits(a, dtype)
    a_img = shared_image(a_off, a_bits)
    b_img = shared_image(b_off, to_bits(b.T, dtype))  # element (n, k) of the MN x K operand
    assert a_img.size * 4 <= probes.PROBE_A_BYTES
    assert b_img.size * 4 <= 4 * probes.PROBE_SHARED_WORDS - probes.PROBE_A_BYTES
    rows, cols = accumulator_positions(n)
    params = np.array(
        [a_lbo, a_sbo, SWIZZLE_CODE[a_layout], b_lbo, b_sbo, SWIZZLE_CODE[b_layout[1]], int(accumulate)]
        + a_steps + b_steps,
        np.int64,
    )
    out = cuda.device_array((128, n // 2), np.float32)
    descs = cuda.to_device(np.zeros(3, np.uint64))
    kernel = _wgmma_kernel(n, dtype, rs, tb, commit_each)
    kernel[1, 128](
        cuda.to_device(a_img), cuda.to_device(b_img), cuda.to_device(a_fragments(a_bits)),
        cuda.to_device(params), cuda.to_device(np.ascontiguousarray(c0[rows, cols])), out, descs,
    )
    acc = out.copy_to_host()
    got = np.full((64, n), np.nan, np.float32)
    got[rows, cols] = acc
    expected = a.astype(np.float64) @ b + (c0 if accumulate else 0)
    return got, expected, descs.copy_to_host(), params


B_LAYOUTS_K = [("K", 128), ("K", 64), ("K", 32), ("K", 0)]
B_LAYOUTS_MN = [("MN", 128), ("MN", 64), ("MN", 32), ("MN", 0)]

WGMMA_CASES = (
    [("ss", "f16", n, False) for n in hp.WGMMA_N]
    + [("ss", "bf16", n, False) for n in (64, 256)]
    + [("ss", "f16", n, True) for n in (8, 64, 128, 256)]
    + [("ss", "bf16", 128, True)]
    + [("rs", "f16", n, False) for n in (8, 64, 128, 256)]
    + [("rs", "bf16", 64, False)]
    + [("rs", "f16", n, True) for n in (64, 128, 256)]
    + [("rs", "bf16", 256, True)]
)


def check_wgmma(rng, n, dtype, rs, tb, a_layout, b_layout, accumulate) -> str | None:
    """Run one case; None when exact, else a description of the mismatch."""
    got, expected, descs, params = run_wgmma(rng, n, dtype, rs, tb, a_layout, b_layout, accumulate)
    assert descs[2] == 0, "probe buffer is not 1024-byte aligned"
    base_a = (int(descs[0]) & 0x3FFF) << 4
    host_a = hp.encode_smem_descriptor(base_a, *(int(p) for p in params[0:3]))
    host_b = hp.encode_smem_descriptor(base_a + probes.PROBE_A_BYTES, *(int(p) for p in params[3:6]))
    assert (descs[0], descs[1]) == (host_a, host_b), "device and host descriptors differ"
    if np.array_equal(got, expected):
        return None
    bad = np.argwhere(got != expected)
    first = tuple(bad[0])
    alt, expected_alt, _, _ = run_wgmma(rng, n, dtype, rs, tb, a_layout, b_layout, accumulate, swap_b=True)
    note = "matches" if np.array_equal(alt, expected_alt) else "does not help"
    return (
        f"A {a_layout}B-swizzle K-major, B {b_layout}, accumulate={accumulate}: {len(bad)} wrong, first "
        f"{first} got {got[first]} expected {expected[first]} (swapping B's LBO/SBO {note})"
    )


@pytest.mark.parametrize("form,dtype,n,tb", WGMMA_CASES)
def test_wgmma_m64nNk16(form, dtype, n, tb, rng):
    """wgmma m64nNk16 f32 += A @ B over K = 64 (four k16 steps, descriptors advanced per step)
    for every canonical B layout of the major-ness, A K-major 128B-swizzled (SS) or from
    registers (RS); with scale-d = 0 on a NaN accumulator first, then accumulating."""
    rs = form == "rs"
    pairs = [(128, b_layout) for b_layout in (B_LAYOUTS_MN if tb else B_LAYOUTS_K)]
    if form == "ss" and not tb and dtype == "f16" and n in (64, 256):
        pairs += [(span, ("K", span)) for span in (64, 32, 0)]  # every A layout too
    failures = [
        check_wgmma(rng, n, dtype, rs, tb, a_layout, b_layout, accumulate)
        for a_layout, b_layout in pairs
        for accumulate in (False, True)
    ]
    failures = [f for f in failures if f]
    assert not failures, "\n".join(failures)


def test_wgmma_wait_group_n(rng):
    """One commit group per k-step, then wait_group 3, 2, 1, 0: the result is complete."""
    for accumulate in (False, True):
        got, expected, _, _ = run_wgmma(
            rng, 64, "f16", False, False, 128, ("K", 128), accumulate, commit_each=True
        )
        np.testing.assert_array_equal(got, expected)


# ---------------------------------------------------------------------------------------------
# mbarrier
# ---------------------------------------------------------------------------------------------


def test_mbarrier_arrival_phases():
    """Count-128 barrier: phase 0 open before arrivals while the preceding phase (parity 1)
    reads as complete; 128 arrivals complete phase 0 and open phase 1; 128 more complete it.
    (arrive_expect_tx / expect_tx transaction counting is checked with TMA in test_tma_load.)"""
    from numba import cuda

    kernel = cuda.jit(probes.MBARRIER_PROBE_ARGTYPES)(probes.mbarrier_probe)
    out = cuda.to_device(np.full((128, 5), 7, np.uint32))
    kernel[1, 128](out)
    np.testing.assert_array_equal(out.copy_to_host(), np.tile([0, 1, 1, 0, 1], (128, 1)))


# ---------------------------------------------------------------------------------------------
# TMA
# ---------------------------------------------------------------------------------------------


def box_model(src: np.ndarray, box, coords) -> np.ndarray:
    """The box of ``src`` at ``coords`` (innermost first); elements outside read as 0."""
    start = tuple(reversed(coords))
    padded = np.pad(src, [(0, b) for b in box])
    return padded[tuple(slice(s, s + b) for s, b in zip(start, box, strict=True))]


def smem_box_image(tile: np.ndarray, span: int) -> np.ndarray:
    """Shared image (uint16) of a box as TMA writes it: dense row-major, swizzled."""
    flat = tile.ravel()
    img = np.zeros_like(flat)
    img[swizzle(np.arange(flat.size) * 2, span) // 2] = flat
    return img


_SPAN_NAME = {0: None, 32: "32B", 64: "64B", 128: "128B"}

TMA_LOAD_CASES = [
    # shape, box, coords (innermost first), swizzle span, flags (1: tensormap fence, 2: prefetch)
    ((100, 200), (32, 64), (64, 32), 128, 0),
    ((100, 200), (32, 64), (64, 32), 128, 1),
    ((100, 200), (32, 64), (64, 32), 128, 2),
    ((100, 200), (32, 64), (64, 32), 128, 4),  # armed with expect_tx + arrive
    ((100, 200), (32, 64), (160, 80), 128, 0),  # partly out of bounds: zero fill
    ((100, 200), (16, 32), (40, 8), 64, 0),
    ((100, 200), (8, 16), (184, 92), 32, 0),
    ((100, 200), (20, 40), (16, 70), 0, 0),
    ((3, 40, 64), (2, 16, 64), (0, 8, 1), 128, 0),
    ((2, 3, 24, 32), (1, 2, 8, 32), (0, 16, 1, 1), 64, 3),
    ((2, 3, 24, 32), (2, 3, 16, 32), (0, 12, 0, 0), 0, 0),
]


@pytest.mark.parametrize("shape,box,coords,span,flags", TMA_LOAD_CASES)
def test_tma_load(shape, box, coords, span, flags, rng):
    """cp.async.bulk.tensor 2-D..4-D tile loads completing on an mbarrier armed with the box's
    byte count: the phase stays open until the bytes land; the shared image matches."""
    from numba import cuda

    from numbaflash.runtime.tensor_map import make_tensor_map

    src = rng.integers(1, 65535, shape, dtype=np.uint16)
    d_src = cuda.to_device(src if len(shape) != 3 else src.view(np.float16))  # f16 map for 3-D
    tm = make_tensor_map(d_src, box, swizzle=_SPAN_NAME[span])
    assert tm.box_bytes == 2 * int(np.prod(box))
    kernel = cuda.jit(probes.TMA_LOAD_PROBE_ARGTYPES)(probes.make_tma_load_probe(len(shape)))
    out = cuda.to_device(np.zeros(tm.box_bytes // 4, np.uint32))
    status = cuda.to_device(np.array([0, 7], np.int32))
    d_coords = cuda.to_device(np.array(coords, np.int32))
    kernel[1, 128](tm.to_device(), d_coords, tm.box_bytes, flags, out, status)
    timed_out, open_before_copy = status.copy_to_host()
    assert timed_out == 0, "mbarrier wait timed out: the TMA load never completed"
    assert open_before_copy == 0, "the phase completed before the expected bytes arrived"
    expected = smem_box_image(box_model(src, box, coords), span)
    np.testing.assert_array_equal(out.copy_to_host().view(np.uint16), expected)


TMA_STORE_CASES = [
    ((64, 128), (16, 64), (64, 16), 128),
    ((64, 128), (16, 64), (96, 56), 0),  # partly outside: only the inside is written
    ((4, 16, 64), (2, 8, 64), (0, 8, 1), 128),
    ((2, 3, 16, 32), (1, 2, 8, 32), (0, 8, 1, 1), 64),
]


@pytest.mark.parametrize("shape,box,coords,span", TMA_STORE_CASES)
def test_tma_store_after_proxy_fence(shape, box, coords, span, rng):
    """Ordinary shared stores + fence.proxy.async.shared::cta + barrier, then a TMA store."""
    from numba import cuda

    from numbaflash.runtime.tensor_map import make_tensor_map

    dst = cuda.to_device(np.zeros(shape, np.uint16))
    tm = make_tensor_map(dst, box, swizzle=_SPAN_NAME[span])
    n = int(np.prod(box))
    img = rng.integers(1, 65535, n, dtype=np.uint16)
    kernel = cuda.jit(probes.TMA_STORE_PROBE_ARGTYPES)(probes.make_tma_store_probe(len(shape)))
    d_coords = cuda.to_device(np.array(coords, np.int32))
    kernel[1, 128](tm.to_device(), d_coords, cuda.to_device(img.view(np.uint32)))
    tile = img[swizzle(np.arange(n) * 2, span) // 2].reshape(box)
    expected = np.zeros(shape, np.uint16)
    start = tuple(reversed(coords))
    region = tuple(slice(s, min(s + b, d)) for s, b, d in zip(start, box, shape, strict=True))
    expected[region] = tile[tuple(slice(0, r.stop - r.start) for r in region)]
    np.testing.assert_array_equal(dst.copy_to_host(), expected)


def test_tma_copy_2d_demo(rng):
    from numba import cuda

    from numbaflash.runtime.tensor_map import make_tensor_map, tensor_maps_to_device

    src = rng.integers(0, 65535, (128, 256), dtype=np.uint16)
    d_src = cuda.to_device(src)
    d_dst = cuda.to_device(np.zeros_like(src))
    maps = tensor_maps_to_device(make_tensor_map(d_src, (64, 64)), make_tensor_map(d_dst, (64, 64)))
    kernel = cuda.jit(hd.TMA_COPY_2D_ARGTYPES)(hd.tma_copy_2d)
    kernel[(4, 2), 32](maps, 64, 64)
    np.testing.assert_array_equal(d_dst.copy_to_host(), src)


# ---------------------------------------------------------------------------------------------
# stmatrix
# ---------------------------------------------------------------------------------------------


def test_stmatrix(rng):
    """x1/x2/x4, plain and .trans: lane 8i+r gives the address of row r of matrix i; register
    i of lane 4g+q holds fragment elements (g, 2q) and (g, 2q+1) of matrix i."""
    from numba import cuda

    regs = rng.integers(0, 2**32, (32, 4), dtype=np.uint32)
    rows = rng.permutation(32).astype(np.int32)
    kernel = cuda.jit(probes.STMATRIX_PROBE_ARGTYPES)(probes.stmatrix_probe)
    out = cuda.to_device(np.zeros((6, 128), np.uint32))
    kernel[1, 32](cuda.to_device(regs), cuda.to_device(rows), out)
    got = out.copy_to_host().view(np.uint16).reshape(6, 32, 8)

    halves = regs.view(np.uint16).reshape(32, 4, 2)  # [lane, reg, low/high]
    lane = np.arange(32)
    for v, (count, trans) in enumerate([(1, False), (2, False), (4, False), (1, True), (2, True), (4, True)]):
        expected = np.zeros((32, 8), np.uint16)
        for i in range(count):
            frag = np.zeros((8, 8), np.uint16)
            frag[lane // 4, 2 * (lane % 4)] = halves[:, i, 0]
            frag[lane // 4, 2 * (lane % 4) + 1] = halves[:, i, 1]
            expected[rows[8 * i: 8 * i + 8]] = frag.T if trans else frag
        np.testing.assert_array_equal(got[v], expected, err_msg=f"stmatrix x{count} trans={trans}")


# ---------------------------------------------------------------------------------------------
# setmaxnreg
# ---------------------------------------------------------------------------------------------


def test_setmaxnreg_producer_consumer_split():
    """384 threads with launch bounds (384, 1) start with 168 registers; warpgroup 0 drops
    to 24, warpgroups 1-2 rise to 240 (24*128 + 240*256 = 168*384), all finish."""
    from numba import cuda

    fn = probes.make_setmaxnreg_probe(24, 240)
    kernel = cuda.jit(probes.SETMAXNREG_PROBE_ARGTYPES, launch_bounds=probes.SETMAXNREG_LAUNCH_BOUNDS)(fn)
    regs = kernel.get_regs_per_thread()
    assert regs * 384 >= 24 * 128 + 240 * 256, f"{regs} registers at entry: setmaxnreg.inc 240 would block"
    out = cuda.to_device(np.zeros(384, np.int32))
    kernel[1, 384](out)
    t = np.arange(384)
    np.testing.assert_array_equal(out.copy_to_host(), 3 * t + t // 128)


# ---------------------------------------------------------------------------------------------
# Demo GEMMs (TMA ring + SS wgmma; A-from-registers RS wgmma with MN-major B)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bf16", [False, True])
def test_wgmma_tma_gemm_demo(bf16, rng):
    dtype = "bf16" if bf16 else "f16"
    a = rng.integers(-8, 9, (128, 256)).astype(np.float32)
    b = rng.integers(-8, 9, (256, 256)).astype(np.float32)  # N x K
    c = hd.run_wgmma_tma_gemm(to_bits(a, dtype), to_bits(b, dtype), bf16=bf16)
    np.testing.assert_array_equal(c, a @ b.T)


@pytest.mark.parametrize("bf16", [False, True])
def test_wgmma_rs_gemm_demo(bf16, rng):
    dtype = "bf16" if bf16 else "f16"
    a = rng.integers(-8, 9, (128, 192)).astype(np.float32)
    b = rng.integers(-8, 9, (192, 256)).astype(np.float32)  # K x N
    c = hd.run_wgmma_rs_gemm(to_bits(a, dtype), to_bits(b, dtype), bf16=bf16)
    np.testing.assert_array_equal(c, a @ b)


def test_bulk_reduce_add_after_vector_stores(rng):
    """``st_shared_v4_f32`` fills a shared buffer, four floats a thread; after fence.proxy.async and
    a barrier one thread adds it into global memory twice with ``bulk_reduce_add_f32`` (each
    committed and waited for): dst = dst0 + 2 src (the (192, 128) backward's dQ path)."""
    from numba import cuda, float32

    from numbaflash import ptx

    def probe(dst, src):
        smem = cuda.shared.array(0, float32)
        t = cuda.threadIdx.x
        base = ptx.shared_address_f32(smem)
        ptx.st_shared_v4_f32(base + 16 * t, src[4 * t], src[4 * t + 1], src[4 * t + 2], src[4 * t + 3])
        hp.fence_proxy_async_shared_cta()
        cuda.syncthreads()
        if t == 0:
            for _ in range(2):
                hp.bulk_reduce_add_f32(ptx.global_address_f32(dst), base, 2048)
                hp.tma_store_commit_group()
                hp.tma_store_wait_group_0()

    src = rng.integers(-8, 8, 512).astype(np.float32)
    dst0 = rng.integers(-8, 8, 512).astype(np.float32)
    dst = cuda.to_device(dst0)
    cuda.jit(probe)[1, 128, 0, 2048](dst, cuda.to_device(src))
    np.testing.assert_array_equal(dst.copy_to_host(), dst0 + 2 * src)
