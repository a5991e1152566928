"""The compile path with no GPU (``runtime/compiler.py``): device functions inlined by NVVM
(``forceinline=True``), typed once each for the target the kernel is compiled for, and the
numba-cuda hook that makes that possible pinned, so that an upgrade that moves it fails here.
Also the progress line a slow compile logs, and the main job's offline path."""

from __future__ import annotations

import inspect
import logging
import math
import warnings

import pytest
from numba import cuda, float32, types

from numbaflash.runtime import cache
from numbaflash.runtime.compiler import compile_cubin, target_capability


def test_numba_asks_get_current_device_for_the_capability():
    """``CUDADispatcher.compile_device`` (how a ``device=True`` function called from a kernel is
    compiled on its own) takes the compute capability from ``dispatcher.get_current_device()``:
    the name ``target_capability`` answers. If numba-cuda moves this, offline compiles break."""
    from numba.cuda import dispatcher

    source = inspect.getsource(dispatcher.CUDADispatcher.compile_device)
    assert "get_current_device().compute_capability" in source
    assert callable(dispatcher.get_current_device)


def test_target_capability_answers_and_restores():
    from numba.cuda import dispatcher

    before = dispatcher.get_current_device
    with target_capability((9, 0, "a")):
        assert dispatcher.get_current_device().compute_capability == (9, 0, "a")
    assert dispatcher.get_current_device is before
    with pytest.raises(ZeroDivisionError), target_capability((8, 0)):
        1 / 0  # noqa: B018
    assert dispatcher.get_current_device is before


def _kernel_calling(helper):
    def kernel(out, x):
        out[0] = helper(x[0])

    return kernel


@pytest.mark.parametrize("cc, approx", [((7, 0), False), ((8, 0), True)])
def test_device_function_is_typed_for_the_target(cc, approx):
    """The capability reaches the device function's own compile: a fastmath ``tanh`` lowers to
    ``tanh.approx.f32`` from sm_75 on and to libdevice below (a numba-cuda lowering choice), so
    its LLVM IR shows which capability it was compiled for. A fresh helper each time: a device
    function is compiled once per argument types."""
    @cuda.jit(device=True, forceinline=True, fastmath=True)
    def helper(x):
        return math.tanh(x)

    from numba.cuda.compiler import compile_all

    argtypes = (types.float32[::1], types.float32[::1])
    with target_capability(cc):
        # The kernel itself targets sm_80 (NVRTC refuses older); the helper sees ``cc``.
        compile_all(_kernel_calling(helper), argtypes, device=False, cc=(8, 0), output="ltoir", abi="numba")
    (cres,) = helper.overloads.values()
    assert ("tanh.approx.f32" in cres.library.get_llvm_str()) == approx


def test_forceinline_helpers_leave_no_call():
    """A chain of forceinline helpers (each calling the next) links into one function: no CALL
    in SASS, and the kernel compiles with no GPU for both families' targets."""
    from numbaflash.tools.inspect import report_from_cubin

    @cuda.jit(device=True, forceinline=True)
    def inner(x):
        return x * float32(2.0) + float32(1.0)

    @cuda.jit(device=True, forceinline=True)
    def outer(x):
        return inner(inner(x))

    argtypes = (types.float32[::1], types.float32[::1])
    for arch in ("sm_80", "sm_90a"):
        report = report_from_cubin(compile_cubin(_kernel_calling(outer), argtypes, arch), "k", arch)
        assert report.calls == 0 and report.spill_instructions == 0, report.opcodes


def test_slow_compile_logs_one_line(monkeypatch, caplog):
    # 0.1 s, not less: on a loaded 2-core CI machine starting the timer thread for "quick" once
    # took over 10 ms, and "quick" then logged its DEBUG line too
    monkeypatch.setattr(cache, "ANNOUNCE_AFTER_S", 0.1)
    import time

    with caplog.at_level(logging.DEBUG, logger="numbaflash"):
        with cache.announce_slow_compile("forward sm_90a f16 causal X"):
            time.sleep(0.5)
        with cache.announce_slow_compile("quick"):
            pass
    lines = [r for r in caplog.records if r.name == "numbaflash"]
    assert [r.levelno for r in lines] == [logging.INFO, logging.DEBUG], lines
    assert "compiling forward sm_90a f16 causal X" in lines[0].getMessage()
    assert "for next time" in lines[0].getMessage()
    assert "quick" not in caplog.text


