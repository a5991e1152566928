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


# Layers, lowest first: a module may import its own layer and those below it, never above.
# ``runtime`` (driver, device state, cache, launch, pipeline) is below everything; the API
# validates and routes to ``operations``, which take configs and kernels; device code
# (``kernels``) sits on the PTX helpers. Tools, demos and entry points may use anything.
LAYERS = {
    "runtime": 0, "__version__": 0,
    "ptx": 1,
    "kernels": 2,
    "configs": 3, "operands": 3,  # tables, dispatch policy, compile; what an input is
    "operations": 4,
    "api": 5, "torch_ops": 5, "torch_route": 5, "fp8": 5,
    "__init__": 6,
    "tools": 7, "demos": 7, "__main__": 7, "bench": 7, "debug": 7, "inspect": 7, "precompile": 7,
    "selftest": 7, "integrations": 7, "distributed": 7,
}


def _layer_of(path: pathlib.Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def package_imports() -> list[tuple[str, str, str]]:
    """(file:line, importing layer, imported layer) for every import of numbaflash code."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        here = path.relative_to(PACKAGE).parts[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom):
                parts = (node.module or "").split(".") if node.module else []
                if node.level == 0:
                    targets = [parts[1:]] if parts[:1] == ["numbaflash"] else []
                else:
                    base = list(here[:len(here) - (node.level - 1)]) + parts
                    targets = [base] if base else [[alias.name] for alias in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name.split(".")[1:] for a in node.names if a.name.startswith("numbaflash.")]
            for target in targets:
                if target:
                    found.append((f"{path.relative_to(PACKAGE)}:{node.lineno}", _layer_of(path), target[0]))
    return found


def test_layers_point_one_way():
    """api -> operations (configs, operands, family records) -> kernels -> ptx, with runtime
    below them all: nothing imports a layer above its own (nothing in ``kernels/`` imports
    ``api``, ``operations``, ``tools`` or ``demos``)."""
    imports = package_imports()
    unknown = sorted({layer for _, a, b in imports for layer in (a, b) if layer not in LAYERS})
    assert not unknown, f"modules with no layer in LAYERS: {unknown}"
    upward = [f"{where}: {a} imports {b}" for where, a, b in imports if LAYERS[b] > LAYERS[a]]
    assert not upward, upward
    assert ("operations/forward.py" in {w.split(":")[0] for w, _, _ in imports})


def test_layer_rule_catches_an_upward_import(tmp_path, monkeypatch):
    """The rule above is live: a kernel module importing the API is found."""
    fake = tmp_path / "numbaflash"
    (fake / "kernels").mkdir(parents=True)
    (fake / "kernels" / "bad.py").write_text("from ..api import flash_attention\nfrom .. import tools\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    assert [(a, b) for _, a, b in package_imports()] == [("kernels", "api"), ("kernels", "tools")]


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    """``numbaflash.operations.forward`` for root/numbaflash/operations/forward.py; a package is
    its ``__init__``."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: pathlib.Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, by every import statement in it: at module
    level, inside functions, and under ``if TYPE_CHECKING`` (a layer's order holds for types
    too). ``from X import name`` counts as importing ``X.name`` when that is a module, else ``X``
    (a package: its ``__init__``); a submodule's implicit import of its parents does not count."""
    root = package.parent
    files = {_module_name(p, root): p for p in sorted(package.rglob("*.py"))}
    top = package.name
    graph = {}
    for module, path in files.items():
        here = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if a.name.split(".")[0] == top}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = ".".join(here.split(".")[:len(here.split(".")) - node.level + 1]
                                    + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                if base.split(".")[0] == top:
                    targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in files else base
                                for a in node.names}
        graph[module] = {t for t in targets if t in files and t != module}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The graph's circles: each strongly connected set of more than one module (Tarjan)."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:
        order[v] = low[v] = len(order)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            members = set()
            while not members or v not in members:
                members.add(stack.pop())
            if len(members) > 1:
                circles.append(frozenset(members))

    for v in sorted(graph):
        if v not in order:
            visit(v)
    return circles


