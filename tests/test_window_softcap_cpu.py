"""Sliding window and softcap (issue 35) on the CPU: validation messages, the backward's acceptance,
the window rule, the KV tile range and masks of the mma.sync kernel (run through the device
functions' Python bodies against brute force), which kernel a call dispatches (the mma.sync
family on Hopper too) and what it is launched with, and the torch op's fake kernel and autograd."""

from __future__ import annotations

import re

import numpy as np
import pytest
from test_api_cpu import (  # noqa: F401  (fixtures)
    FakeDeviceArray,
    fake_device,
    fake_qkv,
    packed,
    parameters,
    pointer,
    qkv,
    sm80_arguments,
)

import numbaflash
from numbaflash import configs
from numbaflash.kernels import blocks
from numbaflash.kernels.families import SM80, family_of, kernel_abi, spec_of
from numbaflash.operations import backward, forward
from numbaflash.runtime import device
from numbaflash.tools.reference import attention_reference, visible_keys

band_kv_tiles = blocks.band_kv_tiles.py_func
band_needs_mask = blocks.band_needs_mask.py_func
mask_band = blocks.mask_band.py_func


@pytest.fixture
def no_compile(monkeypatch):
    """A pretend Hopper GPU; reaching compilation (forward or backward) fails the test."""
    def compile_(*args, **kwargs):
        raise AssertionError("would compile a kernel")

    monkeypatch.setattr(device.GPU, "current", lambda: ((9, 0), 0))
    monkeypatch.setattr(forward, "forward_kernel", compile_)
    monkeypatch.setattr(backward, "run_device", compile_)
    monkeypatch.setattr(backward, "run_numpy", compile_)


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize("window", [(4,), (1, 2, 3), 5, "4,0", None, (1.0, 0), (True, 0),
                                    (0, np.bool_(False)), {4: 0}])
def test_window_size_type(window, no_compile):
    with pytest.raises(TypeError, match=re.escape("window_size must be a pair (left, right) of ints, each -1 "
                                                  "(unbounded) or >= 0, got")):
        numbaflash.flash_attention(*qkv(), window_size=window)


@pytest.mark.parametrize("window", [(-2, 0), (0, -2), (-5, -5), (-1, -100)])
def test_window_size_values(window, no_compile):
    with pytest.raises(ValueError, match=re.escape(f"each -1 (unbounded) or >= 0, got {window}")):
        numbaflash.flash_attention(*qkv(), window_size=window)


@pytest.mark.parametrize("window", [(-1, -1), (0, 0), (4, -1), [3, 7], (np.int64(2), np.int32(0)),
                                    (10**12, 0)])
def test_good_window_reaches_the_kernel(window, no_compile):
    with pytest.raises(AssertionError, match="would compile"):
        numbaflash.flash_attention(*qkv(), window_size=window)


@pytest.mark.parametrize("softcap", ["30", True, np.bool_(True), None, 1j, [30.0]])
def test_softcap_type(softcap, no_compile):
    with pytest.raises(TypeError, match="softcap must be a real number \\(0 for none\\), got"):
        numbaflash.flash_attention(*qkv(), softcap=softcap)


@pytest.mark.parametrize("softcap", [-1.0, -1e-30, float("nan"), float("inf"), -float("inf")])
def test_softcap_values(softcap, no_compile):
    with pytest.raises(ValueError, match=f"softcap must be 0 \\(off\\) or a positive finite number, got "
                                         f"{re.escape(repr(softcap))}"):
        numbaflash.flash_attention(*qkv(), softcap=softcap)


@pytest.mark.parametrize("softcap", [1e-39, 1e300])
def test_softcap_must_give_normal_float32_factors(softcap, no_compile):
    with pytest.raises(ValueError, match="softcap \\* log2\\(e\\) and softmax_scale / softcap must be normal "
                                         f"float32 values .*got softcap {re.escape(repr(softcap))}"):
        numbaflash.flash_attention(*qkv(), softcap=softcap)


