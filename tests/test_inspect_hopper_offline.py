"""CPU tests (no GPU needed): the Hopper demo kernels and the test probes
(``_hopper_probes``) compiled offline for sm_90a give the expected SASS (HGMMA, SYNCS,
UTMALDG/UTMASTG, STSM, USETMAXREG), fully inlined (no CALL, no stack, no local memory,
accumulators in registers); plus the host-side descriptor encoder, the wgmma factories and
the tensor-map argument checks.
"""

from __future__ import annotations

import re

import _hopper_probes as probes
import numpy as np
import pytest
from _sass import assert_fully_inlined as assert_clean

from numbaflash.demos import hopper_gemm as hd
from numbaflash.ptx import hopper as hp
from numbaflash.tools import inspect as nfi
from numbaflash.tools.registry import registered_kernels

ARCH = "sm_90a"
REGISTERED = {**hd.registered(), **probes.registered()}


@pytest.fixture(scope="module")
def reports():
    """Compiled reports shared by the module's tests: ``reports(name)`` for registered kernels."""
    cache = {}

    def get(name: str) -> nfi.KernelReport:
        if name not in cache:
            pyfunc, argtypes, archs = REGISTERED[name]
            assert archs == (ARCH,)
            cache[name] = nfi.inspect_kernel(pyfunc, argtypes, ARCH, name)
        return cache[name]

    return get


def _lines(report: nfi.KernelReport, pattern: str) -> list[str]:
    return [line.strip() for line in report.sass.splitlines() if re.search(pattern, line)]


def test_registry_lists_hopper_demos_not_probes():
    merged = registered_kernels()
    for name, (_, _, archs) in hd.registered().items():
        assert name in merged and archs == (ARCH,)
    assert not set(probes.registered()) & set(merged), "test probes belong to the tests, not the package"


@pytest.mark.parametrize("name", list(REGISTERED))
def test_fully_inlined_no_local_memory(reports, name):
    assert_clean(reports(name))


