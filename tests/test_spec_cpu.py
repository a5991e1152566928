"""The kernel spec (``kernels.spec``) and the family registry (``kernels.families``): one
normalised record per kernel, one factory per (family, operation), no Numba at import."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from numbaflash import configs
from numbaflash.kernels import families
from numbaflash.kernels.shapes import (
    BackwardConfig,
    DecodeConfig,
    ForwardConfig,
    MlaDecodeConfig,
    WsBackwardConfig,
    WsConfig,
    WsMlaConfig,
)
from numbaflash.kernels.spec import AXES, CAUSAL_FREE, kernel_spec

CONFIGS = [ForwardConfig(64), WsConfig(128), BackwardConfig(64), WsBackwardConfig(128, block_m=64),
           DecodeConfig(128), MlaDecodeConfig(), WsMlaConfig()]


def test_a_spec_is_immutable_hashable_and_equal_by_value():
    a = kernel_spec("sm80", "forward", ForwardConfig(64), "bfloat16", "sm_80", causal=True)
    b = kernel_spec("sm80", "forward", ForwardConfig(64), "bfloat16", "sm_80", causal=True)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a.bf16 and not dataclasses.replace(a, dtype="float16").bf16
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.causal = False
    for axis in (*AXES, "causal"):
        assert dataclasses.replace(a, **{axis: not getattr(a, axis)}) != a
    assert a.on("sm_90a") != a and a.on("sm_90a").arch == "sm_90a"
    with pytest.raises(ValueError, match="dtype must be one of"):
        kernel_spec("sm80", "forward", ForwardConfig(64), "f16")


def test_normalisation_happens_once_when_built():
    config = BackwardConfig(64)
    window = kernel_spec("sm80bwd", "backward", config, causal=True, window=True)
    assert not window.causal  # a window kernel is built non-causal
    for operation in CAUSAL_FREE - {"decode_combine", "fp8_v"}:
        spec = kernel_spec("sm80bwd", operation, config, causal=True, window=True, softcap=True, varlen=True)
        assert (spec.causal, spec.window, spec.softcap, spec.varlen) == (False, False, False, True)
        assert window.sibling(operation) == kernel_spec("sm80bwd", operation, config, varlen=False)
    paged = DecodeConfig(128, paged=True)
    decode = kernel_spec("sm80dec", "decode", paged, causal=True, softcap=True)
    assert decode.paged and decode.causal
    assert decode.sibling("decode_combine") == kernel_spec("sm80dec", "decode_combine", paged)
    assert not decode.sibling("decode_combine").paged  # one combine kernel serves paged calls too
    fp8 = WsConfig(128, fp8=True)  # the e4m3 forward's V prep: one kernel per config and layout
    prep = kernel_spec("sm90", "fp8_v", fp8, "bfloat16", causal=True, window=True, softcap=True, sink=True)
    assert prep == kernel_spec("sm90", "fp8_v", fp8) and prep.dtype == "float16" and not prep.varlen
    packed = kernel_spec("sm90", "fp8_v", fp8, "bfloat16", causal=True, varlen=True, sink=True)
    assert packed == kernel_spec("sm90", "fp8_v", fp8, varlen=True) and packed != prep


def test_kind_names_every_set_axis():
    spec = kernel_spec("sm80", "forward", ForwardConfig(64), window=True, softcap=True, varlen=True)
    assert spec.kind == "sm80.forward+window+softcap+varlen"
    assert kernel_spec("sm90", "forward", WsConfig(128)).kind == "sm90.forward"


def test_every_family_operation_has_a_factory_and_nothing_else():
    pairs = {(f.name, op) for f in families.FAMILIES.values() for op in f.operations}
    assert pairs == set(families.FACTORIES)
    assert len(families.FACTORIES) == 16  # the sm80 family's fp8_v: the e4m3 mma.sync forward's V prep
    for config in CONFIGS:
        family = families.family_of(config)
        for operation in family.operations:
            spec = families.spec_of(config, operation)
            assert spec.family == family.name and spec.arch == family.arch
            assert families.kernel_abi(spec)  # a parameter list for the launcher
    with pytest.raises(NotImplementedError, match="no sm90bwd.backward.varlen kernel"):
        families.make_kernel(kernel_spec("sm90bwd", "backward", WsBackwardConfig(128, block_m=64),
                                         varlen=True))
    with pytest.raises(TypeError, match="no kernel family takes a int"):
        families.family_of(3)


def test_the_spec_keys_the_cache():
    from numbaflash.runtime import cache

    a = families.spec_of(ForwardConfig(64), causal=True)
    keys = {cache.kernel_key(s, sources="s", versions={}) for s in
            (a, a.on("sm_86"), dataclasses.replace(a, window=True), dataclasses.replace(a, dtype="bfloat16"))}
    assert len(keys) == 4
    assert cache.kernel_key(a, sources="s", versions={}) == cache.kernel_key(
        families.spec_of(ForwardConfig(64), causal=True), sources="s", versions={})


def test_configs_and_the_kernel_records_import_no_numba_and_no_operations():
    """``configs`` (tables, dispatch, compile) and the kernel records sit below ``operations``: no
    import of it (no circle configs -> operations -> ... -> configs), and no Numba at import."""
    import ast
    import pathlib

    root = pathlib.Path(configs.__file__).parent
    for path in (root / "configs.py", root / "kernels" / "families.py", root / "kernels" / "spec.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.col_offset == 0:  # module-level imports
                assert "operations" not in (node.module or ""), (path.name, node.module)
                assert not (node.module or "").startswith("numba"), (path.name, node.module)
    code = ("import sys, numbaflash.configs, numbaflash.kernels.families; "
            "print(sorted(m for m in sys.modules if m == 'numba' or m.startswith('numba.')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
    assert configs.FAMILY_ARCH == {name: f.arch for name, f in families.FAMILIES.items()}


def test_a_spec_pickles_into_another_process_with_its_own_hash():
    """``precompile`` hands specs to worker processes, whose string hashes differ: the cached hash
    is computed again there."""
    import pickle

    spec = kernel_spec("sm80", "forward", ForwardConfig(64), "bfloat16", "sm_80", causal=True, softcap=True)
    assert pickle.loads(pickle.dumps(spec)) == spec
    code = ("import pickle, sys; s = pickle.loads(sys.stdin.buffer.read()); "
            "print(s.softcap, hash(s) == hash((s.family, s.operation, s.config, s.dtype, s.arch, s.causal, "
            "s.window, s.softcap, s.varlen, s.paged, s.sink, s.batch_idx, s.leftpad, s.rotary, "
            "s.group_split)))")
    done = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(spec), capture_output=True,
                          check=True)
    assert done.stdout.split() == [b"True", b"True"]