def test_show_compile_progress_is_idempotent(capsys):
    log = logging.getLogger("numbaflash")
    saved = (list(log.handlers), log.level)
    try:
        cache.show_compile_progress()
        cache.show_compile_progress()
        assert sum(getattr(h, "_numbaflash_progress", False) for h in log.handlers) == 1
        assert log.getEffectiveLevel() <= logging.INFO
    finally:
        log.handlers[:], log.level = saved


def test_inspect_prints_a_line_per_kernel_as_it_goes(capsys):
    from numbaflash.tools import inspect as nfi

    assert nfi.main(["tile_gemm_f16", "--arch", "sm_80"]) == 0
    captured = capsys.readouterr()
    assert "[1/1] tile_gemm_f16 sm_80:" in captured.err and "registers" in captured.err
    assert "tile_gemm_f16" in captured.out  # the table


def test_main_job_without_gpu_inspects_what_its_call_dispatches():
    """``python -m numbaflash`` on a machine with no GPU: the forward kernel its own call
    dispatches on each family (not all 72), the tile GEMM demo, progress, and where to see more.
    Through the run's cache folder, so the shipped kernels are compiled at most once a run."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from numbaflash.configs import FAMILY_CAPABILITY, forward_config

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-m", "numbaflash"], env=env, capture_output=True, text=True,
                          timeout=600, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "No NVIDIA GPU found" in out and "python -m numbaflash.inspect" in out
    for family, cap in FAMILY_CAPABILITY.items():
        config = forward_config(cap, 128, False, seqlen=4096)  # the job's default call
        assert f"flash_forward_{family} for " in out and repr(config) in out
    table = [line for line in out.splitlines() if line.startswith(("flash_forward_", "tile_gemm_"))
             and " for " not in line]
    assert len(table) == 3, out
    for line in table:  # LDL, STL and CALL are the last three columns: all 0
        assert line.split()[-3:] == ["0", "0", "0"], line


def test_numba_names_the_compile_path_uses():
    """``compiler.numba_library`` calls what ``numba.cuda.compile`` calls, and ``helper_source``
    reads the library's linked files and LLVM IR: if numba-cuda renames these, this fails."""
    from numba.cuda import codegen
    from numba.cuda import compiler as numba_compiler

    source = inspect.getsource(numba_compiler.compile)
    assert "_compile_pyfunc_with_fixup(" in source and "lib.get_ltoir(cc=cc)" in source
    parameters = inspect.signature(numba_compiler._compile_pyfunc_with_fixup).parameters
    assert {"device", "cc", "abi", "launch_bounds", "lto"} <= set(parameters)
    library_source = inspect.getsource(codegen.CUDACodeLibrary)
    assert "self._linking_files = set()" in library_source and "def get_llvm_str(self)" in library_source


def test_declared_functions_and_wgmma_shapes():
    from numbaflash.runtime.compiler import declared_functions, wgmma_shapes

    ir = ('declare void @"wgmma_m64n128k16_f32_bf16_ss"(float* %".1", i64 %".2")\n'
          "declare void @wgmma_fence_operand_32(float*)\n"
          "declare i32 @llvm.nvvm.read.ptx.sreg.tid.x()\n"
          "define void @kernel() {\n  call void @wgmma_fence()\n  ret void\n}\n")
    names = declared_functions(ir)
    assert names == {"wgmma_m64n128k16_f32_bf16_ss", "wgmma_fence_operand_32"}
    assert wgmma_shapes(names | {"wgmma_fence", "mbarrier_wait"}) == [64, 128]


