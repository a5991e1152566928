"""The backward with a learnable sink (issue 56) without a GPU: the specs of a sink call (only the
prepare kernel has a sink build), the sink prepare builds' parameter lists, the checks before
launch, the launches' arguments on a pretend device (the sink and d_sink last in the prepare
kernel's), and autograd through the torch ops with float64 stand-ins for the kernels. The kernels
against float64: ``test_sink_gpu.py``."""

from __future__ import annotations

import inspect
import math

import numpy as np
import pytest
from test_backward_api_cpu import (  # noqa: F401  (fixtures)
    AMPERE,
    FakeDeviceArray,
    FakeLauncher,
    device_inputs,
    fake_gpu,
    no_compile,
)

import numbaflash
from numbaflash import configs
from numbaflash.kernels import families, params
from numbaflash.kernels.families import kernel_abi, kernel_params
from numbaflash.kernels.shapes import BackwardConfig
from numbaflash.kernels.spec import SINK_FREE, kernel_spec
from numbaflash.operations import backward, varlen_backward
from numbaflash.operations.launch_backward import varlen_workspace_layout, workspace_layout
from numbaflash.tools import reference

# ------------------------------------------------------------------ specs and parameter lists


def test_a_sink_call_builds_only_its_prepare_kernel_with_the_sink():
    main = kernel_spec("sm80bwd", "backward", BackwardConfig(64), causal=True, window=True, sink=True)
    assert not main.sink  # SINK_FREE: the main kernel takes the sink-inclusive LSE unchanged
    assert SINK_FREE == {"backward", "backward_dq", "decode_combine", "fp8_v"}
    prep, main_, dq = backward.call_specs(main, sink=True)
    assert (prep.operation, main_, dq.operation) == ("backward_prep", main, "backward_dq")
    assert prep.sink and not dq.sink and not prep.causal and not prep.window
    assert backward.call_specs(main) == [main.sibling(op) for op in families.BACKWARD_OPERATIONS]
    assert kernel_params(prep) == params.BACKWARD_PREP + params.SINK_GRADIENT
    packed = backward.call_specs(kernel_spec("sm80bwd", "backward", BackwardConfig(64), varlen=True), True)[0]
    assert kernel_params(packed) == params.VARLEN_BACKWARD_PREP + params.SINK_GRADIENT
    assert [p.name for p in params.SINK_GRADIENT] == ["sink", "d_sink"]


def test_every_sink_prepare_build_agrees_with_its_declaration():
    """The sink builds of the shipped prepare kernels (dense and packed, both families' configs),
    built on demand and not registered: the declaration is the kernel's parameter list."""
    from numbaflash.tools.registry import backward_sink_kernels

    sinks = backward_sink_kernels()
    assert sinks
    for name, (kernel, argtypes, _) in sinks.items():
        declared = kernel_params(kernel.spec)
        assert kernel.spec.sink and kernel.spec.operation == "backward_prep" and name.endswith("_sink"), name
        assert declared[-2:] == params.SINK_GRADIENT, name
        assert kernel_abi(kernel.spec) == tuple(str(t) for t in argtypes), name
        function = getattr(kernel, "py_func", kernel)
        assert tuple(inspect.signature(function).parameters) == params.names_of(declared), name
        assert kernel.__name__.endswith("_sink"), kernel.__name__
    assert any(k.spec.varlen for k, _, _ in sinks.values())
    assert {k.spec.family for k, _, _ in sinks.values()} == {"sm80bwd", "sm90bwd"}


# ------------------------------------------------------------------ checks before launch


def sink_array(shape=(4,), typestr="<f4", strides=None):
    return FakeDeviceArray(shape, typestr, strides)


@pytest.mark.parametrize(("sink", "error", "message"), [
    (lambda: sink_array((2,)), ValueError, r"learnable_sink must have shape \(heads_q,\) = \(4,\), got \(2,"),
    (lambda: sink_array(typestr="<f2"), TypeError, "learnable_sink must be float32, got float16"),
    (lambda: sink_array(strides=(8,)), ValueError, "learnable_sink must be contiguous"),
    (lambda: np.zeros(4, np.float32), TypeError, r"learnable_sink must be a float32 device array"),
])
def test_a_bad_sink_is_refused_before_the_backward_launches(sink, error, message, no_compile):  # noqa: F811
    x = device_inputs()  # heads_q 4
    with pytest.raises(error, match=message):
        numbaflash.flash_attention_backward(x["dout"], x["q"], x["k"], x["v"], x["out"], x["lse"],
                                            learnable_sink=sink())


