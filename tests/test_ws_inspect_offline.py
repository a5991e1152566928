"""CPU tests (no GPU needed) of the warp-specialised Hopper kernel (``kernels/forward_ws.py``):
compiled offline for sm_90a, its SASS shows the TMA + mbarrier + wgmma pipeline (UTMALDG,
UTMASTG, SYNCS, HGMMA SS and RS, USETMAXREG dealloc/alloc, STSM, named barriers), no cp.async
(LDGSTS) and no local memory, spills or calls; plus the config checks and the host-side
tensor-map encoder it relies on.
"""

from __future__ import annotations

import re

import pytest

from numbaflash.kernels.shapes import WsConfig
from numbaflash.tools import inspect as nfi

ARCH = "sm_90a"
# (config, causal, bf16): the variants whose SASS is checked.
CASES = {
    "d128-full-f16": (WsConfig(128, 128, 2), False, False),
    "d128-pp-causal-bf16": (WsConfig(128, 128, 2, pingpong=True), True, True),
    "d64-pp-causal-f16": (WsConfig(64, 128, 3, pingpong=True), True, False),
    # three consumer warpgroups (192 rows, registers 32 / 160), ping-pong round robin
    "d64-c3-pp-full-bf16": (WsConfig(64, 128, 2, consumers=3, pingpong=True), False, True),
    # 64B swizzle (32-column boxes); O staged in the Q buffer with 128 x 80 tiles (wgmma n80)
    "d96-ovl-causal-bf16": (WsConfig(96, 128, 2), True, True),
    "d256-pp-n80-full-f16": (WsConfig(256, 80, 2, pingpong=True, q_stages=1, o_in_q=True),
                             False, False),
    # 128 x 176 (wgmma n176) with O staged in the V ring: the consumers' named barrier, o_empty
    "d128-ov-n176-full-f16": (WsConfig(128, 176, 2, q_stages=1, o_in_v=True), False, False),
}


@pytest.fixture(scope="module")
def reports():
    from numbaflash.configs import kernel_cubin
    from numbaflash.kernels.families import spec_of

    cache = {}

    def get(name):  # through the run's kernel cache: a shipped case is compiled once per run
        if name not in cache:
            config, causal, bf16 = CASES[name]
            spec = spec_of(config, "forward", bf16, ARCH, causal=causal)
            cache[name] = nfi.report_from_cubin(kernel_cubin(spec).cubin, name, ARCH)
        return cache[name]

    return get


def _lines(report, pattern):
    return [line.strip() for line in report.sass.splitlines() if re.search(pattern, line)]


@pytest.mark.parametrize("name", list(CASES))
def test_pipeline_instructions(reports, name):
    r = reports(name)
    config = CASES[name][0]
    chunks = config.head_dim // config.box_cols
    assert r.count("UTMALDG") >= 3 * chunks  # Q, K, V boxes
    assert r.count("UTMASTG") >= chunks  # O boxes
    assert r.count("SYNCS") >= 8  # mbarrier init, expect-tx, arrive, try-wait
    assert r.count("STSM") >= config.head_dim // 16
    assert r.count("LDGSTS") == 0, "no cp.async in the TMA kernel"
    hgmma = _lines(r, r"HGMMA")
    ss_shape = rf"HGMMA\.64x{config.block_n}x16\.F32\S* R\d+, gdesc"
    rs_shape = rf"HGMMA\.64x{config.head_dim}x16\.F32\S* R\d+, R\d+, gdesc.*tnspB"
    ss = [line for line in hgmma if re.search(ss_shape, line)]
    rs = [line for line in hgmma if re.search(rs_shape, line)]
    assert len(ss) >= config.head_dim // 16, hgmma  # S = Q Kᵀ from shared memory
    assert len(rs) >= config.block_n // 16, hgmma  # O += P V, P from registers, V MN-major


