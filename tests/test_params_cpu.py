"""Each kernel's parameters are declared once (``kernels.params``): the launcher's types (the
ABI), the Numba argument types and the kernel function's own parameter names all come from the
declaration, for every registered kernel (``tools.registry``)."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from numbaflash.kernels import abi, params
from numbaflash.kernels.families import kernel_abi, kernel_argtypes, kernel_params

pytest.importorskip("numba")


@pytest.fixture(scope="module")
def registered():
    from numbaflash.tools.registry import registered_kernels

    return registered_kernels()


def test_every_registered_kernel_agrees_with_its_declaration(registered):
    checked = 0
    for name, (kernel, argtypes, _) in registered.items():
        spec = getattr(kernel, "spec", None)
        if spec is None:  # the demos (tile GEMM, wgmma / TMA probes): no declared list
            continue
        declared = kernel_params(spec)
        assert kernel_abi(spec) == params.types_of(declared) == tuple(str(t) for t in argtypes), name
        assert len(argtypes) == len(declared) == len(kernel_argtypes(spec)), name
        function = getattr(kernel, "py_func", kernel)
        assert tuple(inspect.signature(function).parameters) == params.names_of(declared), name
        checked += 1
    assert 800 < checked <= len(registered) <= 907  # issue 54's cap
    assert not any(getattr(kernel, "spec", None) and (kernel.spec.sink or kernel.spec.group_split)
                   for kernel, _, _ in registered.values())


def test_every_sink_build_agrees_with_its_declaration():
    """The learnable-sink builds of the forward kernels (built on demand, not registered): the
    declaration (the plain build's, then ``params.SINK``) is the kernel's parameter list."""
    from numbaflash.tools.registry import forward_sink_kernels

    sinks = forward_sink_kernels()
    for name, (kernel, argtypes, _) in sinks.items():
        declared = kernel_params(kernel.spec)
        assert kernel.spec.sink and declared[-1] == params.SINK[0] and "_sink_" in name, name
        assert kernel_abi(kernel.spec) == tuple(str(t) for t in argtypes), name
        function = getattr(kernel, "py_func", kernel)
        assert tuple(inspect.signature(function).parameters) == params.names_of(declared), name
    assert {k.spec.family for k, _, _ in sinks.values()} == {"sm80", "sm90"}
    assert any(k.spec.varlen for k, _, _ in sinks.values())


def test_every_fp8_build_agrees_with_its_declaration():
    """The e4m3 forward builds (on demand, not registered), Hopper's and the mma.sync one's: their
    16-bit kernel's parameters (packed: the varlen kernel's), then the descales
    (``params.DESCALES``); with a sink, the sink's logits after them. The V preps, dense and packed,
    have their own lists."""
    import dataclasses

    from numbaflash.tools.registry import _built, forward_fp8_kernels

    fp8 = forward_fp8_kernels()
    assert len(fp8) == 36  # per head dim: 2 preps, 4 dense and 2 packed Hopper builds, 4 mma.sync ones
    assert sum(k.spec.varlen for k, _, _ in fp8.values()) == 9
    assert sum(k.spec.family == "sm80" for k, _, _ in fp8.values()) == 12
    for name, (kernel, argtypes, _) in fp8.items():
        if kernel.spec.operation == "fp8_v":  # the V prep: its own parameter list
            want = params.FP8_V_VARLEN if kernel.spec.varlen else params.FP8_V
            assert kernel_params(kernel.spec) == want and "fp8_transpose_v" in name, name
            assert kernel_abi(kernel.spec) == tuple(str(t) for t in argtypes), name
            continue
        for spec in (kernel.spec, dataclasses.replace(kernel.spec, sink=True)):
            built, types = _built(spec) if spec.sink else (kernel, argtypes)
            declared = kernel_params(spec)
            assert spec.config.fp8 and "_e4m3_" in name, name
            if spec.family == "sm80":
                base = params.FORWARD
            else:
                base = params.VARLEN_WS_FORWARD if spec.varlen else params.WS_FORWARD
            assert declared[:len(base)] == base
            assert declared[len(base):] == params.DESCALES + (params.SINK if spec.sink else ())
            assert kernel_abi(spec) == tuple(str(t) for t in types), name
            function = getattr(built, "py_func", built)
            assert tuple(inspect.signature(function).parameters) == params.names_of(declared), name


def test_every_gqa_split_build_agrees_with_its_declaration():
    """The Hopper backward's GQA-split builds (built on demand, not registered): the declaration is
    the kernel's parameter list, and each is the split build of a registered main kernel."""
    from numbaflash.tools.registry import backward_split_kernels, registered_kernels

    splits = backward_split_kernels()
    plain = {kernel.spec for kernel, _, _ in registered_kernels().values() if hasattr(kernel, "spec")}
    assert len(splits) == 8
    for name, (kernel, argtypes, _) in splits.items():
        spec = kernel.spec
        assert spec.group_split and "_split_" in name and spec.operation == "backward", name
        assert kernel_abi(spec) == tuple(str(t) for t in argtypes), name
        function = getattr(kernel, "py_func", kernel)
        assert tuple(inspect.signature(function).parameters) == params.names_of(kernel_params(spec)), name
        assert dataclasses.replace(spec, group_split=False) in plain, name