def test_numpy_inputs_take_no_sink_in_the_backward(no_compile):  # noqa: F811
    q = np.zeros((1, 8, 4, 64), np.float16)
    k = np.zeros((1, 8, 2, 64), np.float16)
    lse = np.zeros((1, 4, 8), np.float32)
    with pytest.raises(NotImplementedError, match=r"flash_attention_backward\(\): learnable_sink is not"):
        numbaflash.flash_attention_backward(q, q, k, k, q, lse, learnable_sink=np.zeros(4, np.float32))


def offsets():
    return FakeDeviceArray((3,), "<i4")


def test_a_bad_varlen_backward_sink_is_refused_before_launch(monkeypatch, no_compile):  # noqa: F811
    monkeypatch.setattr(varlen_backward, "backward_kernels", no_compile_kernels)
    q, k = FakeDeviceArray((40, 4, 64)), FakeDeviceArray((50, 2, 64))
    lse = FakeDeviceArray((4, 40), "<f4")
    with pytest.raises(ValueError, match=r"learnable_sink must have shape \(heads_q,\) = \(4,\), got \(3,\)"):
        numbaflash.flash_attention_varlen_backward(q, q, k, k, q, lse, offsets(), offsets(), 20, 25,
                                                   learnable_sink=sink_array((3,)))


def no_compile_kernels(*args, **kwargs):
    raise AssertionError("would compile a kernel")


# ------------------------------------------------------------------ the launches


@pytest.fixture
def zeroed(monkeypatch):
    """d_sink arrays made without the driver: (array, (pointer, elements)), each recorded."""
    made = []

    def zeroed_sink_gradient(ref, heads_q, stream):
        array = FakeDeviceArray((heads_q,), "<f4")
        made.append((array, heads_q, stream))
        return array, (array.__cuda_array_interface__["data"][0], heads_q)

    monkeypatch.setattr(backward, "zeroed_sink_gradient", zeroed_sink_gradient)
    monkeypatch.setattr(varlen_backward, "zeroed_sink_gradient", zeroed_sink_gradient)
    return made


def _pointer(x) -> int:
    return x.__cuda_array_interface__["data"][0]


@pytest.mark.parametrize("capability", [AMPERE, (9, 0)])
def test_a_sink_backward_passes_the_sink_and_d_sink_last_to_the_prepare_kernel(fake_gpu, zeroed,  # noqa: F811
                                                                               capability):
    """Both families: the plain call's launches, but the prepare kernel's sink build (its ABI ends
    with two float32 arrays) with (sink, heads_q) and (d_sink, heads_q) after the plain arguments;
    the main and dQ kernels are the plain ones; d_sink comes back fourth."""
    fake_gpu.capability, fake_gpu.limit = capability, configs.max_shared_bytes(capability)
    q_shape, k_shape = (3, 200, 8, 64), (3, 300, 2, 64)
    plain = device_inputs(q_shape, k_shape)
    numbaflash.flash_attention_backward(plain["dout"], plain["q"], plain["k"], plain["v"], plain["out"],
                                        plain["lse"], causal=True)
    before = list(FakeLauncher.launches)
    FakeLauncher.launches.clear()
    x = device_inputs(q_shape, k_shape)
    sink = sink_array((8,))
    found = numbaflash.flash_attention_backward(x["dout"], x["q"], x["k"], x["v"], x["out"], x["lse"],
                                                causal=True, learnable_sink=sink)
    assert len(found) == 4 and found[3] is zeroed[-1][0] and zeroed[-1][1] == 8
    prep, main, dq = FakeLauncher.launches
    assert [launch[0] for launch in (prep, main, dq)] == list(families.BACKWARD_OPERATIONS)
    assert prep[1:5] == before[0][1:5] and main[1:5] == before[1][1:5]
    assert len(prep[5]) == len(before[0][5]) + 2
    assert prep[5][-2:] == ((_pointer(sink), 8), (_pointer(found[3]), 8))
    config = configs.backward_config(capability, 64, True)
    sink_prep = backward.call_specs(families.spec_of(config, "backward", causal=True), True)[0]
    assert kernel_abi(sink_prep)[-2:] == ("array(float32, 1d, C)",) * 2
    assert prep[5][3][1] == workspace_layout(3, 8, 200, 64, config.block_m).row_elements  # D, as plain
    # the sink call's kernels are loaded once: a second call is one lookup
    loads = len(fake_gpu.loads)
    numbaflash.flash_attention_backward(x["dout"], x["q"], x["k"], x["v"], x["out"], x["lse"], causal=True,
                                        learnable_sink=sink)
    assert len(fake_gpu.loads) == loads


