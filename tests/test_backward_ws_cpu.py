"""The Hopper backward (``backward_ws``, family sm90bwd) on the host, no GPU and nothing compiled:
its parameter list, its family record, the dispatch (Hopper at head dims 64 and 128, the mma.sync
backward elsewhere and for packed variable-length calls), the dQ accumulator's fragment order
(that of ``WsBackwardConfig.dq_config()``, whose prepare and dQ kernels it shares), and its
launches (tensor maps of q, k, v, dout through the map slots)."""

from __future__ import annotations

import ctypes
import dataclasses
import threading
import types

import numpy as np
import pytest
from test_backward_api_cpu import FakeLauncher, call, device_inputs, fake_gpu  # noqa: F401 (a fixture)

from numbaflash import configs
from numbaflash.kernels import abi, families
from numbaflash.kernels.shapes import WARPGROUP_ROWS, BackwardConfig, WsBackwardConfig
from numbaflash.operands import Operand
from numbaflash.operations import backward
from numbaflash.operations.launch_backward import (
    BackwardCall,
    backward_rows,
    launch_backward_ws_main,
    launch_backward_ws_split,
    workspace_layout,
)
from numbaflash.runtime import launch as runtime_launch

HOPPER, AMPERE, SM86, BLACKWELL = (9, 0), (8, 0), (8, 6), (10, 0)
WS_CONFIGS = [WsBackwardConfig(64, block_m=128, early_p=True),
              WsBackwardConfig(128, block_m=64, late_rows=True)]
# 80 query rows a step: dQᵀ = Kᵀ dSᵀ (FA4's d128 non-causal tile)
WS_80 = WsBackwardConfig(128, block_m=80, late_rows=True)


@pytest.fixture
def fresh_choice():
    configs._backward_choice.cache_clear()
    yield
    configs._backward_choice.cache_clear()


# ------------------------------------------------------------------ parameter list and family


def test_the_abi_is_the_mma_sync_ones_with_tensor_maps():
    # the mma.sync main kernel's, with four tensor maps in place of q, k, v, dout and their strides;
    # the GQA-split build's: the same, then the split (the dK / dV sums, the tickets, splits)
    assert abi.BACKWARD_WS_ABI[:4] == ("array(uint64, 1d, C)",) * 4
    assert abi.BACKWARD_WS_ABI[4:10] == abi.BACKWARD_ABI[4:10]
    assert abi.BACKWARD_WS_ABI[10:] == abi.BACKWARD_ABI[22:]
    assert abi.BACKWARD_WS_SPLIT_ABI[:-3] == abi.BACKWARD_WS_ABI
    assert abi.BACKWARD_WS_SPLIT_ABI[-3:] == ("array(float32, 1d, C)", "array(int32, 1d, C)", "int64")


def test_the_family_record():
    family = families.SM90_BWD
    assert families.FAMILIES["sm90bwd"] is family and families.family_of_table_kind("ws_bwd") is family
    assert family.arch == "sm_90a" and configs.FAMILY_ARCH["sm90bwd"] == "sm_90a"
    for config in WS_CONFIGS:
        assert families.family_of(config) is family
    assert family.operations == families.BACKWARD_OPERATIONS
    assert not family.runs("backward", varlen=True)  # packed calls run the mma.sync's
    expected_abi = {"backward_prep": abi.BACKWARD_PREP_ABI, "backward_dq": abi.BACKWARD_DQ_ABI}
    config = WS_CONFIGS[0]
    for operation in family.operations:
        for window, softcap in ((False, False), (True, False), (False, True), (True, True)):
            spec = families.spec_of(config, operation, causal=True, window=window, softcap=softcap)
            assert families.kernel_abi(spec) == expected_abi.get(operation, abi.BACKWARD_WS_ABI)
            assert spec.causal == (operation == "backward" and not window)  # as built
            # the prepare and dQ kernels are the mma.sync ones: their Numba types too
            assert len(families.kernel_argtypes(spec)) == len(families.kernel_abi(spec))
            assert (spec.family, spec.operation) in families.FACTORIES
    # the table's round trip
    for config in WS_CONFIGS:
        entry = configs.config_to_json(config)
        assert entry["kernel"] == "ws_bwd" and configs.config_from_json(entry) == config


