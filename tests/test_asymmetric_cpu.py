"""V's head dim apart from Q's and K's (issue 56 item 2), with no GPU: the config, the dispatch and
the checks before anything launches (the kernel compiled offline: ``test_asymmetric_offline``)."""

from __future__ import annotations

import numpy as np
import pytest
from test_api_cpu import FakeDeviceArray, fake_device  # noqa: F401  (the fixture)

import numbaflash
from numbaflash import configs
from numbaflash.kernels.shapes import ForwardConfig
from numbaflash.operands import Operand, check_shapes, describe_out


def operand(name, shape, on_device=True):
    strides = tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
    return Operand(name, shape, "float16", on_device, None, strides, 0)


def test_head_dim_v_equal_to_head_dim_is_the_plain_config():
    assert ForwardConfig(128, head_dim_v=128) == ForwardConfig(128)
    config = ForwardConfig(192, block_m=128, block_n=64, head_dim_v=128)
    assert config.value_dim == 128 and ForwardConfig(128).value_dim == 128
    assert config.shared_bytes == (128 * 192 + 64 * 192 + 64 * 128) * 2


@pytest.mark.parametrize(("head_dim", "head_dim_v", "message"), [
    (192, 96, "multiples of 64 or neither"), (128, 256, "from 32 to head_dim"), (192, 100, "multiple of 32")])
def test_bad_value_dims_are_refused_by_the_config(head_dim, head_dim_v, message):
    with pytest.raises(ValueError, match=message):
        ForwardConfig(head_dim, block_m=128, block_n=64, head_dim_v=head_dim_v).check()


@pytest.mark.parametrize("capability", [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)])
def test_every_pair_has_a_config_that_fits_every_gpu(capability):
    for d, dv in configs.ASYMMETRIC_HEAD_DIMS:
        for causal in (False, True):
            config = configs.forward_config(capability, d, causal, head_dim_v=dv)
            config.check()
            assert (config.head_dim, config.value_dim) == (d, dv)
            assert config.shared_bytes <= configs.max_shared_bytes(capability)


def test_a_pair_with_no_kernel_is_refused_by_the_dispatch_and_packed_calls_take_the_pair():
    with pytest.raises(ValueError, match="no forward kernel for head_dim 128 with head_dim_v 64"):
        configs.forward_config((9, 0), 128, False, head_dim_v=64)
    with pytest.raises(ValueError, match="no backward kernel for head_dim 128 with head_dim_v 64"):
        configs.backward_config((9, 0), 128, False, head_dim_v=64)
    dense = configs.forward_config((9, 0), 192, False, head_dim_v=128)
    assert configs.forward_config((9, 0), 192, False, head_dim_v=128, varlen=True) == dense
    assert configs.backward_config((9, 0), 192, False, head_dim_v=128, varlen=True).value_dim == 128


def test_the_hopper_config_of_a_pair():
    """The pair's Hopper forward: V and O tiles of V's 128 columns beside Q's and K's 192, O
    staged in the V ring (which holds its 128 rows), 208 KB; a pair it lacks or a head dim alone
    is refused; head_dim_v equal to head_dim is the plain config."""
    from numbaflash.kernels.shapes import WsConfig

    config = configs.ASYMMETRIC_WS_DEFAULTS[(192, 128)]
    config.check()
    assert (config.head_dim, config.value_dim, config.block_m, config.block_n) == (192, 128, 128, 128)
    assert config.tile_bytes == {"q": 128 * 192 * 2, "k": 128 * 192 * 2, "v": 128 * 128 * 2, "o": 0}
    assert config.shared_bytes == (128 * 192 + 2 * 128 * 192 + 2 * 128 * 128) * 2 + 1024 <= 227 * 1024
    assert config.o_in_v and config.block_m * config.value_dim * 2 <= config.stages * config.tile_bytes["v"]
    assert WsConfig(128, head_dim_v=128) == WsConfig(128) and WsConfig(128).value_dim == 128
    with pytest.raises(ValueError, match=r"\(head_dim, head_dim_v\) must be one of"):
        WsConfig(128, head_dim_v=64).check()
    with pytest.raises(ValueError, match="shared memory"):  # two Q buffers do not fit beside the rings
        WsConfig(192, stages=2, o_in_v=True, head_dim_v=128).check()


