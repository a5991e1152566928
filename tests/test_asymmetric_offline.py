"""V's head dim apart from Q's and K's (issue 56 item 2): the (192, 128) forward kernels (mma.sync on
sm_80 and sm_90a, the Hopper kernel on sm_90a) and backward kernels compiled offline, with no local
memory, no calls and the tensor-core work of their tiles."""

from __future__ import annotations

import pytest

from numbaflash import configs


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_the_kernel_compiles_with_no_local_memory_or_calls(arch, tmp_path, monkeypatch):
    pytest.importorskip("numba")
    from numbaflash.kernels.families import make_kernel
    from numbaflash.kernels.spec import kernel_spec
    from numbaflash.tools.inspect import report_from_cubin

    monkeypatch.setenv("NUMBAFLASH_CACHE_DIR", str(tmp_path))
    config = configs.forward_config((8, 0), 192, True, head_dim_v=128)
    assert config == configs.ASYMMETRIC_DEFAULTS[(192, 128)]
    spec = kernel_spec("sm80", "forward", config, "bfloat16", arch, causal=True)
    assert make_kernel(spec).__name__ == "flash_forward_d192v128_m128x1_n64_db_ek_causal_bf16"
    entry = configs.kernel_cubin(spec)
    report = report_from_cubin(entry.cubin, entry.entry_name, arch)
    assert report.spill_instructions == 0 and report.calls == 0 and report.local_bytes == 0, report
    assert report.count("HMMA") == 160  # a warp's tile: 8 n-tiles x 12 k-tiles of S, 16 x 4 of O


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_the_backward_kernels_compile_with_no_local_memory_or_calls(arch, tmp_path, monkeypatch):
    pytest.importorskip("numba")
    from numbaflash.kernels.families import make_kernel
    from numbaflash.kernels.spec import kernel_spec
    from numbaflash.tools.inspect import report_from_cubin

    monkeypatch.setenv("NUMBAFLASH_CACHE_DIR", str(tmp_path))
    capability = (8, 0) if arch == "sm_80" else (9, 0)
    # on Hopper the mma.sync kernels run packed calls (dense ones: the Hopper backward's, below)
    config = configs.backward_config(capability, 192, True, head_dim_v=128, varlen=arch == "sm_90a")
    main = kernel_spec("sm80bwd", "backward", config, "bfloat16", arch, causal=True)
    names = []
    for spec in (main, main.sibling("backward_prep"), main.sibling("backward_dq")):
        names.append(make_kernel(spec).__name__)
        entry = configs.kernel_cubin(spec)
        report = report_from_cubin(entry.cubin, entry.entry_name, arch)
        assert report.spill_instructions == 0 and report.calls == 0 and report.local_bytes == 0, report
    vector = "_v4" if arch == "sm_90a" else ""
    assert names == [f"flash_backward_d192v128_m64_n64_w8{vector}_causal_bf16",
                     "flash_backward_prep_d192v128_m64_bf16", f"flash_backward_dq_d192_m64_w8{vector}_bf16"]