def _helpers_of(kernel, argtypes, arch):
    from numbaflash.runtime.compiler import helper_source, numba_library, parse_arch

    library = numba_library(kernel, argtypes, parse_arch(arch))
    library.get_ltoir(cc=parse_arch(arch))
    return helper_source(library)


def test_helper_source_holds_only_the_families_and_wgmma_shapes_called():
    """The helpers NVRTC compiles for a kernel: the families its device functions link, each
    under a ``#line`` naming its file, and of ``wgmma.cu`` only the shapes it calls."""
    from numbaflash.ptx import hopper as hp

    mma, fence = hp.wgmma_ss(64, "f16"), hp.wgmma_fence_operand(64)

    def kernel(acc, desc):
        fence(acc)
        mma(acc, desc[0], desc[1], 1)
        hp.wgmma_commit_group()

    argtypes = (types.float32[::1], types.uint64[::1])
    source = _helpers_of(kernel, argtypes, "sm_90a")
    assert source.split("#line")[0] == "#define WGMMA_SOME_N\n#define WGMMA_N64\n"
    assert [line for line in source.splitlines() if line.startswith("#line")] == ['#line 1 "wgmma.cu"']

    def plain(out, x):
        out[0] = x[0] + float32(1.0)

    assert _helpers_of(plain, (types.float32[::1], types.float32[::1]), "sm_80") == ""


def test_wgmma_kernel_compiles_with_its_shapes_only():
    """A kernel calling one wgmma shape links with only that shape compiled: no CALL, and the
    wgmma in its SASS."""
    from numbaflash.ptx import hopper as hp
    from numbaflash.tools.inspect import report_from_cubin

    mma, fence = hp.wgmma_ss(16, "bf16"), hp.wgmma_fence_operand(16)

    def kernel(out, desc):
        acc = cuda.local.array(8, float32)
        for i in range(8):
            acc[i] = 0.0
        hp.wgmma_fence()
        fence(acc)
        mma(acc, desc[0], desc[1], 1)
        hp.wgmma_commit_group()
        hp.wgmma_wait_group_0()
        fence(acc)
        for i in range(8):
            out[i] = acc[i]

    report = report_from_cubin(compile_cubin(kernel, (types.float32[::1], types.uint64[::1]), "sm_90a"),
                               "k", "sm_90a")
    assert report.calls == 0 and report.spill_instructions == 0
    assert any(op.startswith("HGMMA") for op in report.opcodes), report.opcodes


def test_a_macro_redefined_across_helper_families_is_an_error():
    """Helper families are compiled as one source: one file redefining another's macro stops
    the compile instead of changing a family's code unseen."""
    from numbaflash.runtime.compiler import helper_ltoir

    source = '#define TWICE 1\n#define TWICE 2\nextern "C" __device__ int twice() { return TWICE; }\n'
    with pytest.raises(RuntimeError, match="redefined across helper families"):
        helper_ltoir(source, "sm_80")


def test_other_nvrtc_messages_are_warnings():
    """Any other NVRTC message (a newer NVRTC's notes) is passed on as a warning, not an error: a
    toolchain upgrade never stops every compile."""
    from numbaflash.runtime.compiler import helper_ltoir

    source = 'extern "C" __device__ int unused_local() { int x; return 1; }\n'
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        code = helper_ltoir(source, "sm_80")
    assert code
    assert [w.category for w in seen] == [RuntimeWarning] and "never referenced" in str(seen[0].message)


def test_collector_paused_restores_the_collector():
    import gc

    from numbaflash.runtime.compiler import collector_paused

    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
        kept = [[]]  # a container the collector tracks, alive after the block
    assert gc.isenabled() and gc.get_freeze_count() == 0
    assert any(o is kept for o in gc.get_objects(generation=2))  # moved to the oldest generation
    assert not any(o is kept for o in gc.get_objects(generation=0))
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()  # left as it was
    finally:
        gc.enable()
    with pytest.raises(ZeroDivisionError), collector_paused():
        1 / 0  # noqa: B018
    assert gc.isenabled()


