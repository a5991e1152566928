"""Decode on CPU: the split of a sequence's key tiles (``kernels.decode_mma.decode_split``), the
split count, the page divider and residency, the configs, the checks of bad input (nothing
compiled), the launches against the ABI, and the torch op against a float64 reference."""

from __future__ import annotations

import pytest

from numbaflash.kernels import decode_mma
from numbaflash.kernels.shapes import DecodeConfig

decode_split = decode_mma.decode_split.py_func


@pytest.mark.parametrize("tiles", [0, 1, 2, 7, 64, 513])
@pytest.mark.parametrize("splits", [1, 2, 3, 8, 32, 100])
def test_splits_cover_every_tile_once_in_order(tiles, splits):
    ranges = [decode_split(tiles, splits, s) for s in range(splits)]
    covered = [t for first, last in ranges for t in range(first, last)]
    assert covered == list(range(tiles))
    assert all(0 <= first <= last <= tiles for first, last in ranges)
    sizes = [last - first for first, last in ranges if last > first]
    assert not sizes or max(sizes) - min(sizes[:-1] or sizes) <= 0  # equal but the last


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("m_tiles", [1, 2])
def test_configs_fit_and_the_merge_fits_over_the_ring(head_dim, m_tiles):
    config = DecodeConfig(head_dim, m_tiles=m_tiles)
    config.check()
    q_tile = config.rows * head_dim * 2
    assert config.shared_bytes - q_tile >= config.num_warps * config.rows * (head_dim + 2) * 4


# ------------------------------------------------------------------ the API's checks and launches

import dataclasses  # noqa: E402
import types  # noqa: E402

import numpy as np  # noqa: E402

import numbaflash  # noqa: E402
from numbaflash import configs  # noqa: E402
from numbaflash.operations import decode as decode_op  # noqa: E402
from numbaflash.operations.launch_decode import (  # noqa: E402
    MAX_SPLITS,
    SCRATCH_TAIL_ROWS,
    decode_splits,
    page_divider,
    resident_ctas,
)
from numbaflash.runtime import device  # noqa: E402
from numbaflash.runtime import launch as runtime_launch  # noqa: E402


class FakeDeviceArray:
    """Just enough of ``__cuda_array_interface__`` to be a device array."""

    next_pointer = 1 << 40

    def __init__(self, shape, typestr="<f2", strides=None):
        pointer = FakeDeviceArray.next_pointer
        FakeDeviceArray.next_pointer += 1 << 30
        self.shape = tuple(shape)
        self.dtype = np.dtype(typestr)
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": typestr, "data": (pointer, False),
                                         "strides": strides, "version": 3}


def inputs(batch=2, seqlen_q=1, heads_q=8, heads_kv=2, d=128, capacity=300, seqlen_new=0, paged=False):
    x = {"q": FakeDeviceArray((batch, seqlen_q, heads_q, d)),
         "cache_seqlens": FakeDeviceArray((batch,), "<i4")}
    if paged:
        x["k_cache"] = FakeDeviceArray((40, 16, heads_kv, d))
        x["v_cache"] = FakeDeviceArray((40, 16, heads_kv, d))
        x["block_table"] = FakeDeviceArray((batch, 20), "<i4")
    else:
        x["k_cache"] = FakeDeviceArray((batch, capacity, heads_kv, d))
        x["v_cache"] = FakeDeviceArray((batch, capacity, heads_kv, d))
    if seqlen_new:
        x["k_new"] = FakeDeviceArray((batch, seqlen_new, heads_kv, d))
        x["v_new"] = FakeDeviceArray((batch, seqlen_new, heads_kv, d))
    return x


def call(x, **kwargs):
    x = dict(x)
    return numbaflash.flash_attention_with_kvcache(x.pop("q"), x.pop("k_cache"), x.pop("v_cache"),
                                                   x.pop("cache_seqlens"), **x, **kwargs)


@pytest.fixture
def no_compile(monkeypatch):
    def compile_(*args, **kwargs):
        raise AssertionError("would compile a kernel")

    monkeypatch.setattr(device.GPU, "current", lambda: ((9, 0), 0))
    monkeypatch.setattr(decode_op, "decode_kernels", compile_)


@pytest.mark.parametrize(("change", "error", "match"), [
    ({"cache_seqlens": FakeDeviceArray((2,), "<i8")}, TypeError, "cache_seqlens must be int32"),
    ({"cache_seqlens": FakeDeviceArray((3,), "<i4")}, ValueError, r"cache_seqlens must have shape \(2,\)"),
    ({"k_new": FakeDeviceArray((2, 3, 2, 128))}, ValueError, "k_new and v_new must be given together"),
    ({"k_cache": FakeDeviceArray((2, 300, 3, 128)), "v_cache": FakeDeviceArray((2, 300, 3, 128))}, ValueError,
     "multiple of heads of k/v"),
    ({"k_cache": FakeDeviceArray((3, 300, 2, 128)), "v_cache": FakeDeviceArray((3, 300, 2, 128))}, ValueError,
     "same batch size"),
    ({"k_new": FakeDeviceArray((2, 301, 2, 128)), "v_new": FakeDeviceArray((2, 301, 2, 128))}, ValueError,
     "more than the cache holds"),
    ({"block_table": FakeDeviceArray((2, 20), "<f4")}, TypeError, "block_table must be int32"),
    ({"block_table": FakeDeviceArray((3, 20), "<i4")}, ValueError, "block_table must have shape"),
    ({"num_splits": MAX_SPLITS + 1}, ValueError, "num_splits must be an int"),
    ({"num_splits": True}, ValueError, "num_splits must be an int"),
    ({"causal": "yes"}, TypeError, "causal"),
    ({"out": FakeDeviceArray((2, 1, 8, 64))}, ValueError, "out"),
])
def test_bad_inputs_are_rejected_before_compiling(no_compile, change, error, match):
    with pytest.raises(error, match=match):
        call({**inputs(), **change})


