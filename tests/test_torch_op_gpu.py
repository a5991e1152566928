"""The PyTorch integration on the GPU: ``flash_attention`` on torch CUDA tensors through the
custom ops (``numbaflash/torch_ops.py``) with the real kernels (the mma.sync backward on every
GPU): opcheck, gradients against float64 by FlashAttention's rule, torch.compile(fullgraph=True)
training of a transformer block, and forward + backward captured in one CUDA graph.

Run on a GPU machine with PyTorch (CUDA build) installed:
``NUMBAFLASH_REQUIRE_GPU=1 python -m pytest -q tests/test_torch_op_gpu.py``.
"""

from __future__ import annotations

import logging
import math
import warnings

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the torch-op tests need it")

import numbaflash  # noqa: E402
import numbaflash.torch_ops  # noqa: E402,F401  (registers torch.ops.numbaflash.*, as a first torch call would)
from tests._torch_attention import Block, attention_formula  # noqa: E402

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
# Rounding unit of each dtype: the floor of the error criterion (as tools/reference.py's).
FLOOR_EXP = {torch.float16: 11, torch.bfloat16: 8}


@pytest.fixture
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("PyTorch without CUDA: the torch-op GPU tests need a CUDA build of torch")
    return torch.device("cuda")


def random_leaves(shape_q, shape_k, dtype, seed, magnitude=1.0, requires_grad=True):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return tuple((magnitude * torch.randn(s, device="cuda", generator=gen)).to(dtype)
                 .requires_grad_(requires_grad) for s in (shape_q, shape_k, shape_k))


def skip_if_no_backward_tile(head_dim: int) -> None:
    """head_dim 256's backward tile needs 128 KB of shared memory a CTA (sm_80, sm_90 have it;
    sm_86, sm_89, sm_120 give 99 KB: flash_attention_backward refuses with RuntimeError)."""
    optin = getattr(torch.cuda.get_device_properties(0), "shared_memory_per_block_optin", None)
    if head_dim == 256 and optin is not None and optin < 128 * 1024:
        pytest.skip(f"head_dim 256 backward needs 128 KB of shared memory a CTA; this GPU gives {optin}")


# opcheck ------------------------------------------------------------------------------------------

OPCHECK_CASES = [  # (shape_q, shape_k, causal)
    ((2, 128, 4, 64), (2, 128, 4, 64), False),
    ((2, 300, 8, 128), (2, 260, 2, 128), True),  # GQA 4:1, ragged, seqlen_q > seqlen_k
    ((1, 77, 8, 32), (1, 200, 1, 32), True),  # MQA, seqlen_q < seqlen_k
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape_q, shape_k, causal", OPCHECK_CASES, ids=str)
def test_opcheck(cuda, shape_q, shape_k, causal, dtype):
    """torch.library.opcheck on both ops with the kernels: schema, autograd registration, the
    fake kernels against the real outputs (shapes, strides, dtypes) and AOT dispatch with
    dynamic shapes (eager against AOT-traced, forward and, for the forward op, its backward).
    dQ is summed with float32 atomics in no fixed order, so two runs of the backward may differ
    in the last bit: the comparisons allow that."""
    dt = DTYPES[dtype]
    q, k, v = random_leaves(shape_q, shape_k, dt, seed=1)
    scale = 1 / math.sqrt(shape_q[-1])
    tol = {"atol": 1e-3, "rtol": 2e-2}
    torch.library.opcheck(torch.ops.numbaflash.flash_attention_forward.default, (q, k, v, causal, scale),
                          **tol)
    with torch.no_grad():
        out, lse = torch.ops.numbaflash.flash_attention_forward(q, k, v, causal, scale)
    dout = torch.randn_like(out)
    torch.library.opcheck(torch.ops.numbaflash.flash_attention_backward.default,
                          (dout, q.detach(), k.detach(), v.detach(), out, lse, causal, scale, False), **tol)


# gradients against float64 ------------------------------------------------------------------------

def check_gradients(shape_q, shape_k, dtype, causal, seed, magnitude=1.0, softmax_scale=None):
    """FlashAttention's rule for each of dq, dk, dv: the error against float64 (torch autograd
    of the plain formula) is at most twice the error of the same formula computed in the
    input dtype, plus a floor of a quarter of the dtype's rounding unit (times the largest
    gradient, at least 1); no NaN; rows that see no key get dq exactly 0. The forward's out
    and LSE, through the op, equal the direct path's bit for bit."""
    q, k, v = random_leaves(shape_q, shape_k, dtype, seed, magnitude)
    out, lse = numbaflash.flash_attention(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                          return_lse=True)
    assert out.grad_fn is not None and not lse.requires_grad
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    dout = torch.randn(out.shape, device="cuda", generator=gen).to(dtype)
    out.backward(dout)
    with torch.no_grad():
        direct, direct_lse = numbaflash.flash_attention(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                                        return_lse=True)
    assert torch.equal(out, direct) and torch.equal(lse, direct_lse)

    def formula_grads(compute_dtype):
        leaves = [x.detach().to(compute_dtype).requires_grad_() for x in (q, k, v)]
        ref, _ = attention_formula(*leaves, causal, softmax_scale, dtype=compute_dtype)
        ref.backward(dout.to(compute_dtype))
        return [x.grad for x in leaves]

    exact, low = formula_grads(torch.float64), formula_grads(dtype)
    problems = []
    for name, got, want, rough in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), exact, low, strict=True):
        assert got.shape == want.shape and got.dtype == dtype, name
        if torch.isnan(got).any():
            problems.append(f"{name}: NaN")
            continue
        err = (got.double() - want).abs().max().item()
        err_low = (rough.double() - want).abs().max().item()
        floor = 2.0 ** -FLOOR_EXP[dtype] * max(1.0, want.abs().max().item()) / 4
        if not err <= 2 * err_low + floor:
            problems.append(f"{name}: max error {err:.3e} > 2 x {err_low:.3e} + {floor:.1e}")
    sq, sk = shape_q[1], shape_k[1]
    if causal and sq > sk and not (q.grad[:, : sq - sk] == 0).all():
        problems.append("dq of rows that see no key is not 0")
    assert not problems, problems


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 256])
def test_gradients_every_head_dim(cuda, head_dim, causal, dtype):
    skip_if_no_backward_tile(head_dim)
    check_gradients((2, 237, 4, head_dim), (2, 301, 2, head_dim), DTYPES[dtype], causal, seed=head_dim)


