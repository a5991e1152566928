"""The PyTorch integration on the CPU (``numbaflash/torch_ops.py``): op registration, fake
kernels, the routing of ``flash_attention``, autograd wiring, opcheck and torch.compile.

The ops' implementations are replaced by float64 references (``tests/_torch_attention.py``), so
every test is real without a GPU: what is checked is the wiring around the kernels (what is
saved, what reaches the backward, shapes, routing, tracing). ``tests/test_torch_op_gpu.py``
runs the same on the kernels.
"""

from __future__ import annotations

import logging
import math
import subprocess
import sys
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the torch-op tests need it")

import numbaflash  # noqa: E402
from numbaflash import api, operands, torch_ops  # noqa: E402
from tests._torch_attention import (  # noqa: E402
    Block,
    attention_formula,
    reference_backward,
    reference_forward,
)

EPS = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


@pytest.fixture
def reference_ops(monkeypatch):
    """The ops run float64 references on the CPU; ``calls`` records what reached each."""
    calls = {"forward": [], "backward": []}

    def forward(q, k, v, causal, softmax_scale):
        calls["forward"].append((causal, softmax_scale))
        return reference_forward(q, k, v, causal, softmax_scale)

    def backward(dout, q, k, v, out, lse, causal, softmax_scale, deterministic):
        calls["backward"].append((causal, softmax_scale, deterministic))
        return reference_backward(dout, q, k, v, out, lse, causal, softmax_scale, deterministic)

    monkeypatch.setattr(torch_ops, "run_forward", forward)
    monkeypatch.setattr(torch_ops, "run_backward", backward)
    return calls


def leaves(shape_q, shape_k, dtype=torch.float16, seed=0, requires_grad=True):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(s, generator=gen).to(dtype).requires_grad_(requires_grad)
                 for s in (shape_q, shape_k, shape_k))


def test_import_numbaflash_does_not_import_torch():
    """Neither the import nor a numpy or array-interface call (rejected by validation here,
    where there is no GPU) imports torch: the torch check is a type lookup."""
    code = (
        "import sys, numpy as np, numbaflash\n"
        "class Cai:\n"
        "    __cuda_array_interface__ = {'shape': (1, 8, 2, 264), 'typestr': '<f2', 'data': (1 << 30, False),"
        " 'strides': None, 'version': 3}\n"
        "for x in (np.zeros((1, 8, 2, 264), np.float16), Cai()):\n"
        "    try:\n"
        "        numbaflash.flash_attention(x, x, x)\n"
        "    except ValueError as e:\n"
        "        assert 'head_dim must be one of' in str(e), e\n"
        "print('torch' in sys.modules, 'numbaflash.torch_ops' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False"]


def test_ops_are_registered_with_their_schemas():
    fwd = torch.ops.numbaflash.flash_attention_forward.default
    bwd = torch.ops.numbaflash.flash_attention_backward.default
    assert str(fwd._schema) == (
        "numbaflash::flash_attention_forward(Tensor q, Tensor k, Tensor v, bool causal, "
        "float softmax_scale, SymInt window_left=-1, SymInt window_right=-1, float softcap=0., "
        "Tensor? learnable_sink=None) -> (Tensor, Tensor)")
    assert str(bwd._schema) == (
        "numbaflash::flash_attention_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, "
        "Tensor lse, bool causal, float softmax_scale, bool deterministic, SymInt window_left=-1, "
        "SymInt window_right=-1, float softcap=0.) -> (Tensor, Tensor, Tensor)")
    assert not fwd._schema.is_mutable and not bwd._schema.is_mutable