def test_scalar_operator_memo_answers_as_numba_does():
    """``compiler.scalar_operators_memoised``: an operator on scalars resolves to the signature
    and implementation key Numba's own resolution gives, the second time from the memo, and the
    wrapper is gone after the block. Pins the numba-core names it wraps."""
    import operator

    from numba.core.types.functions import BaseFunction
    from numba.cuda.descriptor import cuda_target

    from numbaflash.runtime import compiler

    parameters = list(inspect.signature(BaseFunction.get_call_type).parameters)
    assert parameters == ["self", "context", "args", "kws"]
    assert "self._impl_keys[sig.args]" in inspect.getsource(BaseFunction.get_call_type)
    context = cuda_target.typing_context
    context.refresh()  # the registries a first compile loads
    cases = [(operator.add, (types.int32, types.int64)), (operator.lt, (types.uint32, types.literal(16))),
             (operator.and_, (types.boolean, types.boolean)), (operator.mul, (types.float32, types.float32))]
    stock = []
    for op, args in cases:
        fnty = context.resolve_value_type(op)
        assert isinstance(fnty, BaseFunction)
        signature = fnty.get_call_type(context, args, {})
        stock.append((signature, fnty._impl_keys[signature.args]))
    original = BaseFunction.get_call_type
    with compiler.scalar_operators_memoised():
        assert BaseFunction.get_call_type is not original
        for _ in range(2):  # resolved, then remembered
            for (op, args), (signature, implementation) in zip(cases, stock, strict=True):
                fnty = context.resolve_value_type(op)
                fnty._impl_keys.pop(signature.args)
                assert fnty.get_call_type(context, args, {}) == signature
                assert fnty._impl_keys[signature.args] == implementation
    assert BaseFunction.get_call_type is original
    remembered = {key[0].typing_key for key in compiler._OPERATOR_SIGNATURES}
    assert {op for op, _ in cases} <= remembered
    assert all(impl in compiler._operator_functions() for _, impl in compiler._OPERATOR_SIGNATURES.values())


def test_kernel_compiles_the_same_with_the_operator_memo():
    """Mixed integer and float arithmetic compiles to the same cubin whether its operators are
    typed by Numba each time (a fresh process state: the memo emptied) or from the memo."""
    from numbaflash.runtime import compiler

    def make():
        @cuda.jit(device=True, forceinline=True)
        def step(x, i, n):
            j = (i * 3 + n) & 7
            return x * float32(j) + float32(i < n) - x / float32(2.0)

        def kernel(out, x, n):
            i = cuda.threadIdx.x
            v = x[i]
            for k in range(4):
                v = step(v, i + k, n)
            out[i] = v

        return kernel

    def sass(cubin):  # the instructions with their encodings (names differ: new functions)
        from numbaflash.tools.inspect import report_from_cubin

        lines = report_from_cubin(cubin, "k", "sm_80").sass.splitlines()
        return [line.split("*/", 1)[1] for line in lines if line.strip().startswith("/*0")]

    argtypes = (types.float32[::1], types.float32[::1], types.int64)
    compiler._OPERATOR_SIGNATURES.clear()
    first = sass(compile_cubin(make(), argtypes, "sm_80"))
    assert compiler._OPERATOR_SIGNATURES and len(first) > 20
    compiler._KERNEL_CUBINS.clear()  # compiled again, not the remembered cubin
    compiler._DEVICE_RESULTS.clear()
    again = sass(compile_cubin(make(), argtypes, "sm_80"))  # new functions, operators from the memo
    assert first == again


def _closures(scale, flag, offset=0.0):
    """A kernel factory: a device function ``step`` capturing ``scale`` and ``flag``, and a kernel
    calling it and adding ``offset`` (new functions at every call, as the package's factories
    build them)."""

    @cuda.jit(device=True, forceinline=True)
    def step(x):
        return x * scale + (float32(1.0) if flag else float32(0.0))

    def kernel(out, x):
        i = cuda.threadIdx.x
        out[i] = step(x[i]) + float32(offset)

    return kernel, step