# ------------------------------------------------------------------ dispatch


@pytest.mark.parametrize("causal", [False, True])
def test_hopper_runs_its_own_backward_at_d64_and_d128(causal, fresh_choice):
    assert set(configs.BACKWARD_WS_DEFAULTS) == {64, 128}
    assert configs.BACKWARD_WS_DEFAULTS[64] == [WsBackwardConfig(64, block_m=128, early_p=True)]
    assert configs.BACKWARD_WS_DEFAULTS[128] == [WsBackwardConfig(128, block_m=64, late_rows=True)]
    for d in (64, 128):
        config = configs.backward_config(HOPPER, d, causal)
        assert config == configs.BACKWARD_WS_DEFAULTS[d][0]
        assert families.family_of(config) is families.SM90_BWD
        assert configs.backward_dispatch_family(HOPPER, d) == "sm90bwd"
        for window, softcap in ((True, False), (False, True), (True, True)):  # its own variants, but
            # for the builds that spill (configs.WS_BACKWARD_LEFT_TO_MMA)
            chosen = configs.backward_config(HOPPER, d, causal, window=window, softcap=softcap)
            if (d, window, softcap) in configs.WS_BACKWARD_LEFT_TO_MMA:
                assert families.family_of(chosen) is families.SM80_BWD
            else:
                assert chosen == config
        # packed variable-length calls: the mma.sync backward, as the H100 compiles it
        for w, s in ((False, False), (True, False), (False, True), (True, True)):
            assert configs.backward_dispatch_family(HOPPER, d, w, s, varlen=True) == "sm80bwd"
            mma = configs.backward_config(HOPPER, d, causal, window=w, softcap=s, varlen=True)
            assert type(mma) is BackwardConfig and mma.dq_vector == 4
            assert mma == configs.backward_for_target(configs.backward_config(AMPERE, d, causal, 227 * 1024),
                                                      HOPPER)
    for d in (32, 96, 256):  # head dims it lacks: the mma.sync backward
        config = configs.backward_config(HOPPER, d, causal)
        assert type(config) is BackwardConfig and config.dq_vector == 4
        assert configs.backward_dispatch_family(HOPPER, d) == "sm80bwd"
    for cap in (AMPERE, SM86, BLACKWELL):  # every other GPU: the mma.sync backward
        for d in configs.BACKWARD_DEFAULTS:
            if cap == SM86 and d == 256:
                continue  # no tile fits 99 KB
            assert type(configs.backward_config(cap, d, causal)) is BackwardConfig
            assert configs.backward_dispatch_family(cap, d) == "sm80bwd"


def test_the_hopper_config_is_not_set_for_the_target():
    for config in WS_CONFIGS:
        assert configs.backward_for_target(config, HOPPER) is config
        assert not hasattr(config, "dq_vector") and config.dq_config().dq_vector == 4


def test_a_tuned_hopper_entry_under_its_own_key(table_with, fresh_choice, monkeypatch):
    # d128 has one Hopper tile that fits (block_m 64): the default here is one that does not, so
    # that the entry's tile runs only through the entry
    tuned, too_big = WsBackwardConfig(128, block_m=64), WsBackwardConfig(128, block_m=128)
    monkeypatch.setitem(configs.BACKWARD_WS_DEFAULTS, 128, [too_big])
    assert configs.backward_table_key(128, True, "sm90bwd") == "sm90bwd/d128/causal"
    table_with({"sm90bwd/d128/causal": tuned, "sm80bwd/d128/causal": BackwardConfig(128, block_n=64)})
    configs._backward_choice.cache_clear()
    assert configs.backward_config(HOPPER, 128, True) == tuned
    assert configs.backward_config(HOPPER, 128, False) == configs.backward_for_target(
        configs.BACKWARD_DEFAULTS[128][0], HOPPER)  # no Hopper tile fits: the mma.sync backward's
    # the mma.sync entry: other GPUs, and Hopper's packed calls
    assert configs.backward_config(AMPERE, 128, True) == BackwardConfig(128, block_n=64)
    assert configs.backward_config(HOPPER, 128, True, varlen=True) == \
        BackwardConfig(128, block_n=64, dq_vector=4)


