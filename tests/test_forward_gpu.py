"""Forward attention on the GPU against the float64 numpy reference, for both kernel families
(the mma.sync family is forced on Hopper too: it is what every other GPU runs).

Criterion (FlashAttention's): the max error of numbaflash is at most twice the max error
of the same computation done in the input dtype (numpy, rounding scores, probabilities
and output to that dtype), plus a rounding floor; no NaN; rows that see no key exactly 0
with LSE -inf; LSE within an absolute tolerance that grows with the score magnitude.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import numbaflash
from numbaflash import configs
from numbaflash.configs import CANDIDATES, FAMILY_CAPABILITY, FAMILY_HEAD_DIMS, SUPPORTED_HEAD_DIMS
from numbaflash.tools.reference import compare_with_reference

ml_dtypes = pytest.importorskip("ml_dtypes")
DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
FAMILIES = ["sm90", "sm80"]
# Each family at the head dims of its own kernel (Hopper runs the sm80 family at the others).
FAMILY_DIMS = [pytest.param(f, d, id=f"{f}-d{d}") for f in FAMILIES for d in FAMILY_HEAD_DIMS[f]]


def gpu_capability() -> tuple[int, int]:
    from numba import cuda

    return tuple(cuda.get_current_device().compute_capability)


def family_config(family: str, head_dim: int, causal: bool):
    """The config ``family`` ships for this problem."""
    return configs.forward_config(FAMILY_CAPABILITY[family], head_dim, causal)


@contextlib.contextmanager
def using(config, causal: bool):
    """Launch ``config`` (any family that runs on this GPU) inside the block; skip otherwise."""
    cap = gpu_capability()
    if configs.arch_family(cap) == "sm80" and isinstance(config, configs.WsConfig):
        pytest.skip(f"{config} needs Hopper; GPU is sm_{cap[0]}{cap[1]}")
    with configs.force_config(cap, causal, config):
        yield


def random_qkv(rng, batch, sq, sk, hq, hkv, d, dtype, amplitude=1.0):
    q = (rng.standard_normal((batch, sq, hq, d)) * amplitude).astype(dtype)
    k = (rng.standard_normal((batch, sk, hkv, d)) * amplitude).astype(dtype)
    v = rng.standard_normal((batch, sk, hkv, d)).astype(dtype)
    return q, k, v


def check_attention(q, k, v, causal, out, lse=None, softmax_scale=None):
    _, problems = compare_with_reference(q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale)
    assert not problems, "; ".join(problems)


CASES = [
    # batch, seqlen_q, seqlen_k, heads_q, heads_kv
    (2, 1, 1, 2, 2),
    (1, 17, 17, 3, 3),
    (2, 127, 127, 2, 1),
    (1, 129, 129, 16, 2),  # GQA 8:1
    (1, 1000, 1000, 2, 2),
    (1, 4097, 4097, 1, 1),
    (2, 100, 300, 4, 1),  # MQA, seqlen_q < seqlen_k
    (2, 300, 100, 2, 2),  # seqlen_q > seqlen_k: causal rows with no key
]


# Every kernel (family, head dim, causality, dtype) on half the shapes, the dtypes taking the
# shapes in turn: each shape still meets every (family, head dim, causality) kernel, in one dtype.
CASE_DTYPES = [(case, list(DTYPES)[i % len(DTYPES)]) for i, case in enumerate(CASES)]


@pytest.mark.gpu
@pytest.mark.parametrize("family, head_dim", FAMILY_DIMS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("case", "dtype"), CASE_DTYPES,
                         ids=[f"b{c[0]}_q{c[1]}_k{c[2]}_h{c[3]}-{c[4]}-{t}" for c, t in CASE_DTYPES])
def test_forward_matches_reference(rng, case, causal, head_dim, dtype, family):
    batch, sq, sk, hq, hkv = case
    q, k, v = random_qkv(rng, batch, sq, sk, hq, hkv, head_dim, DTYPES[dtype])
    with using(family_config(family, head_dim, causal), causal):
        out, lse = numbaflash.flash_attention(q, k, v, causal=causal, return_lse=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    check_attention(q, k, v, causal, out, lse)


@pytest.mark.gpu
@pytest.mark.parametrize("family, head_dim", FAMILY_DIMS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("causal", [False, True])
def test_forward_large_scores(rng, causal, head_dim, dtype, family):
    """Inputs scaled by 30: peaked softmax, large exponent range. In float16 the scale shrinks
    as sqrt(128 / head_dim) above 128: at d256 the scores of the float16 baseline of the
    criterion (``compare_with_reference``) would overflow to inf and its error be NaN
    (seen on an H100: "2 x nan")."""
    amplitude = 30.0 if dtype == "bfloat16" or head_dim <= 128 else 30.0 * (128 / head_dim) ** 0.5
    q, k, v = random_qkv(rng, 2, 333, 517, 4, 2, head_dim, DTYPES[dtype], amplitude=amplitude)
    with using(family_config(family, head_dim, causal), causal):
        out, lse = numbaflash.flash_attention(q, k, v, causal=causal, return_lse=True)
    check_attention(q, k, v, causal, out, lse)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS, ids=lambda d: f"d{d}")
def test_dispatch_without_forcing(rng, head_dim):
    """What ``flash_attention`` picks by itself on this GPU (on Hopper: the sm80 family at the
    head dims the Hopper kernel lacks) is correct, causal, GQA, with LSE."""
    q, k, v = random_qkv(rng, 2, 190, 250, 4, 2, head_dim, np.float16)
    out, lse = numbaflash.flash_attention(q, k, v, causal=True, return_lse=True)
    check_attention(q, k, v, True, out, lse)
    if configs.dispatch_family(gpu_capability(), head_dim) == "sm80":
        assert isinstance(configs.forward_config(gpu_capability(), head_dim, True), configs.ForwardConfig)


@pytest.mark.gpu
def test_softmax_scale_and_out(rng):
    q, k, v = random_qkv(rng, 1, 70, 90, 2, 2, 64, np.float16)
    out = np.full(q.shape, np.nan, np.float16)
    res = numbaflash.flash_attention(q, k, v, softmax_scale=0.3, out=out)
    assert res is out
    check_attention(q, k, v, False, out, softmax_scale=0.3)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_deterministic(rng, causal):
    q, k, v = random_qkv(rng, 2, 513, 700, 4, 2, 128, np.float16)
    a, la = numbaflash.flash_attention(q, k, v, causal=causal, return_lse=True)
    b, lb = numbaflash.flash_attention(q, k, v, causal=causal, return_lse=True)
    assert a.view(np.uint16).tobytes() == b.view(np.uint16).tobytes()
    assert la.tobytes() == lb.tobytes()


@pytest.mark.gpu
def test_numba_device_arrays_zero_copy(rng):
    from numba import cuda

    q, k, v = random_qkv(rng, 2, 200, 150, 4, 4, 128, np.float16)
    dq, dk, dv = (cuda.to_device(x) for x in (q, k, v))
    dout = cuda.to_device(np.full(q.shape, np.nan, np.float16))
    res, lse = numbaflash.flash_attention(dq, dk, dv, causal=True, out=dout, return_lse=True)
    assert res is dout
    check_attention(q, k, v, True, dout.copy_to_host(), lse.copy_to_host())


class _WithStream:
    """A CUDA array interface that names a stream (as CuPy's does): 1 = legacy default."""

    def __init__(self, array, stream: int) -> None:
        self.array, self.stream = array, stream

    @property
    def __cuda_array_interface__(self):
        return {**self.array.__cuda_array_interface__, "stream": self.stream}


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["legacy-default", "own-stream"])
def test_array_interface_stream(rng, which):
    from numba import cuda

    q, k, v = random_qkv(rng, 1, 130, 140, 2, 2, 64, np.float16)
    stream = cuda.stream()
    handle = 1 if which == "legacy-default" else int(stream.handle)
    dq, dk, dv = (_WithStream(cuda.to_device(x), handle) for x in (q, k, v))
    dout = cuda.to_device(np.full(q.shape, np.nan, np.float16))
    numbaflash.flash_attention(dq, dk, dv, out=_WithStream(dout, handle))
    stream.synchronize()
    cuda.synchronize()
    check_attention(q, k, v, False, dout.copy_to_host(), None)


