"""The backward's host side with no GPU: every bad input is rejected before anything is compiled
or launched; the grid, workspace and config arithmetic; the launches' arguments against the
kernels' parameter lists (``kernels.abi``), with the driver and the kernels faked; the numpy
staging; and what precompile and inspect list."""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import re
import sys
import threading
import types

import numpy as np
import pytest

import numbaflash
from numbaflash import configs, operands
from numbaflash.kernels import families, params
from numbaflash.kernels.abi import BACKWARD_ABI, BACKWARD_DQ_ABI, BACKWARD_PREP_ABI, BACKWARD_ROW_ALIGN
from numbaflash.kernels.shapes import PREP_ROWS, PREP_THREADS, BackwardConfig, prep_split
from numbaflash.kernels.spec import kernel_spec
from numbaflash.operations import backward
from numbaflash.operations.launch_backward import (
    backward_grids,
    backward_rows,
    check_backward_grid,
    workspace_layout,
)
from numbaflash.runtime import device, map_slots
from numbaflash.runtime import launch as runtime_launch

HOPPER, AMPERE, SM86 = (9, 0), (8, 0), (8, 6)


def hopper(config: BackwardConfig) -> BackwardConfig:
    """``config`` as an H100 compiles it (the dQ accumulator added four floats at a time)."""
    return dataclasses.replace(config, dq_vector=4)
ABIS = {"backward_prep": BACKWARD_PREP_ABI, "backward": BACKWARD_ABI, "backward_dq": BACKWARD_DQ_ABI}


class FakeDeviceArray:
    """Just enough of ``__cuda_array_interface__`` to be a device array; each gets its own (fake)
    1 GB-aligned address unless ``pointer`` is given."""

    next_pointer = 1 << 40

    def __init__(self, shape, typestr="<f2", strides=None, pointer=None):
        if pointer is None:
            pointer = FakeDeviceArray.next_pointer
            FakeDeviceArray.next_pointer += 1 << 30
        self.shape = tuple(shape)
        self.__cuda_array_interface__ = {
            "shape": tuple(shape), "typestr": typestr, "data": (pointer, False), "strides": strides,
            "version": 3,
        }

    @property
    def pointer(self) -> int:
        return self.__cuda_array_interface__["data"][0]


Q_SHAPE, K_SHAPE = (2, 8, 4, 64), (2, 8, 2, 64)
LSE_SHAPE = (2, 4, 8)


def host_inputs(q_shape=Q_SHAPE, k_shape=K_SHAPE, dtype=np.float16):
    """dout, q, k, v, out, lse as numpy arrays (keyword dict, the API's argument names)."""
    b, s, h, _ = q_shape
    return {"dout": np.zeros(q_shape, dtype), "q": np.zeros(q_shape, dtype), "k": np.zeros(k_shape, dtype),
            "v": np.zeros(k_shape, dtype), "out": np.zeros(q_shape, dtype),
            "lse": np.zeros((b, h, s), np.float32)}


def device_inputs(q_shape=Q_SHAPE, k_shape=K_SHAPE):
    b, s, h, _ = q_shape
    return {"dout": FakeDeviceArray(q_shape), "q": FakeDeviceArray(q_shape), "k": FakeDeviceArray(k_shape),
            "v": FakeDeviceArray(k_shape), "out": FakeDeviceArray(q_shape),
            "lse": FakeDeviceArray((b, h, s), "<f4")}


def call(inputs: dict, **kwargs):
    x = inputs
    return numbaflash.flash_attention_backward(x["dout"], x["q"], x["k"], x["v"], x["out"], x["lse"],
                                               **kwargs)


@pytest.fixture
def no_compile(monkeypatch):
    """Pretend a Hopper GPU is current, and fail if validation lets a call reach the kernels:
    each bad input must be rejected before anything is compiled or launched."""
    def compile_(*args, **kwargs):
        raise AssertionError("would compile a kernel")

    monkeypatch.setattr(device.GPU, "current", lambda: (HOPPER, 0))
    # what picks the GQA split before the kernels (``backward.call_group_splits``): an H100's
    monkeypatch.setattr(device.GPU, "shared_limit", lambda ordinal: 227 * 1024)
    monkeypatch.setattr(device.GPU, "sm_count", lambda ordinal: 132)
    monkeypatch.setattr(backward, "backward_kernels", compile_)
    monkeypatch.setattr(backward, "loaded_kernel", compile_)
    monkeypatch.setattr(configs, "kernel_cubin", compile_)


# ------------------------------------------------------------------ validation


def with_(kind: str, **changes):
    """The good inputs of ``kind`` (host or device) with some replaced (values: callables of the
    good inputs)."""
    def make():
        inputs = host_inputs() if kind == "host" else device_inputs()
        return {**inputs, **{name: f(inputs) for name, f in changes.items()}}
    return make


def _ro(x):
    x = x.copy()
    x.flags.writeable = False
    return x


BF16 = operands.bfloat16_dtype()  # ml_dtypes' (a test dependency), or None
needs_bf16 = pytest.mark.skipif(BF16 is None, reason="needs ml_dtypes")

