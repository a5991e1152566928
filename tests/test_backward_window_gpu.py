"""The backward's sliding window and softcap (issue 35) on the GPU against the float64 numpy
backward, by FlashAttention's rule (``tools.reference.compare_gradients_with_reference``: each of
dq, dk, dv within twice the input-dtype backward's error plus one ulp; dq exactly 0 on rows that
see no key; dk, dv exactly 0 on keys no row sees).

Windows 0, 1, 127, 4096, asymmetric, one side unbounded, with and without causal, rotated over
the head dims and dtypes (the float64 reference is CPU-heavy: a few shapes a test); seqlen_q
above and below seqlen_k, ragged sizes, GQA/MQA; softcap 30 and 50 on large-magnitude inputs;
deterministic mode bit-identical twice with a window; the numpy path; torch autograd against
torch float64 autograd of the formula, and torch.compile(fullgraph=True).

Run: ``OMP_NUM_THREADS=2 NUMBAFLASH_REQUIRE_GPU=1 pytest -n 8 -m gpu tests/test_backward_window_gpu.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_backward_gpu import DTYPES, device, host, problem

import numbaflash
from numbaflash.configs import SUPPORTED_HEAD_DIMS
from numbaflash.tools.reference import attention_backward_reference, compare_gradients_with_reference

gpu = pytest.mark.gpu

# (causal, window_size, softcap), rotated over head dims x dtypes
ROTATION = [
    (False, (0, 0), 0.0),
    (True, (1, -1), 0.0),
    (False, (127, 0), 0.0),
    (False, (4096, 4096), 0.0),  # wider than the problem: the plain kernel
    (False, (5, 90), 30.0),
    (True, (-1, -1), 50.0),
    (False, (-1, 3), 0.0),
    (False, (70, -1), 50.0),
    (True, (33, 7), 0.0),
    (False, (-1, -1), 30.0),
]


def run_backward(q, k, v, dout, causal, window_size=(-1, -1), softcap=0.0, on_device=True,
                 deterministic=False, softmax_scale=None):
    """Forward (out, LSE) then backward, both with the window and softcap; (dq, dk, dv) as numpy."""
    args = [device(x) for x in (q, k, v)] if on_device else [q, k, v]
    dout_in = device(dout) if on_device else dout
    kw = {"causal": causal, "softmax_scale": softmax_scale, "window_size": window_size, "softcap": softcap}
    out, lse = numbaflash.flash_attention(*args, return_lse=True, **kw)
    grads = numbaflash.flash_attention_backward(dout_in, *args, out, lse, deterministic=deterministic, **kw)
    return tuple(host(g) for g in grads)


def check(q, k, v, dout, grads, causal, window_size=(-1, -1), softcap=0.0, softmax_scale=None):
    _, problems = compare_gradients_with_reference(q, k, v, dout, grads, causal=causal,
                                                   softmax_scale=softmax_scale, window_size=window_size,
                                                   softcap=softcap)
    assert not problems, f"causal={causal} window={window_size} softcap={softcap}: " + "; ".join(problems)


@gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
def test_every_head_dim_rotating_windows(rng, head_dim, dtype):
    """Two window/softcap cases a head dim and dtype, ragged GQA shapes, seqlen_q < and > seqlen_k."""
    i = 2 * (SUPPORTED_HEAD_DIMS.index(head_dim) * 2 + list(DTYPES).index(dtype))
    for n, (batch, sq, sk) in enumerate(((2, 137, 201), (1, 211, 130))):
        causal, window, softcap = ROTATION[(i + n) % len(ROTATION)]
        amplitude = 6.0 if softcap else 1.0
        q, k, v, dout = problem(rng, batch, sq, sk, 4, 2, head_dim, DTYPES[dtype], amplitude)
        grads = run_backward(q, k, v, dout, causal, window, softcap)
        check(q, k, v, dout, grads, causal, window, softcap)


@gpu
@pytest.mark.parametrize(
    ("shape", "causal", "window"),
    [
        ((1, 700, 150, 2, 1, 64), True, (10, 0)),  # seqlen_q >> seqlen_k: rows that see no key
        ((1, 150, 700, 2, 2, 128), False, (0, 0)),  # keys no row sees (the first 550)
        ((2, 333, 1000, 8, 1, 64), False, (127, 1)),  # MQA 8:1
        ((1, 1000, 333, 4, 2, 128), False, (1, 4096)),  # right wider than the problem
        ((1, 1, 1, 1, 1, 64), False, (0, 0)),  # length 1
        ((1, 1, 300, 2, 1, 32), False, (5, -1)),  # one query row
        ((1, 257, 257, 2, 2, 256), False, (-1, 20)),  # left unbounded
        ((1, 4200, 4300, 1, 1, 64), False, (4096, -1)),  # window 4096 inside a longer sequence
        ((1, 500, 520, 2, 1, 96), True, (200, 50)),  # causal overrides right
    ],
)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_window_shapes(rng, shape, causal, window, dtype):
    q, k, v, dout = problem(rng, *shape, DTYPES[dtype])
    grads = run_backward(q, k, v, dout, causal, window)
    check(q, k, v, dout, grads, causal, window)


@gpu
@pytest.mark.parametrize("softcap", [30.0, 50.0])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(("shape", "causal", "window"), [
    ((2, 200, 250, 4, 2, 128), False, (-1, -1)),
    ((1, 300, 180, 4, 1, 64), True, (-1, -1)),
    ((1, 260, 300, 2, 2, 96), False, (40, 3)),
])
def test_softcap_large_inputs(rng, softcap, dtype, shape, causal, window):
    """Scores of a few hundred before the cap (amplitude 8 at d64-128): the tanh saturates, and its
    derivative 1 - t² is small on many scores."""
    q, k, v, dout = problem(rng, *shape, DTYPES[dtype], amplitude=8.0)
    grads = run_backward(q, k, v, dout, causal, window, softcap)
    check(q, k, v, dout, grads, causal, window, softcap)


@gpu
def test_softcap_with_a_softmax_scale_on_the_numpy_path(rng):
    q, k, v, dout = problem(rng, 1, 190, 230, 4, 2, 64, np.float16, amplitude=4.0)
    kw = {"window_size": (20, 30), "softcap": 30.0, "softmax_scale": 0.3}
    grads = run_backward(q, k, v, dout, False, on_device=False, **kw)
    check(q, k, v, dout, grads, False, **kw)


@gpu
@pytest.mark.parametrize(("causal", "window", "softcap"), [(False, (64, 10), 0.0), (True, (300, 0), 30.0),
                                                           (False, (0, 0), 0.0)])
def test_deterministic_with_a_window_is_bit_identical(rng, causal, window, softcap):
    """Key blocks skip the query blocks outside the window; each query block's dQ still sums in
    key-block order (no deadlock, the same bits twice), and it is right."""
    q, k, v, dout = problem(rng, 2, 1000, 900, 4, 2, 128, np.float16, 4.0 if softcap else 1.0)
    first = run_backward(q, k, v, dout, causal, window, softcap, deterministic=True)
    second = run_backward(q, k, v, dout, causal, window, softcap, deterministic=True)
    for a, b in zip(first, second, strict=True):
        assert a.tobytes() == b.tobytes()
    check(q, k, v, dout, first, causal, window, softcap)


# ------------------------------------------------------------------ torch


@pytest.fixture
def torch_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch without CUDA")
    import numbaflash.torch_ops  # noqa: F401  (registers the ops)

    return torch


def formula_gradients(torch, q, k, v, dout, causal, window, softcap, scale):
    """torch float64 autograd of the plain formula (FlashAttention's rule), on the CPU."""
    from numbaflash.tools.reference import visible_keys

    tq, tk, tv = (x.detach().double().cpu().requires_grad_() for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    kk = tk.repeat_interleave(group, dim=2).transpose(1, 2)
    vv = tv.repeat_interleave(group, dim=2).transpose(1, 2)
    s = tq.transpose(1, 2) @ kk.transpose(-1, -2) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    seen = torch.tensor(visible_keys(q.shape[1], k.shape[1], causal, window))
    p = torch.nan_to_num(torch.softmax(s.masked_fill(~seen, -torch.inf), dim=-1), nan=0.0)
    (p @ vv).transpose(1, 2).backward(dout.double().cpu())
    return tq.grad.numpy(), tk.grad.numpy(), tv.grad.numpy()


@gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize(("causal", "window", "softcap"), [(False, (48, 8), 30.0), (True, (100, -1), 50.0)])
def test_torch_autograd_against_float64_autograd(torch_cuda, dtype, causal, window, softcap):
    """flash_attention on torch tensors with requires_grad, a window and a softcap: the gradients
    against torch float64 autograd of the formula, within twice the input-dtype backward's error
    (``attention_backward_reference`` rounded) plus one ulp."""
    torch = torch_cuda
    torch_dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    gen = torch.Generator(device="cuda").manual_seed(7)
    shapes = ((2, 230, 4, 128), (2, 260, 2, 128), (2, 260, 2, 128))
    q, k, v = ((6 * torch.randn(s, device="cuda", generator=gen)).to(torch_dtype).requires_grad_()
               for s in shapes)
    dout = torch.randn(shapes[0], device="cuda", generator=gen).to(torch_dtype)
    scale = 128 ** -0.5
    out = numbaflash.flash_attention(q, k, v, causal=causal, window_size=window, softcap=softcap)
    out.backward(dout)
    refs = formula_gradients(torch, q, k, v, dout, causal, window, softcap, scale)
    arrays = [x.detach().cpu().float().numpy().astype(DTYPES[dtype]) for x in (q, k, v, dout)]
    lows = attention_backward_reference(*arrays, causal=causal, window_size=window, softcap=softcap,
                                        rounding_dtype=DTYPES[dtype])
    floor_exp = 10 if dtype == "float16" else 7
    for name, got, ref, low in zip("qkv", (q.grad, k.grad, v.grad), refs, lows, strict=True):
        got = got.double().cpu().numpy()
        err, err_low = np.abs(got - ref).max(), np.abs(low - ref).max()
        floor = 2.0 ** -floor_exp * max(1.0, float(np.abs(ref).max()))
        assert err <= 2 * err_low + floor, f"d{name}: {err:.3e} > 2 x {err_low:.3e} + {floor:.1e}"


@gpu
def test_torch_compile_fullgraph_with_window_and_softcap(torch_cuda):
    """torch.compile(fullgraph=True) of a loss through flash_attention with a window and a softcap:
    the gradients of eager (up to the order of dQ's float32 additions)."""
    torch = torch_cuda
    torch._dynamo.reset()
    gen = torch.Generator(device="cuda").manual_seed(3)
    leaves = [torch.randn(s, device="cuda", generator=gen).half().requires_grad_()
              for s in ((2, 200, 4, 64), (2, 210, 2, 64), (2, 210, 2, 64))]

    def loss(q, k, v):
        return numbaflash.flash_attention(q, k, v, window_size=(32, 0), softcap=30.0).float().square().sum()

    loss(*leaves).backward()
    eager = [x.grad.clone() for x in leaves]
    for x in leaves:
        x.grad = None
    torch.compile(loss, fullgraph=True)(*leaves).backward()
    for a, b in zip(eager, (x.grad for x in leaves), strict=True):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-3)
