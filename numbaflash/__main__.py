"""The main job: ``python -m numbaflash``.

With a GPU: attention on random numpy inputs of a realistic size, checked against the
float64 reference, with the time and TFLOP/s; then the tensor-core tile GEMM demo.
With no GPU: says so, and shows the offline inspection of the forward kernels instead.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def _gpu_name() -> str | None:
    from numba import cuda

    if not cuda.is_available():
        return None
    name = cuda.get_current_device().name
    return name.decode() if isinstance(name, bytes) else str(name)


def run_on_gpu(args: argparse.Namespace) -> None:
    from numba import cuda

    import numbaflash
    from numbaflash.tools.reference import attention_reference

    b, s, h, d = args.batch, args.seqlen, args.heads, args.head_dim
    rng = np.random.default_rng(args.seed)
    q, k, v = (rng.standard_normal((b, s, h, d)).astype(np.float16) for _ in range(3))
    print(f"GPU: {_gpu_name()}  sm_{''.join(map(str, cuda.get_current_device().compute_capability))}")
    print(f"attention: q, k, v = numpy float16 {q.shape} (batch, seqlen, heads, head_dim), "
          f"causal={args.causal}")
    t0 = time.perf_counter()
    out = numbaflash.flash_attention(q, k, v, causal=args.causal)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = numbaflash.flash_attention(q, k, v, causal=args.causal)
    host_call = time.perf_counter() - t0
    # Device-resident timing (no host copies): CUDA events around repeated calls.
    dq, dk, dv = (cuda.to_device(x) for x in (q, k, v))
    dout = cuda.device_array_like(dq)
    numbaflash.flash_attention(dq, dk, dv, causal=args.causal, out=dout)
    start, end = cuda.event(), cuda.event()
    times = []
    for _ in range(args.repeats):
        start.record()
        numbaflash.flash_attention(dq, dk, dv, causal=args.causal, out=dout)
        end.record()
        end.synchronize()
        times.append(cuda.event_elapsed_time(start, end))
    ms = float(np.median(times))
    flops = 4 * b * h * s * s * d / (2 if args.causal else 1)
    # Check two (batch, head) slices against float64 numpy (the full reference is slow on a CPU).
    sl = (slice(0, 1), slice(None), slice(0, 2))
    ref, _ = attention_reference(q[sl], k[sl], v[sl], causal=args.causal)
    low, _ = attention_reference(q[sl], k[sl], v[sl], causal=args.causal, rounding_dtype=np.float16)
    err = np.abs(out[sl].astype(np.float64) - ref).max()
    err_low = np.abs(low - ref).max()
    same = np.array_equal(out.view(np.uint16), dout.copy_to_host().view(np.uint16))
    print(f"first call (compiles the kernel): {first:.2f} s; "
          f"numpy call with copies: {host_call * 1e3:.1f} ms")
    print(f"kernel (device arrays, median of {args.repeats}): {ms:.3f} ms = {flops / ms / 1e9:.1f} TFLOP/s")
    print(f"max |error| vs float64 reference (batch 0, heads 0-1): {err:.2e} "
          f"(numpy in float16: {err_low:.2e}) -> {'OK' if err <= 2 * err_low + 1e-4 else 'FAIL'}")
    print(f"numpy and device-array results bit-identical: {same}; NaN: {bool(np.isnan(out).any())}")
    run_tile_gemm(rng)


def run_tile_gemm(rng) -> None:
    from numba import cuda

    from numbaflash.demos.tile_gemm import TILE_GEMM_ARGTYPES, TILE_M, TILE_N, make_tile_gemm

    m, n, k = 256, 192, 512
    a = rng.standard_normal((m, k)).astype(np.float16)
    b = rng.standard_normal((n, k)).astype(np.float16)
    c = np.full((m, n), np.nan, np.float32)
    kernel = cuda.jit(TILE_GEMM_ARGTYPES)(make_tile_gemm(False))
    dc = cuda.to_device(c)
    kernel[(n // TILE_N, m // TILE_M), 128](cuda.to_device(a.view(np.uint16).ravel()),
                                            cuda.to_device(b.view(np.uint16).ravel()), dc, m, n, k)
    c = dc.copy_to_host()
    ref = a.astype(np.float64) @ b.astype(np.float64).T
    rel = np.linalg.norm(c - ref) / np.linalg.norm(ref)
    print(f"tile GEMM demo (cp.async + ldmatrix + mma.sync): C[{m}x{n}] = A[{m}x{k}] @ B[{n}x{k}]^T, "
          f"relative error vs float64 {rel:.1e} -> {'OK' if rel < 1e-5 else 'FAIL'}")


def run_offline() -> None:
    from numbaflash.kernels.registry import registered_kernels
    from numbaflash.tools.inspect import format_table, inspect_kernel

    print("No NVIDIA GPU found (numba.cuda.is_available() is False): nothing can run here.")
    print("Showing what the kernels compile to instead (NVVM + nvJitLink offline, SASS read by cuobjdump):\n")
    reports = []
    for name, (pyfunc, argtypes, archs) in registered_kernels().items():
        if not name.startswith(("flash_forward", "tile_gemm_f16")):
            continue
        for arch in ("sm_80", "sm_90a"):
            if arch in archs:
                reports.append(inspect_kernel(pyfunc, argtypes, arch, name))
    print(format_table(reports))
    print("\nHMMA = tensor-core mma.sync, LDSM = ldmatrix, LDGSTS = cp.async; LDL/STL/CALL must be 0.")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m numbaflash", description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if _gpu_name() is None:
        run_offline()
    else:
        run_on_gpu(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