def test_each_declaration_parses_into_its_numba_types():
    from numba import types

    assert params.numba_types(params.params((params.U16_ARRAY, "q"), (params.BOOL, "write_lse"),
                                            (params.I32, "seqlen_q"), (params.F32, "scale"))) == (
        types.uint16[::1], types.boolean, types.int32, types.float32)
    for declared in (params.FORWARD, params.VARLEN_WS_FORWARD, params.BACKWARD, params.WS_BACKWARD,
                     params.DECODE_VARIANT, params.DECODE_COMBINE):
        assert tuple(str(t) for t in params.numba_types(declared)) == params.types_of(declared)
        assert len(set(params.names_of(declared))) == len(declared)  # no name twice


def test_the_abi_tuples_are_derived():
    assert abi.FORWARD_ABI == params.types_of(params.FORWARD)
    assert abi.VARLEN_BACKWARD_ABI == params.types_of(params.BACKWARD + params.SEQUENCES)
    assert abi.DECODE_VARIANT_ABI == (*abi.DECODE_ABI, "int64", "int64", "float32")


def test_ordered_puts_named_values_in_declared_order_and_refuses_missing_or_extra_names():
    declared = params.params((params.U16_ARRAY, "q k"), (params.I64, "seqlen_q"))
    assert params.ordered(declared, seqlen_q=3, k=2, q=1) == (1, 2, 3)
    with pytest.raises(TypeError, match=r"missing \['k'\], unknown \[\]"):
        params.ordered(declared, q=1, seqlen_q=3)
    with pytest.raises(TypeError, match=r"missing \[\], unknown \['seqlen_k'\]"):
        params.ordered(declared, q=1, k=2, seqlen_q=3, seqlen_k=4)
    with pytest.raises(TypeError, match=r"missing \['seqlen_q'\], unknown \['seqlen_k'\]"):
        params.ordered(declared, q=1, k=2, seqlen_k=4)


def _backward_call(varlen: bool):
    """A backward call whose every argument is distinct: operands with their own pointers and
    strides, workspace parts, the LSE and the scalars."""
    import numpy as np

    from numbaflash.operands import Operand
    from numbaflash.operations.launch_backward import BackwardCall, Workspace

    batch = 1 if varlen else 2
    shapes = {"do": (batch, 256, 4, 64), "q": (batch, 256, 4, 64), "k": (batch, 300, 2, 64),
              "v": (batch, 300, 2, 64), "o": (batch, 256, 4, 64), "dq": (batch, 256, 4, 64),
              "dk": (batch, 300, 2, 64), "dv": (batch, 300, 2, 64)}
    ops = {name: Operand(name, shape, "float16", True, None, (100 * i + 1, 100 * i + 2, 100 * i + 3, 1),
                         1000 * (i + 1))
           for i, (name, shape) in enumerate(shapes.items())}
    workspace = Workspace((11, 1), (12, 2), (13, 3), (14, 4))
    call = BackwardCall(ops["do"], ops["q"], ops["k"], ops["v"], ops["o"], ops["dq"], ops["dk"], ops["dv"],
                        (15, 5), workspace, 512, np.float32(1.5), np.float32(0.25), True, 0, 0, 7, 8,
                        np.float32(0.5))
    return call, ops