def test_hopper_runs_the_pair_on_its_own_kernel_and_a_forced_config_wins():
    ws, mma = configs.ASYMMETRIC_WS_DEFAULTS[(192, 128)], configs.ASYMMETRIC_DEFAULTS[(192, 128)]
    for varlen in (False, True):
        assert configs.forward_config((9, 0), 192, True, head_dim_v=128, varlen=varlen) == ws
        assert configs.forward_config((8, 0), 192, True, head_dim_v=128, varlen=varlen) == mma
    assert configs.forward_config((9, 0), 192, True, 200 * 1024, head_dim_v=128) == mma  # ws does not fit
    with configs.force_config((9, 0), True, mma):  # what the selftest and the sanitizer do
        assert configs.forward_config((9, 0), 192, True, head_dim_v=128) == mma
        assert configs.forward_config((9, 0), 192, False, head_dim_v=128) == ws  # the other flag's
    with configs.force_config((9, 0), False, configs.DEFAULTS[("sm90", 128)]):  # another head dim's
        assert configs.forward_config((9, 0), 192, False, head_dim_v=128) == ws


def test_check_shapes_takes_the_pairs_only_where_asked():
    q, k = operand("q", (2, 16, 4, 192)), operand("k", (2, 16, 2, 192))
    v = operand("v", (2, 16, 2, 128))
    check_shapes(q, k, v, value_dim=True)
    differs = r"v's head_dim \(128\) differs from q's and k's \(192\).*\(192, 128\)"
    with pytest.raises(ValueError, match=differs):
        check_shapes(q, k, v)
    with pytest.raises(ValueError, match="no kernel for q/k head_dim 128 with v head_dim 64"):
        check_shapes(operand("q", (2, 16, 4, 128)), operand("k", (2, 16, 2, 128)),
                     operand("v", (2, 16, 2, 64)), value_dim=True)
    with pytest.raises(ValueError, match="head_dim must be one of"):  # 192 alone has no kernel
        check_shapes(q, k, operand("v", (2, 16, 2, 192)), value_dim=True)
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        check_shapes(q, k, operand("v", (2, 17, 2, 128)), value_dim=True)


def test_out_must_have_v_s_head_dim():
    q = operand("q", (2, 16, 4, 192))
    expected = r"q's shape with v's head_dim \(2, 16, 4, 128\)"
    with pytest.raises(ValueError, match=expected):
        describe_out(np.zeros((2, 16, 4, 192), np.float16), q, 128)


def test_the_packed_calls_check_out_and_dout_for_v_s_head_dim():
    q, k = np.zeros((16, 2, 192), np.float16), np.zeros((16, 2, 192), np.float16)
    v = np.zeros((16, 2, 128), np.float16)
    cu = np.array([0, 16], np.int32)
    with pytest.raises(ValueError, match=r"out must have q's shape with v's head_dim \(16, 2, 128\)"):
        numbaflash.flash_attention_varlen(q, k, v, cu, cu, 16, 16, out=np.zeros((16, 2, 192), np.float16))
    wrong = np.zeros((16, 2, 192), np.float16)
    with pytest.raises(ValueError, match=r"dout must have the forward's out .* shape \(16, 2, 128\)"):
        numbaflash.flash_attention_varlen_backward(wrong, q, k, v, wrong, np.zeros((2, 16), np.float32), cu,
                                                   cu, 16, 16)
    with pytest.raises(ValueError, match="no kernel for q/k head_dim 192 with v head_dim 264"):  # nor padded
        numbaflash.flash_attention_varlen(q, k, np.zeros((16, 2, 264), np.float16), cu, cu, 16, 16)


def test_check_shapes_takes_one_head_dim_unless_asked():
    q, k = operand("q", (2, 1, 4, 192)), operand("k", (2, 64, 2, 192))
    with pytest.raises(ValueError, match=r"this call needs one head_dim"):
        check_shapes(q, k, operand("v", (2, 64, 2, 128)), paged=False)
    check_shapes(q, k, operand("v", (2, 64, 2, 128)), paged=True, value_dim=True)  # the KV-cache call's


@pytest.mark.parametrize("capability", [(8, 0), (8, 6), (9, 0), (12, 0)])
def test_the_decode_config_of_a_pair(capability):
    """The pair's decode config on every GPU: K tiles of 192 columns and V tiles of 128 in one
    ring stage, O and the warps' merge at 128; the first of the general shapes that fits."""
    from numbaflash.kernels.shapes import DecodeConfig

    for paged in (False, True):
        config = configs.decode_config(capability, 192, 4, paged, head_dim_v=128)
        config.check()
        assert (config.head_dim, config.value_dim, config.paged) == (192, 128, paged)
        assert config.stage_bytes == config.block_n * (192 + 128) * 2 and config.merge_row == 136
        assert config.shared_bytes <= configs.max_shared_bytes(capability)
    assert DecodeConfig(128, head_dim_v=128) == DecodeConfig(128)
    with pytest.raises(ValueError, match="no decode kernel for head_dim 128 with head_dim_v 64"):
        configs.decode_config((9, 0), 128, 4, False, head_dim_v=64)
    with pytest.raises(ValueError, match="one swizzle"):
        DecodeConfig(192, head_dim_v=96).check()