SPECIAL = {  # name: (shape_q, shape_k, causal, magnitude)
    "seqlen_q>>seqlen_k_causal": ((2, 1000, 4, 64), (2, 100, 4, 64), True, 1.0),
    "gqa_8to1": ((2, 513, 16, 128), (2, 513, 2, 128), True, 1.0),
    "mqa": ((1, 300, 8, 64), (1, 700, 1, 64), False, 1.0),
    "ragged_long": ((1, 2049, 4, 128), (1, 3001, 4, 128), True, 1.0),
    "seqlen_1": ((3, 1, 2, 64), (3, 1, 2, 64), False, 1.0),
    "large_magnitude": ((2, 256, 4, 64), (2, 256, 4, 64), False, 8.0),
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", list(SPECIAL))
def test_gradients_special_shapes(cuda, case, dtype):
    shape_q, shape_k, causal, magnitude = SPECIAL[case]
    check_gradients(shape_q, shape_k, DTYPES[dtype], causal, seed=len(case), magnitude=magnitude)


@pytest.mark.gpu
def test_gradients_with_a_softmax_scale_and_views_of_packed_qkv(cuda):
    """q, k, v as views of one packed projection (strided, as a transformer block makes them)
    and a dout that is a sum's expanded gradient; a given softmax_scale."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    qkv = torch.randn(2, 190, 12, 64, device="cuda", generator=gen).half().requires_grad_()
    q, k, v = qkv.split([8, 2, 2], dim=2)
    out = numbaflash.flash_attention(q, k, v, causal=True, softmax_scale=0.2)
    out.float().sum().backward()
    ref_leaf = qkv.detach().double().requires_grad_()
    rq, rk, rv = ref_leaf.split([8, 2, 2], dim=2)
    ref, _ = attention_formula(rq, rk, rv, True, 0.2)
    ref.sum().backward()
    torch.testing.assert_close(qkv.grad.double(), ref_leaf.grad, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_deterministic_backward_is_bit_identical(cuda):
    """With torch.use_deterministic_algorithms(True) at the forward, the backward runs
    deterministic=True: two runs give the same gradients bit for bit."""
    q, k, v = random_leaves((2, 700, 8, 64), (2, 900, 2, 64), torch.bfloat16, seed=5)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        grads = []
        for _ in range(3):
            out = numbaflash.flash_attention(q, k, v, causal=True)
            grads.append(torch.autograd.grad(out, (q, k, v), torch.ones_like(out)))
    finally:
        torch.use_deterministic_algorithms(previous)
    for later in grads[1:]:
        assert all(torch.equal(a, b) for a, b in zip(grads[0], later, strict=True))


# torch.compile ----------------------------------------------------------------------------------

@pytest.mark.gpu
def test_compiled_transformer_block_trains(cuda, caplog):
    """torch.compile(fullgraph=True) (inductor) of the block: one graph and no graph break
    (torch._dynamo.explain), no Python warning and no torch log warning while compiling and
    training; the compiled block matches the eager one; eight AdamW steps on a fixed batch
    lower the loss."""
    import torch._inductor.compile_fx  # noqa: F401  (torch's own import-time deprecation warnings)

    torch._dynamo.reset()
    torch.manual_seed(0)
    block = Block(dim=512, heads=8, kv_heads=2).cuda()
    x = torch.randn(4, 256, 512, device="cuda", dtype=torch.bfloat16)
    target = torch.randn_like(x)
    explained = torch._dynamo.explain(block)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True)
    optimizer = torch.optim.AdamW(block.parameters(), lr=1e-3)
    losses = []
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), block(x), atol=3e-2, rtol=3e-2)
        for _ in range(8):
            optimizer.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(compiled(x).float(), target.float())
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    assert not [f"{w.category.__name__}: {w.message}" for w in caught]
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert losses[-1] < 0.9 * losses[0], losses


# CUDA graphs and the allocator ------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True])
def test_cuda_graph_forward_and_backward(cuda, deterministic):
    """Forward and backward captured in one CUDA graph (global capture mode: a host sync or a
    cudaMalloc inside would fail the capture) with static inputs, after a warm-up on a side
    stream as torch's docs prescribe; replayed with new values copied into the static buffers,
    it gives the eager results (bit for bit with the deterministic backward; within the
    float32 atomics' reordering of dQ otherwise)."""
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    try:
        shape_q, shape_k = (2, 333, 8, 128), (2, 300, 2, 128)
        q, k, v = random_leaves(shape_q, shape_k, torch.float16, seed=11)
        dout = torch.randn(shape_q, device="cuda", dtype=torch.float16)

        def step():
            out = numbaflash.flash_attention(q, k, v, causal=True)
            out.backward(dout)
            return out

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                for x in (q, k, v):
                    x.grad = None
                step()
        torch.cuda.current_stream().wait_stream(side)
        for x in (q, k, v):
            x.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = step()
        static_grads = (q.grad, k.grad, v.grad)

        for seed in (21, 22, 23):
            new = random_leaves(shape_q, shape_k, torch.float16, seed=seed, requires_grad=False)
            with torch.no_grad():
                for x, value in zip((q, k, v), new, strict=True):
                    x.copy_(value)
                dout.copy_(torch.randn_like(dout))
            graph.replay()
            torch.cuda.synchronize()
            eager_leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
            eager_out = numbaflash.flash_attention(*eager_leaves, causal=True)
            eager_out.backward(dout)
            assert torch.equal(static_out, eager_out)
            for name, got, leaf in zip(("dq", "dk", "dv"), static_grads, eager_leaves, strict=True):
                if deterministic:
                    assert torch.equal(got, leaf.grad), name
                else:
                    torch.testing.assert_close(got, leaf.grad, atol=2e-3, rtol=2e-3, msg=name)
    finally:
        torch.use_deterministic_algorithms(previous)


@pytest.mark.gpu
@pytest.mark.parametrize("given_out", [False, True])
def test_cuda_graph_forward_without_autograd(cuda, given_out):
    """The direct path (no autograd) still captures: static q, k, v (and out), replayed with new
    values, equals eager."""
    q, k, v = random_leaves((2, 500, 8, 64), (2, 500, 8, 64), torch.bfloat16, seed=2, requires_grad=False)
    out = torch.empty_like(q) if given_out else None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            numbaflash.flash_attention(q, k, v, causal=True, out=out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = numbaflash.flash_attention(q, k, v, causal=True, out=out)
    for seed in (3, 4):
        for x, value in zip((q, k, v), random_leaves(q.shape, k.shape, q.dtype, seed, requires_grad=False),
                            strict=True):
            x.copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, numbaflash.flash_attention(q, k, v, causal=True))


@pytest.mark.gpu
def test_training_step_neither_syncs_nor_allocates_outside_torch(cuda):
    """After a warm-up, forward + backward through the op make no synchronising torch call
    (torch.cuda.set_sync_debug_mode("error")) and allocate device memory only through torch's
    caching allocator: the driver's free memory plus torch's reserved memory does not move.

    The driver's free memory is the whole GPU's, so other processes on it (pytest-xdist's
    workers) move it too: the check passes if any of three windows of 5 steps leaves it where it
    was. Memory the op kept per step would move it in every window."""
    q, k, v = random_leaves((2, 600, 8, 64), (2, 600, 2, 64), torch.float16, seed=9)
    for _ in range(2):
        numbaflash.flash_attention(q, k, v, causal=True).sum().backward()
    torch.cuda.synchronize()
    moved = []
    for _ in range(3):
        before = torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(5):
                numbaflash.flash_attention(q, k, v, causal=True).sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        moved.append(torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved() - before)
        if moved[-1] == 0:
            break
    assert 0 in moved, f"device memory outside torch's allocator moved by {moved} bytes in each window"
