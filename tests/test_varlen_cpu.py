"""The packed variable-length forward's checks before launch, its grid, and its float64 reference
(CPU only: nothing here compiles or launches)."""

from __future__ import annotations

import numpy as np
import pytest

from numbaflash import flash_attention_varlen
from numbaflash.operations.launch_forward import varlen_grid
from numbaflash.operations.varlen import check_host_offsets, check_max_seqlen, check_offsets_shape
from numbaflash.tools.reference import (
    attention_reference,
    compare_varlen_with_reference,
    varlen_attention_reference,
)


def _inputs(lengths_q=(3, 5), lengths_k=(4, 2), heads=(2, 1), d=64):
    rng = np.random.default_rng(0)
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32)
    q = rng.standard_normal((int(cu_q[-1]), heads[0], d)).astype(np.float16)
    k = rng.standard_normal((int(cu_k[-1]), heads[1], d)).astype(np.float16)
    v = rng.standard_normal((int(cu_k[-1]), heads[1], d)).astype(np.float16)
    return q, k, v, cu_q, cu_k


def _call(**change):
    q, k, v, cu_q, cu_k = _inputs()
    args = {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "max_seqlen_q": 5,
            "max_seqlen_k": 4}
    args.update(change)
    return flash_attention_varlen(**args)


@pytest.mark.parametrize(("change", "error", "message"), [
    ({"cu_seqlens_q": np.array([0, 3, 8], np.int64)}, TypeError, "cu_seqlens_q must be int32, got int64"),
    ({"cu_seqlens_k": np.array([[0, 4, 6]], np.int32)}, ValueError, "cu_seqlens_k must be 1-D"),
    ({"cu_seqlens_k": np.array([0, 6], np.int32)}, ValueError, r"same length \(batch \+ 1\), got 3 and 2"),
    ({"cu_seqlens_q": np.array([1, 3, 8], np.int32)}, ValueError, r"cu_seqlens_q\[0\] must be 0, got 1"),
    ({"cu_seqlens_q": np.array([0, 9, 8], np.int32)}, ValueError, "must be non-decreasing"),
    ({"cu_seqlens_k": np.array([0, 4, 5], np.int32)}, ValueError, r"must equal the packed length 6, got 5"),
    ({"max_seqlen_q": 4}, ValueError, r"max_seqlen_q = 4 is smaller than the longest sequence of "
                                      r"cu_seqlens_q \(5 rows\)"),
    ({"max_seqlen_k": 0}, ValueError, "max_seqlen_k must be a positive int, got 0"),
    ({"max_seqlen_k": 4.0}, ValueError, "max_seqlen_k must be a positive int, got 4.0"),
    ({"cu_seqlens_q": [0, 3, 8]}, TypeError, "cu_seqlens_q must be an int32 numpy array for numpy inputs"),
    ({"q": np.zeros((8, 2, 64, 1), np.float16)}, ValueError, "q must have 3 dimensions"),
    ({"q": np.zeros((8, 2, 48), np.float16)}, ValueError, "q and k must have the same head_dim"),
    ({"k": np.zeros((6, 3, 64), np.float16), "v": np.zeros((6, 3, 64), np.float16)}, ValueError,
     r"multiple of heads of k/v"),
    ({"q": np.zeros((8, 2, 64), np.float32)}, TypeError, "q must be float16 or bfloat16, got float32"),
    ({"window_size": (-2, 0)}, ValueError, "window_size"),
    ({"softcap": -1.0}, ValueError, "softcap"),
])
def test_validation_before_launch(change, error, message):
    with pytest.raises(error, match=message):
        _call(**change)


def test_offset_helpers():
    assert check_offsets_shape("cu", (5,), np.int32) == 4
    with pytest.raises(ValueError, match="batch >= 1"):
        check_offsets_shape("cu", (1,), np.int32)
    check_host_offsets("cu", np.array([0, 0, 3, 3], np.int32), 3, 3, "max")  # empty sequences are fine
    assert check_max_seqlen("m", np.int64(7)) == 7
    with pytest.raises(ValueError):
        check_max_seqlen("m", True)


def test_grid():
    assert varlen_grid(128, 129, 8, 3) == (2, 8, 3)
    assert varlen_grid(64, 1, 1, 1) == (1, 1, 1)