def test_no_import_circles():
    """No module of ``numbaflash`` reaches itself through imports, inside a layer too: ``api``
    and ``torch_ops`` do not import each other, nor ``selftest`` and ``selftest_decode``."""
    graph = import_graph(PACKAGE)
    assert {"numbaflash.api", "numbaflash.torch_ops", "numbaflash.tools.selftest"} <= set(graph)
    assert "numbaflash.operations.entry" in graph["numbaflash.torch_ops"]
    circles = import_circles(graph)
    assert not circles, f"import circles: {[sorted(c) for c in circles]}"


def test_circle_rule_is_live(tmp_path):
    """The rule above is live: a circle through a function-level import, a ``from . import``
    of a sibling, and the package ``__init__`` is found; a chain that does not close is not."""
    fake = tmp_path / "numbaflash"
    (fake / "ops").mkdir(parents=True)
    (fake / "__init__.py").write_text("from .api import f\n")
    (fake / "api.py").write_text("from .ops import run\n\ndef f():\n    from . import torch_ops\n")
    (fake / "torch_ops.py").write_text("import numbaflash.api\n")
    (fake / "ops" / "__init__.py").write_text("")
    (fake / "ops" / "run.py").write_text("from ..ops import base\n")
    (fake / "ops" / "base.py").write_text("from .. import __version__\n")
    (fake / "low.py").write_text("import numpy\n")
    graph = import_graph(fake)
    assert graph["numbaflash.ops.run"] == {"numbaflash.ops.base"}
    assert import_circles(graph) == [frozenset({"numbaflash", "numbaflash.api", "numbaflash.ops.base",
                                                "numbaflash.ops.run", "numbaflash.torch_ops"})]
    (fake / "ops" / "base.py").write_text("x = 1\n")
    assert import_circles(import_graph(fake)) == [frozenset({"numbaflash.api", "numbaflash.torch_ops"})]
    assert import_circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


CONFIG_TYPES = {"ForwardConfig", "WsConfig", "KernelConfig"}
FAMILY_RECORDS = "kernels/families.py"


def config_type_switches(root: pathlib.Path) -> list[str]:
    """Places that switch on a config's type: ``isinstance(x, <a config class>)`` or
    ``type(x) is/== <a config class>``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names: set[str] = set()
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" \
                    and len(node.args) == 2:
                names = {getattr(n, "id", getattr(n, "attr", "")) for n in ast.walk(node.args[1])}
            elif isinstance(node, ast.Compare) and isinstance(node.left, ast.Call) \
                    and getattr(node.left.func, "id", None) == "type":
                names = {getattr(n, "id", getattr(n, "attr", ""))
                         for c in node.comparators for n in ast.walk(c)}
            if names & CONFIG_TYPES:
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_only_the_family_records_switch_on_config_types():
    """Family dispatch goes through ``kernels.families.family_of``: no module of the package,
    the benchmarks or the lab switches on config classes (tests may assert on them)."""
    repo = PACKAGE.parent
    wrong = [w for w in config_type_switches(PACKAGE) if not w.startswith(FAMILY_RECORDS)]
    for folder in ("benchmarks", "lab"):
        if (repo / folder).is_dir():
            wrong += [f"{folder}/{w}" for w in config_type_switches(repo / folder)]
    assert not wrong, wrong


def test_config_switch_rule_is_live(tmp_path):
    (tmp_path / "a.py").write_text("x = isinstance(c, WsConfig)\ny = type(c) is configs.ForwardConfig\n")
    assert config_type_switches(tmp_path) == ["a.py:1", "a.py:2"]


MAX_UNPACKED = 4


def tuple_unpacks(root: pathlib.Path) -> list[str]:
    """Device functions that unpack a positional tuple of more than ``MAX_UNPACKED`` names
    (``a, b, c, d, e = bundle`` or ``for a, b, c, d, e in ...``)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for fn in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(fn, ast.FunctionDef) and _is_device_function(fn)):
                continue
            for node in ast.walk(fn):
                targets = node.targets if isinstance(node, ast.Assign) else \
                    [node.target] if isinstance(node, ast.For) else []
                for t in targets:
                    if isinstance(t, ast.Tuple) and len(t.elts) > MAX_UNPACKED:
                        found.append(f"{path.relative_to(root)}:{node.lineno} {fn.name} ({len(t.elts)})")
    return found


