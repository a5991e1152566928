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


def demo_kernels(args: argparse.Namespace) -> list[tuple[str, object, bool, str]]:
    """(family, config, causal, arch) of the forward kernel that this job's own call
    (float16, ``args.head_dim``, ``args.causal``, ``args.seqlen``) dispatches on each family:
    the mma.sync kernel every GPU from sm_80 on runs, and the Hopper kernel where there is one."""
    from numbaflash.configs import FAMILY_ARCH, FAMILY_CAPABILITY, FAMILY_HEAD_DIMS, forward_config

    return [(family, forward_config(cap, args.head_dim, args.causal, seqlen=args.seqlen), args.causal,
             FAMILY_ARCH[family])
            for family, cap in FAMILY_CAPABILITY.items() if args.head_dim in FAMILY_HEAD_DIMS[family]]


def run_offline(args: argparse.Namespace) -> None:
    from numbaflash.configs import kernel_cubin
    from numbaflash.demos.tile_gemm import TILE_GEMM_ARGTYPES, make_tile_gemm
    from numbaflash.kernels.families import spec_of
    from numbaflash.runtime.cache import cache_root, enabled
    from numbaflash.tools.inspect import format_table, inspect_kernel, report_from_cubin

    print("No NVIDIA GPU found (numba.cuda.is_available() is False): nothing can run here.")
    print(f"Showing what this job's call (float16, head_dim {args.head_dim}, causal={args.causal}, "
          f"seqlen {args.seqlen}) compiles to on each kernel family instead (NVVM + nvJitLink offline, "
          f"SASS read by cuobjdump); "
          + (f"compiled kernels are cached in {cache_root()}." if enabled() else "the cache is off."),
          flush=True)
    reports = []
    for family, config, causal, arch in demo_kernels(args):
        start = time.perf_counter()
        entry = kernel_cubin(spec_of(config, "forward", False, arch, causal=causal))
        name = f"flash_forward_{family}"
        reports.append(report_from_cubin(entry.cubin, name, arch))
        print(f"  {name} for {arch}: {config} ({time.perf_counter() - start:.1f} s)", flush=True)
    start = time.perf_counter()
    reports.append(inspect_kernel(make_tile_gemm(False), TILE_GEMM_ARGTYPES, "sm_80", "tile_gemm_f16"))
    print(f"  tile_gemm_f16 for sm_80 ({time.perf_counter() - start:.1f} s)\n", flush=True)
    print(format_table(reports))
    print("\nHMMA = tensor-core mma.sync, HGMMA = wgmma, QGMMA = 8-bit (e4m3) wgmma, LDSM = ldmatrix, "
          "LDGSTS = cp.async, UTMALDG = TMA load, SYNCS = mbarrier; LDL/STL/CALL must be 0.")
    print("Every shipped kernel on every target: python -m numbaflash.inspect")


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
    from numbaflash.runtime.cache import show_compile_progress

    show_compile_progress()  # a kernel compile that takes a while says so
    if _gpu_name() is None:
        run_offline(args)
    else:
        run_on_gpu(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
