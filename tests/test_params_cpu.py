"""Each kernel's parameters are declared once (``kernels.params``): the launcher's types (the
ABI), the Numba argument types and the kernel function's own parameter names all come from the
declaration, for every registered kernel (``tools.registry``)."""

from __future__ import annotations

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
    assert 800 < checked <= len(registered) <= 907


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
