"""Host-side TMA tensor maps (``cuTensorMapEncodeTiled``) for 16-bit tensors.

A CUtensorMap is a 128-byte opaque descriptor. CUDA C++ passes it by value as a
``__grid_constant__`` kernel parameter; Numba kernels cannot take a 128-byte by-value
parameter, so the map is copied into device global memory (each map one 64-byte aligned row
of a ``uint64[n, 16]`` device array) and the kernel passes a row to the TMA helpers, which
hand its generic address to ``cp.async.bulk.tensor`` (allowed for maps in global memory
that are written before the launch).

    tm_q = make_tensor_map(q_dev, box=(64, 64), swizzle="128B")
    maps = tensor_maps_to_device(tm_q, tm_k)     # device uint64[2, 16]
    kernel[grid, block](maps, ...)               # in the kernel: ptx.tma_load_2d(dst, maps[0], bar, x, y)

Dimensions are given in array order (outermost first) like numpy shapes; the maps and the
device helpers use the TMA convention, innermost first (coordinate c0 indexes the last axis).
"""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Sequence

import numpy as np

SWIZZLE_BYTES = {None: 0, "none": 0, "32B": 32, "64B": 64, "128B": 128}


@dataclasses.dataclass(frozen=True)
class TensorMap:
    """A TMA tensor map: ``words`` holds its 128 bytes as ``uint64[16]``.

    ``shape``/``box`` are in array order (outermost first); ``box_bytes`` is what one load
    brings in (the ``expect_tx`` count). ``source`` keeps the described array alive.
    """

    words: np.ndarray
    shape: tuple[int, ...]
    box: tuple[int, ...]
    swizzle: str | None
    source: object = dataclasses.field(repr=False, compare=False)

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def box_bytes(self) -> int:
        return int(np.prod(self.box)) * 2

    def to_device(self, stream=0):
        """The map as a device ``uint64[16]`` array (pass it where a helper wants ``tmap``)."""
        from numba import cuda

        return cuda.to_device(self.words, stream=stream)


def _cuda_array_interface(array) -> dict:
    cai = getattr(array, "__cuda_array_interface__", None)
    if cai is None:
        raise TypeError("make_tensor_map needs a device array (with __cuda_array_interface__)")
    return cai


def _data_type_name(typestr: str, dtype: str | None) -> str | None:
    """``dtype`` if given, else the array's: float16 -> f16, uint16/int16 (raw bits) -> u16,
    ml_dtypes bfloat16 ('<V2') -> bf16."""
    if dtype is None:
        dtype = {"f2": "f16", "u2": "u16", "i2": "u16", "V2": "bf16"}.get(typestr[1:])
    return dtype


def _data_type(dtype: str | None):
    from cuda.bindings import driver

    kinds = {
        "f16": driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        "bf16": driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        "u16": driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT16,
        "u8": driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT8,
    }
    if dtype not in kinds:
        raise ValueError(f"tensor maps here are for 16-bit data (f16, bf16, u16) or bytes (u8: e4m3); "
                         f"got {dtype!r}")
    return kinds[dtype]


def make_tensor_map(
    array,
    box: Sequence[int],
    *,
    swizzle: str | None = "128B",
    dtype: str | None = None,
    l2_promotion: int = 128,
) -> TensorMap:
    """Encode a tiled tensor map over the 2-D..5-D 16-bit device ``array`` (row-major, rows
    16-byte aligned) with tiles ("boxes") of shape ``box`` (array order, each 1..256).

    ``swizzle``: ``"128B"`` (the layout wgmma reads with 128B-swizzle descriptors; the box's
    innermost extent must then be at most 64 elements), ``"64B"``, ``"32B"`` or ``None``.
    ``dtype``: ``"f16"``, ``"bf16"`` or ``"u16"``; by default taken from the array.
    Out-of-bounds box elements read as zero.
    """
    cai = _cuda_array_interface(array)
    shape = tuple(int(s) for s in cai["shape"])
    if np.dtype(cai["typestr"]).itemsize != 2:
        raise ValueError(f"tensor maps here are for 16-bit elements, not {cai['typestr']}")
    strides = cai.get("strides")
    if strides is None:
        strides = tuple(int(np.prod(shape[i + 1:])) * 2 for i in range(len(shape)))
    words = encode_tensor_map(int(cai["data"][0]), shape, strides, box, swizzle=swizzle,
                              dtype=_data_type_name(cai["typestr"], dtype), l2_promotion=l2_promotion)
    return TensorMap(words, shape, tuple(int(b) for b in box), swizzle, array)


