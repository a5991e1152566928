"""The KV-cache call's ``cache_batch_idx`` and ``cache_leftpad`` (issue 56, item 4) on CPU: the float64
reference (``tools.reference.kvcache_reference``) proved by hand, the spec axes and the parameter
declarations, the checks of bad input (nothing compiled), the launches on a pretend device (the
parameters in order) and the torch op's fake kernel."""

from __future__ import annotations

import dataclasses
import inspect
import types

import numpy as np
import pytest

import numbaflash
from numbaflash.kernels import params
from numbaflash.kernels.families import kernel_params
from numbaflash.kernels.shapes import DecodeConfig
from numbaflash.kernels.spec import kernel_spec
from numbaflash.operations import decode as decode_op
from numbaflash.operations.launch_decode import SCRATCH_TAIL_ROWS
from numbaflash.tools.reference import attention_reference, kvcache_reference
from tests.test_decode_cpu import (
    FakeDeviceArray,
    FakeLauncher,
    call,
    fake_gpu,
    inputs,
    kernel_name,
    no_compile,
)

__all__ = ["fake_gpu", "no_compile"]  # the fixtures, used by name

# ------------------------------------------------------------------ the float64 reference


def test_the_reference_by_hand():
    """One head of dim 1, q = 0: every visible key weighs the same, so out is the mean of the values
    the query sees and LSE = log(count). Sequence 0 uses cache row 1 (cache_batch_idx), its keys start
    at cache row 1 (cache_leftpad): keys = cache rows 1, 2 of batch row 1 and the new row (L = 3);
    causal with seqlen_q 2: query 0 sees keys 0, 1 (L - 2 + 0 = 1), query 1 all three. The new row is
    written at cache row cache_seqlens = 3 of batch row 1 and nowhere else."""
    q = np.zeros((1, 2, 1, 1))
    k_cache = np.zeros((2, 5, 1, 1))
    v_cache = np.arange(10, dtype=np.float64).reshape(2, 5, 1, 1)  # row 1: 5, 6, 7, 8, 9
    k_new, v_new = np.zeros((1, 1, 1, 1)), np.full((1, 1, 1, 1), 20.0)
    out, lse, k_after, v_after = kvcache_reference(
        q, k_cache, v_cache, np.array([3]), k_new=k_new, v_new=v_new, cache_batch_idx=np.array([1]),
        cache_leftpad=np.array([1]), causal=True)
    assert out[0, :, 0, 0].tolist() == [(6 + 7) / 2, (6 + 7 + 20) / 3]
    np.testing.assert_allclose(lse[0, 0], [np.log(2), np.log(3)])
    expected = v_cache.copy()
    expected[1, 3, 0, 0] = 20.0
    assert np.array_equal(v_after, expected) and np.array_equal(k_after, k_cache)
    assert v_cache[1, 3, 0, 0] == 8.0  # the input is left as it was
    # no options: sequence 0 reads batch row 0 from row 0: keys 0, 1, 2 and the new row
    out, *_ = kvcache_reference(q, k_cache, v_cache, np.array([3]), k_new=k_new, v_new=v_new, causal=False)
    assert out[0, :, 0, 0].tolist() == [(0 + 1 + 2 + 20) / 4] * 2


