"""The packed variable-length backward on the CPU: its workspace layout (no two sequences share a
query block, every row is covered), its checks before launch, its float64 reference, and the
torch op's autograd wiring with float64 references in place of the kernels (nothing here
compiles or launches a kernel)."""

from __future__ import annotations

import numpy as np
import pytest

from numbaflash import flash_attention_varlen_backward
from numbaflash.kernels.abi import (
    BACKWARD_ROW_ALIGN,
    VARLEN_BACKWARD_ABI,
    VARLEN_BACKWARD_DQ_ABI,
    VARLEN_BACKWARD_PREP_ABI,
    varlen_padded_rows,
    varlen_row_offset,
    varlen_workspace_rows,
)
from numbaflash.kernels.families import SM80_BWD, kernel_abi, spec_of
from numbaflash.kernels.shapes import BackwardConfig
from numbaflash.operations.launch_backward import varlen_workspace_layout
from numbaflash.tools.reference import (
    attention_backward_reference,
    compare_varlen_gradients_with_reference,
    varlen_attention_backward_reference,
    varlen_attention_reference,
)


def _offsets(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def _regions(lengths):
    cu = _offsets(lengths)
    return [(varlen_row_offset(int(cu[b]), b), varlen_row_offset(int(cu[b]), b) + varlen_padded_rows(int(n)))
            for b, n in enumerate(lengths)]


@pytest.mark.parametrize("seed", range(4))
def test_workspace_regions_are_disjoint_whole_blocks_and_cover_every_row(seed):
    rng = np.random.default_rng(seed)
    for _ in range(500):
        batch = int(rng.integers(1, 12))
        lengths = rng.integers(0, 700, batch)
        lengths[rng.random(batch) < 0.25] = 0
        lengths[rng.random(batch) < 0.1] = 1
        rows = varlen_workspace_rows(int(lengths.sum()), batch)
        assert rows % BACKWARD_ROW_ALIGN == 0
        regions = _regions(lengths)
        for b, ((start, end), n) in enumerate(zip(regions, lengths, strict=True)):
            assert start % BACKWARD_ROW_ALIGN == 0 and end % BACKWARD_ROW_ALIGN == 0
            assert end - start >= n  # every row of the sequence has a workspace row
            assert 0 <= start and end <= rows
            if b:
                assert start >= regions[b - 1][1]  # no overlap with the sequence before
        # Every block of every block_m (64, 128) lies inside one sequence's region.
        owner = np.full(rows, -1)
        for b, (start, end) in enumerate(regions):
            assert (owner[start:end] == -1).all()
            owner[start:end] = b


def test_workspace_layout_of_a_packed_call():
    lengths = [0, 1, 130, 64, 0, 300]
    total_q, batch, heads_q, d = sum(lengths), len(lengths), 3, 64
    for block_m in (64, 128):
        lay = varlen_workspace_layout(total_q, batch, heads_q, d, block_m)
        assert lay.rows == varlen_workspace_rows(total_q, batch) >= total_q + 128
        assert lay.row_elements == heads_q * lay.rows
        assert lay.accum_elements == heads_q * lay.rows * d
        assert lay.counter_elements == heads_q * lay.rows // block_m
        assert lay.total == 2 * lay.row_elements + lay.accum_elements + lay.counter_elements
    # FlashAttention's bound: at most total_q + 128 * batch rows (rounded up to 128).
    assert varlen_workspace_rows(total_q, batch) <= total_q + 128 * batch + 127


def test_the_varlen_kernels_are_registered():
    config = BackwardConfig(64)
    assert SM80_BWD.runs("backward", varlen=True)
    for w in (False, True):
        for s in (False, True):
            spec = spec_of(config, "backward", causal=True, window=w, softcap=s, varlen=True)
            assert kernel_abi(spec) == VARLEN_BACKWARD_ABI and spec.causal == (not w)
            assert kernel_abi(spec.sibling("backward_prep")) == VARLEN_BACKWARD_PREP_ABI
            assert kernel_abi(spec.sibling("backward_dq")) == VARLEN_BACKWARD_DQ_ABI
            assert spec.sibling("backward_dq") == spec_of(config, "backward_dq", varlen=True)


# ------------------------------------------------------------------ checks before launch


def _inputs(lengths_q=(3, 0, 5), lengths_k=(4, 2, 0), heads=(2, 1), d=64, seed=0):
    rng = np.random.default_rng(seed)
    cu_q, cu_k = _offsets(lengths_q), _offsets(lengths_k)
    tq, tk = int(cu_q[-1]), int(cu_k[-1])
    q = rng.standard_normal((tq, heads[0], d)).astype(np.float16)
    k = rng.standard_normal((tk, heads[1], d)).astype(np.float16)
    v = rng.standard_normal((tk, heads[1], d)).astype(np.float16)
    dout = rng.standard_normal((tq, heads[0], d)).astype(np.float16)
    out, lse = varlen_attention_reference(q, k, v, cu_q, cu_k)
    return {"dout": dout, "q": q, "k": k, "v": v, "out": out.astype(np.float16),
            "lse": lse.astype(np.float32),
            "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "max_seqlen_q": 5, "max_seqlen_k": 4}


@pytest.mark.parametrize(("change", "error", "message"), [
    ({"cu_seqlens_q": np.array([0, 3, 3, 8], np.int64)}, TypeError, "cu_seqlens_q must be int32, got int64"),
    ({"cu_seqlens_k": np.array([0, 6], np.int32)}, ValueError, r"same length \(batch \+ 1\), got 4 and 2"),
    ({"cu_seqlens_q": np.array([0, 5, 3, 8], np.int32)}, ValueError, "must be non-decreasing"),
    ({"cu_seqlens_k": np.array([0, 4, 6, 7], np.int32)}, ValueError, r"cu_seqlens_k\[-1\] must equal"),
    ({"max_seqlen_q": 4}, ValueError, "max_seqlen_q = 4 is smaller than the longest sequence"),
    ({"max_seqlen_k": 0}, ValueError, "max_seqlen_k must be a positive int"),
    ({"lse": np.zeros((8, 2), np.float32)}, ValueError,
     r"lse must have shape \(heads_q, total_q\) = \(2, 8\)"),
    ({"lse": np.zeros((2, 8), np.float64)}, TypeError, "lse must be float32"),
    ({"dout": np.zeros((8, 2, 32), np.float16)}, ValueError, "dout must have q's shape"),
    ({"out": np.zeros((8, 2, 64), np.float32)}, (TypeError, ValueError), "out"),
    ({"window_size": (-2, 0)}, ValueError, "window"),
    ({"softcap": -1.0}, ValueError, "softcap"),
    ({"deterministic": 1}, TypeError, "deterministic"),
    ({"causal": "yes"}, TypeError, "causal"),
    ({"dq": np.zeros((8, 2, 32), np.float16)}, ValueError, "dq must have q's shape"),
    ({"q": np.zeros((8, 2, 64), np.float32)}, TypeError, "float16 or bfloat16"),
    ({"k": np.zeros((6, 3, 64), np.float16), "v": np.zeros((6, 3, 64), np.float16)}, ValueError, "multiple"),
])
def test_bad_inputs_rejected_before_anything_compiles(change, error, message):
    args = _inputs()
    args.update(change)
    with pytest.raises(error, match=message):
        flash_attention_varlen_backward(**args)


# ------------------------------------------------------------------ the float64 reference


def test_reference_is_the_dense_reference_per_sequence_and_zero_where_nothing_pairs():
    args = _inputs(lengths_q=(3, 0, 5, 2), lengths_k=(4, 2, 3, 0), seed=1)
    q, k, v, dout = args["q"], args["k"], args["v"], args["dout"]
    cu_q, cu_k = args["cu_seqlens_q"], args["cu_seqlens_k"]
    for causal in (False, True):
        dq, dk, dv = varlen_attention_backward_reference(q, k, v, dout, cu_q, cu_k, causal=causal)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
        for b in range(4):
            q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
            if q1 == q0 or k1 == k0:
                assert (dq[q0:q1] == 0).all() and (dk[k0:k1] == 0).all() and (dv[k0:k1] == 0).all()
                continue
            ref = attention_backward_reference(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1],
                                               dout[None, q0:q1], causal=causal)
            np.testing.assert_array_equal(dq[q0:q1], ref[0][0])
            np.testing.assert_array_equal(dk[k0:k1], ref[1][0])
            np.testing.assert_array_equal(dv[k0:k1], ref[2][0])
        ratio, problems = compare_varlen_gradients_with_reference(q, k, v, dout, cu_q, cu_k, (dq, dk, dv),
                                                                  causal=causal)
        assert problems == [] and ratio <= 1e-6


def test_compare_names_the_sequence_that_fails():
    args = _inputs(lengths_q=(3, 0, 5), lengths_k=(4, 2, 3), seed=2)
    q, k, v, dout = args["q"], args["k"], args["v"], args["dout"]
    cu_q, cu_k = args["cu_seqlens_q"], args["cu_seqlens_k"]
    dq, dk, dv = varlen_attention_backward_reference(q, k, v, dout, cu_q, cu_k)
    bad = dq.copy()
    bad[5] += 0.5  # a row of sequence 2
    _, problems = compare_varlen_gradients_with_reference(q, k, v, dout, cu_q, cu_k, (bad, dk, dv))
    assert problems and all(p.startswith("sequence 2 ") for p in problems)
    bad_dk = dk.copy()
    bad_dk[4] = 1.0  # a key of sequence 1, which has no queries
    _, problems = compare_varlen_gradients_with_reference(q, k, v, dout, cu_q, cu_k, (dq, bad_dk, dv))
    assert problems == [
        "sequence 1 (seqlen_q 0, seqlen_k 2): dk of a sequence without queries is not exactly 0"]
    ratio, problems = compare_varlen_gradients_with_reference(q, k, v, dout, cu_q, cu_k, (dq[:-1], dk, dv))
    assert ratio == np.inf and "dq shape" in problems[0]


# ------------------------------------------------------------------ torch autograd (references in place)


@pytest.fixture
def varlen_reference_ops(monkeypatch):
    """The varlen ops run float64 references on the CPU; ``calls`` records what reached each."""
    torch = pytest.importorskip("torch")
    from numbaflash import torch_ops

    calls = {"forward": [], "backward": []}

    def forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window_size, softcap):
        calls["forward"].append((max_q, max_k, causal))
        out, lse = varlen_attention_reference(q.detach().double().numpy(), k.detach().double().numpy(),
                                              v.detach().double().numpy(), cu_q.numpy(), cu_k.numpy(),
                                              causal=causal, softmax_scale=scale)
        return torch.from_numpy(out).to(q.dtype), torch.from_numpy(lse).float()

    def backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, deterministic, window_size,
                 softcap):
        calls["backward"].append((max_q, max_k, causal, deterministic))
        grads = varlen_attention_backward_reference(q.double().numpy(), k.double().numpy(),
                                                    v.double().numpy(), dout.double().numpy(), cu_q.numpy(),
                                                    cu_k.numpy(), causal=causal, softmax_scale=scale)
        return tuple(torch.from_numpy(g).to(x.dtype) for g, x in zip(grads, (q, k, v), strict=True))

    monkeypatch.setattr(torch_ops, "run_varlen", forward)
    monkeypatch.setattr(torch_ops, "run_varlen_backward", backward)
    return calls


