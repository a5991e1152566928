"""The built wheel ships every PTX helper source, and an installed copy finds them.

Builds the wheel from this checkout, installs it with ``--no-deps`` into a fresh virtual
environment, and runs Python there from another directory in isolated mode (``-I``: no
PYTHONPATH, no current directory on sys.path), so the only numbaflash importable is the
installed one. The run-time dependencies (numba-cuda, numpy, cffi and the CUDA wheels) are
borrowed from the test's own environment through a ``.pth`` file that is processed after
the venv's own site-packages, which keeps this test offline apart from the build backend.
"""

from __future__ import annotations

import importlib.util
import json
import os
import site
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
PTX_FILES = sorted(p.name for p in (REPO / "ptx").glob("*.cu"))

# Runs inside the fresh venv: where is numbaflash, where are its helper sources, and does a
# kernel using the helpers compile offline (NVVM + nvJitLink) against the installed files?
PROBE = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import numbaflash
    from numbaflash.runtime import sources
    from numba import cuda, types
    from numbaflash import ptx
    from numbaflash.runtime.compiler import compile_cubin

    def probe_kernel(x, out):
        i = cuda.grid(1)
        out[i] = ptx.pack_f16x2(x[i], x[i] * 2)

    cubin = compile_cubin(probe_kernel, (types.float32[::1], types.uint32[::1]), "sm_80")
    print(json.dumps({
        "package": str(Path(numbaflash.__file__).resolve().parent),
        "directory": str(sources.ptx_directory()),
        "families": sources.ptx_families(),
        "paths": {f: sources.ptx_source(f) for f in sources.ptx_families()},
        "cubin_bytes": len(cubin),
        "sys_path": sys.path,
    }))
    """
)


def _run(cmd, **kwargs):
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kwargs)
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheelhouse")
    cmd = [sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "--no-cache-dir", "-w", str(out)]
    if importlib.util.find_spec("hatchling") is not None:
        cmd.append("--no-build-isolation")  # the backend is here: no download needed
    _run(cmd)
    (built,) = out.glob("numbaflash-*.whl")
    return built


def test_wheel_ships_every_ptx_source(wheel):
    assert PTX_FILES, "no ptx/*.cu in the checkout"
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        shipped = sorted(n.rsplit("/", 1)[1] for n in names if n.startswith("numbaflash/ptx_sources/"))
        assert shipped == PTX_FILES
        for name in PTX_FILES:
            assert zf.read(f"numbaflash/ptx_sources/{name}") == (REPO / "ptx" / name).read_bytes()
    assert "numbaflash/runtime/sources.py" in names and "numbaflash/ptx/_declare.py" in names
    assert "numbaflash/runtime/cache.py" in names and "numbaflash/tools/precompile.py" in names
    assert not any(n.startswith(("tests/", "ptx/")) for n in names)
    licenses = [n for n in names if n.endswith("/LICENSE") and ".dist-info/" in n]
    assert licenses, "the wheel carries no LICENSE"
    with zipfile.ZipFile(wheel) as zf:
        assert zf.read(licenses[0]) == (REPO / "LICENSE").read_bytes()


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("venv")
    _run([sys.executable, "-m", "venv", str(root)])
    python = root / "bin" / "python"
    _run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "--no-cache-dir", "-q", str(wheel)])
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    venv_site = Path(_run([str(python), "-c", purelib]).strip())
    # Borrow the dependencies: addsitedir also runs their .pth files (numba-cuda needs its
    # redirector); these directories come after the venv's site-packages on sys.path.
    borrowed = dict.fromkeys([*site.getsitepackages(), sysconfig.get_paths()["purelib"]])
    lines = [f"import site; site.addsitedir({d!r})" for d in borrowed if Path(d).is_dir()]
    (venv_site / "zz_borrowed_deps.pth").write_text("\n".join(lines) + "\n")
    # cuda.pathfinder looks for the NVIDIA library wheels (NVRTC, NVVM, nvJitLink) only in
    # the interpreter's own site-packages: show it the borrowed ones.
    for d in borrowed:
        if (Path(d) / "nvidia").is_dir() and not (venv_site / "nvidia").exists():
            (venv_site / "nvidia").symlink_to(Path(d) / "nvidia", target_is_directory=True)
    return root


def _clean_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["PYTHONNOUSERSITE"] = "1"
    return env


def test_installed_wheel_finds_its_sources(venv, tmp_path):
    python = venv / "bin" / "python"
    out = _run([str(python), "-I", "-c", PROBE], cwd=tmp_path, env=_clean_env())
    info = json.loads(out.strip().splitlines()[-1])
    package = Path(info["package"])
    assert package.is_relative_to(venv.resolve()), (package, info["sys_path"])
    assert Path(info["directory"]) == package / "ptx_sources"
    assert info["families"] == [Path(n).stem for n in PTX_FILES]
    for family, path in info["paths"].items():
        path = Path(path)
        assert path.parent == package / "ptx_sources" and path.name == f"{family}.cu"
        assert path.read_bytes() == (REPO / "ptx" / path.name).read_bytes()
    assert info["cubin_bytes"] > 0


def test_installed_console_script(venv, tmp_path):
    out = _run([str(venv / "bin" / "numbaflash-inspect"), "--list"], cwd=tmp_path, env=_clean_env())
    assert "tile_gemm_f16" in out.split()