def test_a_varlen_sink_backward_passes_the_sink_last(fake_gpu, zeroed, monkeypatch):  # noqa: F811
    monkeypatch.setattr(varlen_backward, "empty_like", lambda ref, shape, dtype_name: FakeDeviceArray(shape))
    monkeypatch.setattr(varlen_backward, "empty_lse", lambda ref, shape: FakeDeviceArray(shape, "<f4"))
    fake_gpu.capability, fake_gpu.limit = AMPERE, configs.max_shared_bytes(AMPERE)
    q, k = FakeDeviceArray((40, 4, 64)), FakeDeviceArray((50, 2, 64))
    dout, out, v = FakeDeviceArray((40, 4, 64)), FakeDeviceArray((40, 4, 64)), FakeDeviceArray((50, 2, 64))
    lse, cu_q, cu_k, sink = FakeDeviceArray((4, 40), "<f4"), offsets(), offsets(), sink_array()
    found = numbaflash.flash_attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, 20, 25,
                                                       learnable_sink=sink)
    assert len(found) == 4 and found[3] is zeroed[-1][0]
    prep = FakeLauncher.launches[0]
    assert prep[0] == "backward_prep"
    assert prep[5][-5:] == ((_pointer(cu_q), 3), (_pointer(cu_k), 3), 40, (_pointer(sink), 4),
                            (_pointer(found[3]), 4))
    config = configs.backward_config(AMPERE, 64, False)
    assert prep[5][3][1] == varlen_workspace_layout(40, 2, 4, 64, config.block_m).row_elements


# ------------------------------------------------------------------ autograd


def _reference_sink_ops(monkeypatch):
    """The torch ops' implementations replaced by ``tools.reference`` (float64, on the CPU);
    returns what reached the backward."""
    torch = pytest.importorskip("torch")
    from numbaflash import torch_ops

    seen = []

    def forward(q, k, v, causal, softmax_scale, window_size=(-1, -1), softcap=0.0, learnable_sink=None):
        out, lse = reference.attention_reference(
            q.detach().numpy(), k.detach().numpy(), v.detach().numpy(), causal=causal,
            softmax_scale=softmax_scale,
            window_size=window_size, softcap=softcap,
            sink=None if learnable_sink is None else learnable_sink.detach().numpy())
        return torch.from_numpy(out).to(q.dtype), torch.from_numpy(lse).float()

    def backward(dout, q, k, v, out, lse, causal, softmax_scale, deterministic, window_size=(-1, -1),
                 softcap=0.0, learnable_sink=None):
        seen.append(learnable_sink is not None)
        sink = None if learnable_sink is None else learnable_sink.numpy()
        grads = reference.attention_backward_reference(
            q.numpy(), k.numpy(), v.numpy(), dout.numpy(), causal=causal, softmax_scale=softmax_scale,
            window_size=window_size, softcap=softcap, sink=sink)
        found = [torch.from_numpy(g).to(x.dtype) for g, x in zip(grads[:3], (q, k, v), strict=True)]
        return (*found, torch.from_numpy(grads[3]).float()) if sink is not None else tuple(found)

    monkeypatch.setattr(torch_ops, "run_forward", forward)
    monkeypatch.setattr(torch_ops, "run_backward", backward)
    return torch, seen


def _formula(torch, q, k, v, sink, causal, scale):
    """Attention with a sink in float64 torch (autograd's ground truth): the sink as one more
    column of the scores, dropped after the softmax."""
    b, sq, hq, _ = q.shape
    sk, group = k.shape[1], hq // k.shape[2]
    qf = q.double().transpose(1, 2)
    kf = k.double().repeat_interleave(group, dim=2).transpose(1, 2)
    vf = v.double().repeat_interleave(group, dim=2).transpose(1, 2)
    s = qf @ kf.transpose(-1, -2) * scale
    if causal:
        i = torch.arange(sq)[:, None]
        j = torch.arange(sk)[None, :]
        s = s.masked_fill(j > i + sk - sq, -math.inf)
    column = sink.double()[None, :, None, None].expand(b, hq, sq, 1)
    p = torch.softmax(torch.cat([s, column], dim=-1), dim=-1)[..., :sk]
    return (p @ vf).transpose(1, 2)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sink_only", [False, True])
