"""The e4m3 Hopper forward on the GPU (issue 60), against float64 attention of the dequantized
inputs (x8 · descale).

Tolerance (docs/PERFORMANCE.md, "FP8 forward"): FlashAttention's rule with the FP8 computation as
the "same computation in the input precision": the kernel's largest error against exact attention
of the dequantized inputs is at most 3x that of the float64 computation with P rounded to e4m3
(what any e4m3 PV product does; ``fp8.P_SCALE`` as the kernel scales it), plus the output's own
rounding (2^-8 of the largest |O|, bf16). Outputs are poisoned with NaN before the launch.
"""

from __future__ import annotations

import math
import zlib

import pytest

gpu = pytest.mark.gpu
torch = pytest.importorskip("torch")


def _hopper() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the e4m3 forward runs on Hopper (sm_90) only")


def _reference(q, k, v, *, causal=False, window=(-1, -1), softcap=0.0, scale=None, sink=None, p_fp8=False):
    """float64 attention of float (b, s, h, d) q, k, v with FlashAttention's masks (bottom-right),
    softcap and learnable sink: (out, lse); ``p_fp8``: P = exp(s - max) rounded to e4m3 (times
    ``fp8.P_SCALE``) before P·V, the row sum taken before the rounding. Rows with no key: 0, -inf."""
    from numbaflash.fp8 import P_SCALE

    q, k, v = (x.double() for x in (q, k, v))
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    k = k.repeat_interleave(hq // hk, dim=2)
    v = v.repeat_interleave(hq // hk, dim=2)
    scale = 1 / math.sqrt(d) if scale is None else scale
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(sq, device=q.device)[:, None] + (sk - sq)
    j = torch.arange(sk, device=q.device)[None, :]
    left, right = window
    if causal:
        right = 0
    visible = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if right >= 0:
        visible &= j <= i + right
    if left >= 0:
        visible &= j >= i - left
    s = s.masked_fill(~visible, -math.inf)
    if sink is not None:
        s = torch.cat([s, sink.double()[None, :, None, None].expand(b, hq, sq, 1)], dim=-1)
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    total = p.sum(dim=-1, keepdim=True)
    lse = (m + torch.log(total)).squeeze(-1)
    if sink is not None:
        p = p[..., :-1]
    if p_fp8:
        p = (p * P_SCALE).float().to(torch.float8_e4m3fn).double() / P_SCALE
    out = torch.einsum("bhqk,bkhd->bqhd", p / total.clamp_min(1e-300), v)
    return out, lse


def _case(seed, b, sq, sk, hq, hk, d, outliers=False, unit=False):
    """Random inputs quantized with ``fp8.quantize`` (descales per (batch, KV head)); ``unit``: N(0, 1)
    values cast to e4m3 as they are, descales 1 (what a call without descales means)."""
    from numbaflash import fp8

    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", generator=g) for s, h in ((sq, hq), (sk, hk), (sk, hk)))
    if outliers:
        k = k + 20 * (torch.rand(k.shape, device="cuda", generator=g) < 1e-3)
    if unit:
        ones = torch.ones(b, hk, device="cuda")
        return fp8.Quantized(*(x.to(torch.float8_e4m3fn) for x in (q, k, v)), ones, ones, ones, None, None)
    return fp8.quantize(q, k, v)


def _check(out, quantized, **mask):
    q, k, v = quantized.dequantize()
    exact, lse = _reference(q, k, v, **mask)
    rounded, _ = _reference(q, k, v, p_fp8=True, **mask)
    assert torch.isfinite(out).all(), "an output element was not written (NaN poison) or is not finite"
    err = (out.double() - exact).abs().max().item()
    bound = 3 * (rounded - exact).abs().max().item() + 2**-8 * exact.abs().max().item()
    assert err <= bound, (err, bound)
    return lse


def _variant(variant: str, heads_q: int) -> tuple[dict, dict]:
    """(the call's keyword arguments, the reference's) of a variant test: a window, a softcap, a
    learnable sink or fp16 output (anything else: neither)."""
    kwargs, mask = {}, {}
    if variant == "window":
        kwargs["window_size"] = mask["window"] = (50, 7)
    elif variant == "softcap":
        kwargs["softcap"] = mask["softcap"] = 2.0
    elif variant == "sink":
        kwargs["learnable_sink"] = mask["sink"] = torch.randn(heads_q, device="cuda")
    elif variant == "fp16":
        kwargs["out_dtype"] = torch.float16
    return kwargs, mask


SHAPES = [  # (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim)
    (2, 128, 128, 4, 2, 128),
    (1, 77, 300, 4, 4, 128),  # ragged, seqlen_q far below seqlen_k
    (2, 300, 77, 2, 1, 64),  # ragged the other way (causal: rows that see no key)
    (1, 1, 513, 8, 1, 256),
    (1, 1000, 1000, 2, 2, 64),
    (3, 200, 333, 6, 2, 256),
]


@gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_fp8_forward_matches_float64(shape, causal):
    _hopper()

    b, sq, sk, hq, hk, d = shape
    x = _case(zlib.crc32(repr((shape, causal)).encode()), b, sq, sk, hq, hk, d)
    check_dense_call(x, causal)


def check_dense_call(x, causal):
    """``flash_attention`` on the quantized case ``x`` with its descales into a NaN-poisoned bf16
    ``out``, the LSE returned: the output within ``_check``'s bound, the LSE finite exactly where the
    float64 one is and within 5e-3 there."""
    import numbaflash as nf

    out = torch.full(x.q.shape, math.nan, dtype=torch.bfloat16, device="cuda")
    got, lse = nf.flash_attention(x.q, x.k, x.v, q_descale=x.q_descale, k_descale=x.k_descale,
                                  v_descale=x.v_descale, causal=causal, out=out, return_lse=True)
    assert got is out and got.dtype == torch.bfloat16
    want_lse = _check(got, x, causal=causal)
    seen = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), seen)
    torch.testing.assert_close(lse[seen], want_lse[seen].float(), rtol=0, atol=5e-3)


