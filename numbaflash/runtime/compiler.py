"""Compile a kernel to a linked cubin with no GPU: Numba → NVVM → LTO-IR, then nvJitLink links
it with its PTX helpers (``ptx/*.cu``, compiled to LTO-IR by NVRTC) and runs ptxas.

This is the one compile path of the package: the kernel cache stores what it returns, the
API loads it, and offline inspection disassembles it, so what is inspected is what runs.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import re
import struct
import threading
import types
from collections.abc import Iterator, Sequence
from pathlib import Path

_ARCH_RE = re.compile(r"^sm_(\d+)(\d)(a?)$")


def parse_arch(arch: str) -> tuple:
    """``"sm_90a"`` -> ``(9, 0, "a")``, ``"sm_86"`` -> ``(8, 6)``: Numba's compute capability."""
    match = _ARCH_RE.match(arch)
    if not match or int(match.group(1)) < 8:
        raise ValueError(f"unknown architecture {arch!r}; expected sm_XY or sm_XYa with X >= 8, "
                         f"for example sm_80, sm_86, sm_89, sm_90a")
    major, minor, suffix = int(match.group(1)), int(match.group(2)), match.group(3)
    return (major, minor, suffix) if suffix else (major, minor)


def arch_of(capability: tuple[int, int]) -> str:
    """The target a GPU of ``capability`` compiles for, as Numba picks it: architecture-specific
    (``a``) features from sm_90 on, since the Hopper kernel needs wgmma and setmaxnreg."""
    major, minor = capability
    return f"sm_{major}{minor}" + ("a" if (major, minor) >= (9, 0) else "")


@contextlib.contextmanager
def target_capability(cc: tuple) -> Iterator[None]:
    """While compiling for ``cc``, answer Numba's question "which GPU is this for?" with ``cc``.

    Device functions are ``@cuda.jit(device=True, forceinline=True)``: each is typed and
    lowered once on its own (``CUDADispatcher.compile_device``) and NVVM inlines it, instead of
    Numba deep-copying its IR into every caller. ``compile_device`` takes the compute capability
    from ``numba.cuda.dispatcher.get_current_device()``, which needs a GPU and, with one,
    names the current GPU rather than the target. Inside this context that name answers with
    a stand-in device of capability ``cc``, under Numba's compiler lock so that no other
    thread's compile sees it. ``tests/test_compile_offline.py`` pins this hook, so a numba-cuda
    release that moves it fails there and not in a user's first call.

    The capability only steers lowering choices made below sm_75 (atomics, ``tanh``); the
    device functions' typed IR is the same for every target from sm_80 on, and the per-target
    code comes from NVVM and ptxas at the kernel's own ``cc``."""
    from numba.core.compiler_lock import global_compiler_lock
    from numba.cuda import dispatcher

    device = types.SimpleNamespace(compute_capability=tuple(cc))
    with global_compiler_lock:
        saved = dispatcher.get_current_device
        dispatcher.get_current_device = lambda: device
        try:
            yield
        finally:
            dispatcher.get_current_device = saved