BAD_INPUTS = [
    # q, k, v: the forward's rules
    (with_("host", q=lambda i: i["q"][0]), {}, ValueError, "q must have 4 dimensions"),
    (with_("host", k=lambda i: np.zeros((2, 8, 3, 64), np.float16),
           v=lambda i: np.zeros((2, 8, 3, 64), np.float16)), {}, ValueError, "multiple of heads"),
    (lambda: host_inputs((2, 8, 4, 264), (2, 8, 2, 264)), {}, ValueError,
     r"head_dim must be one of \(32, 64, 96, 128, 256\), got 264"),
    (with_("host", q=lambda i: np.zeros((2, 8, 4, 32), np.float16)), {}, ValueError,
     "q and k must have the same head_dim, got 32 and 64"),
    (with_("host", q=lambda i: i["q"].astype(np.float32)), {}, TypeError, "q must be float16 or bfloat16"),
    (with_("host", v=lambda i: i["v"][:, :4]), {}, ValueError, "k and v must have the same shape"),
    (with_("host", q=lambda i: FakeDeviceArray(Q_SHAPE)), {}, TypeError, "not a mix"),
    (with_("host", q=lambda i: i["q"].tolist()), {}, TypeError, "q must be a numpy array or a CUDA array"),
    # dout and out: q's place, shape and dtype
    (with_("host", dout=lambda i: i["dout"][:, :4]), {}, ValueError,
     r"dout must have q's shape \(2, 8, 4, 64\) and dtype float16, got \(2, 4, 4, 64\) float16"),
    pytest.param(with_("host", out=lambda i: i["out"].astype(BF16)), {}, ValueError,
                 r"out must have q's shape \(2, 8, 4, 64\) and dtype float16, got \(2, 8, 4, 64\) bfloat16",
                 marks=needs_bf16),
    (with_("host", dout=lambda i: i["dout"].astype(np.float32)), {}, TypeError,
     "dout must be float16 or bfloat16"),
    (with_("host", out=lambda i: FakeDeviceArray(Q_SHAPE)), {}, TypeError,
     "out must be a numpy \\(host\\) array like q, got a device array"),
    (with_("device", dout=lambda i: np.zeros(Q_SHAPE, np.float16)), {}, TypeError,
     "dout must be a device array like q, got a numpy \\(host\\) array"),
    # lse: float32 (batch, heads_q, seqlen_q), the inputs' place; on the device C-contiguous
    (with_("host", lse=lambda i: i["lse"].astype(np.float16)), {}, TypeError,
     "lse must be float32 .*got float16"),
    (with_("host", lse=lambda i: np.zeros((2, 8, 4), np.float32)), {}, ValueError,
     r"lse must have shape \(batch, heads_q, seqlen_q\) = \(2, 4, 8\), got \(2, 8, 4\)"),
    (with_("host", lse=lambda i: i["lse"][None]), {}, ValueError, "lse must have shape"),
    (with_("host", lse=lambda i: i["lse"].tolist()), {}, TypeError,
     "lse must be a numpy array or a CUDA array"),
    (with_("host", lse=lambda i: FakeDeviceArray(LSE_SHAPE, "<f4")), {}, TypeError,
     "lse must be a numpy \\(host\\) array like q, got a device array"),
    (with_("device", lse=lambda i: np.zeros(LSE_SHAPE, np.float32)), {}, TypeError,
     "lse must be a device array like q, got a numpy \\(host\\) array"),
    (with_("device", lse=lambda i: FakeDeviceArray(LSE_SHAPE, "<f2")), {}, TypeError, "lse must be float32"),
    (with_("device", lse=lambda i: FakeDeviceArray(LSE_SHAPE, "<f4", strides=(128, 4, 16))), {}, ValueError,
     r"lse must be C-contiguous \(strides \(32, 8, 1\) in elements\), got strides \(32, 1, 4\)"),
    (with_("device", lse=lambda i: FakeDeviceArray(LSE_SHAPE, "<f4", pointer=(1 << 30) + 2)), {}, ValueError,
     "lse must start on a 4-byte boundary"),
    # flags and scale
    (with_("host"), {"causal": "yes"}, TypeError, r"causal must be a bool \(True or False\), got str"),
    (with_("host"), {"deterministic": 1}, TypeError,
     r"deterministic must be a bool \(True or False\), got int"),
    (with_("host"), {"softmax_scale": -1.0}, ValueError, "softmax_scale must be a positive finite number"),
    (with_("host"), {"softmax_scale": "0.1"}, TypeError, "softmax_scale must be a real number or None"),
    # device layout
    (with_("device", dout=lambda i: FakeDeviceArray(Q_SHAPE, pointer=(1 << 30) + 8)), {}, ValueError,
     "dout: rows must start on 16-byte boundaries"),
    (with_("device", out=lambda i: FakeDeviceArray(Q_SHAPE, strides=(8192, 1024, 256, 4))), {}, ValueError,
     "out: the last \\(head_dim\\) dimension must be contiguous"),
]


@pytest.mark.parametrize("make, kwargs, error, message", BAD_INPUTS)
def test_bad_input_rejected_before_compiling(make, kwargs, error, message, no_compile):
    with pytest.raises(error, match=message):
        call(make(), **kwargs)


def _grad(kind, shape, dtype=np.float16, **kw):
    return np.zeros(shape, dtype) if kind == "host" else FakeDeviceArray(shape, **kw)


BAD_GRADIENTS = [
    ("host", {"dq": lambda i: np.zeros(K_SHAPE, np.float16)}, ValueError,
     r"dq must have q's shape \(2, 8, 4, 64\) and dtype float16, got \(2, 8, 2, 64\) float16"),
    ("host", {"dk": lambda i: np.zeros(Q_SHAPE, np.float16)}, ValueError, "dk must have k's shape"),
    ("host", {"dv": lambda i: np.zeros(K_SHAPE, np.float32)}, TypeError, "dv must be float16 or bfloat16"),
    pytest.param("host", {"dv": lambda i: np.zeros(K_SHAPE, BF16)}, ValueError,
                 "dv must have v's shape .* got .* bfloat16", marks=needs_bf16),
    ("host", {"dq": lambda i: FakeDeviceArray(Q_SHAPE)}, TypeError,
     "dq must be a numpy \\(host\\) array like q"),
    ("device", {"dk": lambda i: np.zeros(K_SHAPE, np.float16)}, TypeError,
     "dk must be a device array like k"),
    ("host", {"dq": lambda i: _ro(np.zeros(Q_SHAPE, np.float16))}, ValueError,
     "dq is a read-only numpy array"),
    ("host", {"dk": lambda i: np.lib.stride_tricks.as_strided(np.zeros((2, 8, 1, 64), np.float16), K_SHAPE,
                                                               (1024, 128, 0, 2), writeable=True)},
     ValueError, "dk: strides .* make elements share memory"),
    ("device", {"dv": lambda i: FakeDeviceArray(K_SHAPE, strides=(2048, 0, 128, 2))}, ValueError,
     "dv: strides .* make elements share memory"),
    ("device", {"dq": lambda i: FakeDeviceArray(Q_SHAPE, pointer=(1 << 30) + 8)}, ValueError,
     "dq: rows must start on 16-byte boundaries"),
    # overlaps: with an input, or with each other
    ("host", {"dq": lambda i: i["q"]}, ValueError, "dq shares memory with q"),
    ("host", {"dq": lambda i: i["out"]}, ValueError, "dq shares memory with out"),
    ("host", {"dk": lambda i: i["v"]}, ValueError, "dk shares memory with v"),
    ("host", {"dv": lambda i: i["k"][:, ::-1]}, ValueError, "dv shares memory with k"),
    ("device", {"dq": lambda i: i["dout"]}, ValueError, "dq shares memory with dout"),
    ("device", {"dq": lambda i: FakeDeviceArray(Q_SHAPE, pointer=i["q"].pointer + 4096)}, ValueError,
     "dq shares memory with q"),
    ("device", {"dk": lambda i: FakeDeviceArray(K_SHAPE, pointer=i["lse"].pointer)}, ValueError,
     "dk shares memory with lse"),
]


@pytest.mark.parametrize("kind, grads, error, message", BAD_GRADIENTS)
def test_bad_gradient_outputs_rejected_before_compiling(kind, grads, error, message, no_compile):
    inputs = host_inputs() if kind == "host" else device_inputs()
    with pytest.raises(error, match=message):
        call(inputs, **{name: f(inputs) for name, f in grads.items()})


@pytest.mark.parametrize("kind", ["host", "device"])
def test_gradient_outputs_sharing_memory_rejected(kind, no_compile):
    inputs = host_inputs() if kind == "host" else device_inputs()
    shared = _grad(kind, K_SHAPE)
    with pytest.raises(ValueError, match="dk shares memory with dv"):
        call(inputs, dk=shared, dv=shared)
    if kind == "host":
        packed = np.zeros((2, 8, 4, 4, 64), np.float16)  # dq, and dk + dv, in one array
        with pytest.raises(ValueError, match="dq shares memory with dk"):
            call(inputs, dq=packed[:, :, 0], dk=packed[:, :, 0, 1:3])