def test_function_fingerprint_tells_equal_closures_apart_from_others():
    """``compiler.function_fingerprint``: equal for two closures of the same code over equal
    values; different where a value differs in type (1, 1.0, True), in sign (0.0, -0.0), in the
    function it calls, or in a global it reads."""
    from numbaflash.runtime.compiler import function_fingerprint

    same = [function_fingerprint(_closures(float32(2.0), True)[i]) for i in (0, 0)]
    assert same[0] == same[1]
    assert function_fingerprint(_closures(2, True)[1]) == function_fingerprint(_closures(2, True)[1])
    values = [1, 1.0, True, 0.0, -0.0, float32(2.0), float32(-2.0)]
    prints = {function_fingerprint(_closures(v, True)[1]) for v in values}
    assert len(prints) == len(values)
    assert function_fingerprint(_closures(1, True)[0]) != function_fingerprint(_closures(1, False)[0])
    namespaces = [{"k": 1}, {"k": 2}, {"k": 1}]
    for namespace in namespaces:
        exec("def f(x):\n    return x + k\n", namespace)  # noqa: S102 - the same code, its own globals
    found = [function_fingerprint(n["f"]) for n in namespaces]
    assert found[0] != found[1] and found[0] == found[2]


def test_device_functions_shared_types_an_equal_closure_once():
    """``compiler.device_functions_shared`` (inside ``compile_cubin``): the second of two kernels
    built from equal closures calls the first one's compiled device function (Numba's overload
    table holds the same result), a closure over another value is compiled on its own, and the
    machine code is what a compile without sharing gives. Pins the numba-cuda code it wraps."""
    from numba.cuda import dispatcher

    from numbaflash.runtime import compiler

    source = inspect.getsource(dispatcher.CUDADispatcher.compile_device)
    assert "if args not in self.overloads:" in source and "self.overloads[args] = cres" in source
    original = dispatcher.CUDADispatcher.compile_device
    argtypes = (types.float32[::1], types.float32[::1])
    built = [_closures(float32(3.0), flag, add) for flag, add in ((True, 0.0), (True, 1.0), (False, 0.0))]
    cubins = [compile_cubin(kernel, argtypes, "sm_80") for kernel, _ in built]
    assert dispatcher.CUDADispatcher.compile_device is original
    results = [step.overloads[(types.float32,)] for _, step in built]
    assert results[0] is results[1] and results[2] is not results[0]
    assert compile_cubin(_closures(float32(3.0), True)[0], argtypes, "sm_80") is cubins[0]  # remembered
    compiler._KERNEL_CUBINS.clear()
    compiler._DEVICE_RESULTS.clear()
    alone = compile_cubin(_closures(float32(3.0), True)[0], argtypes, "sm_80")
    compiler._KERNEL_CUBINS.clear()
    shared = compile_cubin(_closures(float32(3.0), True)[0], argtypes, "sm_80")
    assert alone is not shared and _sass_text(alone) == _sass_text(shared)


def _sass_text(cubin) -> list[str]:
    """The instructions of ``cubin`` with their encodings (the entry name differs between compiles)."""
    from numbaflash.tools.inspect import report_from_cubin

    lines = report_from_cubin(cubin, "k", "sm_80").sass.splitlines()
    return [line.split("*/", 1)[1] for line in lines if line.strip().startswith("/*0")]