def compile_cubin(pyfunc, argtypes: Sequence, arch: str, launch_bounds=None) -> bytes:
    """Compile a kernel's Python function for ``arch`` and return the linked cubin.
    ``launch_bounds`` defaults to the function's ``launch_bounds`` attribute (set by the
    package's kernel factories).

    Numba (with ``target_capability``) and NVVM turn the kernel and its device functions into
    one LTO-IR module; NVRTC compiles the PTX helpers that module calls (``helper_source``: the
    helper families it links, and of ``wgmma.cu`` only the shapes it calls) into one LTO-IR
    module (``helper_ltoir``, once per source and target in a process); nvJitLink links the
    two, inlines the helpers and runs ptxas. Python's cyclic garbage collector is paused
    meanwhile (``collector_paused``): Numba allocates millions of short-lived objects, and
    the collections they trigger cost about a tenth of the compile; Numba types each builtin
    operator on scalars once per argument types (``scalar_operators_memoised``), and each
    device function once per process where two kernels build equal ones
    (``device_functions_shared``), and lists an IR statement's variables in one walk
    (``variables_listed_fast``); CUDA's paths, which NVVM and NVRTC ask for, are found in a
    thread meanwhile (``cuda_paths_found_early``). A kernel whose function is equal to one
    this process has compiled for the same argument types, target and launch bounds
    (``function_fingerprint``: the variants a spec gives that do not change the code, such as
    the decode's combine kernel of configs that differ only in fields it does not read) gets
    that cubin back. NVVM gets each LLVM module once (``module_texts``)."""
    from cuda.bindings import nvjitlink

    cc = parse_arch(arch)
    bounds = launch_bounds if launch_bounds is not None else getattr(pyfunc, "launch_bounds", None)
    with collector_paused():
        key = (function_fingerprint(pyfunc), tuple(argtypes), arch, bounds)
        known = _KERNEL_CUBINS.get(key)
        if known is not None:
            return known
        paths = cuda_paths_found_early()
        library = numba_library(pyfunc, tuple(argtypes), cc, bounds)
        library._llvm_strs = module_texts(library)  # what get_ltoir hands NVVM
        paths.join()
        modules = [("kernel", _code_bytes(library.get_ltoir(cc=cc)))]
        source = helper_source(library)
        if source:
            modules.append(("helpers", helper_ltoir(source, arch)))
    handle = nvjitlink.create(2, [f"-arch={arch}", "-lto"])
    try:
        for name, data in modules:
            nvjitlink.add_data(handle, nvjitlink.InputType.LTOIR, data, len(data), name)
        nvjitlink.complete(handle)
        cubin = bytearray(nvjitlink.get_linked_cubin_size(handle))
        nvjitlink.get_linked_cubin(handle, cubin)
    finally:
        nvjitlink.destroy(handle)
    cubin = bytes(cubin)
    with _KERNEL_CUBINS_LOCK:
        _KERNEL_CUBINS[key] = cubin
        while len(_KERNEL_CUBINS) > KERNEL_CUBINS_KEPT:
            del _KERNEL_CUBINS[next(iter(_KERNEL_CUBINS))]
    return cubin


@functools.cache
def cuda_paths_found_early() -> threading.Thread:
    """Start (once per process) a thread that finds the CUDA paths NVVM and NVRTC will ask
    numba-cuda for (``cuda_paths.get_cuda_paths``: libdevice, CUDA's header directory; the
    CCCL headers ``numba.cuda.cudadrv.nvrtc.compile`` adds), and return it; join it before
    NVVM. Both remember what they found, so the compile asks the same questions and gets the
    same answers, sooner. Where no wheel holds CUDA's headers, ``cuda.pathfinder`` finds them
    from the toolkit by loading a library in a subprocess: about 0.3 s that the thread spends
    waiting while Numba compiles (the subprocess holds no lock of this process). A failure is
    left for the compile to meet and report as before."""

    def find() -> None:
        try:
            from cuda import pathfinder
            from numba.cuda.cuda_paths import get_cuda_paths

            get_cuda_paths()
            pathfinder.locate_nvidia_header_directory("cccl")
        except Exception:  # the compile asks again and reports what fails
            pass

    thread = threading.Thread(target=find, name="numbaflash-cuda-paths", daemon=True)
    thread.start()
    return thread


def numba_library(pyfunc, argtypes: tuple, cc: tuple, launch_bounds=None):
    """Numba's code library of the kernel ``pyfunc`` compiled for ``cc`` (typed, lowered, its
    device functions' libraries linked in; ``get_ltoir`` runs NVVM): what
    ``numba.cuda.compile(..., output="ltoir")`` compiles, kept so that ``helper_source`` can
    read which helpers it calls. ``tests/test_compile_offline.py`` pins the numba-cuda names
    this uses."""
    from numba.cuda.compiler import _compile_pyfunc_with_fixup

    with (target_capability(cc), scalar_operators_memoised(), device_functions_shared(),
          variables_listed_fast()):
        library, _ = _compile_pyfunc_with_fixup(pyfunc, argtypes, device=False, cc=cc, abi="numba",
                                                launch_bounds=launch_bounds, lto=True)
    return library


def _code_bytes(code) -> bytes:
    return bytes(code if isinstance(code, (bytes, bytearray)) else code.code)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector (for the whole process) while the block runs, and
    restore it as it was. What the block allocated and still holds (Numba's compile results:
    some 400,000 objects that live as long as the process) goes straight to the oldest
    generation (``gc.freeze`` then ``gc.unfreeze``) rather than being traversed by the young
    collection its allocations would trigger as soon as the collector runs again (0.2 s); the
    few cycles it left as garbage wait for the next full collection."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.unfreeze()
        if enabled:
            gc.enable()