def test_numpy_inputs_are_rejected(no_compile):
    x = {name: np.zeros(a.shape, a.dtype) for name, a in inputs().items()}
    with pytest.raises(TypeError):
        call(x)


def test_splits_from_shapes_only():
    # 512 CTAs fill 264 slots (2 a SM): no split
    assert decode_splits(64, 8, 1, 32768, 64, 132, 2) == 1
    # 8 CTAs: 32 splits take 256 of 264 slots in one wave (33 is past MAX_SPLITS)
    assert decode_splits(1, 8, 1, 8192, 64, 132, 2) == 32
    # 64 CTAs: 4 splits fill one wave (5 would start a second, 20% full: measured 0.60x)
    assert decode_splits(8, 8, 1, 8192, 64, 132, 2) == 4
    assert decode_splits(32, 8, 1, 4096, 64, 132, 2) == 1  # 256 of 264 slots
    assert decode_splits(1, 8, 1, 128, 64, 132, 2) == 1  # 2 tiles: nothing to split
    assert decode_splits(1, 1, 1, 1 << 20, 64, 132) == MAX_SPLITS  # capped for graph capture
    # one CTA a SM (d128): 8 x 8192 keys in 2 splits, 1 x 8192 and 1 x 131072 in 16 (128 of 132 SMs)
    assert decode_splits(8, 8, 1, 8192, 64, 132, 1) == 2
    assert decode_splits(1, 8, 1, 8192, 64, 132, 1) == 16
    assert decode_splits(1, 8, 1, 131072, 64, 132, 1) == 16
    assert decode_splits(16, 8, 1, 8192, 64, 132, 1) == 1  # 128 CTAs: 97% of the SMs
    # two a SM (the ring of 2): 136-192 CTAs give every SM one and stream best unsplit (DEC.6)
    assert decode_splits(17, 8, 1, 4096, 64, 132, 2) == decode_splits(24, 8, 1, 4096, 64, 132, 2) == 1
    assert decode_splits(16, 8, 1, 4096, 64, 132, 2) > 1  # 128 CTAs leave SMs without one
    for b, h, keys, per_sm in ((1, 1, 64, 1), (3, 2, 5000, 2), (16, 8, 65536, 3), (5, 3, 20000, 4)):
        s = decode_splits(b, h, 1, keys, 64, 132, per_sm)
        assert 1 <= s <= MAX_SPLITS and (s == 1 or -(-keys // 64) // s >= 4)


def test_streaming_ctas_keep_64_kb_in_flight_a_sm():
    """d128 (64-key tiles, a ring of 3) has 64 KB of K and V on the way a CTA: one a SM; d64
    (128 keys, a ring of 2) 32 KB: two; d32 16 KB: four, if the SM holds them."""
    from numbaflash.kernels.shapes import DecodeConfig
    from numbaflash.operations.launch_decode import streaming_ctas

    d128, d64, d32 = DecodeConfig(128), DecodeConfig(64, block_n=128, stages=2), DecodeConfig(32)
    assert (d128.bytes_in_flight, d64.bytes_in_flight, d32.bytes_in_flight) == (65536, 32768, 16384)
    assert streaming_ctas(d128.bytes_in_flight, 2) == 1
    assert streaming_ctas(d64.bytes_in_flight, 3) == 2
    assert streaming_ctas(d32.bytes_in_flight, 3) == 3 and streaming_ctas(d32.bytes_in_flight, 8) == 4
    assert streaming_ctas(DecodeConfig(256).bytes_in_flight, 1) == 1


def test_streaming_ctas_scale_with_each_sms_share_of_the_hbm():
    """An H200's SMs each get 1.47x an H100's bandwidth: d64's 32 KB a CTA takes three a SM (the
    nearest count to 94 KB), d128's ring of 3 (64 KB) still one, and MLA's 72 KB one; an H100's
    own bandwidth, a slower GPU's, or none reported (0) keep the H100's counts."""
    from numbaflash.kernels.shapes import DecodeConfig
    from numbaflash.operations.launch_decode import REFERENCE_SM_BANDWIDTH, streaming_ctas

    d128, d64 = DecodeConfig(128), DecodeConfig(64, block_n=128, stages=2)
    h200 = 4.92e12 / 132
    assert streaming_ctas(d64.bytes_in_flight, 3, h200) == 3
    assert streaming_ctas(d64.bytes_in_flight, 2, h200) == 2  # never more than the SM holds
    assert streaming_ctas(d128.bytes_in_flight, 2, h200) == 1
    assert streaming_ctas(72 * 1024, 2, h200) == 1
    assert streaming_ctas(48 * 1024, 3, h200) == 2  # the H100's ceiling is a floor: ceil(64 / 48)
    for bandwidth in (REFERENCE_SM_BANDWIDTH, 2.0e12 / 108, 0.0):
        assert streaming_ctas(d64.bytes_in_flight, 3, bandwidth) == 2
        assert streaming_ctas(d128.bytes_in_flight, 2, bandwidth) == 1
        assert streaming_ctas(48 * 1024, 3, bandwidth) == 2


@pytest.mark.parametrize("limit", [99 * 1024, 163 * 1024, 227 * 1024])
def test_occupancy_shared_holds_an_sm_to_the_streaming_ctas(limit):
    from numbaflash.kernels.shapes import DecodeConfig
    from numbaflash.operations.launch_decode import occupancy_shared

    d64 = DecodeConfig(64, block_n=128, stages=2)
    for config in (DecodeConfig(128), d64, DecodeConfig(32), DecodeConfig(96)):
        if config.shared_bytes > limit:
            continue
        resident = resident_ctas(config.threads, 128, config.shared_bytes, limit)
        for ctas in range(1, resident + 1):
            asked = occupancy_shared(config.shared_bytes, ctas, limit)
            assert config.shared_bytes <= asked <= limit
            assert resident_ctas(config.threads, 128, asked, limit) == ctas


# 1, powers of two and their neighbours (the shift's steps), odd and prime sizes, the served page
# sizes and large ones: where the multiply-and-shift can be off by one.
@pytest.mark.parametrize("page_size", [1, 2, 3, 5, 7, 15, 16, 17, 63, 64, 65, 100, 127, 128, 129, 255, 256,
                                       257, 251, 1000, 4095, 4096, 4097, 65535, 1 << 20])
def test_page_divider_divides(page_size):
    magic, shift = page_divider(page_size)
    rng = np.random.default_rng(page_size)
    keys = [*range(3 * page_size + 2), *(int(j) for j in rng.integers(0, 1 << 31, 200)), (1 << 31) - 1]
    for j in keys:
        assert (j * magic) >> shift == j // page_size and j * magic < 1 << 64


def test_32_row_tiles_only_up_to_head_dim_128():
    """At d256 the 32-row kernel spills (its O is 256 floats a thread): 16-row tiles instead."""
    from numbaflash.configs import decode_config, shipped_decode_configs

    assert decode_config((9, 0), 128, 32, False).m_tiles == 2
    assert decode_config((9, 0), 256, 32, False).m_tiles == 1
    assert decode_config((9, 0), 256, 128, True).m_tiles == 1
    assert all(c.m_tiles == 1 for c in shipped_decode_configs() if c.head_dim > 128)


def test_a_combine_warp_holds_every_split():
    from numbaflash.kernels.decode_mma import SPLITS_PER_WARP

    assert MAX_SPLITS <= SPLITS_PER_WARP  # lane s of the combine warp reads split s


def test_the_split_scratch_holds_every_combine_load():
    """A combine warp loads SPLITS_PER_WARP splits of its row at constant offsets, past the row's
    last split too: from the last row of a call with 2 splits, (SPLITS_PER_WARP - 2) rows of
    head_dim floats past the partials. The scratch's LSEs and its tail cover that (the bind gives
    the combine kernel the whole scratch: ``test_launches_match_the_abi``)."""
    from numbaflash.kernels.decode_mma import SPLITS_PER_WARP

    assert SCRATCH_TAIL_ROWS >= SPLITS_PER_WARP - 2
    for rows, splits, d in ((1, 2, 256), (3, 5, 64), (4, 32, 128)):
        n = rows * splits
        last_read = ((rows - 1) * splits + SPLITS_PER_WARP - 1) * d + d - 1
        assert last_read < n * (d + 1) + SCRATCH_TAIL_ROWS * d


def test_resident_ctas():
    # d128 decode on an H100: 168 registers, 100 KB: shared memory allows 2, registers 3
    assert resident_ctas(128, 168, 100 * 1024, 227 * 1024) == 2
    assert resident_ctas(128, 168, 50 * 1024, 227 * 1024) == 3  # then registers bound it
    assert resident_ctas(128, 255, 34 * 1024, 227 * 1024) == 2  # 256 registers a thread: 2 x 4 warps
    assert resident_ctas(128, 32, 1024, 227 * 1024) == 16  # 2048 threads
    assert resident_ctas(128, 64, 1024, 227 * 1024) == 8  # 64 registers: 8 CTAs
    assert resident_ctas(256, 255, 200 * 1024, 99 * 1024) == 1  # never below one


class FakeLauncher:
    launches: list = []
    programmatic: dict = {}  # launcher name -> launched programmatically

    def __init__(self, kernel, argtypes, name="kernel", programmatic=False):
        self.name, self.argtypes = name, argtypes
        FakeLauncher.programmatic[name] = programmatic

    def bind(self, grid, block, shared_bytes, *args):
        """KernelLauncher.bind's contract: fire(stream, *array pointers, in parameter order)."""
        assert len(args) == len(self.argtypes), (self.name, len(args), len(self.argtypes))
        arrays = [i for i, name in enumerate(self.argtypes) if name.startswith("array")]

        def fire(stream, *pointers):
            assert len(pointers) == len(arrays), (self.name, len(pointers), len(arrays))
            full = list(args)
            for i, pointer in zip(arrays, pointers, strict=True):
                full[i] = (pointer, args[i][1])
            FakeLauncher.launches.append((self.name, grid, block, shared_bytes, tuple(full)))

        return fire


def kernel_name(spec) -> str:
    """A fake kernel's name: its operation and variant (``decode_window_softcap``)."""
    return spec.operation + "_window" * spec.window + "_softcap" * spec.softcap


@pytest.fixture
def fake_gpu(monkeypatch):
    state = device.GpuState()
    monkeypatch.setattr(device, "GPU", state)
    monkeypatch.setattr(state, "current", lambda: ((9, 0), 0))
    monkeypatch.setattr(state, "shared_limit", lambda ordinal: 227 * 1024)
    monkeypatch.setattr(state, "sm_count", lambda ordinal: 132)
    monkeypatch.setattr(state, "scratch_f32", lambda ordinal: (0xF000, 1))
    monkeypatch.setattr(decode_op, "loaded_kernel",
                        lambda spec: (types.SimpleNamespace(handle=1), kernel_name(spec)))
    monkeypatch.setattr(runtime_launch, "KernelLauncher", FakeLauncher)
    monkeypatch.setattr(runtime_launch, "set_dynamic_shared_limit", lambda handle, ordinal, nbytes: None)
    monkeypatch.setattr(runtime_launch, "kernel_registers", lambda handle, ordinal: 168)
    monkeypatch.setattr(decode_op, "empty_like", lambda ref, shape, dtype_name: FakeDeviceArray(shape))
    monkeypatch.setattr(decode_op, "empty_lse", lambda ref, shape: FakeDeviceArray(shape, "<f4"))
    monkeypatch.setattr(FakeLauncher, "launches", [])


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("splits", [1, 4])
def test_launches_match_the_abi(fake_gpu, paged, splits):
    out, lse = call(inputs(seqlen_q=2, seqlen_new=2, paged=paged), num_splits=splits, return_lse=True)
    assert out.shape == (2, 2, 8, 128) and lse.shape == (2, 8, 2)
    names = [launch[0] for launch in FakeLauncher.launches]
    assert names == ["decode", "decode_combine"] if splits > 1 else names[:1] == ["decode"]
    _, grid, block, shared, args = FakeLauncher.launches[0]
    rows = 4 * 2  # group 4 x seqlen_q 2: one row block of 16
    assert grid == (splits, 1 * 2, 2) and block == 128 and rows <= 16
    # d128 streams best at one CTA a SM (the ring of 3): the launch holds the SM to it; a paged
    # cache at two a SM (the ring of 2), where the second CTA hides the block table's work
    assert shared == (113 if paged else 227) * 1024
    assert args[-3] == splits
    assert args[-1] is (splits == 1)  # the decode kernel writes the LSE only without a combine
    if splits > 1:  # one combine warp per 32 columns of the 2 x 8 x 2 rows; it sees the whole scratch
        _, grid, block, shared, args = FakeLauncher.launches[1]
        n = 2 * 8 * 2 * splits
        assert grid == (2 * 8 * 2 * (128 // 32) // 4, 1, 1) and block == 128
        assert args[0][1] == n * (128 + 1) + SCRATCH_TAIL_ROWS * 128


def test_a_grid_wider_than_the_sms_runs_the_ring_of_2_two_a_sm(fake_gpu, monkeypatch):
    """d128: 64 (batch, KV head) CTAs fill half the 132 SMs: the ring of 3 at one CTA a SM and 2
    splits; 256 outnumber them: the ring of 2 at two a SM, one split, in one wave (DEC.6)."""
    built = []
    monkeypatch.setattr(decode_op, "loaded_kernel", lambda spec:
                        (built.append(spec.config) or types.SimpleNamespace(handle=1), spec.operation))
    for batch, stages, splits, shared in ((32, 3, 2, 227 * 1024), (128, 2, 1, 113 * 1024)):
        FakeLauncher.launches.clear()
        call(inputs(batch=batch, capacity=4096))
        assert built[-1].stages == stages and built[-1].block_n == 64
        _, grid, _, launch_shared, _ = FakeLauncher.launches[0]
        assert grid[0] == splits and launch_shared == shared
        assert resident_ctas(128, 168, launch_shared, 227 * 1024) == (1 if stages == 3 else 2)


def test_a_paged_cache_runs_two_ctas_a_sm_by_rows_or_by_tiles(fake_gpu, monkeypatch):
    """A paged cache whose rows are looked up one by one issues more than a contiguous one's walk
    (the rows' addresses from shared memory): at one CTA a SM (4 warps) it streamed at 0.72-0.83 of
    the contiguous cache on an H200, at two a SM 0.92-1.00 (docs/PERFORMANCE.md [PG]). So at d128
    and 16 rows it takes the ring of 2 at two CTAs a SM with twice the splits (pages of 16), and
    at d64 the 128-key tiles. Pages that hold whole tiles (64 rows here) take the same config with
    ``page_tiles`` (a tile's page looked up once: 0.959-0.983 of the contiguous cache against
    0.936-0.970, docs/PERFORMANCE.md [PT]), and a cache_leftpad (keys from any row of a page) keeps
    the lookup by rows."""
    built = []
    monkeypatch.setattr(decode_op, "loaded_kernel", lambda spec:
                        (built.append(spec.config) or types.SimpleNamespace(handle=1), spec.operation))
    cases = ((0, 3, 2, 227 * 1024), (16, 2, 4, 113 * 1024), (64, 2, 4, 113 * 1024))  # page 0: contiguous
    for page, stages, splits, shared in cases:
        FakeLauncher.launches.clear()
        x = inputs(batch=32, capacity=4096)  # 64 (batch, KV head) CTAs, 4096 keys each
        if page:  # the same keys in pages
            x["k_cache"], x["v_cache"] = (FakeDeviceArray((32 * 4096 // page, page, 2, 128)) for _ in "kv")
            x["block_table"] = FakeDeviceArray((32, 4096 // page), "<i4")
        call(x)
        config = built[-1]
        assert config.stages == stages and config.block_n == 64 and config.paged == (page > 0)
        assert config.page_tiles == (page == 64)
        _, grid, _, launch_shared, _ = FakeLauncher.launches[0]
        assert grid[0] == splits and launch_shared == shared
        if page == 64:  # the same cache with a cache_leftpad: rows of any page offset
            call(x, cache_leftpad=FakeDeviceArray((32,), "<i4"))
            assert built[-1].paged and not built[-1].page_tiles and built[-1].stages == 2
    assert configs.decode_config((9, 0), 64, 16, True) == DecodeConfig(64, block_n=128, num_warps=4, stages=2,
                                                                       paged=True)
    assert configs.decode_config((9, 0), 64, 16, True, page_size=64).page_tiles is False  # 128-key tiles
    assert configs.decode_config((9, 0), 64, 16, True, page_size=256) == DecodeConfig(
        64, block_n=128, num_warps=4, stages=2, paged=True, page_tiles=True)
    assert configs.decode_config((9, 0), 128, 16, True, page_size=256) == dataclasses.replace(
        configs.decode_config((9, 0), 128, 16, True), page_tiles=True)


def test_a_paged_configs_row_addresses_follow_its_shared_memory():
    """The paged walk's two buffers of key-row addresses (16 bytes a row, ``st.shared.v4``) sit
    16-byte aligned after the Q tile and the ring or the merge, inside the shared memory the
    config asks for; a contiguous config asks for none."""
    shipped = configs.shipped_decode_configs()
    assert any(c.paged for c in shipped)
    for config in shipped:
        assert config.page_rows_at % 16 == 0
        extra = 2 * config.block_n * 16 if config.paged and not config.page_tiles else 0
        assert config.shared_bytes == config.page_rows_at + extra <= 227 * 1024
        same = dataclasses.replace(config, paged=not config.paged, page_tiles=False)
        assert same.page_rows_at == config.page_rows_at
    assert any(c.page_tiles for c in shipped)


@pytest.mark.parametrize(("capability", "expected"), [((9, 0), True), ((8, 0), False), ((8, 9), False)])
def test_decode_launches_programmatically_from_sm90(fake_gpu, monkeypatch, capability, expected):
    """From sm_90 both kernels are launched with programmatic stream serialization: each may
    start before the kernel ahead of it in the stream ends and waits for it in
    ``ptx.grid_dependency_wait`` before reading its inputs."""
    monkeypatch.setattr(device.GPU, "current", lambda: (capability, 0))
    monkeypatch.setattr(FakeLauncher, "programmatic", {})
    call(inputs(seqlen_q=2), num_splits=3)
    assert FakeLauncher.programmatic == {"decode": expected, "decode_combine": expected}


# ------------------------------------------------------------------ the torch op (CPU, references)


def reference_kvcache(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, causal, softmax_scale,
                      num_splits):
    """What the op returns, in float64 (contiguous caches only), appending k_new / v_new in place."""
    from tests._torch_attention import reference_forward

    torch = pytest.importorskip("torch")
    outs, lses = [], []
    for b in range(q.shape[0]):
        n = int(cache_seqlens[b])
        if k_new is not None:
            k_cache[b, n:n + k_new.shape[1]] = k_new[b]
            v_cache[b, n:n + v_new.shape[1]] = v_new[b]
            n += k_new.shape[1]
        out, lse = reference_forward(q[b:b + 1], k_cache[b:b + 1, :n], v_cache[b:b + 1, :n], causal,
                                     softmax_scale)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def decode_tensors(torch, seqlen_new=1):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 1, 8, 64, generator=gen).half()
    kc, vc = (torch.randn(2, 40, 2, 64, generator=gen).half() for _ in range(2))
    lens = torch.tensor([5, 30], dtype=torch.int32)
    kn, vn = (torch.randn(2, seqlen_new, 2, 64, generator=gen).half() for _ in range(2))
    return q, kc, vc, lens, kn, vn


def test_kvcache_op_fake_kernel_and_opcheck(monkeypatch):
    torch = pytest.importorskip("torch")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from numbaflash import torch_ops

    monkeypatch.setattr(torch_ops, "run_kvcache", reference_kvcache)
    with FakeTensorMode():
        q = torch.empty(3, 4, 8, 128, dtype=torch.bfloat16, device="cuda")
        kc = torch.empty(3, 100, 2, 128, dtype=torch.bfloat16, device="cuda")
        lens = torch.empty(3, dtype=torch.int32, device="cuda")
        out, lse = numbaflash.flash_attention_with_kvcache(q, kc, kc.clone(), lens, return_lse=True)
        assert (out.shape, out.dtype) == (q.shape, q.dtype)
        assert (tuple(lse.shape), lse.dtype) == ((3, 8, 4), torch.float32)
    q, kc, vc, lens, kn, vn = decode_tensors(torch)
    torch.library.opcheck(torch.ops.numbaflash.flash_attention_with_kvcache.default,
                          (q, kc, vc, lens, kn, vn, None, True, 0.125, 0))


def test_compiled_decode_step_has_no_graph_break(monkeypatch):
    torch = pytest.importorskip("torch")
    from numbaflash import torch_ops

    monkeypatch.setattr(torch_ops, "run_kvcache", reference_kvcache)
    torch._dynamo.reset()

    def step(q, kc, vc, lens, kn, vn):
        out = numbaflash.flash_attention_with_kvcache(q, kc, vc, lens, k_new=kn, v_new=vn)
        lens.add_(1)
        return out

    q, kc, vc, lens, kn, vn = decode_tensors(torch)
    explained = torch._dynamo.explain(step)(q, kc.clone(), vc.clone(), lens.clone(), kn, vn)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    eager_caches = (kc.clone(), vc.clone(), lens.clone())
    got = compiled(q, kc, vc, lens, kn, vn)
    want, _ = reference_kvcache(q, eager_caches[0], eager_caches[1], eager_caches[2], kn, vn, None, True,
                                0.125, 0)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert torch.equal(kc, eager_caches[0]) and torch.equal(lens, torch.tensor([6, 31], dtype=torch.int32))


# ------------------------------------------------------------------ sliding window and softcap (issue 35)

import math  # noqa: E402

from numbaflash.kernels import abi  # noqa: E402
from numbaflash.kernels.families import kernel_abi, spec_of  # noqa: E402
from numbaflash.operations.forward import WINDOW_UNBOUNDED  # noqa: E402


@pytest.mark.parametrize(("change", "error", "match"), [
    ({"window_size": (3,)}, TypeError, r"window_size must be a pair \(left, right\) of ints.*tuple \(3,\)"),
    ({"window_size": (1.5, 2)}, TypeError, r"window_size must be a pair .* got tuple \(1.5, 2\)"),
    ({"window_size": (True, 2)}, TypeError, "window_size must be a pair"),
    ({"window_size": 4}, TypeError, "got int 4"),
    ({"window_size": (-2, 0)}, ValueError, r"each -1 \(unbounded\) or >= 0, got \(-2, 0\)"),
    ({"window_size": (0, -5)}, ValueError, r"got \(0, -5\)"),
    ({"softcap": -1.0}, ValueError, "softcap must be 0 .* got -1.0"),
    ({"softcap": float("inf")}, ValueError, "softcap must be 0"),
    ({"softcap": "30"}, TypeError, "softcap must be a real number"),
    ({"softcap": True}, TypeError, "softcap must be a real number"),
    ({"softcap": 1e-40}, ValueError, "normal float32 values"),
])
def test_bad_window_or_softcap_is_rejected_before_compiling(no_compile, change, error, match):
    with pytest.raises(error, match=match):
        call(inputs(), **change)


def test_variant_abi_is_the_plain_one_and_the_window_and_softcap():
    assert abi.DECODE_VARIANT_ABI == (*abi.DECODE_ABI, "int64", "int64", "float32")
    config = DecodeConfig(128)
    for window, softcap in ((True, False), (False, True), (True, True)):
        spec = spec_of(config, "decode", causal=True, window=window, softcap=softcap)
        assert kernel_abi(spec) == abi.DECODE_VARIANT_ABI and spec.causal == (not window)
    assert kernel_abi(spec_of(config, "decode")) == abi.DECODE_ABI
    combine = spec_of(config, "decode", causal=True, window=True, softcap=True).sibling("decode_combine")
    assert combine == spec_of(config, "decode_combine")  # one combine kernel serves every variant


def _window_tiles(total, seqlen_q, group, r0, rows, block_n, left, right, monkeypatch):
    from numbaflash.kernels import blocks

    monkeypatch.setattr(decode_mma, "band_kv_tiles", blocks.band_kv_tiles.py_func)
    return decode_mma.window_tiles.py_func(total, seqlen_q, group, r0, rows, block_n, left, right)


@pytest.mark.parametrize("seed", range(40))
def test_window_tiles_hold_exactly_the_visible_keys_and_splits_cover_them(monkeypatch, seed):
    """The kernel's key range of one row block (``window_tiles``): every key that one of its rows
    sees (FlashAttention's rule with the sequence's own length) lies in it, its first and last
    tiles each hold such a key, it is empty where no row sees a key, and the splits of the range
    (``decode_split`` offset by its first tile) cover it once."""
    rng = np.random.default_rng(seed)
    block_n, rows_per_block = 64, 16
    group = int(rng.choice([1, 2, 4, 8]))
    seqlen_q = int(rng.integers(1, 17))
    total = int(rng.choice([0, 1, 2, 63, 64, 65, int(rng.integers(1, 3000))]))
    left = int(rng.choice([0, 1, 5, 127, int(rng.integers(0, 4000)), WINDOW_UNBOUNDED]))
    right = int(rng.choice([0, 1, 3, int(rng.integers(0, 20)), WINDOW_UNBOUNDED]))
    rows_total = group * seqlen_q
    for r0 in range(0, rows_total, rows_per_block):
        rows = min(rows_per_block, rows_total - r0)
        first, end = _window_tiles(total, seqlen_q, group, r0, rows, block_n, left, right, monkeypatch)
        seen = set()
        for r in range(r0, r0 + rows):
            i = r // group
            lo, hi = max(i + total - seqlen_q - left, 0), min(i + total - seqlen_q + right, total - 1)
            seen |= set(range(lo, hi + 1))
        tiles = sorted({j // block_n for j in seen})
        if not tiles:
            assert first == end
        else:
            assert (first, end) == (tiles[0], tiles[-1] + 1)
        for splits in (1, 3, 32):
            covered = []
            for s in range(splits):
                a, b = decode_split(end - first, splits, s)
                covered += range(first + a, first + b)
            assert covered == list(range(first, end))


def _calls(x, **kwargs):
    """The decode launches of one call: (operation, grid, parameters)."""
    FakeLauncher.launches.clear()
    call(x, **kwargs)
    return [(name, grid, args) for name, grid, _, _, args in FakeLauncher.launches]


@pytest.mark.parametrize(("kwargs", "variant", "sides"), [
    ({}, (False, False), None),  # causal by default: the plain causal kernel
    ({"causal": False}, (False, False), None),
    ({"window_size": (-1, -1), "softcap": 0.0}, (False, False), None),
    ({"window_size": (5, -1)}, (True, False), (5, 0)),  # causal sets the right side to 0
    ({"window_size": (5, -1), "causal": False}, (True, False), (5, WINDOW_UNBOUNDED)),
    ({"window_size": (0, 0), "causal": False}, (True, False), (0, 0)),
    ({"window_size": (-1, 0), "causal": False}, (False, False), None),  # the causal kernel
    ({"window_size": (299, 3), "causal": False}, (False, False), None),  # wider than any sequence: plain
    ({"window_size": (298, -1), "causal": False}, (True, False), (298, WINDOW_UNBOUNDED)),
    ({"window_size": (-1, 1), "causal": False}, (False, False), None),  # right >= seqlen_q - 1: unbounded
    ({"window_size": (-1, 0), "causal": False, "seqlen_q": 3}, (False, False), None),  # causal, any seqlen_q
    ({"window_size": (2, 1), "causal": False, "seqlen_q": 3}, (True, False), (2, 1)),
    ({"softcap": 30.0}, (False, True), (0, 0)),
    ({"softcap": 30, "window_size": (7, 0)}, (True, True), (7, 0)),
])
def test_window_and_softcap_dispatch_and_arguments(fake_gpu, monkeypatch, kwargs, variant, sides):
    kwargs = dict(kwargs)
    built = []
    monkeypatch.setattr(decode_op, "loaded_kernel", lambda spec:
                        built.append((spec.window, spec.softcap, spec.causal))
                        or (types.SimpleNamespace(handle=1), kernel_name(spec)))
    seqlen_q = kwargs.pop("seqlen_q", 2)
    launches = _calls(inputs(seqlen_q=seqlen_q), num_splits=1, **kwargs)
    assert [name for name, _, _ in launches] == [kernel_name(types.SimpleNamespace(
        operation="decode", window=variant[0], softcap=variant[1]))]
    args = launches[0][2]
    scale = 1 / math.sqrt(128)
    softcap = float(kwargs.get("softcap", 0.0))
    if variant == (False, False):
        assert len(args) == len(abi.DECODE_ABI)
        assert args[-2] == np.float32(scale * math.log2(math.e))
        causal = kwargs.get("causal", True) or kwargs.get("window_size") == (-1, 0)
        assert built[0] == (False, False, causal)
        return
    assert len(args) == len(abi.DECODE_VARIANT_ABI)
    assert tuple(args[-3:-1]) == sides
    assert args[-5] == np.float32((softcap or scale) * math.log2(math.e))  # scale_log2
    assert args[-1] == np.float32(scale / softcap if softcap else 0.0)
    window, softcap_variant = variant
    assert built[0] == (window, softcap_variant, not window and kwargs.get("causal", True))


def test_window_splits_follow_the_window_not_the_cache(fake_gpu):
    """4 CTAs on 132 SMs: a 32768-row cache gets 32 splits, a window of 100 keys one (its tiles
    are too few to share), both from the shapes alone."""
    x = inputs(capacity=32768)
    plain = _calls(x)
    assert plain[0][1][0] == MAX_SPLITS and [n for n, _, _ in plain] == ["decode", "decode_combine"]
    window = _calls(x, window_size=(100, 0))
    assert window[0][0] == "decode_window" and window[0][1][0] == 1 and len(window) == 1
    wide = _calls(x, window_size=(4000, 0))  # 64 tiles or so: 16 splits of 4 tiles
    assert wide[0][0] == "decode_window" and wide[0][1][0] == decode_splits(2, 2, 1, 4001 + 64, 64, 132, 1)


def test_plain_calls_keep_their_plans_apart_from_windowed_ones(fake_gpu):
    x = inputs()
    assert _calls(x)[0][0] == "decode"
    assert _calls(x, window_size=(3, 0))[0][0] == "decode_window"
    assert _calls(x, softcap=20.0)[0][0] == "decode_softcap"
    assert _calls(x)[0][0] == "decode"


def test_kvcache_op_takes_window_and_softcap(monkeypatch):
    torch = pytest.importorskip("torch")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from numbaflash import torch_ops

    seen = []
    monkeypatch.setattr(torch_ops, "run_kvcache", lambda *args: seen.append(args[10:]) or reference_kvcache(
        *args[:10]))
    with FakeTensorMode():
        q = torch.empty(3, 4, 8, 128, dtype=torch.bfloat16, device="cuda")
        kc = torch.empty(3, 100, 2, 128, dtype=torch.bfloat16, device="cuda")
        lens = torch.empty(3, dtype=torch.int32, device="cuda")
        out = numbaflash.flash_attention_with_kvcache(q, kc, kc.clone(), lens, window_size=(8, 0),
                                                      softcap=30.0)
        assert out.shape == q.shape
        with pytest.raises(ValueError, match="window_size"):
            numbaflash.flash_attention_with_kvcache(q, kc, kc.clone(), lens, window_size=(-3, 0))
    q, kc, vc, lens, kn, vn = decode_tensors(torch)
    torch.library.opcheck(torch.ops.numbaflash.flash_attention_with_kvcache.default,
                          (q, kc, vc, lens, kn, vn, None, True, 0.125, 0, 4, 0, 30.0))
    assert seen and seen[-1] == ((4, 0), 30.0)


# ------------------------------------------------------------------ a learnable sink (issue 56)


@pytest.mark.parametrize(("sink", "error", "match"), [
    (FakeDeviceArray((4,), "<f4"), ValueError, r"learnable_sink must have shape \(heads_q,\) = \(8,\), got"),
    (FakeDeviceArray((8,), "<f2"), TypeError, "learnable_sink must be float32, got float16"),
])
def test_a_bad_sink_is_rejected_before_compiling(no_compile, sink, error, match):
    with pytest.raises(error, match=match):
        call(inputs(), learnable_sink=sink)


@pytest.mark.parametrize("splits", [1, 4])
def test_a_sink_call_runs_the_sink_build_with_the_sink_last(fake_gpu, monkeypatch, splits):
    """The sink build of the plain call's config, its own plan; its parameters are the plain call's
    then the sink (pointer, heads_q); the combine kernel's launch is the plain call's."""
    built = []
    monkeypatch.setattr(decode_op, "loaded_kernel", lambda spec: built.append(spec)
                        or (types.SimpleNamespace(handle=1), kernel_name(spec)))
    x = inputs(seqlen_q=2, seqlen_new=1)
    plain = _calls(x, num_splits=splits, return_lse=True)
    sink = FakeDeviceArray((8,), "<f4")
    with_sink = _calls(x, num_splits=splits, return_lse=True, learnable_sink=sink)
    assert [s.sink for s in built if s.operation == "decode"] == [False, True]
    assert len(with_sink) == len(plain) == (2 if splits > 1 else 1)
    assert with_sink[0][2][-1] == (sink.__cuda_array_interface__["data"][0], 8)
    assert len(with_sink[0][2]) == len(abi.DECODE_ABI) + 1
    assert with_sink[0][1] == plain[0][1]
    for a, b in zip(with_sink[0][2][:-1], plain[0][2], strict=True):
        assert a == b or (isinstance(a, tuple) and a[1] == b[1])  # array pointers: new outputs
    if splits > 1:
        assert [len(a) for _, _, a in with_sink[1:]] == [len(a) for _, _, a in plain[1:]]
    assert len(device.GPU.plans) == 2


def test_a_window_softcap_sink_call_takes_the_variant_parameters_then_the_sink(fake_gpu):
    sink = FakeDeviceArray((8,), "<f4")
    launches = _calls(inputs(), num_splits=1, window_size=(7, 0), softcap=30.0, learnable_sink=sink)
    args = launches[0][2]
    assert len(args) == len(abi.DECODE_VARIANT_ABI) + 1 and args[-4] == 7  # window_left, ..., sink
    assert args[-1] == (sink.__cuda_array_interface__["data"][0], 8)
