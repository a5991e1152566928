"""CPU tests (no GPU needed): the sm_80 helper test kernels and the demo GEMM compiled
offline for sm_80 and sm_90a must give the expected SASS, fully inlined (no CALL, no stack,
no local memory); plus the pure parts of ``numbaflash.inspect`` and ``numbaflash.runtime.sources``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import _sm80_kernels as K
import pytest
from _sass import assert_fully_inlined, report_cache
from _sass import sass_lines as _sass_lines

from numbaflash.runtime import sources
from numbaflash.tools import inspect as nfi

ARCHS = ("sm_80", "sm_90a")
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def reports():
    """Compiled reports, shared by every test of this module: ``reports(name, arch)``."""
    return report_cache(K.KERNELS)


# --------------------------------------------------------------------------- every kernel


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", list(K.KERNELS))
def test_fully_inlined_no_local_memory(reports, name, arch):
    r = reports(name, arch)
    assert r.arch == arch and r.name == name
    assert_fully_inlined(r)


# --------------------------------------------------------------------------- per family


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("trans", [False, True], ids=["plain", "trans"])
@pytest.mark.parametrize("nregs", [1, 2, 4])
def test_ldmatrix_sass(reports, nregs, trans, arch):
    r = reports(f"ldmatrix_x{nregs}" + ("_trans" if trans else ""), arch)
    shape = ("MT88" if trans else "M88") + ("" if nregs == 1 else f".{nregs}")
    assert r.count("LDSM") == 1
    assert _sass_lines(r, rf"\bLDSM\.16\.{re.escape(shape)} "), r.opcodes


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", ["f16", "bf16"])
def test_mma_sass(reports, kind, arch):
    r = reports(f"mma_{kind}", arch)
    assert r.count("HMMA") == 1
    suffix = r"\.BF16" if kind == "bf16" else ""
    assert _sass_lines(r, rf"\bHMMA\.16816\.F32{suffix} "), r.opcodes


@pytest.mark.parametrize("arch", ARCHS)
def test_cp_async_sass(reports, arch):
    r = reports("cp_async", arch)
    # .cg (L2 only) is LDGSTS.E.BYPASS.128; the zero-fill form carries a negated predicate
    # (!PT for a constant src-size 0, !Pn when src-size is chosen at run time).
    assert len(_sass_lines(r, r"\bLDGSTS\.E\.BYPASS\.128 ")) == r.count("LDGSTS") >= 2
    assert _sass_lines(r, r"\bLDGSTS\.E\.BYPASS\.128 .*, !P(T|\d) ;")
    assert r.count("LDGDEPBAR") == 1  # one commit_group
    assert _sass_lines(r, r"\bDEPBAR\.LE SB0, 0x0 ;")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("n", [0, 1, 2, 3])
def test_wait_group_sass(reports, n, arch):
    r = reports(f"wait_group_{n}", arch)
    assert r.count("LDGDEPBAR") == K.GROUPS
    assert r.count("LDGSTS") == K.GROUPS * K.CHUNKS
    assert _sass_lines(r, rf"\bDEPBAR\.LE SB0, 0x{n} ;"), _sass_lines(r, "DEPBAR")


@pytest.mark.parametrize("arch", ARCHS)
def test_vec4_sass(reports, arch):
    r = reports("vec4", arch)
    assert _sass_lines(r, r"\bSTS\.128 ")
    assert _sass_lines(r, r"\bLDS\.128 ")
    assert _sass_lines(r, r"\bSTG\.E\.128 ")


@pytest.mark.parametrize("arch", ARCHS)
def test_pack_exp2_sass(reports, arch):
    pack = reports("pack", arch)
    assert len(_sass_lines(pack, r"\bF2FP\.BF16(\.F32)?\.PACK_AB ")) == 1
    assert len(_sass_lines(pack, r"\bF2FP(\.F16\.F32)?\.PACK_AB ")) == 1
    exp2 = reports("exp2", arch)
    assert len(_sass_lines(exp2, r"\bMUFU\.EX2 ")) == 1
    poly = reports("exp2_poly", arch)  # the FMA-pipe exp2: no MUFU at all, 3 FFMA of the polynomial
    assert not _sass_lines(poly, r"\bMUFU\.")
    assert len(_sass_lines(poly, r"\bFFMA ")) >= 3


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", ["f16", "bf16"])
def test_tile_gemm_sass(reports, kind, arch):
    r = reports(f"tile_gemm_{kind}", arch)
    suffix = r"\.BF16" if kind == "bf16" else ""
    # One 32-wide K slice per loop trip: 2 k-steps x 8 n-tiles of m16n8k16.
    assert len(_sass_lines(r, rf"\bHMMA\.16816\.F32{suffix} ")) >= 16
    assert r.count("HMMA") == len(_sass_lines(r, rf"\bHMMA\.16816\.F32{suffix} "))
    assert r.count("LDSM") >= 2 * (1 + 4)
    assert r.count("LDGSTS") >= 4
    assert r.shared_bytes >= 2 * 2 * 64 * 32 * 2  # two stages of A and B slices


# --------------------------------------------------------------------------- inspect.py


SASS_SNIPPET = """
        /*0000*/                   IMAD.MOV.U32 R1, RZ, RZ, c[0x0][0x28] ;         /* 0x00000a00ff017624 */
        /*0010*/                   S2R R0, SR_TID.X ;                                /* 0x0000000000007919 */
        /*0020*/               @P0 HMMA.16816.F32 R4, R8, R12, R4 ;                 /* 0x0000000c0804723c */
        /*0030*/              @!P1 HMMA.16816.F32.BF16 R4, R8, R14, R4 ;            /* 0x0000000e0804723c */
        /*0040*/                   LDSM.16.M88.4 R8, [R2] ;                          /* 0x000000000208783b */
        /*0050*/              @!PT LDS RZ, [RZ] ;                                    /* 0x00000000fffff984 */
        /*0060*/              @UP0 LDGSTS.E.BYPASS.128 [R3], [R4.64] ;               /* 0x0000000004037fae */
        /*0070*/                   EXIT ;                                            /* 0x000000000000794d */
        .L_x_0:
        /*0080*/                   BRA `(.L_x_0) ;                                   /* 0xfffffff000007947 */
"""


def test_count_opcodes():
    assert nfi.count_opcodes(SASS_SNIPPET) == {
        "IMAD": 1, "S2R": 1, "HMMA": 2, "LDSM": 1, "LDS": 1, "LDGSTS": 1, "EXIT": 1, "BRA": 1,
    }
    assert nfi.count_opcodes("") == {}


def _report(name, arch, **opcodes):
    return nfi.KernelReport(name, arch, registers=40, stack_bytes=0, shared_bytes=16384, local_bytes=0,
                            opcodes=opcodes)


def test_kernel_report_properties():
    r = _report("k", "sm_80", HMMA=16, LDL=2, STL=3, CALL=1)
    assert r.spill_instructions == 5
    assert r.calls == 1
    assert r.count("HMMA") == 16 and r.count("HGMMA") == 0


def test_format_table():
    rows = [_report("tile_gemm_f16", "sm_80", HMMA=16, LDSM=10, LDGSTS=8), _report("k", "sm_90a", CALL=2)]
    table = nfi.format_table(rows).splitlines()
    assert len(table) == 4
    head = table[0].split()
    assert head[:6] == ["kernel", "arch", "regs", "stack", "smem", "local"]
    assert head[6:] == ["HMMA", "HGMMA", "QGMMA", "LDSM", "LDGSTS", "UTMALDG", "SYNCS", "BAR", "LDL", "STL",
                        "CALL"]
    assert set(table[1]) == {"-", " "}
    assert len({len(line) for line in table}) == 1  # fixed width
    first = table[2].split()
    assert first[:6] == ["tile_gemm_f16", "sm_80", "40", "0", "16384", "0"]
    assert first[6:] == ["16", "0", "0", "10", "8", "0", "0", "0", "0", "0", "0"]
    assert table[3].split()[-1] == "2"
    # Name columns are left-aligned, numbers right-aligned.
    assert table[3].startswith("k ")
    assert table[2].endswith(" 0") and table[3].endswith(" 2")
    assert nfi.format_table([]).splitlines()[0].split()[0] == "kernel"


def test_parse_arch():
    assert nfi.parse_arch("sm_80") == (8, 0)
    assert nfi.parse_arch("sm_90a") == (9, 0, "a")
    assert nfi.parse_arch("sm_100a") == (10, 0, "a") and nfi.parse_arch("sm_86") == (8, 6)
    for bad in ("sm_75", "80", "SM_80", "", "sm_9", "sm_90b"):
        with pytest.raises(ValueError, match="unknown architecture") as info:
            nfi.parse_arch(bad)
        assert "sm_80" in str(info.value) and "sm_90a" in str(info.value)


def test_find_tool_error_message(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(nfi.sys, "path", [str(tmp_path)])
    with pytest.raises(FileNotFoundError) as info:
        nfi.find_tool("cuobjdump")
    message = str(info.value)
    assert "'cuobjdump'" in message
    assert "pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm" in message


def test_find_tool_in_wheel_layout(monkeypatch, tmp_path):
    """A tool under <sys.path entry>/nvidia/**/bin is found when it is executable."""
    tool = tmp_path / "nvidia" / "cu13" / "bin" / "cuobjdump"
    tool.parent.mkdir(parents=True)
    tool.write_text("#!/bin/sh\n")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(nfi.sys, "path", [str(tmp_path)])
    with pytest.raises(FileNotFoundError):
        nfi.find_tool("cuobjdump")  # not executable yet
    tool.chmod(0o755)
    assert nfi.find_tool("cuobjdump") == str(tool)


def test_find_tool_installed():
    path = nfi.find_tool("cuobjdump")
    assert os.access(path, os.X_OK)


def test_main_list_and_no_match(capsys):
    assert nfi.main(["--list"]) == 0
    listed = capsys.readouterr().out.split()
    assert {"tile_gemm_f16", "tile_gemm_bf16"} <= set(listed)
    assert nfi.main(["no-such-kernel-name"]) == 2
    assert "no kernel matches" in capsys.readouterr().err


# --------------------------------------------------------------------------- sources.py


def test_every_family_found():
    families = sources.ptx_families()
    shipped = sorted(p.stem for p in sources.ptx_directory().glob("*.cu"))
    assert families == shipped
    assert {"copy", "ldmatrix", "mma", "convert"} <= set(families)
    if (REPO / "ptx").is_dir() and sources.ptx_directory() == REPO / "ptx":
        assert families == sorted(p.stem for p in (REPO / "ptx").glob("*.cu"))
    for family in families:
        path = Path(sources.ptx_source(family))
        assert path.is_file() and path.parent == sources.ptx_directory() and path.name == f"{family}.cu"


def test_unknown_family():
    with pytest.raises(FileNotFoundError, match="no PTX helper family 'nope'"):
        sources.ptx_source("nope")


def test_every_binding_names_an_existing_helper():
    """Each ``declare("family", "name", ...)`` in numbaflash/ptx binds a function that the
    family's .cu file defines."""
    bindings = Path(sources.__file__).parent.parent / "ptx"
    found = 0
    for py in sorted(bindings.glob("*.py")):
        for family, name in re.findall(r'declare\(\s*"(\w+)",\s*"(\w+)"', py.read_text()):
            text = Path(sources.ptx_source(family)).read_text()
            assert re.search(rf"\b{name}\b", text), f"{py.name}: {name} not in {family}.cu"
            found += 1
    assert found >= 20