def _torch_inputs(torch, lengths_q=(3, 0, 5), lengths_k=(4, 2, 3), heads=(4, 2), d=32, dtype=None):
    gen = torch.Generator().manual_seed(0)
    dtype = dtype or torch.float16
    cu_q = torch.tensor(_offsets(lengths_q))
    cu_k = torch.tensor(_offsets(lengths_k))
    q = torch.randn((int(cu_q[-1]), heads[0], d), generator=gen).to(dtype).requires_grad_(True)
    k = torch.randn((int(cu_k[-1]), heads[1], d), generator=gen).to(dtype).requires_grad_(True)
    v = torch.randn((int(cu_k[-1]), heads[1], d), generator=gen).to(dtype).requires_grad_(True)
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize("causal", [False, True])
def test_autograd_runs_the_varlen_backward_op(varlen_reference_ops, causal):
    import torch

    from numbaflash import flash_attention_varlen

    q, k, v, cu_q, cu_k = _torch_inputs(torch)
    out = flash_attention_varlen(q, k, v, cu_q, cu_k, 5, 4, causal=causal)
    dout = torch.randn(out.shape).to(out.dtype)
    (out.float() * dout.float()).sum().backward()
    assert varlen_reference_ops["backward"] == [(5, 4, causal, False)]
    want = varlen_attention_backward_reference(q.detach().double().numpy(), k.detach().double().numpy(),
                                               v.detach().double().numpy(), dout.double().numpy(),
                                               cu_q.numpy(), cu_k.numpy(), causal=causal)
    for got, ref in zip((q.grad, k.grad, v.grad), want, strict=True):
        np.testing.assert_allclose(got.double().numpy(), ref, atol=2e-2, rtol=2e-2)