def test_a_wrong_kind_under_a_hopper_key_is_an_error(table_with, fresh_choice):
    table_with({"sm90bwd/d64/full": BackwardConfig(64)})
    configs._backward_choice.cache_clear()
    with pytest.raises(ValueError, match="sm90bwd/d64/full must be a ws_bwd config of head_dim 64"):
        configs.backward_config(HOPPER, 64, False)


def test_no_hopper_tile_fits_a_lowered_limit(fresh_choice):
    """Where a device allows less shared memory than the Hopper tiles need, the mma.sync backward's
    choice for that limit runs."""
    limit = 120 * 1024
    config = configs.backward_config(HOPPER, 128, True, limit)
    assert type(config) is BackwardConfig and config.shared_bytes <= limit and config.dq_vector == 4


def test_force_config_with_a_hopper_config(fresh_choice):
    forced = WsBackwardConfig(128, block_m=128)  # returned as it is, even where it does not fit
    with configs.force_config(HOPPER, True, forced):
        assert configs.OVERRIDES == {"sm90bwd/d128/causal": forced}
        assert configs.backward_config(HOPPER, 128, True) == forced
        assert configs.backward_config(HOPPER, 128, False) == configs.BACKWARD_WS_DEFAULTS[128][0]
        # a packed call runs the mma.sync backward: the forced Hopper config is passed over
        assert type(configs.backward_config(HOPPER, 128, True, varlen=True)) is BackwardConfig
    assert configs.OVERRIDES == {}
    # a forced mma.sync config still runs on Hopper at its head dims
    mma = BackwardConfig(64, block_n=64)
    with configs.force_config(HOPPER, False, mma):
        assert configs.backward_config(HOPPER, 64, False) == configs.backward_for_target(mma, HOPPER)
    for cap in (AMPERE, SM86, BLACKWELL):
        with pytest.raises(ValueError, match=r"needs Hopper \(sm_90a\)"):
            with configs.force_config(cap, True, forced):
                pass
        assert not configs.backward_runnable(forced, cap) and configs.backward_runnable(mma, cap)
    assert configs.backward_runnable(forced, HOPPER)


@pytest.mark.parametrize("causal", [False, True])
def test_long_query_sequences_take_80_row_steps_at_d128(causal, fresh_choice):
    """From ``BACKWARD_LONG_SEQLEN`` query rows (dense calls only) Hopper's d128 backward takes 80
    query rows a step (``BACKWARD_WS_LONG``), causal or not; its window and softcap builds, d64,
    the mma.sync GPUs and packed calls keep their configs."""
    assert configs.BACKWARD_WS_LONG == {128: [WS_80]}
    assert WS_80.dq_split == "t" and WS_80.dq_config().dq_transposed
    assert not configs.backward_is_long(configs.BACKWARD_LONG_SEQLEN - 1)
    assert configs.backward_is_long(configs.BACKWARD_LONG_SEQLEN)
    assert not configs.backward_is_long(1 << 20, varlen=True)
    assert configs.backward_config(HOPPER, 128, causal, long=True) == WS_80
    assert configs.backward_config(HOPPER, 128, causal) == configs.BACKWARD_WS_DEFAULTS[128][0]
    for window, softcap in ((True, False), (False, True)):
        assert (configs.backward_config(HOPPER, 128, causal, window=window, softcap=softcap, long=True)
                == configs.backward_config(HOPPER, 128, causal, window=window, softcap=softcap))
    for d, cap in ((64, HOPPER), (128, AMPERE), (64, AMPERE)):
        assert configs.backward_config(cap, d, causal, long=True) == configs.backward_config(cap, d, causal)
    assert configs.backward_config(HOPPER, 128, causal, varlen=True, long=True).block_m == 64  # mma.sync


def test_the_workspace_rows_hold_whole_80_row_blocks():
    """A config of 80 query rows a step gets rows in multiples of 640 (whole 80-row blocks and
    whole 128-row alignment: the prepare kernel's 64-row blocks), the others as before."""
    assert [backward_rows(s, 80) for s in (1, 640, 641, 16384)] == [640, 640, 1280, 16640]
    assert [backward_rows(s, 64) for s in (1, 129)] == [backward_rows(s) for s in (1, 129)] == [128, 256]
    lay = workspace_layout(2, 3, 1000, 128, 80)
    assert lay.rows == 1280 and lay.counter_elements == 2 * 3 * 16