def test_interleaved_gradients_that_share_no_element_are_accepted(no_compile):
    """dk and dv as the two halves of one packed (batch, seqlen, 2, heads, d) array: their extents
    overlap, their elements do not."""
    packed = np.zeros((2, 8, 2, 2, 64), np.float16)
    with pytest.raises(AssertionError, match="would compile"):
        call(host_inputs(), dk=packed[:, :, 0], dv=packed[:, :, 1])
    pointer, (sb, ss, sp, sh) = 1 << 44, (2 * 8 * 2 * 2 * 64, 2 * 2 * 64, 2 * 64, 64)
    dk = FakeDeviceArray(K_SHAPE, strides=(2 * sb, 2 * ss, 2 * sh, 2), pointer=pointer)
    dv = FakeDeviceArray(K_SHAPE, strides=(2 * sb, 2 * ss, 2 * sh, 2), pointer=pointer + 2 * sp)
    with pytest.raises(AssertionError, match="would compile"):
        call(device_inputs(), dk=dk, dv=dv)


@pytest.mark.parametrize("kind", ["host", "device"])
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 256])
def test_good_inputs_reach_the_kernels(kind, head_dim, no_compile):
    q_shape, k_shape = (1, 5, 4, head_dim), (1, 7, 1, head_dim)
    inputs = host_inputs(q_shape, k_shape) if kind == "host" else device_inputs(q_shape, k_shape)
    grads = {"dq": _grad(kind, q_shape), "dk": _grad(kind, k_shape), "dv": _grad(kind, k_shape)}
    for kwargs in ({}, {"causal": True, "deterministic": np.True_, "softmax_scale": 0.5}, grads):
        with pytest.raises(AssertionError, match="would compile"):
            call(inputs, **kwargs)


@needs_bf16
def test_bfloat16_inputs_reach_the_kernels(no_compile):
    inputs = {n: x if n == "lse" else x.astype(BF16) for n, x in host_inputs().items()}
    with pytest.raises(AssertionError, match="would compile"):
        call(inputs, dq=np.zeros(Q_SHAPE, BF16))


def test_numpy_lse_of_any_layout_is_accepted(no_compile):
    inputs = host_inputs()
    inputs["lse"] = np.zeros((2, 8, 4), np.float32).transpose(0, 2, 1)  # (2, 4, 8), not C-contiguous
    with pytest.raises(AssertionError, match="would compile"):
        call(inputs)


def test_grid_limits_checked_before_compiling(no_compile):
    """The prepare and dQ grids are not folded: batch and heads_q are at most 65535 each."""
    with pytest.raises(ValueError, match=r"exceeds the CUDA grid .* got heads_q 4, batch 65536"):
        call(device_inputs((65536, 8, 4, 64), (65536, 8, 2, 64)))
    with pytest.raises(ValueError, match="heads_q 65536, batch 1"):
        call(device_inputs((1, 8, 65536, 64), (1, 8, 1, 64)))
    with pytest.raises(AssertionError, match="would compile"):
        call(device_inputs((65535, 8, 65535, 64), (65535, 8, 1, 64)))


def test_tensors_on_another_device_are_rejected(monkeypatch, no_compile):
    """Operands whose device is known (torch) must be on the current one; lse and the gradients too."""
    seen = []
    monkeypatch.setattr(numbaflash.operations.entry, "check_same_device", lambda ops, current: seen.append(
        [op.name for op in ops]))
    with pytest.raises(AssertionError, match="would compile"):
        call(device_inputs(), dq=FakeDeviceArray(Q_SHAPE))
    assert seen == [["dout", "q", "k", "v", "out", "lse", "dq"]]
    lse = operands.Operand("lse", LSE_SHAPE, "float32", True, None, device=1)
    with pytest.raises(ValueError, match=r"got lse on cuda:1"):
        operands.check_same_device([lse], 0)


# ------------------------------------------------------------------ grid and workspace


def test_rows_round_up_to_the_alignment():
    assert BACKWARD_ROW_ALIGN == 128
    assert [backward_rows(s) for s in (1, 127, 128, 129, 4096, 4097)] == [128, 128, 128, 256, 4096, 4224]


