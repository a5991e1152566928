"""Code-structure rules that keep kernels readable: checked on the source, no GPU needed."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "numbaflash"
MAX_DEVICE_ARGS = 10


def _is_device_function(node: ast.FunctionDef) -> bool:
    """Decorated ``@cuda.jit(device=True, ...)``."""
    for dec in node.decorator_list:
        if isinstance(dec, ast.Call) and any(
            kw.arg == "device" and isinstance(kw.value, ast.Constant) and kw.value.value is True
            for kw in dec.keywords
        ):
            return True
    return False


def device_functions() -> list[tuple[str, int, int]]:
    """(file:line name, argument count) of every device function in the package."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and _is_device_function(node):
                found.append((f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}", len(node.args.args)))
    return found


def _decorator_keywords(node: ast.FunctionDef) -> dict:
    for dec in node.decorator_list:
        if isinstance(dec, ast.Call):
            return {kw.arg: getattr(kw.value, "value", None) for kw in dec.keywords}
    return {}


def test_device_functions_are_inlined_by_nvvm():
    """Every device helper is ``forceinline=True`` (LLVM's alwaysinline: typed once, inlined by
    NVVM), never ``inline="always"`` (Numba deep-copies the callee's IR into every call site,
    level by level: 75% of a kernel's compile time before issue 31)."""
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and _is_device_function(node):
                keywords = _decorator_keywords(node)
                if keywords.get("forceinline") is not True or "inline" in keywords:
                    wrong.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}")
    assert not wrong, f"device functions not forceinline=True: {wrong}"
    generated = (PACKAGE / "kernels" / "common.py").read_text()
    assert 'cuda.jit(device=True, forceinline=True)(namespace["run"])' in generated


def test_device_functions_are_found():
    names = {name.split()[-1] for name, _ in device_functions()}
    assert {"copy_tile_async", "attend_overlapped", "qk_scores", "store_rows_global"} <= names


def test_no_device_function_takes_more_than_10_arguments():
    """Kernel entries take the launch ABI; every helper groups its state into small records."""
    too_many = [f"{name} ({n})" for name, n in device_functions() if n > MAX_DEVICE_ARGS]
    assert not too_many, f"device functions with more than {MAX_DEVICE_ARGS} arguments: {too_many}"


def test_kernels_import_no_upper_layer():
    """Device code sits below the API, the tools and the demos: nothing in ``kernels/`` imports
    ``api``, ``tools`` or ``demos`` (benchmark launchers and the kernel registry live in ``tools/``)."""
    upper = ("api", "tools", "demos")
    wrong = []
    for path in sorted((PACKAGE / "kernels").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                module = node.module or ""
                parts = module.split(".")
                names = [alias.name for alias in node.names]
                absolute = node.level == 0 and parts[0] == "numbaflash" and parts[1:2] in ([u] for u in upper)
                from_parent = not module and set(names) & set(upper)  # from .. import api
                relative_up = node.level >= 2 and (parts[0] in upper or from_parent)
                if absolute or relative_up:
                    wrong.append(f"{path.name}:{node.lineno} from {'.' * node.level}{module} import {names}")
            elif isinstance(node, ast.Import):
                wrong += [f"{path.name}:{node.lineno} import {a.name}" for a in node.names
                          if a.name.split(".")[:2] in (["numbaflash", u] for u in upper)]
    assert not wrong, wrong


# The package top is the public face plus the short ``python -m numbaflash.<tool>`` entry points.
PUBLIC_MODULES = {"__init__", "__main__", "api", "configs"}
TOOL_ENTRY_POINTS = {"bench", "debug", "inspect", "precompile", "selftest"}
SUBPACKAGES = {"kernels", "ptx", "runtime", "tools", "demos"}


def test_package_top_holds_only_the_public_face():
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    assert modules == PUBLIC_MODULES | TOOL_ENTRY_POINTS
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert packages == SUBPACKAGES


def test_tool_entry_points_only_forward_to_tools():
    """Each top-level tool module is a few lines that call ``numbaflash.tools.<name>.main``."""
    for name in TOOL_ENTRY_POINTS:
        text = (PACKAGE / f"{name}.py").read_text()
        assert f"from numbaflash.tools.{name} import main" in text
        assert len(text.splitlines()) <= 8, name


def test_kernels_package_split_by_concern():
    """Device pieces live in one module per concern, and the forward kernels import them."""
    kernels = PACKAGE / "kernels"
    assert {"blocks", "smem", "softmax", "epilogue", "common"} <= {p.stem for p in kernels.glob("*.py")}
    pieces = {"forward_mma.py": ("blocks", "smem", "softmax", "epilogue", "common"),
              "forward_ws.py": ("blocks", "softmax", "epilogue", "common", "wgmma_gemms")}
    for kernel, used in pieces.items():
        text = (kernels / kernel).read_text()
        for piece in used:
            assert f"from .{piece} import" in text, (kernel, piece)


@pytest.mark.parametrize("tool", sorted(TOOL_ENTRY_POINTS))
def test_python_dash_m_tool_help(tool):
    """``python -m numbaflash.<tool> --help`` still works after the move to ``tools/``."""
    done = subprocess.run([sys.executable, "-m", f"numbaflash.{tool}", "--help"],
                          capture_output=True, text=True, timeout=120, cwd=PACKAGE.parent)
    assert done.returncode == 0, done.stderr
    assert f"numbaflash.{tool}" in done.stdout