@gpu
@pytest.mark.parametrize("variant", ["window", "softcap", "sink", "fp16", "no_descale", "outliers"])
def test_fp8_forward_variants(variant):
    _hopper()
    import numbaflash as nf

    b, sq, sk, hq, hk, d = 2, 190, 260, 4, 2, 128
    x = _case(zlib.crc32(variant.encode()), b, sq, sk, hq, hk, d, outliers=variant == "outliers",
              unit=variant == "no_descale")
    kwargs, mask = _variant(variant, hq)
    descales = {} if variant == "no_descale" else dict(q_descale=x.q_descale, k_descale=x.k_descale,
                                                       v_descale=x.v_descale)
    out = nf.flash_attention(x.q, x.k, x.v, **descales, **kwargs)
    assert out.dtype == (torch.float16 if variant == "fp16" else torch.bfloat16)
    _check(out, x, **mask)


@gpu
def test_fp8_numpy_inputs():
    _hopper()
    ml_dtypes = pytest.importorskip("ml_dtypes")
    import numpy as np

    import numbaflash as nf

    x = _case(7, 1, 64, 64, 2, 2, 64)
    q, k, v = (t.view(torch.uint8).cpu().numpy().view(ml_dtypes.float8_e4m3fn) for t in (x.q, x.k, x.v))
    q_d, k_d, v_d = (d.cpu().numpy() for d in (x.q_descale, x.k_descale, x.v_descale))
    out = nf.flash_attention(q, k, v, q_descale=q_d, k_descale=k_d, v_descale=v_d)
    assert isinstance(out, np.ndarray) and out.dtype == ml_dtypes.bfloat16
    _check(torch.from_numpy(out.astype(np.float32)).cuda(), x)


