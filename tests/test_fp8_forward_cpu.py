"""The e4m3 forward's host side and data movement, on the CPU (issue 60): the transposed,
key-permuted V against the fragment layouts the kernel packs P in, the config's byte layout, and
the API's errors before anything launches. The kernel itself: ``test_fp8_forward_gpu.py``."""

from __future__ import annotations

import numpy as np
import pytest

from numbaflash.kernels.fp8_layout import KEY_GROUP, KEY_ORDER, key_index, padded_keys
from numbaflash.kernels.shapes import WsConfig

LANES = 32


def _s_fragments(p: np.ndarray) -> list[list[list[float]]]:
    """Each lane's fp32 accumulators of the 16 x 32 scores ``p`` (four 8-column n-tiles), as wgmma's
    and mma.sync's accumulators hold them: n-tile j, element e: row g + 8 (e // 2), column
    8j + 2t + e % 2 (g = lane // 4, t = lane % 4)."""
    frags = []
    for lane in range(LANES):
        g, t = divmod(lane, 4)
        frags.append([[p[g + 8 * (e // 2), 8 * j + 2 * t + e % 2] for e in range(4)] for j in range(4)])
    return frags


def _packed_p(s: list[list[float]]) -> list[list[float]]:
    """``softmax.pack_p_e4m3``'s four registers of one lane, one 32-key step (kk = 0): register
    2h + r holds s[2h][2r], s[2h][2r + 1], s[2h + 1][2r], s[2h + 1][2r + 1], lowest byte first."""
    return [[s[2 * h][2 * r], s[2 * h][2 * r + 1], s[2 * h + 1][2 * r], s[2 * h + 1][2 * r + 1]]
            for h in range(2) for r in range(2)]


def _a_matrix(regs: list[list[list[float]]]) -> np.ndarray:
    """The 16 x 32 A operand the lanes' 8-bit registers spell (PTX's m16n8k32 / wgmma m64nNk32
    A fragment, per warp): register r row g + 8 (r % 2), columns 16 (r // 2) + 4t .. + 3."""
    a = np.full((16, KEY_GROUP), np.nan)
    for lane, four in enumerate(regs):
        g, t = divmod(lane, 4)
        for r, values in enumerate(four):
            col = 16 * (r // 2) + 4 * t
            a[g + 8 * (r % 2), col:col + 4] = values
    return a


def test_key_order_is_a_permutation_of_each_group():
    assert sorted(KEY_ORDER) == list(range(KEY_GROUP))
    assert KEY_ORDER[:4] == (0, 1, 8, 9)  # lane 0's first register: n-tiles 0 and 1, two keys each


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_packed_p_times_permuted_vt_is_p_times_v(seed):
    """P packed from the lanes' own accumulators (no shuffle) times V stored transposed with its keys
    in ``KEY_ORDER`` (B K-major: B[k, n] = Vt[n, k]) is P·V; with V merely transposed it is not."""
    rng = np.random.default_rng(seed)
    p = rng.standard_normal((16, KEY_GROUP))
    v = rng.standard_normal((KEY_GROUP, 24))
    a = _a_matrix([_packed_p(s) for s in _s_fragments(p)])
    assert not np.isnan(a).any()
    vt = v[list(KEY_ORDER)].T  # column c of the transposed V holds key KEY_ORDER[c]
    np.testing.assert_allclose(a @ vt.T, p @ v, rtol=1e-12, atol=1e-12)
    assert np.abs(a @ v - p @ v).max() > 0.1


@pytest.mark.parametrize("seqlen_k", [1, 31, 32, 33, 100, 128])
def test_key_index_covers_the_padded_keys(seqlen_k):
    keys = padded_keys(seqlen_k)
    assert keys % KEY_GROUP == 0 and seqlen_k <= keys < seqlen_k + KEY_GROUP
    index = key_index(seqlen_k)
    assert sorted(index) == list(range(keys))
    assert index[:KEY_GROUP] == list(KEY_ORDER)


@pytest.mark.parametrize("seqlen_k", [1, 45, 64])
def test_reference_vt_model(seqlen_k):
    torch = pytest.importorskip("torch")
    from _fp8_model import reference_vt

    v = (torch.randn(2, seqlen_k, 3, 64) * 4).to(torch.float8_e4m3fn)
    vt = reference_vt(torch, v)
    keys = padded_keys(seqlen_k)
    assert vt.shape == (2, 3, 64, keys) and vt.dtype == torch.uint8 and vt.is_contiguous()
    raw = v.view(torch.uint8)
    for col, key in enumerate(key_index(seqlen_k)):
        if key < seqlen_k:
            assert torch.equal(vt[:, :, :, col], raw[:, key].permute(0, 1, 2))
        else:
            assert not vt[:, :, :, col].any()


def test_fp8_config_bytes():
    c = WsConfig(128, block_n=128, fp8=True)
    assert (c.element_bytes, c.row_bytes, c.box_cols, c.o_row_bytes, c.o_box_cols, c.vt_row_bytes) == (
        1, 128, 128, 128, 64, 128)
    assert c.tile_bytes == {"q": 128 * 128, "k": 128 * 128, "v": 128 * 128, "o": 128 * 128 * 2}
    d64 = WsConfig(64, block_n=192, consumers=3, fp8=True)
    assert (d64.row_bytes, d64.box_cols, d64.vt_row_bytes) == (64, 64, 64)
    sixteen = WsConfig(128, block_n=128)  # the 16-bit kernels' layout is unchanged
    layout = (sixteen.row_bytes, sixteen.box_cols, sixteen.o_row_bytes, sixteen.o_box_cols)
    assert layout == (128, 64, 128, 64)
    for bad in (WsConfig(96, fp8=True), WsConfig(128, block_n=80, fp8=True),
                WsConfig(256, block_n=64, q_stages=1, o_in_q=True, fp8=True)):
        with pytest.raises(ValueError, match="e4m3 kernel needs"):
            bad.check()


def test_fp8_defaults_fit_and_check():
    from numbaflash import configs

    for head_dim, config in configs.FP8_DEFAULTS.items():
        assert config.fp8 and config.head_dim == head_dim
        config.check()  # shared memory included


def test_fp8_mma_configs():
    """The e4m3 mma.sync forward's configs (``ForwardConfig.fp8``): byte layouts (Q and K rows of
    head_dim bytes, the transposed V's of block_n keys, O's 16-bit rows), shared memory that fits
    every sm_89+ GPU (99 KB) with O's staging over the Q and K tiles, Q resident at head dim 256 too,
    the checks; and the dispatch: Hopper's kernel on sm_90, this one on every other FP8 GPU."""
    from numbaflash import configs
    from numbaflash.kernels.shapes import ForwardConfig
    from numbaflash.operations.fp8_forward import _check_gpu

    for head_dim, c in configs.FP8_MMA_DEFAULTS.items():
        assert c.fp8 and c.head_dim == head_dim and c.q_in_regs
        c.check()
        assert c.shared_bytes == (c.block_m + 2 * c.block_n) * head_dim <= configs.SMALLEST_SHARED_BYTES
        assert (c.block_m + c.block_n) * head_dim >= c.block_m * head_dim * 2  # O's staging
        assert c.o_row_bytes == 128 and c.row_bytes == (64 if head_dim == 64 else 128)
        assert configs.fp8_config((8, 9), head_dim) is c and configs.fp8_config((12, 0), head_dim) is c
        assert configs.fp8_config((9, 0), head_dim) is configs.FP8_DEFAULTS[head_dim]
    assert ForwardConfig(128, block_n=64, fp8=True).vt_row_bytes == 64
    assert ForwardConfig(128).row_bytes == 128 and ForwardConfig(96).row_bytes == 64  # 16-bit: unchanged
    for bad, match in ((ForwardConfig(96, block_m=64, block_n=64, fp8=True), "head_dim 64, 128 or 256"),
                       (ForwardConfig(128, block_m=128, block_n=64, fp8=True), ">= block_m"),
                       (ForwardConfig(128, block_m=64, block_n=96, fp8=True), "multiple of 64"),
                       (ForwardConfig(128, block_m=64, block_n=64, early_k=True, fp8=True),
                        "no double_buffer")):
        with pytest.raises(ValueError, match=match):
            bad.check()
    from numbaflash.kernels.families import make_kernel, spec_of

    with pytest.raises(NotImplementedError, match="no packed"):  # packed e4m3 calls: Hopper's kernel
        make_kernel(spec_of(configs.FP8_MMA_DEFAULTS[128], "forward", True, "sm_89", varlen=True))
    _check_gpu((8, 9))
    _check_gpu((12, 0))
    with pytest.raises(RuntimeError, match="sm_89 or newer"):
        _check_gpu((8, 6))


def _fp8(torch, *shape, dtype=None):
    return torch.randn(*shape).to(dtype or torch.float8_e4m3fn)


def test_api_errors_before_launch():
    torch = pytest.importorskip("torch")
    import numbaflash as nf

    q = _fp8(torch, 1, 64, 4, 128)
    k = _fp8(torch, 1, 64, 2, 128)
    with pytest.raises(TypeError, match="must all be float8_e4m3fn"):
        nf.flash_attention(q, k, k.to(torch.bfloat16))
    with pytest.raises(TypeError, match="not e5m2"):
        nf.flash_attention(q, k, _fp8(torch, 1, 64, 2, 128, dtype=torch.float8_e5m2))
    with pytest.raises(TypeError, match="float8_e4m3fn"):  # descales with 16-bit inputs
        nf.flash_attention(q.to(torch.bfloat16), k.to(torch.bfloat16), k.to(torch.bfloat16),
                           q_descale=torch.ones(1, 2))
    with pytest.raises(ValueError, match=r"q_descale must be float32 of shape \(batch, heads_kv\) = \(1, 2"):
        nf.flash_attention(q, k, k, q_descale=torch.ones(1, 4))
    with pytest.raises(ValueError, match="v_descale must be float32"):
        nf.flash_attention(q, k, k, v_descale=torch.ones(1, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="head dims"):
        nf.flash_attention(_fp8(torch, 1, 8, 2, 96), _fp8(torch, 1, 8, 2, 96), _fp8(torch, 1, 8, 2, 96))
    with pytest.raises(ValueError, match="multiple of heads_kv"):
        nf.flash_attention(_fp8(torch, 1, 8, 3, 64), _fp8(torch, 1, 8, 2, 64), _fp8(torch, 1, 8, 2, 64))
    with pytest.raises(ValueError, match="out_dtype"):
        nf.flash_attention(q, k, k, out_dtype=torch.float32)
    with pytest.raises(ValueError, match="one CUDA device"):  # every other check passed on the CPU
        nf.flash_attention(q, k, k, q_descale=torch.ones(1, 2), out_dtype=torch.float16)


def test_numpy_fp8_inputs_are_recognised():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    pytest.importorskip("torch")
    import numbaflash as nf

    q = np.zeros((1, 8, 2, 64), ml_dtypes.float8_e4m3fn)
    with pytest.raises(TypeError, match="must all be float8_e4m3fn"):
        nf.flash_attention(q, q, q.astype(np.float16))
    with pytest.raises(TypeError, match="not e5m2"):
        nf.flash_attention(q, q, q.astype(ml_dtypes.float8_e5m2))


@pytest.mark.parametrize("lengths", [[1], [0, 5, 0], [31, 1, 33, 64, 0, 2], [100, 7, 129, 32]])
def test_packed_vt_columns(lengths):
    """A packed call's transposed V: each sequence's columns start a whole group, hold its padded
    keys and end where the next sequence's start; the device's ``vt_start`` is the same formula."""
    from numbaflash.kernels.fp8_layout import packed_vt_keys, sequence_vt_start
    from numbaflash.kernels.fp8_prep import vt_start

    cu = np.concatenate([[0], np.cumsum(lengths)])
    starts = [sequence_vt_start(int(c), b) for b, c in enumerate(cu)]
    assert starts[-1] == packed_vt_keys(int(cu[-1]), len(lengths))
    for b, n in enumerate(lengths):
        assert starts[b] % KEY_GROUP == 0
        assert starts[b + 1] - starts[b] >= padded_keys(n) if n else starts[b + 1] >= starts[b]
        assert vt_start.py_func(int(cu[b]), b) == starts[b]


def test_reference_vt_packed_model():
    torch = pytest.importorskip("torch")
    from _fp8_model import reference_vt, reference_vt_packed

    from numbaflash.kernels.fp8_layout import sequence_vt_start

    lengths = [45, 0, 3, 70]
    cu = [0, *np.cumsum(lengths).tolist()]
    v = (torch.randn(cu[-1], 2, 64) * 4).to(torch.float8_e4m3fn)
    vt = reference_vt_packed(torch, v, cu)
    covered = torch.zeros(vt.shape[3], dtype=torch.bool)
    for b, n in enumerate(lengths):
        if n:
            start = sequence_vt_start(cu[b], b)
            one = reference_vt(torch, v[None, cu[b]:cu[b + 1]])[0]
            assert torch.equal(vt[0, :, :, start:start + one.shape[2]], one)
            covered[start:start + one.shape[2]] = True
    assert not vt[..., ~covered].any()  # the gaps between sequences are zero


def test_varlen_api_errors_before_launch():
    torch = pytest.importorskip("torch")
    import numbaflash as nf

    q = _fp8(torch, 70, 4, 128)
    k = _fp8(torch, 50, 2, 128)
    cu_q = torch.tensor([0, 30, 70], dtype=torch.int32)
    cu_k = torch.tensor([0, 10, 50], dtype=torch.int32)
    with pytest.raises(TypeError, match="must all be float8_e4m3fn"):
        nf.flash_attention_varlen(q, k, k.to(torch.bfloat16), cu_q, cu_k, 40, 40)
    with pytest.raises(ValueError, match="3-D"):
        nf.flash_attention_varlen(q[None], k[None], k[None], cu_q, cu_k, 40, 40)
    with pytest.raises(TypeError, match="int32"):
        nf.flash_attention_varlen(q, k, k, cu_q.long(), cu_k, 40, 40)
    with pytest.raises(TypeError, match="cu_seqlens_k must be an int32 torch tensor"):
        nf.flash_attention_varlen(q, k, k, cu_q, cu_k.numpy(), 40, 40)
    with pytest.raises(ValueError, match="same length"):
        nf.flash_attention_varlen(q, k, k, cu_q, cu_k[:2], 40, 40)
    with pytest.raises(ValueError, match="max_seqlen_q must be a positive int"):
        nf.flash_attention_varlen(q, k, k, cu_q, cu_k, 0, 40)
    with pytest.raises(ValueError, match=r"k_descale must be float32 of shape \(batch, heads_kv\) = \(2, 2"):
        nf.flash_attention_varlen(q, k, k, cu_q, cu_k, 40, 40, k_descale=torch.ones(1, 2))
    with pytest.raises(ValueError, match="one CUDA device"):  # every other check passed on the CPU
        nf.flash_attention_varlen(q, k, k, cu_q, cu_k, 40, 40, q_descale=torch.ones(2, 2),
                                  out_dtype=torch.float16)


def test_launch_plan_keys_and_out_overlap():
    """A kept launch plan serves exactly the calls whose checks read the same: the key changes with
    any shape, stride, dtype, device or option, and is None for what the checks must refuse; out's
    overlap with q, k or v is checked on every call's memory."""
    torch = pytest.importorskip("torch")
    from numbaflash.operations.fp8_forward import _check_out_overlap, _plan_key

    q = _fp8(torch, 1, 64, 4, 128)
    k = _fp8(torch, 1, 64, 2, 128)
    options = dict(q_descale=None, k_descale=torch.ones(1, 2), v_descale=None, causal=True,
                   softmax_scale=None, window_size=(-1, -1), softcap=0.0, return_lse=False, out=None,
                   learnable_sink=None, out_dtype=None)
    key = _plan_key(torch, (q, k, k), (), options)
    assert key is not None and key == _plan_key(torch, (q.clone(), k.clone(), k.clone()), (), dict(options))
    wide = _fp8(torch, 1, 64, 4, 256)[..., :128]
    assert _plan_key(torch, (wide, k, k), (), options) != key  # strides
    for change in (dict(causal=False), dict(k_descale=torch.ones(1, 2, dtype=torch.float64)),
                   dict(window_size=(8, 0)), dict(out_dtype=torch.float16), dict(return_lse=True)):
        assert _plan_key(torch, (q, k, k), (), {**options, **change}) != key, change
    assert _plan_key(torch, (q, k, k), (), {**options, "window_size": [8, 0]}) is not None  # a list is fine
    assert _plan_key(torch, (q, k, k), (), {**options, "q_descale": [[1.0, 1.0]]}) is None  # not a tensor
    buffer = torch.zeros(4 * 64 * 4 * 128, dtype=torch.uint8)
    q_in = buffer[:64 * 4 * 128].view(torch.float8_e4m3fn).view(1, 64, 4, 128)
    out = buffer.view(torch.bfloat16)[:64 * 4 * 128].view(1, 64, 4, 128)
    with pytest.raises(ValueError, match="out shares memory with q"):
        _check_out_overlap(out, (q_in, k, k))
    apart = buffer.view(torch.bfloat16)[64 * 4 * 128:].view(1, 64, 4, 128)
    _check_out_overlap(apart, (q_in, k, k))


def test_fp8_calls_trace_as_one_op_under_fake_tensors():
    """Under a FakeTensorMode (what torch.compile and torch.export trace with) an FP8 call is the FP8
    op of ``torch_ops``: its output's shape and dtype and the LSE's, with no kernel and no data."""
    torch = pytest.importorskip("torch")
    from torch._subclasses.fake_tensor import FakeTensorMode

    import numbaflash as nf

    with FakeTensorMode():
        q = torch.empty(2, 64, 4, 128, dtype=torch.float8_e4m3fn)
        k = torch.empty(2, 80, 2, 128, dtype=torch.float8_e4m3fn)
        out, lse = nf.flash_attention(q, k, k, q_descale=torch.ones(2, 2), causal=True, return_lse=True,
                                      out_dtype=torch.float16)
        assert out.shape == q.shape and out.dtype == torch.float16
        assert lse.shape == (2, 4, 64) and lse.dtype == torch.float32
        packed = nf.flash_attention_varlen(q[0], k[0], k[0], torch.zeros(3, dtype=torch.int32),
                                           torch.zeros(3, dtype=torch.int32), 40, 50)
        assert packed.shape == q[0].shape and packed.dtype == torch.bfloat16
        with pytest.raises(TypeError, match="float8_e4m3fn"):
            torch.ops.numbaflash.flash_attention_fp8_forward(q.to(torch.bfloat16), k, k, None, None, None,
                                                             False, 0.1, -1, -1, 0.0, None, torch.bfloat16)