def test_shipped_backward_configs_hold_the_hopper_ones():
    shipped = configs.shipped_backward_configs()
    own = {(d, causal, c) for d, causal, c in shipped if families.family_of(c) is families.SM90_BWD}
    assert own == {(d, causal, configs.BACKWARD_WS_DEFAULTS[d][0])
                   for d in (64, 128) for causal in (False, True)} | {(128, causal, WS_80)
                                                                    for causal in (False, True)}
    for d in configs.BACKWARD_DEFAULTS:
        for causal in (False, True):
            for cap in (AMPERE, HOPPER):
                assert (d, causal, configs.backward_config(cap, d, causal)) in shipped
    packed = configs.shipped_backward_configs(varlen=True)
    assert all(type(c) is BackwardConfig for _, _, c in packed)
    assert {d for d, _, c in packed if c.dq_vector == 4} == set(configs.SUPPORTED_HEAD_DIMS)


def test_precompile_and_inspect_list_the_hopper_kernels():
    from numbaflash.tools import precompile

    items = precompile.backward_kernels_for("sm_90a", candidates=False)
    own = {(s.config, s.causal, s.operation) for s in items if s.family == "sm90bwd"}
    for d in (64, 128):
        config = configs.BACKWARD_WS_DEFAULTS[d][0]
        assert {(config, False, op) for op in families.BACKWARD_OPERATIONS} <= own
        assert (config, True, "backward") in own
    assert not any(s.family == "sm90bwd" for s in precompile.backward_kernels_for("sm_80", candidates=False))


# ------------------------------------------------------------------ the dQ accumulator's order