def test_out_with_autograd_is_refused(varlen_reference_ops):
    import torch

    from numbaflash import flash_attention_varlen

    q, k, v, cu_q, cu_k = _torch_inputs(torch)
    with pytest.raises(RuntimeError, match="out= does not support automatic differentiation"):
        flash_attention_varlen(q, k, v, cu_q, cu_k, 5, 4, out=torch.empty_like(q))
    assert varlen_reference_ops["forward"] == []


def test_fake_backward_shapes_and_checks():
    torch = pytest.importorskip("torch")
    from numbaflash import torch_ops

    q, k, v, cu_q, cu_k = (x.detach().to("meta") for x in _torch_inputs(torch))
    lse = torch.empty((4, 8), dtype=torch.float32, device="meta")
    dq, dk, dv = torch_ops.flash_attention_varlen_backward(q, q, k, v, q, lse, cu_q, cu_k, 5, 4, True, 0.125,
                                                           False)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    with pytest.raises(ValueError, match="lse must have shape"):
        torch_ops.flash_attention_varlen_backward(q, q, k, v, q, lse.T, cu_q, cu_k, 5, 4, True, 0.125, False)


def test_compiled_training_step_has_no_graph_break(varlen_reference_ops):
    import torch

    from numbaflash import flash_attention_varlen

    torch._dynamo.reset()
    q, k, v, cu_q, cu_k = _torch_inputs(torch, dtype=torch.bfloat16)

    def step(q, k, v):
        return flash_attention_varlen(q, k, v, cu_q, cu_k, 5, 4, causal=True).float().square().sum()

    explained = torch._dynamo.explain(step)(q, k, v)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    compiled(q, k, v).backward()
    assert q.grad is not None and k.grad is not None and v.grad is not None
    assert len(varlen_reference_ops["backward"]) == 1