@pytest.mark.parametrize("softcap", [0, 0.0, 30, 50.0, np.float32(30.0), np.int64(20)])
def test_good_softcap_reaches_the_kernel(softcap, no_compile):
    with pytest.raises(AssertionError, match="would compile"):
        numbaflash.flash_attention(*qkv(), softcap=softcap)


def backward_args():
    q, k, v = qkv()
    return q, q, k, v, q, np.zeros((1, 4, 8), np.float32)  # dout, q, k, v, out, lse


@pytest.mark.parametrize(("kwargs", "named"), [({"window_size": (4, 0)}, "window_size=(4, 0)"),
                                               ({"window_size": (-1, 3)}, "window_size=(-1, 3)"),
                                               ({"softcap": 30.0}, "softcap=30.0"),
                                               ({"softcap": 50, "window_size": (-1, -1)}, "softcap=50.0")])
def test_backward_takes_window_and_softcap(kwargs, named, no_compile):
    """The backward has them (tests/test_backward_window_cpu.py): a good value reaches the kernels."""
    with pytest.raises(AssertionError, match="would compile"):
        numbaflash.flash_attention_backward(*backward_args(), **kwargs)


def test_backward_accepts_the_defaults(no_compile):
    with pytest.raises(AssertionError, match="would compile"):
        numbaflash.flash_attention_backward(*backward_args(), window_size=(-1, -1), softcap=0.0)


def test_backward_bad_window_and_softcap_values_raise_the_forwards_errors(no_compile):
    with pytest.raises(ValueError, match="each -1 \\(unbounded\\) or >= 0, got \\(-3, 0\\)"):
        numbaflash.flash_attention_backward(*backward_args(), window_size=(-3, 0))
    with pytest.raises(TypeError, match="softcap must be a real number"):
        numbaflash.flash_attention_backward(*backward_args(), softcap="30")


# ------------------------------------------------------------------ the window rule and the variant


def test_reference_rule_is_flash_attentions():
    """query i sees key j iff i + sk - sq - left <= j <= i + sk - sq + right; causal: right = 0."""
    sq, sk = 5, 9
    seen = visible_keys(sq, sk, False, (2, 1))
    for i in range(sq):
        for j in range(sk):
            assert seen[i, j] == (i + sk - sq - 2 <= j <= i + sk - sq + 1)
    assert (visible_keys(sq, sk, True, (2, -1)) == visible_keys(sq, sk, False, (2, 0))).all()
    assert (visible_keys(sq, sk, True) == visible_keys(sq, sk, False, (-1, 0))).all()
    assert visible_keys(sq, sk).all()


# (sq, sk, causal, window): each branch of ``effective_window`` and each kernel it can lead to, at
# the edges where a side stops bounding anything (left = sk - 2 / sk - 1, right = sq - 2 / sq - 1),
# then a few random draws.
EFFECTIVE_WINDOW_CASES = [
    (7, 64, False, (-1, -1)),  # no window: the plain kernel
    (7, 64, True, (-1, -1)),  # the causal one
    (200, 64, True, (-1, -1)),  # causal, rows that see no key
    (64, 64, False, (0, 0)),  # the diagonal alone
    (64, 64, True, (5, 3)),  # causal sets right to 0: a band ending at the diagonal
    (7, 64, False, (62, 0)),  # left = sk - 2: still bounds a row
    (7, 64, False, (63, 0)),  # left = sk - 1: bounds nothing, so the causal kernel
    (7, 64, False, (-1, 5)),  # right = sq - 2: still bounds a row
    (7, 64, False, (-1, 6)),  # right = sq - 1: bounds nothing, so the plain kernel
    (7, 64, False, (4096, 4096)),  # both sides wider than the problem
    (1, 130, True, (3, -1)),  # one query row: causal's right 0 bounds nothing
    (1, 1, False, (0, 0)),  # one query, one key: (0, 0) bounds nothing
    (200, 3, False, (1, 0)),  # sq > sk: rows above the band see nothing
    (2, 3, True, (-1, 2)),  # causal overrides the right side: the causal kernel
    (130, 1, False, (0, 200)),
]
_draws = np.random.default_rng(35).integers(1, 260, (5, 5))  # sq, sk, causal, left, right
EFFECTIVE_WINDOW_CASES += [(int(sq), int(sk), bool(c % 2), (max(int(left) - 2, -1), max(int(right) - 2, -1)))
                           for sq, sk, c, left, right in _draws]


