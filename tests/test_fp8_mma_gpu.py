"""The e4m3 mma.sync forward (``ForwardConfig.fp8``: mma.sync m16n8k32, issue 60) on the GPU, against
float64 attention of the dequantized inputs with the Hopper kernel's bound (``test_fp8_forward_gpu``).

It is the FP8 forward of every FP8 GPU but Hopper (sm_89, sm_100, sm_120); on Hopper, where ptxas
runs its e4m3 mma.sync as 16-bit tensor-core instructions (correct, no faster), the tests force it by
putting ``configs.FP8_MMA_DEFAULTS``' configs in ``configs.FP8_DEFAULTS``. Outputs are poisoned with
NaN before the launch.
"""

from __future__ import annotations

import zlib

import pytest

gpu = pytest.mark.gpu
torch = pytest.importorskip("torch")

import test_fp8_forward_gpu  # noqa: E402 (after the skip: it needs torch too)

# the Hopper FP8 tests' shapes, and one key
SHAPES = [*test_fp8_forward_gpu.SHAPES, (1, 129, 1, 2, 1, 128)]


@pytest.fixture
def mma_fp8():
    """The mma.sync e4m3 forward on this GPU: forced on Hopper, its own elsewhere (sm_89 on)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    capability = torch.cuda.get_device_capability()
    if capability < (8, 9):
        pytest.skip(f"FP8 tensor cores need sm_89 or newer, this GPU is sm_{capability[0]}{capability[1]}")
    from numbaflash.operations.fp8_forward import mma_kernel_forced

    with mma_kernel_forced():
        yield


def _call(x, out=None, **kwargs):
    import numbaflash as nf

    return nf.flash_attention(x.q, x.k, x.v, q_descale=x.q_descale, k_descale=x.k_descale,
                              v_descale=x.v_descale, out=out, **kwargs)


@gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_fp8_mma_forward_matches_float64(mma_fp8, shape, causal):
    from test_fp8_forward_gpu import _case, check_dense_call

    b, sq, sk, hq, hk, d = shape
    check_dense_call(_case(zlib.crc32(repr(("mma", shape, causal)).encode()), b, sq, sk, hq, hk, d), causal)


@gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("variant", ["window", "softcap", "sink", "fp16", "no_descale", "outliers"])
def test_fp8_mma_forward_variants(mma_fp8, variant, head_dim):
    from test_fp8_forward_gpu import _case, _check, _variant

    b, sq, sk, hq, hk = 2, 190, 260, 4, 2
    x = _case(zlib.crc32(repr((variant, head_dim)).encode()), b, sq, sk, hq, hk, head_dim,
              outliers=variant == "outliers", unit=variant == "no_descale")
    kwargs, mask = _variant(variant, hq)
    if variant == "no_descale":
        import numbaflash as nf

        out = nf.flash_attention(x.q, x.k, x.v)
    else:
        out = _call(x, **kwargs)
    assert out.dtype == (torch.float16 if variant == "fp16" else torch.bfloat16)
    _check(out, x, **mask)


@gpu
def test_fp8_mma_forward_strided_inputs(mma_fp8):
    """q, k and v as views of wider rows (every stride a multiple of 16 bytes, rows not contiguous)
    and heads_kv not the last-but-one stride's: the kernel reads by strides."""
    from test_fp8_forward_gpu import _check

    from numbaflash import fp8

    g = torch.Generator(device="cuda").manual_seed(3)
    wide = [torch.randn(2, s, 3, 256, device="cuda", generator=g) for s in (97, 161, 161)]
    x = fp8.quantize(*(w[..., 64:192] for w in wide))
    q, k, v = (torch.empty(w.shape, device="cuda").to(torch.float8_e4m3fn)[..., 64:192] for w in wide)
    q.copy_(x.q), k.copy_(x.k), v.copy_(x.v)
    assert not q.is_contiguous()
    y = fp8.Quantized(q, k, v, x.q_descale, x.k_descale, x.v_descale, None, None)
    for causal in (False, True):
        _check(_call(y, causal=causal), y, causal=causal)


@gpu
def test_fp8_mma_varlen_is_refused_off_hopper(mma_fp8):
    """Packed FP8 calls run the Hopper kernel only: with the mma.sync kernel a clear error before any
    launch."""
    import numbaflash as nf

    q = torch.randn(10, 2, 64, device="cuda").to(torch.float8_e4m3fn)
    cu = torch.tensor([0, 10], dtype=torch.int32, device="cuda")
    with pytest.raises(NotImplementedError, match="packed"):
        nf.flash_attention_varlen(q, q, q, cu, cu, 10, 10)