def test_autograd_gives_the_sink_its_gradient(monkeypatch, causal, sink_only):
    """The forward op saves the sink; its autograd runs the sink backward op, whose d_sink is the
    sink's gradient (also when only the sink requires grad); q, k, v's match float64 autograd."""
    torch, seen = _reference_sink_ops(monkeypatch)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn((2, 12, 4, 32), generator=gen, dtype=torch.float64)  # seqlen_q > seqlen_k: no-key rows
    k = torch.randn((2, 9, 2, 32), generator=gen, dtype=torch.float64)
    v = torch.randn((2, 9, 2, 32), generator=gen, dtype=torch.float64)
    q, k, v = (x.half().requires_grad_(not sink_only) for x in (q, k, v))
    sink = torch.randn(4, generator=gen).requires_grad_()
    out = numbaflash.flash_attention(q, k, v, causal=causal, learnable_sink=sink)
    dout = torch.randn(out.shape, generator=gen).half()
    out.backward(dout)
    assert seen == [True]
    leaves = [x.detach().requires_grad_() for x in (q, k, v, sink)]
    _formula(torch, *leaves, causal, 1 / math.sqrt(32)).backward(dout.double())
    assert torch.allclose(sink.grad.double(), leaves[3].grad.double(), rtol=1e-3, atol=1e-3)
    assert sink.grad.dtype == torch.float32 and sink.grad.shape == (4,)
    if not sink_only:
        for x, ref in zip((q, k, v), leaves[:3], strict=True):
            assert torch.allclose(x.grad.double(), ref.grad.double(), rtol=2e-2, atol=2e-2)


def test_a_sink_that_needs_no_grad_gets_none(monkeypatch):
    torch, seen = _reference_sink_ops(monkeypatch)
    q = torch.randn((1, 8, 4, 32)).half().requires_grad_()
    k = torch.randn((1, 8, 2, 32)).half()
    sink = torch.zeros(4)
    out = numbaflash.flash_attention(q, k, k, learnable_sink=sink)
    out.sum().backward()
    assert seen == [True] and sink.grad is None and q.grad is not None


def test_the_sink_backward_ops_are_registered_with_their_schemas():
    torch = pytest.importorskip("torch")
    import numbaflash.torch_ops  # noqa: F401  (registers the ops)

    dense = torch.ops.numbaflash.flash_attention_sink_backward.default
    assert str(dense._schema) == (
        "numbaflash::flash_attention_sink_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, "
        "Tensor lse, Tensor learnable_sink, bool causal, float softmax_scale, bool deterministic, "
        "SymInt window_left, SymInt window_right, float softcap) -> (Tensor, Tensor, Tensor, Tensor)")
    packed = torch.ops.numbaflash.flash_attention_varlen_sink_backward.default
    assert "Tensor learnable_sink, Tensor cu_seqlens_q" in str(packed._schema)
    assert not dense._schema.is_mutable and not packed._schema.is_mutable
    # the sinkless ops' schemas are as they were
    assert str(torch.ops.numbaflash.flash_attention_backward.default._schema).endswith(
        "float softcap=0.) -> (Tensor, Tensor, Tensor)")


def test_the_sink_backward_op_passes_opcheck(monkeypatch):
    """torch.library.opcheck (schema, fake kernel against the real outputs, AOT dispatch) on the
    sink backward op, with the float64 stand-in as its implementation."""
    torch, _ = _reference_sink_ops(monkeypatch)
    from numbaflash import torch_ops

    q = torch.randn((1, 10, 4, 32)).half()
    k = torch.randn((1, 7, 2, 32)).half()
    sink = torch.randn(4)
    out, lse = torch_ops.run_forward(q, k, k, True, 0.2, learnable_sink=sink)
    dout = torch.randn(out.shape).half()
    torch.library.opcheck(torch.ops.numbaflash.flash_attention_sink_backward.default,
                          (dout, q, k, k, out, lse, sink, True, 0.2, False, -1, -1, 0.0))


def test_the_fake_sink_backward_checks_the_sink():
    torch = pytest.importorskip("torch")
    from torch._subclasses.fake_tensor import FakeTensorMode

    import numbaflash.torch_ops  # noqa: F401

    with FakeTensorMode():
        q = torch.empty((1, 8, 4, 64), dtype=torch.float16, device="cuda")
        k = torch.empty((1, 8, 2, 64), dtype=torch.float16, device="cuda")
        lse = torch.empty((1, 4, 8), device="cuda")
        op = torch.ops.numbaflash.flash_attention_sink_backward
        flags = (False, 0.1, False, -1, -1, 0.0)
        dq, dk, dv, d_sink = op(q, q, k, k, q, lse, torch.empty(4, device="cuda"), *flags)
        assert (dq.shape, dk.shape, d_sink.shape, d_sink.dtype) == (q.shape, k.shape, (4,), torch.float32)
        with pytest.raises(ValueError, match=r"learnable_sink must have shape \(4,\) and dtype torch.float"):
            op(q, q, k, k, q, lse, torch.empty(3, device="cuda"), *flags)