@pytest.mark.gpu
def test_strided_device_inputs(rng):
    """q, k, v as views into one packed (batch, seqlen, 3, heads, head_dim) buffer."""
    from numba import cuda

    qkv = rng.standard_normal((2, 190, 3, 4, 64)).astype(np.float16)
    d = cuda.to_device(qkv)
    out = numbaflash.flash_attention(d[:, :, 0], d[:, :, 1], d[:, :, 2])
    check_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], False, out.copy_to_host())


@pytest.mark.gpu
def test_misaligned_strided_input_rejected(rng):
    from numba import cuda

    x = cuda.to_device(rng.standard_normal((1, 8, 2, 72)).astype(np.float16))
    view = x[:, :, :, 4:68]  # head_dim 64, rows start 8 bytes in
    with pytest.raises(ValueError, match="16-byte"):
        numbaflash.flash_attention(view, view, view)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_torch_tensors(rng, dtype):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    tdtype = getattr(torch, dtype)
    q = torch.randn(2, 300, 8, 128, device="cuda", dtype=tdtype)
    k = torch.randn(2, 260, 2, 128, device="cuda", dtype=tdtype)
    v = torch.randn(2, 260, 2, 128, device="cuda", dtype=tdtype)
    out = numbaflash.flash_attention(q, k, v, causal=True)
    assert isinstance(out, torch.Tensor) and out.dtype == tdtype and out.shape == q.shape
    sdpa = torch.nn.functional.scaled_dot_product_attention
    qt, kt, vt = (x.transpose(1, 2).float() for x in (q, k, v))
    kt = kt.repeat_interleave(4, dim=1)
    vt = vt.repeat_interleave(4, dim=1)
    mask = torch.ones(300, 260, dtype=torch.bool, device="cuda").tril(260 - 300)
    ref = sdpa(qt, kt, vt, attn_mask=mask).transpose(1, 2)
    ref = torch.nan_to_num(ref)  # rows with no key: SDPA gives NaN, we give 0
    tol = 2e-3 if dtype == "float16" else 1.6e-2
    assert (out.float() - ref).abs().max().item() < tol * 4
    assert not torch.isnan(out).any()