@pytest.mark.parametrize("config", [*WS_CONFIGS, WS_80], ids=str)
def test_the_dq_fragments_are_the_consumer_warps_wgmma_accumulators(config):
    """``dq_config().dq_position`` is where the consumer warps' wgmma accumulators of dQ = dS K
    sit: warp ``warp`` of warpgroup w holds rows 16 (warp % 4) (+ 64 w when the warpgroups split
    dQ by rows, ``dq_split`` "m") of every column, or (split "n") of the columns from
    head_dim / consumers · w; element 4 j + e of its lane the m64nN accumulator's (rows lane / 4
    + 8 (e / 2), column 8 j + 2 (lane % 4) + e % 2). With 80 query rows (split "t") the
    accumulator is dQᵀ's: its rows are head-dim columns 64 w + 16 warp .., its columns queries.
    The positions cover the query block once, and ``dq_offset`` (four floats of an n-tile
    adjacent) is a bijection onto it too."""
    config.check()
    dq = config.dq_config()
    dq.check()
    assert dq.threads == 128 * config.consumers == config.threads - 128  # the consumer threads
    assert (dq.block_m, dq.block_n, dq.head_dim, dq.dq_vector) == (config.block_m, config.block_n,
                                                                   config.head_dim, 4)
    split_m, split_t = config.dq_split == "m", config.dq_split == "t"
    assert split_m == (config.block_m == WARPGROUP_ROWS * config.consumers)
    assert split_t == dq.dq_transposed == (config.block_m % WARPGROUP_ROWS != 0)
    cols = config.block_m if split_t else config.head_dim if split_m else config.head_dim // config.consumers
    elements = config.block_m * config.head_dim // dq.threads
    assert dq.dq_fragment_elements == elements == cols // 8 * 4
    positions, offsets = set(), set()
    for tid in range(dq.threads):
        wg, warp, lane = tid // 128, (tid // 32) % 4, tid % 32
        row0 = 16 * warp + (WARPGROUP_ROWS * wg if split_m or split_t else 0)
        col0 = 0 if split_m or split_t else cols * wg
        for i in range(elements):
            j, e = divmod(i, 4)
            expected = (row0 + lane // 4 + 8 * (e // 2), col0 + 8 * j + 2 * (lane % 4) + e % 2)
            if split_t:  # (query, head-dim column)
                expected = expected[::-1]
            assert dq.dq_position(tid, i) == expected, (tid, i)
            positions.add(expected)
            offsets.add(dq.dq_offset(tid, i))
            # what the kernel's add_dq writes: 16-byte vectors of n-tile j, thread after thread
            assert dq.dq_offset(tid, i) == 4 * tid + j * dq.threads * 4 + e
    assert positions == {(r, c) for r in range(config.block_m) for c in range(config.head_dim)}
    assert offsets == set(range(config.block_m * config.head_dim))


# ------------------------------------------------------------------ launches (faked)


class RecordingSlots:
    """``runtime.map_slots.MapSlots``' interface: records each lookup (and encodes its maps) and
    each use; ``fail`` makes the next lookup's launch fail."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.keys: list[tuple] = []
        self.maps: list = []
        self.used_slots: list[tuple[int, int]] = []

    def address(self, key, encode, stream):
        assert self.lock.locked()  # held from lookup to launch
        self.keys.append(key)
        self.maps.append(encode())
        return (1 << 36) + 512 * (len(self.keys) - 1), len(self.keys) - 1

    def used(self, slot, stream):
        self.used_slots.append((slot, stream))


def operand(name, shape, pointer, strides=None):
    b, s, h, d = shape
    strides = strides or (s * h * d, h * d, d, 1)
    return Operand(name, shape, "bfloat16", True, None, strides, pointer, device=0)


def test_the_main_launch_passes_the_maps_and_the_abi(monkeypatch):
    """``launch_backward_ws_main``: one CTA per key block, KV head and batch; the four tensor maps'
    device addresses from the map slots (keyed by layout and the q, k, v, dout pointers, boxes of
    block_m, block_n, block_n, block_m rows and 64 columns, 128B swizzle), then dk, dv, the
    workspace and the scalars as ``BACKWARD_WS_ABI`` packs them; the slot used after the launch,
    a failed launch included."""
    from numbaflash.runtime import map_slots, tensor_map

    config = WsBackwardConfig(128, block_m=64)
    slots = RecordingSlots()
    monkeypatch.setattr(map_slots, "map_slots", lambda ordinal: slots)
    encoded = []

    def encode_tensor_map(pointer, shape, strides, box, swizzle, dtype):
        encoded.append((pointer, shape, tuple(strides), box, swizzle, dtype))
        return np.zeros(16, np.uint64)

    monkeypatch.setattr(tensor_map, "encode_tensor_map", encode_tensor_map)
    b, sq, sk, hq, hkv, d = 2, 300, 333, 8, 2, 128
    qs, ks = (b, sq, hq, d), (b, sk, hkv, d)
    q, k, v, do = (operand(n, s, (i + 1) << 32) for i, (n, s) in enumerate(
        (("q", qs), ("k", ks), ("v", ks), ("dout", qs))))
    dk_strides = (sk * hkv * 256, hkv * 256, 256, 1)  # padded rows
    dk, dv = operand("dk", ks, 5 << 32, dk_strides), operand("dv", ks, 6 << 32)
    lay = workspace_layout(b, hq, sq, d, config.block_m)
    ws = lay.at(7 << 32)
    call_ = BackwardCall(do, q, k, v, operand("out", qs, 8 << 32), operand("dq", qs, 9 << 32), dk, dv,
                         (10 << 32, b * hq * sq), ws, lay.rows, np.float32(0.5), np.float32(0.25), True,
                         11, 0, 5, 7, np.float32(0.125))
    launches = []

    class Launcher:
        def __init__(self, declared=abi.BACKWARD_WS_ABI):
            self.pack, size = runtime_launch._packer(runtime_launch.param_layout(declared), len(declared))
            self.buffer = ctypes.create_string_buffer(size)

        def __call__(self, grid, block, stream, shared, *args):
            self.pack(self.buffer, *args)  # the kinds the ABI names
            launches.append((grid, block, stream, shared, args))

    zeroed = []
    gpu = types.SimpleNamespace(sm_count=lambda ordinal: 132, zero_words=lambda *a: zeroed.append(a))
    launch = launch_backward_ws_main(config)
    launch(Launcher(), call_, gpu)
    key_blocks = -(-sk // config.block_n)
    [(grid, block, stream, shared, args)] = launches
    assert (grid, block, stream, shared) == ((key_blocks * hkv * b, 1, 1), 384, 11, config.shared_bytes)
    maps = 1 << 36
    assert args[:4] == ((maps, 16), (maps + 128, 16), (maps + 256, 16), (maps + 384, 16))
    assert args[4:10] == ((dk.pointer, dk.span), (dv.pointer, dv.span), ws.lse_log2, ws.delta, ws.dq_accum,
                          ws.counters)
    assert args[10:16] == (*dk_strides[:3], *dv.strides[:3])
    tail_pairs = min(hkv * b, -(-2 * 132 // key_blocks))
    assert args[16:] == (sq, sk, lay.rows, hq, hq // hkv, hkv, tail_pairs, np.float32(0.5), np.float32(0.25),
                         True, 5, 7, np.float32(0.125))  # the unsplit build: no split arguments
    assert zeroed == []
    assert slots.keys[0][1:] == (q.pointer, k.pointer, v.pointer, do.pointer)
    assert slots.used_slots == [(0, 11)]
    assert [(p, box) for p, _, _, box, _, _ in encoded] == [
        (q.pointer, (1, 64, 1, 64)), (k.pointer, (1, 128, 1, 64)), (v.pointer, (1, 128, 1, 64)),
        (do.pointer, (1, 64, 1, 64))]
    assert {(swizzle, dtype) for *_, swizzle, dtype in encoded} == {("128B", "bf16")}
    assert [shape for _, shape, _, _, _, _ in encoded] == [qs, ks, ks, qs]
    # the forward's boxes are unchanged: rows (block_m, block_n, block_n, 64) of q, k, v, out
    from numbaflash.operations import launch_forward

    fwd = configs.DEFAULTS[("sm90", 128)]
    fwd_call = types.SimpleNamespace(q=q, k=k, v=v, o=operand("o", qs, 12 << 32), device=0)
    _, layout, _, encode = launch_forward._tensor_maps(fwd)(fwd_call, gpu)
    encoded.clear()
    encode(1, 2, 3, 4)
    assert [box for *_, box, _, _ in encoded] == [(1, fwd.block_m, 1, 64), (1, fwd.block_n, 1, 64),
                                                  (1, fwd.block_n, 1, 64), (1, 64, 1, 64)]
    assert layout != slots.keys[0][0]  # other boxes: another layout

    def failing(*args):
        raise RuntimeError("launch failed")

    with pytest.raises(RuntimeError, match="launch failed"):
        launch(failing, call_._replace(stream=13), gpu)
    assert slots.used_slots[-1] == (1, 13)  # the slot's copy is on the stream: recorded anyway
    # a GQA group split over 4 CTAs: 4x the CTAs (and the tail's pairs), the sums and tickets
    # zeroed on the call's stream first, then passed last with the split
    split_lay = workspace_layout(b, hq, sq, d, config.block_m, key_blocks * hkv * b, config.block_n)
    split_ws = split_lay.at(7 << 32)
    assert split_ws[:4] == ws[:4]  # the parts before the sums are where they were
    split_call = call_._replace(workspace=split_ws, group_splits=4, deterministic=False)
    with pytest.raises(ValueError, match="split build"):  # the unsplit build takes no split call
        launch(Launcher(), split_call, gpu)
    with pytest.raises(ValueError, match="unsplit build"):  # nor the split build an unsplit one
        launch_backward_ws_split(config)(Launcher(), call_, gpu)
    assert zeroed == []
    launch_backward_ws_split(config)(Launcher(abi.BACKWARD_WS_SPLIT_ABI), split_call, gpu)
    grid, _, _, _, args = launches[-1]
    assert grid == (key_blocks * hkv * 4 * b, 1, 1)
    assert zeroed == [(split_ws.dkv_accum[0], split_lay.dkv_elements + split_lay.ticket_elements, 11)]
    assert split_ws.tickets[0] == split_ws.dkv_accum[0] + 4 * split_lay.dkv_elements
    assert args[22] == min(hkv * 4 * b, -(-2 * 132 // key_blocks))
    assert args[-3:] == (split_ws.dkv_accum, split_ws.tickets, 4)


def test_a_hopper_call_loads_and_launches_the_three_kernels(fake_gpu):  # noqa: F811 (the fixture)
    """A d64 call on Hopper: the Hopper backward's config, the prepare and dQ kernels of its
    ``dq_config()`` (their launches: 128 threads, then 256 over block_m rows), the main kernel
    with its 384 threads and shared memory raised; the workspace of its block_m."""
    q_shape, k_shape = (3, 200, 8, 64), (3, 300, 2, 64)
    inputs = device_inputs(q_shape, k_shape)
    dq, dk, dv = call(inputs, causal=True, softmax_scale=0.25)
    config = configs.BACKWARD_WS_DEFAULTS[64][0]
    assert [load[0] for load in fake_gpu.loads] == [config] * 3
    assert [load[3:] for load in fake_gpu.loads] == [("sm_90a", op) for op in families.BACKWARD_OPERATIONS]
    assert [load[1] for load in fake_gpu.loads] == [False, True, False]  # prep/dQ: built non-causal
    main_handle = 2
    assert fake_gpu.raised == [(main_handle, 0, config.shared_bytes)]
    prep, main, dqk = FakeLauncher.launches
    rows = 256
    assert prep[1:5] == ((rows // 64, 8, 3), 128, 0, 0)
    key_blocks = -(-300 // config.block_n)
    # 3 key blocks x 2 KV heads x batch 3 = 18 CTAs on 132 SMs: each group of 4 query heads is
    # split over 4 CTAs (backward_group_splits), its dK and dV summed in the workspace
    assert main[1:5] == ((key_blocks * 2 * 4 * 3, 1, 1), 384, 0, config.shared_bytes)
    assert dqk[1:5] == ((rows // config.block_m, 8, 3), 256, 0, 0)
    lay = workspace_layout(3, 8, 200, 64, config.block_m, key_blocks * 2 * 3, config.block_n)
    ws = lay.at(main[5][6][0])
    assert main[5][-3:] == (ws.dkv_accum, ws.tickets, 4)
    assert fake_gpu.zeroed == [(ws.dkv_accum[0], lay.dkv_elements + lay.ticket_elements, 0)]
    # the main kernel is the split build (its own spec and cache key); the prepare and dQ kernels
    # are the ones every call runs
    split_main = [s for s in fake_gpu.specs if s.operation == "backward"]
    assert [s.group_split for s in split_main] == [True]
    assert split_main[0].kind == "sm90bwd.backward+group_split"
    assert not any(s.group_split for s in fake_gpu.specs if s.operation != "backward")
    assert prep[5][3:7] == (ws.delta, ws.lse_log2, ws.dq_accum, ws.counters)
    assert prep[5][-1] == rows // config.block_m  # counters per (batch, head): the main kernel's blocks
    assert main[5][4:10] == ((dk.pointer, 3 * 300 * 2 * 64), (dv.pointer, 3 * 300 * 2 * 64), ws.lse_log2,
                             ws.delta, ws.dq_accum, ws.counters)
    assert dqk[5][0] == ws.dq_accum and dqk[5][1][0] == dq.pointer
    assert fake_gpu.slots.keys[-1][1:] == tuple(inputs[n].pointer for n in ("q", "k", "v", "dout"))
    assert fake_gpu.slots.used_slots == [(0, 0)]
    assert backward.ready_key(0, 64, True, False, group_split=True) in backward.gpu_state.GPU.launchers
    assert backward.ready_key(0, 64, True, False) not in backward.gpu_state.GPU.launchers
    # deterministic: no split, the workspace of the unsplit call
    FakeLauncher.launches.clear()
    call(inputs, causal=True, softmax_scale=0.25, deterministic=True)
    _, main, _ = FakeLauncher.launches
    assert main[1][0] == key_blocks * 2 * 3 and len(main[5]) == len(abi.BACKWARD_WS_ABI)  # no split arguments
    assert main[5][6] == workspace_layout(3, 8, 200, 64, config.block_m).at(main[5][6][0]).lse_log2
    assert len(fake_gpu.zeroed) == 1
    plain_main = [s for s in fake_gpu.specs if s.operation == "backward"][1:]  # the unsplit build, loaded now
    assert [s.group_split for s in plain_main] == [False]
    assert plain_main[0] == dataclasses.replace(split_main[0], group_split=False)
    assert backward.ready_key(0, 64, True, False) in backward.gpu_state.GPU.launchers