@pytest.mark.parametrize(("sq", "sk", "causal", "window"), EFFECTIVE_WINDOW_CASES)
def test_effective_window_keeps_the_rule(sq, sk, causal, window):
    """Normalising a side that bounds nothing to -1 never changes which keys a row sees, and a
    window that bounds nothing runs the plain or causal kernel."""
    left, right = forward.effective_window(causal, window, sq, sk)
    assert (visible_keys(sq, sk, False, (left, right)) == visible_keys(sq, sk, causal, window)).all()
    var = forward.variant_of(causal, window, 0.0, 0.125, sq, sk)
    if (left, right) == (-1, -1):
        assert not var.window and not var.causal
    elif (left, right) == (-1, 0):
        assert not var.window and var.causal
    else:
        assert var.window and not var.softcap
        assert var.window_left == (left if left >= 0 else forward.WINDOW_UNBOUNDED)
        assert var.window_right == (right if right >= 0 else forward.WINDOW_UNBOUNDED)
    assert var.rows_end_at_diagonal == (right == 0)


def test_calls_without_a_window_run_what_they_always_ran():
    for causal in (False, True):
        for sq in (1, 100):
            var = forward.variant_of(causal, (-1, -1), 0.0, 0.125, sq, 50)
            assert (var.window, var.softcap, var.causal, var.window_left, var.window_right) == \
                (False, False, causal, 0, 0)
            assert var.scale_log2 == np.float32(0.125 * np.log2(np.e)) and var.cap_scale == 0


def test_softcap_factors():
    var = forward.variant_of(False, (-1, -1), 30.0, 0.125, 64, 64)
    assert var.softcap and not var.window
    assert var.scale_log2 == np.float32(30.0 * np.log2(np.e)) and var.cap_scale == np.float32(0.125 / 30.0)
    var = forward.variant_of(True, (8, -1), 50.0, 0.1, 64, 64)
    assert var.window and var.softcap and var.causal


def test_the_variants_factors_give_flash_attentions_softcap():
    """What the kernel computes with them, exp2(tanh(s · cap_scale) · scale_log2), is
    exp(softcap · tanh(s · scale / softcap))."""
    s = np.linspace(-3000, 3000, 101)
    scale, cap = 0.0884, 30.0
    var = forward.variant_of(False, (-1, -1), cap, scale, 64, 64)
    kernel = np.exp2(np.tanh(s * np.float64(var.cap_scale)) * np.float64(var.scale_log2))
    np.testing.assert_allclose(kernel, np.exp(cap * np.tanh(s * scale / cap)), rtol=1e-5)


def test_variant_specs():
    """A window kernel is built non-causal (its right side 0 is causal masking), a softcap kernel
    causal or not; the window and softcap variants take the plain kernel's parameter list (varlen
    its own)."""
    config = configs.DEFAULTS[("sm80", 64)]
    for softcap in (False, True):
        assert not spec_of(config, causal=True, window=True, softcap=softcap).causal
    assert spec_of(config, causal=True, softcap=True).causal
    dense = {kernel_abi(spec_of(config, window=w, softcap=c)) for w in (False, True) for c in (False, True)}
    assert dense == {kernel_abi(spec_of(config))} != {kernel_abi(spec_of(config, varlen=True))}
    assert SM80.runs("forward", varlen=True)


# ------------------------------------------------------------------ tile range and masks (kernel pieces)

SHAPES = [(1, 1), (1, 300), (300, 1), (100, 100), (129, 300), (300, 129), (64, 64), (500, 64)]
WINDOWS = [(0, 0), (1, 0), (0, 1), (127, 0), (5, 9), (33, 2), (-1, 0), (0, -1), (-1, 5), (70, -1),
           (4096, 4096)]