SHIPPED = {(d, cfg) for _, d, _, cfg in configs.shipped_configs()}
assert {d for d, _ in SHIPPED} == set(SUPPORTED_HEAD_DIMS)
TUNABLE = sorted({(key[1], cfg) for key, cands in CANDIDATES.items() for cfg in cands} | SHIPPED, key=str)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, cfg", TUNABLE, ids=str)
def test_every_tunable_config(rng, head_dim, cfg):
    """Each configuration the autotuner may pick, and each shipped one, is correct on ragged,
    causal, GQA shapes in both dtypes, and gives exactly 0 (LSE -inf) on rows that see no key
    when whole CTAs see none (seqlen_q >= seqlen_k + 2 block_m: the epilogue race of 34e1ab6)."""
    masked_q = 45 + 2 * cfg.block_m + 17
    for causal, dtype, sq, sk in ((False, np.float16, 211, 333), (True, ml_dtypes.bfloat16, 211, 333),
                                  (True, np.float16, masked_q, 45), (True, ml_dtypes.bfloat16, masked_q, 45)):
        q, k, v = random_qkv(rng, 2, sq, sk, 4, 2, head_dim, dtype)
        out = np.full(q.shape, np.nan, dtype)
        with using(cfg, causal):
            _, lse = numbaflash.flash_attention(q, k, v, causal=causal, return_lse=True, out=out)
        check_attention(q, k, v, causal, out, lse)


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("sq, sk", [(3000, 1500), (2000, 1000), (700, 300)])
def test_rows_without_keys_are_zero(rng, sq, sk, dtype, family):
    """The shapes of the 34e1ab6 report (d64 causal, seqlen_q = 2 seqlen_k, batch 2, 6 heads):
    every row below seqlen_q - seqlen_k sees no key and must be exactly 0, LSE -inf."""
    from numbaflash.runtime.buffers import DeviceBuffer

    q, k, v = random_qkv(rng, 2, sq, sk, 6, 6, 64, DTYPES[dtype])
    dq, dk, dv = (DeviceBuffer(x) for x in (q, k, v))
    dout = DeviceBuffer(np.full(q.shape, np.nan, q.dtype))
    with using(family_config(family, 64, True), True):
        for _ in range(3):  # a race need not show on the first call
            _, lse = numbaflash.flash_attention(dq, dk, dv, causal=True, out=dout, return_lse=True)
            out, lse = dout.copy_to_host(), lse.copy_to_host()
            assert (out[:, : sq - sk].astype(np.float32) == 0).all(), "rows with no key are not 0"
            assert np.isneginf(lse[:, :, : sq - sk]).all()
    check_attention(q, k, v, True, out, lse)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("sk_offset", [0, -700, 500])