def encode_tensor_map(
    address: int,
    shape: Sequence[int],
    strides: Sequence[int],
    box: Sequence[int],
    *,
    swizzle: str | None = "128B",
    dtype: str = "f16",
    l2_promotion: int = 128,
) -> np.ndarray:
    """The 128 bytes (``uint64[16]``) of a tiled tensor map over 16-bit data (or bytes: ``dtype``
    "u8", e4m3 operands) at device ``address`` with ``shape`` and byte ``strides`` (array order,
    outermost first; the last stride must be the element's size) and boxes of shape ``box``; the
    checks of ``make_tensor_map``. For
    callers that know a tensor's pointer and strides (torch bfloat16 tensors, for one, have
    no ``__cuda_array_interface__``)."""
    from cuda.bindings import driver

    shape = tuple(int(s) for s in shape)
    rank = len(shape)
    if not 2 <= rank <= 5:
        raise ValueError(f"tensor maps are 2-D to 5-D here; the array is {rank}-D")
    if len(box) != rank or len(strides) != rank:
        raise ValueError(f"box {tuple(box)} must have one extent per dimension of {shape}")
    itemsize = 1 if dtype == "u8" else 2
    strides = tuple(int(s) for s in strides)
    if strides[-1] != itemsize:
        raise ValueError("the innermost dimension must be contiguous")
    if any(s % 16 for s in strides[:-1]):
        raise ValueError(f"outer strides must be multiples of 16 bytes, got {strides}")
    if address % 16:
        raise ValueError("the array's data must be 16-byte aligned")
    if any(not 1 <= b <= 256 for b in box):
        raise ValueError(f"box extents must be 1..256, got {tuple(box)}")
    inner_bytes = box[-1] * itemsize
    if inner_bytes % 16:
        raise ValueError(f"the box's innermost extent must span a multiple of 16 bytes, got {inner_bytes}")
    if swizzle not in SWIZZLE_BYTES:
        raise ValueError(f"swizzle must be one of {list(SWIZZLE_BYTES)}, not {swizzle!r}")
    span = SWIZZLE_BYTES[swizzle]
    if span and inner_bytes > span:
        raise ValueError(f"with {swizzle} swizzle the box's innermost extent is at most {span // itemsize} "
                         "elements")

    swizzles = {
        0: driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE,
        32: driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_32B,
        64: driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_64B,
        128: driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
    }
    promotions = {
        0: driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_NONE,
        64: driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_64B,
        128: driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
        256: driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
    }
    u64, u32 = driver.cuuint64_t, driver.cuuint32_t
    err, tmap = driver.cuTensorMapEncodeTiled(
        _data_type(dtype),
        rank,
        address,
        [u64(d) for d in reversed(shape)],  # innermost first
        [u64(s) for s in reversed(strides[:-1])],  # byte strides of dimensions 1..rank-1
        [u32(int(b)) for b in reversed(box)],
        [u32(1)] * rank,
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        swizzles[span],
        promotions[l2_promotion],
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
    )
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        raise RuntimeError(
            f"cuTensorMapEncodeTiled failed ({name.decode() if name else err}) for shape {shape}, "
            f"strides {strides}, box {tuple(box)}, swizzle {swizzle}"
        )
    raw = ctypes.string_at(tmap.getPtr(), 128)
    return np.frombuffer(raw, dtype=np.uint64).copy()


def tensor_maps_to_device(*maps: TensorMap, stream=0):
    """Copy tensor maps into one device ``uint64[len(maps), 16]`` array (rows are 128 bytes,
    so each map is 64-byte aligned). Keep the ``TensorMap`` objects (and so their arrays)
    alive while kernels use the maps."""
    from numba import cuda

    if not maps:
        raise ValueError("tensor_maps_to_device needs at least one map")
    device = cuda.to_device(np.stack([m.words for m in maps]), stream=stream)
    if device.__cuda_array_interface__["data"][0] % 64:
        raise RuntimeError("tensor maps must be 64-byte aligned in global memory")
    return device