def test_workspace_layout():
    lay = workspace_layout(2, 3, 200, 64, 64)
    n = 2 * 3 * 256
    assert lay.rows == 256 and lay.row_elements == n and lay.accum_elements == n * 64
    assert lay.counter_elements == 2 * 3 * (256 // 64)
    assert (lay.lse_log2, lay.delta, lay.dq_accum, lay.counters) == (0, n, 2 * n, 2 * n + 64 * n)
    assert lay.total == 2 * n + 64 * n + 24
    ws = lay.at(1 << 32)
    assert ws.lse_log2 == (1 << 32, n) and ws.delta == ((1 << 32) + 4 * n, n)
    assert ws.dq_accum == ((1 << 32) + 8 * n, 64 * n)
    assert ws.counters == ((1 << 32) + 4 * (2 * n + 64 * n), 24)
    for pointer, _ in ws:
        assert pointer % 512 == 0  # every part 16-byte aligned and more
    assert workspace_layout(1, 1, 1, 32, 128).counter_elements == 1
    with pytest.raises(ValueError, match="block_m \\(256\\) must divide the workspace's 128 rows"):
        workspace_layout(1, 1, 100, 64, 256)


ALL_BACKWARD_CANDIDATES = sorted({c for cs in configs.BACKWARD_CANDIDATES.values() for c in cs}, key=str)
# One candidate of each dQ geometry (head dim, block_m, dq_tiles: what sets the warps' split of
# dQ and so the fragment order); the others differ only in what dQ does not see.
DQ_GEOMETRIES = list({(c.head_dim, c.block_m, c.dq_tiles): c for c in ALL_BACKWARD_CANDIDATES}.values())


@pytest.mark.parametrize("config", DQ_GEOMETRIES, ids=str)
def test_dq_fragment_order_covers_the_query_block_once(config):
    """The dQ accumulator's fragment order (what the main kernel adds, what the dQ kernel reads
    back) maps the threads' elements onto the block_m x head_dim block one to one, and one
    element index over a warp's 32 lanes is 32 consecutive floats."""
    n = config.dq_fragment_elements
    assert n * config.threads == config.block_m * config.head_dim
    seen = {config.dq_position(tid, i) for tid in range(config.threads) for i in range(n)}
    assert seen == {(r, c) for r in range(config.block_m) for c in range(config.head_dim)}
    # the lane pairs of an m16n8 C fragment: element i and i + 1 (i even) are adjacent columns
    row, col = config.dq_position(37, 6)
    assert config.dq_position(37, 7) == (row, col + 1)


@pytest.mark.parametrize("config", DQ_GEOMETRIES, ids=str)
@pytest.mark.parametrize("vector", [1, 4])
def test_dq_accumulator_offsets_cover_the_block_once(config, vector):
    """``dq_offset`` maps the threads' fragment elements onto the block's floats one to one; one
    add instruction of a warp covers whole 128-byte lines: 32 consecutive floats (one each,
    ``red.global.add.f32``) or 128 (four adjacent each, ``red.global.add.v4.f32``, 16-byte
    aligned)."""
    config = dataclasses.replace(config, dq_vector=vector)
    n = config.dq_fragment_elements
    offsets = [config.dq_offset(tid, i) for tid in range(config.threads) for i in range(n)]
    assert sorted(offsets) == list(range(config.block_m * config.head_dim))
    for i in range(0, n, vector):
        first = [config.dq_offset(tid, i) for tid in range(32, 64)]  # warp 1's lanes
        assert first == [first[0] + vector * lane for lane in range(32)] and first[0] % (32 * vector) == 0
        for e in range(vector):
            assert [config.dq_offset(tid, i + e) for tid in range(32, 64)] == [f + e for f in first]


@pytest.mark.parametrize("capability, vector", [(AMPERE, 1), (SM86, 1), (HOPPER, 4), ((10, 0), 4)])
def test_the_target_sets_the_dq_add_width(capability, vector, fresh_choice):
    """Every config a GPU launches, chosen or forced, adds dQ four floats at a time from sm_90 on
    (``red.global.add.v4.f32`` does not exist before) and one at a time before."""
    # (head dim 96: the mma.sync backward on every GPU; Hopper runs its own at 64 and 128)
    assert configs.backward_config(capability, 96, True, shared_limit=10**6).dq_vector == vector
    with configs.force_config(capability, False, BackwardConfig(64, block_n=64, dq_vector=4)):
        assert configs.backward_config(capability, 64, False).dq_vector == vector
    assert BackwardConfig(64, dq_vector=4).tag.endswith("_v4") and "_v" not in BackwardConfig(64).tag
    with pytest.raises(ValueError, match="dq_vector must be 1 or 4"):
        BackwardConfig(64, dq_vector=2).check()


def test_grids():
    rows_grid, main_grid = backward_grids(200, 300, 8, 2, 3, 128)
    assert rows_grid == (4, 8, 3) and main_grid == (3 * 2 * 3, 1, 1)  # the main grid: one dimension
    assert backward_grids(1, 1, 1, 1, 1, 64) == ((2, 1, 1), (1, 1, 1))
    with pytest.raises(ValueError, match="main grid needs"):
        backward_grids(1, 16 * 2**31, 1, 1, 1, 16)
    with pytest.raises(ValueError, match="main grid needs"):
        backward_grids(1, 2**16, 1, 2**12, 2**12, 16)  # 2^12 blocks x 2^24 pairs
    with pytest.raises(ValueError, match="prepare and dQ grid"):
        backward_grids(1, 1, 65536, 1, 1, 128)
    check_backward_grid(1, 2**16, 65535, 256, 2047)  # the narrowest key block still fits
    check_backward_grid(1, 1, 4096, 4096, 4096)  # heads_kv * batch > 65535: one dimension
    with pytest.raises(ValueError, match="more than CUDA's"):
        check_backward_grid(1, 16 * 2**31, 1, 1, 1)


# ------------------------------------------------------------------ configs


@pytest.fixture
def fresh_choice():
    configs._backward_choice.cache_clear()
    yield
    configs._backward_choice.cache_clear()


def test_defaults_are_valid_and_in_order():
    for d, candidates in configs.BACKWARD_DEFAULTS.items():
        for c in candidates:
            c.check()
            assert c.head_dim == d
        two = {"key_tiles": 2, "dq_tiles": 2} if d in (64, 128) else {}  # the measured winners
        assert candidates[0] == BackwardConfig(d, block_m=64, block_n=64 if d == 256 else 128, **two)
    assert set(configs.BACKWARD_DEFAULTS) == set(configs.SUPPORTED_HEAD_DIMS)
    for d in (32, 64, 96, 128):
        assert configs.BACKWARD_DEFAULTS[d][-4:-1] == [
            BackwardConfig(d, block_m=64, block_n=128),
            BackwardConfig(d, block_m=64, block_n=128, q_stages=1),
            BackwardConfig(d, block_m=64, block_n=64)]
    assert configs.BACKWARD_DEFAULTS[256] == [BackwardConfig(256, block_m=64, block_n=64),
                                              BackwardConfig(256, block_m=64, block_n=64, q_stages=1)]
    for d, candidates in configs.BACKWARD_CANDIDATES.items():  # the defaults, then valid two-tile ones
        assert candidates[:len(configs.BACKWARD_DEFAULTS[d])] == configs.BACKWARD_DEFAULTS[d]
        assert len(set(candidates)) == len(candidates)
        for c in candidates:
            c.check()
        two = [c for c in candidates if c.key_tiles == 2]
        if d in (32, 96):
            assert not two
        else:  # every default's two-tile twin, and at d64 FlashAttention-2's 128-row tile
            twins = {dataclasses.replace(c, key_tiles=2, dq_tiles=2) for c in configs.BACKWARD_DEFAULTS[d]}
            if d == 64:
                twins.add(BackwardConfig(64, block_m=128, block_n=128, key_tiles=2, dq_tiles=2))
            assert twins == set(two)


@pytest.mark.parametrize("causal", [False, True])
def test_config_by_shared_memory(causal, fresh_choice):
    d128 = configs.BACKWARD_DEFAULTS[128]
    assert configs.backward_config(HOPPER, 128, causal) == configs.BACKWARD_WS_DEFAULTS[128][0]  # its own
    assert configs.backward_config(HOPPER, 128, causal, varlen=True) == \
        hopper(d128[0])  # 161 KB
    assert configs.backward_config(AMPERE, 128, causal) == d128[0]  # 163 KB a CTA
    assert configs.backward_config(SM86, 128, causal) == d128[-1]  # 99 KB: 64 x 64, one Q stage
    assert configs.backward_config(AMPERE, 128, causal, shared_limit=140_000) == d128[2]
    assert configs.backward_config(AMPERE, 128, causal, shared_limit=120_000) == d128[3]
    assert configs.backward_config(AMPERE, 256, causal) == configs.BACKWARD_DEFAULTS[256][1]
    assert configs.backward_config(HOPPER, 256, causal) == hopper(configs.BACKWARD_DEFAULTS[256][0])
    with pytest.raises(RuntimeError, match=r"no backward config for head_dim 256 fits in 101376 bytes of "
                                           r"shared memory a CTA \(BackwardConfig\(.*\) needs 214016"):
        configs.backward_config(SM86, 256, causal)
    for cap in (HOPPER, AMPERE, SM86):
        for d in (32, 64, 96, 128):
            assert configs.backward_config(cap, d, causal).shared_bytes <= configs.max_shared_bytes(cap)


def test_table_entries_under_their_own_keys(table_with, fresh_choice):
    tuned = BackwardConfig(128, block_m=128, block_n=64)
    too_big = BackwardConfig(64, block_m=128, block_n=128, q_stages=2)
    assert configs.backward_table_key(128, True) == "sm80bwd/d128/causal"
    table_with({"sm80bwd/d128/causal": tuned, "sm80bwd/d64/full": too_big})
    configs._backward_choice.cache_clear()
    # (on Hopper the packed variable-length calls run the mma.sync backward at every head dim)
    assert configs.backward_config(HOPPER, 128, True, varlen=True) == hopper(tuned)
    assert configs.backward_config(HOPPER, 128, False, varlen=True) == \
        hopper(configs.BACKWARD_DEFAULTS[128][0])
    assert configs.backward_config(HOPPER, 64, False, varlen=True) == hopper(too_big)
    assert configs.backward_config(SM86, 64, False, shared_limit=too_big.shared_bytes - 1) == \
        configs.BACKWARD_DEFAULTS[64][0]
    assert configs.config_to_json(tuned)["kernel"] == "mma_bwd"
    assert configs.config_from_json(configs.config_to_json(tuned)) == tuned
    # The forward's entries and choice are untouched
    assert configs.forward_config(HOPPER, 128, True) == configs.forward_config(HOPPER, 128, True, seqlen=4096)


def test_a_forward_config_under_a_backward_key_is_an_error(table_with, fresh_choice):
    table_with({"sm80bwd/d64/full": configs.DEFAULTS[("sm80", 64)]})
    configs._backward_choice.cache_clear()
    with pytest.raises(ValueError, match="sm80bwd/d64/full must be a mma_bwd config of head_dim 64"):
        configs.backward_config(AMPERE, 64, False)


def test_force_config_with_a_backward_config(fresh_choice):
    forced = BackwardConfig(64, block_m=64, block_n=64, q_stages=1)
    forward_before = configs.forward_config(AMPERE, 64, True)
    unforced = configs.backward_config(AMPERE, 64, False)
    with configs.force_config(AMPERE, True, forced):
        assert configs.OVERRIDES == {"sm80bwd/d64/causal": forced}
        assert configs.backward_config(AMPERE, 64, True) == forced
        assert configs.backward_config(AMPERE, 64, False) == unforced != forced
        assert configs.forward_config(AMPERE, 64, True) == forward_before
    with configs.force_config(HOPPER, False, forced):  # every GPU runs the mma.sync backward
        assert configs.backward_config(HOPPER, 64, False) == hopper(forced)
    assert configs.OVERRIDES == {}


def test_the_family_record():
    config = BackwardConfig(128)
    family = families.family_of(config)
    assert family is families.SM80_BWD and family.name == "sm80bwd" and family.table_kind == "mma_bwd"
    assert families.BACKWARD_OPERATIONS == ("backward_prep", "backward", "backward_dq")
    assert family.operations == families.BACKWARD_OPERATIONS and family.varlen
    for operation, abi in ABIS.items():
        for window in (False, True):
            for softcap in (False, True):
                spec = families.spec_of(config, operation, causal=True, window=window, softcap=softcap)
                assert families.kernel_abi(spec) == abi
                assert families.FACTORIES[(spec.family, spec.operation)] is not None
    with pytest.raises(NotImplementedError, match="the sm80bwd family has no sm80bwd.forward kernel"):
        families.make_kernel(kernel_spec("sm80bwd", "forward", config))
    assert configs.FAMILY_ARCH["sm80bwd"] == "sm_80"
    # The forward's lists hold forward configs only
    assert {fam for fam, _, _, _ in configs.shipped_configs()} == {"sm80", "sm90"}
    assert all(families.family_of(c) is not family for cands in configs.CANDIDATES.values() for c in cands)


def test_shipped_backward_configs():
    shipped = configs.shipped_backward_configs()
    assert len(shipped) == len(set(shipped))
    for d in configs.BACKWARD_DEFAULTS:
        for causal in (False, True):
            for cap in (AMPERE, HOPPER):
                assert (d, causal, configs.backward_config(cap, d, causal)) in shipped
    assert (128, False, configs.BACKWARD_DEFAULTS[128][-1]) in shipped  # what 99 KB GPUs run


# ------------------------------------------------------------------ loading and launching (faked)


class FakeLauncher:
    """Records each launch and packs its arguments as the real launcher does (``param_layout``),
    so that a wrong type or count fails here."""

    launches: list = []

    def __init__(self, kernel, abi, name):
        self.kernel, self.abi, self.name = kernel, abi, name
        self._pack, size = runtime_launch._packer(runtime_launch.param_layout(abi), len(abi))
        self._buffer = ctypes.create_string_buffer(size)

    def __call__(self, grid, block, stream, shared, *args):
        assert len(args) == len(self.abi), (self.name, len(args), len(self.abi))
        self._pack(self._buffer, *args)
        FakeLauncher.launches.append((self.kernel.operation, grid, block, stream, shared, args))
        if self.kernel.run is not None:
            self.kernel.run(args)

    def bind(self, grid, block, shared, *args):
        """As ``KernelLauncher.bind``: ``fire(stream, *pointers)`` puts the pointers into the array
        arguments (the ``(pointer, elements)`` pairs, in order) and launches as a call would."""
        assert len(args) == len(self.abi), (self.name, len(args), len(self.abi))
        self._pack(self._buffer, *args)
        arrays = [i for i, arg in enumerate(args) if type(arg) is tuple]

        def fire(stream, *pointers):
            assert len(pointers) == len(arrays), (self.name, len(pointers), len(arrays))
            given = list(args)
            for i, pointer in zip(arrays, pointers, strict=True):
                given[i] = (pointer, args[i][1])
            self(grid, block, stream, shared, *given)

        return fire


class FakeSlots:
    """``runtime.map_slots.MapSlots``' interface: a slot per key (maps never encoded), every
    lookup and use recorded."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.keys: list[tuple] = []
        self.slot_of: dict[tuple, int] = {}
        self.used_slots: list[tuple[int, int]] = []

    def address(self, key, encode, stream):
        self.keys.append(key)
        slot = self.slot_of.setdefault(key, len(self.slot_of))
        return (1 << 36) + 512 * slot, slot

    def used(self, slot, stream):
        self.used_slots.append((slot, stream))


@pytest.fixture
def fake_gpu(monkeypatch):
    """A fresh GPU state on a pretend device: kernels 'load' without compiling (recorded), launches
    are recorded by ``FakeLauncher``, and new device arrays are ``FakeDeviceArray``s."""
    state = device.GpuState()
    monkeypatch.setattr(device, "GPU", state)
    gpu = types.SimpleNamespace(capability=HOPPER, limit=227 * 1024, loads=[], specs=[], raised=[], runs={})
    monkeypatch.setattr(state, "current", lambda: (gpu.capability, 0))
    monkeypatch.setattr(state, "shared_limit", lambda ordinal: gpu.limit)
    monkeypatch.setattr(state, "sm_count", lambda ordinal: 132)
    gpu.zeroed = []  # (pointer, words, stream) of each GPU.zero_words: a split GQA group's sums
    monkeypatch.setattr(state, "zero_words",
                        lambda pointer, count, stream: gpu.zeroed.append((pointer, count, stream)))

    def loaded_kernel(spec):
        operation = spec.operation
        gpu.loads.append((spec.config, spec.causal, spec.bf16, spec.arch, operation))
        gpu.specs.append(spec)
        kernel = types.SimpleNamespace(handle=len(gpu.loads), operation=operation,
                                       run=gpu.runs.get(operation))
        return kernel, f"{operation}_entry"

    monkeypatch.setattr(backward, "loaded_kernel", loaded_kernel)
    monkeypatch.setattr(runtime_launch, "KernelLauncher", FakeLauncher)
    monkeypatch.setattr(runtime_launch, "set_dynamic_shared_limit",
                        lambda handle, ordinal, nbytes: gpu.raised.append((handle, ordinal, nbytes)))
    monkeypatch.setattr(backward, "empty_like", lambda ref, shape, dtype_name: FakeDeviceArray(shape))
    monkeypatch.setattr(backward, "empty_lse", lambda ref, shape: FakeDeviceArray(shape, "<f4"))
    monkeypatch.setattr(FakeLauncher, "launches", [])
    gpu.slots = FakeSlots()  # the Hopper backward's tensor maps
    monkeypatch.setattr(map_slots, "map_slots", lambda ordinal: gpu.slots)
    configs._backward_choice.cache_clear()
    yield gpu
    configs._backward_choice.cache_clear()


@pytest.mark.parametrize("capability, arch", [(HOPPER, "sm_90a"), (AMPERE, "sm_80"), (SM86, "sm_86")])
def test_kernels_load_once_for_the_gpus_own_target(fake_gpu, capability, arch):
    fake_gpu.capability = capability
    fake_gpu.limit = configs.max_shared_bytes(capability)
    first = backward.backward_kernels(capability, 0, 128, True, False)
    config = configs.backward_config(capability, 128, True)
    assert first.config == config
    # the prepare and dQ kernels do not depend on causal: built once, as non-causal
    assert fake_gpu.loads == [(config, op == "backward", False, arch, op)
                              for op in families.BACKWARD_OPERATIONS]
    assert fake_gpu.raised == [(2, 0, config.shared_bytes)]  # the main kernel's limit, once
    family = families.family_of(config)  # Hopper: its own backward at d128
    assert family is (families.SM90_BWD if capability == HOPPER else families.SM80_BWD)
    assert [launcher.abi for launcher, _ in (first.prep, first.main, first.dq)] == [
        families.kernel_abi(families.spec_of(config, op)) for op in families.BACKWARD_OPERATIONS]
    assert backward.backward_kernels(capability, 0, 128, True, False) is first
    assert len(fake_gpu.loads) == 3
    backward.backward_kernels(capability, 0, 128, True, True)  # bf16: three more kernels
    assert len(fake_gpu.loads) == 6


def test_forced_config_loads_its_own_kernels_and_too_big_is_refused(fake_gpu):
    forced = BackwardConfig(64, block_m=64, block_n=64, q_stages=1)
    unforced = backward.backward_kernels(HOPPER, 0, 64, False, False)
    with configs.force_config(HOPPER, False, forced):
        assert backward.backward_kernels(HOPPER, 0, 64, False, False).config == hopper(forced)
    assert backward.backward_kernels(HOPPER, 0, 64, False, False) is unforced
    big = configs.BACKWARD_DEFAULTS[128][0]
    fake_gpu.limit = 99 * 1024
    message = r"needs 164864 bytes of shared memory a CTA; device 0 \(sm_86\) allows 101376"
    with configs.force_config(SM86, False, big), pytest.raises(RuntimeError, match=message):
        backward.backward_kernels(SM86, 0, 128, False, False)


@pytest.mark.parametrize("deterministic", [False, True])
def test_device_call_launches_prep_main_dq_with_the_abi(fake_gpu, deterministic):
    fake_gpu.capability, fake_gpu.limit = AMPERE, configs.max_shared_bytes(AMPERE)  # the mma.sync backward
    q_shape, k_shape = (3, 200, 8, 64), (3, 300, 2, 64)
    inputs = device_inputs(q_shape, k_shape)
    dq, dk, dv = call(inputs, causal=True, softmax_scale=0.25, deterministic=deterministic)
    config = configs.backward_config(AMPERE, 64, True)
    assert (dq.shape, dk.shape, dv.shape) == (q_shape, k_shape, k_shape)
    prep, main, dqk = FakeLauncher.launches
    assert [launch[0] for launch in FakeLauncher.launches] == list(families.BACKWARD_OPERATIONS)
    rows = 256
    assert prep[1:5] == ((rows // 64, 8, 3), 128, 0, 0)
    key_blocks = -(-300 // config.block_n)
    assert main[1:5] == ((key_blocks * 2 * 3, 1, 1), config.threads, 0, config.shared_bytes)
    assert dqk[1:5] == ((rows // config.block_m, 8, 3), config.threads, 0, 0)
    lay = workspace_layout(3, 8, 200, 64, config.block_m)
    base = main[5][6][0]  # lse_log2: the workspace's first part
    ws = lay.at(base)
    q_span = 3 * 200 * 8 * 64
    dense_q, dense_k = (200 * 8 * 64, 8 * 64, 64), (300 * 2 * 64, 2 * 64, 64)
    assert prep[5] == ((inputs["out"].pointer, q_span), (inputs["dout"].pointer, q_span),
                       (inputs["lse"].pointer, 3 * 8 * 200), ws.delta, ws.lse_log2, ws.dq_accum, ws.counters,
                       *dense_q, *dense_q, 200, rows, 8, rows // config.block_m)
    k_span = 3 * 300 * 2 * 64
    assert main[5][:10] == ((inputs["q"].pointer, q_span), (inputs["k"].pointer, k_span),
                            (inputs["v"].pointer, k_span), (inputs["dout"].pointer, q_span),
                            (dk.pointer, k_span), (dv.pointer, k_span), ws.lse_log2, ws.delta, ws.dq_accum,
                            ws.counters)
    assert main[5][10:28] == (*dense_q, *dense_k, *dense_k, *dense_q, *dense_k, *dense_k)
    tail_pairs = min(2 * 3, -(-2 * 132 // key_blocks))  # two waves of the fake GPU's 132 SMs
    assert main[5][28:] == (200, 300, rows, 8, 4, 2, tail_pairs, np.float32(0.25 * np.log2(np.e)),
                            np.float32(0.25), deterministic, 0, 0, np.float32(0.0))  # no window, no cap
    assert type(main[5][35]) is np.float32 and type(main[5][36]) is np.float32
    assert dqk[5] == (ws.dq_accum, (dq.pointer, q_span), *dense_q, 200, rows, 8, np.float32(0.25))


def test_device_call_writes_into_given_strided_gradients(fake_gpu):
    inputs = device_inputs()
    strides = (8 * 4 * 128, 4 * 128, 128, 1)  # every head's row padded to 128 elements
    given = {"dq": FakeDeviceArray(Q_SHAPE, strides=tuple(2 * s for s in strides)),
             "dk": FakeDeviceArray(K_SHAPE), "dv": FakeDeviceArray(K_SHAPE)}
    dq, dk, dv = call(inputs, **given)
    assert (dq, dk, dv) == (given["dq"], given["dk"], given["dv"])
    _, main, dqk = FakeLauncher.launches
    assert dqk[5][1] == (dq.pointer, 1 + 1 * strides[0] + 7 * strides[1] + 3 * strides[2] + 63)
    assert dqk[5][2:5] == strides[:3]
    assert main[5][4][0] == dk.pointer and main[5][5][0] == dv.pointer


def test_second_call_is_one_lookup(fake_gpu):
    call(device_inputs())
    loads = len(fake_gpu.loads)
    call(device_inputs())
    assert len(fake_gpu.loads) == loads and len(FakeLauncher.launches) == 6
    # 8 / 2 heads on a small grid: the Hopper backward's GQA-split build
    assert backward.ready_key(0, 64, False, False, group_split=True) in device.GPU.launchers


# ------------------------------------------------------------------ numpy staging (driver faked)


class FakeDriver:
    """The driver calls of ``run_numpy`` over host memory: "device" allocations are numpy
    buffers, copies are memmoves, streams are numbers."""

    def __init__(self, monkeypatch):
        from cuda.bindings import driver

        self.ok = driver.CUresult.CUDA_SUCCESS
        self.buffers, self.freed, self.streams = {}, [], []
        for name in ("cuStreamCreate", "cuMemAlloc", "cuMemcpyHtoDAsync", "cuMemcpyDtoHAsync",
                     "cuStreamSynchronize", "cuMemFree", "cuStreamDestroy"):
            monkeypatch.setattr(driver, name, getattr(self, name))

    def cuStreamCreate(self, flags):
        self.streams.append("live")
        return self.ok, 7

    def cuMemAlloc(self, nbytes):
        buffer = np.zeros(nbytes, np.uint8)
        self.buffers[buffer.ctypes.data] = buffer
        return self.ok, buffer.ctypes.data

    def cuMemcpyHtoDAsync(self, dst, src, nbytes, stream):
        ctypes.memmove(dst, src, nbytes)
        return (self.ok,)

    def cuMemcpyDtoHAsync(self, dst, src, nbytes, stream):
        ctypes.memmove(dst, src, nbytes)
        return (self.ok,)

    def cuStreamSynchronize(self, stream):
        return (self.ok,)

    def cuMemFree(self, pointer):
        self.freed.append(pointer)
        return (self.ok,)

    def cuStreamDestroy(self, stream):
        self.streams[-1] = "destroyed"
        return (self.ok,)


def _at(pair, dtype):
    """The fake device memory of a (pointer, elements) argument as a numpy array."""
    pointer, count = pair
    ctype = {np.uint16: ctypes.c_uint16, np.float32: ctypes.c_float}[dtype]
    return np.ctypeslib.as_array((ctype * count).from_address(pointer))


@pytest.fixture
def fake_staging(fake_gpu, monkeypatch):
    from numbaflash.runtime import pipeline

    monkeypatch.setattr(pipeline, "pinned_empty", lambda shape, dtype: np.full(shape, 0xAB, dtype))
    driver = FakeDriver(monkeypatch)
    seen = {}

    def prep(args):  # what reached the device: out, dout, lse
        seen["out"], seen["dout"] = _at(args[0], np.uint16).copy(), _at(args[1], np.uint16).copy()
        seen["lse"] = _at(args[2], np.float32).copy()

    def main(args):  # dk = k, dv = v (bits): the copies in are where the launch says
        _at(args[4], np.uint16)[:] = _at(args[1], np.uint16)
        _at(args[5], np.uint16)[:] = _at(args[2], np.uint16)
        seen["q"], seen["dout_main"] = _at(args[0], np.uint16).copy(), _at(args[3], np.uint16).copy()

    def dq(args):  # dq = 1.0 (float16 bits)
        _at(args[1], np.uint16)[:] = 0x3C00

    fake_gpu.runs.update({"backward_prep": prep, "backward": main, "backward_dq": dq})
    return types.SimpleNamespace(driver=driver, seen=seen, gpu=fake_gpu)


def random_host_inputs(rng, q_shape=(2, 9, 4, 32), k_shape=(2, 5, 2, 32)):
    inputs = host_inputs(q_shape, k_shape)
    return {n: rng.standard_normal(x.shape).astype(x.dtype) for n, x in inputs.items()}


def test_numpy_call_stages_through_one_device_allocation(fake_staging, rng):
    inputs = random_host_inputs(rng)
    inputs["k"] = inputs["k"][:, ::-1]  # any layout: gathered into the pinned block
    dq, dk, dv = call(inputs)
    seen = fake_staging.seen
    for name in ("out", "dout"):
        assert np.array_equal(seen[name], inputs[name].view(np.uint16).ravel())
    assert np.array_equal(seen["lse"], inputs["lse"].ravel())
    assert np.array_equal(seen["q"], inputs["q"].view(np.uint16).ravel())
    assert np.array_equal(dk, inputs["k"]) and np.array_equal(dv, inputs["v"])
    assert dq.dtype == np.float16 and dq.shape == inputs["q"].shape and np.all(dq == 1.0)
    driver = fake_staging.driver
    assert list(driver.buffers) == driver.freed and driver.streams == ["destroyed"]
    assert [launch[3] for launch in FakeLauncher.launches] == [7, 7, 7]  # on the call's own stream


def test_numpy_call_writes_into_given_gradients(fake_staging, rng):
    inputs = random_host_inputs(rng)
    dq = np.zeros((2, 4, 9, 32), np.float16).transpose(0, 2, 1, 3)  # strided
    dk, dv = np.zeros((2, 5, 2, 32), np.float16), np.zeros((2, 5, 2, 32), np.float16)
    got = call(inputs, dq=dq, dk=dk, dv=dv)
    assert got[0] is dq and got[1] is dk and got[2] is dv
    assert np.all(dq == 1.0) and np.array_equal(dk, inputs["k"]) and np.array_equal(dv, inputs["v"])


def test_numpy_call_frees_its_memory_when_a_launch_fails(fake_staging, rng):
    def fail(args):
        raise RuntimeError("backward: cuLaunchKernel failed: CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES")

    fake_staging.gpu.runs["backward"] = fail
    with pytest.raises(RuntimeError, match="LAUNCH_OUT_OF_RESOURCES"):
        call(random_host_inputs(rng))
    driver = fake_staging.driver
    assert list(driver.buffers) == driver.freed and driver.streams == ["destroyed"]


def test_host_layout_is_256_byte_aligned():
    q, kv = (1, 3, 1, 32), (1, 2, 1, 32)
    shapes = {"dout": q, "q": q, "k": kv, "v": kv, "out": q, "lse": (1, 1, 3), "dq": q, "dk": kv, "dv": kv}
    sizes = {n: 4 if n == "lse" else 2 for n in shapes}
    lay = backward.host_layout(shapes, sizes, 1000)
    assert all(offset % 256 == 0 for offset in lay.offsets.values())
    assert lay.inputs == lay.offsets["dq"] == 6 * 256 and lay.grads == 3 * 256
    assert lay.total == 9 * 256 + 1000


# ------------------------------------------------------------------ precompile and inspect


def test_precompile_lists_the_backward_kernels():
    from numbaflash.tools import precompile

    for arch, cap in (("sm_80", AMPERE), ("sm_86", SM86), ("sm_90a", HOPPER)):
        items = precompile.backward_kernels_for(arch, candidates=False)
        expected = set()
        for d in configs.BACKWARD_DEFAULTS:
            for causal, long in itertools.product((False, True), (False, True)):  # short and long sequences
                if cap == SM86 and d == 256:
                    continue
                config = configs.backward_config(cap, d, causal, long=long)
                # the prepare and dQ kernels do not depend on causal: built once, as non-causal
                expected |= {(config, causal and op == "backward", bf16, arch, op, False)
                             for bf16 in (False, True) for op in families.BACKWARD_OPERATIONS}
                if families.family_of(config).group_splits:  # and its main kernel's GQA-split build
                    expected |= {(config, causal, bf16, arch, "backward", True) for bf16 in (False, True)}
        found = [(s.config, s.causal, s.bf16, s.arch, s.operation, s.group_split) for s in items]
        # Hopper: d64 and d128, causal or not, and d128's long-sequence config, causal or not
        assert sum(s.group_split for s in items) == (12 if arch == "sm_90a" else 0)
        assert len(found) == len(expected) and set(found) == expected
        with_candidates = precompile.backward_kernels_for(arch, candidates=True)
        # the candidates, and the chosen configs (on Hopper its own backward's at d64 and d128)
        assert {s.config for s in with_candidates} == {configs.backward_for_target(c, cap)
                                                        for cs in configs.BACKWARD_CANDIDATES.values()
                                                        for c in cs} | {s.config for s in items}
        assert {s.operation for s in precompile.kernels_for(arch, candidates=False)} == {"forward"}


def test_registry_names_every_shipped_backward_kernel(monkeypatch):
    """``python -m numbaflash.inspect backward`` selects these (names holding "backward"); the
    kernel factories are faked here (the kernels' own offline tests compile the real ones)."""
    from numbaflash.tools import registry

    made = []

    def factory(operation):
        def make(config, causal, bf16, **variant):
            made.append((config, causal, bf16, operation))
            return types.SimpleNamespace(__name__=f"k{len(made)}")
        return make

    fake_common = types.ModuleType("numbaflash.kernels.backward_common")  # both backwards' prepare, dQ
    fake_common.make_backward_prep_kernel = factory("backward_prep")
    fake_common.make_backward_dq_kernel = factory("backward_dq")
    monkeypatch.setitem(sys.modules, "numbaflash.kernels.backward_common", fake_common)
    fake = types.ModuleType("numbaflash.kernels.backward_mma")
    fake.make_backward_kernel = factory("backward")
    monkeypatch.setitem(sys.modules, "numbaflash.kernels.backward_mma", fake)
    fake_ws = types.ModuleType("numbaflash.kernels.backward_ws")  # the Hopper backward (sm90bwd)
    fake_ws.make_backward_ws_kernel = factory("backward")
    monkeypatch.setitem(sys.modules, "numbaflash.kernels.backward_ws", fake_ws)
    kernels = registry.backward_kernels()
    shipped = configs.shipped_backward_configs(long=False)  # the long-sequence ones: on demand
    # a main kernel per (config, causal), one prepare and one dQ kernel per config; both dtypes
    assert len(kernels) == len(made) == 2 * (len(shipped) + 2 * len({c for _, _, c in shipped}))
    argtypes = {"backward_prep": params.BACKWARD_PREP, "backward": params.BACKWARD,
                "backward_dq": params.BACKWARD_DQ}
    for name, (kernel, types_, archs) in kernels.items():
        spec = kernel.spec
        config, causal, bf16, operation = spec.config, spec.causal, spec.bf16, spec.operation
        family = families.family_of(config)
        assert "backward" in name and "forward" not in name
        assert not causal or operation == "backward"
        masking = f"{'causal' if causal else 'full'}_" if operation == "backward" else ""
        kind = masking + ("bf16" if bf16 else "f16")
        shape = f"d{config.head_dim}_m{config.block_m}_n{config.block_n}{config.tag}"
        label = operation.replace("backward", "backward_ws") if family is families.SM90_BWD else operation
        assert re.fullmatch(rf"flash_{label}_{shape}_{kind}", name)
        # each config for the target that compiles it: the H100's (dQ four floats at a time)
        # for sm_90a, the A100's and smaller GPUs' for sm_80; the Hopper backward's for sm_90a
        if family is families.SM90_BWD:
            assert "backward_ws" in name and archs == ("sm_90a",)
            declared = params.WS_BACKWARD if operation == "backward" else argtypes[operation]
            assert types_ == params.numba_types(declared)
            continue
        assert types_ == params.numba_types(argtypes[operation])
        assert archs == (("sm_90a",) if config.dq_vector == 4 else ("sm_80",))
    mains = {(c, causal) for c, causal, _, op in made if op == "backward"}
    assert mains == {(c, causal) for _, causal, c in shipped}
    mma = [c for _, _, c in shipped if families.family_of(c) is families.SM80_BWD]
    own = {c.head_dim for _, _, c in shipped if families.family_of(c) is families.SM90_BWD}
    assert own == set(configs.BACKWARD_WS_DEFAULTS)  # Hopper's own backward at d64 and d128
    assert {c.head_dim for c in mma if c.dq_vector == 4} | own == set(configs.SUPPORTED_HEAD_DIMS)
    made.clear()  # what long query sequences add (built on demand, not registered)
    long = [item for item in configs.shipped_backward_configs() if item not in shipped]
    assert {c for _, _, c in long} == {c for cs in configs.BACKWARD_WS_LONG.values() for c in cs}
    assert len(registry.backward_kernels(long=True)) == len(made) == 2 * (len(long) + 2)


@pytest.mark.parametrize("head_dim", range(32, 257, 32))
def test_prep_split_covers_each_row_once(head_dim):
    """The prepare kernel's threads of a row are a power of two that a shuffle tree sums, their
    16-byte chunks cover the row once, and whole passes fill its CTA's rows."""
    per_row, chunks, rows_per_pass = prep_split(head_dim)
    assert per_row & (per_row - 1) == 0 and 1 <= per_row <= 32
    assert per_row * chunks * 8 == head_dim
    assert rows_per_pass * per_row == PREP_THREADS and PREP_ROWS % rows_per_pass == 0
    covered = sorted(8 * (part + per_row * c) for part in range(per_row) for c in range(chunks))
    assert covered == list(range(0, head_dim, 8))