@pytest.mark.parametrize(("causal", "window", "softcap"), [(True, False, False), (False, True, True)])
def test_the_hopper_backward_compiles_with_no_local_memory_or_calls(causal, window, softcap, tmp_path,
                                                                  monkeypatch):
    """The pair's Hopper backward (``kernels.backward_ws_rows``, what an H100 or H200 dispatches for
    dense calls): two consumer warpgroups in 240 registers each with nothing spilled, its GEMMs'
    k-steps (S 12 and dP 8 of m64n48, dQ 6 of m64n96 (K in 64-byte rows), dKᵀ 12 and dVᵀ 8 of m64n48),
    dQ's bulk reduce, and the prepare and dQ kernels the mma.sync config's on sm_90a."""
    pytest.importorskip("numba")
    from numbaflash.kernels.families import make_kernel
    from numbaflash.kernels.spec import kernel_spec
    from numbaflash.tools.inspect import report_from_cubin

    monkeypatch.setenv("NUMBAFLASH_CACHE_DIR", str(tmp_path))
    config = configs.backward_config((9, 0), 192, causal, window=window, softcap=softcap, head_dim_v=128)
    assert config == configs.ASYMMETRIC_BACKWARD_WS[(192, 128)] and not config.swapped
    main = kernel_spec("sm90bwd", "backward", config, "bfloat16", "sm_90a", causal=causal, window=window,
                       softcap=softcap)
    kind = "window_softcap" if window else "causal"
    assert make_kernel(main).__name__ == f"flash_backward_ws_d192_m64_n96_s2_v128_{kind}_bf16"
    entry = configs.kernel_cubin(main)
    report = report_from_cubin(entry.cubin, entry.entry_name, "sm_90a")
    assert report.spill_instructions == 0 and report.calls == 0 and report.local_bytes == 0, report
    assert report.count("HGMMA") == 12 + 8 + 6 + 12 + 8
    assert report.count("UBLKRED") == 2  # dQ's bulk reduce: in turn (deterministic) or not
    assert [make_kernel(main.sibling(op)).__name__ for op in ("backward_prep", "backward_dq")] == [
        "flash_backward_prep_d192v128_m64_bf16", "flash_backward_dq_d192_m64_w8_v4_bf16"]


@pytest.mark.parametrize(("causal", "varlen"), [(True, False), (False, True)])
def test_the_hopper_kernel_compiles_with_no_local_memory_or_calls(causal, varlen, tmp_path, monkeypatch):
    """The pair's Hopper forward (what an H100 or H200 dispatches): d128's registers (the entry's
    168; setmaxnreg moves them), nothing spilled, and S's GEMM three column blocks deep."""
    pytest.importorskip("numba")
    from numbaflash.kernels.families import make_kernel
    from numbaflash.kernels.spec import kernel_spec
    from numbaflash.tools.inspect import report_from_cubin

    monkeypatch.setenv("NUMBAFLASH_CACHE_DIR", str(tmp_path))
    config = configs.forward_config((9, 0), 192, causal, head_dim_v=128, varlen=varlen)
    assert config == configs.ASYMMETRIC_WS_DEFAULTS[(192, 128)]
    spec = kernel_spec("sm90", "forward", config, "bfloat16", "sm_90a", causal=causal, varlen=varlen)
    kind = ("varlen_" if varlen else "") + ("causal" if causal else "full")
    assert make_kernel(spec).__name__ == f"flash_forward_ws_d192v128_m128_n128_s2_ov_{kind}_bf16"
    entry = configs.kernel_cubin(spec)
    report = report_from_cubin(entry.cubin, entry.entry_name, "sm_90a")
    assert report.spill_instructions == 0 and report.calls == 0 and report.local_bytes == 0, report
    assert report.registers == 168 and report.count("HGMMA") > 0


def test_the_decode_kernel_compiles_with_no_local_memory_or_calls(tmp_path, monkeypatch):
    """The pair's decode kernel (K tiles 192 columns, V and O 128) and its combine kernel (O's 128
    columns), sm_80, paged with every cache option and a rotary embedding."""
    pytest.importorskip("numba")
    from numbaflash.kernels.families import make_kernel
    from numbaflash.kernels.spec import kernel_spec
    from numbaflash.tools.inspect import report_from_cubin

    monkeypatch.setenv("NUMBAFLASH_CACHE_DIR", str(tmp_path))
    config = configs.decode_config((8, 0), 192, 4, True, head_dim_v=128)
    main = kernel_spec("sm80dec", "decode", config, "bfloat16", "sm_80", causal=True, sink=True,
                       batch_idx=True, leftpad=True, rotary=1)
    names = []
    for spec in (main, main.sibling("decode_combine")):
        names.append(make_kernel(spec).__name__)
        entry = configs.kernel_cubin(spec)
        report = report_from_cubin(entry.cubin, entry.entry_name, "sm_80")
        assert report.spill_instructions == 0 and report.calls == 0 and report.local_bytes == 0, report
    stages = config.stages
    assert names == [f"flash_decode_d192v128_m16_n64_w4_s{stages}_paged_causal_bf16_sink_bidx_lpad_rope",
                     "flash_decode_combine_d128_bf16"]