@gpu
@pytest.mark.parametrize("shape", [(2, 1, 3, 64), (1, 100, 2, 128), (3, 257, 1, 256), (1, 4096, 8, 128)])
def test_fp8_v_prep_kernel(shape):
    """``kernels.fp8_prep`` against the torch model of the layout, on contiguous and strided V; every
    byte of the poisoned output written."""
    _hopper()
    from _fp8_model import reference_vt

    from numbaflash.kernels.fp8_layout import padded_keys
    from numbaflash.operations.fp8_forward import transpose_v

    b, s, h, d = shape
    wide = torch.randn(b, s, h, 2 * d, device="cuda").to(torch.float8_e4m3fn)
    for v in (wide[..., :d].contiguous(), wide[..., d:]):  # dense, and rows 2 * d apart
        vt = torch.full((b, h, d, padded_keys(s)), 0xAB, dtype=torch.uint8, device="cuda")
        transpose_v(v, vt, torch.cuda.current_device(), torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
        assert torch.equal(vt, reference_vt(torch, v))


@gpu
def test_fp8_configs_on_the_same_tensors(monkeypatch):
    """Two e4m3 configs (128 and 192 keys a tile: the transposed V in 128- and 64-byte swizzle
    blocks) one after the other on the same tensors: each launch gets its own config's tensor maps."""
    _hopper()
    import numbaflash as nf
    from numbaflash import configs
    from numbaflash.kernels.shapes import WsConfig
    from numbaflash.operations import fp8_forward

    x = _case(11, 2, 333, 517, 4, 2, 128)
    monkeypatch.setattr(fp8_forward, "_PLANS", {})
    for config in (WsConfig(128, block_n=128, fp8=True), WsConfig(128, block_n=192, fp8=True)):
        monkeypatch.setitem(configs.FP8_DEFAULTS, 128, config)
        fp8_forward._PLANS.clear()  # (a plan keys the layout, not the config)
        for causal in (False, True):
            out = nf.flash_attention(x.q, x.k, x.v, q_descale=x.q_descale, k_descale=x.k_descale,
                                     v_descale=x.v_descale, causal=causal)
            _check(out, x, causal=causal)


# ---------------------------------------------------------------------------------- packed (varlen)

PACKED = [  # (sequence lengths (seqlen_q, seqlen_k) each, heads_q, heads_kv, head_dim)
    ([(128, 128), (77, 300), (1, 1)], 4, 2, 128),
    ([(300, 77), (0, 5), (64, 0), (190, 190)], 2, 1, 64),  # empty sequences, rows that see no key
    ([(1, 513), (200, 333), (33, 31)], 4, 2, 256),
    ([(1000, 1000), (5, 900), (640, 17)], 6, 2, 64),
]


def _packed_case(seed, lengths, hq, hk, d):
    """Random e4m3 packed q, k, v (N(0, 1) cast), descales per (sequence, KV head) in [0.5, 2], the
    int32 offsets on the GPU."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    cu_q = torch.tensor([0, *torch.tensor([a for a, _ in lengths]).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor([b for _, b in lengths]).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), hq, d, device="cuda", generator=g).to(torch.float8_e4m3fn)
    k = torch.randn(int(cu_k[-1]), hk, d, device="cuda", generator=g).to(torch.float8_e4m3fn)
    v = torch.randn(int(cu_k[-1]), hk, d, device="cuda", generator=g).to(torch.float8_e4m3fn)
    descales = [0.5 + 1.5 * torch.rand(len(lengths), hk, device="cuda", generator=g) for _ in range(3)]
    return q, k, v, descales, cu_q.cuda(), cu_k.cuda()


def _sequence(b, q, k, v, descales, cu_q, cu_k):
    """Sequence b of a packed case as a dense batch of one: a ``fp8.Quantized`` and its rows."""
    from numbaflash import fp8

    qs, qe, ks, ke = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
    one = [d[b:b + 1] for d in descales]
    return fp8.Quantized(q[None, qs:qe], k[None, ks:ke], v[None, ks:ke], *one, None, None), slice(qs, qe)


@gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", PACKED)
def test_fp8_varlen_matches_float64_and_dense(case, causal):
    """Each sequence of a packed call against float64 (the dense tests' bound) and against the dense
    FP8 call on that sequence alone, to the output's rounding; empty sequences and rows that see no key
    give 0 and LSE -inf; the poisoned output is written everywhere."""
    _hopper()
    import numbaflash as nf

    lengths, hq, hk, d = case
    seed = zlib.crc32(repr((case, causal)).encode())
    q, k, v, descales, cu_q, cu_k = _packed_case(seed, lengths, hq, hk, d)
    out = torch.full(q.shape, math.nan, dtype=torch.bfloat16, device="cuda")
    max_q, max_k = max(a for a, _ in lengths), max(b for _, b in lengths)
    got, lse = nf.flash_attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, q_descale=descales[0],
                                         k_descale=descales[1], v_descale=descales[2], causal=causal, out=out,
                                         return_lse=True)
    assert got is out and lse.shape == (hq, q.shape[0])
    assert torch.isfinite(out).all(), "an output row was not written (NaN poison)"
    for b, (sq, sk) in enumerate(lengths):
        if sq == 0:
            continue
        x, rows = _sequence(b, q, k, v, descales, cu_q, cu_k)
        if sk == 0:
            assert not out[rows].any() and torch.isneginf(lse[:, rows]).all()
            continue
        want_lse = _check(out[None, rows], x, causal=causal)[0]
        seen = torch.isfinite(want_lse)
        assert torch.equal(torch.isfinite(lse[:, rows]), seen)
        torch.testing.assert_close(lse[:, rows][seen], want_lse[seen].float(), rtol=0, atol=5e-3)
        dense, dense_lse = nf.flash_attention(x.q, x.k, x.v, q_descale=x.q_descale, k_descale=x.k_descale,
                                              v_descale=x.v_descale, causal=causal, return_lse=True)
        top = dense.float().abs().max().item()
        torch.testing.assert_close(out[rows].float(), dense[0].float(), rtol=0, atol=2**-8 * top + 1e-6)
        torch.testing.assert_close(lse[:, rows][seen], dense_lse[0][seen], rtol=0, atol=1e-5)


@gpu
@pytest.mark.parametrize("variant", ["window", "softcap", "sink", "fp16"])
def test_fp8_varlen_variants(variant):
    _hopper()
    import numbaflash as nf

    lengths, hq, hk, d = [(190, 260), (3, 70), (129, 128)], 4, 2, 128
    q, k, v, descales, cu_q, cu_k = _packed_case(zlib.crc32(variant.encode()), lengths, hq, hk, d)
    kwargs, mask = _variant(variant, hq)
    out = nf.flash_attention_varlen(q, k, v, cu_q, cu_k, 190, 260, q_descale=descales[0],
                                    k_descale=descales[1], v_descale=descales[2], **kwargs)
    assert out.dtype == (torch.float16 if variant == "fp16" else torch.bfloat16)
    for b in range(len(lengths)):
        x, rows = _sequence(b, q, k, v, descales, cu_q, cu_k)
        _check(out[None, rows], x, **mask)


@gpu
@pytest.mark.parametrize("lengths", [[1], [0, 5, 0], [31, 1, 33, 64, 0, 2], [1000, 7, 129, 32, 3000]])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_fp8_v_prep_varlen_kernel(lengths, head_dim):
    """The packed V prep against the torch model, with the grid sized for a smaller maximum than
    the longest sequence (the CTAs loop): every byte of the poisoned output written."""
    _hopper()
    from _fp8_model import reference_vt_packed

    from numbaflash.kernels.fp8_layout import packed_vt_keys
    from numbaflash.operations.fp8_forward import transpose_v_varlen

    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    h = 3
    wide = torch.randn(int(cu[-1]), h, 2 * head_dim, device="cuda").to(torch.float8_e4m3fn)
    for v in (wide[..., :head_dim].contiguous(), wide[..., head_dim:]):
        vt = torch.full((1, h, head_dim, packed_vt_keys(int(cu[-1]), len(lengths))), 0xAB, dtype=torch.uint8,
                        device="cuda")
        transpose_v_varlen(v, cu, vt, 1, torch.cuda.current_device(), torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
        assert torch.equal(vt, reference_vt_packed(torch, v, cu.tolist()))


@gpu
def test_fp8_varlen_numpy_inputs():
    _hopper()
    ml_dtypes = pytest.importorskip("ml_dtypes")
    import numpy as np

    import numbaflash as nf

    lengths = [(40, 70), (9, 3)]
    q, k, v, descales, cu_q, cu_k = _packed_case(5, lengths, 2, 1, 64)
    host = [t.view(torch.uint8).cpu().numpy().view(ml_dtypes.float8_e4m3fn) for t in (q, k, v)]
    out = nf.flash_attention_varlen(*host, cu_q.cpu().numpy(), cu_k.cpu().numpy(), 40, 70,
                                    q_descale=descales[0].cpu().numpy(), k_descale=descales[1].cpu().numpy(),
                                    v_descale=descales[2].cpu().numpy())
    assert isinstance(out, np.ndarray) and out.dtype == ml_dtypes.bfloat16 and out.shape == q.shape
    got = torch.from_numpy(out.astype(np.float32)).cuda()
    for b in range(len(lengths)):
        x, rows = _sequence(b, q, k, v, descales, cu_q, cu_k)
        _check(got[None, rows], x)


@gpu
def test_fp8_varlen_in_a_cuda_graph():
    """The packed call reads no device value on the host: captured once, replayed on new offsets
    (the same totals) it gives the new sequences' attention."""
    _hopper()
    import numbaflash as nf

    lengths = [(100, 150), (60, 90)]
    q, k, v, descales, cu_q, cu_k = _packed_case(9, lengths, 4, 2, 128)
    nf.flash_attention_varlen(q, k, v, cu_q, cu_k, 160, 240, q_descale=descales[0], k_descale=descales[1],
                              v_descale=descales[2])  # compiled and loaded before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = nf.flash_attention_varlen(q, k, v, cu_q, cu_k, 160, 240, q_descale=descales[0],
                                        k_descale=descales[1], v_descale=descales[2])
    cu_q.copy_(torch.tensor([0, 10, 160], dtype=torch.int32))
    cu_k.copy_(torch.tensor([0, 200, 240], dtype=torch.int32))
    out.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    for b in range(2):
        x, rows = _sequence(b, q, k, v, descales, cu_q, cu_k)
        _check(out[None, rows], x)


@gpu
def test_fp8_launch_plans_serve_new_memory():
    """A layout's second call (its launch plan kept) on new memory, with and without out= and
    descales, dense and packed, gives that memory's attention; an out that overlaps an input is
    refused before any launch, on a kept plan too."""
    _hopper()
    import numbaflash as nf

    for seed in (21, 22):  # the second seed runs on the kept plans
        x = _case(seed, 2, 150, 260, 4, 2, 128)
        out = torch.full((2, 150, 4, 128), math.nan, dtype=torch.bfloat16, device="cuda")
        got = nf.flash_attention(x.q, x.k, x.v, q_descale=x.q_descale, k_descale=x.k_descale,
                                 v_descale=x.v_descale, causal=True, out=out)
        assert got is out
        _check(out, x, causal=True)
        unit = _case(seed, 1, 70, 90, 2, 1, 64, unit=True)
        _check(nf.flash_attention(unit.q, unit.k, unit.v), unit)
        lengths = [(40, 70), (9, 3)]
        q, k, v, descales, cu_q, cu_k = _packed_case(seed, lengths, 2, 1, 256)
        packed = nf.flash_attention_varlen(q, k, v, cu_q, cu_k, 40, 70, q_descale=descales[0],
                                           k_descale=descales[1], v_descale=descales[2])
        for b in range(len(lengths)):
            one, rows = _sequence(b, q, k, v, descales, cu_q, cu_k)
            _check(packed[None, rows], one)
    shared = torch.empty(2 * 150 * 4 * 128 * 2, dtype=torch.uint8, device="cuda")
    q_in = shared[:2 * 150 * 4 * 128].view(torch.float8_e4m3fn).view(2, 150, 4, 128)
    q_in.copy_(x.q)
    overlapping = shared.view(torch.bfloat16).view(2, 150, 4, 128)
    for _ in range(2):
        with pytest.raises(ValueError, match="out shares memory with q"):
            nf.flash_attention(q_in, x.k, x.v, causal=True, out=overlapping)


@gpu
def test_fp8_under_torch_compile():
    """FP8 calls inside ``torch.compile(fullgraph=True)`` (the FP8 ops of ``torch_ops``, dense and
    packed) give the eager calls' results bit for bit."""
    _hopper()
    import numbaflash as nf

    x = _case(31, 2, 150, 260, 4, 2, 128)
    lengths = [(40, 70), (9, 3)]
    q, k, v, descales, cu_q, cu_k = _packed_case(31, lengths, 2, 1, 64)

    def dense(q8, k8, v8, qd, kd, vd):
        out, lse = nf.flash_attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, causal=True,
                                      return_lse=True)
        return out * 2, lse

    def packed(q8, k8, v8, cq, ck, qd, kd, vd):
        return nf.flash_attention_varlen(q8, k8, v8, cq, ck, 40, 70, q_descale=qd, k_descale=kd, v_descale=vd,
                                         window_size=(20, 0), out_dtype=torch.float16) + 1

    torch._dynamo.reset()
    args = (x.q, x.k, x.v, x.q_descale, x.k_descale, x.v_descale)
    for got, want in zip(torch.compile(dense, fullgraph=True)(*args), dense(*args), strict=True):
        assert torch.equal(got, want)
    args = (q, k, v, cu_q, cu_k, *descales)
    assert torch.equal(torch.compile(packed, fullgraph=True)(*args), packed(*args))