def test_no_device_function_unpacks_a_long_positional_tuple():
    """Bundles of more than four values are named records (namedtuples), read by field name."""
    wrong = tuple_unpacks(PACKAGE)
    assert not wrong, f"device functions unpacking positional tuples of more than {MAX_UNPACKED}: {wrong}"


def test_tuple_unpack_rule_is_live(tmp_path):
    (tmp_path / "a.py").write_text(
        "@cuda.jit(device=True, forceinline=True)\ndef f(t):\n    a, b, c, d, e = t\n    w, x, y, z = t\n")
    assert tuple_unpacks(tmp_path) == ["a.py:3 f (5)"]


# The package top is the public face plus the short ``python -m numbaflash.<tool>`` entry points.
PUBLIC_MODULES = {"__init__", "__main__", "api", "configs", "operands", "torch_ops", "torch_route", "fp8"}
TOOL_ENTRY_POINTS = {"bench", "debug", "inspect", "precompile", "selftest"}
SUBPACKAGES = {"kernels", "ptx", "runtime", "tools", "demos", "operations", "integrations", "distributed"}


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
    pieces = {"forward_mma.py": ("blocks", "smem", "mma_pieces", "epilogue", "common"),
              "forward_ws.py": ("blocks", "softmax", "epilogue", "common", "wgmma_gemms"),
              "decode_mma.py": ("blocks", "mma_pieces", "epilogue", "common")}
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


# What each test file needs from the machine, by the suffix of its name:
#   test_<subject>_cpu.py      Python and numpy only: no kernel is compiled, no GPU is used;
#   test_<subject>_offline.py  compiles kernels with no GPU (Numba, NVVM, nvJitLink: the
#                              ``cu13`` extra), and uses no GPU;
#   test_<subject>_gpu.py      holds GPU tests (marked ``gpu`` or ``hopper``: they run wherever
#                              a GPU is and are skipped with the reason elsewhere), and may hold
#                              CPU or offline tests of the same subject.
TEST_SUFFIXES = ("cpu", "offline", "gpu")
COMPILERS = {"compile_cubin", "kernel_cubin", "compile_all", "inspect_kernel", "report_from_cubin",
             "cached_cubin", "jit"}


def _marks_gpu(tree: ast.AST) -> bool:
    return any(isinstance(node, ast.Attribute) and node.attr in ("gpu", "hopper")
               and isinstance(node.value, ast.Attribute) and node.value.attr == "mark"
               for node in ast.walk(tree))


def _compiles(tree: ast.AST) -> bool:
    """Calls a compiler (or runs ``python -m numbaflash.precompile``)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = getattr(node.func, "id", getattr(node.func, "attr", ""))
            if name in COMPILERS:
                return True
        if isinstance(node, ast.List) and any(getattr(e, "value", None) == "numbaflash.precompile"
                                              for e in node.elts):  # [python, "-m", "numbaflash.precompile"]
            return True
    return False


def test_file_names_say_what_each_test_file_needs():
    tests = pathlib.Path(__file__).resolve().parent
    wrong = []
    for path in sorted(tests.glob("test_*.py")):
        suffix = path.stem.rsplit("_", 1)[-1]
        tree = ast.parse(path.read_text())
        if suffix not in TEST_SUFFIXES:
            wrong.append(f"{path.name}: name does not end in _cpu, _offline or _gpu")
        elif _marks_gpu(tree) != (suffix == "gpu"):
            wrong.append(f"{path.name}: GPU-marked tests belong in, and only in, a _gpu file")
        elif suffix == "cpu" and _compiles(tree):
            wrong.append(f"{path.name}: compiles kernels, so it is an _offline file")
    assert not wrong, wrong


# Product code cites docs (docs/PERFORMANCE.md, docs/ARCHITECTURE.md), never the lab notebook:
# the notebook is not shipped, and its sections (``[DEC.6]``, ``BW.9``, ...) are a work log.
NOTEBOOK_CITATION = r"notebook|\blab/|\b(?:BW|HB|DEC|WS|CT|W\d+)\.\d+\b"


def notebook_citations(root: pathlib.Path) -> list[str]:
    """Lines of ``root``'s .py files that mention the lab notebook: ``lab/NOTEBOOK.md``, "lab
    notebook", the ``lab/`` folder, or a notebook section such as ``DEC.6``."""
    import re

    pattern = re.compile(NOTEBOOK_CITATION, re.IGNORECASE)
    return [f"{path.relative_to(root)}:{n}" for path in sorted(root.rglob("*.py"))
            for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]