def test_the_reference_of_a_paged_cache_is_the_dense_one():
    """The same keys laid out in pages (pages of 4 rows, in a shuffled order, two table rows more than
    sequences) give the same result and write the same rows, with both options."""
    rng = np.random.default_rng(0)
    batch, rows, capacity, page = 2, 3, 12, 4
    q = rng.standard_normal((batch, 2, 4, 32))
    k_dense, v_dense = (rng.standard_normal((rows, capacity, 2, 32)) for _ in range(2))
    k_new, v_new = (rng.standard_normal((batch, 2, 2, 32)) for _ in range(2))
    lens, idx, pad = np.array([7, 9]), np.array([2, 0]), np.array([3, 0])
    pages = rng.permutation(rows * capacity // page)
    table = pages.reshape(rows, capacity // page)
    k_paged, v_paged = (np.zeros((len(pages), page, 2, 32)) for _ in range(2))
    for r in range(rows):
        for p in range(capacity // page):
            k_paged[table[r, p]] = k_dense[r, p * page:(p + 1) * page]
            v_paged[table[r, p]] = v_dense[r, p * page:(p + 1) * page]
    kw = {"k_new": k_new, "v_new": v_new, "cache_batch_idx": idx, "cache_leftpad": pad, "window_size": (4, 0)}
    dense = kvcache_reference(q, k_dense, v_dense, lens, **kw)
    paged = kvcache_reference(q, k_paged, v_paged, lens, block_table=table, **kw)
    np.testing.assert_array_equal(dense[0], paged[0])
    np.testing.assert_array_equal(dense[1], paged[1])
    for r in range(rows):
        for p in range(capacity // page):
            assert np.array_equal(paged[2][table[r, p]], dense[2][r, p * page:(p + 1) * page])
    # and sequence 0 is attention over its own keys
    keys = np.concatenate([k_dense[2, 3:7], k_new[0]])[None]
    values = np.concatenate([v_dense[2, 3:7], v_new[0]])[None]
    out, lse = attention_reference(q[:1], keys, values, causal=True, window_size=(4, 0))
    np.testing.assert_array_equal(dense[0][:1], out)


# ------------------------------------------------------------------ the spec and the declarations


def test_the_options_are_axes_of_the_decode_kernel_only():
    config = DecodeConfig(128)
    spec = kernel_spec("sm80dec", "decode", config, causal=True, batch_idx=True, leftpad=True)
    assert spec.kind == "sm80dec.decode+batch_idx+leftpad"
    combine = spec.sibling("decode_combine")
    assert not combine.batch_idx and not combine.leftpad
    assert combine == kernel_spec("sm80dec", "decode_combine", config)
    assert not kernel_spec("sm80", "forward", config, batch_idx=True).batch_idx
    plain = kernel_spec("sm80dec", "decode", config, causal=True)
    variants = {plain, dataclasses.replace(plain, batch_idx=True), dataclasses.replace(plain, leftpad=True)}
    assert len(variants) == 3


@pytest.mark.parametrize("variant", [False, True])
@pytest.mark.parametrize("sink", [False, True])
@pytest.mark.parametrize(("batch_idx", "leftpad"), [(False, False), (True, False), (False, True),
                                                    (True, True)])
def test_the_declaration_is_the_kernels_parameter_list(variant, sink, batch_idx, leftpad):
    """``params.decode_params``: the plain or variant list, then the sink, cache_batch_idx and
    cache_leftpad where built; the kernel function's own parameters are those names, in order."""
    pytest.importorskip("numba")
    from numbaflash.kernels.families import make_kernel

    spec = kernel_spec("sm80dec", "decode", DecodeConfig(64, paged=True), causal=not variant, window=variant,
                       sink=sink, batch_idx=batch_idx, leftpad=leftpad)
    declared = kernel_params(spec)
    extra = (("sink",) if sink else ()) + (("cache_batch_idx",) if batch_idx else ()) + (
        ("cache_leftpad",) if leftpad else ())
    base = params.DECODE_VARIANT if variant else params.DECODE
    assert declared[:len(base)] == base and params.names_of(declared[len(base):]) == extra
    kernel = make_kernel(spec)
    assert tuple(inspect.signature(kernel).parameters) == params.names_of(declared)
    name = kernel.__name__
    assert name.endswith("_bidx_lpad" if batch_idx and leftpad else "_bidx" if batch_idx
                         else "_lpad" if leftpad else "_sink" if sink else "16")


def test_plain_builds_keep_their_names():
    pytest.importorskip("numba")
    from numbaflash.kernels.families import make_kernel

    spec = kernel_spec("sm80dec", "decode", DecodeConfig(128), causal=True)
    assert make_kernel(spec).__name__ == "flash_decode_d128_m16_n64_w4_s3_causal_f16"


# ------------------------------------------------------------------ the checks of bad input


@pytest.mark.parametrize("name", ["cache_batch_idx", "cache_leftpad"])
@pytest.mark.parametrize(("array", "error", "match"), [
    (FakeDeviceArray((3,), "<i4"), ValueError, r"must have shape \(2,\), got \(3,\)"),
    (FakeDeviceArray((2, 1), "<i4"), ValueError, r"must have shape \(2,\)"),
    (FakeDeviceArray((2,), "<i8"), TypeError, "must be int32"),
    (np.zeros(2, np.int32), TypeError, "device array"),
])
def test_a_bad_index_array_is_rejected_before_compiling(no_compile, name, array, error, match):
    with pytest.raises(error, match=f"{name} {match}" if match.startswith("must") else match):
        call(inputs(), **{name: array})


def test_a_cache_with_more_rows_than_sequences_needs_cache_batch_idx(no_compile):
    x = inputs()
    x["k_cache"], x["v_cache"] = FakeDeviceArray((5, 300, 2, 128)), FakeDeviceArray((5, 300, 2, 128))
    with pytest.raises(ValueError, match="same batch size"):
        call(x)
    paged = inputs(paged=True)
    paged["block_table"] = FakeDeviceArray((5, 20), "<i4")
    with pytest.raises(ValueError, match="block_table must have shape"):
        call(paged)


# ------------------------------------------------------------------ launches on a pretend device


def _launch(x, **kwargs):
    FakeLauncher.launches.clear()
    call(x, **kwargs)
    return [(name, grid, args) for name, grid, _, _, args in FakeLauncher.launches]


def _pointer(array) -> int:
    return array.__cuda_array_interface__["data"][0]


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize(("batch_idx", "leftpad"), [(True, False), (False, True), (True, True)])
def test_an_option_call_runs_its_build_with_its_arrays_last(fake_gpu, monkeypatch, paged, splits, batch_idx,
                                                           leftpad):
    """The options' build of the plain call's config, a plan of its own; its parameters are the plain
    call's, then (pointer, batch) of cache_batch_idx and of cache_leftpad, in that order; the grid and
    the combine launch are the plain call's. A cache (or block table) of more rows than sequences."""
    built = []
    monkeypatch.setattr(decode_op, "loaded_kernel", lambda spec: built.append(spec)
                        or (types.SimpleNamespace(handle=1), kernel_name(spec)))
    x = inputs(seqlen_q=2, seqlen_new=1, paged=paged)
    plain = _launch(x, num_splits=splits, return_lse=True)
    if batch_idx:
        if paged:
            x["block_table"] = FakeDeviceArray((5, 20), "<i4")
        else:
            x["k_cache"], x["v_cache"] = FakeDeviceArray((5, 300, 2, 128)), FakeDeviceArray((5, 300, 2, 128))
    options = {}
    if batch_idx:
        options["cache_batch_idx"] = FakeDeviceArray((2,), "<i4")
    if leftpad:
        options["cache_leftpad"] = FakeDeviceArray((2,), "<i4")
    got = _launch(x, num_splits=splits, return_lse=True, **options)
    specs = [s for s in built if s.operation == "decode"]
    assert [(s.batch_idx, s.leftpad) for s in specs] == [(False, False), (batch_idx, leftpad)]
    assert specs[1].paged == paged and specs[1].causal == specs[0].causal
    assert len(got) == len(plain) == (2 if splits > 1 else 1)
    args = got[0][2]
    assert len(args) == len(params.DECODE) + len(options)
    assert args[len(params.DECODE):] == tuple((_pointer(a), 2) for a in options.values())
    assert got[0][1] == plain[0][1]
    for a, b in zip(args[:len(params.DECODE)], plain[0][2], strict=True):
        assert a == b or (isinstance(a, tuple) and a[1] == b[1])  # array pointers: new outputs, caches
    if splits > 1:
        assert [len(a) for _, _, a in got[1:]] == [len(a) for _, _, a in plain[1:]]
    assert len(numbaflash.operations.decode.gpu_state.GPU.plans) == 2
    again = _launch(x, num_splits=splits, return_lse=True, **options)  # the plan is kept
    assert len(numbaflash.operations.decode.gpu_state.GPU.plans) == 2 and len(again) == len(got)


def test_a_window_softcap_sink_call_takes_every_option_in_order(fake_gpu):
    sink = FakeDeviceArray((8,), "<f4")
    idx, pad = FakeDeviceArray((2,), "<i4"), FakeDeviceArray((2,), "<i4")
    args = _launch(inputs(), num_splits=1, window_size=(7, 0), softcap=30.0, learnable_sink=sink,
                   cache_batch_idx=idx, cache_leftpad=pad)[0][2]
    n = len(params.DECODE_VARIANT)
    assert len(args) == n + 3 and args[n - 3] == 7  # window_left, ...
    assert args[n:] == ((_pointer(sink), 8), (_pointer(idx), 2), (_pointer(pad), 2))


def test_calls_with_and_without_options_keep_their_plans_apart(fake_gpu):
    x = inputs()
    idx = FakeDeviceArray((2,), "<i4")
    for kwargs in ({}, {"cache_batch_idx": idx}, {"cache_leftpad": idx}, {"cache_batch_idx": idx,
                                                                          "cache_leftpad": idx}, {}):
        _launch(x, num_splits=1, **kwargs)
    assert len(numbaflash.operations.decode.gpu_state.GPU.plans) == 4


# ------------------------------------------------------------------ the torch op


def test_the_torch_op_takes_the_options(monkeypatch):
    torch = pytest.importorskip("torch")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from numbaflash import torch_ops

    seen = []

    def run(*args):
        seen.append(args[10:])
        q = args[0]
        return q.new_empty(q.shape), q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)

    monkeypatch.setattr(torch_ops, "run_kvcache", run)
    with FakeTensorMode():
        q = torch.empty(3, 1, 8, 64, dtype=torch.float16, device="cuda")
        kc = torch.empty(5, 100, 2, 64, dtype=torch.float16, device="cuda")
        lens = torch.empty(3, dtype=torch.int32, device="cuda")
        idx = torch.empty(3, dtype=torch.int32, device="cuda")
        out = torch_ops.flash_attention_with_kvcache(q, kc, kc.clone(), lens, None, None, None, True, 0.125,
                                                     0, -1, -1, 0.0, None, idx, idx)[0]
        assert out.shape == q.shape
        pair = torch.empty(3, 1, 8, 192, dtype=torch.float16, device="cuda")  # (192, 128): out at v's 128
        caches = kc.new_empty(5, 100, 2, 192), kc.new_empty(5, 100, 2, 128)
        out = torch_ops.flash_attention_with_kvcache(pair, *caches, lens, None, None, None, True, 0.125, 0,
                                                     -1, -1, 0.0)[0]
        assert out.shape == (3, 1, 8, 128)
        with pytest.raises(ValueError, match=r"cache_leftpad must be an int32 tensor of shape \(batch,\)"):
            torch_ops.flash_attention_with_kvcache(q, kc, kc.clone(), lens, None, None, None, True, 0.125, 0,
                                                   -1, -1, 0.0, None, idx, torch.empty(2, dtype=torch.int32,
                                                                                       device="cuda"))
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 1, 8, 64, generator=gen).half()
    kc, vc = (torch.randn(3, 40, 2, 64, generator=gen).half() for _ in range(2))
    lens, idx, pad = (torch.tensor(v, dtype=torch.int32) for v in ([5, 30], [2, 0], [1, 3]))
    torch.library.opcheck(torch.ops.numbaflash.flash_attention_with_kvcache.default,
                          (q, kc, vc, lens, None, None, None, True, 0.125, 0, -1, -1, 0.0, None, idx, pad),
                          test_utils=("test_schema",))
    assert seen and torch.equal(seen[-1][-2], idx) and torch.equal(seen[-1][-1], pad)


# ------------------------------------------------------------------ the rotary embedding


def test_the_rotary_reference_by_hand():
    """Angles of 90 degrees (cos 0, sin 1): halves turn (x0, x1, x2, x3) into (-x2, -x3, x0, x1),
    interleaved into (-x1, x0, -x3, x2); columns past rotary_dim stay; position 0 (cos 1, sin 0)
    changes nothing."""
    from numbaflash.tools.reference import rotary_embedding

    x = np.array([[[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]]])  # (1 row, 1 head, d 6), rotary_dim 4
    cos = np.array([[1.0, 1.0], [0.0, 0.0]])
    sin = np.array([[0.0, 0.0], [1.0, 1.0]])
    assert rotary_embedding(x, cos, sin, np.array([1]))[0, 0].tolist() == [-3, -4, 1, 2, 5, 6]
    assert rotary_embedding(x, cos, sin, np.array([1]), True)[0, 0].tolist() == [-2, 1, -4, 3, 5, 6]
    assert np.array_equal(rotary_embedding(x, cos, sin, np.array([0])), x)
    half = x.astype(np.float16)  # 16-bit inputs: float32 arithmetic, the dtype back
    assert rotary_embedding(half, cos, sin, np.array([1])).dtype == np.float16


def rope_table(rows: int, dim: int, base: float = 10000.0) -> tuple[np.ndarray, np.ndarray]:
    """The usual RoPE angles: position p, pair i at p / base^(2i / dim)."""
    angle = np.arange(rows)[:, None] / base ** (np.arange(dim // 2) * 2 / dim)[None, :]
    return np.cos(angle), np.sin(angle)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_scores_depend_on_the_distance_only(interleaved):
    """RoPE's defining property, in float64: rotating q at position p and k at p' gives the scores
    of p - p' only, so moving a whole sequence (cache_seqlens and its keys) leaves out as it was."""
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 3, 2, 32))
    k_new, v_new = rng.standard_normal((1, 3, 1, 32)), rng.standard_normal((1, 3, 1, 32))
    cos, sin = rope_table(64, 16)
    k_cache, v_cache = np.zeros((1, 40, 1, 32)), np.zeros((1, 40, 1, 32))
    outs = []
    for n in (0, 9, 30):  # no cached keys read: leftpad = cache_seqlens
        out, *_ = kvcache_reference(q, k_cache, v_cache, np.array([n]), k_new=k_new, v_new=v_new,
                                    cache_leftpad=np.array([n]), causal=True, rotary_cos=cos, rotary_sin=sin,
                                    rotary_interleaved=interleaved)
        outs.append(out)
    np.testing.assert_allclose(outs[1], outs[0], atol=1e-12)
    np.testing.assert_allclose(outs[2], outs[0], atol=1e-12)
    plain, *_ = kvcache_reference(q, k_cache, v_cache, np.array([9]), k_new=k_new, v_new=v_new,
                                  cache_leftpad=np.array([9]), causal=True)
    assert not np.allclose(plain, outs[0])  # and the rotation did something


def test_the_kvcache_reference_rotates_q_and_the_appended_keys():
    """Causal: query i at cache_seqlens + i; not causal: every query at cache_seqlens; new row t at
    cache_seqlens + t, written rotated into the cache (with leftpad and cache_batch_idx: positions
    are cache rows)."""
    from numbaflash.tools.reference import rotary_embedding

    rng = np.random.default_rng(2)
    q = rng.standard_normal((1, 2, 2, 16))
    k_cache, v_cache = rng.standard_normal((2, 20, 1, 16)), rng.standard_normal((2, 20, 1, 16))
    k_new, v_new = rng.standard_normal((1, 2, 1, 16)), rng.standard_normal((1, 2, 1, 16))
    cos, sin = rope_table(20, 16)
    for causal, step in ((True, 1), (False, 0)):
        out, lse, k_after, _ = kvcache_reference(
            q, k_cache, v_cache, np.array([5]), k_new=k_new, v_new=v_new, cache_batch_idx=np.array([1]),
            cache_leftpad=np.array([2]), causal=causal, rotary_cos=cos, rotary_sin=sin)
        rotated_k = rotary_embedding(k_new[0], cos, sin, np.array([5, 6]))
        assert np.array_equal(k_after[1, 5:7], rotated_k) and np.array_equal(k_after[0], k_cache[0])
        rotated_q = rotary_embedding(q[0], cos, sin, 5 + np.arange(2) * step)
        keys = np.concatenate([k_cache[1, 2:5], rotated_k])[None]
        values = np.concatenate([v_cache[1, 2:5], v_new[0]])[None]
        want, want_lse = attention_reference(rotated_q[None], keys, values, causal=causal)
        np.testing.assert_array_equal(out, want)
        np.testing.assert_array_equal(lse, want_lse)


def _table(rows, half, typestr="<f2"):
    return FakeDeviceArray((rows, half), typestr)


@pytest.mark.parametrize(("change", "error", "match"), [
    ({"rotary_cos": _table(320, 32)}, ValueError, "rotary_cos and rotary_sin must be given together"),
    ({"rotary_cos": _table(320, 32), "rotary_sin": _table(320, 32), "k_new": None, "v_new": None}, ValueError,
     "give k_new and v_new too"),
    ({"rotary_cos": _table(320, 12), "rotary_sin": _table(320, 12)}, ValueError,
     r"rotary_dim \(2 x rotary_cos.shape\[1\]\) must be a multiple of 16 from 16 to head_dim \(128\), "
     "got 24"),
    ({"rotary_cos": _table(320, 72), "rotary_sin": _table(320, 72)}, ValueError, "got 144"),
    ({"rotary_cos": _table(320, 32), "rotary_sin": _table(320, 16)}, ValueError,
     "rotary_sin must have rotary_cos's shape"),
    ({"rotary_cos": _table(320, 32, "<f4"), "rotary_sin": _table(320, 32, "<f4")}, TypeError,
     "rotary_cos must be float16 or bfloat16|rotary_cos: float16 or bfloat16|must be float16"),
    ({"rotary_cos": FakeDeviceArray((320, 32, 1)), "rotary_sin": _table(320, 32)}, ValueError,
     r"rotary_cos must have shape \(seqlen_ro, rotary_dim / 2\)"),
    ({"rotary_cos": _table(200, 32), "rotary_sin": _table(200, 32)}, ValueError,
     r"have 200 rows \(positions\), fewer than the cache holds a sequence \(300\)"),
    ({"rotary_cos": _table(320, 32), "rotary_sin": _table(320, 32), "rotary_interleaved": "yes"}, TypeError,
     "rotary_interleaved must be a bool"),
])
def test_a_bad_rotary_table_is_rejected_before_compiling(no_compile, change, error, match):
    x = {**inputs(seqlen_new=1), **change}
    x = {k: v for k, v in x.items() if v is not None}
    with pytest.raises(error, match=match):
        call(x)


@pytest.mark.parametrize(("kwargs", "step"), [({"causal": True}, 1), ({"causal": False}, 0),
                                              ({"causal": False, "window_size": (20, -1)}, 1),
                                              ({"causal": False, "window_size": (300, 300)}, 0)])
@pytest.mark.parametrize("interleaved", [False, True])
def test_a_rotary_call_passes_its_tables_and_sizes_last(fake_gpu, monkeypatch, kwargs, step, interleaved):
    """The rotary build (1 halves, 2 interleaved) with, after the other parameters, (cos, rows x
    dim / 2), (sin, ...), rotary_dim, the table's rows and the query rows' position step
    (FlashAttention's: 1 in causal and windowed calls; a window as wide as the cache is none)."""
    built = []
    monkeypatch.setattr(decode_op, "loaded_kernel", lambda spec: built.append(spec)
                        or (types.SimpleNamespace(handle=1), kernel_name(spec)))
    cos, sin = _table(320, 32), _table(320, 32)
    pad = FakeDeviceArray((2,), "<i4")
    args = _launch(inputs(seqlen_q=2, seqlen_new=2), num_splits=1, rotary_cos=cos, rotary_sin=sin,
                   rotary_interleaved=interleaved, cache_leftpad=pad, **kwargs)[0][2]
    assert [s.rotary for s in built if s.operation == "decode"] == [2 if interleaved else 1]
    assert args[-6] == (_pointer(pad), 2)
    assert args[-5:] == ((_pointer(cos), 320 * 32), (_pointer(sin), 320 * 32), 64, 320, step)


def test_rotary_declarations_and_names():
    pytest.importorskip("numba")
    from numbaflash.kernels.families import make_kernel

    for rotary, suffix in ((1, "_rope"), (2, "_ropei")):
        spec = kernel_spec("sm80dec", "decode", DecodeConfig(128), causal=True, leftpad=True, rotary=rotary)
        declared = kernel_params(spec)
        assert declared[-len(params.ROTARY):] == params.ROTARY
        assert declared[-len(params.ROTARY) - 1].name == "cache_leftpad"
        kernel = make_kernel(spec)
        assert tuple(inspect.signature(kernel).parameters) == params.names_of(declared)
        assert kernel.__name__ == f"flash_decode_d128_m16_n64_w4_s3_causal_f16_lpad{suffix}"
        assert spec.kind == "sm80dec.decode+leftpad+rotary"
    with pytest.raises(ValueError, match="rotary must be 0"):
        kernel_spec("sm80dec", "decode", DecodeConfig(128), rotary=3)
    assert kernel_spec("sm80", "forward", DecodeConfig(128), rotary=1).rotary == 0


def test_a_compiled_decode_step_with_every_option_has_no_graph_break(monkeypatch):
    """Under torch.compile the options reach the custom op (no graph break, fullgraph), which
    appends in place; here its kernel is ``kvcache_reference`` (CPU tensors, float32)."""
    torch = pytest.importorskip("torch")
    from numbaflash import torch_ops

    def run(q, k_cache, v_cache, lens, k_new, v_new, table, causal, scale, splits, window=(-1, -1),
            softcap=0.0, sink=None, idx=None, pad=None, cos=None, sin=None, interleaved=False):
        host = {"k_new": k_new.numpy(), "v_new": v_new.numpy(), "cache_batch_idx": idx.numpy(),
                "cache_leftpad": pad.numpy(), "rotary_cos": cos.numpy(), "rotary_sin": sin.numpy()}
        out, lse, k_after, v_after = kvcache_reference(q.numpy(), k_cache.numpy(), v_cache.numpy(),
                                                       lens.numpy(), causal=causal, softmax_scale=scale,
                                                       rotary_interleaved=interleaved, **host)
        k_cache.copy_(torch.from_numpy(k_after))
        v_cache.copy_(torch.from_numpy(v_after))
        return torch.from_numpy(out).to(q.dtype), torch.from_numpy(lse).float()

    monkeypatch.setattr(torch_ops, "run_kvcache", run)
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 1, 4, 32, generator=gen)
    kc, vc = (torch.randn(3, 20, 2, 32, generator=gen) for _ in range(2))
    kn, vn = (torch.randn(2, 1, 2, 32, generator=gen) for _ in range(2))
    lens, idx, pad = (torch.tensor(v, dtype=torch.int32) for v in ([5, 9], [2, 0], [1, 4]))
    angle = torch.arange(24)[:, None] / 10000.0 ** (torch.arange(8) / 8)[None, :]
    cos, sin = angle.cos().float(), angle.sin().float()

    def step(q, kc, vc, lens):
        out = numbaflash.flash_attention_with_kvcache(q, kc, vc, lens, k_new=kn, v_new=vn,
                                                      cache_batch_idx=idx, cache_leftpad=pad, rotary_cos=cos,
                                                      rotary_sin=sin, rotary_interleaved=True)
        lens.add_(1)
        return out

    explained = torch._dynamo.explain(step)(q, kc.clone(), vc.clone(), lens.clone())
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    eager = (kc.clone(), vc.clone(), lens.clone())
    want = run(q, eager[0], eager[1], eager[2], kn, vn, None, True, 32 ** -0.5, 0, idx=idx, pad=pad, cos=cos,
               sin=sin, interleaved=True)[0]
    got = torch.compile(step, backend="aot_eager", fullgraph=True)(q, kc, vc, lens)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert torch.equal(kc, eager[0]) and not torch.equal(kc[2, 5], kn[0, 0])  # appended rotated, at row 2
    assert torch.equal(lens, torch.tensor([6, 10], dtype=torch.int32))


# ------------------------------------------------------------------ torch calls of a known layout


def test_torch_option_calls_of_a_known_layout_take_the_plan(fake_gpu, monkeypatch):
    """A torch call with a learnable sink, cache_batch_idx and cache_leftpad whose layout has a
    plan skips the full checks (``decode.run_torch``) and fires the same launch with the new
    call's option pointers; vectors the plan cannot take (another length, dtype, device) are left
    to the full path, which names what is wrong."""
    torch = pytest.importorskip("torch")
    from numbaflash import operands, torch_route
    from numbaflash.operations import entry
    from tests.test_api_cpu import cuda_like

    monkeypatch.setattr(operands, "_RAW_STREAM", lambda ordinal: 7)
    monkeypatch.setattr(torch_route, "route_kvcache", lambda *args: None)  # as for real tensors, eagerly
    q = cuda_like(torch, (2, 1, 8, 128))
    kc, vc = cuda_like(torch, (5, 300, 2, 128)), cuda_like(torch, (5, 300, 2, 128))  # 5 rows: cache_batch_idx
    seqlens = cuda_like(torch, (2,), dtype=torch.int32)
    out = cuda_like(torch, q.shape)

    def options():
        return {"learnable_sink": cuda_like(torch, (8,), dtype=torch.float32),
                "cache_batch_idx": cuda_like(torch, (2,), dtype=torch.int32),
                "cache_leftpad": cuda_like(torch, (2,), dtype=torch.int32)}

    def run(opts):
        FakeLauncher.launches.clear()
        numbaflash.flash_attention_with_kvcache(q, kc, vc, seqlens, num_splits=1, out=out, **opts)
        return [args for _, _, _, _, args in FakeLauncher.launches]

    first = options()
    full = run(first)
    second = options()
    with monkeypatch.context() as patch:  # the plan serves this one: no describing
        patch.setattr(entry, "describe", None)
        planned = run(second)
    n = len(params.DECODE)
    assert len(full) == len(planned) == 1 and full[0][:n] == planned[0][:n]
    assert planned[0][n:] == tuple((second[name].data_ptr(), size) for name, size in
                                   (("learnable_sink", 8), ("cache_batch_idx", 2), ("cache_leftpad", 2)))
    for name, bad, error, match in (
            ("learnable_sink", cuda_like(torch, (4,), dtype=torch.float32), ValueError, r"\(heads_q,\)"),
            ("cache_batch_idx", cuda_like(torch, (2,), dtype=torch.int64), TypeError, "must be int32"),
            ("cache_leftpad", cuda_like(torch, (2,), ordinal=1, dtype=torch.int32), ValueError, "device")):
        with pytest.raises(error, match=match):
            run({**options(), name: bad})


@pytest.mark.parametrize(("causal", "window"), [(True, (-1, -1)), (False, (-1, -1)), (False, (20, -1))])
@pytest.mark.parametrize("interleaved", [False, True])
def test_torch_rotary_calls_of_a_known_layout_take_the_plan(fake_gpu, monkeypatch, causal, window,
                                                             interleaved):
    """A torch rotary call (with a sink and cache_leftpad) whose layout has a plan skips the full
    checks and fires the full path's launch with the new call's table pointers; tables of
    another dtype, or a rotary_interleaved that is not a bool, are left to the full path."""
    torch = pytest.importorskip("torch")
    from numbaflash import operands, torch_route
    from numbaflash.operations import entry
    from tests.test_api_cpu import cuda_like

    monkeypatch.setattr(operands, "_RAW_STREAM", lambda ordinal: 7)
    monkeypatch.setattr(torch_route, "route_kvcache", lambda *args: None)  # as for real tensors, eagerly
    q = cuda_like(torch, (2, 2, 8, 128))
    k_new, v_new = cuda_like(torch, (2, 2, 2, 128)), cuda_like(torch, (2, 2, 2, 128))
    kc, vc = cuda_like(torch, (2, 300, 2, 128)), cuda_like(torch, (2, 300, 2, 128))
    seqlens, out = cuda_like(torch, (2,), dtype=torch.int32), cuda_like(torch, q.shape)

    def run(cos, sin, flag=interleaved):
        FakeLauncher.launches.clear()
        numbaflash.flash_attention_with_kvcache(
            q, kc, vc, seqlens, k_new=k_new, v_new=v_new, num_splits=1, out=out, causal=causal,
            window_size=window, learnable_sink=cuda_like(torch, (8,), dtype=torch.float32),
            cache_leftpad=cuda_like(torch, (2,), dtype=torch.int32), rotary_cos=cos, rotary_sin=sin,
            rotary_interleaved=flag)
        return [args for _, _, _, _, args in FakeLauncher.launches]

    full = run(cuda_like(torch, (300, 32)), cuda_like(torch, (300, 32)))
    cos, sin = cuda_like(torch, (300, 32)), cuda_like(torch, (300, 32))
    with monkeypatch.context() as patch:  # the plan serves this one: no describing
        patch.setattr(entry, "describe", None)
        planned = run(cos, sin)
    n = len(params.DECODE)
    assert len(full) == len(planned) == 1
    assert full[0][:n] == planned[0][:n] and full[0][-3:] == planned[0][-3:]  # rotary_dim, rows, step
    assert planned[0][-5:-3] == ((cos.data_ptr(), 300 * 32), (sin.data_ptr(), 300 * 32))
    with pytest.raises(TypeError, match="rotary_cos must be float16"):
        run(*(cuda_like(torch, (300, 32), dtype=torch.bfloat16) for _ in range(2)))
    with pytest.raises(TypeError, match="rotary_interleaved must be a bool"):
        run(cos, sin, flag=1)


# ------------------------------------------------------------------ V's head dim apart (issue 56 item 2)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("splits", [1, 4])
def test_a_pair_of_head_dims_decodes_at_v_s_width(fake_gpu, monkeypatch, paged, splits):
    """(192, 128): the pair's decode build (K 192 columns, V and O 128), out and the combine at
    V's width: one combine warp per 32 of its columns, the scratch's partial rows 128 floats;
    k_new and v_new each at its cache's head dim, an out of q's head dim refused."""
    built = []
    monkeypatch.setattr(decode_op, "loaded_kernel", lambda spec: built.append(spec)
                        or (types.SimpleNamespace(handle=1), kernel_name(spec)))
    x = inputs(seqlen_q=2, seqlen_new=1, d=192, paged=paged)
    x["v_cache"] = FakeDeviceArray((*x["v_cache"].shape[:3], 128))
    x["v_new"] = FakeDeviceArray((2, 1, 2, 128))
    out, lse = call(x, num_splits=splits, return_lse=True)
    assert out.shape == (2, 2, 8, 128) and lse.shape == (2, 8, 2)
    spec = next(s for s in built if s.operation == "decode")
    assert (spec.config.head_dim, spec.config.value_dim) == (192, 128)
    if splits > 1:
        _, grid, _, _, args = FakeLauncher.launches[1]
        n = 2 * 8 * 2 * splits
        assert grid == (2 * 8 * 2 * (128 // 32) // 4, 1, 1)
        assert args[0][1] == n * (128 + 1) + SCRATCH_TAIL_ROWS * 128
    with pytest.raises(ValueError, match=r"v_new must be .* \(2, 1, 2, 128\)"):
        call({**x, "v_new": FakeDeviceArray((2, 1, 2, 192))}, num_splits=splits)
    with pytest.raises(ValueError, match=r"out must have q's shape with v's head_dim \(2, 2, 8, 128\)"):
        call(x, num_splits=splits, out=FakeDeviceArray((2, 2, 8, 192)))
    with pytest.raises(ValueError, match="no kernel for q/k head_dim 192 with v head_dim 64"):
        call({**x, "v_cache": FakeDeviceArray((*x["v_cache"].shape[:3], 64)),
              "v_new": FakeDeviceArray((2, 1, 2, 64))}, num_splits=splits)