# Each window on two shapes of different kinds (one query or one key, square, sq < sk, sq > sk,
# ends inside and past a tile), the windows that leave whole row blocks seeing nothing, and a few
# random draws: the cases that can fail differently rather than their whole product. Each case
# takes one of the tile shapes in turn (``BLOCK_CASES``).
BAND_CASES = [(*SHAPES[(i + shift) % len(SHAPES)], window)
              for i, window in enumerate(WINDOWS) for shift in (0, 3)]
BAND_CASES += [(300, 129, (-1, 0)), (500, 64, (0, 0)), (500, 64, (1, 0)), (129, 300, (0, 0))]
_draws = np.random.default_rng(54)
BAND_CASES += [(int(_draws.integers(1, 600)), int(_draws.integers(1, 600)),
                (int(_draws.integers(-1, 300)), int(_draws.integers(-1, 300)))) for _ in range(4)]
TILE_SHAPES = [(128, 64), (64, 128), (128, 128)]  # (block_m, block_n)
BLOCK_CASES = [(*case, *TILE_SHAPES[i % len(TILE_SHAPES)]) for i, case in enumerate(BAND_CASES)]


def band_of(sq, sk, window):
    left, right = window
    diag = sk - sq
    return blocks.Band(sk, diag - (forward.WINDOW_UNBOUNDED if left < 0 else left),
                       diag + (forward.WINDOW_UNBOUNDED if right < 0 else right))


