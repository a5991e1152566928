"""PTX bindings: every instruction Numba cannot express, as a device function.

Kernels import from here and never see cffi, raw pointers or address spaces.
Families: async_copy, matrix_load, mma, convert, math, reduce (sm_80+; the e4m3 mma and packing
sm_89+); grid (sm_90+, no-ops below); hopper (sm_90a).
"""

from .async_copy import (
    CP_ASYNC_WAIT_GROUP,
    cp_async_16,
    cp_async_16_at,
    cp_async_16_zfill,
    cp_async_16_zfill_at,
    cp_async_commit_group,
    cp_async_wait_group_0,
    cp_async_wait_group_1,
    cp_async_wait_group_2,
    cp_async_wait_group_3,
    global_address,
    ld_global_nc_v4_at,
    ld_shared_b32,
    ld_shared_f32,
    ld_shared_v4,
    shared_address_f32,
    shared_address_u16,
    shared_address_u32,
    shared_address_u64,
    st_global_v4,
    st_global_v4_at,
    st_shared_b32,
    st_shared_v4,
    st_shared_v4_f32,
)
from .convert import (
    byte_perm,
    exp2,
    exp2_poly,
    f32_from_bf16_bits,
    f32_from_f16_bits,
    log2,
    pack_bf16x2,
    pack_e4m3x4,
    pack_f16x2,
    reciprocal,
)
from .grid import grid_dependency_wait, grid_launch_dependents
from .math import tanh
from .matrix_load import (
    ldmatrix_x1,
    ldmatrix_x1_trans,
    ldmatrix_x2,
    ldmatrix_x2_trans,
    ldmatrix_x4,
    ldmatrix_x4_trans,
)
from .mma import mma_m16n8k16_bf16, mma_m16n8k16_f16, mma_m16n8k32_e4m3
from .reduce import (
    atom_add_acq_rel_gpu_s32,
    global_address_f32,
    global_address_i32,
    ld_acquire_gpu_s32,
    ld_relaxed_gpu_v4_f32,
    red_global_add_f32,
    red_global_add_v4_f32,
    red_release_gpu_add_s32,
)

__all__ = [
    "atom_add_acq_rel_gpu_s32",
    "byte_perm",
    "cp_async_16",
    "cp_async_16_at",
    "cp_async_16_zfill",
    "cp_async_16_zfill_at",
    "cp_async_commit_group",
    "CP_ASYNC_WAIT_GROUP",
    "cp_async_wait_group_0",
    "cp_async_wait_group_1",
    "cp_async_wait_group_2",
    "cp_async_wait_group_3",
    "exp2",
    "exp2_poly",
    "f32_from_bf16_bits",
    "f32_from_f16_bits",
    "global_address",
    "global_address_f32",
    "global_address_i32",
    "grid_dependency_wait",
    "grid_launch_dependents",
    "ld_acquire_gpu_s32",
    "ld_relaxed_gpu_v4_f32",
    "ld_shared_b32",
    "ld_shared_v4",
    "log2",
    "ldmatrix_x1",
    "ldmatrix_x1_trans",
    "ldmatrix_x2",
    "ldmatrix_x2_trans",
    "ldmatrix_x4",
    "ldmatrix_x4_trans",
    "mma_m16n8k16_bf16",
    "mma_m16n8k16_f16",
    "mma_m16n8k32_e4m3",
    "pack_bf16x2",
    "pack_e4m3x4",
    "pack_f16x2",
    "reciprocal",
    "red_global_add_f32",
    "red_global_add_v4_f32",
    "red_release_gpu_add_s32",
    "shared_address_f32",
    "shared_address_u16",
    "shared_address_u32",
    "shared_address_u64",
    "st_global_v4",
    "st_global_v4_at",
    "ld_global_nc_v4_at",
    "ld_shared_f32",
    "st_shared_b32",
    "st_shared_v4_f32",
    "st_shared_v4",
    "tanh",
]

# Hopper (sm_90a): wgmma and matrix descriptors, mbarrier, TMA, stmatrix, proxy fences, setmaxnreg.
from . import hopper  # noqa: E402
from .hopper import *  # noqa: E402, F403

__all__ += hopper.__all__