def test_reference_is_per_sequence():
    q, k, v, cu_q, cu_k = _inputs((3, 0, 5), (4, 2, 0))
    out, lse = varlen_attention_reference(q, k, v, cu_q, cu_k, causal=True)
    assert out.shape == q.shape and lse.shape == (2, 8)
    o0, l0 = attention_reference(q[None, 0:3], k[None, 0:4], v[None, 0:4], causal=True)
    np.testing.assert_array_equal(out[0:3], o0[0])
    np.testing.assert_array_equal(lse[:, 0:3], l0[0])
    assert (out[3:] == 0).all() and np.isneginf(lse[:, 3:]).all()  # the last sequence has no keys


def _as_kernel(q, k, v, cu_q, cu_k, **options):
    """What a kernel that computes in q's dtype would give: out rounded, LSE in float32."""
    out, _ = varlen_attention_reference(q, k, v, cu_q, cu_k, rounding_dtype=q.dtype, **options)
    _, lse = varlen_attention_reference(q, k, v, cu_q, cu_k, **options)
    return out.astype(q.dtype), lse.astype(np.float32)


@pytest.mark.parametrize("options", [{"causal": True}, {"window_size": (2, 1), "softcap": 30.0},
                                     {"softmax_scale": 0.3}])
def test_compare_varlen_accepts_the_reference(options):
    q, k, v, cu_q, cu_k = _inputs((3, 0, 5, 1), (4, 2, 0, 1))
    out, lse = _as_kernel(q, k, v, cu_q, cu_k, **options)
    ratio, problems = compare_varlen_with_reference(q, k, v, cu_q, cu_k, out, lse, **options)
    assert problems == [] and 0 <= ratio <= 1
    assert compare_varlen_with_reference(q, k, v, cu_q, cu_k, out, None, **options)[1] == []


def test_compare_varlen_names_the_wrong_sequence():
    q, k, v, cu_q, cu_k = _inputs((3, 0, 5, 1), (4, 2, 0, 1))  # sequence 2: 5 rows, no key
    out, lse = _as_kernel(q, k, v, cu_q, cu_k, causal=True)

    def problems(o=out, s=lse):
        return compare_varlen_with_reference(q, k, v, cu_q, cu_k, o, s, causal=True)[1]

    bad = out.copy()
    bad[3, 1, 0] = np.nan  # the first row of sequence 2, which has no key
    assert problems(bad) == ["sequence 2 (seqlen_q 5, seqlen_k 0): rows of a sequence without keys are "
                             "not exactly 0"]
    bad = out.copy()
    bad[8, 0] += 0.5  # sequence 3, one row, one key
    found = problems(bad)
    assert len(found) == 1 and found[0].startswith("sequence 3 (seqlen_q 1, seqlen_k 1): max error")
    bad = out.copy()
    bad[0, 0, 0] = np.nan
    assert any(p.startswith("sequence 0") and "NaN" in p for p in problems(bad))
    bad_lse = lse.copy()
    bad_lse[1, 4] = 0.0
    assert problems(out, bad_lse) == [
        "sequence 2 (seqlen_q 5, seqlen_k 0): LSE of a sequence without keys is not -inf"]
    bad_lse = lse.copy()
    bad_lse[0, 1] += 1.0
    assert any(p.startswith("sequence 0") and "LSE max abs error" in p for p in problems(out, bad_lse))
    assert "output shape" in problems(out[:-1])[0]
    assert "LSE shape" in problems(out, lse.T)[0]


def test_import_pulls_neither_torch_nor_numba():
    import subprocess
    import sys

    code = "import sys, numbaflash; print('torch' in sys.modules, 'numba' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.split() == [
        "False", "False"]


def test_torch_requires_grad_goes_through_the_op(monkeypatch):
    """With autograd on, the call runs the varlen op (whose backward is the varlen backward op:
    tests/test_varlen_backward_cpu.py), not the direct path."""
    torch = pytest.importorskip("torch")
    from numbaflash import torch_ops

    seen = []

    def forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window_size, softcap):
        seen.append((max_q, max_k))
        return torch.zeros_like(q), torch.zeros((q.shape[1], q.shape[0]), dtype=torch.float32)

    monkeypatch.setattr(torch_ops, "run_varlen", forward)
    q, k, v, cu_q, cu_k = (torch.from_numpy(x) for x in _inputs())
    q.requires_grad_(True)
    out = flash_attention_varlen(q, k, v, cu_q, cu_k, 5, 4)
    assert seen == [(5, 4)] and out.requires_grad


def test_torch_fake_shapes():
    torch = pytest.importorskip("torch")
    from numbaflash import torch_ops

    q, k, v, cu_q, cu_k = (torch.from_numpy(x).to("meta") for x in _inputs())
    out, lse = torch_ops.flash_attention_varlen_forward(q, k, v, cu_q, cu_k, 5, 4, True, 0.125)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (2, 8) and lse.dtype == torch.float32
