"""Every kernel the package ships, with example argument types, for offline inspection."""

from __future__ import annotations


def registered_kernels() -> dict:
    """name -> (python kernel function, argument types, architectures it targets)."""
    from .tile_gemm import TILE_GEMM_ARGTYPES, make_tile_gemm

    both = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_90a")
    kernels = {
        "tile_gemm_f16": (make_tile_gemm(False), TILE_GEMM_ARGTYPES, both),
        "tile_gemm_bf16": (make_tile_gemm(True), TILE_GEMM_ARGTYPES, both),
    }
    return kernels