def test_the_backward_wants_dout_and_out_of_v_s_head_dim():
    q, k = np.zeros((1, 16, 2, 192), np.float16), np.zeros((1, 16, 2, 192), np.float16)
    v = np.zeros((1, 16, 2, 128), np.float16)
    wrong = np.zeros((1, 16, 2, 192), np.float16)
    with pytest.raises(ValueError, match=r"dout must have the forward's out .* shape \(1, 16, 2, 128\)"):
        numbaflash.flash_attention_backward(wrong, q, k, v, wrong, np.zeros((1, 2, 16), np.float32))


def test_the_backward_config_of_the_pair_fits_every_gpu():
    from numbaflash.kernels.shapes import BackwardConfig

    assert BackwardConfig(128, head_dim_v=128) == BackwardConfig(128)
    for capability in ((8, 0), (8, 6), (8, 9), (9, 0), (12, 0)):
        for d, dv in configs.ASYMMETRIC_HEAD_DIMS:
            if d == 512 and configs.max_shared_bytes(capability) < 160 * 1024:  # 152.5 KB: none there
                with pytest.raises(RuntimeError, match="no backward config of head_dim 512 with head_dim_v"):
                    configs.backward_config(capability, d, True, head_dim_v=dv)
                continue
            config = configs.backward_config(capability, d, True, head_dim_v=dv)
            config.check()
            assert (config.head_dim, config.value_dim) == (d, dv)
            assert config.shared_bytes <= configs.max_shared_bytes(capability)
            if capability == (9, 0) and (d, dv) in configs.ASYMMETRIC_BACKWARD_WS:  # the Hopper tile
                assert config == configs.ASYMMETRIC_BACKWARD_WS[(d, dv)]
                packed = configs.backward_config(capability, d, True, head_dim_v=dv, varlen=True)
                assert packed.dq_vector == 4 and packed.value_dim == dv  # packed calls: mma.sync
                continue
            assert config.dq_vector == (4 if capability[0] >= 9 else 1)
    layout = configs.ASYMMETRIC_BACKWARD_DEFAULTS[(192, 128)][0].shared_layout
    assert layout["p"] - layout["v"] == 64 * 128 * 2 and layout["do"] - layout["q"] == 64 * 192 * 2
    assert layout["lse"] - layout["do"] == 64 * 128 * 2
    one_stage = configs.ASYMMETRIC_BACKWARD_DEFAULTS[(192, 128)][1]
    with configs.force_config((9, 0), True, one_stage):  # what the sanitizer's worker does
        assert configs.backward_config((9, 0), 192, True, head_dim_v=128).q_stages == 1
    assert configs.backward_config((8, 0), 192, True, head_dim_v=128).q_stages == 2
    assert configs.backward_config((9, 0), 192, True, head_dim_v=128, varlen=True).q_stages == 2
    hopper = configs.ASYMMETRIC_BACKWARD_WS[(192, 128)]
    with configs.force_config((9, 0), True, hopper):
        assert configs.backward_config((9, 0), 192, True, head_dim_v=128) is hopper
        # packed calls have no Hopper kernels: the mma.sync config, forced or not
        assert configs.backward_config((9, 0), 192, True, head_dim_v=128, varlen=True).q_stages == 2


def test_the_float64_backward_reference_takes_v_s_head_dim():
    """dq, dk, dv of the reference against central differences of sum(out * dout) in float64, at a
    few coordinates of each (GQA, causal, seqlen_q > seqlen_k)."""
    from numbaflash.tools.reference import attention_backward_reference, attention_reference

    rng = np.random.default_rng(5)
    q, k = rng.standard_normal((1, 5, 4, 48)), rng.standard_normal((1, 3, 2, 48))
    v, dout = rng.standard_normal((1, 3, 2, 32)), rng.standard_normal((1, 5, 4, 32))
    dq, dk, dv = attention_backward_reference(q, k, v, dout, causal=True)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape

    def loss(q, k, v):
        return float((attention_reference(q, k, v, causal=True)[0] * dout).sum())

    for grad, which in ((dq, 0), (dk, 1), (dv, 2)):
        for _ in range(4):
            index = tuple(int(rng.integers(0, n)) for n in grad.shape)
            plus, minus = [x.copy() for x in (q, k, v)], [x.copy() for x in (q, k, v)]
            plus[which][index] += 1e-6
            minus[which][index] -= 1e-6
            numeric = (loss(*plus) - loss(*minus)) / 2e-6
            assert abs(numeric - grad[index]) < 1e-6 * max(1.0, abs(numeric)), (which, index)