@pytest.mark.parametrize(("sq", "sk", "window", "block_m", "block_n"), BLOCK_CASES)
def test_band_kv_tiles(sq, sk, window, block_m, block_n):
    """Every key a block's rows see lies in its tile range; the range's first and last tiles each
    hold a seen key; a block that sees nothing gets an empty range; the range costs the window."""
    seen = visible_keys(sq, sk, False, window)
    band = band_of(sq, sk, window)
    left, right = window
    for m0 in range(0, sq, block_m):
        rows = min(block_m, sq - m0)
        first, end = band_kv_tiles(m0, rows, block_n, band)
        keys = np.flatnonzero(seen[m0:m0 + rows].any(axis=0))
        if keys.size == 0:
            assert first == end
            continue
        assert first * block_n <= keys[0] and keys[-1] < end * block_n
        assert keys[0] // block_n == first and keys[-1] // block_n == end - 1
        if left >= 0 and right >= 0:
            assert end - first <= -(-(rows - 1 + left + right + 1) // block_n) + 1


@pytest.mark.parametrize(("sq", "sk", "window"), BAND_CASES)
def test_band_needs_mask_is_sound(sq, sk, window):
    """Where a warp's tile is said to need no mask, every score in it is visible."""
    seen = np.zeros((sq + 32, sk + 128), bool)  # rows and keys past the ends: never seen
    seen[:sq, :sk] = visible_keys(sq, sk, False, window)
    band = band_of(sq, sk, window)
    for rows in (16, 32):
        for row_first in range(0, sq, rows):
            for col0 in range(0, sk, 64):
                if not band_needs_mask(col0, 64, row_first, rows, band):
                    block = seen[row_first:row_first + rows, col0:col0 + 64]
                    assert block[: max(0, min(rows, sq - row_first))].all()


@pytest.mark.parametrize(("sq", "sk"), [(40, 200), (200, 40), (100, 100)])
@pytest.mark.parametrize("window", [(0, 0), (3, 1), (17, -1), (-1, 5), (2, 40)])
def test_mask_band_matches_the_rule(sq, sk, window):
    """Every lane's fragment of a 16-row m-tile: -inf exactly where the rule hides the key."""
    seen = np.zeros((sq + 16, sk + 64), bool)
    seen[:sq, :sk] = visible_keys(sq, sk, False, window)
    band = band_of(sq, sk, window)
    n_tiles = 8  # 64 keys
    for row0 in range(0, sq, 16):
        for col0 in range(0, sk, 64):
            for lane in range(32):
                s = np.ones((n_tiles, 4), np.float32)
                mask_band(s, n_tiles, col0, row0, lane, band)
                g, t = lane // 4, lane % 4
                for j in range(n_tiles):
                    for e in range(4):
                        row, col = row0 + g + 8 * (e // 2), col0 + 2 * t + 8 * j + e % 2
                        if row < sq:
                            assert (s[j, e] == 1) == seen[row, col], (row0, col0, lane, j, e)


# ------------------------------------------------------------------ dispatch and launch (GPU faked)


@pytest.mark.parametrize("capability", [(9, 0), (8, 0)])
def test_every_forward_operation_runs_the_gpus_own_family(capability):
    """Both forward families have the window, softcap and packed variable-length kernels: a call
    with any runs its GPU's own family where that family has the head dim (Hopper: not 32)."""
    own = configs.arch_family(capability)
    for d in configs.SUPPORTED_HEAD_DIMS:
        expected = own if d in configs.FAMILY_HEAD_DIMS[own] else "sm80"
        for varlen in (False, True):
            assert configs.dispatch_family(capability, d, varlen) == expected, (d, varlen)
            for window in (False, True):
                for causal in (False, True):
                    config = configs.forward_config(capability, d, causal, window=window, varlen=varlen)
                    assert family_of(config).name == expected and family_of(config).runs("forward", varlen)


def test_a_forced_config_serves_every_operation_its_family_has():
    """A forced config (``force_config``) serves every kernel operation of its family, and is
    passed over for one it lacks (then the sm80 family's config runs)."""
    ws = configs.forward_config((9, 0), 128, False)
    with configs.force_config((9, 0), False, ws):
        for window, varlen in ((False, False), (True, False), (False, True), (True, True)):
            assert configs.forward_config((9, 0), 128, False, window=window, varlen=varlen) == ws


@pytest.mark.parametrize(("capability", "head_dim"), [((9, 0), 32), ((8, 0), 64)])
@pytest.mark.parametrize(("causal", "window", "softcap", "variant", "sides"), [
    (False, (64, 0), 0.0, (True, False), (64, 0)),
    (True, (64, -1), 0.0, (True, False), (64, 0)),
    (False, (-1, 3), 0.0, (True, False), (forward.WINDOW_UNBOUNDED, 3)),
    (False, (-1, -1), 30.0, (False, True), (0, 0)),
    (True, (10, 10), 50.0, (True, True), (10, 0)),
])
def test_window_and_softcap_launch(fake_device, capability, head_dim, causal, window, softcap, variant,  # noqa: F811
                                  sides):
    """The call loads its variant of the mma.sync kernel (on Hopper at head dim 32, which only
    that family has; Hopper's own head dims run the sm90 variant: GPU tests) and launches it with
    the window's sides and the softcap's factors after the plain kernel's parameters; a second
    call of the layout reuses the plan."""
    loads = []
    real = forward.loaded_kernel

    def loaded_kernel(spec):
        loads.append(spec)
        return real(spec)

    forward.loaded_kernel = loaded_kernel
    try:
        fake_device.capability = capability
        shape_q, shape_k = (2, 200, 4, head_dim), (2, 300, 2, head_dim)
        for _ in range(2):
            q, k, v = fake_qkv(shape_q, shape_k)
            out = FakeDeviceArray(shape_q)
            numbaflash.flash_attention(q, k, v, causal=causal, window_size=window, softcap=softcap,
                                       softmax_scale=0.5, out=out)
    finally:
        forward.loaded_kernel = real
    spec, = loads
    config = spec.config
    assert (spec.window, spec.softcap) == variant and family_of(config) is SM80
    assert spec.causal == (causal and not spec.window)  # as built
    launch = fake_device.launches.seen[-1]
    scale_log2 = np.float32((softcap or 0.5) * np.log2(np.e))
    expected = sm80_arguments(config, pointer(q), pointer(k), pointer(v), pointer(out),
                              (device.GPU.scratch[0], 1), shape_q, shape_k, 0.5, False)
    expected = (*expected[:-5], scale_log2, False, *sides, np.float32(0.5 / softcap if softcap else 0.0))
    assert parameters(config, launch) == packed(config, *expected)
    assert len(device.GPU.plans) == 1 and len(fake_device.launches.seen) == 2


def test_plain_calls_launch_the_plain_kernel_with_zero_extras(fake_device):  # noqa: F811
    fake_device.capability = (8, 0)
    q, k, v = fake_qkv()
    out = FakeDeviceArray((1, 8, 4, 64))
    numbaflash.flash_attention(q, k, v, causal=True, out=out)
    config = configs.forward_config((8, 0), 64, True)
    expected = sm80_arguments(config, pointer(q), pointer(k), pointer(v), pointer(out),
                              (device.GPU.scratch[0], 1), (1, 8, 4, 64), (1, 8, 2, 64), 0.125, False)
    assert expected[-3:] == (0, 0, np.float32(0.0))
    assert parameters(config, fake_device.launches.seen[-1]) == packed(config, *expected)


# ------------------------------------------------------------------ torch op


def test_torch_op_fake_kernel_and_autograd(monkeypatch):
    torch = pytest.importorskip("torch")
    from numbaflash import torch_ops

    calls = []

    def forward_ref(q, k, v, causal, softmax_scale, window_size=(-1, -1), softcap=0.0):
        calls.append((causal, softmax_scale, window_size, softcap))
        arrays = (x.detach().double().numpy() for x in (q, k, v))
        out, lse = attention_reference(*arrays, causal=causal, softmax_scale=softmax_scale,
                                       window_size=window_size, softcap=softcap)
        return torch.from_numpy(out).to(q.dtype), torch.from_numpy(lse).float()

    backward_calls = []

    def no_backward(*args):
        backward_calls.append(args[6:])  # causal, softmax_scale, deterministic[, window, softcap]
        q, k, v = args[1:4]
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    monkeypatch.setattr(torch_ops, "run_forward", forward_ref)
    monkeypatch.setattr(torch_ops, "run_backward", no_backward)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, generator=gen).half() for s in ((1, 40, 2, 64), (1, 50, 2, 64), (1, 50, 2, 64)))
    op = torch.ops.numbaflash.flash_attention_forward
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        out, lse = op(mode.from_tensor(q), mode.from_tensor(k), mode.from_tensor(v), False, 0.125, 4, 0, 30.0)
        assert out.shape == q.shape and lse.shape == (1, 2, 40) and lse.dtype == torch.float32
        with pytest.raises(ValueError, match="window_size must be"):
            op(mode.from_tensor(q), mode.from_tensor(k), mode.from_tensor(v), False, 0.125, -3, 0, 0.0)
    # Without grad the op's forward runs the window and softcap.
    out, lse = op(q, k, v, True, 0.125, 4, -1, 30.0)
    assert calls[-1] == (True, 0.125, (4, -1), 30.0)
    ref, _ = attention_reference(q.double().numpy(), k.double().numpy(), v.double().numpy(), causal=True,
                                 softmax_scale=0.125, window_size=(4, -1), softcap=30.0)
    np.testing.assert_allclose(out.double().numpy(), ref, atol=2e-3)
    # Through the API with grad: the forward's window and softcap reach the backward op.
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    for kwargs, expected in (({"window_size": (4, 0)}, ((4, 0), 0.0)), ({"softcap": 30.0}, ((-1, -1), 30.0))):
        numbaflash.flash_attention(qg, kg, vg, **kwargs).float().sum().backward()
        assert backward_calls[-1][-2:] == expected
    out, _ = op(qg, kg, vg, False, 0.125, 4, 0, 0.0)
    out.float().sum().backward()
    assert backward_calls[-1][-2:] == ((4, 0), 0.0)
    # Plain calls still reach the op's stand-in with the five original arguments.
    op(q, k, v, False, 0.125)
    assert calls[-1] == (False, 0.125, (-1, -1), 0.0)
