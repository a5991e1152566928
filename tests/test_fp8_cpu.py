"""FP8 quantization (``numbaflash.fp8``, issue 60's quantizer) on the CPU: e4m3 values and
descales in FlashAttention-3's layout, the rounding bound of e4m3, the Hadamard rotation leaving
QKᵀ unchanged, the errors, and the accuracy ordering of FlashAttention-3's outlier experiment."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the FP8 quantizer needs it")

from numbaflash import fp8  # noqa: E402


def _inputs(shape_q=(2, 40, 4, 64), shape_kv=(2, 40, 2, 64), seed=0, outliers=0.0):
    g = torch.Generator().manual_seed(seed)

    def sample(shape):
        x = torch.randn(shape, generator=g)
        if outliers:
            loud = torch.randn(shape, generator=g) * 10
            x = torch.where(torch.rand(shape, generator=g) < outliers, loud, x)
        return x.bfloat16()

    return sample(shape_q), sample(shape_kv), sample(shape_kv)


@pytest.mark.parametrize("block", [None, 16])
def test_values_and_descales(block):
    q, k, v = _inputs()
    out = fp8.quantize(q, k, v, block=block)
    blocks = () if block is None else (math.ceil(40 / block),)
    for x8, d, x in ((out.q, out.q_descale, q), (out.k, out.k_descale, k), (out.v, out.v_descale, v)):
        assert x8.dtype == torch.float8_e4m3fn and x8.shape == x.shape
        assert d.dtype == torch.float32 and tuple(d.shape) == (2, 2, *blocks)
    deq = out.dequantize()
    for x, y, d in zip((q, k, v), deq, (out.q_descale, out.k_descale, out.v_descale), strict=True):
        # e4m3: 3 mantissa bits (relative 2^-4 at most), subnormals in steps of 2^-9 of the scale
        bound = torch.maximum(x.float().abs() * 2**-4, torch.full_like(y, 2**-9 * float(d.max())))
        assert ((x.float() - y).abs() <= bound + 1e-12).all()
    # the largest magnitude of each scale group lands on e4m3's largest finite value
    assert float(out.k.float().abs().amax()) == fp8.E4M3_MAX


def test_query_heads_share_their_kv_heads_scale():
    q, k, v = _inputs()
    q = q.clone()
    q[:, :, 1] *= 100  # head 1 (of KV head 0's group) is the loud one
    out = fp8.quantize(q, k, v)
    amax = q.float().abs().amax(dim=(1, 3))  # (batch, heads_q)
    want = amax.view(2, 2, 2).amax(-1) / fp8.E4M3_MAX
    torch.testing.assert_close(out.q_descale, want)


def test_hadamard_rotation_keeps_qk_and_v():
    q, k, v = _inputs()
    out = fp8.quantize(q, k, v, hadamard=True, seed=3)
    r = out.rotation
    torch.testing.assert_close(r @ r.T, torch.eye(64), atol=1e-6, rtol=0)
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float().repeat_interleave(2, 2))
    s_rot = torch.einsum("bqhd,bkhd->bhqk", q.float() @ r, (k.float() @ r).repeat_interleave(2, 2))
    torch.testing.assert_close(s_rot, s, atol=1e-3, rtol=1e-4)
    # v is quantized as it is
    assert torch.equal(out.v, fp8.quantize(q, k, v).v)
    earlier = fp8.quantize(q, k, v, hadamard_rotation=True, seed=3)  # the option's earlier name
    assert torch.equal(earlier.rotation, r)
    assert torch.equal(earlier.q.view(torch.uint8), out.q.view(torch.uint8))


def test_errors():
    q, k, v = _inputs()
    with pytest.raises(ValueError, match="power of two"):
        fp8.quantize(q[..., :48], k[..., :48], v[..., :48], hadamard_rotation=True)
    with pytest.raises(ValueError, match="block must be"):
        fp8.quantize(q, k, v, block=0)
    with pytest.raises(ValueError, match="multiple of heads_kv"):
        fp8.quantize(q[:, :, :3], k, v)
    with pytest.raises(ValueError, match="floating torch.Tensor"):
        fp8.quantize(q[0], k, v)


def test_outliers_accuracy_ordering():
    """FlashAttention-3's experiment, small: with 0.1% outliers of scale 10, a scale per head beats
    one per tensor only a little, the Hadamard rotation most; FP8's P rounding adds little."""
    q, k, v = _inputs((1, 256, 4, 64), (1, 256, 4, 64), seed=1, outliers=1e-3)
    qd, kd, vd = (x.double() for x in (q, k, v))
    ref = torch.einsum("bhqk,bkhd->bqhd",
                       torch.softmax(torch.einsum("bqhd,bkhd->bhqk", qd, kd) / 8, -1), vd)

    def rmse(quant, **kw):
        return math.sqrt(float(((fp8.attention_reference(quant, **kw) - ref) ** 2).mean()))

    per_head = rmse(fp8.quantize(q, k, v))
    rotated = rmse(fp8.quantize(q, k, v, hadamard=True))
    assert rotated < per_head / 1.3
    assert rmse(fp8.quantize(q, k, v), p_fp8=False) <= per_head * 1.05