def test_launches_pass_each_kernel_its_abi():
    """The three varlen launches (no GPU: a launcher that records) give each kernel as many
    arguments as its ABI lists, in its kinds (arrays as (pointer, elements), ints, floats, bools),
    over grids of the maxima, and the main kernel the sequences' offsets last."""
    from numbaflash.kernels.shapes import BackwardConfig
    from numbaflash.operands import Operand
    from numbaflash.operations.launch_backward import (
        BackwardCall,
        VarlenBackwardCall,
        launch_varlen_backward_dq,
        launch_varlen_backward_main,
        launch_varlen_backward_prep,
    )
    from numbaflash.operations.varlen import packed

    config = BackwardConfig(64)
    total_q, total_k, heads_q, heads_kv, d, batch = 300, 200, 4, 2, 64, 3

    def op(name, total, heads, at):
        return packed(Operand(name, (total, heads, d), "float16", True, None, (heads * d, d, 1), at))

    ws = varlen_workspace_layout(total_q, batch, heads_q, d, config.block_m)
    call = BackwardCall(op("dout", total_q, heads_q, 1 << 20), op("q", total_q, heads_q, 2 << 20),
                        op("k", total_k, heads_kv, 3 << 20), op("v", total_k, heads_kv, 4 << 20),
                        op("out", total_q, heads_q, 5 << 20), op("dq", total_q, heads_q, 6 << 20),
                        op("dk", total_k, heads_kv, 7 << 20), op("dv", total_k, heads_kv, 8 << 20),
                        (9 << 20, heads_q * total_q), ws.at(10 << 20), ws.rows, np.float32(0.18),
                        np.float32(0.125), True, 0, 0)
    vcall = VarlenBackwardCall(call, (11 << 20, batch + 1), (12 << 20, batch + 1), batch, 130, 170)

    class Gpu:
        def sm_count(self, device):
            return 132

    seen = []

    def launcher(grid, threads, stream, shared, *args):
        seen.append((grid, args))

    for launch_of, abi in ((launch_varlen_backward_prep, VARLEN_BACKWARD_PREP_ABI),
                           (launch_varlen_backward_main, VARLEN_BACKWARD_ABI),
                           (launch_varlen_backward_dq, VARLEN_BACKWARD_DQ_ABI)):
        seen.clear()
        launch_of(config)(launcher, vcall, Gpu())
        (grid, args), = seen
        assert len(args) == len(abi)
        for arg, kind in zip(args, abi, strict=True):
            if kind.startswith("array"):
                assert isinstance(arg, tuple) and len(arg) == 2
            else:
                assert not isinstance(arg, tuple), (kind, arg)
        assert args[-3:] == ((11 << 20, batch + 1), (12 << 20, batch + 1), total_q)
        if launch_of is launch_varlen_backward_main:
            assert grid == (-(-170 // config.block_n) * heads_kv * batch, 1, 1)
        else:
            assert grid[1:] == (heads_q, batch) and grid[0] * (64 if launch_of is launch_varlen_backward_prep
                                                               else config.block_m) == 256


@pytest.mark.parametrize("shape", [(163, 2, 64), (4, 163, 2, 64), (5, 64)])
def test_self_overlap_check_takes_any_rank(shape):
    """Given gradients of the packed layouts are 3-D: the no-self-overlap check (every given
    output passes it) takes any rank; a stride 0 or overlapping rows still fail."""
    from numbaflash.operands import Operand, check_no_self_overlap

    strides = tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
    check_no_self_overlap(Operand("dq", shape, "float16", True, None, strides))
    transposed = (*strides[:-2], 1, shape[-2])  # the last two dimensions swapped in memory
    check_no_self_overlap(Operand("dq", shape, "float16", True, None, transposed))
    with pytest.raises(ValueError, match="make elements share memory"):
        check_no_self_overlap(Operand("dq", shape, "float16", True, None, (0, *strides[1:])))