def test_product_code_does_not_cite_the_lab_notebook():
    wrong = notebook_citations(PACKAGE)
    assert not wrong, f"cite docs/PERFORMANCE.md or docs/ARCHITECTURE.md instead of the lab notebook: {wrong}"


def test_notebook_citation_rule_is_live(tmp_path):
    (tmp_path / "a.py").write_text(
        "# see lab/NOTEBOOK.md\nx = 1  # 1.2% faster (lab notebook DEC.5)\n"
        "y = 2  # the probe in lab/ws_check.py\n\"\"\"H100, BW.9 run 1.\"\"\"\n"
        "z = 3  # docs/PERFORMANCE.md, sm_90a, WS_ABI, ring.slot(i), v1.2\n")
    assert notebook_citations(tmp_path) == ["a.py:1", "a.py:2", "a.py:3", "a.py:4"]


# Each kernel is a factory of rooms (docs/ARCHITECTURE.md, "Kernels built from pieces"): no function
# under numbaflash/kernels, nested device functions counted in their factory, is longer than this.
MAX_KERNEL_FUNCTION_LINES = 200


def long_functions(root: pathlib.Path, limit: int = MAX_KERNEL_FUNCTION_LINES) -> list[str]:
    """``file:function (lines)`` of every function under ``root`` longer than ``limit`` lines."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    found.append(f"{path.relative_to(root)}:{node.name} ({length})")
    return found


def test_no_kernel_function_is_longer_than_200_lines():
    assert not long_functions(PACKAGE / "kernels"), long_functions(PACKAGE / "kernels")


def test_function_length_rule_is_live(tmp_path):
    body = "".join(f"        x{i} = {i}\n" for i in range(200))
    (tmp_path / "k.py").write_text(f"def make_kernel():\n    def body():\n{body}    return body\n"
                                   "def short():\n    return 1\n")
    assert long_functions(tmp_path) == ["k.py:make_kernel (203)", "k.py:body (201)"]


# Factories are reached through ``kernels.families.FACTORIES`` (a dict of functions), never by an
# import-path string such as "forward_mma:make_forward_kernel" resolved with importlib.
FACTORY_STRING = r"^[a-z_]+(\.[a-z_]+)*:[A-Za-z_]+$"


def factory_strings(root: pathlib.Path) -> list[str]:
    """``file:line`` of every string constant under ``root`` shaped like "module:attribute"."""
    import re

    pattern = re.compile(FACTORY_STRING)
    return [f"{path.relative_to(root)}:{node.lineno}" for path in sorted(root.rglob("*.py"))
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and pattern.match(node.value)]


def test_no_module_function_factory_strings():
    assert not factory_strings(PACKAGE), factory_strings(PACKAGE)


def test_factory_string_rule_is_live(tmp_path):
    (tmp_path / "f.py").write_text('A = "forward_mma:make_forward_kernel"\nB = "common:FORWARD_ARGTYPES"\n'
                                   'C = "a: b"\nD = "sm_90a"\n')
    assert factory_strings(tmp_path) == ["f.py:1", "f.py:2"]