# Opcodes each registered kernel must show: (opcode, minimum count).
EXPECTED = {
    "wgmma_tma_gemm_f16": {"HGMMA": 4, "WARPGROUP": 1, "SYNCS": 3, "UTMALDG": 2},
    "wgmma_tma_gemm_bf16": {"HGMMA": 4, "WARPGROUP": 1, "SYNCS": 3, "UTMALDG": 2},
    "wgmma_rs_gemm_f16": {"HGMMA": 4, "WARPGROUP": 1, "SYNCS": 3, "UTMALDG": 2},
    "wgmma_rs_gemm_bf16": {"HGMMA": 4, "WARPGROUP": 1, "SYNCS": 3, "UTMALDG": 2},
    "tma_copy_2d": {"UTMALDG": 1, "UTMASTG": 1, "SYNCS": 2},
    "wgmma_probe_ss_n256_f16": {"HGMMA": 4, "WARPGROUP": 1},
    "wgmma_probe_rs_n256_bf16_tb": {"HGMMA": 4, "WARPGROUP": 1},
    "mbarrier_probe": {"SYNCS": 8},
    "tma_load_probe_2d": {"UTMALDG": 1, "SYNCS": 2},
    "tma_load_probe_4d": {"UTMALDG": 1, "SYNCS": 2},
    "tma_store_probe_2d": {"UTMASTG": 1},
    "stmatrix_probe": {"STSM": 6},
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_expected_opcodes(reports, name):
    r = reports(name)
    for opcode, minimum in EXPECTED[name].items():
        assert r.count(opcode) >= minimum, f"{name}: {opcode} x{r.count(opcode)} < {minimum}"


def test_hgmma_shapes_and_operands(reports):
    ss = _lines(reports("wgmma_tma_gemm_f16"), r"HGMMA")
    assert ss and all("64x128x16.F32" in line and "gdesc" in line for line in ss), ss
    assert not any(".BF16" in line for line in ss)
    assert all(".BF16" in line for line in _lines(reports("wgmma_tma_gemm_bf16"), r"HGMMA"))
    assert all("64x256x16.F32" in line for line in _lines(reports("wgmma_probe_ss_n256_f16"), r"HGMMA"))
    # A from registers: the A operand is a register (R..), not a descriptor pair.
    rs = _lines(reports("wgmma_rs_gemm_f16"), r"HGMMA")
    assert rs and all(re.search(r"HGMMA\.64x128x16\.F32\S* R\d+, R\d+, gdesc", line) for line in rs), rs


def test_tma_dimensions(reports):
    assert _lines(reports("tma_load_probe_2d"), r"UTMALDG\.2D")
    assert _lines(reports("tma_load_probe_4d"), r"UTMALDG\.4D")
    assert _lines(reports("tma_store_probe_2d"), r"UTMASTG\.2D")


def test_large_accumulators_stay_in_registers(reports):
    """m64n256: 128 f32 accumulators per thread, passed by pointer, live in registers."""
    for name in ("wgmma_probe_ss_n256_f16", "wgmma_probe_rs_n256_bf16_tb"):
        r = reports(name)
        assert r.registers >= 128 + 8, r.registers
        assert_clean(r)


@pytest.mark.parametrize("n", [8, 16, 32, 96, 192])
def test_every_wgmma_width_compiles(n):
    kernel = probes.make_wgmma_probe(n, "f16", a_from_registers=n % 64 == 32, trans_b=n in (16, 96))
    r = nfi.inspect_kernel(kernel, probes.WGMMA_PROBE_ARGTYPES, ARCH)
    assert_clean(r)
    hgmma = _lines(r, r"HGMMA")
    assert len(hgmma) == 4 and all(f"64x{n}x16.F32" in line for line in hgmma), hgmma


def test_wait_group_variants_compile():
    probe = probes.make_wgmma_probe(64, "f16", commit_each=True)
    r = nfi.inspect_kernel(probe, probes.WGMMA_PROBE_ARGTYPES, ARCH)
    assert_clean(r)
    assert r.count("HGMMA") == 4
    depbars = _lines(r, r"WARPGROUP\.DEPBAR")
    assert {re.search(r"0x(\d)", line).group(1) for line in depbars} >= {"0", "1", "2", "3"}, depbars


def _link_with_launch_bounds(pyfunc, argtypes, launch_bounds) -> nfi.KernelReport:
    return nfi.inspect_kernel(pyfunc, argtypes, ARCH, launch_bounds=launch_bounds)


@pytest.mark.parametrize("dec,inc", [(24, 240), (40, 232), (32, 160), (56, 224)])
def test_setmaxnreg_with_launch_bounds(dec, inc):
    """With launch bounds (384, 1) the kernel has a 168-register cap (ptxas starts it with
    min(168, the largest inc)), and both setmaxnreg instructions survive into SASS."""
    r = _link_with_launch_bounds(
        probes.make_setmaxnreg_probe(dec, inc),
        probes.SETMAXNREG_PROBE_ARGTYPES,
        probes.SETMAXNREG_LAUNCH_BOUNDS,
    )
    assert_clean(r)
    assert r.registers == min(168, inc)
    lines = _lines(r, r"USETMAXREG")
    assert any("DEALLOC" in line and f"{dec:#x}" in line for line in lines), lines
    assert any("ALLOC" in line and "DEALLOC" not in line and f"{inc:#x}" in line for line in lines), lines


# --------------------------------------------------------------------------- host-side pieces


def test_encode_smem_descriptor_bit_fields():
    d = int(hp.encode_smem_descriptor(0x12340, 16, 1024, hp.SWIZZLE_128B))
    assert d & 0x3FFF == (0x12340 >> 4) & 0x3FFF  # start address >> 4, 14 bits
    assert (d >> 16) & 0x3FFF == 1  # LBO >> 4
    assert (d >> 32) & 0x3FFF == 64  # SBO >> 4
    assert (d >> 49) & 7 == 0  # base offset
    assert d >> 62 == 1  # 128B swizzle
    assert int(hp.encode_smem_descriptor(0x400, 2048, 128, hp.SWIZZLE_NONE)) == 0x40 | (128 << 16) | (8 << 32)
    assert int(hp.encode_smem_descriptor(0, 0, 0, hp.SWIZZLE_32B)) == 3 << 62
    assert int(hp.encode_smem_descriptor(0x40000, 0, 0, 0)) == 0  # only the shared window's 18 bits
    assert isinstance(hp.encode_smem_descriptor(0, 0, 0, 0), np.uint64)


def test_wgmma_factories():
    assert hp.wgmma_ss(64) is hp.wgmma_ss(64, "f16", False)  # cached
    assert hp.wgmma_rs(128, "bf16", True) is not hp.wgmma_rs(128, "bf16", False)
    with pytest.raises(ValueError, match="N must be one of"):
        hp.wgmma_ss(40)
    with pytest.raises(ValueError, match="input type"):
        hp.wgmma_rs(64, "f32")


def test_wgmma_source_has_every_variant():
    from numbaflash.runtime.sources import ptx_source

    text = open(ptx_source("wgmma")).read()
    for n in hp.WGMMA_N:
        assert f"WGMMA_N({n}, {n // 2}," in text


class _FakeDeviceArray:
    """Just enough of ``__cuda_array_interface__`` to reach the argument checks."""

    def __init__(self, shape, typestr="<u2", data=0x10000, strides=None):
        self.__cuda_array_interface__ = {
            "shape": shape, "typestr": typestr, "data": (data, False), "strides": strides, "version": 3,
        }


@pytest.mark.parametrize(
    "array,box,swizzle,message",
    [
        (_FakeDeviceArray((64,)), (64,), "128B", "2-D to 5-D"),
        (_FakeDeviceArray((64, 64), "<f4"), (8, 8), "128B", "16-bit"),
        (_FakeDeviceArray((64, 64)), (8,), "128B", "one extent per dimension"),
        (_FakeDeviceArray((64, 64)), (8, 128), "128B", "at most 64 elements"),
        (_FakeDeviceArray((64, 64)), (8, 64), "64B", "at most 32 elements"),
        (_FakeDeviceArray((64, 64)), (8, 4), None, "multiple of 16 bytes"),
        (_FakeDeviceArray((64, 60)), (8, 8), None, "outer strides"),
        (_FakeDeviceArray((64, 64), data=0x10008), (8, 8), None, "16-byte aligned"),
        (_FakeDeviceArray((300, 64)), (257, 8), None, "1..256"),
        (_FakeDeviceArray((64, 64)), (8, 8), "16B", "swizzle must be"),
    ],
)
def test_tensor_map_argument_checks(array, box, swizzle, message):
    from numbaflash.runtime.tensor_map import make_tensor_map

    with pytest.raises(ValueError, match=message):
        make_tensor_map(array, box, swizzle=swizzle)
    with pytest.raises(TypeError):
        make_tensor_map(np.zeros((8, 8), np.uint16), (8, 8))


def test_tensor_map_encode_arguments(monkeypatch):
    """make_tensor_map hands cuTensorMapEncodeTiled innermost-first dimensions, byte strides
    and box, and returns the 128 map bytes as uint64[16] (the driver call is faked here)."""
    from cuda.bindings import driver

    from numbaflash.runtime.tensor_map import make_tensor_map

    calls = []

    def fake_encode(*args):
        calls.append(args)
        tmap = driver.CUtensorMap()
        return driver.CUresult.CUDA_SUCCESS, tmap

    monkeypatch.setattr(driver, "cuTensorMapEncodeTiled", fake_encode)
    array = _FakeDeviceArray((4, 48, 256), typestr="<f2", data=0x20000)
    tm = make_tensor_map(array, (1, 32, 64), swizzle="128B")
    (dtype, rank, address, dims, strides, box, elem_strides, interleave, swizzle, _, oob), = calls
    assert dtype == driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16
    assert (rank, address) == (3, 0x20000)
    assert [int(d) for d in dims] == [256, 48, 4]
    assert [int(s) for s in strides] == [512, 48 * 512]
    assert [int(b) for b in box] == [64, 32, 1]
    assert [int(e) for e in elem_strides] == [1, 1, 1]
    assert interleave == driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE
    assert swizzle == driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B
    assert oob == driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE
    assert tm.words.dtype == np.uint64 and tm.words.shape == (16,)
    assert (tm.rank, tm.box_bytes, tm.shape) == (3, 64 * 32 * 2, (4, 48, 256))
    make_tensor_map(_FakeDeviceArray((64, 64), typestr="<V2"), (8, 8), swizzle=None)
    assert calls[-1][0] == driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