def test_the_packed_forward_check_wants_v_s_head_dim():
    """compare_varlen_with_reference takes the packed reference's own out (v's head dim) and
    names an out of q's head dim as a wrong shape (the device run on 46f90a5 found it asking
    for q's)."""
    from numbaflash.tools.reference import compare_varlen_with_reference, varlen_attention_reference

    rng = np.random.default_rng(6)
    cu_q, cu_k = np.array([0, 0, 1, 6], np.int32), np.array([0, 5, 5, 9], np.int32)
    q, k = rng.standard_normal((6, 4, 48)), rng.standard_normal((9, 2, 48))
    v = rng.standard_normal((9, 2, 32))
    out, lse = varlen_attention_reference(q, k, v, cu_q, cu_k, causal=True)
    assert out.shape == (6, 4, 32)
    ratio, problems = compare_varlen_with_reference(q, k, v, cu_q, cu_k, out, lse, causal=True)
    assert problems == [] and 0 <= ratio <= 1
    wrong = np.zeros(q.shape)
    assert compare_varlen_with_reference(q, k, v, cu_q, cu_k, wrong, lse)[1] == [
        "output shape (6, 4, 48), expected (6, 4, 32)"]


def test_autograd_takes_v_s_head_dim(monkeypatch):
    """The custom ops' wiring with the pair (the kernels stood in by the float64 references of
    ``tests/_torch_attention.py``, as in ``test_torch_op_cpu``): out has v's head dim, the fake
    kernels give the shapes, and q, k, v's gradients match autograd of the plain formula."""
    torch = pytest.importorskip("torch")
    from numbaflash import torch_ops
    from tests._torch_attention import attention_formula, reference_backward, reference_forward

    monkeypatch.setattr(torch_ops, "run_forward", reference_forward)
    monkeypatch.setattr(torch_ops, "run_backward", reference_backward)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 40, 4, 192, generator=gen).half().requires_grad_()
    k = torch.randn(1, 50, 2, 192, generator=gen).half().requires_grad_()
    v = torch.randn(1, 50, 2, 128, generator=gen).half().requires_grad_()
    out = numbaflash.flash_attention(q, k, v, causal=True)
    assert out.shape == (1, 40, 4, 128) and out.grad_fn is not None
    dout = torch.randn(out.shape, generator=gen).half()
    out.backward(dout)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref, _ = attention_formula(q64, k64, v64, True, None)
    ref.backward(dout.double())
    ref = ref.detach()
    torch.testing.assert_close(out.detach().double(), ref, atol=4e-3 * float(ref.abs().max()), rtol=0)
    for got, want in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        assert got.shape == want.shape
        torch.testing.assert_close(got.double(), want, atol=8 * 2.0**-11 * max(1.0, float(want.abs().max())),
                                   rtol=0)
    fake = torch.ops.numbaflash.flash_attention_forward.default
    with torch._subclasses.fake_tensor.FakeTensorMode():
        fq, fk, fv = (torch.empty(x.shape, dtype=x.dtype) for x in (q, k, v))
        fout, flse = fake(fq, fk, fv, True, 192 ** -0.5)
        assert fout.shape == (1, 40, 4, 128) and flse.shape == (1, 4, 40)
        with pytest.raises(ValueError, match="dout must have shape"):
            torch.ops.numbaflash.flash_attention_backward.default(fq, fq, fk, fv, fout, flse, True, 0.1,
                                                                  False)