SHAPES = [  # (shape_q, shape_k): MHA, GQA 8:1, MQA, seqlen_q > seqlen_k, seqlen_q < seqlen_k
    ((2, 128, 4, 64), (2, 128, 4, 64)),
    ((2, 300, 16, 128), (2, 260, 2, 128)),
    ((1, 77, 8, 32), (1, 1000, 1, 32)),
    ((3, 513, 6, 96), (3, 64, 3, 96)),
    ((1, 5, 2, 256), (1, 9, 1, 256)),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape_q, shape_k", SHAPES, ids=str)
def test_fake_kernels_give_shapes_dtypes_and_devices(shape_q, shape_k, dtype):
    """Under FakeTensorMode (fake CUDA tensors: no GPU needed), through ``flash_attention``
    and the ops themselves, and on meta tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    b, sq, hq, _ = shape_q
    with FakeTensorMode():
        q = torch.empty(shape_q, dtype=dtype, device="cuda")
        k, v = (torch.empty(shape_k, dtype=dtype, device="cuda") for _ in range(2))
        for causal in (False, True):
            out, lse = numbaflash.flash_attention(q, k, v, causal=causal, return_lse=True)
            assert (out.shape, out.dtype, out.device.type, out.stride()) == (q.shape, dtype, "cuda",
                                                                              q.contiguous().stride())
            assert (tuple(lse.shape), lse.dtype, lse.device.type, lse.is_contiguous()) == (
                (b, hq, sq), torch.float32, "cuda", True)
            assert numbaflash.flash_attention(q, k, v, causal=causal).shape == q.shape
        dq, dk, dv = torch.ops.numbaflash.flash_attention_backward(out, q, k, v, out, lse, True, 0.1, False)
        assert [(g.shape, g.dtype, g.is_contiguous()) for g in (dq, dk, dv)] == [
            (x.shape, dtype, True) for x in (q, k, v)]
    q, k, v = (torch.empty(s, dtype=dtype, device="meta") for s in (shape_q, shape_k, shape_k))
    out, lse = numbaflash.flash_attention(q, k, v, return_lse=True)
    assert (out.device.type, out.shape, tuple(lse.shape), lse.dtype) == ("meta", q.shape, (b, hq, sq),
                                                                         torch.float32)


@pytest.mark.parametrize("shape_q, shape_k, dtype, error, message", [
    ((1, 8, 4, 64), (1, 8, 3, 64), torch.float16, ValueError, r"heads of q \(4\) must be a multiple"),
    ((1, 8, 4, 264), (1, 8, 2, 264), torch.float16, ValueError,
     r"^head_dim must be one of \(32, 64, 96, 128, 256\), got 264 \("),
    ((1, 8, 4, 64), (2, 8, 2, 64), torch.bfloat16, ValueError, "same batch size"),
    ((1, 8, 4, 64), (1, 8, 2, 64), torch.float32, TypeError,
     "^q must be float16 or bfloat16, got torch.float32$"),
    ((8, 4, 64), (1, 8, 2, 64), torch.float16, ValueError, "4 dimensions"),
])
def test_fake_kernels_reject_what_the_eager_api_rejects(shape_q, shape_k, dtype, error, message):
    """The routing and the fake kernel run the eager API's checks, with its messages."""
    q = torch.empty(shape_q, dtype=dtype, device="meta")
    k = torch.empty(shape_k, dtype=dtype, device="meta")
    with pytest.raises(error, match=message):
        numbaflash.flash_attention(q, k, k)
    with pytest.raises(error, match=message):
        torch.ops.numbaflash.flash_attention_forward(q, k, k, False, 0.125)


def test_fake_backward_checks_dout_out_and_lse():
    q, k = torch.empty(1, 8, 4, 64, dtype=torch.float16, device="meta"), \
        torch.empty(1, 9, 2, 64, dtype=torch.float16, device="meta")
    lse = torch.empty(1, 4, 8, device="meta")
    bwd = torch.ops.numbaflash.flash_attention_backward
    with pytest.raises(ValueError, match=r"dout must have shape \(1, 8, 4, 64\)"):
        bwd(q[:, :4], q, k, k, q, lse, False, 0.1, False)
    with pytest.raises(ValueError, match=r"lse must have shape \(1, 4, 8\) and dtype torch.float32"):
        bwd(q, q, k, k, q, lse.half(), False, 0.1, False)


def test_calls_with_no_autograd_take_the_direct_path(reference_ops):
    """Eager calls that need no gradient never reach the op (no dispatch cost): here the direct
    path rejects CPU tensors, as before; the op's implementation was not called."""
    q, k, v = leaves((1, 8, 4, 64), (1, 8, 2, 64), requires_grad=False)
    with pytest.raises(TypeError, match="torch tensors must be on a CUDA device"):
        numbaflash.flash_attention(q, k, v)
    q.requires_grad_(True)
    for context in (torch.no_grad, torch.inference_mode):
        with context(), pytest.raises(TypeError, match="torch tensors must be on a CUDA device"):
            numbaflash.flash_attention(q, k, v)
    assert reference_ops["forward"] == []


CASES = [  # (shape_q, shape_k, causal, softmax_scale)
    ((2, 33, 4, 64), (2, 33, 4, 64), False, None),
    ((1, 40, 8, 32), (1, 17, 1, 32), True, None),  # MQA, rows that see no key
    ((2, 19, 6, 64), (2, 50, 2, 64), True, 0.3),  # GQA, seqlen_q < seqlen_k
    ((1, 24, 4, 128), (1, 24, 2, 128), False, 0.05),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape_q, shape_k, causal, softmax_scale", CASES, ids=str)
def test_gradients_match_float64_formula(reference_ops, shape_q, shape_k, causal, softmax_scale, dtype):
    """``flash_attention`` is differentiable: its out, LSE and the gradients of q, k, v (the
    backward fed the saved out and LSE) match torch autograd of the plain formula in float64."""
    q, k, v = leaves(shape_q, shape_k, dtype)
    out, lse = numbaflash.flash_attention(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                          return_lse=True)
    assert out.grad_fn is not None and not lse.requires_grad
    gen = torch.Generator().manual_seed(1)
    dout = torch.randn(out.shape, generator=gen).to(dtype)
    out.backward(dout)
    scale = 1 / math.sqrt(shape_q[-1]) if softmax_scale is None else softmax_scale
    assert reference_ops["forward"] == [(causal, scale)]
    assert reference_ops["backward"] == [(causal, scale, False)]

    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref, ref_lse = attention_formula(q64, k64, v64, causal, softmax_scale)
    ref.backward(dout.double())
    ref, ref_lse = ref.detach(), ref_lse.detach()
    eps = EPS[dtype]
    torch.testing.assert_close(out.double(), ref, atol=2 * eps * float(ref.abs().max()), rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-6)
    for name, got, want in (("dq", q.grad, q64.grad), ("dk", k.grad, k64.grad), ("dv", v.grad, v64.grad)):
        assert got.dtype == dtype and got.shape == want.shape, name
        torch.testing.assert_close(got.double(), want, atol=8 * eps * max(1.0, float(want.abs().max())),
                                   rtol=0, msg=name)


def test_gradient_of_a_sum_and_of_views_reaches_the_kernel_dense(reference_ops):
    """A sum's gradient is expanded (stride 0), a transposed one strided, a sliced one may sit
    at an odd offset: the backward makes each dense first (the reference asserts it)."""
    q, k, v = leaves((2, 16, 4, 64), (2, 16, 2, 64))
    numbaflash.flash_attention(q, k, v).sum().backward()
    out = numbaflash.flash_attention(q, k, v)
    out.backward(torch.randn(2, 4, 16, 64).half().transpose(1, 2))
    out = numbaflash.flash_attention(q, k, v)
    out.backward(torch.randn(out.numel() + 3).half()[3:].view(out.shape))
    assert len(reference_ops["backward"]) == 3


def test_deterministic_backward_follows_torch(reference_ops):
    q, k, v = leaves((1, 16, 2, 64), (1, 16, 2, 64))
    numbaflash.flash_attention(q, k, v).sum().backward()
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        numbaflash.flash_attention(q, k, v).sum().backward()
    finally:
        torch.use_deterministic_algorithms(previous)
    assert [call[2] for call in reference_ops["backward"]] == [False, True]


def test_out_with_autograd_is_refused(reference_ops):
    q, k, v = leaves((1, 8, 4, 64), (1, 8, 2, 64))
    with pytest.raises(RuntimeError, match=r"out= does not support automatic differentiation"):
        numbaflash.flash_attention(q, k, v, out=torch.empty_like(q))
    assert reference_ops["forward"] == []


def test_bad_flags_and_scale_rejected_on_the_op_path(reference_ops):
    q, k, v = leaves((1, 8, 4, 64), (1, 8, 2, 64))
    with pytest.raises(TypeError, match=r"causal must be a bool"):
        numbaflash.flash_attention(q, k, v, causal="no")
    with pytest.raises(ValueError, match=r"softmax_scale must be a positive finite number"):
        numbaflash.flash_attention(q, k, v, softmax_scale=-1.0)
    assert reference_ops["forward"] == []


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape_q, shape_k, causal, softmax_scale", CASES[1:3], ids=str)
def test_opcheck(reference_ops, shape_q, shape_k, causal, softmax_scale, dtype):
    """torch.library.opcheck (schema, autograd registration, fake kernel against the real
    outputs' shapes and strides, AOT dispatch with dynamic shapes) on both ops."""
    q, k, v = leaves(shape_q, shape_k, dtype)
    scale = softmax_scale or 1 / math.sqrt(shape_q[-1])
    torch.library.opcheck(torch.ops.numbaflash.flash_attention_forward.default, (q, k, v, causal, scale))
    out, lse = reference_forward(q, k, v, causal, scale)
    dout = torch.randn(out.shape).to(dtype)
    torch.library.opcheck(torch.ops.numbaflash.flash_attention_backward.default,
                          (dout, q.detach(), k.detach(), v.detach(), out, lse, causal, scale, False))


def _first_torch_call_is_traced(monkeypatch):
    """Forget that torch tensors were seen, so that torch.compile traces the first call
    (the type lookup's miss and the import of ``torch_route``)."""
    monkeypatch.setattr(api, "_TORCH_ROUTE", [])
    monkeypatch.setattr(operands, "_KINDS", {np.ndarray: "numpy"})
    torch._dynamo.reset()


def test_compiled_block_has_no_graph_break_no_warning_and_trains(reference_ops, monkeypatch, caplog):
    """torch.compile(fullgraph=True) of a transformer block that calls flash_attention: one
    graph, no break, no Python warning and no torch log warning; the compiled block gives the
    eager block's output, and a few AdamW steps lower the loss."""
    import torch._functorch.aot_autograd  # noqa: F401  (torch's own import-time warnings)

    _first_torch_call_is_traced(monkeypatch)
    torch.manual_seed(0)
    block = Block(dim=128, heads=4, kv_heads=2)
    x = torch.randn(2, 24, 128, dtype=torch.bfloat16)
    target = torch.randn(2, 24, 128, dtype=torch.bfloat16)
    explained = torch._dynamo.explain(block)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    optimizer = torch.optim.AdamW(block.parameters(), lr=3e-3)
    losses = []
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        torch.testing.assert_close(compiled(x), block(x), atol=0, rtol=0)
        for _ in range(6):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(compiled(x).float(), target.float())
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    assert not [str(w.message) for w in caught]
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert losses[-1] < 0.9 * losses[0], losses
    assert len(reference_ops["backward"]) == 6


def test_compile_dynamic_shapes_lse_and_out(reference_ops, monkeypatch):
    """dynamic=True over two shapes with the LSE returned; and without autograd, out= in a
    compiled function gets the result."""
    _first_torch_call_is_traced(monkeypatch)

    def loss_of(q, k, v):
        out, lse = numbaflash.flash_attention(q, k, v, causal=True, return_lse=True)
        return out.float().square().sum() + torch.nan_to_num(lse, neginf=0.0).sum()

    compiled = torch.compile(loss_of, backend="aot_eager", fullgraph=True, dynamic=True)
    for shape_q, shape_k in (((2, 20, 4, 64), (2, 11, 2, 64)), ((1, 9, 4, 64), (1, 30, 2, 64))):
        q, k, v = leaves(shape_q, shape_k)
        compiled(q, k, v).backward()
        grads = [x.grad for x in (q, k, v)]
        for x in (q, k, v):
            x.grad = None
        loss_of(q, k, v).backward()
        for got, x in zip(grads, (q, k, v), strict=True):
            torch.testing.assert_close(got, x.grad, atol=0, rtol=0)

    def into(q, k, v, out):
        return numbaflash.flash_attention(q, k, v, softmax_scale=0.2, out=out)

    q, k, v = leaves((1, 12, 4, 32), (1, 12, 4, 32), requires_grad=False)
    out = torch.zeros_like(q)
    assert torch.compile(into, backend="aot_eager", fullgraph=True)(q, k, v, out) is out
    torch.testing.assert_close(out, reference_forward(q, k, v, False, 0.2)[0], atol=0, rtol=0)


def test_eager_autograd_skips_the_op_and_compiled_or_traced_calls_keep_it(reference_ops, monkeypatch):
    """An eager call that needs grad runs ``torch_ops.EagerAttention`` (the op's implementation and
    formula, without a custom op's dispatch); under a dispatch mode and a torch.func transform the
    op runs as before, with the same gradients."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from numbaflash import torch_route

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    q, k, v = leaves((1, 12, 4, 64), (1, 12, 2, 64))
    dout = torch.randn(1, 12, 4, 64, generator=torch.Generator().manual_seed(3)).half()
    out = numbaflash.flash_attention(q, k, v, causal=True)
    assert type(out.grad_fn).__name__ == "EagerAttentionBackward"
    eager = torch.autograd.grad(out, (q, k, v), dout)
    with Passthrough():
        out = numbaflash.flash_attention(q, k, v, causal=True)
    assert "numbaflash" in out.grad_fn.name()
    for got, want in zip(torch.autograd.grad(out, (q, k, v), dout), eager, strict=True):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    for rule in ("_functorch_active", "_jit_tracing"):
        with monkeypatch.context() as patch:
            patch.setattr(torch_route, rule, lambda: True)
            out = numbaflash.flash_attention(q, k, v, causal=True)
        assert "numbaflash" in out.grad_fn.name(), rule
    # meta tensors that require grad (a model on the meta device) keep the op and its fake kernel
    qm, km, vm = (x.detach().to("meta").requires_grad_() for x in (q, k, v))
    out = numbaflash.flash_attention(qm, km, vm, causal=True)
    assert out.is_meta and out.shape == q.shape and "numbaflash" in out.grad_fn.name()
    # the LSE gets no materialised zero gradient
    out, lse = numbaflash.flash_attention(q, k, v, causal=True, return_lse=True)
    assert not lse.requires_grad
    (out.float().sum() + lse.sum()).backward()
    assert len(reference_ops["backward"]) == 3


def test_attention_autograd_reuses_routes_checks_only(reference_ops, monkeypatch):
    """``torch_route.attention_autograd`` (the transformers integration's training call) runs
    ``EagerAttention`` with the scalars ``route`` checked for the same given values and head dims:
    None before route has seen them, for a call that needs no grad and under a dispatch mode or
    torch.func; after, the same out and gradients as ``flash_attention``, bit for bit, with the
    scale route computed (the default 1/sqrt(head_dim))."""
    from numbaflash import torch_route

    monkeypatch.setattr(torch_route, "_CHECKED", {})
    q, k, v = leaves((1, 12, 4, 64), (1, 12, 2, 64), seed=5)
    dout = torch.randn(1, 12, 4, 64, generator=torch.Generator().manual_seed(6)).half()
    options = (True, None, (-1, -1), 0.0)
    assert torch_route.attention_autograd(q, k, v, *options) is None  # not seen: the caller routes it
    want = numbaflash.flash_attention(q, k, v, causal=True)
    grads = torch.autograd.grad(want, (q, k, v), dout)
    got = torch_route.attention_autograd(q, k, v, *options)
    assert type(got.grad_fn).__name__ == "EagerAttentionBackward"
    assert reference_ops["forward"][-1] == (True, 1 / math.sqrt(64))
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), dout), grads, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert torch_route.attention_autograd(q, k, v, True, None, (-1, -1), 1.0) is None  # other softcap
    assert torch_route.attention_autograd(q[..., :32], k[..., :32], v[..., :32], *options) is None
    with torch.no_grad():
        assert torch_route.attention_autograd(q, k, v, *options) is None
    for rule in ("_functorch_active", "_jit_tracing"):
        with monkeypatch.context() as patch:
            patch.setattr(torch_route, rule, lambda: True)
            assert torch_route.attention_autograd(q, k, v, *options) is None, rule
    # route keeps no entry for a window given as a list (unhashable; the integration gives tuples)
    before = dict(torch_route._CHECKED)
    numbaflash.flash_attention(q, k, v, causal=True, window_size=[-1, -1])
    assert torch_route._CHECKED == before


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_activation_checkpointing_gives_the_same_gradients(reference_ops, reentrant, monkeypatch):
    """``torch.utils.checkpoint`` (as transformers' gradient checkpointing) recomputes the forward
    in the backward: the gradients equal those of the plain call, bit for bit. (The reentrant
    kind's first forward runs without grad, on the direct path: here the reference too.)"""
    from torch.utils.checkpoint import checkpoint

    def direct(q, k, v, causal, softmax_scale, *rest):
        scale = 1 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
        reference_ops["forward"].append((causal, scale))
        return reference_forward(q, k, v, causal, scale)[0]

    monkeypatch.setattr(api, "direct_flash_attention", direct)

    q, k, v = leaves((2, 20, 4, 64), (2, 20, 2, 64))
    dout = torch.randn(2, 20, 4, 64, generator=torch.Generator().manual_seed(5)).half()
    plain = torch.autograd.grad(numbaflash.flash_attention(q, k, v, causal=True), (q, k, v), dout)
    out = checkpoint(lambda a, b, c: numbaflash.flash_attention(a, b, c, causal=True) * 1, q, k, v,
                     use_reentrant=reentrant)
    out.backward(dout)  # (reentrant checkpoints refuse autograd.grad)
    for got, want in zip((q.grad, k.grad, v.grad), plain, strict=True):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert len(reference_ops["forward"]) == 3  # the plain call, the checkpointed one, its recompute


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "varlen"])
def test_backward_formulas_unpack_saved_tensors_once(packed, monkeypatch):
    """Non-reentrant activation checkpointing recomputes the forward when ``ctx.saved_tensors`` is
    unpacked and refuses a second unpack (``CheckpointError``): found on the H200 with gpt-oss's
    learnable sinks, whose formula read the sink in a second unpack. Each formula unpacks once,
    with a sink and without."""
    q, k, v = leaves((1, 8, 2, 64), (1, 8, 2, 64), requires_grad=False)
    out, lse, sink = torch.zeros_like(q), torch.zeros(1, 2, 8), torch.zeros(2)
    cu = torch.tensor([0, 8], dtype=torch.int32)

    def fake_backward(dout, q, k, v, *rest):
        grads = (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v))
        return (*grads, torch.zeros(2)) if isinstance(rest[-1], torch.Tensor) else grads

    monkeypatch.setattr(torch_ops, "run_backward", fake_backward)
    monkeypatch.setattr(torch_ops, "run_varlen_backward", fake_backward)

    class Ctx:
        def __init__(self, saved):
            self._saved, self.unpacks = saved, 0

        @property
        def saved_tensors(self):
            self.unpacks += 1
            return self._saved

    for with_sink in (False, True):
        extra = (sink,) if with_sink else ()
        if packed:
            ctx = Ctx((q[0], k[0], v[0], out[0], lse[0], cu, cu, *extra))
            ctx.max_seqlen_q = ctx.max_seqlen_k = 8
            formula, dout = torch_ops._varlen_backward, out[0]
        else:
            ctx = Ctx((q, k, v, out, lse, *extra))
            formula, dout = torch_ops._backward, out
        ctx.has_sink, ctx.causal, ctx.softmax_scale, ctx.deterministic = with_sink, True, 0.125, False
        ctx.window_size, ctx.softcap, ctx.needs_input_grad = (-1, -1), 0.0, (True,) * 13
        with torch.no_grad():  # the eager formula: the implementations, here the fakes
            grads = formula(ctx, dout, None)
        assert ctx.unpacks == 1, (with_sink, ctx.unpacks)
        assert (grads[-1] is not None) == with_sink
