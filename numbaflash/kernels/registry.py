"""Every kernel the package ships, with example argument types, for offline inspection."""

from __future__ import annotations


def registered_kernels() -> dict:
    """name -> (python kernel function, argument types, architectures it targets)."""
    from . import hopper_demo
    from .tile_gemm import TILE_GEMM_ARGTYPES, make_tile_gemm

    both = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_90a")
    kernels = {
        "tile_gemm_f16": (make_tile_gemm(False), TILE_GEMM_ARGTYPES, both),
        "tile_gemm_bf16": (make_tile_gemm(True), TILE_GEMM_ARGTYPES, both),
    }
    kernels.update(forward_kernels())
    kernels.update(hopper_demo.registered())  # sm_90a: wgmma / TMA demos and probes
    return kernels


def forward_kernels() -> dict:
    """The shipped forward configurations, each for the architecture it is dispatched on."""
    from ..configs import FAMILY_ARCH, shipped_configs
    from .forward_mma import FORWARD_ARGTYPES, make_forward_kernel

    kernels = {}
    for family, _, causal, config in shipped_configs():
        for bf16 in (False, True):
            kernel = make_forward_kernel(config, causal, bf16)
            kernels[f"{kernel.__name__}_{family}"] = (kernel, FORWARD_ARGTYPES, (FAMILY_ARCH[family],))
    return kernels