# (kernel fingerprint, argument types, target, launch bounds) -> cubin, the most recent first out
_KERNEL_CUBINS: dict = {}
_KERNEL_CUBINS_LOCK = threading.Lock()
KERNEL_CUBINS_KEPT = 256
# (device function fingerprint, argument types, return type, compute capability) -> Numba's result
_DEVICE_RESULTS: dict = {}
# id(object) -> (object, fingerprint): each function's fingerprint, computed once (the object is
# kept, so that its id is never another's)
_FINGERPRINTS: dict = {}
_SCALARS = (bool, int, str, bytes, type(None), complex)


def function_fingerprint(value):
    """A hashable value equal for two Python functions (or ``@cuda.jit`` device functions) that
    Numba compiles to the same code: the code object (its bytecode, constants and names), the
    value of every module global it names, its defaults and the values its closure holds, each
    by the same rule, recursively; a device function by its compile options and its Python
    function. Scalars count by type and value (``True``, ``1`` and ``1.0`` differ; a float by
    its bits), tuples (named tuples too) by type and items, modules by name, Numba types by
    value, NumPy scalars by type and bytes; anything else by identity, so that two values
    which might differ are never taken as equal. The kernel factories build a new closure for
    each kernel: equal fingerprints find the ones that are the same function."""
    from numba.cuda.dispatcher import CUDADispatcher

    if isinstance(value, (types.FunctionType, CUDADispatcher)):
        known = _FINGERPRINTS.get(id(value))
        if known is not None and known[0] is value:
            return known[1]
    return _fingerprint(value, {}, CUDADispatcher)


def _fingerprint(value, seen: dict, dispatcher_type):
    if isinstance(value, float):
        return float, value.hex()
    if isinstance(value, _SCALARS):
        return type(value), value
    if type(value) is tuple or isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value), tuple(_fingerprint(v, seen, dispatcher_type) for v in value)
    if isinstance(value, types.ModuleType):
        return "module", value.__name__
    if isinstance(value, (types.FunctionType, dispatcher_type)):
        known = _FINGERPRINTS.get(id(value))
        if known is not None and known[0] is value:
            return known[1]
        if id(value) in seen:  # a function that reaches itself: by identity
            return "self", id(value), seen[id(value)]
        seen[id(value)] = value
        if isinstance(value, dispatcher_type):
            options = tuple(sorted((k, repr(v)) for k, v in value.targetoptions.items()))
            found = "device function", options, _fingerprint(value.py_func, seen, dispatcher_type)
        else:
            code, names = value.__code__, value.__globals__
            cells = tuple(_cell_value(c) for c in value.__closure__ or ())
            keywords = tuple(sorted((value.__kwdefaults__ or {}).items()))
            found = ("function", code,
                     tuple((n, _fingerprint(names[n], seen, dispatcher_type))
                           for n in sorted(_names_of(code)) if n in names),
                     *(_fingerprint(v, seen, dispatcher_type) for v in (
                         value.__defaults__, keywords, cells, getattr(value, "launch_bounds", None))))
        _FINGERPRINTS[id(value)] = (value, found)
        return found
    return _fingerprint_other(value)


def _cell_value(cell):
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell: by identity
        return cell


def _fingerprint_other(value):
    import numpy as np
    from numba.core.types import Type

    if isinstance(value, Type):
        return "numba type", value
    if isinstance(value, np.generic):
        return type(value), value.tobytes()
    if isinstance(value, np.dtype):
        return "dtype", value.str
    known = _FINGERPRINTS.get(id(value))
    if known is None or known[0] is not value:
        known = _FINGERPRINTS[id(value)] = (value, ("object", type(value).__qualname__, id(value)))
    return known[1]