def test_module_texts_gives_each_module_once():
    """``compiler.module_texts``: of a kernel whose device functions reach one function by two
    paths, the LLVM IR of every module Numba lists, each once, the kernel's first; and the same
    text as Numba prints. Pins the numba-cuda code it stands in for."""
    from numba.cuda import codegen

    from numbaflash.runtime.compiler import module_texts, numba_library, parse_arch

    assert "return [self._module] + [" in inspect.getsource(codegen.CUDACodeLibrary.modules.fget)
    assert "self._llvm_strs = [str(mod) for mod in self.modules]" in inspect.getsource(
        codegen.CUDACodeLibrary.llvm_strs.fget)
    assert "irs = self.llvm_strs" in inspect.getsource(codegen.CUDACodeLibrary.get_ltoir)

    @cuda.jit(device=True, forceinline=True)
    def shared(x):
        return x * float32(2.0)

    @cuda.jit(device=True, forceinline=True)
    def left(x):
        return shared(x) + float32(1.0)

    @cuda.jit(device=True, forceinline=True)
    def right(x):
        return shared(x) - float32(1.0)

    def kernel(out, x):
        i = cuda.threadIdx.x
        out[i] = left(x[i]) * right(x[i])

    library = numba_library(kernel, (types.float32[::1], types.float32[::1]), parse_arch("sm_80"))
    numba_texts = [str(m) for m in library.modules]
    texts = module_texts(library)
    assert len(numba_texts) > len(texts) == len(set(texts)) == 4
    assert set(texts) == set(numba_texts) and texts[0] == numba_texts[0]
    assert module_texts(library) == texts  # the linked modules' text remembered


def test_variables_listed_fast_lists_as_numba_does():
    """``compiler.variables_listed_fast``: every statement of a function's Numba IR (calls,
    tuples, slices, a branch, a loop, a raise; ``ir.Del`` statements too) lists the same
    variables, the same objects in the same order, as Numba's own ``Inst._rec_list_vars``, and
    that is back after the block. Pins the numba-cuda code it stands in for."""
    from numba.cuda.compiler import run_frontend
    from numba.cuda.core import ir

    from numbaflash.runtime import compiler

    source = inspect.getsource(ir.Inst._rec_list_vars)
    for test in ("isinstance(val, var_types)", "isinstance(val, inst_types)", "val.list_vars()",
                 "isinstance(val, (list, tuple))", "isinstance(val, dict)", "val.values()"):
        assert test in source
    assert "self._rec_list_vars(self.__dict__)" in inspect.getsource(ir.Stmt.list_vars)
    assert "self._rec_list_vars(self._kws)" in inspect.getsource(ir.Expr.list_vars)

    def function(a, b, n):
        total = (a[0], b[1:n])
        for i in range(n):
            if a[i] > b[i]:
                total = (total[0] + a[i] * b[i], total[1])
            else:
                b[i] = min(a[i], b[i], key=None)
        if n < 0:
            raise ValueError("n", n)
        return total

    statements = [stmt for block in run_frontend(function, emit_dels=True).blocks.values()
                  for stmt in block.body]
    assert any(isinstance(stmt, ir.Del) for stmt in statements)
    stock = [stmt.list_vars() for stmt in statements]
    assert sum(map(len, stock)) > 40
    original = ir.Inst._rec_list_vars
    with compiler.variables_listed_fast():
        assert ir.Inst._rec_list_vars is not original
        fast = [stmt.list_vars() for stmt in statements]
    assert ir.Inst._rec_list_vars is original
    for numba_vars, listed in zip(stock, fast, strict=True):
        assert len(numba_vars) == len(listed)
        assert all(x is y for x, y in zip(numba_vars, listed, strict=True))


def test_cuda_paths_found_early_once_and_remembered():
    """``compiler.cuda_paths_found_early``: one thread per process, which fills the caches that
    NVVM's libdevice and NVRTC's include path read (pinned: numba-cuda's ``get_cuda_paths``
    remembers its answer, and ``nvrtc.compile`` asks for the CCCL headers)."""
    from numba.cuda import cuda_paths
    from numba.cuda.cudadrv import nvrtc

    from numbaflash.runtime import compiler

    assert "get_cuda_paths._cached_result" in inspect.getsource(cuda_paths.get_cuda_paths)
    assert 'locate_nvidia_header_directory("cccl")' in inspect.getsource(nvrtc.compile)
    thread = compiler.cuda_paths_found_early()
    assert compiler.cuda_paths_found_early() is thread
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert hasattr(cuda_paths.get_cuda_paths, "_cached_result")