def test_the_numpy_pipeline_stages_v_and_out_at_v_s_head_dim():
    from numbaflash.runtime.pipeline import Chunk, Problem, chunk_layout

    plain = Problem(2, 100, 300, 8, 2, 192, True)
    pair = Problem(2, 100, 300, 8, 2, 192, True, head_dim_v=128)
    assert pair.value_dim == 128 and plain.value_dim == 192
    assert pair.bytes_per_pair() == plain.bytes_per_pair() - (4 * 100 + 300) * 64 * 2
    chunk = Chunk(0, 2, 0, 2, 0, 100, 300)
    lay, lay_plain = chunk_layout(pair, chunk), chunk_layout(plain, chunk)
    assert lay.q_shape == (2, 100, 8, 192) and lay.kv_shape == (2, 300, 2, 192)
    assert lay.v_shape == (2, 300, 2, 128) and lay.o_shape == (2, 100, 8, 128)
    assert lay_plain.v_shape == lay_plain.kv_shape and lay_plain.o_shape == lay_plain.q_shape
    sizes = [2 * np.prod(s) for s in (lay.q_shape, lay.kv_shape, lay.v_shape, lay.o_shape)]
    aligned = [-(-x // 256) * 256 for x in sizes]
    assert [lay.k - lay.q, lay.v - lay.k, lay.o - lay.v, lay.lse - lay.o] == aligned
    assert lay.nbytes < lay_plain.nbytes


def test_a_compiled_function_of_the_pair_has_no_graph_break_and_its_gradients(monkeypatch):
    """torch.compile(fullgraph=True) of a function calling flash_attention with the pair (the
    kernels stood in by the float64 references): one graph, the eager result, and gradients."""
    torch = pytest.importorskip("torch")
    from numbaflash import api, operands, torch_ops
    from tests._torch_attention import reference_backward, reference_forward

    monkeypatch.setattr(torch_ops, "run_forward", reference_forward)
    monkeypatch.setattr(torch_ops, "run_backward", reference_backward)
    monkeypatch.setattr(api, "_TORCH_ROUTE", [])  # torch.compile traces the first torch call
    monkeypatch.setattr(operands, "_KINDS", {np.ndarray: "numpy"})
    torch._dynamo.reset()

    def attend(q, k, v):
        return numbaflash.flash_attention(q, k, v, causal=True).float().square().sum()

    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 24, 4, 192, generator=gen).bfloat16().requires_grad_()
    k = torch.randn(1, 24, 2, 192, generator=gen).bfloat16().requires_grad_()
    v = torch.randn(1, 24, 2, 128, generator=gen).bfloat16().requires_grad_()
    explained = torch._dynamo.explain(attend)(q, k, v)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)
    loss = compiled(q, k, v)
    loss.backward()
    grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    eager = attend(q, k, v)
    eager.backward()
    torch.testing.assert_close(loss, eager, atol=0, rtol=0)
    for got, x in zip(grads, (q, k, v), strict=True):
        assert got.shape == x.shape
        torch.testing.assert_close(got, x.grad, atol=0, rtol=0)


def test_a_pair_call_on_hopper_launches_the_hopper_kernel(fake_device):  # noqa: F811
    """On a pretend H100 a (192, 128) call loads the pair's Hopper config and returns out of V's
    head dim; its tensor maps' layout holds V's and out's shapes (128 columns)."""
    from numbaflash.operations.launch_forward import _MAP_LAYOUTS

    q, k, v = (FakeDeviceArray(shape) for shape in ((1, 300, 4, 192), (1, 300, 2, 192), (1, 300, 2, 128)))
    out = numbaflash.flash_attention(q, k, v, causal=True)
    assert out.__cuda_array_interface__["shape"] == (1, 300, 4, 128)
    assert fake_device.loads[-1][0] == configs.ASYMMETRIC_WS_DEFAULTS[(192, 128)]
    layout_id = fake_device.slots.keys[-1][0]
    layout = next(key for key, found in _MAP_LAYOUTS.items() if found == layout_id)
    assert (1, 300, 2, 128) in layout and (1, 300, 4, 128) in layout and (1, 300, 4, 192) in layout


def test_the_kvcache_reference_takes_v_s_head_dim():
    """kvcache_reference with v_cache and v_new of 32 columns beside q's and k's 48: out at 32, each
    sequence the plain reference of its own keys and values."""
    from numbaflash.tools.reference import attention_reference, kvcache_reference

    rng = np.random.default_rng(8)
    q, kc = rng.standard_normal((2, 1, 4, 48)), rng.standard_normal((2, 9, 2, 48))
    vc = rng.standard_normal((2, 9, 2, 32))
    kn, vn = rng.standard_normal((2, 2, 2, 48)), rng.standard_normal((2, 2, 2, 32))
    lens = np.array([3, 7])
    out, lse, k_after, v_after = kvcache_reference(q, kc, vc, lens, k_new=kn, v_new=vn)
    assert out.shape == (2, 1, 4, 32) and v_after.shape == vc.shape
    for b in range(2):
        keys = np.concatenate([kc[b, :lens[b]], kn[b]])[None]
        values = np.concatenate([vc[b, :lens[b]], vn[b]])[None]
        o, s = attention_reference(q[b:b + 1], keys, values)
        assert np.allclose(out[b], o[0]) and np.allclose(lse[b], s[0])
        assert np.array_equal(v_after[b, lens[b]:lens[b] + 2], vn[b])