@functools.cache
def _names_of(code: types.CodeType) -> frozenset:
    """Every name ``code`` (and the code of the functions it defines) reads as a global or an
    attribute."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names_of(const)
    return frozenset(names)


@contextlib.contextmanager
def device_functions_shared() -> Iterator[None]:
    """While the block runs, a device function equal to one this process has compiled
    (``function_fingerprint``, for the same argument types and compute capability) reuses that
    compile: Numba's typed, lowered function and its library. The kernel factories build new
    closures for every kernel, and most of them are equal across the kernels of one config
    (the variants change a few rooms), so a process that compiles several kernels types each
    shared function once; what differs is compiled as before.

    ``numba.cuda.dispatcher.CUDADispatcher.compile_device`` is wrapped: on an argument-type
    tuple the dispatcher has not compiled, a result remembered in ``_DEVICE_RESULTS`` is
    stored as its overload (Numba's own table, which typing and lowering read: the caller then
    calls the first function's symbol, which its target context already holds). Call it under
    Numba's compiler lock (``target_capability`` holds it); ``tests/test_compile_offline.py``
    pins what it relies on."""
    from numba.cuda import dispatcher

    compile_device = dispatcher.CUDADispatcher.compile_device

    def shared(self, args, return_type=None):
        if args in self.overloads:
            return self.overloads[args]
        key = (function_fingerprint(self), args, return_type,
               tuple(dispatcher.get_current_device().compute_capability))
        known = _DEVICE_RESULTS.get(key)
        if known is not None:
            self.overloads[args] = known
            return known
        result = compile_device(self, args, return_type)
        _DEVICE_RESULTS[key] = result
        return result

    dispatcher.CUDADispatcher.compile_device = shared
    try:
        yield
    finally:
        dispatcher.CUDADispatcher.compile_device = compile_device


# id(module) -> (module, linkage of its functions, its LLVM IR text)
_MODULE_TEXTS: dict = {}


def module_texts(library) -> list[str]:
    """The LLVM IR of a kernel's Numba code library, one text per module, each module once:
    what NVVM compiles. Numba lists a device function's module once per path that reaches it
    (a function that three others call: four times) and prints every module again for each
    kernel; here a module that several paths reach is given once (NVVM links the copies into
    one anyway: the same cubin), and the text of a device function's module is printed once per
    process (modules reused across kernels: ``device_functions_shared``), again only if its
    functions' linkage has changed since (Numba sets it when a library links it)."""
    own, *linked = library.modules  # the kernel's module first (``CUDACodeLibrary.modules``)
    texts = [str(own)]
    seen = {id(own)}
    for module in linked:
        if id(module) in seen:
            continue
        seen.add(id(module))
        linkage = tuple(f.linkage for f in module.functions)
        known = _MODULE_TEXTS.get(id(module))
        if known is None or known[0] is not module or known[1] != linkage:
            known = _MODULE_TEXTS[id(module)] = (module, linkage, str(module))
        texts.append(known[2])
    return texts


# type -> how ``_variable_lister`` walks a value of it (the ``isinstance`` tests of Numba's
# ``Inst._rec_list_vars``, in its order, made once per type)
_VAR, _INST, _SEQUENCE, _MAPPING, _OTHER = range(5)
_WALKS: dict = {}


@contextlib.contextmanager
def variables_listed_fast() -> Iterator[None]:
    """While the block runs, Numba lists the variables of an IR statement (``list_vars``, which
    its IR passes call for every statement each time they rebuild use-def and liveness
    information: about a tenth of the Numba time) with ``_variable_lister``, which gives the
    same list in the same order without a new list and four ``isinstance`` tests per value
    walked.

    ``numba.cuda.core.ir.Inst._rec_list_vars`` is replaced: the original walks a value
    recursively (a variable: itself; an instruction: its ``list_vars()``; a list or tuple: its
    items; a dict: its values; anything else: nothing) and concatenates; the replacement
    appends to one list, classifies each type once (``_WALKS``) by the same tests, and walks a
    statement's ``__dict__`` or an expression's ``_kws`` directly where the instruction's
    ``list_vars`` is Numba's own (any other ``list_vars`` is called). Call it under Numba's
    compiler lock (``target_capability`` holds it); ``tests/test_compile_offline.py`` checks
    the two agree on every statement of a compiled function."""
    from numba.cuda.core import ir

    original = ir.Inst._rec_list_vars
    ir.Inst._rec_list_vars = _rec_list_vars_fast
    try:
        yield
    finally:
        ir.Inst._rec_list_vars = original


def _rec_list_vars_fast(self, val) -> list:
    found: list = []
    _variable_lister()(val, found)
    return found


@functools.cache
def _variable_lister():
    """``listed(value, found)``: append to ``found`` the variables ``value`` holds, as
    ``Inst._rec_list_vars`` lists them."""
    from numba.cuda.core import ir

    statement_vars, expression_vars = ir.Stmt.list_vars, ir.Expr.list_vars
    sequences = (list, tuple)

    def walk_of(value) -> int:
        if isinstance(value, ir.var_types):
            return _VAR
        if isinstance(value, ir.inst_types):
            return _INST
        if isinstance(value, sequences):
            return _SEQUENCE
        return _MAPPING if isinstance(value, dict) else _OTHER

    def listed(value, found: list) -> None:
        kind = _WALKS.get(type(value))
        if kind is None:
            kind = _WALKS[type(value)] = walk_of(value)
        if kind == _VAR:
            found.append(value)
        elif kind == _INST:
            list_vars = type(value).list_vars
            if list_vars is statement_vars:
                listed(value.__dict__, found)
            elif list_vars is expression_vars:
                listed(value._kws, found)
            else:
                found.extend(value.list_vars())
        elif kind == _SEQUENCE:
            for item in value:
                listed(item, found)
        elif kind == _MAPPING:
            for item in value.values():
                listed(item, found)

    return listed


# (operator function type, typing context, argument types) -> (signature, implementation key)
_OPERATOR_SIGNATURES: dict = {}


@contextlib.contextmanager
def scalar_operators_memoised() -> Iterator[None]:
    """While the block runs, Numba types each builtin operator on scalars (``a + b``,
    ``i < n``, ``x & m`` on integers, floats, booleans, literals among them) once per argument
    types, instead of once per use: the kernels hold about a thousand such uses, and each
    resolution tries every template of the operator (the builtins' signatures and the
    ``@overload`` templates, each hashing the compile flags), about a tenth of the Numba time.

    ``numba.core.types.functions.BaseFunction.get_call_type`` is wrapped: a call on an
    ``operator`` function with scalar arguments and no keywords is answered from
    ``_OPERATOR_SIGNATURES`` when the same function type (a registry that adds templates
    makes a new one) in the same typing context resolved the same argument types before, to a
    builtin implementation (keyed by the operator itself; an ``@overload`` implementation,
    which depends on the flags, is never remembered); it sets the implementation key as the
    first resolution did, so lowering picks the same implementation. Any other call, and a
    failed resolution, goes through Numba unchanged. Call it under Numba's compiler lock
    (``target_capability`` holds it), which every Numba compile takes, so no other compile
    sees the wrapper; ``tests/test_compile_offline.py`` pins what it relies on."""
    from numba.core import types
    from numba.core.types.functions import BaseFunction

    operators = _operator_functions()
    scalars = (types.Number, types.Boolean)
    resolve = BaseFunction.get_call_type

    def get_call_type(self, context, args, kws):
        if kws or self.typing_key not in operators or not all(isinstance(a, scalars) for a in args):
            return resolve(self, context, args, kws)
        key = (self, context, tuple(args))
        known = _OPERATOR_SIGNATURES.get(key)
        if known is not None:
            signature, implementation = known
            self._impl_keys[signature.args] = implementation
            return signature
        signature = resolve(self, context, args, kws)
        if signature is not None:
            implementation = self._impl_keys[signature.args]
            if implementation in operators:
                _OPERATOR_SIGNATURES[key] = (signature, implementation)
        return signature

    BaseFunction.get_call_type = get_call_type
    try:
        yield
    finally:
        BaseFunction.get_call_type = resolve


@functools.cache
def _operator_functions() -> frozenset:
    """Every function of the ``operator`` module (``operator.add``, ``operator.lt``, ...):
    Numba's typing key of a Python operator."""
    import operator

    return frozenset(f for f in vars(operator).values() if callable(f) and not isinstance(f, type))


# "declare void @wgmma_m64n128k16_f32_bf16_ss(float*, i64, i64, i32)": a function the module calls
_DECLARE = re.compile(r'^declare [^@\n]*@"?([A-Za-z_][A-Za-z0-9_]*)"?\(', re.MULTILINE)
# The wgmma shape (N) of a wgmma helper's name; the accumulator fence is named by N / 2.
_WGMMA_N = re.compile(r"^wgmma_m64n(\d+)k(?:16|32)_")
_WGMMA_FENCE = re.compile(r"^wgmma_fence_operand_(\d+)$")


def declared_functions(llvm_ir: str) -> set[str]:
    """Names of the functions an LLVM IR module declares (calls without defining)."""
    return set(_DECLARE.findall(llvm_ir))


def wgmma_shapes(names) -> list[int]:
    """The wgmma N of every wgmma helper among ``names``, ascending."""
    shapes = set()
    for name in names:
        if match := _WGMMA_N.match(name):
            shapes.add(int(match.group(1)))
        elif match := _WGMMA_FENCE.match(name):
            shapes.add(2 * int(match.group(1)))
    return sorted(shapes)


def helper_source(library) -> str:
    """One CUDA C source of the PTX helpers a Numba code library calls: each helper family it
    links (``declare_device(link=ptx/<family>.cu)``), in name order, behind a ``#line`` that
    names its file; ``wgmma.cu`` with only the shapes the library calls (``WGMMA_SOME_N`` and a
    ``WGMMA_N<N>`` each), as its other hundred-odd functions would cost NVRTC more than all the
    other families together. Empty if it calls no helper."""
    families = sorted(Path(str(path)) for path in library._linking_files)
    if not families:
        return ""
    parts = []
    if any(path.name == "wgmma.cu" for path in families):
        shapes = wgmma_shapes(declared_functions(library.get_llvm_str()))
        parts += ["#define WGMMA_SOME_N"] + [f"#define WGMMA_N{n}" for n in shapes]
    for path in families:
        parts += [f'#line 1 "{path.name}"', path.read_text()]
    return "\n".join(parts) + "\n"


@functools.cache
def helper_ltoir(source: str, arch: str) -> bytes:
    """LTO-IR of PTX helper source (``helper_source``) for ``arch``, by NVRTC as Numba compiles
    the files a ``declare_device(link=...)`` names; once per source and target in a process.
    The families are compiled as one source, so a macro that one family redefines from another's
    would change that family's code unseen: such a message is an error. NVRTC's other messages
    (a newer NVRTC's deprecation notes, say) reach the caller as a ``RuntimeWarning``, as
    Numba's own compile of the files would give them."""
    import warnings

    from numba.cuda.cudadrv import nvrtc

    with warnings.catch_warnings():  # numba-cuda repeats the log as a warning: handled below
        warnings.simplefilter("ignore")
        code, log = nvrtc.compile(source, "numbaflash_helpers.cu", parse_arch(arch), ltoir=True)
    text = "\n".join(log if isinstance(log, list) else [str(log)]) if log else ""
    if "redefin" in text:
        raise RuntimeError(f"NVRTC compiled the PTX helpers for {arch} with a macro redefined across "
                           f"helper families; expected none:\n{text}")
    if text.strip():
        warnings.warn(f"NVRTC, compiling the PTX helpers for {arch}:\n{text}", RuntimeWarning, stacklevel=2)
    return _code_bytes(code)


_INFO_PREFIX = b".nv.info."


def entry_name(cubin: bytes) -> str:
    """The mangled name of the one kernel entry in ``cubin``, read from its ELF section names
    (each entry has a ``.nv.info.<name>`` section)."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        raise ValueError("not a 64-bit ELF cubin")
    (shoff,) = struct.unpack_from("<Q", cubin, 0x28)
    entsize, count, names_index = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * entsize) for i in range(count)]
    names_offset = headers[names_index][4]
    entries = []
    for header in headers:
        start = names_offset + header[0]
        name = cubin[start:cubin.index(b"\0", start)]
        if name.startswith(_INFO_PREFIX):
            entries.append(name[len(_INFO_PREFIX):].decode())
    if len(entries) != 1:
        raise ValueError(f"expected one kernel entry in the cubin, found {len(entries)}")
    return entries[0]


def toolchain_versions() -> dict[str, str]:
    """Versions of everything that turns Python into a cubin: numba-cuda, NVVM (library and IR),
    NVRTC (compiles the PTX helpers), nvJitLink, and this package. Read without importing
    Numba (whose import alone costs about 0.4 s) and without a GPU; NVVM is found the way
    numba-cuda finds it (``cuda.pathfinder``)."""
    import ctypes
    from importlib.metadata import version

    from cuda import pathfinder
    from cuda.bindings import nvjitlink, nvrtc

    from .version import VERSION

    nvvm = ctypes.CDLL(pathfinder.load_nvidia_dynamic_lib("nvvm").abs_path)
    v = [ctypes.c_int() for _ in range(4)]
    nvvm.nvvmVersion(ctypes.byref(v[0]), ctypes.byref(v[1]))
    nvvm_version = f"{v[0].value}.{v[1].value}"
    nvvm.nvvmIRVersion(*(ctypes.byref(x) for x in v))
    _, nvrtc_major, nvrtc_minor = nvrtc.nvrtcVersion()
    return {
        "numbaflash": VERSION,
        "numba-cuda": version("numba-cuda"),
        "nvvm": nvvm_version,
        "nvvm-ir": ".".join(str(x.value) for x in v),
        "nvrtc": f"{nvrtc_major}.{nvrtc_minor}",
        "nvjitlink": ".".join(str(x) for x in nvjitlink.version()),
    }