def test_causal_blocks_end_at_seqlen_q(rng, sk_offset, dtype):
    """The causal 3-consumer Hopper kernels start the first 192-row block before row 0 (0, 64 or
    128 rows: ``WsConfig.first_block_lead``), so Q rows before 0 are zero-filled and no warpgroup
    may store them: every residue of seqlen_q mod 192, seqlen_k equal, shorter (rows with no
    key) and longer, against float64, with poisoned outputs."""
    config = configs.WsConfig(64, block_n=128, stages=2, consumers=3, pingpong=True)
    for sq in (1, 63, 64, 65, 128, 129, 191, 192, 193, 5 * 192 + 64, 5 * 192 + 128, 5 * 192 + 150):
        sk = max(sq + sk_offset, 1)
        q, k, v = random_qkv(rng, 2, sq, sk, 3, 1, 64, DTYPES[dtype])
        out = np.full(q.shape, np.nan, q.dtype)
        with using(config, True):
            _, lse = numbaflash.flash_attention(q, k, v, causal=True, return_lse=True, out=out)
        check_attention(q, k, v, True, out, lse)


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_batch_heads_beyond_grid_limit(rng, family):
    """batch = 70000 > 65535 (the grid's z limit): the (batch, head) pairs are folded over two
    grid dimensions; every pair is computed once."""
    q, k, v = random_qkv(rng, 70000, 5, 7, 2, 1, 64, np.float16)
    with using(family_config(family, 64, False), False):
        out, lse = numbaflash.flash_attention(q, k, v, return_lse=True)
    check_attention(q, k, v, False, out, lse)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_folded_grid_on_small_problems(rng, monkeypatch, causal):
    """The folded (batch, head) numbering that batch or heads past 65535 take, forced on a
    ragged GQA problem, gives the same results (the mma.sync kernel unfolds it)."""
    from numbaflash.operations import launch_forward

    monkeypatch.setattr(launch_forward, "FOLD_GRID", True)
    q, k, v = random_qkv(rng, 3, 150, 130, 6, 2, 64, np.float16)
    with using(family_config("sm80", 64, causal), causal):
        out, lse = numbaflash.flash_attention(q, k, v, causal=causal, return_lse=True)
    check_attention(q, k, v, causal, out, lse)


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_out_may_be_q(rng, family):
    """In place: each CTA reads its Q rows before it writes the same O rows."""
    from numba import cuda

    q, k, v = random_qkv(rng, 2, 300, 200, 4, 2, 128, np.float16)
    dq, dk, dv = (cuda.to_device(x) for x in (q, k, v))
    with using(family_config(family, 128, True), True):
        res = numbaflash.flash_attention(dq, dk, dv, causal=True, out=dq)
    assert res is dq
    check_attention(q, k, v, True, dq.copy_to_host())


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_more_than_2_31_elements(family):
    """q and out of 2.16e9 elements (4.3 GB each): offsets past 2^31 stay right. Checks whole
    heads at the start and at the very end of the tensors against a float32 torch reference."""
    torch = pytest.importorskip("torch")
    free, _ = torch.cuda.mem_get_info()
    if free < 12e9:
        pytest.skip(f"needs 12 GB of free GPU memory, {free / 1e9:.1f} GB free")
    gen = torch.Generator(device="cuda").manual_seed(7)
    b, sq, hq, sk, hkv, d = 3, 44000, 128, 100, 8, 128
    assert b * sq * hq * d > 2**31
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.float16, generator=gen)
    k = torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.float16, generator=gen)
    v = torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.float16, generator=gen)
    with using(family_config(family, d, True), True):
        out, lse = numbaflash.flash_attention(q, k, v, causal=True, return_lse=True)
    torch.cuda.synchronize()
    group = hq // hkv
    for bi, h in ((0, 0), (b - 1, hq - 1), (b - 1, hq // 2 + 3)):
        qs, ks, vs = q[bi, :, h].float(), k[bi, :, h // group].float(), v[bi, :, h // group].float()
        s = (qs @ ks.T) / d**0.5
        rows, cols = torch.arange(sq, device="cuda"), torch.arange(sk, device="cuda")
        visible = cols[None, :] <= rows[:, None] + sk - sq
        s = s.masked_fill(~visible, float("-inf"))
        ref_lse = torch.logsumexp(s, dim=1)
        ref = torch.nan_to_num(torch.softmax(s, dim=1)) @ vs
        assert (out[bi, :, h].float() - ref).abs().max().item() < 4e-3
        seen = torch.isfinite(ref_lse)
        assert torch.equal(torch.isneginf(lse[bi, h]), ~seen)
        assert (lse[bi, h][seen] - ref_lse[seen]).abs().max().item() < 1e-3
    del q, out


# Warp-specialised configs whose tiles leave whole warpgroups without rows (192-row tiles,
# skip_tiles) or stage O in the Q buffer or V ring (q_stages 1): each CTA of a 2-CTA grid runs
# many tiles, so the rings wrap and warpgroups go from passing over a tile to working on the next.
FEW_CTA_CONFIGS = sorted({c for key, cands in CANDIDATES.items() if key[0] == "sm90" for c in cands
                          if isinstance(c, configs.WsConfig)
                          and (c.consumers == 3 or c.o_in_q or c.o_in_v)}, key=str)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", FEW_CTA_CONFIGS, ids=str)
def test_ws_two_ctas_match_full_grid(rng, cfg):
    """On a 2-CTA grid the kernel gives bit for bit the full grid's O and LSE, and both are
    correct: ragged rows (1000 = 5 blocks of 192 and 40 rows), causal and not, GQA."""
    torch = pytest.importorskip("torch")
    if configs.arch_family(gpu_capability()) != "sm90":
        pytest.skip("the warp-specialised kernel needs Hopper")
    from numbaflash.tools.ws_launch import flash_attention_ws

    for causal, (batch, sq, sk, hq, hkv) in ((False, (1, 1000, 1000, 2, 1)), (True, (1, 1000, 1000, 2, 1)),
                                             (True, (2, 333, 77, 3, 3))):
        q, k, v = random_qkv(rng, batch, sq, sk, hq, hkv, cfg.head_dim, np.float16)
        tq, tk, tv = (torch.from_numpy(x).cuda() for x in (q, k, v))
        results = []
        for grid in (None, 2):
            out = torch.full_like(tq, float("nan"))
            lse = torch.full((batch, hq, sq), float("nan"), device="cuda")
            flash_attention_ws(tq, tk, tv, causal=causal, return_lse=True, out=out, lse=lse, config=cfg,
                               grid=grid)
            results.append((out.cpu().numpy(), lse.cpu().numpy()))
        (out, lse), (out2, lse2) = results
        assert out.tobytes() == out2.tobytes() and lse.tobytes() == lse2.tobytes(), "2-CTA grid differs"
        check_attention(q, k, v, causal, out, lse)
