"""Code-structure rules that keep kernels readable: checked on the source, no GPU needed."""

from __future__ import annotations

import ast
import pathlib

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


def test_device_functions_are_found():
    names = {name.split()[-1] for name, _ in device_functions()}
    assert {"copy_tile_async", "pipelined_step", "qk_scores", "store_rows_global"} <= names


def test_no_device_function_takes_more_than_10_arguments():
    """Kernel entries take the launch ABI; every helper groups its state into small records."""
    too_many = [f"{name} ({n})" for name, n in device_functions() if n > MAX_DEVICE_ARGS]
    assert not too_many, f"device functions with more than {MAX_DEVICE_ARGS} arguments: {too_many}"