def _named(ops, *names):
    """Each operand as (pointer, elements) and its three strides, by parameter name."""
    values = {}
    for name in names:
        op = ops[name]
        values[name] = (op.pointer, op.span)
        values.update(zip((f"{name}_sb", f"{name}_ss", f"{name}_sh"), op.strides[:3], strict=True))
    return values


@pytest.mark.parametrize("varlen", [False, True])
def test_the_backward_launches_pass_their_arguments_in_declared_order(varlen):
    """The backward's launches call the launcher each call with positional arguments (no bind: no
    cost a call for naming them); here every argument is named and put in the declared order."""
    import types

    from numbaflash.kernels.shapes import BackwardConfig
    from numbaflash.operations import launch_backward as lb

    config = BackwardConfig(64)
    call, ops = _backward_call(varlen)
    ws = call.workspace
    recorded = []

    def launcher(grid, block, stream, shared, *args):
        recorded.append(args)

    gpu = types.SimpleNamespace(sm_count=lambda device: 132)
    extra, scalars, seqlen_k = {}, {"seqlen_q": 256, "rows": call.rows, "heads_q": 4}, 300
    if varlen:  # the maxima differ from the packed totals
        cu_q, cu_k = (21, 3), (22, 3)
        extra = {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "total_q": 256}
        scalars["seqlen_q"], seqlen_k = 200, 280
        vcall = lb.VarlenBackwardCall(call, cu_q, cu_k, 2, 200, 280)
        for launch in (lb.launch_varlen_backward_prep, lb.launch_varlen_backward_main,
                       lb.launch_varlen_backward_dq):
            launch(config)(launcher, vcall, gpu)
        declared = (params.VARLEN_BACKWARD_PREP, params.VARLEN_BACKWARD, params.VARLEN_BACKWARD_DQ)
    else:
        for launch in (lb.launch_backward_prep, lb.launch_backward_main, lb.launch_backward_dq):
            launch(config)(launcher, call, gpu)
        declared = (params.BACKWARD_PREP, params.BACKWARD, params.BACKWARD_DQ)
    key_blocks = -(-seqlen_k // config.block_n)
    prep = params.ordered(declared[0], **_named(ops, "o", "do"), lse=call.lse, delta=ws.delta,
                          lse2=ws.lse_log2, dq_acc=ws.dq_accum, counters=ws.counters, **scalars,
                          counters_per_head=call.rows // config.block_m, **extra)
    main = params.ordered(declared[1], **_named(ops, "q", "k", "v", "do", "dk", "dv"), lse2=ws.lse_log2,
                          delta=ws.delta, dq_acc=ws.dq_accum, counters=ws.counters, **scalars,
                          seqlen_k=seqlen_k, group=2, heads_kv=2,
                          tail_pairs=lb.backward_tail_pairs(key_blocks, 2 * 2, 132),
                          scale_log2=call.scale_log2, scale=call.scale, deterministic=True, window_left=7,
                          window_right=8, cap_scale=call.cap_scale, **extra)
    dq = params.ordered(declared[2], dq_acc=ws.dq_accum, **_named(ops, "dq"), **scalars, scale=call.scale,
                        **extra)
    assert recorded == [prep, main, dq]


@pytest.mark.parametrize("block_m, seqlen_q", [(64, 256), (64, 255), (80, 77), (80, 256), (128, 1)])
def test_the_dq_launch_covers_the_query_blocks_only(block_m, seqlen_q):
    """The dQ kernel's grid is one CTA per query block of the sequence, not per ``block_m`` rows of
    the workspace: at block_m 80 the workspace's rows align to 640, and a CTA past the last query
    block read accumulator rows nothing had written (initcheck, notebook ICTMA) to store nothing."""
    import types

    from numbaflash.kernels.shapes import BackwardConfig
    from numbaflash.operations import launch_backward as lb

    call, ops = _backward_call(False)
    ops["q"].shape = (2, seqlen_q, 4, 64)
    call = call._replace(rows=lb.backward_rows(seqlen_q, block_m))
    config = types.SimpleNamespace(block_m=block_m, threads=BackwardConfig(64).threads)
    grids = []
    lb.launch_backward_dq(config)(lambda grid, *rest: grids.append(grid), call,
                                  types.SimpleNamespace(sm_count=lambda device: 132))
    assert grids == [(-(-seqlen_q // block_m), 4, 2)]
    assert grids[0][0] * block_m <= call.rows  # within the workspace's rows