@pytest.mark.parametrize("name", list(CASES))
def test_register_split(reports, name):
    """Producer gives registers back (24, or 32 beside 3 consumers), consumers take 240 (or
    160); the entry cap is 65536 / threads (168 or 128), and the split uses every register."""
    r = reports(name)
    config = CASES[name][0]
    producer, consumer = config.register_split
    lines = _lines(r, r"USETMAXREG")
    assert any("DEALLOC" in line and f"{producer:#x}" in line for line in lines), lines
    allocs = [line for line in lines if "ALLOC" in line and "DEALLOC" not in line]
    assert any(f"{consumer:#x}" in line for line in allocs), lines
    assert r.registers == (65536 // config.threads) // 8 * 8
    assert producer * 128 + consumer * 128 * config.consumers <= 65536


@pytest.mark.parametrize("name", list(CASES))
def test_no_local_memory_no_calls(reports, name):
    r = reports(name)
    assert r.calls == 0, "a helper was not inlined"
    assert r.stack_bytes == 0 and r.local_bytes == 0
    assert r.spill_instructions == 0, _lines(r, r"\b(LDL|STL)\b")[:10]


@pytest.mark.parametrize("name", list(CASES))
def test_wgmma_not_serialised(reports, name):
    """The kernel waits for its GEMMs a handful of times (wait_group 0/1); ptxas adds a
    WARPGROUP.DEPBAR after every HGMMA when it cannot prove the asynchronous pipeline (seen with
    a conditionally issued first S: every GEMM serialised, 10-25% slower)."""
    r = reports(name)
    assert len(_lines(r, r"WARPGROUP\.DEPBAR")) <= 8 < len(_lines(r, r"HGMMA")), _lines(r, r"DEPBAR")


def test_o_in_v_epilogue_waits_for_every_consumer(reports):
    """O staged in the V ring: the epilogue's named barrier spans both consumer warpgroups
    (256 threads) before stmatrix overwrites V, and the producer waits on O empty."""
    r = reports("d128-ov-n176-full-f16")
    assert any("0x100" in line for line in _lines(r, r"BAR\.SYNC")), _lines(r, r"BAR")
    assert len(_lines(r, r"STSM")) > 0


@pytest.mark.parametrize("name", ["d64-pp-causal-f16", "d64-c3-pp-full-bf16"])
def test_pingpong_uses_named_barriers(reports, name):
    r = reports(name)
    assert _lines(r, r"BAR\.ARV"), "ping-pong hands the turn over with bar.arrive"
    assert len(_lines(r, r"BAR\.SYNC")) >= 3  # syncthreads, turns, epilogue


def test_overlap_waits_for_one_group(reports):
    """With overlap, S_{j+1} is waited for while PV_j may still run (wait_group 1)."""
    r = reports("d64-pp-causal-f16")
    assert any("0x1" in line for line in _lines(r, r"WARPGROUP\.DEPBAR")), _lines(r, r"DEPBAR")


def test_config_checks():
    assert WsConfig(128).shared_bytes <= 227 * 1024
    assert WsConfig(128).threads == 384 and WsConfig(128).block_m == 128
    with pytest.raises(ValueError, match="shared memory"):
        WsConfig(128, stages=4).check()
    with pytest.raises(ValueError, match="head_dim"):
        WsConfig(32).check()
    with pytest.raises(ValueError, match="block_n"):
        WsConfig(256, block_n=96).check()
    assert (WsConfig(96).row_bytes, WsConfig(96).box_cols) == (64, 32)
    assert (WsConfig(256).row_bytes, WsConfig(128).box_cols) == (128, 64)
    with pytest.raises(ValueError, match="shared memory"):  # no room for an O tile at d256
        WsConfig(256, 80, q_stages=1).check()
    with pytest.raises(ValueError, match="o_in_q needs q_stages 1"):
        WsConfig(256, 80, o_in_q=True).check()
    d256 = WsConfig(256, 80, q_stages=1, o_in_q=True)
    d256.check()
    assert d256.shared_bytes == 128 * 256 * 2 + 4 * 80 * 256 * 2 + 1024
    with pytest.raises(ValueError, match="q_stages"):
        WsConfig(64, q_stages=3).check()
    assert WsConfig(128, q_stages=1).shared_bytes == WsConfig(128).shared_bytes - 128 * 128 * 2
    three = WsConfig(64, 128, consumers=3)
    three.check()
    assert (three.block_m, three.threads, three.register_split) == (192, 512, (32, 160))
    with pytest.raises(ValueError, match="3 consumers"):
        WsConfig(128, 128, consumers=3).check()  # O alone would be 64 of the 160 registers
    with pytest.raises(ValueError, match="3 consumers"):
        WsConfig(64, 192, consumers=3).check()
    with pytest.raises(ValueError, match="consumers must be 2 or 3"):
        WsConfig(64, 128, consumers=4).check()
    n176 = WsConfig(128, 176, q_stages=1, o_in_v=True)  # O staged in the V ring: no O tile
    n176.check()
    assert n176.shared_bytes == 128 * 128 * 2 + 4 * 176 * 128 * 2 + 1024
    with pytest.raises(ValueError, match="o_in_v needs 2 consumers"):
        WsConfig(64, 128, consumers=3, o_in_v=True).check()
    with pytest.raises(ValueError, match="o_in_v needs 2 consumers and not o_in_q"):
        WsConfig(128, 176, q_stages=1, o_in_q=True, o_in_v=True).check()


def test_encode_tensor_map_checks():
    from numbaflash.runtime.tensor_map import encode_tensor_map

    shape = (2, 100, 4, 128)
    strides = (100 * 4 * 128 * 2, 4 * 128 * 2, 128 * 2, 2)
    with pytest.raises(ValueError, match="contiguous"):
        encode_tensor_map(0x1000, shape, strides[:3] + (4,), (1, 64, 1, 64))
    with pytest.raises(ValueError, match="multiples of 16"):
        encode_tensor_map(0x1000, shape, (strides[0], 8, strides[2], 2), (1, 64, 1, 64))
    with pytest.raises(ValueError, match="at most 64"):
        encode_tensor_map(0x1000, shape, strides, (1, 64, 1, 128))
    with pytest.raises(ValueError, match="16-bit data"):
        encode_tensor_map(0x1000, shape, strides, (1, 64, 1, 64), dtype="f32")


def _exponentials_beside_pv(report) -> list[int]:
    """For each wait of the KV loop that leaves PV in flight (``WARPGROUP.DEPBAR.LE gsb0, 0x1``):
    the MUFU.EX2 issued before the next wait that retires it (``... 0x0``)."""
    counts, open_ = [], None
    for line in report.sass.splitlines():
        if re.search(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x1\b", line):
            open_ = 0
        elif open_ is not None and "MUFU.EX2" in line:
            open_ += 1
        elif open_ is not None and re.search(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x0\b", line):
            counts.append(open_)
            open_ = None
    return counts


def test_late_pv_wait_keeps_the_exponentials_beside_pv():
    """``WsConfig.late_pv_wait`` (the shipped e4m3 head-dim-64 config): every exponential of a
    tile's softmax (64 a thread: 64 rows x 128 keys over a warpgroup) is issued while PV is in
    flight. Without it ptxas hoists the wait that retires PV above them; should a later ptxas
    stop doing so, the knob is no longer needed (docs/PERFORMANCE.md [WAITPOS])."""
    import dataclasses

    from numbaflash import configs
    from numbaflash.configs import kernel_cubin
    from numbaflash.kernels.families import spec_of

    shipped = configs.FP8_DEFAULTS[64]
    assert shipped.late_pv_wait
    per_thread = 64 * shipped.block_n // 128
    for late in (True, False):
        config = dataclasses.replace(shipped, late_pv_wait=late)
        spec = spec_of(config, "forward", True, ARCH, causal=True)
        counts = _exponentials_beside_pv(nfi.report_from_cubin(kernel_cubin(spec).cubin, "fp8", ARCH))
        assert counts, "no KV loop with PV in flight"
        if late:
            assert min(counts) >= per_thread, counts
        else:
            assert max(counts) < per_thread, counts
