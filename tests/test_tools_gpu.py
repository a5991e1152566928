"""The tools on a GPU: the debug tool on numbaflash (both dtypes, output poisoned), the
bench tool's sanity mode, and that a call on device arrays returns without waiting for the
device (what keeps the bench tool's plain loop in line with its event timing)."""

from __future__ import annotations

import time

import pytest

from numbaflash.tools import bench, debug


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
def test_debug_tool_on_numbaflash_checks_every_element(dtype, causal):
    impl = debug.NumbaflashImpl()
    r = debug.run_debug(impl, batch=1, heads=2, seqlen_q=130, seqlen_k=200, head_dim=64, causal=causal,
                        dtype=dtype, kv_sweep=True)
    assert r.poisoned and impl.note is None, "the output must be poisoned before launch"
    assert r.n_unwritten == 0 and r.n_nan == 0 and r.ok, debug.format_report(r)
    assert len(r.kv_sweep) >= 2 and all(bad == 0 for _, _, bad in r.kv_sweep)


def _torch_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    return torch


@pytest.mark.gpu
@pytest.mark.timing  # a host wall-clock bound: among busy xdist workers a call can miss it
@pytest.mark.parametrize("return_lse", [False, True])
def test_call_returns_while_device_is_busy(return_lse):
    """Queued behind a ~0.1 s sleep kernel, 40 calls must each return in well under that time:
    no call may wait for the device (an allocation freed with cuMemFree would)."""
    import numbaflash

    torch = _torch_cuda()
    q, k, v = (torch.randn(1, 256, 2, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    out = torch.empty_like(q)
    for _ in range(3):
        numbaflash.flash_attention(q, k, v, out=out, return_lse=return_lse)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)
    host_ms = []
    for _ in range(40):
        t0 = time.perf_counter()
        numbaflash.flash_attention(q, k, v, out=out, return_lse=return_lse)
        host_ms.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    assert max(host_ms) < 20, f"a call waited for the device: host ms per call {sorted(host_ms)[-3:]}"


@pytest.mark.gpu
def test_bench_sanity_mode_runs(capsys):
    status = bench.main(["--seqlens", "512", "--head-dims", "64", "--causal", "no", "--repeats", "5",
                         "--warmup", "2", "--backends", "numbaflash", "--sanity", "--no-progress"])
    text = capsys.readouterr().out
    assert "## Timing sanity" in text and "plain/mean" in text and "numbaflash" in text
    assert status in (0, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_bench_numba_path_without_torch(dtype):
    """The bench tool with no PyTorch: inputs as DeviceBuffers (bf16 included), Numba events."""
    import numpy as np

    import numbaflash
    from numbaflash.tools.reference import attention_reference

    if dtype == "bf16":
        pytest.importorskip("ml_dtypes")
    device = bench.Device(None)
    shape = bench.Shape(2, 4, 200, 200, 64, False, dtype)
    sets = device.make_inputs(shape, 2, seed=0)
    args = bench.parse_args(["--repeats", "3", "--warmup", "1", "--warmup-ms", "0"])
    result = bench.run_one(device, "numbaflash", shape, sets, args)
    assert result.ok and result.tflops > 0, result.error
    q, k, v, out = sets[0]
    numbaflash.flash_attention(q, k, v, out=out)
    ref, _ = attention_reference(q.copy_to_host(), k.copy_to_host(), v.copy_to_host())
    err = np.abs(out.copy_to_host().astype(np.float64) - ref).max()
    assert err < (4e-3 if dtype == "fp16" else 3e-2)
